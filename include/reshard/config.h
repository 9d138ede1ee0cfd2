// YAML configuration: model descriptions (configs/models/*.yaml) and resume policies
// (configs/resume/*.yaml), read once into plain structs. Errors name the file and the field.
#pragma once

#include <string>
#include <vector>

#include "reshard/elastic.h"
#include "reshard/model.h"
#include "reshard/plan.h"
#include "reshard/reshard.h"
#include "reshard/topology.h"

namespace reshard {

/// Reads a model file. Keys: name, num_layers, hidden, ffn, heads, query_groups, vocab,
/// vocab_divisible_by, max_position_embeddings, swiglu, tied_embeddings, bias, norm,
/// param_dtype, optimizer, qkv_version, tp_gt_groups, rules: [{pattern, split, reduction}].
/// Unknown keys are an error (a typo must not be ignored). Throws Error(kNotFound) for a missing
/// file, Error(kInvalidArgument) naming "FILE: field F: rule" otherwise.
ModelConfig load_model_config(const std::string& path);
/// Same from YAML text (`origin` names it in messages).
ModelConfig parse_model_config(const std::string& yaml_text, const std::string& origin);

/// What a trainer reads on restart: which checkpoint, the target layout and the policies.
struct ResumeConfig {
  std::string checkpoint;     // root folder
  std::string step;           // "" = latest
  std::string model;          // model file ("" = from the checkpoint's metadata / args)
  Topology target;            // layout of the job that starts now (unset when target_auto)
  bool target_auto = false;   // `target: auto`: choose_layout() picks it from the saved layout,
                              // the job's world size and `elastic`
  ElasticPolicy::Kind elastic_policy = ElasticPolicy::Kind::kKeepModelParallel;
  std::vector<std::string> elastic_allowed;  // policy list: candidates as written (parse_candidate)
  PlanOptions plan;           // replica policy and tolerance, strictness, memory budget, dedup
  std::string verify = kDefaultVerify;  // LoadOptions::verify: full | free | off
};
/// Keys: checkpoint: {root, step}, model, target: "tp=..,pp=.." or "auto",
/// elastic: {policy: keep|list|refuse, allowed: ["tp=2,pp=2", ...]} (only with target: auto;
/// policy list needs allowed), verify: full|free|off (default kDefaultVerify),
/// policies: {replicas: error|average|first,
/// replica_atol, strict_missing, strict_unexpected, memory_budget_bytes (or memory_budget_gib), dedup,
/// compare_replicas, weights_from_master, node_local_reads, vocab_padding: warn|refuse}.
ResumeConfig load_resume_config(const std::string& path);

}  // namespace reshard
