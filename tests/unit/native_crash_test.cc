// kill -9 during saves: a child process saves checkpoints into one root over and over (new steps
// and overwrites of existing ones, through synth/save_native_all_ranks and through the collective
// save_native); the parent kills it with SIGKILL at random moments. After every kill the root must
// open, `latest` must name a complete step, and verify_all must find nothing wrong.
// Replay with RESHARD_TEST_SEED=<printed seed>.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "io/file.h"
#include "reshard/native.h"
#include "unit/core_harness.h"
#include "unit/test_util.h"

namespace reshard {
namespace {

ModelConfig crash_model() {
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

[[noreturn]] void child_loop(const std::string& root, uint64_t base_seed, uint64_t first) {
  try {
    const ModelConfig m = crash_model();
    DeriveOptions o;
    o.weights_on_dp0_only = true;
    const Layout single = derive_layout(m, Topology::parse("tp=1,dp=1,zero=1"), o);
    testing::MemCheckpoint mem(single);
    uint64_t x = base_seed;
    for (auto& b : mem.bufs)
      for (auto& c : b) c = uint8_t((x = x * 6364136223846793005ull + 1442695040888963407ull) >> 56);
    std::vector<const void*> ptrs;
    for (auto& b : mem.bufs) ptrs.push_back(b.data());
    auto comm = make_local_communicator();
    for (uint64_t i = first;; ++i) {
      const std::string step = "step-" + std::to_string(i % 3);  // overwrites existing steps too
      if (i % 2 == 0) {
        synth_checkpoint(root, m, Topology::parse("tp=2,dp=2,zero=1"), base_seed + i, step);
      } else {
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

// Checks values against the synth function where the state says which seed wrote them.
void spot_check_values(const CheckpointReader& r) {
  auto j = nlohmann::json::parse(r.state().json);
  if (!j.contains("synth")) return;
  const uint64_t seed = j["synth"]["seed"].get<uint64_t>();
  const auto& s = r.source();
  for (size_t p = 0; p < s.layout.pieces.size(); p += 7) {
    const Piece& pc = s.layout.pieces[p];
    const Buffer& b = s.layout.buffers[pc.buffer];
    if (b.dtype != DType::F32 || pc.box.numel() == 0) continue;
    const LogicalArray& a = s.layout.arrays[pc.array];
    float got;
    r.read(s.locations[pc.buffer].file, s.locations[pc.buffer].byte_offset + uint64_t(pc.base) * 4, 4, &got);
    const float want = synth_value(seed, a.tensor, a.state, synth_linear_index(a, pc.box.off));
    ASSERT_EQ(0, std::memcmp(&got, &want, 4)) << a.key() << " seed " << seed;
  }
}

TEST(NativeCrash, KillDuringSaveLeavesACompleteCheckpoint) {
  const uint64_t seed = testing::test_seed("NativeCrash.KillDuringSaveLeavesACompleteCheckpoint");
  std::mt19937_64 rng(seed);
  const std::string root = testing::make_temp_dir("native_crash_");
  const int kills = 10;
  std::vector<std::string> latest_seen;
  std::vector<int64_t> periods;
  for (int k = 0; k < kills; ++k) {
    SCOPED_TRACE("kill " + std::to_string(k));
    std::fflush(nullptr);
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) child_loop(root, uint64_t(k) * 1000 + 1, rng() % 6);
    // Wait for two completed saves of this child (each replaces `latest`, a new inode) to learn
    // the period of a save, then kill at a random moment within the next two periods.
    auto wait_for_new_latest = [&] {
      const uint64_t before = testing::latest_inode(root);
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (testing::latest_inode(root) == before && std::chrono::steady_clock::now() < deadline)
        std::this_thread::sleep_for(std::chrono::microseconds(500));
      return std::chrono::steady_clock::now();
    };
    const auto t1 = wait_for_new_latest();
    const auto t2 = wait_for_new_latest();
    const auto period = std::chrono::duration_cast<std::chrono::microseconds>(t2 - t1).count();
    periods.push_back(period);
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % uint64_t(2 * std::max<int64_t>(period, 1000))));
    ASSERT_EQ(::kill(pid, SIGKILL), 0);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the child ended by itself (status " << status << ")";

    const std::string latest = io::read_text(io::join(root, "latest"));
    latest_seen.push_back(latest);
    auto r = open_checkpoint(root);  // `latest` names a complete step
    auto problems = verify_all(*r);
    for (const auto& p : problems) ADD_FAILURE() << p;
    ASSERT_TRUE(problems.empty());
    spot_check_values(*r);
    // Every step folder that exists is complete (the others are dot-named temporaries).
    for (const auto& n : io::list_dir(root)) {
      if (n[0] == '.' || n == "latest") continue;
      OpenOptions o;
      o.step = n;
      auto rs = open_checkpoint(root, o);
      EXPECT_TRUE(verify_all(*rs).empty()) << n;
    }
  }
  std::string seen;
  for (auto& l : latest_seen) seen += l.substr(0, l.size() - 1) + " ";
  std::printf("latest after each kill: %s\n", seen.c_str());
  std::printf("save periods (ms):");
  for (auto p : periods) std::printf(" %.0f", p / 1000.0);
  std::printf("\n");
  io::remove_all(root);
}

}  // namespace
}  // namespace reshard
