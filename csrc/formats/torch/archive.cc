// torch.save archive = ZIP directory + data.pkl + data/<key> records (formats.md section 5).
#include <algorithm>
#include <cstring>
#include <deque>
#include <unordered_map>
#include <unordered_set>

#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard::pt {

using Kind = PyValue::Kind;

namespace {

// The legacy format starts with the pickled magic number 0x1950a86a20f9469cfc6c
// [PT serialization.py `_legacy_save`]: PROTO n, LONG1 10, then the 10 bytes little-endian.
bool is_legacy(const uint8_t* p, size_t n) {
  static const uint8_t magic[] = {0x8a, 0x0a, 0x6c, 0xfc, 0x9c, 0x46, 0xf9,
                                  0x20, 0x6a, 0xa8, 0x50, 0x19};
  return n >= 2 + sizeof magic && p[0] == 0x80 && std::memcmp(p + 2, magic, sizeof magic) == 0;
}

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ' || s.back() == '\0'))
    s.pop_back();
  size_t i = 0;
  while (i < s.size() && s[i] == ' ') ++i;
  return s.substr(i);
}

std::string read_small(const ByteSource& src, const ZipEntry& e, const std::string& path) {
  if (e.uncompressed_size > 4096)
    fail(ErrorCode::kDataLoss, path, ": record '", e.name, "' is unexpectedly large (",
         e.uncompressed_size, " bytes)");
  std::string s(size_t(e.uncompressed_size), '\0');
  src.read(e.data_offset, e.uncompressed_size, s.data());
  return s;
}

// Breadth-first walk recording, for every reachable tensor, the first path that reaches it.
std::vector<TensorRef> collect_tensors(const PyValue& root) {
  struct Visit {
    const PyValue* node;
    int64_t parent;
    enum Edge : uint8_t { kRoot, kItem, kObjItem, kValue, kArgs, kKwargs, kState } edge;
    size_t index;
  };
  std::vector<Visit> visits;
  std::unordered_set<const PyValue*> seen;
  visits.push_back({&root, -1, Visit::kRoot, 0});
  seen.insert(&root);
  std::vector<size_t> tensor_visits;
  for (size_t i = 0; i < visits.size(); ++i) {
    const PyValue* v = visits[i].node;
    auto add = [&](const PyValue* c, Visit::Edge e, size_t idx) {
      if (c && seen.insert(c).second) visits.push_back({c, int64_t(i), e, idx});
    };
    if (v->kind == Kind::Tensor) tensor_visits.push_back(i);
    const bool obj = v->kind == Kind::Object;
    for (size_t k = 0; k < v->items.size(); ++k) add(v->items[k], obj ? Visit::kObjItem : Visit::kItem, k);
    for (size_t k = 0; k < v->entries.size(); ++k) add(v->entries[k].second, Visit::kValue, k);
    add(v->args, Visit::kArgs, 0);
    add(v->kwargs, Visit::kKwargs, 0);
    add(v->state, Visit::kState, 0);
  }
  std::vector<TensorRef> out;
  out.reserve(tensor_visits.size());
  for (size_t ti : tensor_visits) {
    std::vector<std::string> parts;
    for (int64_t i = int64_t(ti); visits[size_t(i)].parent >= 0; i = visits[size_t(i)].parent) {
      const Visit& vi = visits[size_t(i)];
      const PyValue* p = visits[size_t(vi.parent)].node;
      switch (vi.edge) {
        case Visit::kItem: parts.push_back("[" + std::to_string(vi.index) + "]"); break;
        case Visit::kObjItem: parts.push_back(".items[" + std::to_string(vi.index) + "]"); break;
        case Visit::kValue: parts.push_back("[" + quote_key(*p->entries[vi.index].first) + "]"); break;
        case Visit::kArgs: parts.push_back(".args"); break;
        case Visit::kKwargs: parts.push_back(".kwargs"); break;
        case Visit::kState: parts.push_back(".state"); break;
        case Visit::kRoot: break;
      }
    }
    std::string path;
    for (size_t k = parts.size(); k-- > 0;) path += parts[k];
    if (path.empty()) path = "<root>";
    out.push_back({std::move(path), visits[ti].node});
  }
  return out;
}

}  // namespace

const StorageRecord& TorchArchive::record(const TensorInfo& t) const {
  auto it = storages.find(t.storage_key);
  if (it == storages.end())
    fail(ErrorCode::kNotFound, path, ": no record ", prefix, "/data/", t.storage_key);
  return it->second;
}

uint64_t TorchArchive::tensor_data_offset(const TensorInfo& t) const {
  return record(t).offset + uint64_t(t.storage_offset) * t.itemsize;
}

