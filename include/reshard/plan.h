// The planner: a pure function from (source layout + where its buffers live, target layout,
// options) to the plan every rank executes. No I/O, no MPI, no torch; every rank computes the
// same plan (ranks compare Plan::hash() before executing).
//
// Units: bytes unless a name says elements. GB = 10^9 bytes, GiB = 2^30 bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "reshard/layout.h"

namespace reshard {

/// Where a source buffer's first element lives: file index (into SourceLayout::files) and byte
/// offset. file = -1 marks a buffer whose file is missing (coverage errors name it).
struct BufferLocation {
  int32_t file = -1;
  uint64_t byte_offset = 0;
};

struct SourceLayout {
  Layout layout;
  std::vector<std::string> files;          // paths (for messages and the executor's reads)
  std::vector<BufferLocation> locations;   // one per layout.buffers entry
  std::vector<std::string> missing_files;  // files the checkpoint should have but lacks (for messages)
};

enum class ReplicaPolicy : uint8_t { kError, kAverage, kFirst };
const char* replica_policy_name(ReplicaPolicy p);
ReplicaPolicy replica_policy_from_name(const std::string& s);

struct PlanOptions {
  uint64_t memory_budget = uint64_t(1) << 30;  // bytes per rank per wave (staging + receive)
  bool dedup = true;                           // read each source byte once and fan it out
  /// Node of each target rank (index = rank; equal ids share a machine and its page cache).
  /// Empty: every rank is its own node. With dedup, a box that several ranks need is read once
  /// per node, not once per job: the chosen reader sends it to ranks on other nodes, and every
  /// other receiving rank on the reader's node reads it itself from the shared page cache (one
  /// copy out of the page cache beats two through the exchange); storage still sees each byte once
  /// per node (Plan::bytes_reread_on_node counts the rest).
  std::vector<int32_t> rank_node;
  /// For load(): fill rank_node from the machines the ranks run on (one all-gather). Off: one read
  /// per job, ranks of a machine exchange shared bytes.
  bool node_local_reads = true;
  /// kError: copies that differ by more than replica_atol stop the load before any write.
  /// kFirst: load the authoritative copy (lowest (pp, tp, dp) source rank), report differences.
  /// kAverage: load the element-wise mean of every saved copy (fragments carry ReplicaSources),
  /// report differences.
  ReplicaPolicy replica_policy = ReplicaPolicy::kError;
  double replica_atol = 0.0;                   // tolerance for replica comparison (0 = exact)
  bool compare_replicas = true;                // read replicas to compare them (counted apart)
  bool strict_missing = true;    // a target tensor absent from the source is an error
  bool strict_unexpected = true; // a source tensor absent from the target is an error
  /// Fill a target 16-bit weight from the source fp32 master (downcast) when the source has no
  /// 16-bit copy (ZeRO-3 checkpoints). Reported in Plan::notes.
  bool weights_from_master = true;
  /// A target whose padded vocab rows differ from the source's (vocab_divisible_by x tp pads to
  /// another row count): false (default) drops the source's extra padding rows or zero-fills the
  /// target's extra ones and says so in Plan::warnings; true refuses (InvalidArgument), since
  /// trainers that normalise the loss over every padded row compute another loss after either.
  bool refuse_vocab_padding_change = false;
};

/// Smallest memory budget accepted (bytes).
constexpr uint64_t kMinMemoryBudget = 64 * 1024;

/// A target location: rank, buffer of the target layout, element base and strides.
struct Delivery {
  int32_t rank = 0;
  int32_t buffer = 0;
  int64_t base = 0;
  std::array<int64_t, kMaxDims> strides{};
};

/// A box of source elements read once by `reader` and delivered to one or more target places.
/// The reader packs the box in row-major order of the box (source dtype); receivers unpack.
struct Fragment {
  int32_t array = 0;        // target array index
  Box box;                  // logical box (target array coordinates)
  int32_t file = 0;         // source file index
  uint64_t byte_base = 0;   // byte offset in the file of the box origin
  std::array<int64_t, kMaxDims> src_strides{};  // source strides in elements
  DType src_dtype = DType::F32;
  int32_t reader = 0;
  int32_t wave = 0;
  uint32_t first_delivery = 0;
  uint32_t num_deliveries = 0;
  /// Replica policy kAverage only: Plan::replica_sources[first_replica, +num_replicas) are the
  /// other saved copies of (parts of) this box; the reader replaces each element by the mean over
  /// every copy holding it before delivering (see average_replicas in simulate.h).
  uint32_t first_replica = 0;
  uint32_t num_replicas = 0;
  /// A node-local re-read (PlanOptions::rank_node): another fragment, read by a rank of the same
  /// machine, reads exactly these bytes of the same file, i.e. the same page-cache pages, and
  /// checks them under verify="free". This one's reader copies them without hashing them again
  /// (16-bit weights that every dp rank of a machine holds were hashed once per rank before).
  bool reread_on_node = false;
  uint64_t bytes() const { return uint64_t(box.numel()) * dtype_size(src_dtype); }
};

/// Another saved copy of part of a fragment's box (replica policy kAverage).
struct ReplicaSource {
  Box box;                 // logical box (target array coordinates), inside its fragment's box
  int32_t file = 0;
  uint64_t byte_base = 0;  // byte offset in the file of the box origin
  std::array<int64_t, kMaxDims> strides{};  // in elements
  DType dtype = DType::F32;
  uint64_t bytes() const { return uint64_t(box.numel()) * dtype_size(dtype); }
};

/// A dense source range that the layout change reads whole but the memory budget cut into
/// several fragments (one fragment must fit a wave). verify="free" checks whole stored pieces as
/// they are read, which a cut piece is not, so `checker`, a rank that reads the range's first
/// fragment, reads it whole and checks it in the pre-flight when the range is exactly one
/// checksummed unit (one checker per range and machine that reads it). Without this, how much
/// "free" checks would depend on the budget: a corrupted 123 MB embedding loaded unchecked on
/// 8 dp ranks at the default 1 GiB budget.
struct BudgetSplit {
  int32_t file = 0;
  uint64_t byte_base = 0;
  uint64_t bytes = 0;
  int32_t checker = 0;
};

/// Target elements that no source holds and that are zero-filled: vocab padding rows only the
/// target has, and flat-partition padding.
struct Fill {
  int32_t rank = 0;
  int32_t buffer = 0;
  int64_t base = 0;
  Box extent;  // offsets unused; lengths per dim
  std::array<int64_t, kMaxDims> strides{};
};

/// Two source copies of the same logical box that must hold equal values.
struct ReplicaCompare {
  int32_t array = 0;  // target array index (or -1 for a source-only array)
  std::string tensor;
  StateKind state = StateKind::kWeight;
  Box box;
  struct Side {
    int32_t file = 0;
    uint64_t byte_base = 0;
    std::array<int64_t, kMaxDims> strides{};
    DType dtype = DType::F32;
  } authoritative, replica;
  int32_t checker = 0;  // the rank that reads both and compares
};

struct RankStats {
  uint64_t bytes_read = 0;      // by this rank, for the load itself (incl. replica copies averaged)
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  uint64_t peak_staging = 0;    // max over waves of staging + receive bytes
  uint64_t verify_bytes_read = 0;  // replica comparison reads
};

struct Plan {
  Topology source_topo, target_topo;
  std::string change;               // describe_change(source, target)
  int world_size = 0;               // target world size
  std::vector<Fragment> fragments;  // sorted by (wave, reader, file, byte_base)
  std::vector<Delivery> deliveries;
  std::vector<Fill> fills;
  std::vector<ReplicaCompare> replica_compares;
  std::vector<ReplicaSource> replica_sources;  // policy kAverage: indexed by Fragment::first_replica
  std::vector<BudgetSplit> budget_splits;      // sorted by (file, byte_base, checker)
  /// The machine of each rank (load() fills it after planning, from node_of_ranks): ranks that
  /// read the checkpoint through one page cache and one copy of its files. verify="full" gives
  /// every unit one checker per machine whose ranks read it, since machines may each read their
  /// own copy (node-local disks). Empty: one machine. Not part of hash() (the same all-gather
  /// gives it to every rank).
  std::vector<int32_t> rank_machine;
  int num_waves = 0;
  std::vector<RankStats> ranks;
  std::vector<std::string> notes;  // policies applied, weights from master, ...
  /// What changes a trained model's results and that the user should act on: vocab padding rows
  /// dropped or added (with the vocab_divisible_by that keeps them). Not part of hash().
  std::vector<std::string> warnings;
  uint64_t bytes_to_read = 0;      // all ranks, load reads (replica copies averaged included)
  uint64_t bytes_reread_on_node = 0;  // part of bytes_to_read that another rank of the same node
                                      // also reads (served by the node's page cache, not storage)
  uint64_t bytes_needed = 0;       // distinct source bytes the target needs
  uint64_t bytes_to_exchange = 0;  // all ranks, bytes sent to another rank
  uint64_t target_bytes = 0;       // bytes of target state written
  uint64_t peak_staging_bytes_per_rank = 0;

