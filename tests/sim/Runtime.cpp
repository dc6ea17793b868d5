#include "Runtime.h"

#include <c10/util/Exception.h>

#include <array>
#include <map>

namespace hpsim {

Config& config() {
  static Config* c = new Config();  // leaked: stream workers may read it at exit
  return *c;
}

void Marker::complete() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    at_ = Clock::now();
    done_.store(true, std::memory_order_release);
  }
  cv_.notify_all();
}

void Marker::wait() const {
  if (done()) return;
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done(); });
}

Stream::Stream(int device, int64_t id) : device_(device), id_(id), worker_([this] { run(); }) {
  worker_.detach();  // streams live for the whole process
}

void Stream::enqueue(std::function<void()> task) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }
  cv_.notify_all();
}

MarkerPtr Stream::record() {
  auto marker = std::make_shared<Marker>();
  enqueue([marker] { marker->complete(); });
  return marker;
}

void Stream::wait(MarkerPtr marker) {
  if (!marker || marker->done()) return;
  if (id_ == 0 && !config().honor_default_stream_waits.load()) return;
  enqueue([this, marker] {
    if (marker->done()) return;
    const auto start = Clock::now();
    marker->wait();
    wait_ns_ += std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count();
  });
}

bool Stream::idle() {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.empty() && !busy_;
}

void Stream::synchronize() { record()->wait(); }

void Stream::run() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock<std::mutex> lock(mu_);
      busy_ = false;
      cv_.wait(lock, [this] { return !queue_.empty(); });
      task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
    }
    task();  // tasks do not throw: copies and markers only
    tasks_run_ += 1;
  }
}

namespace {

struct DeviceState {
  std::mutex mu;
  std::map<int64_t, std::unique_ptr<Stream>> streams;
  int64_t next_pool = 0;
  int64_t next_new = kPoolStreams + 1;
};

std::array<DeviceState, kDevices>& devices() {
  static auto* d = new std::array<DeviceState, kDevices>();  // leaked with the streams
  return *d;
}

DeviceState& device_state(int device) {
  TORCH_CHECK(device >= 0 && device < kDevices, "hpsim: device index ", device,
              " out of range (", kDevices, " simulated devices)");
  return devices()[device];
}

thread_local int t_device = 0;
thread_local std::array<int64_t, kDevices> t_stream{};

}  // namespace

Stream& stream(int device, int64_t id) {
  DeviceState& d = device_state(device);
  std::lock_guard<std::mutex> lock(d.mu);
  auto& slot = d.streams[id];
  if (!slot) {
    TORCH_CHECK(id >= 0 && id < d.next_new, "hpsim: unknown stream id ", id, " on device ", device);
    slot = std::make_unique<Stream>(device, id);
  }
  return *slot;
}

int64_t next_pool_stream(int device) {
  DeviceState& d = device_state(device);
  std::lock_guard<std::mutex> lock(d.mu);
  const int64_t id = 1 + d.next_pool;
  d.next_pool = (d.next_pool + 1) % kPoolStreams;
  return id;
}

int64_t new_stream(int device) {
  DeviceState& d = device_state(device);
  std::lock_guard<std::mutex> lock(d.mu);
  return d.next_new++;
}

std::vector<Stream*> streams_of(int device) {
  DeviceState& d = device_state(device);
  std::lock_guard<std::mutex> lock(d.mu);
  std::vector<Stream*> out;
  for (auto& kv : d.streams) out.push_back(kv.second.get());
  return out;
}

int current_device() { return t_device; }
void set_current_device(int device) {
  device_state(device);  // range check
  t_device = device;
}
int64_t current_stream(int device) {
  device_state(device);
  return t_stream[device];
}
void set_current_stream(int device, int64_t id) {
  device_state(device);
  t_stream[device] = id;
}

void synchronize_device(int device) {
  for (Stream* s : streams_of(device)) s->synchronize();
}

void link_delay(size_t bytes) {
  const double ns = config().link_ns_per_byte.load() * static_cast<double>(bytes);
  if (ns <= 0.0) return;
  std::this_thread::sleep_for(std::chrono::nanoseconds(static_cast<int64_t>(ns)));
}

}  // namespace hpsim
