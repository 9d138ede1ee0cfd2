// Internal to reshard_cuda: the CUDA error macro and the GPU kernels the CUDA target path uses
// (csrc/exec/cuda_target_kernels.cu). CUDA types are fine here; include/reshard/cuda.h has none.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "reshard/dtype.h"
#include "reshard/error.h"
#include "reshard/layout.h"

namespace reshard::cuda_detail {

/// Raises Error(kInternal) "<what> failed: <cudaGetErrorName>: <cudaGetErrorString>".
[[noreturn]] inline void cuda_fail(cudaError_t e, const char* what, const char* file, int line) {
  fail(ErrorCode::kInternal, what, " failed at ", file, ":", line, ": ", cudaGetErrorName(e), ": ",
       cudaGetErrorString(e));
}

#define RESHARD_CUDA(call)                                                                        \
  do {                                                                                            \
    cudaError_t reshard_cuda_e_ = (call);                                                         \
    if (reshard_cuda_e_ != cudaSuccess) ::reshard::cuda_detail::cuda_fail(reshard_cuda_e_, #call, \
                                                                          __FILE__, __LINE__);    \
  } while (0)

/// A box walked in row-major order, with destination strides in elements.
struct BoxArgs {
  int ndim = 0;
  int64_t len[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};
};

/// True when the kernels convert `from` -> `to` (same type, or both floating point).
bool gpu_can_convert(DType from, DType to);

/// Writes packed elements [e0, e0 + n) of a box (row-major over box.len, source dtype `from`,
/// starting at `packed`) to dst_base + sum(coord[d] * strides[d]) elements of dtype `to`.
cudaError_t launch_unpack(const void* packed, DType from, uint64_t n, int64_t e0, const BoxArgs& box,
                          void* dst_base, DType to, cudaStream_t stream);

/// Contiguous conversion of n elements.
cudaError_t launch_convert(const void* src, DType from, void* dst, DType to, uint64_t n, cudaStream_t stream);

/// Zeroes the elements of a box (element size `elem_bytes`) at base + strides.
cudaError_t launch_fill_zero(void* base, size_t elem_bytes, const BoxArgs& box, cudaStream_t stream);

}  // namespace reshard::cuda_detail
