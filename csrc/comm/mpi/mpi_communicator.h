// MPI implementation of reshard::Communicator. Internal header: it includes <mpi.h>.
//
// - The communicator works on its own duplicate of the given MPI_Comm, with MPI_ERRORS_RETURN set;
//   every MPI call is checked and a failure raises reshard::Error(kInternal) with MPI's own error
//   string, prefixed "[rank r/world]".
// - Every collective is built from nonblocking operations completed by an MPI_Testsome polling
//   loop (busy, with sched_yield) with a timeout: when none of the operations it waits on
//   completes for that long (default 300 s, env RESHARD_COMM_TIMEOUT_S, or
//   set_timeout_seconds()), so a long transfer that keeps progressing never times out, it raises Error(kFailedPrecondition, "[rank r/world] timed out after N s waiting
//   for rank(s) ... in <op>; a peer may have died"); pending receives are cancelled, and the
//   communicator refuses further calls (the caller is expected to abort the job, see abort_world)
//   and its MPI communicator is not freed (a pending nonblocking collective may still use it).
// - all_to_all_v first exchanges (bytes to send, bytes expected, chunk size) with every peer, and
//   all ranks agree (one small allreduce) on whether every pair is consistent; a mismatch raises
//   Error(kFailedPrecondition) on every rank, before any payload moves, and the communicator stays
//   usable. Payload goes as Isend/Irecv pairs of at most chunk_bytes (default 1 GiB, env
//   RESHARD_MPI_CHUNK_BYTES, or set_chunk_bytes()), so counts beyond 2^31 bytes per peer work.
// - broadcast over a subgroup is a pipelined binomial tree of point-to-point messages on the
//   duplicate communicator (tagged apart from all_to_all_v), so only the group's ranks take part.
//   `bytes` and the chunk size must agree across the group (not checked: a disagreement shows as
//   an MPI truncation error or a timeout); an invalid group raises locally, without sending.
// Not thread-safe: one thread at a time may use a communicator.
#pragma once

// reshard_mpi links MPI::MPI_C only: keep OpenMPI's / MPICH's deprecated C++ bindings out, or
// every C++ file including <mpi.h> needs libmpi_cxx. Include <mpi.h> through this header.
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reshard/comm.h"
#include "reshard/comm_mpi.h"

namespace reshard {

/// Concrete MPI communicator; obtain one with make_mpi_communicator().
class MpiCommunicator final : public Communicator {
 public:
  /// Collective over `comm` (MPI_Comm_dup). MPI must be initialised.
  explicit MpiCommunicator(MPI_Comm comm);
  ~MpiCommunicator() override;
  MpiCommunicator(const MpiCommunicator&) = delete;
  MpiCommunicator& operator=(const MpiCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_to_all_v(const void* send, const std::vector<uint64_t>& send_counts,
                    const std::vector<uint64_t>& send_displs, void* recv,
                    const std::vector<uint64_t>& recv_counts,
                    const std::vector<uint64_t>& recv_displs) override;
  void broadcast(void* data, uint64_t bytes, int root, const std::vector<int>& group) override;
  int64_t all_reduce_sum(int64_t value) override;
  int64_t all_reduce_max(int64_t value) override;
  std::vector<std::string> all_gather_strings(const std::string& mine) override;
  void barrier() override;

  /// Largest single MPI message in bytes (1 .. 2^31-1). Must be the same on every rank; for
  /// all_to_all_v this is checked, for broadcast it is the caller's duty. Tests use small values
  /// to exercise the chunked path cheaply.
  void set_chunk_bytes(uint64_t bytes);
  uint64_t chunk_bytes() const { return chunk_bytes_; }
  /// Time a collective may wait for peers before raising (seconds, > 0).
  void set_timeout_seconds(double seconds);
  double timeout_seconds() const { return timeout_s_; }
  /// The duplicated communicator this object owns.
  MPI_Comm comm() const { return comm_; }

 private:
  friend class MpiRequestSet;  // csrc/comm/mpi/mpi_communicator.cc
  void check(int rc, const char* call, const char* op) const;
  void check_usable(const char* op) const;
  std::string prefix() const;

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int size_ = 1;
  uint64_t chunk_bytes_;
  double timeout_s_;
  bool broken_ = false;
};

/// An MPI communicator over a duplicate of `comm` (collective over `comm`).
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm = MPI_COMM_WORLD);

/// Initialises MPI (MPI_Init_thread, MPI_THREAD_SERIALIZED requested) unless already initialised,
/// and finalises it on destruction if, and only if, this object initialised it.
class MpiSession {
 public:
  MpiSession() : MpiSession(nullptr, nullptr) {}
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
  bool owns_mpi() const { return owns_; }
  /// Thread level MPI provides (MPI_THREAD_*).
  int thread_level() const { return provided_; }

 private:
  bool owns_ = false;
  int provided_ = MPI_THREAD_SINGLE;
};

}  // namespace reshard
