// ZIP central-directory reader for torch.save archives (stored entries only).
// Structure layouts follow the PKWARE APPNOTE (end of central directory, ZIP64 locator/record,
// central file header, local file header); torch specifics in formats.md section 5.1.
#include <algorithm>
#include <cstring>
#include <unordered_set>
#include <vector>

#if defined(RESHARD_HAVE_LIBDEFLATE)
#include <libdeflate.h>
#elif defined(RESHARD_HAVE_ZLIB)
#include <zlib.h>
#endif

#include "reshard/error.h"
#include "reshard/torch_archive.h"

namespace reshard::pt {
namespace {

constexpr uint32_t kLocalSig = 0x04034b50;    // PK\3\4
constexpr uint32_t kCentralSig = 0x02014b50;  // PK\1\2
constexpr uint32_t kEocdSig = 0x06054b50;     // PK\5\6
constexpr uint32_t kZip64EocdSig = 0x06064b50;     // PK\6\6
constexpr uint32_t kZip64LocatorSig = 0x07064b50;  // PK\6\7
constexpr size_t kEocdSize = 22, kLocatorSize = 20, kZip64EocdSize = 56;
constexpr size_t kCentralSize = 46, kLocalSize = 30;

uint16_t u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }
uint32_t u32(const uint8_t* p) {
  return uint32_t(p[0]) | (uint32_t(p[1]) << 8) | (uint32_t(p[2]) << 16) | (uint32_t(p[3]) << 24);
}
uint64_t u64(const uint8_t* p) { return uint64_t(u32(p)) | (uint64_t(u32(p + 4)) << 32); }

}  // namespace

