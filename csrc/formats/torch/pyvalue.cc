// PyValue accessors, JSON view and repr; TensorInfo geometry.
#include <cstdio>
#include <unordered_set>

#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard::pt {

using Kind = PyValue::Kind;
using ojson = nlohmann::ordered_json;

const char* PyValue::kind_name(Kind k) {
  switch (k) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::BigInt: return "bigint";
    case Kind::Float: return "float";
    case Kind::String: return "str";
    case Kind::Bytes: return "bytes";
    case Kind::List: return "list";
    case Kind::Tuple: return "tuple";
    case Kind::Dict: return "dict";
    case Kind::Set: return "set";
    case Kind::Global: return "global";
    case Kind::Object: return "object";
    case Kind::Storage: return "storage";
    case Kind::Tensor: return "tensor";
    case Kind::Dtype: return "dtype";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong(const PyValue& v, const char* expected) {
  std::string got = v.kind_name();
  std::string q = v.qualified_name();
  if (!q.empty()) got += " " + q;
  fail(ErrorCode::kInvalidArgument, "expected ", expected, ", got ", got, " ", v.repr(60));
}
}  // namespace

int64_t PyValue::as_int() const {
  if (kind == Kind::Int) return integer;
  if (kind == Kind::Bool) return boolean ? 1 : 0;
  wrong(*this, "int");
}
double PyValue::as_float() const {
  if (kind == Kind::Float) return real;
  if (kind == Kind::Int) return double(integer);
  wrong(*this, "float");
}
bool PyValue::as_bool() const {
  if (kind == Kind::Bool) return boolean;
  wrong(*this, "bool");
}
const std::string& PyValue::as_string() const {
  if (kind == Kind::String) return text;
  wrong(*this, "str");
}
const std::string& PyValue::as_bytes() const {
  if (kind == Kind::Bytes) return text;
  wrong(*this, "bytes");
}
const std::vector<PyValue::Item>& PyValue::as_list() const {
  if (kind == Kind::List) return items;
  wrong(*this, "list");
}
const std::vector<PyValue::Item>& PyValue::as_tuple() const {
  if (kind == Kind::Tuple) return items;
  wrong(*this, "tuple");
}
const std::vector<PyValue::Item>& PyValue::as_sequence() const {
  if (kind == Kind::List || kind == Kind::Tuple) return items;
  wrong(*this, "list or tuple");
}
const std::vector<PyValue::Entry>& PyValue::as_dict() const {
  if (kind == Kind::Dict) return entries;
  wrong(*this, "dict");
}
const TensorInfo& PyValue::as_tensor() const {
  if (kind == Kind::Tensor && tensor) return *tensor;
  wrong(*this, "tensor");
}
const StorageInfo& PyValue::as_storage() const {
  if (kind == Kind::Storage && storage) return *storage;
  wrong(*this, "storage");
}

std::string PyValue::qualified_name() const {
  if (kind == Kind::Global || kind == Kind::Object || kind == Kind::Dtype)
    return module.empty() && name.empty() ? std::string() : module + "." + name;
  return {};
}

const PyValue* PyValue::get(std::string_view key) const {
  const std::vector<Entry>* es = nullptr;
  if (kind == Kind::Dict) {
    es = &entries;
  } else if (kind == Kind::Object) {
    // Objects: keys set with SETITEM, else attributes from a dict BUILD state
    // (e.g. argparse.Namespace, loss scalers).
    for (const auto& [k, v] : entries)
      if (k->kind == Kind::String && k->text == key) return v;
    if (state && state->kind == Kind::Dict) es = &state->entries;
    else if (state && state->kind == Kind::Tuple && state->items.size() == 2 &&
             state->items[0]->kind == Kind::Dict)  // (dict, slotstate)
      es = &state->items[0]->entries;
    if (!es) return nullptr;
  } else {
    wrong(*this, "dict");
  }
  for (const auto& [k, v] : *es)
    if (k->kind == Kind::String && k->text == key) return v;
  return nullptr;
}

const PyValue& PyValue::at(std::string_view key) const {
  const PyValue* v = get(key);
  if (!v) fail(ErrorCode::kNotFound, "key '", std::string(key), "' not found in ", kind_name());
  return *v;
}

// ---- JSON ----
namespace {

std::string hex(const std::string& s, size_t max) {
  static const char* d = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    out += d[uint8_t(s[i]) >> 4];
    out += d[uint8_t(s[i]) & 15];
  }
  return out;
}

struct JsonWriter {
  size_t max_depth = 0, max_nodes = 0, emitted = 0;
  std::unordered_set<const PyValue*> open;

  ojson ints(const std::vector<int64_t>& v) {
    ojson a = ojson::array();
    for (int64_t x : v) a.push_back(x);
    return a;
  }

