#include "hyper_parallel/activation/HostBufferPool.h"

#include "hyper_parallel/common/Macros.h"

#include <ATen/ops/empty.h>

namespace hyper_parallel::activation {

HostBlock::HostBlock(std::shared_ptr<HostBufferPool> pool, at::Tensor buffer, size_t size_class)
    : pool_(std::move(pool)), buffer_(std::move(buffer)), size_class_(size_class) {}

HostBlock::~HostBlock() { pool_->give_back(std::move(buffer_), size_class_, std::move(last_use_)); }

std::shared_ptr<HostBufferPool> HostBufferPool::create(bool pinned, int64_t max_cached_bytes,
                                                       int64_t max_host_bytes,
                                                       bool keep_when_full) {
  HP_CHECK_VALUE(max_host_bytes >= 0, "a host pool cap must be >= 0 bytes (0: no cap), got ",
                 max_host_bytes);
  return std::shared_ptr<HostBufferPool>(
      new HostBufferPool(pinned, max_cached_bytes, max_host_bytes, keep_when_full));
}

size_t HostBufferPool::size_class(size_t nbytes) {
  constexpr size_t kPage = 4096;
  constexpr size_t kSmallLimit = size_t{1} << 20;
  if (nbytes == 0) nbytes = 1;
  if (nbytes <= kSmallLimit) return (nbytes + kPage - 1) / kPage * kPage;
  // Four classes per power of two: step = 2^(floor(log2(n)) - 2).
  size_t high = size_t{1} << (63 - __builtin_clzll(static_cast<unsigned long long>(nbytes)));
  size_t step = high / 4;
  return (nbytes + step - 1) / step * step;
}

std::unique_ptr<HostBlock> HostBufferPool::acquire(size_t nbytes) {
  return acquire_or_null(nbytes, false, false);
}

std::unique_ptr<HostBlock> HostBufferPool::try_acquire(size_t nbytes, bool count_refusal) {
  return acquire_or_null(nbytes, true, count_refusal);
}

std::unique_ptr<HostBlock> HostBufferPool::acquire_or_null(size_t nbytes, bool or_null,
                                                           bool count_refusal) {
  const size_t cls = size_class(nbytes);
  const auto bytes = static_cast<int64_t>(cls);
  at::Tensor buffer;
  bool pinned;
  for (;;) {
    std::vector<CopyEventPtr> wait_on;
    {
      std::lock_guard<std::mutex> lock(mu_);
      promote_completed_locked();
      pinned = pinned_;
      auto it = free_.find(cls);
      if (it != free_.end()) {
        buffer = std::move(it->second);
        free_.erase(it);
        stats_.bytes_cached -= bytes;
        stats_.reuses += 1;
        stats_.bytes_in_use += bytes;
        break;
      }
      if (max_host_bytes_ > 0) {
        // Only the blocks in use cannot be reclaimed: when they leave no room, nothing is
        // dropped or waited for (a refusal keeps the cache, so a steady loop still reuses
        // it, and never waits for a copy that could not make room; tester, session 21).
        if (stats_.bytes_in_use + bytes > max_host_bytes_) {
          if (or_null) {
            if (count_refusal) stats_.refusals += 1;
            return nullptr;
          }
          HP_CHECK(bytes <= max_host_bytes_, "host pool full: a block of ", bytes,
                   " bytes (the size class of ", nbytes, " bytes) is larger than the pool's "
                   "cap of ", max_host_bytes_, " bytes (max_host_bytes). Raise max_host_bytes "
                   "above it, or keep this tensor out of the pool (a swap policy_fn returning "
                   "CheckpointPolicy.MUST_SAVE for it).");
          HP_CHECK(false, "host pool full: a block of ", bytes,
                   " bytes does not fit under the pool's cap of ", max_host_bytes_,
                   " bytes (max_host_bytes), because ", stats_.bytes_in_use,
                   " bytes hold offloaded activations that have not been reloaded yet. "
                   "Raise max_host_bytes of this PinnedMemoryPool, swap fewer layers into "
                   "it, or run the backward that reloads them before the next forward.");
        }
        // It fits once reclaimed: drop cached blocks (largest first), then wait for the
        // pending ones (their last copy) and retry.
        auto held = [&] { return stats_.bytes_in_use + stats_.bytes_pending + stats_.bytes_cached; };
        while (held() + bytes > max_host_bytes_ && !free_.empty()) {
          auto last = std::prev(free_.end());
          stats_.bytes_cached -= static_cast<int64_t>(last->first);
          free_.erase(last);
        }
        if (held() + bytes > max_host_bytes_) {
          HP_INTERNAL_ASSERT(!pending_.empty(), "host pool: over the cap with nothing pending");
          for (const auto& p : pending_) wait_on.push_back(p.last_use);
          stats_.cap_waits += 1;
        }
      }
      if (wait_on.empty()) {
        stats_.bytes_in_use += bytes;  // reserved before allocating (other threads see it)
        stats_.allocations += 1;
        break;
      }
    }
    for (const auto& e : wait_on) e->synchronize();  // then retry: they are reusable now
  }
  if (!buffer.defined()) {
    try {
      buffer = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kCPU)
                                      .pinned_memory(pinned));
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      stats_.bytes_in_use -= bytes;
      stats_.allocations -= 1;
      throw;
    }
  }
  return std::make_unique<HostBlock>(shared_from_this(), std::move(buffer), cls);
}

void HostBufferPool::give_back(at::Tensor buffer, size_t size_class, CopyEventPtr last_use) {
  std::lock_guard<std::mutex> lock(mu_);
  stats_.bytes_in_use -= static_cast<int64_t>(size_class);
  if (last_use && !last_use->query()) {
    stats_.bytes_pending += static_cast<int64_t>(size_class);
    pending_.push_back(Pending{std::move(buffer), size_class, std::move(last_use)});
    return;
  }
  stats_.bytes_cached += static_cast<int64_t>(size_class);
  free_.emplace(size_class, std::move(buffer));
  trim_locked();
}

void HostBufferPool::promote_completed_locked() {
  for (size_t i = 0; i < pending_.size();) {
    if (pending_[i].last_use->query()) {
      stats_.bytes_pending -= static_cast<int64_t>(pending_[i].size_class);
      stats_.bytes_cached += static_cast<int64_t>(pending_[i].size_class);
      free_.emplace(pending_[i].size_class, std::move(pending_[i].buffer));
      pending_[i] = std::move(pending_.back());
      pending_.pop_back();
    } else {
      ++i;
    }
  }
  trim_locked();
}

void HostBufferPool::trim_locked() {
  // Drop the largest free blocks first until the cache is under its bound.
  while (stats_.bytes_cached > max_cached_bytes_ && !free_.empty()) {
    auto it = std::prev(free_.end());
    stats_.bytes_cached -= static_cast<int64_t>(it->first);
    free_.erase(it);
  }
}

HostBufferPoolStats HostBufferPool::stats() {
  std::lock_guard<std::mutex> lock(mu_);
  promote_completed_locked();
  return stats_;
}

void HostBufferPool::empty_cache() {
  std::lock_guard<std::mutex> lock(mu_);
  promote_completed_locked();
  free_.clear();
  stats_.bytes_cached = 0;
}

void HostBufferPool::set_pinned(bool pinned) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pinned != pinned_) {
    free_.clear();
    stats_.bytes_cached = 0;
    pinned_ = pinned;
  }
}

}  // namespace hyper_parallel::activation
