// GoogleTests of the simulated device itself (streams, events, caching allocator) and of
// AcceleratorCopyEngine + HostBufferPool on it, below the Python layer.

#include "Allocator.h"
#include "Runtime.h"

#include "hyper_parallel/activation/AcceleratorCopyEngine.h"
#include "hyper_parallel/activation/HostBufferPool.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/equal.h>
#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <gtest/gtest.h>

#include <thread>

using namespace hyper_parallel::activation;

namespace {

const c10::Device kDev0(c10::DeviceType::PrivateUse1, 0);
const c10::Device kDev1(c10::DeviceType::PrivateUse1, 1);

class SimTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static bool registered = [] {
      c10::register_privateuse1_backend("hpsim");
      return true;
    }();
    (void)registered;
    hpsim::config().link_ns_per_byte = 0.0;
  }
  void TearDown() override {
    hpsim::synchronize_device(0);
    hpsim::synchronize_device(1);
    hpsim::config().link_ns_per_byte = 0.0;
  }
  const c10::impl::DeviceGuardImplInterface* impl() {
    return c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
  }
};

at::Tensor bytes_on(c10::Device device, int64_t n, int64_t start) {
  return at::arange(start, start + n, at::TensorOptions().dtype(at::kLong)).to(at::kByte).to(device);
}

TEST_F(SimTest, EventsOrderStreamsAndMeasureTime) {
  c10::Stream side = impl()->getStreamFromGlobalPool(kDev0, false);
  c10::Stream compute = impl()->getStream(kDev0);
  ASSERT_NE(side.id(), compute.id());
  c10::Event start(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT);
  c10::Event end(c10::DeviceType::PrivateUse1, c10::EventFlag::BACKEND_DEFAULT);
  EXPECT_TRUE(end.query());  // never recorded
  std::atomic<bool> ran{false};
  start.record(side);
  hpsim::stream(0, side.id()).enqueue([&ran] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ran = true;
  });
  end.record(side);
  end.block(compute);  // the compute stream waits for the side stream's task
  std::atomic<bool> seen{false};
  hpsim::stream(0, compute.id()).enqueue([&] { seen = ran.load(); });
  EXPECT_FALSE(end.query());
  end.synchronize();
  EXPECT_TRUE(end.query());
  compute.synchronize();
  EXPECT_TRUE(seen.load());
  EXPECT_GE(start.elapsedTime(end), 19.0);  // milliseconds
}

TEST_F(SimTest, FreedBlockIsReusedAtOnceUnlessRecordedOnAnotherStream) {
  c10::Allocator* alloc = hpsim::device_allocator();
  void* first = nullptr;
  {
    c10::DataPtr a = alloc->allocate(5000);
    first = a.get();
  }
  c10::DataPtr b = alloc->allocate(6000);  // same 8 KiB class: LIFO reuse
  EXPECT_EQ(b.get(), first);
  c10::Stream side = impl()->getStreamFromGlobalPool(kDev0, false);
  std::atomic<bool> release{false};
  hpsim::stream(0, side.id()).enqueue([&release] {
    while (!release.load()) std::this_thread::yield();
  });
  impl()->recordDataPtrOnStream(b, side);
  b.clear();
  c10::DataPtr c = alloc->allocate(6000);
  EXPECT_NE(c.get(), first);  // held until the side stream passes the free point
  release = true;
  hpsim::stream(0, side.id()).synchronize();
  c10::DataPtr d = alloc->allocate(6000);
  EXPECT_EQ(d.get(), first);
}

// The pool is shared by all devices: a block given back while device 0's H2D still reads
// it must not be handed to device 1's D2H. Dropping set_last_use (the wait) is caught.
TEST_F(SimTest, HostBlockIsNotReusedBeforeItsCopyFinished) {
  hpsim::config().link_ns_per_byte = 20000.0;  // 4 KiB: 82 ms; 64 B: 1.3 ms
  auto run = [](bool set_last_use) {
    auto pool = HostBufferPool::create(/*pinned=*/true);
    AcceleratorCopyEngine engine;
    const at::Tensor expected = bytes_on(c10::Device(c10::kCPU), 4096, 0);
    auto x = pool->acquire(4096);
    x->buffer().copy_(expected);  // X holds an offloaded storage
    at::Tensor target = at::empty({4096}, at::TensorOptions().dtype(at::kByte).device(kDev0));
    CopyPlan reload;
    reload.host = x->buffer();
    reload.items.push_back(CopyItem{target, 0, at::Tensor()});
    CopyEventPtr h2d = engine.submit(CopyDirection::kHostToDevice, kDev0, reload, {});
    if (set_last_use) x->set_last_use(h2d);
    x.reset();  // the record went back to device: its block returns to the pool
    auto y = pool->acquire(64);
    CopyPlan offload;
    offload.host = y->buffer();
    offload.items.push_back(CopyItem{bytes_on(kDev1, 64, 7), 0, at::Tensor()});
    CopyEventPtr d2h = engine.submit(CopyDirection::kDeviceToHost, kDev1, offload, {});
    y->set_last_use(d2h);
    h2d->synchronize();
    d2h->synchronize();
    return at::equal(target.cpu(), expected);
  };
  EXPECT_FALSE(run(false)) << "a host block reused during its H2D went unnoticed";
  EXPECT_TRUE(run(true));
}

}  // namespace
