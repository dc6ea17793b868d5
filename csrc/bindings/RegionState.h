#pragma once
// RegionState: whether the region that pushed a PackHook is still open.
//
// A region (docs/design.md, "Regions and threads") pushes the engine's saved-tensor hooks
// on entry and pops them on exit, in single C++ calls (region_enter / region_exit in
// BindRegion.cpp), so a Python exception (KeyboardInterrupt included) can never land
// between a push and its bookkeeping. If a region is nevertheless left without its exit
// (its Python object dropped, or SwapManager().reset() started a new engine generation),
// its PackHook sees the state closed and passes every tensor through untouched, and the
// next region call on the thread pops it from autograd's hook stack.
//
// Thread-safety: `open` is written by the region's own thread (or the token's destructor);
// read with the GIL held.

#include <cstdint>

namespace hyper_parallel::bindings {

struct RegionState {
  bool open = true;
  uint64_t generation = 0;  // SwapEngine::generation() when the region began
};

}  // namespace hyper_parallel::bindings
