#pragma once
// AcceleratorCopyEngine: swap copies on side streams of an accelerator, device-generic
// through c10::impl::DeviceGuardImplInterface (CUDA, XPU, PrivateUse1 = Ascend NPU).
// No CUDA header is included; the backend is whatever torch registered for the device
// type (research/cpp_feasibility.md Q1-Q3).
//
// Streams: one side stream per (device, direction), taken once from the backend's
// global stream pool (the portable call; getNewStream is missing on torch_npu < 2.6).
// Events: c10::Event, recorded and blocked on; host waits poll Event::query(), which
// every backend implements.
//
// Thread-safety: thread-safe; the stream table is guarded by a mutex.

#include "hyper_parallel/activation/CopyEngine.h"

#include <c10/core/Stream.h>

#include <atomic>
#include <map>
#include <mutex>
#include <utility>

namespace hyper_parallel::activation {

class AcceleratorCopyEngine final : public CopyEngine {
 public:
  AcceleratorCopyEngine() = default;
  CopyEventPtr submit(CopyDirection direction, c10::Device device, const CopyPlan& plan,
                      const std::vector<CopyEventPtr>& after) override;
  void release_after(CopyDirection direction, c10::Device device,
                     std::vector<at::DataPtr> memory) override;
  using CopyEngine::release_after;
  void record_use(CopyDirection direction, c10::Device device,
                  const at::DataPtr& memory) override;
  bool wants_pinned_host() const override { return true; }
  int64_t transfers_issued() const override { return transfers_.load(); }

  // The side stream used for `direction` on `device` (created on first use).
  c10::Stream side_stream(c10::Device device, CopyDirection direction);

 private:
  std::mutex mu_;
  std::map<std::pair<std::pair<int, int>, int>, c10::Stream> streams_;
  std::atomic<int64_t> transfers_{0};
};

// True when `device` is an accelerator whose backend can record events (CUDA, XPU,
// PrivateUse1, ...). CPU and meta return false.
bool is_accelerator(c10::Device device);

}  // namespace hyper_parallel::activation
