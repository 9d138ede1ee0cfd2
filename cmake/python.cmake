# The Python extension `reshard._C` (pybind11 + LibTorch). Included by the top-level CMakeLists when
# RESHARD_BUILD_PYTHON=ON. Built by `pip install --no-build-isolation .` (scikit-build-core, SKBUILD
# set), it is installed into the package; a plain CMake build writes it into python/reshard/ so that
#   PYTHONPATH=<repo>/python python -c "import reshard"
# works from the source tree (benchmarks/gpu_check.sh builds that way). The Python that builds it
# (-DPython_EXECUTABLE, or the one pip runs) must import torch and pybind11: their CMake folders
# are asked of it.
#
# Only csrc/python/torch_bindings.cc includes torch headers (compile time on small machines); the
# communicator that calls back into torch.distributed (csrc/python/torch_comm.cc) needs only pybind11.

find_package(Python COMPONENTS Interpreter Development.Module REQUIRED)
execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import torch.utils, pybind11; print(torch.utils.cmake_prefix_path + ';' + pybind11.get_cmake_dir())"
  OUTPUT_VARIABLE RESHARD_PY_CMAKE_DIRS OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE RESHARD_PY_RC)
if(NOT RESHARD_PY_RC EQUAL 0)
  message(FATAL_ERROR "${Python_EXECUTABLE} cannot import torch and pybind11, which the extension builds "
          "against. Install torch first, then `pip install --no-build-isolation .` (an isolated build has no torch), "
          "or configure with -DRESHARD_BUILD_PYTHON=OFF.")
endif()
list(APPEND CMAKE_PREFIX_PATH ${RESHARD_PY_CMAKE_DIRS})
find_package(pybind11 CONFIG REQUIRED)

# The CPU wheel's TorchConfig needs no CUDA; keep its CUDA probing off on hosts that have a toolkit.
set(USE_CUDA OFF CACHE BOOL "" FORCE)
set(CAFFE2_USE_CUDNN OFF CACHE BOOL "" FORCE)
find_package(Torch REQUIRED)

execute_process(
  COMMAND ${Python_EXECUTABLE} -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"
  OUTPUT_VARIABLE RESHARD_TORCH_LIB_DIR OUTPUT_STRIP_TRAILING_WHITESPACE)
find_library(RESHARD_TORCH_PYTHON_LIB torch_python PATHS ${RESHARD_TORCH_LIB_DIR} NO_DEFAULT_PATH REQUIRED)

file(GLOB RESHARD_PY_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/csrc/python/*.cc)
# NO_EXTRAS: no link-time optimisation (it doubled the link time on 2 cores for no measurable gain).
pybind11_add_module(reshard_python MODULE NO_EXTRAS ${RESHARD_PY_SRC})
set_target_properties(reshard_python PROPERTIES
  OUTPUT_NAME _C
  # torch's libraries are loaded by `import torch` (reshard/__init__.py imports it first); the
  # rpaths only help tools that open the module without Python. Installed, torch lies beside the
  # package in the same site-packages.
  BUILD_RPATH "${RESHARD_TORCH_LIB_DIR}"
  INSTALL_RPATH "$ORIGIN/../torch/lib")
if(NOT SKBUILD)
  set_target_properties(reshard_python PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${CMAKE_SOURCE_DIR}/python/reshard)
endif()
target_include_directories(reshard_python PRIVATE ${CMAKE_SOURCE_DIR}/csrc ${TORCH_INCLUDE_DIRS})
target_compile_definitions(reshard_python PRIVATE TORCH_EXTENSION_NAME=_C)
target_link_libraries(reshard_python PRIVATE reshard ${TORCH_LIBRARIES} ${RESHARD_TORCH_PYTHON_LIB})

if(SKBUILD)
  install(TARGETS reshard_python LIBRARY DESTINATION reshard)
endif()
