// Native format: save -> open -> read round trips, checksums, damaged folders, open_checkpoint's
// path cases, the same-filesystem check, and synth.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>

#include "formats/native/layout_json.h"
#include "formats/safetensors/safetensors.h"
#include "io/file.h"
#include "reshard/consolidate.h"
#include "reshard/native.h"
#include "reshard/reshard.h"
#include "unit/checksum_parts.h"
#include "unit/core_harness.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

using nlohmann::json;
using testing::MemCheckpoint;

ModelConfig small_model() {
  ModelConfig m;
  m.name = "tiny";
  m.num_layers = 4;
  m.hidden = 16;
  m.heads = 4;
  m.query_groups = 2;
  m.ffn = 32;
  m.vocab = 50;
  m.vocab_divisible_by = 8;
  m.swiglu = true;
  m.tp_gt_groups = QkvVariant::kReplicateKv;
  m.param_dtype = DType::BF16;
  return m;
}

Layout saved_layout(const ModelConfig& m, const std::string& topo) {
  DeriveOptions o;
  o.weights_on_dp0_only = true;
  return derive_layout(m, Topology::parse(topo), o);
}

std::vector<const void*> const_ptrs(MemCheckpoint& mem) {
  std::vector<const void*> out;
  for (auto& b : mem.bufs) out.push_back(b.data());
  return out;
}

// Byte range of a piece in its file.
std::pair<uint64_t, uint64_t> piece_bytes(const SourceLayout& s, const Piece& p) {
  const size_t es = dtype_size(s.layout.buffers[p.buffer].dtype);
  int64_t span = 1;
  for (int d = 0; d < p.box.ndim; ++d) span += (p.box.len[d] - 1) * p.strides[d];
  return {s.locations[p.buffer].byte_offset + uint64_t(p.base) * es, uint64_t(span) * es};
}

std::string expect_error(ErrorCode code, const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    EXPECT_EQ(error_code_name(e.code()), std::string(error_code_name(code))) << e.what();
    return e.what();
  }
  ADD_FAILURE() << "expected Error(" << error_code_name(code) << ")";
  return {};
}

#define EXPECT_HAS(text, part) EXPECT_NE(std::string(text).find(part), std::string::npos) << (text)

json load_json(const std::string& path) { return json::parse(io::read_text(path)); }
void store_json(const std::string& path, const json& j) {
  std::ofstream(path, std::ios::trunc) << j.dump(1);
}

NonTensorState some_state() {
  NonTensorState s;
  s.iteration = 20;
  s.consumed_samples = 160;
  s.step = 20;
  s.json = R"({"loss_scale": 65536.0, "lr": {"last": 0.0001}})";
  s.per_rank[0] = std::string("\x00\x01\xff binary", 10);
  s.per_rank[3] = "{\"rng\": 7}";
  return s;
}

// ---------------------------------------------------------------------------------------------

TEST(NativeFormat, RoundTripAllRanks) {
  const ModelConfig m = small_model();
  for (const char* topo : {"tp=2,pp=2,dp=2,zero=1", "tp=2,dp=2,zero=0", "tp=1,dp=4,zero=3", "tp=4,pp=1,dp=1,zero=2"}) {
    SCOPED_TRACE(topo);
    const Layout L = saved_layout(m, topo);
    MemCheckpoint mem(L);
    mem.fill_truth(L);
    const std::string root = testing::make_temp_dir("native_rt_");
    const NonTensorState st = some_state();
    save_native_all_ranks(root, "step-20", L, const_ptrs(mem), st);

    EXPECT_EQ(io::read_text(io::join(root, "latest")), "step-20\n");
    auto r = open_checkpoint(root);
    EXPECT_EQ(r->writer(), "native");
    EXPECT_EQ(r->path(), io::join(root, "step-20"));
    const SourceLayout& s = r->source();
    // The layout comes back field by field.
    EXPECT_EQ(s.layout.topo, L.topo);
    ASSERT_EQ(s.layout.buffers.size(), L.buffers.size());
    ASSERT_EQ(s.layout.pieces.size(), L.pieces.size());
    ASSERT_EQ(s.layout.arrays.size(), L.arrays.size());
    ASSERT_EQ(s.layout.tensors.size(), L.tensors.size());
    for (size_t i = 0; i < L.buffers.size(); ++i) {
      EXPECT_EQ(s.layout.buffers[i].name, L.buffers[i].name);
      EXPECT_EQ(s.layout.buffers[i].rank, L.buffers[i].rank);
      EXPECT_EQ(s.layout.buffers[i].dtype, L.buffers[i].dtype);
      EXPECT_EQ(s.layout.buffers[i].numel, L.buffers[i].numel);
      EXPECT_EQ(s.layout.buffers[i].state, L.buffers[i].state);
      EXPECT_EQ(s.layout.buffers[i].group, L.buffers[i].group);
      EXPECT_GE(s.locations[i].file, 0);
    }
    for (size_t i = 0; i < L.pieces.size(); ++i) {
      const Piece &a = s.layout.pieces[i], &b = L.pieces[i];
      EXPECT_EQ(a.array, b.array);
      EXPECT_EQ(a.buffer, b.buffer);
      EXPECT_TRUE(a.box == b.box);
      EXPECT_EQ(a.base, b.base);
      EXPECT_EQ(a.strides, b.strides);
    }
    for (size_t i = 0; i < L.arrays.size(); ++i) {
      EXPECT_EQ(s.layout.arrays[i].key(), L.arrays[i].key());
      EXPECT_EQ(s.layout.arrays[i].shape, L.arrays[i].shape);
      EXPECT_EQ(s.layout.arrays[i].real_rows, L.arrays[i].real_rows);
    }
    for (size_t i = 0; i < L.tensors.size(); ++i) {
      EXPECT_EQ(s.layout.tensors[i].name, L.tensors[i].name);
      EXPECT_EQ(s.layout.tensors[i].shape, L.tensors[i].shape);
      EXPECT_EQ(s.layout.tensors[i].split, L.tensors[i].split);
      EXPECT_EQ(s.layout.tensors[i].owner, L.tensors[i].owner);
      EXPECT_EQ(s.layout.tensors[i].no_weight_decay, L.tensors[i].no_weight_decay);
    }
    ASSERT_EQ(s.layout.flat_groups.size(), L.flat_groups.size());
    for (size_t i = 0; i < L.flat_groups.size(); ++i) {
      ASSERT_EQ(s.layout.flat_groups[i].size(), L.flat_groups[i].size());
      for (size_t g = 0; g < L.flat_groups[i].size(); ++g) {
        EXPECT_EQ(s.layout.flat_groups[i][g].numel, L.flat_groups[i][g].numel);
        EXPECT_EQ(s.layout.flat_groups[i][g].partition_size, L.flat_groups[i][g].partition_size);
        ASSERT_EQ(s.layout.flat_groups[i][g].entries.size(), L.flat_groups[i][g].entries.size());
        for (size_t e = 0; e < L.flat_groups[i][g].entries.size(); ++e) {
          EXPECT_EQ(s.layout.flat_groups[i][g].entries[e].tensor, L.flat_groups[i][g].entries[e].tensor);
          EXPECT_EQ(s.layout.flat_groups[i][g].entries[e].offset, L.flat_groups[i][g].entries[e].offset);
        }
      }
    }
    EXPECT_EQ(s.layout.model.hidden, m.hidden);
    EXPECT_EQ(s.layout.model.swiglu, m.swiglu);
    EXPECT_EQ(s.layout.model.query_groups, m.query_groups);
    EXPECT_EQ(s.layout.model.param_dtype, m.param_dtype);
    // Non-tensor state.
    EXPECT_EQ(r->state().iteration, 20);
    EXPECT_EQ(r->state().consumed_samples, 160);
    EXPECT_EQ(r->state().step, 20);
    EXPECT_EQ(json::parse(r->state().json), json::parse(st.json));
    EXPECT_EQ(r->state().per_rank, st.per_rank);

    // Every piece reads back what was saved, and its checksum matches.
    for (const Piece& p : s.layout.pieces) {
      auto [off, len] = piece_bytes(s, p);
      std::vector<uint8_t> got(len);
      r->read(s.locations[p.buffer].file, off, len, got.data());
      const size_t es = dtype_size(L.buffers[p.buffer].dtype);
      ASSERT_EQ(0, std::memcmp(got.data(), mem.bufs[p.buffer].data() + p.base * es, len)) << L.buffers[p.buffer].name;
      EXPECT_EQ(r->verify_range(s.locations[p.buffer].file, off, len, got.data()), "");
    }
    EXPECT_TRUE(verify_all(*r).empty());
    // Whole buffers too (flat padding included).
    for (size_t b = 0; b < L.buffers.size(); ++b) {
      std::vector<uint8_t> got(mem.bufs[b].size());
      r->read(s.locations[b].file, s.locations[b].byte_offset, got.size(), got.data());
      EXPECT_EQ(got, mem.bufs[b]);
    }
    // No temporaries left behind.
    for (const auto& n : io::list_dir(root)) EXPECT_TRUE(n == "latest" || n == "step-20") << n;
    io::remove_all(root);
  }
}

