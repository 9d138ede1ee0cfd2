#include "reshard/consolidate.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>

#include "reshard/error.h"

namespace reshard {

std::vector<std::string> inferred_tensors(const SourceLayout& source) {
  std::vector<TensorSpec> specs = source.layout.tensors;
  std::vector<std::string> unmatched;
  classify_tensors(source.layout.model, specs, &unmatched);
  return unmatched;
}

namespace {

// layout_like for a layout given box by box (a DCP checkpoint): what an FSDP2 job of the
// target's world size holds, each tensor's dim 0 cut as torch.chunk cuts it (ceil(rows / world)
// rows per rank, the last ranks short or empty), in the source's dtypes.
Layout chunked_like(const Layout& S, const Topology& target, const LikeOptions& o) {
  target.validate();
  if (target.tp != 1 || target.pp != 1 || target.vpp != 1)
    fail(ErrorCode::kInvalidArgument, S.model.name, " records no tensor-parallel or pipeline rules for its tensors, so ",
         target.to_string(), " cannot be derived from it; give a dp-only layout (dp=N: dim 0 of each tensor cut "
         "as FSDP2 cuts it) or load into the live module (reshard.torch.load)");
  std::vector<ExplicitArray> arrays;
  std::vector<ExplicitBuffer> buffers;
  const int world = target.world_size();
  for (size_t i = 0; i < S.arrays.size(); ++i) {
    const LogicalArray& a = S.arrays[i];
    if (!o.optimizer && a.state != StateKind::kWeight) continue;
    DType dt = DType::F32;
    for (const Piece& p : S.pieces)
      if (p.array == int32_t(i)) {
        dt = S.buffers[size_t(p.buffer)].dtype;
        break;
      }
    ExplicitArray e;
    e.tensor = a.tensor;
    e.state = a.state;
    e.shape.assign(a.shape.begin(), a.shape.begin() + a.ndim);
    const int32_t idx = int32_t(arrays.size());
    arrays.push_back(e);
    const int64_t rows = e.shape[0], per = (rows + world - 1) / world;
    for (int r = 0; r < world; ++r) {
      const int64_t lo = std::min(rows, per * r), hi = std::min(rows, per * (r + 1));
      ExplicitBuffer b;
      b.name = std::string(state_kind_name(a.state)) + "/" + a.tensor;
      b.rank = r;
      b.dtype = dt;
      b.array = idx;
      b.offsets.assign(size_t(a.ndim), 0);
      b.sizes = e.shape;
      b.offsets[0] = lo;
      b.sizes[0] = hi - lo;
      buffers.push_back(b);
    }
  }
  return explicit_layout(S.model.name, target, arrays, buffers);
}

}  // namespace

Layout layout_like(const SourceLayout& source, const Topology& target, const LikeOptions& o) {
  const Layout& S = source.layout;
  if (S.explicit_boxes) return chunked_like(S, target, o);
  ModelConfig cfg = S.model;
  if (!o.qkv_order.empty()) {
    if (o.qkv_order != "interleaved" && o.qkv_order != "blocked")
      fail(ErrorCode::kInvalidArgument, "target QKV order '", o.qkv_order, "' must be interleaved or blocked");
    cfg.qkv_order = o.qkv_order;
    cfg.validate();
  }
  if (o.vocab_divisible_by < 0)
    fail(ErrorCode::kInvalidArgument, "target vocab_divisible_by ", o.vocab_divisible_by, " must be > 0");
  if (o.vocab_divisible_by > 0) cfg.vocab_divisible_by = o.vocab_divisible_by;
  if (target.tp != S.topo.tp) {
    auto inferred = inferred_tensors(source);
    if (!inferred.empty()) {
      std::string names;
      for (size_t i = 0; i < inferred.size() && i < 12; ++i) names += (i ? ", " : "") + inferred[i];
      if (inferred.size() > 12) names += ", ...";
      fail(ErrorCode::kInvalidArgument, "tp ", S.topo.tp, "->", target.tp, " refused: ", inferred.size(),
           " tensor(s) match no layout rule, so how they split over tp is unknown: ", names,
           " (the checkpoint records no split rules; only dp-only changes are exact. Add a rule for them "
           "(pattern + split) to the model file)");
    }
  }
  target.validate();
  // The model's own rules first (heads, ffn, hidden, query groups against tp; layers against pp),
  // so `convert` names the same field `plan` does.
  const std::vector<int> stage_of_layer = checked_stage_of_layer(cfg, target, o.stage_of_layer);
  LayoutRecipe r;
  bool has_opt = false;
  for (const auto& a : S.arrays) has_opt |= a.state != StateKind::kWeight;
  for (TensorSpec t : S.tensors) {
    if (t.split == Split::kVocab && t.real_rows >= 0 && !o.keep_source_vocab_rows) t.shape[0] = cfg.padded_vocab(target.tp);
    std::vector<int> st;
    switch (t.owner) {
      case Owner::kLayer:
        st = {t.layer >= 0 && t.layer < int(stage_of_layer.size()) ? stage_of_layer[t.layer] : 0};
        break;
      case Owner::kFirstStage: st = {0}; break;
      case Owner::kLastStage: st = {target.pp - 1}; break;
      case Owner::kFirstAndLast: st = target.pp > 1 ? std::vector<int>{0, target.pp - 1} : std::vector<int>{0}; break;
    }
    r.tensors.push_back(std::move(t));
    r.stages.push_back(st);
  }
  DeriveOptions d;
  d.optimizer = o.optimizer && has_opt;
  d.weights_on_dp0_only = o.weights_on_dp0_only;
  return build_layout(cfg, target, r, d);
}

SourceLayout memory_source(const Layout& layout) {
  SourceLayout s;
  s.layout = layout;
  for (size_t i = 0; i < layout.buffers.size(); ++i) {
    s.files.push_back("memory:" + layout.buffers[i].name + "@rank" + std::to_string(layout.buffers[i].rank));
    s.locations.push_back({int32_t(i), 0});
  }
  return s;
}

ReadFn memory_read(const Layout& layout, const std::vector<const void*>& buffers) {
  RESHARD_CHECK(buffers.size() == layout.buffers.size(), "one pointer per buffer");
  std::vector<uint64_t> sizes;
  for (const auto& b : layout.buffers) sizes.push_back(uint64_t(b.numel) * dtype_size(b.dtype));
  return [buffers, sizes](int32_t file, uint64_t offset, uint64_t length, void* dst) {
    if (file < 0 || size_t(file) >= buffers.size() || offset + length > sizes[file] || offset + length < offset)
      fail(ErrorCode::kDataLoss, "memory buffer ", file, ": read [", offset, ", ", offset + length, ") out of range");
    std::memcpy(dst, static_cast<const uint8_t*>(buffers[file]) + offset, length);
  };
}

Consolidated consolidate_source(const SourceLayout& source, const ReadFn& read, const ConsolidateOptions& opt) {
  Topology one;
  one.zero = 0;
  LikeOptions lo;
  lo.keep_source_vocab_rows = true;
  lo.optimizer = opt.optimizer;
  Layout T = layout_like(source, one, lo);
  PlanOptions po;
  po.replica_policy = opt.replica_policy;
  po.replica_atol = opt.replica_atol;
  po.compare_replicas = opt.compare_replicas;
  po.strict_unexpected = opt.optimizer;  // weights only: the source's optimizer arrays are not wanted
  Plan plan = make_plan(source, T, po);
  std::vector<std::vector<uint8_t>> mem(T.buffers.size());
  std::vector<void*> ptrs;
  for (size_t i = 0; i < T.buffers.size(); ++i) {
    mem[i].assign(uint64_t(T.buffers[i].numel) * dtype_size(T.buffers[i].dtype), 0);
    ptrs.push_back(mem[i].data());
  }
  Consolidated out;
  out.replicas = simulate_plan(plan, T, read, ptrs, opt.replica_policy, opt.replica_atol);
  out.compares = plan.replica_compares;
  out.notes = plan.notes;
  std::unordered_map<std::string, const TensorSpec*> spec;
  for (const auto& t : T.tensors) spec[t.name] = &t;
  for (size_t i = 0; i < T.buffers.size(); ++i) {
    const Buffer& b = T.buffers[i];
    const std::string name = b.name.substr(b.name.find('/') + 1);
    auto it = spec.find(name);
    RESHARD_CHECK(it != spec.end(), "consolidated buffer ", b.name, " names no tensor");
    ConsolidatedTensor c;
    c.shape = it->second->shape;
    c.real_rows = it->second->real_rows;
    c.dtype = b.dtype;
    c.values.resize(b.numel);
    convert_elements(mem[i].data(), b.dtype, c.values.data(), DType::F32, size_t(b.numel));
    out.states[int(b.state)][name] = std::move(c);
  }
  return out;
}

Consolidated consolidate(const CheckpointReader& reader, const ConsolidateOptions& opt) {
  ReadFn read = [&reader](int32_t f, uint64_t off, uint64_t len, void* dst) { reader.read(f, off, len, dst); };
  try {
    return consolidate_source(reader.source(), read, opt);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kDataLoss) throw;
    std::string missing;
    for (const auto& n : reader.notes())
      if (n.rfind("missing file: ", 0) == 0) missing += (missing.empty() ? "" : "; ") + n.substr(14);
    if (missing.empty()) throw;
    throw Error(e.code(), std::string(e.what()) + "; missing files: " + missing);
  }
}

std::map<std::string, std::vector<float>> consolidate(const CheckpointReader& reader, StateKind state,
                                                      const ConsolidateOptions& opt) {
  ConsolidateOptions o = opt;
  o.optimizer = state != StateKind::kWeight;
  Consolidated c = consolidate(reader, o);
  std::map<std::string, std::vector<float>> out;
  for (auto& [n, t] : c.states[int(state)]) out[n] = std::move(t.values);
  return out;
}

}  // namespace reshard
