#pragma once
// Trace: the timeline of swap activity (docs/design.md, "Timeline"), recorded by the
// engine while `hyper_parallel.activation_trace(path)` is active.
//
// Items (all times in nanoseconds of std::chrono::steady_clock, as read on the host):
//  * copy:      one submitted batch (offload = D2H or reload = H2D): group label, bytes,
//               storages, stream ("d2h" / "h2d"), host enqueue time, and start / end of the
//               copy itself. On an accelerator start and end come from timing events
//               recorded on the side stream around the batch, placed on the host clock
//               through a reference event per device recorded at trace start; on the
//               thread backend the worker stamps them. Resolved at stop().
//  * wait:      the compute stream waiting for a reload before an unpack reads it: on an
//               accelerator the interval between timing events recorded on the compute
//               stream before and after the wait (the stall as the stream sees it); on
//               the thread backend the host wait.
//  * instant:   free (device memory released in place, bytes), refill (re-allocated in
//               place), on_demand (a reload started by unpack: a schedule hole).
//  * forward:   a layer's forward on the host thread (begin_forward to end_forward).
//  * backward:  a layer's backward began (backward_begin); the range ends at the next
//               backward begin on the same thread, or at stop().
// Each item also opens a torch.profiler range (RECORD_USER_SCOPE "hyper_parallel::...")
// around the host call, so the engine shows up in a user's profiler trace.
//
// Thread-safety: all methods are thread-safe. Cost when off: one relaxed atomic load.

#include "hyper_parallel/activation/CopyEngine.h"

#include <c10/core/Event.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace hyper_parallel::activation {

int64_t trace_now_ns();

struct TraceItem {
  std::string kind;   // copy | wait | free | refill | on_demand | forward | backward
  std::string label;  // group (layer invocation) name
  std::string stream; // d2h | h2d | compute | host
  int64_t device = -1;
  int64_t bytes = 0;
  int64_t count = 0;   // storages in a copy / free / refill
  int64_t enqueue_ns = 0;
  int64_t start_ns = 0;
  int64_t end_ns = 0;  // == start_ns for an instant
  int64_t thread = 0;
};

class Trace {
 public:
  static Trace& global();
  bool on() const { return on_.load(std::memory_order_relaxed); }
  // Clears and starts recording. Throws c10::Error if a trace is already running.
  void start();
  // Stops, waits for the copies it recorded to finish, and returns the items.
  std::vector<TraceItem> stop();

  void copy(CopyDirection direction, c10::Device device, const std::string& label, int64_t bytes,
            int64_t count, int64_t enqueue_ns, CopyEventPtr done);
  // Runs `wait` (which orders the compute stream after a reload) and records it.
  double timed_wait(c10::Device device, const std::string& label,
                    const std::function<double()>& wait);
  void instant(const char* kind, c10::Device device, const std::string& label, int64_t bytes,
               int64_t count);
  void range(const char* kind, const std::string& label, int64_t start_ns, int64_t end_ns);
  void backward_begin(const std::string& label);

  // Records the reference event of `device` (once per trace; a host wait for the device's
  // current stream). Accelerator copy engines call it before recording timing events.
  void ensure_reference(c10::Device device);
  // Host time of `event`'s completion (waits for it), through the device's reference
  // event; false when the trace has no reference for the device.
  bool host_time_of(c10::Device device, const c10::Event& event, int64_t& ns);

 private:
  struct PendingCopy {
    TraceItem item;
    CopyEventPtr done;
  };
  struct PendingWait {
    TraceItem item;
    std::shared_ptr<c10::Event> before, after;
  };
  struct Reference {
    std::shared_ptr<c10::Event> event;
    int64_t host_ns;
  };

  std::atomic<bool> on_{false};
  std::mutex mu_;
  std::vector<TraceItem> items_;
  std::vector<PendingCopy> copies_;
  std::vector<PendingWait> waits_;
  std::map<std::pair<int, int>, Reference> references_;
};

}  // namespace hyper_parallel::activation
