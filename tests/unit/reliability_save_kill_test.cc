// Reliability: "never lose a checkpoint it saved". A child process saves a model over and over
// (new step names and overwrites of existing steps; synth_checkpoint and the collective
// save_native), and the parent kills it with SIGKILL at uniformly random moments, many times.
// After every kill: `latest` names a step that opens and verifies, every visible step folder
// verifies, the step `latest` named after the previous kill still verifies unless a newer
// complete save replaced it, and values match what the writer wrote. At the end a normal save
// into the littered root succeeds, loads, and removes the dead temporaries.
//
// Two sizes: a ~60 KB model whose saves take milliseconds, so each run lands kills in every phase
// of the protocol (rank files, metadata, rename, `latest`) many times within seconds; and a ~45 MB
// model whose kills land mostly inside the bulk data writes.
// Replay with RESHARD_TEST_SEED=<printed seed>; RESHARD_RELIABILITY_KILLS=<n> for longer runs.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "io/file.h"
#include "reshard/native.h"
#include "reshard/reshard.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

ModelConfig big() {
  ModelConfig m;
  m.name = "crash";
  m.num_layers = 4;
  m.hidden = 256;
  m.heads = 8;
  m.ffn = 1024;
  m.vocab = 5000;
  m.param_dtype = DType::BF16;
  return m;  // about 45 MB per checkpoint at the layouts below
}

ModelConfig tiny() {
  ModelConfig m;
  m.name = "kill";
  m.num_layers = 2;
  m.hidden = 16;
  m.heads = 4;
  m.ffn = 32;
  m.vocab = 40;
  m.vocab_divisible_by = 8;
  m.param_dtype = DType::BF16;
  return m;
}

