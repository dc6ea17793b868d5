#include "hyper_parallel/activation/SwapEngine.h"

#include "hyper_parallel/activation/Eligibility.h"
#include "hyper_parallel/activation/Trace.h"
#include "hyper_parallel/common/Macros.h"

#include <ATen/core/TensorBody.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/DeviceGuard.h>

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <sstream>
#include <tuple>
#include <unordered_set>

namespace hyper_parallel::activation {

namespace {

// The groups whose forward is running on this thread, innermost last, with the engine
// generation they were begun in: reset() starts a new generation, and entries of an older
// one (or of an abandoned region) are dropped on the next lookup, on every thread.
struct CurrentEntry {
  const SwapEngine* engine;
  std::shared_ptr<SwapGroup> group;
  uint64_t generation;
};
thread_local std::vector<CurrentEntry> t_current;
std::atomic<uint64_t> g_generation{0};

bool stale(const CurrentEntry& e) {
  return e.generation != g_generation.load(std::memory_order_relaxed) ||
         e.group->abandoned.load(std::memory_order_relaxed);
}

bool env_flag(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return false;
  const std::string s(v);
  return s == "1" || s == "true" || s == "yes" || s == "on";
}

// 1-D uint8 tensor over all bytes of `storage`, built without dispatch (no version bump,
// no autograd): the unit that copies move.
at::Tensor byte_view(const c10::Storage& storage) {
  const c10::Device device = storage.device();
  auto key = c10::computeDispatchKey(at::kByte, c10::kStrided, device);
  auto t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(storage), c10::DispatchKeySet(key),
                                                    caffe2::TypeMeta::Make<uint8_t>());
  t.unsafeGetTensorImpl()->set_sizes_contiguous({static_cast<int64_t>(storage.nbytes())});
  return t;
}

// Releases the device memory of `storage` in place: the StorageImpl (and every tensor
// and view on it) stays, with nbytes 0, until it is refilled (cpp_feasibility.md Q4).
// Returns the old memory, to be destroyed once the copy reading it is done.
at::DataPtr free_in_place(const c10::Storage& storage) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  at::DataPtr old = impl->set_data_ptr(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
  return old;
}

// Re-allocates `nbytes` for `storage` in place, with the current (compute) stream of its
// device current, so the caching allocator ties the block to the compute stream. A
// PrivateUse1 backend (torch_npu) resizes through its hook, which knows its private storage
// formats; every other device through the storage's allocator (docs/design.md, "Streams
// and events").
void refill_in_place(const c10::Storage& storage, size_t nbytes, c10::Device device) {
  c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
  c10::OptionalDeviceGuard guard;
  if (!device.is_cpu()) guard.reset_device(device);
  if (device.is_privateuseone() && at::isPrivateUse1HooksRegistered()) {
    at::detail::getPrivateUse1Hooks().resizePrivateUse1Bytes(storage, nbytes);
    return;
  }
  impl->set_data_ptr_noswap(impl->allocator()->allocate(nbytes));
  impl->set_nbytes(nbytes);
}

// Timeline label of a group / of a record's last live holder (docs/design.md, "Timeline").
// A storage two groups save is released at the later group's release point and the
// backward reaches that group first, so its prefetch reloads it: the copies are that
// group's. `holders` is in save order (forward order).
std::string trace_label(const SwapGroup& group) {
  if (!group.name().empty()) return group.name();
  return group.layer() >= 0 ? "layer " + std::to_string(group.layer())
                            : "region " + std::to_string(group.id());
}
std::string trace_label(const StorageRecord& record) {
  for (auto it = record.holders.rbegin(); it != record.holders.rend(); ++it) {
    if (auto group = it->lock()) return trace_label(*group);
  }
  return "unowned";
}

}  // namespace

SwapEngine::SwapEngine(SwapEngineOptions options)
    : options_(options),
      counters_(std::make_shared<SwapStatsCounters>()),
      registry_(counters_),
      debug_checks_(env_flag("HYPER_PARALLEL_DEBUG_CHECKS")) {}

SwapEngine::~SwapEngine() {
  if (thread_engine_) thread_engine_->drain();
}

SwapEngine& SwapEngine::global() {
  static SwapEngine* engine = [] {
    auto* e = new SwapEngine();  // intentionally leaked: outlives all hooks
    pthread_atfork([] { SwapEngine::global().prepare_fork(); },
                   [] { SwapEngine::global().parent_after_fork(); },
                   [] { SwapEngine::global().child_after_fork(); });
    return e;
  }();
  return *engine;
}

// ---------------------------------------------------------------- fork

void SwapEngine::prepare_fork() {
  // Lock order: engine, then the pools' leaf locks. No copy can be queued while mu_ is
  // held, so after the drain the child inherits finished copies only.
  mu_.lock();
  if (thread_engine_) thread_engine_->drain();
  for (auto* pool : {pageable_pool_.get(), pinned_pool_.get()}) {
    if (pool) pool->lock_for_fork();
  }
}

void SwapEngine::parent_after_fork() {
  for (auto* pool : {pageable_pool_.get(), pinned_pool_.get()}) {
    if (pool) pool->unlock_after_fork();
  }
  mu_.unlock();
}

void SwapEngine::child_after_fork() {
  for (auto* pool : {pageable_pool_.get(), pinned_pool_.get()}) {
    if (pool) pool->unlock_after_fork();
  }
  // The workers' threads were not copied into the child: joining them would hang, so the
  // old engine is abandoned (its queues are empty) and a new one starts on first use.
  (void)thread_engine_.release();
  wakeups_base_ = inline_base_ = 0;
  mu_.unlock();
}

// ---------------------------------------------------------------- configuration

