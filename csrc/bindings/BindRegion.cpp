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

#include "hyper_parallel/activation/HostBufferPool.h"
#include "hyper_parallel/activation/SwapEngine.h"
#include "hyper_parallel/common/Macros.h"

#include <ATen/SavedTensorHooks.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/node.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <c10/util/SmallVector.h>

namespace py = pybind11;

namespace hyper_parallel::bindings {

using namespace activation;

namespace {

// This thread's stack of autograd's saved-tensor default hooks (the one
// torch.autograd.graph.saved_tensors_hooks pushes on), read and changed in C++: the
// region's steady state makes one push, one read of the top and one pop per region, and
// through torch's Python bindings (torch._C._autograd._push/_pop/_top_saved_tensors_default_
// hooks) each of them was a Python call building its arguments and, for the top, a tuple
// (about a quarter of a region's host instructions, issue 17). The at:: API used here has
// these signatures on torch 2.6-2.14 (research/cpp_feasibility.md Q5); a push while
// hooks are disabled, or a read while dynamo traces, goes through the Python binding,
// which raises torch's own error or gives torch's own answer.
// Thread-safety: the stack is thread-local; callers hold the GIL (the hooks' refcounts).
namespace hooks {

// torch's bindings (the paths above), looked up once; leaked on purpose: no Python object
// may be destroyed after interpreter shutdown.
struct PythonBindings {
  py::object push, top, unpack;
};

const PythonBindings& bindings() {
  static PythonBindings* b = [] {
    py::module_ autograd = py::module_::import("torch._C._autograd");
    return new PythonBindings{autograd.attr("_push_saved_tensors_default_hooks"),
                              autograd.attr("_top_saved_tensors_default_hooks"),
                              py::module_::import("hyper_parallel._C").attr("unpack_hook")};
  }();
  return *b;
}

// The pack hook on top of this thread's stack (borrowed), or null when the stack is empty
// (or, as torch's own reader says then, while dynamo traces).
PyObject* top_pack() {
  const auto& tls = at::SavedTensorDefaultHooks::get_tls_state();
  if (tls.stack.empty()) return nullptr;
  if (tls.is_tracing) {
    py::object top = bindings().top(false);
    return top.is_none() ? nullptr : PyTuple_GET_ITEM(top.ptr(), 0);  // held by the stack
  }
  return tls.stack.top().first.ptr(getPyInterpreter());
}

// Pushes (pack, the engine's unpack hook).
void push(const py::object& pack) {
  const PythonBindings& b = bindings();
  if (!at::SavedTensorDefaultHooks::is_enabled()) {
    b.push(pack, b.unpack);  // raises torch's error (hooks disabled here, and why)
    return;
  }
  at::SavedTensorDefaultHooks::lazy_initialize();
  c10::impl::PyInterpreter* interp = getPyInterpreter();
  // SafePyObject takes over one reference of each.
  at::SavedTensorDefaultHooks::push_hooks(c10::SafePyObject(pack.inc_ref().ptr(), interp),
                                          c10::SafePyObject(b.unpack.inc_ref().ptr(), interp));
}

// Pops the top pair (the stack is not empty: the caller read its top).
void pop() { at::SavedTensorDefaultHooks::pop_hooks(); }

}  // namespace hooks

// Stale hooks appear only when a region is left without its exit (its token dropped while
// open) or when reset() starts a new engine generation. Both bump this epoch; a thread
// scans its hook stack on region entry only when the epoch moved since its last scan, so
// a region in steady state makes no call into autograd's hook stack on entry (issue 17).
std::atomic<uint64_t> g_stale_epoch{0};
// Epoch at this thread's last scan that left its hook stack empty (~0: never).
thread_local uint64_t t_scanned_epoch = ~uint64_t{0};

uint64_t stale_epoch() { return g_stale_epoch.load() + SwapEngine::generation(); }

// Scans of the hook stack made by region entries and exits (tests: none in steady state).
std::atomic<int64_t> g_hook_scans{0};

// Pops the hooks of regions that were left without their exit, while they are on top of
// this thread's stack. Returns how many were popped.
// When the scan empties the stack, no stale hook can be left below: the thread is clean
// until the epoch moves again. (A scan that stops at a live hook may leave stale ones
// under it, so the next entry or exit scans again.)
int pop_stale_hooks() {
  g_hook_scans.fetch_add(1, std::memory_order_relaxed);
  const uint64_t epoch = stale_epoch();
  int popped = 0;
  for (;;) {
    PyObject* top = hooks::top_pack();
    if (top == nullptr) {
      t_scanned_epoch = epoch;
      break;
    }
    if (!is_stale_pack_hook(top)) break;
    hooks::pop();
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
      if (pushed_) g_stale_epoch.fetch_add(1);
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
  void set_pushed(py::object hook) {
    pushed_ = true;
    hook_ = std::move(hook);
  }
  // The pack hook this region pushed (None when it pushed none).
  const py::object& hook() const { return hook_; }
  // Hands the hook back for reuse once it is off the stack (region_exit).
  void recycle_hook() { recycle_pack_hook(std::move(hook_)); hook_ = py::none(); }
  void close() { state_->open = false; }
  bool current_generation() const { return state_->generation == SwapEngine::generation(); }

 private:
  std::shared_ptr<SwapGroup> group_;
  bool joined_;
  bool pushed_ = false;
  py::object hook_;
  std::shared_ptr<RegionState> state_;
};

// True when the innermost saved-tensor hooks of this thread are torch.utils.checkpoint's
// (the frame our checkpoint regions are built on): such a frame recomputes what is saved
// inside it, so no region may hide its hook with ours (_region.in_checkpoint_forward).
bool under_checkpoint_frame() {
  PyObject* top = hooks::top_pack();
  if (top == nullptr || is_pack_hook(top)) return false;  // none, or one of ours
  py::object pack = py::reinterpret_borrow<py::object>(top);
  py::object module = attr_or_none(pack, "__module__");
  return PyUnicode_Check(module.ptr()) &&
         PyUnicode_CompareWithASCIIString(module.ptr(), "torch.utils.checkpoint") == 0;
}

// `exclude`: tensors never swapped by this invocation (None: none); `state_module`: an
// nn.Module whose parameters and buffers are never swapped (None: none); `pool`: the
// HostPool of this invocation's host blocks (None: the engine's; ignored when joined);
// `push` with `auto_push`: push only when grad mode is on and no torch checkpoint frame's
// hooks are innermost (what every Python region asks for: _region.Region, run_region).
// (`mode`: the pack hook's mode, none: push no hook; region_enter below takes it as a
// Python PackMode or None.)
std::shared_ptr<RegionToken> region_enter_mode(int64_t layer, const std::string& name,
                                               bool manual, bool group_swap,
                                               const py::object& exclude,
                                               std::optional<PackMode> mode,
                                               const py::object& policy_fn, bool push,
                                               const py::object& pool,
                                               const py::object& state_module, bool auto_push) {
  SwapEngine& engine = SwapEngine::global();
  if (t_scanned_epoch != stale_epoch()) pop_stale_hooks();
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
    if (!exclude.is_none()) exclude_tensors(*token->group(), exclude);  // DTensor-aware
    if (!state_module.is_none()) exclude_module_state(*token->group(), state_module);
    if (!pool.is_none() && !token->joined()) {
      token->group()->host_pool = pool.cast<std::shared_ptr<HostBufferPool>>();
    }
    // Not under a torch.func transform either: it supports no saved-tensor hooks.
    if (push && auto_push) {
      push = at::GradMode::is_enabled() && !in_func_transform() &&
             !under_checkpoint_frame();
    }
    if (push && mode) {
      py::object hook = make_pack_hook(*mode, policy_fn, token->state());
      hooks::push(hook);
      token->set_pushed(std::move(hook));
    }
  } catch (...) {
    token->close();
    if (!token->joined()) engine.abort_forward(token->group());
    throw;
  }
  return token;
}

std::shared_ptr<RegionToken> region_enter(int64_t layer, const std::string& name, bool manual,
                                          bool group_swap, const py::object& exclude,
                                          const py::object& pack_mode, const py::object& policy_fn,
                                          bool push, const py::object& pool,
                                          const py::object& state_module, bool auto_push) {
  std::optional<PackMode> mode;
  if (!pack_mode.is_none()) mode = pack_mode.cast<PackMode>();
  return region_enter_mode(layer, name, manual, group_swap, exclude, mode, policy_fn, push, pool,
                           state_module, auto_push);
}

// What region_exit tells its caller (bit flags), so that the Python side of a region in
// steady state makes no further call: kExitUnscheduled when the region was unscheduled and
// held records (the caller may warn), kExitDiagnose when its group has something for the
// diagnostics to look at (a skipped tensor, a forward against the chain).
constexpr int kExitUnscheduled = 1;
constexpr int kExitDiagnose = 2;
constexpr int kExitAttached = 4;

// Idempotent: a second exit (or the exit of a region reset() made stale) does nothing
// beyond popping its hook.
// Pops the hook `token` pushed when it is on top of this thread's stack (the steady state:
// one read of the top, one pop); otherwise, or when hooks went stale since this thread's
// last scan, scans as pop_stale_hooks does (ours is stale now, and so is anything that a
// region left open above it).
void pop_own_hook(RegionToken& token) {
  if (t_scanned_epoch == stale_epoch()) {
    if (hooks::top_pack() == token.hook().ptr()) {
      hooks::pop();
      token.recycle_hook();
      return;
    }
  }
  pop_stale_hooks();
}

int attach_backward(const std::shared_ptr<SwapGroup>& group, const py::handle& outputs);

// With `outputs` (not None) and `ok`, also attaches the backward start to the outputs'
// nodes (attach_backward) when the region has a backward to start: not joined, and
// scheduled or holding records. kExitAttached tells the caller it did.
int region_exit(RegionToken& token, bool ok, const py::object& outputs) {
  if (!token.open()) return 0;
  token.close();
  if (token.pushed()) pop_own_hook(token);
  if (token.joined() || !token.current_generation()) return 0;
  SwapEngine& engine = SwapEngine::global();
  if (!ok) {
    engine.abort_forward(token.group());
    return 0;
  }
  int flags = engine.end_forward(token.group()) ? kExitUnscheduled : 0;
  const SwapGroup& g = *token.group();
  if (g.order_reversed || !g.skipped_keys.empty()) flags |= kExitDiagnose;
  if (!outputs.is_none() && (g.layer() >= 0 || !g.records().empty())) {
    attach_backward(token.group(), outputs);
    flags |= kExitAttached;
  }
  warn_pool_refusal();
  return flags;
}

}  // namespace

// `fn(*args, **kwargs)` in a SWAP_ALL region: region_enter, the call, region_exit with the
// outputs, in one call from Python and with no Python object per region (the swap
// wrappers' path, issue 17). `on_flags(token, flags, out, layer, name)` runs after a successful exit
// only when the exit flags say something needs Python (flags 1 or 2) or when
// `python_hooks` (a meter samples, compiled autograd: the backward start is then attached
// by `on_flags` in Python, not here). An exception from `fn` aborts the region and
// propagates unchanged.
py::object run_region(int64_t layer, const std::string& name, const py::object& fn,
                      const py::object& args, const py::object& kwargs,
                      const py::object& policy_fn, bool group_swap, const py::object& pool,
                      const py::object& state_module, bool python_hooks,
                      const py::object& on_flags) {
  auto token = region_enter_mode(layer, name, false, group_swap, py::none(), PackMode::kSwapAll,
                                 policy_fn, true, pool, state_module, true);
  PyObject* raw = PyObject_Call(fn.ptr(), args.ptr(), kwargs.is_none() ? nullptr : kwargs.ptr());
  if (raw == nullptr) {
    py::error_already_set error;  // fetched: the exit below may call into Python
    region_exit(*token, false, py::none());
    throw error;
  }
  py::object out = py::reinterpret_steal<py::object>(raw);
  const int flags = region_exit(*token, true, python_hooks ? py::none() : out);
  if ((flags & (kExitUnscheduled | kExitDiagnose)) != 0 || python_hooks) {
    on_flags(token, flags, out, layer, name);
  }
  return out;
}

namespace {

// Pre-hook on a region's output nodes (C++, no Python call in backward): starts the
// prefetch of the invocation once, then lets go of the group, so the group dies with its
// last saved tensor rather than with the graph. One shared state per region: the first of
// its output nodes to run fires it. Runs on the autograd thread, without the GIL.
struct BackwardStartState {
  std::mutex mu;
  std::shared_ptr<SwapGroup> group;
};

class BackwardStartHook final : public torch::autograd::FunctionPreHook {
 public:
  explicit BackwardStartHook(std::shared_ptr<BackwardStartState> state) : state_(std::move(state)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& grads) override {
    std::shared_ptr<SwapGroup> group;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      group = std::move(state_->group);
      state_->group.reset();
    }
    if (group) SwapEngine::global().backward_begin(group);
    return grads;
  }

