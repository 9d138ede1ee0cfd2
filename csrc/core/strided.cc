#include "reshard/strided.h"

#include <cstring>
#include <vector>

namespace reshard {

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
                const std::array<int64_t, kMaxDims>& strides) {
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  const auto* src = static_cast<const uint8_t*>(packed);
  auto* dst = static_cast<uint8_t*>(base);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t pk) {
    convert_elements(src + pk * fs, from, dst + off * ts, to, size_t(cnt));
  });
}

void copy_box(const void* src, DType from, const std::array<int64_t, kMaxDims>& src_strides, void* dst, DType to,
              const std::array<int64_t, kMaxDims>& dst_strides, const Box& box) {
  const int nd = box.ndim;
  if (box.numel() == 0) return;
  const size_t fs = dtype_size(from), ts = dtype_size(to);
  const auto* s = static_cast<const uint8_t*>(src);
  auto* d = static_cast<uint8_t*>(dst);
  if (nd == 0) {
    convert_elements(s, from, d, to, 1);
    return;
  }
  // Merge trailing dims that are contiguous in both memories into one run of `run` elements.
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
    convert_elements(s + so * int64_t(fs), from, d + dof * int64_t(ts), to, size_t(run));
    int k = outer - 1;
    while (k >= 0 && ++ix[k] >= box.len[k]) ix[k--] = 0;
    if (k < 0) break;
  }
}

void fill_zero_box(void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides) {
  const size_t es = dtype_size(t);
  auto* dst = static_cast<uint8_t*>(base);
  for_each_run(box, strides, [&](int64_t off, int64_t cnt, int64_t) {
    std::memset(dst + off * es, 0, size_t(cnt) * es);
  });
}

}  // namespace reshard