TEST(NativeFormat, DataFilesAreValidAlignedSafetensors) {
  const ModelConfig m = small_model();
  const std::string root = testing::make_temp_dir("native_st_");
  synth_checkpoint(root, m, Topology::parse("tp=2,dp=2,zero=1"), 3);
  auto r = open_checkpoint(root);
  for (const auto& path : r->source().files) {
    std::string bytes = io::read_text(path);
    ASSERT_GE(bytes.size(), 8u);
    uint64_t n = safetensors::parse_header_size(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), path);
    EXPECT_EQ((8 + n) % 8, 0u);
    auto h = safetensors::parse_header(std::string_view(bytes).substr(8, n), path);
    EXPECT_EQ(h.data_start + h.buffer_size, bytes.size());
    for (const auto& [name, t] : h.tensors) {
      ASSERT_TRUE(t.rtype.has_value());
      EXPECT_EQ(t.begin % dtype_size(*t.rtype), 0u) << name;
      EXPECT_EQ(t.shape.size(), 1u);
    }
  }
  io::remove_all(root);
}

// A save that cannot replace `latest` leaves the root as it was: refused before the step goes
// in when `latest` is a folder; the step rename undone when replacing `latest` fails after it
// (an immutable `latest`: convert exited 2 with the old step replaced).
TEST(NativeFormat, SaveThatCannotReplaceLatestLeavesTheRootAsItWas) {
  const ModelConfig m = small_model();
  const Topology t = Topology::parse("tp=1,dp=1,zero=0");
  const std::string root = testing::make_temp_dir("native_latest_");
  // Everything in the root, with each file's bytes.
  auto snapshot = [&] {
    std::map<std::string, std::string> files;
    for (const auto& e : std::filesystem::recursive_directory_iterator(root))
      files[e.path().string()] = e.is_regular_file() ? io::read_text(e.path().string()) : std::string("<dir>");
    return files;
  };
  {
    io::make_dirs(io::join(root, "latest"));
    const auto before = snapshot();
    std::string msg = expect_error(ErrorCode::kFailedPrecondition, [&] { synth_checkpoint(root, m, t, 3); });
    EXPECT_HAS(msg, "latest is a folder");
    EXPECT_EQ(snapshot(), before);
    io::remove_all(io::join(root, "latest"));
  }
  synth_checkpoint(root, m, t, 3);
  const auto before = snapshot();
  const std::string latest = io::join(root, "latest");
  if (std::system(("chattr +i '" + latest + "' 2>/dev/null").c_str()) != 0) {
    io::remove_all(root);
    GTEST_SKIP() << "chattr +i is not available here (needs root and a filesystem with the immutable flag)";
  }
  std::string msg;
  try {
    synth_checkpoint(root, m, t, 4);  // the same step name, other values: replaces step-1
    msg = "<no error>";
  } catch (const Error& e) {
    msg = e.what();
  }
  std::system(("chattr -i '" + latest + "'").c_str());
  EXPECT_NE(msg, "<no error>");
  EXPECT_EQ(snapshot(), before) << msg;  // the old step-1 and `latest`, no leftover
  auto r = open_checkpoint(root);
  EXPECT_EQ(r->state().step, 1 + 3);  // synth's step is 1 + seed
  io::remove_all(root);
}

TEST(NativeFormat, CollectiveSaveWithLocalCommunicator) {
  const ModelConfig m = small_model();
  const Layout L = saved_layout(m, "tp=1,dp=1,zero=1");
  MemCheckpoint mem(L);
  mem.fill_truth(L);
  const std::string root = testing::make_temp_dir("native_coll_");
  auto comm = make_local_communicator();
  save_native(root, "step-1", L, const_ptrs(mem), some_state(), *comm);
  save_native(root, "step-2", L, const_ptrs(mem), some_state(), *comm);
  save_native(root, "step-2", L, const_ptrs(mem), some_state(), *comm);  // overwrite: exchanged in place
  EXPECT_EQ(io::list_dir(root), (std::vector<std::string>{"latest", "step-1", "step-2"}));  // no tokens, no temps
  auto r = open_checkpoint(root);
  EXPECT_EQ(io::base_name(r->path()), "step-2");
  EXPECT_TRUE(verify_all(*r).empty());
  // A layout of another world size is refused before anything is written.
  const Layout L4 = saved_layout(m, "tp=2,dp=2,zero=1");
  MemCheckpoint mem4(L4);
  std::string msg = expect_error(ErrorCode::kInvalidArgument,
                                 [&] { save_native(root, "step-3", L4, const_ptrs(mem4), some_state(), *comm); });
  EXPECT_HAS(msg, "1 ranks");
  for (const char* bad : {"", ".", "..", "latest", "a/b", ".hidden"})
    expect_error(ErrorCode::kInvalidArgument, [&] { save_native(root, bad, L, const_ptrs(mem), some_state(), *comm); });
  EXPECT_FALSE(io::exists(io::join(root, "step-3")));
  io::remove_all(root);
}

TEST(NativeFormat, FsCheckFailuresNamesRanks) {
  std::vector<std::vector<bool>> ok(8, std::vector<bool>(8, true));
  EXPECT_EQ(fs_check_failures(ok, "/ckpt"), "");
  // Two nodes with local disks: ranks 0-3 see 0-3, ranks 4-7 see 4-7.
  std::vector<std::vector<bool>> split(8, std::vector<bool>(8, false));
  for (int r = 0; r < 8; ++r)
    for (int q = 0; q < 8; ++q) split[r][q] = (r < 4) == (q < 4);
  std::string msg = fs_check_failures(split, "/ckpt");
  EXPECT_HAS(msg, "ranks see different filesystems at /ckpt: ");
  EXPECT_HAS(msg, "ranks 0-3 cannot see the files of ranks 4-7");
  EXPECT_HAS(msg, "ranks 4-7 cannot see the files of ranks 0-3");
  EXPECT_HAS(msg, "a multi-node save onto node-local disks would lose shards");
  // Only rank 0 is blind to 4-7.
  auto one = ok;
  for (int q = 4; q < 8; ++q) one[0][q] = false;
  msg = fs_check_failures(one, "/ckpt");
  EXPECT_HAS(msg, "rank 0 cannot see the files of ranks 4-7");
  EXPECT_EQ(msg.find("rank 1"), std::string::npos) << msg;
  // Non-contiguous sets.
  auto odd = ok;
  odd[2][1] = odd[2][3] = odd[2][5] = odd[2][6] = false;
  EXPECT_HAS(fs_check_failures(odd, "/x"), "rank 2 cannot see the files of ranks 1, 3, 5-6");
}