 private:
  std::shared_ptr<BackwardStartState> state_;
};

std::atomic<int64_t> g_backward_hooks{0};  // nodes given a BackwardStartHook (tests)

// Tensor::grad_fn()'s pointer type (std::shared_ptr up to torch 2.12, c10::intrusive_ptr
// since).
using NodePtr = std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())>;

// The distinct output nodes of a region, in the order first seen: a block returns one to a
// few tensors, so a linear scan, inline, no allocation below 4.
using OutputNodes = c10::SmallVector<NodePtr, 4>;

void add_output_nodes(const py::handle& obj, OutputNodes& nodes, int depth) {
  if (THPVariable_Check(obj.ptr())) {
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    auto fn = t.grad_fn();
    if (!fn) return;
    for (const auto& seen : nodes) {
      if (seen.get() == fn.get()) return;
    }
    nodes.push_back(std::move(fn));
    return;
  }
  if (depth > 8) return;
  if (PyTuple_Check(obj.ptr()) || PyList_Check(obj.ptr())) {
    for (const py::handle item : obj) add_output_nodes(item, nodes, depth + 1);
  } else if (PyDict_Check(obj.ptr())) {
    for (const auto item : py::reinterpret_borrow<py::dict>(obj)) {
      add_output_nodes(item.second, nodes, depth + 1);
    }
  }
}

