#include "reshard/layout.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <set>
#include <sstream>
#include <unordered_map>

#include "reshard/error.h"

namespace reshard {

const char* state_kind_name(StateKind s) {
  switch (s) {
    case StateKind::kWeight: return "weight";
    case StateKind::kMaster: return "fp32";
    case StateKind::kExpAvg: return "exp_avg";
    case StateKind::kExpAvgSq: return "exp_avg_sq";
  }
  return "?";
}

StateKind state_kind_from_name(const std::string& s) {
  if (s == "weight" || s == "weights") return StateKind::kWeight;
  if (s == "fp32" || s == "master") return StateKind::kMaster;
  if (s == "exp_avg") return StateKind::kExpAvg;
  if (s == "exp_avg_sq") return StateKind::kExpAvgSq;
  fail(ErrorCode::kInvalidArgument, "unknown state kind '", s, "' (expected weight, fp32, exp_avg, exp_avg_sq)");
}

int64_t Box::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= len[d];
  return n;
}

bool Box::operator==(const Box& o) const {
  if (ndim != o.ndim) return false;
  for (int d = 0; d < ndim; ++d)
    if (off[d] != o.off[d] || len[d] != o.len[d]) return false;
  return true;
}

bool Box::operator<(const Box& o) const {
  if (ndim != o.ndim) return ndim < o.ndim;
  for (int d = 0; d < ndim; ++d) {
    if (off[d] != o.off[d]) return off[d] < o.off[d];
    if (len[d] != o.len[d]) return len[d] < o.len[d];
  }
  return false;
}

std::string Box::to_string() const {
  std::ostringstream os;
  os << "[";
  // The end in 128 bits: boxes read from a damaged file are printed before they are checked.
  for (int d = 0; d < ndim; ++d) {
    const __int128 end = __int128(off[d]) + len[d];
    os << (d ? ", " : "") << off[d] << ":";
    if (end > INT64_MAX || end < INT64_MIN) os << off[d] << "+" << len[d];
    else os << int64_t(end);
  }
  os << "]";
  return os.str();
}

Box intersect(const Box& a, const Box& b) {
  Box r;
  r.ndim = a.ndim;
  for (int d = 0; d < a.ndim; ++d) {
    int64_t lo = std::max(a.off[d], b.off[d]);
    int64_t hi = std::min(a.off[d] + a.len[d], b.off[d] + b.len[d]);
    r.off[d] = lo;
    r.len[d] = hi > lo ? hi - lo : 0;
  }
  if (r.numel() == 0)
    for (int d = 0; d < r.ndim; ++d) r.len[d] = 0;
  return r;
}

bool contains(const Box& outer, const Box& inner) {
  for (int d = 0; d < outer.ndim; ++d)
    if (inner.off[d] < outer.off[d] || inner.off[d] + inner.len[d] > outer.off[d] + outer.len[d]) return false;
  return true;
}

int Layout::find_array(const std::string& tensor, StateKind s) const {
  for (size_t i = 0; i < arrays.size(); ++i)
    if (arrays[i].state == s && arrays[i].tensor == tensor) return int(i);
  return -1;
}

int Layout::find_buffer(int rank, const std::string& name) const {
  for (size_t i = 0; i < buffers.size(); ++i)
    if (buffers[i].rank == rank && buffers[i].name == name) return int(i);
  return -1;
}