  /// A hash of everything a rank executes; equal plans on every rank before execution.
  uint64_t hash() const;
};

/// Plans the whole job. Throws Error with the precise reason, before anything is read:
///  - kDataLoss: target elements that no available source piece covers (the message lists
///    missing files and, per tensor, the uncovered element ranges);
///  - kInvalidArgument: missing/unexpected tensors (per strictness), shape mismatches other than
///    vocab padding rows, a memory budget below kMinMemoryBudget.
Plan make_plan(const SourceLayout& source, const Layout& target, const PlanOptions& options = {});

/// What a plan moves per wave between machines and from storage, for a time estimate. A machine
/// is a set of ranks with one rank_node id (PlanOptions::rank_node; empty: every rank alone).
/// Bytes a fragment's reader sends to a rank on another machine cross both machines' links
/// (counted once out of the reader's machine and once into the receiver's); ranks of one machine
/// exchange through its memory and cost no link bytes. A node-local re-read
/// (Fragment::reread_on_node) comes from the page cache and counts as no storage read.
struct WaveTraffic {
  uint64_t max_link_bytes = 0;  // busiest machine link, max over machines of max(bytes out, bytes in)
  uint64_t max_read_bytes = 0;  // busiest machine's bytes read from storage
  int32_t link_machine = 0;     // the machine with the busiest link (the lowest id among equals)
};
struct TrafficModel {
  std::vector<WaveTraffic> waves;      // one per wave, in wave order
  uint64_t bytes_between_machines = 0;  // all waves, every byte sent from one machine to another
  int num_machines = 0;
  /// Seconds at the given rates, waves one after the other (a wave's exchange waits for its
  /// reads): the sum over waves of each wave's busiest link (or busiest machine's reads) divided
  /// by the rate. A model, not a measurement: no latency, no congestion beyond one link.
  double exchange_seconds = 0.0;
  double read_seconds = 0.0;
};
/// The traffic of `plan` (rank_node as in PlanOptions: one entry per target rank, or empty) at
/// `link_bytes_per_second` per machine and direction and `read_bytes_per_second` per machine.
/// Throws kInvalidArgument when rank_node has another length than plan.world_size or a rate is
/// not positive.
TrafficModel model_traffic(const Plan& plan, const std::vector<int32_t>& rank_node, double link_bytes_per_second,
                           double read_bytes_per_second);

/// The vocab_divisible_by d for which Megatron's padding of `vocab` at tensor parallel `tp`,
/// ceil(vocab / (d * tp)) * d * tp, equals `rows`: the largest power of two that does, else the
/// smallest d that does; 0 when none does (rows < vocab, or rows not a multiple of tp).
int64_t divisor_for_rows(int64_t vocab, int64_t rows, int tp);

/// Uncovered regions found while planning (also in the kDataLoss message), for tests and reports.
struct CoverageGap {
  std::string tensor;
  StateKind state;
  Box region;
};
/// Like make_plan's coverage check alone: every target element not covered by the source,
/// ignoring vocab padding rows. Empty when the source covers the target.
std::vector<CoverageGap> find_coverage_gaps(const SourceLayout& source, const Layout& target);

/// A byte range of one source file that the format stores a checksum for. Where they come from:
/// native checkpoints store an xxh3-64 per piece (docs/format.md); DeepSpeed's torch.save zip
/// archives store a CRC-32 per storage record (PKWARE APPNOTE, local file header / central
/// directory), one record per tensor storage, e.g. a whole ZeRO flat partition.
struct ChecksumUnit {
  int32_t file = 0;
  uint64_t offset = 0;  // bytes
  uint64_t length = 0;  // bytes
};

/// A checksum unit that `checker` reads whole and checks in the pre-flight, before any live
/// tensor is written (load option verify="full").
struct ChecksumCheck {
  ChecksumUnit unit;
  int32_t checker = 0;
  /// No fragment reads the unit whole and dense (a tp split, a ZeRO re-cut, a DeepSpeed flat
  /// partition read tensor by tensor): verify="free" cannot check it.
  bool cut = false;
};

/// True when a box whose element (i_0, ..., i_n) lies at sum(i_d * strides[d]) is one contiguous
/// run in row-major box order (dims of length 1 ignored).
bool box_is_dense(const Box& box, const std::array<int64_t, kMaxDims>& strides);
/// Elements from the first to the last element of `box` laid out with (non-negative) `strides`,
/// both included: the extent a strided read of it covers (0 for an empty box).
int64_t box_span(const Box& box, const std::array<int64_t, kMaxDims>& strides);

/// For verify="full": every checksum unit that a fragment of `plan` reads bytes of (its replica
/// sources under policy average included), with one checker per machine whose ranks read it
/// (Plan::rank_machine; each machine may read its own copy of the files): the reader of that
/// machine's fragment with the most bytes inside the unit (ties: the earlier fragment), so a
/// unit read whole is checked by the rank that reads it and a cut unit's extra read is the
/// smallest and stays on a machine that reads the unit anyway. `cut` marks a unit that no
/// fragment of that machine reads whole and dense. Sorted by (file, offset, machine). Units may
/// overlap. Pure: no I/O; O(fragments x units touched + units log units).
std::vector<ChecksumCheck> checksum_checks(const Plan& plan, std::vector<ChecksumUnit> units);

/// Box difference a \ b as at most 2*ndim disjoint boxes.
std::vector<Box> box_subtract(const Box& a, const Box& b);

}  // namespace reshard
