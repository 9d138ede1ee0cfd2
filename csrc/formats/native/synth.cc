// Synthetic checkpoints: every element a pure function of (seed, tensor, state, logical index).
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>

#include "formats/native/native_internal.h"
#include "io/parallel.h"
#include "reshard/error.h"
#include "reshard/native.h"

namespace reshard {
namespace {

inline uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t key_of(uint64_t seed, const std::string& tensor, StateKind state) {
  // The 16-bit weight is the downcast of the master: both use the master's key.
  if (state == StateKind::kWeight) state = StateKind::kMaster;
  uint64_t h = 1469598103934665603ull;
  for (char c : tensor) h = (h ^ uint8_t(c)) * 1099511628211ull;
  return splitmix(h ^ splitmix(seed) ^ (uint64_t(state) + 1) * 0xd6e8feb86659fd93ull);
}

// Finite floats with |x| in [2^-17, 2^1); exp_avg_sq non-negative.
inline float value_of(uint64_t key, int64_t lin, bool non_negative) {
  uint64_t h = splitmix(key ^ (uint64_t(lin) * 0x9e3779b97f4a7c15ull));
  uint32_t exp = 110 + uint32_t((((h >> 32) & 0xffffffu) * 18u) >> 24);
  uint32_t bits = (uint32_t(h) & 0x807fffffu) | (exp << 23);
  if (non_negative) bits &= 0x7fffffffu;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

void fill_values(uint64_t key, bool non_negative, int64_t lin0, int64_t n, float* out) {
  for (int64_t k = 0; k < n; ++k) out[k] = value_of(key, lin0 + k, non_negative);
}

struct WorkItem {
  int piece;
  int64_t outer_begin, outer_end;  // range of outer (all but the last dim) coordinates
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

}  // namespace

float synth_value(uint64_t seed, const std::string& tensor, StateKind state, int64_t linear) {
  return value_of(key_of(seed, tensor, state), linear, state == StateKind::kExpAvgSq);
}

int64_t synth_linear_index(const LogicalArray& a, const std::array<int64_t, kMaxDims>& ix) {
  int64_t lin = 0;
  for (int d = 0; d < a.ndim; ++d) lin = lin * (d == 0 ? 1 : a.shape[d]) + ix[d];
  return lin;
}

void synth_checkpoint(const std::string& root, const ModelConfig& model, const Topology& topo, uint64_t seed,
                      const std::string& step) {
  DeriveOptions dopt;
  dopt.weights_on_dp0_only = true;
  const Layout L = derive_layout(model, topo, dopt);
  const int world = topo.world_size();

  NonTensorState state;
  state.step = int64_t(1 + seed % 1000);
  state.iteration = state.step;
  state.consumed_samples = state.step * 8;
  state.json = "{\"synth\": {\"seed\": " + std::to_string(seed) + "}}";
  for (int r = 0; r < world; ++r)
    state.per_rank[r] = "{\"rng\": \"synth-" + std::to_string(seed) + "-" + std::to_string(r) + "\"}";

  std::vector<uint64_t> keys(L.arrays.size());
  for (size_t a = 0; a < L.arrays.size(); ++a) keys[a] = key_of(seed, L.arrays[a].tensor, L.arrays[a].state);
  std::vector<std::vector<int>> pieces_of_rank(world);
  for (size_t p = 0; p < L.pieces.size(); ++p) pieces_of_rank[L.buffers[L.pieces[p].buffer].rank].push_back(int(p));

  std::vector<std::unique_ptr<void, FreeDeleter>> storage(L.buffers.size());
  const int nthreads = default_threads();

  auto provide = [&](int rank) {
    for (auto& s : storage) s.reset();
    std::vector<const void*> ptrs(L.buffers.size(), nullptr);
    for (size_t b = 0; b < L.buffers.size(); ++b) {
      if (L.buffers[b].rank != rank) continue;
      const size_t bytes = size_t(L.buffers[b].numel) * dtype_size(L.buffers[b].dtype);
      storage[b].reset(std::calloc(std::max<size_t>(bytes, 1), 1));  // padding stays zero
      if (!storage[b]) fail(ErrorCode::kFailedPrecondition, "synth: cannot allocate ", bytes, " bytes for ", L.buffers[b].name);
      ptrs[b] = storage[b].get();
    }
    // Work items of about 1M elements.
    std::vector<WorkItem> items;
    for (int p : pieces_of_rank[rank]) {
      const Piece& pc = L.pieces[p];
      if (pc.box.numel() == 0) continue;
      const int nd = pc.box.ndim;
      const int64_t inner = nd == 0 ? 1 : pc.box.len[nd - 1];
      const int64_t outer = pc.box.numel() / inner;
      const int64_t step_outer = std::max<int64_t>(1, (int64_t(1) << 20) / inner);
      for (int64_t o = 0; o < outer; o += step_outer) items.push_back({p, o, std::min(outer, o + step_outer)});
    }
    std::vector<std::vector<float>> tmps(static_cast<size_t>(nthreads));  // per thread
    parallel_for(items.size(), nthreads, [&](size_t k, int w) {
      std::vector<float>& tmp = tmps[size_t(w)];
      const WorkItem& it = items[k];
      const Piece& pc = L.pieces[it.piece];
      const LogicalArray& a = L.arrays[pc.array];
      const Buffer& buf = L.buffers[pc.buffer];
      const uint64_t key = keys[pc.array];
      const bool nonneg = a.state == StateKind::kExpAvgSq;
      const size_t es = dtype_size(buf.dtype);
      char* dst = static_cast<char*>(storage[pc.buffer].get());
      const int nd = pc.box.ndim;
      const int last = nd - 1;
      const int64_t inner = nd == 0 ? 1 : pc.box.len[last];
      const int64_t inner_stride = nd == 0 ? 1 : pc.strides[last];
      // Row-major multipliers of the logical array (dim 0's length ignored).
      std::array<int64_t, kMaxDims> mult{};
      int64_t m = 1;
      for (int d = nd - 1; d >= 0; --d) {
        mult[d] = m;
        m *= a.shape[d];
      }
      tmp.resize(size_t(inner));
      for (int64_t o = it.outer_begin; o < it.outer_end; ++o) {
        // Outer coordinate o -> box-relative indices of dims [0, last).
        int64_t rest = o, lin0 = 0, mem = pc.base;
        for (int d = last - 1; d >= 0; --d) {
          const int64_t i = rest % pc.box.len[d];
          rest /= pc.box.len[d];
          lin0 += (pc.box.off[d] + i) * mult[d];
          mem += i * pc.strides[d];
        }
        if (nd > 0) lin0 += pc.box.off[last];
        char* out = dst + uint64_t(mem) * es;
        if (buf.dtype == DType::F32 && inner_stride == 1) {
          fill_values(key, nonneg, lin0, inner, reinterpret_cast<float*>(out));
          continue;
        }
        fill_values(key, nonneg, lin0, inner, tmp.data());
        if (inner_stride == 1) {
          convert_elements(tmp.data(), DType::F32, out, buf.dtype, size_t(inner));
        } else {
          for (int64_t k2 = 0; k2 < inner; ++k2)
            convert_elements(&tmp[k2], DType::F32, out + uint64_t(k2 * inner_stride) * es, buf.dtype, 1);
        }
      }
    });
    return ptrs;
  };
  native::save_all_ranks_with(root, step, L, state, provide);
}

}  // namespace reshard
