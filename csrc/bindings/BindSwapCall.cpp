// A swap wrapper's whole call in one C++ function (issue 17; docs/design.md, "Regions and
// threads"): what _swap.swap_call and SwapWrapper.forward decide in Python before a region
// (plain call in backward or without grad, the layer's schedule node and name, whether
// Python hooks are needed, the thread's stack of running wrappers) is decided here, then
// run_region runs the region. Everything that is not the steady state of a training
// forward (another framework's backend imported, a checkpoint region on this thread's
// recompute stack) goes to the Python path it replaces, `fallback`, unchanged.
//
// Thread-safety: needs the GIL (every function here runs with it held). The Python state
// read here (the recompute and wrapper thread-locals, the meter's module globals, sys.modules)
// is the same state the Python path reads, so both paths decide alike.

#include "Bindings.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/graph_task.h>

namespace py = pybind11;

namespace hyper_parallel::bindings {

namespace {

// Set once by configure_swap_forward (from _swap.py at import). Leaked on purpose: no
// Python object may be destroyed after interpreter shutdown.
struct SwapCallConfig {
  py::object fallback;        // fallback(owner, fn, args, kwargs, policy_fn, group_swap,
                              //          pool, state_module, nest_check)
  py::object on_flags;        // _region.after_run_region
  py::object warn_nested;     // _wrappers._warn_nested(outer, inner)
  py::object backend_names;   // tuple of module names whose import means another backend
  py::object sys_modules;     // sys.modules
  py::object recompute_tls;   // _recompute_state._tls (its "stack": checkpoint regions)
  py::object wrapper_tls;     // _wrappers._tls (its "running": the wrappers running)
  py::object memory_globals;  // _memory's module dict ("_active": a sampling meter)
  py::object layer_attr;      // "_hyper_parallel_layer" (_swap_manager._LAYER_ATTR)
  py::object dict_attr, stack_key, running_key, active_key, layer_id_attr, name_attr,
      qualname_attr, compiled_autograd_module, compiled_autograd_flag;
};

SwapCallConfig* g_config = nullptr;

const SwapCallConfig& config() {
  if (g_config == nullptr) {
    throw std::runtime_error(
        "hyper_parallel: swap_forward called before configure_swap_forward; import "
        "hyper_parallel.core.activation_checkpoint first.");
  }
  return *g_config;
}

}  // namespace

py::object attr_or_none(const py::handle& obj, const py::handle& name) {
  PyObject* value = PyObject_GetAttr(obj.ptr(), name.ptr());
  if (value != nullptr) return py::reinterpret_steal<py::object>(value);
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
  PyErr_Clear();
  return py::none();
}

py::object attr_or_none(const py::handle& obj, const char* name) {
  PyObject* value = PyObject_GetAttrString(obj.ptr(), name);
  if (value != nullptr) return py::reinterpret_steal<py::object>(value);
  if (!PyErr_ExceptionMatches(PyExc_AttributeError)) throw py::error_already_set();
  PyErr_Clear();
  return py::none();
}

namespace {

// torch.nn.Module (the class object, looked up once; leaked on purpose, as above).
PyObject* module_type() {
  static PyObject* type = py::object(py::module_::import("torch.nn").attr("Module")).release().ptr();
  return type;
}

bool is_module(const py::handle& obj) {
  const int r = PyObject_IsInstance(obj.ptr(), module_type());
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// _swap_manager.layer_node(obj) for an existing node: a module's instance dict entry, any
// other object's attribute (a bound method finds its function's). None when it has none.
py::object layer_node(const py::handle& obj, const SwapCallConfig& c) {
  if (!is_module(obj)) return attr_or_none(obj, c.layer_attr);
  PyObject** slot = _PyObject_GetDictPtr(obj.ptr());
  if (slot == nullptr || *slot == nullptr) return py::none();
  PyObject* node = PyDict_GetItemWithError(*slot, c.layer_attr.ptr());  // borrowed
  if (node == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::none();
  }
  return py::reinterpret_borrow<py::object>(node);
}

// _swap.region_name(fn) for an fn without a node: a module's class name, else the object's
// __qualname__ (its class name without one).
std::string plain_name(const py::handle& fn, const SwapCallConfig& c) {
  if (!is_module(fn)) {
    py::object q = attr_or_none(fn, c.qualname_attr);
    if (!q.is_none()) return py::str(q).cast<std::string>();
  }
  return py::str(py::type::handle_of(fn).attr("__name__")).cast<std::string>();
}

// True when a framework with a backend of its own is imported (_backends.loaded_frameworks).
bool another_framework_loaded(const SwapCallConfig& c) {
  for (const py::handle name : c.backend_names) {
    if (PyDict_Contains(c.sys_modules.ptr(), name.ptr()) == 1) return true;
  }
  return false;
}

// The thread-local list `key` of a threading.local (created empty when `create`), or null.
// Borrowed from the local's per-thread dict, which the local keeps alive.
PyObject* thread_list(const py::object& local, const py::object& key, bool create,
                      const SwapCallConfig& c) {
  py::object dict = local.attr(c.dict_attr);
  PyObject* list = PyDict_GetItemWithError(dict.ptr(), key.ptr());
  if (list == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    if (!create) return nullptr;
    py::list fresh;
    if (PyDict_SetItem(dict.ptr(), key.ptr(), fresh.ptr()) != 0) throw py::error_already_set();
    return PyDict_GetItem(dict.ptr(), key.ptr());
  }
  return list;
}

// Whether Python must see the region's exit: a meter samples, or compiled autograd is on
// (_region.after_run_region then attaches the backward start in Python).
bool python_hooks_needed(const SwapCallConfig& c) {
  PyObject* active = PyDict_GetItemWithError(c.memory_globals.ptr(), c.active_key.ptr());
  if (active == nullptr && PyErr_Occurred()) throw py::error_already_set();
  if (active != nullptr && active != Py_None) return true;
  PyObject* ca = PyDict_GetItemWithError(c.sys_modules.ptr(), c.compiled_autograd_module.ptr());
  if (ca == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return false;
  }
  py::object on = attr_or_none(ca, c.compiled_autograd_flag);
  const int truth = PyObject_IsTrue(on.ptr());
  if (truth < 0) throw py::error_already_set();
  return truth == 1;
}

py::object call_plain(const py::object& fn, const py::object& args, const py::object& kwargs) {
  PyObject* out = PyObject_Call(fn.ptr(), args.ptr(), kwargs.is_none() ? nullptr : kwargs.ptr());
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

// One call of a swap wrapper: `owner` is the wrapper (the module wrapper, or the wrapping
// function) whose schedule node places the call, `fn` what it wraps, called as
// fn(*args, **kwargs); `state_module` the module whose parameters and buffers are never
// swapped (None: none); `nest_check` keeps the thread's stack of running wrappers (and
// warns about nesting) as ActivationWrapper._hp_call does.
py::object swap_forward(const py::object& owner, const py::object& fn, const py::object& args,
                        const py::object& kwargs, const py::object& policy_fn, bool group_swap,
                        const py::object& pool, const py::object& state_module, bool nest_check) {
  const SwapCallConfig& c = config();
  auto slow = [&] {
    return c.fallback(owner, fn, args, kwargs, policy_fn, group_swap, pool, state_module,
                      nest_check);
  };
  if (another_framework_loaded(c)) return slow();
  // In backward (a recompute) or without grad the call runs plainly (_region.in_backward).
  if (torch::autograd::get_current_graph_task_id() != -1 || !at::GradMode::is_enabled()) {
    return call_plain(fn, args, kwargs);
  }
  PyObject* recompute = thread_list(c.recompute_tls, c.stack_key, false, c);
  if (recompute != nullptr && PyList_GET_SIZE(recompute) > 0) return slow();  // Python decides

  py::object node = layer_node(owner, c);
  if (node.is_none()) node = layer_node(fn, c);
  int64_t layer = -1;
  std::string name;
  if (!node.is_none()) {
    layer = node.attr(c.layer_id_attr).cast<int64_t>();
    name = node.attr(c.name_attr).cast<std::string>();
  } else {
    name = plain_name(fn, c);
  }
  const bool python_hooks = python_hooks_needed(c);
  if (!nest_check) {
    return run_region(layer, name, fn, args, kwargs, policy_fn, group_swap, pool, state_module,
                      python_hooks, c.on_flags);
  }
  PyObject* running = thread_list(c.wrapper_tls, c.running_key, true, c);
  const Py_ssize_t depth = PyList_GET_SIZE(running);
  if (depth > 0 && PyList_GET_ITEM(running, depth - 1) != owner.ptr()) {
    c.warn_nested(py::reinterpret_borrow<py::object>(PyList_GET_ITEM(running, depth - 1)), owner);
  }
  if (PyList_Append(running, owner.ptr()) != 0) throw py::error_already_set();
  auto pop = [&] {
    const Py_ssize_t n = PyList_GET_SIZE(running);
    if (n > 0) PyList_SetSlice(running, n - 1, n, nullptr);
  };
  try {
    py::object out = run_region(layer, name, fn, args, kwargs, policy_fn, group_swap, pool,
                                state_module, python_hooks, c.on_flags);
    pop();
    return out;
  } catch (...) {
    pop();  // (a Python error in flight is held by its error_already_set, not set)
    throw;
  }
}

}  // namespace

void bind_swap_call(py::module_& m) {
  m.def("configure_swap_forward",
        [](py::object fallback, py::object on_flags, py::object warn_nested,
           py::tuple backend_names, py::object recompute_tls, py::object wrapper_tls,
           py::dict memory_globals, py::str layer_attr) {
          auto* c = new SwapCallConfig();
          c->fallback = std::move(fallback);
          c->on_flags = std::move(on_flags);
          c->warn_nested = std::move(warn_nested);
          c->backend_names = std::move(backend_names);
          c->sys_modules = py::module_::import("sys").attr("modules");
          c->recompute_tls = std::move(recompute_tls);
          c->wrapper_tls = std::move(wrapper_tls);
          c->memory_globals = std::move(memory_globals);
          c->layer_attr = std::move(layer_attr);
          c->dict_attr = py::str("__dict__");
          c->stack_key = py::str("stack");
          c->running_key = py::str("running");
          c->active_key = py::str("_active");
          c->layer_id_attr = py::str("layer_id");
          c->name_attr = py::str("name");
          c->qualname_attr = py::str("__qualname__");
          c->compiled_autograd_module = py::str("torch._dynamo.compiled_autograd");
          c->compiled_autograd_flag = py::str("compiled_autograd_enabled");
          g_config = c;  // a second call (a reload) leaks the first: a few objects, once
        },
        py::arg("fallback"), py::arg("on_flags"), py::arg("warn_nested"),
        py::arg("backend_names"), py::arg("recompute_tls"), py::arg("wrapper_tls"),
        py::arg("memory_globals"), py::arg("layer_attr"),
        "Sets what swap_forward reads and calls (once, from hyper_parallel's _swap.py).");
  m.def("swap_forward", &swap_forward, py::arg("owner"), py::arg("fn"), py::arg("args"),
        py::arg("kwargs"), py::arg("policy_fn"), py::arg("group_swap"), py::arg("pool"),
        py::arg("state_module"), py::arg("nest_check"),
        "One swap wrapper call, fn(*args, **kwargs): plainly in backward or without grad, "
        "else in its layer's SWAP_ALL region (run_region); another framework's backend or a "
        "checkpoint region on this thread goes to the configured Python fallback.");
}

}  // namespace hyper_parallel::bindings
