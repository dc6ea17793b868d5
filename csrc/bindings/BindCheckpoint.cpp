#include "Bindings.h"

#include "hyper_parallel/activation/CheckpointPolicy.h"
#include "hyper_parallel/activation/OpPolicyTable.h"
#include "hyper_parallel/activation/RngStep.h"
#include "hyper_parallel/activation/SacCache.h"
#include "hyper_parallel/activation/SwapEngine.h"
#include "hyper_parallel/common/Macros.h"

#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace hyper_parallel::bindings {

using namespace activation;

namespace {

// Converts one leaf of an op's output. Returns false for values the cache does not hold
// (tensor subclasses such as DTensor or FakeTensor, SymInts, nested containers).
bool leaf_to_ivalue(PyObject* obj, std::vector<c10::IValue>& out) {
  if (obj == Py_None) {
    out.emplace_back();
  } else if (THPVariable_CheckExact(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.key_set().has(c10::DispatchKey::Python)) return false;
    out.emplace_back(t);
  } else if (PyBool_Check(obj)) {
    out.emplace_back(obj == Py_True);
  } else if (PyLong_CheckExact(obj)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow != 0) return false;
    out.emplace_back(static_cast<int64_t>(v));
  } else if (PyFloat_CheckExact(obj)) {
    out.emplace_back(PyFloat_AS_DOUBLE(obj));
  } else {
    return false;
  }
  return true;
}

bool to_ivalues(const py::handle& obj, std::vector<c10::IValue>& out, OutputKind& kind) {
  PyObject* p = obj.ptr();
  if (PyTuple_Check(p) || PyList_Check(p)) {
    kind = PyTuple_Check(p) ? OutputKind::kTuple : OutputKind::kList;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(p);
    PyObject** items = PySequence_Fast_ITEMS(p);
    out.reserve(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!leaf_to_ivalue(items[i], out)) return false;
    }
    return true;
  }
  kind = OutputKind::kSingle;
  return leaf_to_ivalue(p, out);
}

py::object from_ivalue(c10::IValue&& v) {
  if (v.isTensor()) {
    return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(v).toTensor()));
  }
  if (v.isNone()) return py::none();
  if (v.isBool()) return py::bool_(v.toBool());
  if (v.isInt()) return py::int_(v.toInt());
  if (v.isDouble()) return py::float_(v.toDouble());
  HP_INTERNAL_ASSERT(false, "unexpected cached value ", v.tagKind());
  return py::none();
}

// SacCache::input_signature of a Python op call: the tensors among `args` (a tuple) and
// `kwargs` (a dict) in order, nested lists and tuples included. 0 (unchecked) for None.
uint64_t mix_py(uint64_t h, PyObject* o, int depth) {
  if (THPVariable_Check(o)) {
    const at::Tensor& t = THPVariable_Unpack(o);
    return t.defined() ? SacCache::mix_signature(h, t) : h;
  }
  if (depth < 4 && (PyTuple_Check(o) || PyList_Check(o))) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    for (Py_ssize_t i = 0; i < n; ++i) h = mix_py(h, items[i], depth + 1);
  }
  return h;
}

uint64_t py_input_signature(const py::handle& args, const py::handle& kwargs) {
  if (args.is_none()) return 0;
  uint64_t h = mix_py(SacCache::kSignatureSeed, args.ptr(), 0);
  if (!kwargs.is_none() && PyDict_Check(kwargs.ptr())) {
    PyObject* key = nullptr;
    PyObject* value = nullptr;
    Py_ssize_t pos = 0;
    while (PyDict_Next(kwargs.ptr(), &pos, &key, &value)) h = mix_py(h, value, 1);
  }
  return h == 0 ? 1 : h;
}

py::object from_replay(SacCache::Replay&& r) {
  if (r.kind == OutputKind::kSingle) {
    HP_INTERNAL_ASSERT(r.outputs.size() == 1, "a single output cached as ", r.outputs.size());
    return from_ivalue(std::move(r.outputs[0]));
  }
  const size_t n = r.outputs.size();
  if (r.kind == OutputKind::kTuple) {
    py::tuple t(n);
    for (size_t i = 0; i < n; ++i) t[i] = from_ivalue(std::move(r.outputs[i]));
    return std::move(t);
  }
  py::list l(n);
  for (size_t i = 0; i < n; ++i) l[i] = from_ivalue(std::move(r.outputs[i]));
  return std::move(l);
}

// Whether the backward now running keeps its graph (retain_graph=True): then cached
// outputs must survive this recompute for the next backward.
bool backward_keeps_graph() { return torch::autograd::get_current_graph_task_keep_graph(); }

}  // namespace

