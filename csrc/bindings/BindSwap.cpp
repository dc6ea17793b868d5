#include "Bindings.h"

#include <ATen/EmptyTensor.h>

#include "hyper_parallel/activation/CheckpointPolicy.h"
#include "hyper_parallel/activation/Eligibility.h"
#include "hyper_parallel/activation/SavedBytesMeter.h"
#include "hyper_parallel/activation/SwapEngine.h"
#include "hyper_parallel/common/Macros.h"

#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/stl.h>

#include <atomic>
#include <vector>

namespace py = pybind11;

namespace hyper_parallel::bindings {

using namespace activation;

namespace {

SwapEngine& engine() { return SwapEngine::global(); }

// Converts what a policy function returned into a CheckpointPolicy: ours, torch's
// CheckpointPolicy (by member name), or nullopt.
std::optional<CheckpointPolicy> to_policy(const py::handle& obj) {
  py::detail::make_caster<CheckpointPolicy> ours;
  if (ours.load(obj, /*convert=*/false)) return py::detail::cast_op<CheckpointPolicy>(ours);
  if (PyBool_Check(obj.ptr())) return std::nullopt;
  py::object name = attr_or_none(obj, "name");
  if (!name.is_none() && !attr_or_none(obj, "value").is_none() && py::isinstance<py::str>(name)) {
    return policy_from_string(name.cast<std::string>());
  }
  return std::nullopt;
}

// ---------------------------------------------------------------- DTensor (issue 6)
// A DTensor is a Python wrapper subclass: the outer tensor has no data of its own, its
// values live in a plain local tensor (`_local_tensor`, this rank's shard). Autograd saves
// the outer DTensor. The pack hook swaps it through its local tensor's storage and keeps a
// DTensorHandle meanwhile: the local tensor's SavedHandle plus the DTensor's spec (mesh,
// placements, global shape and stride). The unpack hook makes the local storage resident
// through SwapEngine::unpack (reload, wait, version check) and builds a DTensor from that
// local tensor and the same spec. The original DTensor object is not kept: it references
// the local storage, and the engine frees a storage only when nothing but its own handles
// references it. Other Python subclasses still pass through untouched (SPEC 4.4).

// The DTensor class, or nullptr while torch.distributed.tensor is not imported (then no
// DTensor exists). Only looked up for tensors with the Python dispatch key, never for
// plain ones. Guarded by the GIL; the reference is kept for the life of the process.
PyObject* dtensor_type() {
  static PyObject* cls = nullptr;
  if (cls == nullptr) {
    static PyObject* name = PyUnicode_InternFromString("torch.distributed.tensor");
    PyObject* mod = PyImport_GetModule(name);
    if (mod == nullptr) {
      PyErr_Clear();
      return nullptr;
    }
    cls = PyObject_GetAttrString(mod, "DTensor");
    Py_DECREF(mod);
    if (cls == nullptr) PyErr_Clear();
  }
  return cls;
}

bool is_dtensor(const py::handle& obj) {
  PyObject* cls = dtensor_type();
  return cls != nullptr && reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())) == cls;
}

// The DTensor's local tensor as the engine should see it: tensor_data() shares its storage
// and version counter but drops its autograd flags (a local tensor made by from_local is a
// leaf that requires grad; whether a DTensor is a parameter is decided on the outer tensor).
at::Tensor dtensor_local(const py::handle& obj) {
  return THPVariable_Unpack(obj.attr("_local_tensor").ptr()).tensor_data();
}

// torch.nn.Parameter (the class object, looked up once; leaked with the interpreter).
PyTypeObject* parameter_type() {
  static PyTypeObject* cls = [] {
    py::object p = py::module_::import("torch.nn.parameter").attr("Parameter");
    return reinterpret_cast<PyTypeObject*>(p.release().ptr());
  }();
  return cls;
}

// A frozen parameter anywhere (issue 17 tester F1): an nn.Parameter (or subclass) that
// does not require grad, which the Eligibility rule (leaf that requires grad) cannot see,
// whoever owns it: another module, a closure, a function's default. Also a tensor
// subclass made a parameter (nn.Parameter(DTensor) keeps the DTensor type and sets
// `_is_param`). Only leaves are asked: a parameter is a leaf, and this keeps the check off
// the common path (outputs of ops have a grad_fn or are not leaves of a frozen model).
bool is_frozen_parameter(const py::handle& obj, const at::Tensor& t) {
  if (t.requires_grad() || !t.is_leaf()) return false;
  if (PyType_IsSubtype(Py_TYPE(obj.ptr()), parameter_type())) return true;
  if (!t.key_set().has(c10::DispatchKey::Python)) return false;
  PyObject* flag = PyObject_GetAttrString(obj.ptr(), "_is_param");
  if (flag == nullptr) {
    PyErr_Clear();
    return false;
  }
  const bool is_param = PyObject_IsTrue(flag) == 1;
  Py_DECREF(flag);
  return is_param;
}

// A leaf that requires grad (a parameter) or a view of one; the Eligibility rule, applied
// to the outer DTensor.
bool is_parameter_like(const at::Tensor& t) {
  if (t.requires_grad() && t.is_leaf()) return true;
  if (!t.is_view()) return false;
  const at::TensorBase& base = t._base();
  return base.defined() && base.requires_grad() && base.is_leaf();
}

// What the pack hook returns for a swapped DTensor. An in-place op on a DTensor bumps the
// version counter of the outer tensor only (it writes the local tensor below autograd), so
// the outer counter is kept (without the tensor) and checked at unpack, as autograd would.
struct DTensorHandle {
  std::shared_ptr<SavedHandle> local;  // the local tensor's storage, managed by the engine
  py::object spec;                     // the DTensor's DTensorSpec
  c10::VariableVersion version;        // the outer DTensor's version counter
  uint32_t saved_version;
};