uint64_t Layout::total_bytes() const {
  uint64_t n = 0;
  for (const auto& b : buffers) n += uint64_t(b.numel) * dtype_size(b.dtype);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Flat ranges and boxes.

namespace {

void decompose(const Box& ext, const std::array<int64_t, kMaxDims>& rm, int dim, int64_t begin,
               int64_t end, std::array<int64_t, kMaxDims>& origin, std::vector<Box>* out) {
  if (begin >= end) return;
  const int nd = ext.ndim;
  auto emit = [&](int d, int64_t lo, int64_t hi) {  // dims < d fixed at origin, dim d = [lo, hi), rest full
    Box b;
    b.ndim = nd;
    for (int k = 0; k < nd; ++k) {
      if (k < d) { b.off[k] = origin[k]; b.len[k] = 1; }
      else if (k == d) { b.off[k] = lo; b.len[k] = hi - lo; }
      else { b.off[k] = 0; b.len[k] = ext.len[k]; }
    }
    out->push_back(b);
  };
  if (dim == nd - 1) {
    emit(dim, begin, end);
    return;
  }
  const int64_t s = rm[dim];
  int64_t first = begin / s, last = end / s;
  if (first == last) {
    origin[dim] = first;
    decompose(ext, rm, dim + 1, begin - first * s, end - first * s, origin, out);
    return;
  }
  if (begin % s != 0) {
    origin[dim] = first;
    decompose(ext, rm, dim + 1, begin % s, s, origin, out);
    ++first;
  }
  if (last > first) emit(dim, first, last);
  if (end % s != 0) {
    origin[dim] = last;
    decompose(ext, rm, dim + 1, 0, end % s, origin, out);
  }
}

std::array<int64_t, kMaxDims> row_major(const std::array<int64_t, kMaxDims>& len, int nd) {
  std::array<int64_t, kMaxDims> s{};
  int64_t acc = 1;
  for (int d = nd - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= len[d];
  }
  return s;
}

}  // namespace

std::vector<Box> flat_range_to_boxes(const Box& extent, int64_t begin, int64_t end) {
  std::vector<Box> out;
  if (extent.ndim == 0) {  // a scalar: one element
    if (begin < end) out.push_back(extent);
    return out;
  }
  auto rm = row_major(extent.len, extent.ndim);
  std::array<int64_t, kMaxDims> origin{};
  decompose(extent, rm, 0, begin, end, origin, &out);
  return out;
}

void append_flat_range_pieces(const TpShard& shard, int64_t a, int64_t b, int32_t array,
                              int32_t buffer, int64_t buffer_offset, std::vector<Piece>* out) {
  for (const Piece& p : shard.pieces) {
    const int nd = p.box.ndim;
    const int64_t n = p.box.numel();
    int64_t lo = std::max(a, p.base), hi = std::min(b, p.base + n);
    if (lo >= hi) continue;
    // Memory order of the piece: dims by decreasing stride (dims of length 1 do not matter).
    std::array<int, kMaxDims> perm{};
    std::iota(perm.begin(), perm.begin() + nd, 0);
    std::stable_sort(perm.begin(), perm.begin() + nd, [&](int x, int y) {
      bool xs = p.box.len[x] == 1, ys = p.box.len[y] == 1;
      if (xs != ys) return xs;  // unit dims first: they never change the offset
      return p.strides[x] > p.strides[y];
    });
    Box ext;
    ext.ndim = nd;
    for (int k = 0; k < nd; ++k) ext.len[k] = p.box.len[perm[k]];
    auto rm = row_major(ext.len, nd);
    for (int k = 0; k < nd; ++k)
      RESHARD_CHECK(ext.len[k] == 1 || rm[k] == p.strides[perm[k]],
                    "piece memory is not contiguous; cannot cut a flat range of it");
    for (const Box& sub : flat_range_to_boxes(ext, lo - p.base, hi - p.base)) {
      Piece q;
      q.array = array;
      q.buffer = buffer;
      q.box.ndim = nd;
      int64_t rel = 0;
      for (int k = 0; k < nd; ++k) {
        int d = perm[k];
        q.box.off[d] = p.box.off[d] + sub.off[k];
        q.box.len[d] = sub.len[k];
        rel += sub.off[k] * rm[k];
      }
      q.strides = p.strides;
      q.base = buffer_offset + (p.base + rel - a);
      out->push_back(q);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-parallel shards.

namespace {

Box full_box(const std::vector<int64_t>& shape) {
  Box b;
  b.ndim = int(shape.size());
  for (int d = 0; d < b.ndim; ++d) b.len[d] = shape[d];
  return b;
}

std::array<int64_t, kMaxDims> rm_of(const std::vector<int64_t>& shape) {
  std::array<int64_t, kMaxDims> len{};
  for (size_t d = 0; d < shape.size(); ++d) len[d] = shape[d];
  return row_major(len, int(shape.size()));
}

int64_t prod(const std::vector<int64_t>& v) {
  int64_t n = 1;
  for (auto x : v) n *= x;
  return n;
}

}  // namespace

TpShard tp_shard(const TensorSpec& spec, const ModelConfig& cfg, int tp, int t) {
  TpShard s;
  const auto& g = spec.shape;
  const int nd = int(g.size());
  if (nd > kMaxDims - 1 && spec.split != Split::kReplicated)
    fail(ErrorCode::kUnsupported, "tensor ", spec.name, " has ", nd, " dims; at most ", kMaxDims - 1, " are supported for split tensors");
  auto even = [&](int64_t n, const char* what) {
    if (n % tp != 0)
      fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": ", what, "=", n, " is not divisible by tp=", tp);
    return n / tp;
  };
  auto one_piece = [&](const std::vector<int64_t>& logical, const std::vector<int64_t>& local, Box box) {
    s.logical_shape = logical;
    s.local_shape = local;
    Piece p;
    p.box = box;
    p.base = 0;
    p.strides = rm_of(local);
    s.pieces.push_back(p);
  };
  switch (spec.split) {
    case Split::kReplicated:
      if (spec.reduction == Reduction::kPartialSum) {
        // Each tp rank holds its own partial value: the logical view gets a leading tp index, so
        // rank t's copy is the box [t] x shape and no two ranks' values are taken for replicas.
        if (nd > kMaxDims - 1)
          fail(ErrorCode::kUnsupported, "tensor ", spec.name, " has ", nd, " dims; partial_sum tensors support at most ", kMaxDims - 1);
        std::vector<int64_t> logical = {int64_t(tp)};
        logical.insert(logical.end(), g.begin(), g.end());
        std::vector<int64_t> local1 = logical;
        local1[0] = 1;
        Box b = full_box(logical);
        b.off[0] = t;
        b.len[0] = 1;
        one_piece(logical, local1, b);
        s.local_shape = g;
        return s;
      }
      one_piece(g, g, full_box(g));
      return s;
    case Split::kColumn:
    case Split::kVocab: {
      if (nd < 1) fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": a ", split_name(spec.split), " split needs >= 1 dim");
      auto local = g;
      local[0] = even(g[0], "rows");
      Box b = full_box(g);
      b.off[0] = t * local[0];
      b.len[0] = local[0];
      one_piece(g, local, b);
      return s;
    }
    case Split::kRow: {
      if (nd < 2) fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": a row split needs >= 2 dims, shape has ", nd);
      auto local = g;
      local[1] = even(g[1], "columns");
      Box b = full_box(g);
      b.off[1] = t * local[1];
      b.len[1] = local[1];
      one_piece(g, local, b);
      return s;
    }
    case Split::kSwiglu: {
      if (g[0] % 2 != 0) fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": SwiGLU rows=", g[0], " must be even");
      if (g[0] != 2 * int64_t(cfg.ffn))
        fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": SwiGLU rows=", g[0], " but the model says 2*ffn=", 2 * int64_t(cfg.ffn));
      std::vector<int64_t> logical = {2, g[0] / 2};
      logical.insert(logical.end(), g.begin() + 1, g.end());
      auto local = logical;
      local[1] = even(logical[1], "ffn rows per half");
      Box b = full_box(logical);
      b.off[1] = t * local[1];
      b.len[1] = local[1];
      one_piece(logical, local, b);
      s.local_shape = g;
      s.local_shape[0] = g[0] / tp;
      return s;
    }
    case Split::kQkv: {
      const int64_t ng = cfg.groups(), hn = cfg.head_dim(), q = cfg.heads / ng;
      if (g[0] != ng * (q + 2) * hn)
        fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": fused QKV rows=", g[0], " but the model says (query_groups=",
             ng, ") * (heads/groups + 2 = ", q + 2, ") * (head_dim=", hn, ") = ", ng * (q + 2) * hn,
             "; check heads and query_groups in the model file");
      std::vector<int64_t> logical = {ng, q + 2, hn};
      logical.insert(logical.end(), g.begin() + 1, g.end());
      const int lnd = int(logical.size());
      const int64_t inner = prod(std::vector<int64_t>(g.begin() + 1, g.end()));  // H or 1
      std::vector<int64_t> local_rows = g;
      local_rows[0] = g[0] / tp;
      s.logical_shape = logical;
      s.local_shape = local_rows;
      if (tp <= ng) {
        if (ng % tp != 0) fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": query_groups=", ng, " not divisible by tp=", tp);
        const int64_t npg = ng / tp;
        Box b = full_box(logical);
        b.off[0] = t * npg;
        b.len[0] = npg;
        Piece p;
        p.box = b;
        const QkvOrder order = cfg.qkv_layout();
        if (order == QkvOrder::kBlocked && q > 1) {
          // Per rank [Q | K | V]: npg*q query heads (group-major), then npg K heads, then npg V
          // heads, hn rows each. Three pieces: the query slots, the K slot, the V slot.
          const int64_t row = hn * inner;
          Piece qp = p, kp = p, vp = p;
          qp.box.len[1] = q;
          qp.strides = {};
          qp.strides[0] = q * row;
          qp.strides[1] = row;
          qp.strides[2] = inner;
          if (lnd == 4) qp.strides[3] = 1;
          kp.box.off[1] = q;
          kp.box.len[1] = 1;
          kp.strides = {};
          kp.strides[0] = row;
          kp.strides[1] = row;
          kp.strides[2] = inner;
          if (lnd == 4) kp.strides[3] = 1;
          kp.base = npg * q * row;
          vp.box.off[1] = q + 1;
          vp.box.len[1] = 1;
          vp.strides = kp.strides;
          vp.base = npg * (q + 1) * row;
          s.pieces.push_back(qp);
          s.pieces.push_back(kp);
          s.pieces.push_back(vp);
          return s;
        }
        if (order == QkvOrder::kInterleaved) {
          std::vector<int64_t> local = logical;
          local[0] = npg;
          p.strides = rm_of(local);
        } else if (order == QkvOrder::kPerHeadV1) {  // per rank [np, hn, 3, (H)]
          p.strides = {};
          p.strides[0] = hn * 3 * inner;
          p.strides[1] = inner;
          p.strides[2] = 3 * inner;
          if (lnd == 4) p.strides[3] = 1;
        } else {  // blocked, multi-head attention (version 0): per rank [3, np, hn, (H)]
          p.strides = {};
          p.strides[0] = hn * inner;
          p.strides[1] = npg * hn * inner;
          p.strides[2] = inner;
          if (lnd == 4) p.strides[3] = 1;
        }
        s.pieces.push_back(p);
        return s;
      }
      if (cfg.qkv_layout() != QkvOrder::kInterleaved)
        fail(ErrorCode::kUnsupported, "tensor ", spec.name, ": tp=", tp, " > query_groups=", ng, " with QKV rows in the ",
             qkv_order_name(cfg.qkv_layout()), " order (qkv_version ", cfg.qkv_version, ")");
      if (tp % ng != 0) fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": tp=", tp, " is not a multiple of query_groups=", ng);
      switch (cfg.tp_gt_groups) {
        case QkvVariant::kRefuse:
          fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": tp=", tp, " > query_groups=", ng,
               " and the model's tp_gt_groups is refuse; set even_rows or replicate_kv");
        case QkvVariant::kEvenRows: {
          const int64_t total = prod(logical);
          const int64_t per = total / tp;
          Box ext = full_box(logical);
          auto grm = rm_of(logical);
          for (const Box& sub : flat_range_to_boxes(ext, t * per, (t + 1) * per)) {
            Piece p;
            p.box = sub;
            p.strides = grm;
            int64_t at = 0;
            for (int d = 0; d < lnd; ++d) at += sub.off[d] * grm[d];
            p.base = at - t * per;
            s.pieces.push_back(p);
          }
          return s;
        }
        case QkvVariant::kReplicateKv: {
          const int64_t r = tp / ng;  // ranks per group
          if (q % r != 0) fail(ErrorCode::kInvalidArgument, "tensor ", spec.name, ": heads per group=", q, " not divisible by tp/groups=", r);
          const int64_t qq = q / r, grp = t / r, j = t % r;
          std::vector<int64_t> local = logical;
          local[0] = 1;
          local[1] = qq + 2;
          auto lrm = rm_of(local);
          std::vector<int64_t> lr = g;
          lr[0] = (qq + 2) * hn;
          s.local_shape = lr;
          Box bq = full_box(logical);
          bq.off[0] = grp; bq.len[0] = 1;
          bq.off[1] = j * qq; bq.len[1] = qq;
          Piece pq; pq.box = bq; pq.base = 0; pq.strides = lrm;
          Box bkv = bq;
          bkv.off[1] = q; bkv.len[1] = 2;
          Piece pkv; pkv.box = bkv; pkv.base = qq * lrm[1]; pkv.strides = lrm;
          s.pieces.push_back(pq);
          s.pieces.push_back(pkv);
          return s;
        }
      }
    }
  }
  RESHARD_CHECK(false, "unhandled split");
  return s;
}

