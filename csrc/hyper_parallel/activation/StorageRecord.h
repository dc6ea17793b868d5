#pragma once
// StorageRecord: one device storage under swap management, and its residency state.
//
// Residency (docs/design.md, "Residency state machine"):
//
//   kDevice --offload--> kOffloading --(d2h observed done)--> kHost
//      ^                     |                                  |
//      |                     +-------------reload---------------+
//      |                                   v
//      +-----------wait_resident------ kReloading
//
// kDevice:     device bytes valid; no host copy.
// kOffloading: device memory released (storage nbytes == 0); the D2H copy into the host
//              block is queued; host bytes valid once d2h_done completes.
// kHost:       as kOffloading, d2h_done known complete.
// kReloading:  device memory re-allocated in place; H2D queued (after d2h_done); device
//              bytes valid once h2d_done completes.
// Every transition goes through transition(), which throws on an illegal one.
//
// One record per StorageImpl (AliasRegistry): every tensor, view or alias of that storage
// shares it, so a storage is copied once and refilled once, whatever views were saved.
// The record holds the StorageImpl weakly: it never keeps an activation alive.
//
// Thread-safety: fields are guarded by the SwapEngine lock, except the atomics.

#include "hyper_parallel/activation/CopyEngine.h"
#include "hyper_parallel/activation/HostBufferPool.h"
#include "hyper_parallel/activation/SwapStats.h"

#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <atomic>
#include <memory>
#include <vector>

namespace hyper_parallel::activation {

class SwapGroup;

enum class Residency : uint8_t { kDevice, kOffloading, kHost, kReloading };
const char* to_string(Residency r);

class StorageRecord {
 public:
  StorageRecord(const c10::Storage& storage, c10::ScalarType dtype,
                std::shared_ptr<SwapStatsCounters> stats);
  ~StorageRecord();
  StorageRecord(const StorageRecord&) = delete;
  StorageRecord& operator=(const StorageRecord&) = delete;

  // The storage, or an undefined Storage if it died.
  c10::Storage storage() const;
  const c10::StorageImpl* key() const { return key_; }
  size_t nbytes() const { return nbytes_; }
  c10::Device device() const { return device_; }
  c10::ScalarType dtype() const { return dtype_; }
  Residency state() const { return state_; }
  // Moves to `to`; throws c10::Error if the transition is not in the diagram above.
  void transition(Residency to);

  // Live tensors that hyper_parallel itself holds on this storage (saved-tensor handles
  // and registrations). Used to tell whether anyone else still uses the storage.
  std::atomic<int64_t> alias_refs{0};

  // Groups (layer invocations) that hold this record, and whether each released it.
  std::vector<std::weak_ptr<SwapGroup>> holders;
  // True when every holder that is still alive has released the record.
  bool released_by_all_holders() const;
  // True once autograd (or the selective-checkpoint cache) was handed this storage by
  // unpack(): from then on it is being read by a backward and never leaves the device
  // again (docs/design.md, "Who may release a storage").
  bool in_use_by_backward = false;
  // Whether the record may leave the device now: every live holder released it, no
  // holder's backward has begun, and no backward was handed the storage.
  bool may_leave_device() const;

  // True once the record was offloaded, or counted as kept on device at a backward start
  // (SwapStats skipped: kInUseElsewhere, kLastLayer): it is counted at most once.
  bool settled = false;
  // True once a release found no room for it under its PinnedMemoryPool's cap, the pool
  // made to keep such storages on the device (HostBufferPool::keep_when_full): counted as
  // SkipReason::kHostPoolFull then (and `settled`), the count taken back if a later
  // release moves it.
  bool pool_refused = false;

  // Copy state (meaningful outside kDevice).
  std::shared_ptr<HostBlock> host;   // shared by the records of one fused bucket
  // The pool its host blocks come from (the first group that held it chose it, e.g. a
  // PinnedMemoryPool given as cpu_pool=); null: the engine's pool for its device.
  std::shared_ptr<HostBufferPool> host_pool;
  size_t host_offset = 0;
  CopyEventPtr d2h_done;
  CopyEventPtr h2d_done;
  // Records offloaded together in one fused bucket (including this one); reloaded together.
  std::shared_ptr<std::vector<std::weak_ptr<StorageRecord>>> bucket;

 private:
  c10::weak_intrusive_ptr<c10::StorageImpl> storage_;
  const c10::StorageImpl* key_;
  size_t nbytes_;
  c10::Device device_;
  c10::ScalarType dtype_;
  Residency state_ = Residency::kDevice;
  std::shared_ptr<SwapStatsCounters> stats_;
};

}  // namespace hyper_parallel::activation
