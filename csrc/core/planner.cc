// The planner. See include/reshard/plan.h for the contract and DESIGN.md for the reasoning.
//
// Outline:
//  1. match target arrays to source arrays by (tensor, state kind); shapes must agree except the
//     rows of vocab tensors (padding differs with tp);
//  2. per source array, pick the authoritative copy of every element (pieces ordered by the
//     source rank's (pp, tp, dp) coordinates) and turn the other copies into replica comparisons;
//  3. intersect every target piece with the authoritative pieces through a per-array index
//     (sorted by dim-0 offset with a prefix maximum of dim-0 ends: no all-pairs scan);
//  4. dedup: identical needs of one source piece become one fragment with several deliveries,
//     overlapping needs are cut on a grid so that every source element is read once;
//  5. cut fragments to fit the memory budget, choose readers (a receiver, least-loaded first),
//     and pack fragments into global waves first-fit.
#include <algorithm>
#include <functional>
#include <map>
#include <numeric>
#include <queue>
#include <set>
#include <sstream>
#include <tuple>
#include <unordered_map>

#include "reshard/error.h"
#include "reshard/plan.h"

namespace reshard {

const char* replica_policy_name(ReplicaPolicy p) {
  switch (p) {
    case ReplicaPolicy::kError: return "error";
    case ReplicaPolicy::kAverage: return "average";
    case ReplicaPolicy::kFirst: return "first";
  }
  return "?";
}

ReplicaPolicy replica_policy_from_name(const std::string& s) {
  if (s == "error") return ReplicaPolicy::kError;
  if (s == "average") return ReplicaPolicy::kAverage;
  if (s == "first") return ReplicaPolicy::kFirst;
  fail(ErrorCode::kInvalidArgument, "unknown replica policy '", s, "' (expected error, average or first)");
}

std::vector<Box> box_subtract(const Box& a, const Box& b) {
  Box x = intersect(a, b);
  if (x.empty()) return {a};
  std::vector<Box> out;
  Box rest = a;  // shrinks dim by dim
  for (int d = 0; d < a.ndim; ++d) {
    if (x.off[d] > rest.off[d]) {
      Box lo = rest;
      lo.len[d] = x.off[d] - rest.off[d];
      out.push_back(lo);
    }
    int64_t xend = x.off[d] + x.len[d], rend = rest.off[d] + rest.len[d];
    if (xend < rend) {
      Box hi = rest;
      hi.off[d] = xend;
      hi.len[d] = rend - xend;
      out.push_back(hi);
    }
    rest.off[d] = x.off[d];
    rest.len[d] = x.len[d];
  }
  return out;
}

namespace {

struct SrcPiece {
  Box box;
  int32_t file = -1;
  uint64_t byte_base = 0;
  std::array<int64_t, kMaxDims> strides{};
  DType dtype = DType::F32;
  int32_t order = 0;  // position in the authoritative order (smaller wins)
  int32_t rank = 0;   // source rank whose buffer holds it
};

// Static interval index on dim 0: pieces sorted by off[0], prefix max of end[0].
struct BoxIndex {
  std::vector<int32_t> ids;       // into the piece vector, sorted by off0
  std::vector<int64_t> off0;
  std::vector<int64_t> max_end0;  // prefix max

  template <typename GetBox>
  void build(size_t n, GetBox get) {
    ids.resize(n);
    std::iota(ids.begin(), ids.end(), 0);
    std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) {
      const Box &x = get(a), &y = get(b);
      return x.ndim ? x.off[0] < y.off[0] : false;
    });
    off0.resize(n);
    max_end0.resize(n);
    int64_t m = INT64_MIN;
    for (size_t i = 0; i < n; ++i) {
      const Box& b = get(ids[i]);
      off0[i] = b.ndim ? b.off[0] : 0;
      m = std::max(m, b.ndim ? b.off[0] + b.len[0] : 1);
      max_end0[i] = m;
    }
  }
  template <typename GetBox, typename Fn>
  void query(const Box& q, GetBox get, Fn fn) const {
    if (ids.empty()) return;
    int64_t qlo = q.ndim ? q.off[0] : 0, qhi = q.ndim ? q.off[0] + q.len[0] : 1;
    size_t first = size_t(std::upper_bound(max_end0.begin(), max_end0.end(), qlo) - max_end0.begin());
    size_t last = size_t(std::lower_bound(off0.begin(), off0.end(), qhi) - off0.begin());
    for (size_t i = first; i < last; ++i) {
      const Box& b = get(ids[i]);
      Box x = intersect(b, q);
      if (!x.empty()) fn(ids[i], x);
    }
  }
};

uint64_t sub_byte_base(const SrcPiece& p, const Box& sub) {
  int64_t rel = 0;
  for (int d = 0; d < sub.ndim; ++d) rel += (sub.off[d] - p.box.off[d]) * p.strides[d];
  return p.byte_base + uint64_t(rel) * dtype_size(p.dtype);
}

int64_t sub_base(int64_t base, const Box& whole, const std::array<int64_t, kMaxDims>& strides, const Box& sub) {
  int64_t rel = 0;
  for (int d = 0; d < sub.ndim; ++d) rel += (sub.off[d] - whole.off[d]) * strides[d];
  return base + rel;
}

struct Need {
  int32_t src;  // authoritative source piece id (per array, global id below)
  Box box;
  Delivery dst;
};

uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

bool shapes_compatible(const LogicalArray& s, const LogicalArray& t) {
  if (s.ndim != t.ndim) return false;
  // Vocab tensors: the real rows (the model's vocab) must agree, even where the padded shapes do;
  // otherwise padding rows would load as vocab rows, or vocab rows be dropped as padding.
  if (s.real_rows >= 0 && t.real_rows >= 0 && s.real_rows != t.real_rows) return false;
  for (int d = 0; d < s.ndim; ++d) {
    if (s.shape[d] == t.shape[d]) continue;
    if (d == 0 && s.real_rows >= 0 && s.real_rows == t.real_rows) continue;  // vocab padding rows
    return false;
  }
  return true;
}

std::string shape_str(const LogicalArray& a) {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < a.ndim; ++d) os << (d ? ", " : "") << a.shape[d];
  os << "]";
  return os.str();
}

// Source arrays prepared for lookup.
struct SourceIndex {
  std::vector<std::vector<SrcPiece>> auth;  // per source array: authoritative sub-pieces
  std::vector<BoxIndex> index;
  std::vector<std::vector<SrcPiece>> copies;  // per source array: every available piece
  std::vector<BoxIndex> copies_index;
  std::vector<ReplicaCompare> compares;
};

