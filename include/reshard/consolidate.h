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
  /// Pipeline stage of each global layer at the target (may be uneven, see
  /// stage_of_layer_from_sizes); empty: the uniform split, which needs pp*vpp to divide the layers.
  std::vector<int> stage_of_layer;
  /// The target's fused QKV row order ("interleaved" or "blocked"; ModelConfig::qkv_order);
  /// empty: the source's.
  std::string qkv_order;
  /// The target's vocab_divisible_by (Megatron's --make-vocab-size-divisible-by): vocab tensors
  /// get ceil(vocab / (d * tp)) * d * tp rows; 0: the source's.
  int vocab_divisible_by = 0;
};

/// The layout of the source's own tensors (names, global shapes, splits, stage owners) under
/// another topology, with the param groups derive_layout would build. Tensors that no layout rule
/// of the source's model names (a reader inferred them as replicated) keep their split only while
/// tp does not change: a tp change for them is refused with Error(kInvalidArgument) naming them
/// (failures.md B05: add a rule for them in the model file). A source given box by box
/// (Layout::explicit_boxes, a DCP checkpoint) has no such rules: its like-layout at dp=N cuts dim 0
/// of every tensor as FSDP2 does (torch.chunk: ceil(rows / N) rows per rank), and any tp, pp or
/// vpp other than 1 is kInvalidArgument.
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

/// One tensor at one tp rank whose stored weights are not its fp32 master weights rounded.
struct MasterMismatch {
  std::string tensor;
  int tp_rank = 0;
  DType weight_dtype = DType::BF16;  // the dtype the checkpoint stores the weights in
  int64_t compared = 0;              // elements of the tp rank's shard (vocab padding rows included)
  int64_t differing = 0;             // elements where weight != master rounded to weight_dtype
  std::string first;                 // index of the first of them in the tp rank's shard, "[r, c]"
  float weight = 0, master = 0;      // the two values there
  /// Replicated over tp (tp > 1): compared once, on tp rank 0's copy (the one a load uses).
  bool replicated = false;
  std::string weight_files, master_files;  // file names holding the two on this tp rank
  /// "tensor T (tp rank r): K of N weight elements differ from the fp32 master rounded to BF16
  /// (first at [r, c] ...: weight w, master m); the model files and the optimizer files disagree ..."
  /// (fp32 weights: "... differ from the fp32 master (first at ..."), ending "...: weights in
  /// layer_03-model_01-model_states.pt, master in zero_pp_rank_0_mp_rank_01_optim_states.pt, ...".
  /// A tensor replicated over tp says "(replicated over tp, tp rank 0's copy)".
  std::string to_string() const;
};

struct MasterCheck {
  int64_t tensors_checked = 0;   // tensors with both weights and an fp32 master stored
  int64_t elements_checked = 0;  // summed over tp ranks
  uint64_t bytes_read = 0;       // read from the checkpoint for it (replica comparisons included)
  int64_t tensors_direct = 0;    // of tensors_checked: compared straight out of the file mappings
  /// Most bytes of weights and masters held at once (all tp ranks' shards): at most
  /// options.memory_budget (a larger tensor is compared a range of its elements at a time),
  /// unless a budget smaller than one element of every shard is given.
  uint64_t peak_bytes_held = 0;
  std::vector<MasterMismatch> mismatches;
};

/// Checks that every tensor's stored weights equal its fp32 master weights rounded (to nearest
/// even) to the weights' dtype, element by element at the checkpoint's own tp. Mixed-precision
/// optimizers keep that true in every checkpoint saved between steps: the master starts as a copy
/// of the 16-bit (or fp32) parameters, and each step writes the updated master back into them
/// (DeepSpeed 0.19.8: runtime/zero/stage_1_and_2.py's step copies each fp32 partition into the
/// bit16 partition, then all-gathers it; runtime/bf16_optimizer.py's update_lp_params does the
/// same; Megatron's mixed-precision optimizers copy main params to model params after the step.
/// A checkpoint whose files come from one save holds both sides of that copy). A difference means the 16-bit model files and the optimizer files disagree: two
/// tp ranks' layer files swapped (same shapes, every checksum valid), files from different saves,
/// or weights edited without their master; a load would start from the weights and the first
/// step would overwrite them from the master. Tensors without both a stored weight and a stored
/// master (ZeRO-3 checkpoints store no 16-bit weights; weights-only checkpoints) are skipped.
/// Memory: the weights and masters of a batch of tensors at a time, at most
/// options.memory_budget bytes; a tensor larger than that (an embedding, a fused SwiGLU
/// dense_h_to_4h or QKV) is compared a range of its shards' elements, in stored order, at a time,
/// whatever its dims, so MasterCheck::peak_bytes_held stays within the budget (unless a tensor's
/// pieces are not dense in their buffers: then that tensor is held whole; no format here stores
/// such pieces). Errors: the reader's
/// read errors; Error(kDataLoss) when a region is covered by no file, or (options.replicas)
/// copies of a replicated weight or master differ. Used by `reshard verify`, by loads with
/// verify="full" and by `convert --verify full`.
struct MasterCheckOptions {
  /// Bytes of weights and masters held at a time, over all threads (each thread reuses one
  /// buffer of its share batch after batch).
  uint64_t memory_budget = uint64_t(64) << 20;
  /// Threads comparing batches of tensors at once: 0 for default_threads() (io/parallel.h).
  int threads = 0;
  /// Only this part's share of the tensors with both stored, so the ranks of a load share the
  /// work: the tensors go to the parts by bytes (largest first, each to the part with the fewest
  /// bytes so far; ties to the lower part), the same split on every rank.
  int part = 0, parts = 1;
  /// Compare the copies of replicated tensors too (the planner's replica check, policy error).
  /// Off: the first copy of each is compared with the master, the others are not read (a load
  /// compares replicas itself, under its own policy).
  bool replicas = true;
  /// With replicas off: compare each tensor whose pieces allow it straight out of the reader's
  /// file mappings (no plan, no copy: a weight run against its master run, the master rounded
  /// slab by slab), the others through a consolidation into held buffers. Same findings either
  /// way (tests compare the two); false: every tensor through the consolidation.
  bool direct = true;
};
MasterCheck check_weights_against_master(const CheckpointReader& reader, const MasterCheckOptions& options = {});

/// In-memory buffers of a layout as a source: file i is buffer i (offset 0). With `memory_read`
/// (buffers[i] points at buffer i's bytes) it lets a target be consolidated or planned from again
/// (A -> B -> A checks).
SourceLayout memory_source(const Layout& layout);
ReadFn memory_read(const Layout& layout, const std::vector<const void*>& buffers);

}  // namespace reshard
