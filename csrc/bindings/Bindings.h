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

}  // namespace hyper_parallel::bindings