TEST(NativeFormat, ChecksumDetectsFlippedByte) {
  const ModelConfig m = small_model();
  const std::string root = testing::make_temp_dir("native_flip_");
  synth_checkpoint(root, m, Topology::parse("tp=2,dp=2,zero=1"), 11);
  const std::string file = io::join(root, "step-1/rank_00001.safetensors");
  std::string buf_name, byte_text;
  {
    auto r = open_checkpoint(root);
    ASSERT_TRUE(verify_all(*r).empty());
    const auto& s = r->source();
    // A piece in rank 1's fp32 partition.
    for (const Piece& p : s.layout.pieces) {
      const Buffer& b = s.layout.buffers[p.buffer];
      if (b.rank != 1 || b.state != StateKind::kMaster) continue;
      auto [off, len] = piece_bytes(s, p);
      buf_name = b.name;
      byte_text = "bytes [" + std::to_string(off) + ", " + std::to_string(off + len) + ")";
      // Flip one byte in the middle of it.
      testing::flip_bits(file, off + len / 2, 0x10);
      break;
    }
  }
  ASSERT_FALSE(buf_name.empty());
  auto r = open_checkpoint(root);
  auto problems = verify_all(*r);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_HAS(problems[0], "rank_00001.safetensors");
  EXPECT_HAS(problems[0], "buffer " + buf_name);
  EXPECT_HAS(problems[0], byte_text);
  EXPECT_HAS(problems[0], "xxh3 mismatch");
  // The incremental check a load's copy step uses finds the same piece, with the same message,
  // and passes every other piece.
  int failing = 0;
  for (const ChecksumUnit& u : r->checksum_units()) {
    const std::string p = testing::check_unit_in_parts(*r, u);
    if (p.empty()) continue;
    ++failing;
    EXPECT_EQ(p, problems[0]);
  }
  EXPECT_EQ(failing, 1);
  EXPECT_EQ(r->begin_check(0, 0, 1), nullptr) << "a range that is no piece has no check";
  io::remove_all(root);
}

// verify_all reads a piece through a small buffer a chunk (8 MiB) at a time: a piece of several
// chunks passes when sound and fails when a byte of its last chunk is flipped (a chunk skipped
// or read twice would fail the sound one; a hash of the first chunk only would pass the other).
TEST(NativeFormat, VerifyChecksPiecesLargerThanItsReadChunk) {
  ModelConfig m = small_model();
  m.vocab = 300000;  // word embeddings' fp32 master: 300000 x 16 x 4 B = 19.2 MB, three chunks
  const std::string root = testing::make_temp_dir("native_big_piece_");
  synth_checkpoint(root, m, Topology::parse("tp=1,dp=1,zero=0"), 3);
  const std::string file = io::join(root, "step-1/rank_00000.safetensors");
  uint64_t off = 0, len = 0;
  {
    auto r = open_checkpoint(root);
    ASSERT_TRUE(verify_all(*r).empty());
    for (const Piece& p : r->source().layout.pieces) {
      auto [o, l] = piece_bytes(r->source(), p);
      if (l > len) off = o, len = l;
    }
  }
  ASSERT_GT(len, uint64_t(16) << 20);
  testing::flip_bits(file, off + len - 5, 0x01);
  const std::vector<std::string> problems = verify_all(*open_checkpoint(root));
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_HAS(problems[0], "bytes [" + std::to_string(off) + ", " + std::to_string(off + len) + ")");
  EXPECT_HAS(problems[0], "xxh3 mismatch");
  io::remove_all(root);
}

TEST(NativeFormat, MissingRankFileIsReportedByThePlanner) {
  const ModelConfig m = small_model();
  const Topology t = Topology::parse("tp=2,dp=1,zero=1");
  const std::string root = testing::make_temp_dir("native_missing_");
  synth_checkpoint(root, m, t, 5);
  ASSERT_EQ(::unlink(io::join(root, "step-1/rank_00001.safetensors").c_str()), 0);
  auto r = open_checkpoint(root);  // no throw
  bool noted = false;
  for (const auto& n : r->notes()) noted |= n.find("rank_00001.safetensors") != std::string::npos;
  EXPECT_TRUE(noted);
  const auto& s = r->source();
  for (size_t b = 0; b < s.layout.buffers.size(); ++b)
    EXPECT_EQ(s.locations[b].file < 0, s.layout.buffers[b].rank == 1) << s.layout.buffers[b].name;
  const Layout target = derive_layout(m, t);
  EXPECT_FALSE(find_coverage_gaps(s, target).empty());
  std::string msg = expect_error(ErrorCode::kDataLoss, [&] { make_plan(s, target); });
  EXPECT_HAS(msg, "layers.0.self_attention.query_key_value.weight");
  auto problems = verify_all(*r);
  ASSERT_FALSE(problems.empty());
  EXPECT_HAS(problems[0], "rank_00001.safetensors: missing");
  expect_error(ErrorCode::kNotFound, [&] { r->file_size(1); });
  io::remove_all(root);
}

TEST(NativeFormat, TruncatedDataFile) {
  const ModelConfig m = small_model();
  const std::string root = testing::make_temp_dir("native_trunc_");
  synth_checkpoint(root, m, Topology::parse("tp=2,dp=1,zero=1"), 5);
  const std::string file = io::join(root, "step-1/rank_00000.safetensors");
  ASSERT_EQ(::truncate(file.c_str(), off_t(io::file_size(file) - 100)), 0);
  std::string msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, "rank_00000.safetensors");
  EXPECT_HAS(msg, "buffer ");
  EXPECT_HAS(msg, "truncated");
  // Cut inside the header.
  ASSERT_EQ(::truncate(file.c_str(), 20), 0);
  msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, "rank_00000.safetensors");
  // Trailing bytes: opens (with a note), verify reports the size.
  synth_checkpoint(root, m, Topology::parse("tp=2,dp=1,zero=1"), 5);
  { std::ofstream(file, std::ios::app | std::ios::binary) << "junk"; }
  auto r = open_checkpoint(root);
  auto problems = verify_all(*r);
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_HAS(problems[0], "rank_00000.safetensors");
  EXPECT_HAS(problems[0], "metadata records");
  io::remove_all(root);
}

