// DeepSpeed / Megatron-DeepSpeed step folders read in place, as a reshard source layout.
//
// What is read from where (facts: shared research formats.md §1-§4; checked on DeepSpeed 0.19.8
// files written by integration/megatron_deepspeed/make_checkpoints.py):
//  * tp, pp: pipeline engine (`module` is None, layer_XX-model_YY files): tp = number of model-axis
//    ranks in the layer file names, pp = mp_world_size / tp (mp_rank = stage * tp + tp_rank);
//    plain engine: tp = mp_world_size, pp = 1. Cross-checked with args and
//    checkpoint_parallel_dimensions when present.
//  * dp: partition_count of the optimizer files (all groups equal), cross-checked with
//    dp_world_size and the number of optimizer files per mp rank.
//  * ZeRO stage and writer from the optimizer-file keys: fp32_flat_groups -> ZeRO-3; zero_stage ->
//    DeepSpeedZeroOptimizer (1 or 2); neither zero_stage nor loss_scaler -> BF16_Optimizer. The
//    bf16_ file-name prefix is ignored.
//  * param groups in flat order from each mp rank's param_shapes; partition size P from the saved
//    moment lengths; each saved fp32 partition is the real count or P (else an error naming file,
//    group and both counts); group_paddings and param_slice_mappings are cross-checks.
//  * stage of every tensor from the param_shapes of each mp rank; spec roles from the names inside
//    each spec; transformer specs numbered by position.
//  * model config (QKV meaning, SwiGLU, groups, vocab) from `args` or OpenOptions.model_path.
//  * which file a file is: torch.save names each archive's top-level folder after the file it
//    writes, so a file whose folder names another DeepSpeed file was renamed after the save and is
//    refused at open (ds::archive_name_conflict).
#include "formats/deepspeed/deepspeed_reader.h"
#include "formats/torch/record_check.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <set>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "formats/deepspeed/ds_names.h"
#include "io/file.h"
#include "reshard/config.h"
#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard {
namespace {

using pt::PyValue;
using Kind = PyValue::Kind;

// Megatron's transformer layer of a canonical name: "layers.<n>.<rest>" -> n; -1 for any other
// name, also for a number of more than 7 digits (no model has that many layers).
int layer_of(const std::string& name) {
  static const std::string pre = "layers.";
  if (name.compare(0, pre.size(), pre) != 0) return -1;
  size_t j = pre.size();
  while (j < name.size() && name[j] >= '0' && name[j] <= '9') ++j;
  if (j == pre.size() || j - pre.size() > 7 || j >= name.size() || name[j] != '.') return -1;
  return std::stoi(name.substr(pre.size(), j - pre.size()));
}

// ---------------------------------------------------------------------------------------------
// Small PyValue helpers (never throw for a missing key or a wrong kind: return nullptr).

const PyValue* get(const PyValue* v, std::string_view key) {
  if (!v || (v->kind != Kind::Dict && v->kind != Kind::Object)) return nullptr;
  return v->get(key);
}

const PyValue* get_index(const PyValue* v, int64_t key) {
  if (!v || v->kind != Kind::Dict) return nullptr;
  for (const auto& [k, val] : v->entries)
    if (k->kind == Kind::Int && k->integer == key) return val;
  return nullptr;
}

const std::vector<const PyValue*>* seq(const PyValue* v) {
  if (!v || (v->kind != Kind::List && v->kind != Kind::Tuple)) return nullptr;
  return &v->items;
}

bool is_int(const PyValue* v) { return v && (v->kind == Kind::Int || v->kind == Kind::Bool); }
bool is_num(const PyValue* v) { return v && (v->kind == Kind::Int || v->kind == Kind::Bool || v->kind == Kind::Float); }

std::optional<int64_t> opt_int(const PyValue* v) {
  if (is_int(v)) return v->kind == Kind::Bool ? int64_t(v->boolean) : v->integer;
  return std::nullopt;
}
std::optional<bool> opt_bool(const PyValue* v) {
  if (v && v->kind == Kind::Bool) return v->boolean;
  if (v && v->kind == Kind::Int) return v->integer != 0;
  return std::nullopt;
}
// The attention's query groups as the trainer's args record them: Megatron-LM's
// group_query_attention + num_query_groups, Megatron-DeepSpeed's num_key_value_heads; an explicit
// group_query_attention=False means one group per head. nullopt when args say nothing.
std::optional<int64_t> args_query_groups(const PyValue* args) {
  std::optional<int64_t> groups;
  auto gqa = opt_bool(get(args, "group_query_attention"));
  if (gqa && *gqa) groups = opt_int(get(args, "num_query_groups"));
  if (!groups) groups = opt_int(get(args, "num_key_value_heads"));
  if (!groups && (!gqa || *gqa)) groups = opt_int(get(args, "num_query_groups"));
  if (!groups && gqa && !*gqa) groups = opt_int(get(args, "num_attention_heads"));
  return groups;
}
std::optional<std::string> opt_str(const PyValue* v) {
  if (v && v->kind == Kind::String) return v->text;
  return std::nullopt;
}
std::optional<double> opt_num(const PyValue* v) {
  if (!is_num(v)) return std::nullopt;
  if (v->kind == Kind::Float) return v->real;
  return double(*opt_int(v));
}

// ZeroStageEnum member (getattr(Cls, 'name') or Cls(value)) or a plain int.
std::optional<int> zero_stage_value(const PyValue* v) {
  if (!v) return std::nullopt;
  if (is_int(v)) return int(*opt_int(v));
  if (v->kind == Kind::Object) {
    if (v->enum_member) {
      static const std::map<std::string, int> names = {
          {"disabled", 0}, {"optimizer_states", 1}, {"gradients", 2}, {"weights", 3}, {"max_stage", 3}};
      auto it = names.find(v->text);
      if (it != names.end()) return it->second;
    }
    if (auto* a = seq(v->args); a && a->size() == 1 && is_int((*a)[0])) return int((*a)[0]->integer);
  }
  return std::nullopt;
}

std::vector<int64_t> shape_of(const PyValue* v) {  // torch.Size / tuple of ints
  std::vector<int64_t> s;
  auto* items = seq(v);
  if (!items) return {-1};
  for (auto* x : *items) {
    if (!is_int(x)) return {-1};
    s.push_back(x->integer);
  }
  return s;
}

std::string shape_str(const std::vector<int64_t>& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t prod(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (auto x : s) n *= x;
  return n;
}

nlohmann::ordered_json to_json_safe(const PyValue* v) {
  if (!v) return nullptr;
  try {
    return v->to_json(64, 1u << 20);
  } catch (const Error& e) {
    return {{"__error__", e.what()}};
  }
}

// ---------------------------------------------------------------------------------------------
// The reader.

class DeepSpeedReader final : public CheckpointReader {
 public:
  std::string writer() const override { return writer_; }
  std::string path() const override { return dir_; }
  const SourceLayout& source() const override { return source_; }
  const NonTensorState& state() const override { return state_; }
  std::vector<std::string> notes() const override { return notes_; }

  void read(int32_t file, uint64_t offset, uint64_t length, void* dst) const override {
    if (file < 0 || size_t(file) >= fds_.size())
      fail(ErrorCode::kNotFound, "DeepSpeed checkpoint ", dir_, ": no file with index ", file);
    fds_[file].pread(offset, length, dst);
  }
  const uint8_t* mapped(int32_t file) const override {
    if (file < 0 || size_t(file) >= fds_.size()) return nullptr;
    const io::MappedFile* m = maps_->get(size_t(file));
    return m ? m->data() : nullptr;
  }
  void drop_mapped_pages() const override { maps_->drop_all(); }
  std::string fingerprint() const override {
    // Every record's zip CRC-32, with its file's name, offset and length: the optimizer state
    // changes every step, so two saves differ; where the folder is mounted does not matter.
    XXH3_state_t* st = XXH3_createState();
    XXH3_64bits_reset(st);
    for (size_t f = 0; f < records_.size(); ++f) {
      const std::string& path = source_.files[f];
      const std::string name = path.substr(path.find_last_of('/') + 1);
      XXH3_64bits_update(st, name.data(), name.size() + 1);
      for (const auto& [off, rec] : records_[f]) {
        const uint64_t v[3] = {off, rec.first, rec.second};
        XXH3_64bits_update(st, v, sizeof v);
      }
    }
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits_digest(st));
    XXH3_freeState(st);
    return hex;
  }

  uint64_t file_size(int32_t file) const override {
    if (file < 0 || size_t(file) >= fds_.size())
      fail(ErrorCode::kNotFound, "DeepSpeed checkpoint ", dir_, ": no file with index ", file);
    // The file the open read (its descriptor), not whatever the path names now; and unchanged
    // since then: a file overwritten in place after the open (`cp B A` keeps A's inode) would
    // hand the load another rank's bytes, which verify="free" checks only where a read covers a
    // whole record. The load's pre-flight calls this for every file it reads.
    const io::File::Stamp now = fds_[file].stamp();
    if (!(now == stamps_[file]))
      fail(ErrorCode::kDataLoss, source_.files[file], " changed since the checkpoint was opened (",
           now.size == stamps_[file].size ? std::to_string(now.size) + " bytes"
                                          : std::to_string(stamps_[file].size) + " -> " + std::to_string(now.size) + " bytes",
           now.mtime_ns == stamps_[file].mtime_ns ? std::string() : ", another modification time",
           "); open the checkpoint again");
    return now.size;
  }
  // DeepSpeed files carry no checksums of their own; a read that covers a whole storage record
  // is checked against the zip CRC-32 of that record.
  bool has_checksum(int32_t file, uint64_t offset, uint64_t length) const override {
    return pt::zip_records_have(records_, file, offset, length);
  }

  std::unique_ptr<RangeCheck> begin_check(int32_t file, uint64_t offset, uint64_t length) const override {
    if (!has_checksum(file, offset, length)) return nullptr;
    return pt::zip_record_check(source_.files[size_t(file)], offset, length, records_[size_t(file)].at(offset).second);
  }

  std::vector<ChecksumUnit> checksum_units() const override {
    return pt::zip_record_units(records_);
  }

  std::string dir_, writer_;
  SourceLayout source_;
  NonTensorState state_;
  std::vector<std::string> notes_;
  std::vector<io::File> fds_;
  std::vector<io::File::Stamp> stamps_;  // per file, when the open read it
  pt::ZipRecords records_;  // offset -> (length, crc)
  std::string missing_;  // missing files, comma-separated
  // Made once the file list is final; each file is mapped on its first use (MappedFileSet::get).
  std::unique_ptr<io::MappedFileSet> maps_;
};

struct Opened {
  std::string name, path;
  ds::FileName fn;
  pt::TorchArchive ar;
  std::unique_ptr<pt::FileSource> src;
  int index = -1;  // into the reader's files
};

// A tensor found in a file.
struct Found {
  Opened* file = nullptr;
  const pt::TensorInfo* t = nullptr;
  std::string where;  // python-like path for messages
};

struct Builder {
  std::string dir;
  OpenOptions opt;
  DeepSpeedReader* r = nullptr;
  std::vector<std::unique_ptr<Opened>> files;
  std::map<int, Opened*> model;                  // mp -> mp_rank file (or lowest-dp ZeRO-3 model file)
  std::map<std::pair<int, int>, Opened*> zmodel;  // (dp, mp) -> ZeRO-3 model file
  std::map<std::pair<int, int>, Opened*> optim;   // (dp, mp)
  std::map<std::pair<int, int>, Opened*> layer;   // (idx, tp)
  std::vector<std::string> missing;              // file names expected but absent
  std::vector<std::string> missing_states;       // the model-states files among them (RNG, client state)

  int tp = 1, pp = 1, dp = 1, zero = 0, mp_world = 1;
  bool pipeline = false;
  enum Writer { kNone, kZero12, kBf16, kZero3, kZero0 } wkind = kNone;
  // ZeRO-0 with an optimizer: its state_dict under each mp_rank file's `optimizer`, saved by dp
  // rank 0 [deepspeed/runtime/engine.py _save_checkpoint: `optimizer` when neither ZeRO nor bf16].
  //   kFp16Unfused: FP16_UnfusedOptimizer {cur_scale, ..., optimizer_state_dict, fp32_groups: one
  //                 fp32 copy per parameter} [deepspeed/runtime/fp16/unfused_optimizer.py];
  //   kFp16Fused:   FP16_Optimizer {..., optimizer_state_dict, fp32_groups_flat: one flat fp32 copy
  //                 per group, the parameters side by side} [deepspeed/runtime/fp16/fused_optimizer.py];
  //   kTorch:       the torch optimizer's own state_dict {state, param_groups} (fp32: the module
  //                 weights are the master).
  enum Zero0Kind { kFp16Unfused, kFp16Fused, kTorch } z0kind = kTorch;
  // Where each parameter's optimizer state lies: per mp rank, DeepSpeed name -> (group, index in
  // the group, torch state index, element offset in the group's flat fp32 copy).
  struct Zero0Slot {
    int group = 0, index = 0;
    int64_t state = 0, offset = 0;
  };
  std::map<int, std::map<std::string, Zero0Slot>> z0slots;
  std::map<std::string, bool> z0_no_wd;  // canonical name -> in a no-weight-decay group
  std::set<std::pair<int, size_t>> round_robin_groups;  // (mp, group) whose flat order is round robin

