#include "hyper_parallel/activation/AliasRegistry.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace hyper_parallel::activation {
namespace {

TEST(AliasRegistryTest, ViewsOfOneStorageShareOneRecord) {
  auto stats = std::make_shared<SwapStatsCounters>();
  AliasRegistry registry(stats);
  at::Tensor base = at::randn({6, 8});
  std::vector<at::Tensor> views = {
      base,
      base.t(),
      base.narrow(0, 2, 3).narrow(1, 1, 5),
      base.select(0, 4).unsqueeze(0).expand({5, 8}),  // stride 0
      base.view({48}),
      base.view(at::kInt),  // reinterpreted dtype, same storage
  };
  auto first = registry.get_or_create(views[0].storage(), views[0].scalar_type());
  ASSERT_NE(first, nullptr);
  EXPECT_EQ(first->nbytes(), 48 * sizeof(float));
  for (const auto& v : views) {
    EXPECT_EQ(registry.get_or_create(v.storage(), v.scalar_type()), first);
    EXPECT_EQ(registry.find(v.storage().unsafeGetStorageImpl()), first);
  }
  EXPECT_EQ(registry.live_records(), 1u);
  // Resident bytes count the storage once.
  EXPECT_EQ(stats->resident_bytes.load(), static_cast<int64_t>(48 * sizeof(float)));
}

TEST(AliasRegistryTest, DistinctStoragesGetDistinctRecords) {
  auto stats = std::make_shared<SwapStatsCounters>();
  AliasRegistry registry(stats);
  at::Tensor a = at::randn({4});
  at::Tensor b = a.clone();
  auto ra = registry.get_or_create(a.storage(), a.scalar_type());
  auto rb = registry.get_or_create(b.storage(), b.scalar_type());
  EXPECT_NE(ra, rb);
  EXPECT_EQ(registry.live_records(), 2u);
  EXPECT_EQ(registry.find(a.storage().unsafeGetStorageImpl()), ra);
  EXPECT_EQ(registry.find(b.storage().unsafeGetStorageImpl()), rb);
}

TEST(AliasRegistryTest, FindOfUnknownStorageIsNull) {
  AliasRegistry registry(std::make_shared<SwapStatsCounters>());
  at::Tensor a = at::randn({4});
  EXPECT_EQ(registry.find(a.storage().unsafeGetStorageImpl()), nullptr);
  EXPECT_EQ(registry.find(nullptr), nullptr);
  EXPECT_EQ(registry.live_records(), 0u);
}

TEST(AliasRegistryTest, DeadRecordIsNotFound) {
  AliasRegistry registry(std::make_shared<SwapStatsCounters>());
  at::Tensor a = at::randn({4});
  const c10::StorageImpl* key = a.storage().unsafeGetStorageImpl();
  auto record = registry.get_or_create(a.storage(), a.scalar_type());
  record->transition(Residency::kOffloading);
  record.reset();  // the registry holds records weakly
  EXPECT_EQ(registry.find(key), nullptr);
  EXPECT_EQ(registry.live_records(), 0u);
  // The storage is still alive: a new record starts on device, with no copy state.
  auto again = registry.get_or_create(a.storage(), a.scalar_type());
  EXPECT_EQ(again->state(), Residency::kDevice);
  EXPECT_EQ(again->host, nullptr);
  EXPECT_EQ(registry.find(key), again);
}

TEST(AliasRegistryTest, RecordOfADeadStorageIsNotFound) {
  AliasRegistry registry(std::make_shared<SwapStatsCounters>());
  at::Tensor a = at::randn({4});
  const c10::StorageImpl* key = a.storage().unsafeGetStorageImpl();
  auto record = registry.get_or_create(a.storage(), a.scalar_type());
  a.reset();
  EXPECT_FALSE(record->storage());
  EXPECT_EQ(registry.find(key), nullptr);
}

TEST(AliasRegistryTest, NewStorageNeverAliasesADeadRecord) {
  auto stats = std::make_shared<SwapStatsCounters>();
  AliasRegistry registry(stats);
  // Records that outlive their storages (state off device, as after an offload)...
  std::vector<std::shared_ptr<StorageRecord>> survivors;
  // ...and records that die before their storages.
  for (int i = 0; i < 300; ++i) {
    at::Tensor t = at::empty({16 + (i % 5)});
    auto record = registry.get_or_create(t.storage(), t.scalar_type());
    ASSERT_EQ(record->state(), Residency::kDevice) << "iteration " << i;
    ASSERT_EQ(record->nbytes(), t.storage().nbytes()) << "iteration " << i;
    ASSERT_EQ(record->storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
    for (const auto& old : survivors) {
      ASSERT_NE(old, record) << "iteration " << i;
    }
    if (i % 2 == 0) {
      record->transition(Residency::kOffloading);
      survivors.push_back(record);
    }
    // t dies here: its StorageImpl may be freed and its address reused next iteration.
  }
  for (const auto& old : survivors) {
    EXPECT_FALSE(old->storage());
    EXPECT_EQ(registry.find(old->key()), nullptr);
  }
  EXPECT_EQ(registry.live_records(), survivors.size());
}

TEST(AliasRegistryTest, SweepKeepsLiveRecords) {
  AliasRegistry registry(std::make_shared<SwapStatsCounters>());
  std::vector<at::Tensor> keep;
  std::vector<std::shared_ptr<StorageRecord>> live;
  // Far more entries than the first sweep point; every tenth one stays alive.
  for (int i = 0; i < 3000; ++i) {
    at::Tensor t = at::empty({4});
    auto record = registry.get_or_create(t.storage(), t.scalar_type());
    if (i % 10 == 0) {
      keep.push_back(t);
      live.push_back(record);
    }
  }
  EXPECT_EQ(registry.live_records(), live.size());
  for (size_t i = 0; i < keep.size(); ++i) {
    EXPECT_EQ(registry.find(keep[i].storage().unsafeGetStorageImpl()), live[i]);
    EXPECT_EQ(registry.get_or_create(keep[i].storage(), keep[i].scalar_type()), live[i]);
  }
  registry.clear();
  EXPECT_EQ(registry.live_records(), 0u);
  EXPECT_EQ(registry.find(keep[0].storage().unsafeGetStorageImpl()), nullptr);
}

}  // namespace
}  // namespace hyper_parallel::activation
