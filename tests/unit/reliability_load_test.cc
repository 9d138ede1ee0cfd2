// Reliability: every way a load can go wrong ends in a clear Error (code + a message naming the
// path, tensor, region, rank or field) raised before any live tensor is touched; a failure after
// live tensors were partly written says the live state is unusable. The faults are real files
// damaged on disk, plus a reader and a communicator that fail on purpose (fault injection lives in
// this test, not in the library). docs/reliability.md has the table of faults and messages.
//
// Cases already covered elsewhere are not repeated here (tests/unit/native_format_test.cc:
// NativeOpen.PathCases, NativeFormat.* for truncation, checksum, metadata and path traversal at
// open time; tests/mpi/load_test.cc: MissingRankFileFailsEveryRankBeforeAnyWrite under MPI).
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>

#include "formats/native/layout_json.h"
#include "formats/native/native_internal.h"
#include "io/file.h"
#include "reshard/error.h"
#include "reshard/strided.h"
#include "reshard/native.h"
#include "reshard/reshard.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

using nlohmann::json;
constexpr uint8_t kSentinel = 0xA5;

ModelConfig model(int hidden = 16, int ffn = 32) {
  ModelConfig m;
  m.name = "rel";
  m.num_layers = 2;
  m.hidden = hidden;
  m.heads = 4;
  m.query_groups = 2;
  m.ffn = ffn;
  m.vocab = 50;
  m.vocab_divisible_by = 8;
  m.swiglu = true;
  m.param_dtype = DType::BF16;
  return m;
}

std::string expect_error(ErrorCode code, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(error_code_name(e.code())), error_code_name(code)) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected Error(" << error_code_name(code) << ")";
  return {};
}
#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

json load_json(const std::string& p) { return json::parse(io::read_text(p)); }
void store_json(const std::string& p, const json& j) { std::ofstream(p, std::ios::trunc) << j.dump(1); }

// This rank's live buffers of a target layout (one process: rank 0 holds them all), filled with a
// sentinel so that any write is visible.
struct Live {
  std::vector<std::vector<uint8_t>> mem;
  std::vector<void*> ptrs;
  explicit Live(const Layout& t) : mem(t.buffers.size()), ptrs(t.buffers.size(), nullptr) {
    for (size_t b = 0; b < t.buffers.size(); ++b) {
      mem[b].assign(size_t(t.buffers[b].numel) * dtype_size(t.buffers[b].dtype), kSentinel);
      ptrs[b] = mem[b].data();
    }
  }
  bool untouched() const {
    for (const auto& m : mem)
      for (uint8_t x : m)
        if (x != kSentinel) return false;
    return true;
  }
};

// A checkpoint root with one synth step; removed at the end.
struct Ckpt {
  std::string root;
  Ckpt(const std::string& tag, const ModelConfig& m, const std::string& topo, uint64_t seed = 7) {
    root = testing::make_temp_dir("rel_" + tag + "_");
    synth_checkpoint(root, m, Topology::parse(topo), seed);
  }
  ~Ckpt() { io::remove_all(root); }
  std::string step() const { return io::join(root, "step-1"); }
  std::string file(int r) const {
    char n[64];
    std::snprintf(n, sizeof n, "step-1/rank_%05d.safetensors", r);
    return io::join(root, n);
  }
};

LoadReport load_local(const CheckpointReader& ck, const Layout& t, Live& live, const LoadOptions& o = {}) {
  auto comm = make_local_communicator();
  return load(ck, t, live.ptrs, *comm, o);
}

// ---- fault injection: a reader that fails its Nth read, a communicator that fails its Nth exchange

class FaultReader final : public CheckpointReader {
 public:
  FaultReader(const CheckpointReader& inner, int fail_at) : in_(inner), fail_at_(fail_at) {}
  std::string writer() const override { return in_.writer(); }
  std::string path() const override { return in_.path(); }
  const SourceLayout& source() const override { return in_.source(); }
  const NonTensorState& state() const override { return in_.state(); }
  std::vector<std::string> notes() const override { return in_.notes(); }
  uint64_t file_size(int32_t f) const override { return in_.file_size(f); }
  std::unique_ptr<RangeCheck> begin_check(int32_t f, uint64_t o, uint64_t l) const override {
    return in_.begin_check(f, o, l);
  }
  void read(int32_t f, uint64_t o, uint64_t l, void* dst) const override {
    if (++reads_ == fail_at_)
      fail(ErrorCode::kDataLoss, "injected I/O error reading ", source().files[f], " bytes [", o, ", ", o + l, ")");
    in_.read(f, o, l, dst);
  }
  int reads() const { return reads_; }

