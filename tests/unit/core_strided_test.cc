// The box copy kernels: streaming (non-temporal) stores must write exactly the bytes ordinary
// stores write, for every length and every source/destination misalignment, and never a byte
// outside the destination range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "reshard/strided.h"

namespace reshard {
namespace {

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& b : v) {
    x ^= x << 13, x ^= x >> 17, x ^= x << 5;
    b = uint8_t(x);
  }
  return v;
}

TEST(StreamCopy, EveryLengthAndAlignmentMatchesMemcpyAndStaysInRange) {
  const size_t kGuard = 64;
  const std::vector<size_t> lengths = {0, 1, 2, 3, 7, 15, 16, 17, 31, 32, 33, 63, 64, 127, 128, 129, 255,
                                       256, 257, 300, 383, 384, 511, 512, 513, 1000, 4096, 4099, 65536 + 77};
  for (size_t n : lengths)
    for (size_t dmis = 0; dmis < 40; dmis += 3)
      for (size_t smis : {size_t(0), size_t(1), size_t(5), size_t(16), size_t(33)}) {
        std::vector<uint8_t> src = pattern(n + smis + 1, uint32_t(n * 131 + smis));
        std::vector<uint8_t> dst(n + dmis + 2 * kGuard, 0xAB);
        std::vector<uint8_t> want = dst;
        std::memcpy(want.data() + kGuard + dmis, src.data() + smis, n);
        stream_copy(dst.data() + kGuard + dmis, src.data() + smis, n);
        ASSERT_EQ(dst, want) << "n=" << n << " dst misalignment " << dmis << " src misalignment " << smis;
      }
}

// A row-parallel tp merge: each source row is half a destination row (runs of 300 bf16 = 600
// bytes, rows of 600 elements), so every run streams a head, a body and a tail.
TEST(StreamCopy, CopyBoxStreamingEqualsCachedOnStridedRuns) {
  Box box;
  box.ndim = 2;
  box.len[0] = 37;
  box.len[1] = 300;
  std::array<int64_t, kMaxDims> src_strides{}, dst_strides{};
  src_strides[0] = 300, src_strides[1] = 1;
  dst_strides[0] = 600, dst_strides[1] = 1;
  std::vector<uint8_t> src = pattern(37 * 300 * 2, 9);
  for (int col0 : {0, 300, 3, 301}) {
    std::vector<uint8_t> a(37 * 600 * 2 + 64, 0x5A), b = a;
    copy_box(src.data(), DType::BF16, src_strides, a.data() + col0 * 2, DType::BF16, dst_strides, box, Store::kCached);
    copy_box(src.data(), DType::BF16, src_strides, b.data() + col0 * 2, DType::BF16, dst_strides, box, Store::kStream);
    ASSERT_EQ(a, b) << "destination column " << col0;
    // the cached copy itself put the rows where they belong
    ASSERT_EQ(0, std::memcmp(a.data() + (5 * 600 + col0) * 2, src.data() + 5 * 300 * 2, 600));
  }
}

TEST(StreamCopy, UnpackBoxStreamingEqualsCachedAndConvertsWhenDtypesDiffer) {
  Box box;
  box.ndim = 2;
  box.len[0] = 9;
  box.len[1] = 129;
  std::array<int64_t, kMaxDims> strides{};
  strides[0] = 200, strides[1] = 1;
  std::vector<float> packed(9 * 129);
  for (size_t i = 0; i < packed.size(); ++i) packed[i] = float(i) * 0.25f - 7.f;
  // same dtype: streamed
  std::vector<float> a(9 * 200 + 3, -1.f), b = a;
  unpack_box(packed.data(), DType::F32, a.data() + 3, DType::F32, box, strides, Store::kCached);
  unpack_box(packed.data(), DType::F32, b.data() + 3, DType::F32, box, strides, Store::kStream);
  ASSERT_EQ(a, b);
  EXPECT_EQ(a[3 + 4 * 200 + 128], packed[4 * 129 + 128]);
  EXPECT_EQ(a[3 + 4 * 200 + 129], -1.f);  // outside the box: untouched
  // dtype conversion ignores the store mode and still converts
  std::vector<double> c(9 * 200, 0.0), d = c;
  unpack_box(packed.data(), DType::F32, c.data(), DType::F64, box, strides, Store::kCached);
  unpack_box(packed.data(), DType::F32, d.data(), DType::F64, box, strides, Store::kStream);
  ASSERT_EQ(c, d);
  EXPECT_EQ(d[8 * 200 + 100], double(packed[8 * 129 + 100]));
}

