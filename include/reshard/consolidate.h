// Consolidation: every tensor and optimizer state of a checkpoint as one full (tp=1, pp=1, dp=1,
// ZeRO-0) tensor in memory, by planning to that layout and running the plan in memory
// (simulate_plan). Generic over CheckpointReader (native and DeepSpeed alike); used by `diff`,
// `convert`, `inspect --stats` and the tests. Memory: the whole consolidated state (4 bytes per
// element per state kind); meant for inspection and tests, not for large-scale loads.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/layout.h"
#include "reshard/plan.h"
#include "reshard/simulate.h"

namespace reshard {

struct LikeOptions {
  /// Vocab tensors keep the source's padded row count (no padding row dropped or added) instead of
  /// the Megatron padding at the target's tp.
  bool keep_source_vocab_rows = false;
  /// Include the optimizer state kinds (fp32 master, exp_avg, exp_avg_sq) when the source has them.
  bool optimizer = true;
  /// 16-bit weights on dp rank 0 only (a saved checkpoint) instead of every rank (a live job).
  bool weights_on_dp0_only = false;
};

/// The layout of the source's own tensors (names, global shapes, splits, stage owners) under
/// another topology, with the param groups derive_layout would build. Tensors that no layout rule
/// of the source's model names (a reader inferred them as replicated) keep their split only while
/// tp does not change: a tp change for them is refused with Error(kInvalidArgument) naming them
/// (failures.md B05: add a rule for them in the model file).
Layout layout_like(const SourceLayout& source, const Topology& target, const LikeOptions& options = {});

/// Tensor names of `source` that no rule of its model names (see layout_like).
std::vector<std::string> inferred_tensors(const SourceLayout& source);

struct ConsolidateOptions {
  bool optimizer = true;  // also fp32, exp_avg, exp_avg_sq (when the source has them)
  ReplicaPolicy replica_policy = ReplicaPolicy::kError;
  double replica_atol = 0.0;
  bool compare_replicas = true;
};

struct ConsolidatedTensor {
  std::vector<int64_t> shape;  // global shape; vocab tensors: the source's padded rows
  int64_t real_rows = -1;      // vocab tensors: rows >= real_rows are padding (data)
  DType dtype = DType::F32;    // dtype the values were stored in (values are exact in float)
  std::vector<float> values;   // row-major over `shape`; fused tensors as the tp=1 trainer holds
                               // them (SwiGLU [gate; up], QKV grouped rows)
};

struct Consolidated {
  std::map<std::string, ConsolidatedTensor> states[kNumStateKinds];  // by StateKind
  std::vector<ReplicaCompare> compares;  // replica comparisons made (plan order)
  std::vector<ReplicaResult> replicas;   // their max |diff|
  std::vector<std::string> notes;        // the plan's notes
  const std::map<std::string, ConsolidatedTensor>& operator[](StateKind s) const { return states[int(s)]; }
};

/// Consolidates a source whose bytes come from `read`. Throws the planner's and executor's
/// errors (coverage: kDataLoss listing uncovered regions; replicas differing under policy error:
/// kDataLoss with max |diff|).
Consolidated consolidate_source(const SourceLayout& source, const ReadFn& read, const ConsolidateOptions& options = {});

/// Consolidates a checkpoint. A coverage error also names the reader's missing files.
Consolidated consolidate(const CheckpointReader& reader, const ConsolidateOptions& options = {});

/// One state kind only, as name -> values.
std::map<std::string, std::vector<float>> consolidate(const CheckpointReader& reader, StateKind state,
                                                      const ConsolidateOptions& options = {});

/// In-memory buffers of a layout as a source: file i is buffer i (offset 0). With `memory_read`
/// (buffers[i] points at buffer i's bytes) it lets a target be consolidated or planned from again
/// (A -> B -> A checks).
SourceLayout memory_source(const Layout& layout);
ReadFn memory_read(const Layout& layout, const std::vector<const void*>& buffers);

}  // namespace reshard
