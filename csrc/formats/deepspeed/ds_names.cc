#include "formats/deepspeed/ds_names.h"

#include <cctype>
#include <regex>

namespace reshard::ds {

namespace {
int to_int(const std::string& s) {
  if (s.empty() || s.size() > 9) return -1;
  for (char c : s)
    if (!std::isdigit(static_cast<unsigned char>(c))) return -1;
  return std::stoi(s);
}
bool starts_with(const std::string& s, const std::string& p) { return s.compare(0, p.size(), p) == 0; }
}  // namespace

FileName parse_file_name(const std::string& name) {
  // [DS engine.py _get_ckpt_name, _get_zero_ckpt_name, _get_expert_ckpt_name; pipe/module.py ckpt_layer_path]
  static const std::regex model(R"(mp_rank_(\d+)_model_states\.pt)");
  static const std::regex zero3_model(R"(zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt)");
  static const std::regex optim(R"((bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt)");
  static const std::regex layer(R"(layer_(\d+)-model_(\d+)-model_states\.pt)");
  static const std::regex layer_no_model(R"(layer_(\d+)-model_states\.pt)");
  static const std::regex moe(R"((layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_\d+_mp_rank_\d+_optim_states\.pt)");
  FileName f;
  std::smatch m;
  if (std::regex_match(name, m, zero3_model)) {
    f.kind = FileName::kZero3Model;
    f.dp = to_int(m[1]);
    f.mp = to_int(m[2]);
  } else if (std::regex_match(name, m, optim)) {
    f.kind = FileName::kOptim;
    f.bf16_prefix = m[1].matched;
    f.dp = to_int(m[2]);
    f.mp = to_int(m[3]);
  } else if (std::regex_match(name, m, moe)) {
    f.kind = FileName::kMoE;
  } else if (std::regex_match(name, m, model)) {
    f.kind = FileName::kModel;
    f.mp = to_int(m[1]);
  } else if (std::regex_match(name, m, layer)) {
    f.kind = FileName::kLayer;
    f.layer = to_int(m[1]);
    f.tp = to_int(m[2]);
  } else if (std::regex_match(name, m, layer_no_model)) {
    f.kind = FileName::kLayer;
    f.layer = to_int(m[1]);
    f.tp = 0;
  }
  if (f.kind != FileName::kOther && f.kind != FileName::kMoE && (f.mp < -1 || f.dp < -1 || f.layer < -1 || f.tp < -1))
    f.kind = FileName::kOther;  // numbers too large to be real
  return f;
}

std::string describe(const FileName& f) {
  const std::string mp = "mp rank " + std::to_string(f.mp), dp = "dp rank " + std::to_string(f.dp);
  switch (f.kind) {
    case FileName::kModel: return "the model states of " + mp;
    case FileName::kZero3Model: return "the ZeRO-3 model states of " + dp + ", " + mp;
    case FileName::kOptim: return "the optimizer state of " + dp + ", " + mp;
    case FileName::kLayer: return "pipeline layer " + std::to_string(f.layer) + " of tp rank " + std::to_string(f.tp);
    case FileName::kMoE: return "an expert file";
    default: return "a file that is not part of a DeepSpeed save";
  }
}

std::string archive_name_conflict(const std::string& file_name, const std::string& folder) {
  const size_t dot = file_name.find_last_of('.');
  const std::string stem = dot == std::string::npos ? file_name : file_name.substr(0, dot);
  if (folder == stem) return "";
  // The folder carries no extension; DeepSpeed's names all end in .pt.
  const FileName was = parse_file_name(folder + ".pt"), is = parse_file_name(file_name);
  if (was.kind == FileName::kOther || was.kind == FileName::kMoE) return "";
  if (was.kind == is.kind && was.mp == is.mp && was.dp == is.dp && was.layer == is.layer && was.tp == is.tp)
    return "";
  return "it was saved as " + folder + ".pt (its archive's top-level folder is '" + folder +
         "/', and torch.save names that folder after the file it writes), so it holds " + describe(was) +
         ", not " + describe(is) + " as its name says: files of this save were renamed, swapped or copied over one " +
         "another after it was written";
}

SpecRole role_of_locals(const std::set<std::string>& locals) {
  if (locals.empty()) return SpecRole::kUnknown;
  if (locals.count("word_embeddings.weight")) return SpecRole::kEmbedding;
  for (const auto& n : locals)
    if (starts_with(n, "self_attention.") || starts_with(n, "mlp.") || starts_with(n, "input_layernorm.") ||
        starts_with(n, "post_attention_layernorm."))
      return SpecRole::kTransformer;
  if (locals.count("lm_head.weight")) return SpecRole::kHead;
  bool norm = true;
  for (const auto& n : locals) norm = norm && (n == "weight" || n == "bias");
  return norm ? SpecRole::kNormCandidate : SpecRole::kUnknown;
}

std::string canonical_in_spec(SpecRole role, int layer, const std::string& local, const std::string& fallback) {
  switch (role) {
    case SpecRole::kEmbedding: return "embedding." + local;
    case SpecRole::kTransformer: return "layers." + std::to_string(layer) + "." + local;
    case SpecRole::kHead: return local == "lm_head.weight" ? local : "lm_head." + local;
    case SpecRole::kFinalNorm: return "final_layernorm." + local;
    default: return fallback;
  }
}

std::string canonical_plain(const std::string& name) {
  // [MDS model/language_model.py state_dict_for_save_checkpoint; formats.md §1.3]
  static const std::string emb = "language_model.embedding.", enc = "language_model.encoder.",
                           out = "language_model.output_layer.";
  if (starts_with(name, emb)) return "embedding." + name.substr(emb.size());
  if (starts_with(name, enc)) {
    std::string rest = name.substr(enc.size());
    if (starts_with(rest, "layers.")) return rest;
    if (starts_with(rest, "final_layernorm.")) return rest;
    if (starts_with(rest, "final_norm.")) return "final_layernorm." + rest.substr(11);
    return name;
  }
  if (starts_with(name, out)) return "lm_head." + name.substr(out.size());
  return name;
}

PipeName split_pipe_name(const std::string& name) {
  PipeName p;
  static const std::string tied = "tied_modules.";
  if (starts_with(name, tied)) {
    size_t dot = name.find('.', tied.size());
    if (dot == std::string::npos) {
      p.local = name;
      return p;
    }
    p.tied = name.substr(tied.size(), dot - tied.size());
    p.local = name.substr(dot + 1);
    return p;
  }
  size_t dot = name.find('.');
  if (dot != std::string::npos) {
    int s = to_int(name.substr(0, dot));
    if (s >= 0) {
      p.spec = s;
      p.local = name.substr(dot + 1);
      return p;
    }
  }
  p.local = name;
  return p;
}

}  // namespace reshard::ds