// The saved-tensor pack hook of a region. Called by autograd (with the GIL) once per
// saved tensor; returns a SavedHandle for a swapped tensor, a DTensorHandle for a swapped
// DTensor, or the tensor itself.
// What the pack hook returns for a tensor it does not swap. With saved-tensor hooks
// installed, autograd no longer checks version counters itself (SavedVariable::unpack skips
// the check when hooks are present), so the hook keeps the version seen at pack time and
// unpack_hook raises on an in-place modification, exactly as autograd would without hooks.
// Its destruction tells the active meter that the storage may have died (SavedBytesMeter.h).
struct SavedPassThrough {
  SavedPassThrough(py::object held, c10::VariableVersion counter, uint32_t at_pack)
      : tensor(std::move(held)), version(std::move(counter)), saved_version(at_pack) {}
  ~SavedPassThrough() {
    if (SavedBytesMeter::active() == nullptr || !tensor || !THPVariable_Check(tensor.ptr())) {
      return;  // (per saved tensor: no meter, no work)
    }
    SavedBytesMeter::note_release(THPVariable_Unpack(tensor.ptr()));
  }
  SavedPassThrough(const SavedPassThrough&) = delete;
  SavedPassThrough& operator=(const SavedPassThrough&) = delete;

  py::object tensor;
  c10::VariableVersion version;
  uint32_t saved_version;
};

// The tensor is held as a detached alias (same storage and version counter, no grad_fn)
// when it has a grad_fn: a saved output holding its own grad_fn closes a cycle (its node
// owns the SavedVariable, which would own the tensor, which owns the node) that Python's
// collector cannot see through (autograd's nodes are not traversed), so a graph dropped
// without a backward (`u.norm().item()` for a log line) was never freed, nor the tensors it
// saved: a registered storage it had saved stayed on the device (tester D, session 20).
// Lossless: with hooks, SavedVariable keeps the grad_fn and output number itself and
// rebuilds the tensor from the data unpack returns (torch's saved_variable.cpp; torch's
// docs detach in pack hooks for this reason).
py::object pass_through(const py::object& obj, const at::Tensor& t) {
  const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
  if (!version.enabled()) return obj;  // inference tensors track no version
  py::object held = obj;
  if (!t.is_leaf()) {
    held = t.key_set().has(c10::DispatchKey::Python)
               ? obj.attr("detach")()  // a subclass detaches through its own dispatch
               : py::reinterpret_steal<py::object>(THPVariable_Wrap(t.detach()));
  }
  return py::cast(std::make_shared<SavedPassThrough>(std::move(held), version,
                                                    version.current_version()));
}

class PackHook {
 public:
  PackHook(PackMode mode, py::object policy_fn, std::shared_ptr<RegionState> state = nullptr)
      : mode_(mode), policy_fn_(std::move(policy_fn)), state_(std::move(state)) {}

  // Points a hook that nothing else references any more at a new region (make_pack_hook).
  void rebind(PackMode mode, py::object policy_fn, std::shared_ptr<RegionState> state) {
    mode_ = mode;
    policy_fn_ = std::move(policy_fn);
    state_ = std::move(state);
  }

  // False once the region that pushed this hook ended or was abandoned (RegionState.h).
  bool live() const {
    return !state_ || (state_->open && state_->generation == SwapEngine::generation());
  }

  py::object operator()(const py::object& obj) const {
    if (!THPVariable_Check(obj.ptr())) return obj;
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (!live()) return pass_through(obj, t);
    if (t.key_set().has(c10::DispatchKey::Python)) return pack_subclass(obj, t);
    if (auto* meter = SavedBytesMeter::active()) meter->observe(t);
    auto group = engine().current_group();
    if (!group) return pass_through(obj, t);
    if (is_frozen_parameter(obj, t)) {
      if (mode_ == PackMode::kSwapAll) engine().count_skipped(group, t, SkipReason::kParameter);
      return pass_through(obj, t);
    }
    if (!policy_swaps(obj, t, t)) return pass_through(obj, t);
    auto handle = engine().pack(group, t, mode_);
    if (!handle) return pass_through(obj, t);
    return py::cast(std::move(handle));
  }

 private:
  // False when the swap policy_fn keeps the tensor on device (or it is ineligible anyway).
  // `shown` is what the error message describes, `data` what would be swapped.
  bool policy_swaps(const py::object& obj, const at::Tensor& shown, const at::Tensor& data) const {
    if (mode_ != PackMode::kSwapAll || policy_fn_.is_none()) return true;
    // Ineligible: the policy is not asked; pack() skips (and counts) it.
    if (check_eligible(data, engine().cpu_swap()) != Ineligible::kNone) return true;
    py::object result = policy_fn_(obj);
    auto policy = to_policy(result);
    HP_CHECK_VALUE(policy && (*policy == CheckpointPolicy::MUST_SAVE ||
                              *policy == CheckpointPolicy::MUST_SWAP),
                   "the swap policy_fn returned ", std::string(py::repr(result)),
                   " for a saved tensor of shape ", shown.sizes(), " and dtype ",
                   shown.scalar_type(), "; a swap policy must return CheckpointPolicy.MUST_SAVE "
                   "(keep on device) or CheckpointPolicy.MUST_SWAP (offload).");
    if (*policy == CheckpointPolicy::MUST_SWAP) return true;
    engine().count_skipped(engine().current_group(), data, SkipReason::kKeptByPolicy);
    return false;
  }

  // Tensors with the Python dispatch key: a DTensor is swapped through its local tensor,
  // any other subclass passes through.
  py::object pack_subclass(const py::object& obj, const at::Tensor& t) const {
    auto* meter = SavedBytesMeter::active();
    if (!is_dtensor(obj)) {
      if (meter) meter->observe(t);
      return pass_through(obj, t);
    }
    // a DTensor parameter (frozen or not) or a view of one
    if (is_parameter_like(t) || is_frozen_parameter(obj, t)) return pass_through(obj, t);
    at::Tensor local = dtensor_local(obj);
    if (meter) meter->observe(local);
    auto group = engine().current_group();
    // policy_fn sees the DTensor
    if (!group || !policy_swaps(obj, t, local)) return pass_through(obj, t);
    auto handle = engine().pack(group, local, mode_);
    if (!handle) return pass_through(obj, t);
    const c10::VariableVersion& version = t.unsafeGetTensorImpl()->version_counter();
    return py::cast(std::make_shared<DTensorHandle>(
        DTensorHandle{std::move(handle), obj.attr("_spec"), version, version.current_version()}));
  }