  // Per mp rank: param groups as (DeepSpeed name, local shape).
  std::map<int, std::vector<std::vector<std::pair<std::string, std::vector<int64_t>>>>> shapes;
  std::map<std::string, std::string> canon;  // DeepSpeed param name -> canonical
  // Pipeline specs.
  std::map<int, std::set<std::string>> spec_locals;
  std::map<int, ds::SpecRole> spec_role;
  std::map<int, int> spec_layer;
  std::map<std::string, int> tied_spec;  // tied key -> layer-file spec index
  std::map<std::string, std::set<std::string>> tied_locals;
  std::vector<int> stage_min_spec;

  ModelConfig cfg;
  std::string cfg_origin;

  void note(std::string s) { r->notes_.push_back(std::move(s)); }

  Opened* open(const std::string& name, const ds::FileName& fn) {
    auto o = std::make_unique<Opened>();
    o->name = name;
    o->path = io::join(dir, name);
    o->fn = fn;
    try {
      o->src = std::make_unique<pt::FileSource>(o->path);
      o->ar = pt::open_torch_archive(*o->src, o->path);
    } catch (const Error& e) {
      std::string msg = e.what();
      if (msg.find(o->path) == std::string::npos) msg = o->path + ": " + msg;
      throw Error(e.code(), msg);
    }
    // A file renamed after the save (two tp ranks' layer files swapped, ZeRO-3 optimizer files
    // swapped) passes every shape and checksum; torch.save's archive folder still says what it is.
    const std::string conflict = ds::archive_name_conflict(name, o->ar.prefix);
    if (!conflict.empty()) fail(ErrorCode::kDataLoss, o->path, ": ", conflict);
    if (o->ar.root().kind != Kind::Dict)
      fail(ErrorCode::kInvalidArgument, o->path, ": expected a dict at the top of the pickle, found ",
           o->ar.root().kind_name());
    files.push_back(std::move(o));
    return files.back().get();
  }

  // Two names for one file of a save (mp_rank_0 next to mp_rank_00, layer_03-model_states next to
  // layer_03-model_00-model_states): one would silently win over the other.
  template <typename Map, typename Key>
  Opened* open_once(const Map& m, const Key& key, const std::string& name, const ds::FileName& fn) {
    if (auto it = m.find(key); it != m.end())
      fail(ErrorCode::kInvalidArgument, dir, ": two files hold ", ds::describe(fn), ": ", it->second->name, " and ", name,
           "; remove the one that is not from this save");
    return open(name, fn);
  }

  int file_index(Opened* f) {
    if (f->index >= 0) return f->index;
    f->index = int(r->source_.files.size());
    r->source_.files.push_back(f->path);
    r->fds_.push_back(io::File::open_read(f->path));
    r->stamps_.push_back(r->fds_.back().stamp());
    std::map<uint64_t, std::pair<uint64_t, uint32_t>> recs;
    for (const auto& [key, rec] : f->ar.storages) {
      const std::string entry = f->ar.prefix + "/data/" + key;
      if (const pt::ZipEntry* z = f->ar.zip.find(entry)) recs[rec.offset] = {rec.length, z->crc32};
    }
    r->records_.push_back(std::move(recs));
    return f->index;
  }

  // Reads a scalar (0-d or 1-element) tensor value, or a Python number.
  double scalar(Opened* f, const PyValue* v, const std::string& what) {
    if (auto n = opt_num(v)) return *n;
    if (!v || v->kind != Kind::Tensor) fail(ErrorCode::kInvalidArgument, f->path, ": ", what, " is not a number or tensor");
    const pt::TensorInfo& t = v->as_tensor();
    if (t.numel() != 1 || !t.dtype_known) fail(ErrorCode::kUnsupported, f->path, ": ", what, " is not a 1-element tensor of a known dtype");
    uint8_t buf[8] = {};
    f->src->read(f->ar.tensor_data_offset(t), t.itemsize, buf);
    double out = 0;
    convert_elements(buf, t.dtype, &out, DType::F64, 1);
    return out;
  }

