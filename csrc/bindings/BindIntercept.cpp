#include "Bindings.h"

#include "hyper_parallel/activation/OpInterceptor.h"
#include "hyper_parallel/activation/OpPolicyTable.h"

#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>

namespace py = pybind11;

namespace hyper_parallel::bindings {

using namespace activation;

namespace {

// The classifier of _selective.py: classify("aten::mm.default") -> (key, kind, writes,
// is_to_copy, is_random) or None (schema rules).
OpClassifier python_classifier(py::object fn) {
  auto held = std::make_shared<py::object>(std::move(fn));
  return [held](const c10::OperatorHandle& op) {
    const auto& name = op.operator_name();
    const std::string full =
        name.name + "." + (name.overload_name.empty() ? "default" : name.overload_name);
    py::gil_scoped_acquire gil;
    py::object res = (*held)(full);
    if (res.is_none()) return facts_from_schema(op);
    auto t = res.cast<py::tuple>();
    OpFacts f;
    f.key = t[0].cast<int64_t>();
    f.kind = static_cast<OpKind>(t[1].cast<int>());
    f.writes = t[2].cast<std::vector<int>>();
    f.to_copy = t[3].cast<bool>();
    f.seeded = t.size() > 4 && t[4].cast<bool>();
    return f;
  };
}

// A collective of a C++-intercepted region goes to Python:
// handler(op_name, args, kwargs, recompute) -> output (as the op returns it).
SacRegion::CollectiveFn python_collective(py::object fn) {
  auto held = std::make_shared<py::object>(std::move(fn));
  return [held](const c10::OperatorHandle& op, torch::jit::Stack* stack, bool recompute) {
    const auto& schema = op.schema();
    const auto& arguments = schema.arguments();
    const size_t n = arguments.size();
    py::gil_scoped_acquire gil;
    py::list args;
    py::dict kwargs;
    auto values = torch::jit::last(*stack, n);
    for (size_t i = 0; i < n; ++i) {
      py::object v = torch::jit::toPyObject(values[i]);
      if (arguments[i].kwarg_only()) {
        kwargs[py::str(arguments[i].name())] = std::move(v);
      } else {
        args.append(std::move(v));
      }
    }
    torch::jit::drop(*stack, n);
    const auto& name = op.operator_name();
    py::object out = (*held)(name.name + "." + (name.overload_name.empty() ? "default"
                                                                           : name.overload_name),
                             py::tuple(args), kwargs, recompute);
    const auto& returns = schema.returns();
    if (returns.size() == 1) {
      stack->push_back(torch::jit::toIValue(out, returns[0].type()));
    } else {
      auto t = out.cast<py::sequence>();
      for (size_t i = 0; i < returns.size(); ++i) {
        stack->push_back(torch::jit::toIValue(t[i], returns[i].type()));
      }
    }
  };
}

}  // namespace

void bind_intercept(py::module_& m) {
  m.def("intercept_install", &OpInterceptor::install,
        "Registers the C++ selective-checkpoint interception (idempotent); whether it is "
        "available on this torch (csrc/hyper_parallel/activation/OpInterceptor.h).");
  m.def("intercept_unavailable_reason", &OpInterceptor::unavailable_reason);
  m.def("set_op_classifier",
        [](py::object fn) { OpInterceptor::set_classifier(python_classifier(std::move(fn))); },
        py::arg("classify"),
        "classify('ns::op.overload') -> (op key, kind, written positions, is _to_copy, "
        "is random) or None; called once per op (memoised in C++).");
  m.def("forget_intercepted_ops", &OpInterceptor::forget_ops);
  m.def("intercepted_total", &OpInterceptor::intercepted_total,
        "Ops handled in C++ by selective-checkpoint regions so far (process-wide).");
  m.def("intercept_depth", &OpInterceptor::depth,
        "C++-intercepted regions active on this thread.");

  py::class_<SacRegion, std::shared_ptr<SacRegion>>(m, "SacRegion", R"doc(
One selective-checkpoint region invocation whose ops are intercepted in C++ (a declarative
policy): its SacCache and the record of tensors from outside the region. See
csrc/hyper_parallel/activation/OpInterceptor.h.)doc")
      .def(py::init([](std::shared_ptr<SacCache> cache, py::object describe) {
             ExternalReads::Describe d;
             if (!describe.is_none()) {
               auto held = std::make_shared<py::object>(std::move(describe));
               d = [held](const at::Tensor& t) {
                 py::gil_scoped_acquire gil;
                 return (*held)(py::reinterpret_steal<py::object>(THPVariable_Wrap(t)))
                     .cast<std::string>();
               };
             }
             return std::make_shared<SacRegion>(std::move(cache), std::move(d));
           }),
           py::arg("cache"), py::arg("describe") = py::none())
      .def_property_readonly("cache", &SacRegion::cache)
      .def("set_collective_handler",
           [](SacRegion& r, py::object fn) { r.set_collective_fn(python_collective(std::move(fn))); })
      .def("enter_forward", &SacRegion::enter_forward)
      .def("enter_recompute", &SacRegion::enter_recompute)
      .def("exit", &SacRegion::exit)
      .def("end_forward", &SacRegion::end_forward)
      .def_property_readonly("written", &SacRegion::written)
      .def("written_tensors", &SacRegion::written_tensors,
           "External tensors the forward wrote and whose value was kept.")
      .def("recompute_save",
           [](SacRegion& r, const at::Tensor& t) {
             auto s = r.recompute_save(t);
             return py::make_tuple(std::move(s.tensor), s.watch);
           },
           py::arg("tensor"),
           "(tensor to save in place of `tensor`, whether it shares memory with a private "
           "copy of a written external tensor); see ExternalReads::recompute_save.")
      .def("read_in_forward", &SacRegion::read_in_forward, py::arg("tensor"),
           "Whether the forward read `tensor`'s value (ExternalReads::read_in_forward).")
      .def("add_excluding", &SacRegion::add_excluding, py::arg("delta"))
      .def_property_readonly("intercepted", &SacRegion::intercepted)
      .def_property_readonly("python_calls", &SacRegion::python_calls);
}

}  // namespace hyper_parallel::bindings
