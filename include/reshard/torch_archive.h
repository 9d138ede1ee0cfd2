// reshard: reading torch.save archives without Python.
//
// Three layers, each a pure parser over a random-access `ByteSource` (no I/O of its own):
//   1. `read_zip_directory`  - the ZIP container (central directory only; never reads entry data).
//   2. `parse_pickle`        - a restricted, non-executing unpickler producing a `PyValue` graph.
//   3. `open_torch_archive`  - both together: finds `<prefix>/data.pkl`, parses it, maps storage
//                              keys to byte ranges of `<prefix>/data/<key>` and validates every
//                              tensor against its storage record.
//
// Format facts and where they come from (tags as in shared/research/formats.md section 0):
//   * A torch.save file (torch >= 1.6) is a ZIP whose first 4 bytes are `PK\x03\x04`; anything
//     else is the legacy format. [PT serialization.py `_is_zipfile`]
//   * All entries live under one top-level folder whose name varies (the file's basename without
//     extension, or `archive` when saved to a stream); the prefix is taken from the first entry.
//     [PT inline_container.cc `PyTorchStreamReader::init`]
//   * Records: `data.pkl`, `data/<key>` (raw little-endian storage bytes), `byteorder`
//     (`little`/`big`, absent means little), `version`, `.data/serialization_id`, and in newer
//     torch `.format_version` / `.storage_alignment`. [PT serialization.py `_save`;
//     inline_container.cc `writeEndOfFile`]
//   * Entries are stored (method 0); local headers carry zero sizes (data-descriptor flag), so
//     sizes come only from the central directory, ZIP64 extra field 0x0001 where >= 4 GiB; data
//     starts at local header offset + 30 + name length + local extra length (64-byte aligned by a
//     padding extra field). [PT inline_container.cc `getRecordOffset`, `getPadding`]
//   * The pickle is protocol 2; tensors are `REDUCE(torch._utils._rebuild_tensor_v2, (storage,
//     storage_offset, size, stride, requires_grad, hooks[, metadata]))`, newer dtypes use
//     `_rebuild_tensor_v3(..., dtype, metadata)` with an `UntypedStorage`; storages are
//     `BINPERSID(('storage', torch.<X>Storage, key, location, numel))`. Offsets, sizes and strides
//     are in elements. [PT _tensor.py `_reduce_ex_internal`; _utils.py; serialization.py
//     `persistent_id`] For typed storages `numel` counts elements; for `UntypedStorage` it counts
//     bytes (observed with torch 2.13: a 2-element uint16 tensor records numel 4).
//   * Legacy (non-zip) files begin with the pickled magic number 0x1950a86a20f9469cfc6c.
//     [PT serialization.py `_legacy_save`] They are rejected with kUnsupported.
//
// Errors: every failure is a reshard::Error whose message names the display path given by the
// caller, and the ZIP entry / pickle byte position / tensor path involved:
//   kInvalidArgument  not a torch.save file; pickle limits exceeded; a rebuild call with
//                     arguments of the wrong shape
//   kDataLoss         truncated or corrupt bytes (bad offsets, bad signatures, CRC mismatch of
//                     data.pkl, malformed pickle, tensor extent outside its storage record)
//   kUnsupported      compressed ZIP entries, legacy serialization, big-endian archives,
//                     pickle constructs this reader does not model (EXT codes, out-of-band buffers)
//   kNotFound         FileSource: the file does not exist; PyValue::at / TorchArchive::record:
//                     the key or storage record is absent
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "reshard/dtype.h"

namespace reshard::pt {

// ------------------------------------------------------------------------------------------------
// Byte sources
// ------------------------------------------------------------------------------------------------

/// Random-access read-only bytes. Implementations must be safe to call from one thread at a time.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  /// Total size in bytes.
  virtual uint64_t size() const = 0;
  /// Copies exactly `len` bytes starting at `offset` into `dst`. Throws Error(kDataLoss) if the
  /// range is not inside [0, size()) or the bytes cannot be read.
  virtual void read(uint64_t offset, uint64_t len, void* dst) const = 0;
};

/// Bytes held in memory. Does not own the bytes unless constructed from a vector/string.
class MemorySource final : public ByteSource {
 public:
  MemorySource(const void* data, size_t size) : data_(static_cast<const uint8_t*>(data)), size_(size) {}
  explicit MemorySource(std::string owned)
      : owned_(std::move(owned)), data_(reinterpret_cast<const uint8_t*>(owned_.data())),
        size_(owned_.size()) {}
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, uint64_t len, void* dst) const override;

 private:
  std::string owned_;
  const uint8_t* data_;
  size_t size_;
};

