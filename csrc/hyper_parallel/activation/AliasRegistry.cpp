#include "hyper_parallel/activation/AliasRegistry.h"

namespace hyper_parallel::activation {

std::shared_ptr<StorageRecord> AliasRegistry::get_or_create(const c10::Storage& storage,
                                                            c10::ScalarType dtype) {
  const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
  auto& slot = map_[key];
  if (auto record = slot.lock()) {
    if (record->storage().unsafeGetStorageImpl() == key) return record;
  }
  auto record = std::make_shared<StorageRecord>(storage, dtype, stats_);
  slot = record;
  if (map_.size() >= sweep_at_) sweep();
  return record;
}

std::shared_ptr<StorageRecord> AliasRegistry::find(const c10::StorageImpl* storage) const {
  auto it = map_.find(storage);
  if (it == map_.end()) return nullptr;
  auto record = it->second.lock();
  if (record && record->storage().unsafeGetStorageImpl() == storage) return record;
  return nullptr;
}

size_t AliasRegistry::live_records() const {
  size_t n = 0;
  for (const auto& kv : map_) n += kv.second.expired() ? 0 : 1;
  return n;
}

void AliasRegistry::sweep() {
  for (auto it = map_.begin(); it != map_.end();) {
    it = it->second.expired() ? map_.erase(it) : std::next(it);
  }
  sweep_at_ = std::max<size_t>(1024, map_.size() * 2);
}

}  // namespace hyper_parallel::activation