  ojson run(const PyValue* v, size_t depth) {
    if (!v) return nullptr;
    if (++emitted > max_nodes)
      fail(ErrorCode::kInvalidArgument, "JSON view would exceed ", max_nodes,
           " values (shared sub-objects repeat); refusing");
    if (depth > max_depth)
      fail(ErrorCode::kInvalidArgument, "JSON view deeper than ", max_depth, " levels");
    switch (v->kind) {
      case Kind::None: return nullptr;
      case Kind::Bool: return v->boolean;
      case Kind::Int: return v->integer;
      case Kind::Float: return v->real;
      case Kind::String: return v->text;
      case Kind::BigInt: return ojson{{"__int__", v->text}};
      case Kind::Bytes: {
        ojson o{{"__bytes__", v->text.size()}, {"hex", hex(v->text, 64)}};
        if (!v->type_name.empty()) o["type"] = v->type_name;
        return o;
      }
      case Kind::Global: return ojson{{"__global__", v->qualified_name()}};
      case Kind::Dtype: return ojson{{"__dtype__", v->text}};
      case Kind::Storage: {
        const StorageInfo& s = *v->storage;
        return ojson{{"__storage__", s.key}, {"dtype", s.untyped ? "untyped" : s.torch_dtype},
                     {"numel", s.numel}, {"location", s.location}};
      }
      case Kind::Tensor: {
        const TensorInfo& t = *v->tensor;
        ojson o{{"__tensor__", t.torch_dtype}, {"shape", ints(t.shape)}, {"stride", ints(t.stride)},
                {"storage", t.storage_key}, {"offset", t.storage_offset}};
        if (t.is_parameter) o["parameter"] = true;
        if (t.requires_grad) o["requires_grad"] = true;
        if (!v->type_name.empty()) o["type"] = v->type_name;
        return o;
      }
      default: break;
    }
    if (!open.insert(v).second) return ojson{{"__cycle__", true}};
    ojson out;
    switch (v->kind) {
      case Kind::List:
      case Kind::Tuple:
      case Kind::Set: {
        ojson a = ojson::array();
        for (const PyValue* c : v->items) a.push_back(run(c, depth + 1));
        if (v->kind == Kind::Set) out = ojson{{"__set__", std::move(a)}};
        else out = std::move(a);
        break;
      }
      case Kind::Dict: {
        bool str_keys = true;
        for (const auto& e : v->entries) str_keys = str_keys && e.first->kind == Kind::String;
        if (str_keys) {
          out = ojson::object();
          for (const auto& [k, val] : v->entries) out[k->text] = run(val, depth + 1);
        } else {
          ojson a = ojson::array();
          for (const auto& [k, val] : v->entries)
            a.push_back(ojson::array({run(k, depth + 1), run(val, depth + 1)}));
          out = ojson{{"__dict__", std::move(a)}};
        }
        break;
      }
      case Kind::Object: {
        if (v->enum_member) {
          out = ojson{{"__enum__", v->qualified_name()}, {"member", v->text}};
          break;
        }
        out = ojson{{"__object__", v->qualified_name().empty() ? std::string("<call>")
                                                               : v->qualified_name()}};
        if (v->callable && v->callable->kind != Kind::Global)
          out["callable"] = run(v->callable, depth + 1);
        if (v->args) out["args"] = run(v->args, depth + 1);
        if (v->kwargs) out["kwargs"] = run(v->kwargs, depth + 1);
        if (v->state) out["state"] = run(v->state, depth + 1);
        if (!v->items.empty()) {
          ojson a = ojson::array();
          for (const PyValue* c : v->items) a.push_back(run(c, depth + 1));
          out["items"] = std::move(a);
        }
        if (!v->entries.empty()) {
          ojson a = ojson::array();
          for (const auto& [k, val] : v->entries)
            a.push_back(ojson::array({run(k, depth + 1), run(val, depth + 1)}));
          out["entries"] = std::move(a);
        }
        break;
      }
      default: break;
    }
    open.erase(v);
    return out;
  }
};

struct ReprWriter {
  size_t max_len = 0;
  std::string out;
  std::unordered_set<const PyValue*> open;
  bool full() const { return out.size() >= max_len; }

