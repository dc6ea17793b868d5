#pragma once
// SwapGroup: the records saved during ONE invocation of one layer (or one manual group).
//
// Never per module: a layer called twice before backward (gradient accumulation,
// micro-batches, weight sharing) has two groups, each with its own schedule links
// (SPEC 4.5). Groups are owned by the saved-tensor handles autograd holds (and the
// backward pre-hooks of the invocation), so a group dies with its graph; the schedule
// only holds weak references.
//
// Thread-safety: guarded by the SwapEngine lock.

#include "hyper_parallel/activation/HostBufferPool.h"
#include "hyper_parallel/activation/PointerSet.h"
#include "hyper_parallel/activation/StorageRecord.h"
#include "hyper_parallel/activation/SwapStats.h"

#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace hyper_parallel::activation {

class SavedHandle;

// What the pack hook of a region does with an eligible saved tensor.
enum class PackMode : uint8_t {
  kSwapAll = 0,         // swap() / swap_wrapper: every eligible tensor (subject to policy)
  kRegisteredOnly = 1,  // only storages registered in the group (swap_tensor_wrapper, MUST_SWAP)
};

class SwapGroup {
 public:
  SwapGroup(int64_t id, int64_t layer, std::string name, bool manual, bool group_swap)
      : id_(id), layer_(layer), name_(std::move(name)), manual_(manual), group_swap_(group_swap) {}

  int64_t id() const { return id_; }
  int64_t layer() const { return layer_; }  // -1 when not a registered layer
  const std::string& name() const { return name_; }
  void set_name(std::string name) { name_ = std::move(name); }
  bool manual() const { return manual_; }
  bool group_swap() const { return group_swap_; }
  void set_group_swap(bool on) { group_swap_ = on; }

  // Records of this invocation, each once.
  const std::vector<std::shared_ptr<StorageRecord>>& records() const { return records_; }
  bool holds(const c10::StorageImpl* key) const { return index_.count(key) != 0; }
  std::shared_ptr<StorageRecord> find(const c10::StorageImpl* key) const;
  void add(const std::shared_ptr<StorageRecord>& record);

  // Host pool for the records this group adds (cpu_pool=); null: the engine's pool.
  std::shared_ptr<HostBufferPool> host_pool;
  // Storages never swapped for this invocation (the wrapped module's parameters/buffers).
  PointerSet excluded;
  // Storages a registered-only invocation saw saved unregistered (autograd keeps those
  // tensors as themselves): one registered later that is still held at the backward is
  // skipped as kSavedBeforeRegistration, not kInUseElsewhere. Weak references, so that no
  // later storage takes a listed one's address (raw pointers had named a fresh tensor
  // after a dead one; tester C, session 20).
  c10::SmallVector<c10::weak_intrusive_ptr<c10::StorageImpl>, 8> passed;
  // Whether `key` is one of `passed`.
  bool saw_passed(const c10::StorageImpl* key) const;
  // Handles for tensors registered explicitly (swap_tensor_wrapper); they count as
  // hyper_parallel's own references. They do not point back to the group.
  std::vector<std::shared_ptr<SavedHandle>> registrations;

  // Saved tensors of this invocation that were not offloaded, by reason (bytes and storages;
  // each storage once). `skipped_keys` dedupes.
  std::array<int64_t, kNumSkipReasons> skipped_bytes{};
  std::array<int64_t, kNumSkipReasons> skipped_count{};
  PointerSet skipped_keys;  // a storage, or a tensor without one

  bool forward_done = false;
  bool released = false;    // this invocation allows its records to leave the device
  bool load_launched = false;  // a reload of its records was started (launch_load, prefetch)
  // Released, but its offload waits in its thread's queue for the offload window
  // (SwapEngine::pump_offloads_locked; docs/design.md, "Offload window").
  bool offload_pending = false;
  bool aborted = false;     // forward raised
  // The backward of this invocation began (its pre-hook fired, a later layer's backward
  // prefetched it, or autograd unpacked one of its tensors): its records stay on device
  // from now on (docs/design.md, "Who may release a storage").
  bool backward_started = false;
  // The region of this invocation was dropped without ending (an exception inside the
  // region bookkeeping, e.g. KeyboardInterrupt): its stack entry is pruned by the next
  // region call on its thread. Atomic: set by a destructor without the engine lock.
  std::atomic<bool> abandoned{false};
  int64_t trace_forward_start_ns = 0;  // begin_forward time while a Trace records
  // The layer has a predecessor in the chain, but no invocation of it ran before this one
  // on this thread (the first layer run, or a forward order against the chain).
  bool orphan = false;
  // The forward runs against the declared chain (Schedule::on_begin): this invocation
  // began while an orphan invocation of a layer after it in the chain was alive.
  bool order_reversed = false;
  std::weak_ptr<SwapGroup> prev;  // invocation of the predecessor layer in the same pass
  std::weak_ptr<SwapGroup> next;

 private:
  int64_t id_;
  int64_t layer_;
  std::string name_;
  bool manual_;
  bool group_swap_;
  std::vector<std::shared_ptr<StorageRecord>> records_;
  std::unordered_map<const c10::StorageImpl*, size_t> index_;
};

}  // namespace hyper_parallel::activation