 private:
  const CheckpointReader& in_;
  int fail_at_;
  mutable std::atomic<int> reads_{0};
};

class FaultComm final : public Communicator {
 public:
  explicit FaultComm(int fail_at) : in_(make_local_communicator()), fail_at_(fail_at) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "fault"; }
  void all_to_all_v(const void* s, const std::vector<uint64_t>& sc, const std::vector<uint64_t>& sd, void* r,
                    const std::vector<uint64_t>& rc, const std::vector<uint64_t>& rd) override {
    if (++calls_ == fail_at_)
      fail(ErrorCode::kFailedPrecondition, "[rank 0/1] all_to_all_v: timed out after 1 s waiting for rank 1 "
           "(injected: the peer died)");
    in_->all_to_all_v(s, sc, sd, r, rc, rd);
  }
  void broadcast(void* d, uint64_t n, int root, const std::vector<int>& g) override { in_->broadcast(d, n, root, g); }
  int64_t all_reduce_sum(int64_t v) override { return in_->all_reduce_sum(v); }
  int64_t all_reduce_max(int64_t v) override { return in_->all_reduce_max(v); }
  std::vector<std::string> all_gather_strings(const std::string& s) override { return in_->all_gather_strings(s); }
  void barrier() override { in_->barrier(); }
  int calls() const { return calls_; }

 private:
  std::unique_ptr<Communicator> in_;
  int fail_at_;
  int calls_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Paths: what NativeOpen.PathCases does not already try.

TEST(ReliabilityPaths, LatestAndStepNamesCannotEscapeTheRoot) {
  Ckpt c("paths", model(), "tp=1,dp=1,zero=1");
  const std::string latest = io::join(c.root, "latest");
  io::make_dirs(io::join(c.root, "../rel_escape_target_step"));
  for (const char* bad : {"../rel_escape_target_step", "/etc", ".", ""}) {
    SCOPED_TRACE(bad);
    io::write_text(latest, std::string(bad) + "\n");
    std::string msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(c.root); });
    EXPECT_HAS(msg, latest);
    EXPECT_HAS(msg, "not a step folder name");
  }
  io::remove_all(io::join(c.root, "../rel_escape_target_step"));
  io::write_text(latest, "step-1\n");
  OpenOptions o;
  for (const char* bad : {"../step-1", "step-1/..", "/tmp"}) {
    SCOPED_TRACE(bad);
    o.step = bad;
    std::string msg = expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(c.root, o); });
    EXPECT_HAS(msg, std::string("step '") + bad + "' not found");
  }
  // A folder with a step's name that holds no checkpoint is refused, not skipped for another step.
  io::make_dirs(io::join(c.root, "step-2"));
  o.step = "step-2";
  std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(c.root, o); });
  EXPECT_HAS(msg, io::join(c.root, "step-2"));
  EXPECT_HAS(msg, "is not a step folder");
  io::write_text(latest, "step-2\n");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(c.root); });
  EXPECT_HAS(msg, "step-2");
}

// ---------------------------------------------------------------------------------------------
// Partial checkpoints: some ranks' files missing (node-local disks).

TEST(ReliabilityPartial, MissingRankFilesNamedWithUncoveredRangesNothingWritten) {
  const ModelConfig m = model();
  Ckpt c("partial", m, "tp=2,dp=2,zero=1");
  ASSERT_EQ(::unlink(c.file(1).c_str()), 0);  // tp 1 of dp 0: weights and a quarter of the optimizer state
  ASSERT_EQ(::unlink(c.file(3).c_str()), 0);
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  Live live(t);
  std::string msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(*ck, t, live); });
  EXPECT_HAS(msg, "checkpoint does not cover the model");
  EXPECT_HAS(msg, "of source rank 1");  // the message lists the first 8 buffers without a file
  EXPECT_HAS(msg, "uncovered: tensor ");
  EXPECT_HAS(msg, "(fp32): elements [");
  EXPECT_TRUE(live.untouched());
  // The message a trainer sees must name the missing files themselves (the CLI's convert adds
  // them; load() must too, so that Python callers get them).
  EXPECT_HAS(msg, "rank_00001.safetensors");
  EXPECT_HAS(msg, "rank_00003.safetensors");
}

// ---------------------------------------------------------------------------------------------
// Files damaged after open (between inspect/plan and load): pre-flight catches it before writes.

