// Bindings of the swap timeline (Trace.h): hyper_parallel.activation_trace drives them.

#include "Bindings.h"

#include "hyper_parallel/activation/Trace.h"

namespace py = pybind11;

namespace hyper_parallel::bindings {

using activation::Trace;
using activation::TraceItem;

void bind_trace(py::module_& m) {
  m.def("trace_start", [] { Trace::global().start(); },
        "Starts recording the swap timeline. Raises RuntimeError if one is recording.");
  m.def("trace_stop", [] {
    std::vector<TraceItem> items;
    {
      py::gil_scoped_release release;  // waits for the recorded copies
      items = Trace::global().stop();
    }
    py::list out;
    for (const auto& it : items) {
      py::dict d;
      d["kind"] = it.kind;
      d["label"] = it.label;
      d["stream"] = it.stream;
      d["device"] = it.device;
      d["bytes"] = it.bytes;
      d["count"] = it.count;
      d["enqueue_ns"] = it.enqueue_ns;
      d["start_ns"] = it.start_ns;
      d["end_ns"] = it.end_ns;
      d["thread"] = it.thread;
      out.append(std::move(d));
    }
    return out;
  }, "Stops recording; returns the items (dicts; times in ns of the host's steady clock).");
  m.def("trace_now_ns", &activation::trace_now_ns);
}

}  // namespace hyper_parallel::bindings
