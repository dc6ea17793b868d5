// hpsim: the DeviceGuardImpl (devices, streams, events) and the PrivateUse1 hooks
// (pinned memory, storage resize) of the simulated device. See Runtime.h.

#include "Allocator.h"
#include "Runtime.h"
#include "Storage.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace hpsim {

namespace {

constexpr auto kType = c10::DeviceType::PrivateUse1;

c10::Device make_device(int index) { return c10::Device(kType, static_cast<c10::DeviceIndex>(index)); }

int index_of(c10::Device d) { return d.has_index() ? d.index() : current_device(); }

c10::Stream make_stream(int device, int64_t id) {
  return c10::Stream(c10::Stream::UNSAFE, make_device(device), id);
}

Stream& sim_stream(const c10::Stream& s) { return stream(s.device_index(), s.id()); }

class GuardImpl final : public c10::impl::DeviceGuardImplInterface {
 public:
  c10::DeviceType type() const override { return kType; }
  c10::Device exchangeDevice(c10::Device d) const override {
    const int old = current_device();
    if (d.has_index()) set_current_device(d.index());
    return make_device(old);
  }
  c10::Device getDevice() const override { return make_device(current_device()); }
  void setDevice(c10::Device d) const override { set_current_device(index_of(d)); }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index() && d.index() >= 0 && d.index() < kDevices) set_current_device(d.index());
  }
  c10::Stream getStream(c10::Device d) const override {
    const int i = index_of(d);
    return make_stream(i, current_stream(i));
  }
  c10::Stream getDefaultStream(c10::Device d) const override { return make_stream(index_of(d), 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool) const override {
    const int i = index_of(d);
    return make_stream(i, next_pool_stream(i));
  }
  c10::Stream getNewStream(c10::Device d, int) const override {
    const int i = index_of(d);
    return make_stream(i, new_stream(i));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    const int i = s.device_index();
    const int64_t old = current_stream(i);
    stream(i, s.id());  // validates the id
    set_current_stream(i, s.id());
    return make_stream(i, old);
  }
  c10::DeviceIndex deviceCount() const noexcept override { return kDevices; }

  void record(void** event, const c10::Stream& s, const c10::DeviceIndex,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    MarkerPtr m = sim_stream(s).record();
    std::lock_guard<std::mutex> lock(e->mu);
    e->last = std::move(m);
  }
  void block(void* event, const c10::Stream& s) const override {
    if (event == nullptr) return;
    sim_stream(s).wait(static_cast<Event*>(event)->latest());
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;
    MarkerPtr m = static_cast<Event*>(event)->latest();
    return !m || m->done();
  }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    if (MarkerPtr m = static_cast<Event*>(event)->latest()) m->wait();
  }
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    TORCH_CHECK(start && end, "hpsim: both events must be recorded before elapsed_time");
    MarkerPtr a = static_cast<Event*>(start)->latest();
    MarkerPtr b = static_cast<Event*>(end)->latest();
    TORCH_CHECK(a && b && a->done() && b->done(),
                "hpsim: both events must have completed before elapsed_time");
    return std::chrono::duration<double, std::milli>(b->completed_at() - a->completed_at()).count();
  }
  bool queryStream(const c10::Stream& s) const override { return sim_stream(s).idle(); }
  void synchronizeStream(const c10::Stream& s) const override { sim_stream(s).synchronize(); }
  void synchronizeDevice(const c10::DeviceIndex d) const override { synchronize_device(d); }
  void recordDataPtrOnStream(const c10::DataPtr& data_ptr, const c10::Stream& s) const override {
    record_stream(data_ptr, s.id());
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

class Hooks final : public at::PrivateUse1HooksInterface {
 public:
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return kDevices; }
  void setCurrentDevice(c10::DeviceIndex d) const override { set_current_device(d); }
  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(current_device());
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    const int old = current_device();
    set_current_device(d);
    return static_cast<c10::DeviceIndex>(old);
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    return exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    // Random ops run through the CPU fallback, so the CPU generator is the one they use.
    return at::detail::getDefaultCPUGenerator();
  }
  c10::Device getDeviceFromPtr(void* data) const override {
    const int d = device_of(data);
    TORCH_CHECK(d >= 0, "hpsim: pointer is not simulated device memory");
    return make_device(d);
  }
  bool isPinnedPtr(const void* data) const override { return is_pinned(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_storage_bytes(storage, newsize);
  }
};

struct RegisterHooks {
  RegisterHooks() {
    static Hooks* hooks = new Hooks();
    at::RegisterPrivateUse1HooksInterface(hooks);
  }
} register_hooks;

}  // namespace

}  // namespace hpsim
