// The native checkpoint format: saving (collective or from one process), reading, verifying, and
// synthetic checkpoints. The folder layout, metadata fields, checksums and the atomic save
// protocol are specified in docs/format.md.
//
//   ROOT/latest                        text: the name of the newest complete step folder
//   ROOT/<step>/metadata.json          format, topology, model, layout piece table with an xxh3-64
//                                      checksum per piece, non-tensor state, data files and sizes
//   ROOT/<step>/rank_00000.safetensors one per rank: that rank's buffers, tensor name = buffer
//                                      name, 1-D shape [numel], dtype = buffer dtype
//
// Units: bytes unless a name says elements.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"
#include "reshard/comm.h"
#include "reshard/layout.h"

namespace reshard {

/// metadata.json "format_version" this build writes and the highest it reads.
constexpr int kNativeFormatVersion = 1;

/// Saves one step, collectively: every rank of `comm` calls it with the same root, step, layout
/// and state; comm.size() must equal layout.topo.world_size() and comm.rank() is the layout rank.
/// `buffers` is indexed like layout.buffers; entries of this rank's buffers must point at
/// numel * dtype_size bytes, the others are ignored (may be null). Derive layouts for saving with
/// DeriveOptions::weights_on_dp0_only = true so dp-replicated weights are saved once.
///
/// Protocol (docs/format.md): (1) every rank proves it sees the files of every other rank under
/// `root`; (2) each rank writes and fsyncs ROOT/.tmp-<step>-<nonce>/rank_<r>.safetensors and
/// checksums its pieces; (3) rank 0 writes metadata.json, fsyncs, renames the folder to
/// ROOT/<step> (atomically exchanging it with an existing one), fsyncs ROOT, then replaces
/// ROOT/latest through a temporary file + rename. A crash at any point leaves the previous
/// checkpoint intact and `latest` naming a complete step.
///
/// Errors (raised on every rank, nothing is left half-visible):
///  - kFailedPrecondition: ranks see different filesystems at root (names the ranks), or a rank
///    failed to write (the message carries each failing rank's error);
///  - kInvalidArgument: a bad step name (empty, ".", "..", "latest", containing '/', starting with
///    '.'), a null buffer of this rank, comm size different from the layout's world size.
///  - kFailedPrecondition: another writer of `root` held its lock (ROOT/.reshard-lock) longer
///    than RESHARD_LOCK_TIMEOUT_S seconds (default 600; names the holder), or, with
///    `replace_step` false, ROOT/<step> exists once the lock is held (another writer saved it).
/// Writers of one root run one at a time (docs/format.md §5).
void save_native(const std::string& root, const std::string& step, const Layout& layout,
                 const std::vector<const void*>& buffers, const NonTensorState& state, Communicator& comm,
                 bool replace_step = true);

/// Same as save_native from one process that holds every rank's buffers (synth, convert): no
/// filesystem check is needed; rank files are written one after another.
void save_native_all_ranks(const std::string& root, const std::string& step, const Layout& layout,
                           const std::vector<const void*>& buffers, const NonTensorState& state,
                           bool replace_step = true);

/// The pure core of the same-filesystem check. seen[r][q] says whether rank r saw rank q's token
/// file. Returns "" when every rank saw every token, else the message every rank raises, e.g.
/// "ranks see different filesystems at /ckpt: rank 0 cannot see the files of ranks 4-7; ...;
/// a multi-node save onto node-local disks would lose shards".
std::string fs_check_failures(const std::vector<std::vector<bool>>& seen, const std::string& root);

/// Opens a native step folder (one holding metadata.json). open_checkpoint() calls this after
/// resolving `latest` / a step name; `notes` are prepended to the reader's notes().
/// Validates metadata against the safetensors headers; a missing data file is not an error here:
/// its buffers get location.file = -1 and notes() names it, so the planner reports exactly what
/// is uncovered. Errors: kNotFound (no metadata.json), kDataLoss (bad metadata JSON or field,
/// naming file and field; a data file whose header disagrees with metadata or whose buffers lie
/// outside the file, naming file and buffer; a truncated data file), kInvalidArgument (a data
/// file name that is not a plain rank_NNNNN.safetensors, e.g. path traversal), kUnsupported
/// (format_version newer than kNativeFormatVersion).
std::unique_ptr<CheckpointReader> open_native(const std::string& step_dir, std::vector<std::string> notes = {});

/// Reads every stored byte of an opened checkpoint and checks it: native, the stored xxh3-64 of
/// each piece and every data file present and of the size metadata records; other formats,
/// every checksum unit the reader exposes read whole and checked (DeepSpeed: the zip CRC-32 of
/// each record, ZeRO flat partitions included) and every piece outside such a unit read. Returns
/// one message per problem naming file, buffer, tensor and byte range; empty when the checkpoint
/// is sound. A format without checksums gets the read checks only.
std::vector<std::string> verify_all(const CheckpointReader& reader);

/// Writes a synthetic checkpoint of (model, topology) as ROOT/<step> (and `latest`), saved with
/// weights_on_dp0_only. Every element is a pure function of (seed, tensor, state, logical index),
/// so synth at two layouts with the same seed holds the same consolidated model: fp32 master =
/// finite floats, 16-bit weight = the master downcast to model.param_dtype (round to nearest
/// even), exp_avg arbitrary finite, exp_avg_sq non-negative, flat-partition padding zero.
/// Non-tensor state: step = 1 + seed % 1000, iteration = step, consumed_samples = 8 * step,
/// per_rank[r] = {"rng": "synth-<seed>-<r>"}. Memory: one rank's buffers at a time.
void synth_checkpoint(const std::string& root, const ModelConfig& model, const Topology& topo, uint64_t seed,
                      const std::string& step = "step-1");

/// The fp32 value synth stores for (tensor, state) at logical row-major index `linear` (dim 0's
/// length ignored, so padded vocab sizes agree). For StateKind::kWeight it returns the master's
/// value; the stored weight is its downcast to the param dtype.
float synth_value(uint64_t seed, const std::string& tensor, StateKind state, int64_t linear);

/// Row-major index of a logical coordinate, ignoring dim 0's length (as synth uses it).
int64_t synth_linear_index(const LogicalArray& a, const std::array<int64_t, kMaxDims>& ix);

}  // namespace reshard
