// Layout, model config and non-tensor state <-> JSON, as stored in a native step folder's
// metadata.json (docs/format.md). Readers name the offending field and file:
//   Error(kDataLoss, "<file>: field 'pieces[3].len': expected an array of integers").
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <simdjson.h>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/layout.h"

namespace reshard::native {

/// Writing: nlohmann-json (layout_to_json and friends build documents with it).
using nlohmann::json;

/// Read-only view of a JSON value that knows its path, for precise errors. Reading goes through
/// simdjson's DOM (a tape parsed at about 1 GB/s; nlohmann's DOM parsed the 300 KB metadata of an
/// 8-layer GPT in 3 ms, which every rank of a load paid). A Field points into the JsonDoc that
/// parsed it: keep the document alive while its Fields are used.
class Field {
 public:
  /// The root of a document (path "").
  Field(simdjson::dom::element e, const std::string& file) : e_(e), file_(file) {}
  /// The field's path ("pieces[3].len"; "" for the root), for messages. Built when asked: the
  /// reader built one for every value it read of a 300 KB metadata.json (17,237 values in the 2 GB
  /// benchmark's); making paths lazy, with integer lists read without a Field per element, took
  /// that open from 3.7 to 2.7 ms of CPU, which every rank of a load pays.
  std::string path() const;
  bool is_object() const { return e_.type() == simdjson::dom::element_type::OBJECT; }
  bool has(std::string_view key) const;  // false also when this is not an object
  Field operator[](std::string_view key) const;  // kDataLoss when missing or not an object
  /// Every array element, in order (kDataLoss if not an array).
  std::vector<Field> items() const;
  /// Every object member (key, value), in the document's order (kDataLoss if not an object).
  std::vector<std::pair<std::string, Field>> members() const;
  size_t size() const;  // array length (kDataLoss if not an array)
  std::string str() const;
  int64_t i64() const;
  double f64() const;
  bool boolean() const;
  std::vector<int64_t> i64s() const;
  /// The value as compact JSON text (object members in the document's order).
  std::string minified() const;
  [[noreturn]] void bad(const std::string& why) const;

 private:
  // Where a Field is: a member (key) or array element (index) of the Field at `up`; the root
  // has no `up`. Made for a Field when it gets its first child, shared by its children.
  struct Node {
    std::shared_ptr<const Node> up;
    std::string_view key;  // points into the JsonDoc
    int64_t index;         // >= 0 for an array element
  };
  static std::string path_of(const Node* up, std::string_view key, int64_t index);
  Field(simdjson::dom::element e, std::shared_ptr<const Node> up, std::string_view key, int64_t index,
        const std::string& file)
      : e_(e), up_(std::move(up)), key_(key), index_(index), file_(file) {}
  const std::shared_ptr<const Node>& node() const;

  simdjson::dom::element e_;
  std::shared_ptr<const Node> up_;  // nullptr: the root
  std::string_view key_;
  int64_t index_ = -1;
  mutable std::shared_ptr<const Node> node_;
  const std::string& file_;
};

/// One parsed JSON text, named `file` in errors. Not copyable or movable: its Fields point into it.
class JsonDoc {
 public:
  /// Throws Error(kDataLoss, "<file> is not valid JSON: <what and where>"); the where (line,
  /// column) comes from re-parsing a failed text with nlohmann-json, which reports it.
  JsonDoc(std::string_view text, std::string file);
  JsonDoc(const JsonDoc&) = delete;
  JsonDoc& operator=(const JsonDoc&) = delete;
  Field root() const { return Field(root_, file_); }

 private:
  simdjson::dom::parser parser_;
  simdjson::dom::element root_;
  std::string file_;
};

json model_to_json(const ModelConfig& m);
ModelConfig model_from_json(const Field& f);

/// `checksums`: one per piece (hex xxh3-64), or empty to leave them out.
json layout_to_json(const Layout& L, const std::vector<std::string>& buffer_files,
                    const std::vector<std::string>& checksums);
/// Parses the layout fields of a metadata object and checks its internal consistency (indices,
/// pieces inside their buffers and arrays). Returns per buffer the data file name and per piece the
/// checksum ("" when absent).
Layout layout_from_json(const Field& meta, std::vector<std::string>* buffer_files, std::vector<std::string>* checksums);

/// A digest of everything a layout says (topology, model, tensors, arrays, buffers, every piece's
/// box, base and strides, flat groups) as 16 lowercase hex digits of xxh3-64 over a fixed binary
/// form; the model enters as its metadata JSON text. The writer records it in every data file's
/// __metadata__ (`layout`), the reader recomputes it from the parsed metadata.json and refuses a
/// difference: an edit of metadata.json (a piece's strides or offsets, consistently swapped labels)
/// keeps every stored checksum valid, and only this says the file was changed (format.md §2).
std::string layout_digest(const Layout& L);

json state_to_json(const NonTensorState& s);
NonTensorState state_from_json(const Field& f);

/// metadata.json's contents, parsed and checked for internal consistency: everything a native
/// reader learns before it opens a data file (docs/format.md).
struct Metadata {
  Layout layout;
  NonTensorState state;
  std::vector<std::string> buffer_files;  ///< per buffer: its data file's name
  std::vector<int> buffer_file;           ///< per buffer: its index in `files`
  std::vector<std::string> checksums;     ///< per piece: xxh3-64 as 16 lowercase hex digits
  std::vector<std::pair<std::string, int64_t>> files;  ///< data files: plain rank file name, bytes
  std::string save;  ///< the save's id ("" in files written before it was recorded); format.md §3
};
/// Parses a metadata.json text named `path` in errors: kDataLoss for text that is not JSON or a
/// field that is missing, mistyped or inconsistent; kUnsupported for a format_version newer than
/// this reader; kInvalidArgument for a data file name that is not a plain rank_NNNNN.safetensors
/// (no path may leave the step folder). The reader and the fuzz target (tests/fuzz) share it.
Metadata parse_metadata(std::string_view text, const std::string& path);

/// True for plain names rank_<5 or more digits>.safetensors (no '/', no "..").
bool is_rank_file_name(const std::string& name);

std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text, const Field& where);

/// Element span of a piece in its buffer: [base, base + span) (positive strides; the span equals
/// the box's numel for the contiguous pieces our layouts produce).
int64_t piece_span(const Piece& p);

}  // namespace reshard::native
