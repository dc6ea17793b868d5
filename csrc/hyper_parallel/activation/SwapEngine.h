#pragma once
// SwapEngine: the runtime behind SwapManager (SPEC 2, 3, 5, 6).
//
// Owns the alias registry, the layer schedule, the live invocations (groups), the copy
// engines (accelerator streams, or the worker-thread backend for host tensors), the host
// buffer pools and the statistics. Python only calls in from its hooks:
//
//   begin_forward(layer)      a region (layer invocation) starts; it becomes current
//   pack(tensor, mode)        saved-tensor pack hook -> SavedHandle or null (pass through)
//   register_tensor(tensor)   swap_tensor_wrapper: add a storage to the current group
//   end_forward(group)        the region ended: release per schedule, retry deferred frees
//   abort_forward(group)      the region raised: unlink, keep everything on device
//   backward_begin(group)     first gradient reached the region: prefetch (SPEC 3)
//   unpack(handle)            saved-tensor unpack hook: reload/wait, version check
//
// A record leaves the device ("release") only when (1) every live group holding it has
// released it, and (2) no one but hyper_parallel's own handles references its storage
// (use count == alias_refs). (2) is how a storage that a later forward consumer still
// needs (layer output, skip connection, shared input) stays on device: the free is
// deferred and retried at the next release point. See docs/design.md.
//
// Who may release a storage (docs/design.md, "Who may release a storage"): a storage
// leaves the device only at a release point of the thread that ran the forward of its
// invocation (its end of forward, or a later end of forward on that thread for a deferred
// release), or by launch_offload of its manual group, and never once the backward of any
// invocation holding it has begun or autograd was handed it by unpack().
//
// Thread-safety: every public method is thread-safe. One engine mutex guards registry,
// groups and schedule; no copy runs and no host wait happens under it.
//
// fork(): the process-wide engine registers pthread_atfork handlers. Before a fork the
// copy queues are drained under the engine lock, so the child inherits no copy in flight;
// in the child the worker threads (which do not exist there) are abandoned and created
// anew on first use (SPEC 4.6: "the next step behaves as in a fresh process").
//
// Debug checks (HYPER_PARALLEL_DEBUG_CHECKS=1, or set_debug_checks): every release
// verifies that each holder finished its forward and has not begun its backward, and
// every unpack verifies the storage handed to autograd is resident, so a broken rule fails
// loudly where it is broken instead of as a wrong read later.

#include "hyper_parallel/activation/AcceleratorCopyEngine.h"
#include "hyper_parallel/activation/AliasRegistry.h"
#include "hyper_parallel/activation/HostBufferPool.h"
#include "hyper_parallel/activation/SavedHandle.h"
#include "hyper_parallel/activation/Schedule.h"
#include "hyper_parallel/activation/SwapGroup.h"
#include "hyper_parallel/activation/SwapStats.h"
#include "hyper_parallel/activation/ThreadCopyEngine.h"

#include <atomic>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace hyper_parallel::activation {

struct SwapEngineOptions {
  bool cpu_swap = false;                        // swap host tensors through the thread backend
  double cpu_delay_ns_per_byte = 0.0;           // artificial delay of the thread backend
  int prefetch_depth = 1;                       // layers reloaded ahead in backward
  size_t fusion_threshold_bytes = size_t{32} << 20;  // group_swap: bucket limit (32 MiB)
  // Invocations whose D2H copies may be in flight at once; the offloads of later releases
  // wait in a queue, and those still waiting when their backward begins stay on device
  // (docs/design.md, "Offload window"). 0: no limit (every release submits at once).
  int offload_window = 2;
};

class SwapEngine {
 public:
  explicit SwapEngine(SwapEngineOptions options = {});
  ~SwapEngine();
  SwapEngine(const SwapEngine&) = delete;
  SwapEngine& operator=(const SwapEngine&) = delete;

  // The process-wide engine (never destroyed, so hooks running at exit stay valid).
  static SwapEngine& global();

  // --- configuration -------------------------------------------------------------
  void set_cpu_swap(bool enabled);
  bool cpu_swap() const;
  void set_cpu_delay_ns_per_byte(double delay);
  void set_prefetch_depth(int depth);   // >= 0; throws c10::Error otherwise
  int prefetch_depth() const;
  void set_fusion_threshold(int64_t bytes);  // > 0
  int64_t fusion_threshold() const;
  void set_offload_window(int groups);  // >= 0; throws c10::ValueError otherwise
  int offload_window() const;
  void set_debug_checks(bool enabled);
  bool debug_checks() const;
  // Fault injection for the race tests, never for production: with `skip` on, unpack
  // does not order the compute stream after a reload's H2D copy. The race tests turn it
  // on to prove they fail when that wait is missing (issue 18.5).
  void set_skip_reload_wait(bool skip);

  // --- layer graph ---------------------------------------------------------------
  int64_t new_layer();
  void link_layers(int64_t prev, int64_t next);
  void remove_layer(int64_t layer);
  bool layer_scheduled(int64_t layer) const;

