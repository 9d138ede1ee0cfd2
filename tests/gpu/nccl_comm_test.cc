// The NCCL communicator at world size 1 (one GPU) against the shared conformance cases, its
// bootstraps (unique id, through another communicator) and the device-pointer all-to-all-v.
// Built by cmake/nccl.cmake; run on a GPU machine (benchmarks/gpu_check.sh).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm_conformance.h"
#include "reshard/comm.h"
#include "reshard/comm_nccl.h"
#include "reshard/error.h"

namespace reshard {
namespace {

namespace conf = conformance;

std::unique_ptr<NcclCommunicator> make_one() {
  return make_nccl_communicator(nccl_unique_id(), 0, 1, NcclOptions{0, uint64_t(1) << 20, 60});
}

class CommNccl : public ::testing::Test {
 protected:
  void SetUp() override {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
    c = make_one();
  }
  std::unique_ptr<NcclCommunicator> c;
};

TEST_F(CommNccl, Identity) {
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->name(), "nccl");
  EXPECT_FALSE(c->nccl_version().empty());
  std::printf("NCCL %s on device %d\n", c->nccl_version().c_str(), c->device());
}

TEST_F(CommNccl, BootstrapThroughAnotherCommunicator) {
  auto local = make_local_communicator();
  auto n = make_nccl_communicator(*local, NcclOptions{0, uint64_t(1) << 20, 60});
  EXPECT_EQ(n->size(), 1);
  EXPECT_EQ(n->all_reduce_sum(41), 41);
}

TEST(CommNcclIds, UniqueIdIs128BytesAndFresh) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) GTEST_SKIP() << "no CUDA device";
  const std::string a = nccl_unique_id(), b = nccl_unique_id();
  EXPECT_EQ(a.size(), 128u);
  EXPECT_NE(a, b);
  EXPECT_THROW(make_nccl_communicator(std::string(5, 'x'), 0, 1), Error);
}

// Staging of 1 MiB: the random case crosses chunk boundaries with counts up to 3 MB.
TEST_F(CommNccl, AllToAllRandom) { conf::all_to_all_random(*c, conf::shared_seed(*c, "CommNccl.AllToAllRandom"), 20, 3000000); }

TEST_F(CommNccl, AllToAllInPlace) {
  std::vector<uint8_t> buf = {1, 2, 3, 4};
  c->all_to_all_v(buf.data(), {4}, {0}, buf.data(), {4}, {0});
  EXPECT_EQ(buf, (std::vector<uint8_t>{1, 2, 3, 4}));
}

TEST_F(CommNccl, AllToAllBig) {
  if (!std::getenv("RESHARD_TEST_BIG")) GTEST_SKIP() << "set RESHARD_TEST_BIG=1 (needs ~4.3 GB)";
  conf::all_to_all_big(*c, (uint64_t(1) << 31) + 4097);
}

TEST_F(CommNccl, AllToAllMismatch) { conf::all_to_all_mismatch(*c); }
TEST_F(CommNccl, AllToAllBadArguments) { conf::all_to_all_bad_arguments(*c); }

TEST_F(CommNccl, Broadcast) {
  conf::broadcast_random_groups(*c, conf::shared_seed(*c, "CommNccl.Broadcast"), 10, 3 << 20);
  conf::broadcast_invalid_group(*c);
}

TEST_F(CommNccl, AllReduce) { conf::all_reduce(*c); }
TEST_F(CommNccl, AllGatherStrings) { conf::all_gather_strings(*c, conf::shared_seed(*c, "CommNccl.AllGatherStrings")); }
TEST_F(CommNccl, Barrier) { conf::barrier(*c); }

TEST_F(CommNccl, AllToAllDevice) {
  const size_t n = (size_t(3) << 20) + 17;
  std::vector<uint8_t> host(n), back(n, 0);
  conf::fill_pattern(host.data(), n, 0, 0, 7);
  uint8_t *s = nullptr, *r = nullptr;
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&s), n + 64), cudaSuccess);
  ASSERT_EQ(cudaMalloc(reinterpret_cast<void**>(&r), n + 64), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(s + 5, host.data(), n, cudaMemcpyHostToDevice), cudaSuccess);
  c->all_to_all_v_device(s, {n}, {5}, r, {n}, {11});
  ASSERT_EQ(cudaMemcpy(back.data(), r + 11, n, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(conf::first_diff(back.data(), host.data(), n), -1);
  cudaFree(s);
  cudaFree(r);
}

}  // namespace
}  // namespace reshard
