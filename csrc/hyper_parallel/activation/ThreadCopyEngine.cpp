#include "hyper_parallel/activation/ThreadCopyEngine.h"

#include "hyper_parallel/common/Macros.h"

#include <chrono>
#include <cstring>

namespace hyper_parallel::activation {

size_t CopyPlan::total_bytes() const {
  size_t n = 0;
  for (const auto& item : items) n += item.device_bytes.nbytes();
  return n;
}

namespace {

class FlagEvent final : public CopyEvent {
 public:
  bool query() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  double synchronize() const override {
    auto start = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    if (done_) return 0.0;
    cv_.wait(lock, [&] { return done_; });
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double block_compute(c10::Device) const override { return synchronize(); }
  void set() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
};

void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

}  // namespace

// One FIFO worker thread: the "stream" of one copy direction.
class ThreadCopyEngine::Worker {
 public:
  Worker() : thread_([this] { run(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
  }
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    idle_cv_.wait(lock, [&] { return tasks_.empty() && !busy_; });
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;  // stop_ and nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
        busy_ = true;
      }
      task();
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy_ = false;
      }
      idle_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  bool busy_ = false;
  std::thread thread_;
};

ThreadCopyEngine::ThreadCopyEngine(double delay_ns_per_byte)
    : delay_ns_per_byte_(delay_ns_per_byte) {
  workers_[0] = std::make_unique<Worker>();
  workers_[1] = std::make_unique<Worker>();
}

ThreadCopyEngine::~ThreadCopyEngine() = default;

CopyEventPtr ThreadCopyEngine::submit(CopyDirection direction, c10::Device device,
                                      const CopyPlan& plan,
                                      const std::vector<CopyEventPtr>& after) {
  HP_INTERNAL_ASSERT(plan.host.defined() && plan.host.is_cpu());
  auto done = std::make_shared<FlagEvent>();
  const bool to_host = direction == CopyDirection::kDeviceToHost;
  transfers_ += plan.fused ? 1 : static_cast<int64_t>(plan.items.size());
  // Raw pointers are taken now: an offloaded storage drops its data pointer right after
  // submit(); the memory itself stays alive until release_after()'s task, queued behind
  // this one, destroys it.
  struct Span { uint8_t* device; size_t host_offset; size_t n; };
  std::vector<Span> spans;
  spans.reserve(plan.items.size());
  for (const auto& item : plan.items) {
    spans.push_back(Span{static_cast<uint8_t*>(item.device_bytes.data_ptr()), item.host_offset,
                         item.device_bytes.nbytes()});
  }
  const size_t total = plan.total_bytes();
  const bool fused = plan.fused;
  workers_[static_cast<int>(direction)]->post(
      [host_tensor = plan.host, spans = std::move(spans), after, done, to_host, total, fused,
       delay = delay_ns_per_byte_.load()]() {
        for (const auto& ev : after) ev->synchronize();
        auto* host = static_cast<uint8_t*>(host_tensor.data_ptr());
        if (fused && !spans.empty()) {
          // Gather (D2H) or scatter (H2D) through one staging buffer: one transfer.
          std::vector<uint8_t> staging(total);
          const size_t base = spans[0].host_offset;
          if (to_host) {
            size_t off = 0;
            for (const auto& s : spans) { copy_bytes(staging.data() + off, s.device, s.n); off += s.n; }
            copy_bytes(host + base, staging.data(), total);
          } else {
            copy_bytes(staging.data(), host + base, total);
            size_t off = 0;
            for (const auto& s : spans) { copy_bytes(s.device, staging.data() + off, s.n); off += s.n; }
          }
        } else {
          for (const auto& s : spans) {
            if (to_host) copy_bytes(host + s.host_offset, s.device, s.n);
            else copy_bytes(s.device, host + s.host_offset, s.n);
          }
        }
        if (delay > 0.0 && total > 0) {
          std::this_thread::sleep_for(
              std::chrono::nanoseconds(static_cast<int64_t>(delay * static_cast<double>(total))));
        }
        done->set();
      });
  return done;
}

void ThreadCopyEngine::release_after(CopyDirection direction, c10::Device,
                                     at::DataPtr memory) {
  // DataPtr is move-only; std::function needs copyable callables, so box it.
  auto boxed = std::make_shared<at::DataPtr>(std::move(memory));
  workers_[static_cast<int>(direction)]->post([boxed]() { boxed->clear(); });
}

void ThreadCopyEngine::drain() {
  workers_[0]->drain();
  workers_[1]->drain();
}

}  // namespace hyper_parallel::activation
