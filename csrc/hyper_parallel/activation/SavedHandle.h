#pragma once
// SavedHandle: what the pack hook returns for a swapped saved tensor, and what the
// unpack hook (or the selective-checkpoint cache) turns back into a tensor.
//
// It holds an alias of the saved tensor (Tensor::tensor_data(): same TensorImpl metadata
// and storage, the SAME version counter, no autograd history, so no reference cycle
// through grad_fn) plus the version seen at pack time, the storage's record and the
// invocation's group. While a handle lives, its record counts it in alias_refs.
//
// Thread-safety: immutable after construction; unpacking goes through SwapEngine.

#include "hyper_parallel/activation/SavedBytesMeter.h"
#include "hyper_parallel/activation/StorageRecord.h"

#include <ATen/core/Tensor.h>

#include <memory>

namespace hyper_parallel::activation {

class SwapGroup;

class SavedHandle {
 public:
  SavedHandle(std::shared_ptr<StorageRecord> record, std::shared_ptr<SwapGroup> group,
              at::Tensor alias)
      : record_(std::move(record)), group_(std::move(group)), alias_(std::move(alias)),
        saved_version_(alias_._version()) {
    record_->alias_refs.fetch_add(1);
  }
  ~SavedHandle() {
    record_->alias_refs.fetch_sub(1);
    SavedBytesMeter::note_release(alias_);  // its storage may die now (SavedBytesMeter.h)
  }
  SavedHandle(const SavedHandle&) = delete;
  SavedHandle& operator=(const SavedHandle&) = delete;

  const std::shared_ptr<StorageRecord>& record() const { return record_; }
  const std::shared_ptr<SwapGroup>& group() const { return group_; }
  const at::Tensor& alias() const { return alias_; }
  uint32_t saved_version() const { return saved_version_; }

 private:
  std::shared_ptr<StorageRecord> record_;
  std::shared_ptr<SwapGroup> group_;  // null for registrations (no cycle group->handle->group)
  at::Tensor alias_;
  uint32_t saved_version_;
};

}  // namespace hyper_parallel::activation