// Rank files renamed among themselves, or one copied in from another save, keep their own
// checksums and shapes: a load that cuts pieces between ranks (tp 2 -> 4) under verify="free"
// read them unchecked and loaded rank 3's optimizer state as rank 2's (reproduced with `reshard
// convert --verify free` before the files recorded their rank). Each file's header now records its
// rank and the save's id, and the open refuses a file whose record disagrees with metadata.json.
TEST(NativeFormat, RankFilesSwappedOrFromAnotherSaveAreRefusedAtOpen) {
  const ModelConfig m = small_model();
  const std::string root = testing::make_temp_dir("native_ident_"), other = testing::make_temp_dir("native_ident2_");
  const Topology topo = Topology::parse("tp=2,dp=2,zero=1");
  synth_checkpoint(root, m, topo, 5);
  synth_checkpoint(other, m, topo, 5);  // the same values, another save
  const std::string step = io::join(root, "step-1");
  auto file = [&](int r) { return io::join(step, "rank_0000" + std::to_string(r) + ".safetensors"); };
  auto swap = [&](int a, int b) { testing::swap_files(file(a), file(b)); };
  ASSERT_EQ(std::filesystem::file_size(file(2)), std::filesystem::file_size(file(3)));
  swap(2, 3);
  std::string msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, file(2) + ": the file holds the buffers of rank '3'");
  EXPECT_HAS(msg, "metadata.json puts rank 2's buffers in it: rank files were renamed, swapped");
  swap(2, 3);
  ASSERT_NO_THROW(open_checkpoint(root));
  // The same rank's file from another save of the same values: every checksum would pass.
  std::filesystem::copy_file(file(1), step + "/keep");
  std::filesystem::copy_file(io::join(other, "step-1/rank_00001.safetensors"), file(1),
                             std::filesystem::copy_options::overwrite_existing);
  msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, file(1) + ": the file was written by another save than metadata.json (save id '");
  EXPECT_HAS(msg, "copied in from another checkpoint");
  std::filesystem::rename(step + "/keep", file(1));
  ASSERT_NO_THROW(open_checkpoint(root));

  // A header with a save id but no rank (the record is all or nothing), and long or multi-line
  // values: one line, each value cut at 40 bytes.
  {
    std::filesystem::copy_file(file(2), step + "/keep");
    std::string bytes = io::read_text(file(2));
    const size_t at = bytes.find("\"rank\":\"2\",");
    ASSERT_NE(at, std::string::npos);
    bytes.replace(at, 11, std::string(11, ' '));
    std::ofstream(file(2), std::ios::binary | std::ios::trunc) << bytes;
    msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
    EXPECT_HAS(msg, file(2) + ": the file's safetensors header records no rank and save id '");
    std::filesystem::rename(step + "/keep", file(2));
  }
  // A rank value of 60 bytes with a line separator and an escape sequence (the header rewritten,
  // its data untouched): one line, the value quoted and cut at 40 bytes.
  {
    std::filesystem::copy_file(file(2), step + "/keep");
    std::string bytes = io::read_text(file(2));
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    json h = json::parse(bytes.substr(8, size_t(n)));
    h["__metadata__"]["rank"] = "2\xe2\x80\xa8" "X\x1b[31m" + std::string(50, 'y');
    std::string text = h.dump();
    text.append((8 - (8 + text.size()) % 8) % 8, ' ');
    const uint64_t m2 = text.size();
    std::string out(reinterpret_cast<const char*>(&m2), 8);
    out += text + bytes.substr(8 + size_t(n));
    std::ofstream(file(2), std::ios::binary | std::ios::trunc) << out;
    msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_HAS(msg, "the file holds the buffers of rank '2\\u2028X\\x1b[31myyy");
    EXPECT_HAS(msg, "' (60 bytes, cut) (its safetensors header's __metadata__ says so)");
    std::filesystem::rename(step + "/keep", file(2));
  }
  EXPECT_EQ(detail::one_line("a\nb\x1b[31m\xe2\x80\xa8" "c\xc2\x85" "d\x7f"), "a\\x0ab\\x1b[31m\\u2028c\\u0085d\\x7f");
  EXPECT_EQ(detail::one_line("plain caf\xc3\xa9 \xe2\x80\x94 ok"), "plain caf\xc3\xa9 \xe2\x80\x94 ok");
  // Files of earlier writers: rank and save, no layout digest. Open as before
  // (identity checked, the digest not compared).
  {
    const std::string layout_now = native::layout_digest(open_checkpoint(root)->source().layout);
    for (int r = 0; r < 4; ++r) std::filesystem::copy_file(file(r), file(r) + ".keep");
    for (int r = 0; r < 4; ++r) {
      std::string bytes = io::read_text(file(r));
      const std::string rec = "\"layout\":\"" + layout_now + "\",";
      const size_t at = bytes.find(rec);
      ASSERT_NE(at, std::string::npos) << file(r);
      bytes.replace(at, rec.size(), std::string(rec.size(), ' '));
      std::ofstream(file(r), std::ios::binary | std::ios::trunc) << bytes;
    }
    auto opened = open_checkpoint(root);
    EXPECT_TRUE(verify_all(*opened).empty());
    opened.reset();
    for (int r = 0; r < 4; ++r) std::filesystem::rename(file(r) + ".keep", file(r));
  }
  // Checkpoints written before the files recorded rank and save (no "save" in metadata.json, only
  // "format" in __metadata__) open and verify as before; a file that has the record next to a
  // metadata.json that has none is from another save.
  const std::string meta = io::join(step, "metadata.json");
  json j = json::parse(io::read_text(meta));
  ASSERT_TRUE(j.contains("save"));
  const std::string save = j["save"];
  const std::string layout = native::layout_digest(open_checkpoint(root)->source().layout);
  j.erase("save");
  store_json(meta, j);
  msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, "(save id '" + save + "' in the file's header, none in metadata.json)");
  for (int r = 0; r < 4; ++r) {
    std::string bytes = io::read_text(file(r));
    const std::string rec = ",\"layout\":\"" + layout + "\",\"rank\":\"" + std::to_string(r) + "\",\"save\":\"" + save + "\"";
    const size_t at = bytes.find(rec);
    ASSERT_NE(at, std::string::npos) << file(r);
    ASSERT_LT(at, 200u) << "the record is in the header's __metadata__";
    bytes.replace(at, rec.size(), std::string(rec.size(), ' '));  // JSON whitespace: sizes stay
    std::ofstream(file(r), std::ios::binary | std::ios::trunc) << bytes;
  }
  auto r = open_checkpoint(root);
  EXPECT_TRUE(verify_all(*r).empty());
  io::remove_all(root);
  io::remove_all(other);
}

