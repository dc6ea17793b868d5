#pragma once
// A set of addresses that is built often and stays small: a swap group's never-swapped
// storages (the wrapped module's parameters and buffers, added at every region entry) and
// its skipped saved tensors (docs/design.md, "Regions and threads"). The first 16 keys live
// inside the object and are found by a scan (no allocation: a transformer block has 9-20
// parameters and buffers); later keys go to a hash set. An unordered_set alone made a heap
// node per key and a bucket array at every region entry (issue 17).
//
// Thread-safety: none of its own (a group's sets are used under the engine's mutex or by
// the thread running the group's forward).

#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstddef>
#include <unordered_set>

namespace hyper_parallel::activation {

class PointerSet {
 public:
  // Adds `key`; false when it was there already.
  bool insert(const void* key) {
    if (count(key) != 0) return false;
    if (small_.size() < kInline) {
      small_.push_back(key);
    } else {
      large_.insert(key);
    }
    return true;
  }
  // 1 when `key` was inserted, else 0 (std::unordered_set's count).
  size_t count(const void* key) const {
    if (std::find(small_.begin(), small_.end(), key) != small_.end()) return 1;
    return large_.empty() ? 0 : large_.count(key);
  }
  bool empty() const { return small_.empty(); }
  size_t size() const { return small_.size() + large_.size(); }

 private:
  static constexpr size_t kInline = 16;
  c10::SmallVector<const void*, kInline> small_;
  std::unordered_set<const void*> large_;
};

}  // namespace hyper_parallel::activation