void bind_checkpoint(py::module_& m) {
  m.def("intern_op", [](const std::string& name) { return OpNames::intern(name); },
        py::arg("name"),
        "Small integer key of an op name ('aten.mm.default'; 'aten::mm' spellings are "
        "normalised). Keys are process-wide and stable.");
  m.def("backward_keeps_graph", &backward_keeps_graph,
        "Whether the backward running on this thread keeps its graph (retain_graph=True).");
  m.def("input_signature", &py_input_signature, py::arg("args"), py::arg("kwargs") = py::none(),
        "SacCache's hash of the dtypes and shapes of the tensors among an op call's args "
        "(a tuple) and kwargs (a dict); 0 for args=None.");
  m.def("op_name", [](int64_t key) { return OpNames::name(key); }, py::arg("key"),
        "The op name of a key returned by intern_op.");

  py::class_<OpPolicyTable, std::shared_ptr<OpPolicyTable>>(m, "OpPolicyTable", R"doc(
Declarative selective-checkpoint policy: op name -> CheckpointPolicy, evaluated in C++.
Names are 'ns.op.overload' (one overload) or 'ns.op' (every overload of the op); ops in
neither get the default. See csrc/hyper_parallel/activation/OpPolicyTable.h.)doc")
      .def(py::init<CheckpointPolicy>(), py::arg("default") = CheckpointPolicy::PREFER_RECOMPUTE)
      .def("set", &OpPolicyTable::set, py::arg("name"), py::arg("policy"))
      .def_property("default", &OpPolicyTable::default_policy, &OpPolicyTable::set_default)
      .def("lookup", &OpPolicyTable::lookup, py::arg("op_name"),
           "Policy of the op with this full name ('aten.mm.default').")
      .def("policy_for", &OpPolicyTable::policy_for, py::arg("op_key"))
      .def("entries", &OpPolicyTable::entries)
      .def("__len__", &OpPolicyTable::size)
      .def("__repr__", [](const OpPolicyTable& t) {
        std::string s = "OpPolicyTable({";
        bool first = true;
        for (const auto& e : t.entries()) {
          s += (first ? "'" : ", '") + e.first + "': " + to_string(e.second);
          first = false;
        }
        return s + "}, default=" + to_string(t.default_policy()) + ")";
      });

  // Returned by SacCache.replay when the op must run again.
  static py::object* recompute_marker = new py::object(
      py::module_::import("builtins").attr("object")());
  m.attr("SAC_RECOMPUTE") = *recompute_marker;

  py::class_<RngStep>(m, "RngStep", R"doc(
What one random op did to its device's default generator in a selective checkpoint region's
forward (csrc/hyper_parallel/activation/RngStep.h): handed to SacCache.record with the op's
cached outputs, so that recompute moves the generator as running the op would have.
)doc")
      .def_static("before", &RngStep::before, py::arg("device"),
                  "The default generator's state of `device` (torch.device) before the op, or "
                  "None when the device has no default generator.")
      .def("after", &RngStep::after,
           "Right after the op: records the state; returns whether the op moved it.")
      .def("replay", &RngStep::replay,
           "Sets the generator to the 'after' state if it is at the 'before' state; returns "
           "whether it did.");

  py::class_<SacCache, std::shared_ptr<SacCache>>(m, "SacCache", R"doc(
State of one selective-checkpoint region invocation: per (op, call index) either a
'recompute' marker, cached outputs, or swap handles (MUST_SWAP). See
csrc/hyper_parallel/activation/SacCache.h.)doc")
      .def(py::init([](std::shared_ptr<OpPolicyTable> table, bool allow_cache_entry_mutation) {
             return std::make_shared<SacCache>(std::move(table), nullptr,
                                               allow_cache_entry_mutation);
           }),
           py::arg("table") = nullptr, py::arg("allow_cache_entry_mutation") = false)
      .def_property_readonly("table", [](const SacCache& c) {
        return std::const_pointer_cast<OpPolicyTable>(c.table());
      })
      .def("record",
           [](SacCache& c, int64_t op_key, const py::handle& out, const py::object& policy,
              std::optional<RngStep> rng, const py::handle& args, const py::handle& kwargs) {
             const CheckpointPolicy p =
                 policy.is_none() ? c.table_policy(op_key) : policy.cast<CheckpointPolicy>();
             std::vector<c10::IValue> values;
             OutputKind kind = OutputKind::kSingle;
             if (is_recompute(p)) {
               c.record(op_key, p, values, kind, nullptr);
               return true;
             }
             if (!to_ivalues(out, values, kind)) {
               c.record(op_key, CheckpointPolicy::PREFER_RECOMPUTE, {}, kind, nullptr);
               return false;
             }
             std::shared_ptr<SwapGroup> group;
             if (is_swap(p)) group = SwapEngine::global().current_group();
             c.record(op_key, p, values, kind, group, std::move(rng),
                      py_input_signature(args, kwargs));
             return true;
           },
           py::arg("op_key"), py::arg("output"), py::arg("policy") = py::none(),
           py::arg("rng") = py::none(), py::arg("args") = py::none(),
           py::arg("kwargs") = py::none(),
           "Records the next call of op_key in forward with `policy` (None: the table's); "
           "`rng`: a random op's RngStep (after() called), replayed with its outputs. "
           "`args`, `kwargs`: the call's arguments, whose tensors' dtypes and shapes replay "
           "checks (None: not checked). "
           "Returns False when the output could not be cached (a tensor subclass, SymInt, ...) "
           "and the call was recorded as 'recompute' instead.")
      .def("end_forward",
           [](SacCache& c) {
             py::list out;
             for (const auto& d : c.end_forward()) {
               out.append(py::make_tuple(OpNames::name(d.op_key), d.call, d.policy));
             }
             return out;
           },
           "Demotes to 'recompute' the cached entries modified in place during the forward; "
           "returns [(op name, call index, requested policy)] of those.")
      .def("before_write",
           [](SacCache& c, const py::handle& target) {
             // A tensor, or a sequence of them (an op's written argument).
             PyObject* p = target.ptr();
             if (THPVariable_Check(p)) {
               c.before_write(THPVariable_Unpack(p));
             } else if (PyTuple_Check(p) || PyList_Check(p)) {
               const Py_ssize_t n = PySequence_Fast_GET_SIZE(p);
               PyObject** items = PySequence_Fast_ITEMS(p);
               for (Py_ssize_t i = 0; i < n; ++i) {
                 if (THPVariable_Check(items[i])) c.before_write(THPVariable_Unpack(items[i]));
               }
             }
           },
           py::arg("target"),
           "An op of the region's forward is about to write `target` (a tensor or a sequence "
           "of them): a cached output sharing its storage is demoted by end_forward().")
      .def("watch",
           [](SacCache& c, const py::handle& out) {
             // The tensors of an op's output (a tensor, or a tuple / list of them).
             std::vector<c10::IValue> values;
             PyObject* p = out.ptr();
             auto add = [&values](PyObject* o) {
               if (THPVariable_Check(o)) values.emplace_back(THPVariable_Unpack(o));
             };
             if (PyTuple_Check(p) || PyList_Check(p)) {
               const Py_ssize_t n = PySequence_Fast_GET_SIZE(p);
               PyObject** items = PySequence_Fast_ITEMS(p);
               for (Py_ssize_t i = 0; i < n; ++i) add(items[i]);
             } else {
               add(p);
             }
             if (!values.empty()) c.watch(values);
           },
           py::arg("output"),
           "An op of the region's forward returned `output`: its tensors that share a cached "
           "output's storage through another version counter are watched (SacCache.h).")
      .def("begin_recompute", &SacCache::begin_recompute)
      .def("replay",
           [](SacCache& c, int64_t op_key, const py::handle& args,
              const py::handle& kwargs) -> py::object {
             const bool retain = backward_keeps_graph();
             // Taken before the GIL is released, for a cached call only.
             const bool check = c.next_is_cached(op_key);
             const uint64_t inputs = check ? py_input_signature(args, kwargs) : 0;
             SacCache::Replay r;
             {
               py::gil_scoped_release no_gil;  // may wait for a reload
               r = c.replay(op_key, retain, [inputs] { return inputs; });
             }
             if (r.recompute) return *recompute_marker;
             return from_replay(std::move(r));
           },
           py::arg("op_key"), py::arg("args") = py::none(), py::arg("kwargs") = py::none(),
           "The cached outputs of the next call of op_key in this recompute pass, or "
           "SAC_RECOMPUTE when the op must run again. `args`, `kwargs`: the recompute call's "
           "arguments; a cached call whose forward had tensors of other dtypes or shapes "
           "there raises (the recomputed op sequence differs).")
      .def("next_is_cached", &SacCache::next_is_cached, py::arg("op_key"),
           "Whether the next replay of op_key in this pass hands back cached outputs.")
      .def("stats", [](const SacCache& c) {
        const SacCacheStats s = c.stats();
        py::dict d;
        d["recompute_entries"] = s.recompute_entries;
        d["saved_entries"] = s.saved_entries;
        d["swapped_entries"] = s.swapped_entries;
        d["dropped_entries"] = s.dropped_entries;
        d["saved_tensors"] = s.saved_tensors;
        d["swapped_tensors"] = s.swapped_tensors;
        d["replays"] = s.replays;
        return d;
      })
      .def("cached_tensors", &SacCache::cached_tensors, py::arg("swapped") = false,
           "Fresh aliases of the live cached tensors (swapped ones, or those kept on device).")
      .def("clear", &SacCache::clear);
}

}  // namespace hyper_parallel::bindings