TEST(NativeFormat, MetadataDisagreeingWithDataFiles) {
  const ModelConfig m = small_model();
  const std::string root = testing::make_temp_dir("native_meta_");
  const std::string meta = io::join(root, "step-1/metadata.json");
  auto fresh = [&] {
    io::remove_all(io::join(root, "step-1"));
    synth_checkpoint(root, m, Topology::parse("tp=2,dp=1,zero=1"), 5);
    return load_json(meta);
  };
  // The error opening the checkpoint raises once `text` is its metadata.json.
  auto refused_text = [&](ErrorCode code, const std::string& text) {
    { std::ofstream(meta, std::ios::trunc | std::ios::binary) << text; }
    return expect_error(code, [&] { open_checkpoint(root); });
  };
  // ... once `edit` changed a fresh checkpoint's metadata (and, if it likes, its files).
  auto refused = [&](ErrorCode code, const std::function<void(json&)>& edit) {
    json j = fresh();
    edit(j);
    return refused_text(code, j.dump(1));
  };
  // `text` with `what` inserted right before the first `before`.
  auto inserted = [](std::string text, const std::string& before, const std::string& what) {
    const size_t at = text.find(before);
    EXPECT_NE(at, std::string::npos) << before;
    return at == std::string::npos ? text : text.insert(at, what);
  };

  // A piece pointing past the end of its buffer.
  std::string msg = refused(ErrorCode::kDataLoss, [](json& j) { j["pieces"][3]["base"] = int64_t(1) << 40; });
  EXPECT_HAS(msg, "metadata.json");
  EXPECT_HAS(msg, "pieces[3]");
  EXPECT_HAS(msg, "outside buffer");
  // A buffer larger than the tensor the file holds.
  std::string bname;
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    j["buffers"][0]["numel"] = j["buffers"][0]["numel"].get<int64_t>() + 1000;
    bname = j["buffers"][0]["name"];
  });
  EXPECT_HAS(msg, "rank_00000.safetensors");
  EXPECT_HAS(msg, bname);
  // A data file whose header points past its end, with metadata agreeing on the short size.
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    const std::string file = io::join(root, "step-1/rank_00001.safetensors");
    std::string bytes = io::read_text(file);
    bytes.resize(bytes.size() - 64);
    { std::ofstream(file, std::ios::trunc | std::ios::binary) << bytes; }
    for (auto& f : j["files"])
      if (f["name"] == "rank_00001.safetensors") f["bytes"] = bytes.size();
  });
  EXPECT_HAS(msg, "rank_00001.safetensors: buffer ");
  EXPECT_HAS(msg, "lies outside the file");
  // Labels edited so that they disagree with each other: every checksum still holds, and a load
  // would put one array's values in another. Two arrays' states swapped (exp_avg <-> exp_avg_sq
  // of one tensor), the buffers' states swapped with them, two tensors' names swapped (same shape).
  auto array_index = [](const json& j, const std::string& tensor, const std::string& state) {
    for (size_t i = 0; i < j["arrays"].size(); ++i)
      if (j["arrays"][i]["tensor"] == tensor && j["arrays"][i]["state"] == state) return i;
    ADD_FAILURE() << tensor << "/" << state;
    return size_t(0);
  };
  const std::string qkv0 = "layers.0.self_attention.query_key_value.weight", qkv1 = "layers.1.self_attention.query_key_value.weight";
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    std::swap(j["arrays"][array_index(j, qkv0, "exp_avg")]["state"], j["arrays"][array_index(j, qkv0, "exp_avg_sq")]["state"]);
  });
  EXPECT_HAS(msg, "metadata.json: field 'pieces[");
  EXPECT_HAS(msg, "does not belong in buffer exp_avg");
  EXPECT_HAS(msg, "the labels in this file were edited");
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    for (auto& a : j["arrays"])
      if (a["state"] == "exp_avg") a["state"] = "exp_avg_sq"; else if (a["state"] == "exp_avg_sq") a["state"] = "exp_avg";
    for (auto& b : j["buffers"])
      if (b["state"] == "exp_avg") b["state"] = "exp_avg_sq"; else if (b["state"] == "exp_avg_sq") b["state"] = "exp_avg";
  });
  EXPECT_HAS(msg, "metadata.json: field 'buffers[");
  EXPECT_HAS(msg, "' does not agree with its state 'exp_avg");
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    std::swap(j["arrays"][array_index(j, qkv0, "weight")]["tensor"], j["arrays"][array_index(j, qkv1, "weight")]["tensor"]);
  });
  EXPECT_HAS(msg, "does not belong in buffer weight/layers.");
  EXPECT_HAS(msg, "which holds weight values of layers.");
  // The same for the fp32 masters, which only a flat ZeRO partition holds (its name says state
  // and group, not tensor): flat_groups says where each tensor lies.
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    std::swap(j["arrays"][array_index(j, qkv0, "fp32")]["tensor"], j["arrays"][array_index(j, qkv1, "fp32")]["tensor"]);
  });
  EXPECT_HAS(msg, "/fp32 lies at flat elements [");
  EXPECT_HAS(msg, "of param group 0 of (pp 0, tp ");
  EXPECT_HAS(msg, "'s entry [");
  EXPECT_HAS(msg, "the labels in this file were edited");
  // One rank's buffers pointed at another rank's file (tp rank 1's buffers
  // read tp rank 0's bytes, whose pieces lie on the same byte ranges and passed their checksums).
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    for (auto& b : j["buffers"])
      if (b["rank"] == 1) b["file"] = "rank_00000.safetensors";
  });
  EXPECT_HAS(msg, ".file' is rank_00000.safetensors but buffer ");
  EXPECT_HAS(msg, " belongs to rank 1, whose data file is rank_00001.safetensors");
  // Geometry edited with every checksum kept: the `off` of two tp ranks'
  // pieces of one weight swapped loads the two halves swapped, and every label still agrees. The
  // layout digest each data file records (format.md §2) says metadata.json changed.
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    const size_t w = array_index(j, "layers.0.mlp.dense_4h_to_h.weight", "weight");
    std::vector<size_t> ps;
    for (size_t k = 0; k < j["pieces"].size(); ++k)
      if (j["pieces"][k]["array"] == w) ps.push_back(k);
    ASSERT_EQ(ps.size(), 2u);
    ASSERT_NE(j["pieces"][ps[0]]["off"], j["pieces"][ps[1]]["off"]);
    ASSERT_EQ(j["pieces"][ps[0]]["len"], j["pieces"][ps[1]]["len"]);
    std::swap(j["pieces"][ps[0]]["off"], j["pieces"][ps[1]]["off"]);
  });
  EXPECT_HAS(msg, "metadata.json of ");
  EXPECT_HAS(msg, "does not describe the layout its data files were saved with (layout digest '");
  EXPECT_HAS(msg, "was edited or damaged after the save");
  // A square piece's strides swapped: the same bytes read transposed.
  {
    const std::string root1 = testing::make_temp_dir("native_transpose_");
    synth_checkpoint(root1, m, Topology::parse("tp=1,dp=1,zero=0"), 5);
    const std::string meta1 = io::join(root1, "step-1/metadata.json");
    json j = load_json(meta1);
    bool done = false;
    for (auto& p : j["pieces"])
      if (!done && p["len"].size() == 2 && p["len"][0] == p["len"][1] && p["len"][0].get<int64_t>() > 1) {
        std::swap(p["strides"][0], p["strides"][1]);
        done = true;
      }
    ASSERT_TRUE(done) << "no square 2-D piece";
    store_json(meta1, j);
    msg = expect_error(ErrorCode::kDataLoss, [&] { open_checkpoint(root1); });
    EXPECT_HAS(msg, "does not describe the layout its data files were saved with");
    io::remove_all(root1);
  }
  // A field of the wrong type is named.
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["buffers"][2]["dtype"] = 7; });
  EXPECT_HAS(msg, "field 'buffers[2].dtype'");
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j.erase("topology"); });
  EXPECT_HAS(msg, "field 'topology' is missing");
  // Not JSON at all: the message says where (nlohmann's line and column).
  msg = refused_text(ErrorCode::kDataLoss, "{\n \"format\": nope}");
  EXPECT_HAS(msg, "metadata.json is not valid JSON");
  EXPECT_HAS(msg, "line 2, column");
  // A byte order mark, and a key given twice (the first would count here, the last in Python's
  // json): refused, naming the key and where.
  const std::string clean = fresh().dump(1);
  msg = refused_text(ErrorCode::kDataLoss, "\xEF\xBB\xBF" + clean);
  EXPECT_HAS(msg, "byte order mark");
  msg = refused_text(ErrorCode::kDataLoss, inserted(clean, "\"checksum\"", "\"checksum\": \"md5\",\n "));
  EXPECT_HAS(msg, "key 'checksum' appears twice in the top-level object");
  msg = refused_text(ErrorCode::kDataLoss, inserted(clean, "\"base\"", "\"base\": 0,\n "));
  EXPECT_HAS(msg, "key 'base' appears twice in field 'pieces[0]'");
  // An integer past int64 is refused naming its field, not wrapped to a negative size.
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["buffers"][1]["numel"] = uint64_t(1) << 63; });
  EXPECT_HAS(msg, "field 'buffers[1].numel': integer out of range");
  // A negative file size.
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["files"][0]["bytes"] = -5; });
  EXPECT_HAS(msg, "field 'files[0].bytes': must not be negative");
  // A float where an integer belongs.
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["pieces"][3]["base"] = 1.5; });
  EXPECT_HAS(msg, "field 'pieces[3].base': expected an integer");
  // Elements of integer lists and keys of nested objects are named to the element (paths are
  // built only for messages; these pin them).
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["pieces"][4]["len"][0] = "2"; });
  EXPECT_HAS(msg, "field 'pieces[4].len[0]': expected an integer");
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["arrays"][1]["shape"][0] = uint64_t(1) << 63; });
  EXPECT_HAS(msg, "field 'arrays[1].shape[0]': integer out of range");
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["state"]["iteration"] = "seven"; });
  EXPECT_HAS(msg, "field 'state.iteration': expected an integer");
  msg = refused_text(ErrorCode::kDataLoss, inserted(clean, "\"offset\"", "\"offset\": 0,\n "));
  EXPECT_HAS(msg, "key 'offset' appears twice in field 'flat_groups[0][0].entries[0]'");
  // A piece without its checksum (deleted, emptied, not hex): refused at open, since a piece with
  // no checksum would load unchecked even under verify="full".
  for (const json& bad : {json(nullptr), json(""), json("D432FF013EDDF4C8"), json("d432ff01")}) {
    msg = refused(ErrorCode::kDataLoss, [&](json& j) {
      if (bad.is_null()) j["pieces"][5].erase("xxh3");
      else j["pieces"][5]["xxh3"] = bad;
    });
    EXPECT_HAS(msg, "field 'pieces[5].xxh3'");
    EXPECT_HAS(msg, "16 lowercase hex digits");
  }
  msg = refused(ErrorCode::kUnsupported, [](json& j) { j["checksum"] = "md5"; });
  EXPECT_HAS(msg, "field 'checksum' is 'md5'");
  // Two pieces over the same elements of one buffer, each with a matching checksum (the second
  // given the first's base and checksum): one tensor's values would load into another.
  int a = -1, b = -1;
  {
    const json j = fresh();
    for (int k = 0; k < int(j["pieces"].size()) && b < 0; ++k) {
      const json& p = j["pieces"][k];
      if (a < 0) a = k;
      else if (p["buffer"] == j["pieces"][a]["buffer"] && p["len"] == j["pieces"][a]["len"]) b = k;
      else if (p["buffer"] != j["pieces"][a]["buffer"]) a = k;
    }
  }
  ASSERT_GE(b, 0) << "no two pieces of one shape in one buffer";
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    j["pieces"][b]["base"] = j["pieces"][a]["base"];
    j["pieces"][b]["xxh3"] = j["pieces"][a]["xxh3"];
  });
  EXPECT_HAS(msg, "overlap pieces[" + std::to_string(a) + "]");
  EXPECT_HAS(msg, "never share an element");
  // The same overlap by one element, with an empty piece sorted between the two.
  msg = refused(ErrorCode::kDataLoss, [&](json& j) {
    j["pieces"][b]["base"] = j["pieces"][a]["base"].get<int64_t>() + 1;
    json empty = j["pieces"][a];
    empty["base"] = j["pieces"][b]["base"];
    empty["len"][0] = 0;
    j["pieces"].push_back(empty);
  });
  EXPECT_HAS(msg, "field 'pieces[" + std::to_string(b) + "]'");
  EXPECT_HAS(msg, "overlap pieces[" + std::to_string(a) + "]");
  // Non-tensor state: counters below -1 (unknown) and a json that is not an object.
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["state"]["iteration"] = -7; });
  EXPECT_HAS(msg, "field 'state.iteration': must be -1 (unknown) or more");
  msg = refused(ErrorCode::kDataLoss, [](json& j) { j["state"]["json"] = json::array({1, 2}); });
  EXPECT_HAS(msg, "field 'state.json': expected an object");
  // A newer format version.
  msg = refused(ErrorCode::kUnsupported, [](json& j) { j["format_version"] = 2; });
  EXPECT_HAS(msg, "format_version 2");
  io::remove_all(root);
}

