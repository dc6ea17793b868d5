#pragma once
// SavedBytesMeter: peak bytes of storages held for backward, on any device (SPEC 6).
//
// observe(t) remembers t's storage (weakly, once per storage). sample() sums the current
// nbytes() of the observed storages that are still alive: a storage offloaded in place
// reports 0, a reloaded one its full size, a dead one nothing. The peak is the largest
// sample. Parameters and views of parameters are not activations and are ignored.
// Samples are taken by observe() (incrementally: + the new storage's bytes) and by
// sample() (exactly); the engine releases memory only at region boundaries, where the
// Python layer samples, so the incremental total never misses a free in between.
//
// Thread-safety: thread-safe (internal mutex).

#include <ATen/core/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>

namespace hyper_parallel::activation {

class SavedBytesMeter {
 public:
  void observe(const at::Tensor& t);
  // Exact current total; updates the peak.
  int64_t sample();
  int64_t peak() const;
  int64_t observed_storages() const;
  void reset();

  // The meter PackHooks report to (at most one active at a time), or null.
  static SavedBytesMeter* active();
  static void set_active(SavedBytesMeter* meter);

 private:
  mutable std::mutex mu_;
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> seen_;
  int64_t running_ = 0;
  int64_t peak_ = 0;
};

}  // namespace hyper_parallel::activation
