// The NCCL communicator (library `reshard_nccl`, built by cmake/nccl.cmake where CUDA and NCCL
// are found; it defines RESHARD_HAVE_NCCL=1 for its users). No NCCL or CUDA type appears here.
//
// Bootstrap, one of:
//  - from any reshard communicator (MPI, the trainer's torch store / process group, local):
//    rank 0 makes the ncclUniqueId and broadcasts it over `bootstrap`:
//        auto mpi = reshard::make_world_communicator();
//        auto nccl = reshard::make_nccl_communicator(*mpi, {.device = local_rank});
//  - from a unique id the caller distributed itself (Python: through the trainer's TCPStore):
//        std::string id = reshard::nccl_unique_id();   // on one rank, then share the 128 bytes
//        auto nccl = reshard::make_nccl_communicator(id, rank, world, opts);
//
// The Communicator interface takes host pointers: they are staged through device buffers of
// NcclOptions::staging_bytes (chunked, so any size works). NcclCommunicator adds the same
// all-to-all-v on device pointers, for callers whose data already lives on the GPU.
//
// Errors raise reshard::Error(kInternal) with NCCL's / CUDA's own error string (and
// ncclGetLastError's detail), prefixed with "[rank r/world]"; a collective that does not finish
// within NcclOptions::timeout_seconds aborts the NCCL communicator and raises.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reshard/comm.h"

namespace reshard {

struct NcclOptions {
  /// CUDA device of this rank; -1: the calling thread's current device.
  int device = -1;
  /// Device staging per direction for host-pointer collectives (bytes).
  uint64_t staging_bytes = uint64_t(64) << 20;
  /// A collective still running after this long aborts the communicator (0: wait forever).
  double timeout_seconds = 600;
};

/// A fresh ncclUniqueId as NCCL_UNIQUE_ID_BYTES (128) bytes. Needs no GPU on the calling rank
/// beyond NCCL's own bootstrap (it opens a listening socket).
std::string nccl_unique_id();

class NcclCommunicator : public Communicator {
 public:
  /// all_to_all_v on device memory of this communicator's device (same contract as the host
  /// version). `stream` is a cudaStream_t or null for the communicator's own stream; the call
  /// returns once the exchange completed.
  virtual void all_to_all_v_device(const void* send, const std::vector<uint64_t>& send_counts,
                                   const std::vector<uint64_t>& send_displs, void* recv,
                                   const std::vector<uint64_t>& recv_counts,
                                   const std::vector<uint64_t>& recv_displs, void* stream = nullptr) = 0;
  /// NCCL's version as "2.28.3".
  virtual std::string nccl_version() const = 0;
  virtual int device() const = 0;
};

/// Collective over `size` processes that all pass the same 128-byte `unique_id`.
std::unique_ptr<NcclCommunicator> make_nccl_communicator(const std::string& unique_id, int rank, int size,
                                                         const NcclOptions& options = {});

/// Collective over `bootstrap`: rank 0 makes the id and broadcasts it; same ranks and size.
std::unique_ptr<NcclCommunicator> make_nccl_communicator(Communicator& bootstrap, const NcclOptions& options = {});

}  // namespace reshard