void SwapEngine::set_cpu_swap(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  options_.cpu_swap = enabled;
}
bool SwapEngine::cpu_swap() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.cpu_swap;
}
void SwapEngine::set_cpu_delay_ns_per_byte(double delay) {
  // At most 1 s per byte: anything larger is a unit mistake and would overflow the
  // worker's sleep (inf and NaN are rejected here, not inside the worker).
  HP_CHECK_VALUE(std::isfinite(delay) && delay >= 0.0 && delay <= 1e9,
                 "the CPU swap delay must be a finite number of nanoseconds per byte in "
                 "[0, 1e9], got ", delay);
  std::lock_guard<std::mutex> lock(mu_);
  options_.cpu_delay_ns_per_byte = delay;
  if (thread_engine_) thread_engine_->set_delay_ns_per_byte(delay);
}
void SwapEngine::set_prefetch_depth(int depth) {
  HP_CHECK_VALUE(depth >= 0, "prefetch depth must be >= 0 (layers reloaded ahead), got ", depth);
  std::lock_guard<std::mutex> lock(mu_);
  options_.prefetch_depth = depth;
}
int SwapEngine::prefetch_depth() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.prefetch_depth;
}
void SwapEngine::set_fusion_threshold(int64_t bytes) {
  HP_CHECK_VALUE(bytes > 0, "the group_swap fusion threshold must be > 0 bytes, got ", bytes);
  std::lock_guard<std::mutex> lock(mu_);
  options_.fusion_threshold_bytes = static_cast<size_t>(bytes);
}
int64_t SwapEngine::fusion_threshold() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(options_.fusion_threshold_bytes);
}
void SwapEngine::set_offload_window(int groups) {
  HP_CHECK_VALUE(groups >= 0, "offload window must be >= 0 invocations (0: no limit), got ",
                 groups);
  std::lock_guard<std::mutex> lock(mu_);
  options_.offload_window = groups;
}

int SwapEngine::offload_window() const {
  std::lock_guard<std::mutex> lock(mu_);
  return options_.offload_window;
}

void SwapEngine::set_debug_checks(bool enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  debug_checks_ = enabled;
}
bool SwapEngine::debug_checks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return debug_checks_;
}
void SwapEngine::set_skip_reload_wait(bool skip) { skip_reload_wait_.store(skip); }

// ---------------------------------------------------------------- layer graph

int64_t SwapEngine::new_layer() {
  std::lock_guard<std::mutex> lock(mu_);
  return schedule_.new_layer();
}
void SwapEngine::link_layers(int64_t prev, int64_t next) {
  std::lock_guard<std::mutex> lock(mu_);
  schedule_.link(prev, next);
}
void SwapEngine::remove_layer(int64_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  schedule_.remove_layer(layer);
}
bool SwapEngine::layer_scheduled(int64_t layer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return schedule_.scheduled(layer);
}

// ---------------------------------------------------------------- invocations

std::shared_ptr<SwapGroup> SwapEngine::begin_forward(int64_t layer, const std::string& name,
                                                     bool manual, bool group_swap) {
  std::shared_ptr<SwapGroup> group;
  {
    std::lock_guard<std::mutex> lock(mu_);
    group = std::make_shared<SwapGroup>(next_group_id_++, layer, name, manual, group_swap);
    if (Trace::global().on()) group->trace_forward_start_ns = trace_now_ns();
    schedule_.on_begin(group);
    if (!name.empty()) named_[name] = group;
    if (manual) manual_[name] = group;
  }
  t_current.push_back(CurrentEntry{this, group, g_generation.load()});
  return group;
}

namespace {
// Pops `group` from this thread's stack. Entries above it are regions that began inside
// it and never ended (their bookkeeping was interrupted): they are dropped too and
// returned, so the caller can unlink them. False when `group` is not on the stack.
bool pop_current(const SwapEngine* engine, const std::shared_ptr<SwapGroup>& group,
                 std::vector<std::shared_ptr<SwapGroup>>* dropped) {
  for (auto it = t_current.rbegin(); it != t_current.rend(); ++it) {
    if (it->engine == engine && it->group == group) {
      auto pos = std::next(it).base();
      for (auto above = std::next(pos); above != t_current.end(); ++above) {
        if (above->engine == engine) dropped->push_back(above->group);
      }
      t_current.erase(pos, t_current.end());
      return true;
    }
  }
  return false;
}
}  // namespace

size_t SwapEngine::thread_region_count(const SwapEngine* engine) {
  size_t n = 0;
  for (const auto& e : t_current) n += (e.engine == engine && !stale(e)) ? 1 : 0;
  return n;
}

uint64_t SwapEngine::generation() { return g_generation.load(); }

bool SwapEngine::end_forward(const std::shared_ptr<SwapGroup>& group) {
  std::vector<std::shared_ptr<SwapGroup>> dropped;
  const bool found = pop_current(this, group, &dropped);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& g : dropped) schedule_.on_abort(g);
  HP_CHECK(found || group->abandoned.load(), "a swap region ended on a thread where it did "
           "not begin (or ended twice). Begin and end each layer's forward on the same thread; "
           "a model may run on several threads, but each forward call stays on one.");
  // SPEC 4.7: a registered tensor written in place after registration is an error,
  // never a silently stale copy.
  for (const auto& reg : group->registrations) {
    if (reg->alias()._version() != reg->saved_version()) {
      schedule_.on_abort(group);
      HP_CHECK(false, "a tensor registered with swap_tensor_wrapper (shape ",
               reg->alias().sizes(), ", dtype ", reg->alias().scalar_type(),
               ") was modified in place after it was registered (version ",
               reg->saved_version(), " -> ", reg->alias()._version(),
               "). Register the tensor after its last in-place update, or clone it first.");
    }
  }
  group->forward_done = true;
  counters_->release_points += 1;
  if (group->trace_forward_start_ns != 0) {
    Trace::global().range("forward", trace_label(*group), group->trace_forward_start_ns,
                          trace_now_ns());
  }
  if (schedule_.releases_at_forward_end(*group)) {
    if (options_.offload_window > 0) {
      group->released = true;
      group->offload_pending = true;
      pending_offloads_[std::this_thread::get_id()].push_back(group);
    } else {
      release_locked(group);
    }
  }
  pump_offloads_locked(*group);
  retry_deferred_locked();
  return !group->manual() && !schedule_.scheduled(group->layer()) && !group->records().empty();
}

void SwapEngine::abort_forward(const std::shared_ptr<SwapGroup>& group) {
  std::vector<std::shared_ptr<SwapGroup>> dropped;
  pop_current(this, group, &dropped);
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& g : dropped) schedule_.on_abort(g);
  schedule_.on_abort(group);
}

void SwapEngine::abandon_forward(const std::shared_ptr<SwapGroup>& group) {
  group->abandoned.store(true);
  std::lock_guard<std::mutex> lock(mu_);
  if (!group->forward_done) schedule_.on_abort(group);
}

