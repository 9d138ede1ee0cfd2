#include "reshard/strided.h"

#include "core/xxh3_range.h"

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RESHARD_X86 1
#endif

namespace reshard {

namespace {

#ifdef RESHARD_X86
// The bulk of a streaming copy: dst is 64-byte aligned (a cache line), n a multiple of 64 (SSE2)
// or 128 (AVX2). Unaligned loads, non-temporal stores, no fence.
void stream_body_sse2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
}

__attribute__((target("avx2"))) void stream_body_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  for (size_t i = 0; i < n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
}

// (__builtin_cpu_init first: this initializer may run before libgcc's own.)
const bool kHaveAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));
#endif

// Copies fewer than 64 bytes with at most two (overlapping) loads and stores of one width: a
// libc or `rep movs` call costs more than the copy at this size.
[[maybe_unused]] inline void small_copy(uint8_t* d, const uint8_t* s, size_t n) {
  auto two = [&](auto word) {
    using W = decltype(word);
    W a, b;
    std::memcpy(&a, s, sizeof(W));
    std::memcpy(&b, s + n - sizeof(W), sizeof(W));
    std::memcpy(d, &a, sizeof(W));
    std::memcpy(d + n - sizeof(W), &b, sizeof(W));
  };
  struct W32 { uint64_t w[4]; };
  struct W16 { uint64_t lo, hi; };
  if (n >= 32) {
    two(W32{});
  } else if (n >= 16) {
    two(W16{});
  } else if (n >= 8) {
    two(uint64_t{});
  } else if (n >= 4) {
    two(uint32_t{});
  } else if (n >= 2) {
    two(uint16_t{});
  } else if (n == 1) {
    *d = *s;
  }
}

// Streams without the closing fence (copy_box and unpack_box fence once per box). Only whole
// 64-byte cache lines of the destination get non-temporal stores; the partial first and last
// lines get ordinary ones. A line written both ways (part cached, part streamed) must be evicted
// from the cache before the streamed part can go out, which made copies of misaligned short runs
// slower than a plain memcpy.
void stream_copy_nofence(void* dst, const void* src, size_t n) {
#ifdef RESHARD_X86
  constexpr size_t kLine = 64;
  // Below a few cache lines the head and tail handling costs more than it saves.
  if (n >= 4 * kLine) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    const size_t head = (kLine - (reinterpret_cast<uintptr_t>(d) & (kLine - 1))) & (kLine - 1);
    small_copy(d, s, head);
    d += head, s += head, n -= head;
    const size_t lines = n / kLine * kLine;
    if (kHaveAvx2) {
      const size_t body = lines / 128 * 128;
      stream_body_avx2(d, s, body);
      stream_body_sse2(d + body, s + body, lines - body);  // at most one line
    } else {
      stream_body_sse2(d, s, lines);
    }
    small_copy(d + lines, s + lines, n - lines);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void store_fence() {
#ifdef RESHARD_X86
  _mm_sfence();
#endif
}

// One run of a box copy: a streaming byte copy when the dtypes match and the caller asked for it.
inline void copy_run(const uint8_t* s, DType from, uint8_t* d, DType to, size_t n, Store store) {
  if (store == Store::kStream && from == to) {
    stream_copy_nofence(d, s, n * dtype_size(from));
  } else {
    convert_elements(s, from, d, to, n);
  }
}

}  // namespace

void stream_copy(void* dst, const void* src, size_t n) {
  stream_copy_nofence(dst, src, n);
  store_fence();
}

void for_each_run(const Box& box, const std::array<int64_t, kMaxDims>& strides,
                  const std::function<void(int64_t, int64_t, int64_t)>& fn) {
  const int nd = box.ndim;
  if (box.numel() == 0) return;
  if (nd == 0) {
    fn(0, 1, 0);
    return;
  }
  // Fold trailing dims that are contiguous into one inner run.
  int inner = nd - 1;
  int64_t run = box.len[inner];
  bool contiguous_inner = strides[inner] == 1 || box.len[inner] == 1;
  if (!contiguous_inner) {
    run = 1;  // element-wise runs along a strided innermost dim
  } else {
    int64_t expect = box.len[inner];
    while (inner > 0 && (box.len[inner - 1] == 1 || strides[inner - 1] == expect)) {
      --inner;
      expect *= box.len[inner];
    }
    run = expect;
    if (box.len[inner] == 1 && inner > 0) {
      // leading unit dims change nothing
    }
  }
  // Iterate over the outer dims [0, inner) (or [0, nd) when runs are single elements).
  const int outer = contiguous_inner ? inner : nd;
  std::array<int64_t, kMaxDims> ix{};
  int64_t packed = 0;
  int64_t pending_off = -1, pending_cnt = 0, pending_packed = 0;
  while (true) {
    int64_t off = 0;
    for (int d = 0; d < outer; ++d) off += ix[d] * strides[d];
    if (pending_cnt > 0 && pending_off + pending_cnt == off) {
      pending_cnt += run;
    } else {
      if (pending_cnt > 0) fn(pending_off, pending_cnt, pending_packed);
      pending_off = off;
      pending_cnt = run;
      pending_packed = packed;
    }
    packed += run;
    int d = outer - 1;
    while (d >= 0 && ++ix[d] >= box.len[d]) ix[d--] = 0;
    if (d < 0) break;
  }
  if (pending_cnt > 0) fn(pending_off, pending_cnt, pending_packed);
}

void pack_box(const void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides,
              void* packed) {
  const size_t es = dtype_size(t);
  const auto* src = static_cast<const uint8_t*>(base);
  auto* dst = static_cast<uint8_t*>(packed);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t pk) {
    std::memcpy(dst + pk * es, src + off * es, size_t(cnt) * es);
  });
}

