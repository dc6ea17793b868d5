#include "hyper_parallel/activation/StorageRecord.h"

#include "hyper_parallel/activation/SwapGroup.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace hyper_parallel::activation {
namespace {

constexpr Residency kAll[] = {Residency::kDevice, Residency::kOffloading, Residency::kHost,
                              Residency::kReloading};

bool is_legal(Residency from, Residency to) {
  using R = Residency;
  return (from == R::kDevice && to == R::kOffloading) ||
         (from == R::kOffloading && to == R::kHost) ||
         (from == R::kOffloading && to == R::kReloading) ||
         (from == R::kHost && to == R::kReloading) ||
         (from == R::kReloading && to == R::kDevice);
}

// Drives `record` (fresh, kDevice) to `target` through legal transitions.
void walk_to(StorageRecord& record, Residency target) {
  switch (target) {
    case Residency::kDevice:
      return;
    case Residency::kOffloading:
      record.transition(Residency::kOffloading);
      return;
    case Residency::kHost:
      record.transition(Residency::kOffloading);
      record.transition(Residency::kHost);
      return;
    case Residency::kReloading:
      record.transition(Residency::kOffloading);
      record.transition(Residency::kReloading);
      return;
  }
}

TEST(StorageRecordTest, StartsOnDeviceAndDescribesItsStorage) {
  auto stats = std::make_shared<SwapStatsCounters>();
  at::Tensor t = at::randn({3, 5});
  StorageRecord record(t.storage(), t.scalar_type(), stats);
  EXPECT_EQ(record.state(), Residency::kDevice);
  EXPECT_EQ(record.nbytes(), 15 * sizeof(float));
  EXPECT_EQ(record.key(), t.storage().unsafeGetStorageImpl());
  EXPECT_TRUE(record.device().is_cpu());
  EXPECT_EQ(record.dtype(), at::kFloat);
  EXPECT_EQ(record.storage().unsafeGetStorageImpl(), t.storage().unsafeGetStorageImpl());
  EXPECT_EQ(record.alias_refs.load(), 0);
  EXPECT_STREQ(to_string(Residency::kDevice), "device");
  EXPECT_STREQ(to_string(Residency::kOffloading), "offloading");
  EXPECT_STREQ(to_string(Residency::kHost), "host");
  EXPECT_STREQ(to_string(Residency::kReloading), "reloading");
}

TEST(StorageRecordTest, HoldsItsStorageWeakly) {
  auto stats = std::make_shared<SwapStatsCounters>();
  at::Tensor t = at::randn({8});
  StorageRecord record(t.storage(), t.scalar_type(), stats);
  EXPECT_EQ(t.storage().use_count(), 1u);  // the record adds no strong reference
  t.reset();
  EXPECT_FALSE(record.storage());
  // The key (identity) is still known after the storage died.
  EXPECT_NE(record.key(), nullptr);
}

TEST(StorageRecordTest, FullLegalCycles) {
  auto stats = std::make_shared<SwapStatsCounters>();
  at::Tensor t = at::randn({16});
  StorageRecord record(t.storage(), t.scalar_type(), stats);
  for (int cycle = 0; cycle < 3; ++cycle) {
    record.transition(Residency::kOffloading);
    EXPECT_EQ(record.state(), Residency::kOffloading);
    record.transition(Residency::kHost);
    EXPECT_EQ(record.state(), Residency::kHost);
    record.transition(Residency::kReloading);
    EXPECT_EQ(record.state(), Residency::kReloading);
    record.transition(Residency::kDevice);
    EXPECT_EQ(record.state(), Residency::kDevice);
    // Reload straight from kOffloading (on-demand reload before the D2H was observed).
    record.transition(Residency::kOffloading);
    record.transition(Residency::kReloading);
    record.transition(Residency::kDevice);
  }
}

TEST(StorageRecordTest, EveryTransitionIsLegalOrThrows) {
  auto stats = std::make_shared<SwapStatsCounters>();
  at::Tensor t = at::randn({4});
  for (Residency from : kAll) {
    for (Residency to : kAll) {
      StorageRecord record(t.storage(), t.scalar_type(), stats);
      walk_to(record, from);
      ASSERT_EQ(record.state(), from);
      const int64_t resident_before = stats->resident_bytes.load();
      if (is_legal(from, to)) {
        EXPECT_NO_THROW(record.transition(to)) << to_string(from) << " -> " << to_string(to);
        EXPECT_EQ(record.state(), to);
      } else {
        try {
          record.transition(to);
          ADD_FAILURE() << "illegal " << to_string(from) << " -> " << to_string(to)
                        << " did not throw";
        } catch (const c10::Error& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("illegal residency transition"), std::string::npos) << msg;
          EXPECT_NE(msg.find(to_string(from)), std::string::npos) << msg;
        }
        // A refused transition changes nothing.
        EXPECT_EQ(record.state(), from);
        EXPECT_EQ(stats->resident_bytes.load(), resident_before);
      }
    }
  }
  // All records died: nothing is counted as resident any more.
  EXPECT_EQ(stats->resident_bytes.load(), 0);
}

