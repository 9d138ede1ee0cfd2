// torch.distributed.checkpoint folders: `.metadata` + `__<rank>_<n>.distcp` data files.
//
// Format facts (PyTorch torch/distributed/checkpoint/{metadata,filesystem}.py, observed with
// torch 2.13; docs/format.md "DCP"):
//  * `.metadata` is a pickle (protocol 4) of Metadata(state_dict_metadata, planner_data,
//    storage_data, storage_meta, version): dataclasses built by NEWOBJ + BUILD with a dict state.
//    state_dict_metadata maps each flat key to TensorStorageMetadata(properties, size, chunks) or
//    BytesStorageMetadata(); TensorProperties' state is the tuple (dtype, layout, requires_grad,
//    memory_format, pin_memory); each ChunkStorageMetadata holds offsets and sizes (torch.Size) in
//    elements of the global tensor. storage_data maps MetadataIndex(fqn, offset) to
//    _StorageInfo(relative_path, offset, length, transform_descriptors).
//  * The bytes at [offset, offset + length) of relative_path are one torch.save archive of the
//    chunk (a contiguous tensor of the chunk's sizes, its storage record exactly the chunk), or
//    of the object of a bytes entry.
//  * Flat keys come from flatten_state_dict: nested dict keys joined with '.', list indices as
//    numbers ("optim.param_groups.0.lr").
#include "formats/dcp/dcp_reader.h"
#include "formats/torch/record_check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "io/file.h"
#include "reshard/error.h"
#include "reshard/layout.h"
#include "reshard/torch_archive.h"

namespace reshard {
namespace {

using pt::PyValue;
using Kind = PyValue::Kind;

constexpr const char* kMetadata = ".metadata";
constexpr uint64_t kMaxMetadataBytes = uint64_t(1) << 30;

// A window of another byte source: a chunk's torch.save archive inside a .distcp file.
class SliceSource final : public pt::ByteSource {
 public:
  SliceSource(const pt::ByteSource& base, uint64_t offset, uint64_t length) : base_(base), off_(offset), len_(length) {}
  uint64_t size() const override { return len_; }
  void read(uint64_t offset, uint64_t len, void* dst) const override {
    if (offset > len_ || len > len_ - offset)
      fail(ErrorCode::kDataLoss, "read [", offset, ", ", offset + len, ") past a ", len_, "-byte archive");
    base_.read(off_ + offset, len, dst);
  }

 private:
  const pt::ByteSource& base_;
  uint64_t off_, len_;
};

// The pickle globals a DCP `.metadata` may name; everything else is refused by name.
bool allowed_global(const std::string& module, const std::string& name) {
  static const std::set<std::pair<std::string, std::string>> ok = {
      {"torch.distributed.checkpoint.metadata", "Metadata"},
      {"torch.distributed.checkpoint.metadata", "TensorStorageMetadata"},
      {"torch.distributed.checkpoint.metadata", "BytesStorageMetadata"},
      {"torch.distributed.checkpoint.metadata", "TensorProperties"},
      {"torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"},
      {"torch.distributed.checkpoint.metadata", "MetadataIndex"},
      {"torch.distributed.checkpoint.metadata", "StorageMeta"},
      {"torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"},
      {"torch.distributed.checkpoint.filesystem", "_StorageInfo"},
      {"torch.serialization", "_get_layout"},
      {"torch", "Size"},
      {"collections", "OrderedDict"},
      {"pathlib", "PosixPath"},
      {"pathlib", "PurePosixPath"},
      {"pathlib", "WindowsPath"},
      {"pathlib", "PureWindowsPath"},
  };
  return ok.count({module, name}) > 0;
}

// A dataclass field: the BUILD state dict (or the dict of a (dict, slots) / (None, slots) pair).
const PyValue* field(const PyValue* obj, const char* name) {
  if (!obj) return nullptr;
  if (obj->kind == Kind::Dict) return obj->get(name);
  if (obj->kind != Kind::Object) return nullptr;
  if (const PyValue* v = obj->get(name)) return v;
  const PyValue* st = obj->state;
  if (st && st->kind == Kind::Tuple && st->items.size() == 2 && st->items[1]->kind == Kind::Dict)
    return st->items[1]->get(name);
  return nullptr;
}

bool is_object(const PyValue* v, const char* cls) { return v && v->kind == Kind::Object && v->name == cls; }

std::vector<int64_t> ints(const PyValue* v, const std::string& what) {
  if (!v || (v->kind != Kind::Tuple && v->kind != Kind::List))
    fail(ErrorCode::kDataLoss, what, " is not a tuple of ints (", v ? v->kind_name() : "missing", ")");
  std::vector<int64_t> out;
  for (const PyValue* x : v->items) {
    if (x->kind != Kind::Int || x->integer < 0) fail(ErrorCode::kDataLoss, what, " holds ", x->repr(40), ", not a size");
    out.push_back(x->integer);
  }
  return out;
}

std::string box_text(const std::vector<int64_t>& off, const std::vector<int64_t>& len) {
  std::string s = "[";
  for (size_t d = 0; d < off.size(); ++d)
    s += (d ? ", " : "") + std::to_string(off[d]) + ":" + std::to_string(off[d] + len[d]);
  return s + "]";
}

// "__3_0.distcp" -> 3 (the writing rank); -1 for another name.
int writer_rank(const std::string& rel) {
  if (rel.size() < 10 || rel.compare(0, 2, "__") != 0) return -1;
  size_t i = 2, n = 0;
  long r = 0;
  while (i < rel.size() && std::isdigit(static_cast<unsigned char>(rel[i])) && n < 9) r = r * 10 + (rel[i++] - '0'), ++n;
  if (n == 0 || i >= rel.size() || rel[i] != '_') return -1;
  return int(r);
}

struct Chunk {
  std::string key;
  std::vector<int64_t> off, len;
  std::string rel;       // data file
  uint64_t offset = 0, length = 0;  // the chunk's archive in that file
};

struct StorageInfo {
  std::string rel;
  uint64_t offset = 0, length = 0;
};

class DcpReader final : public CheckpointReader {
 public:
  std::string writer() const override { return "dcp"; }
  std::string path() const override { return dir_; }
  const SourceLayout& source() const override { return source_; }
  const NonTensorState& state() const override { return state_; }
  std::vector<std::string> notes() const override { return notes_; }

