#include "hyper_parallel/activation/HostBufferPool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <string>
#include <vector>

namespace hyper_parallel::activation {
namespace {

// An event the test completes by hand.
class ManualEvent final : public CopyEvent {
 public:
  bool query() const override { return done.load(); }
  double synchronize() const override { return 0.0; }
  double block_compute(c10::Device) const override { return 0.0; }
  std::atomic<bool> done{false};
};

TEST(HostBufferPoolTest, SizeClasses) {
  EXPECT_EQ(HostBufferPool::size_class(1), 4096u);
  EXPECT_EQ(HostBufferPool::size_class(4096), 4096u);
  EXPECT_EQ(HostBufferPool::size_class(4097), 8192u);
  EXPECT_EQ(HostBufferPool::size_class(size_t{1} << 20), size_t{1} << 20);
  // Above 1 MiB: four classes per power of two.
  EXPECT_EQ(HostBufferPool::size_class((size_t{1} << 20) + 1), (size_t{1} << 20) + (size_t{1} << 18));
  EXPECT_EQ(HostBufferPool::size_class(size_t{3} << 20), size_t{3} << 20);
  for (size_t n : {size_t{5000}, size_t{3} << 20, (size_t{7} << 22) + 3}) {
    const size_t c = HostBufferPool::size_class(n);
    EXPECT_GE(c, n);
    EXPECT_LE(static_cast<double>(c), 1.25 * static_cast<double>(n) + 4096);
  }
}

TEST(HostBufferPoolTest, ReusesBlocksWithoutNewAllocations) {
  auto pool = HostBufferPool::create(/*pinned=*/false);
  for (int step = 0; step < 50; ++step) {
    auto a = pool->acquire(10000);
    auto b = pool->acquire(3 << 20);
    EXPECT_GE(a->buffer().numel(), 10000);
    EXPECT_EQ(a->buffer().scalar_type(), at::kByte);
    EXPECT_TRUE(a->buffer().is_cpu());
  }
  const auto s = pool->stats();
  EXPECT_EQ(s.allocations, 2);  // warm-up only
  EXPECT_EQ(s.reuses, 98);
  EXPECT_EQ(s.bytes_in_use, 0);
  EXPECT_EQ(s.bytes_cached,
            static_cast<int64_t>(HostBufferPool::size_class(10000) + HostBufferPool::size_class(3 << 20)));
}

TEST(HostBufferPoolTest, BlockIsNotReusedBeforeItsLastCopyCompletes) {
  auto pool = HostBufferPool::create(false);
  auto event = std::make_shared<ManualEvent>();
  void* first = nullptr;
  {
    auto block = pool->acquire(8192);
    first = block->buffer().data_ptr();
    block->set_last_use(event);
  }
  EXPECT_EQ(pool->stats().bytes_pending, 8192);
  auto second = pool->acquire(8192);  // must not get the pending block
  EXPECT_NE(second->buffer().data_ptr(), first);
  EXPECT_EQ(pool->stats().allocations, 2);
  event->done = true;
  auto third = pool->acquire(8192);  // now the first block is free again
  EXPECT_EQ(third->buffer().data_ptr(), first);
  EXPECT_EQ(pool->stats().bytes_pending, 0);
}

TEST(HostBufferPoolTest, CacheIsBounded) {
  auto pool = HostBufferPool::create(false, /*max_cached_bytes=*/16384);
  {
    auto a = pool->acquire(8192);
    auto b = pool->acquire(8192);
    auto c = pool->acquire(8192);
  }
  EXPECT_LE(pool->stats().bytes_cached, 16384);
  pool->empty_cache();
  EXPECT_EQ(pool->stats().bytes_cached, 0);
}

// An event that completes when someone waits for it (a copy that finishes during the wait).
class CompletesOnWait final : public CopyEvent {
 public:
  bool query() const override { return done.load(); }
  double synchronize() const override {
    done.store(true);
    waits.fetch_add(1);
    return 0.0;
  }
  double block_compute(c10::Device) const override { return 0.0; }
  mutable std::atomic<bool> done{false};
  mutable std::atomic<int> waits{0};
};

TEST(HostBufferPoolTest, CapRefusesWhenBlocksInUseLeaveNoRoom) {
  auto pool = HostBufferPool::create(false, int64_t{8} << 30, /*max_host_bytes=*/16384);
  auto a = pool->acquire(8192);
  auto b = pool->acquire(8192);
  try {
    pool->acquire(1);
    FAIL() << "acquire over the cap must throw";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("hyper_parallel: host pool full"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cap of 16384 bytes"), std::string::npos) << msg;
  }
  const auto s = pool->stats();
  EXPECT_EQ(s.bytes_in_use, 16384);  // the refused request reserved nothing
  EXPECT_EQ(s.allocations, 2);
}

TEST(HostBufferPoolTest, TryAcquireReturnsNullWhereAcquireThrowsAndCountsIt) {
  auto pool = HostBufferPool::create(false, int64_t{8} << 30, /*max_host_bytes=*/16384,
                                     /*keep_when_full=*/true);
  EXPECT_TRUE(pool->keep_when_full());
  auto a = pool->try_acquire(8192);
  ASSERT_NE(a, nullptr);
  EXPECT_FALSE(pool->take_first_refusal());  // nothing refused yet
  auto b = pool->try_acquire(12288);         // 8192 + 12288 > 16384, nothing to wait for
  EXPECT_EQ(b, nullptr);
  auto c = pool->try_acquire(8192);          // still fits
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(pool->try_acquire(1), nullptr);
  const auto s = pool->stats();
  EXPECT_EQ(s.refusals, 2);
  EXPECT_EQ(s.bytes_in_use, 16384);  // the refused requests reserved nothing
  EXPECT_EQ(s.allocations, 2);
  EXPECT_TRUE(pool->take_first_refusal());   // once...
  EXPECT_FALSE(pool->take_first_refusal());  // ...per pool
  a.reset();  // given back (no copy in flight): cached, then reused under the cap
  EXPECT_NE(pool->try_acquire(8192), nullptr);
}

TEST(HostBufferPoolTest, ARefusalKeepsTheCacheAndWaitsForNothing) {
  // Only the blocks in use cannot be reclaimed: a block they leave no room for is refused
  // before any cached block is dropped or any pending copy waited for (tester, session 21:
  // a steady loop reallocated every step).
  auto pool = HostBufferPool::create(false, int64_t{8} << 30, /*max_host_bytes=*/16384,
                                     /*keep_when_full=*/true);
  auto held = pool->acquire(8192);
  { auto cached = pool->acquire(4096); }  // given back with no copy: cached
  EXPECT_EQ(pool->stats().bytes_cached, 4096);
  EXPECT_EQ(pool->try_acquire(12288), nullptr);            // 8192 in use + 12288 > 16384
  EXPECT_EQ(pool->try_acquire(12288, /*count_refusal=*/false), nullptr);
  auto s = pool->stats();
  EXPECT_EQ(s.bytes_cached, 4096);  // kept
  EXPECT_EQ(s.cap_waits, 0);
  EXPECT_EQ(s.refusals, 1);         // the uncounted try is not a refusal
  EXPECT_NE(pool->try_acquire(4096), nullptr);  // the cached block, reused
  EXPECT_EQ(pool->stats().reuses, 1);
  // acquire() says the same at once, and names a block larger than the cap as such.
  auto raising = HostBufferPool::create(false, int64_t{8} << 30, /*max_host_bytes=*/4096);
  try {
    raising->acquire(8192);
    FAIL() << "a block larger than the cap must throw";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("is larger than the pool's cap of 4096 bytes"), std::string::npos) << msg;
  }
}

TEST(HostBufferPoolTest, CapWaitsForAnInFlightBlockAndReusesIt) {
  auto pool = HostBufferPool::create(false, int64_t{8} << 30, /*max_host_bytes=*/16384);
  auto event = std::make_shared<CompletesOnWait>();
  {
    auto first = pool->acquire(8192);
    first->set_last_use(event);
  }
  EXPECT_EQ(pool->stats().bytes_pending, 8192);
  auto held = pool->acquire(4096);  // fits: 8192 pending + 4096
  auto again = pool->acquire(8192);  // does not fit until the pending block completes
  EXPECT_EQ(event->waits.load(), 1);
  const auto s = pool->stats();
  EXPECT_EQ(s.cap_waits, 1);
  EXPECT_EQ(s.reuses, 1);  // the waited-for block itself
  EXPECT_EQ(s.allocations, 2);
  EXPECT_EQ(s.bytes_in_use, 8192 + 4096);
  EXPECT_LE(s.bytes_in_use + s.bytes_pending + s.bytes_cached, 16384);
}

TEST(HostBufferPoolTest, CapDropsCachedBlocksOfOtherSizes) {
  auto pool = HostBufferPool::create(false, int64_t{8} << 30, /*max_host_bytes=*/16384);
  { auto big = pool->acquire(12288); }
  EXPECT_EQ(pool->stats().bytes_cached, 12288);
  auto small = pool->acquire(8192);
  const auto s = pool->stats();
  EXPECT_EQ(s.bytes_cached, 0);
  EXPECT_EQ(s.bytes_in_use, 8192);
  EXPECT_EQ(s.allocations, 2);
}

TEST(HostBufferPoolTest, NoCapByDefault) {
  auto pool = HostBufferPool::create(false);
  EXPECT_EQ(pool->max_host_bytes(), 0);
  std::vector<std::unique_ptr<HostBlock>> blocks;
  for (int i = 0; i < 8; ++i) blocks.push_back(pool->acquire(1 << 20));
  EXPECT_EQ(pool->stats().bytes_in_use, 8 << 20);
  EXPECT_THROW(HostBufferPool::create(false, 0, -1), c10::Error);
}

}  // namespace
}  // namespace hyper_parallel::activation
