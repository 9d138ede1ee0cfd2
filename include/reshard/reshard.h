// reshard's facade: what faces (CLI, Python, trainer integrations) call. It wires readers, the
// planner and the executor; nothing below it knows its callers.
//
//   auto ckpt = reshard::open_checkpoint("/ckpt");               // any supported format
//   reshard::Layout target = reshard::derive_layout(model, topo);  // or built from a live optimizer
//   reshard::LoadReport r = reshard::load(*ckpt, target, my_buffers, comm);
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/comm.h"
#include "reshard/layout.h"
#include "reshard/plan.h"

namespace reshard {

/// The checksum mode every face uses when its caller names none: LoadOptions::verify, the CLI's
/// `convert --verify` and `bench load --verify`, ResumeConfig::verify (a resume YAML without a
/// `verify:` key), `reshard.load(verify=)` and the Megatron-DeepSpeed hook (exported to Python as
/// `reshard.DEFAULT_VERIFY`). "full": every stored piece the load touches is checked before any
/// live tensor is written; "free" (no extra read, cut pieces unchecked) is one argument away.
inline constexpr const char* kDefaultVerify = "full";

/// One step of a load as it finishes (LoadOptions::on_progress), on this rank.
struct LoadProgress {
  /// "plan" (planned, options agreed), "preflight" (files, replicas and verify="full"'s pass
  /// checked; nothing written yet), "wave" (one wave's fragments are in this rank's live tensors).
  const char* stage = "";
  int index = 0, count = 0;    // "wave": 1..count (count = Plan::num_waves); other stages: 1 of 1
  uint64_t bytes_done = 0;     // this rank: source bytes of the fragments delivered to it so far
  uint64_t bytes_total = 0;    // this rank: source bytes of all fragments delivered to it
  double seconds = 0;          // since load() began
};

struct LoadOptions {
  PlanOptions plan;
  /// Threads per rank that read, check and copy: 1..1024, or 0 for default_threads()
  /// ($RESHARD_THREADS, else the cores up to 8; io/parallel.h); else Error(kInvalidArgument). On
  /// the 2-core benchmark machine 1, 2 and 4 were within noise even at 8 ranks.
  int io_threads = 0;
  /// Checksum checks while loading (units: native pieces with their xxh3-64, DeepSpeed zip records
  /// with their CRC-32; see ChecksumUnit). The default is kDefaultVerify ("full"), the one
  /// default of every face (CLI, Python API, trainer hook, resume YAML):
  ///  - "free": every fragment that is exactly one unit is checked as it is read, at no
  ///    extra read: before its bytes go to another rank or to staging, or, when this rank copies
  ///    it straight out of the file mapping into its own live tensors, slab by slab (256 KiB) as
  ///    it is copied, so it crosses memory once; a piece that fails there has its live copy
  ///    overwritten with NaN (all-ones bytes for non-float dtypes). A unit that several ranks of
  ///    one machine each read whole (node-local reads: 16-bit weights every dp rank holds) is
  ///    checked by one of them, the others copy the same page-cache bytes unchecked
  ///    (Fragment::reread_on_node); when the load fails, their copies are overwritten with NaN
  ///    too. A unit the layout change reads whole but the memory budget cuts into several
  ///    fragments is read whole once more by one rank per machine and checked in the pre-flight,
  ///    before any write (Plan::budget_splits; in verify_bytes_read). Units cut between fragments
  ///    by the layout change itself (a tp split, a ZeRO partition re-cut, a DeepSpeed flat
  ///    partition read tensor by tensor) are not checked: LoadReport::bytes_unchecked says how
  ///    many bytes, and a note in LoadReport::policies says so.
  ///  - "full" (default): every unit the load touches (also those cut between fragments), read whole by
  ///    one rank and checked in the pre-flight before any write, so any mismatch is kDataLoss
  ///    with no live tensor written; the pass counts in verify_bytes_read. Then the
  ///    checkpoint's weights against its fp32 master (check_weights_against_master, the ranks
  ///    sharing the tensors): a weight that is not its master rounded (DeepSpeed tp layer files
  ///    swapped, files from different saves) is kDataLoss naming tensor, tp rank and element on
  ///    every rank, with no live tensor written.
  ///  - "off": none.
  /// Errors: a mismatch is Error(kDataLoss) naming file, tensor/record and byte range, or
  /// kFailedPrecondition ("the live state is unusable") when checked pieces were already copied;
  /// no value of a piece that fails its check stays in a live tensor (never copied, or
  /// overwritten with NaN). Another value is kInvalidArgument.
  std::string verify = kDefaultVerify;
  /// Called on the thread that called load(), on every rank, after planning, after the
  /// pre-flight and after each wave (a progress bar, a log line). It must not throw: the other
  /// ranks would wait for this one in the next collective. Empty: no calls.
  std::function<void(const LoadProgress&)> on_progress;
};

struct LoadReport {
  std::string change;           // layout change in words ("tp 2->4, dp 4->2, ZeRO-1 partitions re-cut")
  std::string source_layout, target_layout, writer, path;
  uint64_t bytes_read = 0;        // all ranks, load reads
  uint64_t bytes_reread_on_node = 0;  // of bytes_read: re-read by a second rank of one machine
                                      // (page cache, not storage; node_local_reads)
  uint64_t bytes_needed = 0;      // distinct source bytes
  uint64_t bytes_exchanged = 0;   // all ranks, sent to another rank
  uint64_t verify_bytes_read = 0; // all ranks: replica comparison reads and verify="full"'s pass
  uint64_t target_bytes = 0;      // bytes of live state written, all ranks
  uint64_t checksums_verified = 0;  // all ranks: checks of stored checksums made (units or fragments)
  /// All ranks: bytes those checks hashed (bytes several ranks of one machine read count once;
  /// a unit checked by several ranks, as the memory budget's cut units are when reads are not
  /// node-local, counts once per check, so this can exceed bytes_read).
  uint64_t bytes_verified = 0;
  /// All ranks: bytes read from storage (page-cache re-reads by a second rank of a machine not
  /// counted) that no check covered: with verify="free", the parts of stored pieces cut between
  /// target ranks (a tp split, a ZeRO re-cut); everything read with "off"; 0 with "full".
  /// `reshard verify` checks every piece.
  uint64_t bytes_unchecked = 0;
  /// This rank's own numbers (the totals above are over all ranks).
  uint64_t rank_bytes_read = 0, rank_bytes_sent = 0, rank_bytes_received = 0;
  double read_seconds = 0, copy_seconds = 0, exchange_seconds = 0, scatter_seconds = 0;  // this rank (ExecStats)
  /// This rank: the pre-flight before any write (plan agreement, file checks, the verify="full"
  /// checksum pass, replica comparisons), seconds.
  double preflight_seconds = 0;
  double plan_seconds = 0;        // planning (every rank plans the whole job)
  double seconds = 0;             // wall time of the load, max over ranks, planning included
  double gbps = 0;                // target_bytes / seconds / 1e9 (GB = 10^9 bytes)
  int waves = 0;
  uint64_t peak_staging_bytes = 0;  // max over ranks
  /// Max over ranks: bytes of weights and masters the verify="full" weights-vs-master comparison
  /// held at a time (at most min(64 MiB, the plan's memory budget); 0 without verify="full").
  uint64_t peak_verify_bytes = 0;
  std::vector<std::string> policies;     // policies applied and notes from the plan
  std::vector<std::string> warnings;     // Plan::warnings: what changes results (vocab padding rows)
  std::vector<std::string> not_carried;  // state not carried over, and why
  std::vector<std::string> replica_report;
  NonTensorState state;  // per_rank blobs only when the layout is identical
  std::string to_json() const;
  std::string to_text() const;
};

/// Plans and executes a load into this rank's buffers of `target`. Collective over comm.
/// `buffers[i]` points at target.buffers[i]'s memory when it belongs to comm.rank(), else null.
/// Errors: kInvalidArgument at once when target's world size is not comm.size(); those of the
/// options (io_threads, verify) and of make_plan (coverage, strictness, shapes, budget) raised on
/// every rank before anything is read, also when only one rank's fail (the ranks gather every
/// rank's outcome right after planning; the message names each failing rank); pre-flight and
/// replica errors before any write; kFailedPrecondition when a failure happens after live tensors
/// were partly written (a checksum mismatch found while copying, a finite value that does not fit
/// the target buffer's dtype, naming the buffer; raised on every rank).
LoadReport load(const CheckpointReader& checkpoint, const Layout& target, const std::vector<void*>& buffers,
                Communicator& comm, const LoadOptions& options = {});

/// Node id of every rank of comm, for PlanOptions::rank_node: ranks share an id when they run on
/// one kernel (boot id and host name) and see `checkpoint`'s step folder as the same device and
/// inode, i.e. read its files through one page cache (two containers of a host that mount
/// different disks at one path get different ids). Ids are numbered in rank order of first
/// appearance. Collective (one all-gather of short strings).
std::vector<int32_t> node_of_ranks(Communicator& comm, const CheckpointReader& checkpoint);

/// The dry run: plan only, touching no tensor data (headers only).
Plan plan_load(const CheckpointReader& checkpoint, const Layout& target, const PlanOptions& options, double* plan_seconds);

/// JSON summary of a plan, with at least source_world_size, target_world_size, bytes_to_read,
/// bytes_to_exchange, bytes_needed, target_bytes, peak_staging_bytes_per_rank, num_waves,
/// num_fragments, plan_seconds, change, notes, and from `target` (the layout planned for)
/// live_bytes_per_rank_max / live_bytes_max_rank (the largest rank's target buffers, bytes),
/// live_bytes_total (every rank's, i.e. what one process holding the whole target needs) and
/// read_bytes_per_rank_max / read_bytes_max_rank (the source bytes of the busiest reader).
std::string plan_summary_json(const Plan& plan, double plan_seconds, const Layout& target);

}  // namespace reshard
