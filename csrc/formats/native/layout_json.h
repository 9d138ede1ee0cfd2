// Layout, model config and non-tensor state <-> JSON, as stored in a native step folder's
// metadata.json (docs/format.md). Readers name the offending field and file:
//   Error(kDataLoss, "<file>: field 'pieces[3].len': expected an array of integers").
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/layout.h"

namespace reshard::native {

using nlohmann::json;

/// Read-only view of a JSON value that knows its path, for precise errors.
class Field {
 public:
  Field(const json& j, std::string path, const std::string& file) : j_(j), path_(std::move(path)), file_(file) {}
  const json& raw() const { return j_; }
  const std::string& path() const { return path_; }
  bool has(const std::string& key) const { return j_.is_object() && j_.contains(key); }
  Field operator[](const std::string& key) const;  // kDataLoss when missing
  Field operator[](size_t i) const;
  size_t size() const;  // array length (kDataLoss if not an array)
  std::string str() const;
  int64_t i64() const;
  double f64() const;
  bool boolean() const;
  std::vector<int64_t> i64s() const;
  [[noreturn]] void bad(const std::string& why) const;

 private:
  const json& j_;
  std::string path_;
  const std::string& file_;
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

json state_to_json(const NonTensorState& s);
NonTensorState state_from_json(const Field& f);

std::string base64_encode(const std::string& bytes);
std::string base64_decode(const std::string& text, const Field& where);

/// Element span of a piece in its buffer: [base, base + span) (positive strides; the span equals
/// the box's numel for the contiguous pieces our layouts produce).
int64_t piece_span(const Piece& p);

}  // namespace reshard::native
