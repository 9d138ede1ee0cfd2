#include "reshard/model.h"

#include <cmath>

#include <regex>

#include "reshard/error.h"

namespace reshard {

const char* split_name(Split s) {
  switch (s) {
    case Split::kReplicated: return "replicated";
    case Split::kColumn: return "column";
    case Split::kRow: return "row";
    case Split::kVocab: return "vocab";
    case Split::kQkv: return "qkv";
    case Split::kSwiglu: return "swiglu";
  }
  return "?";
}

Split split_from_name(const std::string& s) {
  if (s == "replicated") return Split::kReplicated;
  if (s == "column") return Split::kColumn;
  if (s == "row") return Split::kRow;
  if (s == "vocab") return Split::kVocab;
  if (s == "qkv") return Split::kQkv;
  if (s == "swiglu") return Split::kSwiglu;
  fail(ErrorCode::kInvalidArgument, "unknown split '", s,
       "' (expected replicated, column, row, vocab, qkv or swiglu)");
}

const char* qkv_variant_name(QkvVariant v) {
  switch (v) {
    case QkvVariant::kRefuse: return "refuse";
    case QkvVariant::kEvenRows: return "even_rows";
    case QkvVariant::kReplicateKv: return "replicate_kv";
  }
  return "?";
}

QkvVariant qkv_variant_from_name(const std::string& s) {
  if (s == "refuse") return QkvVariant::kRefuse;
  if (s == "even_rows") return QkvVariant::kEvenRows;
  if (s == "replicate_kv") return QkvVariant::kReplicateKv;
  fail(ErrorCode::kInvalidArgument, "unknown tp_gt_groups variant '", s,
       "' (expected refuse, even_rows or replicate_kv)");
}

int64_t ModelConfig::padded_vocab(int tp) const {
  int64_t m = int64_t(vocab_divisible_by) * tp;
  return (vocab + m - 1) / m * m;
}

void ModelConfig::check_sizes(int64_t padded, const std::string& where) const {
  // Counted in 128 bits so that no product can wrap before it is compared with the limits.
  using Big = __int128;
  auto text = [](Big n) {
    std::string t;
    do {
      t.insert(t.begin(), char('0' + int(n % 10)));
      n /= 10;
    } while (n > 0);
    return t;
  };
  auto refuse = [&](const char* what, Big n, Big limit) {
    fail(ErrorCode::kInvalidArgument, "model '", name, "'", where, ": ", what, " = ", text(n), " exceeds the limit of ",
         text(limit),
         " (reshard's declared model limits, include/reshard/model.h: every element and byte count must fit in "
         "int64 with room for the optimizer state)");
  };
  if (num_layers > kMaxModelLayers) refuse("num_layers", num_layers, kMaxModelLayers);
  if (vocab > kMaxModelParameters) refuse("vocab", vocab, kMaxModelParameters);
  if (max_position_embeddings > kMaxModelParameters)
    refuse("max_position_embeddings", max_position_embeddings, kMaxModelParameters);
  const Big H = hidden, F = ffn, hn = hidden / heads, ng = groups();
  const Big q = heads / ng;
  const Big Vp = padded;
  const Big emb = Vp * H;
  const Big qkv = ng * (q + 2) * hn * H;
  const Big up = (swiglu ? 2 : 1) * F * H;
  const Big per_layer = qkv + H * H + up + F * H + 8 * H + (swiglu ? 2 : 1) * F + ng * (q + 2) * hn;
  const Big total = emb * (tied_embeddings ? 1 : 2) + Big(max_position_embeddings) * H + per_layer * num_layers + 2 * H;
  const Big limit = kMaxModelParameters;
  if (emb > limit) refuse("the word embedding's elements (padded vocab x hidden)", emb, limit);
  if (qkv > limit) refuse("a fused QKV weight's elements", qkv, limit);
  if (up > limit) refuse("an MLP weight's elements (ffn x hidden)", up, limit);
  if (total > limit) refuse("the model's parameters", total, limit);
}

void ModelConfig::validate() const {
  auto positive = [&](const char* field, int64_t v) {
    if (v <= 0)
      fail(ErrorCode::kInvalidArgument, "model '", name, "': field ", field, "=", v, " must be > 0");
  };
  positive("num_layers", num_layers);
  positive("hidden", hidden);
  positive("ffn", ffn);
  positive("heads", heads);
  positive("vocab", vocab);
  positive("vocab_divisible_by", vocab_divisible_by);
  if (hidden % heads != 0)
    fail(ErrorCode::kInvalidArgument, "model '", name, "': hidden=", hidden,
         " must be divisible by heads=", heads);
  if (query_groups < 0 || (query_groups > 0 && heads % query_groups != 0))
    fail(ErrorCode::kInvalidArgument, "model '", name, "': heads=", heads,
         " must be divisible by query_groups=", query_groups);
  if (norm != "layernorm" && norm != "rmsnorm")
    fail(ErrorCode::kInvalidArgument, "model '", name, "': field norm='", norm,
         "' must be layernorm or rmsnorm");
  // Values a checkpoint's metadata could not hold (JSON has no NaN or infinity; a negative count
  // is refused when read back): a save would write a step that no open accepts.
  if (max_position_embeddings < 0)
    fail(ErrorCode::kInvalidArgument, "model '", name, "': field max_position_embeddings=", max_position_embeddings,
         " must be >= 0 (0: no position embeddings)");
  if (!std::isfinite(qkv_version) || qkv_version < 0)
    fail(ErrorCode::kInvalidArgument, "model '", name, "': field qkv_version=", qkv_version,
         " must be a finite number >= 0 (Megatron's checkpoint_version)");
  if (!qkv_order.empty() && qkv_order != "interleaved" && qkv_order != "blocked" && qkv_order != "v1" &&
      qkv_order != "unknown")
    fail(ErrorCode::kInvalidArgument, "model '", name, "': field qkv_order='", qkv_order,
         "' must be interleaved, blocked or v1 (or left out: from qkv_version)");
  if (vocab > kMaxModelParameters)  // before padded_vocab, which must not overflow
    fail(ErrorCode::kInvalidArgument, "model '", name, "': field vocab=", vocab, " exceeds the limit of ",
         kMaxModelParameters, " (reshard's declared model limits, include/reshard/model.h)");
  check_sizes(padded_vocab(1), "");
  if (groups() != heads && (qkv_layout() == QkvOrder::kPerHeadV1 || (qkv_order.empty() && qkv_version < 2.0)))
    fail(ErrorCode::kInvalidArgument, "model '", name, "': qkv_version=", qkv_version,
         " (rows [3,np,hn] or [np,hn,3]) exists only for multi-head attention, but query_groups=",
         query_groups, " != heads=", heads, " (grouped-query rows as [Q | K | V] blocks: qkv_order: blocked)");
}

QkvOrder ModelConfig::qkv_layout() const {
  if (qkv_order == "interleaved") return QkvOrder::kInterleaved;
  if (qkv_order == "blocked") return QkvOrder::kBlocked;
  if (qkv_order == "v1") return QkvOrder::kPerHeadV1;
  if (qkv_version >= 2.0) return QkvOrder::kInterleaved;
  return qkv_version >= 1.0 ? QkvOrder::kPerHeadV1 : QkvOrder::kBlocked;
}

const char* qkv_order_name(QkvOrder o) {
  switch (o) {
    case QkvOrder::kInterleaved: return "interleaved";
    case QkvOrder::kBlocked: return "blocked";
    case QkvOrder::kPerHeadV1: return "v1";
  }
  return "?";
}

void ModelConfig::validate_for(int tp, int pp, int vpp, bool even_stages) const {
  validate();
  auto divides = [&](const char* what, int64_t n) {
    if (n % tp != 0)
      fail(ErrorCode::kInvalidArgument, "model '", name, "' does not fit tp=", tp, ": ", what, "=", n,
           " is not divisible by tp");
  };
  if (tp <= 0 || int64_t(vocab_divisible_by) * tp > kMaxModelParameters)
    fail(ErrorCode::kInvalidArgument, "model '", name, "' does not fit tp=", tp, ": tp must be > 0 and vocab_divisible_by x tp "
         "within the model limits");
  check_sizes(padded_vocab(tp), " at tp=" + std::to_string(tp));
  divides("heads", heads);
  divides("ffn", ffn);
  divides("hidden", hidden);
  if (tp > groups()) {
    if (tp % groups() != 0)
      fail(ErrorCode::kInvalidArgument, "model '", name, "' does not fit tp=", tp, ": tp > query_groups=",
           groups(), " needs tp to be a multiple of query_groups");
    if (tp_gt_groups == QkvVariant::kRefuse)
      fail(ErrorCode::kInvalidArgument, "model '", name, "': tp=", tp, " > query_groups=", groups(),
           ": the fused QKV layout differs by trainer; set tp_gt_groups to even_rows (Megatron-Core) "
           "or replicate_kv (K/V copied per rank) in the model file");
  } else if (groups() % tp != 0) {
    fail(ErrorCode::kInvalidArgument, "model '", name, "' does not fit tp=", tp, ": query_groups=",
         groups(), " is not divisible by tp");
  }
  if (!even_stages) return;
  if (pp * vpp > num_layers)
    fail(ErrorCode::kInvalidArgument, "model '", name, "' does not fit pp=", pp, ",vpp=", vpp,
         ": pp*vpp=", pp * vpp, " > num_layers=", num_layers);
  if (num_layers % (pp * vpp) != 0)
    fail(ErrorCode::kInvalidArgument, "model '", name, "' does not fit pp=", pp, ",vpp=", vpp,
         ": num_layers=", num_layers, " is not divisible by pp*vpp=", pp * vpp,
         " (reshard's own split of the layers is uniform; give an uneven one: the CLI's --target-stages "
         "2,1,1 (layers per stage); the Megatron-DeepSpeed hook takes it from the engine, "
         "build_layout(stages=...) and DeriveOptions::stage_of_layer from their caller)");
}

std::string model_differences(const ModelConfig& a, const ModelConfig& b) {
  std::string out;
  auto cmp = [&](const char* field, const std::string& x, const std::string& y) {
    if (x != y) out += std::string(out.empty() ? "" : "; ") + field + " " + x + " vs " + y;
  };
  auto n = [](int64_t v) { return std::to_string(v); };
  auto t = [](bool v) { return std::string(v ? "true" : "false"); };
  cmp("num_layers", n(a.num_layers), n(b.num_layers));
  cmp("hidden", n(a.hidden), n(b.hidden));
  cmp("ffn", n(a.ffn), n(b.ffn));
  cmp("heads", n(a.heads), n(b.heads));
  cmp("query_groups", n(a.groups()), n(b.groups()));
  cmp("vocab", n(a.vocab), n(b.vocab));
  cmp("vocab_divisible_by", n(a.vocab_divisible_by), n(b.vocab_divisible_by));
  cmp("max_position_embeddings", n(a.max_position_embeddings), n(b.max_position_embeddings));
  cmp("swiglu", t(a.swiglu), t(b.swiglu));
  cmp("tied_embeddings", t(a.tied_embeddings), t(b.tied_embeddings));
  cmp("bias", t(a.bias), t(b.bias));
  cmp("norm", a.norm, b.norm);
  cmp("param_dtype", dtype_name(a.param_dtype), dtype_name(b.param_dtype));
  if (!b.qkv_order.empty() && a.qkv_order_known() && b.qkv_order_known())
    cmp("qkv_order", qkv_order_name(a.qkv_layout()), qkv_order_name(b.qkv_layout()));
  return out;
}

std::vector<LayoutRule> default_gpt_rules(const ModelConfig& cfg) {
  const char* L = R"(layers\.\d+\.)";
  std::string l = L;
  std::vector<LayoutRule> r;
  r.push_back({R"(embedding\.word_embeddings\.weight)", Split::kVocab});
  r.push_back({R"(lm_head\.weight)", Split::kVocab});
  r.push_back({R"(embedding\.position_embeddings\.weight)", Split::kReplicated});
  r.push_back({l + R"(self_attention\.query_key_value\.(weight|bias))", Split::kQkv});
  r.push_back({l + R"(self_attention\.dense\.weight)", Split::kRow});
  r.push_back({l + R"(mlp\.dense_h_to_4h\.(weight|bias))", cfg.swiglu ? Split::kSwiglu : Split::kColumn});
  r.push_back({l + R"(mlp\.dense_4h_to_h\.weight)", Split::kRow});
  r.push_back({R"(.*(layernorm|norm)\.(weight|bias))", Split::kReplicated});
  r.push_back({l + R"((self_attention\.dense|mlp\.dense_4h_to_h)\.bias)", Split::kReplicated});
  return r;
}

namespace {

struct CompiledRule {
  LayoutRule rule;
  std::regex re;
  bool user = false;
  int matches = 0;
};

std::vector<CompiledRule> compile_rules(const ModelConfig& cfg) {
  std::vector<CompiledRule> out;
  auto add = [&](const LayoutRule& r, bool user) {
    try {
      out.push_back({r, std::regex(r.pattern, std::regex::ECMAScript), user, 0});
    } catch (const std::regex_error& e) {
      fail(ErrorCode::kInvalidArgument, "model '", cfg.name, "': rule pattern '", r.pattern,
           "' is not a valid regex: ", e.what());
    }
  };
  for (const auto& r : cfg.rules) add(r, true);
  for (const auto& r : default_gpt_rules(cfg)) add(r, false);
  return out;
}

// Matches all specs; returns false for specs no rule names.
void apply_rules(const ModelConfig& cfg, std::vector<CompiledRule>& rules,
                 std::vector<TensorSpec>& specs, std::vector<std::string>* unmatched) {
  for (auto& s : specs) {
    bool found = false;
    for (auto& r : rules) {
      if (std::regex_match(s.name, r.re)) {
        ++r.matches;
        if (!found) {
          s.split = r.rule.split;
          s.reduction = r.rule.reduction;
          found = true;
        }
        if (!r.user) break;  // built-in rules: first match only; user rules are all counted
      }
    }
    if (!found && unmatched) unmatched->push_back(s.name);
  }
  for (const auto& r : rules) {
    if (r.user && r.matches == 0)
      fail(ErrorCode::kInvalidArgument, "model '", cfg.name, "': rule '", r.rule.pattern, "' (split ",
           split_name(r.rule.split), ") matches no tensor; every rule must match at least one tensor");
  }
}

}  // namespace

void classify_tensors(const ModelConfig& cfg, std::vector<TensorSpec>& specs,
                      std::vector<std::string>* unmatched) {
  auto rules = compile_rules(cfg);
  apply_rules(cfg, rules, specs, unmatched);
}

std::vector<TensorSpec> model_tensors(const ModelConfig& cfg, int tp) {
  cfg.validate();
  if (tp <= 0) fail(ErrorCode::kInvalidArgument, "model '", cfg.name, "': tp=", tp, " must be > 0");
  cfg.check_sizes(cfg.padded_vocab(tp), " at tp=" + std::to_string(tp));
  const int64_t H = cfg.hidden, F = cfg.ffn, hn = cfg.head_dim(), ng = cfg.groups();
  const int64_t q = cfg.heads / ng;
  const int64_t qkv_rows = ng * (q + 2) * hn;
  const int64_t Vp = cfg.padded_vocab(tp);
  std::vector<TensorSpec> out;
  auto add = [&](std::string name, std::vector<int64_t> shape, Owner owner, int layer, bool nwd) {
    TensorSpec s;
    s.name = std::move(name);
    s.shape = std::move(shape);
    s.owner = owner;
    s.layer = layer;
    s.no_weight_decay = nwd;
    out.push_back(std::move(s));
  };
  Owner emb_owner = cfg.tied_embeddings ? Owner::kFirstAndLast : Owner::kFirstStage;
  add("embedding.word_embeddings.weight", {Vp, H}, emb_owner, -1, false);
  out.back().real_rows = cfg.vocab;
  if (cfg.max_position_embeddings > 0)
    add("embedding.position_embeddings.weight", {cfg.max_position_embeddings, H}, Owner::kFirstStage, -1, false);
  const bool ln_bias = cfg.norm == "layernorm";
  for (int i = 0; i < cfg.num_layers; ++i) {
    std::string p = "layers." + std::to_string(i) + ".";
    add(p + "input_layernorm.weight", {H}, Owner::kLayer, i, true);
    if (ln_bias) add(p + "input_layernorm.bias", {H}, Owner::kLayer, i, true);
    add(p + "self_attention.query_key_value.weight", {qkv_rows, H}, Owner::kLayer, i, false);
    if (cfg.bias) add(p + "self_attention.query_key_value.bias", {qkv_rows}, Owner::kLayer, i, true);
    add(p + "self_attention.dense.weight", {H, H}, Owner::kLayer, i, false);
    if (cfg.bias) add(p + "self_attention.dense.bias", {H}, Owner::kLayer, i, true);
    add(p + "post_attention_layernorm.weight", {H}, Owner::kLayer, i, true);
    if (ln_bias) add(p + "post_attention_layernorm.bias", {H}, Owner::kLayer, i, true);
    int64_t up = cfg.swiglu ? 2 * F : F;
    add(p + "mlp.dense_h_to_4h.weight", {up, H}, Owner::kLayer, i, false);
    if (cfg.bias) add(p + "mlp.dense_h_to_4h.bias", {up}, Owner::kLayer, i, true);
    add(p + "mlp.dense_4h_to_h.weight", {H, F}, Owner::kLayer, i, false);
    if (cfg.bias) add(p + "mlp.dense_4h_to_h.bias", {H}, Owner::kLayer, i, true);
  }
  add("final_layernorm.weight", {H}, Owner::kLastStage, -1, true);
  if (ln_bias) add("final_layernorm.bias", {H}, Owner::kLastStage, -1, true);
  if (!cfg.tied_embeddings) {
    add("lm_head.weight", {Vp, H}, Owner::kLastStage, -1, false);
    out.back().real_rows = cfg.vocab;
  }
  std::vector<std::string> unmatched;
  classify_tensors(cfg, out, &unmatched);
  RESHARD_CHECK(unmatched.empty(), "built-in GPT tensor without a rule: ", unmatched.front());
  return out;
}

std::vector<int> stage_of_layer_from_sizes(const std::vector<int>& sizes, int num_layers, int pp, int vpp) {
  if (vpp != 1)
    fail(ErrorCode::kInvalidArgument, "layers per stage are given for vpp=", vpp,
         ": uneven stages are supported without virtual stages only (vpp=1)");
  if (int(sizes.size()) != pp)
    fail(ErrorCode::kInvalidArgument, "layers per stage has ", sizes.size(), " entries for pp=", pp, "; give one per stage");
  std::vector<int> stage;
  for (int s = 0; s < pp; ++s) {
    if (sizes[size_t(s)] < 0)
      fail(ErrorCode::kInvalidArgument, "layers per stage: stage ", s, " has ", sizes[size_t(s)], " layers");
    for (int k = 0; k < sizes[size_t(s)]; ++k) stage.push_back(s);
  }
  if (int(stage.size()) != num_layers)
    fail(ErrorCode::kInvalidArgument, "layers per stage sum to ", stage.size(), " but the model has num_layers=", num_layers);
  return stage;
}

std::vector<int> uniform_stage_of_layer(int num_layers, int pp, int vpp) {
  std::vector<int> stage(num_layers, 0);
  int chunks = pp * vpp;
  int per_chunk = num_layers / chunks;
  for (int i = 0; i < num_layers; ++i) {
    int c = per_chunk > 0 ? i / per_chunk : 0;
    if (c >= chunks) c = chunks - 1;
    stage[i] = c % pp;
  }
  return stage;
}

}  // namespace reshard
