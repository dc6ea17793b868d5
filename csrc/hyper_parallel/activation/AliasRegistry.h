#pragma once
// AliasRegistry: StorageImpl* -> StorageRecord, shared by all groups.
//
// The only way to get a record, so two saved views of one storage (or one storage saved
// by two layers) share one record and are copied once (SPEC 4.3). Entries hold records
// weakly and records hold their storage weakly; a record's weak reference keeps the
// StorageImpl object's address from being reused, so a stale entry never aliases a new
// storage. Expired entries are swept when the map doubles in size.
//
// Thread-safety: guarded by the SwapEngine lock.

#include "hyper_parallel/activation/StorageRecord.h"

#include <memory>
#include <unordered_map>

namespace hyper_parallel::activation {

class AliasRegistry {
 public:
  explicit AliasRegistry(std::shared_ptr<SwapStatsCounters> stats) : stats_(std::move(stats)) {}

  // The live record for `storage`, created (state kDevice) if there is none.
  std::shared_ptr<StorageRecord> get_or_create(const c10::Storage& storage,
                                               c10::ScalarType dtype);
  // The live record for `storage`, or null.
  std::shared_ptr<StorageRecord> find(const c10::StorageImpl* storage) const;
  size_t live_records() const;
  void clear() { map_.clear(); }

 private:
  void sweep();
  std::shared_ptr<SwapStatsCounters> stats_;
  std::unordered_map<const c10::StorageImpl*, std::weak_ptr<StorageRecord>> map_;
  size_t sweep_at_ = 1024;
};

}  // namespace hyper_parallel::activation
