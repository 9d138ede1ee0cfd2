// In-memory checkpoints for planner tests: every source buffer is a "file" filled with values
// that are a pure function of (tensor, state, logical index), so the expected value of every
// target element is known whatever the layouts.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/plan.h"
#include "reshard/simulate.h"
#include "reshard/strided.h"

namespace reshard::testing {

inline uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

inline uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;
  for (char c : s) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return h;
}

/// Ground truth: exactly representable in bf16 for weights (8 significant bits), arbitrary
/// finite fp32 bit patterns for optimizer states.
inline float truth(const LogicalArray& a, int64_t linear) {
  uint64_t h = splitmix(name_hash(a.key()) ^ uint64_t(linear) * 0x100000001b3ull);
  if (a.state == StateKind::kWeight) return float(int(h % 255) - 127) / 16.0f;
  uint32_t bits = uint32_t(h);
  bits = (bits & 0x807fffffu) | (uint32_t(100 + (h >> 40) % 50) << 23);  // finite, moderate exponent
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

/// Linear index of a logical coordinate in a row-major space whose dim 0 is `rows` long.
inline int64_t linear_index(const LogicalArray& a, const std::array<int64_t, kMaxDims>& ix) {
  int64_t lin = 0;
  for (int d = 0; d < a.ndim; ++d) lin = lin * (d == 0 ? 1 << 30 : a.shape[d]) + ix[d];
  return lin;
}

template <typename Fn>
void for_each_index(const Box& b, Fn fn) {
  if (b.numel() == 0) return;
  std::array<int64_t, kMaxDims> ix{};
  while (true) {
    std::array<int64_t, kMaxDims> g{};
    for (int d = 0; d < b.ndim; ++d) g[d] = b.off[d] + ix[d];
    int64_t rel = 0;
    for (int d = 0; d < b.ndim; ++d) rel = rel * b.len[d] + ix[d];
    fn(g, rel);
    int d = b.ndim - 1;
    while (d >= 0 && ++ix[d] >= b.len[d]) ix[d--] = 0;
    if (d < 0) break;
  }
}

/// Buffers of a layout as byte vectors.
struct MemCheckpoint {
  std::vector<std::vector<uint8_t>> bufs;

  explicit MemCheckpoint(const Layout& L) {
    for (const auto& b : L.buffers) bufs.emplace_back(size_t(b.numel) * dtype_size(b.dtype), 0);
  }
  std::vector<void*> ptrs() {
    std::vector<void*> p;
    for (auto& b : bufs) p.push_back(b.data());
    return p;
  }
  /// Writes the ground truth into every piece of the layout.
  void fill_truth(const Layout& L) {
    for (const Piece& p : L.pieces) {
      const auto& a = L.arrays[p.array];
      const auto& buf = L.buffers[p.buffer];
      for_each_index(p.box, [&](const std::array<int64_t, kMaxDims>& g, int64_t) {
        int64_t off = p.base;
        for (int d = 0; d < p.box.ndim; ++d) off += (g[d] - p.box.off[d]) * p.strides[d];
        float v = truth(a, linear_index(a, g));
        convert_elements(&v, DType::F32, bufs[p.buffer].data() + off * dtype_size(buf.dtype), buf.dtype, 1);
      });
    }
  }
  /// Source view: one file per buffer.
  SourceLayout as_source(const Layout& L) const {
    SourceLayout s;
    s.layout = L;
    for (size_t i = 0; i < L.buffers.size(); ++i) {
      s.files.push_back("mem://" + std::to_string(L.buffers[i].rank) + "/" + L.buffers[i].name);
      s.locations.push_back({int32_t(i), 0});
    }
    return s;
  }
  ReadFn reader() const {
    return [this](int32_t file, uint64_t off, uint64_t len, void* dst) {
      const auto& b = bufs.at(file);
      if (off + len > b.size()) fail(ErrorCode::kDataLoss, "read past end of mem file ", file);
      std::memcpy(dst, b.data() + off, len);
    };
  }
};

/// Checks every target piece against the truth (padding rows beyond `src_rows` must be zero).
/// Returns the number of wrong elements; the first few are described in *why.
inline int64_t check_truth(const Layout& T, MemCheckpoint& mem, int64_t src_vocab_rows_min,
                           std::string* why) {
  int64_t bad = 0;
  for (const Piece& p : T.pieces) {
    const auto& a = T.arrays[p.array];
    const auto& buf = T.buffers[p.buffer];
    for_each_index(p.box, [&](const std::array<int64_t, kMaxDims>& g, int64_t) {
      int64_t off = p.base;
      for (int d = 0; d < p.box.ndim; ++d) off += (g[d] - p.box.off[d]) * p.strides[d];
      float got;
      convert_elements(mem.bufs[p.buffer].data() + off * dtype_size(buf.dtype), buf.dtype, &got, DType::F32, 1);
      float want = truth(a, linear_index(a, g));
      if (a.real_rows >= 0 && g[0] >= src_vocab_rows_min) want = 0.f;
      // A weight filled from the fp32 master is the downcast of the master's truth.
      if (std::memcmp(&got, &want, 4) != 0) {
        if (bad < 5 && why) *why += a.key() + " at " + std::to_string(g[0]) + "; ";
        ++bad;
      }
    });
  }
  return bad;
}

}  // namespace reshard::testing
