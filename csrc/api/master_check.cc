// The stored weights against the fp32 master weights (consolidate.h, check_weights_against_master).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <unordered_map>

#include "io/parallel.h"
#include "reshard/consolidate.h"
#include "reshard/error.h"

namespace reshard {

namespace {

// `T` with only its weight and fp32 master arrays (a ZeRO-0 layout: one buffer per array),
// weight buffers in `weight_dtype[tensor]` (the dtype the checkpoint stores them in).
Layout weights_and_masters(const Layout& T, const std::unordered_map<std::string, DType>& weight_dtype) {
  Layout out = T;
  out.arrays.clear();
  out.buffers.clear();
  out.pieces.clear();
  std::vector<int32_t> new_array(T.arrays.size(), -1), new_buffer(T.buffers.size(), -1);
  for (size_t a = 0; a < T.arrays.size(); ++a)
    if (T.arrays[a].state == StateKind::kWeight || T.arrays[a].state == StateKind::kMaster) {
      new_array[a] = int32_t(out.arrays.size());
      out.arrays.push_back(T.arrays[a]);
    }
  for (const Piece& p : T.pieces) {
    if (new_array[p.array] < 0) continue;
    if (new_buffer[p.buffer] < 0) {
      new_buffer[p.buffer] = int32_t(out.buffers.size());
      Buffer b = T.buffers[p.buffer];
      if (b.state == StateKind::kWeight) b.dtype = weight_dtype.at(T.arrays[p.array].tensor);
      out.buffers.push_back(b);
    }
    Piece q = p;
    q.array = new_array[p.array];
    q.buffer = new_buffer[p.buffer];
    out.pieces.push_back(q);
  }
  return out;
}

// The dims of piece `p` longer than 1, outermost first (largest stride first), when the piece
// fills [base, base + numel) of its buffer densely in that order (any order of the dims: a
// legacy QKV's pieces are permuted); nullopt otherwise. A dense piece's elements in a buffer
// range [lo, hi) are one range of its linear index in that order.
std::optional<std::vector<int>> dense_order(const Piece& p) {
  std::vector<int> ord;
  for (int d = 0; d < p.box.ndim; ++d)
    if (p.box.len[d] > 1) ord.push_back(d);
  std::sort(ord.begin(), ord.end(), [&p](int x, int y) { return p.strides[x] > p.strides[y]; });
  int64_t unit = 1;
  for (size_t k = ord.size(); k-- > 0;) {
    if (p.strides[ord[k]] != unit) return std::nullopt;
    unit *= p.box.len[ord[k]];
  }
  return ord;
}

// Whether every buffer of `tensor` in `T` (a ZeRO-0 layout: one buffer per array and tp rank)
// can be cut into element ranges: each of its pieces is dense (dense_order) and within its buffer.
bool cuttable(const Layout& T, const std::string& tensor) {
  for (const Piece& p : T.pieces) {
    if (T.arrays[p.array].tensor != tensor || p.box.numel() == 0) continue;
    if (!dense_order(p) || p.base < 0 || p.base + p.box.numel() > T.buffers[p.buffer].numel) return false;
  }
  return true;
}

// Cuts every buffer of `tensor` in `T` to its elements [lo, hi) (cuttable): the buffer then
// holds those elements only and each piece is replaced by the boxes of it that lie there. A
// range of a piece's linear index is a run of boxes: a partial innermost run, then ever larger
// aligned blocks, then ever smaller ones (at most 2 x dims - 1 boxes), whatever the tensor's
// shape, so a fused SwiGLU half or QKV query group is cut like any matrix's rows.
void keep_elements(Layout& T, const std::string& tensor, int64_t lo, int64_t hi) {
  std::vector<int64_t> numel(T.buffers.size(), -1);
  std::vector<Piece> kept;
  for (const Piece& p : T.pieces) {
    if (T.arrays[p.array].tensor != tensor) {
      kept.push_back(p);
      continue;
    }
    const int64_t n_buf = T.buffers[p.buffer].numel;
    numel[p.buffer] = std::min(hi, n_buf) - std::min(lo, n_buf);
    const std::vector<int> ord = *dense_order(p);
    // The piece's linear indices in [lo, hi) of the buffer.
    int64_t a = std::max(lo, p.base) - p.base;
    const int64_t b = std::min(hi, p.base + p.box.numel()) - p.base;
    const size_t k_dims = ord.size();
    std::vector<int64_t> inner(k_dims, 1);  // elements per unit step of dim ord[k]
    for (size_t k = k_dims; k-- > 1;) inner[k - 1] = inner[k] * p.box.len[ord[k]];
    while (a < b) {
      Piece q = p;
      if (k_dims == 0) {  // one element
        q.base = p.base - lo;
        kept.push_back(q);
        break;
      }
      // The outermost level whose unit starts at `a` and fits before `b`.
      size_t k = 0;
      while (a % inner[k] != 0 || inner[k] > b - a) ++k;
      int64_t base = p.base;
      for (size_t j = 0; j < k_dims; ++j) {
        const int d = ord[j];
        const int64_t at = (a / inner[j]) % p.box.len[d];
        if (j < k) {
          q.box.off[d] = p.box.off[d] + at;
          q.box.len[d] = 1;
        } else if (j == k) {
          q.box.off[d] = p.box.off[d] + at;
          q.box.len[d] = std::min((b - a) / inner[k], p.box.len[d] - at);
        }
        base += (j <= k ? at : 0) * p.strides[d];
      }
      q.base = base - lo;
      a += q.box.len[ord[k]] * inner[k];
      // The box is dense from q.base, so it lies within the cut buffer exactly when its last
      // element does.
      RESHARD_CHECK(q.base >= 0 && q.base + q.box.numel() <= numel[p.buffer], "element range [", lo, ", ", hi,
                    ") of ", tensor, ": box ", q.box.to_string(), " at ", q.base, " outside the cut buffer");
      kept.push_back(q);
    }
  }
  T.pieces.swap(kept);
  for (size_t b = 0; b < T.buffers.size(); ++b)
    if (numel[b] >= 0) T.buffers[b].numel = numel[b];
}

// Bytes of all of T's buffers.
uint64_t bytes_held(const Layout& T) {
  uint64_t n = 0;
  for (const Buffer& b : T.buffers) n += uint64_t(b.numel) * dtype_size(b.dtype);
  return n;
}

// Names of the files holding pieces of source array `a` on tp rank `tp_rank` (at most three).
std::string files_holding(const SourceLayout& src, int a, int tp_rank) {
  std::vector<std::string> names;
  for (const Piece& p : src.layout.pieces) {
    if (p.array != a || p.box.numel() == 0) continue;
    if (src.layout.topo.tp_rank(src.layout.buffers[p.buffer].rank) != tp_rank) continue;
    const int32_t f = src.locations[p.buffer].file;
    if (f < 0) continue;
    const std::string& path = src.files[size_t(f)];
    const std::string name = path.substr(path.find_last_of('/') + 1);
    if (std::find(names.begin(), names.end(), name) == names.end()) names.push_back(name);
  }
  std::string s;
  for (size_t i = 0; i < names.size() && i < 3; ++i) s += (i ? ", " : "") + names[i];
  if (names.size() > 3) s += ", ... (" + std::to_string(names.size()) + " files)";
  return s;
}

std::string index_text(int64_t linear, const std::vector<int64_t>& shape) {
  std::vector<int64_t> ix(shape.size(), 0);
  for (size_t d = shape.size(); d-- > 0;) {
    const int64_t n = std::max<int64_t>(1, shape[d]);
    ix[d] = linear % n;
    linear /= n;
  }
  std::string s = "[";
  for (size_t d = 0; d < ix.size(); ++d) s += (d ? ", " : "") + std::to_string(ix[d]);
  return s + "]";
}


// One tp rank's shard of a tensor compared straight out of the file mappings: every weight piece
// with every master piece it meets, the shard's elements the bounding box `box` of its pieces
// (row-major over it is the shard's stored order, as consolidation lays it out).
struct DirectShard {
  int tp_rank = 0;
  Box box;
  std::vector<std::pair<const Piece*, const Piece*>> pairs;  // (weight, master), boxes meeting
};

// The direct comparison of tensor `t` (DirectShard per compared tp rank), or false where it
// needs the consolidating path: a file that is not mapped, a piece not contiguous along its last
// dim or outside its file, weight or master copies that overlap (dp copies: the path with the
// planner picks the copy a load uses), a shard that is not one box of its pieces (QKV K/V rows
// copied to several tp ranks), a master that is not F32.
bool direct_shards(const CheckpointReader& reader, const SourceLayout& src, const TensorSpec& t, DType wd,
                   std::map<int32_t, uint64_t>& file_size, std::vector<DirectShard>* out) {
  const Layout& S = src.layout;
  const int wa = S.find_array(t.name, StateKind::kWeight), ma = S.find_array(t.name, StateKind::kMaster);
  const bool replicated = t.split == Split::kReplicated && t.reduction == Reduction::kReplicated;
  const int ranks = replicated ? 1 : S.topo.tp;
  std::vector<std::vector<const Piece*>> w(size_t(S.topo.tp)), m(size_t(S.topo.tp));
  for (const Piece& p : S.pieces) {
    if ((p.array != wa && p.array != ma) || p.box.numel() == 0) continue;
    const Buffer& b = S.buffers[size_t(p.buffer)];
    const BufferLocation& loc = src.locations[size_t(p.buffer)];
    if (b.dtype != (p.array == wa ? wd : DType::F32) || loc.file < 0 || !reader.mapped(loc.file)) return false;
    const int nd = p.box.ndim, last = nd - 1;
    if (nd < 1 || (p.box.len[last] > 1 && p.strides[last] != 1) || p.base < 0) return false;
    // Dense in row-major order over its box (a legacy QKV's permuted pieces are not: their
    // stored order is not the array's, so they go through the consolidation).
    int64_t unit = 1;
    for (int d = last; d >= 0; --d) {
      if (p.box.len[d] > 1 && p.strides[d] != unit) return false;
      unit *= p.box.len[d];
    }
    int64_t hi = p.base;  // last element of the box in its buffer
    for (int d = 0; d < nd; ++d) hi += (p.box.len[d] - 1) * p.strides[d];
    if (hi >= b.numel) return false;
    auto fs = file_size.find(loc.file);
    if (fs == file_size.end()) fs = file_size.emplace(loc.file, reader.file_size(loc.file)).first;
    if (loc.byte_offset + uint64_t(hi + 1) * dtype_size(b.dtype) > fs->second) return false;
    (p.array == wa ? w : m)[size_t(S.topo.tp_rank(b.rank))].push_back(&p);
  }
  auto bounding = [](const std::vector<const Piece*>& ps, Box* box) {
    *box = ps[0]->box;
    int64_t sum = 0;
    for (const Piece* p : ps) {
      for (int d = 0; d < box->ndim; ++d) {
        const int64_t lo = std::min(box->off[d], p->box.off[d]);
        const int64_t hi = std::max(box->off[d] + box->len[d], p->box.off[d] + p->box.len[d]);
        box->off[d] = lo;
        box->len[d] = hi - lo;
      }
      sum += p->box.numel();
    }
    for (size_t i = 0; i < ps.size(); ++i)
      for (size_t j = i + 1; j < ps.size(); ++j)
        if (intersect(ps[i]->box, ps[j]->box).numel() > 0) return false;
    return sum == box->numel();
  };
  for (int r = 0; r < ranks; ++r) {
    if (w[size_t(r)].empty() || m[size_t(r)].empty()) return false;
    DirectShard sh;
    sh.tp_rank = r;
    Box mbox;
    if (!bounding(w[size_t(r)], &sh.box) || !bounding(m[size_t(r)], &mbox)) return false;
    if (mbox.off != sh.box.off || mbox.len != sh.box.len || mbox.ndim != sh.box.ndim) return false;
    int64_t local = 1;
    for (int64_t d : tp_shard(t, S.model, S.topo.tp, r).local_shape) local *= d;
    if (local != sh.box.numel()) return false;
    for (const Piece* pw : w[size_t(r)])
      for (const Piece* pm : m[size_t(r)])
        if (intersect(pw->box, pm->box).numel() > 0) sh.pairs.emplace_back(pw, pm);
    out->push_back(std::move(sh));
  }
  return true;
}
}  // namespace

std::string MasterMismatch::to_string() const {
  char vals[96];
  std::snprintf(vals, sizeof vals, "weight %.9g, master %.9g", double(weight), double(master));
  const std::string where = replicated ? "replicated over tp, tp rank 0's copy" : "tp rank " + std::to_string(tp_rank);
  return "tensor " + tensor + " (" + where + "): " + std::to_string(differing) + " of " +
         std::to_string(compared) + " weight elements differ from the fp32 master" +
         (weight_dtype == DType::F32 ? std::string() : std::string(" rounded to ") + dtype_name(weight_dtype)) + " (first at " + first + " of the tp rank's shard: " + vals +
         "); the model files and the optimizer files disagree (files swapped or from different saves, or weights "
         "edited after the save): weights in " + (weight_files.empty() ? "?" : weight_files) + ", master in " +
         (master_files.empty() ? "?" : master_files);
}

MasterCheck check_weights_against_master(const CheckpointReader& reader, const MasterCheckOptions& o) {
  const int part = o.part, parts = o.parts;
  RESHARD_CHECK(parts >= 1 && part >= 0 && part < parts, "part ", part, " of ", parts);
  const SourceLayout& src = reader.source();
  const Layout& S = src.layout;
  MasterCheck out;

  // Tensors whose weight and master are both stored (a ZeRO-3 checkpoint stores no 16-bit
  // weights: a load makes them from the master, so there is nothing to compare).
  std::vector<bool> stored(S.arrays.size(), false);
  std::unordered_map<std::string, DType> weight_dtype;
  for (const Piece& p : S.pieces) {
    if (p.box.numel() == 0) continue;
    stored[p.array] = true;
    if (S.arrays[p.array].state == StateKind::kWeight) weight_dtype[S.arrays[p.array].tensor] = S.buffers[p.buffer].dtype;
  }
  std::vector<const TensorSpec*> candidates;
  std::vector<uint64_t> candidate_bytes;
  for (const TensorSpec& t : S.tensors) {
    const int w = S.find_array(t.name, StateKind::kWeight), m = S.find_array(t.name, StateKind::kMaster);
    if (w < 0 || m < 0 || !stored[w] || !stored[m]) continue;
    candidates.push_back(&t);
    // Weights and masters of every tp rank's shard as held (a tensor replicated over tp, a
    // partial_sum one: tp whole copies; a QKV whose K/V rows are copied to several tp ranks
    // when tp > query groups: those copies), so a batch within the budget holds no more.
    uint64_t n = 0;
    for (int r = 0; r < S.topo.tp; ++r) {
      uint64_t local = 1;
      for (int64_t d : tp_shard(t, S.model, S.topo.tp, r).local_shape) local *= uint64_t(d);
      n += local;
    }
    candidate_bytes.push_back(n * (dtype_size(weight_dtype.at(t.name)) + 4));
  }
  // The parts share the tensors by bytes: largest first, each to the part with the fewest bytes
  // so far (ties: the lower part; the same split on every rank). Every other tensor in stored
  // order gave one part all the weight matrices and the other all the biases and norms (a
  // 2-rank load: 0.34 s on one rank, 0.004 s on the other).
  std::vector<size_t> order(candidates.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return candidate_bytes[x] > candidate_bytes[y]; });
  std::vector<uint64_t> load(size_t(parts), 0);
  std::vector<bool> mine(candidates.size(), false);
  for (size_t i : order) {
    const size_t p = size_t(std::min_element(load.begin(), load.end()) - load.begin());
    load[p] += candidate_bytes[i];
    mine[i] = int(p) == part;
  }
  std::vector<TensorSpec> both;
  std::vector<uint64_t> bytes;
  for (size_t i = 0; i < candidates.size(); ++i)
    if (mine[i]) {
      both.push_back(*candidates[i]);
      bytes.push_back(candidate_bytes[i]);
    }
  if (both.empty()) return out;
  // Position of each tensor in the checkpoint's order, so that findings come back in it.
  std::unordered_map<std::string, size_t> order_of;
  for (size_t i = 0; i < S.tensors.size(); ++i) order_of[S.tensors[i].name] = i;
  std::vector<std::pair<size_t, MasterMismatch>> found;

