#pragma once
// Which saved tensors may be swapped (SPEC 4.4). Everything else passes through untouched.
//
// Not swapped: undefined tensors; tensors without a plain storage (sparse COO/CSR/CSC/BSR/BSC,
// nested, mkldnn, and any tensor whose storage access throws);
// meta/fake/functional tensors and Python subclasses (Python/Functionalize keys);
// storages that are not resizable or have no allocator (from_blob, DLPack, numpy);
// copy-on-write storages; empty storages; leaves that require grad (parameters) and
// views of them; host tensors unless CPU swap is enabled; devices whose backend torch
// did not register.
//
// Thread-safety: pure functions.

#include "hyper_parallel/activation/SwapStats.h"

#include <ATen/core/Tensor.h>

#include <optional>

namespace hyper_parallel::activation {

enum class Ineligible : uint8_t {
  kNone = 0,
  kUndefined,
  kNoStorage,
  kMetaOrFake,
  kSubclassOrFunctional,
  kHostTensor,
  kUnsupportedDevice,
  kForeignStorage,
  kCopyOnWrite,
  kEmpty,
  kParameter,
};

const char* to_string(Ineligible reason);

// kNone when `t` may be swapped. `cpu_swap`: host tensors are swappable (test backend).
Ineligible check_eligible(const at::Tensor& t, bool cpu_swap);

// The statistics bucket of an ineligible tensor; nullopt for kNone and kUndefined (nothing
// to count).
std::optional<SkipReason> skip_reason(Ineligible reason);

// What the skip statistics count an ineligible tensor as: `key` dedupes (its storage when it
// has a plain one, else the tensor itself), `nbytes` is the memory it holds (a sparse
// tensor: its index and value tensors; mkldnn: numel * itemsize; unknown: 0). Never
// touches a storage whose access throws.
// Whether `t` is strided, not nested, and its storage can be read (t.storage() does not
// throw): what every storage-keyed lookup (registry, meter, exclusions) needs.
bool has_plain_storage(const at::Tensor& t);

struct SkipFootprint {
  const void* key = nullptr;
  size_t nbytes = 0;
};
SkipFootprint skip_footprint(const at::Tensor& t);

}  // namespace hyper_parallel::activation