void SwapEngine::backward_begin(const std::shared_ptr<SwapGroup>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  if (Trace::global().on()) Trace::global().backward_begin(trace_label(*group));
  counters_->prefetch_points += 1;
  count_kept_locked(*group);
  // schedule_.prefetch_targets's invocations, walked in place (no vector per backward start).
  std::shared_ptr<SwapGroup> g = group;
  const int depth = std::max(options_.prefetch_depth, 0);
  for (int i = 0; g && i <= depth; ++i) {
    g->backward_started = true;  // its records stay on device from now on
    load_group_locked(g);
    if (i < depth) g = g->prev.lock();
  }
}

std::vector<std::shared_ptr<SwapGroup>> SwapEngine::prefetch_targets(
    const std::shared_ptr<SwapGroup>& group) const {
  std::lock_guard<std::mutex> lock(mu_);
  return schedule_.prefetch_targets(group, options_.prefetch_depth);
}

std::shared_ptr<SwapGroup> SwapEngine::current_group() const {
  // Entries of an older generation (reset()) or of an abandoned region are dropped here.
  while (!t_current.empty() && t_current.back().engine == this && stale(t_current.back())) {
    t_current.pop_back();
  }
  for (auto it = t_current.rbegin(); it != t_current.rend(); ++it) {
    if (it->engine == this && !stale(*it)) return it->group;
  }
  return nullptr;
}

std::shared_ptr<SwapGroup> SwapEngine::find_group(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = named_.find(name);
  return it == named_.end() ? nullptr : it->second.lock();
}

void SwapEngine::name_group(const std::shared_ptr<SwapGroup>& group) {
  std::lock_guard<std::mutex> lock(mu_);
  named_[group->name()] = group;
  if (group->manual()) manual_[group->name()] = group;
}

// ---------------------------------------------------------------- saved tensors

std::shared_ptr<SavedHandle> SwapEngine::pack(const std::shared_ptr<SwapGroup>& group,
                                              const at::Tensor& t, PackMode mode) {
  if (!group) return nullptr;
  std::shared_ptr<StorageRecord> record;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // Only a region that swaps everything counts what it skips: a registered-only region
    // (plain chained module, checkpoint) never asked for the others.
    const bool counts = mode == PackMode::kSwapAll;
    const Ineligible why = check_eligible(t, options_.cpu_swap);
    if (why != Ineligible::kNone) {
      const auto reason = skip_reason(why);
      if (counts && reason) {
        const SkipFootprint f = skip_footprint(t);
        count_skipped_locked(group.get(), f.key, f.nbytes, *reason);
      }
      return nullptr;
    }
    const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
    if (group->excluded.count(key) != 0) {
      if (counts) count_skipped_locked(group.get(), key, t.storage().nbytes(), SkipReason::kBuffer);
      return nullptr;
    }
    if (mode == PackMode::kRegisteredOnly) {
      record = group->find(key);
      if (!record) {
        // (a later registration of it comes too late)
        group->passed.emplace_back(t.storage().getWeakStorageImpl());
        return nullptr;
      }
    } else {
      record = registry_.get_or_create(t.storage(), t.scalar_type());
      if (!group->holds(key)) {
        group->add(record);
        record->holders.push_back(group);
      }
    }
  }
  return std::make_shared<SavedHandle>(std::move(record), group, t.tensor_data());
}

bool SwapEngine::register_tensor(const std::shared_ptr<SwapGroup>& group, const at::Tensor& t) {
  if (!group) return false;
  std::lock_guard<std::mutex> lock(mu_);
  const Ineligible why = check_eligible(t, options_.cpu_swap);
  if (why != Ineligible::kNone) {
    if (const auto reason = skip_reason(why)) {
      const SkipFootprint f = skip_footprint(t);
      count_skipped_locked(group.get(), f.key, f.nbytes, *reason);
    }
    return false;
  }
  const c10::StorageImpl* key = t.storage().unsafeGetStorageImpl();
  if (group->excluded.count(key) != 0) {
    count_skipped_locked(group.get(), key, t.storage().nbytes(), SkipReason::kBuffer);
    return false;
  }
  auto record = registry_.get_or_create(t.storage(), t.scalar_type());
  if (!group->holds(key)) {
    group->add(record);
    record->holders.push_back(group);
  }
  group->registrations.push_back(std::make_shared<SavedHandle>(record, nullptr, t.tensor_data()));
  return true;
}

void SwapEngine::count_skipped(const std::shared_ptr<SwapGroup>& group, const at::Tensor& t,
                               SkipReason reason) {
  if (!t.defined()) return;
  const SkipFootprint f = skip_footprint(t);
  std::lock_guard<std::mutex> lock(mu_);
  count_skipped_locked(group.get(), f.key, f.nbytes, reason);
}

void SwapEngine::count_skipped_locked(SwapGroup* group, const void* key,
                                      size_t nbytes, SkipReason reason) {
  if (group != nullptr) {
    if (!group->skipped_keys.insert(key)) return;  // this storage was counted already
    group->skipped_bytes[static_cast<size_t>(reason)] += static_cast<int64_t>(nbytes);
    group->skipped_count[static_cast<size_t>(reason)] += 1;
  }
  counters_->add_skipped(reason, static_cast<int64_t>(nbytes));
}

std::vector<std::string> SwapEngine::take_pool_warnings() {
  std::vector<std::weak_ptr<HostBufferPool>> pools;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pool_warning_pending_.store(false, std::memory_order_relaxed);
    pools.swap(refused_pools_);
  }
  std::vector<std::string> out;
  for (const auto& weak : pools) {
    auto pool = weak.lock();
    if (!pool || !pool->take_first_refusal()) continue;
    std::ostringstream msg;
    msg << "hyper_parallel: a PinnedMemoryPool(max_host_bytes=" << pool->max_host_bytes()
        << ", when_full='keep') had no room under its cap for an offload: the activations "
           "that did not fit stay on the device (SwapManager().stats()['skipped']"
           "['host_pool_full'] counts them, the pool's stats()['refusals'] counts the "
           "refusals). Raise max_host_bytes, or swap fewer layers into this pool, to offload "
           "them. This is said once per pool.";
    out.push_back(msg.str());
  }
  return out;
}

