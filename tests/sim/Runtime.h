#pragma once
// hpsim runtime: a simulated accelerator on the host, for tests only (docs/design.md,
// "Simulated device"). Never part of the installed package.
//
// Model (the facts follow CUDA's stream semantics; the design follows PyTorch's OpenReg
// test backend, written anew and smaller):
//  * kDevices devices. Each has a default stream (id 0), a pool of kPoolStreams streams
//    (ids 1..kPoolStreams, handed out round robin) and streams made by getNewStream
//    (ids above the pool). Every stream is one worker thread running its tasks in FIFO
//    order; the host never runs device work itself.
//  * The current stream is per host thread and per device (default stream until set).
//  * An event is the latest Marker recorded on it: record() queues a task that stamps
//    the time and completes the marker; block() queues a task that waits for the marker
//    recorded before the call (later records do not affect it); query() never blocks.
//  * Device memory is host memory from mmap. With `protect` it is PROT_NONE except while
//    a stream task holds an Access on it, so a host read of device memory crashes.
//
// Thread-safety: every function is thread-safe.

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace hpsim {

constexpr int kDevices = 2;
constexpr int kPoolStreams = 4;

using Clock = std::chrono::steady_clock;

// Test switches (hpsim::configure from Python). Read by stream tasks and the allocator.
struct Config {
  std::atomic<double> link_ns_per_byte{0.0};  // delay of a copy touching pinned host memory
  std::atomic<bool> protect{false};           // PROT_NONE device memory (new blocks only)
  std::atomic<bool> poison{true};             // fill new allocations with 0xFF (NaN) in stream order
  // Debug switches that break the protocol on purpose, so race tests can show they fail:
  std::atomic<bool> honor_record_stream{true};       // allocator obeys recordDataPtrOnStream
  std::atomic<bool> honor_default_stream_waits{true};  // default stream obeys block(event)
};
Config& config();

// Completes once; waiters block on it.
class Marker {
 public:
  void complete();
  bool done() const { return done_.load(std::memory_order_acquire); }
  void wait() const;
  Clock::time_point completed_at() const { return at_; }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::atomic<bool> done_{false};
  Clock::time_point at_{};
};
using MarkerPtr = std::shared_ptr<Marker>;

class Stream {
 public:
  Stream(int device, int64_t id);
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  int device() const { return device_; }
  int64_t id() const { return id_; }
  void enqueue(std::function<void()> task);
  // A marker completed when every task queued so far has run.
  MarkerPtr record();
  // Queues a wait for `marker` (no-op when null or done).
  void wait(MarkerPtr marker);
  bool idle();
  void synchronize();
  // Seconds this stream's worker spent blocked in waits on other streams' markers.
  double wait_seconds() const { return static_cast<double>(wait_ns_.load()) * 1e-9; }
  int64_t tasks_run() const { return tasks_run_.load(); }

 private:
  void run();
  int device_;
  int64_t id_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false;
  std::atomic<int64_t> wait_ns_{0};
  std::atomic<int64_t> tasks_run_{0};
  std::thread worker_;
};

// The stream `id` of `device` (created on first use; never destroyed).
Stream& stream(int device, int64_t id);
int64_t next_pool_stream(int device);
int64_t new_stream(int device);
// All streams of `device` created so far.
std::vector<Stream*> streams_of(int device);

int current_device();
void set_current_device(int device);
int64_t current_stream(int device);
void set_current_stream(int device, int64_t id);
void synchronize_device(int device);

// An event handle (the void* of DeviceGuardImplInterface).
struct Event {
  std::mutex mu;
  MarkerPtr last;
  MarkerPtr latest() {
    std::lock_guard<std::mutex> lock(mu);
    return last;
  }
};

// Sleeps for the simulated link time of `bytes` (link_ns_per_byte).
void link_delay(size_t bytes);

}  // namespace hpsim