  // Straight out of the file mappings where the pieces allow it (direct_shards): a load's check
  // (replicas compared by the load itself) spent 70% of its time planning and copying the
  // weights and masters into an arena before comparing them (2.06 GB, 2 ranks: 0.19 s of
  // 0.27 s per rank). The rest go through the consolidating path below.
  std::vector<TensorSpec> direct;
  std::vector<std::vector<DirectShard>> direct_plan;
  if (!o.replicas && o.direct) {
    std::map<int32_t, uint64_t> file_size;
    std::vector<TensorSpec> rest;
    std::vector<uint64_t> rest_bytes;
    for (size_t k = 0; k < both.size(); ++k) {
      std::vector<DirectShard> sh;
      if (direct_shards(reader, src, both[k], weight_dtype.at(both[k].name), file_size, &sh)) {
        direct.push_back(both[k]);
        direct_plan.push_back(std::move(sh));
      } else {
        rest.push_back(both[k]);
        rest_bytes.push_back(bytes[k]);
      }
    }
    both.swap(rest);
    bytes.swap(rest_bytes);
  }
  const int threads = o.threads > 0 ? o.threads : default_threads();
  if (!direct.empty()) {
    struct DirectOut {
      std::vector<MasterMismatch> mismatches;
      uint64_t bytes_read = 0;
      int64_t elements = 0;
    };
    std::vector<DirectOut> dres(direct.size());
    constexpr size_t kRun = size_t(1) << 14;
    const int workers = std::max(1, std::min<int>(threads, int(direct.size())));
    std::vector<std::vector<uint8_t>> rounded(static_cast<size_t>(workers), std::vector<uint8_t>(kRun * 8));
    std::vector<std::vector<float>> weight_f32(static_cast<size_t>(workers), std::vector<float>(kRun));
    std::vector<std::vector<float>> rounded_f32(static_cast<size_t>(workers), std::vector<float>(kRun));
    parallel_for(direct.size(), workers, [&](size_t k, int wi) {
      const TensorSpec& t = direct[k];
      const DType wd = weight_dtype.at(t.name);
      const size_t es = dtype_size(wd);
      const bool replicated = t.split == Split::kReplicated && t.reduction == Reduction::kReplicated;
      for (const DirectShard& sh : direct_plan[k]) {
        MasterMismatch mm;
        mm.tensor = t.name;
        mm.tp_rank = sh.tp_rank;
        mm.weight_dtype = wd;
        mm.compared = sh.box.numel();
        mm.replicated = replicated && S.topo.tp > 1;
        int64_t first = -1;
        const int nd = sh.box.ndim, last = nd - 1;
        std::array<int64_t, kMaxDims> row{};  // row-major strides of the shard's box
        row[size_t(last)] = 1;
        for (int d = last; d-- > 0;) row[size_t(d)] = row[size_t(d) + 1] * sh.box.len[size_t(d) + 1];
        for (const auto& [pw, pm] : sh.pairs) {
          const Box I = intersect(pw->box, pm->box);
          const BufferLocation& lw = src.locations[size_t(pw->buffer)];
          const BufferLocation& lm = src.locations[size_t(pm->buffer)];
          const uint8_t* wbase = reader.mapped(lw.file) + lw.byte_offset;
          const uint8_t* mbase = reader.mapped(lm.file) + lm.byte_offset;
          const int64_t n_run = I.len[size_t(last)];
          int64_t rows = 1;
          for (int d = 0; d < last; ++d) rows *= I.len[size_t(d)];
          for (int64_t rix = 0; rix < rows; ++rix) {
            // The run's first element: its coordinates, then its place in each buffer and in the shard.
            int64_t rest = rix, ow = pw->base, om = pm->base, local = 0;
            for (int d = last; d >= 0; --d) {
              int64_t c = I.off[size_t(d)];
              if (d < last) {
                c += rest % I.len[size_t(d)];
                rest /= I.len[size_t(d)];
              }
              ow += (c - pw->box.off[size_t(d)]) * pw->strides[size_t(d)];
              om += (c - pm->box.off[size_t(d)]) * pm->strides[size_t(d)];
              local += (c - sh.box.off[size_t(d)]) * row[size_t(d)];
            }
            for (int64_t at = 0; at < n_run; at += int64_t(kRun)) {
              const size_t n = size_t(std::min<int64_t>(int64_t(kRun), n_run - at));
              const float* master = reinterpret_cast<const float*>(mbase) + om + at;
              const uint8_t* weight = wbase + size_t(ow + at) * es;
              uint8_t* rd = rounded[size_t(wi)].data();
              convert_elements(master, DType::F32, rd, wd, n);
              if (std::memcmp(rd, weight, n * es) == 0) continue;
              float* a = weight_f32[size_t(wi)].data();
              float* b = rounded_f32[size_t(wi)].data();
              convert_elements(rd, wd, b, DType::F32, n);
              convert_elements(weight, wd, a, DType::F32, n);
              for (size_t i = 0; i < n; ++i) {
                if (a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) continue;
                ++mm.differing;
                const int64_t li = local + at + int64_t(i);
                if (first < 0 || li < first) {
                  first = li;
                  mm.weight = a[i];
                  mm.master = master[i];
                }
              }
            }
          }
        }
        dres[k].bytes_read += uint64_t(mm.compared) * (es + 4);
        dres[k].elements += mm.compared;
        if (mm.differing) {
          mm.first = index_text(first, tp_shard(t, S.model, S.topo.tp, sh.tp_rank).local_shape);
          mm.weight_files = files_holding(src, S.find_array(t.name, StateKind::kWeight), mm.tp_rank);
          mm.master_files = files_holding(src, S.find_array(t.name, StateKind::kMaster), mm.tp_rank);
          dres[k].mismatches.push_back(std::move(mm));
        }
      }
    });
    for (size_t k = 0; k < direct.size(); ++k) {
      out.bytes_read += dres[k].bytes_read;
      out.elements_checked += dres[k].elements;
      ++out.tensors_checked;
      ++out.tensors_direct;
      for (MasterMismatch& mm : dres[k].mismatches) found.emplace_back(order_of.at(mm.tensor), std::move(mm));
    }
  }
  if (both.empty()) {
    std::stable_sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
    for (auto& f : found) out.mismatches.push_back(std::move(f.second));
    return out;
  }