void SwapEngine::count_kept_locked(const SwapGroup& group) {
  if (group.manual()) return;  // released only by the user's launch_offload
  const bool last_layer = !group.released && !schedule_.releases_at_forward_end(group);
  if (!group.released && !last_layer) return;
  // Released, but its offload never left the queue (docs/design.md, "Offload window").
  const bool link_saturated = group.offload_pending;
  for (const auto& r : group.records()) {
    if (r->state() != Residency::kDevice || r->settled) continue;
    r->settled = true;
    // Still referenced elsewhere: where an op of the invocation saved it before it was
    // registered, autograd's own saved tensor is (at least) what holds it (tester B,
    // session 20: it was reported as in use elsewhere with no word of why). Told apart
    // here, at the backward, not at the registration: a save whose graph was dropped since
    // (a logged `u.norm().item()`) holds nothing (tester D).
    counters_->add_skipped(last_layer       ? SkipReason::kLastLayer
                           : link_saturated ? SkipReason::kLinkSaturated
                           : group.saw_passed(r->key()) ? SkipReason::kSavedBeforeRegistration
                                                        : SkipReason::kInUseElsewhere,
                           static_cast<int64_t>(r->nbytes()));
  }
}

at::Tensor SwapEngine::unpack(const SavedHandle& handle) {
  const at::Tensor& alias = handle.alias();
  HP_CHECK(alias._version() == handle.saved_version(),
           "a tensor saved for backward (shape ", alias.sizes(), ", dtype ", alias.scalar_type(),
           ") was modified by an in-place operation after it was saved (version ",
           handle.saved_version(), " -> ", alias._version(),
           "). Clone the tensor before modifying it, or move the in-place op out of the "
           "checkpoint/swap region.");
  const auto& record = handle.record();
  CopyEventPtr pending;
  std::string label;  // timeline only
  {
    std::lock_guard<std::mutex> lock(mu_);
    // From here a backward reads this storage: no release point on any thread may take it
    // off the device again (the tensor returned below shares our alias's TensorImpl, so the
    // storage's use count cannot show autograd's reference).
    record->in_use_by_backward = true;
    if (const auto& g = handle.group()) g->backward_started = true;
    if (Trace::global().on()) label = trace_label(*record);
    switch (record->state()) {
      case Residency::kDevice:
        check_resident(*record, alias);
        return alias;
      case Residency::kOffloading:
      case Residency::kHost:
        // A schedule hole (no prefetch reached this group): reload on demand. The reload
        // is ordered after the D2H copy (SPEC 4.2).
        counters_->on_demand_reloads += 1;
        Trace::global().instant("on_demand", record->device(), label,
                                static_cast<int64_t>(record->nbytes()), 1);
        reload_locked(record);
        [[fallthrough]];
      case Residency::kReloading:
        pending = record->h2d_done;
        break;
    }
  }
  const c10::Device device = record->device();
  const double waited = skip_reload_wait_.load()
                            ? 0.0
                            : Trace::global().timed_wait(device, label, [&] {
                                return pending->block_compute(device);
                              });
  counters_->stall_nanoseconds += static_cast<int64_t>(waited * 1e9);
  std::lock_guard<std::mutex> lock(mu_);
  if (record->state() == Residency::kReloading && record->h2d_done == pending) {
    record->transition(Residency::kDevice);
    record->host.reset();  // back to the pool, pending on `pending`
    record->d2h_done.reset();
    record->h2d_done.reset();
    record->bucket.reset();
  }
  check_resident(*record, alias);
  return alias;
}

at::Tensor SwapEngine::try_unpack(const SavedHandle& handle) {
  const at::Tensor& alias = handle.alias();
  if (alias._version() != handle.saved_version()) return unpack(handle);  // raises
  const auto& record = handle.record();
  std::lock_guard<std::mutex> lock(mu_);
  const Residency state = record->state();
  const bool done = state == Residency::kDevice ||
                    (state == Residency::kReloading && record->h2d_done->query());
  if (!done) return {};
  // What unpack() does on these paths (the reload's wait, had it run, returns at once).
  record->in_use_by_backward = true;
  if (const auto& g = handle.group()) g->backward_started = true;
  if (state == Residency::kReloading) {
    record->transition(Residency::kDevice);
    record->host.reset();
    record->d2h_done.reset();
    record->h2d_done.reset();
    record->bucket.reset();
  }
  check_resident(*record, alias);
  return alias;
}

void SwapEngine::check_resident(const StorageRecord& record, const at::Tensor& alias) const {
  // SPEC 4.2 at its source: autograd is never handed a released or half-refilled storage.
  const c10::StorageImpl* impl = alias.storage().unsafeGetStorageImpl();
  // On the device by the engine's account (never released, or refilled by its reload to
  // exactly record.nbytes()), yet smaller: code outside the engine shrank or freed the
  // storage after it was saved (untyped_storage().resize_(0), as FSDP does with its own
  // buffers). Plain torch fails there too ("data is not allocated yet"); say so. A storage
  // grown since (resize_ keeps the values) still holds the saved bytes: plain torch reads
  // it, and so does this (such a storage never leaves the device: try_offload_locked).
  const bool on_device = record.state() == Residency::kDevice;
  HP_CHECK(!on_device || impl->nbytes() >= record.nbytes(),
           "a tensor saved for backward (shape ", alias.sizes(), ", dtype ",
           alias.scalar_type(), ") has a storage of ", impl->nbytes(), " bytes, but it held ",
           record.nbytes(), " when it was saved: something resized or freed it after the "
           "forward (e.g. untyped_storage().resize_(0)). A tensor saved for backward must "
           "keep its storage until the backward has read it: free it after backward(), or "
           "clone it before freeing.");
  HP_INTERNAL_ASSERT((on_device ? impl->nbytes() >= record.nbytes()
                                : impl->nbytes() == record.nbytes()) &&
                         (record.nbytes() == 0 || impl->data() != nullptr),
                     "unpack would hand autograd a storage that is not resident (",
                     impl->nbytes(), " of ", record.nbytes(), " bytes, state ",
                     to_string(record.state()), ")");
}

// ---------------------------------------------------------------- release and reload

namespace {
// Whether `storage` has a Python storage object (made by t.untyped_storage() or t.storage())
// that nothing in Python references any more. Such an object holds one strong reference
// of the StorageImpl, and torch keeps it alive for as long as the StorageImpl has other
// C++ references (PyObject preservation, c10/util/intrusive_ptr.h), so merely reading a
// tensor's storage once, in a policy or anywhere, adds 1 to use_count() for the storage's
// whole life. That reference is nobody's use when the Python object's refcount is 1 (only
// the preservation holds it). Reading the refcount needs the GIL: every path that may
// free a storage (end_forward, launch_offload) is entered from Python holding it; without
// an interpreter (C++ tests, LibTorch) no storage has a Python object.
bool has_idle_python_storage(const c10::Storage& storage) {
  const c10::impl::PyObjectSlot* slot = storage.unsafeGetStorageImpl()->pyobj_slot();
  return slot->load_pyobj() != nullptr && slot->has_unique_reference();
}
}  // namespace