  void list_and_open();
  void topology();
  void zero0_optimizer();
  void zero0_groups();
  const PyValue* zero0_torch_state(int mp) {
    const PyValue* o = get(&model[mp]->ar.root(), "optimizer");
    return z0kind == kTorch ? o : get(o, "optimizer_state_dict");
  }
  void read_shapes();
  void name_specs();
  void model_config();
  void qkv_order(Opened* first, std::optional<double> cv, const PyValue* args);
  void build();
  void non_tensor_state();
};

// ---------------------------------------------------------------------------------------------

void Builder::list_and_open() {
  if (!io::is_dir(dir)) fail(ErrorCode::kNotFound, "DeepSpeed step folder ", dir, " does not exist");
  // ds_to_universal's output: optimizer state per parameter under zero/<param>/{fp32, exp_avg,
  // exp_avg_sq}.pt, no optim_states files [deepspeed/checkpoint/ds_to_universal.py].
  if (io::is_dir(io::join(dir, "zero"))) {
    bool has_optim = false;
    for (const auto& name : io::list_dir(dir))
      if (name.find("optim_states.pt") != std::string::npos) has_optim = true;
    if (!has_optim)
      fail(ErrorCode::kUnsupported, dir, " is a DeepSpeed Universal Checkpoint (zero/<param>/fp32.pt, exp_avg.pt, "
           "exp_avg_sq.pt written by ds_to_universal); reshard reads the checkpoint it was converted from (the "
           "global_stepN folder) and reshards that directly, with no conversion");
  }
  std::vector<std::string> moe;
  for (const auto& name : io::list_dir(dir)) {
    ds::FileName fn = ds::parse_file_name(name);
    switch (fn.kind) {
      case ds::FileName::kOther: break;
      case ds::FileName::kMoE: moe.push_back(name); break;
      case ds::FileName::kModel: model[fn.mp] = open_once(model, fn.mp, name, fn); break;
      case ds::FileName::kZero3Model: zmodel[{fn.dp, fn.mp}] = open_once(zmodel, std::make_pair(fn.dp, fn.mp), name, fn); break;
      case ds::FileName::kOptim: {
        auto key = std::make_pair(fn.dp, fn.mp);
        if (optim.count(key))
          fail(ErrorCode::kInvalidArgument, dir, ": two optimizer files for dp rank ", fn.dp, ", mp rank ", fn.mp, ": ",
               optim[key]->name, " and ", name);
        optim[key] = open(name, fn);
        break;
      }
      case ds::FileName::kLayer: layer[{fn.layer, fn.tp}] = open_once(layer, std::make_pair(fn.layer, fn.tp), name, fn); break;
    }
  }
  if (!moe.empty())
    fail(ErrorCode::kUnsupported, dir, ": mixture-of-experts files (", moe.front(), moe.size() > 1 ? ", ..." : "",
         ") are not supported by the DeepSpeed reader");
  if (model.empty() && zmodel.empty())
    fail(ErrorCode::kInvalidArgument, dir, " holds no mp_rank_XX_model_states.pt or zero_pp_rank_D_mp_rank_XX_model_states.pt");
  if (!model.empty() && !zmodel.empty())
    fail(ErrorCode::kInvalidArgument, dir, " mixes mp_rank_XX_model_states.pt (ZeRO 0-2) with zero_pp_rank_*_model_states.pt (ZeRO-3)");
  for (auto& [k, f] : zmodel)
    if (!model.count(k.second)) model[k.second] = f;  // lowest dp rank first (map order)
}

void Builder::topology() {
  // mp_world_size and dp_world_size must agree across model files.
  std::optional<int64_t> mpw, dpw;
  std::string mpw_file;
  for (auto& [mp, f] : model) {
    auto m = opt_int(get(&f->ar.root(), "mp_world_size"));
    auto d = opt_int(get(&f->ar.root(), "dp_world_size"));
    if (!m) fail(ErrorCode::kInvalidArgument, f->path, ": no integer mp_world_size");
    if (mpw && *mpw != *m)
      fail(ErrorCode::kDataLoss, "mp_world_size differs between ", mpw_file, " (", *mpw, ") and ", f->path, " (", *m, ")");
    mpw = m;
    mpw_file = f->path;
    if (d) dpw = d;
  }
  mp_world = int(*mpw);
  if (mp_world < 1 || mp_world > (1 << 20)) fail(ErrorCode::kInvalidArgument, mpw_file, ": mp_world_size=", mp_world);
  for (auto& [mp, f] : model)
    if (mp >= mp_world)
      fail(ErrorCode::kInvalidArgument, f->path, ": mp rank ", mp, " but mp_world_size is ", mp_world);

  Opened* first = model.begin()->second;
  const PyValue* module = get(&first->ar.root(), "module");
  pipeline = (!module || module->is_none()) && !layer.empty();
  if ((!module || module->is_none()) && layer.empty() && zmodel.empty())
    fail(ErrorCode::kDataLoss, first->path, ": `module` is None (pipeline engine) but the folder has no layer_*-model_states.pt files");
  if (pipeline) {
    int max_tp = 0;
    for (auto& [k, f] : layer) max_tp = std::max(max_tp, k.second);
    tp = max_tp + 1;
    if (mp_world % tp != 0)
      fail(ErrorCode::kInvalidArgument, dir, ": layer files name ", tp, " tensor-parallel ranks but mp_world_size=", mp_world,
           " is not a multiple of it");
    pp = mp_world / tp;
    note("pipeline engine (module is None, layer files present): tp=" + std::to_string(tp) +
         " from layer file names, pp=" + std::to_string(pp) + " = mp_world_size / tp");
  } else {
    tp = mp_world;
    pp = 1;
  }
  // Cross-checks.
  const PyValue* args = get(&first->ar.root(), "args");
  auto check = [&](const char* what, std::optional<int64_t> v, int mine) {
    if (v && *v != mine)
      fail(ErrorCode::kInvalidArgument, first->path, ": ", what, "=", *v, " but the files say ", mine,
           pipeline ? " (layer file names and mp_world_size)" : " (mp_world_size)");
  };
  check("args.tensor_model_parallel_size", opt_int(get(args, "tensor_model_parallel_size")), tp);
  if (pipeline) check("args.pipeline_model_parallel_size", opt_int(get(args, "pipeline_model_parallel_size")), pp);
  const PyValue* cpd = get(&first->ar.root(), "checkpoint_parallel_dimensions");
  check("checkpoint_parallel_dimensions.tp_degree", opt_int(get(cpd, "tp_degree")), tp);
  check("checkpoint_parallel_dimensions.pp_degree", opt_int(get(cpd, "pp_degree")), pp);

  for (int mp = 0; mp < mp_world; ++mp) {
    if (zmodel.empty()) {
      if (!model.count(mp)) {
        missing.push_back("mp_rank_" + std::string(mp < 10 ? "0" : "") + std::to_string(mp) + "_model_states.pt");
        missing_states.push_back(missing.back());
      }
    }
  }

  // Writer and dp from the optimizer files.
  if (optim.empty()) {
    // A folder without optimizer files is weights only, but only when its writer kept no
    // optimizer state: DeepSpeed writes *_optim_states.pt whenever ZeRO (stage >= 1) or
    // BF16_Optimizer (bf16) ran [deepspeed/runtime/engine.py _save_zero_checkpoint], and the
    // torch optimizer's state_dict under model_states' `optimizer` otherwise. Loading such a folder
    // as weights only would drop the Adam moments without a word.
    // Every form DeepSpeed's config parser takes: zero_optimization as a dict (stage an int, a
    // ZeroStageEnum or a digit string) or as a bool (true = stage 1, deprecated); "bf16" or its
    // old name "bfloat16" {enabled}. Megatron's args (zero_stage, bf16) decide where ds_config
    // is missing or says nothing.
    const PyValue* cfg = get(&first->ar.root(), "ds_config");
    const PyValue* zo = get(cfg, "zero_optimization");
    std::optional<int> stage;
    std::string said;
    if (zo && zo->kind == Kind::Bool) stage = zo->boolean ? 1 : 0;
    else if (const PyValue* st = get(zo, "stage")) {
      stage = zero_stage_value(st);
      if (!stage && st->kind == Kind::String && !st->text.empty() && st->text.size() < 3 &&
          std::all_of(st->text.begin(), st->text.end(), [](char c) { return c >= '0' && c <= '9'; }))
        stage = std::stoi(st->text);
    }
    if (stage) said = "ds_config zero_optimization stage " + std::to_string(*stage);
    std::optional<bool> bf16;
    for (const char* key : {"bf16", "bfloat16"})
      if (!bf16) {
        bf16 = opt_bool(get(get(cfg, key), "enabled"));
        if (bf16 && *bf16) said += std::string(said.empty() ? "" : ", ") + "ds_config " + key + ".enabled=true";
      }
    if (!stage || *stage == 0) {
      if (const auto zs = opt_int(get(args, "zero_stage")); zs && *zs >= 1) {
        stage = int(*zs);
        said += std::string(said.empty() ? "" : ", ") + "args.zero_stage=" + std::to_string(*zs);
      }
    }
    if (!bf16 || !*bf16) {
      if (const auto ab = opt_bool(get(args, "bf16")); ab && *ab) {
        bf16 = true;
        said += std::string(said.empty() ? "" : ", ") + "args.bf16=true";
      }
    }
    if ((stage && *stage >= 1) || (bf16 && *bf16))
      fail(ErrorCode::kDataLoss, dir, ": no *_optim_states.pt files, but ", first->path, " says ", said,
           ", so DeepSpeed wrote the optimizer state (fp32 master, exp_avg, exp_avg_sq) to "
           "[bf16_]zero_pp_rank_<dp>_mp_rank_<mp>_optim_states.pt files (dp_world_size ", dpw ? *dpw : 1,
           "): they are missing (a copy without them?); loading the weights alone would lose the optimizer state");
    zero = 0;
    dp = dpw ? int(*dpw) : 1;
    const PyValue* torch_opt = get(&first->ar.root(), "optimizer");
    if (torch_opt && !torch_opt->is_none()) {
      zero0_optimizer();
      return;
    }
    wkind = kNone;
    r->writer_ = "deepspeed";
    note("no *_optim_states.pt files: the checkpoint holds weights only (no ZeRO optimizer state)");
  } else {
    std::optional<int64_t> pc;
    std::string pc_file;
    for (auto& [k, f] : optim) {
      const PyValue* osd = get(&f->ar.root(), "optimizer_state_dict");
      if (!osd) fail(ErrorCode::kInvalidArgument, f->path, ": no optimizer_state_dict");
      Writer w;
      auto zs = zero_stage_value(get(osd, "zero_stage"));
      if (get(osd, "fp32_flat_groups")) {
        if (zs && *zs != 3) fail(ErrorCode::kInvalidArgument, f->path, ": fp32_flat_groups (ZeRO-3) but zero_stage=", *zs);
        w = kZero3;
      } else if (get(osd, "single_partition_of_fp32_groups")) {
        if (zs) {
          if (*zs != 1 && *zs != 2) fail(ErrorCode::kUnsupported, f->path, ": zero_stage=", *zs, " with single_partition_of_fp32_groups");
          w = kZero12;
          if (zero != 0 && zero != *zs) fail(ErrorCode::kDataLoss, f->path, ": zero_stage=", *zs, " but other files say ", zero);
          zero = *zs;
        } else if (get(osd, "loss_scaler")) {
          fail(ErrorCode::kUnsupported, f->path, ": a loss_scaler without zero_stage: unknown optimizer writer");
        } else {
          w = kBf16;
        }
      } else {
        std::string keys;
        if (osd->kind == Kind::Dict)
          for (auto& [kk, vv] : osd->entries) keys += (keys.empty() ? "" : ", ") + (kk->kind == Kind::String ? kk->text : std::string("?"));
        fail(ErrorCode::kUnsupported, f->path, ": optimizer_state_dict has neither single_partition_of_fp32_groups nor "
             "fp32_flat_groups (keys: ", keys, "); this optimizer writer is not supported");
      }
      if (get(get(osd, "base_optimizer_state"), "state") == nullptr && w != kZero3 &&
          seq(get(osd, "base_optimizer_state")))
        fail(ErrorCode::kUnsupported, f->path, ": elastic checkpoint (base_optimizer_state is a list) is not supported");
      if (wkind != kNone && w != wkind) fail(ErrorCode::kDataLoss, f->path, ": written by a different optimizer than the other optimizer files");
      wkind = w;
      // partition_count: list per group (ZeRO-1/2, BF16) or an int (ZeRO-3).
      const PyValue* pcv = get(osd, "partition_count");
      std::optional<int64_t> this_pc;
      if (auto* l = seq(pcv)) {
        for (auto* x : *l) {
          auto v = opt_int(x);
          if (!v) fail(ErrorCode::kInvalidArgument, f->path, ": partition_count holds a non-integer");
          if (this_pc && *this_pc != *v)
            fail(ErrorCode::kUnsupported, f->path, ": param groups with different partition counts (expert data parallelism) are not supported");
          this_pc = v;
        }
      } else {
        this_pc = opt_int(pcv);
      }
      if (!this_pc || *this_pc < 1) fail(ErrorCode::kInvalidArgument, f->path, ": no valid partition_count");
      if (pc && *pc != *this_pc)
        fail(ErrorCode::kDataLoss, "partition_count differs between ", pc_file, " (", *pc, ") and ", f->path, " (", *this_pc, ")");
      pc = this_pc;
      pc_file = f->path;
    }
    dp = int(*pc);
    if (wkind == kZero3) zero = 3;
    if (wkind == kBf16) zero = 1;
    r->writer_ = wkind == kZero3 ? "deepspeed-zero3" : wkind == kBf16 ? "deepspeed-bf16" : "deepspeed-zero" + std::to_string(zero);
    if (dpw && *dpw != dp)
      fail(ErrorCode::kInvalidArgument, pc_file, ": partition_count=", dp, " but dp_world_size=", *dpw, " in the model files");
    for (auto& [k, f] : optim) {
      if (k.first >= dp) fail(ErrorCode::kInvalidArgument, f->path, ": dp rank ", k.first, " but partition_count is ", dp);
      if (k.second >= mp_world) fail(ErrorCode::kInvalidArgument, f->path, ": mp rank ", k.second, " but mp_world_size is ", mp_world);
    }
    const std::string prefix = optim.begin()->second->fn.bf16_prefix ? "bf16_" : "";
    for (int mp = 0; mp < mp_world; ++mp)
      for (int d = 0; d < dp; ++d)
        if (!optim.count({d, mp}))
          missing.push_back(prefix + "zero_pp_rank_" + std::to_string(d) + "_mp_rank_" + (mp < 10 ? "0" : "") +
                            std::to_string(mp) + "_optim_states.pt");
    // ZeRO-3 saves a model-states file per dp rank too (its RNG state and client state); one
    // missing is a copy that lost a file, which `verify` must name (it used to say "every file is
    // present").
    if (!zmodel.empty())
      for (int mp = 0; mp < mp_world; ++mp)
        for (int d = 0; d < dp; ++d)
          if (!zmodel.count({d, mp})) {
            missing.push_back("zero_pp_rank_" + std::to_string(d) + "_mp_rank_" + (mp < 10 ? "0" : "") +
                              std::to_string(mp) + "_model_states.pt");
            missing_states.push_back(missing.back());
          }
    std::string why = wkind == kZero3   ? "fp32_flat_groups"
                      : wkind == kBf16 ? "no zero_stage and no loss_scaler: BF16_Optimizer"
                                       : "zero_stage=" + std::to_string(zero) + ": DeepSpeedZeroOptimizer";
    note("optimizer writer " + r->writer_ + " (from the optimizer-file keys: " + why + "); dp=" + std::to_string(dp) +
         " from partition_count");
  }
  if (zero == 3 && pp > 1) fail(ErrorCode::kUnsupported, dir, ": ZeRO-3 with pipeline parallelism");
}

void Builder::zero0_optimizer() {
  if (pipeline)
    fail(ErrorCode::kUnsupported, dir, ": a pipeline checkpoint whose optimizer state is under the mp_rank files' "
         "`optimizer` (ZeRO stage 0 without bf16) is not supported; loading the weights alone would lose it");
  std::optional<Zero0Kind> kind;
  std::string kind_file;
  for (auto& [mp, f] : model) {
    const PyValue* o = get(&f->ar.root(), "optimizer");
    if (!o || o->is_none())
      fail(ErrorCode::kDataLoss, f->path, ": no optimizer state under `optimizer`, but ", kind_file, " has one");
    Zero0Kind k;
    if (get(o, "optimizer_state_dict") && seq(get(o, "fp32_groups"))) {
      k = kFp16Unfused;
    } else if (get(o, "optimizer_state_dict") && seq(get(o, "fp32_groups_flat"))) {
      k = kFp16Fused;
    } else if (get(o, "state") && seq(get(o, "param_groups"))) {
      k = kTorch;
    } else {
      std::string keys;
      if (o->kind == Kind::Dict)
        for (auto& [kk, vv] : o->entries) keys += (keys.empty() ? "" : ", ") + (kk->kind == Kind::String ? kk->text : kk->repr());
      fail(ErrorCode::kUnsupported, f->path, ": `optimizer` holds {", keys, "}: not a state_dict of DeepSpeed's "
           "FP16_Optimizer (fp32_groups_flat), FP16_UnfusedOptimizer (fp32_groups) or a torch optimizer "
           "(state, param_groups), the ZeRO stage 0 writers reshard reads");
    }
    if (kind && *kind != k) fail(ErrorCode::kDataLoss, f->path, ": `optimizer` written by another optimizer than ", kind_file, "'s");
    kind = k;
    kind_file = f->path;
  }
  z0kind = *kind;
  wkind = kZero0;
  r->writer_ = z0kind == kTorch ? "deepspeed-zero0" : "deepspeed-zero0-fp16";
  note(std::string("optimizer writer ") + r->writer_ + " (no *_optim_states.pt; mp_rank files' `optimizer` holds " +
       (z0kind == kFp16Unfused ? "FP16_UnfusedOptimizer's state: one fp32 copy per parameter"
        : z0kind == kFp16Fused ? "FP16_Optimizer's state: one flat fp32 copy per param group"
                               : "the torch optimizer's state_dict: the fp32 module weights are the master") +
       "); dp=" + std::to_string(dp) + " from dp_world_size, optimizer state replicated over dp");
}

// Which module parameter each saved ZeRO-0 moment belongs to. A torch optimizer state_dict numbers
// its parameters, it does not name them, and DeepSpeed records no param_shapes without ZeRO; the
// groups are Megatron's (get_param_groups: biases and 1-D tensors without weight decay, the rest
// with, each in module order), told apart by wd_mult (Megatron-DeepSpeed) or weight_decay. Every
// group must then match the saved copies shape by shape, and (16-bit runs) each parameter's saved
// fp32 copy must give its 16-bit weight, checked on its first and last elements in build();
// anything else is refused, never guessed.
void Builder::zero0_groups() {
  for (auto& [mp, f] : model) {
    const PyValue* o = get(&f->ar.root(), "optimizer");
    const PyValue* tsd = zero0_torch_state(mp);
    const std::string base = f->path + "[optimizer]" + (z0kind == kTorch ? "" : "[optimizer_state_dict]");
    auto* pgs = seq(get(tsd, "param_groups"));
    const PyValue* state = get(tsd, "state");
    if (!pgs || !state) fail(ErrorCode::kInvalidArgument, base, ": no param_groups list or state dict");
    const char* copies_key = z0kind == kFp16Unfused ? "fp32_groups" : "fp32_groups_flat";
    auto* copies = z0kind == kTorch ? nullptr : seq(get(o, copies_key));
    if (copies && copies->size() != pgs->size())
      fail(ErrorCode::kDataLoss, f->path, "[optimizer][", copies_key, "] has ", copies->size(), " groups but param_groups has ",
           pgs->size());
    std::vector<std::pair<std::string, std::vector<int64_t>>> all;
    for (auto& grp : shapes[mp])
      for (auto& e : grp) all.push_back(e);
    std::vector<size_t> by_rule[2];  // [with weight decay, without]
    for (size_t i = 0; i < all.size(); ++i) {
      const std::string& n = all[i].first;
      const bool nwd = (n.size() >= 5 && n.compare(n.size() - 5, 5, ".bias") == 0) || all[i].second.size() == 1;
      by_rule[nwd].push_back(i);
    }
    bool used[2] = {false, false};
    for (size_t g = 0; g < pgs->size(); ++g) {
      const PyValue* pg = (*pgs)[g];
      auto* ids = seq(get(pg, "params"));
      if (!ids) fail(ErrorCode::kInvalidArgument, base, "[param_groups][", g, "] has no params list");
      if (ids->empty()) continue;
      const auto wd_mult = opt_num(get(pg, "wd_mult"));
      const bool nwd = wd_mult ? *wd_mult == 0.0 : opt_num(get(pg, "weight_decay")).value_or(0.0) == 0.0;
      if (used[nwd])
        fail(ErrorCode::kUnsupported, base, ": two param groups ", nwd ? "without" : "with", " weight decay; reshard tells "
             "which parameter each saved ZeRO-0 moment belongs to by Megatron's param groups ([weight decay, no weight "
             "decay], each in module order) and cannot map other groups");
      used[nwd] = true;
      const auto& members = by_rule[nwd];
      // The saved copies' shapes (per parameter) or flat length (FP16_Optimizer).
      std::vector<std::vector<int64_t>> saved;
      int64_t flat = -1;
      if (z0kind == kFp16Unfused) {
        auto* l = seq((*copies)[g]);
        if (!l) fail(ErrorCode::kInvalidArgument, f->path, "[optimizer][fp32_groups][", g, "] is not a list");
        for (auto* t : *l) {
          if (t->kind != Kind::Tensor) fail(ErrorCode::kInvalidArgument, f->path, "[optimizer][fp32_groups][", g, "] holds a non-tensor");
          saved.push_back(t->as_tensor().shape);
        }
      } else if (z0kind == kFp16Fused) {
        const PyValue* t = (*copies)[g];
        if (t->kind != Kind::Tensor) fail(ErrorCode::kInvalidArgument, f->path, "[optimizer][fp32_groups_flat][", g, "] is not a tensor");
        if (ids->size() != 1)
          fail(ErrorCode::kDataLoss, base, "[param_groups][", g, "] lists ", ids->size(), " parameters; FP16_Optimizer keeps one flat one");
        flat = int64_t(t->as_tensor().numel());
      } else {
        for (auto* id : *ids) {
          auto sid = opt_int(id);
          const PyValue* ea = sid ? get(get_index(state, *sid), "exp_avg") : nullptr;
          if (!ea || ea->kind != Kind::Tensor)
            fail(ErrorCode::kDataLoss, base, "[state][", sid.value_or(-1), "] has no exp_avg tensor (parameter ", saved.size(),
                 " of param group ", g, "): the optimizer has not stepped, or the state is incomplete");
          saved.push_back(ea->as_tensor().shape);
        }
      }
      auto listing = [&]() {
        std::string s;
        for (size_t k = 0; k < members.size() && k < 8; ++k)
          s += (k ? ", " : "") + all[members[k]].first + " " + shape_str(all[members[k]].second);
        return s + (members.size() > 8 ? ", ..." : "");
      };
      const char* why = ": the trainer's param groups are not Megatron's ([weight decay, no weight decay], each in module "
                        "order), so reshard cannot tell which parameter each saved moment belongs to";
      if (z0kind != kFp16Fused && (saved.size() != members.size() || saved.size() != ids->size()))
        fail(ErrorCode::kUnsupported, base, "[param_groups][", g, "] holds ", ids->size(), " parameters (", saved.size(),
             " saved copies) but the module has ", members.size(), " ", nwd ? "without" : "with", " weight decay (", listing(), ")", why);
      int64_t at = 0;
      for (size_t k = 0; k < members.size(); ++k) {
        const auto& [n, shape] = all[members[k]];
        if (z0kind != kFp16Fused && saved[k] != shape)
          fail(ErrorCode::kUnsupported, base, "[param_groups][", g, "]: parameter ", k, " is saved with shape ", shape_str(saved[k]),
               " but the module's ", k, "-th parameter ", nwd ? "without" : "with", " weight decay is ", n, " ", shape_str(shape), why);
        Zero0Slot z;
        z.group = int(g);
        z.index = int(k);
        z.state = z0kind == kFp16Fused ? opt_int((*ids)[0]).value_or(-1) : opt_int((*ids)[k]).value_or(-1);
        z.offset = at;
        at += prod(shape);
        z0slots[mp][canon[n]] = z;
        z0_no_wd[canon[n]] = nwd;
      }
      if (z0kind == kFp16Fused && flat != at)
        fail(ErrorCode::kUnsupported, f->path, "[optimizer][fp32_groups_flat][", g, "] holds ", flat, " elements but the module's ",
             members.size(), " parameters ", nwd ? "without" : "with", " weight decay hold ", at, why);
    }
    for (int c = 0; c < 2; ++c)
      if (!used[c] && !by_rule[c].empty())
        fail(ErrorCode::kUnsupported, base, ": no param group ", c ? "without" : "with", " weight decay, but the module has ",
             by_rule[c].size(), " such parameters (", all[by_rule[c][0]].first, ", ...)", ": the trainer's param groups are not "
             "Megatron's, so reshard cannot tell which parameter each saved moment belongs to");
  }
}

void Builder::read_shapes() {
  for (auto& [mp, f] : model) {
    const PyValue* ps = get(&f->ar.root(), "param_shapes");
    auto* groups = seq(ps);
    if (!groups) {
      if (zero == 0) continue;  // no ZeRO: param_shapes may be absent; module/layer files name the tensors
      fail(ErrorCode::kInvalidArgument, f->path, ": no param_shapes list (needed to interpret the ZeRO partitions)");
    }
    auto& out = shapes[mp];
    for (size_t g = 0; g < groups->size(); ++g) {
      const PyValue* od = (*groups)[g];
      if (od->kind != Kind::Dict) fail(ErrorCode::kInvalidArgument, f->path, ": param_shapes[", g, "] is not a dict");
      out.emplace_back();
      for (auto& [k, v] : od->entries) {
        if (k->kind != Kind::String) fail(ErrorCode::kInvalidArgument, f->path, ": param_shapes[", g, "] has a non-string key");
        auto s = shape_of(v);
        if (!s.empty() && s[0] < 0) fail(ErrorCode::kInvalidArgument, f->path, ": param_shapes[", g, "][", k->text, "] is not a shape");
        out.back().emplace_back(k->text, s);
      }
    }
  }
  if (zero == 0 && shapes.empty()) {
    // Weights only: name the tensors from the module / layer files instead (one "group").
    for (auto& [mp, f] : model) {
      auto& out = shapes[mp];
      out.emplace_back();
      if (!pipeline) {
        std::function<void(const PyValue*, const std::string&)> walk = [&](const PyValue* v, const std::string& p) {
          if (v->kind == Kind::Dict) {
            for (auto& [k, x] : v->entries)
              if (k->kind == Kind::String) walk(x, p.empty() ? k->text : p + "." + k->text);
          } else if (v->kind == Kind::Tensor) {
            out.back().emplace_back(p, v->as_tensor().shape);
          }
        };
        walk(get(&f->ar.root(), "module"), "");
      }
    }
    if (pipeline) fail(ErrorCode::kUnsupported, dir, ": pipeline checkpoint without param_shapes (no ZeRO) is not supported");
  }
  // A missing mp_rank file: borrow the names from another tp rank of the same stage.
  for (int mp = 0; mp < mp_world; ++mp) {
    if (shapes.count(mp)) continue;
    const int p = mp / tp;
    for (int t = 0; t < tp; ++t)
      if (shapes.count(p * tp + t)) {
        shapes[mp] = shapes[p * tp + t];
        note("mp rank " + std::to_string(mp) + ": no model file; param names and shapes taken from mp rank " +
             std::to_string(p * tp + t) + " of the same stage");
        break;
      }
    if (!shapes.count(mp))
      fail(ErrorCode::kDataLoss, dir, ": no model file for any tensor-parallel rank of pipeline stage ", p,
           " (missing: ", missing.empty() ? std::string("?") : missing.front(), ", ...); the tensors of that stage are unknown");
  }
}

void Builder::name_specs() {
  if (!pipeline) {
    for (auto& [mp, groups] : shapes)
      for (auto& g : groups)
        for (auto& [n, s] : g) canon[n] = ds::canonical_plain(n);
    return;
  }
  stage_min_spec.assign(pp, INT32_MAX);
  std::map<int, std::set<int>> spec_stages;
  for (auto& [mp, groups] : shapes)
    for (auto& g : groups)
      for (auto& [n, s] : g) {
        ds::PipeName pn = ds::split_pipe_name(n);
        if (pn.spec >= 0) {
          spec_locals[pn.spec].insert(pn.local);
          spec_stages[pn.spec].insert(mp / tp);
          stage_min_spec[mp / tp] = std::min(stage_min_spec[mp / tp], pn.spec);
        } else if (!pn.tied.empty()) {
          tied_locals[pn.tied].insert(pn.local);
        }
      }
  // Layer files: the local names inside each; files of tied modules are matched by their names.
  std::map<int, std::set<std::string>> file_locals;
  for (auto& [k, f] : layer)
    for (auto& [kk, v] : f->ar.root().entries)
      if (kk->kind == Kind::String) file_locals[k.first].insert(kk->text);
  for (auto& [idx, locals] : file_locals) {
    if (spec_locals.count(idx)) continue;
    for (auto& [key, tl] : tied_locals) {
      bool inside = std::all_of(locals.begin(), locals.end(), [&](const std::string& n) { return tl.count(n) > 0; });
      if (inside && !tied_spec.count(key)) {
        tied_spec[key] = idx;
        break;
      }
    }
    if (!std::any_of(tied_spec.begin(), tied_spec.end(), [&](auto& kv) { return kv.second == idx; })) {
      // A layer file whose spec no param_shapes names (frozen or unknown): name its tensors anyway.
      spec_locals[idx] = locals;
    }
  }
  for (auto& [s, locals] : spec_locals) spec_role[s] = ds::role_of_locals(locals);
  int last_transformer = -1, n = 0;
  for (auto& [s, role] : spec_role)
    if (role == ds::SpecRole::kTransformer) {
      spec_layer[s] = n++;
      last_transformer = s;
    }
  std::vector<int> norms;
  for (auto& [s, role] : spec_role)
    if (role == ds::SpecRole::kNormCandidate && s > last_transformer) norms.push_back(s);
  if (norms.size() == 1) spec_role[norms[0]] = ds::SpecRole::kFinalNorm;
  for (auto& [s, role] : spec_role)
    if (role == ds::SpecRole::kNormCandidate) role = ds::SpecRole::kUnknown;
  auto layer_of = [&](int s) { return spec_layer.count(s) ? spec_layer[s] : -1; };
  for (auto& [mp, groups] : shapes)
    for (auto& g : groups)
      for (auto& [name, s] : g) {
        ds::PipeName pn = ds::split_pipe_name(name);
        if (pn.spec >= 0) {
          canon[name] = ds::canonical_in_spec(spec_role[pn.spec], layer_of(pn.spec), pn.local, name);
        } else if (!pn.tied.empty()) {
          canon[name] = ds::canonical_in_spec(ds::role_of_locals(tied_locals[pn.tied]), -1, pn.local, name);
        } else {
          canon[name] = name;
        }
      }
  std::string roles;
  for (auto& [s, role] : spec_role) {
    static const char* rn[] = {"unknown", "embedding", "transformer", "head", "norm?", "final norm"};
    roles += (roles.empty() ? "" : ", ") + std::to_string(s) + "=" + rn[int(role)];
    if (role == ds::SpecRole::kTransformer) roles += " (layer " + std::to_string(spec_layer[s]) + ")";
  }
  for (auto& [k, s] : tied_spec) roles += ", " + std::to_string(s) + "=tied module '" + k + "'";
  note("pipeline specs (roles from the parameter names inside them): " + roles);
}

void Builder::model_config() {
  Opened* first = model.begin()->second;
  const PyValue* root = &first->ar.root();
  const PyValue* args = get(root, "args");
  const PyValue* uci = get(root, "universal_checkpoint_info");
  if (gives_model(opt)) {
    cfg = given_model(opt);
    cfg_origin = opt.model ? "the given model description" : opt.model_path;
    note("model description from " + cfg_origin + " (QKV row meaning, SwiGLU, query groups, vocab)");
    // The model file fills in what the files cannot prove; where the trainer's `args` record a
    // field too, the two must agree. A model file that says "no SwiGLU" for a SwiGLU model of the
    // same shapes cut dense_h_to_4h as [g0;u0;g1;u1] with every check passing.
    if (args && args->kind == Kind::Object) {
      std::string differ;
      auto same = [&](const char* field, const std::string& in_args, const std::string& in_file) {
        if (in_args != in_file)
          differ += std::string(differ.empty() ? "" : "; ") + field + " " + in_args + " in args, " + in_file + " in the model file";
      };
      auto b = [](bool v) { return std::string(v ? "true" : "false"); };
      if (auto v = opt_int(get(args, "num_layers"))) same("num_layers", std::to_string(*v), std::to_string(cfg.num_layers));
      if (auto v = opt_int(get(args, "hidden_size"))) same("hidden", std::to_string(*v), std::to_string(cfg.hidden));
      if (auto v = opt_int(get(args, "num_attention_heads"))) same("heads", std::to_string(*v), std::to_string(cfg.heads));
      if (auto v = opt_int(get(args, "ffn_hidden_size"))) same("ffn", std::to_string(*v), std::to_string(cfg.ffn));
      if (auto v = args_query_groups(args)) same("query groups", std::to_string(*v), std::to_string(cfg.groups()));
      if (auto v = opt_bool(get(args, "swiglu"))) same("swiglu", b(*v), b(cfg.swiglu));
      if (auto v = opt_bool(get(args, "untie_embeddings_and_output_weights")))
        same("tied_embeddings", b(!*v), b(cfg.tied_embeddings));
      if (!differ.empty())
        fail(ErrorCode::kInvalidArgument, first->path, ": ", given_model_name(opt),
             " disagrees with the trainer's own record (`args`) in the checkpoint: ", differ,
             ". These decide how fused tensors (QKV, SwiGLU) are cut; loading under the wrong one gives wrong values "
             "with every check passing. Fix the model file, or leave it out to use `args`");
    }
  } else {
    if (!args || args->kind != Kind::Object)
      fail(ErrorCode::kInvalidArgument, first->path, ": no `args` Namespace to read the model description from; give a model "
           "file (OpenOptions.model_path / --model) describing heads, query groups, SwiGLU and the vocab size");
    cfg_origin = first->path + " args";
    auto need_int = [&](const char* k) -> int64_t {
      auto v = opt_int(get(args, k));
      if (!v) fail(ErrorCode::kInvalidArgument, first->path, ": args.", k, " is missing; give a model file (OpenOptions.model_path)");
      return *v;
    };
    cfg.name = "deepspeed-args";
    cfg.num_layers = int(need_int("num_layers"));
    cfg.hidden = int(need_int("hidden_size"));
    cfg.heads = int(need_int("num_attention_heads"));
    auto ffn = opt_int(get(args, "ffn_hidden_size"));
    cfg.ffn = int(ffn ? *ffn : 4 * cfg.hidden);
    const std::optional<int64_t> groups = args_query_groups(args);
    cfg.query_groups = groups ? int(*groups) : 0;
    if (cfg.query_groups == cfg.heads) cfg.query_groups = 0;
    cfg.swiglu = opt_bool(get(args, "swiglu")).value_or(false);
    auto untie = opt_bool(get(args, "untie_embeddings_and_output_weights"));
    cfg.tied_embeddings = untie ? !*untie : true;
    cfg.bias = opt_bool(get(args, "add_bias_linear")).value_or(true);
    std::string norm = opt_str(get(args, "normalization")).value_or("layernorm");
    std::transform(norm.begin(), norm.end(), norm.begin(), [](unsigned char c) { return std::tolower(c); });
    cfg.norm = norm;
    cfg.vocab_divisible_by = int(opt_int(get(args, "make_vocab_size_divisible_by")).value_or(128));
    // Learned absolute positions: Megatron-LM records position_embedding_type, Megatron-DeepSpeed
    // add_position_embedding (False with rotary) [MDS arguments.py --no-position-embedding].
    auto pos = opt_str(get(args, "position_embedding_type"));
    auto add_pos = opt_bool(get(args, "add_position_embedding"));
    auto mpe = opt_int(get(args, "max_position_embeddings"));
    const bool learned = pos ? *pos == "learned_absolute" : add_pos.value_or(true);
    cfg.max_position_embeddings = (mpe && learned) ? int(*mpe) : 0;
    note("model description from `args` in " + first->path + ": layers=" + std::to_string(cfg.num_layers) + ", hidden=" +
         std::to_string(cfg.hidden) + ", heads=" + std::to_string(cfg.heads) + ", query_groups=" + std::to_string(cfg.groups()) +
         ", ffn=" + std::to_string(cfg.ffn) + ", swiglu=" + (cfg.swiglu ? "true" : "false") + ", tied=" +
         (cfg.tied_embeddings ? "true" : "false") + " (the files cannot prove the QKV row meaning or SwiGLU; "
         "give a model file to override)");
  }
  // QKV row order: checkpoint_version [MDS checkpointing.py; DS state_dict_factory.py: absent -> 0],
  // and the writer's code (qkv_order).
  auto cv = opt_num(get(root, "checkpoint_version"));
  qkv_order(first, cv, args);
  if (!gives_model(opt)) {
    cfg.qkv_version = cv ? *cv : 0.0;
    if (!cv) note("no checkpoint_version: QKV rows read as version 0 ([3, np, hn] per rank), as DeepSpeed does");
  } else if (cv && *cv != cfg.qkv_version) {
    // The files record the QKV row order they were written in; the model file cannot change it.
    fail(ErrorCode::kInvalidArgument, first->path, ": checkpoint_version ", *cv, " in the files, qkv_version ",
         cfg.qkv_version, " in ", given_model_name(opt), ": the QKV rows were saved in the files' order; "
         "loading them as another gives wrong values with every check passing. Fix qkv_version in the model file "
         "(or leave the file out)");
  }
  // Vocab: V from universal_checkpoint_info.original_vocab_size (or the model file), Vp from files.
  std::optional<int64_t> V = opt_int(get(uci, "original_vocab_size"));
  if (!V) V = opt_int(get(args, "vocab_size"));
  if (gives_model(opt) && cfg.vocab > 0) {
    if (V && *V != cfg.vocab) note("vocab " + std::to_string(*V) + " in the files, " + std::to_string(cfg.vocab) + " in the model file: the model file wins");
    V = cfg.vocab;
  }
  std::optional<int64_t> Vp = opt_int(get(args, "padded_vocab_size"));
  if (!Vp) Vp = opt_int(get(uci, "padded_vocab_size"));
  // The embedding rows in the files are the authority for Vp.
  for (auto& [mp, groups] : shapes)
    for (auto& g : groups)
      for (auto& [n, s] : g)
        if (canon[n] == "embedding.word_embeddings.weight" && !s.empty()) {
          int64_t files_vp = s[0] * tp;
          if (Vp && *Vp != files_vp)
            fail(ErrorCode::kInvalidArgument, model.at(mp)->path, ": word embedding has ", s[0], " rows per tp rank x tp ", tp, " = ",
                 files_vp, " but padded_vocab_size is ", *Vp);
          Vp = files_vp;
        }
  if (V) {
    cfg.vocab = *V;
  } else {
    cfg.vocab = Vp.value_or(0);
    note("real vocab size unknown (no universal_checkpoint_info.original_vocab_size, no args.vocab_size): all " +
         std::to_string(cfg.vocab) + " embedding rows are treated as real");
  }
  if (Vp && cfg.padded_vocab(tp) != *Vp) {
    // The divisor in args (or the default) does not reproduce the files' padding: find the one that does.
    note("padded vocab " + std::to_string(*Vp) + " is not the Megatron padding of vocab " + std::to_string(cfg.vocab) +
         " with make_vocab_size_divisible_by=" + std::to_string(cfg.vocab_divisible_by) + " at tp=" + std::to_string(tp) +
         "; using divisor " + std::to_string(*Vp / tp));
    cfg.vocab_divisible_by = int(*Vp / tp);
  }
}

// The fused QKV row order is a property of the code that wrote the files, which checkpoint_version
// alone does not pin down: upstream Megatron-DeepSpeed's ParallelAttention splits each tp rank's
// query_key_value output into three contiguous blocks [Q | K | V] since its FPDT change (676a482c,
// 2024-12: `each_hidden_size = mixed_x_layer.shape[-1] // 3`), and before it viewed the rows as
// [groups, heads/groups + 2, hn] (megatron/model/transformer.py), both under checkpoint_version
// 3.0. The same change added the argument `ds_sequence_parallel_fpdt` [MDS arguments.py], so a
// saved `args` Namespace that has it was written by the blocked code. Without `args`, and with a
// model file that does not state qkv_order, the order is "unknown": loads at the same tp copy the
// rows as saved, and the planner refuses any re-cut.
void Builder::qkv_order(Opened* first, std::optional<double> cv, const PyValue* args) {
  const bool have_args = args && args->kind == Kind::Object;
  const bool blocked_writer = have_args && get(args, "ds_sequence_parallel_fpdt") != nullptr;
  const std::string stated = cfg.qkv_order;  // from the model file, or ""
  const std::string version = cv ? std::to_string(*cv) : std::string("absent");
  if (blocked_writer) {
    if (!stated.empty() && stated != "blocked")
      fail(ErrorCode::kInvalidArgument, first->path, ": ", given_model_name(opt), " says qkv_order: ", stated,
           ", but the files' `args` has ds_sequence_parallel_fpdt, so they were written by Megatron-DeepSpeed at or "
           "after its FPDT change (676a482c, 2024-12), whose attention splits each tp rank's query_key_value rows "
           "into [Q | K | V] blocks; fix qkv_order in the model file (blocked) or leave it out");
    if (cfg.groups() != cfg.heads)
      fail(ErrorCode::kUnsupported, first->path, ": query_groups=", cfg.groups(), " < heads=", cfg.heads,
           " written by Megatron-DeepSpeed at or after its FPDT change (args has ds_sequence_parallel_fpdt), whose "
           "attention cuts each rank's fused rows in three equal thirds, which does not match grouped-query "
           "attention's Q, K and V sizes; refusing rather than guessing the rows' meaning");
    cfg.qkv_order = "blocked";
    note("QKV rows: [Q | K | V] blocks per tp rank (args has ds_sequence_parallel_fpdt: Megatron-DeepSpeed at or after "
         "676a482c, 2024-12), although checkpoint_version is " + version);
  } else if (!stated.empty()) {
    note("QKV rows: " + stated + " (qkv_order in " + given_model_name(opt) + ")");
  } else if (have_args) {
    const double v = cv ? *cv : 0.0;
    cfg.qkv_order = qkv_order_name(v >= 2.0 ? QkvOrder::kInterleaved : v >= 1.0 ? QkvOrder::kPerHeadV1 : QkvOrder::kBlocked);
    note("QKV rows: " + cfg.qkv_order + " (checkpoint_version " + version + ", written by a Megatron trainer whose "
         "`args` lacks ds_sequence_parallel_fpdt: Megatron-LM, or Megatron-DeepSpeed before 2024-12)");
  } else {
    cfg.qkv_order = "unknown";
    note("QKV rows: order unknown (no `args` in the files, no qkv_order in the model file): copied as saved at the "
         "same tp; a load that re-cuts them is refused until the model file states qkv_order");
  }
}

void Builder::build() {
  if (wkind == kZero0) zero0_groups();
  // ---- Tensor specs: local shapes per (stage, tp rank), checked equal across tp ranks (even
  // splits) and stages (pipeline replicas).
  struct Seen {
    std::vector<int64_t> local;
    std::set<int> stages;
    std::string ds_name;
    int first = 0;
    bool nwd = false;
  };
  std::map<std::string, Seen> seen;
  std::map<std::pair<int, int>, std::vector<int64_t>> local_by_rank;
  int order = 0;
  for (auto& [mp, groups] : shapes) {
    const int p = mp / tp;
    const PyValue* pg = nullptr;
    for (int d = 0; d < dp && !pg; ++d)
      if (optim.count({d, mp})) {
        const PyValue* osd = get(&optim[{d, mp}]->ar.root(), "optimizer_state_dict");
        pg = get(get(osd, wkind == kZero3 ? "optimizer_state_dict" : "base_optimizer_state"), "param_groups");
      }
    for (size_t g = 0; g < groups.size(); ++g) {
      bool nwd = false;
      if (auto* l = seq(pg); l && g < l->size()) nwd = opt_num(get((*l)[g], "weight_decay")).value_or(1.0) == 0.0;
      for (auto& [n, s] : groups[g]) {
        const std::string& c = canon[n];
        auto it = seen.find(c);
        if (it == seen.end()) {
          seen[c] = {s, {p}, n, order++, wkind == kZero0 ? z0_no_wd[c] : nwd};
        } else {
          if (it->second.local != s)
            fail(ErrorCode::kUnsupported, model.count(mp) ? model[mp]->path : dir, ": tensor ", c, " (", n, ") has local shape ",
                 shape_str(s), " here but ", shape_str(it->second.local), " on another rank; uneven splits are not supported");
          it->second.stages.insert(p);
        }
      }
    }
  }
  // Duplicate canonical names from different DeepSpeed names.
  {
    std::map<std::string, std::string> back;
    for (auto& [n, c] : canon) {
      auto it = back.find(c);
      if (it != back.end() && it->second != n) {
        ds::PipeName a = ds::split_pipe_name(it->second), b = ds::split_pipe_name(n);
        bool same_tied = !a.tied.empty() && a.tied == b.tied;
        if (!same_tied) fail(ErrorCode::kInvalidArgument, dir, ": parameters ", it->second, " and ", n, " both map to ", c);
      }
      back[c] = n;
    }
  }
  std::vector<TensorSpec> specs;
  std::vector<std::string> names;
  for (auto& [c, s] : seen) names.push_back(c);
  auto rank_key = [&](const std::string& c) {
    // Model order: embeddings, layers by number, final norm, head, then unknown by first sight.
    if (c.rfind("embedding.", 0) == 0) return std::make_pair(0, seen[c].first);
    if (const int layer = layer_of(c); layer >= 0) return std::make_pair(1 + layer, seen[c].first);
    if (c.rfind("final_layernorm.", 0) == 0) return std::make_pair(1 << 20, seen[c].first);
    if (c.rfind("lm_head.", 0) == 0) return std::make_pair((1 << 20) + 1, seen[c].first);
    return std::make_pair((1 << 20) + 2, seen[c].first);
  };
  {  // each key once (the comparator ran it O(n log n) times)
    std::vector<std::pair<std::pair<int, int>, std::string>> keyed;
    for (auto& c : names) keyed.emplace_back(rank_key(c), std::move(c));
    std::stable_sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
    for (size_t i = 0; i < keyed.size(); ++i) names[i] = std::move(keyed[i].second);
  }
  for (auto& c : names) {
    TensorSpec t;
    t.name = c;
    t.shape = seen[c].local;
    t.no_weight_decay = seen[c].nwd;
    specs.push_back(t);
  }
  std::vector<std::string> unmatched;
  classify_tensors(cfg, specs, &unmatched);
  std::set<std::string> inferred(unmatched.begin(), unmatched.end());
  for (auto& u : unmatched) {
    note("tensor " + u + " (" + seen[u].ds_name + ") matches no layout rule: inferred replicated over tp (its local shape " +
         shape_str(seen[u].local) + " is the same on every tp rank); exact for dp-only changes, a tp change needs a rule "
         "for it in the model file");
  }
  int num_transformer = 0;
  std::map<std::string, int> dead_copies;  // tensor -> the one stage whose copy is kept
  for (auto& t : specs) {
    switch (t.split) {
      case Split::kColumn: case Split::kVocab: case Split::kQkv: case Split::kSwiglu:
        if (t.shape.empty()) fail(ErrorCode::kInvalidArgument, "tensor ", t.name, ": a ", split_name(t.split), " split of a scalar");
        t.shape[0] *= tp;
        break;
      case Split::kRow:
        if (t.shape.size() < 2) fail(ErrorCode::kInvalidArgument, "tensor ", t.name, ": a row split of shape ", shape_str(t.shape));
        t.shape[1] *= tp;
        break;
      case Split::kReplicated: break;
    }
    if (t.split == Split::kVocab) t.real_rows = std::min<int64_t>(cfg.vocab, t.shape[0]);
    const auto& st = seen[t.name].stages;
    // Owners as Megatron means them; an unknown tensor by where the files put it.
    if (const int layer = layer_of(t.name); layer >= 0) {
      t.owner = Owner::kLayer;
      t.layer = layer;
      num_transformer = std::max(num_transformer, t.layer + 1);
    } else if (t.name == "embedding.word_embeddings.weight") {
      t.owner = cfg.tied_embeddings ? Owner::kFirstAndLast : Owner::kFirstStage;
    } else if (t.name.rfind("embedding.", 0) == 0) {
      t.owner = Owner::kFirstStage;
    } else if (t.name.rfind("final_layernorm.", 0) == 0 || t.name.rfind("lm_head.", 0) == 0) {
      t.owner = Owner::kLastStage;
    } else if (st.count(0) && st.count(pp - 1) && pp > 1) {
      t.owner = Owner::kFirstAndLast;
    } else if (st.count(pp - 1) && !st.count(0)) {
      t.owner = Owner::kLastStage;
    } else {
      t.owner = Owner::kFirstStage;
    }
    // A tied module's other parameters (e.g. learned position embeddings in the tied 'embed'
    // module) also sit on the last stage, but DeepSpeed all-reduces only the tied attribute: the
    // extra copies are unused by the forward and drift (weight decay, zero gradients). The copy on
    // the owning stage is the real one (ds_to_universal also takes pipeline stage 0's).
    if (seen[t.name].ds_name.rfind("tied_modules.", 0) == 0 && t.owner == Owner::kFirstStage && st.size() > 1) {
      dead_copies[t.name] = *st.begin();
      note("tensor " + t.name + " (" + seen[t.name].ds_name + "): copies on stages other than " + std::to_string(*st.begin()) +
           " are ignored; DeepSpeed synchronizes only the tied weight of a tied module, so they are not replicas");
    }
  }
  // Cross-checks of the model description against the files.
  {
    bool has_head = seen.count("lm_head.weight") > 0;
    if (cfg.tied_embeddings == has_head)
      fail(ErrorCode::kInvalidArgument, cfg_origin, " says tied_embeddings=", cfg.tied_embeddings ? "true" : "false",
           " but the checkpoint ", has_head ? "has" : "has no", " lm_head weight");
    if (num_transformer != cfg.num_layers)
      fail(ErrorCode::kInvalidArgument, cfg_origin, " says num_layers=", cfg.num_layers, " but the checkpoint has ", num_transformer,
           " transformer layers");
    bool has_qkv_bias = seen.count("layers.0.self_attention.query_key_value.bias") > 0;
    if (seen.count("layers.0.self_attention.query_key_value.weight") && has_qkv_bias != cfg.bias)
      fail(ErrorCode::kInvalidArgument, cfg_origin, " says add_bias_linear=", cfg.bias ? "true" : "false", " but the checkpoint ",
           has_qkv_bias ? "has" : "has no", " linear biases");
    bool has_ln_bias = seen.count("layers.0.input_layernorm.bias") > 0;
    if (seen.count("layers.0.input_layernorm.weight") && has_ln_bias != (cfg.norm == "layernorm"))
      fail(ErrorCode::kInvalidArgument, cfg_origin, " says normalization=", cfg.norm, " but the checkpoint ",
           has_ln_bias ? "has" : "has no", " norm biases");
    if (seen.count("embedding.position_embeddings.weight") && cfg.max_position_embeddings == 0)
      cfg.max_position_embeddings = int(seen["embedding.position_embeddings.weight"].local[0]);
  }
  cfg.validate();

  // Stage of every tensor from the files.
  LayoutRecipe recipe;
  recipe.tensors = specs;
  for (auto& t : specs) {
    auto& st = seen[t.name].stages;
    if (dead_copies.count(t.name)) recipe.stages.push_back({dead_copies[t.name]});
    else recipe.stages.emplace_back(st.begin(), st.end());
  }
  std::map<std::string, size_t> spec_index;
  for (size_t i = 0; i < specs.size(); ++i) spec_index[specs[i].name] = i;

  // 16-bit weight dtype from the files (the first weight tensor found).
  std::optional<DType> wdt;
  auto consider = [&](const pt::TensorInfo& t, const std::string& where) {
    if (!t.dtype_known) fail(ErrorCode::kUnsupported, where, ": tensor of dtype ", t.torch_dtype, " is not supported");
    if (t.numel() == 0) return;
    if (!wdt) wdt = t.dtype;
  };
  // Weight tensors by (canonical, tp rank) with their spec index (pipeline) or mp rank (plain).
  struct WeightAt {
    Opened* f;
    const pt::TensorInfo* t;
    std::string where;
    int spec;
  };
  std::multimap<std::pair<std::string, int>, WeightAt> weights;
  if (pipeline) {
    for (auto& [k, f] : layer) {
      const int idx = k.first, t = k.second;
      ds::SpecRole role = ds::SpecRole::kUnknown;
      int lay = -1;
      std::string tied;
      for (auto& [key, s] : tied_spec)
        if (s == idx) tied = key;
      if (!tied.empty()) role = ds::role_of_locals(tied_locals[tied]);
      else if (spec_role.count(idx)) role = spec_role[idx], lay = spec_layer.count(idx) ? spec_layer[idx] : -1;
      for (auto& [kk, v] : f->ar.root().entries) {
        if (kk->kind != Kind::String || v->kind != Kind::Tensor) continue;
        std::string ds_name = tied.empty() ? std::to_string(idx) + "." + kk->text : "tied_modules." + tied + "." + kk->text;
        std::string c = canon.count(ds_name) ? canon[ds_name] : ds::canonical_in_spec(role, lay, kk->text, ds_name);
        consider(v->as_tensor(), f->path);
        weights.insert({{c, t}, {f, &v->as_tensor(), f->path + "[" + kk->text + "]", idx}});
      }
    }
  } else {
    for (auto& [mp, f] : model) {
      if (!zmodel.empty()) break;
      std::function<void(const PyValue*, const std::string&)> walk = [&](const PyValue* v, const std::string& p) {
        if (v->kind == Kind::Dict) {
          for (auto& [k, x] : v->entries)
            if (k->kind == Kind::String) walk(x, p.empty() ? k->text : p + "." + k->text);
        } else if (v->kind == Kind::Tensor) {
          std::string c = canon.count(p) ? canon[p] : ds::canonical_plain(p);
          consider(v->as_tensor(), f->path);
          weights.insert({{c, mp}, {f, &v->as_tensor(), f->path + "[module." + p + "]", -1}});
        }
      };
      const PyValue* module = get(&f->ar.root(), "module");
      if (module) walk(module, "");
    }
  }
  auto weights_at = [&](const std::string& c, int mp) -> const pt::TensorInfo* {
    auto it = weights.find({c, mp});
    return it == weights.end() ? nullptr : it->second.t;
  };
  if (wdt) cfg.param_dtype = *wdt;
  else if (auto pd = get(get(&model.begin()->second->ar.root(), "args"), "params_dtype"); pd && pd->kind == Kind::Dtype && pd->dtype_known)
    cfg.param_dtype = pd->dtype;

  // ---- Param groups per (stage, tp rank) from param_shapes, partition sizes from the files.
  if (zero >= 1) {
    recipe.groups.assign(size_t(pp) * tp, {});
    for (int mp = 0; mp < mp_world; ++mp) {
      auto& groups = shapes[mp];
      std::vector<FlatGroup> fg(groups.size());
      // Files of this mp rank.
      std::vector<std::pair<int, Opened*>> ofiles;
      for (int d = 0; d < dp; ++d)
        if (optim.count({d, mp})) ofiles.push_back({d, optim[{d, mp}]});
      for (size_t g = 0; g < groups.size(); ++g) {
        FlatGroup& G = fg[g];
        std::vector<int64_t> pads(groups[g].size(), 0);
        if (!ofiles.empty() && zero <= 2) {
          auto* all = seq(get(get(&ofiles[0].second->ar.root(), "optimizer_state_dict"), "param_alignment_paddings"));
          if (all && g < all->size())
            if (auto* l = seq((*all)[g]); l && l->size() == pads.size())
              for (size_t i = 0; i < pads.size(); ++i) pads[i] = opt_int((*l)[i]).value_or(0);
        }
        // Partition size from the saved moments (padded partitions).
        std::optional<int64_t> P;
        std::string P_file;
        for (auto& [d, f] : ofiles) {
          const PyValue* osd = get(&f->ar.root(), "optimizer_state_dict");
          const PyValue* st = get(get(osd, zero == 3 ? "optimizer_state_dict" : "base_optimizer_state"), "state");
          const PyValue* gs = get_index(st, int64_t(g));
          for (const char* k : {"exp_avg", "exp_avg_sq"}) {
            const PyValue* v = get(gs, k);
            if (!v || v->kind != Kind::Tensor)
              fail(ErrorCode::kInvalidArgument, f->path, ": optimizer state of group ", g, " has no ", k, " tensor");
            int64_t len = int64_t(v->as_tensor().numel());
            if (P && *P != len)
              fail(ErrorCode::kDataLoss, f->path, ": group ", g, " ", k, " has ", len, " elements but ", P_file, " has ", *P,
                   "; partitions of one group must be equal");
            P = len;
            P_file = f->path;
          }
        }
        int64_t at = 0;
        // Flat order: param_shapes order, which DeepSpeed writes in the flat buffer's order, also
        // under round_robin_gradients (engine.py _get_zero_param_shapes takes round_robin_bit16_groups).
        const Opened* mf = model.count(mp) ? model[mp] : nullptr;
        if (zero <= 2 && wkind == kZero12 && dp > 1 && mf &&
            opt_bool(get(get(get(&mf->ar.root(), "ds_config"), "zero_optimization"), "round_robin_gradients")).value_or(false))
          round_robin_groups.insert({mp, g});
        for (size_t i = 0; i < groups[g].size(); ++i) {
          const auto& [n, s] = groups[g][i];
          const int64_t numel = prod(s);
          G.entries.push_back({canon[n], at, numel});
          if (zero == 3) at += (numel + dp - 1) / dp;  // each parameter padded to a multiple of dp [DS partition_parameters.py]
          else at += numel + pads[i];
          G.no_weight_decay = seen[canon[n]].nwd;
        }
        int64_t N = 0;
        for (const auto& e : G.entries) N = std::max(N, zero == 3 ? at : e.offset + e.numel);
        if (zero == 3) N = at;
        G.numel = N;
        if (!P) {
          if (zero == 3) P = N;
          else {
            int64_t align = 2 * int64_t(dp);
            P = (N + align - 1) / align * align / dp;
          }
          note("mp rank " + std::to_string(mp) + ", group " + std::to_string(g) + ": no optimizer file, partition size " +
               std::to_string(*P) + " computed (alignment 2*dp)");
        }
        G.partition_size = *P;
        if (zero == 3) {
          if (*P != N)
            fail(ErrorCode::kDataLoss, P_file, ": group ", g, " holds ", *P, " elements per rank but its parameters need ", N,
                 " (sum of ceil(numel/dp) over param_shapes[", g, "])");
        } else {
          if (*P * dp < N)
            fail(ErrorCode::kDataLoss, P_file, ": group ", g, ": partition size ", *P, " x dp ", dp, " < ", N,
                 " elements named by param_shapes[", g, "]");
          const int64_t align = 2 * int64_t(dp);
          if ((N + align - 1) / align * align != *P * dp)
            note("mp rank " + std::to_string(mp) + ", group " + std::to_string(g) + ": padded size " + std::to_string(*P * dp) +
                 " is not " + std::to_string(N) + " rounded up to 2*dp=" + std::to_string(align) + " (read from the files as is)");
        }
        // Saved lengths and paddings, per rank.
        for (auto& [d, f] : ofiles) {
          const PyValue* osd = get(&f->ar.root(), "optimizer_state_dict");
          const PyValue* fp = seq(get(osd, zero == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups"))
                                  ? get(osd, zero == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups")
                                  : nullptr;
          auto* l = seq(fp);
          if (!l || l->size() != groups.size())
            fail(ErrorCode::kDataLoss, f->path, ": ", zero == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups", " has ",
                 l ? l->size() : 0, " groups but param_shapes has ", groups.size());
          const PyValue* tv = (*l)[g];
          if (tv->kind != Kind::Tensor) fail(ErrorCode::kInvalidArgument, f->path, ": fp32 partition of group ", g, " is not a tensor");
          const int64_t len = int64_t(tv->as_tensor().numel());
          const int64_t real = zero == 3 ? *P : std::clamp<int64_t>(N - int64_t(d) * *P, 0, *P);
          if (len != real && len != *P)
            fail(ErrorCode::kDataLoss, f->path, ": group ", g, " fp32 partition has ", len, " elements; expected the real count ", real,
                 " or the partition size ", *P, " (dp rank ", d, " of ", dp, ", ", N, " elements in the group)");
          if (zero <= 2) {
            auto* gp = seq(get(osd, "group_paddings"));
            if (gp && g < gp->size()) {
              int64_t pad = opt_int((*gp)[g]).value_or(-1);
              int64_t expect = wkind == kBf16 ? (d == dp - 1 ? *P * dp - N : 0) : *P - real;
              if (len == real && wkind == kBf16) expect = *P - real;
              if (pad != expect)
                fail(ErrorCode::kDataLoss, f->path, ": group ", g, " group_paddings says ", pad, " but the partition layout gives ", expect,
                     " (partition size ", *P, ", ", N, " elements, dp rank ", d, " of ", dp, ")");
            }
            // param_slice_mappings: (numel, start) per parameter fragment of this rank. Under
            // round_robin_gradients without alignment padding DeepSpeed computes them in the
            // group's original parameter order, not in the flat buffer's (stage_1_and_2.py
            // _link_all_hp_params passes the reordered offsets only when some padding is
            // non-zero): there they do not describe the saved partitions and are not compared.
            auto* psm = seq(get(osd, "param_slice_mappings"));
            const bool psm_stale = round_robin_groups.count({mp, g}) &&
                                   std::all_of(pads.begin(), pads.end(), [](int64_t x) { return x == 0; });
            if (psm_stale && d == ofiles[0].first)
              note("mp rank " + std::to_string(mp) + ", group " + std::to_string(g) + ": param_slice_mappings not compared "
                   "(under round_robin_gradients without padding DeepSpeed writes them in the group's original parameter "
                   "order, not the flat buffer's; param_shapes gives the flat order)");
            if (psm && !psm_stale && g < psm->size() && (*psm)[g]->kind == Kind::Dict) {
              std::map<std::string, std::pair<int64_t, int64_t>> frag;
              for (auto& [k, v] : (*psm)[g]->entries) {
                auto numel = opt_int(get(v, "numel"));
                auto start = opt_int(get(v, "start"));
                if (k->kind == Kind::String && numel && start) frag[k->text] = {*numel, *start};
              }
              for (size_t i = 0; i < groups[g].size(); ++i) {
                const auto& e = G.entries[i];
                int64_t lo = std::max(e.offset, int64_t(d) * *P), hi = std::min(e.offset + e.numel, int64_t(d + 1) * *P);
                auto it = frag.find(groups[g][i].first);
                if (lo >= hi) {
                  if (it != frag.end() && it->second.first > 0)
                    fail(ErrorCode::kDataLoss, f->path, ": param_slice_mappings[", g, "] lists ", groups[g][i].first,
                         " on dp rank ", d, " but the flat layout puts none of it there");
                  continue;
                }
                if (it == frag.end() || it->second.first != hi - lo || it->second.second != lo - int64_t(d) * *P)
                  fail(ErrorCode::kDataLoss, f->path, ": param_slice_mappings[", g, "][", groups[g][i].first, "] is ",
                       it == frag.end() ? std::string("absent") : "(numel " + std::to_string(it->second.first) + ", start " + std::to_string(it->second.second) + ")",
                       " but the flat layout from param_shapes gives (numel ", hi - lo, ", start ", lo - int64_t(d) * *P, ")");
              }
            }
          }
        }
      }
      recipe.groups[mp] = fg;  // mp = stage * tp + tp_rank: the same slot order as build_layout
    }
  }

  Topology topo;
  topo.tp = tp;
  topo.pp = pp;
  topo.dp = dp;
  topo.zero = zero;
  DeriveOptions dopt;
  dopt.weights_on_dp0_only = true;
  dopt.optimizer = zero >= 1 || wkind == kZero0;
  Layout L = build_layout(cfg, topo, recipe, dopt);

  // ---- Locate every buffer.
  std::vector<BufferLocation> locs(L.buffers.size());
  std::vector<bool> drop(L.buffers.size(), false);
  std::set<std::string> tied_notes;
  auto owner_stage = [&](int spec) {
    int best = 0;
    for (int p = 0; p < pp; ++p)
      if (stage_min_spec.size() > size_t(p) && stage_min_spec[p] != INT32_MAX && stage_min_spec[p] <= spec) best = p;
    return best;
  };
  auto check_tensor = [&](const pt::TensorInfo& t, const std::string& where, const Buffer& b, int64_t expect_numel,
                          const std::vector<int64_t>* expect_shape) {
    if (!t.dtype_known || t.dtype != b.dtype)
      fail(ErrorCode::kUnsupported, where, ": dtype ", t.torch_dtype, " but the layout expects ", dtype_name(b.dtype), " for ", b.name);
    if (!t.is_contiguous())
      fail(ErrorCode::kUnsupported, where, ": tensor for ", b.name, " is not contiguous (shape ", shape_str(t.shape), ", stride ",
           shape_str(t.stride), "); strided tensors are not supported");
    if (expect_shape && t.shape != *expect_shape)
      fail(ErrorCode::kDataLoss, where, ": shape ", shape_str(t.shape), " but ", b.name, " expects ", shape_str(*expect_shape));
    if (int64_t(t.numel()) != expect_numel && !(b.group >= 0))
      fail(ErrorCode::kDataLoss, where, ": ", t.numel(), " elements but ", b.name, " has ", expect_numel);
  };
  // ZeRO-0 state of one tensor on one mp rank (zero0_groups placed it); a 16-bit run's fp32 copy
  // must give the module's 16-bit weight on its first and last elements.
  auto locate_zero0 = [&](const Buffer& B, const std::string& rest, int mp, int t, const pt::TensorInfo* weight,
                          BufferLocation* loc) {
    auto mf = model.find(mp);
    if (mf == model.end()) {
      loc->file = -1;
      return;
    }
    Opened* f = mf->second;
    auto zs = z0slots[mp].find(rest);
    if (zs == z0slots[mp].end())
      fail(ErrorCode::kInternal, f->path, ": no ZeRO-0 optimizer slot for ", rest);
    const Zero0Slot& z = zs->second;
    const PyValue* o = get(&f->ar.root(), "optimizer");
    const PyValue* tv = nullptr;
    std::string where;
    int64_t elem_off = 0;
    const std::string g = std::to_string(z.group);
    if (B.state == StateKind::kMaster && z0kind == kTorch) {
      if (!weight) fail(ErrorCode::kDataLoss, f->path, ": module has no tensor for ", rest);
      if (!weight->dtype_known || weight->dtype != DType::F32)
        fail(ErrorCode::kUnsupported, f->path, ": module weight ", rest, " is ", weight->torch_dtype, " but a torch optimizer's "
             "master (ZeRO-0 without FP16_Optimizer) is the float32 module weight itself");
      *loc = {file_index(f), f->ar.tensor_data_offset(*weight)};
      return;
    }
    if (B.state == StateKind::kMaster && z0kind == kFp16Unfused) {
      tv = (*seq((*seq(get(o, "fp32_groups")))[z.group]))[z.index];
      where = f->path + "[optimizer][fp32_groups][" + g + "][" + std::to_string(z.index) + "]";
    } else if (B.state == StateKind::kMaster) {
      tv = (*seq(get(o, "fp32_groups_flat")))[z.group];
      elem_off = z.offset;
      where = f->path + "[optimizer][fp32_groups_flat][" + g + "]";
    } else {
      const char* key = B.state == StateKind::kExpAvg ? "exp_avg" : "exp_avg_sq";
      tv = get(get_index(get(zero0_torch_state(mp), "state"), z.state), key);
      elem_off = z0kind == kFp16Fused ? z.offset : 0;
      where = f->path + "[optimizer]" + (z0kind == kTorch ? "" : "[optimizer_state_dict]") + "[state][" +
              std::to_string(z.state) + "][" + key + "]";
    }
    if (!tv || tv->kind != Kind::Tensor) fail(ErrorCode::kInvalidArgument, where, " is not a tensor");
    const pt::TensorInfo& ti = tv->as_tensor();
    if (elem_off == 0 && z0kind != kFp16Fused) {
      const TpShard sh = tp_shard(specs[spec_index.at(rest)], cfg, tp, t);
      check_tensor(ti, where, B, B.numel, &sh.local_shape);
    } else {
      check_tensor(ti, where, B, int64_t(ti.numel()), nullptr);
      if (elem_off + B.numel > int64_t(ti.numel()))
        fail(ErrorCode::kDataLoss, where, ": ", ti.numel(), " elements, but ", rest, " lies at [", elem_off, ", ",
             elem_off + B.numel, ")");
    }
    const uint64_t at = f->ar.tensor_data_offset(ti) + uint64_t(elem_off) * ti.itemsize;
    *loc = {file_index(f), at};
    if (B.state != StateKind::kMaster || !weight || !weight->dtype_known || weight->dtype == DType::F32) return;
    // The fp32 copy downcast must be the 16-bit weight (what every FP16 optimizer step writes).
    const int64_t n = B.numel, k = std::min<int64_t>(n, 64);
    for (int64_t start : {int64_t(0), n - k}) {
      const size_t kk = static_cast<size_t>(k);
      std::vector<float> m(kk);
      std::vector<uint16_t> w(kk), down(kk);
      f->src->read(at + uint64_t(start) * 4, uint64_t(k) * 4, m.data());
      f->src->read(f->ar.tensor_data_offset(*weight) + uint64_t(start) * 2, uint64_t(k) * 2, w.data());
      convert_elements(m.data(), DType::F32, down.data(), weight->dtype, size_t(k));
      for (int64_t i = 0; i < k; ++i)
        if (down[size_t(i)] != w[size_t(i)])
          fail(ErrorCode::kDataLoss, where, ": element ", start + i, " of the fp32 copy of ", rest, " is ", m[size_t(i)],
               ", which does not give the module's ", dtype_name(weight->dtype), " weight there: the saved optimizer "
               "state is not this module's (param groups in another order than Megatron's, or files of different saves)");
    }
  };
  std::map<std::string, std::vector<int64_t>> local_shape_of;
  for (size_t b = 0; b < L.buffers.size(); ++b) {
    const Buffer& B = L.buffers[b];
    const int p = topo.pp_rank(B.rank), d = topo.dp_rank(B.rank), t = topo.tp_rank(B.rank);
    const int mp = p * tp + t;
    const size_t slash = B.name.find('/');
    const std::string kind = B.name.substr(0, slash), rest = B.name.substr(slash + 1);
    if (B.state == StateKind::kWeight) {
      if (zero == 3) {
        drop[b] = true;  // ZeRO-3 model files hold placeholders; weights come from the fp32 master
        continue;
      }
      const size_t ti = spec_index.at(rest);
      const TpShard sh = tp_shard(specs[ti], cfg, tp, t);
      auto range = weights.equal_range({rest, pipeline ? t : mp});
      const WeightAt* hit = nullptr;
      int saving_spec = -1;
      for (auto it = range.first; it != range.second; ++it) {
        saving_spec = it->second.spec;
        if (!pipeline || owner_stage(it->second.spec) == p) hit = &it->second;
      }
      if (hit) {
        check_tensor(*hit->t, hit->where, B, B.numel, &sh.local_shape);
        locs[b] = {file_index(hit->f), hit->f->ar.tensor_data_offset(*hit->t)};
        continue;
      }
      if (pipeline) {
        // Which spec should hold it on this stage? From param_shapes names.
        int expect_spec = -1;
        for (auto& grp : shapes[mp])
          for (auto& [nn, ss] : grp) {
            if (canon[nn] != rest) continue;
            ds::PipeName pn = ds::split_pipe_name(nn);
            int s = pn.spec >= 0 ? pn.spec : (tied_spec.count(pn.tied) ? tied_spec[pn.tied] : -1);
            if (s >= 0 && owner_stage(s) == p) expect_spec = s;
            if (s < 0 && !pn.tied.empty() && p == 0) expect_spec = -2;  // tied module whose file is unknown
          }
        if (expect_spec == -1 && saving_spec >= 0 && owner_stage(saving_spec) != p) {
          drop[b] = true;  // a tied replica: its 16-bit weight is saved once, by the stage owning the layer file
          tied_notes.insert(rest);
          continue;
        }
        if (expect_spec == -1) {
          drop[b] = true;
          tied_notes.insert(rest);
          continue;
        }
        if (expect_spec >= 0 && layer.count({expect_spec, t}))
          fail(ErrorCode::kDataLoss, layer[{expect_spec, t}]->path, ": no tensor for ", rest, " (named by param_shapes of mp rank ", mp, ")");
        char buf[64];
        std::snprintf(buf, sizeof buf, "layer_%02d-model_%02d-model_states.pt", std::max(expect_spec, 0), t);
        if (expect_spec >= 0 && std::find(missing.begin(), missing.end(), buf) == missing.end()) missing.push_back(buf);
        locs[b].file = -1;
        continue;
      }
      if (model.count(mp))
        fail(ErrorCode::kDataLoss, model[mp]->path, ": module has no tensor for ", rest, " (named by param_shapes)");
      locs[b].file = -1;  // mp_rank file missing
      continue;
    }
    if (wkind == kZero0) {  // per-tensor state: "<state>/<tensor>", in the mp_rank file's `optimizer`
      locate_zero0(B, rest, mp, t, weights_at(rest, mp), &locs[b]);
      continue;
    }
    // Optimizer flat partitions: "<state>/group<g>".
    const int g = B.group;
    auto it = optim.find({d, mp});
    if (it == optim.end()) {
      locs[b].file = -1;
      continue;
    }
    Opened* f = it->second;
    const PyValue* osd = get(&f->ar.root(), "optimizer_state_dict");
    const PyValue* tv = nullptr;
    std::string where;
    if (B.state == StateKind::kMaster) {
      const char* key = zero == 3 ? "fp32_flat_groups" : "single_partition_of_fp32_groups";
      tv = (*seq(get(osd, key)))[g];
      where = f->path + "[optimizer_state_dict][" + key + "][" + std::to_string(g) + "]";
    } else {
      const char* base = zero == 3 ? "optimizer_state_dict" : "base_optimizer_state";
      const char* key = B.state == StateKind::kExpAvg ? "exp_avg" : "exp_avg_sq";
      tv = get(get_index(get(get(osd, base), "state"), g), key);
      where = f->path + "[optimizer_state_dict][" + base + "][state][" + std::to_string(g) + "][" + key + "]";
    }
    if (!tv || tv->kind != Kind::Tensor) fail(ErrorCode::kInvalidArgument, where, " is not a tensor");
    const pt::TensorInfo& ti = tv->as_tensor();
    check_tensor(ti, where, B, B.numel, nullptr);
    if (int64_t(ti.numel()) > B.numel)
      fail(ErrorCode::kDataLoss, where, ": ", ti.numel(), " elements but the partition size is ", B.numel);
    locs[b] = {file_index(f), f->ar.tensor_data_offset(ti)};
  }
  for (auto& t : tied_notes)
    note("tensor " + t + ": 16-bit weight saved only by the stage that owns its layer file; its fp32 master and moments exist on "
         "every stage that holds it (compared as replicas)");

  // ---- Drop buffers that hold nothing by design (and, for ZeRO-3, the weight arrays).
  {
    std::vector<int32_t> bmap(L.buffers.size(), -1), amap(L.arrays.size(), -1);
    std::vector<Buffer> nb;
    std::vector<BufferLocation> nl;
    for (size_t b = 0; b < L.buffers.size(); ++b)
      if (!drop[b]) {
        bmap[b] = int32_t(nb.size());
        nb.push_back(L.buffers[b]);
        nl.push_back(locs[b]);
      }
    std::vector<LogicalArray> na;
    for (size_t a = 0; a < L.arrays.size(); ++a)
      if (!(zero == 3 && L.arrays[a].state == StateKind::kWeight)) {
        amap[a] = int32_t(na.size());
        na.push_back(L.arrays[a]);
      }
    std::vector<Piece> np;
    for (Piece pc : L.pieces) {
      if (bmap[pc.buffer] < 0 || amap[pc.array] < 0) continue;
      auto dc = dead_copies.find(L.arrays[pc.array].tensor);
      if (dc != dead_copies.end() && topo.pp_rank(L.buffers[pc.buffer].rank) != dc->second) continue;
      pc.buffer = bmap[pc.buffer];
      pc.array = amap[pc.array];
      np.push_back(pc);
    }
    L.buffers = std::move(nb);
    L.arrays = std::move(na);
    L.pieces = std::move(np);
    locs = std::move(nl);
    if (zero == 3)
      note("ZeRO-3: model files hold placeholders; 16-bit weights come from the fp32 master (downcast to " +
           std::string(dtype_name(cfg.param_dtype)) + ")");
  }
  r->source_.layout = std::move(L);
  r->source_.locations = std::move(locs);
  for (auto& m : missing) {
    const bool states = std::find(missing_states.begin(), missing_states.end(), m) != missing_states.end();
    note("missing file: " + io::join(dir, m) +
         (states ? " (its ranks' RNG and client state are not available)" : " (its ranks' data is not available)"));
  }
  for (auto& m : missing) r->missing_ += (r->missing_.empty() ? "" : ", ") + io::join(dir, m);
  for (auto& m : missing) r->source_.missing_files.push_back(io::join(dir, m));
}

void Builder::non_tensor_state() {
  NonTensorState& S = r->state_;
  Opened* first = model.begin()->second;
  const PyValue* root = &first->ar.root();
  // iteration and global_steps must agree across model files.
  std::optional<int64_t> it0, gs0;
  std::string f0;
  std::vector<Opened*> mfiles;
  for (auto& [mp, f] : model) mfiles.push_back(f);
  for (auto& [k, f] : zmodel)
    if (std::find(mfiles.begin(), mfiles.end(), f) == mfiles.end()) mfiles.push_back(f);
  for (Opened* f : mfiles) {
    auto it = opt_int(get(&f->ar.root(), "iteration"));
    auto gs = opt_int(get(&f->ar.root(), "global_steps"));
    if (f0.empty()) {
      it0 = it, gs0 = gs, f0 = f->path;
      continue;
    }
    if (it != it0) fail(ErrorCode::kDataLoss, "iteration differs between ", f0, " (", it0.value_or(-1), ") and ", f->path, " (", it.value_or(-1), ")");
    if (gs != gs0) fail(ErrorCode::kDataLoss, "global_steps differs between ", f0, " (", gs0.value_or(-1), ") and ", f->path, " (", gs.value_or(-1), ")");
  }
  S.iteration = it0 ? *it0 : gs0.value_or(-1);
  const PyValue* args = get(root, "args");
  auto cs = opt_int(get(args, "consumed_train_samples"));
  S.consumed_samples = cs ? *cs : opt_int(get(root, "global_samples")).value_or(-1);
  // Optimizer step: every group of every file must agree.
  std::optional<double> step;
  std::string step_file;
  nlohmann::ordered_json loss_scaler, param_groups;
  for (auto& [k, f] : optim) {
    const PyValue* osd = get(&f->ar.root(), "optimizer_state_dict");
    const PyValue* base = get(osd, zero == 3 ? "optimizer_state_dict" : "base_optimizer_state");
    const PyValue* st = get(base, "state");
    if (!st || st->kind != Kind::Dict) continue;
    for (auto& [gk, gv] : st->entries) {
      const PyValue* sv = get(gv, "step");
      if (!sv) continue;
      double v = scalar(f, sv, "step of group " + gk->repr());
      if (step && *step != v)
        fail(ErrorCode::kDataLoss, "optimizer step differs: ", step_file, " has ", *step, ", ", f->path, " group ", gk->repr(), " has ", v);
      step = v;
      step_file = f->path;
    }
    if (loss_scaler.is_null() && get(osd, "loss_scaler")) loss_scaler = to_json_safe(get(osd, "loss_scaler"));
    if (param_groups.is_null() && get(base, "param_groups")) param_groups = to_json_safe(get(base, "param_groups"));
  }
  if (wkind == kZero0) {  // ZeRO-0: the torch optimizer's state in each mp_rank file's `optimizer`
    for (auto& [mp, f] : model) {
      const PyValue* tsd = zero0_torch_state(mp);
      const PyValue* st = get(tsd, "state");
      if (st && st->kind == Kind::Dict)
        for (auto& [gk, gv] : st->entries) {
          const PyValue* sv = get(gv, "step");
          if (!sv) continue;
          double v = scalar(f, sv, "[optimizer] step of parameter " + gk->repr());
          if (step && *step != v)
            fail(ErrorCode::kDataLoss, "optimizer step differs: ", step_file, " has ", *step, ", ", f->path, " parameter ",
                 gk->repr(), " has ", v);
          step = v;
          step_file = f->path;
        }
      if (param_groups.is_null() && get(tsd, "param_groups")) param_groups = to_json_safe(get(tsd, "param_groups"));
      // FP16_Optimizer / FP16_UnfusedOptimizer keep their loss scaler's state beside the torch
      // optimizer's: dynamic_loss_scale, cur_scale, cur_iter, last_overflow_iter, scale_factor,
      // scale_window [deepspeed/runtime/fp16/*optimizer.py state_dict].
      const PyValue* o = get(&f->ar.root(), "optimizer");
      if (z0kind != kTorch && loss_scaler.is_null() && get(o, "cur_scale")) {
        loss_scaler = nlohmann::ordered_json::object();
        for (const char* k : {"dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor", "scale_window"})
          if (const PyValue* v = get(o, k)) loss_scaler[k] = to_json_safe(v);
      }
    }
  }
  S.step = step ? int64_t(std::llround(*step)) : -1;
  // A model-states file from another save copied into this folder (an older mp_rank_00 copied
  // into global_step3 loaded as "iteration 2, optimizer step 3" and the trainer replayed
  // a batch; DeepSpeed's own loader takes it too, and a pipeline's mp_rank files hold no weights
  // for the weights-vs-master check to compare). Two facts every save keeps:
  // - DeepSpeed names a save `global_step<global_steps>` unless the caller gives a tag
  //   (DeepSpeedEngine.save_checkpoint; Megatron-DeepSpeed gives none), so a folder of that form
  //   whose model files say otherwise holds files of another save, or was renamed;
  // - an optimizer takes at most one step per engine step (skipped steps: fewer), so Adam's step
  //   count cannot exceed global_steps (Megatron's iteration where global_steps is absent).
  {
    const std::string folder = io::base_name(dir);
    const std::string kTag = "global_step";
    const std::string digits = folder.compare(0, kTag.size(), kTag) == 0 ? folder.substr(kTag.size()) : "";
    const bool numbered = !digits.empty() && digits.size() <= 18 &&
                          std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
    if (numbered && gs0 && std::stoll(digits) != *gs0)
      fail(ErrorCode::kDataLoss, f0, ": global_steps=", *gs0, " but the folder is ", folder,
           " (DeepSpeed names a save global_step<global_steps>): the model-states files come from another save "
           "(copied in?) or the folder was renamed; refusing to mix the state of two saves");
    const std::optional<int64_t> engine_steps = gs0 ? gs0 : it0;
    // FP16_Optimizer and FP16_UnfusedOptimizer step the torch optimizer once with zero gradients
    // when they are built (initialize_optimizer_states), so theirs is one step ahead.
    const double init_steps = wkind == kZero0 && z0kind != kTorch ? 1.0 : 0.0;
    if (step && engine_steps && *step > double(*engine_steps) + init_steps + 0.5)
      fail(ErrorCode::kDataLoss, step_file, ": the optimizer has taken ", *step, " steps but ", f0, " records ",
           gs0 ? "global_steps=" : "iteration=", *engine_steps,
           "; an optimizer cannot step more often than the engine, so these files come from different saves "
           "(a model-states file of an earlier save copied in?)");
  }
  nlohmann::ordered_json j;
  j["format"] = r->writer_;
  j["ds_version"] = to_json_safe(get(root, "ds_version"));
  j["checkpoint_version"] = to_json_safe(get(root, "checkpoint_version"));
  j["iteration"] = S.iteration;
  j["global_steps"] = to_json_safe(get(root, "global_steps"));
  j["global_samples"] = to_json_safe(get(root, "global_samples"));
  j["skipped_steps"] = to_json_safe(get(root, "skipped_steps"));
  j["tokens"] = to_json_safe(get(root, "tokens"));
  j["consumed_samples"] = S.consumed_samples;
  j["step"] = S.step;
  j["args"] = to_json_safe(args);
  j["lr_scheduler"] = to_json_safe(get(root, "lr_scheduler"));
  j["loss_scaler"] = loss_scaler;
  j["param_groups"] = param_groups;
  j["ds_config"] = to_json_safe(get(root, "ds_config"));
  j["universal_checkpoint_info"] = to_json_safe(get(root, "universal_checkpoint_info"));
  S.json = j.dump();
  // RNG state per source rank, opaque: one entry per dp rank when saved per dp rank, else one.
  const Topology& T = r->source_.layout.topo;
  for (int p = 0; p < pp; ++p)
    for (int d = 0; d < dp; ++d)
      for (int t = 0; t < tp; ++t) {
        int mp = p * tp + t;
        Opened* f = zmodel.count({d, mp}) ? zmodel[{d, mp}] : (model.count(mp) ? model[mp] : nullptr);
        if (!f) continue;
        const PyValue* rng = get(&f->ar.root(), "rng_state");
        auto* l = seq(rng);
        const PyValue* v = rng;
        if (l) v = l->size() == size_t(dp) ? (*l)[d] : (l->empty() ? nullptr : (*l)[0]);
        if (v) S.per_rank[T.rank_of(p, d, t)] = to_json_safe(v).dump();
      }
  // All or nothing: with a model-states file missing, some ranks would restore their streams and
  // others reseed (and a ZeRO-3 dp rank without its own file would take dp rank 0's stream).
  if (!missing_states.empty()) {
    S.per_rank.clear();
    std::string files;
    for (const auto& m : missing_states) files += (files.empty() ? "" : ", ") + io::join(dir, m);
    S.per_rank_not_carried = "per-rank state (RNG) of the save: its model-states file(s) " + files +
                             " are missing, so no rank's stream is restored; every rank reseeds";
  }
}

}  // namespace

std::unique_ptr<CheckpointReader> open_deepspeed(const std::string& step_dir, const OpenOptions& options,
                                                 std::vector<std::string> notes) {
  auto reader = std::make_unique<DeepSpeedReader>();
  reader->notes_ = std::move(notes);
  reader->dir_ = step_dir;
  while (reader->dir_.size() > 1 && reader->dir_.back() == '/') reader->dir_.pop_back();
  Builder b;
  b.dir = reader->dir_;
  b.opt = options;
  b.r = reader.get();
  b.list_and_open();
  b.topology();
  b.read_shapes();
  b.name_specs();
  b.model_config();
  b.build();
  b.non_tensor_state();
  // Mapped through the descriptors the open read the files through: a file renamed or swapped
  // after the open is not what a load copies.
  reader->maps_ = std::make_unique<io::MappedFileSet>(reader->source_.files,
                                                      [r = reader.get()](size_t i) { return r->fds_[i].fd(); });
  return reader;
}

}  // namespace reshard
