// Restricted unpickler: hand-assembled pickles (opcode encodings per Python's pickletools docs).
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <random>
#include <string>

#include "reshard/error.h"
#include "reshard/torch_archive.h"
#include "unit/test_util.h"

namespace reshard::pt {
namespace {

using Kind = PyValue::Kind;
using namespace std::string_literals;

// ---- tiny pickle assembler ----
struct P {
  std::string b;
  P& raw(const std::string& s) { b += s; return *this; }
  P& op(char c) { b += c; return *this; }
  P& proto(int v) { b += '\x80'; b += char(v); return *this; }
  P& u32(uint32_t v) { for (int i = 0; i < 4; ++i) b += char((v >> (8 * i)) & 0xFF); return *this; }
  P& str(const std::string& s) { b += 'X'; u32(uint32_t(s.size())); b += s; return *this; }
  P& global(const std::string& m, const std::string& n) { b += 'c' + m + "\n" + n + "\n"; return *this; }
  P& i1(uint8_t v) { b += 'K'; b += char(v); return *this; }
  P& i4(int32_t v) { b += 'J'; u32(uint32_t(v)); return *this; }
  P& long1(const std::string& bytes) { b += '\x8a'; b += char(bytes.size()); b += bytes; return *this; }
  P& stop() { b += '.'; return *this; }
  std::shared_ptr<const PickleDocument> parse(const PickleLimits& lim = {}) const {
    return parse_pickle(reinterpret_cast<const uint8_t*>(b.data()), b.size(), "test.pkl", lim);
  }
};

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

TEST(ParseTorchPickle, Scalars) {
  // (None, True, False, 7, 300, 70000, -2, 1.5, 'hé', b'\x00\xff')
  P p;
  p.proto(2).op('(').op('N').op('\x88').op('\x89').i1(7).raw("M").raw(std::string("\x2c\x01", 2));
  p.i4(70000).i4(-2);
  p.raw("G").raw(std::string("\x3f\xf8\x00\x00\x00\x00\x00\x00", 8));  // 1.5 big-endian
  p.str("h\xc3\xa9");
  p.raw("C").raw(std::string("\x02\x00\xff", 3));  // SHORT_BINBYTES
  p.op('t').stop();
  auto doc = p.parse();
  const auto& t = doc->root().as_tuple();
  ASSERT_EQ(t.size(), 10u);
  EXPECT_TRUE(t[0]->is_none());
  EXPECT_TRUE(t[1]->as_bool());
  EXPECT_FALSE(t[2]->as_bool());
  EXPECT_EQ(t[3]->as_int(), 7);
  EXPECT_EQ(t[4]->as_int(), 300);
  EXPECT_EQ(t[5]->as_int(), 70000);
  EXPECT_EQ(t[6]->as_int(), -2);
  EXPECT_DOUBLE_EQ(t[7]->as_float(), 1.5);
  EXPECT_EQ(t[8]->as_string(), "h\xc3\xa9");
  EXPECT_EQ(t[9]->as_bytes(), std::string("\x00\xff", 2));
  EXPECT_EQ(doc->root().repr(), "(None, True, False, 7, 300, 70000, -2, 1.5, 'h\xc3\xa9', b'\\x00\xff')");
}

TEST(ParseTorchPickle, BigIntegers) {
  // 2**100: 13 bytes LE two's complement; -(2**70); int64 max; 2**63 (needs 9 bytes); 0 (0 bytes)
  std::string two100(13, '\0');
  two100[12] = 0x10;
  std::string neg70(9, '\0');
  neg70[8] = char(0xC0);  // -(2**70) = ...C0 00*8
  std::string i64max("\xff\xff\xff\xff\xff\xff\xff\x7f", 8);
  std::string two63("\x00\x00\x00\x00\x00\x00\x00\x80\x00", 9);
  std::string m1("\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", 10);  // -1 padded
  P p;
  p.proto(2).op('(').long1(two100).long1(neg70).long1(i64max).long1(two63).long1("").long1(m1);
  p.op('l').stop();
  auto doc = p.parse();
  const auto& l = doc->root().as_list();
  ASSERT_EQ(l.size(), 6u);
  EXPECT_EQ(l[0]->kind, Kind::BigInt);
  EXPECT_EQ(l[0]->text, "1267650600228229401496703205376");
  EXPECT_EQ(l[1]->text, "-1180591620717411303424");
  EXPECT_EQ(l[2]->as_int(), INT64_MAX);
  EXPECT_EQ(l[3]->kind, Kind::BigInt);
  EXPECT_EQ(l[3]->text, "9223372036854775808");
  EXPECT_EQ(l[4]->as_int(), 0);
  EXPECT_EQ(l[5]->as_int(), -1);
  EXPECT_EQ(l[0]->to_json()["__int__"], "1267650600228229401496703205376");
}

TEST(ParseTorchPickle, TextProtocolOpcodes) {
  // protocol 0: INT, LONG, FLOAT, STRING, UNICODE, PUT/GET, LIST/DICT/TUPLE, GLOBAL + REDUCE
  // the list holds: True, -42, big, 2.25, "a'b\n", "café é", dict, "k" (memo), tuple, OrderedDict
  std::string s = "(lp0\nI01\naI-42\naL123456789012345678901234567890L\naF2.25\naS'a\\'b\\n'\n"
      "aVcaf\\u00e9 \xe9\na(dp1\nVk\np2\nI5\nsag2\na(I1\nI2\ntp3\naccollections\nOrderedDict\n(tRa.";
  auto doc = parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "t0.pkl");
  const auto& l = doc->root().as_list();
  ASSERT_EQ(l.size(), 10u);
  EXPECT_TRUE(l[0]->as_bool());
  EXPECT_EQ(l[1]->as_int(), -42);
  EXPECT_EQ(l[2]->kind, Kind::BigInt);
  EXPECT_EQ(l[2]->text, "123456789012345678901234567890");
  EXPECT_DOUBLE_EQ(l[3]->as_float(), 2.25);
  EXPECT_EQ(l[4]->as_string(), "a'b\n");
  EXPECT_EQ(l[5]->as_string(), "caf\xc3\xa9 \xc3\xa9");
  EXPECT_EQ(l[6]->at("k").as_int(), 5);
  EXPECT_EQ(l[7], l[6]->as_dict()[0].first);  // memo aliasing: same node
  EXPECT_EQ(l[8]->as_tuple().size(), 2u);
  EXPECT_EQ(l[9]->kind, Kind::Dict);
  EXPECT_EQ(l[9]->type_name, "collections.OrderedDict");
}

TEST(ParseTorchPickle, Protocol4Opcodes) {
  // FRAME, SHORT_BINUNICODE, MEMOIZE, STACK_GLOBAL, EMPTY_SET + ADDITEMS, FROZENSET, BINBYTES8
  P p;
  p.proto(4);
  std::string body;
  body += "\x8c\x08" "builtins" "\x94";       // 'builtins' memo 0
  body += "\x8c\x03" "int" "\x94";            // 'int' memo 1
  body += "\x93\x94";                        // STACK_GLOBAL -> builtins.int, memo 2
  body += "\x8f\x94(K\x01K\x02\x90";           // {1, 2}
  body += "(K\x03\x91";                       // frozenset({3})
  body += std::string("\x8e\x03\x00\x00\x00\x00\x00\x00\x00" "abc", 12);
  body += "h\x00"s;                            // BINGET 0 -> 'builtins'
  body += "\x87\x87";                         // nest into tuples: ((global, set, fs), bytes, 'builtins')... 
  p.raw("\x95").raw(std::string(8, '\0'));    // FRAME length (checked only against the input size)
  p.raw(body).stop();
  // TUPLE3 twice needs 5 items then 3: global, set, fs, bytes, 'builtins' -> (global,(set,fs,bytes)...)
  auto doc = p.parse();
  const PyValue& r = doc->root();
  ASSERT_EQ(r.kind, Kind::Tuple);
  ASSERT_EQ(r.items.size(), 3u);
  EXPECT_EQ(r.items[0]->qualified_name(), "builtins.int");
  EXPECT_EQ(r.items[1]->kind, Kind::Set);
  EXPECT_EQ(r.items[1]->items.size(), 2u);
  const PyValue& inner = *r.items[2];
  ASSERT_EQ(inner.items.size(), 3u);
  EXPECT_EQ(inner.items[0]->type_name, "frozenset");
  EXPECT_EQ(inner.items[1]->as_bytes(), "abc");
  EXPECT_EQ(inner.items[2]->as_string(), "builtins");
}

TEST(ParseTorchPickle, KnownCallablesBecomeDataNodes) {
  P p;
  p.proto(2).op('(');
  p.global("torch", "Size").op('(').i1(2).i1(3).op('t').op('\x85').op('R');          // torch.Size
  p.global("__builtin__", "set").op(']').op('(').i1(1).i1(2).op('e').op('\x85').op('R');
  p.global("_codecs", "encode").str("\xc3\xbf" "a").str("latin1").op('\x86').op('R');  // b'\xffa'
  p.global("builtins", "getattr").global("mymod", "Color").str("RED").op('\x86').op('R');
  p.global("torch", "bfloat16");
  p.global("torch", "float");                                                       // alias
  p.global("argparse", "Namespace").op(')').op('\x81').op('}').str("lr").raw("G").raw(std::string("\x3f\xe0\0\0\0\0\0\0", 8)).op('s').op('b');
  p.op('t').stop();
  auto doc = p.parse();
  const auto& t = doc->root().as_tuple();
  ASSERT_EQ(t.size(), 7u);
  EXPECT_EQ(t[0]->kind, Kind::Tuple);
  EXPECT_EQ(t[0]->type_name, "torch.Size");
  EXPECT_EQ(t[0]->items[1]->as_int(), 3);
  EXPECT_EQ(t[1]->kind, Kind::Set);
  EXPECT_EQ(t[1]->items.size(), 2u);
  EXPECT_EQ(t[2]->as_bytes(), "\xff" "a");
  EXPECT_TRUE(t[3]->enum_member);
  EXPECT_EQ(t[3]->qualified_name(), "mymod.Color");
  EXPECT_EQ(t[3]->text, "RED");
  EXPECT_EQ(t[4]->kind, Kind::Dtype);
  EXPECT_TRUE(t[4]->dtype_known);
  EXPECT_EQ(t[4]->dtype, DType::BF16);
  EXPECT_EQ(t[5]->text, "float32");
  EXPECT_EQ(t[6]->kind, Kind::Object);
  EXPECT_EQ(t[6]->qualified_name(), "argparse.Namespace");
  EXPECT_DOUBLE_EQ(t[6]->at("lr").as_float(), 0.5);
  auto j = doc->root().to_json();
  EXPECT_EQ(j[4]["__dtype__"], "bfloat16");
  EXPECT_EQ(j[3]["member"], "RED");
  EXPECT_EQ(j[6]["state"]["lr"], 0.5);
}

TEST(ParseTorchPickle, TensorAndParameter) {
  auto tensor = [](P& p, const std::string& key, int numel) {
    p.global("torch._utils", "_rebuild_tensor_v2").op('(');
    p.op('(').str("storage").global("torch", "HalfStorage").str(key).str("cpu").i1(uint8_t(numel)).op('t').op('Q');
    p.i1(1).i1(2).i1(3).op('\x86').i1(1).i1(2).op('\x86').op('\x89');
    p.global("collections", "OrderedDict").op(')').op('R').op('t').op('R');
  };
  P p;
  p.proto(2).op('}').op('(').str("t");
  tensor(p, "0", 8);
  p.str("p").global("torch._utils", "_rebuild_parameter");
  tensor(p, "1", 7);
  p.op('\x88').global("collections", "OrderedDict").op(')').op('R').op('\x87').op('R');
  p.op('u').stop();
  auto doc = p.parse();
  const TensorInfo& t = doc->root().at("t").as_tensor();
  EXPECT_EQ(t.storage_key, "0");
  EXPECT_EQ(t.torch_dtype, "float16");
  EXPECT_EQ(t.dtype, DType::F16);
  EXPECT_EQ(t.itemsize, 2u);
  EXPECT_EQ(t.storage_offset, 1);
  EXPECT_EQ(t.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(t.stride, (std::vector<int64_t>{1, 2}));
  EXPECT_EQ(t.storage_numel, 8u);
  EXPECT_EQ(t.storage_nbytes, 16u);
  EXPECT_EQ(t.extent(), 1u + 1 * 1 + 2 * 2);
  EXPECT_FALSE(t.is_contiguous());
  const TensorInfo& pa = doc->root().at("p").as_tensor();
  EXPECT_TRUE(pa.is_parameter);
  EXPECT_TRUE(pa.requires_grad);
  EXPECT_EQ(pa.storage_key, "1");
  auto j = doc->root().to_json();
  EXPECT_EQ(j["t"]["__tensor__"], "float16");
  EXPECT_EQ(j["t"]["offset"], 1);
  EXPECT_EQ(j["p"]["parameter"], true);
}

TEST(ParseTorchPickle, RebuildWithBadArgumentsIsAnError) {
  P p;
  p.proto(2).global("torch._utils", "_rebuild_tensor_v2").str("notastorage").i1(0).op('\x86').op('R').stop();
  Error e = expect_error([&] { p.parse(); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("test.pkl"), std::string::npos) << e.what();
}

TEST(ParseTorchPickle, HostileGlobalIsInert) {
  std::string marker = testing::make_temp_dir("reshard_pickle_") + "/pwned";
  P p;
  p.proto(2).global("os", "system").str("touch " + marker).op('\x85').op('R');
  p.global("posix", "system").str("touch " + marker).op('\x85').op('R');
  p.global("builtins", "eval").str("__import__('os').system('touch " + marker + "')").op('\x85').op('R');
  p.op('\x87').stop();
  auto doc = p.parse();
  const auto& t = doc->root().as_tuple();
  ASSERT_EQ(t.size(), 3u);
  EXPECT_EQ(t[0]->kind, Kind::Object);
  EXPECT_EQ(t[0]->qualified_name(), "os.system");
  EXPECT_EQ(t[0]->args->as_tuple()[0]->as_string(), "touch " + marker);
  EXPECT_EQ(t[2]->qualified_name(), "builtins.eval");
  struct stat st;
  EXPECT_NE(::stat(marker.c_str(), &st), 0) << "pickle executed code!";
  EXPECT_NE(doc->root().repr().find("os.system"), std::string::npos);
}

TEST(ParseTorchPickle, DeepNestingIsRejectedNotOverflowed) {
  // 200000 nested lists: ']' * n then 'a' * (n-1)
  const size_t n = 200000;
  std::string s = "\x80\x02" + std::string(n, ']') + std::string(n - 1, 'a') + ".";
  Error e = expect_error([&] {
    parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "deep.pkl");
  });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("deep.pkl"), std::string::npos);
  EXPECT_NE(std::string(e.what()).find("nested deeper"), std::string::npos) << e.what();

  // nesting through TUPLE1
  std::string t = "\x80\x02N" + std::string(n, '\x85') + ".";
  e = expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(t.data()), t.size(), "deep2.pkl"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);