  void read(int32_t file, uint64_t offset, uint64_t length, void* dst) const override {
    if (file < 0 || size_t(file) >= fds_.size())
      fail(ErrorCode::kNotFound, "DCP checkpoint ", dir_, ": no file with index ", file);
    fds_[size_t(file)].pread(offset, length, dst);
  }
  const uint8_t* mapped(int32_t file) const override {
    if (file < 0 || size_t(file) >= fds_.size()) return nullptr;
    const io::MappedFile* m = maps_->get(size_t(file));
    return m ? m->data() : nullptr;
  }
  void drop_mapped_pages() const override { maps_->drop_all(); }
  std::string fingerprint() const override { return fingerprint_; }
  uint64_t file_size(int32_t file) const override {
    if (file < 0 || size_t(file) >= fds_.size())
      fail(ErrorCode::kNotFound, "DCP checkpoint ", dir_, ": no file with index ", file);
    const io::File::Stamp now = fds_[size_t(file)].stamp();
    if (!(now == stamps_[size_t(file)]))
      fail(ErrorCode::kDataLoss, source_.files[size_t(file)], " changed since the checkpoint was opened (",
           stamps_[size_t(file)].size, " -> ", now.size, " bytes); open the checkpoint again");
    return now.size;
  }
  // Each chunk's storage record carries the zip CRC-32 of its bytes (csrc/formats/torch/record_check.h).
  bool has_checksum(int32_t file, uint64_t offset, uint64_t length) const override {
    return pt::zip_records_have(records_, file, offset, length);
  }
  std::unique_ptr<RangeCheck> begin_check(int32_t file, uint64_t offset, uint64_t length) const override {
    if (!has_checksum(file, offset, length)) return nullptr;
    return pt::zip_record_check(source_.files[size_t(file)], offset, length, records_[size_t(file)].at(offset).second,
                                " of its chunk");
  }
  std::vector<ChecksumUnit> checksum_units() const override {
    return pt::zip_record_units(records_);
  }