[[noreturn]] void child_loop(const std::string& root, const ModelConfig& m, uint64_t seed0, uint64_t first) {
  try {
    DeriveOptions o;
    o.weights_on_dp0_only = true;
    const Layout single = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"), o);
    std::vector<std::vector<uint8_t>> bufs;
    for (const auto& b : single.buffers) bufs.emplace_back(size_t(b.numel) * dtype_size(b.dtype), 0);
    auto comm = make_local_communicator();
    for (uint64_t i = first;; ++i) {
      const std::string step = "step-" + std::to_string(i % 4);
      if (i % 2 == 0) {
        synth_checkpoint(root, m, Topology::parse("tp=2,dp=2,zero=1"), seed0 + i, step);
      } else {
        // Every byte of this save is (i + byte index) so a reader can tell which save wrote it.
        std::vector<const void*> ptrs;
        for (auto& b : bufs) {
          for (size_t k = 0; k < b.size(); ++k) b[k] = uint8_t(i + k);
          ptrs.push_back(b.data());
        }
        NonTensorState st;
        st.step = st.iteration = int64_t(i);
        save_native(root, step, single, ptrs, st, *comm);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "child: %s\n", e.what());
    ::_exit(3);
  }
}

// Opens root (or one step), verifies every checksum and the values the writer put there.
void check_step(const std::string& root, const std::string& step) {
  OpenOptions o;
  o.step = step;
  auto r = open_checkpoint(root, o);
  auto problems = verify_all(*r);
  for (const auto& p : problems) ADD_FAILURE() << step << ": " << p;
  const auto& s = r->source();
  auto j = nlohmann::json::parse(r->state().json);
  for (size_t p = 0; p < s.layout.pieces.size(); ++p) {
    const Piece& pc = s.layout.pieces[p];
    const Buffer& b = s.layout.buffers[pc.buffer];
    if (pc.box.numel() == 0) continue;
    const uint64_t at = s.locations[pc.buffer].byte_offset + uint64_t(pc.base) * dtype_size(b.dtype);
    if (j.contains("synth")) {
      if (b.dtype != DType::F32) continue;
      float got;
      r->read(s.locations[pc.buffer].file, at, 4, &got);
      const LogicalArray& a = s.layout.arrays[pc.array];
      const float want = synth_value(j["synth"]["seed"].get<uint64_t>(), a.tensor, a.state, synth_linear_index(a, pc.box.off));
      ASSERT_EQ(0, std::memcmp(&got, &want, 4)) << step << " " << a.key();
    } else {
      uint8_t got;
      r->read(s.locations[pc.buffer].file, at, 1, &got);
      ASSERT_EQ(got, uint8_t(uint64_t(r->state().step) + uint64_t(pc.base) * dtype_size(b.dtype)))
          << step << " " << b.name;
    }
  }
}

// Kills a saving child `kills` times (at least `min_kills`, then until `budget` is spent) and checks
// the root after each kill and after a final normal save.
void run_kills(const char* name, const ModelConfig& m, int kills, int min_kills, std::chrono::seconds budget) {
  const uint64_t seed = testing::test_seed(name);
  std::mt19937_64 rng(seed);
  const std::string root = testing::make_temp_dir("rel_kill_");
  if (const char* env = std::getenv("RESHARD_RELIABILITY_KILLS")) kills = std::atoi(env);
  const auto t_start = std::chrono::steady_clock::now();
  std::string prev_latest;
  int done = 0, ended_by_itself = 0;
  for (int k = 0; k < kills; ++k) {
    // Stay well inside the per-file budget on a loaded machine (at least 15 kills).
    if (k >= min_kills && std::chrono::steady_clock::now() - t_start > budget) break;
    SCOPED_TRACE("kill " + std::to_string(k) + " seed " + std::to_string(seed));
    std::fflush(nullptr);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) child_loop(root, m, uint64_t(k) * 1000 + 1, rng() % 8);
    // One completed save (a new `latest` inode) gives the period; kill uniformly within 2 periods.
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t before = testing::latest_inode(root);
    while (testing::latest_inode(root) == before && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    const int64_t period = std::max<int64_t>(
        200, std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count());
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % uint64_t(2 * period)));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    if (!WIFSIGNALED(status)) ++ended_by_itself;
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child ended by itself (status " << status << ")";

    const std::string latest = io::read_text(io::join(root, "latest"));
    std::string name = latest.substr(0, latest.find('\n'));
    check_step(root, name);
    for (const auto& n : io::list_dir(root)) {
      if (n[0] == '.' || n == "latest") continue;
      check_step(root, n);  // every visible step is complete
    }
    // The step `latest` named after the previous kill is still there (possibly replaced whole).
    if (!prev_latest.empty()) {
      EXPECT_TRUE(io::is_dir(io::join(root, prev_latest))) << prev_latest;
    }
    prev_latest = name;
    ++done;
  }
  EXPECT_GE(done, min_kills);
  // A normal save into the root littered with dead temporaries succeeds and loads.
  synth_checkpoint(root, m, Topology::parse("tp=1,dp=2,zero=1"), 99, "step-final");
  check_step(root, "step-final");
  {
    auto r = open_checkpoint(root);
    EXPECT_EQ(io::base_name(r->path()), "step-final");
    const Layout t = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"));
    std::vector<std::vector<uint8_t>> mem;
    std::vector<void*> ptrs;
    for (const auto& b : t.buffers) mem.emplace_back(size_t(b.numel) * dtype_size(b.dtype), 0);
    for (auto& m : mem) ptrs.push_back(m.data());
    auto comm = make_local_communicator();
    load(*r, t, ptrs, *comm);
  }
  int temporaries = 0;
  std::string names;
  for (const auto& n : io::list_dir(root))
    if (n[0] == '.') {
      ++temporaries;
      names += " " + n;
    }
  std::printf("%s: %d kills in %.1f s (seed %llu); leftover temporaries: %d\n", m.name.c_str(), done,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count(),
              (unsigned long long)seed, temporaries);
  // That save also removed the dead temporaries of the killed ones (each can be checkpoint-sized).
  EXPECT_EQ(temporaries, 0) << names;
  io::remove_all(root);
}

TEST(ReliabilitySaveKill, ManyRandomKillsNeverLoseTheLastCompleteCheckpoint) {
  // Stay well inside the per-file budget on a loaded machine (at least 15 kills).
  run_kills("ReliabilitySaveKill.ManyRandomKills", tiny(), 60, 15, std::chrono::seconds(18));
}

TEST(ReliabilitySaveKill, KillsInsideTheDataWritesOfALargerModel) {
  run_kills("ReliabilitySaveKill.KillsInsideTheDataWrites", big(), 10, 10, std::chrono::seconds(0));
}

}  // namespace
}  // namespace reshard