void unpack_box(const void* packed, DType from, void* base, DType to, const Box& box,
                const std::array<int64_t, kMaxDims>& strides, Store store) {
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  const auto* src = static_cast<const uint8_t*>(packed);
  auto* dst = static_cast<uint8_t*>(base);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t pk) {
    copy_run(src + pk * fs, from, dst + off * ts, to, size_t(cnt), store);
  });
  if (store == Store::kStream) store_fence();
}

namespace {

// Calls fn(src_offset, dst_offset, count) (in elements) for each run of the box that is
// contiguous in both memories, in the box's row-major order: trailing dims contiguous in both
// are merged into one run; a strided innermost dim gives runs of one element.
template <typename Fn>
void for_each_copy_run(const Box& box, const std::array<int64_t, kMaxDims>& src_strides,
                       const std::array<int64_t, kMaxDims>& dst_strides, Fn fn) {
  const int nd = box.ndim;
  if (box.numel() == 0) return;
  if (nd == 0) {
    fn(int64_t(0), int64_t(0), int64_t(1));
    return;
  }
  int inner = nd - 1;
  int64_t run = 1;
  if ((src_strides[inner] == 1 || box.len[inner] == 1) && (dst_strides[inner] == 1 || box.len[inner] == 1)) {
    run = box.len[inner];
    while (inner > 0 && (box.len[inner - 1] == 1 ||
                         (src_strides[inner - 1] == run && dst_strides[inner - 1] == run))) {
      --inner;
      run *= box.len[inner];
    }
  } else {
    inner = nd;  // element-wise along a strided innermost dim
  }
  const int outer = inner;
  std::array<int64_t, kMaxDims> ix{};
  while (true) {
    int64_t so = 0, dof = 0;
    for (int k = 0; k < outer; ++k) {
      so += ix[k] * src_strides[k];
      dof += ix[k] * dst_strides[k];
    }
    fn(so, dof, run);
    int k = outer - 1;
    while (k >= 0 && ++ix[k] >= box.len[k]) ix[k--] = 0;
    if (k < 0) break;
  }
}

}  // namespace

void copy_box(const void* src, DType from, const std::array<int64_t, kMaxDims>& src_strides, void* dst, DType to,
              const std::array<int64_t, kMaxDims>& dst_strides, const Box& box, Store store) {
  if (box.numel() == 0) return;
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  for_each_copy_run(box, src_strides, dst_strides, [&](int64_t so, int64_t dof, int64_t run) {
    copy_run(s + so * int64_t(fs), from, d + dof * int64_t(ts), to, size_t(run), store);
  });
  if (store == Store::kStream) store_fence();
}

void copy_box_hashing(const void* src, DType from, const std::array<int64_t, kMaxDims>& src_strides, void* dst, DType to,
                      const std::array<int64_t, kMaxDims>& dst_strides, const Box& box, Xxh3Range& hash) {
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  for_each_copy_run(box, src_strides, dst_strides, [&](int64_t so, int64_t dof, int64_t run) {
    const uint8_t* rs = s + so * int64_t(fs);
    if (from == to) {
      hash.copy(d + dof * int64_t(ts), rs, uint64_t(run) * fs);
    } else {
      convert_elements(rs, from, d + dof * int64_t(ts), to, size_t(run));
      hash.hash_upto(rs + uint64_t(run) * fs);
    }
  });
}

void for_each_slab(const Box& box, int64_t max_elems,
                   const std::function<void(const Box& slab, int64_t packed_offset)>& fn) {
  if (box.numel() == 0) return;
  const int nd = box.ndim;
  Box slab = box;
  for (int d = 0; d < nd; ++d) slab.off[d] = 0;
  if (nd == 0) {
    fn(slab, 0);
    return;
  }
  max_elems = std::max<int64_t>(max_elems, 1);
  // The outermost dim d whose rows (every dim after d whole) hold at most max_elems elements.
  int d = 0;
  int64_t row = box.numel() / box.len[0];
  while (row > max_elems) row /= box.len[++d];
  const int64_t step = std::max<int64_t>(1, max_elems / row);
  std::array<int64_t, kMaxDims> ix{};  // indices of the dims before d
  int64_t packed = 0;
  while (true) {
    for (int k = 0; k < d; ++k) slab.off[k] = ix[k], slab.len[k] = 1;
    for (int64_t start = 0; start < box.len[d]; start += step) {
      slab.off[d] = start;
      slab.len[d] = std::min(step, box.len[d] - start);
      fn(slab, packed);
      packed += slab.len[d] * row;
    }
    int k = d - 1;
    while (k >= 0 && ++ix[k] >= box.len[k]) ix[k--] = 0;
    if (k < 0) break;
  }
}

void fill_poison_box(void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides) {
  const size_t es = dtype_size(t);
  uint8_t one[8];
  switch (t) {
    case DType::BF16: { const uint16_t v = 0x7fc0; std::memcpy(one, &v, 2); break; }
    case DType::F16: { const uint16_t v = 0x7e00; std::memcpy(one, &v, 2); break; }
    case DType::F32: { const uint32_t v = 0x7fc00000u; std::memcpy(one, &v, 4); break; }
    case DType::F64: { const uint64_t v = 0x7ff8000000000000ull; std::memcpy(one, &v, 8); break; }
    default: std::memset(one, 0xff, sizeof one);
  }
  auto* dst = static_cast<uint8_t*>(base);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t) {
    for (int64_t i = 0; i < cnt; ++i) std::memcpy(dst + (off + i) * int64_t(es), one, es);
  });
}

void fill_zero_box(void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides) {
  const size_t es = dtype_size(t);
  auto* dst = static_cast<uint8_t*>(base);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t) {
    std::memset(dst + off * es, 0, size_t(cnt) * es);
  });
}

}  // namespace reshard
