#pragma once
// ThreadCopyEngine: the copy backend for host tensors (SPEC 5, "CPU copy backend").
//
// Each direction has one worker thread that executes batches in submission order, like a
// stream. A batch starts only after the events it was given have completed. Device
// memory handed to release_after() is destroyed by the worker after the batches queued
// before it, so an in-flight copy never reads freed memory. An optional artificial delay
// (nanoseconds per byte) widens every race window in tests. A batch of at most
// kInlineCopyBytes with no delay and nothing to wait for runs on the submitting thread when
// its worker is idle (as save_on_cpu copies inline): waking a worker costs more than such
// a copy (docs/design.md, "Batching").
//
// Thread-safety: all public methods are thread-safe.

#include "hyper_parallel/activation/CopyEngine.h"

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

namespace hyper_parallel::activation {

class ThreadCopyEngine final : public CopyEngine {
 public:
  static constexpr size_t kInlineCopyBytes = size_t{64} << 10;  // 64 KiB

  explicit ThreadCopyEngine(double delay_ns_per_byte = 0.0);
  ~ThreadCopyEngine() override;
  ThreadCopyEngine(const ThreadCopyEngine&) = delete;
  ThreadCopyEngine& operator=(const ThreadCopyEngine&) = delete;

  CopyEventPtr submit(CopyDirection direction, c10::Device device, const CopyPlan& plan,
                      const std::vector<CopyEventPtr>& after) override;
  void release_after(CopyDirection direction, c10::Device device,
                     std::vector<at::DataPtr> memory) override;
  using CopyEngine::release_after;
  void record_use(CopyDirection, c10::Device, const at::DataPtr&) override {}
  bool wants_pinned_host() const override { return false; }
  int64_t transfers_issued() const override { return transfers_.load(); }

  void set_delay_ns_per_byte(double delay) { delay_ns_per_byte_.store(delay); }
  double delay_ns_per_byte() const { return delay_ns_per_byte_.load(); }
  // Blocks until both workers are idle.
  void drain();
  // How many times a post() woke a sleeping worker (both directions; issue 17: at most one
  // per release or prefetch point, none when nothing was queued).
  int64_t wakeups() const { return wakeups_.load(); }
  // Copy batches that ran inline on the submitting thread.
  int64_t inline_copies() const { return inline_copies_.load(); }

 private:
  class Worker;
  std::atomic<int64_t> wakeups_{0};  // declared before the workers, which point at it
  std::unique_ptr<Worker> workers_[2];
  std::atomic<double> delay_ns_per_byte_;
  std::atomic<int64_t> transfers_{0};
  std::atomic<int64_t> inline_copies_{0};
};

}  // namespace hyper_parallel::activation