// ---------------------------------------------------------------------------------------------
// Whole layouts.

namespace {

std::vector<int> stages_of(const TensorSpec& t, const std::vector<int>& stage_of_layer, int pp) {
  switch (t.owner) {
    case Owner::kLayer: return {stage_of_layer.at(t.layer)};
    case Owner::kFirstStage: return {0};
    case Owner::kLastStage: return {pp - 1};
    case Owner::kFirstAndLast: return pp > 1 ? std::vector<int>{0, pp - 1} : std::vector<int>{0};
  }
  return {0};
}

}  // namespace

std::vector<int> checked_stage_of_layer(const ModelConfig& cfg, const Topology& topo, const std::vector<int>& given) {
  // A given split (the trainer's or the user's) may be uneven; reshard's own split is not.
  cfg.validate_for(topo.tp, topo.pp, topo.vpp, /*even_stages=*/given.empty());
  if (given.empty()) return uniform_stage_of_layer(cfg.num_layers, topo.pp, topo.vpp);
  if (int(given.size()) != cfg.num_layers)
    fail(ErrorCode::kInvalidArgument, "stage_of_layer has ", given.size(), " entries for ", cfg.num_layers, " layers");
  for (int l = 0; l < cfg.num_layers; ++l)
    if (given[size_t(l)] < 0 || given[size_t(l)] >= topo.pp)
      fail(ErrorCode::kInvalidArgument, "stage_of_layer puts layer ", l, " on stage ", given[size_t(l)], ", not in [0, pp=",
           topo.pp, ")");
  // With virtual stages a stage holds several chunks of layers in schedule order, which a stage
  // per layer does not describe; only reshard's own interleaved split is planned then.
  if (topo.vpp > 1 && (topo.pp * topo.vpp > cfg.num_layers || cfg.num_layers % (topo.pp * topo.vpp) != 0 ||
                       given != uniform_stage_of_layer(cfg.num_layers, topo.pp, topo.vpp)))
    fail(ErrorCode::kInvalidArgument, "stage_of_layer differs from the interleaved split of ", cfg.num_layers,
         " layers over pp=", topo.pp, ",vpp=", topo.vpp, ": uneven stages are supported with vpp=1 only");
  return given;
}

