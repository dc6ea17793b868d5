#pragma once
// CopyEngine: where swap copies run, and how their completion is observed.
//
// Protocol (docs/design.md, "Streams and events"):
//  * The compute stream is the current stream of the device at the time of the call.
//  * submit() queues a batch of copies on the side stream of one direction, ordered after
//    all work queued so far on the compute stream and after the events in `after`.
//  * The returned CopyEvent completes when the whole batch is done. The compute stream
//    waits on it (CopyEvent::block_compute) before it reads a reloaded storage.
//  * release_after() drops device memory that the side stream may still be reading; the
//    memory is not reused before the queued copies of that direction complete.
//
// Two implementations:
//  * AcceleratorCopyEngine: c10 streams/events through DeviceGuardImplInterface
//    (CUDA, XPU, PrivateUse1/NPU). No CUDA header.
//  * ThreadCopyEngine: host tensors; each direction is a real worker thread (the
//    "stream"), events are completion flags, optional per-byte delay for tests.
//
// Thread-safety: all methods may be called from any thread.

#include <ATen/core/Tensor.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>

#include <cstddef>
#include <memory>
#include <vector>

namespace hyper_parallel::activation {

enum class CopyDirection : uint8_t { kDeviceToHost = 0, kHostToDevice = 1 };

class CopyEvent {
 public:
  virtual ~CopyEvent() = default;
  // True once the batch completed. Never blocks.
  virtual bool query() const = 0;
  // Blocks the calling host thread until the batch completed; returns seconds waited.
  virtual double synchronize() const = 0;
  // Orders the current compute stream of `device` after the batch. On a real stream
  // this does not block the host; on the thread engine it is a host wait (the host is
  // the compute stream). Returns host seconds waited (0 when nothing blocked).
  virtual double block_compute(c10::Device device) const = 0;
  // Once completed: the interval during which the batch ran, on the host clock of
  // trace_now_ns() (Trace.h). False when it was not measured (no trace at submit).
  virtual bool interval(int64_t& start_ns, int64_t& end_ns) const { return false; }
};
using CopyEventPtr = std::shared_ptr<const CopyEvent>;

// One storage (viewed as 1-D uint8, contiguous, covering the whole storage) and where
// its bytes live on the host: `host_offset` bytes into `host`, or into the plan's host
// block when `host` is undefined.
struct CopyItem {
  at::Tensor device_bytes;
  size_t host_offset = 0;
  at::Tensor host;
};

// A batch: items copied between their storages and host blocks (1-D uint8 CPU tensors).
// When `fused`, the engine gathers the items into one device staging buffer and moves
// it with a single host<->device copy (SPEC 2, group_swap); items are then laid out
// back to back starting at items[0].host_offset.
struct CopyPlan {
  at::Tensor host;
  std::vector<CopyItem> items;
  bool fused = false;  // requires every item to use `host`
  size_t total_bytes() const;
  const at::Tensor& host_of(const CopyItem& item) const {
    return item.host.defined() ? item.host : host;
  }
};

class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual CopyEventPtr submit(CopyDirection direction, c10::Device device, const CopyPlan& plan,
                              const std::vector<CopyEventPtr>& after) = 0;
  // Frees `memory` (the old data pointers of offloaded storages) once the copies queued
  // so far in `direction` have finished reading it.
  virtual void release_after(CopyDirection direction, c10::Device device,
                             std::vector<at::DataPtr> memory) = 0;
  void release_after(CopyDirection direction, c10::Device device, at::DataPtr memory) {
    std::vector<at::DataPtr> one;
    one.push_back(std::move(memory));
    release_after(direction, device, std::move(one));
  }
  // Tells the device allocator that the side stream of `direction` writes `memory`
  // (allocated on the compute stream), so it is not reused before that write ends.
  virtual void record_use(CopyDirection direction, c10::Device device,
                          const at::DataPtr& memory) = 0;
  // True when host blocks should be page-locked (a real accelerator is present).
  virtual bool wants_pinned_host() const = 0;
  // Number of host<->device copy operations issued so far (a fused batch counts 1).
  virtual int64_t transfers_issued() const = 0;
};

}  // namespace hyper_parallel::activation
