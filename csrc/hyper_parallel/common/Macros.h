#pragma once
// Error macros for hyper_parallel.
//
// HP_CHECK is for user errors: it throws c10::Error (RuntimeError in Python) whose
// message starts with "hyper_parallel: " and should say what to do next.
// HP_INTERNAL_ASSERT is for invariants of the engine itself: a failure is a bug.

#include <c10/util/Exception.h>

#define HP_CHECK(cond, ...) TORCH_CHECK((cond), "hyper_parallel: ", __VA_ARGS__)
#define HP_CHECK_VALUE(cond, ...) TORCH_CHECK_VALUE((cond), "hyper_parallel: ", __VA_ARGS__)
#define HP_INTERNAL_ASSERT(cond, ...)                                               \
  TORCH_INTERNAL_ASSERT((cond), "hyper_parallel internal error (please report): ", \
                        ##__VA_ARGS__)