  // --- invocations -----------------------------------------------------------------
  // Starts an invocation of `layer` (-1: none) and pushes it as the current group of
  // this thread. `manual`: released only by launch_offload (group_context).
  std::shared_ptr<SwapGroup> begin_forward(int64_t layer, const std::string& name, bool manual,
                                           bool group_swap);
  // Pops `group` and applies the schedule. Returns true when the group is unscheduled
  // and holds records (the caller may warn that there is no overlap).
  bool end_forward(const std::shared_ptr<SwapGroup>& group);
  void abort_forward(const std::shared_ptr<SwapGroup>& group);
  // The region of `group` was dropped without ending (any thread): marks it abandoned, so
  // its thread's stack entry is pruned, and unlinks it if its forward had not finished.
  void abandon_forward(const std::shared_ptr<SwapGroup>& group);
  void backward_begin(const std::shared_ptr<SwapGroup>& group);
  // The invocations whose reload backward_begin(group) starts: `group` itself, then up to
  // prefetch_depth predecessors, nearest first (SPEC 3). For backends that keep their
  // tensors outside the engine and move them themselves (docs/design.md, "Backends").
  std::vector<std::shared_ptr<SwapGroup>> prefetch_targets(
      const std::shared_ptr<SwapGroup>& group) const;
  // Current group of this thread, or null.
  std::shared_ptr<SwapGroup> current_group() const;
  std::shared_ptr<SwapGroup> find_group(const std::string& name) const;
  // Whether a group was ever created under `name` (it may have died since).
  bool knows_group(const std::string& name) const;
  // Drops the name `name` (and the engine's hold on a manual group of that name): later
  // lookups of it fail as for a name never used. Its records stay where they are.
  void forget_group(const std::string& name);
  // How many named groups are alive (their saved tensors or a manual hold keep them).
  int64_t live_group_count() const;
  // Makes `group` findable under its (new) name.
  void name_group(const std::shared_ptr<SwapGroup>& group);

  // --- saved tensors -----------------------------------------------------------------
  // Null when `t` passes through (ineligible, excluded, or mode kRegisteredOnly and the
  // storage is not registered in the group).
  std::shared_ptr<SavedHandle> pack(const std::shared_ptr<SwapGroup>& group, const at::Tensor& t,
                                    PackMode mode);
  // Registers `t`'s storage with `group` (swap_tensor_wrapper). Returns false when `t` is
  // not eligible.
  bool register_tensor(const std::shared_ptr<SwapGroup>& group, const at::Tensor& t);
  // Counts `t`'s storage as not offloaded for `reason` in the statistics and in `group`
  // (once per storage and group). pack() and register_tensor() count ineligible tensors
  // themselves; callers use this for decisions made outside the engine (kKeptByPolicy).
  void count_skipped(const std::shared_ptr<SwapGroup>& group, const at::Tensor& t,
                     SkipReason reason);
  // Makes the handle's storage resident and returns its tensor. Throws c10::Error when the
  // tensor was modified in place after it was saved or registered (SPEC 4.7).
  at::Tensor unpack(const SavedHandle& handle);
  // unpack() when it needs no wait: the storage is on device or its reload completed.
  // Otherwise returns an undefined tensor and changes nothing, so the caller may release
  // the GIL before the blocking unpack() (the unpack hook's fast path, issue 17).
  at::Tensor try_unpack(const SavedHandle& handle);

  // --- manual group control (SPEC 2: launch/wait offload/load) -------------------------
  void launch_offload(const std::shared_ptr<SwapGroup>& group);
  void wait_offload(const std::shared_ptr<SwapGroup>& group);
  void launch_load(const std::shared_ptr<SwapGroup>& group);
  void wait_load(const std::shared_ptr<SwapGroup>& group);

  // --- observability -----------------------------------------------------------------
  SwapStats stats();
  // Clears counters; with `schedule`, also forgets layer links and live-invocation links.
  void reset(bool schedule);
  // Waits for every queued copy of the thread backend (tests).
  void synchronize();
  // The one-time warning of each pool made to keep on the device what does not fit under
  // its cap (PinnedMemoryPool(when_full="keep")) that a release met full since the last
  // call, the first time it was met full; empty otherwise (the bindings turn each into a
  // Python UserWarning after each release point). Thread-safe.
  std::vector<std::string> take_pool_warnings();
  // Whether take_pool_warnings() may have something to say (one relaxed atomic load).
  bool pool_warning_pending() const {
    return pool_warning_pending_.load(std::memory_order_relaxed);
  }
  // Residency of the record of `t`'s storage, or nullptr when it is not managed.
  const char* residency_of(const at::Tensor& t) const;
  // Layers known to the schedule (linked or with invocations waiting to be linked).
  int64_t scheduled_layer_count() const;
  // Live groups on this thread's current-group stack of `engine` (tests).
  static size_t thread_region_count(const SwapEngine* engine);
  // Incremented by reset(true): regions begun in an older generation are no longer current
  // on any thread.
  static uint64_t generation();