LayoutRecipe default_recipe(const ModelConfig& cfg, const Topology& topo, const DeriveOptions& opt) {
  topo.validate();
  const std::vector<int> stage_of_layer = checked_stage_of_layer(cfg, topo, opt.stage_of_layer);
  LayoutRecipe r;
  r.tensors = model_tensors(cfg, topo.tp);
  for (const auto& t : r.tensors) r.stages.push_back(stages_of(t, stage_of_layer, topo.pp));
  return r;
}

std::vector<int> stage_of_layer_in(const Layout& L) {
  const int layers = L.model.num_layers;
  if (layers <= 0) return {};
  std::vector<int> stage(size_t(layers), -1);
  std::unordered_map<std::string, const TensorSpec*> spec;
  for (const TensorSpec& t : L.tensors) spec[t.name] = &t;
  for (const Piece& pc : L.pieces) {
    const LogicalArray& a = L.arrays[size_t(pc.array)];
    if (a.state != StateKind::kWeight) continue;
    auto it = spec.find(a.tensor);
    if (it == spec.end() || it->second->owner != Owner::kLayer) continue;
    const int l = it->second->layer;
    if (l < 0 || l >= layers) return {};
    const int s = L.topo.pp_rank(L.buffers[size_t(pc.buffer)].rank);
    if (stage[size_t(l)] >= 0 && stage[size_t(l)] != s) return {};
    stage[size_t(l)] = s;
  }
  for (int s : stage)
    if (s < 0) return {};
  return stage;
}

