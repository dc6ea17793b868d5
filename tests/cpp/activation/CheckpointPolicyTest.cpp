#include "hyper_parallel/activation/CheckpointPolicy.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <string>

namespace hyper_parallel::activation {
namespace {

TEST(CheckpointPolicyTest, ValuesAreTheContract) {
  EXPECT_EQ(static_cast<int>(CheckpointPolicy::MUST_SAVE), 0);
  EXPECT_EQ(static_cast<int>(CheckpointPolicy::PREFER_SAVE), 1);
  EXPECT_EQ(static_cast<int>(CheckpointPolicy::MUST_RECOMPUTE), 2);
  EXPECT_EQ(static_cast<int>(CheckpointPolicy::PREFER_RECOMPUTE), 3);
  EXPECT_EQ(static_cast<int>(CheckpointPolicy::MUST_SWAP), 4);
}

TEST(CheckpointPolicyTest, StringRoundTripAndTorchNames) {
  for (int i = 0; i < kNumCheckpointPolicies; ++i) {
    auto p = static_cast<CheckpointPolicy>(i);
    auto back = policy_from_string(to_string(p));
    ASSERT_TRUE(back.has_value());
    EXPECT_EQ(*back, p);
  }
  EXPECT_EQ(policy_from_string("MUST_CPU_OFFLOAD"), CheckpointPolicy::MUST_SWAP);
  EXPECT_EQ(policy_from_string("PREFER_CPU_OFFLOAD"), CheckpointPolicy::MUST_SWAP);
  EXPECT_FALSE(policy_from_string("must_save").has_value());
  EXPECT_FALSE(policy_from_string("").has_value());
}

TEST(CheckpointPolicyTest, FromIntRejectsOutOfRangeWithPrefix) {
  EXPECT_EQ(policy_from_int(3), CheckpointPolicy::PREFER_RECOMPUTE);
  try {
    policy_from_int(5);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("hyper_parallel: invalid CheckpointPolicy value 5"),
              std::string::npos);
  }
  EXPECT_THROW(policy_from_int(-1), c10::Error);
}

TEST(CheckpointPolicyTest, Classification) {
  EXPECT_TRUE(is_save(CheckpointPolicy::PREFER_SAVE));
  EXPECT_FALSE(is_save(CheckpointPolicy::MUST_SWAP));
  EXPECT_TRUE(is_recompute(CheckpointPolicy::PREFER_RECOMPUTE));
  EXPECT_TRUE(is_swap(CheckpointPolicy::MUST_SWAP));
}

}  // namespace
}  // namespace hyper_parallel::activation
