# CUDA targets and the NCCL communicator. Included by the top-level CMakeLists when
# RESHARD_WITH_NCCL=ON (after `reshard` and `reshard_mpi` exist). Builds, where the CUDA toolkit
# (nvcc) and NCCL's header and library are found:
#   reshard_cuda   csrc/exec/cuda_target.cc + cuda_target_kernels.cu  (load_to_cuda, include/reshard/cuda.h)
#   reshard_nccl   csrc/comm/nccl/*.cc, *.cu                            (include/reshard/comm_nccl.h)
#   gpu tests      tests/gpu/*_test.cc (gtest; run only on a machine with a GPU: benchmarks/gpu_check.sh)
#   gpu_load       benchmarks/gpu_load.cc (throughput into CUDA buffers and the same-run ceilings)
#   reshard_gpu    all of the above: the compile-and-link-only check on machines without a GPU
#                  (scripts/test.sh: cmake --build build --target reshard_gpu)
# They are EXCLUDE_FROM_ALL: the default build stays CPU-only; build `reshard_gpu` to get them.
# No torch here: the CUDA and NCCL code links only the CUDA runtime and NCCL.
#
# Where things are looked up:
#   nvcc:   CMAKE_CUDA_COMPILER, else CUDACXX, else /usr/local/cuda/bin/nvcc
#   NCCL:   RESHARD_NCCL_ROOT / $NCCL_ROOT (include/nccl.h, lib/libnccl.so*), else the nvidia/nccl
#           folder of Python's site-packages (PyPI nvidia-nccl-cu13), asking Python_EXECUTABLE,
#           .venv/bin/python or python3, else the system.
#   archs:  CMAKE_CUDA_ARCHITECTURES, default 90 (H100/H200).

include(CheckLanguage)
set(RESHARD_HAVE_CUDA OFF)
set(RESHARD_HAVE_NCCL OFF)

if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
  set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
endif()
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  message(STATUS "reshard: no CUDA compiler found; CUDA targets and the NCCL communicator are not built")
  return()
endif()
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
set(RESHARD_HAVE_CUDA ON)

# ---- NCCL ----
set(_reshard_nccl_hints "")
if(RESHARD_NCCL_ROOT)
  list(APPEND _reshard_nccl_hints ${RESHARD_NCCL_ROOT})
endif()
if(DEFINED ENV{NCCL_ROOT})
  list(APPEND _reshard_nccl_hints $ENV{NCCL_ROOT})
endif()
foreach(_py ${Python_EXECUTABLE} ${CMAKE_SOURCE_DIR}/.venv/bin/python python3)
  if(_py)
    execute_process(
      COMMAND ${_py} -c "import nvidia.nccl as m, os; print(list(m.__path__)[0])"
      OUTPUT_VARIABLE _nccl_py OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _rc)
    if(_rc EQUAL 0 AND EXISTS "${_nccl_py}/include/nccl.h")
      list(APPEND _reshard_nccl_hints ${_nccl_py})
    endif()
  endif()
endforeach()
find_path(RESHARD_NCCL_INCLUDE_DIR nccl.h HINTS ${_reshard_nccl_hints} PATH_SUFFIXES include)
find_library(RESHARD_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_reshard_nccl_hints} PATH_SUFFIXES lib lib64)
if(RESHARD_NCCL_INCLUDE_DIR AND RESHARD_NCCL_LIBRARY)
  set(RESHARD_HAVE_NCCL ON)
  get_filename_component(RESHARD_NCCL_LIB_DIR ${RESHARD_NCCL_LIBRARY} DIRECTORY)
  message(STATUS "reshard: NCCL ${RESHARD_NCCL_LIBRARY} (headers ${RESHARD_NCCL_INCLUDE_DIR})")
else()
  message(STATUS "reshard: NCCL not found (hints: ${_reshard_nccl_hints}); the NCCL communicator is not built")
endif()

set(_reshard_gpu_targets "")