bool SwapEngine::in_use_elsewhere(const StorageRecord& record, const c10::Storage& storage) const {
  // `storage` itself is one reference, an idle Python storage object another; every other
  // one must be a handle of ours.
  int64_t others = static_cast<int64_t>(storage.use_count()) - 1;
  if (has_idle_python_storage(storage)) others -= 1;
  return others > record.alias_refs.load();
}

void SwapEngine::release_locked(const std::shared_ptr<SwapGroup>& group) {
  group->released = true;
  try_offload_locked(group->records(), group->group_swap());
}

void SwapEngine::try_offload_locked(std::vector<std::shared_ptr<StorageRecord>> candidates,
                                    bool fuse) {
  // Per (device, host pool): (records, storages) ready to leave the device now.
  std::map<std::tuple<int, int, HostBufferPool*>,
           std::pair<std::vector<std::shared_ptr<StorageRecord>>, std::vector<c10::Storage>>>
      ready;
  std::unordered_set<const c10::StorageImpl*> seen;
  for (auto& record : candidates) {
    if (!seen.insert(record->key()).second) continue;  // listed twice (deferred by two groups)
    if (record->state() != Residency::kDevice) continue;
    // The last holder to release retries; a storage in a backward never leaves.
    if (!record->may_leave_device()) continue;
    c10::Storage storage = record->storage();
    if (!storage || storage.nbytes() != record->nbytes()) continue;
    if (in_use_elsewhere(*record, storage)) {
      deferred_[std::this_thread::get_id()].push_back(record);
      counters_->deferred_frees += 1;
      continue;
    }
    if (debug_checks_) check_release_locked(*record);
    auto key = std::make_tuple(static_cast<int>(record->device().type()),
                               static_cast<int>(record->device().index()),
                               record->host_pool.get());
    ready[key].first.push_back(record);
    ready[key].second.push_back(std::move(storage));
  }
  const size_t threshold = options_.fusion_threshold_bytes;
  for (auto& kv : ready) {
    auto& records = kv.second.first;
    auto& storages = kv.second.second;
    if (!fuse) {
      offload_batch_locked(records, storages, false);
      continue;
    }
    // group_swap: bucket records under the threshold by dtype, filling each bucket up to
    // the threshold; everything else moves on its own.
    std::map<int, std::pair<std::vector<std::shared_ptr<StorageRecord>>, std::vector<c10::Storage>>> open;
    std::map<int, size_t> open_bytes;
    std::vector<std::shared_ptr<StorageRecord>> single_records;
    std::vector<c10::Storage> single_storages;
    auto flush = [&](int dtype) {
      auto& b = open[dtype];
      if (b.first.size() > 1) {
        offload_batch_locked(b.first, b.second, true);
      } else if (b.first.size() == 1) {
        single_records.push_back(b.first[0]);
        single_storages.push_back(b.second[0]);
      }
      b.first.clear();
      b.second.clear();
      open_bytes[dtype] = 0;
    };
    for (size_t i = 0; i < records.size(); ++i) {
      const size_t n = records[i]->nbytes();
      if (n >= threshold) {
        single_records.push_back(records[i]);
        single_storages.push_back(storages[i]);
        continue;
      }
      const int dtype = static_cast<int>(records[i]->dtype());
      if (open_bytes[dtype] + n > threshold) flush(dtype);
      open[dtype].first.push_back(records[i]);
      open[dtype].second.push_back(storages[i]);
      open_bytes[dtype] += n;
    }
    for (auto& b : open) flush(b.first);
    if (!single_records.empty()) offload_batch_locked(single_records, single_storages, false);
  }
}

void SwapEngine::offload_batch_locked(const std::vector<std::shared_ptr<StorageRecord>>& records,
                                      const std::vector<c10::Storage>& storages, bool fused) {
  // One submit for the whole batch: a fused bucket shares one host block and moves as one
  // transfer; otherwise each storage gets its own block (reusable on its own) but the
  // copies still share one event and one release.
  const c10::Device device = records.front()->device();
  CopyEngine& engine = engine_for(device);
  HostBufferPool& pool = records.front()->host_pool ? *records.front()->host_pool
                                                    : pool_for(device);
  if (records.front()->host_pool && pool.pinned() != engine.wants_pinned_host()) {
    pool.set_pinned(engine.wants_pinned_host());  // a user pool takes its first device's kind
  }
  // Every block is acquired before any storage is freed: a pool that raises leaves the
  // batch intact on the device. A pool that keeps what does not fit (keep_when_full) lends
  // blocks to those that fit, in order (a fused bucket it has no room for is tried
  // storage by storage); the others stay, counted by refuse().
  const bool keep = pool.keep_when_full();
  auto take = [&](size_t nbytes) {
    return keep ? pool.try_acquire(nbytes) : pool.acquire(nbytes);
  };
  // A storage the pool had no room for stays on the device, counted kept at once (once,
  // whatever region or backward it belongs to; a later release that moves it takes the
  // count back: offload_blocks_locked).
  auto refuse = [&](const std::shared_ptr<StorageRecord>& r) {
    if (!r->pool_refused) {
      r->pool_refused = true;
      r->settled = true;
      counters_->add_skipped(SkipReason::kHostPoolFull, static_cast<int64_t>(r->nbytes()));
    }
    auto shared = pool.shared_from_this();
    bool listed = false;
    for (const auto& w : refused_pools_) listed = listed || w.lock() == shared;
    if (!listed) refused_pools_.push_back(shared);
    pool_warning_pending_.store(true, std::memory_order_relaxed);
  };
  std::vector<std::shared_ptr<StorageRecord>> kept_records;
  std::vector<c10::Storage> kept_storages;
  const std::vector<std::shared_ptr<StorageRecord>>* batch = &records;
  const std::vector<c10::Storage>* batch_storages = &storages;
  std::vector<std::shared_ptr<HostBlock>> blocks;
  size_t total = 0;
  for (const auto& r : records) total += r->nbytes();
  if (fused) {
    // The bucket's one block (its size class can exceed the sum of its storages'):
    // without room for it, the storages go one by one (and those that do not fit stay, or
    // raise, as the pool says).
    std::unique_ptr<HostBlock> block = pool.try_acquire(total, /*count_refusal=*/false);
    if (!block) {
      offload_batch_locked(records, storages, false);
      return;
    }
    blocks.push_back(std::move(block));
  } else {
    for (size_t i = 0; i < records.size(); ++i) {
      std::unique_ptr<HostBlock> block = take(records[i]->nbytes());
      if (!block) {
        refuse(records[i]);
        continue;
      }
      blocks.push_back(std::move(block));
      kept_records.push_back(records[i]);
      kept_storages.push_back(storages[i]);
    }
    if (kept_records.size() != records.size()) {
      if (kept_records.empty()) return;
      batch = &kept_records;
      batch_storages = &kept_storages;
      total = 0;
      for (const auto& r : kept_records) total += r->nbytes();
    }
  }
  offload_blocks_locked(*batch, *batch_storages, fused, device, engine, std::move(blocks),
                        total);
}