SourceIndex index_source(const SourceLayout& src, bool want_compares) {
  const Layout& L = src.layout;
  SourceIndex out;
  const size_t na = L.arrays.size();
  out.auth.resize(na);
  out.index.resize(na);
  out.copies.resize(na);
  out.copies_index.resize(na);
  std::vector<std::vector<SrcPiece>> all(na);
  for (const Piece& p : L.pieces) {
    const BufferLocation& loc = src.locations.at(p.buffer);
    if (loc.file < 0) continue;  // file missing: this piece covers nothing
    const Buffer& b = L.buffers[p.buffer];
    SrcPiece s;
    s.box = p.box;
    s.file = loc.file;
    s.byte_base = loc.byte_offset + uint64_t(p.base) * dtype_size(b.dtype);
    s.strides = p.strides;
    s.dtype = b.dtype;
    const Topology& T = L.topo;
    s.order = (T.pp_rank(b.rank) * T.tp + T.tp_rank(b.rank)) * T.dp + T.dp_rank(b.rank);
    s.rank = b.rank;
    all[p.array].push_back(s);
  }
  for (size_t a = 0; a < na; ++a) {
    auto& v = all[a];
    std::stable_sort(v.begin(), v.end(), [](const SrcPiece& x, const SrcPiece& y) {
      if (x.order != y.order) return x.order < y.order;
      return x.byte_base < y.byte_base;
    });
    BoxIndex idx;
    idx.build(v.size(), [&](int32_t i) -> const Box& { return v[i].box; });
    std::vector<SrcPiece> replicas;
    for (size_t i = 0; i < v.size(); ++i) {
      // Earlier pieces overlapping this one.
      std::vector<Box> rest = {v[i].box};
      idx.query(v[i].box, [&](int32_t j) -> const Box& { return v[j].box; }, [&](int32_t j, const Box&) {
        if (size_t(j) >= i) return;
        std::vector<Box> next;
        for (const Box& r : rest)
          for (const Box& q : box_subtract(r, v[j].box)) next.push_back(q);
        rest.swap(next);
      });
      int64_t kept = 0;
      for (const Box& r : rest) {
        SrcPiece s = v[i];
        s.box = r;
        s.byte_base = sub_byte_base(v[i], r);
        out.auth[a].push_back(s);
        kept += r.numel();
      }
      if (kept < v[i].box.numel()) replicas.push_back(v[i]);
    }
    auto& au = out.auth[a];
    out.index[a].build(au.size(), [&](int32_t i) -> const Box& { return au[i].box; });
    out.copies_index[a] = idx;
    out.copies[a] = v;
    if (!want_compares) continue;
    for (const SrcPiece& r : replicas) {
      out.index[a].query(r.box, [&](int32_t j) -> const Box& { return au[j].box; }, [&](int32_t j, const Box& x) {
        if (au[j].order == r.order) return;  // the replica's own authoritative part
        ReplicaCompare c;
        c.array = -1;
        c.tensor = L.arrays[a].tensor;
        c.state = L.arrays[a].state;
        c.box = x;
        c.authoritative = {au[j].file, sub_byte_base(au[j], x), au[j].strides, au[j].dtype};
        c.replica = {r.file, sub_byte_base(r, x), r.strides, r.dtype};
        out.compares.push_back(c);
      });
    }
  }
  return out;
}

}  // namespace

uint64_t Plan::hash() const {
  uint64_t h = 1469598103934665603ull;
  h = mix(h, fragments.size());
  for (const auto& f : fragments) {
    h = mix(h, uint64_t(f.array));
    for (int d = 0; d < f.box.ndim; ++d) h = mix(mix(h, uint64_t(f.box.off[d])), uint64_t(f.box.len[d]));
    h = mix(h, uint64_t(f.file));
    h = mix(h, f.byte_base);
    h = mix(h, uint64_t(f.reader));
    h = mix(h, uint64_t(f.wave));
    h = mix(h, uint64_t(f.reread_on_node));
    for (uint32_t k = 0; k < f.num_deliveries; ++k) {
      const auto& d = deliveries[f.first_delivery + k];
      h = mix(mix(mix(h, uint64_t(d.rank)), uint64_t(d.buffer)), uint64_t(d.base));
    }
  }
  for (const auto& b : budget_splits) h = mix(mix(mix(mix(h, uint64_t(b.file)), b.byte_base), b.bytes), uint64_t(b.checker));
  h = mix(h, fills.size());
  h = mix(h, replica_compares.size());
  h = mix(h, replica_sources.size());
  for (const auto& r : replica_sources) h = mix(mix(h, uint64_t(r.file)), r.byte_base);
  return h;
}

// A load that re-cuts fused QKV rows (a tp change, or source and target in different row orders)
// must know the order on both sides: a wrong guess gives wrong values that every check passes.
// A side whose reader could not tell (ModelConfig::qkv_order "unknown") is refused here, naming
// the key that settles it; at the same tp and order the rows are copied as saved.
static void check_qkv_order_known(const Layout& S, const Layout& T, const std::vector<int>& src_of) {
  if (S.model.qkv_order_known() && T.model.qkv_order_known()) return;
  const bool recut = S.topo.tp != T.topo.tp || S.model.qkv_layout() != T.model.qkv_layout();
  if (!recut) return;
  std::unordered_map<std::string, Split> split;
  for (const TensorSpec& t : T.tensors) split[t.name] = t.split;
  for (size_t i = 0; i < T.arrays.size(); ++i) {
    if (src_of[i] < 0) continue;
    auto it = split.find(T.arrays[i].tensor);
    if (it == split.end() || it->second != Split::kQkv) continue;
    const char* side = S.model.qkv_order_known() ? "target model" : "checkpoint";
    fail(ErrorCode::kInvalidArgument, "tensor ", T.arrays[i].tensor, ": the fused QKV row order of the ", side,
         " is not known (its writer recorded nothing that settles it; checkpoint_version alone does not: "
         "Megatron-DeepSpeed writes [Q | K | V] blocks under version 3.0 since 2024-12), and this load re-cuts "
         "those rows (tp ", S.topo.tp, "->", T.topo.tp, ", order ", qkv_order_name(S.model.qkv_layout()), "->",
         qkv_order_name(T.model.qkv_layout()), "); state it with qkv_order: interleaved | blocked in the ",
         "model file (interleaved: [groups, heads/groups + 2, head_dim] rows per tp rank, as Megatron-LM and "
         "Megatron-DeepSpeed before 2024-12; blocked: [Q | K | V] per tp rank)");
  }
}


// The vocab_divisible_by that makes Megatron's padding of `vocab` at tp `tp` come to `rows`
// (ceil(vocab / (d * tp)) * d * tp == rows): the largest power of two that does, else the
// smallest divisor that does; 0 when none does.
int64_t divisor_for_rows(int64_t vocab, int64_t rows, int tp) {
  if (vocab <= 0 || rows < vocab || tp <= 0 || rows % tp != 0) return 0;
  auto works = [&](int64_t d) { const int64_t m = d * tp; return rows % m == 0 && rows - m < vocab; };
  int64_t best = 0;
  for (int64_t d = 1; d * tp <= rows; d *= 2)
    if (works(d)) best = d;
  if (best) return best;
  for (int64_t d = 1; d * tp <= rows; ++d)
    if (works(d)) return d;
  return 0;
}

