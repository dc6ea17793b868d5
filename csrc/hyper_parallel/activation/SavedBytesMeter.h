#pragma once
// SavedBytesMeter: peak bytes of storages held for backward, on any device (SPEC 6).
//
// observe(t) remembers t's storage (weakly, once per storage). sample() sums the current
// nbytes() of the observed storages that are still alive: a storage offloaded in place
// reports 0, a reloaded one its full size, a dead one nothing. The peak is the largest
// sample. Parameters and views of parameters are not activations and are ignored.
// Samples are taken by observe() (incrementally: + the new storage's bytes) and by
// sample() (exactly). A saved storage dies only after what its pack hook returned is
// released (autograd frees a node's saved tensors after its backward, or with a graph
// dropped unused), and the engine frees device memory in place only at region
// boundaries, where the Python layer samples. So the pack hooks' saved objects call
// note_release() when destroyed, and the next observe() recounts exactly first: a
// storage freed between two forwards (the backward of one gradient-accumulation
// micro-batch before the next one's forward) leaves the total before the next one is
// added. The forward itself stays O(1) per saved tensor (nothing is released in it).
//
// Epochs (the planner's profile, docs/design.md "Shared inputs"): begin_epoch(e) with e >= 1
// tags the storages first observed from then on with e; observing again, in epoch e, a
// storage first observed in an epoch 1 <= f < e adds its bytes to resaved_bytes(e) (once
// per storage and epoch): bytes a layer saves that an earlier layer saved first. Epoch 0
// (the default) and negative epochs record nothing.
//
// Thread-safety: thread-safe (internal mutex).

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace hyper_parallel::activation {

class SavedBytesMeter {
 public:
  void observe(const at::Tensor& t);
  // Exact current total; updates the peak.
  int64_t sample();
  int64_t peak() const;
  int64_t observed_storages() const;
  void reset();
  void begin_epoch(int epoch);
  // Bytes re-observed in `epoch` of storages first observed in an earlier epoch >= 1.
  int64_t resaved_bytes(int epoch) const;
  // Current bytes of the live storages first observed in `epoch` (any epoch; a storage
  // offloaded in place counts 0). The profile reads it when the backward ends: what the
  // caller still holds of each layer's saves.
  int64_t live_bytes(int epoch) const;

  // The meter PackHooks report to (at most one active at a time), or null.
  static SavedBytesMeter* active();
  static void set_active(SavedBytesMeter* meter);
  // A saved object (a pass-through or a swap handle) was destroyed: marks the active
  // meter's running total stale, so its next observe() recounts. Lock-free, noexcept
  // (called from destructors, on any thread).
  static void note_release() noexcept;

 private:
  // Sums the live observed storages, erases the dead ones, updates the peak. Needs mu_.
  int64_t recount_locked();

  mutable std::mutex mu_;
  std::atomic<bool> stale_{false};
  struct Seen {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int first_epoch = 0;
    int last_resaved = 0;  // the last epoch that counted it in resaved_
  };
  std::unordered_map<const c10::StorageImpl*, Seen> seen_;
  int64_t running_ = 0;
  int64_t peak_ = 0;
  int epoch_ = 0;
  std::unordered_map<int, int64_t> resaved_;
};

}  // namespace hyper_parallel::activation
