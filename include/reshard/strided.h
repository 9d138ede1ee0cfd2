// Strided box copies: the one kernel every executor uses. A box of `len` elements per dim lives
// in memory at base + sum(i_d * strides[d]) elements; "packed" means row-major order of the box.
#pragma once

#include <cstdint>
#include <functional>

#include "reshard/dtype.h"
#include "reshard/layout.h"

namespace reshard {

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
                const std::array<int64_t, kMaxDims>& strides);

/// Copies a box from strided memory of dtype `from` (src at the box origin, src_strides) to
/// strided memory of dtype `to` (dst at the box origin, dst_strides), converting: one pass, no
/// packed intermediate. Trailing dims contiguous on both sides are merged into one run.
void copy_box(const void* src, DType from, const std::array<int64_t, kMaxDims>& src_strides, void* dst, DType to,
              const std::array<int64_t, kMaxDims>& dst_strides, const Box& box);

/// Zero-fills a strided box of dtype t.
void fill_zero_box(void* base, DType t, const Box& box, const std::array<int64_t, kMaxDims>& strides);

}  // namespace reshard
