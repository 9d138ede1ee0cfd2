// gtest main for the tests run under mpirun (tests/mpi/run.sh): initialises MPI, lets only rank 0
// print gtest's normal output (other ranks print only their failures, prefixed with their rank),
// and returns a status reduced over all ranks, so that a failure on any rank fails every rank.
#include <gtest/gtest.h>

#include <cstdio>

#include "comm/mpi/mpi_communicator.h"

namespace {

// Listener for ranks other than 0: silent except for failed assertions.
class FailuresOnly : public ::testing::EmptyTestEventListener {
 public:
  explicit FailuresOnly(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (!r.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 r.file_name() ? r.file_name() : "?", r.line_number(), r.message());
    std::fflush(stderr);
  }

 private:
  int rank_;
};

}  // namespace

int main(int argc, char** argv) {
  reshard::MpiSession session(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailuresOnly(rank));
  } else {
    std::printf("[mpi] world size %d\n", size);
  }
  int local = RUN_ALL_TESTS() != 0 ? 1 : 0;
  int global = local;
  MPI_Allreduce(&local, &global, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && global != local) {
    std::printf("[mpi] FAILED on another rank (see its [rank r] messages)\n");
  }
  std::fflush(stdout);
  return global;
}