// Slabs tile the box exactly once, in packed order, each a contiguous packed range of at most
// max_elems elements (or one innermost row... down to single elements), with whole inner dims.
TEST(Slabs, TileTheBoxInPackedOrder) {
  struct Case { std::vector<int64_t> len; int64_t max; };
  const std::vector<Case> cases = {{{1000}, 256}, {{1000}, 1}, {{1000}, 5000}, {{7, 300}, 1000}, {{7, 300}, 299},
                                   {{3, 5, 7}, 36}, {{3, 5, 7}, 6}, {{2, 1, 9}, 9}, {{4, 0, 3}, 2}, {{}, 10}};
  for (const Case& c : cases) {
    Box box;
    box.ndim = int(c.len.size());
    for (int d = 0; d < box.ndim; ++d) box.off[d] = 11 * d + 3, box.len[d] = c.len[size_t(d)];
    std::array<int64_t, kMaxDims> strides{};  // row-major strides of the box
    for (int d = box.ndim - 1, s = 1; d >= 0; s *= int(box.len[d]), --d) strides[d] = s;
    std::vector<int> seen(size_t(box.numel()), 0);
    int64_t next = 0, slabs = 0;
    for_each_slab(box, c.max, [&](const Box& slab, int64_t packed) {
      ++slabs;
      ASSERT_EQ(packed, next) << "slabs come in packed order";
      ASSERT_LE(slab.numel(), std::max<int64_t>(c.max, 1));
      // the slab's own origin is at its packed offset, and its elements are consecutive
      int64_t origin = 0;
      for (int d = 0; d < box.ndim; ++d) {
        origin += slab.off[d] * strides[d];
        ASSERT_LE(slab.off[d] + slab.len[d], box.len[d]);
      }
      ASSERT_EQ(origin, packed);
      // (for_each_run gives offsets from the slab's origin)
      for_each_run(slab, strides, [&](int64_t off, int64_t cnt, int64_t pk) {
        ASSERT_EQ(off, pk) << "a slab is one contiguous range";
        for (int64_t i = 0; i < cnt; ++i) ++seen[size_t(origin + off + i)];
      });
      next += slab.numel();
    });
    EXPECT_EQ(next, box.numel());
    for (int x : seen) ASSERT_EQ(x, 1);
    if (box.numel() > 0) {
      EXPECT_GE(slabs, (box.numel() + std::max<int64_t>(c.max, 1) - 1) / std::max<int64_t>(c.max, 1));
    }
  }
}

TEST(Poison, FloatsBecomeNanOthersAllOnesOutsideUntouched) {
  Box box;
  box.ndim = 2;
  box.len[0] = 3;
  box.len[1] = 4;
  std::array<int64_t, kMaxDims> strides{};
  strides[0] = 10, strides[1] = 1;
  {
    std::vector<float> v(30, 1.5f);
    fill_poison_box(v.data() + 2, DType::F32, box, strides);
    for (int i = 0; i < 30; ++i) {
      const bool inside = i >= 2 && (i - 2) % 10 < 4 && (i - 2) / 10 < 3;
      EXPECT_EQ(std::isnan(v[size_t(i)]), inside) << i;
      if (!inside) {
        EXPECT_EQ(v[size_t(i)], 1.5f) << i;
      }
    }
  }
  {
    std::vector<uint16_t> v(30, 0x3f80);  // bf16 1.0
    fill_poison_box(v.data(), DType::BF16, box, strides);
    EXPECT_EQ(v[0], 0x7fc0);
    EXPECT_EQ(v[23], 0x7fc0);
    EXPECT_EQ(v[4], 0x3f80);
    std::vector<uint16_t> h(30, 0x3c00);  // fp16 1.0
    fill_poison_box(h.data(), DType::F16, box, strides);
    EXPECT_EQ(h[13], 0x7e00);
    std::vector<double> d(30, 2.0);
    fill_poison_box(d.data(), DType::F64, box, strides);
    EXPECT_TRUE(std::isnan(d[21]));
    EXPECT_EQ(d[29], 2.0);
    std::vector<int32_t> n(30, 7);
    fill_poison_box(n.data(), DType::I32, box, strides);
    EXPECT_EQ(n[1], -1);
    EXPECT_EQ(n[5], 7);
  }
}

}  // namespace
}  // namespace reshard
