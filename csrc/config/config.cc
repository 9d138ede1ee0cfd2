#include "reshard/config.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include "io/file.h"
#include "reshard/error.h"
#include "reshard/plan.h"

namespace reshard {
namespace {

// Model and resume files are a few KB; 1 MiB leaves room and stops a path to a device
// (/dev/zero, a FIFO) from being read without end (reading /dev/zero reached 7.5 GB RSS in 15 s).
constexpr uint64_t kMaxConfigBytes = uint64_t(1) << 20;

std::string read_text(const std::string& path) {
  if (io::is_dir(path))
    fail(ErrorCode::kInvalidArgument, "config file ", path, " is a folder; give the path of a YAML file");
  if (!io::exists(path)) fail(ErrorCode::kNotFound, "cannot open config file ", path, " (no such file)");
  if (!io::is_file(path))
    fail(ErrorCode::kInvalidArgument, "config file ", path, " is not a regular file (a device, FIFO or socket); give the "
         "path of a YAML file");
  if (io::file_size(path) > kMaxConfigBytes)
    fail(ErrorCode::kInvalidArgument, "config file ", path, " is ", io::file_size(path), " bytes; a model or resume "
         "file is a few KB (at most ", kMaxConfigBytes, " bytes read)");
  std::ifstream in(path);
  if (!in) fail(ErrorCode::kNotFound, "cannot open config file ", path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

YAML::Node parse_yaml(const std::string& text, const std::string& origin) {
  try {
    // One document: a second one ("---" and more keys, appended by a script) would be ignored
    // by YAML::Load, as ambiguous as a key given twice.
    const std::vector<YAML::Node> docs = YAML::LoadAll(text);
    if (docs.size() > 1)
      fail(ErrorCode::kInvalidArgument, origin, ": holds ", docs.size(), " YAML documents (separated by ---); one is expected");
    YAML::Node n = docs.empty() ? YAML::Node() : docs[0];
    if (!n.IsMap()) fail(ErrorCode::kInvalidArgument, origin, ": expected a YAML mapping at the top level");
    return n;
  } catch (const YAML::Exception& e) {
    fail(ErrorCode::kInvalidArgument, origin, ": invalid YAML at line ", e.mark.line + 1, ": ", e.msg);
  }
}

template <typename T>
T get(const YAML::Node& n, const std::string& key, const std::string& origin, T dflt) {
  const YAML::Node v = n[key];
  if (!v) return dflt;
  try {
    if (!v.IsScalar()) throw YAML::BadConversion(v.Mark());
    return v.as<T>();
  } catch (const YAML::Exception&) {
    fail(ErrorCode::kInvalidArgument, origin, ": field ", key, ": cannot read '", YAML::Dump(v), "' as the expected type");
  }
}

// `n` (the field `where`, "" at the top level) must be a mapping whose keys are names from
// `known`, each given once (yaml-cpp keeps duplicates and reads the first silently).
void check_keys(const YAML::Node& n, const std::set<std::string>& known, const std::string& origin,
                const std::string& where) {
  const std::string field = where.empty() ? "the top level" : "field " + where.substr(0, where.size() - 1);
  if (!n.IsMap()) fail(ErrorCode::kInvalidArgument, origin, ": ", field, " must be a mapping of names to values");
  std::set<std::string> seen;
  for (auto it = n.begin(); it != n.end(); ++it) {
    if (!it->first.IsScalar())
      fail(ErrorCode::kInvalidArgument, origin, ": a key under ", field, " is not a name: ", YAML::Dump(it->first));
    std::string k = it->first.as<std::string>();
    if (!seen.insert(k).second) fail(ErrorCode::kInvalidArgument, origin, ": field '", where, k, "' is given twice");
    if (!known.count(k)) {
      std::string list;
      for (const auto& x : known) list += (list.empty() ? "" : ", ") + x;
      fail(ErrorCode::kInvalidArgument, origin, ": unknown field '", where, k, "' (known: ", list, ")");
    }
  }
}

}  // namespace

ModelConfig parse_model_config(const std::string& text, const std::string& origin) {
  YAML::Node n = parse_yaml(text, origin);
  check_keys(n,
             {"name", "num_layers", "hidden", "ffn", "heads", "query_groups", "vocab", "vocab_divisible_by",
              "max_position_embeddings", "swiglu", "tied_embeddings", "bias", "norm", "param_dtype", "optimizer",
              "qkv_version", "qkv_order", "tp_gt_groups", "rules"},
             origin, "");
  ModelConfig m;
  m.name = get<std::string>(n, "name", origin, origin);
  m.num_layers = get<int>(n, "num_layers", origin, 0);
  m.hidden = get<int>(n, "hidden", origin, 0);
  m.ffn = get<int>(n, "ffn", origin, 4 * m.hidden);
  m.heads = get<int>(n, "heads", origin, 0);
  m.query_groups = get<int>(n, "query_groups", origin, 0);
  m.vocab = get<int64_t>(n, "vocab", origin, 0);
  m.vocab_divisible_by = get<int>(n, "vocab_divisible_by", origin, 128);
  m.max_position_embeddings = get<int>(n, "max_position_embeddings", origin, 0);
  m.swiglu = get<bool>(n, "swiglu", origin, false);
  m.tied_embeddings = get<bool>(n, "tied_embeddings", origin, false);
  m.bias = get<bool>(n, "bias", origin, true);
  m.norm = get<std::string>(n, "norm", origin, "layernorm");
  try {
    m.param_dtype = dtype_from_name(get<std::string>(n, "param_dtype", origin, "bf16"));
  } catch (const Error& e) {
    fail(ErrorCode::kInvalidArgument, origin, ": field param_dtype: ", e.what());
  }
  m.optimizer = get<std::string>(n, "optimizer", origin, "adam");
  if (m.optimizer != "adam" && m.optimizer != "adamw")
    fail(ErrorCode::kInvalidArgument, origin, ": field optimizer='", m.optimizer, "': only adam/adamw (fp32 master + moments) is supported");
  m.qkv_version = get<double>(n, "qkv_version", origin, 3.0);
  m.qkv_order = get<std::string>(n, "qkv_order", origin, "");
  try {
    m.tp_gt_groups = qkv_variant_from_name(get<std::string>(n, "tp_gt_groups", origin, "refuse"));
  } catch (const Error& e) {
    fail(ErrorCode::kInvalidArgument, origin, ": field tp_gt_groups: ", e.what());
  }
  if (const YAML::Node rules = n["rules"]) {
    if (!rules.IsSequence()) fail(ErrorCode::kInvalidArgument, origin, ": field rules must be a list");
    for (size_t i = 0; i < rules.size(); ++i) {
      const YAML::Node r = rules[i];
      std::string where = "rules[" + std::to_string(i) + "].";
      check_keys(r, {"pattern", "split", "reduction"}, origin, where);
      LayoutRule lr;
      lr.pattern = get<std::string>(r, "pattern", origin, "");
      if (lr.pattern.empty()) fail(ErrorCode::kInvalidArgument, origin, ": field ", where, "pattern is missing");
      try {
        lr.split = split_from_name(get<std::string>(r, "split", origin, "replicated"));
      } catch (const Error& e) {
        fail(ErrorCode::kInvalidArgument, origin, ": field ", where, "split: ", e.what());
      }
      std::string red = get<std::string>(r, "reduction", origin, "replicated");
      if (red == "replicated") lr.reduction = Reduction::kReplicated;
      else if (red == "partial_sum") lr.reduction = Reduction::kPartialSum;
      else fail(ErrorCode::kInvalidArgument, origin, ": field ", where, "reduction='", red, "' must be replicated or partial_sum");
      m.rules.push_back(lr);
    }
  }
  try {
    m.validate();
  } catch (const Error& e) {
    fail(ErrorCode::kInvalidArgument, origin, ": ", e.what());
  }
  return m;
}

ModelConfig load_model_config(const std::string& path) { return parse_model_config(read_text(path), path); }

ResumeConfig load_resume_config(const std::string& path) {
  YAML::Node n = parse_yaml(read_text(path), path);
  check_keys(n, {"checkpoint", "model", "target", "elastic", "policies", "verify"}, path, "");
  ResumeConfig rc;
  if (const YAML::Node c = n["checkpoint"]) {
    check_keys(c, {"root", "step"}, path, "checkpoint.");
    rc.checkpoint = get<std::string>(c, "root", path, "");
    rc.step = get<std::string>(c, "step", path, "");
  }
  if (rc.checkpoint.empty()) fail(ErrorCode::kInvalidArgument, path, ": field checkpoint.root is missing");
  rc.model = get<std::string>(n, "model", path, "");
  rc.verify = get<std::string>(n, "verify", path, kDefaultVerify);
  if (rc.verify != "free" && rc.verify != "full" && rc.verify != "off")
    fail(ErrorCode::kInvalidArgument, path, ": field verify is '", rc.verify, "'; expected free, full or off");
  const std::string target = get<std::string>(n, "target", path, "");
  rc.target_auto = target == "auto";
  if (!rc.target_auto) {
    try {
      rc.target = Topology::parse(target);
    } catch (const Error& e) {
      fail(ErrorCode::kInvalidArgument, path, ": field target: ", e.what(), " (or 'auto': chosen at restart)");
    }
  }
  if (const YAML::Node e = n["elastic"]) {
    if (!rc.target_auto)
      fail(ErrorCode::kInvalidArgument, path, ": field elastic is given but target is a fixed layout; ",
           "write target: auto to let the restart choose it");
    check_keys(e, {"policy", "allowed"}, path, "elastic.");
    try {
      rc.elastic_policy = ElasticPolicy::parse_kind(get<std::string>(e, "policy", path, "keep"));
    } catch (const Error& x) {
      fail(ErrorCode::kInvalidArgument, path, ": field elastic.policy: ", x.what());
    }
    if (const YAML::Node a = e["allowed"]) {
      if (!a.IsSequence()) fail(ErrorCode::kInvalidArgument, path, ": field elastic.allowed must be a list of layouts");
      for (size_t i = 0; i < a.size(); ++i) {
        const std::string where = "elastic.allowed[" + std::to_string(i) + "]";
        if (!a[i].IsScalar()) fail(ErrorCode::kInvalidArgument, path, ": field ", where, " must be a layout string");
        const std::string text = a[i].as<std::string>();
        try {
          parse_candidate(text, Topology{});
        } catch (const Error& x) {
          fail(ErrorCode::kInvalidArgument, path, ": field ", where, ": ", x.what());
        }
        rc.elastic_allowed.push_back(text);
      }
    }
    if (rc.elastic_policy == ElasticPolicy::Kind::kAllowedList && rc.elastic_allowed.empty())
      fail(ErrorCode::kInvalidArgument, path, ": field elastic.allowed is missing or empty; policy list needs ",
           "the layouts to choose from, in order of preference");
    if (rc.elastic_policy != ElasticPolicy::Kind::kAllowedList && !rc.elastic_allowed.empty())
      fail(ErrorCode::kInvalidArgument, path, ": field elastic.allowed is given with policy '",
           ElasticPolicy::kind_name(rc.elastic_policy), "', which does not read it; write policy: list");
  }
  if (const YAML::Node p = n["policies"]) {
    check_keys(p, {"replicas", "replica_atol", "strict_missing", "strict_unexpected", "memory_budget_bytes",
                   "memory_budget_gib", "dedup", "compare_replicas", "weights_from_master", "node_local_reads",
                   "vocab_padding"},
               path, "policies.");
    try {
      rc.plan.replica_policy = replica_policy_from_name(get<std::string>(p, "replicas", path, "error"));
    } catch (const Error& e) {
      fail(ErrorCode::kInvalidArgument, path, ": field policies.replicas: ", e.what());
    }
    rc.plan.replica_atol = get<double>(p, "replica_atol", path, 0.0);
    if (!(rc.plan.replica_atol >= 0))
      fail(ErrorCode::kInvalidArgument, path, ": field policies.replica_atol must be a number >= 0, got ", rc.plan.replica_atol);
    const std::string vp = get<std::string>(p, "vocab_padding", path, "warn");
    if (vp != "warn" && vp != "refuse")
      fail(ErrorCode::kInvalidArgument, path, ": field policies.vocab_padding is '", vp, "'; expected warn or refuse");
    rc.plan.refuse_vocab_padding_change = vp == "refuse";
    rc.plan.strict_missing = get<bool>(p, "strict_missing", path, true);
    rc.plan.strict_unexpected = get<bool>(p, "strict_unexpected", path, true);
    if (p["memory_budget_gib"] && p["memory_budget_bytes"])
      fail(ErrorCode::kInvalidArgument, path, ": fields policies.memory_budget_gib and policies.memory_budget_bytes are ",
           "both given; give one");
    if (p["memory_budget_gib"]) {
      const double gib = get<double>(p, "memory_budget_gib", path, 1.0);
      if (!(gib > 0) || !std::isfinite(gib) || gib >= double(1ull << 34))
        fail(ErrorCode::kInvalidArgument, path, ": field policies.memory_budget_gib must be a positive number of GiB, got ", gib);
      rc.plan.memory_budget = uint64_t(gib * double(1ull << 30));
    }
    if (p["memory_budget_bytes"]) {
      const int64_t b = get<int64_t>(p, "memory_budget_bytes", path, 0);
      if (b <= 0) fail(ErrorCode::kInvalidArgument, path, ": field policies.memory_budget_bytes must be positive, got ", b);
      rc.plan.memory_budget = uint64_t(b);
    }
    if ((p["memory_budget_gib"] || p["memory_budget_bytes"]) && rc.plan.memory_budget < kMinMemoryBudget)
      fail(ErrorCode::kInvalidArgument, path, ": field policies.", p["memory_budget_gib"] ? "memory_budget_gib" : "memory_budget_bytes",
           " gives ", rc.plan.memory_budget, " bytes, below the minimum of ", kMinMemoryBudget,
           " bytes (64 KiB): a wave must hold at least one chunk of a piece");
    rc.plan.dedup = get<bool>(p, "dedup", path, true);
    rc.plan.compare_replicas = get<bool>(p, "compare_replicas", path, true);
    rc.plan.weights_from_master = get<bool>(p, "weights_from_master", path, true);
    rc.plan.node_local_reads = get<bool>(p, "node_local_reads", path, true);
  }
  return rc;
}

}  // namespace reshard