/// A file read with pread(2). Opening throws kNotFound (missing) or kInvalidArgument (not a
/// regular readable file), naming the path.
class FileSource final : public ByteSource {
 public:
  explicit FileSource(const std::string& path);
  ~FileSource() override;
  FileSource(const FileSource&) = delete;
  FileSource& operator=(const FileSource&) = delete;
  uint64_t size() const override { return size_; }
  void read(uint64_t offset, uint64_t len, void* dst) const override;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// ------------------------------------------------------------------------------------------------
// ZIP
// ------------------------------------------------------------------------------------------------

/// One central-directory entry. All sizes/offsets in bytes, absolute within the source.
struct ZipEntry {
  std::string name;                 // full name, e.g. "mp_rank_00_model_states/data/0"
  uint16_t method = 0;              // 0 = stored (only stored entries are accepted)
  uint16_t flags = 0;               // general purpose bit flags
  uint32_t crc32 = 0;               // from the central directory
  uint64_t compressed_size = 0;     // == uncompressed_size for stored entries
  uint64_t uncompressed_size = 0;
  uint64_t local_header_offset = 0;
  uint64_t data_offset = 0;         // local_header_offset + 30 + name len + local extra len
};

struct ZipDirectory {
  std::vector<ZipEntry> entries;    // in central-directory order
  bool zip64 = false;               // a ZIP64 end-of-central-directory record was used
  uint64_t cd_offset = 0, cd_size = 0;
  /// Entry with exactly this name, or nullptr (linear scan).
  const ZipEntry* find(std::string_view name) const;
};

/// Reads the end-of-central-directory (searching the last 64 KiB + 22 bytes), the ZIP64 locator
/// and record when present, every central-directory entry (with its ZIP64 extra field 0x0001) and
/// each entry's local header (to compute `data_offset`). Every offset is bounds-checked against
/// `src.size()`. Throws kInvalidArgument when there is no end-of-central-directory at all,
/// kDataLoss for inconsistent/truncated structures, kUnsupported for a compressed or encrypted
/// entry (naming it), multi-disk archives. Reads O(central directory) bytes; never entry data.
ZipDirectory read_zip_directory(const ByteSource& src, const std::string& display_path);

/// CRC-32 (ISO-HDLC, as used by ZIP) of `n` bytes, continuing from `crc` (0 to start).
uint32_t zip_crc32(const void* data, size_t n, uint32_t crc = 0);

// ------------------------------------------------------------------------------------------------
// Pickle values
// ------------------------------------------------------------------------------------------------

/// A storage referenced by BINPERSID ('storage', <class>, key, location, numel).
struct StorageInfo {
  std::string key;                  // record name under <prefix>/data/
  std::string location;             // "cpu", "cuda:0", ...
  std::string torch_dtype;          // torch name from the class ("float32", ...), "" for untyped
  bool untyped = false;             // UntypedStorage: numel counts bytes
  uint64_t numel = 0;               // as recorded: elements (typed) or bytes (untyped)
};

/// What `_rebuild_tensor_v2/_v3` (optionally wrapped by `_rebuild_parameter`) describes.
struct TensorInfo {
  std::string storage_key;
  std::string location;
  std::string torch_dtype;          // torch's name: "float32", "bfloat16", "uint16", ...
  bool dtype_known = false;         // true when `dtype` below is meaningful
  DType dtype = DType::U8;          // reshard dtype (valid if dtype_known)
  uint32_t itemsize = 0;            // bytes per element (known for every torch dtype we map)
  int64_t storage_offset = 0;       // elements
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;      // elements
  uint64_t storage_numel = 0;       // storage size in elements (storage_nbytes / itemsize)
  uint64_t storage_nbytes = 0;      // storage size in bytes as declared by the persistent id
  bool requires_grad = false;
  bool is_parameter = false;        // wrapped by torch._utils._rebuild_parameter*
  /// Number of elements (product of shape; 1 for a 0-d tensor).
  uint64_t numel() const;
  /// Elements of the storage spanned: 0 if any dim is 0, else 1 + sum((shape_i-1)*stride_i).
  /// Throws kDataLoss on overflow or negative sizes/strides.
  uint64_t extent() const;
  bool is_contiguous() const;
};

class PyValue {
 public:
  enum class Kind : uint8_t {
    None, Bool, Int, BigInt, Float, String, Bytes, List, Tuple, Dict, Set,
    Global, Object, Storage, Tensor, Dtype,
  };
  using Item = const PyValue*;
  using Entry = std::pair<const PyValue*, const PyValue*>;