  std::string dir_, fingerprint_;
  SourceLayout source_;
  NonTensorState state_;
  std::vector<std::string> notes_;
  std::vector<io::File> fds_;
  std::vector<io::File::Stamp> stamps_;
  pt::ZipRecords records_;  // offset -> (length, crc)
  std::unique_ptr<io::MappedFileSet> maps_;
};

// Where the optimizer's and the model's entries sit among the flat keys.
struct Prefixes {
  std::string optim;  // "optim." for "optim.state.<fqn>.exp_avg"
  std::string model;  // "model." for "model.<fqn>"
  bool optim_found = false;
};

// The optimizer kind a key ends with ("exp_avg", "exp_avg_sq", "step"), or "".
std::string optim_kind(const std::string& key) {
  for (const char* k : {".exp_avg_sq", ".exp_avg", ".step"}) {
    const size_t n = std::strlen(k);
    if (key.size() > n && key.compare(key.size() - n, n, k) == 0) return k + 1;
  }
  return "";
}

// Position of "state." at a segment boundary, or npos.
size_t state_segment(const std::string& key) {
  for (size_t p = key.find("state."); p != std::string::npos; p = key.find("state.", p + 1))
    if (p == 0 || key[p - 1] == '.') return p;
  return std::string::npos;
}

Prefixes infer_prefixes(const std::vector<std::string>& tensor_keys) {
  Prefixes px;
  std::set<std::string> fqns;
  for (const auto& k : tensor_keys) {
    const std::string kind = optim_kind(k);
    const size_t p = state_segment(k);
    if (kind.empty() || p == std::string::npos) continue;
    const std::string pre = k.substr(0, p);
    if (!px.optim_found) px.optim = pre, px.optim_found = true;
    if (pre != px.optim) continue;
    const size_t b = p + 6, e = k.size() - kind.size() - 1;
    if (e > b) fqns.insert(k.substr(b, e - b));
  }
  std::map<std::string, size_t> votes;
  bool all_model = true;
  size_t model_keys = 0;
  for (const auto& k : tensor_keys) {
    if (px.optim_found && k.compare(0, px.optim.size() + 6, px.optim + "state.") == 0) continue;
    ++model_keys;
    all_model &= k.compare(0, 6, "model.") == 0;
    for (size_t p = 0; p < k.size(); p = k.find('.', p) + 1) {
      if (fqns.count(k.substr(p))) {
        ++votes[k.substr(0, p)];
        break;
      }
      if (k.find('.', p) == std::string::npos) break;
    }
  }
  if (!votes.empty()) {
    px.model = std::max_element(votes.begin(), votes.end(), [](auto& a, auto& b) { return a.second < b.second; })->first;
  } else if (all_model && model_keys > 0) {
    px.model = "model.";
  }
  return px;
}

struct Builder {
  DcpReader* r = nullptr;
  std::string dir, meta_path;
  std::map<std::string, int32_t> file_index;  // relative path -> index into r->source_.files (-1 missing)
  std::vector<std::unique_ptr<pt::FileSource>> sources;

  int32_t file_of(const std::string& rel) {
    auto it = file_index.find(rel);
    if (it != file_index.end()) return it->second;
    const bool control = std::any_of(rel.begin(), rel.end(), [](char ch) { return uint8_t(ch) < 0x20 || ch == 127; });
    if (rel.empty() || control || rel.find('/') != std::string::npos || rel == "." || rel == "..")
      fail(ErrorCode::kDataLoss, meta_path, " names data file '", rel.substr(0, 80), "', not a file name in the folder");
    const std::string p = io::join(dir, rel);
    int32_t idx = -1;
    if (io::is_file(p)) {
      idx = int32_t(r->source_.files.size());
      r->source_.files.push_back(p);
      r->fds_.push_back(io::File::open_read(p));
      r->stamps_.push_back(r->fds_.back().stamp());
      r->records_.emplace_back();
      sources.push_back(std::make_unique<pt::FileSource>(p));
    } else {
      r->source_.missing_files.push_back(p);
    }
    file_index[rel] = idx;
    return idx;
  }

