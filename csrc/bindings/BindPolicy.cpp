#include "Bindings.h"

#include "hyper_parallel/activation/CheckpointPolicy.h"

#include <pybind11/native_enum.h>

namespace py = pybind11;

namespace hyper_parallel::bindings {

using activation::CheckpointPolicy;

void bind_policy(py::module_& m) {
  // A real Python enum.Enum (as torch's CheckpointPolicy is), built from the C++ enum,
  // which stays the one definition. The Python layer adds the conversions with torch's
  // enum (src/hyper_parallel/core/activation_checkpoint/_policy.py).
  py::native_enum<CheckpointPolicy>(m, "CheckpointPolicy", "enum.Enum", R"doc(
What to do with an op output inside a checkpoint region (or a saved tensor in a swap
region). Values match torch.utils.checkpoint.CheckpointPolicy for 0..3; MUST_SWAP (4)
offloads the output to host memory and reloads it before backward (torch's
MUST_CPU_OFFLOAD, also 4).)doc")
      .value("MUST_SAVE", CheckpointPolicy::MUST_SAVE)
      .value("PREFER_SAVE", CheckpointPolicy::PREFER_SAVE)
      .value("MUST_RECOMPUTE", CheckpointPolicy::MUST_RECOMPUTE)
      .value("PREFER_RECOMPUTE", CheckpointPolicy::PREFER_RECOMPUTE)
      .value("MUST_SWAP", CheckpointPolicy::MUST_SWAP)
      .finalize();
  m.def("policy_from_string",
        [](const std::string& name) -> py::object {
          auto p = activation::policy_from_string(name);
          if (!p) return py::none();
          return py::cast(*p);
        },
        py::arg("name"),
        "CheckpointPolicy for a name (torch's MUST_CPU_OFFLOAD/PREFER_CPU_OFFLOAD map to "
        "MUST_SWAP), or None.");
  m.def("policy_from_int", &activation::policy_from_int, py::arg("value"));
}

}  // namespace hyper_parallel::bindings
