// Pure helpers of the DeepSpeed reader: file names and module names -> canonical tensor names.
// No I/O. Facts: shared research formats.md §1.2 (file names), §1.3-§1.4 (module and layer-file
// names), §2 (spec indices, tied modules); model.h (canonical names).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

namespace reshard::ds {

/// What a file in a DeepSpeed tag folder is, from its name alone.
struct FileName {
  enum Kind { kOther, kModel, kZero3Model, kOptim, kLayer, kMoE };
  Kind kind = kOther;
  int mp = -1;     // model-parallel rank (mp_rank_XX): pp_stage * tp + tp_rank under PP
  int dp = -1;     // zero_pp_rank_{dp}: rank inside the optimizer's data-parallel group
  int layer = -1;  // layer_{idx}: pipeline spec index
  int tp = -1;     // layer_XX-model_{tp}: the topology's model-axis rank (0 when the name has none)
  bool bf16_prefix = false;  // bf16_zero_pp_rank_...: says only that bf16 was on, not who wrote it
};
FileName parse_file_name(const std::string& name);

/// What a file holds, in words, from its parsed name: "the optimizer state of dp rank 1, mp rank 0",
/// "layer 3 of tp rank 1", ...
std::string describe(const FileName& f);

/// Checks a file's name against the name torch.save gave its archive. torch.save(obj, path) names
/// the ZIP's top-level folder after the file it writes: the file name without its last extension
/// ("archive" when it writes to a buffer or to a non-ASCII path). Checked on DeepSpeed 0.19.8 saves
/// under torch 2.13 (every file of a Megatron-DeepSpeed step folder, the demo's included) and on
/// torch.save of "b.c.pt" -> "b.c/", of "noext" -> "noext/".
/// Returns "" when the folder gives no evidence against the name: the folder is the file's own stem,
/// is not a DeepSpeed file name at all (saved through a buffer, renamed wholesale by a tool), or
/// names the same file (kind, ranks and layer equal; the bf16_ prefix is ignored, as for the file
/// names). Otherwise returns why the file is not what its name says: its folder is the name of
/// another file of a DeepSpeed save (two files swapped, or one copied over another), e.g.
/// "it was saved as layer_03-model_01-model_states.pt (layer 3 of tp rank 1) ...".
/// `file_name` is a base name ("layer_03-model_00-model_states.pt"), `folder` the archive's
/// top-level folder without the slash. Pure.
std::string archive_name_conflict(const std::string& file_name, const std::string& folder);

/// Role of a pipeline spec (or tied module), from the local parameter names inside it.
enum class SpecRole { kUnknown, kEmbedding, kTransformer, kHead, kNormCandidate, kFinalNorm };
SpecRole role_of_locals(const std::set<std::string>& locals);

/// Canonical name of a local name in a spec of a given role; `layer` is the global layer number
/// for transformer specs. Unknown roles keep `fallback` (the DeepSpeed name).
std::string canonical_in_spec(SpecRole role, int layer, const std::string& local, const std::string& fallback);

/// Canonical name of a plain-engine (non-pipeline) Megatron module name, e.g.
/// language_model.encoder.layers.3.mlp.dense_4h_to_h.weight -> layers.3.mlp.dense_4h_to_h.weight.
/// Names it does not know are returned unchanged.
std::string canonical_plain(const std::string& name);

/// A pipeline param_shapes name split into its spec index or tied-module key and the local name:
/// "3.mlp.x" -> spec 3, local "mlp.x"; "tied_modules.embed.word_embeddings.weight" -> tied "embed".
struct PipeName {
  int spec = -1;
  std::string tied;   // tied module key, "" if none
  std::string local;  // name inside the spec
};
PipeName split_pipe_name(const std::string& name);

}  // namespace reshard::ds