  // The archive of a chunk or bytes entry, checked to lie inside its file.
  pt::TorchArchive archive(int32_t f, uint64_t offset, uint64_t length, const std::string& key) {
    const pt::FileSource& src = *sources[size_t(f)];
    if (offset > src.size() || length > src.size() - offset)
      fail(ErrorCode::kDataLoss, src.path(), ": entry ", key, " at bytes [", offset, ", ", offset + length,
           ") runs past the end of the file (", src.size(), " bytes; truncated?)");
    SliceSource slice(src, offset, length);
    return pt::open_torch_archive(slice, src.path() + " (entry " + key + " at byte " + std::to_string(offset) + ")");
  }
};

}  // namespace

bool is_dcp_step(const std::string& dir) { return io::is_file(io::join(dir, kMetadata)); }

std::unique_ptr<CheckpointReader> open_dcp(const std::string& dir, const OpenOptions& opt, std::vector<std::string> notes) {
  if (gives_model(opt))
    fail(ErrorCode::kInvalidArgument, dir, " is a torch.distributed.checkpoint folder, read by its keys; ",
         given_model_name(opt), " does not apply to it: leave it out");
  auto reader = std::make_unique<DcpReader>();
  DcpReader* r = reader.get();
  r->dir_ = dir;
  r->notes_ = std::move(notes);
  Builder b;
  b.r = r;
  b.dir = dir;
  b.meta_path = io::join(dir, kMetadata);

  const std::string text = io::read_text(b.meta_path, kMaxMetadataBytes);
  {
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", (unsigned long long)XXH3_64bits(text.data(), text.size()));
    r->fingerprint_ = hex;
  }
  std::shared_ptr<const pt::PickleDocument> doc;
  try {
    doc = pt::parse_pickle(reinterpret_cast<const uint8_t*>(text.data()), text.size(), b.meta_path);
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kInvalidArgument) throw;
    fail(ErrorCode::kDataLoss, e.what(), " (a damaged or partly written DCP .metadata)");
  }
  for (const auto& n : doc->nodes())
    if (n->kind == Kind::Global && !allowed_global(n->module, n->name))
      fail(ErrorCode::kInvalidArgument, b.meta_path, ": the pickle names ", n->module, ".", n->name,
           ", which is not a DCP metadata class; refused (reshard never runs code from a checkpoint)");
  const PyValue* root = &doc->root();
  if (!is_object(root, "Metadata"))
    fail(ErrorCode::kDataLoss, b.meta_path, ": the pickle is a ", root->kind_name(), " ", root->repr(60),
         ", not a DCP Metadata");
  const PyValue* sdm = field(root, "state_dict_metadata");
  const PyValue* sd = field(root, "storage_data");
  if (!sdm || sdm->kind != Kind::Dict || !sd || sd->kind != Kind::Dict)
    fail(ErrorCode::kDataLoss, b.meta_path, ": Metadata lacks state_dict_metadata or storage_data dicts");
  nlohmann::ordered_json dcp_json = nlohmann::ordered_json::object();
  if (const PyValue* v = field(root, "version"); v && v->kind == Kind::String) dcp_json["version"] = v->text;
  if (const PyValue* sm = field(root, "storage_meta"))
    if (const PyValue* id = field(sm, "save_id"); id && id->kind == Kind::String) dcp_json["save_id"] = id->text;

  // storage_data: (fqn, chunk offsets) -> byte range.
  std::map<std::pair<std::string, std::vector<int64_t>>, StorageInfo> where;
  for (const auto& [k, v] : sd->entries) {
    const PyValue* fqn = field(k, "fqn");
    if (!is_object(k, "MetadataIndex") || !fqn || fqn->kind != Kind::String || !is_object(v, "_StorageInfo"))
      fail(ErrorCode::kDataLoss, b.meta_path, ": a storage_data entry is not MetadataIndex -> _StorageInfo");
    const PyValue* off = field(k, "offset");
    std::vector<int64_t> o = off && !off->is_none() ? ints(off, "storage offset of " + fqn->text) : std::vector<int64_t>{};
    const PyValue* rel = field(v, "relative_path");
    const PyValue* bo = field(v, "offset");
    const PyValue* bl = field(v, "length");
    if (!rel || rel->kind != Kind::String || !bo || bo->kind != Kind::Int || !bl || bl->kind != Kind::Int ||
        bo->integer < 0 || bl->integer < 0)
      fail(ErrorCode::kDataLoss, b.meta_path, ": the storage of ", fqn->text, " has no file, offset and length");
    if (const PyValue* t = field(v, "transform_descriptors"); t && !t->is_none() && !t->items.empty())
      fail(ErrorCode::kUnsupported, b.meta_path, ": ", fqn->text, " is stored through transforms (",
           t->repr(80), "); reshard reads DCP files written without compression or other extensions");
    where[{fqn->text, o}] = {rel->text, uint64_t(bo->integer), uint64_t(bl->integer)};
  }