  Kind kind = Kind::None;
  bool boolean = false;       // Bool
  int64_t integer = 0;        // Int
  double real = 0;            // Float
  /// String: UTF-8 text. Bytes: raw bytes. BigInt: decimal digits with optional '-'.
  /// Dtype: torch name ("float32"). Object made by getattr(EnumClass, name): the member name.
  std::string text;
  /// Global: module and name. Also set on Object (the callable's module/name if it was a Global).
  std::string module, name;
  /// Python type when more specific than the kind: "collections.OrderedDict", "torch.Size",
  /// "frozenset", "bytearray"; empty for the plain builtin type.
  std::string type_name;
  std::vector<Item> items;     // List/Tuple/Set elements; Object: APPENDed/ADDITEMS values
  std::vector<Entry> entries;  // Dict items in order; Object: SETITEM values
  const PyValue* callable = nullptr;  // Object: what was called / instantiated (usually a Global)
  const PyValue* args = nullptr;      // Object: the argument tuple
  const PyValue* kwargs = nullptr;    // Object: NEWOBJ_EX keyword dict
  const PyValue* state = nullptr;     // any: the BUILD state (e.g. OrderedDict `_metadata`)
  bool enum_member = false;           // Object from getattr(<class>, '<member>')
  bool dtype_known = false;           // Dtype: `dtype` is meaningful
  DType dtype = DType::U8;            // Dtype
  std::unique_ptr<StorageInfo> storage;  // Storage
  std::unique_ptr<TensorInfo> tensor;    // Tensor
  uint32_t depth = 0;                    // nesting depth (as known when built)

  static const char* kind_name(Kind k);
  const char* kind_name() const { return kind_name(kind); }
  bool is(Kind k) const { return kind == k; }
  bool is_none() const { return kind == Kind::None; }

  // Type-checked accessors; throw Error(kInvalidArgument, "expected <kind>, got <kind> ...").
  int64_t as_int() const;        // Int (Bool is accepted as 0/1)
  double as_float() const;       // Float or Int
  bool as_bool() const;          // Bool
  const std::string& as_string() const;  // String
  const std::string& as_bytes() const;   // Bytes
  const std::vector<Item>& as_list() const;      // List
  const std::vector<Item>& as_tuple() const;     // Tuple
  const std::vector<Item>& as_sequence() const;  // List or Tuple
  const std::vector<Entry>& as_dict() const;     // Dict
  const TensorInfo& as_tensor() const;           // Tensor
  const StorageInfo& as_storage() const;         // Storage
  /// "module.name" of a Global, or of an Object's callable when that is a Global; else "".
  std::string qualified_name() const;

  /// Dict (or Object with SETITEM entries / dict `state`) lookup of a string key; nullptr when
  /// absent. Linear in the number of entries. Throws kInvalidArgument for other kinds.
  const PyValue* get(std::string_view key) const;
  /// Like get() but throws kNotFound naming the key when absent.
  const PyValue& at(std::string_view key) const;

  /// JSON view for `inspect` (key order preserved): scalars as JSON scalars, List/Tuple/Set as arrays, Dict with string
  /// keys as objects (other keys: {"__dict__": [[k, v], ...]}), tensors as {"__tensor__": dtype,
  /// "shape", "stride", "storage", "offset"}, Globals as {"__global__": "module.name"}, Objects as
  /// {"__object__": name, "args", "state", ...}, BigInt as {"__int__": "digits"}, Bytes as
  /// {"__bytes__": length, "hex": first 64 bytes}. Shared nodes are repeated, cycles become
  /// {"__cycle__": true}. Throws kInvalidArgument beyond `max_depth` or when more than
  /// `max_nodes` nodes would be emitted (aliasing can make the tree exponential).
  nlohmann::ordered_json to_json(size_t max_depth = 256, size_t max_nodes = 1u << 22) const;
  /// Short Python-like repr, truncated to about `max_len` characters.
  std::string repr(size_t max_len = 200) const;
};

/// Limits against hostile input; exceeding one throws kInvalidArgument naming it. Every value
/// costs one opcode byte or more, so node count is also bounded by the pickle size; one node takes
/// about 250 bytes of memory (PyValue plus its arena slot).
struct PickleLimits {
  size_t max_depth = 512;          // nesting depth of containers
  size_t max_stack = 1u << 22;     // values on the VM stack (all marks together)
  size_t max_marks = 4096;         // open MARKs
  size_t max_memo = 1u << 24;      // memo entries
  size_t max_nodes = 1u << 24;     // values created in total
};

/// A parsed pickle: owns every node (an arena, so aliasing and cycles are safe).
class PickleDocument {
 public:
  const PyValue& root() const { return *root_; }
  size_t node_count() const { return nodes_.size(); }
  /// Every node, in creation order (useful for linear scans, e.g. all tensors).
  const std::vector<std::unique_ptr<PyValue>>& nodes() const { return nodes_; }

