// The box copy kernels (and the replica comparison built on the same slabs): streaming (non-temporal) stores must write exactly the bytes ordinary
// stores write, for every length and every source/destination misalignment, and never a byte
// outside the destination range.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "reshard/dtype.h"
#include "reshard/error.h"
#include "reshard/simulate.h"
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


// Replica comparison reads slab by slab: a box of several slabs, each side strided differently
// inside its "file", must report the one differing element wherever it is, in either dtype pair.
TEST(ReplicaCompare, FindsTheOneDifferenceInAnySlabOfAStridedBoxAcrossDtypes) {
  // Box [3, 700, 300] (630,000 elements: three slabs of 2^18 at most) at offset (1, 5, 7) of a
  // [5, 720, 310] array in file 0 (authoritative, f32) and at offset (0, 0, 2) of a [3, 700, 304]
  // array in file 1 (replica, f32 or bf16).
  const std::array<int64_t, 3> la = {5, 720, 310}, lb = {3, 700, 304};
  Box box;
  box.ndim = 3;
  box.len = {3, 700, 300};
  auto strides = [](const std::array<int64_t, 3>& l) {
    std::array<int64_t, kMaxDims> s{};
    s[2] = 1, s[1] = l[2], s[0] = l[1] * l[2];
    return s;
  };
  ReplicaCompare c;
  c.box = box;
  c.authoritative.file = 0;
  c.authoritative.strides = strides(la);
  c.authoritative.dtype = DType::F32;
  c.authoritative.byte_base = uint64_t(1 * c.authoritative.strides[0] + 5 * c.authoritative.strides[1] + 7) * 4;
  c.replica.file = 1;
  c.replica.strides = strides(lb);
  for (DType rt : {DType::F32, DType::BF16}) {
    c.replica.dtype = rt;
    const size_t re = dtype_size(rt);
    c.replica.byte_base = 2 * re;
    // Values exact in bf16 (small integers) so the two dtypes hold the same numbers.
    std::vector<float> fa(size_t(la[0] * la[1] * la[2]));
    for (size_t i = 0; i < fa.size(); ++i) fa[i] = float(int(i % 97) - 48);
    std::vector<float> fb(size_t(lb[0] * lb[1] * lb[2]), 0.0f);
    // The replica holds the box's values at its own place.
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 700; ++j)
        for (int64_t k = 0; k < 300; ++k)
          fb[size_t(i * c.replica.strides[0] + j * c.replica.strides[1] + k + 2)] =
              fa[size_t((i + 1) * c.authoritative.strides[0] + (j + 5) * c.authoritative.strides[1] + k + 7)];
    std::vector<std::vector<uint8_t>> files(2);
    auto put = [&](int file, const std::vector<float>& v, DType t) {
      files[size_t(file)].resize(v.size() * dtype_size(t));
      convert_elements(v.data(), DType::F32, files[size_t(file)].data(), t, v.size());
    };
    ReadFn read = [&](int32_t file, uint64_t off, uint64_t len, void* dst) {
      ASSERT_LE(off + len, files[size_t(file)].size());
      std::memcpy(dst, files[size_t(file)].data() + off, len);
    };
    put(0, fa, DType::F32);
    put(1, fb, rt);
    EXPECT_EQ(replica_max_abs_diff(c, read), 0.0) << dtype_name(rt);
    // One element differs, in the last slab (i = 2), then in the first; elements outside the box
    // (the replica's padding columns) never count.
    for (int64_t i : {int64_t(2), int64_t(0)}) {
      std::vector<float> g = fb;
      g[size_t(i * c.replica.strides[0] + 650 * c.replica.strides[1] + 299 + 2)] += 3.0f;
      g[size_t(1 * c.replica.strides[0] + 10 * c.replica.strides[1] + 0)] = 1e6f;  // padding column
      put(1, g, rt);
      EXPECT_EQ(replica_max_abs_diff(c, read), 3.0) << dtype_name(rt) << " slab of i=" << i;
    }
    // Equal infinities are equal; a NaN against a number is +inf; two NaNs are equal.
    std::vector<float> inf_a = fa, inf_b = fb;
    const size_t at_a = size_t(1 * c.authoritative.strides[0] + 5 * c.authoritative.strides[1] + 7);
    const size_t at_b = 2;
    inf_a[at_a] = INFINITY, inf_b[at_b] = INFINITY;
    put(0, inf_a, DType::F32);
    put(1, inf_b, rt);
    EXPECT_EQ(replica_max_abs_diff(c, read), 0.0) << dtype_name(rt);
    inf_a[at_a] = NAN, inf_b[at_b] = NAN;
    put(0, inf_a, DType::F32);
    put(1, inf_b, rt);
    EXPECT_EQ(replica_max_abs_diff(c, read), 0.0) << dtype_name(rt);
    inf_b[at_b] = 1.0f;
    put(1, inf_b, rt);
    EXPECT_EQ(replica_max_abs_diff(c, read), INFINITY) << dtype_name(rt);
  }
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {
// A finite value that would round to +-inf in a narrower type is refused (bf16 1e6 into
// an f16 model used to load as inf); the largest finite values, inf and NaN themselves convert.
TEST(Convert, FiniteValuesThatDoNotFitAreRefusedNotTurnedIntoInf) {
  auto to = [](auto v, DType from, DType to_type) {
    uint64_t out = 0;
    convert_elements(&v, from, &out, to_type, 1);
    return out;
  };
  auto refused = [&](auto v, DType from, DType to_type) {
    try {
      to(v, from, to_type);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find(std::string("does not fit in ") + dtype_name(to_type)), std::string::npos) << e.what();
      return true;
    }
    return false;
  };
  EXPECT_EQ(to(65504.0f, DType::F32, DType::F16), 0x7bffu);  // f16's largest finite
  EXPECT_TRUE(refused(65536.0f, DType::F32, DType::F16));
  EXPECT_TRUE(refused(-1.0e6f, DType::F32, DType::F16));
  EXPECT_TRUE(refused(uint16_t(0x4974), DType::BF16, DType::F16));  // bf16 999424
  EXPECT_EQ(to(std::numeric_limits<float>::infinity(), DType::F32, DType::F16), 0x7c00u);  // inf stays inf
  EXPECT_EQ(to(uint16_t(0x7bff), DType::F16, DType::BF16) & 0x7f80u, 0x4780u);  // f16 always fits in bf16
  EXPECT_TRUE(refused(std::numeric_limits<float>::max(), DType::F32, DType::BF16));
  EXPECT_TRUE(refused(1.0e300, DType::F64, DType::F32));
  EXPECT_TRUE(refused(1.0e300, DType::F64, DType::F16));
  EXPECT_TRUE(refused(1.0e300, DType::F64, DType::BF16));
  EXPECT_EQ(to(1.0e-30, DType::F64, DType::F16), 0u);  // below the smallest subnormal: zero, as torch
}