void SwapEngine::offload_blocks_locked(const std::vector<std::shared_ptr<StorageRecord>>& records,
                                       const std::vector<c10::Storage>& storages, bool fused,
                                       c10::Device device, CopyEngine& engine,
                                       std::vector<std::shared_ptr<HostBlock>> blocks,
                                       size_t total) {
  CopyPlan plan;
  plan.fused = fused;
  if (fused) plan.host = blocks.front()->buffer();
  size_t offset = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    CopyItem item{byte_view(storages[i]), fused ? offset : 0, at::Tensor()};
    if (!fused) item.host = blocks[i]->buffer();
    plan.items.push_back(std::move(item));
    offset += records[i]->nbytes();
  }
  const int64_t enqueue_ns = trace_now_ns();
  CopyEventPtr done = engine.submit(CopyDirection::kDeviceToHost, device, plan, {});
  if (collect_d2h_) collect_d2h_->push_back(done);
  if (Trace::global().on()) {
    const std::string label = trace_label(*records.front());
    const auto n = static_cast<int64_t>(records.size());
    Trace::global().copy(CopyDirection::kDeviceToHost, device, label,
                         static_cast<int64_t>(total), n, enqueue_ns, done);
    Trace::global().instant("free", device, label, static_cast<int64_t>(total), n);
  }
  for (auto& block : blocks) block->set_last_use(done);
  plan.items.clear();  // drop our byte views before freeing
  auto bucket = fused ? std::make_shared<std::vector<std::weak_ptr<StorageRecord>>>() : nullptr;
  std::vector<at::DataPtr> released;
  released.reserve(records.size());
  offset = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    released.push_back(free_in_place(storages[i]));
    r->transition(Residency::kOffloading);
    r->settled = true;
    if (r->pool_refused) {  // counted kept when refused; moved after all
      r->pool_refused = false;
      counters_->remove_skipped(SkipReason::kHostPoolFull, static_cast<int64_t>(r->nbytes()));
    }
    r->host = fused ? blocks.front() : blocks[i];
    r->host_offset = fused ? offset : 0;
    r->d2h_done = done;
    r->bucket = bucket;
    if (bucket) bucket->push_back(r);
    offset += r->nbytes();
  }
  engine.release_after(CopyDirection::kDeviceToHost, device, std::move(released));
  counters_->transfers += fused ? 1 : static_cast<int64_t>(records.size());
  counters_->offload_bytes += static_cast<int64_t>(total);
  counters_->offload_count += static_cast<int64_t>(records.size());
  if (fused) counters_->fused_copies += 1;
}

void SwapEngine::reload_locked(const std::shared_ptr<StorageRecord>& record) {
  // Fused buckets come back together: one H2D copy for the bucket.
  if (!record->bucket) {
    reload_batch_locked({record});
    return;
  }
  std::vector<std::shared_ptr<StorageRecord>> members;
  for (const auto& weak : *record->bucket) {
    auto m = weak.lock();
    if (m && (m->state() == Residency::kOffloading || m->state() == Residency::kHost)) {
      members.push_back(std::move(m));
    }
  }
  reload_batch_locked(members);
}

void SwapEngine::reload_batch_locked(const std::vector<std::shared_ptr<StorageRecord>>& candidates) {
  // A storage that died while offloaded (every tensor on it was dropped) has no reader left
  // and is skipped; the strong references taken here keep the others alive until refilled.
  std::vector<std::shared_ptr<StorageRecord>> members;
  std::vector<c10::Storage> storages;
  for (const auto& m : candidates) {
    c10::Storage storage = m->storage();
    if (!storage) continue;
    members.push_back(m);
    storages.push_back(std::move(storage));
  }
  if (members.empty()) return;
  // One transfer when the batch is exactly one complete fused bucket.
  const auto& bucket = members.front()->bucket;
  bool fused = bucket && members.size() > 1 && members.size() == bucket->size();
  for (const auto& m : members) fused = fused && m->bucket == bucket;
  const c10::Device device = members.front()->device();
  CopyEngine& engine = engine_for(device);
  const bool poison_refills =
      device.is_cpu() && (options_.cpu_delay_ns_per_byte > 0.0 || debug_checks_);
  CopyPlan plan;
  plan.fused = fused;
  if (fused) plan.host = members.front()->host->buffer();
  std::vector<CopyEventPtr> after;
  size_t total = 0;
  for (size_t i = 0; i < members.size(); ++i) {
    const auto& m = members[i];
    refill_in_place(storages[i], m->nbytes(), device);
    if (poison_refills && m->nbytes() != 0) {
      // Test mode on the host backend: the refilled memory holds a poison pattern (NaN for
      // floats) until the H2D copy lands, so a read that skips the wait is always wrong,
      // never accidentally right because the allocator handed back the freed block.
      std::memset(storages[i].mutable_data(), 0xFF, m->nbytes());
    }
    plan.items.push_back(CopyItem{byte_view(storages[i]), m->host_offset,
                                  fused ? at::Tensor() : m->host->buffer()});
    if (std::find(after.begin(), after.end(), m->d2h_done) == after.end()) {
      after.push_back(m->d2h_done);  // ordered after the D2H that filled the block
    }
    total += m->nbytes();
  }
  const int64_t enqueue_ns = trace_now_ns();
  CopyEventPtr done = engine.submit(CopyDirection::kHostToDevice, device, plan, after);
  if (Trace::global().on()) {
    const std::string label = trace_label(*members.front());
    const auto n = static_cast<int64_t>(members.size());
    Trace::global().instant("refill", device, label, static_cast<int64_t>(total), n);
    Trace::global().copy(CopyDirection::kHostToDevice, device, label,
                         static_cast<int64_t>(total), n, enqueue_ns, done);
  }
  for (size_t i = 0; i < members.size(); ++i) {
    const auto& m = members[i];
    m->host->set_last_use(done);
    engine.record_use(CopyDirection::kHostToDevice, device,
                      storages[i].unsafeGetStorageImpl()->data_ptr());
    if (m->state() == Residency::kOffloading && m->d2h_done->query()) {
      m->transition(Residency::kHost);
    }
    m->transition(Residency::kReloading);
    m->h2d_done = done;
  }
  counters_->transfers += fused ? 1 : static_cast<int64_t>(members.size());
  counters_->reload_bytes += static_cast<int64_t>(total);
  counters_->reload_count += static_cast<int64_t>(members.size());
  if (fused) counters_->fused_copies += 1;
}

