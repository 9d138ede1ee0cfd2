// The local communicator (world of 1) against the shared conformance cases.
#include <gtest/gtest.h>

#include <cstdlib>

#include "comm_conformance.h"
#include "reshard/comm.h"
#include "reshard/error.h"

namespace reshard {
namespace {

namespace conf = conformance;

TEST(CommLocal, Identity) {
  auto c = make_local_communicator();
  EXPECT_EQ(c->rank(), 0);
  EXPECT_EQ(c->size(), 1);
  EXPECT_EQ(c->name(), "local");
}

TEST(CommLocal, AllToAllRandom) {
  auto c = make_local_communicator();
  conf::all_to_all_random(*c, conf::shared_seed(*c, "CommLocal.AllToAllRandom"), 20, 100000);
}

TEST(CommLocal, AllToAllInPlace) {
  auto c = make_local_communicator();
  std::vector<uint8_t> buf = {1, 2, 3, 4};
  c->all_to_all_v(buf.data(), {4}, {0}, buf.data(), {4}, {0});
  EXPECT_EQ(buf, (std::vector<uint8_t>{1, 2, 3, 4}));
}

TEST(CommLocal, AllToAllBig) {
  if (!std::getenv("RESHARD_TEST_BIG")) GTEST_SKIP() << "set RESHARD_TEST_BIG=1 (needs ~4.3 GB)";
  auto c = make_local_communicator();
  conf::all_to_all_big(*c, (uint64_t(1) << 31) + 4097);
}

TEST(CommLocal, AllToAllMismatch) {
  auto c = make_local_communicator();
  conf::all_to_all_mismatch(*c);
}

TEST(CommLocal, AllToAllBadArguments) {
  auto c = make_local_communicator();
  conf::all_to_all_bad_arguments(*c);
}

TEST(CommLocal, Broadcast) {
  auto c = make_local_communicator();
  conf::broadcast_random_groups(*c, conf::shared_seed(*c, "CommLocal.Broadcast"), 10, 4096);
  conf::broadcast_invalid_group(*c);
}

TEST(CommLocal, AllReduce) {
  auto c = make_local_communicator();
  conf::all_reduce(*c);
}

TEST(CommLocal, AllGatherStrings) {
  auto c = make_local_communicator();
  conf::all_gather_strings(*c, conf::shared_seed(*c, "CommLocal.AllGatherStrings"));
}

TEST(CommLocal, Barrier) {
  auto c = make_local_communicator();
  conf::barrier(*c);
}

}  // namespace
}  // namespace reshard