TEST(ReliabilityCorrupt, FileTruncatedOrDeletedAfterOpenFailsPreflightBeforeAnyWrite) {
  const ModelConfig m = model();
  Ckpt c("preflight", m, "tp=2,dp=1,zero=1");
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  {
    auto ck = open_checkpoint(c.root);
    ASSERT_EQ(::truncate(c.file(1).c_str(), off_t(io::file_size(c.file(1)) / 2)), 0);
    Live live(t);
    std::string msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(*ck, t, live); });
    EXPECT_HAS(msg, "pre-flight check failed before any live tensor was written");
    EXPECT_HAS(msg, c.file(1));
    EXPECT_HAS(msg, "truncated");
    EXPECT_TRUE(live.untouched());
  }
  synth_checkpoint(c.root, m, Topology::parse("tp=2,dp=1,zero=1"), 7);
  {
    auto ck = open_checkpoint(c.root);
    ASSERT_EQ(::unlink(c.file(0).c_str()), 0);
    Live live(t);
    std::string msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(*ck, t, live); });
    EXPECT_HAS(msg, "pre-flight check failed before any live tensor was written");
    EXPECT_HAS(msg, c.file(0));
    EXPECT_TRUE(live.untouched());
  }
}

// Rank files swapped after the open (under mpirun: the open had checked the
// headers, the load opened the files again by path and loaded rank 3's optimizer state as rank
// 2's under a tp 2 -> 4 re-cut that verify="free" does not check). The pre-flight now opens the
// handle that reads and the mapping use and checks its header against the one seen at open. Here
// one process loads tp=1 with verify="off" (no checksum would notice) and "free".
TEST(ReliabilityCorrupt, RankFilesSwappedAfterOpenFailPreflightBeforeAnyWrite) {
  const ModelConfig m = model();
  Ckpt c("swap_after_open", m, "tp=2,dp=2,zero=1");
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  auto swap = [&] { testing::swap_files(c.file(2), c.file(3)); };
  for (const char* v : {"off", "free"}) {
    SCOPED_TRACE(v);
    auto ck = open_checkpoint(c.root);
    swap();
    LoadOptions o;
    o.verify = v;
    Live live(t);
    const std::string msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(*ck, t, live, o); });
    EXPECT_HAS(msg, "pre-flight check failed before any live tensor was written");
    EXPECT_HAS(msg, c.file(2) + " is not the file this checkpoint was opened with");
    EXPECT_TRUE(live.untouched());
    swap();  // back
  }
  // Swapped back before the load: the files are the ones the open saw, and the load is exact.
  auto ck = open_checkpoint(c.root);
  Live a(t), b(t);
  load_local(*ck, t, a);
  swap();
  swap();
  auto again = open_checkpoint(c.root);
  load_local(*again, t, b);
  for (size_t i = 0; i < t.buffers.size(); ++i) ASSERT_EQ(a.mem[i], b.mem[i]) << t.buffers[i].name;
}

TEST(ReliabilityCorrupt, FlippedByteFailsTheLoadNamingFileAndPiece) {
  const ModelConfig m = model();
  Ckpt c("flip", m, "tp=1,dp=1,zero=1");
  auto ck0 = open_checkpoint(c.root);
  // The fp32 master partition: flip a byte in its middle.
  const auto& s = ck0->source();
  int b = -1;
  for (size_t i = 0; i < s.layout.buffers.size(); ++i)
    if (s.layout.buffers[i].state == StateKind::kMaster) b = int(i);
  ASSERT_GE(b, 0);
  const uint64_t at = s.locations[b].byte_offset + uint64_t(s.layout.buffers[b].numel) * 2;
  {
    testing::flip_bits(c.file(0), at, 0x01);
  }
  auto ck = open_checkpoint(c.root);  // headers are fine
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  Live live(t);
  LoadOptions free_mode;
  free_mode.verify = "free";  // checks as it copies (the default, "full", is the block below)
  try {
    load_local(*ck, t, live, free_mode);
    FAIL() << "a flipped byte must not load";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_HAS(msg, "rank_00000.safetensors");
    EXPECT_HAS(msg, "xxh3 mismatch");
    EXPECT_HAS(msg, "buffer " + s.layout.buffers[b].name);
    // Either nothing was written (kDataLoss) or the error says the live state is unusable.
    if (e.code() == ErrorCode::kFailedPrecondition) {
      EXPECT_HAS(msg, "the live state is unusable");
    } else {
      EXPECT_EQ(e.code(), ErrorCode::kDataLoss) << msg;
      EXPECT_TRUE(live.untouched());
    }
    // Either way no value of the corrupted piece stays in the live tensor: a piece copied out of
    // the file mapping is checked slab by slab as it is copied, and when its checksum fails at
    // the end its live copy is overwritten with NaN (other, verified pieces may have been copied
    // already).
    EXPECT_HAS(msg, "overwritten with NaN");
    const int64_t bad_elem = s.layout.buffers[b].numel / 2;
    int tb = -1;
    for (size_t i = 0; i < t.buffers.size(); ++i)
      if (t.buffers[i].name == s.layout.buffers[b].name && t.buffers[i].rank == s.layout.buffers[b].rank) tb = int(i);
    ASSERT_GE(tb, 0);
    int pieces_hit = 0;
    for (const Piece& pc : s.layout.pieces) {
      if (pc.buffer != b || bad_elem < pc.base || bad_elem >= pc.base + native::piece_span(pc)) continue;
      ++pieces_hit;
      for (int64_t k = pc.base; k < pc.base + native::piece_span(pc); ++k) {
        float v;
        std::memcpy(&v, &live.mem[tb][size_t(k) * 4], 4);
        ASSERT_TRUE(std::isnan(v)) << "element " << k << " of the corrupted piece holds " << v << ", not NaN";
      }
    }
    EXPECT_EQ(pieces_hit, 1);
  }
  // `verify full` checks every piece before any write: all or nothing.
  {
    Live live_full(t);
    LoadOptions o;
    o.verify = "full";
    std::string msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(*ck, t, live_full, o); });
    EXPECT_HAS(msg, "xxh3 mismatch");
    EXPECT_HAS(msg, "before any live tensor was written");
    EXPECT_TRUE(live_full.untouched());
  }
  // `verify off` loads it (the user's explicit choice); the report counts no checksum.
  Live live2(t);
  LoadOptions o;
  o.verify = "off";
  LoadReport r = load_local(*ck, t, live2, o);
  EXPECT_EQ(r.checksums_verified, 0u);
}

