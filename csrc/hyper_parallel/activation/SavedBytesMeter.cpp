#include "hyper_parallel/activation/SavedBytesMeter.h"

#include "hyper_parallel/activation/Eligibility.h"

#include <c10/core/Storage.h>

#include <iterator>

namespace hyper_parallel::activation {

namespace {
std::atomic<SavedBytesMeter*> g_active{nullptr};
}

SavedBytesMeter* SavedBytesMeter::active() { return g_active.load(std::memory_order_acquire); }
void SavedBytesMeter::set_active(SavedBytesMeter* meter) {
  g_active.store(meter, std::memory_order_release);
}

void SavedBytesMeter::note_release(const c10::StorageImpl* storage) noexcept {
  SavedBytesMeter* meter = active();
  if (meter == nullptr) return;
  std::lock_guard<std::mutex> lock(meter->mu_);
  try {
    meter->suspects_.push_back(storage);
  } catch (...) {  // (out of memory) every entry is checked instead
    meter->recount_all_ = true;
  }
}

void SavedBytesMeter::note_release(const at::Tensor& t) noexcept {
  if (active() == nullptr || !t.defined() || !has_plain_storage(t)) return;
  note_release(t.storage().unsafeGetStorageImpl());
}

void SavedBytesMeter::settle_locked() {
  if (recount_all_ || suspects_.size() > seen_.size()) {
    recount_locked();  // (as cheap, and it checks every storage)
    return;
  }
  // A released storage still alive (the caller holds it) is watched until it dies. The
  // watch is checked at every settle while it is short (kWatchAlways), else once per as
  // many observes as it holds: a caller that keeps every released storage (a tester: a
  // detached copy of each layer's dropped statistic) made a check per release quadratic.
  for (const c10::StorageImpl* key : suspects_) {
    if (keep_if_alive_locked(key)) watch_.insert(key);
  }
  suspects_.clear();
  if (watch_.size() > kWatchAlways && observes_since_watch_ < watch_.size()) return;
  observes_since_watch_ = 0;
  for (auto w = watch_.begin(); w != watch_.end();) {
    w = keep_if_alive_locked(*w) ? std::next(w) : watch_.erase(w);
  }
}

bool SavedBytesMeter::keep_if_alive_locked(const c10::StorageImpl* key) {
  auto it = seen_.find(key);
  if (it == seen_.end()) return false;
  if (!it->second.storage.expired()) return true;
  running_ -= it->second.counted;
  seen_.erase(it);
  return false;
}

void SavedBytesMeter::observe(const at::Tensor& t) {
  if (!has_plain_storage(t) || t.is_meta()) return;
  if (t.requires_grad() && t.is_leaf()) return;  // a parameter
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    if (base.defined() && base.requires_grad() && base.is_leaf()) return;
  }
  const c10::Storage& storage = t.storage();
  const c10::StorageImpl* key = storage.unsafeGetStorageImpl();
  std::lock_guard<std::mutex> lock(mu_);
  ++observes_since_watch_;
  // A watched storage may die with no release to announce it (its last other holder lets
  // go): the watch is checked here too, at every observe while it is short, else once per
  // as many observes as it holds (settle_locked).
  if (recount_all_ || !suspects_.empty() ||
      (!watch_.empty() &&
       (watch_.size() <= kWatchEveryObserve || observes_since_watch_ >= watch_.size()))) {
    settle_locked();
  }
  auto it = seen_.find(key);
  if (it != seen_.end() && !it->second.storage.expired()) {
    Seen& s = it->second;
    if (epoch_ >= 1 && s.first_epoch >= 1 && s.first_epoch < epoch_ && s.last_resaved != epoch_) {
      s.last_resaved = epoch_;
      resaved_[epoch_] += static_cast<int64_t>(storage.nbytes());
    }
    return;
  }
  const auto bytes = static_cast<int64_t>(storage.nbytes());
  if (it != seen_.end()) running_ -= it->second.counted;  // a dead storage's address, reused
  seen_.insert_or_assign(key, Seen{storage.getWeakStorageImpl(), epoch_, 0, bytes});
  running_ += bytes;
  if (running_ > peak_) peak_ = running_;
}

int64_t SavedBytesMeter::sample() {
  std::lock_guard<std::mutex> lock(mu_);
  return recount_locked();
}

int64_t SavedBytesMeter::recount_locked() {
  int64_t total = 0;
  for (auto it = seen_.begin(); it != seen_.end();) {
    if (auto strong = it->second.storage.lock()) {
      it->second.counted = static_cast<int64_t>(strong->nbytes());
      total += it->second.counted;
      ++it;
    } else {
      it = seen_.erase(it);
    }
  }
  // The released storages still counted (alive) are watched from now on.
  if (recount_all_) {
    // (a release went unrecorded: every storage is watched)
    for (const auto& kv : seen_) watch_.insert(kv.first);
    recount_all_ = false;
  }
  watch_.insert(suspects_.begin(), suspects_.end());
  suspects_.clear();
  for (auto w = watch_.begin(); w != watch_.end();) {
    w = seen_.count(*w) != 0 ? std::next(w) : watch_.erase(w);
  }
  observes_since_watch_ = 0;
  running_ = total;
  if (total > peak_) peak_ = total;
  return total;
}

int64_t SavedBytesMeter::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

int64_t SavedBytesMeter::observed_storages() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(seen_.size());
}

void SavedBytesMeter::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  seen_.clear();
  suspects_.clear();
  watch_.clear();
  recount_all_ = false;
  running_ = 0;
  peak_ = 0;
  epoch_ = 0;
  resaved_.clear();
}

void SavedBytesMeter::begin_epoch(int epoch) {
  std::lock_guard<std::mutex> lock(mu_);
  epoch_ = epoch;
}

int64_t SavedBytesMeter::resaved_bytes(int epoch) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = resaved_.find(epoch);
  return it == resaved_.end() ? 0 : it->second;
}

std::optional<int> SavedBytesMeter::first_epoch(const at::Tensor& t) const {
  if (!has_plain_storage(t)) return std::nullopt;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(t.storage().unsafeGetStorageImpl());
  if (it == seen_.end() || it->second.storage.expired()) return std::nullopt;
  return it->second.first_epoch;
}

bool SavedBytesMeter::saved_in(const at::Tensor& t, int epoch) const {
  if (!has_plain_storage(t)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seen_.find(t.storage().unsafeGetStorageImpl());
  if (it == seen_.end() || it->second.storage.expired()) return false;
  return it->second.first_epoch == epoch || it->second.last_resaved == epoch;
}

int64_t SavedBytesMeter::live_bytes(int epoch) const {
  std::lock_guard<std::mutex> lock(mu_);
  int64_t total = 0;
  for (const auto& kv : seen_) {
    if (kv.second.first_epoch != epoch) continue;
    if (auto strong = kv.second.storage.lock()) total += static_cast<int64_t>(strong->nbytes());
  }
  return total;
}

}  // namespace hyper_parallel::activation
