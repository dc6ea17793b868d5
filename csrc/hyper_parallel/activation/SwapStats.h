#pragma once
// Counters of SPEC section 6. Updated with atomics so that destructors (which may run
// on any thread, outside the engine lock) can adjust them.

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>

namespace hyper_parallel::activation {

// Why a saved tensor was not offloaded (SwapManager().stats()["skipped"]). Counted once per
// storage and layer invocation at pack time (the first group of reasons) or at the start
// of the invocation's backward (kInUseElsewhere, kLastLayer: the storage never left).
enum class SkipReason : uint8_t {
  kParameter = 0,          // a leaf that requires grad, a view of one, or any nn.Parameter
  kBuffer,                 // the region module's own buffer
  kHostTensor,             // already in host memory, CPU swap off
  kForeignStorage,         // not resizable / no allocator / IPC (from_blob, DLPack)
  kCopyOnWrite,            // copy-on-write storage
  kEmptyStorage,           // 0 bytes
  kNoStorage,              // sparse, nested, mkldnn
  kMetaOrFake,             // meta or fake tensor
  kSubclassOrFunctional,   // Python subclass (not a DTensor) or functional tensor
  kUnsupportedDevice,      // a device without a registered backend
  kKeptByPolicy,           // the swap policy_fn returned MUST_SAVE
  kInUseElsewhere,         // released, but still referenced outside the engine at backward
  kLastLayer,              // the last layer of a chain keeps its activations (SPEC 3)
  kLinkSaturated,          // its offload was still waiting for the link when its backward
                           // began (docs/design.md, "Offload window")
  kSavedBeforeRegistration,  // registered (swap_tensor_wrapper) after an op of the layer had
                             // saved it: autograd holds it as itself, out of the engine's reach
  kHostPoolFull,           // its PinnedMemoryPool(when_full="keep") had no room under its cap
  kCount
};
constexpr size_t kNumSkipReasons = static_cast<size_t>(SkipReason::kCount);
// Stable snake_case name of a reason ("parameter", "host_tensor", ...).
const char* to_string(SkipReason reason);

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
  std::atomic<int64_t> release_points{0};       // end_forward / launch_offload calls
  std::atomic<int64_t> prefetch_points{0};      // backward_begin / launch_load calls
  std::array<std::atomic<int64_t>, kNumSkipReasons> skipped_bytes{};  // storage bytes
  std::array<std::atomic<int64_t>, kNumSkipReasons> skipped_count{};  // storages

  void add_skipped(SkipReason reason, int64_t nbytes) {
    skipped_bytes[static_cast<size_t>(reason)] += nbytes;
    skipped_count[static_cast<size_t>(reason)] += 1;
  }
  // Takes back one add_skipped() (a storage counted kept that a later release moved).
  void remove_skipped(SkipReason reason, int64_t nbytes) {
    skipped_bytes[static_cast<size_t>(reason)] -= nbytes;
    skipped_count[static_cast<size_t>(reason)] -= 1;
  }

  void add_resident(int64_t delta) {
    const int64_t now = resident_bytes.fetch_add(delta) + delta;
    int64_t peak = peak_resident_bytes.load();
    while (now > peak && !peak_resident_bytes.compare_exchange_weak(peak, now)) {
    }
  }
  void reset() {
    for (auto* c : {&offload_bytes, &offload_count, &reload_bytes, &reload_count, &fused_copies,
                    &transfers,
                    &on_demand_reloads, &stall_nanoseconds, &deferred_frees, &release_points,
                    &prefetch_points}) {
      c->store(0);
    }
    for (size_t i = 0; i < kNumSkipReasons; ++i) {
      skipped_bytes[i].store(0);
      skipped_count[i].store(0);
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
  // Release / prefetch points, and the copy workers' wake-ups (CPU backend) since reset.
  int64_t release_points = 0, prefetch_points = 0, worker_wakeups = 0, inline_copies = 0;
  double stall_seconds = 0.0;
  int64_t live_records = 0;
  // Invocations whose D2H copies occupy the offload window now (docs/design.md, "Offload
  // window"), and how many of them have every copy complete but were not yet retired.
  int64_t window_in_flight = 0, window_complete = 0;
  std::array<int64_t, kNumSkipReasons> skipped_bytes{}, skipped_count{};
};

}  // namespace hyper_parallel::activation
