#include "hyper_parallel/activation/ThreadCopyEngine.h"

#include "hyper_parallel/activation/Trace.h"

#include "hyper_parallel/common/Macros.h"

#include <algorithm>
#include <atomic>
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
  bool query() const override { return done_.load(std::memory_order_acquire); }
  double synchronize() const override {
    if (query()) return 0.0;
    auto start = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    ++waiters_;
    cv_.wait(lock, [&] { return done_.load(std::memory_order_acquire); });
    --waiters_;
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  double block_compute(c10::Device) const override { return synchronize(); }
  bool interval(int64_t& start_ns, int64_t& end_ns) const override {
    start_ns = start_ns_.load();
    end_ns = end_ns_.load();
    return query() && start_ns != 0;
  }
  void stamp_start() { start_ns_.store(trace_now_ns()); }  // the worker began the batch
  void set() {
    end_ns_.store(trace_now_ns());
    bool notify;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_.store(true, std::memory_order_release);
      notify = waiters_ > 0;
    }
    if (notify) cv_.notify_all();
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  mutable int waiters_ = 0;
  std::atomic<bool> done_{false};
  std::atomic<int64_t> start_ns_{0}, end_ns_{0};
};

void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

}  // namespace

// One FIFO worker thread: the "stream" of one copy direction.
class ThreadCopyEngine::Worker {
 public:
  explicit Worker(std::atomic<int64_t>* wakeups) : wakeups_(wakeups), thread_([this] { run(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // Wakes the worker only if it sleeps, and at most once per sleep: the poster that wakes
  // it clears `sleeping_`, so a release point that posts a copy and then the memory to
  // free after it signals once (issue 17: one wake-up per release point).
  //
  // `may_run_inline`: the task needs no wait and no delay, so when the worker is idle with
  // nothing queued it runs right here, under the worker's lock (so nothing posted meanwhile
  // can overtake it): no wake-up, no hand-off, and no wait for it later. Returns whether
  // it ran inline.
  bool post(std::function<void()> task, bool may_run_inline = false) {
    bool wake;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (may_run_inline && tasks_.empty() && !busy_) {
        task();
        return true;
      }
      tasks_.push_back(std::move(task));
      wake = sleeping_;
      sleeping_ = false;
    }
    if (wake) {
      wakeups_->fetch_add(1, std::memory_order_relaxed);
      cv_.notify_one();
    }
    return false;
  }
  void drain() {
    std::unique_lock<std::mutex> lock(mu_);
    ++drainers_;
    idle_cv_.wait(lock, [&] { return tasks_.empty() && !busy_; });
    --drainers_;
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        while (!stop_ && tasks_.empty()) {
          sleeping_ = true;  // (again after a spurious wake-up)
          cv_.wait(lock);
        }
        sleeping_ = false;
        if (tasks_.empty()) return;  // stop_ and nothing left
        task = std::move(tasks_.front());
        tasks_.pop_front();
        busy_ = true;
      }
      task();
      bool notify;
      {
        std::lock_guard<std::mutex> lock(mu_);
        busy_ = false;
        notify = drainers_ > 0;
      }
      if (notify) idle_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::condition_variable idle_cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  bool busy_ = false;
  bool sleeping_ = false;
  int drainers_ = 0;
  std::atomic<int64_t>* wakeups_;  // the engine's counter (outlives the worker)
  std::thread thread_;
};

ThreadCopyEngine::ThreadCopyEngine(double delay_ns_per_byte)
    : delay_ns_per_byte_(delay_ns_per_byte) {
  workers_[0] = std::make_unique<Worker>(&wakeups_);
  workers_[1] = std::make_unique<Worker>(&wakeups_);
}

ThreadCopyEngine::~ThreadCopyEngine() = default;

CopyEventPtr ThreadCopyEngine::submit(CopyDirection direction, c10::Device device,
                                      const CopyPlan& plan,
                                      const std::vector<CopyEventPtr>& after) {
  auto done = std::make_shared<FlagEvent>();
  const bool to_host = direction == CopyDirection::kDeviceToHost;
  transfers_ += plan.fused ? 1 : static_cast<int64_t>(plan.items.size());
  // Raw pointers are taken now: an offloaded storage drops its data pointer right after
  // submit(); the memory itself stays alive until release_after()'s task, queued behind
  // this one, destroys it. The task keeps the host blocks alive.
  // A reload task also keeps its target storages alive (`keep`): a reload target must not
  // be freed (its last tensor dropped) while the worker still writes into it. On an
  // accelerator record_use() gives the same guarantee through the caching allocator.
  struct Span { uint8_t* device; uint8_t* host; size_t n; };
  std::vector<Span> spans;
  std::vector<at::Tensor> hosts;
  std::vector<at::Tensor> keep;
  spans.reserve(plan.items.size());
  keep.reserve(plan.items.size());
  for (const auto& item : plan.items) {
    if (!to_host) keep.push_back(item.device_bytes);
    const at::Tensor& host = plan.host_of(item);
    HP_INTERNAL_ASSERT(host.defined() && host.is_cpu());
    spans.push_back(Span{static_cast<uint8_t*>(item.device_bytes.data_ptr()),
                         static_cast<uint8_t*>(host.data_ptr()) + item.host_offset,
                         item.device_bytes.nbytes()});
    if (hosts.empty() || !hosts.back().is_same(host)) hosts.push_back(host);
  }
  const size_t total = plan.total_bytes();
  const double delay_now = delay_ns_per_byte_.load();
  // A small batch with nothing to wait for costs less to copy here than to hand to the
  // worker (a futex wake-up, then the reader's wait): it runs inline when the worker idles.
  const bool small = total <= kInlineCopyBytes && delay_now == 0.0 &&
                     std::all_of(after.begin(), after.end(),
                                 [](const CopyEventPtr& e) { return e->query(); });
  const bool ran_inline = workers_[static_cast<int>(direction)]->post(
      [hosts = std::move(hosts), keep = std::move(keep), spans = std::move(spans),
       after = after, done, to_host, total, delay = delay_now]() mutable {
        for (const auto& ev : after) ev->synchronize();
        done->stamp_start();
        // The artificial link delay comes BEFORE the bytes move: a reader that does not
        // wait for `done` then sees bytes that are not there yet, and memory freed or
        // reused before its D2H ran is read too late, so a missing wait in the protocol
        // shows up as wrong values in the race tests (issue 18.5).
        if (delay > 0.0 && total > 0) {
          std::this_thread::sleep_for(
              std::chrono::nanoseconds(static_cast<int64_t>(delay * static_cast<double>(total))));
        }
        // On the host a fused bucket needs no staging buffer: there is no DMA launch to
        // amortise, so the spans go straight to their offsets in the block (the bucket
        // still counts as one transfer).
        for (const auto& s : spans) {
          if (to_host) copy_bytes(s.host, s.device, s.n);
          else copy_bytes(s.device, s.host, s.n);
        }
        // The batch's references go before its event completes: a reader that waited for
        // it and then drops the last tensor of a reload target frees that storage there,
        // not later on this thread (the saved-activation meter had counted a reloaded
        // storage autograd had released, still held by the finished task, into the next
        // micro-batch's forward: CI, test_memory.py, 20 480 B read for 14 336 B).
        keep.clear();
        hosts.clear();
        after.clear();
        done->set();
      },
      small);
  if (ran_inline) inline_copies_.fetch_add(1, std::memory_order_relaxed);
  return done;
}

void ThreadCopyEngine::release_after(CopyDirection direction, c10::Device,
                                     std::vector<at::DataPtr> memory) {
  if (memory.empty()) return;
  // DataPtr is move-only; std::function needs copyable callables, so box the batch.
  auto boxed = std::make_shared<std::vector<at::DataPtr>>(std::move(memory));
  // Inline when the worker idles: the copies queued before this release are done then.
  workers_[static_cast<int>(direction)]->post([boxed]() { boxed->clear(); },
                                              /*may_run_inline=*/true);
}

void ThreadCopyEngine::drain() {
  workers_[0]->drain();
  workers_[1]->drain();
}

}  // namespace hyper_parallel::activation
