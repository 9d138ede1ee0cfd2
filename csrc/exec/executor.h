// The distributed executor: runs this rank's part of a plan. Collective over `comm`.
//
// Order of work (DESIGN.md "Pre-flight", "Execute"):
//  1. ranks agree on the plan hash;
//  2. pre-flight: every rank checks the files it will read (existence, size); replica
//     comparisons assigned to this rank run; the outcome is all-gathered, so a missing file or a
//     replica divergence fails on every rank, by name, before any target byte is written;
//  3. zero fills (vocab padding rows only the target has, flat-partition padding);
//  4. waves: read (thread pool: checksums checked on the mapped file, or positioned reads into
//     staging where the reader has no mapping) -> status all-gathered -> local copies (straight
//     from the mapped file into live tensors) + all-to-all-v of packed fragments -> scatter of
//     received fragments -> group broadcasts of fragments many ranks need.
// A failure after the first write raises Error(kFailedPrecondition) saying the live state is
// unusable and the trainer must not continue.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/comm.h"
#include "reshard/plan.h"

namespace reshard {

enum class VerifyMode : uint8_t {
  kOff,   // no checksum checks during load
  kFree,  // check stored checksums of fragments that are exactly one stored piece (no extra reads)
  kFull,  // every checksum unit the plan touches, read whole by one rank and checked in the
          // pre-flight, before any write (checksum_checks in plan.h; the reads count as verify reads)
};

struct ExecOptions {
  int io_threads = 4;
  ReplicaPolicy replica_policy = ReplicaPolicy::kError;
  double replica_atol = 0.0;
  VerifyMode verify = VerifyMode::kFree;
  /// The load's memory budget per rank (PlanOptions::memory_budget). The verify=kFull
  /// weights-vs-master comparison holds at most min(its own cap, this) at a time
  /// (MasterCheckOptions::memory_budget, 64 MiB), so the pre-flight stays within what a wave may use.
  uint64_t memory_budget = PlanOptions{}.memory_budget;
  /// Called (on the executing thread) once every element of one of this rank's target buffers
  /// has been written; GPU targets use it to start the host-to-device copy of a finished buffer
  /// while later waves are still being read.
  std::function<void(int32_t buffer)> on_buffer_done;
  /// Called (on the executing thread) after the pre-flight with wave = 0, then after each wave
  /// with wave = 1..plan.num_waves, once that wave's fragments are in this rank's live tensors
  /// (progress reports; LoadOptions::on_progress).
  std::function<void(int wave)> on_wave_done;
};

struct ExecStats {
  uint64_t bytes_read = 0;         // this rank, load reads
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t verify_bytes_read = 0;  // replica comparison reads
  uint64_t checksums_verified = 0; // fragments whose stored checksum was checked
  uint64_t bytes_verified = 0;     // their bytes
  uint64_t bytes_unchecked = 0;    // this rank's storage reads that no checksum check covered
  uint64_t peak_staging_bytes = 0;
  uint64_t peak_verify_bytes = 0;  // the verify=kFull weights-vs-master batches, held at a time
  // read: checksum checks and reads/packs of this rank's fragments; copy: local copies into live
  // tensors and send slots; exchange: all-to-all-v and group broadcasts (with their unpacking);
  // scatter: unpacking received fragments; preflight: plan agreement, file checks, verify="full"
  // checksum pass and replica comparisons, before any write.
  double read_seconds = 0, copy_seconds = 0, exchange_seconds = 0, scatter_seconds = 0, total_seconds = 0;
  double preflight_seconds = 0;
  std::vector<std::string> replica_report;  // "tensor (state): max |diff| x" for differing replicas
};

/// Steps 1-2 alone (plan-hash agreement, pre-flight of the files and byte ranges this rank reads
/// and of its buffers, replica comparisons, and with verify kFull every checksum unit the plan
/// touches, on up to io_threads threads), collective; every executor runs them before its first
/// write. Throws as described above; returns the replica report (policies other than error) and
/// adds the comparison and checksum-unit reads to stats->verify_bytes_read and the units checked
/// to stats->checksums_verified / bytes_verified.
std::vector<std::string> run_preflight(const Plan& plan, const Layout& target, const CheckpointReader& source,
                                       const std::vector<void*>& buffers, Communicator& comm, ReplicaPolicy policy,
                                       double atol, ExecStats* stats, VerifyMode verify = VerifyMode::kFree,
                                       int io_threads = 1, uint64_t memory_budget = PlanOptions{}.memory_budget);

/// Executes this rank's part of `plan`. `buffers[i]` points at target layout buffer i when that
/// buffer belongs to comm.rank(), else nullptr. Errors: see the header comment.
ExecStats execute_plan(const Plan& plan, const Layout& target, const CheckpointReader& source,
                       const std::vector<void*>& buffers, Communicator& comm, const ExecOptions& options = {});

}  // namespace reshard