// Metadata whose numbers overflow int64 arithmetic must still be caught: a piece box with
// off + len past INT64_MAX (wrapping negative would pass a naive `off + len > shape` check), and
// strides whose span overflows.
TEST(ReliabilityCorrupt, MetadataWithOverflowingNumbersIsDataLoss) {
  const ModelConfig m = model();
  Ckpt c("overflow", m, "tp=1,dp=1,zero=1");
  const std::string meta = io::join(c.step(), "metadata.json");
  const json orig = load_json(meta);
  const int64_t big = int64_t(1) << 62;
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
  };
  const std::vector<Case> cases = {
      {"off + len wraps", [&](json& j) {
         auto& p = j["pieces"][1];
         p["off"][0] = big;
         p["len"][0] = big;
         for (auto& s : p["strides"]) s = 0;
       }},
      {"huge len, zero strides", [&](json& j) {
         auto& p = j["pieces"][1];
         p["len"][0] = INT64_MAX;
         for (auto& s : p["strides"]) s = 0;
       }},
      {"span overflows", [&](json& j) {
         auto& p = j["pieces"][1];
         p["strides"][0] = INT64_MAX;
       }},
      {"base + span wraps", [&](json& j) { j["pieces"][1]["base"] = INT64_MAX; }},
      {"sum of two huge stride terms", [&](json& j) {  // each term fits int64, their sum does not
         auto& p = j["pieces"][1];
         const int nd = int(p["strides"].size());
         for (int d = 0; d < nd; ++d) p["strides"][d] = INT64_MAX / 2;
       }},
  };
  for (const auto& cs : cases) {
    SCOPED_TRACE(cs.what);
    json j = orig;
    cs.edit(j);
    store_json(meta, j);
    std::string msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(c.root); });
    EXPECT_HAS(msg, "pieces[1]");
  }
  // An array whose element count overflows int64.
  json j = orig;
  j["arrays"][0]["shape"] = json::array({big, 4});
  store_json(meta, j);
  std::string msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(c.root); });
  EXPECT_HAS(msg, "field 'arrays[0].shape': the shape has 2^63 elements or more");
}

// A model config that a checkpoint's metadata.json cannot hold (JSON has no NaN; a negative count
// is refused when read back): synth wrote steps that no open accepted.
TEST(ReliabilityModel, ValuesMetadataCannotHoldAreRefusedAtValidation) {
  for (double v : {std::nan(""), double(INFINITY), -1.0}) {
    ModelConfig m = model();
    m.query_groups = m.heads;  // qkv_version < 2 needs multi-head attention
    m.qkv_version = v;
    const std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { m.validate(); });
    EXPECT_HAS(msg, "field qkv_version=");
    EXPECT_HAS(msg, "must be a finite number >= 0");
  }
  ModelConfig m = model();
  m.max_position_embeddings = -5;
  const std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { m.validate(); });
  EXPECT_HAS(msg, "field max_position_embeddings=-5 must be >= 0");
  // And what a checkpoint holds round-trips: 0 position embeddings, qkv_version 0.
  ModelConfig ok = model();
  ok.query_groups = ok.heads;
  ok.max_position_embeddings = 0;
  ok.qkv_version = 0.0;
  EXPECT_NO_THROW(ok.validate());
}

