#include "hyper_parallel/activation/StorageRecord.h"

#include "hyper_parallel/activation/SwapGroup.h"
#include "hyper_parallel/common/Macros.h"

namespace hyper_parallel::activation {

const char* to_string(Residency r) {
  switch (r) {
    case Residency::kDevice: return "device";
    case Residency::kOffloading: return "offloading";
    case Residency::kHost: return "host";
    case Residency::kReloading: return "reloading";
  }
  return "unknown";
}

StorageRecord::StorageRecord(const c10::Storage& storage, c10::ScalarType dtype,
                             std::shared_ptr<SwapStatsCounters> stats)
    : storage_(storage.getWeakStorageImpl()),
      key_(storage.unsafeGetStorageImpl()),
      nbytes_(storage.nbytes()),
      device_(storage.device()),
      dtype_(dtype),
      stats_(std::move(stats)) {
  stats_->add_resident(static_cast<int64_t>(nbytes_));
}

StorageRecord::~StorageRecord() {
  if (state_ == Residency::kDevice || state_ == Residency::kReloading) {
    stats_->add_resident(-static_cast<int64_t>(nbytes_));
  }
  // `host` (if any) goes back to its pool here, pending on the last copy that used it.
}

c10::Storage StorageRecord::storage() const {
  auto strong = storage_.lock();
  if (!strong) return c10::Storage();
  return c10::Storage(std::move(strong));
}

void StorageRecord::transition(Residency to) {
  const Residency from = state_;
  const bool legal = (from == Residency::kDevice && to == Residency::kOffloading) ||
                     (from == Residency::kOffloading && to == Residency::kHost) ||
                     (from == Residency::kOffloading && to == Residency::kReloading) ||
                     (from == Residency::kHost && to == Residency::kReloading) ||
                     (from == Residency::kReloading && to == Residency::kDevice);
  HP_INTERNAL_ASSERT(legal, "illegal residency transition ", to_string(from), " -> ",
                     to_string(to), " for a storage of ", nbytes_, " bytes");
  if (from == Residency::kDevice) stats_->add_resident(-static_cast<int64_t>(nbytes_));
  if (to == Residency::kReloading) stats_->add_resident(static_cast<int64_t>(nbytes_));
  state_ = to;
}

bool StorageRecord::released_by_all_holders() const {
  for (const auto& weak : holders) {
    if (auto group = weak.lock()) {
      if (!group->released) return false;
    }
  }
  return true;
}

bool StorageRecord::may_leave_device() const {
  if (in_use_by_backward) return false;
  for (const auto& weak : holders) {
    if (auto group = weak.lock()) {
      if (!group->released || group->backward_started) return false;
    }
  }
  return true;
}

}  // namespace hyper_parallel::activation
