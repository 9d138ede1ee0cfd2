// The communicator of one process: rank 0 of a world of 1. Every collective is a copy (or nothing).
#include <cstring>
#include <string>
#include <vector>

#include "reshard/comm.h"
#include "reshard/error.h"

namespace reshard {
namespace {

class LocalCommunicator final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "local"; }

  void all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts,
                    const std::vector<uint64_t>& send_displs, void* recv,
                    const std::vector<uint64_t>& recv_counts,
                    const std::vector<uint64_t>& recv_displs) override {
    if (send_counts.size() != 1 || send_displs.size() != 1 || recv_counts.size() != 1 ||
        recv_displs.size() != 1) {
      fail(ErrorCode::kInvalidArgument, "[rank 0/1] all_to_all_v: count and displacement vectors ",
           "must have one entry per rank (1), got send_counts=", send_counts.size(),
           " send_displs=", send_displs.size(), " recv_counts=", recv_counts.size(),
           " recv_displs=", recv_displs.size());
    }
    if (send_counts[0] != recv_counts[0]) {
      fail(ErrorCode::kFailedPrecondition, "[rank 0/1] all_to_all_v count mismatch: rank 0 expects ",
           recv_counts[0], " bytes from rank 0, but rank 0 sends ", send_counts[0],
           " bytes to rank 0");
    }
    const uint64_t n = send_counts[0];
    if (n == 0) return;
    const char* src = static_cast<const char*>(send) + send_displs[0];
    char* dst = static_cast<char*>(recv) + recv_displs[0];
    if (src != dst) std::memmove(dst, src, n);
  }

  void broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) override {
    if (root != 0 || group.size() != 1 || group[0] != 0) {
      std::string g;
      for (int r : group) g += (g.empty() ? "" : ",") + std::to_string(r);
      fail(ErrorCode::kInvalidArgument, "[rank 0/1] broadcast: root ", root, " and group {", g,
           "} must be rank 0 of the local communicator");
    }
    // The root's data is already in place.
  }

  int64_t all_reduce_sum(int64_t value) override { return value; }
  int64_t all_reduce_max(int64_t value) override { return value; }
  std::vector<std::string> all_gather_strings(const std::string& mine) override { return {mine}; }
  void barrier() override {}
};

}  // namespace

std::unique_ptr<Communicator> make_local_communicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace reshard