// ---------------------------------------------------------------------------------------------
// Topologies that cannot hold the model; world size mismatch.

TEST(ReliabilityTopology, ModelThatDoesNotFitIsRefusedNamingTheField) {
  const ModelConfig m = model();  // heads 4, groups 2, layers 2
  std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { derive_layout(m, Topology::parse("tp=3")); });
  EXPECT_HAS(msg, "tp=3");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { derive_layout(m, Topology::parse("tp=4")); });
  EXPECT_HAS(msg, "tp=4");
  EXPECT_HAS(msg, "query_groups=2");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { derive_layout(m, Topology::parse("tp=8")); });
  EXPECT_HAS(msg, "heads=4 is not divisible by tp");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { derive_layout(m, Topology::parse("pp=4")); });
  EXPECT_HAS(msg, "pp=4");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=0").validate(); });
  EXPECT_HAS(msg, "tp=0");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=2,dq=2"); });
  EXPECT_HAS(msg, "dq");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=2,tp=4"); });
  EXPECT_HAS(msg, "tp is given twice");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=99999999999999999999"); });
  EXPECT_HAS(msg, "tp=99999999999999999999 is out of range");
  // Typos: an empty item, a sign, a world size no job has (it was killed for memory while planning).
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=2,,dp=2"); });
  EXPECT_HAS(msg, "empty item");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=+2"); });
  EXPECT_HAS(msg, "tp='+2' is not an integer");
  EXPECT_EQ(Topology::parse("tp=2,dp=2,").dp, 2);  // one trailing comma is fine
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=1,dp=1000000"); });
  EXPECT_HAS(msg, "has 1000000 ranks; at most 65536");
  EXPECT_EQ(Topology::parse("tp=8,pp=16,dp=512").world_size(), 65536);
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { Topology::parse("tp=1,dp=65537"); });
  EXPECT_HAS(msg, "at most 65536");

  Ckpt c("world", m, "tp=1,dp=1,zero=1");
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=2,dp=1,zero=1"));
  Live live(t);
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { load_local(*ck, t, live); });
  EXPECT_HAS(msg, "world size 2 but the job has 1 ranks");
  EXPECT_TRUE(live.untouched());
}

// ---------------------------------------------------------------------------------------------
// Model and checkpoint disagree.