// The vectorised fp32 -> bf16 loop rounds every bit pattern as the per-element rule does
// (nearest even; NaN stays a quiet NaN with its sign; inf stays inf), whole arrays at a time,
// and still refuses a finite value that rounds to inf anywhere in a long array.
TEST(Convert, Fp32ToBf16ArraysRoundLikeTheOneElementRule) {
  auto one = [](uint32_t u) {  // the rule, element by element
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  };
  std::vector<uint32_t> words = {0u,          0x80000000u, 0x3f800000u, 0x3f808000u, 0x3f818000u, 0x3f807fffu,
                                 0x7f800000u, 0xff800000u, 0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x00000001u,
                                 0x00008000u, 0x00018000u, 0x7f7f7fffu, 0xff7f7fffu};
  uint64_t x = 0x9e3779b97f4a7c15ull;
  while (words.size() < 100003) {  // an odd length: the vector loop's tail too
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    const uint32_t w = uint32_t(x >> 32);
    // Keep finite values that round to inf out of this array (they are refused, below).
    if ((w & 0x7fffffffu) >= 0x7f7f8000u && (w & 0x7fffffffu) < 0x7f800000u) continue;
    words.push_back(w);
  }
  std::vector<uint16_t> got(words.size());
  convert_elements(words.data(), DType::F32, got.data(), DType::BF16, words.size());
  for (size_t i = 0; i < words.size(); ++i) ASSERT_EQ(got[i], one(words[i])) << "word " << std::hex << words[i];
  words[words.size() / 2] = 0x7f7fffffu;  // FLT_MAX rounds to inf: refused
  try {
    convert_elements(words.data(), DType::F32, got.data(), DType::BF16, words.size());
    ADD_FAILURE() << "FLT_MAX inside an array was converted to inf";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not fit in BF16"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace reshard