  PackMode mode_;
  py::object policy_fn_;
  std::shared_ptr<RegionState> state_;
};

// The Python type of a bound class, looked up once (the unpack hook tests every saved
// object against these; pybind's isinstance searches its type registry on every call).
template <typename T>
PyTypeObject* bound_type() {
  static PyTypeObject* type = reinterpret_cast<PyTypeObject*>(py::type::of<T>().ptr());
  return type;
}

py::object unpack_hook(const py::object& obj) {
  if (Py_TYPE(obj.ptr()) == bound_type<SavedHandle>()) {
    // The common swapped case: no GIL release unless it has to wait (issue 17).
    const auto& handle = obj.cast<const SavedHandle&>();
    at::Tensor t = engine().try_unpack(handle);
    if (!t.defined()) {
      auto keep = obj.cast<std::shared_ptr<SavedHandle>>();
      py::gil_scoped_release no_gil;  // waits for a copy
      t = engine().unpack(*keep);
    }
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t)));
  }
  if (Py_TYPE(obj.ptr()) == bound_type<SavedPassThrough>()) {
    const auto& p = obj.cast<const SavedPassThrough&>();
    const uint32_t now = p.version.current_version();
    if (now != p.saved_version) {
      const at::Tensor& t = THPVariable_Unpack(p.tensor.ptr());
      HP_CHECK(false, "a tensor saved for backward (shape ", t.sizes(), ", dtype ",
               t.scalar_type(), ") was modified by an in-place operation after it was saved "
               "(version ", p.saved_version, " -> ", now, "). Clone the tensor before "
               "modifying it, or run the in-place op (e.g. optimizer.step()) after backward.");
    }
    return p.tensor;
  }
  if (Py_TYPE(obj.ptr()) == bound_type<DTensorHandle>()) {
    auto handle = obj.cast<std::shared_ptr<DTensorHandle>>();
    HP_CHECK(handle->version.current_version() == handle->saved_version,
             "a DTensor saved for backward (placements ", std::string(py::str(
                 handle->spec.attr("placements"))), ") was modified by an in-place operation "
             "after it was saved (version ", handle->saved_version, " -> ",
             handle->version.current_version(), "). Clone the tensor before modifying it, or "
             "move the in-place op out of the checkpoint/swap region.");
    at::Tensor local;
    {
      py::gil_scoped_release no_gil;
      local = engine().unpack(*handle->local);
    }
    // Same spec, so the same mesh, placements and global shape; requires_grad is False as
    // for any unpacked alias (autograd attaches the saved grad_fn itself).
    py::object local_obj = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(local)));
    return py::reinterpret_borrow<py::object>(dtensor_type())(local_obj, handle->spec,
                                                              py::arg("requires_grad") = false);
  }
  return obj;
}

}  // namespace

