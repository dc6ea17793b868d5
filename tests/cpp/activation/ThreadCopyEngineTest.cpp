#include "hyper_parallel/activation/ThreadCopyEngine.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

namespace hyper_parallel::activation {
namespace {

const c10::Device kCpu(c10::kCPU);

// An event the test opens by hand; a batch that waits on it cannot start before.
class Gate final : public CopyEvent {
 public:
  bool query() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return open_;
  }
  double synchronize() const override {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return open_; });
    return 0.0;
  }
  double block_compute(c10::Device) const override { return synchronize(); }
  void open() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool open_ = false;
};

at::Tensor random_bytes(int64_t n, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, 256, {n}, gen, at::TensorOptions().dtype(at::kByte));
}

at::Tensor host_block(int64_t n) {
  // Filled with a pattern the copies must overwrite.
  return at::full({n}, 0xAB, at::TensorOptions().dtype(at::kByte));
}

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.nbytes() == b.nbytes() &&
         std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

TEST(ThreadCopyEngineTest, RoundTripRestoresBytesExactly) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/2.0);
  EXPECT_FALSE(engine.wants_pinned_host());
  const std::vector<int64_t> sizes = {1, 2, 3, 5, 7, 4097, 65535, (1 << 20) + 3};
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t n = sizes[k];
    at::Tensor src = random_bytes(n, 1000 + k);
    at::Tensor original = src.clone();
    const int64_t offset = static_cast<int64_t>(k) * 3;  // unaligned host offsets too
    at::Tensor host = host_block(n + offset + 5);
    CopyPlan d2h;
    d2h.host = host;
    d2h.items.push_back(CopyItem{src, static_cast<size_t>(offset)});
    EXPECT_EQ(d2h.total_bytes(), static_cast<size_t>(n));
    auto down = engine.submit(CopyDirection::kDeviceToHost, kCpu, d2h, {});
    down->synchronize();
    ASSERT_TRUE(down->query());
    EXPECT_TRUE(same_bytes(host.narrow(0, offset, n).contiguous(), original)) << "n=" << n;
    // Bytes outside the item are untouched.
    if (offset > 0) EXPECT_EQ(host[offset - 1].item<uint8_t>(), 0xAB);
    EXPECT_EQ(host[offset + n].item<uint8_t>(), 0xAB);

    // The "device" memory is lost (as after an offload), then refilled from the host.
    src.fill_(0);
    CopyPlan h2d;
    h2d.host = host;
    h2d.items.push_back(CopyItem{src, static_cast<size_t>(offset)});
    auto up = engine.submit(CopyDirection::kHostToDevice, kCpu, h2d, {down});
    EXPECT_GE(up->block_compute(kCpu), 0.0);
    ASSERT_TRUE(up->query());
    EXPECT_TRUE(same_bytes(src, original)) << "n=" << n;
  }
  EXPECT_EQ(engine.transfers_issued(), 2 * static_cast<int64_t>(sizes.size()));
}

TEST(ThreadCopyEngineTest, FusedPlanEqualsPerItemCopies) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/1.0);
  const std::vector<int64_t> sizes = {1, 13, 4, 1000, 7, 2, 4099};
  std::vector<at::Tensor> srcs;
  int64_t total = 0;
  for (size_t k = 0; k < sizes.size(); ++k) {
    srcs.push_back(random_bytes(sizes[k], 77 + k));
    total += sizes[k];
  }
  const size_t base = 9;  // a bucket that does not start at the block's beginning
  auto plan_for = [&](const std::vector<at::Tensor>& tensors, const at::Tensor& host, bool fused) {
    CopyPlan plan;
    plan.host = host;
    plan.fused = fused;
    size_t off = base;
    for (const auto& t : tensors) {
      plan.items.push_back(CopyItem{t, off});
      off += t.nbytes();
    }
    return plan;
  };
  at::Tensor host_fused = host_block(total + 20);
  at::Tensor host_single = host_block(total + 20);
  const int64_t before = engine.transfers_issued();
  auto e1 = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan_for(srcs, host_fused, true), {});
  EXPECT_EQ(engine.transfers_issued() - before, 1);  // one gathered copy
  auto e2 = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan_for(srcs, host_single, false), {});
  EXPECT_EQ(engine.transfers_issued() - before, 1 + static_cast<int64_t>(sizes.size()));
  e1->synchronize();
  e2->synchronize();
  EXPECT_TRUE(same_bytes(host_fused, host_single));
  EXPECT_EQ(host_fused[base - 1].item<uint8_t>(), 0xAB);
  EXPECT_EQ(host_fused[base + total].item<uint8_t>(), 0xAB);

  // Scatter back: fused and per-item copies give the same (original) bytes.
  std::vector<at::Tensor> out_fused, out_single;
  for (int64_t n : sizes) {
    out_fused.push_back(at::zeros({n}, at::kByte));
    out_single.push_back(at::zeros({n}, at::kByte));
  }
  auto u1 = engine.submit(CopyDirection::kHostToDevice, kCpu, plan_for(out_fused, host_fused, true), {e1});
  auto u2 = engine.submit(CopyDirection::kHostToDevice, kCpu, plan_for(out_single, host_single, false), {e2});
  u1->synchronize();
  u2->synchronize();
  for (size_t k = 0; k < sizes.size(); ++k) {
    EXPECT_TRUE(same_bytes(out_fused[k], srcs[k])) << "item " << k;
    EXPECT_TRUE(same_bytes(out_single[k], srcs[k])) << "item " << k;
  }
}

