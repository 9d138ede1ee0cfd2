// XXH3-64 of one contiguous range of memory, computed while the range is copied.
#pragma once

#include <array>
#include <cstdint>

#include "reshard/dtype.h"
#include "reshard/layout.h"
#include "reshard/strided.h"

namespace reshard {

/// The XXH3-64 digest (seed 0, the default secret) of the `len` bytes at `base`: the value
/// `XXH3_64bits(base, len)` of libxxhash returns, and what the native format stores per piece
/// (docs/format.md). The bytes are hashed in 64-byte stripes while copy() moves them, one loop
/// for both (the copy's loads feed the hash from the L1 cache), so a piece that is copied and
/// checked crosses memory once with the hash mostly hidden behind the copy. The algorithm (stripes,
/// 1 KiB blocks, accumulator scramble, the last stripe, the merge) follows the XXH3 specification
/// of the xxHash project (doc/xxhash_spec.md, "XXH3 64-bit"); inputs of up to 240 bytes, which
/// XXH3 hashes whole, go to libxxhash. tests/unit/xxh3_range_test.cc compares every path with
/// libxxhash.
///
/// The range must stay readable until digest(): the hash reads it at `base`, in its own order
/// (copy() only decides when), so the digest is of the range whatever was copied.
class Xxh3Range {
 public:
  Xxh3Range(const void* base, uint64_t len);

  /// Copies n bytes from src to dst (no overlap; any alignment) and hashes every stripe of the
  /// range that ends at or before src + n. src must lie in the range; successive calls should move
  /// forward through it (a stripe is hashed once, when the first call reaching its end passes
  /// it). `store` as for copy_box (reshard/strided.h): kStream writes whole 64-byte lines with
  /// non-temporal stores where the CPU has AVX2 and ends with a store fence; kCached writes
  /// through the cache (buffers read again at once: send slots, staging).
  void copy(void* dst, const void* src, uint64_t n, Store store = Store::kStream);

  /// Hashes every stripe that ends at or before `end` (a pointer into the range, or its end) and
  /// that no call has hashed yet; for bytes copied some other way (a dtype conversion).
  void hash_upto(const void* end);

  /// The digest of the whole range (hashes what is left first); the same value when called again.
  uint64_t digest();

  /// Tests only: take the portable path (no AVX2) even where the CPU has AVX2.
  static void force_portable_for_tests(bool on);

 private:
  const uint8_t* base_;
  uint64_t len_;
  uint64_t next_ = 0;     // range offset of the next stripe to hash (a multiple of 64)
  uint64_t stripes_ = 0;  // stripes hashed so far
  uint64_t regular_;      // stripes XXH3 accumulates before its last one: (len - 1) / 64 above 240 bytes
  alignas(32) uint64_t acc_[8];
};

/// copy_box (reshard/strided.h) from a source that is one Xxh3Range, dense in the box's row-major
/// order, feeding the range's hash as it goes: runs are copied in source order, with the range's
/// fused copy where from == to, else converted with ordinary stores and then hashed.
void copy_box_hashing(const void* src, DType from, const std::array<int64_t, kMaxDims>& src_strides, void* dst, DType to,
                      const std::array<int64_t, kMaxDims>& dst_strides, const Box& box, Xxh3Range& hash);

}  // namespace reshard