uint32_t zip_crc32(const void* data, size_t n, uint32_t crc) {
#if defined(RESHARD_HAVE_LIBDEFLATE)
  return libdeflate_crc32(crc, data, n);
#elif defined(RESHARD_HAVE_ZLIB)
  return uint32_t(crc32_z(uLong(crc), static_cast<const Bytef*>(data), z_size_t(n)));
#else
  static const auto table = [] {
    std::vector<uint32_t> t(256);
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return ~crc;
#endif
}

const ZipEntry* ZipDirectory::find(std::string_view name) const {
  for (const auto& e : entries)
    if (e.name == name) return &e;
  return nullptr;
}

ZipDirectory read_zip_directory(const ByteSource& src, const std::string& path) {
  const uint64_t size = src.size();
  ZipDirectory dir;

  // ---- end of central directory: last 64 KiB comment + 22 bytes ----
  if (size < kEocdSize) {
    bool pk = false;
    if (size >= 4) {
      uint8_t m[4];
      src.read(0, 4, m);
      pk = u32(m) == kLocalSig;
    }
    fail(pk ? ErrorCode::kDataLoss : ErrorCode::kInvalidArgument, path, ": ",
         pk ? "truncated ZIP archive" : "not a ZIP archive", " (", size, " bytes)");
  }
  const uint64_t tail_len = std::min<uint64_t>(size, 0xFFFF + kEocdSize);
  const uint64_t tail_start = size - tail_len;
  std::vector<uint8_t> tail(tail_len);
  src.read(tail_start, tail_len, tail.data());
  int64_t eocd_rel = -1;
  bool saw_sig = false;
  for (int64_t i = int64_t(tail_len - kEocdSize); i >= 0; --i) {
    const uint8_t* p = tail.data() + i;
    if (u32(p) != kEocdSig) continue;
    saw_sig = true;
    if (uint64_t(i) + kEocdSize + u16(p + 20) == tail_len) {
      eocd_rel = i;
      break;
    }
  }
  if (eocd_rel < 0) {
    uint8_t m[4];
    src.read(0, 4, m);
    bool pk = u32(m) == kLocalSig;
    fail(pk || saw_sig ? ErrorCode::kDataLoss : ErrorCode::kInvalidArgument, path, ": ",
         pk || saw_sig ? "truncated or corrupt ZIP archive: no valid end-of-central-directory record"
                       : "not a ZIP archive (no end-of-central-directory record)");
  }
  const uint64_t eocd_pos = tail_start + uint64_t(eocd_rel);
  const uint8_t* e = tail.data() + eocd_rel;
  uint64_t n_entries = u16(e + 10);
  uint64_t cd_size = u32(e + 12);
  uint64_t cd_offset = u32(e + 16);
  if (u16(e + 4) != 0 || u16(e + 6) != 0 || u16(e + 8) != u16(e + 10))
    fail(ErrorCode::kUnsupported, path, ": multi-disk ZIP archives are not supported");
  uint64_t cd_limit = eocd_pos;  // the central directory must end before this

  // ---- ZIP64 locator + record ----
  if (eocd_pos >= kLocatorSize) {
    uint8_t loc[kLocatorSize];
    src.read(eocd_pos - kLocatorSize, kLocatorSize, loc);
    if (u32(loc) == kZip64LocatorSig) {
      uint64_t rec = u64(loc + 8);
      if (rec > eocd_pos - kLocatorSize || eocd_pos - kLocatorSize - rec < kZip64EocdSize)
        fail(ErrorCode::kDataLoss, path, ": ZIP64 end-of-central-directory offset ", rec,
             " is out of range (file has ", size, " bytes)");
      uint8_t r[kZip64EocdSize];
      src.read(rec, kZip64EocdSize, r);
      if (u32(r) != kZip64EocdSig)
        fail(ErrorCode::kDataLoss, path, ": bad ZIP64 end-of-central-directory signature at offset ",
             rec);
      if (u32(r + 16) != 0 || u32(r + 20) != 0 || u64(r + 24) != u64(r + 32))
        fail(ErrorCode::kUnsupported, path, ": multi-disk ZIP archives are not supported");
      n_entries = u64(r + 32);
      cd_size = u64(r + 40);
      cd_offset = u64(r + 48);
      cd_limit = rec;
      dir.zip64 = true;
    }
  }
  if (cd_offset > cd_limit || cd_size > cd_limit - cd_offset)
    fail(ErrorCode::kDataLoss, path, ": central directory [", cd_offset, ", +", cd_size,
         ") lies outside the file (it must end by offset ", cd_limit, " of ", size, " bytes)");
  if (n_entries > cd_size / kCentralSize)
    fail(ErrorCode::kDataLoss, path, ": central directory of ", cd_size, " bytes cannot hold ",
         n_entries, " entries");
  dir.cd_offset = cd_offset;
  dir.cd_size = cd_size;

  std::vector<uint8_t> cd(cd_size);
  src.read(cd_offset, cd_size, cd.data());
  dir.entries.reserve(size_t(n_entries));
  std::unordered_set<std::string> seen;
  uint64_t pos = 0;
  for (uint64_t i = 0; i < n_entries; ++i) {
    if (cd_size - pos < kCentralSize)
      fail(ErrorCode::kDataLoss, path, ": central directory truncated at entry ", i);
    const uint8_t* c = cd.data() + pos;
    if (u32(c) != kCentralSig)
      fail(ErrorCode::kDataLoss, path, ": bad central directory signature for entry ", i,
           " at offset ", cd_offset + pos);
    ZipEntry z;
    z.flags = u16(c + 8);
    z.method = u16(c + 10);
    z.crc32 = u32(c + 16);
    z.compressed_size = u32(c + 20);
    z.uncompressed_size = u32(c + 24);
    const uint16_t name_len = u16(c + 28), extra_len = u16(c + 30), comment_len = u16(c + 32);
    const uint16_t disk = u16(c + 34);
    z.local_header_offset = u32(c + 42);
    const uint64_t var = uint64_t(name_len) + extra_len + comment_len;
    if (cd_size - pos - kCentralSize < var)
      fail(ErrorCode::kDataLoss, path, ": central directory truncated in entry ", i);
    z.name.assign(reinterpret_cast<const char*>(c + kCentralSize), name_len);
    // ZIP64 extended information extra field (id 0x0001): fields present only for those whose
    // 32-bit value is saturated, in the order usize, csize, local offset, disk.
    const uint8_t* x = c + kCentralSize + name_len;
    for (size_t off = 0; off + 4 <= extra_len;) {
      uint16_t id = u16(x + off), len = u16(x + off + 2);
      if (off + 4 + len > extra_len)
        fail(ErrorCode::kDataLoss, path, ": entry '", z.name, "': extra field overruns its area");
      if (id == 0x0001) {
        const uint8_t* f = x + off + 4;
        size_t avail = len, k = 0;
        auto take = [&](uint64_t& v) {
          if (avail - k < 8)
            fail(ErrorCode::kDataLoss, path, ": entry '", z.name, "': ZIP64 extra field too short");
          v = u64(f + k);
          k += 8;
        };
        if (z.uncompressed_size == 0xFFFFFFFFu) take(z.uncompressed_size);
        if (z.compressed_size == 0xFFFFFFFFu) take(z.compressed_size);
        if (z.local_header_offset == 0xFFFFFFFFu) take(z.local_header_offset);
      }
      off += 4 + size_t(len);
    }
    pos += kCentralSize + var;
    if (disk != 0 && disk != 0xFFFF)
      fail(ErrorCode::kUnsupported, path, ": entry '", z.name, "' is on another disk");
    if (z.flags & 0x1)
      fail(ErrorCode::kUnsupported, path, ": entry '", z.name, "' is encrypted");
    if (z.method != 0)
      fail(ErrorCode::kUnsupported, path, ": entry '", z.name, "' is compressed (method ",
           z.method, "); torch.save writes stored entries only");
    if (z.compressed_size != z.uncompressed_size)
      fail(ErrorCode::kDataLoss, path, ": stored entry '", z.name, "' has compressed size ",
           z.compressed_size, " != uncompressed size ", z.uncompressed_size);
    if (!seen.insert(z.name).second)
      fail(ErrorCode::kDataLoss, path, ": duplicate ZIP entry '", z.name, "'");

    // Local header: only its name/extra lengths matter (sizes there are zero for torch files).
    if (z.local_header_offset > cd_offset || cd_offset - z.local_header_offset < kLocalSize)
      fail(ErrorCode::kDataLoss, path, ": entry '", z.name, "': local header offset ",
           z.local_header_offset, " is outside the data area (central directory at ", cd_offset,
           ")");
    uint8_t l[kLocalSize];
    src.read(z.local_header_offset, kLocalSize, l);
    if (u32(l) != kLocalSig)
      fail(ErrorCode::kDataLoss, path, ": entry '", z.name, "': bad local header signature at offset ",
           z.local_header_offset);
    const uint64_t lname = u16(l + 26), lextra = u16(l + 28);
    z.data_offset = z.local_header_offset + kLocalSize + lname + lextra;
    if (z.data_offset > cd_offset || z.compressed_size > cd_offset - z.data_offset)
      fail(ErrorCode::kDataLoss, path, ": entry '", z.name, "': data [", z.data_offset, ", +",
           z.compressed_size, ") overruns the data area (central directory at ", cd_offset, ")");
    if (lname != name_len)
      fail(ErrorCode::kDataLoss, path, ": entry '", z.name,
           "': local header name length differs from the central directory");
    std::string lname_s(name_len, '\0');
    src.read(z.local_header_offset + kLocalSize, name_len, lname_s.data());
    if (lname_s != z.name)
      fail(ErrorCode::kDataLoss, path, ": entry '", z.name,
           "': local header names a different file");
    dir.entries.push_back(std::move(z));
  }
  return dir;
}

}  // namespace reshard::pt
