// The few collectives reshard uses, over bytes. Implementations: local (one process), MPI,
// torch ProcessGroup (Python side), NCCL (GPU). Communicators know bytes, not formats.
//
// Every call is collective over the communicator's world unless stated otherwise: every rank must
// call it, in the same order. Errors raise reshard::Error(kInternal or kFailedPrecondition) with the
// library's own error string kept (e.g. the MPI error text), prefixed with "[rank r/world]".
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace reshard {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// Human-readable name ("local", "mpi", "torch:gloo", "nccl").
  virtual std::string name() const = 0;

  /// All-to-all-v over bytes. Rank r sends send_counts[p] bytes starting at send + send_displs[p]
  /// to each rank p, and receives recv_counts[p] bytes from rank p into recv + recv_displs[p].
  /// Counts and displacements are in bytes and may exceed 2^31. The caller makes send/recv
  /// counts consistent (what r sends to p is what p expects from r); a mismatch is an Error.
  virtual void all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts,
                            const std::vector<uint64_t>& send_displs, void* recv,
                            const std::vector<uint64_t>& recv_counts,
                            const std::vector<uint64_t>& recv_displs) = 0;

  /// Broadcast `bytes` bytes from `root` to every rank in `group` (ranks of this communicator,
  /// sorted, containing the caller and root). Collective over `group` only.
  virtual void broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) = 0;

  /// Sum / max of one int64 over all ranks (status codes, byte counts).
  virtual int64_t all_reduce_sum(int64_t value) = 0;
  virtual int64_t all_reduce_max(int64_t value) = 0;

  /// Gathers one string from every rank onto every rank (error messages, plan hashes, tokens).
  virtual std::vector<std::string> all_gather_strings(const std::string& mine) = 0;

  virtual void barrier() = 0;
};

/// A communicator of one rank (rank 0 of world 1). Collectives are copies.
std::unique_ptr<Communicator> make_local_communicator();

}  // namespace reshard