  // many open MARKs
  std::string m = "\x80\x02" + std::string(n, '(') + ".";
  e = expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(m.data()), m.size(), "marks.pkl"); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("MARK"), std::string::npos);
}

TEST(ParseTorchPickle, ExponentialAliasingIsBoundedInViews) {
  // x = None; 64 times: x = (x, x)  -> 2**64 leaves when expanded as a tree
  std::string s = "\x80\x02N";
  for (int i = 0; i < 64; ++i) s += "2\x86";
  s += ".";
  auto doc = parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "laughs.pkl");
  EXPECT_EQ(doc->node_count(), 65u);
  Error e = expect_error([&] { doc->root().to_json(256, 100000); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_LE(doc->root().repr(100).size(), 103u);
}

TEST(ParseTorchPickle, CyclesAreSafe) {
  // l = []; l.append(l)
  std::string s = "\x80\x02]q\x00h\x00" "a."s;
  auto doc = parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "cycle.pkl");
  const PyValue& r = doc->root();
  ASSERT_EQ(r.as_list().size(), 1u);
  EXPECT_EQ(r.as_list()[0], &r);
  EXPECT_EQ(r.repr(), "[...]");
  EXPECT_EQ(r.to_json()[0]["__cycle__"], true);
}

TEST(ParseTorchPickle, CorruptStreamsAreDataLoss) {
  struct Case { std::string bytes, what; };
  std::vector<Case> cases = {
      {"\x80\x02h\x05."s, "never stored"},
      {"\x80\x02" "a.", "underflow"},
      {"\x80\x02\xff.", "unknown opcode"},
      {"\x80\x02X\xff\xff\x00\x00" "ab."s, "truncated"},
      {"\x80\x02", "without STOP"},
      {"\x80\x02.", "empty stack"},
      {"\x80\x02X\x02\x00\x00\x00\xc3\x28."s, "UTF-8"},
      {"\x80\x02(K\x01K\x02K\x03" "d.", "odd number"},
      {"\x80\x02K\x01(K\x02" "a.", "underflow"},  // APPEND may not cross a MARK
  };
  for (const auto& c : cases) {
    Error e = expect_error([&] {
      parse_pickle(reinterpret_cast<const uint8_t*>(c.bytes.data()), c.bytes.size(), "bad.pkl");
    });
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.pkl"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("at byte"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find(c.what), std::string::npos) << e.what();
  }
  std::string proto9 = "\x80\x09N.";
  EXPECT_EQ(expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(proto9.data()), proto9.size(), "p.pkl"); }).code(),
            ErrorCode::kUnsupported);
}

