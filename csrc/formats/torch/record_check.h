// The checksum check of one zip storage record (a DeepSpeed or DCP torch.save archive): its bytes
// against the CRC-32 the zip directory stores. Header-only; used by the readers (library layer),
// never by the parsers themselves.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/torch_archive.h"

namespace reshard::pt {

/// A RangeCheck of bytes [offset, offset + length) of the file `path` against `want` (the
/// record's zip CRC-32, PKWARE APPNOTE). finish() is empty when they match, else
/// "<path>: bytes [a, b) fail the zip CRC-32<what> (stored x, computed y)".
inline std::unique_ptr<RangeCheck> zip_record_check(std::string path, uint64_t offset, uint64_t length, uint32_t want,
                                                    std::string what = "") {
  struct Check final : RangeCheck {
    std::string path, what;
    uint64_t offset = 0, length = 0;
    uint32_t want = 0, crc = 0;
    void update(const void* data, size_t n) override { crc = zip_crc32(data, n, crc); }
    std::string finish() override {
      if (crc == want) return {};
      std::ostringstream os;
      os << path << ": bytes [" << offset << ", " << offset + length << ") fail the zip CRC-32" << what << " (stored "
         << std::hex << want << ", computed " << crc << ")";
      return os.str();
    }
  };
  auto c = std::make_unique<Check>();
  c->path = std::move(path);
  c->what = std::move(what);
  c->offset = offset, c->length = length, c->want = want;
  return c;
}

/// The storage records of a reader's files: per file index, record offset -> (length, CRC-32).
using ZipRecords = std::vector<std::map<uint64_t, std::pair<uint64_t, uint32_t>>>;

/// Whether [offset, offset + length) of file `file` is exactly one record (has_checksum).
inline bool zip_records_have(const ZipRecords& r, int32_t file, uint64_t offset, uint64_t length) {
  if (file < 0 || size_t(file) >= r.size()) return false;
  auto it = r[size_t(file)].find(offset);
  return it != r[size_t(file)].end() && it->second.first == length;
}

/// Every record as a checksum unit, in file and offset order (checksum_units).
inline std::vector<ChecksumUnit> zip_record_units(const ZipRecords& r) {
  std::vector<ChecksumUnit> out;
  for (size_t f = 0; f < r.size(); ++f)
    for (const auto& [off, rec] : r[f]) out.push_back({int32_t(f), off, rec.first});
  return out;
}

}  // namespace reshard::pt
