#pragma once
// SavedBytesMeter: peak bytes of storages held for backward, on any device (SPEC 6).
//
// observe(t) remembers t's storage (weakly, once per storage). sample() sums the current
// nbytes() of the observed storages that are still alive: a storage offloaded in place
// reports 0, a reloaded one its full size, a dead one nothing. The peak is the largest
// sample. Parameters and views of parameters are not activations and are ignored.
// Samples are taken by observe() (incrementally: + the new storage's bytes) and by
// sample() (exactly: every observed storage). A saved storage dies only after what its
// pack hook returned is released (autograd frees a node's saved tensors after its
// backward, or with a graph dropped unused), and the engine frees device memory in place
// only at region boundaries, where the Python layer samples. So the pack hooks' saved
// objects, and selective checkpoint's cached outputs (SacCache slots, which observe()
// counts when cached), name their storage to note_release() when destroyed (a cache slot
// had not: its storage counted until the next sample(), and a user's meter read 1.8 %
// above the planner's sampled one), and the next observe()
// first takes those of them that died out of the total (a released storage still alive is
// watched, and taken out once it dies: the watch is checked at observes too, so one whose
// other holder lets go later leaves before the next saves are added; it had waited for
// the next release or sample, and CI read one micro-batch's peak 43 % high): a storage
// freed between two
// forwards (the backward of one gradient-accumulation micro-batch before the next one's
// forward) leaves it before the next one is added. O(1) per saved tensor and per release
// (a tester's 8 000-layer forward that dropped a graph per layer: a recount of every
// storage per release had made it quadratic), amortized where the caller holds more
// than kWatchAlways released storages: those are checked once per as many observes, so
// one that dies may count until then.
// A storage counts while it is alive, so one the caller still holds after its backward
// (a list of micro-batch inputs, the last micro-batch's output in a loop variable) keeps
// counting: its memory is still allocated, and the planner's cost model counts it so too
// (held bytes, CostModel.h).
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
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

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
  // The planner's boundary storages (docs/design.md, "Boundary storages"): whether t's
  // storage, observed and alive, was observed in `epoch` >= 1 (first, or again: the last
  // epoch that saved it again), and the epoch that first observed it (nullopt: never
  // observed, or dead).
  bool saved_in(const at::Tensor& t, int epoch) const;
  std::optional<int> first_epoch(const at::Tensor& t) const;

  // The meter PackHooks report to (at most one active at a time), or null.
  static SavedBytesMeter* active();
  static void set_active(SavedBytesMeter* meter);
  // A saved object (a pass-through, a swap handle or a SacCache slot) holding `storage` was
  // destroyed: the active meter checks at its next observe() whether the storage died.
  // noexcept (called from destructors, on any thread; takes the meter's lock, a leaf lock).
  static void note_release(const c10::StorageImpl* storage) noexcept;
  // The same for the storage of `t` (an undefined tensor, or one without plain storage, is
  // ignored); returns at once when no meter is active. The one call of every saved
  // object's destructor.
  static void note_release(const at::Tensor& t) noexcept;

 private:
  // Sums the live observed storages, erases the dead ones, updates the peak. Needs mu_.
  int64_t recount_locked();
  // Takes the released storages that died out of the running total. Needs mu_.
  void settle_locked();
  // Whether `key` is an observed storage still alive; a dead one leaves the running total
  // and the observed set. Needs mu_.
  bool keep_if_alive_locked(const c10::StorageImpl* key);

  mutable std::mutex mu_;
  std::vector<const c10::StorageImpl*> suspects_;  // note_release() since the last settle
  // Released storages found alive (held by the caller): checked again at each settle
  // while at most kWatchAlways, else once per watch_.size() observes (amortized O(1)); an
  // observe with no new release checks a watch of at most kWatchEveryObserve, else once per
  // watch_.size() observes.
  static constexpr size_t kWatchAlways = 256;
  static constexpr size_t kWatchEveryObserve = 16;
  std::unordered_set<const c10::StorageImpl*> watch_;
  size_t observes_since_watch_ = 0;
  bool recount_all_ = false;                        // a suspect could not be recorded
  struct Seen {
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
    int first_epoch = 0;
    int last_resaved = 0;  // the last epoch that counted it in resaved_
    int64_t counted = 0;   // its bytes in running_
  };
  std::unordered_map<const c10::StorageImpl*, Seen> seen_;
  int64_t running_ = 0;
  int64_t peak_ = 0;
  int epoch_ = 0;
  std::unordered_map<int, int64_t> resaved_;
};

}  // namespace hyper_parallel::activation
