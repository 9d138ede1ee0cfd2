// Loading into CUDA device buffers (library `reshard_cuda`, built by cmake/nccl.cmake where the
// CUDA toolkit is found). No CUDA type appears here: device buffers are plain pointers returned by
// cudaMalloc (or torch's CUDA allocator), streams are never exposed.
//
//   std::vector<void*> dev = ...;                       // one slot per target buffer, null if not ours
//   reshard::CudaLoadStats cs;
//   reshard::LoadReport r = reshard::load_to_cuda(*ckpt, target, dev, comm, {}, {}, &cs);
//
// Paths (docs/gpu.md):
//  - "direct" (no fragment crosses ranks; always at world size 1): io threads read fragment chunks
//    straight into pinned host slots (or let the GPU copy them out of a registered read-only mmap
//    of the file), each thread copies its slot to the GPU on its own stream while it reads the
//    next; packing/strides and dtype conversion run on the GPU;
//  - "host" (fragments cross ranks): the executor loads into pinned host mirrors of the buffers
//    and every finished buffer (ExecOptions::on_buffer_done) is copied to the GPU asynchronously
//    while later waves are still read; the exchange runs over `comm` (MPI, NCCL, torch).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/comm.h"
#include "reshard/layout.h"
#include "reshard/reshard.h"

namespace reshard {

struct CudaLoadOptions {
  /// CUDA device of the buffers; -1: the calling thread's current device.
  int device = -1;
  /// Reader threads of the direct path (each with its own stream and pinned slots); 0: 16.
  int io_threads = 0;
  /// Bytes per pinned slot (one read + one host-to-device copy); fragments are cut to this size.
  uint64_t chunk_bytes = uint64_t(64) << 20;
  /// Pinned slots per reader thread (2: read the next chunk while the last one is copied).
  int slots_per_thread = 2;
  /// Where the direct path's bytes come from:
  ///  "pread": positioned reads into pinned slots (CPU copies out of the page cache);
  ///  "mmap":  the GPU copies straight out of a read-only mmap of the file registered with
  ///           cudaHostRegister(ReadOnly), for fragments contiguous in the file (the others use
  ///           pread); no CPU copy, but stored checksums cannot be checked on the way
  ///           (LoadOptions::verify "full" with "mmap" is Error(kInvalidArgument));
  ///  "auto":  "pread".
  std::string source = "auto";
  /// Force the host path even when the direct path applies (tests, comparisons).
  bool force_host_path = false;
};

struct CudaLoadStats {
  std::string path;               // "direct" or "host"
  std::string source;             // "pread" or "mmap"
  int device = -1;
  int io_threads = 0;
  uint64_t h2d_bytes = 0;         // bytes copied host -> device
  uint64_t gpu_converted_bytes = 0;  // target bytes written by a conversion / scatter kernel
  uint64_t pinned_bytes = 0;      // pinned host memory held during the load
  uint64_t chunks = 0;            // slot-sized work items
  uint64_t registered_bytes = 0;  // mmap path: bytes registered with cudaHostRegister
  double setup_seconds = 0;       // pinned allocation / registration / device scratch
  double copy_seconds = 0;        // reads + copies until the last copy finished
};

/// True when a CUDA device can be used (driver and device present).
bool cuda_available();

/// Plans and loads this rank's buffers of `target` into device memory. Collective over `comm`.
/// `device_buffers[i]` is the device pointer of target.buffers[i] when it belongs to comm.rank()
/// (numel * dtype_size bytes on CudaLoadOptions::device), else null. Errors as reshard::load;
/// CUDA failures raise Error(kInternal) with the CUDA error string, or kFailedPrecondition once
/// device buffers were partly written. Returns after every byte is on the device.
LoadReport load_to_cuda(const CheckpointReader& checkpoint, const Layout& target,
                        const std::vector<void*>& device_buffers, Communicator& comm,
                        const LoadOptions& options = {}, const CudaLoadOptions& cuda = {},
                        CudaLoadStats* stats = nullptr);

/// Frees the pinned host slots, device scratch and streams the direct path keeps between loads
/// (they are allocated on the first load and reused while the options stay the same).
void cuda_release_staging();

}  // namespace reshard