namespace {

// "" when every vocab array keeps its padded row count; else one sentence naming the tensors,
// the rows dropped or added, and the divisor that keeps the source's rows.
std::string vocab_padding_change(const Layout& S, const Layout& target, const std::vector<int>& src_of) {
  std::map<std::string, std::pair<int64_t, int64_t>> rows;  // tensor -> (source rows, target rows)
  int64_t real = -1;
  for (size_t i = 0; i < target.arrays.size(); ++i) {
    if (src_of[i] < 0) continue;
    const auto& s = S.arrays[src_of[i]];
    const auto& t = target.arrays[i];
    if (s.real_rows < 0 || t.real_rows < 0 || s.shape[0] == t.shape[0]) continue;
    rows[t.tensor] = {s.shape[0], t.shape[0]};
    real = t.real_rows;
  }
  if (rows.empty()) return "";
  std::string names;
  for (const auto& [n, r] : rows) names += (names.empty() ? "" : ", ") + n;
  const auto [src_rows, dst_rows] = rows.begin()->second;
  const int tp = target.topo.tp;
  std::ostringstream os;
  os << "vocab padding: the source pads vocab " << real << " to " << src_rows << " rows, the target to " << dst_rows
     << " (vocab_divisible_by " << target.model.vocab_divisible_by << " x tp " << tp << "): ";
  if (dst_rows < src_rows)
    os << src_rows - dst_rows << " trained padding row(s) of " << names << " dropped (every state kind; real rows kept)";
  else
    os << dst_rows - src_rows << " padding row(s) of " << names << " added as zeros";
  os << ". A trainer whose loss normalises over every padded row (Megatron's vocab-parallel cross entropy) computes "
        "another loss from the same weights; ";
  if (const int64_t d = divisor_for_rows(real, src_rows, tp))
    os << "vocab_divisible_by " << d << " (--make-vocab-size-divisible-by " << d << ") at tp " << tp << " keeps the "
       << src_rows << " rows";
  else
    os << "no vocab_divisible_by gives " << src_rows << " rows at tp " << tp;
  return os.str();
}

}  // namespace