TEST(ParseTorchPickle, LimitsAreEnforced) {
  std::string s = "\x80\x02(" + std::string(100, 'N') + "l.";
  PickleLimits lim;
  lim.max_nodes = 50;
  Error e = expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "n.pkl", lim); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  lim = {};
  lim.max_stack = 10;
  e = expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "n.pkl", lim); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  std::string memo = "\x80\x02N";
  for (int i = 0; i < 20; ++i) memo += "q" + std::string(1, char(i));
  memo += ".";
  lim = {};
  lim.max_memo = 10;
  e = expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(memo.data()), memo.size(), "m.pkl", lim); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
}

TEST(ParseTorchPickle, TruncationAtEveryCutPoint) {
  P p;
  p.proto(2).op('}').op('(').str("a").op(']').op('(').i1(1).i4(-5).op('e').str("b");
  p.global("collections", "OrderedDict").op(')').op('R').op('u').stop();
  auto full = p.parse();
  EXPECT_EQ(full->root().at("a").as_list().size(), 2u);
  for (size_t cut = 0; cut < p.b.size(); ++cut) {
    Error e = expect_error([&] { parse_pickle(reinterpret_cast<const uint8_t*>(p.b.data()), cut, "cut.pkl"); });
    EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << "cut " << cut << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find("cut.pkl"), std::string::npos);
  }
}