TorchArchive open_torch_archive(const ByteSource& src, const std::string& path,
                                const PickleLimits& limits) {
  uint8_t head[14] = {};
  const size_t head_len = size_t(std::min<uint64_t>(src.size(), sizeof head));
  src.read(0, head_len, head);
  if (head_len < 4 || std::memcmp(head, "PK\x03\x04", 4) != 0) {
    // An empty or zero-filled file is one whose write never happened (a rank killed after
    // creating it, space allocated but not written): data lost, not a file of another kind.
    if (src.size() == 0) fail(ErrorCode::kDataLoss, path, ": empty file (0 bytes; a save that did not finish?)");
    if (std::all_of(head, head + head_len, [](uint8_t b) { return b == 0; }))
      fail(ErrorCode::kDataLoss, path, ": starts with zero bytes, not a ZIP local header (a write that did not finish?)");
    if (is_legacy(head, head_len))
      fail(ErrorCode::kUnsupported, path,
           ": legacy torch serialization; re-save with torch.save(obj, path) under torch >= 1.6");
    fail(ErrorCode::kInvalidArgument, path,
         ": not a torch.save archive (does not start with a ZIP local header)");
  }

  TorchArchive ar;
  ar.path = path;
  ar.zip = read_zip_directory(src, path);
  if (ar.zip.entries.empty())
    fail(ErrorCode::kInvalidArgument, path, ": not a torch.save archive (empty ZIP)");
  const std::string& first = ar.zip.entries.front().name;
  size_t slash = first.find('/');
  if (slash == std::string::npos || slash == 0)
    fail(ErrorCode::kInvalidArgument, path, ": not a torch.save archive (first entry '", first,
         "' is not inside a top-level folder)");
  ar.prefix = first.substr(0, slash);
  const std::string pre = ar.prefix + "/";

  const ZipEntry* pkl = ar.zip.find(pre + "data.pkl");
  if (!pkl)
    fail(ErrorCode::kInvalidArgument, path, ": not a torch.save archive (no ", pre, "data.pkl)");

  ar.byteorder = "little";
  if (const ZipEntry* bo = ar.zip.find(pre + "byteorder")) {
    ar.byteorder = trim(read_small(src, *bo, path));
    if (ar.byteorder != "little")
      fail(ErrorCode::kUnsupported, path, ": byteorder record says '", ar.byteorder,
           "'; only little-endian archives are supported");
  }
  if (const ZipEntry* ve = ar.zip.find(pre + "version")) ar.version = trim(read_small(src, *ve, path));

  for (const ZipEntry& e : ar.zip.entries) {
    if (e.name.compare(0, pre.size() + 5, pre + "data/") != 0 || e.name.size() == pre.size() + 5)
      continue;
    std::string key = e.name.substr(pre.size() + 5);
    ar.storages[key] = StorageRecord{key, e.data_offset, e.uncompressed_size};
  }

  std::string bytes(size_t(pkl->uncompressed_size), '\0');
  src.read(pkl->data_offset, pkl->uncompressed_size, bytes.data());
  uint32_t crc = zip_crc32(bytes.data(), bytes.size());
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  crc = pkl->crc32;  // let the fuzzer reach the unpickler through mutated archives
#endif
  if (crc != pkl->crc32)
    fail(ErrorCode::kDataLoss, path, ": ", pkl->name, " fails its CRC-32 check (stored ",
         pkl->crc32, ", computed ", crc, ")");
  ar.pickle = parse_pickle(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                           path + ": " + pkl->name, limits);

  ar.tensors = collect_tensors(ar.root());
  for (const TensorRef& tr : ar.tensors) {
    const TensorInfo& t = *tr.value->tensor;
    auto it = ar.storages.find(t.storage_key);
    if (it == ar.storages.end())
      fail(ErrorCode::kDataLoss, path, ": tensor ", tr.path, " uses storage '", t.storage_key,
           "' but the archive has no record ", pre, "data/", t.storage_key);
    const StorageRecord& rec = it->second;
    if (t.storage_nbytes > rec.length)
      fail(ErrorCode::kDataLoss, path, ": storage '", t.storage_key, "' (used by tensor ", tr.path,
           ") declares ", t.storage_nbytes, " bytes but its record holds ", rec.length);
    uint64_t extent, end_el, end_bytes;
    try {
      extent = t.extent();
    } catch (const Error& e) {
      fail(ErrorCode::kDataLoss, path, ": tensor ", tr.path, ": ", e.what());
    }
    if (__builtin_add_overflow(uint64_t(t.storage_offset), extent, &end_el) ||
        __builtin_mul_overflow(end_el, uint64_t(t.itemsize), &end_bytes) ||
        (extent > 0 && end_bytes > t.storage_nbytes))
      fail(ErrorCode::kDataLoss, path, ": tensor ", tr.path, " (", t.torch_dtype, ", offset ",
           t.storage_offset, ", extent ", extent, " elements) overruns storage '", t.storage_key,
           "' of ", t.storage_nbytes, " bytes (record ", pre, "data/", t.storage_key, " has ",
           rec.length, " bytes)");
  }
  return ar;
}

TorchArchive open_torch_file(const std::string& path, const PickleLimits& limits) {
  FileSource src(path);
  return open_torch_archive(src, path, limits);
}

}  // namespace reshard::pt