void SwapEngine::load_group_locked(const std::shared_ptr<SwapGroup>& group) {
  group->load_launched = true;
  // Buckets reload as units; every other offloaded record of the group goes in one batch.
  std::vector<std::shared_ptr<StorageRecord>> singles;
  for (const auto& r : group->records()) {
    if (r->state() != Residency::kOffloading && r->state() != Residency::kHost) continue;
    if (r->bucket) {
      reload_locked(r);  // the rest of its bucket leaves the offloaded states with it
    } else {
      singles.push_back(r);
    }
  }
  std::map<std::pair<int, int>, std::vector<std::shared_ptr<StorageRecord>>> by_device;
  for (auto& r : singles) {
    by_device[{static_cast<int>(r->device().type()), static_cast<int>(r->device().index())}]
        .push_back(std::move(r));
  }
  for (const auto& kv : by_device) reload_batch_locked(kv.second);
}

void SwapEngine::pump_offloads_locked(const SwapGroup& ending) {
  auto it = pending_offloads_.find(std::this_thread::get_id());
  if (it == pending_offloads_.end()) return;
  auto& queue = it->second;
  // Entries that need no offload any more: dropped, already submitted, or their backward
  // began while they waited (they stay on device; count_kept_locked counts them as
  // link_saturated when their own backward begins).
  auto stale = [](const std::shared_ptr<SwapGroup>& g) {
    return !g || !g->offload_pending || g->backward_started;
  };
  while (!queue.empty() && stale(queue.front().lock())) queue.pop_front();
  // Near the turn (the end of the forward of the last layer of a chain, or of the layer
  // before it), an offload that waited since an earlier release point stays waiting, and so
  // does everything queued behind it: the link is behind by a full window, so its copy
  // would end after the turn, lower no peak, and hold up the reloads wanted first in
  // backward (docs/design.md, "Offload window").
  if (!queue.empty() && queue.front().lock().get() != &ending &&
      schedule_.near_end(ending.layer())) {
    return;
  }
  const size_t window = static_cast<size_t>(options_.offload_window);
  while (!queue.empty()) {
    // Completion is checked oldest first: D2H copies run in submission order on one link.
    while (!offloads_in_flight_.empty() &&
           std::all_of(offloads_in_flight_.front().begin(), offloads_in_flight_.front().end(),
                       [](const CopyEventPtr& e) { return e->query(); })) {
      offloads_in_flight_.pop_front();
    }
    if (window > 0 && offloads_in_flight_.size() >= window) break;
    std::shared_ptr<SwapGroup> group = queue.front().lock();
    queue.pop_front();
    if (stale(group)) continue;
    group->offload_pending = false;
    std::vector<CopyEventPtr> submitted;
    collect_d2h_ = &submitted;
    try {
      release_locked(group);
    } catch (...) {
      collect_d2h_ = nullptr;
      throw;
    }
    collect_d2h_ = nullptr;
    if (!submitted.empty()) offloads_in_flight_.push_back(std::move(submitted));
  }
  // An emptied queue stays for this thread's next release point (no map node per layer);
  // queues of threads that are gone are dropped once there are many.
  if (queue.empty() && pending_offloads_.size() > kMaxIdleOffloadQueues) {
    for (auto q = pending_offloads_.begin(); q != pending_offloads_.end();) {
      q = q->second.empty() ? pending_offloads_.erase(q) : std::next(q);
    }
  }
}

void SwapEngine::retry_deferred_locked() {
  auto it = deferred_.find(std::this_thread::get_id());
  if (it == deferred_.end()) return;
  std::vector<std::shared_ptr<StorageRecord>> candidates;
  for (const auto& weak : it->second) {
    auto r = weak.lock();
    if (r && r->state() == Residency::kDevice) candidates.push_back(std::move(r));
  }
  deferred_.erase(it);  // what is still in use is deferred again below
  if (!candidates.empty()) try_offload_locked(std::move(candidates), false);
}

void SwapEngine::check_release_locked(const StorageRecord& record) const {
  for (const auto& weak : record.holders) {
    auto g = weak.lock();
    if (!g) continue;
    HP_INTERNAL_ASSERT(g->manual() || g->forward_done,
                       "release of a storage whose invocation (group ", g->id(),
                       ") has not finished its forward");
    HP_INTERNAL_ASSERT(!g->backward_started,
                       "release of a storage whose invocation (group ", g->id(),
                       ") already began its backward");
  }
  HP_INTERNAL_ASSERT(!record.in_use_by_backward,
                     "release of a storage that a backward was handed by unpack()");
}

// ---------------------------------------------------------------- manual control

void SwapEngine::launch_offload(const std::shared_ptr<SwapGroup>& group) {
  HP_CHECK_VALUE(group, "launch_offload: no such swap group");
  std::lock_guard<std::mutex> lock(mu_);
  counters_->release_points += 1;
  release_locked(group);
  // From here the group lives as long as the saved tensors that need it: the engine stops
  // pinning it by name, so a manual group per step cannot accumulate.
  auto it = manual_.find(group->name());
  if (it != manual_.end() && it->second == group) manual_.erase(it);
}

bool SwapEngine::knows_group(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  return named_.count(name) != 0;
}

void SwapEngine::forget_group(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  named_.erase(name);
  manual_.erase(name);
}

int64_t SwapEngine::live_group_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t n = 0;
  for (const auto& kv : named_) n += kv.second.expired() ? 0 : 1;
  return n;
}