namespace {

void exclude_one(SwapGroup& g, const py::handle& obj) {
  if (!THPVariable_Check(obj.ptr())) return;
  const at::Tensor& outer = THPVariable_Unpack(obj.ptr());
  // A DTensor parameter's data is its local tensor's storage. (Only a tensor with the
  // Python key can be one: the DTensor type lookup is not free while
  // torch.distributed.tensor is not imported, and this runs per parameter per region.)
  if (outer.key_set().has(c10::DispatchKey::Python) && is_dtensor(obj)) {
    const at::Tensor local = dtensor_local(obj);
    if (has_plain_storage(local)) g.excluded.insert(local.storage().unsafeGetStorageImpl());
    return;
  }
  if (has_plain_storage(outer)) g.excluded.insert(outer.storage().unsafeGetStorageImpl());
}

// The attribute names nn.Module keeps its state under, interned once (leaked on purpose:
// they must outlive every module).
struct ModuleKeys {
  PyObject* parameters;
  PyObject* buffers;
  PyObject* modules;
};

const ModuleKeys& module_keys() {
  static const ModuleKeys keys{PyUnicode_InternFromString("_parameters"),
                               PyUnicode_InternFromString("_buffers"),
                               PyUnicode_InternFromString("_modules")};
  return keys;
}

// The dict `key` in the instance dict `dict` of a module (nullptr when absent).
PyObject* module_dict_entry(PyObject* dict, PyObject* key) {
  PyObject* entry = PyDict_GetItem(dict, key);  // borrowed
  return (entry != nullptr && PyDict_Check(entry)) ? entry : nullptr;
}

// Calls visit(is_parameter, entries, key, value) for every entry of the _parameters and
// _buffers dicts
// of `module`'s tree. `seen`: the modules walked so far (a submodule shared by two parents
// is walked once; a transformer block has tens of modules, so a linear scan beats a hash
// set). `what` names the caller in the error for a tree too deep (a cycle).
template <class Visit>
void walk_module_state(PyObject* module, c10::SmallVectorImpl<PyObject*>& seen, int depth,
                       const char* what, Visit&& visit) {
  for (PyObject* m : seen) {
    if (m == module) return;
  }
  seen.push_back(module);
  HP_CHECK(depth < 1000, "the module tree given to a ", what, " is more than 1000 levels "
           "deep (a cycle in _modules?); check the model's submodule structure.");
  PyObject** dict_ptr = _PyObject_GetDictPtr(module);
  if (dict_ptr == nullptr || *dict_ptr == nullptr) return;
  PyObject* dict = *dict_ptr;
  const ModuleKeys& keys = module_keys();
  for (PyObject* state : {keys.parameters, keys.buffers}) {
    if (PyObject* entries = module_dict_entry(dict, state)) {
      PyObject *key, *value;
      Py_ssize_t pos = 0;
      while (PyDict_Next(entries, &pos, &key, &value)) {
        visit(state == keys.parameters, entries, key, value);
      }
    }
  }
  if (PyObject* children = module_dict_entry(dict, keys.modules)) {
    PyObject *key, *child;
    Py_ssize_t pos = 0;
    while (PyDict_Next(children, &pos, &key, &child)) {
      if (child != Py_None) walk_module_state(child, seen, depth + 1, what, visit);
    }
  }
}

void exclude_module_tree(SwapGroup& g, PyObject* module, c10::SmallVectorImpl<PyObject*>& seen) {
  walk_module_state(module, seen, 0, "swap region",
                    [&g](bool, PyObject*, PyObject*, PyObject* value) { exclude_one(g, value); });
}

// Whether `obj` is a torch.nn.Parameter (a module's own parameter).
bool is_parameter_object(PyObject* obj) {
  static PyObject* cls =
      py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();  // leaked
  const int r = PyObject_IsInstance(obj, cls);
  if (r < 0) throw py::error_already_set();
  return r == 1;
}

// What a module's tree holds before a checkpoint region's forward, for its recompute to
// put back (put_module_state) where the slot was swapped for the forward only: a flat
// tuple of (dict, key, holder, is_parameter) entries. `modules`: a module, or a list of
// them (checkpoint_sequential's segment). Recorded:
//  * parameter slots holding a plain tensor, not an nn.Parameter (what
//    torch.func.functional_call or a stateless reparametrization puts there), by a weak
//    reference: put back while the caller still holds it (as one does a functional_call's
//    parameters until backward), and a framework's gathered copy dropped after its layer
//    is not kept alive until the recompute (a tester: every layer's gathered weight alive
//    at once);
//  * buffer slots, strongly (a buffer reassigned in forward is read again by recompute).
// Parameter slots holding an nn.Parameter are the module's own and never put back.
py::tuple module_state_refs(const py::handle& modules) {
  c10::SmallVector<PyObject*, 32> seen;
  std::vector<py::object> out;
  static PyObject* weakref_type =
      py::object(py::module_::import("weakref").attr("ref")).release().ptr();  // leaked
  auto visit = [&out](bool is_parameter, PyObject* entries, PyObject* key, PyObject* value) {
    if (!THPVariable_Check(value)) return;
    py::object holder = py::reinterpret_borrow<py::object>(value);
    if (is_parameter) {
      if (is_parameter_object(value)) return;
      PyObject* ref = PyObject_CallOneArg(weakref_type, value);
      if (ref == nullptr) throw py::error_already_set();
      holder = py::reinterpret_steal<py::object>(ref);
    }
    out.push_back(py::reinterpret_borrow<py::object>(entries));
    out.push_back(py::reinterpret_borrow<py::object>(key));
    out.push_back(std::move(holder));
    out.push_back(py::bool_(is_parameter));
  };
  if (PyList_Check(modules.ptr())) {
    for (const py::handle m : modules) walk_module_state(m.ptr(), seen, 0, "checkpoint region", visit);
  } else {
    walk_module_state(modules.ptr(), seen, 0, "checkpoint region", visit);
  }
  py::tuple refs(out.size());
  for (size_t i = 0; i < out.size(); ++i) refs[i] = std::move(out[i]);
  return refs;
}

// Whether `obj` is not a plain tensor or Parameter: a tensor subclass with Python dispatch
// (DTensor) or no tensor at all. FSDP2 swaps a module's sharded DTensor parameters and
// its unsharded ones in and out around forward and backward itself, so a slot holding a
// subclass on either side is its framework's business and is never put back.
bool subclass_or_other(PyObject* obj) {
  if (!THPVariable_Check(obj)) return true;
  return THPVariable_Unpack(obj).key_set().has(c10::DispatchKey::Python);
}

// Whether `obj`'s storage still holds its elements (a framework that frees gathered
// parameters after use, as ZeRO-3 does, resizes the storage to 0).
bool storage_intact(PyObject* obj) {
  const at::Tensor& t = THPVariable_Unpack(obj);
  if (t.numel() == 0 || !t.has_storage()) return true;
  return t.storage().nbytes() >=
         at::detail::computeStorageNbytes(t.sizes(), t.strides(), t.dtype().itemsize(),
                                          t.storage_offset());
}

// Puts each (dict, key, holder, is_parameter) of `refs` back where the dict holds another
// tensor under the key now, when the swap is one made for the forward only: a parameter
// slot that holds a module's own nn.Parameter again, where the forward's value was a plain
// tensor (torch.func.functional_call, stateless reparametrization), or a buffer slot
// reassigned since. Left alone: keys no longer in their dict; a tensor subclass or a
// non-tensor on either side (FSDP2 swaps sharded DTensor and unsharded parameters itself);
// a forward value dropped since (a weak holder) or whose storage was freed, and a
// parameter slot holding something else than an nn.Parameter now (a framework that
// gathers parameters into new tensors for each use: its backward's are the ones to use).
// With `undo`, every entry is set as given.
// Returns the entries it replaced, with the values it found (pass them back with `undo` to
// restore); empty when nothing was put back.
py::tuple put_module_state(const py::tuple& refs, bool undo) {
  std::vector<py::object> replaced;
  const Py_ssize_t n = PyTuple_GET_SIZE(refs.ptr());
  HP_CHECK_VALUE(n % 4 == 0, "put_module_state takes (dict, key, value, is_parameter) entries");
  for (Py_ssize_t i = 0; i < n; i += 4) {
    PyObject* dict = PyTuple_GET_ITEM(refs.ptr(), i);
    PyObject* key = PyTuple_GET_ITEM(refs.ptr(), i + 1);
    PyObject* value = PyTuple_GET_ITEM(refs.ptr(), i + 2);
    PyObject* is_param = PyTuple_GET_ITEM(refs.ptr(), i + 3);
    if (PyWeakref_Check(value)) {
      value = PyWeakref_GetObject(value);  // borrowed; None once the tensor is gone
      if (value == Py_None) continue;      // dropped after the forward: nothing to put back
    }
    PyObject* now = PyDict_GetItemWithError(dict, key);  // borrowed
    if (now == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;
    }
    if (now == value) continue;
    if (!undo) {
      if (subclass_or_other(now) || subclass_or_other(value) || !storage_intact(value)) continue;
      if (is_param == Py_True && (!is_parameter_object(now) || is_parameter_object(value))) {
        continue;
      }
    }
    replaced.push_back(py::reinterpret_borrow<py::object>(dict));
    replaced.push_back(py::reinterpret_borrow<py::object>(key));
    replaced.push_back(py::reinterpret_borrow<py::object>(now));
    replaced.push_back(py::reinterpret_borrow<py::object>(is_param));
    if (PyDict_SetItem(dict, key, value) != 0) throw py::error_already_set();
  }
  py::tuple out(replaced.size());
  for (size_t i = 0; i < replaced.size(); ++i) out[i] = std::move(replaced[i]);
  return out;
}

// The offsets into `refs` (module_state_refs' entries) of the buffer slots that hold
// another tensor now than when `refs` was taken: buffers the forward reassigned
// (`self.cache = ...`, `register_buffer` again). A key no longer in its dict, and a tensor
// subclass or non-tensor on either side, are left out (as put_module_state leaves them).
// Usually empty; one pointer comparison per buffer.
py::list reassigned_buffers(const py::tuple& refs) {
  py::list out;
  const Py_ssize_t n = PyTuple_GET_SIZE(refs.ptr());
  HP_CHECK_VALUE(n % 4 == 0, "reassigned_buffers takes module_state_refs' entries");
  for (Py_ssize_t i = 0; i < n; i += 4) {
    if (PyTuple_GET_ITEM(refs.ptr(), i + 3) == Py_True) continue;  // a parameter slot
    PyObject* now = PyDict_GetItemWithError(PyTuple_GET_ITEM(refs.ptr(), i),
                                            PyTuple_GET_ITEM(refs.ptr(), i + 1));
    if (now == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      continue;
    }
    PyObject* before = PyTuple_GET_ITEM(refs.ptr(), i + 2);
    if (now == before || subclass_or_other(now) || subclass_or_other(before)) continue;
    out.append(py::int_(i));
  }
  return out;
}

}  // namespace

