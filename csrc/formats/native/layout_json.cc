#include "formats/native/layout_json.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <unordered_map>

#include "formats/native/native_internal.h"
#include "reshard/error.h"
#include "reshard/native.h"
#include "reshard/plan.h"

namespace reshard::native {

// ---------------------------------------------------------------------------------------------
// Field

std::string Field::path_of(const Node* up, std::string_view key, int64_t index) {
  if (!up) return std::string();
  std::string p = path_of(up->up.get(), up->key, up->index);
  if (index >= 0) return p + "[" + std::to_string(index) + "]";
  return p.empty() ? std::string(key) : p + "." + std::string(key);
}

std::string Field::path() const { return path_of(up_.get(), key_, index_); }

const std::shared_ptr<const Field::Node>& Field::node() const {
  if (!node_) node_ = std::make_shared<const Node>(Node{up_, key_, index_});
  return node_;
}

void Field::bad(const std::string& why) const {
  const std::string p = path();
  fail(ErrorCode::kDataLoss, file_, ": field '", p.empty() ? "<root>" : p, "': ", why);
}

bool Field::has(std::string_view key) const {
  simdjson::dom::object o;
  simdjson::dom::element v;
  return !e_.get_object().get(o) && !o.at_key(key).get(v);
}

Field Field::operator[](std::string_view key) const {
  simdjson::dom::object o;
  if (e_.get_object().get(o)) bad("expected an object");
  simdjson::dom::element v;
  if (o.at_key(key).get(v)) {
    const std::string p = path();
    fail(ErrorCode::kDataLoss, file_, ": field '", p.empty() ? std::string(key) : p + "." + std::string(key), "' is missing");
  }
  return Field(v, node(), key, -1, file_);
}

std::vector<Field> Field::items() const {
  simdjson::dom::array a;
  if (e_.get_array().get(a)) bad("expected an array");
  std::vector<Field> out;
  out.reserve(a.size());
  for (simdjson::dom::element v : a) out.push_back(Field(v, node(), std::string_view(), int64_t(out.size()), file_));
  return out;
}

std::vector<std::pair<std::string, Field>> Field::members() const {
  simdjson::dom::object o;
  if (e_.get_object().get(o)) bad("expected an object");
  std::vector<std::pair<std::string, Field>> out;
  for (simdjson::dom::key_value_pair kv : o) out.emplace_back(std::string(kv.key), Field(kv.value, node(), kv.key, -1, file_));
  return out;
}

size_t Field::size() const {
  simdjson::dom::array a;
  if (e_.get_array().get(a)) bad("expected an array");
  return a.size();
}

std::string Field::str() const {
  std::string_view v;
  if (e_.get_string().get(v)) bad("expected a string");
  return std::string(v);
}

int64_t Field::i64() const {
  if (e_.type() == simdjson::dom::element_type::UINT64) bad("integer out of range");
  int64_t v = 0;
  if (e_.type() != simdjson::dom::element_type::INT64 || e_.get_int64().get(v)) bad("expected an integer");
  return v;
}

double Field::f64() const {
  double v = 0;
  if (!e_.is_number() || e_.get_double().get(v)) bad("expected a number");
  return v;
}

bool Field::boolean() const {
  bool v = false;
  if (e_.get_bool().get(v)) bad("expected true or false");
  return v;
}

std::vector<int64_t> Field::i64s() const {
  simdjson::dom::array a;
  if (e_.get_array().get(a)) bad("expected an array");
  std::vector<int64_t> v;
  v.reserve(a.size());
  for (simdjson::dom::element x : a) {
    int64_t n = 0;
    if (x.type() != simdjson::dom::element_type::INT64 || x.get_int64().get(n))
      Field(x, node(), std::string_view(), int64_t(v.size()), file_).i64();  // names the element, throws
    v.push_back(n);
  }
  return v;
}

std::string Field::minified() const { return simdjson::minify(e_); }

namespace {

// Where refuse_duplicate_keys is in the document: a chain of its callers' frames on the stack,
// turned into a path ("pieces[3].len") only for a message.
struct At {
  const At* up;
  std::string_view key;  // a member's key, or
  size_t index;          // an array element's index (key empty)
  std::string path() const {
    if (!up) return std::string();
    std::string p = up->path();
    if (key.empty()) return p + "[" + std::to_string(index) + "]";
    return p.empty() ? std::string(key) : p + "." + std::string(key);
  }
};

// A key given twice in one object: simdjson's lookups take the first, Python's json and
// nlohmann the last, so two tools would read different metadata. Refused, naming the key.
void refuse_duplicate_keys(simdjson::dom::element e, const At& at, const std::string& file) {
  const auto nested = [](simdjson::dom::element v) {
    return v.type() == simdjson::dom::element_type::ARRAY || v.type() == simdjson::dom::element_type::OBJECT;
  };
  if (e.type() == simdjson::dom::element_type::ARRAY) {
    size_t i = 0;
    for (simdjson::dom::element v : simdjson::dom::array(e)) {
      if (nested(v)) refuse_duplicate_keys(v, At{&at, std::string_view(), i}, file);
      ++i;
    }
    return;
  }
  if (e.type() != simdjson::dom::element_type::OBJECT) return;
  std::vector<std::string_view> keys;
  for (simdjson::dom::key_value_pair kv : simdjson::dom::object(e)) {
    keys.push_back(kv.key);
    // An empty key is a member too: give it a name that is not an array index.
    if (nested(kv.value)) refuse_duplicate_keys(kv.value, At{&at, kv.key.empty() ? std::string_view("\"\"") : kv.key, 0}, file);
  }
  std::sort(keys.begin(), keys.end());
  for (size_t k = 1; k < keys.size(); ++k)
    if (keys[k] == keys[k - 1]) {
      const std::string path = at.path();
      fail(ErrorCode::kDataLoss, file, ": key '", keys[k], "' appears twice in ", path.empty() ? "the top-level object" : "field '" + path + "'",
           " (readers disagree on which one counts)");
    }
}

}  // namespace

JsonDoc::JsonDoc(std::string_view text, std::string file) : file_(std::move(file)) {
  if (text.substr(0, 3) == "\xEF\xBB\xBF")
    fail(ErrorCode::kDataLoss, file_, " is not valid JSON: it starts with a UTF-8 byte order mark (written by an editor?)");
  // simdjson reads up to SIMDJSON_PADDING bytes past the end: parse a padded copy.
  const simdjson::padded_string padded(text);
  if (auto err = parser_.parse(padded).get(root_)) {
    std::string why = simdjson::error_message(err);
    try {
      const json probe = json::parse(text);  // nlohmann names the line and column
      (void)probe;
    } catch (const json::exception& e) {
      why = e.what();
    }
    fail(ErrorCode::kDataLoss, file_, " is not valid JSON: ", why);
  }
  refuse_duplicate_keys(root_, At{nullptr, std::string_view(), 0}, file_);
}

namespace {

// Parses a name with a from_name function, turning its kInvalidArgument into a field error.
template <typename Fn>
auto parse_name(const Field& f, Fn fn) {
  std::string s = f.str();
  try {
    return fn(s);
  } catch (const Error& e) {
    f.bad(e.what());
  }
}

const char* reduction_name(Reduction r) { return r == Reduction::kPartialSum ? "partial_sum" : "replicated"; }
Reduction reduction_from(const Field& f) {
  std::string s = f.str();
  if (s == "replicated") return Reduction::kReplicated;
  if (s == "partial_sum") return Reduction::kPartialSum;
  f.bad("unknown reduction '" + s + "' (expected replicated or partial_sum)");
}

const char* owner_name(Owner o) {
  switch (o) {
    case Owner::kLayer: return "layer";
    case Owner::kFirstStage: return "first_stage";
    case Owner::kLastStage: return "last_stage";
    case Owner::kFirstAndLast: return "first_and_last";
  }
  return "layer";
}
Owner owner_from(const Field& f) {
  std::string s = f.str();
  if (s == "layer") return Owner::kLayer;
  if (s == "first_stage") return Owner::kFirstStage;
  if (s == "last_stage") return Owner::kLastStage;
  if (s == "first_and_last") return Owner::kFirstAndLast;
  f.bad("unknown owner '" + s + "' (expected layer, first_stage, last_stage, first_and_last)");
}

int small_int(const Field& f, int64_t lo, int64_t hi) {
  int64_t v = f.i64();
  if (v < lo || v > hi) f.bad("value " + std::to_string(v) + " outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return int(v);
}

json dims(const std::array<int64_t, kMaxDims>& a, int nd) { return std::vector<int64_t>(a.begin(), a.begin() + nd); }

void dims_from(const Field& f, int nd, std::array<int64_t, kMaxDims>& out, bool non_negative) {
  const std::vector<Field> v = f.items();
  if (int(v.size()) != nd) f.bad("expected " + std::to_string(nd) + " entries, found " + std::to_string(v.size()));
  for (int d = 0; d < nd; ++d) {
    out[d] = v[size_t(d)].i64();
    if (non_negative && out[d] < 0) v[size_t(d)].bad("must not be negative");
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Model

json model_to_json(const ModelConfig& m) {
  json rules = json::array();
  for (const auto& r : m.rules)
    rules.push_back({{"pattern", r.pattern}, {"split", split_name(r.split)}, {"reduction", reduction_name(r.reduction)}});
  json j = {{"name", m.name},
          {"num_layers", m.num_layers},
          {"hidden", m.hidden},
          {"ffn", m.ffn},
          {"heads", m.heads},
          {"query_groups", m.query_groups},
          {"vocab", m.vocab},
          {"vocab_divisible_by", m.vocab_divisible_by},
          {"max_position_embeddings", m.max_position_embeddings},
          {"swiglu", m.swiglu},
          {"tied_embeddings", m.tied_embeddings},
          {"bias", m.bias},
          {"norm", m.norm},
          {"param_dtype", dtype_name(m.param_dtype)},
          {"optimizer", m.optimizer},
          {"qkv_version", m.qkv_version},
          {"tp_gt_groups", qkv_variant_name(m.tp_gt_groups)},
          {"rules", rules}};
  // Written only when stated, so that the layout digest of files saved before the field existed
  // is computed from the same JSON when they are read back.
  if (!m.qkv_order.empty()) j["qkv_order"] = m.qkv_order;
  return j;
}

ModelConfig model_from_json(const Field& f) {
  ModelConfig m;
  m.name = f["name"].str();
  m.num_layers = small_int(f["num_layers"], 0, 1 << 20);
  m.hidden = small_int(f["hidden"], 0, INT32_MAX);
  m.ffn = small_int(f["ffn"], 0, INT32_MAX);
  m.heads = small_int(f["heads"], 0, INT32_MAX);
  m.query_groups = small_int(f["query_groups"], 0, INT32_MAX);
  m.vocab = f["vocab"].i64();
  m.vocab_divisible_by = small_int(f["vocab_divisible_by"], 1, INT32_MAX);
  m.max_position_embeddings = small_int(f["max_position_embeddings"], 0, INT32_MAX);
  m.swiglu = f["swiglu"].boolean();
  m.tied_embeddings = f["tied_embeddings"].boolean();
  m.bias = f["bias"].boolean();
  m.norm = f["norm"].str();
  m.param_dtype = parse_name(f["param_dtype"], dtype_from_name);
  m.optimizer = f["optimizer"].str();
  m.qkv_version = f["qkv_version"].f64();
  if (f.has("qkv_order")) m.qkv_order = f["qkv_order"].str();
  m.tp_gt_groups = parse_name(f["tp_gt_groups"], qkv_variant_from_name);
  for (const Field& rule : f["rules"].items()) {
    LayoutRule r;
    r.pattern = rule["pattern"].str();
    r.split = parse_name(rule["split"], split_from_name);
    r.reduction = reduction_from(rule["reduction"]);
    m.rules.push_back(r);
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Layout

int64_t piece_span(const Piece& p) { return box_span(p.box, p.strides); }

json layout_to_json(const Layout& L, const std::vector<std::string>& buffer_files,
                    const std::vector<std::string>& checksums) {
  json tensors = json::array();
  for (const auto& t : L.tensors) {
    tensors.push_back({{"name", t.name},
                       {"shape", t.shape},
                       {"split", split_name(t.split)},
                       {"reduction", reduction_name(t.reduction)},
                       {"owner", owner_name(t.owner)},
                       {"layer", t.layer},
                       {"no_weight_decay", t.no_weight_decay},
                       {"real_rows", t.real_rows}});
  }
  json arrays = json::array();
  for (const auto& a : L.arrays) {
    arrays.push_back({{"tensor", a.tensor},
                      {"state", state_kind_name(a.state)},
                      {"shape", dims(a.shape, a.ndim)},
                      {"real_rows", a.real_rows},
                      {"reduction", reduction_name(a.reduction)}});
  }
  json buffers = json::array();
  for (size_t i = 0; i < L.buffers.size(); ++i) {
    const auto& b = L.buffers[i];
    buffers.push_back({{"name", b.name},
                       {"rank", b.rank},
                       {"dtype", dtype_name(b.dtype)},
                       {"numel", b.numel},
                       {"state", state_kind_name(b.state)},
                       {"group", b.group},
                       {"file", buffer_files.at(i)}});
  }
  json pieces = json::array();
  for (size_t i = 0; i < L.pieces.size(); ++i) {
    const auto& p = L.pieces[i];
    json e = {{"array", p.array},
              {"buffer", p.buffer},
              {"off", dims(p.box.off, p.box.ndim)},
              {"len", dims(p.box.len, p.box.ndim)},
              {"base", p.base},
              {"strides", dims(p.strides, p.box.ndim)}};
    if (!checksums.empty()) e["xxh3"] = checksums.at(i);
    pieces.push_back(std::move(e));
  }
  json groups = json::array();
  for (const auto& per_shard : L.flat_groups) {
    json gs = json::array();
    for (const auto& g : per_shard) {
      json entries = json::array();
      for (const auto& e : g.entries) entries.push_back({{"tensor", e.tensor}, {"offset", e.offset}, {"numel", e.numel}});
      gs.push_back({{"entries", entries},
                    {"numel", g.numel},
                    {"partition_size", g.partition_size},
                    {"no_weight_decay", g.no_weight_decay}});
    }
    groups.push_back(gs);
  }
  json j = {{"topology", L.topo.to_string()}, {"model", model_to_json(L.model)}, {"tensors", tensors},
            {"arrays", arrays},               {"buffers", buffers},               {"pieces", pieces},
            {"flat_groups", groups}};
  // Written only when set, so layouts derived from a model keep their record (and digest).
  if (L.explicit_boxes) j["explicit_boxes"] = true;
  return j;
}

std::string layout_digest(const Layout& L) {
  Xxh3Stream h;
  auto i64 = [&](int64_t v) { h.update(&v, sizeof v); };
  auto str = [&](const std::string& v) {
    i64(int64_t(v.size()));
    h.update(v.data(), v.size());
  };
  str(L.topo.to_string());
  try {
    str(model_to_json(L.model).dump());
  } catch (const json::exception& e) {  // e.g. a model name that is not UTF-8
    fail(ErrorCode::kInvalidArgument, "the model config cannot be written as JSON: ", e.what());
  }
  i64(int64_t(L.tensors.size()));
  for (const TensorSpec& t : L.tensors) {
    str(t.name);
    i64(int64_t(t.shape.size()));
    for (int64_t d : t.shape) i64(d);
    for (int64_t v : {int64_t(t.split), int64_t(t.reduction), int64_t(t.owner), int64_t(t.layer),
                      int64_t(t.no_weight_decay), t.real_rows})
      i64(v);
  }
  i64(int64_t(L.arrays.size()));
  for (const LogicalArray& a : L.arrays) {
    str(a.tensor);
    for (int64_t v : {int64_t(a.state), int64_t(a.ndim), a.real_rows, int64_t(a.reduction)}) i64(v);
    for (int d = 0; d < a.ndim; ++d) i64(a.shape[d]);
  }
  i64(int64_t(L.buffers.size()));
  for (const Buffer& b : L.buffers) {
    str(b.name);
    for (int64_t v : {int64_t(b.rank), int64_t(b.dtype), b.numel, int64_t(b.state), int64_t(b.group)}) i64(v);
  }
  i64(int64_t(L.pieces.size()));
  for (const Piece& p : L.pieces) {
    for (int64_t v : {int64_t(p.array), int64_t(p.buffer), int64_t(p.box.ndim), p.base}) i64(v);
    for (int d = 0; d < p.box.ndim; ++d) {
      i64(p.box.off[d]);
      i64(p.box.len[d]);
      i64(p.strides[d]);
    }
  }
  if (L.explicit_boxes) str("explicit_boxes");
  i64(int64_t(L.flat_groups.size()));
  for (const auto& shard : L.flat_groups) {
    i64(int64_t(shard.size()));
    for (const FlatGroup& g : shard) {
      i64(int64_t(g.entries.size()));
      for (const auto& e : g.entries) {
        str(e.tensor);
        i64(e.offset);
        i64(e.numel);
      }
      for (int64_t v : {g.numel, g.partition_size, int64_t(g.no_weight_decay)}) i64(v);
    }
  }
  return h.hex();
}

Layout layout_from_json(const Field& meta, std::vector<std::string>* buffer_files, std::vector<std::string>* checksums) {
  Layout L;
  {
    Field t = meta["topology"];
    try {
      L.topo = Topology::parse(t.str());
      L.topo.validate();
    } catch (const Error& e) {
      t.bad(e.what());
    }
  }
  L.model = model_from_json(meta["model"]);
  if (meta.has("explicit_boxes")) L.explicit_boxes = meta["explicit_boxes"].boolean();

  for (const Field& f : meta["tensors"].items()) {
    TensorSpec t;
    t.name = f["name"].str();
    t.shape = f["shape"].i64s();
    t.split = parse_name(f["split"], split_from_name);
    t.reduction = reduction_from(f["reduction"]);
    t.owner = owner_from(f["owner"]);
    t.layer = small_int(f["layer"], -1, INT32_MAX);
    t.no_weight_decay = f["no_weight_decay"].boolean();
    t.real_rows = f["real_rows"].i64();
    L.tensors.push_back(std::move(t));
  }

  for (const Field& f : meta["arrays"].items()) {
    LogicalArray a;
    a.tensor = f["tensor"].str();
    a.state = parse_name(f["state"], state_kind_from_name);
    Field shape = f["shape"];
    if (shape.size() > size_t(kMaxDims)) shape.bad("more than " + std::to_string(kMaxDims) + " dims");
    a.ndim = int(shape.size());
    dims_from(shape, a.ndim, a.shape, true);
    {
      __int128 n = 1;
      for (int d = 0; d < a.ndim; ++d) n = std::min<__int128>(n * a.shape[d], __int128(INT64_MAX) + 1);
      if (n > __int128(INT64_MAX)) shape.bad("the shape has 2^63 elements or more");
    }
    a.real_rows = f["real_rows"].i64();
    a.reduction = reduction_from(f["reduction"]);
    L.arrays.push_back(a);
  }

  const int world = L.topo.world_size();
  for (const Field& f : meta["buffers"].items()) {
    Buffer b;
    b.name = f["name"].str();
    b.rank = small_int(f["rank"], 0, world - 1);
    b.dtype = parse_name(f["dtype"], dtype_from_name);
    b.numel = f["numel"].i64();
    if (b.numel < 0) f["numel"].bad("must not be negative");
    b.state = parse_name(f["state"], state_kind_from_name);
    b.group = small_int(f["group"], -1, INT32_MAX);
    if (buffer_files) buffer_files->push_back(f["file"].str());
    L.buffers.push_back(b);
  }

  for (const Field& f : meta["pieces"].items()) {
    Piece p;
    p.array = int32_t(small_int(f["array"], 0, int64_t(L.arrays.size()) - 1));
    p.buffer = int32_t(small_int(f["buffer"], 0, int64_t(L.buffers.size()) - 1));
    const LogicalArray& a = L.arrays[p.array];
    p.box.ndim = a.ndim;
    dims_from(f["off"], a.ndim, p.box.off, true);
    dims_from(f["len"], a.ndim, p.box.len, true);
    dims_from(f["strides"], a.ndim, p.strides, true);
    p.base = f["base"].i64();
    for (int d = 0; d < a.ndim; ++d)
      if (p.box.len[d] > a.shape[d] || p.box.off[d] > a.shape[d] - p.box.len[d])  // no int64 overflow
        f.bad("box " + p.box.to_string() + " exceeds the shape of array " + a.key());
    // The span 1 + sum((len - 1) * stride) in 128 bits: huge strides overflowed int64 (UB) before
    // the bounds check; the box lies inside the array's shape, whose element count fits int64.
    __int128 span = 0;
    if (p.box.numel() > 0) {
      span = 1;
      for (int d = 0; d < a.ndim; ++d)  // each term < 2^126; capped at 2^64 so the sum stays < 2^127
        span = std::min<__int128>(span + __int128(p.box.len[d] - 1) * p.strides[d], __int128(1) << 64);
    }
    if (p.base < 0 || span > __int128(L.buffers[p.buffer].numel - p.base))  // no int64 overflow
      f.bad("elements [" + std::to_string(p.base) + ", " +
            (span <= __int128(INT64_MAX) ? std::to_string(uint64_t(p.base) + uint64_t(span)) : "2^63 or more") +
            ") lie outside buffer " + L.buffers[p.buffer].name + " of " + std::to_string(L.buffers[p.buffer].numel) +
            " elements");
    if (checksums) checksums->push_back(f.has("xxh3") ? f["xxh3"].str() : std::string());
    L.pieces.push_back(p);
  }

  Field groups = meta["flat_groups"];
  for (const Field& per_shard : groups.items()) {
    std::vector<FlatGroup> gs;
    for (const Field& f : per_shard.items()) {
      FlatGroup g;
      for (const Field& e : f["entries"].items())
        g.entries.push_back({e["tensor"].str(), e["offset"].i64(), e["numel"].i64()});
      g.numel = f["numel"].i64();
      g.partition_size = f["partition_size"].i64();
      g.no_weight_decay = f["no_weight_decay"].boolean();
      gs.push_back(std::move(g));
    }
    L.flat_groups.push_back(std::move(gs));
  }
  return L;
}

// ---------------------------------------------------------------------------------------------
// Non-tensor state

json state_to_json(const NonTensorState& s) {
  json extra;
  try {
    extra = json::parse(s.json.empty() ? std::string("{}") : s.json);
  } catch (const json::exception& e) {
    fail(ErrorCode::kInvalidArgument, "NonTensorState::json is not valid JSON: ", e.what());
  }
  // Readers refuse anything else (state_from_json), so a save must not write it: the newest
  // checkpoint would not open.
  if (!extra.is_object())
    fail(ErrorCode::kInvalidArgument, "NonTensorState::json must be one JSON object, not ", extra.type_name(), " (",
         s.json.substr(0, 40), ")");
  json per_rank = json::object();
  for (const auto& [r, blob] : s.per_rank) per_rank[std::to_string(r)] = base64_encode(blob);
  return {{"iteration", s.iteration}, {"consumed_samples", s.consumed_samples}, {"step", s.step},
          {"json", extra},            {"per_rank_base64", per_rank}};
}

NonTensorState state_from_json(const Field& f) {
  NonTensorState s;
  s.iteration = f["iteration"].i64();
  s.consumed_samples = f["consumed_samples"].i64();
  s.step = f["step"].i64();
  for (const char* k : {"iteration", "consumed_samples", "step"})  // -1: unknown (NonTensorState)
    if (f[k].i64() < -1) f[k].bad("must be -1 (unknown) or more");
  if (!f["json"].is_object()) f["json"].bad("expected an object");
  s.json = f["json"].minified();
  for (const auto& [key, v] : f["per_rank_base64"].members()) {
    char* end = nullptr;
    long r = std::strtol(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || r < 0) v.bad("key is not a rank number");
    s.per_rank[int(r)] = base64_decode(v.str(), v);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// The whole metadata file

bool is_rank_file_name(const std::string& n) {
  const std::string pre = "rank_", suf = ".safetensors";
  if (n.size() < pre.size() + suf.size() + 5) return false;
  if (n.compare(0, pre.size(), pre) != 0 || n.compare(n.size() - suf.size(), suf.size(), suf) != 0) return false;
  for (size_t i = pre.size(); i < n.size() - suf.size(); ++i)
    if (n[i] < '0' || n[i] > '9') return false;
  return true;
}

Metadata parse_metadata(std::string_view text, const std::string& path) {
  const JsonDoc doc(text, path);
  const Field root = doc.root();
  if (root["format"].str() != kFormatName)
    root["format"].bad("expected \"" + std::string(kFormatName) + "\", found \"" + root["format"].str() + "\"");
  const int64_t version = root["format_version"].i64();
  if (version > kNativeFormatVersion)
    fail(ErrorCode::kUnsupported, path, ": format_version ", version, " is newer than this reshard reads (",
         kNativeFormatVersion, "); upgrade reshard");
  if (version < 1) root["format_version"].bad("must be >= 1");

  Metadata md;
  if (root.has("save")) md.save = root["save"].str();
  md.layout = layout_from_json(root, &md.buffer_files, &md.checksums);
  md.state = state_from_json(root["state"]);

  // Every piece carries its checksum: the writer always stores one, so a missing or malformed one
  // is damage (or an edit) that would otherwise turn the piece's check off, also under
  // verify="full".
  if (const std::string algo = root["checksum"].str(); algo != "xxh3-64")
    fail(ErrorCode::kUnsupported, path, ": field 'checksum' is '", algo, "'; this reshard reads \"xxh3-64\"");
  for (size_t i = 0; i < md.checksums.size(); ++i) {
    const std::string& h = md.checksums[i];
    const bool hex16 = h.size() == 16 && std::all_of(h.begin(), h.end(), [](char c) {
                         return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
                       });
    if (!hex16)
      fail(ErrorCode::kDataLoss, path, ": field 'pieces[", i, "].xxh3' is ", h.empty() ? "missing or empty" : "'" + h + "'",
           "; every piece stores its xxh3-64 as 16 lowercase hex digits");
  }
  // The labels agree with each other (format.md §3): a buffer is named "<state>/<tensor>" or
  // "<state>/group<g>" after its own state and group, and its data file names its data the same
  // way; each piece's array has its buffer's state and, in a per-tensor buffer, its tensor. Two
  // arrays' `state` or `tensor` swapped in metadata.json (exp_avg <-> exp_avg_sq) kept every
  // checksum valid and loaded one state's values as the other's.
  for (size_t b = 0; b < md.layout.buffers.size(); ++b) {
    const Buffer& buf = md.layout.buffers[b];
    const std::string state = state_kind_name(buf.state);
    const std::string want_rest = buf.group >= 0 ? "group" + std::to_string(buf.group) : std::string();
    const bool ok = buf.name.size() > state.size() + 1 && buf.name.compare(0, state.size() + 1, state + "/") == 0 &&
                    (buf.group < 0 || buf.name.compare(state.size() + 1, std::string::npos, want_rest) == 0);
    if (!ok)
      fail(ErrorCode::kDataLoss, path, ": field 'buffers[", b, "]': the name '", buf.name,
           "' does not agree with its state '", state, "'",
           buf.group >= 0 ? " and group " + std::to_string(buf.group) : std::string(), " (the writer names it '", state,
           "/", buf.group >= 0 ? want_rest : std::string("<tensor>"), "'); the labels in this file were edited");
  }
  for (size_t i = 0; i < md.layout.pieces.size(); ++i) {
    const Piece& p = md.layout.pieces[i];
    const LogicalArray& a = md.layout.arrays[size_t(p.array)];
    const Buffer& buf = md.layout.buffers[size_t(p.buffer)];
    const std::string_view buf_tensor =
        buf.group >= 0 ? std::string_view() : std::string_view(buf.name).substr(buf.name.find('/') + 1);
    if (a.state != buf.state || (buf.group < 0 && std::string_view(a.tensor) != buf_tensor))
      fail(ErrorCode::kDataLoss, path, ": field 'pieces[", i, "]': its array ", a.key(),
           " does not belong in buffer ", buf.name, " (rank ", buf.rank, "), which holds ",
           buf.group >= 0 ? std::string(state_kind_name(buf.state)) + " values of param group " + std::to_string(buf.group)
                          : std::string(state_kind_name(buf.state)) + " values of " + std::string(buf_tensor),
           "; the labels in this file were edited (a load would put one array's values in another)");
  }
  // Pieces of one buffer never share an element: two pieces over the same bytes would load one
  // tensor's values into another (each with a matching checksum).
  {
    std::vector<std::tuple<int32_t, int64_t, int64_t, size_t>> spans;  // buffer, begin, end, piece
    spans.reserve(md.layout.pieces.size());
    for (size_t i = 0; i < md.layout.pieces.size(); ++i) {
      const Piece& p = md.layout.pieces[i];
      spans.emplace_back(p.buffer, p.base, p.base + piece_span(p), i);
    }
    std::sort(spans.begin(), spans.end());
    size_t far = spans.size();  // the earlier non-empty piece of this buffer that reaches furthest
    for (size_t k = 0; k < spans.size(); ++k) {
      const auto& [b1, s1, e1, i1] = spans[k];
      if (s1 == e1) continue;  // empty: no element to share
      if (far < spans.size() && std::get<0>(spans[far]) == b1 && s1 < std::get<2>(spans[far])) {
        const auto& [b0, s0, e0, i0] = spans[far];
        fail(ErrorCode::kDataLoss, path, ": field 'pieces[", i1, "]': elements [", s1, ", ", e1, ") of buffer ",
             md.layout.buffers[size_t(b1)].name, " (rank ", md.layout.buffers[size_t(b1)].rank, ") overlap pieces[", i0,
             "] [", s0, ", ", e0, "); the pieces of a buffer never share an element");
      }
      if (far == spans.size() || std::get<0>(spans[far]) != b1 || e1 > std::get<2>(spans[far])) far = k;
    }
  }

  // A piece of a flat ZeRO partition lies where flat_groups puts its tensor: ZeRO-1/2, flat
  // elements [d * P + base, + span) of the (pp, tp) shard's group inside the tensor's entry;
  // ZeRO-3, [base, + span) inside the entry's per-rank part [offset, offset + ceil(numel / dp)).
  // The partition's name gives its state and group but no tensor, so two same-shaped tensors'
  // array labels swapped would otherwise load each one's master and moments as the other's.
  {
    const Topology& T = md.layout.topo;
    const auto& fg = md.layout.flat_groups;
    std::unordered_map<std::string, int> tensor_id;
    for (const LogicalArray& a : md.layout.arrays) tensor_id.emplace(a.tensor, int(tensor_id.size()));
    std::vector<int> array_tensor(md.layout.arrays.size());
    for (size_t i = 0; i < md.layout.arrays.size(); ++i) array_tensor[i] = tensor_id.at(md.layout.arrays[i].tensor);
    std::map<std::pair<size_t, int>, std::vector<int>> entry_of;  // (shard, group) -> per tensor id: entry or -1
    for (size_t i = 0; i < md.layout.pieces.size(); ++i) {
      const Piece& p = md.layout.pieces[i];
      const Buffer& buf = md.layout.buffers[size_t(p.buffer)];
      if (buf.group < 0) continue;
      const int d = T.dp_rank(buf.rank);
      const size_t shard = size_t(T.pp_rank(buf.rank)) * size_t(T.tp) + size_t(T.tp_rank(buf.rank));
      auto where = [&] {
        return "param group " + std::to_string(buf.group) + " of (pp " + std::to_string(T.pp_rank(buf.rank)) + ", tp " +
               std::to_string(T.tp_rank(buf.rank)) + ")";
      };
      if (shard >= fg.size() || size_t(buf.group) >= fg[shard].size())
        fail(ErrorCode::kDataLoss, path, ": field 'buffers[", p.buffer, "]': buffer ", buf.name,
             " (rank ", buf.rank, ") is a flat partition of ", where(), ", which 'flat_groups' does not have");
      const FlatGroup& g = fg[shard][size_t(buf.group)];
      auto [it, fresh] = entry_of.try_emplace({shard, buf.group});
      if (fresh) {
        it->second.assign(tensor_id.size(), -1);
        for (size_t k = 0; k < g.entries.size(); ++k)
          if (auto t = tensor_id.find(g.entries[k].tensor); t != tensor_id.end()) it->second[size_t(t->second)] = int(k);
      }
      const LogicalArray& a = md.layout.arrays[size_t(p.array)];
      const int k = it->second[size_t(array_tensor[size_t(p.array)])];
      if (k < 0)
        fail(ErrorCode::kDataLoss, path, ": field 'pieces[", i, "]': its array ", a.key(),
             " is in buffer ", buf.name, " (rank ", buf.rank, "), but 'flat_groups' does not put tensor ",
             a.tensor, " in ", where(), "; the labels in this file were edited");
      const FlatGroup::Entry& e = g.entries[size_t(k)];
      const int64_t span = piece_span(p);
      const bool z3 = T.zero == 3;
      const __int128 lo = z3 ? __int128(p.base) : __int128(d) * g.partition_size + p.base;
      const __int128 e_lo = e.offset, e_hi = z3 ? __int128(e.offset) + (__int128(e.numel) + T.dp - 1) / T.dp : __int128(e.offset) + e.numel;
      if (span > 0 && (lo < e_lo || lo + span > e_hi))
        fail(ErrorCode::kDataLoss, path, ": field 'pieces[", i, "]': its array ", a.key(), " lies at ",
             z3 ? "elements [" : "flat elements [", int64_t(lo), ", ", int64_t(lo + span), ") of ", where(),
             z3 ? " in rank " + std::to_string(buf.rank) + "'s partition" : std::string(), ", outside tensor ",
             a.tensor, "'s entry [", int64_t(e_lo), ", ", int64_t(e_hi),
             ") in 'flat_groups'; the labels in this file were edited (a load would put one tensor's values in another)");
    }
  }
  // Data files: plain names inside the step folder only, each listed once.
  std::map<std::string, int> file_index;
  const std::vector<Field> files = root["files"].items();
  for (size_t i = 0; i < files.size(); ++i) {
    std::string name = files[i]["name"].str();
    const int64_t bytes = files[i]["bytes"].i64();
    if (!is_rank_file_name(name))
      fail(ErrorCode::kInvalidArgument, path, ": field 'files[", i, "].name' is '", name,
           "'; only plain rank_NNNNN.safetensors names inside the step folder are allowed");
    if (bytes < 0) files[i]["bytes"].bad("must not be negative");
    if (!file_index.emplace(name, int(i)).second)
      fail(ErrorCode::kDataLoss, path, ": field 'files[", i, "].name': '", name, "' listed twice");
    md.files.emplace_back(std::move(name), bytes);
  }
  for (size_t b = 0; b < md.buffer_files.size(); ++b) {
    const std::string& name = md.buffer_files[b];
    if (!is_rank_file_name(name))
      fail(ErrorCode::kInvalidArgument, path, ": field 'buffers[", b, "].file' is '", name,
           "'; only plain rank_NNNNN.safetensors names inside the step folder are allowed");
    auto it = file_index.find(name);
    if (it == file_index.end())
      fail(ErrorCode::kDataLoss, path, ": field 'buffers[", b, "].file' names ", name, ", which 'files' does not list");
    // A rank's buffers live in that rank's file (the writer's rule, format.md §2): a buffer
    // pointed at another rank's file would read that rank's bytes, under checksums of the same
    // byte ranges.
    const Buffer& buf = md.layout.buffers[b];
    if (name != rank_file_name(buf.rank))
      fail(ErrorCode::kDataLoss, path, ": field 'buffers[", b, "].file' is ", name, " but buffer ", buf.name,
           " belongs to rank ", buf.rank, ", whose data file is ", rank_file_name(buf.rank));
    md.buffer_file.push_back(it->second);
  }
  return md;
}

static const char kB64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

std::string base64_encode(const std::string& in) {
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 2 < in.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8 | uint8_t(in[i + 2]);
    for (int k = 3; k >= 0; --k) out.push_back(kB64[(v >> (6 * k)) & 63]);
  }
  if (i + 1 == in.size()) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    out += {kB64[v >> 18], kB64[(v >> 12) & 63], '=', '='};
  } else if (i + 2 == in.size()) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16 | uint32_t(uint8_t(in[i + 1])) << 8;
    out += {kB64[v >> 18], kB64[(v >> 12) & 63], kB64[(v >> 6) & 63], '='};
  }
  return out;
}

std::string base64_decode(const std::string& in, const Field& where) {
  if (in.size() % 4 != 0) where.bad("base64 length is not a multiple of 4");
  auto val = [&](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    where.bad(std::string("invalid base64 character '") + c + "'");
  };
  std::string out;
  for (size_t i = 0; i < in.size(); i += 4) {
    int pad = (in[i + 3] == '=') + (in[i + 2] == '=');
    if (pad && i + 4 != in.size()) where.bad("base64 padding in the middle");
    uint32_t v = uint32_t(val(in[i])) << 18 | uint32_t(val(in[i + 1])) << 12 |
                 uint32_t(pad >= 2 ? 0 : val(in[i + 2])) << 6 | uint32_t(pad >= 1 ? 0 : val(in[i + 3]));
    out.push_back(char(v >> 16));
    if (pad < 2) out.push_back(char((v >> 8) & 0xff));
    if (pad < 1) out.push_back(char(v & 0xff));
  }
  return out;
}

}  // namespace reshard::native