Plan make_plan(const SourceLayout& source, const Layout& target, const PlanOptions& opt) {
  if (!(opt.replica_atol >= 0))
    fail(ErrorCode::kInvalidArgument, "replica tolerance (replica_atol) ", opt.replica_atol, " must be >= 0");
  if (opt.memory_budget < kMinMemoryBudget)
    fail(ErrorCode::kInvalidArgument, "memory budget ", opt.memory_budget, " bytes is below the minimum of ",
         kMinMemoryBudget, " bytes (64 KiB); a wave must hold at least one chunk of a piece");
  const Layout& S = source.layout;
  if (source.locations.size() != S.buffers.size())
    fail(ErrorCode::kInternal, "source layout has ", S.buffers.size(), " buffers but ", source.locations.size(), " locations");
  Plan plan;
  plan.source_topo = S.topo;
  plan.target_topo = target.topo;
  plan.change = describe_change(S.topo, target.topo);
  // Layouts given box by box (DCP chunks, a live module's DTensor shards) are not described by
  // their topologies: two with one world size may cut every tensor differently.
  if (S.explicit_boxes || target.explicit_boxes)
    plan.change = "tensors re-cut box by box (" + std::to_string(S.topo.world_size()) + " -> " +
                  std::to_string(target.topo.world_size()) + " ranks)";
  plan.world_size = target.topo.world_size();
  const int W = plan.world_size;

  // 1. Match arrays.
  std::unordered_map<std::string, int> src_by_key;
  for (size_t i = 0; i < S.arrays.size(); ++i) src_by_key[S.arrays[i].key()] = int(i);
  std::vector<int> src_of(target.arrays.size(), -1);
  std::vector<std::string> missing, mismatched;
  std::vector<bool> src_used(S.arrays.size(), false);
  int from_master = 0;
  // The dtype each array is stored in (its first piece's buffer): integer and float values do
  // not convert, and finding that while copying would leave live tensors partly written.
  auto array_dtypes = [](const Layout& L) {
    std::vector<int> dt(L.arrays.size(), -1);
    for (const Piece& pc : L.pieces)
      if (dt[size_t(pc.array)] < 0) dt[size_t(pc.array)] = int(L.buffers[size_t(pc.buffer)].dtype);
    return dt;
  };
  const std::vector<int> src_dt = array_dtypes(S), tgt_dt = array_dtypes(target);
  std::vector<std::string> kind_mismatch;
  for (size_t i = 0; i < target.arrays.size(); ++i) {
    const auto& ta = target.arrays[i];
    auto it = src_by_key.find(ta.key());
    bool has_pieces = false;
    if (it != src_by_key.end()) has_pieces = true;
    if (it == src_by_key.end() && ta.state == StateKind::kWeight && opt.weights_from_master) {
      auto m = src_by_key.find(ta.tensor + "/fp32");
      if (m != src_by_key.end()) {
        it = m;
        has_pieces = true;
        ++from_master;
      }
    }
    if (!has_pieces) {
      missing.push_back(ta.key());
      continue;
    }
    const auto& sa = S.arrays[it->second];
    if ((sa.reduction == Reduction::kPartialSum || ta.reduction == Reduction::kPartialSum) &&
        S.topo.tp != target.topo.tp)
      fail(ErrorCode::kUnsupported, "tensor ", ta.tensor, " is declared partial_sum (each tp rank holds a partial value); "
           "merging by sum and splitting by division across a tp change (", S.topo.tp, "->", target.topo.tp,
           ") is not implemented, and copying it as a replica would be wrong");
    if (!shapes_compatible(sa, ta)) {
      std::string what = "tensor " + ta.tensor + " (" + state_kind_name(ta.state) + "): checkpoint shape " +
                         shape_str(sa) + " vs model shape " + shape_str(ta);
      if (sa.real_rows >= 0 && ta.real_rows >= 0 && sa.real_rows != ta.real_rows)
        what += " (vocab: " + std::to_string(sa.real_rows) + " real rows in the checkpoint, " +
                std::to_string(ta.real_rows) + " in the model)";
      mismatched.push_back(what);
      continue;
    }
    const int sd = src_dt[size_t(it->second)], td = tgt_dt[i];
    if (sd >= 0 && td >= 0 && dtype_is_float(DType(sd)) != dtype_is_float(DType(td)))
      kind_mismatch.push_back("tensor " + ta.tensor + " (" + state_kind_name(ta.state) + "): checkpoint " +
                              dtype_name(DType(sd)) + " vs model " + dtype_name(DType(td)));
    src_of[i] = it->second;
    src_used[it->second] = true;
  }
  if (!kind_mismatch.empty()) {
    std::string msg = std::to_string(kind_mismatch.size()) +
                      " tensor state(s) are integers on one side and floats on the other, which do not convert: ";
    for (size_t i = 0; i < kind_mismatch.size() && i < 8; ++i) msg += (i ? "; " : "") + kind_mismatch[i];
    fail(ErrorCode::kInvalidArgument, msg);
  }
  check_qkv_order_known(S, target, src_of);
  if (!mismatched.empty()) {
    std::string msg = "model and checkpoint disagree on " + std::to_string(mismatched.size()) + " tensor shape(s): ";
    for (size_t i = 0; i < mismatched.size() && i < 8; ++i) msg += (i ? "; " : "") + mismatched[i];
    fail(ErrorCode::kInvalidArgument, msg);
  }
  if (!missing.empty()) {
    std::string msg = std::to_string(missing.size()) + " tensor state(s) of the model are not in the checkpoint: ";
    for (size_t i = 0; i < missing.size() && i < 12; ++i) msg += (i ? ", " : "") + missing[i];
    if (missing.size() > 12) msg += ", ...";
    if (opt.strict_missing) fail(ErrorCode::kInvalidArgument, msg, " (strict_missing is on)");
    plan.notes.push_back("left unchanged (strict_missing off): " + msg);
  }
  {
    std::vector<std::string> unexpected;
    for (size_t i = 0; i < S.arrays.size(); ++i)
      if (!src_used[i] && target.find_array(S.arrays[i].tensor, StateKind::kWeight) < 0 &&
          S.arrays[i].state == StateKind::kWeight)
        unexpected.push_back(S.arrays[i].tensor);
    if (!unexpected.empty()) {
      std::string msg = std::to_string(unexpected.size()) + " checkpoint tensor(s) are not in the model: ";
      for (size_t i = 0; i < unexpected.size() && i < 12; ++i) msg += (i ? ", " : "") + unexpected[i];
      if (opt.strict_unexpected) fail(ErrorCode::kInvalidArgument, msg, " (strict_unexpected is on)");
      plan.notes.push_back("ignored (strict_unexpected off): " + msg);
    }
  }
  {
    // Optimizer state the checkpoint holds for a tensor whose state the target places nowhere
    // (a trainer's param groups that leave the tensor out: a frozen parameter, or groups built
    // wrong). Without this it was not loaded and nothing said so.
    std::vector<char> placed(target.arrays.size(), 0);
    for (const Piece& pc : target.pieces) placed[size_t(pc.array)] = 1;
    std::vector<std::string> unplaced;
    for (size_t i = 0; i < target.arrays.size(); ++i)
      if (target.arrays[i].state != StateKind::kWeight && src_of[i] >= 0 && !placed[i])
        unplaced.push_back(target.arrays[i].key());
    if (!unplaced.empty()) {
      std::string msg = std::to_string(unplaced.size()) +
                        " optimizer state(s) in the checkpoint have no place in the target (its param groups leave "
                        "the tensor out): ";
      for (size_t i = 0; i < unplaced.size() && i < 12; ++i) msg += (i ? ", " : "") + unplaced[i];
      if (unplaced.size() > 12) msg += ", ...";
      if (opt.strict_unexpected)
        fail(ErrorCode::kInvalidArgument, msg, " (strict_unexpected is on; turn it off to resume without them, e.g. "
             "for frozen parameters)");
      plan.notes.push_back("not loaded (strict_unexpected off): " + msg);
    }
  }
  if (from_master > 0)
    plan.notes.push_back(std::to_string(from_master) +
                         " 16-bit weight(s) filled by downcasting the checkpoint's fp32 master (no 16-bit copy saved)");

  // 2. Authoritative copies and replicas.
  SourceIndex si = index_source(source, opt.compare_replicas);
  if (!opt.compare_replicas) plan.notes.push_back("replicas not compared (compare_replicas off)");

  // 3. Needs.
  std::vector<size_t> auth_base(S.arrays.size() + 1, 0);
  for (size_t a = 0; a < S.arrays.size(); ++a) auth_base[a + 1] = auth_base[a] + si.auth[a].size();
  std::vector<Need> needs;
  needs.reserve(target.pieces.size() * 2);
  const bool same_topology = S.topo == target.topo;
  const size_t own_base = auth_base.back();
  std::vector<SrcPiece> own;            // own-file copies used by identity layouts (ids from own_base)
  std::vector<int32_t> own_array;       // their source array
  std::vector<std::string> gaps;
  size_t n_gaps = 0;
  std::vector<Box> hits;  // boxes of the current target piece found so far (reused: no malloc per piece)
  for (const Piece& tp : target.pieces) {
    int sa = src_of[tp.array];
    if (sa < 0) continue;
    const auto& au = si.auth[sa];
    const Buffer& tb = target.buffers[tp.buffer];
    int64_t covered = 0;
    hits.clear();
    auto add_need = [&](int32_t src_id, const Box& x) {
      Need n;
      n.src = src_id;
      n.box = x;
      n.dst.rank = tb.rank;
      n.dst.buffer = tp.buffer;
      n.dst.base = sub_base(tp.base, tp.box, tp.strides, x);
      n.dst.strides = tp.strides;
      needs.push_back(n);
      covered += x.numel();
      hits.push_back(x);
    };
    if (same_topology) {
      // Identity layouts: a rank reads the copy in its own files where one exists, so that
      // replicated tensors cause no exchange.
      const auto& cp = si.copies[sa];
      si.copies_index[sa].query(tp.box, [&](int32_t j) -> const Box& { return cp[j].box; }, [&](int32_t j, const Box& x) {
        if (cp[j].rank != tb.rank) return;
        for (const Box& h : hits)
          if (!intersect(h, x).empty()) return;  // already covered by an earlier own copy
        add_need(int32_t(own_base + own.size()), x);
        own.push_back(cp[j]);
        own_array.push_back(sa);
      });
    }
    if (hits.empty()) {
      si.index[sa].query(tp.box, [&](int32_t j) -> const Box& { return au[j].box; },
                         [&](int32_t j, const Box& x) { add_need(int32_t(auth_base[sa] + j), x); });
    } else if (covered < tp.box.numel()) {
      std::vector<Box> rest = {tp.box};
      for (const Box& h : hits) {
        std::vector<Box> next;
        for (const Box& r : rest)
          for (const Box& q : box_subtract(r, h)) next.push_back(q);
        rest.swap(next);
      }
      for (const Box& r : rest)
        si.index[sa].query(r, [&](int32_t j) -> const Box& { return au[j].box; },
                           [&](int32_t j, const Box& x) { add_need(int32_t(auth_base[sa] + j), x); });
    }
    if (covered == tp.box.numel()) continue;
    // Uncovered: vocab padding rows are filled; anything else is a coverage error.
    std::vector<Box> rest = {tp.box};
    for (const Box& h : hits) {
      std::vector<Box> next;
      for (const Box& r : rest)
        for (const Box& q : box_subtract(r, h)) next.push_back(q);
      rest.swap(next);
    }
    const auto& ta = target.arrays[tp.array];
    for (const Box& r : rest) {
      Box pad = r, real = r;
      if (ta.real_rows >= 0 && r.ndim > 0) {
        int64_t lo = r.off[0], hi = r.off[0] + r.len[0];
        int64_t cut = std::clamp<int64_t>(ta.real_rows, lo, hi);
        real.len[0] = cut - lo;
        pad.off[0] = cut;
        pad.len[0] = hi - cut;
      } else {
        pad.len[0] = 0;
      }
      if (r.ndim > 0 && pad.len[0] > 0) {
        Fill f;
        f.rank = tb.rank;
        f.buffer = tp.buffer;
        f.base = sub_base(tp.base, tp.box, tp.strides, pad);
        f.extent = pad;
        f.strides = tp.strides;
        plan.fills.push_back(f);
      }
      if (r.ndim == 0 || real.len[0] > 0) {
        ++n_gaps;
        if (gaps.size() < 16)
          gaps.push_back("tensor " + ta.tensor + " (" + state_kind_name(ta.state) + "): elements " +
                         (r.ndim == 0 ? r.to_string() : real.to_string()) + " of logical shape " + shape_str(ta) +
                         " (target rank " + std::to_string(tb.rank) + ")");
      }
    }
  }
  if (n_gaps > 0) {
    std::string msg = "checkpoint does not cover the model: " + std::to_string(n_gaps) + " region(s) covered by no file";
    if (!S.buffers.empty()) {
      std::vector<std::string> missing_files;
      for (size_t b = 0; b < S.buffers.size(); ++b)
        if (source.locations[b].file < 0) missing_files.push_back(S.buffers[b].name + " of source rank " + std::to_string(S.buffers[b].rank));
      if (!missing_files.empty()) {
        msg += "; " + std::to_string(missing_files.size()) + " source buffer(s) have no file: ";
        for (size_t i = 0; i < missing_files.size() && i < 8; ++i) msg += (i ? ", " : "") + missing_files[i];
        if (missing_files.size() > 8) msg += ", ...";
      }
    }
    if (!source.missing_files.empty()) {
      msg += "; missing file(s): ";
      for (size_t i = 0; i < source.missing_files.size() && i < 16; ++i) msg += (i ? ", " : "") + source.missing_files[i];
      if (source.missing_files.size() > 16) msg += ", ... (" + std::to_string(source.missing_files.size()) + " in all)";
    }
    msg += "; uncovered: ";
    for (size_t i = 0; i < gaps.size(); ++i) msg += (i ? "; " : "") + gaps[i];
    if (n_gaps > gaps.size()) msg += "; ...";
    fail(ErrorCode::kDataLoss, msg);
  }
  // Vocab padding rows that differ between source and target (dropped or added): a warning, or
  // with PlanOptions::refuse_vocab_padding_change an error, before anything is read.
  if (const std::string w = vocab_padding_change(S, target, src_of); !w.empty()) {
    if (opt.refuse_vocab_padding_change)
      fail(ErrorCode::kInvalidArgument, w, " (refused: policy vocab_padding=refuse)");
    plan.warnings.push_back(w);
  }

  auto src_piece = [&](int32_t id) -> const SrcPiece& {
    if (size_t(id) >= own_base) return own[id - own_base];
    size_t a = size_t(std::upper_bound(auth_base.begin(), auth_base.end(), size_t(id)) - auth_base.begin()) - 1;
    return si.auth[a][id - auth_base[a]];
  };

  // 4. Fragments.
  std::sort(needs.begin(), needs.end(), [](const Need& x, const Need& y) {
    if (x.src != y.src) return x.src < y.src;
    if (!(x.box == y.box)) return x.box < y.box;
    if (x.dst.rank != y.dst.rank) return x.dst.rank < y.dst.rank;
    return x.dst.buffer < y.dst.buffer;
  });
  struct Proto {
    int32_t array;
    int32_t src;
    Box box;
    std::vector<Delivery> dst;
  };
  std::vector<Proto> protos;
  std::vector<int32_t> tgt_array_of_src(S.arrays.size(), -1);
  for (size_t i = 0; i < target.arrays.size(); ++i)
    if (src_of[i] >= 0) tgt_array_of_src[src_of[i]] = int32_t(i);
  auto src_array_of_piece = [&](int32_t id) -> int32_t {
    if (size_t(id) >= own_base) return own_array[id - own_base];
    return int32_t(std::upper_bound(auth_base.begin(), auth_base.end(), size_t(id)) - auth_base.begin()) - 1;
  };
  auto array_of_src_piece = [&](int32_t id) { return tgt_array_of_src[src_array_of_piece(id)]; };
  // Replica policy average: the other saved copies of a box read from source piece `id`.
  const bool average = opt.replica_policy == ReplicaPolicy::kAverage;
  auto for_each_replica = [&](int32_t id, const Box& box, const std::function<void(const SrcPiece&, const Box&)>& fn) {
    const SrcPiece& sp = src_piece(id);
    if (!dtype_is_float(sp.dtype)) return;  // integer copies are not averaged: the first one loads
    const int32_t sa = src_array_of_piece(id);
    const auto& cp = si.copies[sa];
    si.copies_index[sa].query(box, [&](int32_t j) -> const Box& { return cp[j].box; }, [&](int32_t j, const Box& x) {
      if (cp[j].order == sp.order) return;  // the copy being read
      fn(cp[j], x);
    });
  };
  uint64_t bytes_needed = 0;
  for (size_t i = 0; i < needs.size();) {
    size_t j = i;
    while (j < needs.size() && needs[j].src == needs[i].src) ++j;
    const SrcPiece& sp = src_piece(needs[i].src);
    const int32_t arr = array_of_src_piece(needs[i].src);
    if (!opt.dedup) {
      for (size_t k = i; k < j; ++k) {
        protos.push_back({arr, needs[k].src, needs[k].box, {needs[k].dst}});
        bytes_needed += 0;  // computed below from distinct boxes
      }
    }
    // Distinct boxes of this source piece (needs are sorted by box).
    std::vector<std::pair<Box, std::vector<Delivery>>> distinct;
    for (size_t k = i; k < j; ++k) {
      if (distinct.empty() || !(distinct.back().first == needs[k].box)) distinct.push_back({needs[k].box, {}});
      distinct.back().second.push_back(needs[k].dst);
    }
    // Clusters of overlapping distinct boxes (union-find over an index sweep).
    std::vector<int> parent(distinct.size());
    std::iota(parent.begin(), parent.end(), 0);
    std::function<int(int)> find = [&](int x) { return parent[x] == x ? x : parent[x] = find(parent[x]); };
    if (distinct.size() > 1) {
      BoxIndex bi;
      bi.build(distinct.size(), [&](int32_t k) -> const Box& { return distinct[k].first; });
      for (size_t k = 0; k < distinct.size(); ++k)
        bi.query(distinct[k].first, [&](int32_t m) -> const Box& { return distinct[m].first; },
                 [&](int32_t m, const Box&) { if (size_t(m) != k) parent[find(int(k))] = find(m); });
    }
    std::map<int, std::vector<int>> clusters;
    for (size_t k = 0; k < distinct.size(); ++k) clusters[find(int(k))].push_back(int(k));
    for (auto& [root, members] : clusters) {
      if (members.size() == 1) {
        auto& d = distinct[members[0]];
        bytes_needed += uint64_t(d.first.numel()) * dtype_size(sp.dtype);
        if (opt.dedup) protos.push_back({arr, needs[i].src, d.first, d.second});
        continue;
      }
      // Grid cells of the cluster: every element read once, delivered to each box holding it.
      const int nd = distinct[members[0]].first.ndim;
      std::array<std::vector<int64_t>, kMaxDims> cuts;
      for (int m : members)
        for (int d = 0; d < nd; ++d) {
          cuts[d].push_back(distinct[m].first.off[d]);
          cuts[d].push_back(distinct[m].first.off[d] + distinct[m].first.len[d]);
        }
      for (int d = 0; d < nd; ++d) {
        std::sort(cuts[d].begin(), cuts[d].end());
        cuts[d].erase(std::unique(cuts[d].begin(), cuts[d].end()), cuts[d].end());
      }
      std::array<size_t, kMaxDims> ix{};
      while (true) {
        Box cell;
        cell.ndim = nd;
        for (int d = 0; d < nd; ++d) {
          cell.off[d] = cuts[d][ix[d]];
          cell.len[d] = cuts[d][ix[d] + 1] - cuts[d][ix[d]];
        }
        std::vector<Delivery> dst;
        for (int m : members) {
          const Box& b = distinct[m].first;
          if (!contains(b, cell)) continue;
          for (const Delivery& dv : distinct[m].second) {
            Delivery c = dv;
            c.base = sub_base(dv.base, b, dv.strides, cell);
            dst.push_back(c);
          }
        }
        if (!dst.empty()) {
          bytes_needed += uint64_t(cell.numel()) * dtype_size(sp.dtype);
          if (opt.dedup) protos.push_back({arr, needs[i].src, cell, dst});
        }
        int d = nd - 1;
        while (d >= 0 && ++ix[d] + 1 >= cuts[d].size()) ix[d--] = 0;
        if (d < 0) break;
      }
    }
    i = j;
  }
  needs.clear();
  needs.shrink_to_fit();

  // 5a. Cut fragments to the budget.
  const bool node_local = opt.dedup && !opt.rank_node.empty();
  if (node_local && int(opt.rank_node.size()) != W)
    fail(ErrorCode::kInvalidArgument, "rank_node has ", opt.rank_node.size(), " entries for ", W, " target ranks");
  std::vector<Proto> cut;
  cut.reserve(protos.size());
  // Dense source ranges the budget cuts although the layout change reads them whole: verify="free"
  // checks them in the pre-flight (Plan::budget_splits, checkers chosen below). Keyed by the
  // authoritative range the fragments read; under policy average the replica copies read with
  // it are listed too (they are read chunk by chunk as well).
  struct SplitRange {
    int32_t file;
    uint64_t base, bytes;
    bool operator<(const SplitRange& o) const { return std::tie(file, base, bytes) < std::tie(o.file, o.base, o.bytes); }
    bool operator==(const SplitRange& o) const { return file == o.file && base == o.base && bytes == o.bytes; }
  };
  std::map<std::pair<int32_t, uint64_t>, std::pair<uint64_t, std::vector<SplitRange>>> split_ranges;  // auth (file, base) -> (bytes, ranges)
  std::vector<int32_t> rk;  // receiving ranks of the proto being cut (reused)
  std::function<void(Proto&&, bool)> split = [&](Proto&& p, bool top) {
    const SrcPiece& sp = src_piece(p.src);
    const uint64_t es = dtype_size(sp.dtype);
    uint64_t bytes = uint64_t(p.box.numel()) * es;
    // The reader holds the packed box plus one send copy per other receiving rank. With
    // node-local reads only receivers on other machines than the reader's get a send copy (the
    // others read their own); the reader is not chosen yet, so count the worst receiver.
    rk.clear();
    for (const auto& d : p.dst) rk.push_back(d.rank);
    if (!std::is_sorted(rk.begin(), rk.end())) std::sort(rk.begin(), rk.end());  // mostly in rank order already
    rk.erase(std::unique(rk.begin(), rk.end()), rk.end());
    uint64_t copies = uint64_t(rk.size()) + 1;
    if (node_local) {
      std::map<int32_t, uint64_t> per_node;
      for (int32_t r : rk) ++per_node[opt.rank_node[r]];
      uint64_t fewest = rk.size();
      for (const auto& [node, n] : per_node) fewest = std::min(fewest, n);
      copies = 1 + (uint64_t(rk.size()) - fewest);
    }
    // Averaging replicas also holds one replica read and a double accumulator (3 x fp32 bytes).
    bool has_replicas = false;
    if (average) for_each_replica(p.src, p.box, [&](const SrcPiece&, const Box&) { has_replicas = true; });
    if (has_replicas) copies += 3;
    const uint64_t limit = std::max<uint64_t>(opt.memory_budget / copies, 1);
    if (bytes <= limit || p.box.numel() <= 1) {
      cut.push_back(std::move(p));
      return;
    }
    if (top && box_is_dense(p.box, sp.strides)) {
      auto& e = split_ranges[{sp.file, sub_byte_base(sp, p.box)}];
      e.first = std::max(e.first, bytes);
      e.second.push_back({sp.file, sub_byte_base(sp, p.box), bytes});
      if (has_replicas)
        for_each_replica(p.src, p.box, [&](const SrcPiece& c, const Box& x) {
          if (box_is_dense(x, c.strides))
            e.second.push_back({c.file, sub_byte_base(c, x), uint64_t(x.numel()) * dtype_size(c.dtype)});
        });
    }
    // Split the outermost dim in source memory order that has more than one element.
    int best = -1;
    for (int d = 0; d < p.box.ndim; ++d)
      if (p.box.len[d] > 1 && (best < 0 || sp.strides[d] > sp.strides[best])) best = d;
    uint64_t unit = bytes / uint64_t(p.box.len[best]);
    int64_t step = std::max<int64_t>(1, int64_t(limit / std::max<uint64_t>(unit, 1)));
    for (int64_t o = 0; o < p.box.len[best]; o += step) {
      Proto q;
      q.array = p.array;
      q.src = p.src;
      q.box = p.box;
      q.box.off[best] = p.box.off[best] + o;
      q.box.len[best] = std::min(step, p.box.len[best] - o);
      q.dst.reserve(p.dst.size());
      for (const Delivery& dv : p.dst) {
        Delivery c = dv;
        c.base = sub_base(dv.base, p.box, dv.strides, q.box);
        q.dst.push_back(c);
      }
      split(std::move(q), false);
    }
  };
  for (auto& p : protos) split(std::move(p), true);
  protos.clear();
  protos.shrink_to_fit();

  // 5b. Readers and waves.
  plan.ranks.assign(W, RankStats{});
  // The first reader of each box: the rank that reads it from storage, checks it under
  // verify="free" and sends it to ranks on other machines (node-local re-reads and receivers do
  // the same work whoever it is). Boxes only one rank receives are that rank's; the others go,
  // largest first, to the receiving rank with the fewest bytes so far (a greedy pass in file
  // order left the 2 GB tp merge's two ranks checking 1.02 and 0.87 GB, the pipeline target's
  // 0.60 and 0.38 GB: each rank's optimizer share came first and the weights all went to the
  // rank whose share came later).
  std::vector<int32_t> first_reader(cut.size());
  {
    std::vector<uint64_t> first_load(W, 0);
    std::vector<size_t> shared;
    auto bytes_of = [&](size_t ci) { return uint64_t(cut[ci].box.numel()) * dtype_size(src_piece(cut[ci].src).dtype); };
    for (size_t ci = 0; ci < cut.size(); ++ci) {
      const Proto& p = cut[ci];
      first_reader[ci] = p.dst.front().rank;
      bool one = true;
      for (const auto& d : p.dst) one = one && d.rank == p.dst.front().rank;
      if (one)
        first_load[first_reader[ci]] += bytes_of(ci);
      else
        shared.push_back(ci);
    }
    std::stable_sort(shared.begin(), shared.end(), [&](size_t a, size_t b) { return bytes_of(a) > bytes_of(b); });
    for (size_t ci : shared) {
      int32_t best = -1;
      for (const auto& d : cut[ci].dst)
        if (best < 0 || first_load[d.rank] < first_load[best] || (first_load[d.rank] == first_load[best] && d.rank < best))
          best = d.rank;
      first_reader[ci] = best;
      first_load[best] += bytes_of(ci);
    }
  }
  std::vector<std::vector<uint64_t>> wave_use;  // [wave][rank]
  plan.fragments.reserve(cut.size());
  {
    size_t deliveries = 0;  // a sibling takes its deliveries from its fragment: the sum stays
    for (const auto& p : cut) deliveries += p.dst.size();
    plan.deliveries.reserve(deliveries);
  }
  std::vector<Proto> siblings;  // node-local re-reads split off below, placed after `cut`
  std::vector<int32_t> remote;  // receivers of the current fragment other than its reader (reused)
  if (node_local) {
    // Never reallocated inside the loop (it holds a reference into it): a sibling per delivery at most.
    size_t most = 0;
    for (const auto& p : cut) most += p.dst.size();
    siblings.reserve(most);
  }
  for (size_t ci = 0; ci < cut.size() + siblings.size(); ++ci) {
    const bool sibling = ci >= cut.size();
    Proto& p = sibling ? siblings[ci - cut.size()] : cut[ci];
    const SrcPiece& sp = src_piece(p.src);
    auto by_place = [](const Delivery& a, const Delivery& b) {
      return a.rank != b.rank ? a.rank < b.rank : (a.buffer != b.buffer ? a.buffer < b.buffer : a.base < b.base);
    };
    if (!std::is_sorted(p.dst.begin(), p.dst.end(), by_place)) std::sort(p.dst.begin(), p.dst.end(), by_place);
    Fragment f;
    f.array = p.array;
    f.box = p.box;
    f.file = sp.file;
    f.byte_base = sub_byte_base(sp, p.box);
    f.src_strides = sp.strides;
    f.src_dtype = sp.dtype;
    const uint64_t bytes = f.bytes();
    uint64_t replica_bytes = 0;
    if (average) {
      f.first_replica = uint32_t(plan.replica_sources.size());
      for_each_replica(p.src, p.box, [&](const SrcPiece& c, const Box& x) {
        plan.replica_sources.push_back({x, c.file, sub_byte_base(c, x), c.strides, c.dtype});
        replica_bytes += plan.replica_sources.back().bytes();
      });
      f.num_replicas = uint32_t(plan.replica_sources.size()) - f.first_replica;
    }
    const int reader = sibling ? p.dst.front().rank : first_reader[ci];
    if (node_local) {
      // Other receiving ranks on the reader's node read their own copy (from the shared page
      // cache); only ranks on other nodes get the bytes through the exchange.
      std::vector<Delivery> keep, own;
      int32_t own_rank = -1;
      auto flush = [&] {
        if (own.empty()) return;
        Proto q;
        q.array = p.array;
        q.src = p.src;
        q.box = p.box;
        q.dst = std::move(own);
        siblings.push_back(std::move(q));
        own.clear();
      };
      for (const Delivery& d : p.dst) {  // sorted by rank
        if (d.rank != reader && opt.rank_node[d.rank] == opt.rank_node[reader]) {
          if (d.rank != own_rank) flush();
          own_rank = d.rank;
          own.push_back(d);
        } else {
          keep.push_back(d);
        }
      }
      flush();
      p.dst = std::move(keep);
    }
    if (sibling) plan.bytes_reread_on_node += bytes;
    f.reread_on_node = sibling;
    f.reader = reader;
    // Ranks and bytes this fragment adds to a wave.
    remote.clear();
    for (const auto& d : p.dst)
      if (d.rank != reader && (remote.empty() || remote.back() != d.rank)) remote.push_back(d.rank);
    int w = 0;
    for (;; ++w) {
      if (w == int(wave_use.size())) wave_use.emplace_back(W, 0);
      auto& u = wave_use[w];
      // staging + one send copy per receiver (+ replica read and accumulator when averaging)
      const uint64_t reader_cost = bytes * (1 + remote.size() + (f.num_replicas ? 3 : 0));
      bool ok = u[reader] + reader_cost <= opt.memory_budget || u[reader] == 0;
      for (size_t k = 0; ok && k < remote.size(); ++k) ok = u[remote[k]] + bytes <= opt.memory_budget || u[remote[k]] == 0;
      if (ok) break;
    }
    auto& u = wave_use[w];
    u[reader] += bytes * (1 + remote.size() + (f.num_replicas ? 3 : 0));
    for (int32_t r : remote) u[r] += bytes;
    f.wave = w;
    plan.ranks[reader].bytes_read += bytes + replica_bytes;
    plan.bytes_to_read += bytes + replica_bytes;
    const uint64_t numel = uint64_t(f.box.numel());
    for (const auto& d : p.dst) plan.target_bytes += numel * dtype_size(target.buffers[d.buffer].dtype);
    for (int32_t r : remote) {
      plan.ranks[reader].bytes_sent += bytes;
      plan.ranks[r].bytes_received += bytes;
      plan.bytes_to_exchange += bytes;
    }
    f.first_delivery = uint32_t(plan.deliveries.size());
    f.num_deliveries = uint32_t(p.dst.size());
    for (const auto& d : p.dst) plan.deliveries.push_back(d);
    plan.fragments.push_back(f);
  }
  plan.num_waves = int(wave_use.size());
  for (const auto& u : wave_use)
    for (int r = 0; r < W; ++r) {
      plan.ranks[r].peak_staging = std::max(plan.ranks[r].peak_staging, u[r]);
      plan.peak_staging_bytes_per_rank = std::max(plan.peak_staging_bytes_per_rank, u[r]);
    }
  plan.bytes_needed = bytes_needed;

  // Order fragments for execution: by wave, then reader, file and offset (sequential reads).
  std::vector<size_t> order(plan.fragments.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    const auto &x = plan.fragments[a], &y = plan.fragments[b];
    if (x.wave != y.wave) return x.wave < y.wave;
    if (x.reader != y.reader) return x.reader < y.reader;
    if (x.file != y.file) return x.file < y.file;
    return x.byte_base < y.byte_base;
  });
  std::vector<Fragment> sorted;
  sorted.reserve(order.size());
  for (size_t i : order) sorted.push_back(plan.fragments[i]);
  plan.fragments.swap(sorted);

  // Budget splits: one checker per split range and machine whose ranks read any of its fragments
  // (machines may each read their own copy of the files; with dedup off every reader reads its
  // own), a rank of that machine that reads one.
  if (!split_ranges.empty()) {
    for (auto& [key, entry] : split_ranges) {  // with dedup off, several protos list one range
      std::sort(entry.second.begin(), entry.second.end());
      entry.second.erase(std::unique(entry.second.begin(), entry.second.end()), entry.second.end());
    }
    std::set<std::tuple<int32_t, uint64_t, int32_t>> seen;  // (file, base, machine)
    for (const Fragment& f : plan.fragments) {
      auto it = split_ranges.upper_bound({f.file, f.byte_base});
      if (it == split_ranges.begin()) continue;
      --it;
      if (it->first.first != f.file || f.byte_base >= it->first.second + it->second.first) continue;
      const int32_t machine = node_local ? opt.rank_node[f.reader] : f.reader;
      if (!seen.insert({f.file, it->first.second, machine}).second) continue;
      for (const SplitRange& r : it->second.second) plan.budget_splits.push_back({r.file, r.base, r.bytes, f.reader});
    }
    std::sort(plan.budget_splits.begin(), plan.budget_splits.end(), [](const BudgetSplit& a, const BudgetSplit& b) {
      return std::tie(a.file, a.byte_base, a.checker) < std::tie(b.file, b.byte_base, b.checker);
    });
  }

  // Flat-partition padding: target buffer elements no piece covers are zero-filled.
  {
    std::vector<std::vector<std::pair<int64_t, int64_t>>> ranges(target.buffers.size());
    for (const Piece& p : target.pieces) ranges[p.buffer].push_back({p.base, p.base + p.box.numel()});
    for (size_t b = 0; b < target.buffers.size(); ++b) {
      auto& r = ranges[b];
      std::sort(r.begin(), r.end());
      int64_t at = 0;
      auto gap = [&](int64_t lo, int64_t hi) {
        if (hi <= lo) return;
        Fill f;
        f.rank = target.buffers[b].rank;
        f.buffer = int32_t(b);
        f.base = lo;
        f.extent.ndim = 1;
        f.extent.len[0] = hi - lo;
        f.strides[0] = 1;
        plan.fills.push_back(f);
      };
      for (const auto& [lo, hi] : r) {
        gap(at, lo);
        at = std::max(at, hi);
      }
      gap(at, target.buffers[b].numel);
    }
  }

  // Replica comparisons: only for arrays the target uses; checker ranks round-robin by bytes.
  // (load, rank), least loaded first and the lowest rank among equals: no scan over every rank
  // per comparison (16,384 ranks at scale).
  using Load = std::pair<uint64_t, int32_t>;
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> check_load;
  for (int32_t r = 0; r < W; ++r) check_load.push({0, r});
  for (auto& c : si.compares) {
    int ta = -1;
    auto it = src_by_key.find(c.tensor + "/" + state_kind_name(c.state));
    if (it != src_by_key.end()) ta = tgt_array_of_src[it->second];
    if (ta < 0) continue;
    c.array = ta;
    auto [load, best] = check_load.top();
    check_load.pop();
    c.checker = best;
    uint64_t bytes = uint64_t(c.box.numel()) * (dtype_size(c.authoritative.dtype) + dtype_size(c.replica.dtype));
    check_load.push({load + bytes, best});
    plan.ranks[best].verify_bytes_read += bytes;
    plan.replica_compares.push_back(c);
  }
  if (!plan.replica_compares.empty())
    plan.notes.push_back(std::to_string(plan.replica_compares.size()) + " replica region(s) compared, policy " +
                         replica_policy_name(opt.replica_policy));
  return plan;
}