void exclude_tensors(SwapGroup& group, const py::handle& tensors) {
  for (const auto& obj : tensors) exclude_one(group, obj);
}

void exclude_module_state(SwapGroup& group, const py::handle& module) {
  c10::SmallVector<PyObject*, 32> seen;  // (no allocation for a block's module tree)
  exclude_module_tree(group, module.ptr(), seen);
}

namespace {
// PackHook objects of this thread's ended regions (recycle_pack_hook), oldest first, each
// with the one reference this list owns. Autograd keeps a reference to the pack hook of
// every tensor saved under it until that tensor is freed, so a hook is reused only once
// this list's reference is its last. Raw pointers, leaked at thread exit: a thread's
// destructors may run without the GIL.
constexpr size_t kSpareHooks = 16;  // more layers than this in one forward: new objects
constexpr size_t kSpareScan = 4;    // entries looked at per region entry
thread_local std::vector<PyObject*> t_spare_hooks;
std::atomic<int64_t> g_pack_hooks_made{0};  // PackHook objects created by make_pack_hook
}  // namespace

int64_t pack_hooks_made() { return g_pack_hooks_made.load(std::memory_order_relaxed); }

py::object make_pack_hook(PackMode mode, py::object policy_fn, std::shared_ptr<RegionState> state) {
  // Reuse saves a pybind instance (allocation and registry insert) per region (issue 17).
  auto& spare = t_spare_hooks;
  const size_t scan = std::min(spare.size(), kSpareScan);
  for (size_t i = 0; i < scan; ++i) {
    PyObject* hook = spare[i];
    if (Py_REFCNT(hook) != 1) continue;
    spare.erase(spare.begin() + static_cast<std::ptrdiff_t>(i));
    auto owned = py::reinterpret_steal<py::object>(hook);
    owned.cast<PackHook&>().rebind(mode, std::move(policy_fn), std::move(state));
    return owned;
  }
  g_pack_hooks_made.fetch_add(1, std::memory_order_relaxed);
  return py::cast(PackHook(mode, std::move(policy_fn), std::move(state)));
}

void recycle_pack_hook(py::object hook) {
  if (hook.is_none() || t_spare_hooks.size() >= kSpareHooks) return;
  t_spare_hooks.push_back(hook.release().ptr());
}

bool is_stale_pack_hook(const py::handle& hook) {
  return py::isinstance<PackHook>(hook) && !hook.cast<const PackHook&>().live();
}

bool is_pack_hook(PyObject* hook) {
  // PackHook's Python type, compared exactly (a subclass answers false); leaked on
  // purpose, as the other module-lifetime objects.
  static PyObject* type = py::type::of<PackHook>().inc_ref().ptr();
  return reinterpret_cast<PyObject*>(Py_TYPE(hook)) == type;
}

namespace {

// The live group named `name`; null when it existed but died (every tensor it held is
// gone, so there is nothing left to move). Throws for a name never used.
std::shared_ptr<SwapGroup> group_by_name(const std::string& name) {
  auto group = engine().find_group(name);
  HP_CHECK_VALUE(group || engine().knows_group(name), "no live swap group named '", name,
                 "'. Create it with SwapManager().group_context(name) (or check "
                 "get_current_group_name()) before launching its offload or load.");
  return group;
}

}  // namespace

