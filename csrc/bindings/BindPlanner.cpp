#include "Bindings.h"

#include "hyper_parallel/planner/Planner.h"

namespace py = pybind11;

namespace hyper_parallel::bindings {

using namespace planner;

void bind_planner(py::module_& m) {
  py::class_<OptionCost>(m, "PlannerOptionCost",
                         "One strategy's profiled cost for one layer (bytes, seconds); see "
                         "csrc/hyper_parallel/planner/CostModel.h.")
      .def(py::init([](int64_t kept, int64_t offload, double fwd, double bwd, int64_t deferred,
                       int64_t shared, int64_t held, int64_t input, int64_t output) {
             return OptionCost{kept, offload, fwd, bwd, deferred, shared, held, input, output};
           }),
           py::arg("kept_bytes"), py::arg("offload_bytes"), py::arg("forward_seconds"),
           py::arg("backward_seconds"), py::arg("deferred_bytes") = 0,
           py::arg("shared_bytes") = 0, py::arg("held_bytes") = 0, py::arg("input_bytes") = 0,
           py::arg("output_bytes") = 0)
      .def_readwrite("kept_bytes", &OptionCost::kept_bytes)
      .def_readwrite("offload_bytes", &OptionCost::offload_bytes)
      .def_readwrite("deferred_bytes", &OptionCost::deferred_bytes)
      .def_readwrite("shared_bytes", &OptionCost::shared_bytes)
      .def_readwrite("held_bytes", &OptionCost::held_bytes)
      .def_readwrite("input_bytes", &OptionCost::input_bytes)
      .def_readwrite("output_bytes", &OptionCost::output_bytes)
      .def_readwrite("forward_seconds", &OptionCost::forward_seconds)
      .def_readwrite("backward_seconds", &OptionCost::backward_seconds);

  py::class_<StepProfile>(m, "PlannerProfile",
                          "A profiled step: per layer and option costs, bytes and time outside "
                          "the layers, copy links (CostModel.h).")
      .def(py::init<>())
      .def_readwrite("options", &StepProfile::options)
      .def_readwrite("layers", &StepProfile::layers)
      .def_readwrite("base_bytes", &StepProfile::base_bytes)
      .def_readwrite("tail_bytes", &StepProfile::tail_bytes)
      .def_readwrite("tail_held_bytes", &StepProfile::tail_held_bytes)
      .def_readwrite("outside_seconds", &StepProfile::outside_seconds)
      .def_readwrite("tail_seconds", &StepProfile::tail_seconds)
      .def_readwrite("prefetch_depth", &StepProfile::prefetch_depth)
      .def_readwrite("offload_window", &StepProfile::offload_window)
      .def("set_links",
           [](StepProfile& p, double d2h_latency, double d2h_per_byte, double h2d_latency,
              double h2d_per_byte) {
             p.d2h = CopyLink{d2h_latency, d2h_per_byte};
             p.h2d = CopyLink{h2d_latency, h2d_per_byte};
           },
           py::arg("d2h_latency"), py::arg("d2h_seconds_per_byte"), py::arg("h2d_latency"),
           py::arg("h2d_seconds_per_byte"))
      .def("validate", &StepProfile::validate);

  auto prediction_dict = [](const Prediction& p) {
    py::dict d;
    d["peak_bytes"] = p.peak_bytes;
    d["step_seconds"] = p.step_seconds;
    d["stall_seconds"] = p.stall_seconds;
    d["offload_bytes"] = p.offload_bytes;
    d["host_peak_bytes"] = p.host_peak_bytes;
    d["peak_layer"] = p.peak_layer;
    d["peak_in_backward"] = p.peak_in_backward;
    return d;
  };
  m.def("planner_evaluate",
        [prediction_dict](const StepProfile& p, const std::vector<int>& assignment) {
          p.validate();  // negative or overflowing bytes, bad times: a clear error
          return prediction_dict(evaluate(p, assignment));
        },
        py::arg("profile"), py::arg("assignment"),
        "Predicted peak bytes and step seconds of one assignment (option index per layer).");

  auto result = [prediction_dict](const PlanResult& r) -> py::object {
    if (!r.feasible) return py::none();
    py::dict stats;
    stats["labels_created"] = r.stats.labels_created;
    stats["labels_kept"] = r.stats.labels_kept;
    stats["widest_layer"] = r.stats.widest_layer;
    stats["exact"] = r.stats.exact;
    stats["lower_bound_seconds"] = r.stats.lower_bound;  // NaN: none known
    // min_peak(): no plan peaks below this (bytes); the plan's own peak where it is proven
    // the least. -1 from solve().
    stats["least_peak_bound_bytes"] = r.stats.least_peak_bound;
    return py::make_tuple(r.assignment, prediction_dict(r.prediction), stats);
  };
  py::class_<Planner>(m, "Planner", "Exact per-layer strategy optimizer (Planner.h).")
      .def(py::init<StepProfile, int64_t, double>(), py::arg("profile"),
           py::arg("byte_quantum") = 1, py::arg("time_tolerance") = 0.0)
      .def("solve",
           [result](const Planner& pl, int64_t budget, const std::vector<uint64_t>& allowed,
                    int64_t host_budget, int64_t deepening_labels) {
             PlanResult r;
             {
               py::gil_scoped_release no_gil;
               r = pl.solve(budget, allowed, host_budget, deepening_labels);
             }
             return result(r);
           },
           py::arg("budget_bytes"), py::arg("allowed") = std::vector<uint64_t>{},
           py::arg("host_budget_bytes") = -1, py::arg("deepening_labels") = kDeepeningLabels,
           "(assignment, prediction, search stats) of the fastest plan within the budgets "
           "(host_budget_bytes < 0: unbounded), or None. deepening_labels: the labels the "
           "exact searches that prove a plan optimal may create after the capped searches "
           "(Planner.h; 0: the capped searches' plan stands, with its proven gap).")
      .def("min_peak",
           [result](const Planner& pl, const std::vector<uint64_t>& allowed,
                    int64_t host_budget) {
             PlanResult r;
             {
               py::gil_scoped_release no_gil;
               r = pl.min_peak(allowed, host_budget);
             }
             return result(r);
           },
           py::arg("allowed") = std::vector<uint64_t>{}, py::arg("host_budget_bytes") = -1,
           "(assignment, prediction, search stats) at the smallest budget solve() meets, or "
           "None when the host budget cannot be met.");
}

}  // namespace hyper_parallel::bindings
