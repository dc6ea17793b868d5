#pragma once
// HostBufferPool: bounded pool of host blocks that hold offloaded activations.
//
// Blocks are 1-D uint8 CPU tensors, page-locked when an accelerator is in use (pinned
// memory is what lets D2H/H2D copies run asynchronously). Sizes are rounded up to a
// size class: multiples of 4 KiB below 1 MiB, then four classes per power of two
// (at most 25% internal waste; the scheme of jemalloc's size classes).
//
// A block given back is not reusable until the CopyEvent of the last copy that touched
// it has completed (SPEC 4.8): it waits in a pending list, promoted to the free list when
// its event queries complete. acquire() reuses a free block of the same class before it
// allocates; in a steady training loop, every step finds its blocks in the free list, so
// allocations() stops growing after warm-up. Cached (free) bytes above `max_cached_bytes`
// are released to the system.
//
// Cap (`max_host_bytes`, 0 = none): the bytes the pool holds from the system (in use +
// pending + cached) never exceed it. When the blocks in use alone leave no room, acquire()
// throws c10::Error naming the cap at once (dropping nothing, waiting for nothing);
// otherwise a block that does not fit first drops cached blocks, then waits for pending
// blocks (their last copy) and reuses or drops them. A pool per
// purpose (PinnedMemoryPool in Python) bounds the host memory of the activations it holds.
// A pool made with `keep_when_full` tells the engine to keep such a batch on the device
// instead (try_acquire() returns null where acquire() throws; docs/design.md, "Host
// memory"): the cap still holds, the device keeps the bytes that did not fit.
//
// Thread-safety: all methods are thread-safe (one internal mutex, never held while
// calling out, except the allocator).

#include "hyper_parallel/activation/CopyEngine.h"

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace hyper_parallel::activation {

struct HostBufferPoolStats {
  int64_t bytes_in_use = 0;    // handed out and not given back
  int64_t bytes_pending = 0;   // given back, waiting for their last copy to finish
  int64_t bytes_cached = 0;    // free, ready for reuse
  int64_t allocations = 0;     // blocks ever allocated from the system
  int64_t reuses = 0;          // acquire() satisfied from the free list
  int64_t cap_waits = 0;       // acquire() waited for pending blocks to fit under the cap
  int64_t refusals = 0;        // try_acquire() found no room under the cap (returned null)
};

class HostBufferPool;

// A block lent by the pool; returned to it (pending on `last_use`) when destroyed.
class HostBlock {
 public:
  HostBlock(std::shared_ptr<HostBufferPool> pool, at::Tensor buffer, size_t size_class);
  ~HostBlock();
  HostBlock(const HostBlock&) = delete;
  HostBlock& operator=(const HostBlock&) = delete;

  // 1-D uint8 CPU tensor of capacity() bytes.
  const at::Tensor& buffer() const { return buffer_; }
  size_t capacity() const { return size_class_; }
  // Records the event of the latest copy that reads or writes this block.
  void set_last_use(CopyEventPtr event) { last_use_ = std::move(event); }

 private:
  std::shared_ptr<HostBufferPool> pool_;
  at::Tensor buffer_;
  size_t size_class_;
  CopyEventPtr last_use_;
};

class HostBufferPool : public std::enable_shared_from_this<HostBufferPool> {
 public:
  // `pinned`: allocate page-locked memory (requires an accelerator backend in torch).
  // `max_host_bytes`: cap on the bytes held from the system (0: no cap).
  // `keep_when_full`: what the engine does with an offload that does not fit under the
  // cap (false: raise, through acquire(); true: keep it on the device, try_acquire()).
  static std::shared_ptr<HostBufferPool> create(bool pinned,
                                                int64_t max_cached_bytes = int64_t{8} << 30,
                                                int64_t max_host_bytes = 0,
                                                bool keep_when_full = false);

  // Returns a block of at least `nbytes` (> 0) bytes. Throws c10::Error when the system
  // allocation fails, or when the blocks in use (held by offloaded activations) leave no
  // room for it under the cap. May block the calling thread on copy events (never while
  // holding the pool lock) when it fits once pending blocks are reclaimed.
  std::unique_ptr<HostBlock> acquire(size_t nbytes);
  // acquire(), but null where acquire() would throw for the cap (counted in
  // stats().refusals when `count_refusal`); a failed system allocation still throws. When
  // the blocks in use leave no room, it returns at once: no cached block is dropped and no
  // copy waited for.
  std::unique_ptr<HostBlock> try_acquire(size_t nbytes, bool count_refusal = true);

  // Size class for a request of `nbytes`.
  static size_t size_class(size_t nbytes);

  HostBufferPoolStats stats();
  // Drops every free block (pending ones stay until their copies end).
  void empty_cache();
  bool pinned() const { return pinned_; }
  int64_t max_host_bytes() const { return max_host_bytes_; }
  bool keep_when_full() const { return keep_when_full_; }
  // True the first time it is called after a refusal of try_acquire(), false after (the
  // engine's one warning per pool).
  bool take_first_refusal() {
    std::lock_guard<std::mutex> lock(mu_);
    if (stats_.refusals == 0 || warned_) return false;
    warned_ = true;
    return true;
  }
  void set_pinned(bool pinned);
  // fork(): the engine's prepare handler takes the pool lock so that the child inherits it
  // unlocked and consistent (SwapEngine, "fork"); both sides release it after the fork.
  void lock_for_fork() { mu_.lock(); }
  void unlock_after_fork() { mu_.unlock(); }

 private:
  friend class HostBlock;
  HostBufferPool(bool pinned, int64_t max_cached_bytes, int64_t max_host_bytes,
                 bool keep_when_full)
      : pinned_(pinned), max_cached_bytes_(max_cached_bytes), max_host_bytes_(max_host_bytes),
        keep_when_full_(keep_when_full) {}
  std::unique_ptr<HostBlock> acquire_or_null(size_t nbytes, bool or_null, bool count_refusal);
  void give_back(at::Tensor buffer, size_t size_class, CopyEventPtr last_use);
  void promote_completed_locked();
  void trim_locked();

  struct Pending {
    at::Tensor buffer;
    size_t size_class;
    CopyEventPtr last_use;
  };
  std::mutex mu_;
  bool pinned_;
  int64_t max_cached_bytes_;
  int64_t max_host_bytes_;
  const bool keep_when_full_;
  bool warned_ = false;
  std::multimap<size_t, at::Tensor> free_;
  std::vector<Pending> pending_;
  HostBufferPoolStats stats_;
};

}  // namespace hyper_parallel::activation