TEST(ParseTorchPickle, RandomBytesNeverCrash) {
  uint64_t seed = testing::test_seed("ParseTorchPickle.RandomBytesNeverCrash");
  std::mt19937_64 rng(seed);
  // opcode-heavy alphabet so that streams get past the first byte
  const std::string alphabet = "()NKJMXCqhabtlu}]\x85\x86\x87\x88\x89R\x81Q.sde0012\x8a\x8c\x94\x93\x8f\x90";
  int ok = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    std::string s = "\x80\x02";
    size_t len = rng() % 64;
    for (size_t i = 0; i < len; ++i)
      s += (rng() % 4) ? alphabet[rng() % alphabet.size()] : char(rng() & 0xFF);
    try {
      auto doc = parse_pickle(reinterpret_cast<const uint8_t*>(s.data()), s.size(), "rand.pkl");
      (void)doc->root().repr();
      try {
        (void)doc->root().to_json(64, 10000).dump();
      } catch (const Error&) {
      }
      ++ok;
    } catch (const Error& e) {
      ASSERT_NE(std::string(e.what()).find("rand.pkl"), std::string::npos) << e.what();
    }
  }
  std::printf("random pickles parsed successfully: %d / 20000\n", ok);
}

TEST(ParseTorchPickle, AccessorsNameTheExpectedKind) {
  P p;
  p.proto(2).str("x").stop();
  auto doc = p.parse();
  Error e = expect_error([&] { doc->root().as_int(); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(std::string(e.what()).find("expected int"), std::string::npos) << e.what();
  e = expect_error([&] { doc->root().get("k"); });
  EXPECT_NE(std::string(e.what()).find("expected dict"), std::string::npos) << e.what();
}

}  // namespace
}  // namespace reshard::pt