TEST(StorageRecordTest, ResidentBytesFollowTheState) {
  auto stats = std::make_shared<SwapStatsCounters>();
  at::Tensor a = at::randn({100});   // 400 bytes
  at::Tensor b = at::randn({25});    // 100 bytes
  {
    StorageRecord ra(a.storage(), a.scalar_type(), stats);
    EXPECT_EQ(stats->resident_bytes.load(), 400);
    {
      StorageRecord rb(b.storage(), b.scalar_type(), stats);
      EXPECT_EQ(stats->resident_bytes.load(), 500);
      EXPECT_EQ(stats->peak_resident_bytes.load(), 500);
      rb.transition(Residency::kOffloading);
      EXPECT_EQ(stats->resident_bytes.load(), 400);
    }
    // rb died off device: nothing more is subtracted.
    EXPECT_EQ(stats->resident_bytes.load(), 400);
    ra.transition(Residency::kOffloading);
    EXPECT_EQ(stats->resident_bytes.load(), 0);
    ra.transition(Residency::kHost);
    EXPECT_EQ(stats->resident_bytes.load(), 0);
    ra.transition(Residency::kReloading);  // device memory is allocated again
    EXPECT_EQ(stats->resident_bytes.load(), 400);
    ra.transition(Residency::kDevice);
    EXPECT_EQ(stats->resident_bytes.load(), 400);
    EXPECT_EQ(stats->peak_resident_bytes.load(), 500);
  }
  EXPECT_EQ(stats->resident_bytes.load(), 0);
  // A record that dies while reloading gives its bytes back too.
  {
    StorageRecord r(a.storage(), a.scalar_type(), stats);
    walk_to(r, Residency::kReloading);
    EXPECT_EQ(stats->resident_bytes.load(), 400);
  }
  EXPECT_EQ(stats->resident_bytes.load(), 0);
}

TEST(StorageRecordTest, ReleasedByAllHolders) {
  auto stats = std::make_shared<SwapStatsCounters>();
  at::Tensor t = at::randn({4});
  StorageRecord record(t.storage(), t.scalar_type(), stats);
  EXPECT_TRUE(record.released_by_all_holders());  // no holder at all
  auto g1 = std::make_shared<SwapGroup>(1, 0, "", false, false);
  auto g2 = std::make_shared<SwapGroup>(2, 1, "", false, false);
  record.holders.push_back(g1);
  record.holders.push_back(g2);
  EXPECT_FALSE(record.released_by_all_holders());
  g1->released = true;
  EXPECT_FALSE(record.released_by_all_holders());
  g2->released = true;
  EXPECT_TRUE(record.released_by_all_holders());
  // A holder that died (its graph was freed) no longer holds anything back.
  auto g3 = std::make_shared<SwapGroup>(3, 2, "", false, false);
  record.holders.push_back(g3);
  EXPECT_FALSE(record.released_by_all_holders());
  g3.reset();
  EXPECT_TRUE(record.released_by_all_holders());
}

}  // namespace
}  // namespace hyper_parallel::activation