TEST(NativeFormat, PathTraversalIsRefused) {
  const ModelConfig m = small_model();
  const std::string root = testing::make_temp_dir("native_trav_");
  const std::string meta = io::join(root, "step-1/metadata.json");
  synth_checkpoint(root, m, Topology::parse("tp=2,dp=1,zero=1"), 5);
  const json orig = load_json(meta);
  // A decoy outside the step folder.
  io::write_text(io::join(root, "x.safetensors"), "decoy");
  for (const char* bad : {"../x.safetensors", "/etc/passwd", "sub/rank_00000.safetensors", "rank_0.safetensors",
                          "rank_00000.safetensors/../../x.safetensors"}) {
    SCOPED_TRACE(bad);
    json j = orig;
    j["files"][0]["name"] = bad;
    store_json(meta, j);
    std::string msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(root); });
    EXPECT_HAS(msg, bad);
    j = orig;
    j["buffers"][0]["file"] = bad;
    store_json(meta, j);
    msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(root); });
    EXPECT_HAS(msg, bad);
  }
  io::remove_all(root);
}

TEST(NativeOpen, PathCases) {
  const ModelConfig m = small_model();
  const Topology t = Topology::parse("tp=1,dp=2,zero=1");
  const std::string base = testing::make_temp_dir("native_open_");

  std::string msg = expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(base + "/nope"); });
  EXPECT_HAS(msg, base + "/nope");

  io::write_text(io::join(base, "afile"), "x");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(io::join(base, "afile")); });
  EXPECT_HAS(msg, "afile is a file; give the checkpoint folder");

  io::make_dirs(io::join(base, "empty"));
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(io::join(base, "empty")); });
  EXPECT_HAS(msg, "empty folder");

  io::make_dirs(io::join(base, "junk"));
  io::write_text(io::join(base, "junk/readme.txt"), "x");
  msg = expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(io::join(base, "junk")); });
  EXPECT_HAS(msg, "not a checkpoint folder");

  // Steps 10 and 20, then no latest.
  const std::string root = io::join(base, "ckpt");
  synth_checkpoint(root, m, t, 10, "step-10");
  synth_checkpoint(root, m, t, 20, "step-20");
  EXPECT_EQ(io::base_name(open_checkpoint(root)->path()), "step-20");
  {
    OpenOptions o;
    o.step = "20";
    auto r = open_checkpoint(root, o);
    EXPECT_EQ(io::base_name(r->path()), "step-20");
    EXPECT_EQ(r->state().step, 21);  // 1 + seed % 1000
    o.step = "10";
    EXPECT_EQ(io::base_name(open_checkpoint(root, o)->path()), "step-10");
    o.step = "step-10";
    EXPECT_EQ(open_checkpoint(root, o)->state().step, 11);
    o.step = "30";
    msg = expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(root, o); });
    EXPECT_HAS(msg, "step '30' not found");
    EXPECT_HAS(msg, "available steps: step-10, step-20");
    o.step = "2";  // never a prefix/substring match
    expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(root, o); });
  }
  // A step folder given directly.
  {
    auto r = open_checkpoint(io::join(root, "step-10"));
    EXPECT_EQ(r->state().step, 11);
    bool noted = false;
    for (const auto& n : r->notes()) noted |= n.find("a step folder was given; loading that step") != std::string::npos;
    EXPECT_TRUE(noted);
    OpenOptions o;
    o.step = "20";
    expect_error(ErrorCode::kInvalidArgument, [&] { open_checkpoint(io::join(root, "step-10"), o); });
  }
  // latest naming a missing step.
  io::write_text(io::join(root, "latest"), "step-99\n");
  msg = expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, io::join(root, "latest"));
  EXPECT_HAS(msg, "step-99");
  // No latest at all.
  ::unlink(io::join(root, "latest").c_str());
  msg = expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(root); });
  EXPECT_HAS(msg, "no `latest`");
  EXPECT_HAS(msg, "step-10, step-20");
  // Leftover temporaries of a crashed save are not steps.
  io::make_dirs(io::join(root, ".tmp-step-30-0123456789abcdef"));
  msg = expect_error(ErrorCode::kNotFound, [&] { open_checkpoint(root); });
  EXPECT_EQ(msg.find(".tmp"), std::string::npos) << msg;
  // DeepSpeed folders go to the DeepSpeed reader.
  const std::string ds = io::join(base, "ds");
  io::make_dirs(io::join(ds, "global_step5"));
  io::write_text(io::join(ds, "global_step5/mp_rank_00_model_states.pt"), "");
  io::write_text(io::join(ds, "latest"), "global_step5");
  for (const std::string& p : {ds, io::join(ds, "global_step5")}) {
    try {
      open_checkpoint(p);
    } catch (const Error& e) {
      // The stub (or a real reader failing on the empty file) answers, not the native reader.
      EXPECT_EQ(std::string(e.what()).find("metadata.json"), std::string::npos) << e.what();
    }
  }
  io::remove_all(base);
}