TEST(ReliabilityModel, MissingUnexpectedShapeAndDtypeMismatches) {
  ModelConfig m = model();
  m.bias = false;
  Ckpt c("model", m, "tp=1,dp=1,zero=1");
  auto ck = open_checkpoint(c.root);
  const Topology one = Topology::parse("tp=1,dp=1,zero=1");

  // The model has biases the checkpoint lacks: missing tensors, named; strict_missing off loads
  // the rest and leaves them untouched.
  ModelConfig with_bias = m;
  with_bias.bias = true;
  {
    const Layout t = derive_layout(with_bias, one);
    Live live(t);
    std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { load_local(*ck, t, live); });
    EXPECT_HAS(msg, "not in the checkpoint");
    EXPECT_HAS(msg, ".bias");
    EXPECT_HAS(msg, "strict_missing is on");
    EXPECT_TRUE(live.untouched());
  }
  // The checkpoint has biases the model lacks: unexpected tensors; strict_unexpected off ignores them.
  {
    Ckpt cb("model_bias", with_bias, "tp=1,dp=1,zero=1");
    auto ckb = open_checkpoint(cb.root);
    const Layout t = derive_layout(m, one);
    Live live(t);
    std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { load_local(*ckb, t, live); });
    EXPECT_HAS(msg, "not in the model");
    EXPECT_HAS(msg, ".bias");
    EXPECT_HAS(msg, "strict_unexpected is on");
    EXPECT_TRUE(live.untouched());
    LoadOptions o;
    o.plan.strict_unexpected = false;
    LoadReport r = load_local(*ckb, t, live, o);
    bool noted = false;
    for (const auto& p : r.policies) noted |= p.find("ignored (strict_unexpected off)") != std::string::npos;
    EXPECT_TRUE(noted);
  }
  // Shapes: another ffn.
  {
    ModelConfig other = m;
    other.ffn = 48;
    const Layout t = derive_layout(other, one);
    Live live(t);
    std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { load_local(*ck, t, live); });
    EXPECT_HAS(msg, "disagree on");
    EXPECT_HAS(msg, "dense_h_to_4h.weight");
    EXPECT_HAS(msg, "checkpoint shape");
    EXPECT_TRUE(live.untouched());
  }
  // dtype: a bf16 checkpoint into an fp16 model is converted on the way in, and the report says
  // the checkpoint's writer and layout; the 16-bit weights then equal the fp32 master downcast
  // (synth's contract), so it is a conversion, never a reinterpretation of bytes.
  {
    ModelConfig f16 = m;
    f16.param_dtype = DType::F16;
    const Layout t = derive_layout(f16, one);
    Live live(t);
    try {
      load_local(*ck, t, live);
      for (size_t b = 0; b < t.buffers.size(); ++b) {
        if (t.buffers[b].state != StateKind::kWeight) continue;
        const auto& bytes = live.mem[b];
        std::vector<float> got(size_t(t.buffers[b].numel));
        convert_elements(bytes.data(), DType::F16, got.data(), DType::F32, int64_t(got.size()));
        for (float x : got) ASSERT_TRUE(std::isfinite(x)) << t.buffers[b].name;
      }
    } catch (const Error& e) {
      // Refusing is acceptable too, if it says so by name and before any write.
      EXPECT_HAS(e.what(), "dtype");
      EXPECT_TRUE(live.untouched());
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Replicated tensors that differ across tp ranks.

TEST(ReliabilityReplicas, DifferingReplicaPolicies) {
  const ModelConfig m = model();
  Ckpt c("replica", m, "tp=2,dp=1,zero=1");
  std::string tensor;
  {
    auto ck = open_checkpoint(c.root);
    const auto& s = ck->source();
    // The first replicated 16-bit weight on tp rank 1: bump one element's low mantissa bit and
    // store its piece's new checksum, so it is a replica that differs (diverged in training), not
    // a corrupt file.
    int buf = -1;
    for (size_t b = 0; b < s.layout.buffers.size() && buf < 0; ++b) {
      const Buffer& B = s.layout.buffers[b];
      if (B.rank != 1 || B.state != StateKind::kWeight) continue;
      for (const Piece& p : s.layout.pieces)
        if (p.buffer == int(b)) {
          const std::string& tn = s.layout.arrays[p.array].tensor;
          for (const auto& ts : s.layout.tensors)
            if (ts.name == tn && ts.split == Split::kReplicated) {
              buf = int(b);
              tensor = tn;
            }
        }
    }
    ASSERT_GE(buf, 0);
    testing::flip_bits(c.file(1), s.locations[buf].byte_offset, 0x01);
    const std::string meta = io::join(c.step(), "metadata.json");
    json j = load_json(meta);
    const std::string data = io::read_text(c.file(1));
    for (size_t k = 0; k < s.layout.pieces.size(); ++k) {
      const Piece& p = s.layout.pieces[k];
      if (p.buffer != buf) continue;
      const size_t es = dtype_size(s.layout.buffers[size_t(buf)].dtype);
      j["pieces"][k]["xxh3"] = native::xxh3_hex(data.data() + s.locations[size_t(buf)].byte_offset + uint64_t(p.base) * es,
                                                uint64_t(native::piece_span(p)) * es);
    }
    store_json(meta, j);
  }
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  {
    Live live(t);
    std::string msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(*ck, t, live); });
    EXPECT_HAS(msg, "replicated values differ");
    EXPECT_HAS(msg, tensor);
    EXPECT_HAS(msg, "max |diff|");
    EXPECT_HAS(msg, "rank_00001.safetensors");
    EXPECT_HAS(msg, "no live tensor was written");
    EXPECT_TRUE(live.untouched());
  }
  Live first(t);
  {
    LoadOptions o;
    o.plan.replica_policy = ReplicaPolicy::kFirst;
    LoadReport r = load_local(*ck, t, first, o);
    ASSERT_EQ(r.replica_report.size(), 1u);
    EXPECT_HAS(r.replica_report[0], tensor);
    EXPECT_HAS(r.replica_report[0], "max |diff|");
  }
  {
    // Average: element 0 of the tensor is the mean of rank 0's value and rank 1's (one bf16 ulp
    // apart), rounded to bf16; every other byte equals what policy 'first' loaded.
    Live avg(t);
    LoadOptions o;
    o.plan.replica_policy = ReplicaPolicy::kAverage;
    LoadReport r = load_local(*ck, t, avg, o);
    ASSERT_EQ(r.replica_report.size(), 1u);
    EXPECT_HAS(r.replica_report[0], tensor);
    const int tb = t.find_buffer(0, "weight/" + tensor);
    ASSERT_GE(tb, 0);
    uint16_t a_bits, got;
    std::memcpy(&a_bits, first.mem[tb].data(), 2);
    std::memcpy(&got, avg.mem[tb].data(), 2);
    const uint16_t b_bits = uint16_t(a_bits ^ 1);  // the flipped low bit of rank 1's copy
    double a, b;
    convert_elements(&a_bits, DType::BF16, &a, DType::F64, 1);
    convert_elements(&b_bits, DType::BF16, &b, DType::F64, 1);
    const double mean = (a + b) / 2;
    uint16_t want;
    convert_elements(&mean, DType::F64, &want, DType::BF16, 1);
    EXPECT_EQ(got, want) << "a " << a << " b " << b;
    EXPECT_TRUE(got == a_bits || got == b_bits) << "a half-ulp mean rounds to one of the copies";
    for (size_t i = 0; i < t.buffers.size(); ++i) {
      if (int(i) == tb) {
        EXPECT_TRUE(std::equal(first.mem[i].begin() + 2, first.mem[i].end(), avg.mem[i].begin() + 2));
      } else {
        EXPECT_EQ(first.mem[i], avg.mem[i]) << t.buffers[i].name;
      }
    }
    EXPECT_GT(r.bytes_read, r.bytes_needed) << "the other copies are read too";
  }
  {
    Live live(t);
    LoadOptions o;
    o.plan.replica_atol = 1.0;  // within tolerance: loads under 'error'
    LoadReport r = load_local(*ck, t, live, o);
    EXPECT_TRUE(r.replica_report.empty());
  }
}

