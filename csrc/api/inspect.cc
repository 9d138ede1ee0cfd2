#include "reshard/inspect.h"

#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include "reshard/consolidate.h"
#include "reshard/error.h"

namespace reshard {

std::string inspect_json(const CheckpointReader& reader, bool stats) {
  using json = nlohmann::ordered_json;
  const SourceLayout& src = reader.source();
  const Layout& L = src.layout;
  const NonTensorState& st = reader.state();
  json j;
  j["path"] = reader.path();
  j["writer"] = reader.writer();
  j["topology"] = {{"tp", L.topo.tp}, {"pp", L.topo.pp}, {"vpp", L.topo.vpp}, {"dp", L.topo.dp}, {"zero", L.topo.zero}};
  j["iteration"] = st.iteration;
  j["step"] = st.step;
  j["consumed_samples"] = st.consumed_samples;
  const ModelConfig& m = L.model;
  j["model"] = {{"num_layers", m.num_layers}, {"hidden", m.hidden},  {"ffn", m.ffn},
                {"heads", m.heads},           {"query_groups", m.groups()}, {"vocab", m.vocab},
                {"vocab_divisible_by", m.vocab_divisible_by}, {"max_position_embeddings", m.max_position_embeddings},
                {"swiglu", m.swiglu},         {"tied_embeddings", m.tied_embeddings}, {"bias", m.bias},
                {"norm", m.norm},             {"param_dtype", dtype_name(m.param_dtype)}, {"qkv_version", m.qkv_version},
                {"qkv_order", m.qkv_order_known() ? qkv_order_name(m.qkv_layout()) : "unknown"},
                {"tp_gt_groups", qkv_variant_name(m.tp_gt_groups)}};
  json tensors = json::array();
  for (const auto& t : L.tensors) {
    json e = {{"name", t.name}, {"shape", t.shape}, {"dtype", dtype_name(m.param_dtype)}, {"split", split_name(t.split)}};
    if (t.real_rows >= 0) e["real_rows"] = t.real_rows;
    tensors.push_back(e);
  }
  j["tensors"] = tensors;
  j["files"] = src.files;

  json problems = json::array();
  ReadFn read = [&reader](int32_t f, uint64_t off, uint64_t len, void* dst) { reader.read(f, off, len, dst); };
  // Replica agreement and coverage, against the consolidated (tp=1, pp=1, dp=1) layout.
  try {
    Topology one;
    LikeOptions lo;
    lo.keep_source_vocab_rows = true;
    Layout T = layout_like(src, one, lo);
    PlanOptions po;
    po.compare_replicas = true;
    Plan plan = make_plan(src, T, po);
    std::map<std::pair<std::string, int>, double> worst;
    for (const auto& c : plan.replica_compares) {
      double d = replica_max_abs_diff(c, read);
      auto key = std::make_pair(c.tensor, int(c.state));
      if (d > 0 || std::isnan(d)) worst[key] = std::max(worst[key], d);
    }
    for (const auto& [k, d] : worst) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.6g", d);
      problems.push_back("replicated tensor " + k.first + " (" + state_kind_name(StateKind(k.second)) +
                         ") differs between its copies in the checkpoint: max |diff| " + buf);
    }
  } catch (const Error& e) {
    problems.push_back(e.what());
  }
  j["problems"] = problems;
  json notes = reader.notes();
  j["notes"] = notes;

  if (stats) {
    json s = json::object();
    try {
      ConsolidateOptions co;
      co.optimizer = false;
      co.replica_policy = ReplicaPolicy::kFirst;
      co.compare_replicas = false;
      Consolidated c = consolidate(reader, co);
      for (const auto& [name, t] : c[StateKind::kWeight]) {
        double sum = 0, sq = 0, mn = INFINITY, mx = -INFINITY;
        int64_t zeros = 0;
        for (float v : t.values) {
          sum += v;
          sq += double(v) * v;
          mn = std::min(mn, double(v));
          mx = std::max(mx, double(v));
          zeros += v == 0.0f;
        }
        const double n = double(t.values.size());
        const double mean = n > 0 ? sum / n : 0;
        const double var = n > 0 ? std::max(0.0, sq / n - mean * mean) : 0;
        s[name] = {{"mean", mean}, {"std", std::sqrt(var)}, {"min", n > 0 ? mn : 0}, {"max", n > 0 ? mx : 0},
                   {"zero_fraction", n > 0 ? double(zeros) / n : 0}};
      }
    } catch (const Error& e) {
      j["problems"].push_back(std::string("stats: ") + e.what());
    }
    j["stats"] = s;
  }
  return j.dump(1);
}

}  // namespace reshard
