// Single-file state dicts (safetensors, torch.save) as canonical name -> tensor; see
// include/reshard/state_dict.h.
#include "reshard/state_dict.h"

#include <sys/stat.h>

#include <functional>
#include <map>
#include <set>

#include "formats/deepspeed/ds_names.h"
#include "formats/safetensors/safetensors.h"
#include "io/file.h"
#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard {

namespace {

bool has_suffix(const std::string& p, const std::string& suf) {
  return p.size() > suf.size() && p.compare(p.size() - suf.size(), suf.size(), suf) == 0;
}

bool is_regular_file(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

StateDict read_safetensors_file(const std::string& path) {
  StateDict f;
  f.path = path;
  io::File fh = io::File::open_read(path);
  const uint64_t size = fh.size();
  if (size < 8) fail(ErrorCode::kInvalidArgument, path, " is not a safetensors file (", size, " bytes)");
  uint8_t prefix[8];
  fh.pread(0, 8, prefix);
  const uint64_t n = safetensors::parse_header_size(prefix, size, path);
  std::string htext(size_t(n), '\0');
  fh.pread(8, n, htext.data());
  safetensors::Header h = safetensors::parse_header(htext, path);
  if (h.data_start + h.buffer_size > size)
    fail(ErrorCode::kDataLoss, path, ": the header describes ", h.buffer_size, " data bytes but the file ends at byte ",
         size);
  for (const auto& [name, t] : h.tensors) {
    if (!t.rtype) fail(ErrorCode::kUnsupported, path, ": tensor ", name, " has dtype ", t.dtype, ", which reshard does not read");
    StateDictTensor x;
    x.shape = t.shape;
    x.dtype = *t.rtype;
    x.numel = t.numel();
    x.data.resize(t.end - t.begin);
    fh.pread(h.data_start + t.begin, t.end - t.begin, x.data.data());
    f.all_f32 &= x.dtype == DType::F32;
    f.tensors.emplace(name, std::move(x));
  }
  if (f.tensors.empty()) fail(ErrorCode::kInvalidArgument, path, " holds no tensors");
  return f;
}

// A torch.save state dict (e.g. DeepSpeed's zero_to_fp32 output): name -> tensor, possibly nested
// (Megatron's module dict) or under a "module" key. DeepSpeed module names are mapped to the
// canonical names `inspect` shows: pipeline names by the role of each spec (transformer specs
// numbered in spec order), plain-engine names by their Megatron path (formats.md §1.3-1.4).
StateDict read_torch_file(const std::string& path) {
  StateDict f;
  f.path = path;
  pt::TorchArchive ar = pt::open_torch_file(path);
  const pt::PyValue* root = &ar.root();
  if (root->is(pt::PyValue::Kind::Dict))
    if (const pt::PyValue* m = root->get("module"); m && m->is(pt::PyValue::Kind::Dict)) root = m;
  if (!root->is(pt::PyValue::Kind::Dict))
    fail(ErrorCode::kInvalidArgument, path, ": expected a state dict (name -> tensor) at the top level, found ", root->kind_name());
  std::vector<std::pair<std::string, const pt::TensorInfo*>> flat;
  std::function<void(const pt::PyValue&, const std::string&)> walk = [&](const pt::PyValue& d, const std::string& pre) {
    for (const auto& [k, v] : d.entries) {
      if (!k || !k->is(pt::PyValue::Kind::String)) continue;
      const std::string name = pre.empty() ? k->text : pre + "." + k->text;
      if (v->is(pt::PyValue::Kind::Dict)) walk(*v, name);
      else if (v->is(pt::PyValue::Kind::Tensor)) flat.push_back({name, v->tensor.get()});
    }
  };
  walk(*root, "");
  if (flat.empty()) fail(ErrorCode::kInvalidArgument, path, " holds no tensors");
  // Pipeline names: roles per spec from the local names inside it.
  std::map<int, std::set<std::string>> spec_locals;
  bool pipeline = false;
  for (const auto& [n, t] : flat) {
    ds::PipeName pn = ds::split_pipe_name(n);
    if (pn.spec >= 0 || !pn.tied.empty()) pipeline = true;
    if (pn.spec >= 0) spec_locals[pn.spec].insert(pn.local);
  }
  std::map<int, std::pair<ds::SpecRole, int>> spec_role;  // spec -> (role, global layer)
  int layer = 0;
  for (const auto& [spec, locals] : spec_locals) {
    ds::SpecRole r = ds::role_of_locals(locals);
    spec_role[spec] = {r, r == ds::SpecRole::kTransformer ? layer++ : -1};
  }
  io::File fh = io::File::open_read(path);
  for (const auto& [n, t] : flat) {
    std::string canonical;
    if (pipeline) {
      ds::PipeName pn = ds::split_pipe_name(n);
      if (!pn.tied.empty()) {
        canonical = ds::canonical_in_spec(ds::SpecRole::kEmbedding, -1, pn.local, n);
      } else if (pn.spec >= 0) {
        auto [role, l] = spec_role[pn.spec];
        if (role == ds::SpecRole::kNormCandidate) role = ds::SpecRole::kFinalNorm;
        canonical = ds::canonical_in_spec(role, l, pn.local, n);
      } else {
        canonical = n;
      }
    } else {
      canonical = ds::canonical_plain(n);
    }
    if (!t->dtype_known) fail(ErrorCode::kUnsupported, path, ": tensor ", n, " has dtype ", t->torch_dtype, ", which reshard does not read");
    if (!t->is_contiguous()) fail(ErrorCode::kUnsupported, path, ": tensor ", n, " is not contiguous");
    StateDictTensor x;
    x.shape = t->shape;
    x.dtype = t->dtype;
    x.numel = int64_t(t->numel());
    x.data.resize(size_t(x.numel) * dtype_size(x.dtype));
    if (!x.data.empty()) fh.pread(ar.tensor_data_offset(*t), x.data.size(), x.data.data());
    f.all_f32 &= x.dtype == DType::F32;
    if (!f.tensors.emplace(canonical, std::move(x)).second)
      fail(ErrorCode::kInvalidArgument, path, ": two tensors map to the canonical name ", canonical);
  }
  return f;
}

}  // namespace

bool is_state_dict_file(const std::string& path) {
  return is_regular_file(path) && (has_suffix(path, ".safetensors") || has_suffix(path, ".pt") ||
                                   has_suffix(path, ".bin") || has_suffix(path, ".pth"));
}

StateDict read_state_dict(const std::string& path) {
  if (!is_state_dict_file(path))
    fail(ErrorCode::kInvalidArgument, path, " is not a state-dict file (a regular .safetensors, .pt, .pth or .bin file)");
  return has_suffix(path, ".safetensors") ? read_safetensors_file(path) : read_torch_file(path);
}

}  // namespace reshard