 private:
  friend class PickleParser;
  std::vector<std::unique_ptr<PyValue>> nodes_;
  const PyValue* root_ = nullptr;
};

/// Parses one pickle (protocols 0-5 as far as torch checkpoints use them) from memory. Nothing
/// is imported or executed: GLOBAL yields a Global node; REDUCE/NEWOBJ of the known torch and
/// builtin callables yields a specific node (Tensor, Storage, Dict for OrderedDict, Tuple for
/// torch.Size, Set, Bytes for _codecs.encode, Dtype for torch.<dtype>, enum members); every other
/// call yields an inert Object node. `display_name` prefixes every error message, followed by
/// "at byte N". Linear time in `len`.
std::shared_ptr<const PickleDocument> parse_pickle(const uint8_t* data, size_t len,
                                                   const std::string& display_name,
                                                   const PickleLimits& limits = {});

/// Maps torch dtype names ("float32", "bfloat16", "half", "long", "uint16", ...) to the element
/// size and, where reshard has one, the DType. Returns false for unknown names.
bool torch_dtype_info(std::string_view torch_name, uint32_t* itemsize, bool* known, DType* dtype);

// ------------------------------------------------------------------------------------------------
// torch.save archive
// ------------------------------------------------------------------------------------------------

/// Byte range of `<prefix>/data/<key>` in the file.
struct StorageRecord {
  std::string key;
  uint64_t offset = 0;   // absolute byte offset in the source
  uint64_t length = 0;   // bytes
};

struct TensorRef {
  std::string path;         // Python-style path from the root, e.g. ["module"]["fc.weight"]
  const PyValue* value;     // Kind::Tensor
};

struct TorchArchive {
  std::string path;                           // display path given to open_torch_archive
  std::string prefix;                         // top-level folder, e.g. "mp_rank_00_model_states"
  ZipDirectory zip;
  std::shared_ptr<const PickleDocument> pickle;
  std::map<std::string, StorageRecord> storages;  // key -> every data/<key> record in the zip
  std::vector<TensorRef> tensors;             // every tensor node reachable from the root, first
                                              // path found (breadth-first), in that order
  std::string byteorder;                      // "little" (also when the record is absent)
  std::string version;                        // content of `version` (trimmed), "" if absent

  const PyValue& root() const { return pickle->root(); }
  /// Record holding `t`'s bytes (kNotFound naming the key if absent; never for validated ones).
  const StorageRecord& record(const TensorInfo& t) const;
  /// Absolute byte offset of element 0 of `t` (record offset + storage_offset * itemsize).
  uint64_t tensor_data_offset(const TensorInfo& t) const;
};

/// Opens a torch.save archive: reads the ZIP directory and `<prefix>/data.pkl` (checking its CRC),
/// parses it, checks `byteorder` (kUnsupported unless "little"), and checks every tensor's element
/// range [storage_offset, storage_offset + extent) * itemsize lies inside its `data/<key>` record
/// (kDataLoss naming file, storage key and tensor path). Never reads tensor bytes. Legacy
/// (pre-1.6) files throw kUnsupported; non-torch files kInvalidArgument.
TorchArchive open_torch_archive(const ByteSource& src, const std::string& display_path,
                                const PickleLimits& limits = {});

/// Convenience: FileSource(path) + open_torch_archive(source, path).
TorchArchive open_torch_file(const std::string& path, const PickleLimits& limits = {});

/// Python-like string literal for a key in paths/messages: "name" with escapes.
std::string quote_key(const PyValue& key);

}  // namespace reshard::pt