// Reads every buffer of the checkpoint at `root`, lets `edit` change a buffer's bytes, and saves
// them all as step-2 through the writer, so every checksum holds for the edited bytes.
void resave_edited(const std::string& root, const std::function<void(const Buffer&, std::vector<uint8_t>&)>& edit) {
  auto sound = open_checkpoint(root);
  const SourceLayout& s = sound->source();
  std::vector<std::vector<uint8_t>> mem(s.layout.buffers.size());
  std::vector<const void*> ptrs;
  for (size_t b = 0; b < s.layout.buffers.size(); ++b) {
    const Buffer& buf = s.layout.buffers[b];
    mem[b].resize(size_t(buf.numel) * dtype_size(buf.dtype));
    sound->read(s.locations[b].file, s.locations[b].byte_offset, mem[b].size(), mem[b].data());
    edit(buf, mem[b]);
    ptrs.push_back(mem[b].data());
  }
  save_native_all_ranks(root, "step-2", s.layout, ptrs, sound->state());
}

// check_weights_against_master within a budget smaller than a tensor compares it a range of
// The load's comparison (replicas compared by the load itself) straight out of the file mappings
// gives what the consolidating path gives: the same findings, in the same order, over the same
// tensors and elements, for every split into parts; `direct` tensors took the direct path (-1:
// some but not all).
void expect_direct_equals_consolidated(const CheckpointReader& ck, int64_t direct) {
  for (int parts : {1, 2, 3}) {
    SCOPED_TRACE("parts " + std::to_string(parts));
    int64_t checked = 0, direct_seen = 0;
    for (int part = 0; part < parts; ++part) {
      MasterCheckOptions slow, fast;
      slow.replicas = fast.replicas = false;
      slow.direct = false;
      slow.part = fast.part = part;
      slow.parts = fast.parts = parts;
      const MasterCheck s = check_weights_against_master(ck, slow), f = check_weights_against_master(ck, fast);
      EXPECT_EQ(s.tensors_direct, 0);
      ASSERT_EQ(f.mismatches.size(), s.mismatches.size());
      for (size_t i = 0; i < s.mismatches.size(); ++i) EXPECT_EQ(f.mismatches[i].to_string(), s.mismatches[i].to_string());
      EXPECT_EQ(f.tensors_checked, s.tensors_checked);
      EXPECT_EQ(f.elements_checked, s.elements_checked);
      checked += f.tensors_checked;
      direct_seen += f.tensors_direct;
    }
    if (direct >= 0) EXPECT_EQ(direct_seen, direct);
    else EXPECT_TRUE(direct_seen > 0 && direct_seen < checked) << direct_seen << " of " << checked;
    EXPECT_GT(checked, 0);
  }
}

// local rows at a time. One bf16 ulp edited in a late row of tp rank 1's word embeddings (seen
// through the writer, so every checksum holds) is found at its index in that rank's shard, with
// the same finding as one pass over the whole tensor, and no more than the budget held at once.
TEST(NativeSynth, WeightsAgainstMasterInRowRangesFindALateRowEdit) {
  ModelConfig m = small_model();
  m.vocab = 500;  // 504 padded rows x 16: word embeddings 504 x 16 x 6 B = 48 KB (two tp shards)
  const std::string root = testing::make_temp_dir("master_rows_");
  synth_checkpoint(root, m, Topology::parse("tp=2,pp=1,dp=1,zero=1"), 11);
  const std::string tensor = "embedding.word_embeddings.weight";
  int64_t rows = 0;
  resave_edited(root, [&](const Buffer& buf, std::vector<uint8_t>& bytes) {
    if (buf.rank != 1 || buf.name != "weight/" + tensor) return;
    rows = buf.numel / m.hidden;
    bytes[size_t((rows - 3) * m.hidden + 5) * 2] ^= 1;  // [rows - 3, 5], low bit of the bf16
  });
  ASSERT_GT(rows, 100);
  auto ck = open_checkpoint(root);
  ASSERT_NE(ck->path().find("step-2"), std::string::npos);
  MasterCheckOptions whole, cut;
  cut.memory_budget = 4096;  // 21 rows of both shards' weights and masters
  const MasterCheck a = check_weights_against_master(*ck, whole), b = check_weights_against_master(*ck, cut);
  ASSERT_EQ(a.mismatches.size(), 1u);
  const MasterMismatch& mm = a.mismatches[0];
  EXPECT_EQ(mm.tensor, tensor);
  EXPECT_EQ(mm.tp_rank, 1);
  EXPECT_EQ(mm.differing, 1);
  EXPECT_EQ(mm.compared, rows * m.hidden);
  EXPECT_EQ(mm.first, "[" + std::to_string(rows - 3) + ", 5]");
  ASSERT_EQ(b.mismatches.size(), 1u);
  EXPECT_EQ(b.mismatches[0].to_string(), mm.to_string());
  EXPECT_EQ(b.tensors_checked, a.tensors_checked);
  EXPECT_EQ(b.elements_checked, a.elements_checked);
  EXPECT_GT(a.peak_bytes_held, cut.memory_budget);
  EXPECT_LE(b.peak_bytes_held, cut.memory_budget);
  expect_direct_equals_consolidated(*ck, a.tensors_checked);
  std::filesystem::remove_all(root);
}

// Fused tensors are cut by element ranges of their stored order too: SwiGLU dense_h_to_4h's
// layout array is [2, ffn/tp, hidden] and a grouped QKV's [groups, ...], so cutting the layout
// array's dim 0 held a whole half or query group (270 MB for one llama2-7b layer at a 64 MiB
// budget). A budget smaller than one matrix row makes every range start and end mid-row, and
// the legacy QKV (version 0) has permuted strides.
TEST(NativeSynth, WeightsAgainstMasterInElementRangesCutFusedTensorsWithinTheBudget) {
  ModelConfig legacy = small_model();
  legacy.query_groups = 0;
  legacy.qkv_version = 0;
  legacy.param_dtype = DType::F16;
  for (const ModelConfig& m : {small_model(), legacy}) {
    SCOPED_TRACE(m.qkv_version);
    const std::string root = testing::make_temp_dir("master_fused_");
    synth_checkpoint(root, m, Topology::parse("tp=2,pp=1,dp=1,zero=1"), 5);
    // One flipped low bit in tp rank 1's weight shard of each of these, at element `at` of the
    // shard (from its end when negative): the up half of SwiGLU, a middle query group.
    const std::vector<std::pair<std::string, int64_t>> edits = {{"layers.1.mlp.dense_h_to_4h.weight", -7},
                                                                {"layers.2.self_attention.query_key_value.weight", 100}};
    std::map<std::string, std::string> first;  // tensor -> expected first index
    const std::vector<TensorSpec> tensors = open_checkpoint(root)->source().layout.tensors;
    resave_edited(root, [&](const Buffer& buf, std::vector<uint8_t>& bytes) {
      for (const auto& [tensor, at] : edits) {
        if (buf.rank != 1 || buf.name != "weight/" + tensor) continue;
        const int64_t e = at < 0 ? buf.numel + at : at;
        bytes[size_t(e) * 2] ^= 1;
        const auto t = std::find_if(tensors.begin(), tensors.end(), [&](const TensorSpec& x) { return x.name == tensor; });
        ASSERT_NE(t, tensors.end()) << tensor;
        const std::vector<int64_t> shape = tp_shard(*t, m, 2, 1).local_shape;
        ASSERT_EQ(shape.size(), 2u);
        first[tensor] = "[" + std::to_string(e / shape[1]) + ", " + std::to_string(e % shape[1]) + "]";
      }
    });
    ASSERT_EQ(first.size(), edits.size());
    auto ck = open_checkpoint(root);
    MasterCheckOptions whole, cut;
    cut.memory_budget = 100;  // 8 elements of both tp shards' weights and masters: under a row
    const MasterCheck a = check_weights_against_master(*ck, whole), b = check_weights_against_master(*ck, cut);
    ASSERT_EQ(a.mismatches.size(), edits.size());
    for (const MasterMismatch& mm : a.mismatches) {
      SCOPED_TRACE(mm.tensor);
      ASSERT_TRUE(first.count(mm.tensor));
      EXPECT_EQ(mm.tp_rank, 1);
      EXPECT_EQ(mm.differing, 1);
      EXPECT_EQ(mm.first, first[mm.tensor]);
    }
    ASSERT_EQ(b.mismatches.size(), a.mismatches.size());
    for (size_t i = 0; i < a.mismatches.size(); ++i) EXPECT_EQ(b.mismatches[i].to_string(), a.mismatches[i].to_string());
    EXPECT_EQ(b.tensors_checked, a.tensors_checked);
    EXPECT_EQ(b.elements_checked, a.elements_checked);
    EXPECT_LE(b.peak_bytes_held, cut.memory_budget);
    // The legacy QKV's permuted pieces are not in row-major order: those tensors go through the
    // consolidation, the others straight out of the mappings.
    expect_direct_equals_consolidated(*ck, m.qkv_version == 0 ? -1 : a.tensors_checked);
    std::filesystem::remove_all(root);
  }
}