TEST(ThreadCopyEngineTest, EventCompletesOnlyAfterTheCopy) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/5.0);
  auto gate = std::make_shared<Gate>();
  at::Tensor src = random_bytes(1 << 16, 5);
  at::Tensor host = host_block(1 << 16);
  CopyPlan plan;
  plan.host = host;
  plan.items.push_back(CopyItem{src, 0});
  auto done = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan, {gate});
  // The batch cannot have started: its event is not complete and no byte moved.
  EXPECT_FALSE(done->query());
  EXPECT_EQ(host[0].item<uint8_t>(), 0xAB);
  gate->open();
  done->synchronize();
  EXPECT_TRUE(done->query());
  EXPECT_TRUE(same_bytes(host, src));
  // Without a gate, a delayed copy's bytes are all there once its event completes.
  at::Tensor host2 = host_block(1 << 16);
  plan.host = host2;
  auto done2 = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan, {});
  done2->synchronize();
  EXPECT_TRUE(done2->query());
  EXPECT_TRUE(same_bytes(host2, src));
}

TEST(ThreadCopyEngineTest, AfterEventsOrderABatchAfterAnother) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/5.0);
  auto gate = std::make_shared<Gate>();
  const int64_t n = 50000;
  at::Tensor src = random_bytes(n, 11);
  at::Tensor host = host_block(n);
  at::Tensor dst = at::zeros({n}, at::kByte);
  CopyPlan down;
  down.host = host;
  down.items.push_back(CopyItem{src, 0});
  auto d2h = engine.submit(CopyDirection::kDeviceToHost, kCpu, down, {gate});
  CopyPlan up;
  up.host = host;
  up.items.push_back(CopyItem{dst, 0});
  // The H2D runs on the other worker, so only `after` can order it behind the D2H.
  auto h2d = engine.submit(CopyDirection::kHostToDevice, kCpu, up, {d2h});
  EXPECT_FALSE(d2h->query());
  EXPECT_FALSE(h2d->query());
  EXPECT_EQ(dst[0].item<uint8_t>(), 0);
  gate->open();
  h2d->synchronize();
  EXPECT_TRUE(d2h->query());
  EXPECT_TRUE(same_bytes(dst, src));  // it read what the D2H wrote, not the 0xAB pattern
}

TEST(ThreadCopyEngineTest, BatchesOfOneDirectionRunInSubmissionOrder) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/3.0);
  at::Tensor host = host_block(1 << 16);
  std::vector<at::Tensor> srcs;
  std::vector<CopyEventPtr> events;
  // Every batch writes the same host bytes: the last one submitted must win.
  for (int i = 0; i < 8; ++i) {
    srcs.push_back(random_bytes(1 << 16, 300 + i));
    CopyPlan plan;
    plan.host = host;
    plan.items.push_back(CopyItem{srcs.back(), 0});
    events.push_back(engine.submit(CopyDirection::kDeviceToHost, kCpu, plan, {}));
  }
  events.back()->synchronize();
  for (const auto& e : events) EXPECT_TRUE(e->query());
  EXPECT_TRUE(same_bytes(host, srcs.back()));
}

struct ReleaseProbe {
  std::atomic<bool> ran{false};
  std::atomic<bool> copy_done_when_freed{false};
  CopyEventPtr copy;
  std::vector<uint8_t> memory;
};

void probe_deleter(void* ctx) {
  auto* probe = static_cast<ReleaseProbe*>(ctx);
  probe->copy_done_when_freed = probe->copy && probe->copy->query();
  probe->ran = true;
}

