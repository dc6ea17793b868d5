#include "hyper_parallel/activation/Trace.h"

#include "hyper_parallel/common/Macros.h"

#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <thread>

namespace hyper_parallel::activation {

namespace {

int64_t thread_key() {
  return static_cast<int64_t>(std::hash<std::thread::id>{}(std::this_thread::get_id()) & 0x7fffffff);
}

c10::Stream current_stream(c10::Device device) {
  return c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
}

std::shared_ptr<c10::Event> record_timing_event(c10::Device device) {
  auto event = std::make_shared<c10::Event>(device.type(), c10::EventFlag::BACKEND_DEFAULT);
  event->record(current_stream(device));
  return event;
}

}  // namespace

int64_t trace_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

Trace& Trace::global() {
  static Trace* trace = new Trace();  // leaked: copies may complete after exit starts
  return *trace;
}

void Trace::start() {
  std::lock_guard<std::mutex> lock(mu_);
  HP_CHECK(!on_.load(), "an activation trace is already recording; end it (leave its "
           "`with hyper_parallel.activation_trace(...)` block) before starting another.");
  items_.clear();
  copies_.clear();
  waits_.clear();
  references_.clear();
  on_.store(true);
}

void Trace::ensure_reference(c10::Device device) {
  std::lock_guard<std::mutex> lock(mu_);
  auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  if (references_.count(key) != 0) return;
  // A timing event on the idle-after-sync compute stream: its completion is "now" on the
  // host clock, the origin of every device timestamp of this device.
  auto event = record_timing_event(device);
  event->synchronize();
  references_.emplace(key, Reference{std::move(event), trace_now_ns()});
}

bool Trace::host_time_of(c10::Device device, const c10::Event& event, int64_t& ns) {
  std::shared_ptr<c10::Event> ref;
  int64_t ref_ns = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = references_.find({static_cast<int>(device.type()), static_cast<int>(device.index())});
    if (it == references_.end()) return false;
    ref = it->second.event;
    ref_ns = it->second.host_ns;
  }
  event.synchronize();
  ns = ref_ns + static_cast<int64_t>(ref->elapsedTime(event) * 1e6);
  return true;
}

void Trace::copy(CopyDirection direction, c10::Device device, const std::string& label,
                 int64_t bytes, int64_t count, int64_t enqueue_ns, CopyEventPtr done) {
  if (!on()) return;
  TraceItem item;
  item.kind = "copy";
  item.label = label;
  item.stream = direction == CopyDirection::kDeviceToHost ? "d2h" : "h2d";
  item.device = device.index();
  item.bytes = bytes;
  item.count = count;
  item.enqueue_ns = enqueue_ns;
  item.thread = thread_key();
  std::lock_guard<std::mutex> lock(mu_);
  copies_.push_back(PendingCopy{std::move(item), std::move(done)});
}

double Trace::timed_wait(c10::Device device, const std::string& label,
                         const std::function<double()>& wait) {
  RECORD_USER_SCOPE("hyper_parallel::wait_reload");
  if (!on()) return wait();
  TraceItem item;
  item.kind = "wait";
  item.label = label;
  item.stream = "compute";
  item.device = device.index();
  item.thread = thread_key();
  item.enqueue_ns = trace_now_ns();
  if (device.is_cpu()) {
    const double waited = wait();
    item.start_ns = item.enqueue_ns;
    item.end_ns = trace_now_ns();
    std::lock_guard<std::mutex> lock(mu_);
    items_.push_back(std::move(item));
    return waited;
  }
  ensure_reference(device);
  auto before = record_timing_event(device);
  const double waited = wait();
  auto after = record_timing_event(device);
  std::lock_guard<std::mutex> lock(mu_);
  waits_.push_back(PendingWait{std::move(item), std::move(before), std::move(after)});
  return waited;
}

void Trace::instant(const char* kind, c10::Device device, const std::string& label,
                    int64_t bytes, int64_t count) {
  if (!on()) return;
  TraceItem item;
  item.kind = kind;
  item.label = label;
  item.stream = "host";
  item.device = device.index();
  item.bytes = bytes;
  item.count = count;
  item.thread = thread_key();
  item.enqueue_ns = item.start_ns = item.end_ns = trace_now_ns();
  std::lock_guard<std::mutex> lock(mu_);
  items_.push_back(std::move(item));
}

void Trace::range(const char* kind, const std::string& label, int64_t start_ns, int64_t end_ns) {
  if (!on()) return;
  TraceItem item;
  item.kind = kind;
  item.label = label;
  item.stream = "host";
  item.thread = thread_key();
  item.enqueue_ns = item.start_ns = start_ns;
  item.end_ns = end_ns;
  std::lock_guard<std::mutex> lock(mu_);
  items_.push_back(std::move(item));
}

void Trace::backward_begin(const std::string& label) {
  if (!on()) return;
  const int64_t now = trace_now_ns();
  range("backward", label, now, -1);  // end resolved at stop()
}

std::vector<TraceItem> Trace::stop() {
  std::vector<TraceItem> items;
  std::vector<PendingCopy> copies;
  std::vector<PendingWait> waits;
  {
    std::lock_guard<std::mutex> lock(mu_);
    on_.store(false);
    items.swap(items_);
    copies.swap(copies_);
    waits.swap(waits_);
  }
  const int64_t stop_ns = trace_now_ns();
  for (auto& c : copies) {
    c.done->synchronize();
    int64_t s = 0, e = 0;
    if (!c.done->interval(s, e)) s = e = c.item.enqueue_ns;
    c.item.start_ns = s;
    c.item.end_ns = e;
    items.push_back(std::move(c.item));
  }
  for (auto& w : waits) {
    const c10::Device device(w.before->device_type(), static_cast<c10::DeviceIndex>(w.item.device));
    int64_t s = w.item.enqueue_ns, e = w.item.enqueue_ns;
    host_time_of(device, *w.before, s);
    host_time_of(device, *w.after, e);
    w.item.start_ns = s;
    w.item.end_ns = std::max(s, e);
    items.push_back(std::move(w.item));
  }
  // A backward range ends where the next one on its thread begins.
  std::vector<TraceItem*> backward;
  for (auto& it : items) {
    if (it.kind == "backward") backward.push_back(&it);
  }
  std::sort(backward.begin(), backward.end(), [](const TraceItem* a, const TraceItem* b) {
    return a->thread != b->thread ? a->thread < b->thread : a->start_ns < b->start_ns;
  });
  for (size_t i = 0; i < backward.size(); ++i) {
    const bool last = i + 1 == backward.size() || backward[i + 1]->thread != backward[i]->thread;
    backward[i]->end_ns = last ? stop_ns : backward[i + 1]->start_ns;
  }
  std::sort(items.begin(), items.end(),
            [](const TraceItem& a, const TraceItem& b) { return a.start_ns < b.start_ns; });
  {
    std::lock_guard<std::mutex> lock(mu_);
    references_.clear();
  }
  return items;
}

}  // namespace hyper_parallel::activation
