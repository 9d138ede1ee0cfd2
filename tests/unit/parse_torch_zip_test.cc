// ZIP directory reader and archive-level checks on synthetic archives (built here, in memory).
// Layouts per PKWARE APPNOTE; torch conventions per formats.md section 5.1.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "reshard/error.h"
#include "reshard/torch_archive.h"
#include "unit/test_util.h"

namespace reshard::pt {
namespace {

using namespace std::string_literals;

void put16(std::string& s, uint32_t v) { s += char(v & 0xFF); s += char((v >> 8) & 0xFF); }
void put32(std::string& s, uint32_t v) { for (int i = 0; i < 4; ++i) s += char((v >> (8 * i)) & 0xFF); }
void put64(std::string& s, uint64_t v) { for (int i = 0; i < 8; ++i) s += char((v >> (8 * i)) & 0xFF); }
void set32(std::string& s, size_t at, uint32_t v) { for (int i = 0; i < 4; ++i) s[at + i] = char((v >> (8 * i)) & 0xFF); }
void set64(std::string& s, size_t at, uint64_t v) { for (int i = 0; i < 8; ++i) s[at + i] = char((v >> (8 * i)) & 0xFF); }

struct In {
  std::string name, data;
  uint16_t method = 0;
  bool zip64_extra = false;  // saturate 32-bit fields in the CD and give them in extra 0x0001
};
struct Opts {
  bool zip64 = true;   // torch always finalizes with a ZIP64 EOCD record
  bool align = true;   // 64-byte aligned data via an "FB" padding extra field
  std::string comment;
};

// A torch-like ZIP: local headers with zero sizes and flags 0x0808, sizes in the CD only.
std::string build_zip(const std::vector<In>& ins, const Opts& o = {}) {
  std::string z;
  std::vector<uint64_t> offs;
  for (const In& in : ins) {
    offs.push_back(z.size());
    put32(z, 0x04034b50);
    put16(z, 20); put16(z, 0x0808); put16(z, in.method); put16(z, 0); put16(z, 0);
    put32(z, 0); put32(z, 0); put32(z, 0);
    put16(z, uint32_t(in.name.size()));
    size_t pad = 0;
    if (o.align) {
      size_t start = z.size() + 2 + in.name.size() + 4;
      pad = (64 - start % 64) % 64;
    }
    put16(z, o.align ? uint32_t(pad + 4) : 0);
    z += in.name;
    if (o.align) { z += "FB"; put16(z, uint32_t(pad)); z += std::string(pad, 'Z'); }
    z += in.data;
  }
  const uint64_t cd_off = z.size();
  for (size_t i = 0; i < ins.size(); ++i) {
    const In& in = ins[i];
    put32(z, 0x02014b50);
    put16(z, 45); put16(z, 45); put16(z, 0x0808); put16(z, in.method); put16(z, 0); put16(z, 0);
    put32(z, zip_crc32(in.data.data(), in.data.size()));
    std::string extra;
    if (in.zip64_extra) {
      put32(z, 0xFFFFFFFF); put32(z, 0xFFFFFFFF);
      put16(extra, 1); put16(extra, 24);
      put64(extra, in.data.size()); put64(extra, in.data.size()); put64(extra, offs[i]);
    } else {
      put32(z, uint32_t(in.data.size())); put32(z, uint32_t(in.data.size()));
    }
    put16(z, uint32_t(in.name.size())); put16(z, uint32_t(extra.size())); put16(z, 0);
    put16(z, 0); put16(z, 0); put32(z, 0);
    put32(z, in.zip64_extra ? 0xFFFFFFFF : uint32_t(offs[i]));
    z += in.name;
    z += extra;
  }
  const uint64_t cd_size = z.size() - cd_off;
  if (o.zip64) {
    const uint64_t rec = z.size();
    put32(z, 0x06064b50); put64(z, 44); put16(z, 45); put16(z, 45); put32(z, 0); put32(z, 0);
    put64(z, ins.size()); put64(z, ins.size()); put64(z, cd_size); put64(z, cd_off);
    put32(z, 0x07064b50); put32(z, 0); put64(z, rec); put32(z, 1);
  }
  put32(z, 0x06054b50); put16(z, 0); put16(z, 0);
  put16(z, uint32_t(ins.size())); put16(z, uint32_t(ins.size()));
  put32(z, uint32_t(cd_size)); put32(z, uint32_t(cd_off));
  put16(z, uint32_t(o.comment.size()));
  z += o.comment;
  return z;
}

template <typename F>
Error expect_error(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e;
  }
  ADD_FAILURE() << "expected reshard::Error";
  return Error(ErrorCode::kInternal, "no error");
}

bool has(const Error& e, const std::string& s) {
  return std::string(e.what()).find(s) != std::string::npos;
}

// ---- pickle snippets (protocol 2) ----
std::string u32s(uint32_t v) { std::string s; put32(s, v); return s; }
std::string pstr(const std::string& s) { return "X" + u32s(uint32_t(s.size())) + s; }
std::string pglobal(const std::string& m, const std::string& n) { return "c" + m + "\n" + n + "\n"; }
std::string pint(int32_t v) { return "J" + u32s(uint32_t(v)); }
// _rebuild_tensor_v2(('storage', torch.<cls>, key, 'cpu', numel), offset, shape, stride, False, OrderedDict())
std::string ptensor(const std::string& cls, const std::string& key, int numel, int offset,
                    const std::vector<int>& shape, const std::vector<int>& stride) {
  std::string s = pglobal("torch._utils", "_rebuild_tensor_v2") + "(";
  s += "(" + pstr("storage") + pglobal("torch", cls) + pstr(key) + pstr("cpu") + pint(numel) + "tQ";
  s += pint(offset) + "(";
  for (int x : shape) s += pint(x);
  s += "t(";
  for (int x : stride) s += pint(x);
  s += "t\x89" + pglobal("collections", "OrderedDict") + ")Rt" + "R";
  return s;
}
std::string pdict1(const std::string& key, const std::string& value) {
  return "\x80\x02}" + pstr(key) + value + "s.";
}

TEST(ParseTorchZip, ReadsTorchLikeArchive) {
  for (bool zip64 : {true, false}) {
    for (bool align : {true, false}) {
      std::vector<In> ins = {{"arch/data.pkl", "pickle-bytes"}, {"arch/data/0", std::string(100, 'x')},
                             {"arch/version", "3\n"}, {"arch/data/1", ""}};
      std::string z = build_zip(ins, {zip64, align, ""});
      MemorySource src(z);
      ZipDirectory d = read_zip_directory(src, "a.pt");
      EXPECT_EQ(d.zip64, zip64);
      ASSERT_EQ(d.entries.size(), 4u);
      for (size_t i = 0; i < ins.size(); ++i) {
        const ZipEntry& e = d.entries[i];
        EXPECT_EQ(e.name, ins[i].name);
        EXPECT_EQ(e.uncompressed_size, ins[i].data.size());
        EXPECT_EQ(z.substr(e.data_offset, e.uncompressed_size), ins[i].data);
        EXPECT_EQ(e.crc32, zip_crc32(ins[i].data.data(), ins[i].data.size()));
        if (align) {
          EXPECT_EQ(e.data_offset % 64, 0u);
        }
      }
      ASSERT_NE(d.find("arch/data/0"), nullptr);
      EXPECT_EQ(d.find("arch/data/0")->uncompressed_size, 100u);
      EXPECT_EQ(d.find("nope"), nullptr);
    }
  }
}

TEST(ParseTorchZip, CrcMatchesKnownValue) {
  EXPECT_EQ(zip_crc32("123456789", 9), 0xCBF43926u);  // the CRC-32 check value
}

TEST(ParseTorchZip, CommentAndZip64ExtraField) {
  std::vector<In> ins = {{"p/data.pkl", "abc", 0, true}, {"p/data/0", "0123456789", 0, true}};
  std::string z = build_zip(ins, {true, true, "a trailing comment PK\x05\x06 inside"});
  MemorySource src(z);
  ZipDirectory d = read_zip_directory(src, "c.pt");
  ASSERT_EQ(d.entries.size(), 2u);
  EXPECT_EQ(d.entries[1].uncompressed_size, 10u);
  EXPECT_EQ(z.substr(d.entries[1].data_offset, 10), "0123456789");
}

TEST(ParseTorchZip, RejectsCompressedEntryNamingIt) {
  std::string z = build_zip({{"p/data.pkl", "abc"}, {"p/data/0", "zz", 8}});
  MemorySource src(z);
  Error e = expect_error([&] { read_zip_directory(src, "comp.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(has(e, "comp.pt") && has(e, "p/data/0") && has(e, "compressed")) << e.what();
}

TEST(ParseTorchZip, CentralDirectoryPastEofIsDataLoss) {
  for (bool zip64 : {true, false}) {
    std::string z = build_zip({{"p/data.pkl", "abc"}}, {zip64, true, ""});
    const size_t eocd = z.size() - 22;
    if (zip64) {
      size_t rec = z.rfind("PK\x06\x06");
      set64(z, rec + 48, z.size() + 1000);  // ZIP64 record's cd offset
    } else {
      set32(z, eocd + 16, uint32_t(z.size() + 1000));
    }
    MemorySource src(z);
    Error e = expect_error([&] { read_zip_directory(src, "cdpast.pt"); });
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_TRUE(has(e, "cdpast.pt") && has(e, "central directory")) << e.what();
  }
  // a huge entry count
  std::string z = build_zip({{"p/data.pkl", "abc"}}, {false, true, ""});
  set32(z, z.size() - 22 + 8, 0xFFFF0000u | 0xFFFF);  // this+total entries = 0xFFFF
  MemorySource src(z);
  EXPECT_EQ(expect_error([&] { read_zip_directory(src, "n.pt"); }).code(), ErrorCode::kDataLoss);
}

TEST(ParseTorchZip, BadLocalHeaderOffsetsAreDataLoss) {
  std::vector<In> ins = {{"p/data.pkl", "abc", 0, true}};
  std::string z = build_zip(ins);
  size_t x = z.find("p/data.pkl", z.find("PK\x01\x02")) + 10;  // the CD extra field
  set64(z, x + 4 + 16, uint64_t(1) << 40);  // local header offset in the ZIP64 extra
  MemorySource src(z);
  Error e = expect_error([&] { read_zip_directory(src, "lho.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, "lho.pt") && has(e, "p/data.pkl")) << e.what();
  // size in the extra field that runs past the data area
  z = build_zip(ins);
  set64(z, x + 4, 1u << 20);
  set64(z, x + 12, 1u << 20);
  MemorySource src2(z);
  e = expect_error([&] { read_zip_directory(src2, "size.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, "overruns")) << e.what();
}

TEST(ParseTorchZip, NotAZipAndTruncation) {
  MemorySource empty("", 0);
  EXPECT_EQ(expect_error([&] { read_zip_directory(empty, "e.pt"); }).code(), ErrorCode::kInvalidArgument);
  std::string junk(1000, 'j');
  MemorySource js(junk);
  Error e = expect_error([&] { read_zip_directory(js, "junk.bin"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(has(e, "junk.bin"));

  std::string z = build_zip({{"p/data.pkl", "\x80\x02N."}, {"p/data/0", std::string(300, 'q')},
                             {"p/byteorder", "little"}});
  for (size_t cut = 0; cut < z.size(); ++cut) {
    MemorySource src(z.data(), cut);
    Error e2 = expect_error([&] { open_torch_archive(src, "cut.pt"); });
    EXPECT_TRUE(has(e2, "cut.pt")) << cut << ": " << e2.what();
    if (cut >= 4) {
      EXPECT_EQ(e2.code(), ErrorCode::kDataLoss) << cut << ": " << e2.what();
    }
  }
}

TEST(ParseTorchZip, RandomCorruptionNeverCrashes) {
  uint64_t seed = testing::test_seed("ParseTorchZip.RandomCorruptionNeverCrashes");
  std::mt19937_64 rng(seed);
  std::string base = build_zip({{"p/data.pkl", pdict1("w", ptensor("FloatStorage", "0", 4, 0, {4}, {1}))},
                                {"p/data/0", std::string(16, '\x01')}, {"p/version", "3\n"}});
  int ok = 0;
  for (int iter = 0; iter < 5000; ++iter) {
    std::string z = base;
    int flips = 1 + int(rng() % 4);
    for (int f = 0; f < flips; ++f) z[rng() % z.size()] = char(rng() & 0xFF);
    MemorySource src(z);
    try {
      TorchArchive a = open_torch_archive(src, "flip.pt");
      (void)a.root().to_json().dump();
      ++ok;
    } catch (const Error& e) {
      ASSERT_TRUE(has(e, "flip.pt")) << e.what();
    }
  }
  std::printf("corrupted archives still readable: %d / 5000\n", ok);
}

// ---- archive-level checks on synthetic archives ----

TEST(ParseTorchArchive, SyntheticTensorAndRecords) {
  std::string pkl = pdict1("w", ptensor("FloatStorage", "0", 6, 1, {2, 2}, {1, 2}));
  std::string data(24, '\0');
  for (int i = 0; i < 6; ++i) { float f = float(i) * 1.5f; std::memcpy(&data[size_t(i) * 4], &f, 4); }
  std::string z = build_zip({{"weird.name/data.pkl", pkl}, {"weird.name/byteorder", "little"},
                             {"weird.name/data/0", data}, {"weird.name/version", "3\n"}});
  MemorySource src(z);
  TorchArchive a = open_torch_archive(src, "syn.pt");
  EXPECT_EQ(a.prefix, "weird.name");
  EXPECT_EQ(a.version, "3");
  EXPECT_EQ(a.byteorder, "little");
  ASSERT_EQ(a.tensors.size(), 1u);
  EXPECT_EQ(a.tensors[0].path, "[\"w\"]");
  const TensorInfo& t = a.tensors[0].value->as_tensor();
  const StorageRecord& r = a.record(t);
  EXPECT_EQ(r.length, 24u);
  EXPECT_EQ(r.offset % 64, 0u);
  // element [1][1] = storage[1 + 1*1 + 1*2] = 4 * 1.5
  float f;
  src.read(a.tensor_data_offset(t) + uint64_t(1 * 1 + 1 * 2) * 4, 4, &f);
  EXPECT_FLOAT_EQ(f, 6.0f);
}

TEST(ParseTorchArchive, TensorOverrunningStorageIsDataLoss) {
  // storage declares 4 floats, record holds 16 bytes, tensor needs 5 elements
  std::string z = build_zip({{"a/data.pkl", pdict1("layer.w", ptensor("FloatStorage", "7", 4, 0, {5}, {1}))},
                             {"a/data/7", std::string(16, '\0')}});
  MemorySource src(z);
  Error e = expect_error([&] { open_torch_archive(src, "over.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, "over.pt") && has(e, "'7'") && has(e, "[\"layer.w\"]")) << e.what();

  // storage declares more bytes than its record holds
  z = build_zip({{"a/data.pkl", pdict1("x", ptensor("DoubleStorage", "0", 8, 0, {2}, {1}))},
                 {"a/data/0", std::string(16, '\0')}});
  MemorySource src2(z);
  e = expect_error([&] { open_torch_archive(src2, "short.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, "short.pt") && has(e, "declares 64 bytes")) << e.what();

  // missing record
  z = build_zip({{"a/data.pkl", pdict1("x", ptensor("FloatStorage", "3", 2, 0, {2}, {1}))}});
  MemorySource src3(z);
  e = expect_error([&] { open_torch_archive(src3, "missing.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, "missing.pt") && has(e, "a/data/3")) << e.what();

  // strides pointing far outside
  z = build_zip({{"a/data.pkl", pdict1("x", ptensor("FloatStorage", "0", 4, 0, {2, 2}, {1, 1000000}))},
                 {"a/data/0", std::string(16, '\0')}});
  MemorySource src4(z);
  EXPECT_EQ(expect_error([&] { open_torch_archive(src4, "stride.pt"); }).code(), ErrorCode::kDataLoss);
}

TEST(ParseTorchArchive, HostilePickleInArchiveIsInert) {
  std::string marker = testing::make_temp_dir("reshard_zip_") + "/pwned";
  std::string pkl = "\x80\x02" + pglobal("os", "system") + pstr("touch " + marker) + "\x85R.";
  std::string z = build_zip({{"a/data.pkl", pkl}});
  MemorySource src(z);
  TorchArchive a = open_torch_archive(src, "evil.pt");
  EXPECT_EQ(a.root().kind, PyValue::Kind::Object);
  EXPECT_EQ(a.root().qualified_name(), "os.system");
  EXPECT_EQ(a.root().to_json()["__object__"], "os.system");
  FILE* f = std::fopen(marker.c_str(), "r");
  EXPECT_EQ(f, nullptr) << "pickle executed code!";
  if (f) std::fclose(f);
}

TEST(ParseTorchArchive, DeeplyNestedPickleInArchiveErrors) {
  std::string pkl = "\x80\x02" + std::string(100000, ']') + std::string(99999, 'a') + ".";
  std::string z = build_zip({{"a/data.pkl", pkl}});
  MemorySource src(z);
  Error e = expect_error([&] { open_torch_archive(src, "deep.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(has(e, "deep.pt") && has(e, "a/data.pkl") && has(e, "at byte")) << e.what();
}

TEST(ParseTorchArchive, RecordLevelErrors) {
  // big-endian
  std::string z = build_zip({{"a/data.pkl", "\x80\x02N."}, {"a/byteorder", "big"}});
  MemorySource s1(z);
  Error e = expect_error([&] { open_torch_archive(s1, "be.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(has(e, "be.pt") && has(e, "big")) << e.what();
  // no data.pkl
  z = build_zip({{"a/other", "x"}});
  MemorySource s2(z);
  e = expect_error([&] { open_torch_archive(s2, "nopkl.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_TRUE(has(e, "a/data.pkl")) << e.what();
  // entry not under a folder
  z = build_zip({{"data.pkl", "\x80\x02N."}});
  MemorySource s3(z);
  EXPECT_EQ(expect_error([&] { open_torch_archive(s3, "flat.pt"); }).code(), ErrorCode::kInvalidArgument);
  // CRC mismatch of data.pkl
  z = build_zip({{"a/data.pkl", "\x80\x02K\x05."}});
  z[z.find("\x80\x02K\x05.") + 3] = '\x06';
  MemorySource s4(z);
  e = expect_error([&] { open_torch_archive(s4, "crc.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, "CRC")) << e.what();
  // legacy magic
  std::string legacy = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.rest"s;
  MemorySource s5(legacy);
  e = expect_error([&] { open_torch_archive(s5, "old.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
  EXPECT_TRUE(has(e, "old.pt") && has(e, "legacy torch serialization")) << e.what();
  // a plain pickle is not a torch archive
  std::string plain = "\x80\x02N.";
  MemorySource s6(plain);
  EXPECT_EQ(expect_error([&] { open_torch_archive(s6, "plain.pkl"); }).code(), ErrorCode::kInvalidArgument);
}

TEST(ParseTorchArchive, FileSourceErrors) {
  Error e = expect_error([&] { FileSource f("/nonexistent/dir/x.pt"); });
  EXPECT_EQ(e.code(), ErrorCode::kNotFound);
  EXPECT_TRUE(has(e, "/nonexistent/dir/x.pt"));
  std::string dir = testing::make_temp_dir("reshard_fs_");
  EXPECT_EQ(expect_error([&] { FileSource f(dir); }).code(), ErrorCode::kInvalidArgument);
  std::string path = dir + "/t.pt";
  std::string z = build_zip({{"t/data.pkl", pdict1("x", ptensor("IntStorage", "0", 2, 0, {2}, {1}))},
                             {"t/data/0", "\x01\x00\x00\x00\x02\x00\x00\x00"s}});
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  std::fwrite(z.data(), 1, z.size(), f);
  std::fclose(f);
  TorchArchive a = open_torch_file(path);
  EXPECT_EQ(a.prefix, "t");
  FileSource fs(path);
  int32_t v[2];
  fs.read(a.tensor_data_offset(a.root().at("x").as_tensor()), 8, v);
  EXPECT_EQ(v[0], 1);
  EXPECT_EQ(v[1], 2);
  e = expect_error([&] { fs.read(z.size() - 2, 4, v); });
  EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
  EXPECT_TRUE(has(e, path));
  std::remove(path.c_str());
  ::rmdir(dir.c_str());
}

}  // namespace
}  // namespace reshard::pt