  void str(const std::string& s, char q) {
    out += q;
    for (char c : s) {
      if (full()) return;
      if (c == q || c == '\\') { out += '\\'; out += c; }
      else if (c == '\n') out += "\\n";
      else if (uint8_t(c) < 0x20) { char b[8]; std::snprintf(b, sizeof b, "\\x%02x", uint8_t(c)); out += b; }
      else out += c;
    }
    out += q;
  }
  void ints(const std::vector<int64_t>& v) {
    out += '[';
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    out += ']';
  }
  void run(const PyValue* v) {
    if (full()) return;
    if (!v) { out += "NULL"; return; }
    switch (v->kind) {
      case Kind::None: out += "None"; return;
      case Kind::Bool: out += v->boolean ? "True" : "False"; return;
      case Kind::Int: out += std::to_string(v->integer); return;
      case Kind::BigInt: out += v->text; return;
      case Kind::Float: { char b[32]; std::snprintf(b, sizeof b, "%.17g", v->real); out += b; return; }
      case Kind::String: str(v->text, '\''); return;
      case Kind::Bytes: out += 'b'; str(v->text, '\''); return;
      case Kind::Global: out += v->qualified_name(); return;
      case Kind::Dtype: out += "torch." + v->text; return;
      case Kind::Storage:
        out += "Storage(key='" + v->storage->key + "', " +
               (v->storage->untyped ? std::string("untyped") : v->storage->torch_dtype) +
               ", numel=" + std::to_string(v->storage->numel) + ")";
        return;
      case Kind::Tensor: {
        const TensorInfo& t = *v->tensor;
        out += t.is_parameter ? "Parameter(" : "Tensor(";
        out += t.torch_dtype + ", shape=";
        ints(t.shape);
        out += ", stride=";
        ints(t.stride);
        out += ", storage='" + t.storage_key + "', offset=" + std::to_string(t.storage_offset) + ")";
        return;
      }
      default: break;
    }
    if (!open.insert(v).second) { out += "..."; return; }
    auto list = [&](const std::vector<PyValue::Item>& xs, const char* l, const char* r) {
      out += l;
      for (size_t i = 0; i < xs.size() && !full(); ++i) {
        if (i) out += ", ";
        run(xs[i]);
      }
      out += r;
    };
    switch (v->kind) {
      case Kind::List: list(v->items, "[", "]"); break;
      case Kind::Tuple:
        if (!v->type_name.empty()) out += v->type_name + "(";
        list(v->items, "(", v->items.size() == 1 ? ",)" : ")");
        if (!v->type_name.empty()) out += ")";
        break;
      case Kind::Set: list(v->items, v->type_name == "frozenset" ? "frozenset({" : "{", v->type_name == "frozenset" ? "})" : "}"); break;
      case Kind::Dict:
        if (!v->type_name.empty()) out += v->type_name + "(";
        out += '{';
        for (size_t i = 0; i < v->entries.size() && !full(); ++i) {
          if (i) out += ", ";
          run(v->entries[i].first);
          out += ": ";
          run(v->entries[i].second);
        }
        out += '}';
        if (!v->type_name.empty()) out += ")";
        break;
      case Kind::Object:
        if (v->enum_member) { out += v->qualified_name() + "." + v->text; break; }
        out += v->qualified_name().empty() ? std::string("<call>") : v->qualified_name();
        if (v->args) run(v->args);
        if (v->state) { out += "<state="; run(v->state); out += ">"; }
        break;
      default: break;
    }
    open.erase(v);
  }
};

}  // namespace

ojson PyValue::to_json(size_t max_depth, size_t max_nodes) const {
  JsonWriter w;
  w.max_depth = max_depth;
  w.max_nodes = max_nodes;
  return w.run(this, 0);
}

std::string PyValue::repr(size_t max_len) const {
  ReprWriter w;
  w.max_len = max_len;
  w.run(this);
  if (w.out.size() > max_len) {
    w.out.resize(max_len);
    w.out += "...";
  }
  return w.out;
}

std::string quote_key(const PyValue& key) {
  if (key.kind == Kind::String) {
    std::string out = "\"";
    for (char c : key.text) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  }
  return key.repr(80);
}

// ---- TensorInfo ----
uint64_t TensorInfo::numel() const {
  uint64_t n = 1;
  for (int64_t s : shape) {
    if (s < 0) fail(ErrorCode::kDataLoss, "tensor on storage '", storage_key, "' has negative size ", s);
    if (__builtin_mul_overflow(n, uint64_t(s), &n))
      fail(ErrorCode::kDataLoss, "tensor on storage '", storage_key, "': element count overflows");
  }
  return n;
}

uint64_t TensorInfo::extent() const {
  if (shape.size() != stride.size())
    fail(ErrorCode::kDataLoss, "tensor on storage '", storage_key, "' has ", shape.size(),
         " sizes but ", stride.size(), " strides");
  uint64_t span = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0 || stride[i] < 0)
      fail(ErrorCode::kDataLoss, "tensor on storage '", storage_key, "' has a negative size or stride");
    if (shape[i] == 0) return 0;
    uint64_t step;
    if (__builtin_mul_overflow(uint64_t(shape[i] - 1), uint64_t(stride[i]), &step) ||
        __builtin_add_overflow(span, step, &span))
      fail(ErrorCode::kDataLoss, "tensor on storage '", storage_key, "': extent overflows");
  }
  return span;
}

bool TensorInfo::is_contiguous() const {
  if (shape.size() != stride.size()) return false;
  int64_t expected = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    if (shape[i] == 1) continue;
    if (stride[i] != expected) return false;
    if (__builtin_mul_overflow(expected, shape[i], &expected)) return false;
  }
  return true;
}

}  // namespace reshard::pt