Layout derive_layout(const ModelConfig& cfg, const Topology& topo, const DeriveOptions& opt) {
  return build_layout(cfg, topo, default_recipe(cfg, topo, opt), opt);
}

Layout build_layout(const ModelConfig& cfg, const Topology& topo, const LayoutRecipe& recipe, const DeriveOptions& opt) {
  topo.validate();
  Layout L;
  L.topo = topo;
  L.model = cfg;
  L.tensors = recipe.tensors;
  if (recipe.stages.size() != L.tensors.size())
    fail(ErrorCode::kInvalidArgument, "layout recipe has ", recipe.stages.size(), " stage lists for ", L.tensors.size(), " tensors");

  const int nstates = opt.optimizer ? kNumStateKinds : 1;
  // arrays[t * nstates + s]
  std::vector<std::vector<TpShard>> shards(L.tensors.size());
  std::unordered_map<std::string, size_t> tensor_index;
  for (size_t i = 0; i < L.tensors.size(); ++i) {
    const auto& spec = L.tensors[i];
    tensor_index[spec.name] = i;
    for (int t = 0; t < topo.tp; ++t) shards[i].push_back(tp_shard(spec, cfg, topo.tp, t));
    for (int s = 0; s < nstates; ++s) {
      LogicalArray a;
      a.tensor = spec.name;
      a.state = StateKind(s);
      a.ndim = int(shards[i][0].logical_shape.size());
      for (int d = 0; d < a.ndim; ++d) a.shape[d] = shards[i][0].logical_shape[d];
      a.real_rows = spec.real_rows;
      a.reduction = spec.reduction;
      L.arrays.push_back(a);
    }
  }
  auto array_of = [&](size_t tensor, StateKind s) { return int32_t(tensor * nstates + int(s)); };

  // Tensors per stage, in parameter order.
  std::vector<std::vector<size_t>> stage_tensors(topo.pp);
  for (size_t i = 0; i < L.tensors.size(); ++i)
    for (int p : recipe.stages[i]) {
      if (p < 0 || p >= topo.pp) fail(ErrorCode::kInvalidArgument, "tensor ", L.tensors[i].name, " is placed on stage ", p, " but pp=", topo.pp);
      stage_tensors[p].push_back(i);
    }

  L.flat_groups.assign(size_t(topo.pp) * topo.tp, {});
  const StateKind opt_states[] = {StateKind::kMaster, StateKind::kExpAvg, StateKind::kExpAvgSq};
  const int dp = topo.dp;

  for (int p = 0; p < topo.pp; ++p) {
    for (int t = 0; t < topo.tp; ++t) {
      std::vector<FlatGroup> groups;
      std::vector<std::vector<size_t>> group_tensors;
      const size_t slot = size_t(p) * topo.tp + t;
      if (slot < recipe.groups.size() && !recipe.groups[slot].empty()) {
        groups = recipe.groups[slot];
        for (size_t g = 0; g < groups.size(); ++g) {
          group_tensors.emplace_back();
          int64_t end = 0;
          for (const auto& e : groups[g].entries) {
            auto it = tensor_index.find(e.tensor);
            if (it == tensor_index.end())
              fail(ErrorCode::kInvalidArgument, "param group ", g, " of (pp ", p, ", tp ", t, ") names tensor ", e.tensor, " that the layout does not have");
            int64_t n = prod(shards[it->second][t].local_shape);
            if (n != e.numel)
              fail(ErrorCode::kInvalidArgument, "param group ", g, " of (pp ", p, ", tp ", t, "): tensor ", e.tensor, " has ", e.numel,
                   " elements in the group but its tp shard has ", n);
            group_tensors[g].push_back(it->second);
            if (topo.zero == 3) end = std::max(end, e.offset + (e.numel + dp - 1) / dp);
            else end = std::max(end, e.offset + e.numel);
          }
          if (topo.zero >= 1 && topo.zero <= 2 && groups[g].partition_size * dp < end)
            fail(ErrorCode::kInvalidArgument, "param group ", g, " of (pp ", p, ", tp ", t, "): partition size ", groups[g].partition_size,
                 " x dp ", dp, " < ", end, " elements");
          if (topo.zero == 3 && groups[g].partition_size < end)
            fail(ErrorCode::kInvalidArgument, "param group ", g, " of (pp ", p, ", tp ", t, "): partition size ", groups[g].partition_size,
                 " < ", end, " elements");
        }
      } else {
        // Param groups: Megatron's [weight decay, no weight decay], in parameter order.
        groups.resize(2);
        groups[1].no_weight_decay = true;
        group_tensors.resize(2);
        for (size_t i : stage_tensors[p]) {
          int g = L.tensors[i].no_weight_decay ? 1 : 0;
          int64_t n = prod(shards[i][t].local_shape);
          groups[g].entries.push_back({L.tensors[i].name, groups[g].numel, n});
          groups[g].numel += n;
          group_tensors[g].push_back(i);
        }
        if (topo.zero == 3) {  // per-parameter partitions: offsets in the per-rank buffer
          for (auto& grp : groups) {
            int64_t at = 0;
            for (auto& e : grp.entries) {
              int64_t part = (e.numel + dp - 1) / dp;
              e.offset = at;
              at += part;
            }
            grp.partition_size = at;
          }
        } else if (topo.zero >= 1) {
          for (auto& grp : groups) {
            int64_t align = int64_t(opt.align_factor) * dp;
            int64_t padded = (grp.numel + align - 1) / align * align;
            grp.partition_size = padded / dp;
          }
        }
      }
      if (topo.zero >= 1) L.flat_groups[slot] = groups;
      const size_t slot_first_piece = L.pieces.size(), slot_first_buffer = L.buffers.size();

      for (int d = 0; d < dp; ++d) {
        // When the vector must grow: room for this slot's other dp ranks and the later slots,
        // each as many pieces as this slot's first dp rank added. Growing by doubling copied and
        // faulted in about twice the final size (hundreds of MB for a 16,384-rank target).
        if (d == 1) {
          const size_t slots_after = size_t(topo.pp) * size_t(topo.tp) - slot - 1;
          auto grow = [&](auto& v, size_t first) {
            const size_t per_rank = v.size() - first;
            const size_t more = per_rank * size_t(dp - 1);
            if (v.capacity() >= v.size() + more) return;
            const size_t later = per_rank * size_t(dp) * slots_after;
            v.reserve(v.size() + more + later + (more + later) / 16);
          };
          grow(L.pieces, slot_first_piece);
          grow(L.buffers, slot_first_buffer);
        }
        const int rank = topo.rank_of(p, d, t);
        const bool replica_ok = !opt.weights_on_dp0_only || d == 0;
        // 16-bit weights.
        for (size_t i : stage_tensors[p]) {
          const TpShard& sh = shards[i][t];
          int64_t n = prod(sh.local_shape);
          if (topo.zero == 3) {  // partitioned like the optimizer state
            int64_t part = (n + dp - 1) / dp;
            Buffer b{"weight/" + L.tensors[i].name, rank, cfg.param_dtype, part, StateKind::kWeight, -1};
            L.buffers.push_back(b);
            int64_t lo = std::min(n, d * part), hi = std::min(n, (d + 1) * part);
            append_flat_range_pieces(sh, lo, hi, array_of(i, StateKind::kWeight), int32_t(L.buffers.size() - 1), 0, &L.pieces);
            continue;
          }
          if (!replica_ok) continue;
          L.buffers.push_back({"weight/" + L.tensors[i].name, rank, cfg.param_dtype, n, StateKind::kWeight, -1});
          for (Piece pc : sh.pieces) {
            pc.array = array_of(i, StateKind::kWeight);
            pc.buffer = int32_t(L.buffers.size() - 1);
            L.pieces.push_back(pc);
          }
        }
        if (!opt.optimizer) continue;
        for (StateKind st : opt_states) {
          if (topo.zero == 0) {
            if (!replica_ok) continue;
            for (size_t i : stage_tensors[p]) {
              const TpShard& sh = shards[i][t];
              L.buffers.push_back({std::string(state_kind_name(st)) + "/" + L.tensors[i].name, rank, DType::F32,
                                   prod(sh.local_shape), st, -1});
              for (Piece pc : sh.pieces) {
                pc.array = array_of(i, st);
                pc.buffer = int32_t(L.buffers.size() - 1);
                L.pieces.push_back(pc);
              }
            }
            continue;
          }
          for (size_t g = 0; g < groups.size(); ++g) {
            const FlatGroup& grp = groups[g];
            L.buffers.push_back({std::string(state_kind_name(st)) + "/group" + std::to_string(g), rank, DType::F32,
                                 grp.partition_size, st, int(g)});
            const int32_t buf = int32_t(L.buffers.size() - 1);
            for (size_t k = 0; k < grp.entries.size(); ++k) {
              size_t i = group_tensors[g][k];
              const auto& e = grp.entries[k];
              if (topo.zero == 3) {
                int64_t part = (e.numel + dp - 1) / dp;
                int64_t lo = std::min(e.numel, d * part), hi = std::min(e.numel, (d + 1) * part);
                append_flat_range_pieces(shards[i][t], lo, hi, array_of(i, st), buf, e.offset, &L.pieces);
              } else {
                const int64_t P = grp.partition_size;
                int64_t lo = std::max(e.offset, d * P), hi = std::min(e.offset + e.numel, (d + 1) * P);
                if (lo >= hi) continue;
                append_flat_range_pieces(shards[i][t], lo - e.offset, hi - e.offset, array_of(i, st), buf,
                                         lo - d * P, &L.pieces);
              }
            }
          }
        }
      }
    }
  }
  return L;
}