std::vector<CoverageGap> find_coverage_gaps(const SourceLayout& source, const Layout& target) {
  std::vector<CoverageGap> out;
  try {
    PlanOptions o;
    o.compare_replicas = false;
    o.strict_missing = false;
    o.strict_unexpected = false;
    make_plan(source, target, o);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDataLoss) throw;
    // Recompute the regions precisely for callers that want them as data.
    SourceIndex si = index_source(source, false);
    std::unordered_map<std::string, int> src_by_key;
    for (size_t i = 0; i < source.layout.arrays.size(); ++i) src_by_key[source.layout.arrays[i].key()] = int(i);
    for (const Piece& tp : target.pieces) {
      const auto& ta = target.arrays[tp.array];
      auto it = src_by_key.find(ta.key());
      if (it == src_by_key.end()) continue;
      const auto& au = si.auth[it->second];
      std::vector<Box> rest = {tp.box};
      si.index[it->second].query(tp.box, [&](int32_t j) -> const Box& { return au[j].box; }, [&](int32_t, const Box& x) {
        std::vector<Box> next;
        for (const Box& r : rest)
          for (const Box& q : box_subtract(r, x)) next.push_back(q);
        rest.swap(next);
      });
      for (Box r : rest) {
        if (ta.real_rows >= 0 && r.ndim > 0) {
          int64_t hi = r.off[0] + r.len[0];
          if (r.off[0] >= ta.real_rows) continue;
          r.len[0] = std::min(hi, ta.real_rows) - r.off[0];
        }
        out.push_back({ta.tensor, ta.state, r});
      }
    }
  }
  return out;
}

}  // namespace reshard
