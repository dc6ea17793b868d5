#pragma once
// Each Bind*.cpp adds one concept's bindings to the extension module. Bindings only
// translate between Python and the C++ core; they hold no state of their own.

#include <torch/csrc/utils/pybind.h>

namespace hyper_parallel::bindings {

void bind_policy(pybind11::module_& m);
void bind_swap(pybind11::module_& m);
void bind_checkpoint(pybind11::module_& m);

}  // namespace hyper_parallel::bindings