// Adds one BackwardStartHook per distinct output node of `outputs` (a tensor, or tuples,
// lists and dicts of them; other leaves are ignored). Returns how many nodes got one.
int attach_backward(const std::shared_ptr<SwapGroup>& group, const py::handle& outputs) {
  OutputNodes nodes;
  add_output_nodes(outputs, nodes, 0);
  if (nodes.empty()) return 0;
  auto state = std::make_shared<BackwardStartState>();
  state->group = group;
  for (const auto& node : nodes) node->add_pre_hook(std::make_unique<BackwardStartHook>(state));
  g_backward_hooks.fetch_add(static_cast<int64_t>(nodes.size()), std::memory_order_relaxed);
  return static_cast<int>(nodes.size());
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
        py::arg("push"), py::arg("pool") = py::none(), py::arg("state_module") = py::none(),
        py::arg("auto_push") = false,
        "Begins (or joins) the group of one layer invocation, excludes `exclude`'s storages and "
        "those of `state_module`'s parameters and buffers, sets its host `pool` and, with "
        "`push`, pushes the engine's saved-tensor hooks, all in one call (`auto_push`: only "
        "when grad mode is on and no torch checkpoint frame is innermost).");
  m.def("region_exit", &region_exit, py::arg("token"), py::arg("ok"),
        py::arg("outputs") = py::none(),
        "Pops the region's hooks and ends (`ok`) or aborts its group, in one call; with "
        "`outputs`, attaches the backward start to their nodes. Returns bit flags: 1 the "
        "region was unscheduled and held records, 2 its group has skipped tensors or ran "
        "against the chain (for the diagnostics), 4 the backward start was attached.");
  m.def("run_region", &run_region, py::arg("layer"), py::arg("name"), py::arg("fn"),
        py::arg("args"), py::arg("kwargs"), py::arg("policy_fn"), py::arg("group_swap"),
        py::arg("pool"), py::arg("state_module"), py::arg("python_hooks"), py::arg("on_flags"),
        "fn(*args, **kwargs) in a SWAP_ALL region (region_enter, the call, region_exit with "
        "the outputs) in one call; `on_flags(token, flags, out, layer, name)` runs after the exit when "
        "flags & 3 or `python_hooks`. An exception from fn aborts the region and propagates.");
  m.def("under_checkpoint_frame", &under_checkpoint_frame,
        "True when this thread's innermost saved-tensor hooks are torch.utils.checkpoint's.");
  m.def("pop_stale_hooks", &pop_stale_hooks,
        "Pops this thread's saved-tensor hooks of regions that were left without their exit.");
  m.def("attach_backward", &attach_backward, py::arg("group"), py::arg("outputs"),
        "Adds a C++ pre-hook to each distinct grad_fn of `outputs` (tensors in nested tuples, "
        "lists, dicts) that starts `group`'s prefetch once, when the first of them runs. "
        "Returns the number of nodes hooked.");
  m.def("region_counters", [] {
    py::dict d;
    d["hook_scans"] = g_hook_scans.load();
    d["backward_hooks"] = g_backward_hooks.load();
    d["pack_hooks_made"] = pack_hooks_made();
    return d;
  }, "Hook-stack scans, C++ backward hooks and PackHook objects (new, not reused) made by "
     "regions since import (tests).");
}

}  // namespace hyper_parallel::bindings
