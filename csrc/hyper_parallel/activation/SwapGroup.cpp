#include "hyper_parallel/activation/SwapGroup.h"

#include "hyper_parallel/activation/SavedHandle.h"

namespace hyper_parallel::activation {

bool SwapGroup::saw_passed(const c10::StorageImpl* key) const {
  for (const auto& weak : passed) {
    if (weak._unsafe_get_target() == key) return true;
  }
  return false;
}

std::shared_ptr<StorageRecord> SwapGroup::find(const c10::StorageImpl* key) const {
  auto it = index_.find(key);
  return it == index_.end() ? nullptr : records_[it->second];
}

void SwapGroup::add(const std::shared_ptr<StorageRecord>& record) {
  if (index_.emplace(record->key(), records_.size()).second) {
    records_.push_back(record);
    if (host_pool && !record->host_pool) record->host_pool = host_pool;
  }
}

}  // namespace hyper_parallel::activation