// ---------------------------------------------------------------------------------------------
// Memory budget.

TEST(ReliabilityBudget, TooSmallIsAClearErrorAndTheMinimumStillLoadsBitwise) {
  const ModelConfig m = model(128, 512);  // fp32 master of dense_h_to_4h alone is 512 KiB
  Ckpt c("budget", m, "tp=2,dp=1,zero=1");
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  for (uint64_t b : {uint64_t(0), uint64_t(1), kMinMemoryBudget - 1}) {
    Live live(t);
    LoadOptions o;
    o.plan.memory_budget = b;
    std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { load_local(*ck, t, live, o); });
    EXPECT_HAS(msg, "memory budget " + std::to_string(b) + " bytes is below the minimum");
    EXPECT_TRUE(live.untouched());
  }
  Live ref(t), small(t);
  load_local(*ck, t, ref);
  LoadOptions o;
  o.verify = "free";
  o.plan.memory_budget = kMinMemoryBudget;
  LoadReport r = load_local(*ck, t, small, o);
  EXPECT_GT(r.waves, 4);
  EXPECT_LE(r.peak_staging_bytes, kMinMemoryBudget);
  EXPECT_EQ(r.peak_verify_bytes, 0u) << "verify=\"free\" runs no weights-vs-master comparison";
  for (size_t b = 0; b < t.buffers.size(); ++b) ASSERT_EQ(ref.mem[b], small.mem[b]) << t.buffers[b].name;
  // verify="full" compares the weights with their fp32 masters before any write, within the
  // load's budget too (it used to hold whole 512 KiB masters at a 64 KiB budget); these pieces
  // are compared straight out of the file mappings, so nothing is held at all.
  Live full(t);
  o.verify = "full";
  r = load_local(*ck, t, full, o);
  EXPECT_GT(r.verify_bytes_read, 0u);
  EXPECT_LE(r.peak_verify_bytes, kMinMemoryBudget);
  for (size_t b = 0; b < t.buffers.size(); ++b) ASSERT_EQ(ref.mem[b], full.mem[b]) << t.buffers[b].name;
}

TEST(ReliabilityModel, BuffersThatShareMemoryAreRefusedBeforeAnyWrite) {
  const ModelConfig m = model();
  Ckpt c("alias", m, "tp=2,dp=1,zero=1");
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  // Two fp32 buffers: the second given memory that starts inside the first's.
  std::vector<size_t> f32;
  for (size_t b = 0; b < t.buffers.size(); ++b)
    if (t.buffers[b].dtype == DType::F32 && t.buffers[b].numel > 1) f32.push_back(b);
  ASSERT_GE(f32.size(), 2u);
  Live live(t);
  live.ptrs[f32[1]] = static_cast<uint8_t*>(live.ptrs[f32[0]]) + 4;
  std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { load_local(*ck, t, live); });
  EXPECT_HAS(msg, "target buffers " + t.buffers[f32[0]].name + " and " + t.buffers[f32[1]].name + " overlap in memory");
  EXPECT_HAS(msg, "before any live tensor was written");
  EXPECT_TRUE(live.untouched());
  // Each buffer in memory of its own: loads.
  Live ok(t);
  load_local(*ck, t, ok);
}