void warn_pool_refusal() {
  if (!SwapEngine::global().pool_warning_pending()) return;
  for (const std::string& msg : SwapEngine::global().take_pool_warnings()) {
    if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 1) < 0) throw py::error_already_set();
  }
}

void bind_swap(py::module_& m) {
  m.def("module_state_refs", &module_state_refs, py::arg("module"),
        "The (dict, key, value) triples of every _parameters / _buffers entry of the module's "
        "tree, flat in one tuple (shared submodules once).");
  m.def("reassigned_buffers", &reassigned_buffers, py::arg("refs"),
        "Offsets into module_state_refs' tuple of the buffer slots that hold another tensor "
        "now (reassigned by the forward).");
  m.def("put_module_state", &put_module_state, py::arg("refs"), py::arg("undo") = false,
        "Puts module_state_refs' values back where the forward's were swapped in for the "
        "forward only (see BindSwap.cpp); returns the replaced entries (pass them back with "
        "undo=True to restore), empty when nothing was put back.");
  py::enum_<PackMode>(m, "PackMode")
      .value("SWAP_ALL", PackMode::kSwapAll)
      .value("REGISTERED_ONLY", PackMode::kRegisteredOnly);

  py::class_<SavedHandle, std::shared_ptr<SavedHandle>>(m, "SavedHandle",
      "Opaque handle of a swapped saved tensor (returned by the pack hook).")
      .def_property_readonly("nbytes", [](const SavedHandle& h) { return h.record()->nbytes(); })
      .def_property_readonly("residency",
                             [](const SavedHandle& h) { return to_string(h.record()->state()); });

  py::class_<SwapGroup, std::shared_ptr<SwapGroup>>(m, "SwapGroup",
      "One invocation of a layer (or one manual group): the storages it swaps.")
      .def_property_readonly("id", &SwapGroup::id)
      .def_property_readonly("layer", &SwapGroup::layer)
      .def_property("name", &SwapGroup::name, &SwapGroup::set_name)
      .def_property_readonly("released", [](const SwapGroup& g) { return g.released; },
                             "Whether end_forward let this invocation leave the device.")
      .def_property_readonly("num_records", [](const SwapGroup& g) { return g.records().size(); })
      .def_property_readonly("record_bytes", [](const SwapGroup& g) {
        size_t n = 0;
        for (const auto& r : g.records()) n += r->nbytes();
        return n;
      })
      .def_property_readonly("storage_nbytes", [](const SwapGroup& g) {
        // Current bytes of each record's storage (0 while offloaded; -1 once it died).
        std::vector<int64_t> out;
        for (const auto& r : g.records()) {
          c10::Storage s = r->storage();
          out.push_back(s ? static_cast<int64_t>(s.nbytes()) : -1);
        }
        return out;
      })
      .def_property_readonly("skipped", [](const SwapGroup& g) {
        // reason -> (storages, bytes) of what this invocation did not offload at pack time.
        py::dict d;
        for (size_t i = 0; i < kNumSkipReasons; ++i) {
          if (g.skipped_count[i] == 0) continue;
          d[to_string(static_cast<SkipReason>(i))] = py::make_tuple(g.skipped_count[i],
                                                                    g.skipped_bytes[i]);
        }
        return d;
      })
      .def_property_readonly("order_reversed", [](const SwapGroup& g) { return g.order_reversed; })
      .def_property_readonly("residencies", [](const SwapGroup& g) {
        std::vector<std::string> out;
        for (const auto& r : g.records()) out.emplace_back(to_string(r->state()));
        return out;
      })
      .def("exclude", [](SwapGroup& g, const py::iterable& tensors) { exclude_tensors(g, tensors); },
           py::arg("tensors"), "Never swap the storages of these tensors in this invocation.")
      .def("exclude_module_state",
           [](SwapGroup& g, const py::handle& module) { exclude_module_state(g, module); },
           py::arg("module"),
           "Never swap the storages of the parameters and buffers of `module` (an nn.Module, "
           "submodules included) in this invocation.");

  py::class_<HostBufferPool, std::shared_ptr<HostBufferPool>>(m, "HostPool",
      "A host buffer pool of its own, capped at max_host_bytes (PinnedMemoryPool).")
      .def(py::init([](int64_t max_host_bytes, bool keep_when_full) {
             return HostBufferPool::create(/*pinned=*/false, /*max_cached_bytes=*/max_host_bytes,
                                           max_host_bytes, keep_when_full);
           }), py::arg("max_host_bytes"), py::arg("keep_when_full") = false)
      .def_property_readonly("max_host_bytes", &HostBufferPool::max_host_bytes)
      .def_property_readonly("keep_when_full", &HostBufferPool::keep_when_full)
      .def_property_readonly("pinned", &HostBufferPool::pinned)
      .def("stats", [](HostBufferPool& pool) {
        const HostBufferPoolStats st = pool.stats();
        py::dict d;
        d["bytes_in_use"] = st.bytes_in_use;
        d["bytes_pending"] = st.bytes_pending;
        d["bytes_cached"] = st.bytes_cached;
        d["allocations"] = st.allocations;
        d["reuses"] = st.reuses;
        d["cap_waits"] = st.cap_waits;
        d["refusals"] = st.refusals;
        return d;
      })
      .def("empty_cache", &HostBufferPool::empty_cache)
      .def("acquire_for_test", [](HostBufferPool& pool, size_t nbytes) {
        // A block held by the returned capsule-like object until it is dropped (tests).
        return std::shared_ptr<HostBlock>(pool.acquire(nbytes));
      }, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>());
  py::class_<HostBlock, std::shared_ptr<HostBlock>>(m, "HostBlock")
      .def_property_readonly("capacity", &HostBlock::capacity);
  m.def("set_group_pool", [](SwapGroup& g, std::shared_ptr<HostBufferPool> pool) {
    g.host_pool = std::move(pool);
  }, py::arg("group"), py::arg("pool"), "Host pool of the records this group adds.");
  m.def("find_group", [](const std::string& n) { return engine().find_group(n); },
        "The live group named n, or None (also for a name never used).");
  m.def("knows_group", [](const std::string& n) { return engine().knows_group(n); });
  m.def("forget_group", [](const std::string& n) { engine().forget_group(n); });
  m.def("live_group_count", [] { return engine().live_group_count(); });

  py::class_<PackHook>(m, "PackHook")
      .def(py::init<PackMode, py::object>(), py::arg("mode"), py::arg("policy_fn") = py::none())
      .def("__call__", &PackHook::operator(), py::arg("tensor"))
      .def_property_readonly("live", &PackHook::live);
  py::class_<DTensorHandle, std::shared_ptr<DTensorHandle>>(m, "DTensorHandle",
      "Opaque handle of a swapped saved DTensor: its local tensor's handle and its spec.")
      .def_property_readonly("local", [](const DTensorHandle& h) { return h.local; })
      .def_property_readonly("spec", [](const DTensorHandle& h) { return h.spec; });
  py::class_<SavedPassThrough, std::shared_ptr<SavedPassThrough>>(m, "SavedPassThrough",
      "A saved tensor kept as is, with the version seen at pack time.");
  m.def("unpack_hook", &unpack_hook, py::arg("packed"));

  py::class_<SavedBytesMeter, std::shared_ptr<SavedBytesMeter>>(m, "SavedBytesMeter",
      "Peak bytes of storages saved for backward (see SavedBytesMeter.h).")
      .def(py::init<>())
      .def("observe", [](SavedBytesMeter& meter, const py::object& obj) {
        if (!THPVariable_Check(obj.ptr())) return obj;
        const at::Tensor& t = THPVariable_Unpack(obj.ptr());
        if (!is_dtensor(obj)) {
          meter.observe(t);
        } else if (!is_parameter_like(t)) {
          meter.observe(dtensor_local(obj));  // a DTensor's bytes are its local shard's
        }
        return pass_through(obj, t);
      }, py::arg("tensor"),
      "Records the tensor's storage; returns what unpack_hook accepts (a pack hook).")
      .def("sample", &SavedBytesMeter::sample)
      .def_property_readonly("peak", &SavedBytesMeter::peak)
      .def_property_readonly("observed_storages", &SavedBytesMeter::observed_storages)
      .def("reset", &SavedBytesMeter::reset)
      .def("begin_epoch", &SavedBytesMeter::begin_epoch, py::arg("epoch"))
      .def("resaved_bytes", &SavedBytesMeter::resaved_bytes, py::arg("epoch"))
      .def("live_bytes", &SavedBytesMeter::live_bytes, py::arg("epoch"))
      .def("saved_in", &SavedBytesMeter::saved_in, py::arg("tensor"), py::arg("epoch"),
           "Whether the tensor's storage, alive, was saved in `epoch` (first or again).")
      .def("first_epoch", &SavedBytesMeter::first_epoch, py::arg("tensor"),
           "The epoch that first saved the tensor's storage, or None (not saved, or dead).")
      .def("activate", [](const std::shared_ptr<SavedBytesMeter>& meter) {
        HP_CHECK(SavedBytesMeter::active() == nullptr,
                 "another saved_activation_memory() meter is already active; nesting meters is "
                 "not supported, measure one region at a time");
        SavedBytesMeter::set_active(meter.get());
      })
      .def("deactivate", [](const std::shared_ptr<SavedBytesMeter>& meter) {
        if (SavedBytesMeter::active() == meter.get()) SavedBytesMeter::set_active(nullptr);
      });
  m.def("active_meter", []() -> py::object {
    return SavedBytesMeter::active() ? py::bool_(true) : py::bool_(false);
  });

  // Engine entry points (the process-wide SwapEngine).
  m.def("set_cpu_swap", [](bool on) { engine().set_cpu_swap(on); }, py::arg("enabled"));
  m.def("cpu_swap", [] { return engine().cpu_swap(); });
  m.def("set_cpu_delay_ns_per_byte", [](double d) { engine().set_cpu_delay_ns_per_byte(d); });
  m.def("set_prefetch_depth", [](int64_t d) {
    HP_CHECK_VALUE(d >= 0 && d <= 1 << 20, "prefetch depth must be an int in [0, 2**20] "
                   "(layers reloaded ahead), got ", d);
    engine().set_prefetch_depth(static_cast<int>(d));
  }, py::arg("depth"));
  m.def("set_offload_window", [](int64_t n) {
    HP_CHECK_VALUE(n >= 0 && n <= 1 << 20, "offload window must be an int in [0, 2**20] "
                   "(invocations with offloads in flight; 0: no limit), got ", n);
    engine().set_offload_window(static_cast<int>(n));
  }, py::arg("groups"),
        "How many invocations may have D2H copies in flight; later offloads queue, and those "
        "still queued when their backward begins stay on device (docs/design.md).");
  m.def("offload_window", [] { return engine().offload_window(); });
  m.def("set_debug_checks", [](bool on) { engine().set_debug_checks(on); }, py::arg("enabled"),
        "Check every release and every unpack against the release rules (SwapEngine.h).");
  m.def("debug_checks", [] { return engine().debug_checks(); });
  m.def("_set_skip_reload_wait", [](bool on) { engine().set_skip_reload_wait(on); },
        py::arg("skip"), "Fault injection for race tests only: unpack skips the H2D wait.");
  m.def("scheduled_layer_count", [] { return engine().scheduled_layer_count(); });
  m.def("thread_region_count", [] { return SwapEngine::thread_region_count(&engine()); },
        "Open regions (groups on this thread's current-group stack).");
  m.def("prefetch_depth", [] { return engine().prefetch_depth(); });
  m.def("set_fusion_threshold", [](int64_t b) { engine().set_fusion_threshold(b); });
  m.def("fusion_threshold", [] { return engine().fusion_threshold(); });
  m.def("new_layer", [] { return engine().new_layer(); });
  m.def("link_layers", [](int64_t a, int64_t b) { engine().link_layers(a, b); });
  m.def("remove_layer", [](int64_t l) { engine().remove_layer(l); });
  m.def("layer_scheduled", [](int64_t l) { return engine().layer_scheduled(l); });
  m.def("begin_forward", [](int64_t layer, const std::string& name, bool manual, bool group_swap) {
    return engine().begin_forward(layer, name, manual, group_swap);
  }, py::arg("layer"), py::arg("name"), py::arg("manual") = false, py::arg("group_swap") = false);
  m.def("end_forward", [](const std::shared_ptr<SwapGroup>& g) {
    const bool unscheduled = engine().end_forward(g);
    warn_pool_refusal();
    return unscheduled;
  });
  m.def("abort_forward", [](const std::shared_ptr<SwapGroup>& g) { engine().abort_forward(g); });
  m.def("backward_begin", [](const std::shared_ptr<SwapGroup>& g) { engine().backward_begin(g); },
        py::call_guard<py::gil_scoped_release>());
  m.def("prefetch_targets", [](const std::shared_ptr<SwapGroup>& g) {
    return engine().prefetch_targets(g);
  }, "The invocations backward_begin(group) reloads: group, then its predecessors.");
  m.def("current_group", [] { return engine().current_group(); });
  m.def("name_group", [](const std::shared_ptr<SwapGroup>& g) { engine().name_group(g); });
  m.def("set_group_swap", [](const std::shared_ptr<SwapGroup>& g, bool on) { g->set_group_swap(on); });
  m.def("register_tensor", [](const py::object& obj) {
    if (!THPVariable_Check(obj.ptr())) return false;
    if (is_dtensor(obj)) {  // registered through its local tensor, unless a parameter
      if (is_parameter_like(THPVariable_Unpack(obj.ptr()))) return false;
      return engine().register_tensor(engine().current_group(), dtensor_local(obj));
    }
    return engine().register_tensor(engine().current_group(), THPVariable_Unpack(obj.ptr()));
  }, py::arg("tensor"));
  m.def("launch_offload", [](const std::string& n) {
    if (auto g = group_by_name(n)) engine().launch_offload(g);
    warn_pool_refusal();
  });
  m.def("wait_offload", [](const std::string& n) {
    auto g = group_by_name(n);
    if (!g) return;
    py::gil_scoped_release no_gil;
    engine().wait_offload(g);
  });
  m.def("launch_load", [](const std::string& n) {
    if (auto g = group_by_name(n)) engine().launch_load(g);
  });
  m.def("wait_load", [](const std::string& n) {
    auto g = group_by_name(n);
    if (!g) return;
    py::gil_scoped_release no_gil;
    engine().wait_load(g);
  });
  m.def("synchronize", [] { engine().synchronize(); }, py::call_guard<py::gil_scoped_release>());
  m.def("reset", [](bool schedule) { engine().reset(schedule); }, py::arg("schedule") = true);
  m.def("residency", [](const py::object& obj) -> py::object {
    HP_CHECK_VALUE(THPVariable_Check(obj.ptr()), "residency() expects a tensor");
    const at::Tensor t = is_dtensor(obj) ? dtensor_local(obj) : THPVariable_Unpack(obj.ptr());
    const char* r = engine().residency_of(t);
    if (!r) return py::none();
    return py::str(r);
  }, py::arg("tensor"), "'device', 'offloading', 'host', 'reloading', or None if unmanaged "
     "(a DTensor: its local tensor's storage).");
  m.def("ineligible_reason", [](const py::object& obj) -> py::object {
    HP_CHECK_VALUE(THPVariable_Check(obj.ptr()), "ineligible_reason() expects a tensor");
    at::Tensor t = THPVariable_Unpack(obj.ptr());
    if (is_dtensor(obj)) {  // judged as the pack hook does: outer parameter rule, local data
      if (is_parameter_like(t)) return py::str(to_string(Ineligible::kParameter));
      t = dtensor_local(obj);
    }
    auto r = check_eligible(t, engine().cpu_swap());
    if (r == Ineligible::kNone) return py::none();
    return py::str(to_string(r));
  }, py::arg("tensor"));
  m.def("stats", [] {
    SwapStats s = engine().stats();
    py::dict d;
    d["offload_bytes"] = s.offload_bytes;
    d["offload_count"] = s.offload_count;
    d["reload_bytes"] = s.reload_bytes;
    d["reload_count"] = s.reload_count;
    d["resident_bytes"] = s.resident_bytes;
    d["peak_resident_bytes"] = s.peak_resident_bytes;
    d["pinned_bytes_in_use"] = s.pinned_bytes_in_use;
    d["pinned_bytes_cached"] = s.pinned_bytes_cached;
    d["host_bytes_pending"] = s.host_bytes_pending;
    d["host_allocations"] = s.host_allocations;
    d["host_reuses"] = s.host_reuses;
    d["fused_copies"] = s.fused_copies;
    d["transfers"] = s.transfers;
    d["stall_seconds"] = s.stall_seconds;
    d["on_demand_reloads"] = s.on_demand_reloads;
    d["deferred_frees"] = s.deferred_frees;
    d["release_points"] = s.release_points;
    d["prefetch_points"] = s.prefetch_points;
    d["worker_wakeups"] = s.worker_wakeups;
    d["inline_copies"] = s.inline_copies;
    d["live_records"] = s.live_records;
    d["window_in_flight"] = s.window_in_flight;
    d["window_complete"] = s.window_complete;
    py::dict skipped;  // reason -> {"count": storages, "bytes": bytes}; every reason listed
    for (size_t i = 0; i < kNumSkipReasons; ++i) {
      py::dict entry;
      entry["count"] = s.skipped_count[i];
      entry["bytes"] = s.skipped_bytes[i];
      skipped[to_string(static_cast<SkipReason>(i))] = entry;
    }
    d["skipped"] = skipped;
    return d;
  });
}

}  // namespace hyper_parallel::bindings
