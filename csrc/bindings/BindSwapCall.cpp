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
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/jit/frontend/tracer.h>

#include <vector>

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

// dict[key] borrowed, or nullptr when absent (a lookup error propagates).
PyObject* dict_item(PyObject* dict, PyObject* key) {
  PyObject* value = PyDict_GetItemWithError(dict, key);
  if (value == nullptr && PyErr_Occurred()) throw py::error_already_set();
  return value;
}

bool truthy(PyObject* value) {
  const int r = PyObject_IsTrue(value);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// _swap_manager.layer_node(obj) for an existing node: a module's instance dict entry, any
// other object's attribute (a bound method finds its function's). None when it has none.
py::object layer_node(const py::handle& obj, const SwapCallConfig& c) {
  if (!is_module(obj)) return attr_or_none(obj, c.layer_attr);
  PyObject** slot = _PyObject_GetDictPtr(obj.ptr());
  if (slot == nullptr || *slot == nullptr) return py::none();
  PyObject* node = dict_item(*slot, c.layer_attr.ptr());
  return node == nullptr ? py::none() : py::reinterpret_borrow<py::object>(node);
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
  PyObject* list = dict_item(dict.ptr(), key.ptr());
  if (list == nullptr) {
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
  PyObject* active = dict_item(c.memory_globals.ptr(), c.active_key.ptr());
  if (active != nullptr && active != Py_None) return true;
  PyObject* ca = dict_item(c.sys_modules.ptr(), c.compiled_autograd_module.ptr());
  return ca != nullptr && truthy(attr_or_none(ca, c.compiled_autograd_flag).ptr());
}

py::object call_plain(const py::object& fn, const py::object& args, const py::object& kwargs) {
  PyObject* out = PyObject_Call(fn.ptr(), args.ptr(), kwargs.is_none() ? nullptr : kwargs.ptr());
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

// One call of a swap wrapper: `owner` is the wrapper (the module wrapper, or the wrapping
// function) whose schedule node places the call, `fn` what it wraps, called as
// fn(*args, **kwargs) (`kwargs` a dict, or None for no keywords: the call slot's case);
// `state_module` the module whose parameters and buffers are never
// swapped (None: none); `nest_check` keeps the thread's stack of running wrappers (and
// warns about nesting) as ActivationWrapper._hp_call does.
py::object swap_forward(const py::object& owner, const py::object& fn, const py::object& args,
                        const py::object& kwargs, const py::object& policy_fn, bool group_swap,
                        const py::object& pool, const py::object& state_module, bool nest_check) {
  const SwapCallConfig& c = config();
  auto slow = [&] {
    const py::object keywords = kwargs.is_none() ? py::object(py::dict()) : kwargs;
    return c.fallback(owner, fn, args, keywords, policy_fn, group_swap, pool, state_module,
                      nest_check);
  };
  // Another framework's backend, or a torch.func transform (no saved-tensor hooks there:
  // _region.in_func_transform runs the call plainly and warns): Python decides.
  if (another_framework_loaded(c) || in_func_transform()) {
    return slow();
  }
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

// SwapWrapper's call slot (issue 17). `wrapper(x)` on a module wrapper reaches the type's
// tp_call; Python's class statement sets it to the generic slot that looks up and runs the
// Python __call__ (one Python frame and its checks: about 6k instructions per layer). This
// slot makes the same decision in C++: nn.Module.__call__'s no-hook case (no forward/backward
// hook on the wrapper, no global module hook, not compiled, not traced by the JIT or dynamo,
// forward not replaced on the instance) calls swap_forward directly; any other case, and
// anything it cannot read as expected, runs the Python __call__, which decides again.
// The Python __call__ stays on the class (dynamo inlines it; a subclass's slot is the generic
// one), and assigning SwapWrapper.__call__ resets the slot to the generic one.
struct ModuleCallConfig {
  PyObject* module_globals = nullptr;    // torch.nn.modules.module.__dict__
  PyObject* compiler_globals = nullptr;  // torch.compiler.__dict__
  std::vector<PyObject*> instance_hooks;  // interned names of the four hook dicts
  std::vector<PyObject*> global_hooks;    // interned names of the four global hook dicts
  PyObject *compiled_call_impl, *forward, *modules, *prefix, *pool, *pool_native, *policy_fn,
      *group_swap, *nests, *call, *is_compiling_flag;
  PyObject* wrapper_forward = nullptr;  // SwapWrapper.forward when the slot was installed
};

ModuleCallConfig* g_module_call = nullptr;

PyObject* interned(const char* s) {
  PyObject* name = PyUnicode_InternFromString(s);
  if (name == nullptr) throw py::error_already_set();
  return name;  // leaked on purpose, as the config is
}

// True when every no-hook condition holds and every entry the fast case reads is there.
bool plain_module_call(PyObject* self, PyObject* dict, const ModuleCallConfig& c) {
  // (nn.Module's class attribute None unless compile() set one on the instance)
  PyObject* compiled = dict_item(dict, c.compiled_call_impl);
  if (compiled == nullptr) compiled = _PyType_Lookup(Py_TYPE(self), c.compiled_call_impl);
  if (compiled != Py_None) return false;
  if (dict_item(dict, c.forward) != nullptr) return false;
  // (a forward overridden by a subclass or patched on the class runs through __call__)
  if (_PyType_Lookup(Py_TYPE(self), c.forward) != c.wrapper_forward) return false;
  for (PyObject* name : c.instance_hooks) {
    PyObject* hooks = dict_item(dict, name);
    if (hooks == nullptr || truthy(hooks)) return false;
  }
  for (PyObject* name : c.global_hooks) {
    PyObject* hooks = dict_item(c.module_globals, name);
    if (hooks == nullptr || truthy(hooks)) return false;
  }
  if (torch::jit::tracer::isTracing()) return false;
  PyObject* compiling = dict_item(c.compiler_globals, c.is_compiling_flag);
  return compiling != nullptr && !truthy(compiling);
}

py::object swap_wrapper_call_impl(PyObject* self, PyObject* args, PyObject* kwargs) {
  const ModuleCallConfig& c = *g_module_call;
  PyObject** dict_slot = _PyObject_GetDictPtr(self);
  PyObject* dict = dict_slot != nullptr ? *dict_slot : nullptr;
  if (dict != nullptr && plain_module_call(self, dict, c)) {
    PyObject* modules = dict_item(dict, c.modules);
    PyObject* inner = modules != nullptr && PyDict_Check(modules) ? dict_item(modules, c.prefix)
                                                                    : nullptr;
    PyObject* pool = dict_item(dict, c.pool);
    PyObject* policy_fn = dict_item(dict, c.policy_fn);
    PyObject* group_swap = dict_item(dict, c.group_swap);
    PyObject* nests = _PyType_Lookup(Py_TYPE(self), c.nests);  // borrowed, no error set
    if (inner != nullptr && pool != nullptr && policy_fn != nullptr && group_swap != nullptr &&
        nests != nullptr) {
      py::object native = pool == Py_None
                              ? py::none()
                              : py::reinterpret_steal<py::object>(PyObject_GetAttr(pool, c.pool_native));
      if (!native) throw py::error_already_set();
      const auto inner_obj = py::reinterpret_borrow<py::object>(inner);
      return swap_forward(py::reinterpret_borrow<py::object>(self), inner_obj,
                          py::reinterpret_borrow<py::object>(args),
                          kwargs != nullptr ? py::reinterpret_borrow<py::object>(kwargs)
                                            : py::none(),
                          py::reinterpret_borrow<py::object>(policy_fn), truthy(group_swap),
                          native, inner_obj, !truthy(nests));
    }
  }
  // Every other case: the class's Python __call__ (nn.Module.__call__ underneath).
  PyObject* call = _PyType_Lookup(Py_TYPE(self), c.call);
  if (call == nullptr) {
    throw py::type_error("hyper_parallel: this swap wrapper's class has no __call__");
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  std::vector<PyObject*> stack(static_cast<size_t>(n) + 1);
  stack[0] = self;
  for (Py_ssize_t i = 0; i < n; ++i) stack[static_cast<size_t>(i) + 1] = PyTuple_GET_ITEM(args, i);
  PyObject* out = PyObject_VectorcallDict(call, stack.data(), static_cast<size_t>(n) + 1, kwargs);
  if (out == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(out);
}

PyObject* swap_wrapper_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  HANDLE_TH_ERRORS
  return swap_wrapper_call_impl(self, args, kwargs).release().ptr();
  END_HANDLE_TH_ERRORS
}

// Installs swap_wrapper_call as `cls`'s tp_call. Refused (False) when this torch has no
// torch.compiler._is_compiling_flag to read: the class then keeps the generic slot.
bool install_swap_wrapper_call(const py::type& cls) {
  py::module_ compiler = py::module_::import("torch.compiler");
  if (!py::hasattr(compiler, "_is_compiling_flag")) return false;
  if (g_module_call == nullptr) {
    auto* c = new ModuleCallConfig();  // leaked on purpose, as SwapCallConfig is
    c->module_globals =
        py::object(py::module_::import("torch.nn.modules.module").attr("__dict__")).release().ptr();
    c->compiler_globals = py::object(compiler.attr("__dict__")).release().ptr();
    for (const char* name : {"_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks",
                             "_backward_hooks"}) {
      c->instance_hooks.push_back(interned(name));
    }
    for (const char* name : {"_global_forward_pre_hooks", "_global_forward_hooks",
                             "_global_backward_pre_hooks", "_global_backward_hooks"}) {
      c->global_hooks.push_back(interned(name));
    }
    c->compiled_call_impl = interned("_compiled_call_impl");
    c->forward = interned("forward");
    c->modules = interned("_modules");
    c->prefix = interned("_checkpoint_wrapped_module");
    c->pool = interned("_hp_cpu_pool");
    c->pool_native = interned("_pool");
    c->policy_fn = interned("_hp_policy_fn");
    c->group_swap = interned("_hp_group_swap");
    c->nests = interned("_hp_nests");
    c->call = interned("__call__");
    c->is_compiling_flag = interned("_is_compiling_flag");
    g_module_call = c;
  }
  PyObject* forward = _PyType_Lookup(reinterpret_cast<PyTypeObject*>(cls.ptr()),
                                     g_module_call->forward);
  if (forward == nullptr) return false;
  Py_INCREF(forward);  // (leaked on purpose, as the config is)
  g_module_call->wrapper_forward = forward;
  reinterpret_cast<PyTypeObject*>(cls.ptr())->tp_call = &swap_wrapper_call;
  return true;
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
  m.def("install_swap_wrapper_call", &install_swap_wrapper_call, py::arg("cls"),
        "Makes cls(...)'s call (its tp_call) take nn.Module.__call__'s no-hook case in C++ "
        "(swap_forward on cls's instance state), every other case through cls.__call__; "
        "False (nothing changed) when this torch has no torch.compiler._is_compiling_flag.");
  m.def("swap_forward", &swap_forward, py::arg("owner"), py::arg("fn"), py::arg("args"),
        py::arg("kwargs"), py::arg("policy_fn"), py::arg("group_swap"), py::arg("pool"),
        py::arg("state_module"), py::arg("nest_check"),
        "One swap wrapper call, fn(*args, **kwargs): plainly in backward or without grad, "
        "else in its layer's SWAP_ALL region (run_region); another framework's backend or a "
        "checkpoint region on this thread goes to the configured Python fallback.");
}

}  // namespace hyper_parallel::bindings
