#pragma once
// Which saved tensors may be swapped (SPEC 4.4). Everything else passes through untouched.
//
// Not swapped: undefined tensors; tensors without a storage (sparse, nested, mkldnn);
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

}  // namespace hyper_parallel::activation
