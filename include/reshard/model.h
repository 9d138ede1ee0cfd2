// Model description and tensor-parallel rules: which tensors a GPT-style model has, their global
// shapes, and how each is split over tp ranks.
//
// Canonical tensor names use global layer numbers (never stage-local ones):
//   embedding.word_embeddings.weight          [Vp, H]    vocab-parallel (rows split over tp)
//   embedding.position_embeddings.weight      [S, H]     replicated (learned positions only)
//   layers.{i}.input_layernorm.{weight,bias}  [H]        replicated
//   layers.{i}.self_attention.query_key_value.{weight,bias}  [ng*(q+2)*hn, H]  fused QKV
//   layers.{i}.self_attention.dense.weight    [H, H]     row-parallel (dim 1); bias replicated
//   layers.{i}.post_attention_layernorm.*     [H]        replicated
//   layers.{i}.mlp.dense_h_to_4h.{weight,bias} [F or 2F, H] column-parallel (SwiGLU: fused gate/up)
//   layers.{i}.mlp.dense_4h_to_h.weight       [H, F]     row-parallel; bias replicated
//   final_layernorm.{weight,bias}             [H]        replicated
//   lm_head.weight                            [Vp, H]    vocab-parallel (absent when tied)
// Facts: Megatron-DeepSpeed megatron/model/{transformer,language_model,gpt_model}.py and
// megatron/core/tensor_parallel/layers.py (shared research formats.md §1.4, §4).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reshard/dtype.h"

namespace reshard {

/// How a tensor is split over tp ranks. Fused kinds have a logical view in which every tp shard
/// is a box (DESIGN.md): SwiGLU [2F, H] is viewed as [2, F, H] split on dim 1; grouped-query QKV
/// [ng*(q+2)*hn, H] as [ng, q+2, hn, H] split on dim 0.
enum class Split : uint8_t {
  kReplicated,  // every tp rank holds the whole tensor (a replica per tp rank)
  kColumn,      // dim 0 split evenly
  kRow,         // dim 1 split evenly
  kVocab,       // dim 0 split evenly over the padded vocab; rows >= vocab are padding (data)
  kQkv,         // fused query/key/value rows, see QkvVariant and qkv_version
  kSwiglu,      // fused [gate; up] rows, each half split evenly
};
const char* split_name(Split s);
Split split_from_name(const std::string& s);  // "replicated", "column", "row", "vocab", "qkv", "swiglu"

/// How a trainer lays out fused QKV when tp > query groups (the files differ by trainer).
enum class QkvVariant : uint8_t {
  kRefuse,       // error: the layout is ambiguous (default)
  kEvenRows,     // the fused rows are split evenly over tp (Megatron-Core)
  kReplicateKv,  // each rank holds its query heads plus a copy of its group's K and V
};
const char* qkv_variant_name(QkvVariant v);
QkvVariant qkv_variant_from_name(const std::string& s);

/// Row order of the fused QKV tensor within each tp rank's rows. A property of the code that
/// wrote (or will read) the tensor, not of Megatron's checkpoint_version alone: upstream
/// Megatron-DeepSpeed splits each rank's rows as three contiguous blocks since its FPDT change
/// (676a482c, 2024-12) while still recording checkpoint_version 3.0.
enum class QkvOrder : uint8_t {
  kInterleaved,  // [groups, heads/groups + 2, hn] per rank (Megatron checkpoint_version >= 2; MHA: [np, 3, hn])
  kBlocked,      // [Q | K | V] per rank: np*hn query rows, then groups*hn K rows, then V (version 0: [3, np, hn])
  kPerHeadV1,    // [np, hn, 3] per rank (Megatron checkpoint_version 1.x; MHA only)
};
const char* qkv_order_name(QkvOrder o);  // "interleaved", "blocked", "v1"

/// Value semantics across tp ranks.
enum class Reduction : uint8_t { kReplicated, kPartialSum };

/// Which pipeline stages hold a tensor.
enum class Owner : uint8_t { kLayer, kFirstStage, kLastStage, kFirstAndLast };

struct LayoutRule {
  std::string pattern;  // ECMAScript regex matched against the whole canonical name
  Split split = Split::kReplicated;
  Reduction reduction = Reduction::kReplicated;
};

/// Declared model limits, checked by ModelConfig::validate before any plan or write: at most
/// 2^44 parameters in all (about 17.6 trillion, ten times the largest dense models published;
/// each tensor, padded vocab included, within that) and 16384 layers. With them every element
/// count, and every byte count of the weights and the fp32 optimizer state (at most 16 bytes per
/// parameter), fits int64 with room to spare, and a metadata-only plan stays within a few hundred
/// MB (its fragments are cut to the memory budget: a 2^44-parameter model at the default 1 GiB
/// planned in 0.34 GB). A config beyond them is refused naming the field or tensor.
inline constexpr int64_t kMaxModelParameters = int64_t(1) << 44;
inline constexpr int kMaxModelLayers = 16384;

struct ModelConfig {
  std::string name;
  int num_layers = 0;
  int hidden = 0;
  int ffn = 0;                  // ffn hidden size F (SwiGLU: dense_h_to_4h has 2F rows)
  int heads = 0;
  int query_groups = 0;         // 0 means heads (multi-head attention)
  int64_t vocab = 0;            // real vocabulary size V
  int vocab_divisible_by = 128; // Megatron's make_vocab_size_divisible_by
  int max_position_embeddings = 0;  // > 0: learned absolute position embeddings
  bool swiglu = false;
  bool tied_embeddings = false;
  bool bias = true;             // add_bias_linear
  std::string norm = "layernorm";  // "layernorm" (weight, bias) or "rmsnorm" (weight)
  DType param_dtype = DType::BF16;
  std::string optimizer = "adam";  // Adam/AdamW with fp32 master weights
  double qkv_version = 3.0;     // Megatron checkpoint_version: 0 -> [3,np,hn], 1.0 -> [np,hn,3], >=2 -> [np,3,hn]
  /// The QKV row order when stated: "interleaved", "blocked", "v1"; "" = from qkv_version;
  /// "unknown" = a reader could not tell (layouts assume qkv_version's order, and the planner
  /// refuses any load that would re-cut QKV rows: a tp change or a different target order).
  std::string qkv_order;
  QkvVariant tp_gt_groups = QkvVariant::kRefuse;
  /// Rules added before the built-in GPT rules (the first matching rule wins).
  std::vector<LayoutRule> rules;