TEST(ReliabilityBudget, ALoadKeepsNoCopiedSourcePageMapped) {
  // A load copies out of its reader's file mappings; a mapped page counts in the process's RSS
  // for as long as the reader lives (a trainer may keep it), so each copied chunk is dropped from
  // the mapping once copied. The reader stays open here while its mappings are measured.
  const ModelConfig m = model(256, 1024);
  Ckpt c("dropmap", m, "tp=2,dp=1,zero=1");
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  // Reference: the same load through positioned reads only (the wrapper has no mappings).
  auto plain_ck = open_checkpoint(c.root);
  FaultReader plain(*plain_ck, -1);
  Live ref(t);
  load_local(plain, t, ref);
  for (const char* v : {"free", "full", "off"}) {
    SCOPED_TRACE(v);
    auto ck = open_checkpoint(c.root);
    Live live(t);
    LoadOptions o;
    o.verify = v;
    const LoadReport r = load_local(*ck, t, live, o);
    for (size_t b = 0; b < t.buffers.size(); ++b) ASSERT_EQ(ref.mem[b], live.mem[b]) << t.buffers[b].name;
    ASSERT_GT(r.bytes_read, uint64_t(16) << 20);
    auto [rss, maps] = testing::mapped_rss_under(c.root);
    EXPECT_EQ(maps, 2) << "both rank files are read through their mappings";
    EXPECT_EQ(rss, 0u) << "of " << r.bytes_read << " bytes copied";
  }
  // The measure sees mapped pages: a full check that keeps its pages mapped leaves most of the
  // files resident in this process; the default drops them as it goes.
  for (bool drop : {false, true}) {
    auto ck = open_checkpoint(c.root);
    const std::vector<ChecksumUnit> units = ck->checksum_units();
    uint64_t bytes = 0;
    for (const ChecksumUnit& u : units) bytes += u.length;
    EXPECT_TRUE(check_checksum_units(*ck, units, 2, drop).empty());
    const uint64_t rss = testing::mapped_rss_under(c.root).first;
    if (drop) EXPECT_EQ(rss, 0u);
    else EXPECT_GT(rss, bytes / 2);
  }
}

// ---------------------------------------------------------------------------------------------
// Failures after live tensors were partly written.

TEST(ReliabilityLive, ReadFailureInALaterWaveSaysTheLiveStateIsUnusable) {
  const ModelConfig m = model(128, 512);
  Ckpt c("live_read", m, "tp=2,dp=1,zero=1");
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  LoadOptions o;
  o.verify = "free";  // "full" would read every piece before the first write, failing there
  o.plan.memory_budget = kMinMemoryBudget;
  o.io_threads = 1;
  FaultReader count(*ck, -1);
  {
    Live live(t);
    load_local(count, t, live, o);
  }
  ASSERT_GT(count.reads(), 10);
  FaultReader fr(*ck, count.reads() / 2);
  Live live(t);
  std::string msg = expect_error(ErrorCode::kFailedPrecondition, [&] { load_local(fr, t, live, o); });
  EXPECT_HAS(msg, "after live tensors were partly written");
  EXPECT_HAS(msg, "the live state is unusable and the trainer must abort");
  EXPECT_HAS(msg, "injected I/O error reading");
  EXPECT_FALSE(live.untouched());
  // The first read failing: nothing written, plain kDataLoss.
  FaultReader first(*ck, 1);
  Live live1(t);
  msg = expect_error(ErrorCode::kDataLoss, [&] { load_local(first, t, live1, o); });
  EXPECT_HAS(msg, "failed before any live tensor was written");
  EXPECT_TRUE(live1.untouched()) << "zero fills ran before the first wave's reads were checked";
}

TEST(ReliabilityLive, ExchangeFailureAfterWritesSaysTheLiveStateIsUnusable) {
  // A communicator error (a peer died, a timeout) in a later wave's exchange: the survivors must
  // hear that their live state is unusable, not only the communicator's error.
  const ModelConfig m = model(128, 512);
  Ckpt c("live_comm", m, "tp=2,dp=1,zero=1");
  auto ck = open_checkpoint(c.root);
  const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
  LoadOptions o;
  o.plan.memory_budget = kMinMemoryBudget;
  FaultComm fc(3);
  Live live(t);
  try {
    load(*ck, t, live.ptrs, fc, o);
    FAIL() << "the injected exchange failure was not raised";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_HAS(msg, "timed out");
    ASSERT_FALSE(live.untouched());
    EXPECT_EQ(e.code(), ErrorCode::kFailedPrecondition) << msg;
    EXPECT_HAS(msg, "the live state is unusable");
  }
}

}  // namespace
}  // namespace reshard
