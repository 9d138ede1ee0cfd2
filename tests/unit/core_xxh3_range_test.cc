// Xxh3Range (csrc/core/xxh3_range.h) against libxxhash's XXH3_64bits: every length around the
// algorithm's boundaries (240 bytes, stripes of 64, blocks of 1 KiB), copies cut into runs of any
// size at any alignment, with streaming and ordinary stores, the AVX2 and the portable path, and
// copy_box_hashing with strided destinations and dtype conversion.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <cstring>
#include <random>
#include <vector>

#include "core/xxh3_range.h"
#include "reshard/strided.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

struct Portable {
  explicit Portable(bool on) { Xxh3Range::force_portable_for_tests(on); }
  ~Portable() { Xxh3Range::force_portable_for_tests(false); }
};

std::vector<uint8_t> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = uint8_t(rng());
  return v;
}

// Lengths where XXH3 changes course: empty, the short forms, 240/241 (whole-input vs stripes),
// around every stripe and block edge of the first few blocks, and a few large ones.
std::vector<size_t> edge_lengths() {
  std::vector<size_t> out;
  for (size_t n = 0; n <= 300; ++n) out.push_back(n);
  for (size_t k = 5; k <= 40; ++k)
    for (int d = -2; d <= 2; ++d) out.push_back(size_t(int64_t(k * 64) + d));
  for (size_t blocks : {1, 2, 3, 16, 17})
    for (int d = -65; d <= 65; d += 13) out.push_back(size_t(int64_t(blocks * 1024) + d));
  for (size_t n : {1u << 20, (1u << 20) + 1, (1u << 20) - 63, 3000017u}) out.push_back(n);
  return out;
}

TEST(Xxh3Range, DigestOfUntouchedRangeMatchesLibxxhash) {
  const auto data = random_bytes(3000017 + 64, 7);
  for (bool portable : {false, true}) {
    Portable p(portable);
    for (size_t n : edge_lengths())
      for (size_t off : {size_t(0), size_t(1), size_t(37)}) {
        Xxh3Range h(data.data() + off, n);
        ASSERT_EQ(h.digest(), XXH3_64bits(data.data() + off, n)) << "len " << n << " offset " << off << " portable " << portable;
      }
  }
}

TEST(Xxh3Range, CopiesInRunsOfAnySizeHashAndCopyExactly) {
  const uint64_t seed = testing::test_seed("Xxh3Range.CopiesInRunsOfAnySizeHashAndCopyExactly");
  std::mt19937_64 rng(seed);
  const auto data = random_bytes((1 << 21) + 128, seed);
  std::vector<uint8_t> out((1 << 21) + 256);
  for (bool portable : {false, true}) {
    Portable p(portable);
    for (int trial = 0; trial < 1500; ++trial) {
      const size_t len = trial < 600 ? size_t(trial) * 3 : size_t(rng() % (1 << 21));
      const size_t src_off = rng() % 64, dst_off = rng() % 64;
      const uint8_t* src = data.data() + src_off;
      std::fill(out.begin(), out.end(), uint8_t(0xA5));
      Xxh3Range h(src, len);
      // Runs from 1 byte to tens of KiB, so runs start and end inside stripes and blocks.
      const size_t max_run = trial % 3 == 0 ? 100 : trial % 3 == 1 ? 5000 : 70000;
      for (size_t at = 0; at < len;) {
        const size_t n = std::min(len - at, size_t(1 + rng() % max_run));
        h.copy(out.data() + dst_off + at, src + at, n, (at / 4096) % 2 ? Store::kCached : Store::kStream);
        at += n;
      }
      ASSERT_EQ(h.digest(), XXH3_64bits(src, len)) << "len " << len << " trial " << trial << " portable " << portable;
      ASSERT_EQ(std::memcmp(out.data() + dst_off, src, len), 0) << "len " << len << " trial " << trial;
      // Nothing written outside [dst_off, dst_off + len).
      for (size_t i = 0; i < dst_off; ++i) ASSERT_EQ(out[i], 0xA5);
      ASSERT_EQ(out[dst_off + len], 0xA5) << "len " << len;
    }
  }
}

TEST(Xxh3Range, HashUptoAloneAndMixedWithCopies) {
  const auto data = random_bytes(50000, 3);
  std::vector<uint8_t> out(50000);
  for (bool portable : {false, true}) {
    Portable p(portable);
    // Only hash_upto, in uneven steps (bytes converted or copied elsewhere).
    for (size_t len : {size_t(241), size_t(1024), size_t(1025), size_t(49999)}) {
      Xxh3Range h(data.data(), len);
      for (size_t at = 0; at < len; at += 777) h.hash_upto(data.data() + std::min(len, at));
      EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), len)) << len;
    }
    // Copies with gaps between them (a gap is hashed by the next call that passes it) and a
    // hash_upto behind what was already hashed (no stripe twice).
    Xxh3Range h(data.data(), 49999);
    h.copy(out.data(), data.data(), 10000);
    h.hash_upto(data.data() + 5000);
    h.copy(out.data() + 20000, data.data() + 20000, 9999);
    h.hash_upto(data.data() + 35000);
    EXPECT_EQ(h.digest(), XXH3_64bits(data.data(), 49999));
  }
}

TEST(Xxh3Range, CopyBoxHashingMatchesCopyBoxAndTheHashOfTheSource) {
  // A [rows, cols] source, dense, copied into a column block of a wider destination (runs of one
  // row each), as a tp merge writes a row-parallel weight; and with a bf16 -> f32 conversion.
  const int64_t rows = 300, cols = 77, wide = 200, col0 = 45;
  const auto src = random_bytes(size_t(rows * cols * 2), 11);
  Box box;
  box.ndim = 2;
  box.len = {rows, cols};
  const std::array<int64_t, kMaxDims> ss = {cols, 1}, ds = {wide, 1};
  for (bool portable : {false, true}) {
    Portable p(portable);
    for (DType to : {DType::BF16, DType::F32}) {
      const size_t es = dtype_size(to);
      std::vector<uint8_t> want(size_t(rows * wide) * es, 0), got(size_t(rows * wide) * es, 0);
      copy_box(src.data(), DType::BF16, ss, want.data() + col0 * es, to, ds, box, Store::kStream);
      Xxh3Range h(src.data(), src.size());
      copy_box_hashing(src.data(), DType::BF16, ss, got.data() + col0 * es, to, ds, box, h);
      EXPECT_EQ(h.digest(), XXH3_64bits(src.data(), src.size())) << dtype_name(to);
      EXPECT_EQ(got, want) << dtype_name(to);
    }
  }
}

TEST(Xxh3Range, AChangedByteChangesTheDigest) {
  auto data = random_bytes(100000, 5);
  std::vector<uint8_t> out(100000);
  Xxh3Range a(data.data(), data.size());
  a.copy(out.data(), data.data(), data.size());
  const uint64_t before = a.digest();
  data[77777] ^= 0x10;
  Xxh3Range b(data.data(), data.size());
  b.copy(out.data(), data.data(), data.size());
  EXPECT_NE(b.digest(), before);
  EXPECT_EQ(b.digest(), XXH3_64bits(data.data(), data.size()));
}

}  // namespace
}  // namespace reshard
