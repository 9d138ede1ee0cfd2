#include "core/xxh3_range.h"

#include <xxhash.h>

#include <atomic>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define RESHARD_X86 1
#endif

namespace reshard {

namespace {

// XXH3's constants and default secret (192 bytes), as the XXH3 specification gives them
// (xxHash doc/xxhash_spec.md, "XXH3 64-bit": PRIME32_1..3, PRIME64_1..5, kSecret).
constexpr uint64_t kP32_1 = 0x9E3779B1u, kP32_2 = 0x85EBCA77u, kP32_3 = 0xC2B2AE3Du;
constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull, kP64_2 = 0xC2B2AE3D27D4EB4Full, kP64_3 = 0x165667B19E3779F9ull,
                   kP64_4 = 0x85EBCA77C2B2AE63ull, kP64_5 = 0x27D4EB2F165667C5ull;
alignas(64) constexpr uint8_t kSecret[192] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e};
constexpr uint64_t kStripe = 64;
constexpr uint64_t kStripesPerBlock = (sizeof kSecret - kStripe) / 8;  // 16: a 1 KiB block
constexpr size_t kScrambleAt = sizeof kSecret - kStripe;               // 128
constexpr size_t kLastStripeAt = sizeof kSecret - kStripe - 7;         // 121
constexpr size_t kMergeAt = 11;
constexpr uint64_t kMidsizeMax = 240;  // up to this many bytes XXH3 hashes the input whole

constexpr bool kLittleEndian = __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__;

inline uint64_t read64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;  // little-endian hosts only (see kLittleEndian)
}

// One stripe into the 8 accumulators, portable form.
inline void accumulate_stripe(uint64_t acc[8], const uint8_t* in, const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    const uint64_t v = read64(in + 8 * i);
    const uint64_t k = v ^ read64(secret + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (k & 0xFFFFFFFFu) * (k >> 32);
  }
}

inline void scramble(uint64_t acc[8], const uint8_t* secret) {
  for (int i = 0; i < 8; ++i) {
    uint64_t a = acc[i];
    a ^= a >> 47;
    a ^= read64(secret + 8 * i);
    acc[i] = a * kP32_1;
  }
}

inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
  const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return uint64_t(r) ^ uint64_t(r >> 64);
}

inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  return h ^ (h >> 32);
}

std::atomic<bool> g_force_portable{false};

#ifdef RESHARD_X86
const bool kHaveAvx2 = (__builtin_cpu_init(), __builtin_cpu_supports("avx2"));

// The AVX2 forms of the same two steps, on the accumulators held as two 256-bit vectors.
__attribute__((target("avx2"))) inline void accumulate_stripe_avx2(__m256i acc[2], const uint8_t* in,
                                                                   const uint8_t* secret) {
  for (int i = 0; i < 2; ++i) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + 32 * i));
    const __m256i k = _mm256_xor_si256(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32 * i)));
    const __m256i k_hi = _mm256_shuffle_epi32(k, _MM_SHUFFLE(0, 3, 0, 1));
    const __m256i product = _mm256_mul_epu32(k, k_hi);                        // lo32(k) * hi32(k)
    const __m256i swapped = _mm256_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2));  // acc[i ^ 1] += v[i]
    acc[i] = _mm256_add_epi64(acc[i], _mm256_add_epi64(product, swapped));
  }
}

__attribute__((target("avx2"))) inline void scramble_avx2(__m256i acc[2], const uint8_t* secret) {
  const __m256i prime = _mm256_set1_epi32(int(uint32_t(kP32_1)));
  for (int i = 0; i < 2; ++i) {
    __m256i a = _mm256_xor_si256(acc[i], _mm256_srli_epi64(acc[i], 47));
    a = _mm256_xor_si256(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(secret + 32 * i)));
    const __m256i lo = _mm256_mul_epu32(a, prime);
    const __m256i hi = _mm256_mul_epu32(_mm256_shuffle_epi32(a, _MM_SHUFFLE(0, 3, 0, 1)), prime);
    acc[i] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));  // a * P32_1 mod 2^64
  }
}

// Hashes the range's stripes that end by `upto` (range offset), AVX2 accumulators in registers.
__attribute__((target("avx2"))) inline void stripes_avx2(__m256i acc[2], const uint8_t* base, uint64_t& next,
                                                         uint64_t& stripes, uint64_t regular, uint64_t upto) {
  while (stripes < regular && next + kStripe <= upto) {
    accumulate_stripe_avx2(acc, base + next, kSecret + 8 * (stripes % kStripesPerBlock));
    next += kStripe;
    if (++stripes % kStripesPerBlock == 0) scramble_avx2(acc, kSecret + kScrambleAt);
  }
}