  // Entries: tensors (with chunks) and bytes.
  struct TensorEntry {
    std::string key;
    std::vector<int64_t> size;
    std::string dtype;
    std::vector<Chunk> chunks;
  };
  std::vector<TensorEntry> tensors;
  std::vector<std::string> bytes_keys;
  for (const auto& [k, v] : sdm->entries) {
    if (k->kind != Kind::String) fail(ErrorCode::kDataLoss, b.meta_path, ": a state_dict_metadata key is not a string");
    if (is_object(v, "BytesStorageMetadata")) {
      bytes_keys.push_back(k->text);
      continue;
    }
    if (!is_object(v, "TensorStorageMetadata"))
      fail(ErrorCode::kDataLoss, b.meta_path, ": entry ", k->text, " is ", v->repr(60), ", not tensor or bytes metadata");
    TensorEntry t;
    t.key = k->text;
    t.size = ints(field(v, "size"), "the size of " + k->text);
    const PyValue* props = field(v, "properties");
    const PyValue* dt = props && props->state && props->state->kind == Kind::Tuple && !props->state->items.empty()
                            ? props->state->items[0]
                            : field(props, "dtype");
    if (!dt || dt->kind != Kind::Dtype) fail(ErrorCode::kDataLoss, b.meta_path, ": entry ", k->text, " records no dtype");
    t.dtype = dt->text;
    const PyValue* chunks = field(v, "chunks");
    if (!chunks || chunks->kind != Kind::List) fail(ErrorCode::kDataLoss, b.meta_path, ": entry ", k->text, " has no chunk list");
    for (const PyValue* c : chunks->items) {
      Chunk ch;
      ch.key = t.key;
      ch.off = ints(field(c, "offsets"), "a chunk offset of " + k->text);
      ch.len = ints(field(c, "sizes"), "a chunk size of " + k->text);
      if (ch.off.size() != t.size.size() || ch.len.size() != t.size.size())
        fail(ErrorCode::kDataLoss, b.meta_path, ": a chunk of ", k->text, " has ", ch.off.size(), " dims, the tensor ",
             t.size.size());
      for (size_t d = 0; d < t.size.size(); ++d)
        if (ch.off[d] > t.size[d] || ch.len[d] > t.size[d] - ch.off[d])
          fail(ErrorCode::kDataLoss, b.meta_path, ": chunk ", box_text(ch.off, ch.len), " of ", k->text,
               " lies outside its size ", box_text(std::vector<int64_t>(t.size.size(), 0), t.size));
      auto it = where.find({t.key, ch.off});
      if (it == where.end())
        fail(ErrorCode::kDataLoss, b.meta_path, ": chunk ", box_text(ch.off, ch.len), " of ", k->text,
             " has no storage entry (no file holds it)");
      ch.rel = it->second.rel, ch.offset = it->second.offset, ch.length = it->second.length;
      t.chunks.push_back(std::move(ch));
    }
    tensors.push_back(std::move(t));
  }

  std::vector<std::string> tensor_keys;
  for (const auto& t : tensors) tensor_keys.push_back(t.key);
  const Prefixes px = infer_prefixes(tensor_keys);
  const std::string optim_state = px.optim + "state.";
  dcp_json["prefixes"] = {{"model", px.model}, {"optim", px.optim_found ? optim_state : std::string()}};
  r->notes_.push_back("DCP keys: model tensors under '" + px.model + "'" +
                      (px.optim_found ? ", optimizer state under '" + optim_state + "'" : ", no optimizer state") +
                      " (inferred from the keys)");