  // fork() support (see above); called by the pthread_atfork handlers of global().
  void prepare_fork();
  void parent_after_fork();
  void child_after_fork();

 private:
  struct Batch;
  CopyEngine& engine_for(c10::Device device);
  HostBufferPool& pool_for(c10::Device device);
  // All under mu_:
  void release_locked(const std::shared_ptr<SwapGroup>& group);
  void try_offload_locked(std::vector<std::shared_ptr<StorageRecord>> candidates, bool fuse);
  void offload_batch_locked(const std::vector<std::shared_ptr<StorageRecord>>& records,
                            const std::vector<c10::Storage>& storages, bool fused);
  // offload_batch_locked() once every block is held (one per record, or one for a fused
  // bucket of `total` bytes): one submit, then the storages are freed.
  void offload_blocks_locked(const std::vector<std::shared_ptr<StorageRecord>>& records,
                             const std::vector<c10::Storage>& storages, bool fused,
                             c10::Device device, CopyEngine& engine,
                             std::vector<std::shared_ptr<HostBlock>> blocks, size_t total);
  // Reloads `record` (with its fused bucket, if any).
  void reload_locked(const std::shared_ptr<StorageRecord>& record);
  // Reloads `records` (offloaded, one device) with one submit; fused iff they are exactly
  // one complete bucket.
  void reload_batch_locked(const std::vector<std::shared_ptr<StorageRecord>>& records);
  void load_group_locked(const std::shared_ptr<SwapGroup>& group);
  // Retries the releases deferred by this thread's earlier release points.
  void retry_deferred_locked();
  // At the end of `ending`'s forward: submits the offloads queued by this thread's release
  // points while fewer than offload_window invocations have D2H copies in flight, except at
  // the last two layers of a chain, where nothing waiting is submitted (docs/design.md,
  // "Offload window").
  void pump_offloads_locked(const SwapGroup& ending);
  // Debug checks of a release (see above).
  void check_release_locked(const StorageRecord& record) const;
  bool in_use_elsewhere(const StorageRecord& record, const c10::Storage& storage) const;
  // Internal error unless the alias's storage is resident (SPEC 4.2).
  void check_resident(const StorageRecord& record, const at::Tensor& alias) const;
  void count_skipped_locked(SwapGroup* group, const void* key, size_t nbytes,
                            SkipReason reason);
  // At the start of `group`'s backward: counts its records still on device (kept because
  // still referenced elsewhere, or because it is the last layer of a chain).
  void count_kept_locked(const SwapGroup& group);

  mutable std::mutex mu_;
  SwapEngineOptions options_;
  std::shared_ptr<SwapStatsCounters> counters_;
  AliasRegistry registry_;
  Schedule schedule_;
  std::unordered_map<std::string, std::weak_ptr<SwapGroup>> named_;
  // Manual groups (group_context) are driven by the user by name, so the engine keeps the
  // latest one of each name alive until its launch_offload (then its saved tensors own
  // it), until it is replaced, or until reset().
  std::unordered_map<std::string, std::shared_ptr<SwapGroup>> manual_;
  // Releases postponed because the storage was still referenced, per forward thread: only
  // that thread's later release points retry them (never another thread's forward).
  std::unordered_map<std::thread::id, std::vector<std::weak_ptr<StorageRecord>>> deferred_;
  // Released invocations whose offload waits for the window, per forward thread, oldest
  // first (only that thread's release points submit them, as for deferred_). A thread's
  // emptied queue is kept for its next release point; empty queues are dropped once there
  // are more than kMaxIdleOffloadQueues (threads that are gone).
  std::unordered_map<std::thread::id, std::deque<std::weak_ptr<SwapGroup>>> pending_offloads_;
  static constexpr size_t kMaxIdleOffloadQueues = 64;
  // D2H events of the invocations submitted through the window that may be in flight.
  std::deque<std::vector<CopyEventPtr>> offloads_in_flight_;
  std::vector<CopyEventPtr>* collect_d2h_ = nullptr;  // set while the pump submits a group
  // The pools that refused under a keep_when_full cap since take_pool_warnings().
  std::vector<std::weak_ptr<HostBufferPool>> refused_pools_;
  std::atomic<bool> pool_warning_pending_{false};
  bool debug_checks_ = false;
  std::atomic<bool> skip_reload_wait_{false};
  int64_t next_group_id_ = 0;
  std::unique_ptr<ThreadCopyEngine> thread_engine_;
  int64_t wakeups_base_ = 0;  // thread_engine_->wakeups() at the last reset (stats)
  int64_t inline_base_ = 0;   // thread_engine_->inline_copies() at the last reset
  std::unique_ptr<AcceleratorCopyEngine> accel_engine_;
  std::shared_ptr<HostBufferPool> pageable_pool_;
  std::shared_ptr<HostBufferPool> pinned_pool_;
};

}  // namespace hyper_parallel::activation