# ---- reshard_cuda: loading into CUDA buffers ----
add_library(reshard_cuda STATIC EXCLUDE_FROM_ALL
            ${CMAKE_SOURCE_DIR}/csrc/exec/cuda_target.cc
            ${CMAKE_SOURCE_DIR}/csrc/exec/cuda_target_kernels.cu)
target_link_libraries(reshard_cuda PUBLIC reshard CUDA::cudart)
target_include_directories(reshard_cuda PRIVATE ${CMAKE_SOURCE_DIR}/csrc)
target_compile_definitions(reshard_cuda PRIVATE RESHARD_CUDA_TARGET_IMPL=1 PUBLIC RESHARD_HAVE_CUDA=1)
target_compile_options(reshard_cuda PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall>)
list(APPEND _reshard_gpu_targets reshard_cuda)

# ---- reshard_nccl ----
if(RESHARD_HAVE_NCCL)
  file(GLOB RESHARD_NCCL_SRC CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/csrc/comm/nccl/*.cc ${CMAKE_SOURCE_DIR}/csrc/comm/nccl/*.cu)
  add_library(reshard_nccl STATIC EXCLUDE_FROM_ALL ${RESHARD_NCCL_SRC})
  target_include_directories(reshard_nccl PUBLIC ${RESHARD_NCCL_INCLUDE_DIR})
  target_link_libraries(reshard_nccl PUBLIC reshard ${RESHARD_NCCL_LIBRARY} CUDA::cudart)
  target_compile_definitions(reshard_nccl PUBLIC RESHARD_HAVE_NCCL=1)
  # The wheel ships libnccl.so.2 only; keep its folder on the run path.
  set_target_properties(reshard_nccl PROPERTIES INTERFACE_LINK_DIRECTORIES ${RESHARD_NCCL_LIB_DIR})
  list(APPEND _reshard_gpu_targets reshard_nccl)
endif()

# ---- GPU tests (gtest): built wherever CUDA is found, run only where a GPU is ----
find_package(GTest QUIET)
if(GTest_FOUND)
  file(GLOB RESHARD_GPU_TESTS CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/tests/gpu/*_test.cc)
  foreach(src ${RESHARD_GPU_TESTS})
    get_filename_component(name ${src} NAME_WE)
    if(name MATCHES "nccl" AND NOT RESHARD_HAVE_NCCL)
      continue()
    endif()
    add_executable(${name} EXCLUDE_FROM_ALL ${src} ${CMAKE_SOURCE_DIR}/tests/unit/test_util.cc)
    target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests ${CMAKE_SOURCE_DIR}/csrc)
    target_link_libraries(${name} PRIVATE reshard_cuda GTest::gtest GTest::gtest_main)
    if(RESHARD_HAVE_NCCL)
      target_link_libraries(${name} PRIVATE reshard_nccl)
    endif()
    if(RESHARD_HAVE_MPI)
      target_link_libraries(${name} PRIVATE reshard_mpi)
    endif()
    target_compile_definitions(${name} PRIVATE RESHARD_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
    list(APPEND _reshard_gpu_targets ${name})
  endforeach()
endif()

# ---- throughput driver ----
if(EXISTS ${CMAKE_SOURCE_DIR}/benchmarks/gpu_load.cc)
  add_executable(gpu_load EXCLUDE_FROM_ALL ${CMAKE_SOURCE_DIR}/benchmarks/gpu_load.cc)
  target_link_libraries(gpu_load PRIVATE reshard_cuda)
  target_include_directories(gpu_load PRIVATE ${CMAKE_SOURCE_DIR}/csrc)
  if(TARGET reshard_nccl)
    target_link_libraries(gpu_load PRIVATE reshard_nccl)
  endif()
  target_compile_definitions(gpu_load PRIVATE RESHARD_SOURCE_DIR="${CMAKE_SOURCE_DIR}")
  list(APPEND _reshard_gpu_targets gpu_load)
endif()

add_custom_target(reshard_gpu DEPENDS ${_reshard_gpu_targets})
message(STATUS "reshard: CUDA ${CUDAToolkit_VERSION} (archs ${CMAKE_CUDA_ARCHITECTURES}); target reshard_gpu builds: ${_reshard_gpu_targets}")