  int groups() const { return query_groups > 0 ? query_groups : heads; }
  /// The order QKV rows are laid out in: qkv_order when stated, else qkv_version's meaning
  /// (0 -> blocked, [1, 2) -> v1, >= 2 -> interleaved).
  QkvOrder qkv_layout() const;
  bool qkv_order_known() const { return qkv_order != "unknown"; }
  int head_dim() const { return hidden / heads; }
  /// Padded vocab at tensor parallel size tp: the smallest multiple of vocab_divisible_by*tp
  /// that is >= vocab [Megatron tokenizer.py _vocab_size_with_padding].
  int64_t padded_vocab(int tp) const;
  /// Field checks, the declared size limits included (kMaxModelParameters, kMaxModelLayers).
  /// Throws Error(kInvalidArgument) naming the field and the rule.
  void validate() const;
  /// The size limits at a padded vocab (validate: tp=1; validate_for: the topology's tp).
  /// Throws Error(kInvalidArgument) naming the count that exceeds its limit; `where` is appended
  /// to the model's name in the message (e.g. " at tp=8").
  void check_sizes(int64_t padded_vocab_rows, const std::string& where) const;
  /// Checks that the model fits a topology: tp divides heads, groups, ffn, hidden (row split);
  /// tp > groups needs a variant other than refuse; with `even_stages`, pp*vpp <= layers and
  /// divides them (the uniform split reshard derives itself). A trainer that gives its own stage of
  /// each layer (DeepSpeed's PipelineModule partitions unevenly, e.g. 4 layers over pp=3) passes
  /// even_stages=false. Throws Error(kInvalidArgument) naming the field and the rule.
  void validate_for(int tp, int pp, int vpp, bool even_stages = true) const;
};

/// The fields on which two descriptions of one model disagree, as "hidden 4 vs 8; swiglu false
/// vs true" (first `a`, then `b`), or "" when they agree on everything that decides tensor shapes,
/// cuts and dtypes: num_layers, hidden, ffn, heads, query groups, vocab, vocab_divisible_by,
/// max_position_embeddings, swiglu, tied_embeddings, bias, norm, param_dtype and the QKV row order
/// (compared only where `b` states qkv_order and neither is "unknown"). The name is not compared.
std::string model_differences(const ModelConfig& a, const ModelConfig& b);

struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;  // global shape as the trainer sees it at this side's tp (Vp rows for vocab)
  Split split = Split::kReplicated;
  Reduction reduction = Reduction::kReplicated;
  Owner owner = Owner::kLayer;
  int layer = -1;              // global layer index for Owner::kLayer
  bool no_weight_decay = false;  // Megatron param group: biases and norms
  int64_t real_rows = -1;      // vocab tensors: V (rows >= V are padding)
};

/// The built-in rules for GPT-family canonical names (the QKV/SwiGLU rules follow the config).
std::vector<LayoutRule> default_gpt_rules(const ModelConfig& cfg);

/// Every tensor of the model in the trainer's parameter order (embedding, layers, final norm,
/// head), with global shapes at tensor-parallel size tp. Rules are applied (cfg.rules first, then
/// the defaults); each rule in cfg.rules must match at least one tensor, else Error(kInvalidArgument)
/// naming the rule (failures.md B09).
std::vector<TensorSpec> model_tensors(const ModelConfig& cfg, int tp);

/// Applies rules to tensors discovered in a checkpoint (name + shape). A tensor no rule names is
/// reported in `unmatched`; each cfg.rules entry must match something (B09).
void classify_tensors(const ModelConfig& cfg, std::vector<TensorSpec>& specs,
                      std::vector<std::string>* unmatched);

/// Pipeline stage of each global layer: layers split evenly into pp*vpp chunks; chunk c goes to
/// stage c % pp (interleaved). Returns a vector of size num_layers.
std::vector<int> uniform_stage_of_layer(int num_layers, int pp, int vpp);

/// Pipeline stage of each global layer from the number of layers on each stage, in stage order
/// (`{2, 1, 1}`: layers 0-1 on stage 0, layer 2 on stage 1, layer 3 on stage 2; how DeepSpeed's
/// PipelineModule may split 4 layers over pp=3). Throws Error(kInvalidArgument) naming the rule:
/// one size per stage (pp of them), none negative, summing to num_layers, and vpp == 1 (an
/// interleaved schedule's chunks are not described by per-stage sizes).
std::vector<int> stage_of_layer_from_sizes(const std::vector<int>& layers_per_stage, int num_layers, int pp, int vpp);

}  // namespace reshard