  // Tensors -> arrays; step counters -> the state.
  std::vector<ExplicitArray> arrays;
  std::vector<ExplicitBuffer> buffers;
  std::vector<BufferLocation> locations;
  std::map<std::string, double> steps;  // fqn -> step
  std::vector<std::string> skipped;
  int world = 1;
  for (const auto& t : tensors)
    for (const auto& c : t.chunks) {
      const int wr = writer_rank(c.rel);
      if (wr >= kMaxWorldSize)
        fail(ErrorCode::kDataLoss, b.meta_path, ": data file ", c.rel, " names writer rank ", wr, ", beyond the ",
             kMaxWorldSize, " ranks a job may have");
      world = std::max(world, wr + 1);
    }
  for (const auto& t : tensors) {
    std::string name = t.key;
    StateKind state = StateKind::kWeight;
    std::string kind;
    if (px.optim_found && t.key.compare(0, optim_state.size(), optim_state) == 0 && !(kind = optim_kind(t.key)).empty()) {
      name = t.key.substr(optim_state.size(), t.key.size() - optim_state.size() - kind.size() - 1);
      if (kind == "step") {
        if (!t.size.empty() || t.chunks.size() != 1)
          fail(ErrorCode::kDataLoss, b.meta_path, ": step counter ", t.key, " is not one scalar");
        const Chunk& c = t.chunks[0];
        const int32_t f = b.file_of(c.rel);
        if (f < 0) {
          skipped.push_back(t.key + " (its file " + c.rel + " is missing)");
          continue;
        }
        pt::TorchArchive ar = b.archive(f, c.offset, c.length, t.key);
        if (ar.tensors.size() != 1 || ar.tensors[0].value->tensor->numel() != 1)
          fail(ErrorCode::kDataLoss, b.sources[size_t(f)]->path(), ": step counter ", t.key, " is not one scalar tensor");
        const pt::TensorInfo& ti = *ar.tensors[0].value->tensor;
        uint8_t raw[8] = {};
        if (ti.itemsize > 8) fail(ErrorCode::kUnsupported, "step counter ", t.key, " has dtype ", ti.torch_dtype);
        b.sources[size_t(f)]->read(c.offset + ar.tensor_data_offset(ti), ti.itemsize, raw);
        double v = 0;
        if (ti.torch_dtype == "float32") { float x; std::memcpy(&x, raw, 4); v = x; }
        else if (ti.torch_dtype == "float64") std::memcpy(&v, raw, 8);
        else if (ti.torch_dtype == "int64") { int64_t x; std::memcpy(&x, raw, 8); v = double(x); }
        else fail(ErrorCode::kUnsupported, "step counter ", t.key, " has dtype ", ti.torch_dtype);
        steps[name] = v;
        continue;
      }
      state = kind == "exp_avg" ? StateKind::kExpAvg : StateKind::kExpAvgSq;
    } else if (!px.model.empty() && t.key.compare(0, px.model.size(), px.model) == 0) {
      name = t.key.substr(px.model.size());
    }
    if (t.size.empty()) {
      skipped.push_back(t.key + " (a 0-d tensor)");
      continue;
    }
    uint32_t itemsize = 0;
    bool known = false;
    DType dtype = DType::F32;
    if (!pt::torch_dtype_info(t.dtype, &itemsize, &known, &dtype) || !known)
      fail(ErrorCode::kUnsupported, b.meta_path, ": tensor ", t.key, " has dtype ", t.dtype, ", which reshard does not load");
    const int32_t a = int32_t(arrays.size());
    arrays.push_back({name, state, t.size});
    // Overlapping chunks would make the value of an element depend on which one is read.
    std::vector<const Chunk*> order;
    for (const auto& c : t.chunks) {
      int64_t n = 1;
      for (int64_t d : c.len) n *= d;
      if (n > 0) order.push_back(&c);
    }
    std::sort(order.begin(), order.end(), [](const Chunk* x, const Chunk* y) { return x->off < y->off; });
    for (size_t i = 0; i < order.size(); ++i)
      for (size_t j = i + 1; j < order.size() && order[j]->off[0] < order[i]->off[0] + order[i]->len[0]; ++j) {
        bool overlap = true;
        for (size_t d = 0; d < t.size.size(); ++d)
          overlap &= order[j]->off[d] < order[i]->off[d] + order[i]->len[d] &&
                     order[i]->off[d] < order[j]->off[d] + order[j]->len[d];
        if (overlap)
          fail(ErrorCode::kDataLoss, b.meta_path, ": tensor ", t.key, ": chunks ", box_text(order[i]->off, order[i]->len),
               " (", order[i]->rel, ") and ", box_text(order[j]->off, order[j]->len), " (", order[j]->rel,
               ") overlap; a checkpoint holds each element once");
      }
    for (const Chunk* c : order) {
      const int32_t f = b.file_of(c->rel);
      ExplicitBuffer buf;
      buf.name = t.key + "@" + box_text(c->off, c->len);
      buf.rank = std::max(0, writer_rank(c->rel));
      buf.dtype = dtype;
      buf.array = a;
      buf.offsets = c->off;
      buf.sizes = c->len;
      uint64_t numel = 1;
      for (int64_t d : c->len) numel *= uint64_t(d);
      BufferLocation loc;
      if (f >= 0) {
        pt::TorchArchive ar = b.archive(f, c->offset, c->length, t.key);
        const std::string at = b.sources[size_t(f)]->path() + ": chunk " + box_text(c->off, c->len) + " of " + t.key;
        if (ar.tensors.size() != 1) fail(ErrorCode::kDataLoss, at, " holds ", ar.tensors.size(), " tensors, not one");
        const pt::TensorInfo& ti = *ar.tensors[0].value->tensor;
        if (ti.torch_dtype != t.dtype || ti.shape != c->len || !ti.is_contiguous())
          fail(ErrorCode::kDataLoss, at, " holds a ", ti.torch_dtype, " tensor of shape ",
               box_text(std::vector<int64_t>(ti.shape.size(), 0), ti.shape), ti.is_contiguous() ? "" : " (not contiguous)",
               "; the metadata says ", t.dtype, " ", box_text(std::vector<int64_t>(c->len.size(), 0), c->len));
        loc.file = f;
        loc.byte_offset = c->offset + ar.tensor_data_offset(ti);
        // The chunk's storage record is its checksum unit: exactly the chunk's bytes as DCP writes
        // them, or a larger record (a view saved by another writer), which verify="full" then
        // reads whole.
        const pt::StorageRecord& rec = ar.record(ti);
        if (const pt::ZipEntry* e = ar.zip.find(ar.prefix + "/data/" + rec.key))
          r->records_[size_t(f)][c->offset + rec.offset] = {rec.length, e->crc32};
        else
          fail(ErrorCode::kDataLoss, at, ": its storage record ", rec.key, " is not in the archive");
      }
      buffers.push_back(std::move(buf));
      locations.push_back(loc);
    }
  }
  for (const auto& m : r->source_.missing_files) r->notes_.push_back("missing file: " + m);
  if (!skipped.empty()) {
    std::string s;
    for (const auto& k : skipped) s += (s.empty() ? "" : "; ") + k;
    r->notes_.push_back("not loaded: " + s);
  }