std::string overlapping_buffers(const Layout& L, int rank, const std::vector<const void*>& memory) {
  std::vector<std::pair<uintptr_t, size_t>> at;  // (first byte, buffer)
  for (size_t b = 0; b < L.buffers.size() && b < memory.size(); ++b)
    if (L.buffers[b].rank == rank && L.buffers[b].numel > 0 && memory[b])
      at.push_back({reinterpret_cast<uintptr_t>(memory[b]), b});
  std::sort(at.begin(), at.end());
  for (size_t i = 1; i < at.size(); ++i) {
    const Buffer& prev = L.buffers[at[i - 1].second];
    const uintptr_t prev_end = at[i - 1].first + uintptr_t(prev.numel) * dtype_size(prev.dtype);
    if (at[i].first < prev_end)
      return "buffers " + prev.name + " and " + L.buffers[at[i].second].name + " overlap in memory (" +
             std::to_string(prev_end - at[i].first) + " bytes)";
  }
  return {};
}

}  // namespace reshard

namespace reshard {

Layout explicit_layout(const std::string& name, const Topology& topo, const std::vector<ExplicitArray>& arrays,
                       const std::vector<ExplicitBuffer>& buffers) {
  topo.validate();
  if (topo.tp != 1 || topo.pp != 1 || topo.vpp != 1)
    fail(ErrorCode::kInvalidArgument, name, ": a layout given box by box counts ranks only (dp); got ", topo.to_string());
  Layout L;
  L.topo = topo;
  L.model.name = name;
  L.explicit_boxes = true;
  std::set<std::pair<std::string, int>> seen;
  std::unordered_map<std::string, size_t> spec_of;  // tensor name -> index into L.tensors
  for (const ExplicitArray& a : arrays) {
    const std::string what = name + ": tensor " + a.tensor + " (" + state_kind_name(a.state) + ")";
    if (a.shape.empty() || a.shape.size() > size_t(kMaxDims))
      fail(ErrorCode::kInvalidArgument, what, " has ", a.shape.size(), " dims; 1..", kMaxDims, " are supported");
    if (!seen.insert({a.tensor, int(a.state)}).second) fail(ErrorCode::kInvalidArgument, what, " is listed twice");
    int64_t n = 1;
    for (int64_t d : a.shape) {
      if (d < 0 || d > kMaxModelParameters)
        fail(ErrorCode::kInvalidArgument, what, ": dim ", d, " outside [0, 2^44]");
      n = d == 0 ? 0 : n;
      if (n > 0 && d > 0 && n > kMaxModelParameters / d)
        fail(ErrorCode::kInvalidArgument, what, ": more than 2^44 elements");
      n *= d;
    }
    LogicalArray la;
    la.tensor = a.tensor;
    la.state = a.state;
    la.ndim = int(a.shape.size());
    for (int d = 0; d < la.ndim; ++d) la.shape[d] = a.shape[size_t(d)];
    L.arrays.push_back(la);
    auto [it, fresh] = spec_of.emplace(a.tensor, L.tensors.size());
    if (fresh) {
      TensorSpec t;
      t.name = a.tensor;
      t.shape = a.shape;
      L.tensors.push_back(t);
    } else if (L.tensors[it->second].shape != a.shape) {
      fail(ErrorCode::kInvalidArgument, what, " has another shape than the tensor's other states");
    }
  }
  std::set<std::pair<int, std::string>> names;
  for (const ExplicitBuffer& b : buffers) {
    const std::string what = name + ": buffer " + b.name + " of rank " + std::to_string(b.rank);
    if (b.array < 0 || size_t(b.array) >= L.arrays.size())
      fail(ErrorCode::kInvalidArgument, what, " names tensor index ", b.array, " of ", L.arrays.size());
    if (b.rank < 0 || b.rank >= topo.world_size())
      fail(ErrorCode::kInvalidArgument, what, ": rank outside [0, ", topo.world_size(), ")");
    if (!names.insert({b.rank, b.name}).second) fail(ErrorCode::kInvalidArgument, what, " is listed twice");
    const LogicalArray& a = L.arrays[size_t(b.array)];
    if (int(b.offsets.size()) != a.ndim || int(b.sizes.size()) != a.ndim)
      fail(ErrorCode::kInvalidArgument, what, ": a box of ", b.offsets.size(), " offsets and ", b.sizes.size(),
           " sizes for ", a.tensor, " of ", a.ndim, " dims");
    Piece p;
    p.array = b.array;
    p.buffer = int32_t(L.buffers.size());
    p.box.ndim = a.ndim;
    for (int d = 0; d < a.ndim; ++d) {
      const int64_t o = b.offsets[size_t(d)], n = b.sizes[size_t(d)];
      if (o < 0 || n < 0 || o > a.shape[d] || n > a.shape[d] - o)
        fail(ErrorCode::kInvalidArgument, what, ": dim ", d, " [", o, ", ", o, " + ", n, ") outside ", a.tensor,
             "'s ", a.shape[d]);
      p.box.off[d] = o;
      p.box.len[d] = n;
    }
    int64_t stride = 1;
    for (int d = a.ndim - 1; d >= 0; --d) {
      p.strides[d] = stride;
      stride *= p.box.len[d];
    }
    Buffer buf;
    buf.name = b.name;
    buf.rank = b.rank;
    buf.dtype = b.dtype;
    buf.numel = p.box.numel();
    buf.state = a.state;
    L.buffers.push_back(buf);
    if (buf.numel > 0) L.pieces.push_back(p);
  }
  return L;
}

}  // namespace reshard
