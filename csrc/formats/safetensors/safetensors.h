// safetensors: header parser and header builder. Pure (no file I/O): callers read the bytes.
//
// Format [safetensors README "Format"; safetensors/src/tensor.rs, commit 24b0b285]:
//   8 bytes   N, little-endian u64: length of the header
//   N bytes   UTF-8 JSON object starting with '{', possibly right-padded with spaces (0x20);
//             the reference writer pads to a multiple of 8 so that the data starts aligned
//   rest      the byte buffer; each tensor's data_offsets [begin, end) are relative to its start
// Header: name -> {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]} and optionally
// "__metadata__": {string: string}. No duplicate names; the offsets, sorted, tile the buffer
// exactly (no holes, no overlap); end - begin = numel * dtype size; header at most 100 MB
// (MAX_HEADER_SIZE in tensor.rs).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reshard/dtype.h"

namespace reshard::safetensors {

constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct TensorInfo {
  std::string dtype;                 // safetensors dtype string as written ("F32", "BF16", "F8_E4M3")
  std::optional<DType> rtype;        // the reshard dtype when reshard handles it
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;       // data_offsets, relative to the byte buffer
  int64_t numel() const;
};

struct Header {
  uint64_t header_size = 0;          // N
  uint64_t data_start = 0;           // 8 + N: file offset of the byte buffer
  uint64_t buffer_size = 0;          // bytes the tensors tile (max end)
  std::map<std::string, TensorInfo> tensors;
  std::map<std::string, std::string> metadata;  // __metadata__
};

/// Bits per element of a safetensors dtype string (F4 -> 4, F6_E2M3 -> 6, F32 -> 32); 0 when the
/// string is not a safetensors dtype.
int dtype_bits(const std::string& dtype);

/// Reads N from the first 8 bytes. Error(kDataLoss) when N exceeds kMaxHeaderSize or `file_size`
/// (pass UINT64_MAX when unknown) cannot hold 8 + N bytes. `what` names the file in messages.
uint64_t parse_header_size(const uint8_t prefix[8], uint64_t file_size, const std::string& what);

/// Parses and validates the N header bytes (the JSON, after the 8-byte length). Every problem is
/// Error(kDataLoss) naming `what`, the tensor and the field. The buffer's extent against the file
/// size is the caller's check (data_start + buffer_size <= file size).
Header parse_header(std::string_view json, const std::string& what);

/// One tensor to write: its bytes follow the previous tensor's.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
};

/// Builds the 8-byte length + JSON header (space-padded so that 8 + N is a multiple of 8) for
/// tensors stored in the given order, back to back from buffer offset 0. Returns the header bytes;
/// `offsets` (if given) receives each tensor's [begin, end) in the buffer. Error(kInvalidArgument)
/// on a duplicate or empty name or a name starting with "__".
std::string build_header(const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         std::vector<std::pair<uint64_t, uint64_t>>* offsets = nullptr);

}  // namespace reshard::safetensors