// The fused loop: body a multiple of 128 (and, when streaming, d 64-byte aligned). Each 128
// bytes copied (unaligned loads; non-temporal or ordinary stores) lets the stripes that end by
// them be hashed from L1.
template <bool kStreamStores>
__attribute__((target("avx2"))) void copy_hash_avx2(uint8_t* d, const uint8_t* s, uint64_t body, uint64_t rel,
                                                    uint64_t acc_mem[8], const uint8_t* base, uint64_t& next,
                                                    uint64_t& stripes, uint64_t regular) {
  __m256i acc[2] = {_mm256_load_si256(reinterpret_cast<const __m256i*>(acc_mem)),
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(acc_mem + 4))};
  for (uint64_t i = 0; i < body; i += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    const __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    if constexpr (kStreamStores) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), a);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
    }
    stripes_avx2(acc, base, next, stripes, regular, rel + i + 128);
  }
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc_mem), acc[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc_mem + 4), acc[1]);
}

__attribute__((target("avx2"))) void hash_upto_avx2(uint64_t acc_mem[8], const uint8_t* base, uint64_t& next,
                                                    uint64_t& stripes, uint64_t regular, uint64_t upto) {
  __m256i acc[2] = {_mm256_load_si256(reinterpret_cast<const __m256i*>(acc_mem)),
                    _mm256_load_si256(reinterpret_cast<const __m256i*>(acc_mem + 4))};
  stripes_avx2(acc, base, next, stripes, regular, upto);
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc_mem), acc[0]);
  _mm256_store_si256(reinterpret_cast<__m256i*>(acc_mem + 4), acc[1]);
}
#endif

bool use_avx2() {
#ifdef RESHARD_X86
  return kLittleEndian && kHaveAvx2 && !g_force_portable.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

}  // namespace

void Xxh3Range::force_portable_for_tests(bool on) { g_force_portable = on; }

Xxh3Range::Xxh3Range(const void* base, uint64_t len)
    : base_(static_cast<const uint8_t*>(base)), len_(len), regular_(len > kMidsizeMax ? (len - 1) / kStripe : 0) {
  const uint64_t init[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  std::memcpy(acc_, init, sizeof acc_);
  if (!kLittleEndian) regular_ = 0;  // digest() hashes the whole range with libxxhash
}

void Xxh3Range::hash_upto(const void* end) {
  const uint64_t upto = uint64_t(static_cast<const uint8_t*>(end) - base_);
  if (stripes_ >= regular_ || next_ + kStripe > upto) return;
#ifdef RESHARD_X86
  if (use_avx2()) {
    hash_upto_avx2(acc_, base_, next_, stripes_, regular_, upto);
    return;
  }
#endif
  while (stripes_ < regular_ && next_ + kStripe <= upto) {
    accumulate_stripe(acc_, base_ + next_, kSecret + 8 * (stripes_ % kStripesPerBlock));
    next_ += kStripe;
    if (++stripes_ % kStripesPerBlock == 0) scramble(acc_, kSecret + kScrambleAt);
  }
}

void Xxh3Range::copy(void* dst, const void* src, uint64_t n, Store store) {
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
#ifdef RESHARD_X86
  if (use_avx2() && n >= 4 * 64) {
    const bool stream = store == Store::kStream;
    // Streaming stores need whole aligned lines: the partial first line gets ordinary stores.
    const uint64_t head = stream ? (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63 : 0;
    std::memcpy(d, s, head);
    const uint64_t body = (n - head) / 128 * 128;
    const uint64_t rel = uint64_t(s + head - base_);
    if (stream) copy_hash_avx2<true>(d + head, s + head, body, rel, acc_, base_, next_, stripes_, regular_);
    else copy_hash_avx2<false>(d + head, s + head, body, rel, acc_, base_, next_, stripes_, regular_);
    std::memcpy(d + head + body, s + head + body, n - head - body);
    if (stream) _mm_sfence();
    hash_upto(s + n);
    return;
  }
#endif
  std::memcpy(d, s, n);
  hash_upto(s + n);
}

uint64_t Xxh3Range::digest() {
  if (len_ <= kMidsizeMax || !kLittleEndian) return XXH3_64bits(base_, len_);
  hash_upto(base_ + len_);
  // The last stripe: the range's final 64 bytes (overlapping the regular ones), then the merge.
  uint64_t acc[8];
  std::memcpy(acc, acc_, sizeof acc);
  accumulate_stripe(acc, base_ + len_ - kStripe, kSecret + kLastStripeAt);
  uint64_t h = len_ * kP64_1;
  for (int i = 0; i < 4; ++i)
    h += mul128_fold64(acc[2 * i] ^ read64(kSecret + kMergeAt + 16 * i), acc[2 * i + 1] ^ read64(kSecret + kMergeAt + 16 * i + 8));
  return avalanche(h);
}

}  // namespace reshard
