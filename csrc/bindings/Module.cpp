#include "Bindings.h"

#include <c10/util/Exception.h>

namespace {

// Python classes for the core's c10::ValueError / TypeError / IndexError: each derives from
// the matching Python exception and from RuntimeError (what pybind11 raised for them
// before, so `except RuntimeError` keeps working), and carries the message without the
// C++ backtrace that c10::Error::what() appends.
PyObject* new_error(const char* name, PyObject* base, const char* doc) {
  PyObject* bases = PyTuple_Pack(2, base, PyExc_RuntimeError);
  PyObject* cls = PyErr_NewExceptionWithDoc(name, doc, bases, nullptr);
  Py_DECREF(bases);
  if (cls == nullptr) throw py::error_already_set();
  return cls;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hyper_parallel C++ core (activation swap engine, checkpoint policies)";
  static PyObject* value_error =
      new_error("hyper_parallel._C.HyperParallelValueError", PyExc_ValueError,
                "A bad argument to the hyper_parallel core (a ValueError and a RuntimeError).");
  static PyObject* type_error =
      new_error("hyper_parallel._C.HyperParallelTypeError", PyExc_TypeError,
                "An argument of the wrong type (a TypeError and a RuntimeError).");
  static PyObject* index_error =
      new_error("hyper_parallel._C.HyperParallelIndexError", PyExc_IndexError,
                "An index out of range (an IndexError and a RuntimeError).");
  m.attr("HyperParallelValueError") = py::handle(value_error);
  m.attr("HyperParallelTypeError") = py::handle(type_error);
  m.attr("HyperParallelIndexError") = py::handle(index_error);
  // Other c10::Error kinds (out of memory among them) keep pybind11's default translation.
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const c10::ValueError& e) {
      PyErr_SetString(value_error, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      PyErr_SetString(type_error, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      PyErr_SetString(index_error, e.what_without_backtrace());
    }
  });
  hyper_parallel::bindings::bind_policy(m);
  hyper_parallel::bindings::bind_swap(m);
  hyper_parallel::bindings::bind_region(m);
  hyper_parallel::bindings::bind_checkpoint(m);
  hyper_parallel::bindings::bind_trace(m);
  hyper_parallel::bindings::bind_planner(m);
  hyper_parallel::bindings::bind_intercept(m);
  hyper_parallel::bindings::bind_swap_call(m);
}
