#pragma once
// Each Bind*.cpp adds one concept's bindings to the extension module. Bindings only
// translate between Python and the C++ core; they hold no state of their own.

#include "RegionState.h"

#include "hyper_parallel/activation/SwapGroup.h"

#include <torch/csrc/utils/pybind.h>

#include <memory>

namespace hyper_parallel::bindings {

void bind_policy(pybind11::module_& m);
void bind_swap(pybind11::module_& m);
void bind_checkpoint(pybind11::module_& m);
void bind_region(pybind11::module_& m);
void bind_trace(pybind11::module_& m);
void bind_planner(pybind11::module_& m);
void bind_intercept(pybind11::module_& m);

// BindSwap.cpp: a PackHook object for a region (`state` may be null: always live).
pybind11::object make_pack_hook(activation::PackMode mode, pybind11::object policy_fn,
                                std::shared_ptr<RegionState> state);
// Whether `hook` is a PackHook whose region is no longer open (see RegionState.h).
bool is_stale_pack_hook(const pybind11::handle& hook);

// Adds the storages of `tensors` (an iterable; non-tensors are skipped, a DTensor counts by
// its local tensor) to `group`'s never-swapped set. Needs the GIL.
void exclude_tensors(activation::SwapGroup& group, const pybind11::handle& tensors);

// Adds the storages of every parameter and buffer of the nn.Module `module` and of its
// submodules (what module.parameters() and module.buffers() yield, read straight from the
// modules' _parameters, _buffers and _modules dictionaries, so a region pays no Python
// generator walk: ~1 us for a transformer block instead of ~38 us). Needs the GIL.
void exclude_module_state(activation::SwapGroup& group, const pybind11::handle& module);

}  // namespace hyper_parallel::bindings
