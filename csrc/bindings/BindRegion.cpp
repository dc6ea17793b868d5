// Region entry and exit as single C++ calls (docs/design.md, "Regions and threads").
//
// A region starts (or joins) a swap group, excludes the module's parameters, and pushes
// the engine's saved-tensor hooks; its exit pops the hooks and ends or aborts the group.
// Each of the two is one call from Python, so no Python exception (KeyboardInterrupt from
// a signal handler included: CPython delivers those between bytecodes only) can land
// between a push and the bookkeeping that undoes it. What can still be lost is the token
// itself (an exception after region_enter returned, before its caller kept it); its
// destructor then abandons the region, and RegionState makes its hook inert.

#include "Bindings.h"

#include "hyper_parallel/activation/SwapEngine.h"
#include "hyper_parallel/common/Macros.h"

namespace py = pybind11;

namespace hyper_parallel::bindings {

using namespace activation;

namespace {

// torch's own bindings of autograd's saved-tensor default-hook stack (the ones
// torch.autograd.graph.saved_tensors_hooks uses; stable across torch 2.4-2.14).
struct HookStack {
  py::object push, pop, top, unpack;
};

const HookStack& hook_stack() {
  // Leaked on purpose: Python objects must not be destroyed after interpreter shutdown.
  static HookStack* stack = [] {
    py::module_ autograd = py::module_::import("torch._C._autograd");
    return new HookStack{autograd.attr("_push_saved_tensors_default_hooks"),
                         autograd.attr("_pop_saved_tensors_default_hooks"),
                         autograd.attr("_top_saved_tensors_default_hooks"),
                         py::module_::import("hyper_parallel._C").attr("unpack_hook")};
  }();
  return *stack;
}

// Pops the hooks of regions that were left without their exit, while they are on top of
// this thread's stack. Returns how many were popped.
int pop_stale_hooks() {
  const HookStack& hs = hook_stack();
  int popped = 0;
  for (;;) {
    py::object top = hs.top(false);
    if (top.is_none()) break;
    py::tuple pair = top.cast<py::tuple>();
    if (!is_stale_pack_hook(pair[0])) break;
    hs.pop();
    ++popped;
  }
  return popped;
}

class RegionToken {
 public:
  RegionToken(std::shared_ptr<SwapGroup> group, bool joined)
      : group_(std::move(group)), joined_(joined), state_(std::make_shared<RegionState>()) {
    state_->generation = SwapEngine::generation();
  }
  ~RegionToken() {
    // Dropped while open: the region's exit never ran (see the file comment).
    if (state_->open) {
      state_->open = false;
      if (!joined_ && group_) SwapEngine::global().abandon_forward(group_);
    }
  }
  RegionToken(const RegionToken&) = delete;
  RegionToken& operator=(const RegionToken&) = delete;

  const std::shared_ptr<SwapGroup>& group() const { return group_; }
  bool joined() const { return joined_; }
  bool pushed() const { return pushed_; }
  bool open() const { return state_->open; }
  const std::shared_ptr<RegionState>& state() const { return state_; }
  void set_pushed() { pushed_ = true; }
  void close() { state_->open = false; }
  bool current_generation() const { return state_->generation == SwapEngine::generation(); }

 private:
  std::shared_ptr<SwapGroup> group_;
  bool joined_;
  bool pushed_ = false;
  std::shared_ptr<RegionState> state_;
};

std::shared_ptr<RegionToken> region_enter(int64_t layer, const std::string& name, bool manual,
                                          bool group_swap, const py::object& exclude,
                                          const py::object& pack_mode, const py::object& policy_fn,
                                          bool push) {
  SwapEngine& engine = SwapEngine::global();
  pop_stale_hooks();
  std::shared_ptr<RegionToken> token;
  auto outer = (layer < 0 && !manual) ? engine.current_group() : nullptr;
  if (outer && outer->layer() >= 0) {
    // An unscheduled region inside a scheduled layer's forward joins its invocation.
    token = std::make_shared<RegionToken>(outer, /*joined=*/true);
    if (group_swap) outer->set_group_swap(true);
  } else {
    token = std::make_shared<RegionToken>(engine.begin_forward(layer, name, manual, group_swap),
                                          /*joined=*/false);
  }
  try {
    if (!exclude.is_none()) {
      py::cast(token->group()).attr("exclude")(exclude);  // SwapGroup.exclude (DTensor-aware)
    }
    if (push && !pack_mode.is_none()) {
      const HookStack& hs = hook_stack();
      hs.push(make_pack_hook(pack_mode.cast<PackMode>(), policy_fn, token->state()), hs.unpack);
      token->set_pushed();
    }
  } catch (...) {
    token->close();
    if (!token->joined()) engine.abort_forward(token->group());
    throw;
  }
  return token;
}

// Returns true when the region was unscheduled and held records (the caller may warn).
// Idempotent: a second exit (or the exit of a region reset() made stale) does nothing
// beyond popping its hook.
bool region_exit(RegionToken& token, bool ok) {
  if (!token.open()) return false;
  token.close();
  if (token.pushed()) pop_stale_hooks();  // ours is stale now, and so is anything left above
  if (token.joined() || !token.current_generation()) return false;
  SwapEngine& engine = SwapEngine::global();
  if (!ok) {
    engine.abort_forward(token.group());
    return false;
  }
  return engine.end_forward(token.group());
}

}  // namespace

void bind_region(py::module_& m) {
  py::class_<RegionToken, std::shared_ptr<RegionToken>>(m, "RegionToken",
      "An open region: its swap group and whether it pushed the saved-tensor hooks.")
      .def_property_readonly("group", &RegionToken::group)
      .def_property_readonly("joined", &RegionToken::joined)
      .def_property_readonly("pushed", &RegionToken::pushed)
      .def_property_readonly("open", &RegionToken::open);
  m.def("region_enter", &region_enter, py::arg("layer"), py::arg("name"), py::arg("manual"),
        py::arg("group_swap"), py::arg("exclude"), py::arg("pack_mode"), py::arg("policy_fn"),
        py::arg("push"),
        "Begins (or joins) the group of one layer invocation, excludes `exclude`'s storages and, "
        "with `push`, pushes the engine's saved-tensor hooks, all in one call.");
  m.def("region_exit", &region_exit, py::arg("token"), py::arg("ok"),
        "Pops the region's hooks and ends (`ok`) or aborts its group, in one call.");
  m.def("pop_stale_hooks", &pop_stale_hooks,
        "Pops this thread's saved-tensor hooks of regions that were left without their exit.");
}

}  // namespace hyper_parallel::bindings
