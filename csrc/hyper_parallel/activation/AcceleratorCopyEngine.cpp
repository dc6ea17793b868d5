#include "hyper_parallel/activation/AcceleratorCopyEngine.h"

#include "hyper_parallel/activation/Trace.h"
#include "hyper_parallel/common/Macros.h"

#include <ATen/record_function.h>

#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <chrono>
#include <thread>

namespace hyper_parallel::activation {

namespace {

const c10::impl::DeviceGuardImplInterface* guard_impl(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type());
}

c10::Stream current_stream(c10::Device device) { return guard_impl(device)->getStream(device); }

// A recorded c10::Event. c10::Event is move-only; the shared_ptr of CopyEventPtr shares it.
class StreamEvent final : public CopyEvent {
 public:
  // `start`: a timing event recorded on `stream` before the batch (only while a trace
  // records), which makes interval() available.
  StreamEvent(c10::Device device, const c10::Stream& stream,
              std::shared_ptr<c10::Event> start = nullptr)
      : device_(device),
        event_(device.type(),
               start ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT),
        start_(std::move(start)) {
    event_.record(stream);
  }
  bool interval(int64_t& start_ns, int64_t& end_ns) const override {
    if (!start_) return false;
    Trace& trace = Trace::global();
    return trace.host_time_of(device_, *start_, start_ns) &&
           trace.host_time_of(device_, event_, end_ns);
  }
  bool query() const override { return event_.query(); }
  double synchronize() const override {
    // Poll: Event::synchronize is not implemented by every backend (torch_npu < 2.6).
    if (event_.query()) return 0.0;
    auto start = std::chrono::steady_clock::now();
    while (!event_.query()) std::this_thread::yield();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double block_compute(c10::Device device) const override {
    event_.block(current_stream(device));
    return 0.0;
  }
  void block(const c10::Stream& stream) const { event_.block(stream); }

 private:
  c10::Device device_;
  c10::Event event_;
  std::shared_ptr<c10::Event> start_;
};

}  // namespace

bool is_accelerator(c10::Device device) {
  if (device.is_cpu() || device.is_meta()) return false;
  return c10::impl::hasDeviceGuardImpl(device.type());
}

c10::Stream AcceleratorCopyEngine::side_stream(c10::Device device, CopyDirection direction) {
  std::lock_guard<std::mutex> lock(mu_);
  auto key = std::make_pair(std::make_pair(static_cast<int>(device.type()),
                                           static_cast<int>(device.index())),
                            static_cast<int>(direction));
  auto it = streams_.find(key);
  if (it != streams_.end()) return it->second;
  c10::DeviceGuard guard(device);
  c10::Stream stream = guard_impl(device)->getStreamFromGlobalPool(device, /*isHighPriority=*/false);
  streams_.emplace(key, stream);
  return stream;
}

CopyEventPtr AcceleratorCopyEngine::submit(CopyDirection direction, c10::Device device,
                                           const CopyPlan& plan,
                                           const std::vector<CopyEventPtr>& after) {
  c10::DeviceGuard device_guard(device);
  const c10::Stream compute = current_stream(device);
  const c10::Stream side = side_stream(device, direction);
  // The side stream starts after everything queued so far on the compute stream: the
  // data to offload has been produced, and a reload target is no longer in use.
  c10::Event ready(device.type());
  ready.record(compute);
  ready.block(side);
  for (const auto& ev : after) {
    if (auto* se = dynamic_cast<const StreamEvent*>(ev.get())) se->block(side);
  }
  const bool to_host = direction == CopyDirection::kDeviceToHost;
  RECORD_USER_SCOPE(to_host ? "hyper_parallel::offload" : "hyper_parallel::reload");
  std::shared_ptr<c10::Event> start;
  if (Trace::global().on()) {  // docs/design.md, "Timeline"
    Trace::global().ensure_reference(device);
    start = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
    start->record(side);
  }
  {
    c10::StreamGuard stream_guard(side);
    if (plan.fused && !plan.items.empty()) {
      const auto total = static_cast<int64_t>(plan.total_bytes());
      const auto base = static_cast<int64_t>(plan.items[0].host_offset);
      // Staging is allocated with the side stream current, so it belongs to that stream
      // and is reusable as soon as the side stream moves on.
      at::Tensor staging = at::empty({total}, plan.items[0].device_bytes.options());
      at::Tensor host = plan.host.narrow(0, base, total);
      int64_t off = 0;
      if (to_host) {
        for (const auto& item : plan.items) {
          const auto n = static_cast<int64_t>(item.device_bytes.nbytes());
          staging.narrow(0, off, n).copy_(item.device_bytes, /*non_blocking=*/true);
          off += n;
        }
        host.copy_(staging, /*non_blocking=*/true);
      } else {
        staging.copy_(host, /*non_blocking=*/true);
        for (const auto& item : plan.items) {
          const auto n = static_cast<int64_t>(item.device_bytes.nbytes());
          item.device_bytes.copy_(staging.narrow(0, off, n), /*non_blocking=*/true);
          off += n;
        }
      }
      transfers_ += 1;
    } else {
      for (const auto& item : plan.items) {
        const auto n = static_cast<int64_t>(item.device_bytes.nbytes());
        at::Tensor host = plan.host_of(item).narrow(0, static_cast<int64_t>(item.host_offset), n);
        if (to_host) {
          host.copy_(item.device_bytes, /*non_blocking=*/true);
        } else {
          item.device_bytes.copy_(host, /*non_blocking=*/true);
        }
      }
      transfers_ += static_cast<int64_t>(plan.items.size());
    }
  }
  return std::make_shared<StreamEvent>(device, side, std::move(start));
}

void AcceleratorCopyEngine::release_after(CopyDirection direction, c10::Device device,
                                          std::vector<at::DataPtr> memory) {
  // The caching allocator keeps each block reserved until the side stream passes the
  // point recorded at free time (cpp_feasibility.md Q3), so the compute stream never
  // has to wait for the offload before it can free.
  const c10::Stream side = side_stream(device, direction);
  for (auto& m : memory) {
    guard_impl(device)->recordDataPtrOnStream(m, side);
    m.clear();
  }
}

void AcceleratorCopyEngine::record_use(CopyDirection direction, c10::Device device,
                                       const at::DataPtr& memory) {
  guard_impl(device)->recordDataPtrOnStream(memory, side_stream(device, direction));
}

}  // namespace hyper_parallel::activation