TEST(ThreadCopyEngineTest, ReleaseAfterFreesOnlyAfterQueuedCopies) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/5.0);
  auto gate = std::make_shared<Gate>();
  ReleaseProbe probe;
  const int64_t n = 30001;
  at::Tensor pattern = random_bytes(n, 21);
  probe.memory.assign(static_cast<const uint8_t*>(pattern.data_ptr()),
                      static_cast<const uint8_t*>(pattern.data_ptr()) + n);
  at::Tensor device_bytes = at::from_blob(probe.memory.data(), {n}, at::kByte);
  at::Tensor host = host_block(n);
  CopyPlan plan;
  plan.host = host;
  plan.items.push_back(CopyItem{device_bytes, 0});
  probe.copy = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan, {gate});
  device_bytes.reset();
  plan.items.clear();
  engine.release_after(CopyDirection::kDeviceToHost, kCpu,
                       at::DataPtr(probe.memory.data(), &probe, &probe_deleter, kCpu));
  // The copy is held back by the gate, so the memory it reads must still be alive.
  EXPECT_FALSE(probe.ran.load());
  gate->open();
  engine.drain();
  EXPECT_TRUE(probe.ran.load());
  EXPECT_TRUE(probe.copy_done_when_freed.load());
  EXPECT_TRUE(same_bytes(host, pattern));
}

// A reader that saw a batch's event complete and then drops the last tensor of a reload
// target frees its storage then: the finished batch no longer holds it. (The worker had
// dropped a batch's references only after completing its event, so a storage autograd
// released right after its reload lived on for a moment on the worker thread, and the
// saved-activation meter counted it into the next micro-batch's forward: CI, session 26.)
TEST(ThreadCopyEngineTest, ACompletedBatchHoldsNoReferenceToItsTensors) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/0.5);  // on the worker, not inline
  for (int round = 0; round < 300; ++round) {
    const auto direction =
        round % 2 == 0 ? CopyDirection::kHostToDevice : CopyDirection::kDeviceToHost;
    at::Tensor target = random_bytes(4096, 100 + round);
    at::Tensor host = host_block(4096);
    CopyEventPtr done;
    {
      CopyPlan plan;
      plan.host = host;
      plan.items.push_back(CopyItem{target, 0});
      done = engine.submit(direction, kCpu, plan, {});
    }
    while (!done->query()) {
      // spin: look the moment the event completes
    }
    ASSERT_EQ(target.use_count(), 1) << "round " << round << ": the engine still holds the "
                                     << (direction == CopyDirection::kHostToDevice
                                             ? "reload target" : "device bytes");
    ASSERT_EQ(host.use_count(), 1) << "round " << round
                                   << ": the engine still holds the host block";
  }
}

TEST(ThreadCopyEngineTest, ReleaseAfterWithNothingQueuedFreesPromptly) {
  ThreadCopyEngine engine;
  ReleaseProbe probe;
  probe.memory.resize(8);
  engine.release_after(CopyDirection::kHostToDevice, kCpu,
                       at::DataPtr(probe.memory.data(), &probe, &probe_deleter, kCpu));
  engine.drain();
  EXPECT_TRUE(probe.ran.load());
}

TEST(ThreadCopyEngineTest, EmptyPlanCompletes) {
  ThreadCopyEngine engine(/*delay_ns_per_byte=*/10.0);
  CopyPlan plan;
  plan.host = host_block(16);
  auto e = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan, {});
  e->synchronize();
  EXPECT_TRUE(e->query());
  EXPECT_EQ(engine.transfers_issued(), 0);
}

TEST(ThreadCopyEngineTest, DestructorFinishesQueuedWork) {
  at::Tensor src = random_bytes(1 << 15, 3);
  at::Tensor host = host_block(1 << 15);
  ReleaseProbe probe;
  probe.memory.resize(4);
  CopyEventPtr e;
  {
    ThreadCopyEngine engine(/*delay_ns_per_byte=*/20.0);
    CopyPlan plan;
    plan.host = host;
    plan.items.push_back(CopyItem{src, 0});
    e = engine.submit(CopyDirection::kDeviceToHost, kCpu, plan, {});
    probe.copy = e;
    engine.release_after(CopyDirection::kDeviceToHost, kCpu,
                         at::DataPtr(probe.memory.data(), &probe, &probe_deleter, kCpu));
  }
  EXPECT_TRUE(e->query());
  EXPECT_TRUE(same_bytes(host, src));
  EXPECT_TRUE(probe.ran.load());
  EXPECT_TRUE(probe.copy_done_when_freed.load());
}

TEST(ThreadCopyEngineTest, DelayIsAdjustable) {
  ThreadCopyEngine engine(3.5);
  EXPECT_DOUBLE_EQ(engine.delay_ns_per_byte(), 3.5);
  engine.set_delay_ns_per_byte(0.0);
  EXPECT_DOUBLE_EQ(engine.delay_ns_per_byte(), 0.0);
}

}  // namespace
}  // namespace hyper_parallel::activation