void SwapEngine::wait_offload(const std::shared_ptr<SwapGroup>& group) {
  HP_CHECK_VALUE(group, "wait_offload: no such swap group");
  std::vector<CopyEventPtr> events;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // A wait with nothing launched is a schedule bug (the copies it meant to wait for
    // never start); the reference refuses it too.
    HP_CHECK_VALUE(group->released, "wait_offload('", group->name(),
                   "') before launch_offload: the group's offload was never started; call "
                   "launch_offload('", group->name(), "') first");
    for (const auto& r : group->records()) {
      if (r->state() == Residency::kOffloading) events.push_back(r->d2h_done);
    }
  }
  for (const auto& e : events) e->synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& r : group->records()) {
    if (r->state() == Residency::kOffloading && r->d2h_done->query()) r->transition(Residency::kHost);
  }
}

void SwapEngine::launch_load(const std::shared_ptr<SwapGroup>& group) {
  HP_CHECK_VALUE(group, "launch_load: no such swap group");
  std::lock_guard<std::mutex> lock(mu_);
  counters_->prefetch_points += 1;
  load_group_locked(group);
}

void SwapEngine::wait_load(const std::shared_ptr<SwapGroup>& group) {
  HP_CHECK_VALUE(group, "wait_load: no such swap group");
  std::vector<std::pair<std::shared_ptr<StorageRecord>, CopyEventPtr>> pending;
  std::string label;  // timeline only
  {
    std::lock_guard<std::mutex> lock(mu_);
    HP_CHECK_VALUE(group->load_launched || group->backward_started, "wait_load('",
                   group->name(), "') before launch_load: the group's reload was never "
                   "started; call launch_load('", group->name(), "') first");
    for (const auto& r : group->records()) {
      if (r->state() == Residency::kReloading) pending.emplace_back(r, r->h2d_done);
    }
    if (Trace::global().on()) label = trace_label(*group);
  }
  for (const auto& p : pending) {
    const c10::Device device = p.first->device();
    counters_->stall_nanoseconds += static_cast<int64_t>(
        Trace::global().timed_wait(device, label,
                                   [&] { return p.second->block_compute(device); }) *
        1e9);
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& p : pending) {
    const auto& r = p.first;
    if (r->state() == Residency::kReloading && r->h2d_done == p.second) {
      r->transition(Residency::kDevice);
      r->host.reset();
      r->d2h_done.reset();
      r->h2d_done.reset();
      r->bucket.reset();
    }
  }
}

// ---------------------------------------------------------------- observability

SwapStats SwapEngine::stats() {
  SwapStats s;
  s.offload_bytes = counters_->offload_bytes.load();
  s.offload_count = counters_->offload_count.load();
  s.reload_bytes = counters_->reload_bytes.load();
  s.reload_count = counters_->reload_count.load();
  s.resident_bytes = counters_->resident_bytes.load();
  s.peak_resident_bytes = counters_->peak_resident_bytes.load();
  s.fused_copies = counters_->fused_copies.load();
  s.transfers = counters_->transfers.load();
  s.on_demand_reloads = counters_->on_demand_reloads.load();
  s.deferred_frees = counters_->deferred_frees.load();
  s.release_points = counters_->release_points.load();
  s.prefetch_points = counters_->prefetch_points.load();
  s.stall_seconds = static_cast<double>(counters_->stall_nanoseconds.load()) * 1e-9;
  for (size_t i = 0; i < kNumSkipReasons; ++i) {
    s.skipped_bytes[i] = counters_->skipped_bytes[i].load();
    s.skipped_count[i] = counters_->skipped_count[i].load();
  }
  std::lock_guard<std::mutex> lock(mu_);
  for (auto* pool : {pageable_pool_.get(), pinned_pool_.get()}) {
    if (!pool) continue;
    const auto ps = pool->stats();
    s.pinned_bytes_in_use += ps.bytes_in_use;
    s.pinned_bytes_cached += ps.bytes_cached;
    s.host_bytes_pending += ps.bytes_pending;
    s.host_allocations += ps.allocations;
    s.host_reuses += ps.reuses;
  }
  s.live_records = static_cast<int64_t>(registry_.live_records());
  s.window_in_flight = static_cast<int64_t>(offloads_in_flight_.size());
  for (const auto& copies : offloads_in_flight_) {
    if (std::all_of(copies.begin(), copies.end(), [](const CopyEventPtr& e) { return e->query(); })) {
      ++s.window_complete;
    }
  }
  if (thread_engine_) {
    s.worker_wakeups = thread_engine_->wakeups() - wakeups_base_;
    s.inline_copies = thread_engine_->inline_copies() - inline_base_;
  }
  return s;
}

void SwapEngine::reset(bool schedule) {
  counters_->reset();
  std::lock_guard<std::mutex> lock(mu_);
  wakeups_base_ = thread_engine_ ? thread_engine_->wakeups() : 0;
  inline_base_ = thread_engine_ ? thread_engine_->inline_copies() : 0;
  if (schedule) {
    deferred_.clear();
    pending_offloads_.clear();
    offloads_in_flight_.clear();
    schedule_.clear();
    named_.clear();
    manual_.clear();
    // Regions still open on any thread (left by an interrupted step) stop being current.
    g_generation.fetch_add(1);
  }
}

int64_t SwapEngine::scheduled_layer_count() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(schedule_.layer_count());
}

void SwapEngine::synchronize() {
  ThreadCopyEngine* engine;
  {
    std::lock_guard<std::mutex> lock(mu_);
    engine = thread_engine_.get();
  }
  if (engine) engine->drain();
}

const char* SwapEngine::residency_of(const at::Tensor& t) const {
  if (!has_plain_storage(t)) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  auto record = registry_.find(t.storage().unsafeGetStorageImpl());
  return record ? to_string(record->state()) : nullptr;
}

CopyEngine& SwapEngine::engine_for(c10::Device device) {
  if (device.is_cpu()) {
    if (!thread_engine_) {
      thread_engine_ = std::make_unique<ThreadCopyEngine>(options_.cpu_delay_ns_per_byte);
    }
    return *thread_engine_;
  }
  if (!accel_engine_) accel_engine_ = std::make_unique<AcceleratorCopyEngine>();
  return *accel_engine_;
}

HostBufferPool& SwapEngine::pool_for(c10::Device device) {
  if (device.is_cpu()) {
    if (!pageable_pool_) pageable_pool_ = HostBufferPool::create(/*pinned=*/false);
    return *pageable_pool_;
  }
  if (!pinned_pool_) pinned_pool_ = HostBufferPool::create(/*pinned=*/true);
  return *pinned_pool_;
}

}  // namespace hyper_parallel::activation
