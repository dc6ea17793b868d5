#pragma once
// Counters of SPEC section 6. Updated with atomics so that destructors (which may run
// on any thread, outside the engine lock) can adjust them.

#include <atomic>
#include <cstdint>

namespace hyper_parallel::activation {

struct SwapStatsCounters {
  std::atomic<int64_t> offload_bytes{0};
  std::atomic<int64_t> offload_count{0};
  std::atomic<int64_t> reload_bytes{0};
  std::atomic<int64_t> reload_count{0};
  std::atomic<int64_t> resident_bytes{0};       // managed (swappable) bytes on device now
  std::atomic<int64_t> peak_resident_bytes{0};
  std::atomic<int64_t> fused_copies{0};         // host<->device copies that carried a bucket
  std::atomic<int64_t> transfers{0};            // host<->device copy operations issued
  std::atomic<int64_t> on_demand_reloads{0};    // reloads started by unpack (schedule hole)
  std::atomic<int64_t> stall_nanoseconds{0};    // host time spent waiting for a reload
  std::atomic<int64_t> deferred_frees{0};       // release attempts postponed: storage in use

  void add_resident(int64_t delta) {
    const int64_t now = resident_bytes.fetch_add(delta) + delta;
    int64_t peak = peak_resident_bytes.load();
    while (now > peak && !peak_resident_bytes.compare_exchange_weak(peak, now)) {
    }
  }
  void reset() {
    for (auto* c : {&offload_bytes, &offload_count, &reload_bytes, &reload_count, &fused_copies,
                    &transfers,
                    &on_demand_reloads, &stall_nanoseconds, &deferred_frees}) {
      c->store(0);
    }
    peak_resident_bytes.store(resident_bytes.load());
  }
};

// A plain snapshot, for callers.
struct SwapStats {
  int64_t offload_bytes = 0, offload_count = 0, reload_bytes = 0, reload_count = 0;
  int64_t resident_bytes = 0, peak_resident_bytes = 0;
  int64_t pinned_bytes_in_use = 0, pinned_bytes_cached = 0, host_bytes_pending = 0;
  int64_t host_allocations = 0, host_reuses = 0;
  int64_t fused_copies = 0, transfers = 0, on_demand_reloads = 0, deferred_frees = 0;
  double stall_seconds = 0.0;
  int64_t live_records = 0;
};

}  // namespace hyper_parallel::activation
