#include "Bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "hyper_parallel C++ core (activation swap engine, checkpoint policies)";
  hyper_parallel::bindings::bind_policy(m);
  hyper_parallel::bindings::bind_swap(m);
  hyper_parallel::bindings::bind_region(m);
  hyper_parallel::bindings::bind_checkpoint(m);
  hyper_parallel::bindings::bind_trace(m);
  hyper_parallel::bindings::bind_planner(m);
  hyper_parallel::bindings::bind_intercept(m);
  hyper_parallel::bindings::bind_swap_call(m);
}