  const ReadFn read = [&reader](int32_t f, uint64_t off, uint64_t len, void* dst) { reader.read(f, off, len, dst); };
  // At the checkpoint's own tp (a partial_sum tensor stays as stored), one machine, no ZeRO.
  Topology own;
  own.tp = S.topo.tp;
  own.zero = 0;
  LikeOptions lo;
  lo.keep_source_vocab_rows = true;
  PlanOptions po;
  po.strict_unexpected = false;    // exp_avg, exp_avg_sq and the other tensors are not wanted here
  po.weights_from_master = false;  // compare what is stored, never a weight made from the master
  po.compare_replicas = o.replicas;
  po.replica_policy = o.replicas ? ReplicaPolicy::kError : ReplicaPolicy::kFirst;
  // Batches of tensors in stored order, each as many as fit a worker's share of the budget (at
  // least one), checked on `threads` workers at once; each worker holds its own arena, so
  // together they hold at most the budget.
  const int workers = std::max(1, std::min<int>(threads, int(both.size())));
  const uint64_t budget = std::max<uint64_t>(1, o.memory_budget / uint64_t(workers));
  std::vector<std::pair<size_t, size_t>> batches;
  for (size_t begin = 0; begin < both.size();) {
    size_t end = begin;
    uint64_t batch = 0;
    do batch += bytes[end++];
    while (end < both.size() && batch + bytes[end] <= budget);
    batches.emplace_back(begin, end);
    begin = end;
  }
  struct Worker {
    SourceLayout sub;
    std::vector<uint8_t> arena;
    std::vector<uint8_t> rounded;
    std::vector<float> a, b;
    uint64_t peak = 0;
  };
  struct BatchOut {
    std::vector<MasterMismatch> mismatches;
    uint64_t bytes_read = 0;
    int64_t elements = 0;
  };
  constexpr size_t kSlab = size_t(1) << 16;
  std::vector<Worker> pool(static_cast<size_t>(workers));
  std::vector<BatchOut> results(batches.size());
  parallel_for(batches.size(), workers, [&](size_t bi, int wi) {
    Worker& w = pool[size_t(wi)];
    BatchOut& res = results[bi];
    if (w.rounded.empty()) {
      w.sub = src;
      w.rounded.resize(kSlab * 8);
      w.a.resize(kSlab);
      w.b.resize(kSlab);
    }
    const size_t first = batches[bi].first, last = batches[bi].second;
    // The source as seen by this batch: its tensors [first, last) and only their pieces, so
    // each pass plans over those, not over the whole checkpoint (a tensor cut into element
    // ranges is planned once per range).
    SourceLayout& sub = w.sub;
    sub.layout.tensors.assign(both.begin() + long(first), both.begin() + long(last));
    std::vector<bool> want(S.arrays.size(), false);
    for (size_t k = first; k < last; ++k)
      for (StateKind st : {StateKind::kWeight, StateKind::kMaster}) {
        const int ar = S.find_array(both[k].name, st);
        if (ar >= 0) want[size_t(ar)] = true;
      }
    sub.layout.pieces.clear();
    for (const Piece& p : S.pieces)
      if (want[size_t(p.array)]) sub.layout.pieces.push_back(p);
    // findings per tensor of the batch and tp rank, reported once every pass over them is done
    std::vector<std::vector<MasterMismatch>> acc(last - first, std::vector<MasterMismatch>(size_t(own.tp)));
    // One pass: plan the layout `T` (the batch's tensors, or elements [elem_lo, ...) of one
    // tensor's shards), read it into the arena and compare each tensor's weights with its master.
    auto pass = [&](const Layout& T, int64_t elem_lo) {
      // A tensor cut into element ranges has its replica copies compared in its first pass only:
      // each pass's plan compares the copies whole, so doing it in every pass read them again per
      // range (a 134 MB replicated tensor at an 8 MiB budget: 118 GB read).
      PlanOptions pass_po = po;
      if (elem_lo > 0) {
        pass_po.compare_replicas = false;
        pass_po.replica_policy = ReplicaPolicy::kFirst;
      }
      const Plan plan = make_plan(sub, T, pass_po);
      // The batch's buffers in one arena reused by every batch: fresh pages cost a fault and a
      // clear each (in a VM several times a copy), which made this check cost seconds per GB.
      // No clearing: make_plan refuses a target element no stored piece covers, so the plan
      // writes every byte of T's buffers (clearing them cost a tenth of `reshard verify`).
      std::vector<size_t> offset_of(T.buffers.size());
      size_t total = 0;
      for (size_t i = 0; i < T.buffers.size(); ++i) {
        offset_of[i] = total;
        total += (size_t(T.buffers[i].numel) * dtype_size(T.buffers[i].dtype) + 63) / 64 * 64;
      }
      if (w.arena.size() < total) w.arena.resize(total);
      w.peak = std::max(w.peak, bytes_held(T));
      std::vector<void*> ptrs;
      for (size_t i = 0; i < T.buffers.size(); ++i) ptrs.push_back(w.arena.data() + offset_of[i]);
      const std::vector<ReplicaResult> compared = simulate_plan(plan, T, read, ptrs, pass_po.replica_policy, 0.0);
      res.bytes_read += plan.bytes_to_read;
      for (const ReplicaResult& c : compared)
        res.bytes_read += 2 * plan.replica_compares[c.compare].box.numel() *
                          dtype_size(plan.replica_compares[c.compare].authoritative.dtype);
      for (size_t k = first; k < last; ++k) {
        const TensorSpec& t = both[k];
        const DType wd = weight_dtype.at(t.name);
        // A tensor replicated over tp: every tp rank's shard was filled from the same first copy
        // (the planner's authoritative one, tp rank 0's), so one comparison says all there is;
        // copies that differ are the replica check's finding.
        const bool replicated = t.split == Split::kReplicated && t.reduction == Reduction::kReplicated;
        for (int r = 0; r < (replicated ? 1 : own.tp); ++r) {
          const int wb = T.find_buffer(r, std::string(state_kind_name(StateKind::kWeight)) + "/" + t.name);
          const int mb = T.find_buffer(r, std::string(state_kind_name(StateKind::kMaster)) + "/" + t.name);
          if (wb < 0 || mb < 0) continue;
          RESHARD_CHECK(T.buffers[wb].numel == T.buffers[mb].numel, "weight and master shards of ", t.name, " differ in size");
          MasterMismatch& mm = acc[k - first][size_t(r)];
          mm.tensor = t.name;
          mm.tp_rank = r;
          mm.weight_dtype = wd;
          mm.compared += T.buffers[wb].numel;
          mm.replicated = replicated && own.tp > 1;
          // Slab by slab: the master rounded to the weight's dtype against the stored bytes;
          // where they differ, value by value (equal values, two zeros and two NaNs agree).
          const size_t es = dtype_size(wd);
          const int64_t n_all = T.buffers[wb].numel;
          for (int64_t at = 0; at < n_all; at += int64_t(kSlab)) {
            const size_t n = size_t(std::min<int64_t>(int64_t(kSlab), n_all - at));
            const float* master = static_cast<const float*>(ptrs[size_t(mb)]) + at;
            const uint8_t* weight = static_cast<const uint8_t*>(ptrs[size_t(wb)]) + size_t(at) * es;
            convert_elements(master, DType::F32, w.rounded.data(), wd, n);
            if (std::memcmp(w.rounded.data(), weight, n * es) == 0) continue;
            convert_elements(w.rounded.data(), wd, w.b.data(), DType::F32, n);
            convert_elements(weight, wd, w.a.data(), DType::F32, n);
            for (size_t i = 0; i < n; ++i) {
              if (w.a[i] == w.b[i] || (std::isnan(w.a[i]) && std::isnan(w.b[i]))) continue;
              if (mm.differing++ == 0) {
                mm.first = index_text(elem_lo + at + int64_t(i), tp_shard(t, S.model, own.tp, r).local_shape);
                mm.weight = w.a[i];
                mm.master = master[i];
              }
            }
          }
          res.elements += T.buffers[wb].numel;
        }
      }
    };
    {
      const Layout T = weights_and_masters(layout_like(sub, own, lo), weight_dtype);
      if (last - first > 1 || bytes_held(T) <= budget || !cuttable(T, both[first].name)) {
        pass(T, 0);
      } else {
        // One tensor larger than the budget (an embedding, a fused SwiGLU or QKV matrix): its
        // shards' elements a range at a time, so the arena stays within the budget. The ranges
        // cut the stored order, whatever the tensor's dims (a row, a half or a query group).
        int64_t n = 0;
        uint64_t element_bytes = 0;  // one element of every buffer of the tensor
        for (const Buffer& buf : T.buffers) {
          n = std::max(n, buf.numel);
          element_bytes += dtype_size(buf.dtype);
        }
        const int64_t step = std::max<int64_t>(1, int64_t(budget / element_bytes));
        for (int64_t lo_el = 0; lo_el < n; lo_el += step) {
          Layout part_of = T;
          keep_elements(part_of, both[first].name, lo_el, std::min(n, lo_el + step));
          pass(part_of, lo_el);
        }
      }
    }
    for (size_t k = first; k < last; ++k)
      for (MasterMismatch& mm : acc[k - first]) {
        if (!mm.differing) continue;
        mm.weight_files = files_holding(src, S.find_array(mm.tensor, StateKind::kWeight), mm.tp_rank);
        mm.master_files = files_holding(src, S.find_array(mm.tensor, StateKind::kMaster), mm.tp_rank);
        res.mismatches.push_back(std::move(mm));
      }
  });
  // In stored order, as one thread would have found them (a failure was rethrown above).
  for (size_t bi = 0; bi < batches.size(); ++bi) {
    out.bytes_read += results[bi].bytes_read;
    out.elements_checked += results[bi].elements;
    out.tensors_checked += int64_t(batches[bi].second - batches[bi].first);
    for (MasterMismatch& mm : results[bi].mismatches) found.emplace_back(order_of.at(mm.tensor), std::move(mm));
  }
  std::stable_sort(found.begin(), found.end(), [](const auto& x, const auto& y) { return x.first < y.first; });
  for (auto& f : found) out.mismatches.push_back(std::move(f.second));
  for (const Worker& w : pool) out.peak_bytes_held += w.peak;
  return out;
}

}  // namespace reshard