  // Step counters: one value when they agree (Adam's bias correction), each named otherwise.
  nlohmann::ordered_json param_steps = nlohmann::ordered_json::object();
  for (const auto& [fqn, v] : steps) param_steps[fqn] = v;
  if (!steps.empty()) {
    dcp_json["param_steps"] = param_steps;
    const double first = steps.begin()->second;
    const bool same = std::all_of(steps.begin(), steps.end(), [&](auto& kv) { return kv.second == first; });
    const bool whole = std::isfinite(first) && first >= 0 && first <= 9007199254740992.0 && first == std::floor(first);
    if (same && whole) r->state_.step = int64_t(first);
    else if (same) r->notes_.push_back("the optimizer's step counters hold " + std::to_string(first) +
                                       ", not a whole step count; kept as given (state JSON dcp.param_steps)");
    else r->notes_.push_back("the optimizer's step counters differ between parameters; each is kept (state JSON dcp.param_steps)");
  }
  // Non-tensor entries: parsed (never executed) into the state JSON where they are plain values.
  nlohmann::ordered_json values = nlohmann::ordered_json::object();
  std::vector<std::string> unread;
  for (const auto& k : bytes_keys) {
    auto it = where.find({k, {}});
    const int32_t f = it == where.end() ? -1 : b.file_of(it->second.rel);
    if (f < 0) {
      unread.push_back(k);
      continue;
    }
    try {
      pt::TorchArchive ar = b.archive(f, it->second.offset, it->second.length, k);
      values[k] = ar.root().to_json(32, 1u << 16);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kDataLoss) throw;
      unread.push_back(k);
    }
  }
  if (!bytes_keys.empty()) {
    dcp_json["values"] = values;
    r->notes_.push_back(std::to_string(bytes_keys.size() - unread.size()) +
                        " non-tensor entries (optimizer hyperparameters and the like) read into the state JSON (dcp.values)" +
                        (unread.empty() ? std::string() : "; not read: " + unread[0] + (unread.size() > 1 ? ", ..." : "")));
  }
  r->state_.json = nlohmann::ordered_json{{"dcp", dcp_json}}.dump();

  Topology topo;
  topo.dp = world;
  topo.zero = 3;
  r->source_.layout = explicit_layout("DCP checkpoint " + dir, topo, arrays, buffers);
  r->source_.locations = std::move(locations);
  r->maps_ = std::make_unique<io::MappedFileSet>(r->source_.files, [r](size_t i) { return r->fds_[i].fd(); });
  return reader;
}

}  // namespace reshard
