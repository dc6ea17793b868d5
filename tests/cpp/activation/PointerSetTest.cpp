#include "hyper_parallel/activation/PointerSet.h"

#include <gtest/gtest.h>

#include <vector>

namespace hyper_parallel::activation {
namespace {

TEST(PointerSetTest, InsertsOnceAndFindsEveryKeyInlineAndBeyond) {
  std::vector<int> objects(40);
  PointerSet set;
  EXPECT_TRUE(set.empty());
  for (int& o : objects) {
    EXPECT_EQ(set.count(&o), 0u);
    EXPECT_TRUE(set.insert(&o));
    EXPECT_FALSE(set.insert(&o));  // a second insert of a key is refused
    EXPECT_EQ(set.count(&o), 1u);
  }
  EXPECT_EQ(set.size(), objects.size());  // 16 inline, 24 in the hash set
  for (const int& o : objects) EXPECT_EQ(set.count(&o), 1u);
  int other = 0;
  EXPECT_EQ(set.count(&other), 0u);
  EXPECT_EQ(set.count(nullptr), 0u);
}

}  // namespace
}  // namespace hyper_parallel::activation
