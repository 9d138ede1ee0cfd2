// Restricted, non-executing unpickler for torch.save's data.pkl.
//
// Opcode set and semantics: Python's pickle protocols 0-5 as documented by the standard library's
// `pickletools` module (opcode names, argument encodings, stack effects). Torch-specific call
// shapes: formats.md section 5.2 [PT _tensor.py, _utils.py, serialization.py]. Nothing is ever
// imported or called: GLOBAL yields an inert Global node, and calls yield data nodes.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard::pt {

using Kind = PyValue::Kind;

namespace {

struct DtypeRow {
  const char* name;
  const char* canonical;
  uint32_t itemsize;
  bool known;
  DType dtype;
};

// torch dtype names (canonical and the aliases torch exposes as attributes).
const DtypeRow kDtypes[] = {
    {"float64", "float64", 8, true, DType::F64},   {"double", "float64", 8, true, DType::F64},
    {"float32", "float32", 4, true, DType::F32},   {"float", "float32", 4, true, DType::F32},
    {"float16", "float16", 2, true, DType::F16},   {"half", "float16", 2, true, DType::F16},
    {"bfloat16", "bfloat16", 2, true, DType::BF16}, {"int64", "int64", 8, true, DType::I64},
    {"long", "int64", 8, true, DType::I64},        {"int32", "int32", 4, true, DType::I32},
    {"int", "int32", 4, true, DType::I32},         {"int16", "int16", 2, true, DType::I16},
    {"short", "int16", 2, true, DType::I16},       {"int8", "int8", 1, true, DType::I8},
    {"uint8", "uint8", 1, true, DType::U8},        {"bool", "bool", 1, true, DType::Bool},
    {"uint16", "uint16", 2, false, DType::U8},     {"uint32", "uint32", 4, false, DType::U8},
    {"uint64", "uint64", 8, false, DType::U8},     {"complex32", "complex32", 4, false, DType::U8},
    {"chalf", "complex32", 4, false, DType::U8},   {"complex64", "complex64", 8, false, DType::U8},
    {"cfloat", "complex64", 8, false, DType::U8},  {"complex128", "complex128", 16, false, DType::U8},
    {"cdouble", "complex128", 16, false, DType::U8},
    {"float8_e4m3fn", "float8_e4m3fn", 1, false, DType::U8},
    {"float8_e5m2", "float8_e5m2", 1, false, DType::U8},
    {"float8_e4m3fnuz", "float8_e4m3fnuz", 1, false, DType::U8},
    {"float8_e5m2fnuz", "float8_e5m2fnuz", 1, false, DType::U8},
    {"float8_e8m0fnu", "float8_e8m0fnu", 1, false, DType::U8},
    {"qint8", "qint8", 1, false, DType::U8},       {"quint8", "quint8", 1, false, DType::U8},
    {"qint32", "qint32", 4, false, DType::U8},     {"quint4x2", "quint4x2", 1, false, DType::U8},
    {"quint2x4", "quint2x4", 1, false, DType::U8},
};

const DtypeRow* find_dtype(std::string_view n) {
  for (const auto& r : kDtypes)
    if (n == r.name) return &r;
  return nullptr;
}

// torch.<X>Storage class -> torch dtype name [PT storage.py `_dtype_to_storage_type_map`].
const char* storage_class_dtype(std::string_view cls) {
  static const std::pair<const char*, const char*> kMap[] = {
      {"DoubleStorage", "float64"},       {"FloatStorage", "float32"},
      {"HalfStorage", "float16"},         {"BFloat16Storage", "bfloat16"},
      {"LongStorage", "int64"},           {"IntStorage", "int32"},
      {"ShortStorage", "int16"},          {"CharStorage", "int8"},
      {"ByteStorage", "uint8"},           {"BoolStorage", "bool"},
      {"ComplexDoubleStorage", "complex128"}, {"ComplexFloatStorage", "complex64"},
      {"QInt8Storage", "qint8"},          {"QInt32Storage", "qint32"},
      {"QUInt8Storage", "quint8"},        {"QUInt4x2Storage", "quint4x2"},
      {"QUInt2x4Storage", "quint2x4"},
  };
  for (const auto& [k, v] : kMap)
    if (cls == k) return v;
  return nullptr;
}

bool valid_utf8(const uint8_t* s, size_t n) {
  size_t i = 0;
  while (i < n) {
    uint8_t c = s[i];
    if (c < 0x80) { ++i; continue; }
    size_t len;
    uint32_t cp;
    if ((c & 0xE0) == 0xC0) { len = 2; cp = c & 0x1F; }
    else if ((c & 0xF0) == 0xE0) { len = 3; cp = c & 0x0F; }
    else if ((c & 0xF8) == 0xF0) { len = 4; cp = c & 0x07; }
    else return false;
    if (n - i < len) return false;
    for (size_t k = 1; k < len; ++k) {
      if ((s[i + k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      return false;
    i += len;
  }
  return true;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

// Two's-complement little-endian bytes -> decimal text.
std::string le_bytes_to_decimal(const uint8_t* p, size_t n) {
  bool neg = n > 0 && (p[n - 1] & 0x80);
  std::vector<uint8_t> mag(p, p + n);
  if (neg) {  // magnitude = ~x + 1
    unsigned carry = 1;
    for (auto& b : mag) {
      unsigned v = unsigned(uint8_t(~b)) + carry;
      b = uint8_t(v);
      carry = v >> 8;
    }
  }
  std::vector<uint32_t> words((n + 3) / 4, 0);
  for (size_t i = 0; i < n; ++i) words[i / 4] |= uint32_t(mag[i]) << (8 * (i % 4));
  while (!words.empty() && words.back() == 0) words.pop_back();
  std::string digits;
  while (!words.empty()) {
    uint64_t rem = 0;
    for (size_t i = words.size(); i-- > 0;) {
      uint64_t cur = (rem << 32) | words[i];
      words[i] = uint32_t(cur / 1000000000u);
      rem = cur % 1000000000u;
    }
    while (!words.empty() && words.back() == 0) words.pop_back();
    for (int k = 0; k < 9; ++k) {
      digits += char('0' + rem % 10);
      rem /= 10;
      if (words.empty() && rem == 0) break;
    }
  }
  if (digits.empty()) digits = "0";
  if (neg) digits += '-';
  std::reverse(digits.begin(), digits.end());
  return digits;
}

// UTF-8 text whose code points are all < 256 -> those bytes. False if not latin-1 encodable.
bool latin1_from_utf8(const std::string& s, std::string* out) {
  out->clear();
  out->reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint8_t c = uint8_t(s[i]);
    if (c < 0x80) {
      *out += char(c);
      ++i;
    } else if ((c & 0xE0) == 0xC0 && i + 1 < s.size()) {
      uint32_t cp = ((c & 0x1Fu) << 6) | (uint8_t(s[i + 1]) & 0x3Fu);
      if (cp > 0xFF) return false;
      *out += char(cp);
      i += 2;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

bool torch_dtype_info(std::string_view torch_name, uint32_t* itemsize, bool* known, DType* dtype) {
  const DtypeRow* r = find_dtype(torch_name);
  if (!r) return false;
  if (itemsize) *itemsize = r->itemsize;
  if (known) *known = r->known;
  if (dtype) *dtype = r->dtype;
  return true;
}

class PickleParser {
 public:
  PickleParser(const uint8_t* d, size_t n, const std::string& name, const PickleLimits& lim)
      : d_(d), n_(n), name_(name), lim_(lim), doc_(std::make_shared<PickleDocument>()) {}

  std::shared_ptr<const PickleDocument> run();

 private:
  template <typename... A>
  [[noreturn]] void corrupt(A&&... a) {
    fail(ErrorCode::kDataLoss, name_, ": corrupt pickle at byte ", op_pos_, ": ",
         std::forward<A>(a)...);
  }
  template <typename... A>
  [[noreturn]] void invalid(A&&... a) {
    fail(ErrorCode::kInvalidArgument, name_, ": pickle at byte ", op_pos_, ": ",
         std::forward<A>(a)...);
  }
  template <typename... A>
  [[noreturn]] void unsupported(A&&... a) {
    fail(ErrorCode::kUnsupported, name_, ": pickle at byte ", op_pos_, ": ",
         std::forward<A>(a)...);
  }

  PyValue* make(Kind k) {
    if (doc_->nodes_.size() >= lim_.max_nodes)
      invalid("more than ", lim_.max_nodes, " values (limit against hostile input)");
    doc_->nodes_.push_back(std::make_unique<PyValue>());
    PyValue* v = doc_->nodes_.back().get();
    v->kind = k;
    return v;
  }
  const uint8_t* take(size_t k) {
    if (n_ - pos_ < k)
      corrupt("truncated: needs ", k, " more bytes, ", n_ - pos_, " left");
    const uint8_t* p = d_ + pos_;
    pos_ += k;
    return p;
  }
  uint64_t le(size_t k) {
    const uint8_t* p = take(k);
    uint64_t v = 0;
    for (size_t i = 0; i < k; ++i) v |= uint64_t(p[i]) << (8 * i);
    return v;
  }
  std::string_view line() {
    const void* nl = std::memchr(d_ + pos_, '\n', n_ - pos_);
    if (!nl) corrupt("truncated: unterminated text argument");
    size_t end = size_t(static_cast<const uint8_t*>(nl) - d_);
    std::string_view s(reinterpret_cast<const char*>(d_ + pos_), end - pos_);
    pos_ = end + 1;
    if (!s.empty() && s.back() == '\r') s.remove_suffix(1);
    return s;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(PyValue* v) {
    if (stack_.size() >= lim_.max_stack)
      invalid("stack deeper than ", lim_.max_stack, " values (limit against hostile input)");
    stack_.push_back(v);
  }
  PyValue* pop() {
    if (stack_.size() <= floor()) corrupt("stack underflow");
    PyValue* v = stack_.back();
    stack_.pop_back();
    return v;
  }
  PyValue* top() {
    if (stack_.size() <= floor()) corrupt("stack underflow");
    return stack_.back();
  }
  // Items above the topmost MARK; the mark is removed and the items popped.
  std::vector<PyValue*> pop_mark() {
    if (marks_.empty()) corrupt("no MARK on the stack");
    size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyValue*> items(stack_.begin() + long(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  void child(PyValue* parent, const PyValue* c) {
    if (c && c->depth + 1 > parent->depth) {
      parent->depth = c->depth + 1;
      if (parent->depth > lim_.max_depth)
        invalid("values nested deeper than ", lim_.max_depth, " levels (limit against hostile input)");
    }
  }
  void add_item(PyValue* parent, PyValue* c) {
    child(parent, c);
    parent->items.push_back(c);
  }
  void add_entry(PyValue* parent, PyValue* k, PyValue* v) {
    child(parent, k);
    child(parent, v);
    parent->entries.emplace_back(k, v);
  }
  PyValue* seq(Kind k, const std::vector<PyValue*>& items) {
    PyValue* v = make(k);
    v->items.reserve(items.size());
    for (PyValue* c : items) add_item(v, c);
    return v;
  }
  void memo_put(uint64_t idx, PyValue* v) {
    auto it = memo_.find(idx);
    if (it != memo_.end()) {
      it->second = v;
      return;
    }
    if (memo_.size() >= lim_.max_memo)
      invalid("more than ", lim_.max_memo, " memo entries (limit against hostile input)");
    memo_.emplace(idx, v);
  }
  PyValue* memo_get(uint64_t idx) {
    auto it = memo_.find(idx);
    if (it == memo_.end()) corrupt("memo key ", idx, " was never stored");
    return it->second;
  }
  PyValue* make_string(const uint8_t* p, size_t k) {
    if (!valid_utf8(p, k)) corrupt("string is not valid UTF-8");
    PyValue* v = make(Kind::String);
    v->text.assign(reinterpret_cast<const char*>(p), k);
    return v;
  }
  PyValue* make_bytes(const uint8_t* p, size_t k) {
    PyValue* v = make(Kind::Bytes);
    v->text.assign(reinterpret_cast<const char*>(p), k);
    return v;
  }
  PyValue* make_int(int64_t i) {
    PyValue* v = make(Kind::Int);
    v->integer = i;
    return v;
  }
  PyValue* make_long_bytes(const uint8_t* p, size_t k);
  PyValue* make_decimal(std::string_view s);
  PyValue* make_global(std::string module, std::string name);
  PyValue* call(PyValue* callable, PyValue* args, PyValue* kwargs, bool newobj);
  PyValue* generic_object(PyValue* callable, PyValue* args, PyValue* kwargs);
  PyValue* rebuild_tensor(const std::vector<const PyValue*>& a, bool v3);
  PyValue* persistent_load(PyValue* pid);
  std::string quoted_string(std::string_view s);
  std::string raw_unicode_escape(std::string_view s);
  int64_t int_arg(const PyValue* v, const char* what);
  std::vector<int64_t> int_tuple(const PyValue* v, const char* what);

  const uint8_t* d_;
  size_t n_;
  size_t pos_ = 0, op_pos_ = 0;
  std::string name_;
  PickleLimits lim_;
  std::shared_ptr<PickleDocument> doc_;
  std::vector<PyValue*> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyValue*> memo_;
};

PyValue* PickleParser::make_long_bytes(const uint8_t* p, size_t k) {
  if (k == 0) return make_int(0);
  bool neg = p[k - 1] & 0x80;
  bool fits = true;
  for (size_t i = 8; i < k; ++i)
    if (p[i] != (neg ? 0xFF : 0x00)) fits = false;
  if (k > 8 && (bool(p[7] & 0x80) != neg)) fits = false;
  if (fits) {
    uint64_t u = neg ? ~uint64_t(0) : 0;
    for (size_t i = 0; i < std::min<size_t>(k, 8); ++i) {
      u &= ~(uint64_t(0xFF) << (8 * i));
      u |= uint64_t(p[i]) << (8 * i);
    }
    return make_int(int64_t(u));
  }
  if (k > 4096) unsupported("integer of ", k, " bytes is too large");
  PyValue* v = make(Kind::BigInt);
  v->text = le_bytes_to_decimal(p, k);
  return v;
}

PyValue* PickleParser::make_decimal(std::string_view s) {
  std::string t(s);
  while (!t.empty() && (t.back() == 'L' || t.back() == ' ')) t.pop_back();
  size_t i = (!t.empty() && (t[0] == '-' || t[0] == '+')) ? 1 : 0;
  if (i == t.size()) corrupt("bad integer literal");
  for (size_t k = i; k < t.size(); ++k)
    if (t[k] < '0' || t[k] > '9') corrupt("bad integer literal");
  errno = 0;
  char* end = nullptr;
  long long x = std::strtoll(t.c_str(), &end, 10);
  if (errno == 0 && end == t.c_str() + t.size()) return make_int(int64_t(x));
  if (t.size() > 10000) unsupported("integer literal of ", t.size(), " digits is too large");
  PyValue* v = make(Kind::BigInt);
  if (t[0] == '+') t.erase(0, 1);
  size_t neg = t[0] == '-' ? 1 : 0;
  size_t nz = t.find_first_not_of('0', neg);
  v->text = (neg ? "-" : "") + t.substr(nz);
  return v;
}

PyValue* PickleParser::make_global(std::string module, std::string name) {
  if (module == "torch") {
    if (const DtypeRow* r = find_dtype(name)) {
      PyValue* v = make(Kind::Dtype);
      v->text = r->canonical;
      v->dtype_known = r->known;
      v->dtype = r->dtype;
      v->module = std::move(module);
      v->name = std::move(name);
      return v;
    }
  }
  PyValue* v = make(Kind::Global);
  v->module = std::move(module);
  v->name = std::move(name);
  return v;
}

int64_t PickleParser::int_arg(const PyValue* v, const char* what) {
  if (v->kind == Kind::Int) return v->integer;
  if (v->kind == Kind::Bool) return v->boolean;
  invalid(what, " must be an int, got ", v->kind_name());
}

std::vector<int64_t> PickleParser::int_tuple(const PyValue* v, const char* what) {
  if (v->kind != Kind::Tuple && v->kind != Kind::List)
    invalid(what, " must be a tuple of ints, got ", v->kind_name());
  std::vector<int64_t> out;
  out.reserve(v->items.size());
  for (const PyValue* c : v->items) {
    int64_t x = int_arg(c, what);
    if (x < 0) invalid(what, " has a negative entry ", x);
    out.push_back(x);
  }
  return out;
}

// ('storage', <storage class>, key, location, numel) [PT serialization.py `persistent_id`].
PyValue* PickleParser::persistent_load(PyValue* pid) {
  if (pid->kind != Kind::Tuple || pid->items.size() < 5 || pid->items[0]->kind != Kind::String ||
      pid->items[0]->text != "storage")
    unsupported("persistent id is not a ('storage', class, key, location, numel) tuple");
  const PyValue* cls = pid->items[1];
  const PyValue* key = pid->items[2];
  const PyValue* loc = pid->items[3];
  const PyValue* numel = pid->items[4];
  if (key->kind != Kind::String && key->kind != Kind::Int)
    invalid("storage key must be a string, got ", key->kind_name());
  auto info = std::make_unique<StorageInfo>();
  info->key = key->kind == Kind::String ? key->text : std::to_string(key->integer);
  if (loc->kind == Kind::String) info->location = loc->text;
  int64_t n = int_arg(numel, "storage numel");
  if (n < 0) invalid("storage '", info->key, "' has negative numel ", n);
  info->numel = uint64_t(n);
  if (cls->kind == Kind::Dtype) {  // storage given directly as a dtype (not written by torch.save)
    info->torch_dtype = cls->text;
  } else if (cls->kind == Kind::Global &&
             (cls->module == "torch" || cls->module == "torch.cuda" || cls->module == "torch.storage")) {
    if (cls->name == "UntypedStorage" || cls->name == "_UntypedStorage") {
      info->untyped = true;
    } else if (const char* dt = storage_class_dtype(cls->name)) {
      info->torch_dtype = dt;
    } else {
      unsupported("storage '", info->key, "' has unknown class ", cls->module, ".", cls->name);
    }
  } else {
    unsupported("storage '", info->key, "' class is not a torch storage class (", cls->kind_name(),
                " ", cls->qualified_name(), ")");
  }
  PyValue* v = make(Kind::Storage);
  v->storage = std::move(info);
  return v;
}

// _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad, hooks[, metadata])
// _rebuild_tensor_v3(storage, storage_offset, size, stride, requires_grad, hooks, dtype, metadata)
PyValue* PickleParser::rebuild_tensor(const std::vector<const PyValue*>& a, bool v3) {
  const char* fn = v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2";
  if (v3 ? a.size() < 7 : a.size() < 4)
    invalid("torch._utils.", fn, " called with ", a.size(), " arguments");
  if (a[0]->kind != Kind::Storage)
    invalid("torch._utils.", fn, ": first argument must be a storage, got ", a[0]->kind_name());
  const StorageInfo& s = *a[0]->storage;
  auto t = std::make_unique<TensorInfo>();
  t->storage_key = s.key;
  t->location = s.location;
  int64_t off = int_arg(a[1], "storage_offset");
  if (off < 0) invalid("tensor on storage '", s.key, "' has negative storage_offset ", off);
  t->storage_offset = off;
  t->shape = int_tuple(a[2], "tensor size");
  t->stride = int_tuple(a[3], "tensor stride");
  if (t->shape.size() != t->stride.size())
    invalid("tensor on storage '", s.key, "' has ", t->shape.size(), " sizes but ",
            t->stride.size(), " strides");
  if (a.size() > 4) t->requires_grad = a[4]->kind == Kind::Bool ? a[4]->boolean : false;
  std::string dt = s.torch_dtype;
  if (v3) {
    if (a[6]->kind != Kind::Dtype)
      invalid("torch._utils._rebuild_tensor_v3: dtype argument is a ", a[6]->kind_name());
    dt = a[6]->text;
  } else if (s.untyped) {
    invalid("tensor on untyped storage '", s.key, "' without a dtype");
  }
  if (!torch_dtype_info(dt, &t->itemsize, &t->dtype_known, &t->dtype))
    unsupported("tensor on storage '", s.key, "' has unknown dtype '", dt, "'");
  t->torch_dtype = dt;
  uint32_t storage_item = 1;
  if (!s.untyped && !torch_dtype_info(s.torch_dtype, &storage_item, nullptr, nullptr))
    unsupported("storage '", s.key, "' has unknown dtype '", s.torch_dtype, "'");
  if (s.numel > UINT64_MAX / storage_item)
    invalid("storage '", s.key, "' numel ", s.numel, " overflows");
  t->storage_nbytes = s.numel * storage_item;
  t->storage_numel = t->storage_nbytes / t->itemsize;
  PyValue* v = make(Kind::Tensor);
  v->tensor = std::move(t);
  return v;
}

PyValue* PickleParser::generic_object(PyValue* callable, PyValue* args, PyValue* kwargs) {
  PyValue* v = make(Kind::Object);
  v->callable = callable;
  v->args = args;
  v->kwargs = kwargs;
  if (callable->kind == Kind::Global || callable->kind == Kind::Dtype) {
    v->module = callable->module;
    v->name = callable->name;
  }
  child(v, args);
  child(v, kwargs);
  return v;
}

PyValue* PickleParser::call(PyValue* callable, PyValue* args, PyValue* kwargs, bool newobj) {
  if (callable->kind != Kind::Global || args->kind != Kind::Tuple)
    return generic_object(callable, args, kwargs);
  const std::string& m = callable->module;
  const std::string& n = callable->name;
  std::vector<const PyValue*> a(args->items.begin(), args->items.end());
  const bool builtins = m == "__builtin__" || m == "builtins";

  if (m == "torch._utils" && !newobj) {
    if (n == "_rebuild_tensor_v2" || n == "_rebuild_tensor") return rebuild_tensor(a, false);
    if (n == "_rebuild_tensor_v3") return rebuild_tensor(a, true);
    if (n == "_rebuild_parameter" || n == "_rebuild_parameter_with_state") {
      if (a.empty() || a[0]->kind != Kind::Tensor)
        invalid("torch._utils.", n, ": first argument must be a tensor, got ",
                a.empty() ? "nothing" : a[0]->kind_name());
      PyValue* v = make(Kind::Tensor);
      v->tensor = std::make_unique<TensorInfo>(*a[0]->tensor);
      v->tensor->is_parameter = true;
      v->tensor->requires_grad = a.size() > 1 && a[1]->kind == Kind::Bool && a[1]->boolean;
      if (n == "_rebuild_parameter_with_state" && a.size() > 3) {
        v->state = a[3];
        child(v, a[3]);
      }
      return v;
    }
  }
  // _rebuild_from_type_v2(func, new_type, args, state): tensor subclasses.
  if (m == "torch._tensor" && n == "_rebuild_from_type_v2" && a.size() >= 3 &&
      a[0]->kind == Kind::Global && a[0]->module == "torch._utils" && a[2]->kind == Kind::Tuple &&
      (a[0]->name == "_rebuild_tensor_v2" || a[0]->name == "_rebuild_tensor_v3")) {
    std::vector<const PyValue*> inner(a[2]->items.begin(), a[2]->items.end());
    PyValue* v = rebuild_tensor(inner, a[0]->name == "_rebuild_tensor_v3");
    if (a[1]->kind == Kind::Global) v->type_name = a[1]->module + "." + a[1]->name;
    if (a.size() > 3) {
      v->state = a[3];
      child(v, a[3]);
    }
    return v;
  }
  if (m == "collections" && n == "OrderedDict") {
    PyValue* v = make(Kind::Dict);
    v->type_name = "collections.OrderedDict";
    if (!a.empty()) {
      const PyValue* src = a[0];
      if (src->kind == Kind::Dict) {
        for (const auto& [k, val] : src->entries)
          add_entry(v, const_cast<PyValue*>(k), const_cast<PyValue*>(val));
      } else if (src->kind == Kind::List || src->kind == Kind::Tuple) {
        for (const PyValue* pair : src->items) {
          if ((pair->kind != Kind::Tuple && pair->kind != Kind::List) || pair->items.size() != 2)
            invalid("collections.OrderedDict argument items must be pairs");
          add_entry(v, const_cast<PyValue*>(pair->items[0]), const_cast<PyValue*>(pair->items[1]));
        }
      } else {
        invalid("collections.OrderedDict argument is a ", src->kind_name());
      }
    }
    return v;
  }
  if (m == "torch" && n == "Size") {
    PyValue* v = make(Kind::Tuple);
    v->type_name = "torch.Size";
    if (!a.empty()) {
      if (a[0]->kind != Kind::Tuple && a[0]->kind != Kind::List)
        invalid("torch.Size argument is a ", a[0]->kind_name());
      for (const PyValue* c : a[0]->items) add_item(v, const_cast<PyValue*>(c));
    }
    return v;
  }
  if (builtins && (n == "set" || n == "frozenset")) {
    PyValue* v = make(Kind::Set);
    if (n == "frozenset") v->type_name = "frozenset";
    if (!a.empty()) {
      if (a[0]->kind != Kind::List && a[0]->kind != Kind::Tuple && a[0]->kind != Kind::Set)
        invalid("builtins.", n, " argument is a ", a[0]->kind_name());
      for (const PyValue* c : a[0]->items) add_item(v, const_cast<PyValue*>(c));
    }
    return v;
  }
  if (m == "_codecs" && n == "encode" && a.size() == 2 && a[0]->kind == Kind::String &&
      a[1]->kind == Kind::String && (a[1]->text == "latin1" || a[1]->text == "latin-1")) {
    // bytes pickled by protocol < 3: the latin-1 decoding of the bytes as a str.
    std::string out;
    if (!latin1_from_utf8(a[0]->text, &out)) return generic_object(callable, args, kwargs);
    PyValue* v = make(Kind::Bytes);
    v->text = std::move(out);
    return v;
  }
  if (builtins && n == "bytearray" && a.size() <= 2) {
    std::string out;
    if (a.size() == 1 && a[0]->kind == Kind::Bytes) {
      out = a[0]->text;
    } else if (a.size() == 2 && a[0]->kind == Kind::String && a[1]->kind == Kind::String &&
               (a[1]->text == "latin1" || a[1]->text == "latin-1")) {
      if (!latin1_from_utf8(a[0]->text, &out)) return generic_object(callable, args, kwargs);
    } else if (!a.empty()) {
      return generic_object(callable, args, kwargs);
    }
    PyValue* v = make(Kind::Bytes);
    v->type_name = "bytearray";
    v->text = std::move(out);
    return v;
  }
  if (builtins && n == "getattr" && a.size() == 2 && a[0]->kind == Kind::Global &&
      a[1]->kind == Kind::String) {
    // Enum members pickle as getattr(EnumClass, 'NAME') on Python >= 3.11.
    PyValue* v = generic_object(const_cast<PyValue*>(a[0]), args, kwargs);
    v->enum_member = true;
    v->text = a[1]->text;
    return v;
  }
  return generic_object(callable, args, kwargs);
}

std::string PickleParser::quoted_string(std::string_view s) {
  if (s.size() < 2 || (s[0] != '\'' && s[0] != '"') || s.back() != s[0])
    corrupt("STRING argument is not quoted");
  s = s.substr(1, s.size() - 2);
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (c != '\\' || i + 1 == s.size()) {
      out += c;
      continue;
    }
    char e = s[++i];
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '0': out += '\0'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'x':
        if (i + 2 < s.size() + 0 && std::isxdigit(uint8_t(s[i + 1])) && std::isxdigit(uint8_t(s[i + 2]))) {
          out += char(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
          i += 2;
        } else {
          corrupt("bad \\x escape in STRING");
        }
        break;
      default: out += '\\'; out += e; break;
    }
  }
  return out;
}

std::string PickleParser::raw_unicode_escape(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    uint8_t c = uint8_t(s[i]);
    if (c == '\\' && i + 1 < s.size() && (s[i + 1] == 'u' || s[i + 1] == 'U')) {
      size_t k = s[i + 1] == 'u' ? 4 : 8;
      if (i + 2 + k > s.size()) corrupt("bad \\u escape in UNICODE");
      uint32_t cp = 0;
      for (size_t j = 0; j < k; ++j) {
        char h = s[i + 2 + j];
        if (!std::isxdigit(uint8_t(h))) corrupt("bad \\u escape in UNICODE");
        cp = cp * 16 + uint32_t(std::isdigit(uint8_t(h)) ? h - '0' : (std::tolower(h) - 'a' + 10));
      }
      if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) corrupt("bad code point in UNICODE");
      append_utf8(out, cp);
      i += 1 + k;
    } else {
      append_utf8(out, c);  // latin-1
    }
  }
  return out;
}

std::shared_ptr<const PickleDocument> PickleParser::run() {
  while (true) {
    op_pos_ = pos_;
    if (pos_ >= n_) corrupt("truncated: ended without STOP");
    const uint8_t op = d_[pos_++];
    switch (op) {
      case 0x80: {  // PROTO
        uint8_t p = *take(1);
        if (p > 5) unsupported("pickle protocol ", int(p), " (at most 5 is supported)");
        break;
      }
      case 0x95: {  // FRAME
        uint64_t len = le(8);
        if (len > n_ - pos_) corrupt("FRAME of ", len, " bytes overruns the data");
        break;
      }
      case '.': {  // STOP
        if (stack_.empty()) corrupt("STOP with an empty stack");
        doc_->root_ = stack_.back();
        return doc_;
      }
      case '(': {  // MARK
        if (marks_.size() >= lim_.max_marks)
          invalid("more than ", lim_.max_marks, " open MARKs (limit against hostile input)");
        marks_.push_back(stack_.size());
        break;
      }
      case '0':  // POP
        if (stack_.size() > floor()) stack_.pop_back();
        else pop_mark();
        break;
      case '1':  // POP_MARK
        pop_mark();
        break;
      case '2':  // DUP
        push(top());
        break;
      // ---- scalars ----
      case 'N': push(make(Kind::None)); break;
      case 0x88:
      case 0x89: {  // NEWTRUE / NEWFALSE
        PyValue* v = make(Kind::Bool);
        v->boolean = op == 0x88;
        push(v);
        break;
      }
      case 'J': push(make_int(int32_t(uint32_t(le(4))))); break;  // BININT
      case 'K': push(make_int(int64_t(le(1)))); break;            // BININT1
      case 'M': push(make_int(int64_t(le(2)))); break;            // BININT2
      case 0x8a: {  // LONG1
        size_t k = size_t(le(1));
        push(make_long_bytes(take(k), k));
        break;
      }
      case 0x8b: {  // LONG4
        int32_t k = int32_t(uint32_t(le(4)));
        if (k < 0) corrupt("LONG4 with negative length");
        push(make_long_bytes(take(size_t(k)), size_t(k)));
        break;
      }
      case 'I': {  // INT (text)
        std::string_view s = line();
        if (s == "00" || s == "01") {
          PyValue* v = make(Kind::Bool);
          v->boolean = s == "01";
          push(v);
        } else {
          push(make_decimal(s));
        }
        break;
      }
      case 'L': push(make_decimal(line())); break;  // LONG (text)
      case 'G': {  // BINFLOAT, big-endian
        const uint8_t* p = take(8);
        uint64_t u = 0;
        for (int i = 0; i < 8; ++i) u = (u << 8) | p[i];
        PyValue* v = make(Kind::Float);
        std::memcpy(&v->real, &u, 8);
        push(v);
        break;
      }
      case 'F': {  // FLOAT (text)
        std::string s(line());
        char* end = nullptr;
        double x = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) corrupt("bad FLOAT literal");
        PyValue* v = make(Kind::Float);
        v->real = x;
        push(v);
        break;
      }
      // ---- strings and bytes ----
      case 'X': {  // BINUNICODE
        size_t k = size_t(le(4));
        push(make_string(take(k), k));
        break;
      }
      case 0x8c: {  // SHORT_BINUNICODE
        size_t k = size_t(le(1));
        push(make_string(take(k), k));
        break;
      }
      case 0x8d: {  // BINUNICODE8
        uint64_t k = le(8);
        if (k > n_ - pos_) corrupt("truncated: string of ", k, " bytes");
        push(make_string(take(size_t(k)), size_t(k)));
        break;
      }
      case 'V': {  // UNICODE (raw-unicode-escape text)
        PyValue* v = make(Kind::String);
        v->text = raw_unicode_escape(line());
        push(v);
        break;
      }
      case 'S': {  // STRING (quoted text); Python 3 decodes it as ASCII-ish str
        std::string s = quoted_string(line());
        PyValue* v = make(Kind::String);
        for (char c : s) append_utf8(v->text, uint8_t(c));
        push(v);
        break;
      }
      case 'T':    // BINSTRING
      case 'U': {  // SHORT_BINSTRING
        size_t k = size_t(le(op == 'T' ? 4 : 1));
        const uint8_t* p = take(k);
        PyValue* v = make(Kind::String);
        for (size_t i = 0; i < k; ++i) append_utf8(v->text, p[i]);
        push(v);
        break;
      }
      case 'B': {  // BINBYTES
        size_t k = size_t(le(4));
        push(make_bytes(take(k), k));
        break;
      }
      case 'C': {  // SHORT_BINBYTES
        size_t k = size_t(le(1));
        push(make_bytes(take(k), k));
        break;
      }
      case 0x8e:    // BINBYTES8
      case 0x96: {  // BYTEARRAY8
        uint64_t k = le(8);
        if (k > n_ - pos_) corrupt("truncated: bytes of ", k, " bytes");
        PyValue* v = make_bytes(take(size_t(k)), size_t(k));
        if (op == 0x96) v->type_name = "bytearray";
        push(v);
        break;
      }
      case 0x97:
      case 0x98:
        unsupported("out-of-band buffers (NEXT_BUFFER/READONLY_BUFFER)");
      // ---- containers ----
      case '}': push(make(Kind::Dict)); break;
      case ']': push(make(Kind::List)); break;
      case ')': push(make(Kind::Tuple)); break;
      case 0x8f: push(make(Kind::Set)); break;  // EMPTY_SET
      case 't': push(seq(Kind::Tuple, pop_mark())); break;
      case 'l': push(seq(Kind::List, pop_mark())); break;
      case 0x91: {  // FROZENSET
        PyValue* v = seq(Kind::Set, pop_mark());
        v->type_name = "frozenset";
        push(v);
        break;
      }
      case 0x85: {  // TUPLE1
        PyValue* a = pop();
        push(seq(Kind::Tuple, {a}));
        break;
      }
      case 0x86: {  // TUPLE2
        PyValue* b = pop();
        PyValue* a = pop();
        push(seq(Kind::Tuple, {a, b}));
        break;
      }
      case 0x87: {  // TUPLE3
        PyValue* c = pop();
        PyValue* b = pop();
        PyValue* a = pop();
        push(seq(Kind::Tuple, {a, b, c}));
        break;
      }
      case 'd': {  // DICT
        auto items = pop_mark();
        if (items.size() % 2) corrupt("DICT with an odd number of items");
        PyValue* v = make(Kind::Dict);
        for (size_t i = 0; i < items.size(); i += 2) add_entry(v, items[i], items[i + 1]);
        push(v);
        break;
      }
      case 'a': {  // APPEND
        PyValue* x = pop();
        PyValue* l = top();
        if (l->kind != Kind::List && l->kind != Kind::Object)
          corrupt("APPEND to a ", l->kind_name());
        add_item(l, x);
        break;
      }
      case 'e': {  // APPENDS
        auto items = pop_mark();
        PyValue* l = top();
        if (l->kind != Kind::List && l->kind != Kind::Object)
          corrupt("APPENDS to a ", l->kind_name());
        for (PyValue* x : items) add_item(l, x);
        break;
      }
      case 0x90: {  // ADDITEMS
        auto items = pop_mark();
        PyValue* s = top();
        if (s->kind != Kind::Set && s->kind != Kind::Object) corrupt("ADDITEMS to a ", s->kind_name());
        for (PyValue* x : items) add_item(s, x);
        break;
      }
      case 's': {  // SETITEM
        PyValue* v = pop();
        PyValue* k = pop();
        PyValue* d = top();
        if (d->kind != Kind::Dict && d->kind != Kind::Object) corrupt("SETITEM on a ", d->kind_name());
        add_entry(d, k, v);
        break;
      }
      case 'u': {  // SETITEMS
        auto items = pop_mark();
        PyValue* d = top();
        if (d->kind != Kind::Dict && d->kind != Kind::Object) corrupt("SETITEMS on a ", d->kind_name());
        if (items.size() % 2) corrupt("SETITEMS with an odd number of items");
        for (size_t i = 0; i < items.size(); i += 2) add_entry(d, items[i], items[i + 1]);
        break;
      }
      // ---- memo ----
      case 'p': {  // PUT (text)
        PyValue* v = top();
        std::string s(line());
        char* end = nullptr;
        unsigned long long idx = std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || end != s.c_str() + s.size()) corrupt("bad PUT index");
        memo_put(idx, v);
        break;
      }
      case 'q': memo_put(le(1), top()); break;   // BINPUT
      case 'r': memo_put(le(4), top()); break;   // LONG_BINPUT
      case 0x94: memo_put(memo_.size(), top()); break;  // MEMOIZE
      case 'g': {  // GET (text)
        std::string s(line());
        char* end = nullptr;
        unsigned long long idx = std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || end != s.c_str() + s.size()) corrupt("bad GET index");
        push(memo_get(idx));
        break;
      }
      case 'h': push(memo_get(le(1))); break;  // BINGET
      case 'j': push(memo_get(le(4))); break;  // LONG_BINGET
      // ---- globals and calls (never executed) ----
      case 'c': {  // GLOBAL
        std::string module(line());
        std::string name(line());
        push(make_global(std::move(module), std::move(name)));
        break;
      }
      case 0x93: {  // STACK_GLOBAL
        PyValue* name = pop();
        PyValue* module = pop();
        if (name->kind != Kind::String || module->kind != Kind::String)
          corrupt("STACK_GLOBAL needs two strings");
        push(make_global(module->text, name->text));
        break;
      }
      case 'R': {  // REDUCE
        PyValue* args = pop();
        PyValue* fn = pop();
        push(call(fn, args, nullptr, false));
        break;
      }
      case 0x81: {  // NEWOBJ
        PyValue* args = pop();
        PyValue* cls = pop();
        push(call(cls, args, nullptr, true));
        break;
      }
      case 0x92: {  // NEWOBJ_EX
        PyValue* kwargs = pop();
        PyValue* args = pop();
        PyValue* cls = pop();
        push(generic_object(cls, args, kwargs));
        break;
      }
      case 'i': {  // INST (protocol 0): module\nname\n, args above MARK
        std::string module(line());
        std::string name(line());
        auto items = pop_mark();
        PyValue* cls = make_global(std::move(module), std::move(name));
        push(generic_object(cls, seq(Kind::Tuple, items), nullptr));
        break;
      }
      case 'o': {  // OBJ (protocol 1): MARK cls args...
        auto items = pop_mark();
        if (items.empty()) corrupt("OBJ without a class");
        PyValue* cls = items[0];
        items.erase(items.begin());
        push(generic_object(cls, seq(Kind::Tuple, items), nullptr));
        break;
      }
      case 'b': {  // BUILD
        PyValue* state = pop();
        PyValue* obj = top();
        obj->state = state;
        child(obj, state);
        break;
      }
      case 'Q': push(persistent_load(pop())); break;  // BINPERSID
      case 'P':
        unsupported("text persistent ids (PERSID) are not used by torch.save");
      case 0x82:
      case 0x83:
      case 0x84:
        unsupported("extension registry codes (EXT1/EXT2/EXT4)");
      default:
        corrupt("unknown opcode 0x", "0123456789abcdef"[op >> 4], "0123456789abcdef"[op & 15]);
    }
  }
}

std::shared_ptr<const PickleDocument> parse_pickle(const uint8_t* data, size_t len,
                                                   const std::string& display_name,
                                                   const PickleLimits& limits) {
  PickleParser p(data, len, display_name, limits);
  return p.run();
}

}  // namespace reshard::pt
