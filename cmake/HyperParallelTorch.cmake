# Locate the torch that is installed in the Python interpreter we build for.
#
# We deliberately do NOT call find_package(Torch): on a CUDA build of torch its
# Caffe2Config.cmake requires the CUDA toolkit at configure time, and our core is
# device-generic C++ that needs no CUDA headers (research/cpp_feasibility.md Q8).
# Instead we ask torch itself for its include and library paths and its C++ ABI.
#
# Provides:
#   hp::torch          INTERFACE target: includes, c10/torch/torch_cpu, ABI define, C++ std
#   hp::torch_python   INTERFACE target: hp::torch + libtorch_python (bindings only)
#   HP_TORCH_VERSION   e.g. 2.13.0
#   Python_EXECUTABLE, Python_SOABI via FindPython (Development.Module)

find_package(Python 3.9 REQUIRED COMPONENTS Interpreter Development.Module)

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c
"import torch, torch.utils.cpp_extension as ce
print(torch.__version__.split('+')[0])
print('|'.join(ce.include_paths()))
print('|'.join(ce.library_paths()))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _hp_torch_info
  RESULT_VARIABLE _hp_torch_rc
  ERROR_VARIABLE _hp_torch_err
  OUTPUT_STRIP_TRAILING_WHITESPACE)
if(NOT _hp_torch_rc EQUAL 0)
  message(FATAL_ERROR
    "hyper_parallel: could not import torch with ${Python_EXECUTABLE}:\n${_hp_torch_err}\n"
    "Install torch first (for example `pip install torch==2.13.0`), then rebuild with "
    "`pip install --no-build-isolation -e .` or `bash scripts/setup.sh`.")
endif()
string(REPLACE "\n" ";" _hp_torch_lines "${_hp_torch_info}")
list(GET _hp_torch_lines 0 HP_TORCH_VERSION)
list(GET _hp_torch_lines 1 _hp_torch_includes)
list(GET _hp_torch_lines 2 _hp_torch_libdirs)
list(GET _hp_torch_lines 3 _hp_torch_cxx11_abi)
string(REPLACE "|" ";" _hp_torch_includes "${_hp_torch_includes}")
string(REPLACE "|" ";" _hp_torch_libdirs "${_hp_torch_libdirs}")

if(HP_TORCH_VERSION VERSION_LESS 2.6 OR HP_TORCH_VERSION VERSION_GREATER_EQUAL 2.15)
  message(WARNING "hyper_parallel supports torch 2.6 to 2.14; found ${HP_TORCH_VERSION}")
endif()
# torch >= 2.12 headers require C++20 (ATen/ATen.h #error); older ones build as C++17.
if(HP_TORCH_VERSION VERSION_GREATER_EQUAL 2.12)
  set(HP_CXX_STANDARD 20)
else()
  set(HP_CXX_STANDARD 17)
endif()
message(STATUS "hyper_parallel: torch ${HP_TORCH_VERSION}, C++${HP_CXX_STANDARD}, "
               "_GLIBCXX_USE_CXX11_ABI=${_hp_torch_cxx11_abi}")

set(_hp_torch_libs)
foreach(_lib c10 torch torch_cpu)
  find_library(HP_LIB_${_lib} NAMES ${_lib} PATHS ${_hp_torch_libdirs} NO_DEFAULT_PATH REQUIRED)
  list(APPEND _hp_torch_libs ${HP_LIB_${_lib}})
endforeach()
find_library(HP_LIB_torch_python NAMES torch_python PATHS ${_hp_torch_libdirs} NO_DEFAULT_PATH REQUIRED)
set(HP_TORCH_LIBRARY_DIRS ${_hp_torch_libdirs})

add_library(hp_torch INTERFACE)
add_library(hp::torch ALIAS hp_torch)
target_include_directories(hp_torch SYSTEM INTERFACE ${_hp_torch_includes})
target_link_libraries(hp_torch INTERFACE ${_hp_torch_libs})
target_compile_definitions(hp_torch INTERFACE _GLIBCXX_USE_CXX11_ABI=${_hp_torch_cxx11_abi})
target_compile_features(hp_torch INTERFACE cxx_std_${HP_CXX_STANDARD})

add_library(hp_torch_python INTERFACE)
add_library(hp::torch_python ALIAS hp_torch_python)
target_link_libraries(hp_torch_python INTERFACE hp_torch ${HP_LIB_torch_python})
