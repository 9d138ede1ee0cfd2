#include "formats/safetensors/safetensors.h"

#include <algorithm>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "reshard/error.h"

namespace reshard::safetensors {

using nlohmann::json;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

int dtype_bits(const std::string& t) {
  // safetensors/src/tensor.rs `enum Dtype` (commit 24b0b285).
  static const std::map<std::string, int> bits = {
      {"BOOL", 8},   {"U8", 8},          {"I8", 8},          {"I16", 16},         {"U16", 16},
      {"F16", 16},   {"BF16", 16},       {"I32", 32},        {"U32", 32},         {"F32", 32},
      {"F64", 64},   {"I64", 64},        {"U64", 64},        {"C64", 64},         {"F8_E5M2", 8},
      {"F8_E4M3", 8}, {"F8_E8M0", 8},    {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},  {"F4", 4},
      {"F6_E2M3", 6}, {"F6_E3M2", 6}};
  auto it = bits.find(t);
  return it == bits.end() ? 0 : it->second;
}

namespace {

std::optional<DType> reshard_type(const std::string& t) {
  if (t == "F64") return DType::F64;
  if (t == "F32") return DType::F32;
  if (t == "F16") return DType::F16;
  if (t == "BF16") return DType::BF16;
  if (t == "I64") return DType::I64;
  if (t == "I32") return DType::I32;
  if (t == "I16") return DType::I16;
  if (t == "I8") return DType::I8;
  if (t == "U8") return DType::U8;
  if (t == "BOOL") return DType::Bool;
  return std::nullopt;
}

}  // namespace

uint64_t parse_header_size(const uint8_t prefix[8], uint64_t file_size, const std::string& what) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | prefix[i];
  if (n > kMaxHeaderSize)
    fail(ErrorCode::kDataLoss, what, ": safetensors header length ", n, " exceeds the 100 MB limit (not a safetensors file?)");
  if (file_size != UINT64_MAX && (file_size < 8 || n > file_size - 8))
    fail(ErrorCode::kDataLoss, what, ": safetensors header length ", n, " does not fit in the file (", file_size,
         " bytes; truncated?)");
  return n;
}

Header parse_header(std::string_view text, const std::string& what) {
  if (text.empty() || text[0] != '{')
    fail(ErrorCode::kDataLoss, what, ": safetensors header does not start with '{'");
  // Duplicate names are an error in safetensors; nlohmann keeps the last silently, so watch keys.
  std::set<std::string> seen;
  std::string dup;
  json j;
  try {
    j = json::parse(text.begin(), text.end(), [&](int depth, json::parse_event_t ev, json& parsed) {
      if (ev == json::parse_event_t::key && depth == 1) {
        const std::string& k = parsed.get_ref<const std::string&>();
        if (!seen.insert(k).second && dup.empty()) dup = k;
      }
      return true;
    });
  } catch (const json::exception& e) {
    fail(ErrorCode::kDataLoss, what, ": safetensors header is not valid JSON: ", e.what());
  }
  if (!dup.empty()) fail(ErrorCode::kDataLoss, what, ": safetensors header names tensor '", dup, "' twice");
  if (!j.is_object()) fail(ErrorCode::kDataLoss, what, ": safetensors header is not a JSON object");

  Header h;
  h.header_size = text.size();
  h.data_start = 8 + text.size();
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(ErrorCode::kDataLoss, what, ": __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(ErrorCode::kDataLoss, what, ": __metadata__['", m.key(), "'] must be a string");
        h.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    auto field = [&](const char* f) -> const json& {
      if (!v.is_object()) fail(ErrorCode::kDataLoss, what, ": tensor '", name, "' entry is not an object");
      auto f_it = v.find(f);
      if (f_it == v.end()) fail(ErrorCode::kDataLoss, what, ": tensor '", name, "' has no '", f, "'");
      return *f_it;
    };
    TensorInfo t;
    const json& dt = field("dtype");
    if (!dt.is_string()) fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': dtype must be a string");
    t.dtype = dt.get<std::string>();
    const int bits = dtype_bits(t.dtype);
    if (bits == 0) fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': unknown safetensors dtype '", t.dtype, "'");
    t.rtype = reshard_type(t.dtype);
    const json& sh = field("shape");
    if (!sh.is_array()) fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': shape must be an array");
    __int128 numel = 1;
    for (const auto& d : sh) {
      if (!d.is_number_unsigned())
        fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': shape entries must be non-negative integers");
      t.shape.push_back(int64_t(d.get<uint64_t>()));
      numel *= d.get<uint64_t>();
      if (numel > (__int128(1) << 62)) fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': shape too large");
    }
    const json& off = field("data_offsets");
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': data_offsets must be two non-negative integers");
    t.begin = off[0].get<uint64_t>();
    t.end = off[1].get<uint64_t>();
    if (t.end < t.begin)
      fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': data_offsets [", t.begin, ", ", t.end, ") end before they begin");
    __int128 nbits = numel * bits;
    if (nbits % 8 != 0)
      fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': ", int64_t(numel), " elements of ", t.dtype,
           " are not a whole number of bytes");
    if (uint64_t(nbits / 8) != t.end - t.begin)
      fail(ErrorCode::kDataLoss, what, ": tensor '", name, "': data_offsets [", t.begin, ", ", t.end, ") hold ",
           t.end - t.begin, " bytes but shape and dtype ", t.dtype, " need ", uint64_t(nbits / 8));
    h.tensors.emplace(name, std::move(t));
  }
  // The offsets must tile [0, buffer_size) exactly. Sorted by (begin, end) with the offsets at
  // hand (the comparator used to look both names up in the map on every comparison).
  struct Span { uint64_t begin, end; const std::string* name; };
  std::vector<Span> order;
  order.reserve(h.tensors.size());
  for (const auto& [n, t] : h.tensors) order.push_back({t.begin, t.end, &n});
  std::sort(order.begin(), order.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t at = 0;
  for (const Span& t : order) {
    if (t.begin != at)
      fail(ErrorCode::kDataLoss, what, ": tensor '", *t.name, "' data_offsets [", t.begin, ", ", t.end, ") ",
           t.begin > at ? "leave a hole after byte " : "overlap the previous tensor, which ends at byte ", at,
           " (offsets must tile the buffer)");
    at = t.end;
  }
  h.buffer_size = at;
  return h;
}

std::string build_header(const std::vector<TensorToWrite>& tensors, const std::map<std::string, std::string>& metadata,
                         std::vector<std::pair<uint64_t, uint64_t>>* offsets) {
  json j = json::object();
  if (!metadata.empty()) j["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t at = 0;
  if (offsets) offsets->clear();
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail(ErrorCode::kInvalidArgument, "safetensors tensor name '", t.name, "' is not allowed");
    if (!names.insert(t.name).second)
      fail(ErrorCode::kInvalidArgument, "safetensors tensor name '", t.name, "' given twice");
    uint64_t n = 1;
    for (auto d : t.shape) {
      if (d < 0) fail(ErrorCode::kInvalidArgument, "tensor '", t.name, "' has a negative dimension");
      n *= uint64_t(d);
    }
    uint64_t bytes = n * dtype_size(t.dtype);
    j[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {at, at + bytes}}};
    if (offsets) offsets->push_back({at, at + bytes});
    at += bytes;
  }
  std::string body = j.dump();
  while ((8 + body.size()) % 8 != 0) body.push_back(' ');
  std::string out(8, '\0');
  uint64_t n = body.size();
  for (int i = 0; i < 8; ++i) out[i] = char((n >> (8 * i)) & 0xff);
  return out + body;
}

}  // namespace reshard::safetensors
