// torch.save archives written by the venv's torch (tests/fixtures/make_torch_fixtures.py, run at
// test time) compared against the script's expected.json sidecar, plus corruption of those files.
#include <cstdio>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "reshard/error.h"
#include "reshard/torch_archive.h"
#include "unit/test_util.h"

namespace reshard::pt {
namespace {

using Kind = PyValue::Kind;
using json = nlohmann::json;

bool exists(const std::string& p) {
  struct stat st;
  return ::stat(p.c_str(), &st) == 0;
}

// Runs the fixture script once per machine and script version: ctest runs every test in its own
// process, and each run imports torch, so the files are cached in $TMPDIR under a name that
// carries a hash of the script (made in a temporary folder and renamed into place, so parallel
// test processes never see half a set). Sets *why and returns "" when it cannot.
std::string fixtures(std::string* why) {
  static std::string dir, reason;
  static bool done = false;
  if (!done) {
    done = true;
    std::string py = testing::source_path(".venv/bin/python");
    std::string script = testing::source_path("tests/fixtures/make_torch_fixtures.py");
    std::ifstream sf(script, std::ios::binary);
    std::stringstream body;
    body << sf.rdbuf();
    uint64_t h = 1469598103934665603ull;
    for (char c : body.str()) h = (h ^ uint8_t(c)) * 1099511628211ull;
    const char* tmp = std::getenv("TMPDIR");
    std::string cache = std::string(tmp ? tmp : "/tmp") + "/reshard_torch_fixtures_" + std::to_string(h);
    if (exists(cache + "/expected.json")) {
      dir = cache;
    } else if (!exists(py)) {
      reason = "no venv python at " + py + " (run scripts/setup to create .venv with torch)";
    } else if (std::system(("'" + py + "' -c 'import torch, numpy' >/dev/null 2>&1").c_str()) != 0) {
      reason = py + " cannot import torch and numpy";
    } else {
      std::string out = testing::make_temp_dir("reshard_torch_fixtures_tmp_");
      std::string cmd = "'" + py + "' '" + script + "' '" + out + "' > '" + out + "/log.txt' 2>&1";
      if (std::system(cmd.c_str()) != 0) {
        std::ifstream log(out + "/log.txt");
        std::stringstream ss;
        ss << log.rdbuf();
        reason = "fixture script failed: " + ss.str();
      } else if (::rename(out.c_str(), cache.c_str()) == 0 || exists(cache + "/expected.json")) {
        dir = exists(cache + "/expected.json") ? cache : out;
      } else {
        dir = out;
      }
    }
  }
  *why = reason;
  return dir;
}

#define FIXTURES(var)                       \
  std::string why_;                         \
  const std::string var = fixtures(&why_);  \
  if (var.empty()) GTEST_SKIP() << why_;

json expected(const std::string& dir) {
  std::ifstream f(dir + "/expected.json");
  return json::parse(f);
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A ByteSource that counts what the parser reads.
class CountingSource : public ByteSource {
 public:
  explicit CountingSource(const ByteSource& s) : s_(s) {}
  uint64_t size() const override { return s_.size(); }
  void read(uint64_t off, uint64_t len, void* dst) const override {
    bytes_ += len;
    s_.read(off, len, dst);
  }
  mutable uint64_t bytes_ = 0;

 private:
  const ByteSource& s_;
};

double element(const uint8_t* p, const std::string& dt) {
  auto ld = [&](auto x) { std::memcpy(&x, p, sizeof x); return double(x); };
  if (dt == "float32") return ld(float());
  if (dt == "float64") return ld(double());
  if (dt == "float16" || dt == "bfloat16") {
    float f;
    convert_elements(p, dt == "float16" ? DType::F16 : DType::BF16, &f, DType::F32, 1);
    return f;
  }
  if (dt == "int64") return ld(int64_t());
  if (dt == "int32") return ld(int32_t());
  if (dt == "int16") return ld(int16_t());
  if (dt == "int8") return ld(int8_t());
  if (dt == "uint8" || dt == "bool") return ld(uint8_t());
  if (dt == "uint16") return ld(uint16_t());
  ADD_FAILURE() << "no decoder for " << dt;
  return 0;
}

// Elements of `t` in logical row-major order, read through the record's bytes and the strides.
std::vector<double> tensor_values(const ByteSource& src, const TorchArchive& a, const TensorInfo& t) {
  const StorageRecord& r = a.record(t);
  std::string bytes(r.length, '\0');
  src.read(r.offset, r.length, bytes.data());
  std::vector<double> out;
  uint64_t n = t.numel();
  std::vector<int64_t> idx(t.shape.size(), 0);
  for (uint64_t k = 0; k < n; ++k) {
    int64_t el = t.storage_offset;
    for (size_t d = 0; d < idx.size(); ++d) el += idx[d] * t.stride[d];
    EXPECT_LE(uint64_t(el + 1) * t.itemsize, r.length);
    out.push_back(element(reinterpret_cast<const uint8_t*>(bytes.data()) + el * t.itemsize, t.torch_dtype));
    for (size_t d = idx.size(); d-- > 0;) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

void check_tensor(const ByteSource& src, const TorchArchive& a, const PyValue& v, const json& e,
                  const std::string& what) {
  SCOPED_TRACE(what);
  ASSERT_EQ(v.kind, Kind::Tensor) << v.repr();
  const TensorInfo& t = v.as_tensor();
  EXPECT_EQ(t.torch_dtype, e["dtype"].get<std::string>());
  EXPECT_EQ(t.shape, e["shape"].get<std::vector<int64_t>>());
  EXPECT_EQ(t.stride, e["stride"].get<std::vector<int64_t>>());
  EXPECT_EQ(t.storage_offset, e["offset"].get<int64_t>());
  EXPECT_EQ(t.storage_numel, e["storage_numel"].get<uint64_t>());
  EXPECT_EQ(t.is_parameter, e["is_parameter"].get<bool>());
  std::vector<double> vals = tensor_values(src, a, t);
  const json& ev = e["values"];
  ASSERT_LE(ev.size(), vals.size());
  for (size_t i = 0; i < ev.size(); ++i) {
    double x = ev[i].is_boolean() ? double(ev[i].get<bool>()) : ev[i].get<double>();
    EXPECT_EQ(vals[i], x) << "element " << i;
  }
  if (e.contains("sum")) {
    double s = 0;
    for (double x : vals) s += x;
    double es = e["sum"].get<double>();
    EXPECT_NEAR(s, es, 1e-9 * std::max(1.0, std::fabs(es)));
  }
}

struct Opened {
  std::unique_ptr<FileSource> src;
  TorchArchive ar;
};
Opened open_fixture(const std::string& dir, const std::string& name) {
  Opened o;
  o.src = std::make_unique<FileSource>(dir + "/" + name);
  o.ar = open_torch_archive(*o.src, dir + "/" + name);
  return o;
}

TEST(ParseTorchFixture, DtypesAndValues) {
  FIXTURES(dir);
  json e = expected(dir)["dtypes.pt"];
  Opened o = open_fixture(dir, "dtypes.pt");
  EXPECT_EQ(o.ar.prefix, e["prefix"]);
  EXPECT_EQ(o.ar.version, "3");
  EXPECT_EQ(o.ar.byteorder, "little");
  EXPECT_EQ(o.ar.tensors.size(), e["tensors"].size());
  for (auto& [k, et] : e["tensors"].items()) check_tensor(*o.src, o.ar, o.ar.root().at(k), et, k);
  // reshard dtypes where they exist; uint16 is recognised but has no reshard DType
  EXPECT_EQ(o.ar.root().at("bf16").as_tensor().dtype, DType::BF16);
  EXPECT_EQ(o.ar.root().at("bool").as_tensor().dtype, DType::Bool);
  EXPECT_EQ(o.ar.root().at("i64").as_tensor().dtype, DType::I64);
  EXPECT_FALSE(o.ar.root().at("u16").as_tensor().dtype_known);
  // every data record is 64-byte aligned
  for (const auto& [key, rec] : o.ar.storages) EXPECT_EQ(rec.offset % 64, 0u) << key;
}

TEST(ParseTorchFixture, ViewsShareOneStorage) {
  FIXTURES(dir);
  json e = expected(dir)["views.pt"];
  Opened o = open_fixture(dir, "views.pt");
  for (auto& [k, et] : e["tensors"].items()) check_tensor(*o.src, o.ar, o.ar.root().at(k), et, k);
  std::string key = o.ar.root().at("base").as_tensor().storage_key;
  for (const auto& name : e["shared"])
    EXPECT_EQ(o.ar.root().at(name.get<std::string>()).as_tensor().storage_key, key) << name;
  EXPECT_NE(o.ar.root().at("other").as_tensor().storage_key, key);
  EXPECT_EQ(o.ar.storages.size(), 2u);
  EXPECT_FALSE(o.ar.root().at("t").as_tensor().is_contiguous());
  EXPECT_TRUE(o.ar.root().at("mat").as_tensor().is_contiguous());
}

TEST(ParseTorchFixture, StateDictIsOrderedDictWithMetadata) {
  FIXTURES(dir);
  json e = expected(dir)["state_dict.pt"];
  Opened o = open_fixture(dir, "state_dict.pt");
  const PyValue& r = o.ar.root();
  EXPECT_EQ(r.kind, Kind::Dict);
  EXPECT_EQ(r.type_name, "collections.OrderedDict");
  std::vector<std::string> keys;
  for (const auto& [k, v] : r.as_dict()) keys.push_back(k->as_string());
  EXPECT_EQ(keys, e["keys"].get<std::vector<std::string>>());
  ASSERT_NE(r.state, nullptr);
  EXPECT_NE(r.state->get("_metadata"), nullptr);
  for (auto& [k, et] : e["tensors"].items()) check_tensor(*o.src, o.ar, r.at(k), et, k);
  ASSERT_EQ(o.ar.tensors.size(), keys.size());
  EXPECT_EQ(o.ar.tensors[0].path, "[\"" + keys[0] + "\"]");
}

void check_misc(const std::string& dir, const std::string& file) {
  SCOPED_TRACE(file);
  json e = expected(dir)[file];
  Opened o = open_fixture(dir, file);
  const PyValue& r = o.ar.root();
  EXPECT_EQ(o.ar.prefix, e["prefix"]);

  const PyValue& nested = r.at("nested");
  EXPECT_EQ(nested.at("a").as_list()[2]->as_tuple()[1]->as_string(), "x");
  EXPECT_TRUE(nested.at("a").as_list()[2]->as_tuple()[2]->is_none());
  EXPECT_DOUBLE_EQ(nested.at("b").at("d").as_float(), 1.25);
  EXPECT_FALSE(nested.at("b").at("c").as_tuple()[1]->as_bool());

  const PyValue& args = r.at("args");
  EXPECT_EQ(args.kind, Kind::Object);
  EXPECT_EQ(args.qualified_name(), "argparse.Namespace");
  EXPECT_DOUBLE_EQ(args.at("lr").as_float(), e["args"]["lr"].get<double>());
  EXPECT_EQ(args.at("name").as_string(), e["args"]["name"]);
  EXPECT_EQ(args.at("layers").as_int(), e["args"]["layers"].get<int64_t>());
  EXPECT_EQ(args.at("params_dtype").kind, Kind::Dtype);
  EXPECT_EQ(args.at("params_dtype").text, e["args"]["params_dtype"]);

  const PyValue& names = r.at("names");
  EXPECT_EQ(names.kind, Kind::Set);
  std::vector<std::string> ns;
  for (auto* x : names.items) ns.push_back(x->as_string());
  std::sort(ns.begin(), ns.end());
  EXPECT_EQ(ns, e["names"].get<std::vector<std::string>>());

  const std::string& blob = r.at("blob").as_bytes();
  std::string hex;
  for (unsigned char c : blob) { char b[3]; std::snprintf(b, 3, "%02x", c); hex += b; }
  EXPECT_EQ(hex, e["blob_hex"]);

  EXPECT_EQ(r.at("big").kind, Kind::BigInt);
  EXPECT_EQ(r.at("big").text, e["big"]);
  EXPECT_EQ(r.at("neg_big").text, e["neg_big"]);
  EXPECT_EQ(r.at("int_max").as_int(), e["int_max"].get<int64_t>());
  EXPECT_EQ(r.at("int_min").as_int(), e["int_min"].get<int64_t>());
  EXPECT_EQ(r.at("neg").as_int(), -7);

  // Python random.getstate(): (version, tuple of 625 ints, None)
  const auto& rng = r.at("py_rng").as_tuple();
  ASSERT_EQ(rng.size(), 3u);
  EXPECT_EQ(rng[0]->as_int(), e["py_rng_version"].get<int64_t>());
  const auto& st = rng[1]->as_tuple();
  ASSERT_EQ(st.size(), e["py_rng_len"].get<size_t>());
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(st[i]->as_int(), e["py_rng_head"][i].get<int64_t>());
  EXPECT_EQ(st.back()->as_int(), e["py_rng_tail"].get<int64_t>());
  EXPECT_TRUE(rng[2]->is_none());

  // numpy: ('MT19937', ndarray(uint32[624]), pos, has_gauss, cached_gaussian)
  const auto& np = r.at("np_rng").as_tuple();
  ASSERT_EQ(np.size(), 5u);
  EXPECT_EQ(np[0]->as_string(), e["np_rng_name"]);
  EXPECT_EQ(np[2]->as_int(), e["np_rng_pos"].get<int64_t>());
  const PyValue& arr = *np[1];
  EXPECT_EQ(arr.kind, Kind::Object);
  EXPECT_NE(arr.qualified_name().find("_reconstruct"), std::string::npos) << arr.qualified_name();
  ASSERT_NE(arr.state, nullptr);
  const auto& ast = arr.state->as_tuple();  // (version, shape, dtype, is_fortran, raw bytes)
  ASSERT_EQ(ast.size(), 5u);
  EXPECT_EQ(ast[1]->as_tuple()[0]->as_int(), e["np_rng_len"].get<int64_t>());
  const std::string& raw = ast[4]->as_bytes();
  ASSERT_EQ(raw.size(), 4 * e["np_rng_len"].get<size_t>());
  uint32_t key0;
  std::memcpy(&key0, raw.data(), 4);
  EXPECT_EQ(key0, e["np_rng_key0"].get<uint32_t>());

  // enum member: Cls(value) or getattr(Cls, 'NAME') depending on the Python version
  const PyValue& color = r.at("color");
  EXPECT_EQ(color.kind, Kind::Object);
  EXPECT_EQ(color.qualified_name(), e["color_class"]);
  if (color.enum_member) {
    EXPECT_EQ(color.text, e["color_member"]);
  } else {
    EXPECT_EQ(color.args->as_tuple()[0]->as_int(), e["color_value"].get<int64_t>());
  }

  const PyValue& size = r.at("size");
  EXPECT_EQ(size.type_name, "torch.Size");
  std::vector<int64_t> dims;
  for (auto* x : size.as_tuple()) dims.push_back(x->as_int());
  EXPECT_EQ(dims, e["size"].get<std::vector<int64_t>>());

  EXPECT_EQ(r.at("dtype").kind, Kind::Dtype);
  EXPECT_EQ(r.at("dtype").text, e["dtype"]);
  EXPECT_EQ(r.at("dtype").dtype, DType::F16);
  check_tensor(*o.src, o.ar, r.at("param"), e["param"], "param");
  EXPECT_TRUE(r.at("param").as_tensor().requires_grad);
  EXPECT_TRUE(r.at("empty_tuple").as_tuple().empty());
  EXPECT_EQ(r.at("unicode").as_string(), e["unicode"]);
  EXPECT_EQ(r.at("ordered").type_name, "collections.OrderedDict");
  EXPECT_EQ(r.at("ordered").as_dict()[0].first->as_string(), "z");

  // the inspect view
  auto j = r.to_json();
  EXPECT_EQ(j["param"]["__tensor__"], "float32");
  EXPECT_EQ(j["param"]["parameter"], true);
  EXPECT_EQ(j["big"]["__int__"], e["big"].get<std::string>());
  EXPECT_EQ(j["args"]["__object__"], "argparse.Namespace");
  EXPECT_FALSE(j.dump().empty());
  EXPECT_FALSE(r.repr(10000).empty());
}

TEST(ParseTorchFixture, MiscPythonValues) {
  FIXTURES(dir);
  check_misc(dir, "misc.pt");
}

TEST(ParseTorchFixture, MiscPythonValuesProtocol4) {
  FIXTURES(dir);
  check_misc(dir, "misc_proto4.pt");
}

TEST(ParseTorchFixture, BigTensorReadsOnlyDirectoryAndPickle) {
  FIXTURES(dir);
  json e = expected(dir)["big.pt"];
  FileSource fs(dir + "/big.pt");
  CountingSource cs(fs);
  TorchArchive a = open_torch_archive(cs, "big.pt");
  EXPECT_GT(fs.size(), 280000u);
  // EOCD tail (<= 64 KiB + 22, clamped to the file), the central directory, local headers, data.pkl
  EXPECT_LT(cs.bytes_, 70000u) << "parser read tensor bytes";
  for (auto& [k, et] : e["tensors"].items()) check_tensor(fs, a, a.root().at(k), et, k);
}

TEST(ParseTorchFixture, PrefixesVary) {
  FIXTURES(dir);
  json all = expected(dir);
  for (std::string file : {"odd name+x.v2.ckpt", "odd name+\xc3\xbcn\xc3\xaf.v2.ckpt", "stream.pt"}) {
    SCOPED_TRACE(file);
    Opened o = open_fixture(dir, file);
    EXPECT_EQ(o.ar.prefix, all[file]["prefix"].get<std::string>());
    check_tensor(*o.src, o.ar, o.ar.root().at("x"), all[file]["tensors"]["x"], "x");
  }
  Opened b = open_fixture(dir, "bare.pt");
  check_tensor(*b.src, b.ar, b.ar.root(), all["bare.pt"]["root"], "root");
  ASSERT_EQ(b.ar.tensors.size(), 1u);
  EXPECT_EQ(b.ar.tensors[0].path, "<root>");
}

TEST(ParseTorchFixture, PlainPicklesAllProtocols) {
  FIXTURES(dir);
  json e = expected(dir)["plain"];
  for (int proto = 0; proto <= 5; ++proto) {
    SCOPED_TRACE("protocol " + std::to_string(proto));
    std::string b = read_file(dir + "/plain_p" + std::to_string(proto) + ".pkl");
    auto doc = parse_pickle(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "plain.pkl");
    const PyValue& r = doc->root();
    const auto& ints = r.at("ints").as_list();
    ASSERT_EQ(ints.size(), e["ints"].size());
    for (size_t i = 0; i < ints.size(); ++i) EXPECT_EQ(ints[i]->as_int(), e["ints"][i].get<int64_t>());
    const auto& bigs = r.at("bigs").as_list();
    ASSERT_EQ(bigs.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(bigs[i]->kind, Kind::BigInt);
      EXPECT_EQ(bigs[i]->text, e["bigs"][i].get<std::string>());
    }
    const auto& fl = r.at("floats").as_list();
    for (size_t i = 0; i < fl.size(); ++i) EXPECT_EQ(fl[i]->as_float(), e["floats"][i].get<double>());
    EXPECT_EQ(r.at("str").as_string(), e["str"].get<std::string>());
    EXPECT_EQ(r.at("bytes").as_bytes(), std::string("\x00\x01\xff", 3));
    EXPECT_EQ(r.at("bytearray").as_bytes(), "xy");
    const auto& tu = r.at("tuples").as_list();
    ASSERT_EQ(tu.size(), 5u);
    for (size_t i = 0; i < 5; ++i) EXPECT_EQ(tu[i]->as_tuple().size(), i);
    EXPECT_EQ(r.at("set").kind, Kind::Set);
    EXPECT_EQ(r.at("set").items.size(), 2u);
    EXPECT_EQ(r.at("frozenset").kind, Kind::Set);
    EXPECT_EQ(r.at("frozenset").items[0]->as_int(), 7);
    const auto& flags = r.at("flags").as_list();
    EXPECT_TRUE(flags[0]->as_bool());
    EXPECT_FALSE(flags[1]->as_bool());
    EXPECT_TRUE(flags[2]->is_none());
    const auto& sh = r.at("shared").as_list();
    EXPECT_EQ(sh[0], sh[1]) << "memo aliasing lost";
    EXPECT_EQ(r.at("od").as_dict()[0].first->as_string(), "b");
    EXPECT_EQ(r.at("ns").at("k").as_int(), 3);
  }
}

TEST(ParseTorchFixture, LegacyFormatIsUnsupported) {
  FIXTURES(dir);
  try {
    open_torch_file(dir + "/legacy.pt");
    FAIL() << "legacy file accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
    EXPECT_NE(std::string(e.what()).find("legacy.pt"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("torch >= 1.6"), std::string::npos) << e.what();
  }
}

TEST(ParseTorchFixture, TruncationAtManyCutPoints) {
  FIXTURES(dir);
  for (std::string file : {"dtypes.pt", "misc.pt"}) {
    std::string bytes = read_file(dir + "/" + file);
    ASSERT_FALSE(bytes.empty());
    std::vector<size_t> cuts;
    for (size_t c = 0; c < bytes.size(); c += 37) cuts.push_back(c);
    for (size_t c = bytes.size() > 300 ? bytes.size() - 300 : 0; c < bytes.size(); ++c) cuts.push_back(c);
    for (size_t cut : cuts) {
      MemorySource src(bytes.data(), cut);
      std::string name = "cut_" + std::to_string(cut) + "_" + file;
      try {
        open_torch_archive(src, name);
        ADD_FAILURE() << file << " truncated to " << cut << " bytes was accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
        if (cut >= 4) {
          EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << e.what();
        }
      }
    }
  }
}

TEST(ParseTorchFixture, RandomByteFlipsNeverCrash) {
  FIXTURES(dir);
  uint64_t seed = testing::test_seed("ParseTorchFixture.RandomByteFlipsNeverCrash");
  std::mt19937_64 rng(seed);
  std::string base = read_file(dir + "/misc.pt");
  int ok = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string b = base;
    int flips = 1 + int(rng() % 8);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] ^= char(1 + rng() % 255);
    MemorySource src(b);
    try {
      TorchArchive a = open_torch_archive(src, "flipped.pt");
      (void)a.root().to_json().dump(-1, ' ', false, json::error_handler_t::replace);
      ++ok;
    } catch (const Error& e) {
      ASSERT_NE(std::string(e.what()).find("flipped.pt"), std::string::npos) << e.what();
    }
  }
  std::printf("flipped archives still readable: %d / 2000\n", ok);
}

TEST(ParseTorchFixture, CentralDirectoryPastEofInRealFile) {
  FIXTURES(dir);
  std::string b = read_file(dir + "/views.pt");
  size_t rec = b.rfind("PK\x06\x06");
  ASSERT_NE(rec, std::string::npos) << "torch always writes a ZIP64 end record";
  uint64_t past = b.size() + 4096;
  std::memcpy(&b[rec + 48], &past, 8);
  MemorySource src(b);
  try {
    open_torch_archive(src, "views_cd_past_eof.pt");
    FAIL() << "accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss);
    EXPECT_NE(std::string(e.what()).find("views_cd_past_eof.pt"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace reshard::pt
