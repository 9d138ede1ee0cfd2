// Strided box copies: the one kernel every executor uses. A box of `len` elements per dim lives
// in memory at base + sum(i_d * strides[d]) elements; "packed" means row-major order of the box.
#pragma once

#include <cstdint>
#include <functional>

#include "reshard/dtype.h"
#include "reshard/layout.h"

namespace reshard {

/// How a copy writes its destination. kCached: ordinary stores (the bytes land in the cache;
/// right for buffers read again soon, such as send slots). kStream: non-temporal stores where the
/// CPU has them (x86-64 SSE2/AVX2), so a large destination is written to memory without first
/// being read into the cache (no read-for-ownership): about a third less memory traffic per byte
/// copied, right for live tensors that the trainer reads long after the load. Conversions between
/// dtypes always use ordinary stores. Every call that streams ends with a store fence, so the
/// bytes are visible to other threads once it returns.
enum class Store { kCached, kStream };

/// Copies n bytes from src to dst (no overlap) with non-temporal stores where available (see
/// Store::kStream), memcpy elsewhere. Ends with a store fence.
void stream_copy(void* dst, const void* src, size_t n);

/// Calls fn(element_offset, count, packed_offset) for each maximal contiguous run of the box in
/// memory, in packed (row-major box) order. Runs that are adjacent both in memory and in packed
/// order are merged, so a contiguous box is one run.
void for_each_run(const Box& box, const std::array<int64_t, kMaxDims>& strides,
                  const std::function<void(int64_t elem_offset, int64_t count, int64_t packed_offset)>& fn);

/// Packs a strided box (dtype t, base pointer at the box origin) into `packed` (row-major).
void pack_box(const void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides,
              void* packed);

/// Unpacks a row-major packed box of dtype `from` into strided memory of dtype `to` (converting).
void unpack_box(const void* packed, DType from, void* base, DType to, const Box& box,
                const std::array<int64_t, kMaxDims>& strides, Store store = Store::kCached);

/// Copies a box from strided memory of dtype `from` (src at the box origin, src_strides) to
/// strided memory of dtype `to` (dst at the box origin, dst_strides), converting: one pass, no
/// packed intermediate. Trailing dims contiguous on both sides are merged into one run.
void copy_box(const void* src, DType from, const std::array<int64_t, kMaxDims>& src_strides, void* dst, DType to,
              const std::array<int64_t, kMaxDims>& dst_strides, const Box& box, Store store = Store::kCached);

/// Splits a box into sub-boxes ("slabs") that each cover a contiguous range of the box's packed
/// (row-major) order of at most max(max_elems, 1) elements, and calls fn(slab, packed_offset) for
/// each, in packed order. Slab offsets are relative to the box origin. A slab is a range of the
/// outermost dim whose rows hold at most max_elems elements, with every inner dim whole; slabs of
/// a box that is contiguous in memory are consecutive byte ranges of that memory.
void for_each_slab(const Box& box, int64_t max_elems,
                   const std::function<void(const Box& slab, int64_t packed_offset)>& fn);

/// Fills a strided box of dtype t with a value no load produces by accident: quiet NaN for float
/// dtypes (bf16 0x7fc0, f16 0x7e00, f32 0x7fc00000, f64 0x7ff8000000000000), all-ones bytes for
/// the others. Used where a checked piece turns out corrupt after its copy began.
void fill_poison_box(void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides);

/// Zero-fills a strided box of dtype t.
void fill_zero_box(void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides);

}  // namespace reshard
