#pragma once
// Each Bind*.cpp adds one concept's bindings to the extension module. Bindings only
// translate between Python and the C++ core; they hold no state of their own.

#include "RegionState.h"

#include "hyper_parallel/activation/SwapGroup.h"

#include <c10/core/impl/LocalDispatchKeySet.h>
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
void bind_swap_call(pybind11::module_& m);

// True inside a torch.func transform (grad, vjp, jacrev, vmap, ...) on this thread: the
// functorch front-mode key is in the thread's included dispatch keys while its layer stack
// is not empty. torch.func supports no saved-tensor hooks, so no region pushes them there
// (_region.in_func_transform). (ATen/functorch/DynamicLayer.h's maybeCurrentDynamicLayer
// says the same, but its header needs nlohmann/json, which torch does not ship.)
inline bool in_func_transform() {
  return c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode);
}

// getattr(obj, name, None) with Python's meaning: None only when the lookup raises
// AttributeError; any other exception (a property that fails) propagates as
// py::error_already_set. (pybind11's getattr with a default swallows every exception, and
// py::hasattr every one too.) Needs the GIL. Defined in BindSwapCall.cpp.
pybind11::object attr_or_none(const pybind11::handle& obj, const pybind11::handle& name);
pybind11::object attr_or_none(const pybind11::handle& obj, const char* name);

// BindSwap.cpp: a PackHook object for a region (`state` may be null: always live), a
// recycled one when one is free.
pybind11::object make_pack_hook(activation::PackMode mode, pybind11::object policy_fn,
                                std::shared_ptr<RegionState> state);
// Hands a hook whose region ended (popped from autograd's stack) back for reuse by
// make_pack_hook, which reuses it once nothing else references it. Needs the GIL.
void recycle_pack_hook(pybind11::object hook);
// PackHook objects make_pack_hook created (not reused) since import (tests).
int64_t pack_hooks_made();
// Whether `hook` is a PackHook whose region is no longer open (see RegionState.h).
bool is_stale_pack_hook(const pybind11::handle& hook);
// Whether `hook`'s type is exactly PackHook (one pointer compare, no lookup).
bool is_pack_hook(PyObject* hook);

// Adds the storages of `tensors` (an iterable; non-tensors are skipped, a DTensor counts by
// its local tensor) to `group`'s never-swapped set. Needs the GIL.
void exclude_tensors(activation::SwapGroup& group, const pybind11::handle& tensors);

// Adds the storages of every parameter and buffer of the nn.Module `module` and of its
// submodules (what module.parameters() and module.buffers() yield, read straight from the
// modules' _parameters, _buffers and _modules dictionaries, so a region pays no Python
// generator walk: ~1 us for a transformer block instead of ~38 us). Needs the GIL.
void exclude_module_state(activation::SwapGroup& group, const pybind11::handle& module);

// After a release point (region exit, end_forward, launch_offload): the engine's one-time
// warning of a PinnedMemoryPool(when_full="keep") that had no room (an atomic load when
// there is none), as a Python UserWarning; throws py::error_already_set when warnings are
// errors. Needs the GIL. Defined in BindSwap.cpp.
void warn_pool_refusal();

// BindRegion.cpp: `fn(*args, **kwargs)` in a SWAP_ALL region (region entry, the call, the
// exit with the outputs) in one call; `on_flags(token, flags, out, layer, name)` runs after
// the exit when its flags need Python or `python_hooks`. Needs the GIL.
pybind11::object run_region(int64_t layer, const std::string& name, const pybind11::object& fn,
                            const pybind11::object& args, const pybind11::object& kwargs,
                            const pybind11::object& policy_fn, bool group_swap,
                            const pybind11::object& pool, const pybind11::object& state_module,
                            bool python_hooks, const pybind11::object& on_flags);

}  // namespace hyper_parallel::bindings
