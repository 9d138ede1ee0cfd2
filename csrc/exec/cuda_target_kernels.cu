// GPU side of the CUDA target path: scatter of packed fragment elements into strided target
// buffers with dtype conversion, contiguous conversion, and zero fills. Conversions go through
// fp32 exactly as convert_elements does on the CPU (round to nearest even), so a GPU load is
// bitwise equal to a CPU load of the same plan.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "exec/cuda_target.h"

namespace reshard::cuda_detail {
namespace {

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<double>(double v) { return float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_f32<double>(float v) { return double(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Same-type moves are plain copies of the element's bits.
template <typename S, typename D> struct Conv {
  __device__ __forceinline__ static D apply(S v) { return from_f32<D>(to_f32<S>(v)); }
};
template <typename T> struct Conv<T, T> {
  __device__ __forceinline__ static T apply(T v) { return v; }
};

template <int ND>
__device__ __forceinline__ int64_t box_offset(int64_t linear, const BoxArgs& b) {
  int64_t off = 0;
#pragma unroll
  for (int d = ND - 1; d >= 0; --d) {
    const int64_t c = linear % b.len[d];
    linear /= b.len[d];
    off += c * b.strides[d];
  }
  return off;
}

template <typename S, typename D, int ND>
__global__ void unpack_kernel(const S* __restrict__ packed, uint64_t n, int64_t e0, BoxArgs box, D* __restrict__ dst) {
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x) {
    const int64_t off = box_offset<ND>(e0 + int64_t(i), box);
    dst[off] = Conv<S, D>::apply(packed[i]);
  }
}

template <typename S, typename D>
__global__ void convert_kernel(const S* __restrict__ src, D* __restrict__ dst, uint64_t n) {
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    dst[i] = Conv<S, D>::apply(src[i]);
}

template <typename T, int ND>
__global__ void fill_kernel(T* __restrict__ base, uint64_t n, BoxArgs box) {
  for (uint64_t i = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += uint64_t(gridDim.x) * blockDim.x)
    base[box_offset<ND>(int64_t(i), box)] = T{};
}

constexpr int kThreads = 256;
unsigned blocks_for(uint64_t n) {
  uint64_t b = (n + kThreads - 1) / kThreads;
  if (b > 132 * 32) b = 132 * 32;  // grid-stride beyond a few waves of the chip
  return unsigned(b < 1 ? 1 : b);
}

template <typename S, typename D>
cudaError_t unpack_typed(const void* packed, uint64_t n, int64_t e0, const BoxArgs& box, void* dst, cudaStream_t s) {
  const S* p = static_cast<const S*>(packed);
  D* d = static_cast<D*>(dst);
  const unsigned g = blocks_for(n);
  switch (box.ndim) {
    case 0:
    case 1: unpack_kernel<S, D, 1><<<g, kThreads, 0, s>>>(p, n, e0, box, d); break;
    case 2: unpack_kernel<S, D, 2><<<g, kThreads, 0, s>>>(p, n, e0, box, d); break;
    case 3: unpack_kernel<S, D, 3><<<g, kThreads, 0, s>>>(p, n, e0, box, d); break;
    case 4: unpack_kernel<S, D, 4><<<g, kThreads, 0, s>>>(p, n, e0, box, d); break;
    default: unpack_kernel<S, D, kMaxDims><<<g, kThreads, 0, s>>>(p, n, e0, box, d); break;
  }
  return cudaGetLastError();
}

template <typename S, typename F>
cudaError_t dispatch_to(DType to, F&& f) {
  switch (to) {
    case DType::F64: return f(S{}, double{});
    case DType::F32: return f(S{}, float{});
    case DType::F16: return f(S{}, __half{});
    case DType::BF16: return f(S{}, __nv_bfloat16{});
    default: return cudaErrorInvalidValue;
  }
}
template <typename F>
cudaError_t dispatch_float(DType from, DType to, F&& f) {
  switch (from) {
    case DType::F64: return dispatch_to<double>(to, f);
    case DType::F32: return dispatch_to<float>(to, f);
    case DType::F16: return dispatch_to<__half>(to, f);
    case DType::BF16: return dispatch_to<__nv_bfloat16>(to, f);
    default: return cudaErrorInvalidValue;
  }
}
template <typename F>
cudaError_t dispatch_raw(size_t es, F&& f) {
  switch (es) {
    case 1: return f(uint8_t{}, uint8_t{});
    case 2: return f(uint16_t{}, uint16_t{});
    case 4: return f(uint32_t{}, uint32_t{});
    case 8: return f(uint64_t{}, uint64_t{});
    default: return cudaErrorInvalidValue;
  }
}

bool is_float(DType t) { return t == DType::F64 || t == DType::F32 || t == DType::F16 || t == DType::BF16; }

}  // namespace

bool gpu_can_convert(DType from, DType to) { return from == to || (is_float(from) && is_float(to)); }

cudaError_t launch_unpack(const void* packed, DType from, uint64_t n, int64_t e0, const BoxArgs& box, void* dst_base,
                          DType to, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  auto go = [&](auto s, auto d) { return unpack_typed<decltype(s), decltype(d)>(packed, n, e0, box, dst_base, stream); };
  if (from == to) return dispatch_raw(dtype_size(from), go);
  return dispatch_float(from, to, go);
}

cudaError_t launch_convert(const void* src, DType from, void* dst, DType to, uint64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  if (from == to) return cudaMemcpyAsync(dst, src, n * dtype_size(from), cudaMemcpyDeviceToDevice, stream);
  auto go = [&](auto s, auto d) {
    using S = decltype(s);
    using D = decltype(d);
    convert_kernel<S, D><<<blocks_for(n), kThreads, 0, stream>>>(static_cast<const S*>(src), static_cast<D*>(dst), n);
    return cudaGetLastError();
  };
  return dispatch_float(from, to, go);
}

cudaError_t launch_fill_zero(void* base, size_t elem_bytes, const BoxArgs& box, cudaStream_t stream) {
  uint64_t n = 1;
  for (int d = 0; d < box.ndim; ++d) n *= uint64_t(box.len[d]);
  if (n == 0) return cudaSuccess;
  auto go = [&](auto s, auto) {
    using T = decltype(s);
    const unsigned g = blocks_for(n);
    T* p = static_cast<T*>(base);
    switch (box.ndim) {
      case 0:
      case 1: fill_kernel<T, 1><<<g, kThreads, 0, stream>>>(p, n, box); break;
      case 2: fill_kernel<T, 2><<<g, kThreads, 0, stream>>>(p, n, box); break;
      case 3: fill_kernel<T, 3><<<g, kThreads, 0, stream>>>(p, n, box); break;
      case 4: fill_kernel<T, 4><<<g, kThreads, 0, stream>>>(p, n, box); break;
      default: fill_kernel<T, kMaxDims><<<g, kThreads, 0, stream>>>(p, n, box); break;
    }
    return cudaGetLastError();
  };
  return dispatch_raw(elem_bytes, go);
}

}  // namespace reshard::cuda_detail