// Two costs of the batching and the cut. A batch is sized by
// what its tensors hold at the checkpoint's tp: at tp 4 with 2 query groups (replicate_kv) every
// tp rank also holds its group's K and V rows, which a size taken from the global shape missed
// (a batch over the budget). And a replicated tensor cut into ranges has its copies compared
// once, not once per range: the bytes read are the same at every budget.
TEST(NativeSynth, WeightsAgainstMasterBatchesCountCopiedKvRowsAndCompareReplicasOnce) {
  ModelConfig m = small_model();  // 2 query groups, replicate_kv
  m.vocab = 400;
  m.tied_embeddings = true;
  const std::string root = testing::make_temp_dir("master_batches_");
  synth_checkpoint(root, m, Topology::parse("tp=4,pp=1,dp=1,zero=1"), 9);
  auto ck = open_checkpoint(root);
  MasterCheckOptions whole;
  whole.memory_budget = uint64_t(1) << 40;
  const MasterCheck a = check_weights_against_master(*ck, whole);
  EXPECT_TRUE(a.mismatches.empty());
  for (uint64_t budget : {uint64_t(333), uint64_t(4000), uint64_t(12345)}) {
    SCOPED_TRACE(budget);
    MasterCheckOptions o;
    o.memory_budget = budget;
    const MasterCheck b = check_weights_against_master(*ck, o);
    EXPECT_LE(b.peak_bytes_held, budget);
    EXPECT_EQ(b.elements_checked, a.elements_checked);
    EXPECT_EQ(b.bytes_read, a.bytes_read);
    EXPECT_TRUE(b.mismatches.empty());
  }
  std::filesystem::remove_all(root);
}

TEST(NativeSynth, SameSeedSameModelAtAnyLayout) {
  ModelConfig m = small_model();
  m.vocab = 45;  // padded differently at tp=1 and tp=4
  ModelConfig legacy = small_model();  // QKV version 0: permuted strides
  legacy.query_groups = 0;
  legacy.qkv_version = 0;
  legacy.tied_embeddings = true;
  legacy.param_dtype = DType::F16;
  const uint64_t seed = 77;
  const std::string base = testing::make_temp_dir("native_synth_");
  for (const char* topo : {"tp=1,dp=1,zero=0", "tp=2,pp=2,dp=2,zero=1", "tp=4,dp=1,zero=2", "tp=1,dp=3,zero=3",
                           "legacy:tp=2,pp=2,dp=1,zero=1", "legacy:tp=4,dp=2,zero=1"}) {
    SCOPED_TRACE(topo);
    std::string name = topo;
    const bool is_legacy = name.rfind("legacy:", 0) == 0;
    if (is_legacy) name = name.substr(7);
    const ModelConfig& model = is_legacy ? legacy : m;
    const std::string root = io::join(base, topo);
    synth_checkpoint(root, model, Topology::parse(name), seed);
    auto r = open_checkpoint(root);
    EXPECT_TRUE(verify_all(*r).empty());
    EXPECT_EQ(r->state().step, int64_t(1 + seed % 1000));
    EXPECT_EQ(r->state().iteration, r->state().step);
    EXPECT_EQ(r->state().consumed_samples, 8 * r->state().step);
    EXPECT_EQ(int(r->state().per_rank.size()), Topology::parse(name).world_size());
    const auto& s = r->source();
    int64_t checked = 0;
    for (const Piece& p : s.layout.pieces) {
      const LogicalArray& a = s.layout.arrays[p.array];
      const Buffer& b = s.layout.buffers[p.buffer];
      auto [off, len] = piece_bytes(s, p);
      std::vector<uint8_t> bytes(len);
      r->read(s.locations[p.buffer].file, off, len, bytes.data());
      testing::for_each_index(p.box, [&](const std::array<int64_t, kMaxDims>& g, int64_t) {
        int64_t e = 0;
        for (int d = 0; d < p.box.ndim; ++d) e += (g[d] - p.box.off[d]) * p.strides[d];
        float got;
        convert_elements(bytes.data() + e * dtype_size(b.dtype), b.dtype, &got, DType::F32, 1);
        float want = synth_value(seed, a.tensor, a.state, synth_linear_index(a, g));
        ASSERT_TRUE(std::isfinite(want));
        if (a.state == StateKind::kExpAvgSq) {
          ASSERT_GE(want, 0.f);
        }
        if (b.dtype != DType::F32) {  // the stored weight is the downcast of the master
          uint16_t h;
          convert_elements(&want, DType::F32, &h, b.dtype, 1);
          convert_elements(&h, b.dtype, &want, DType::F32, 1);
        }
        ASSERT_EQ(0, std::memcmp(&got, &want, 4)) << a.key() << " at " << g[0];
        ++checked;
      });
    }
    EXPECT_GT(checked, 0);
    // Weights equal the downcast master.
    EXPECT_EQ(synth_value(seed, "x", StateKind::kWeight, 5), synth_value(seed, "x", StateKind::kMaster, 5));
    EXPECT_NE(synth_value(seed, "x", StateKind::kExpAvg, 5), synth_value(seed, "x", StateKind::kMaster, 5));
  }
  io::remove_all(base);
}

// Synthesises about 0.93 GB (GPT with hidden 1024, 4 layers, fp32 masters + moments) and times it.
// Run with --gtest_also_run_disabled_tests.
TEST(NativeSynth, DISABLED_TimingOneGigabyte) {
  ModelConfig m;
  m.name = "timing";
  m.num_layers = 4;
  m.hidden = 1024;
  m.heads = 16;
  m.ffn = 4096;
  m.vocab = 8000;
  m.param_dtype = DType::BF16;
  const Topology t = Topology::parse("tp=2,pp=2,dp=2,zero=1");
  const std::string root = testing::make_temp_dir("native_timing_");
  auto t0 = std::chrono::steady_clock::now();
  synth_checkpoint(root, m, t, 1);
  auto t1 = std::chrono::steady_clock::now();
  auto r = open_checkpoint(root);
  uint64_t bytes = 0;
  for (const auto& f : r->source().files) bytes += io::file_size(f);
  auto t2 = std::chrono::steady_clock::now();
  auto problems = verify_all(*r);
  auto t3 = std::chrono::steady_clock::now();
  EXPECT_TRUE(problems.empty());
  auto sec = [](auto a, auto b) { return std::chrono::duration<double>(b - a).count(); };
  std::printf("synth %.3f GB in %.2f s (%.2f GB/s); open %.3f s; verify_all %.2f s\n", bytes / 1e9, sec(t0, t1),
              bytes / 1e9 / sec(t0, t1), sec(t1, t2), sec(t2, t3));
  io::remove_all(root);
}

}  // namespace
}  // namespace reshard
