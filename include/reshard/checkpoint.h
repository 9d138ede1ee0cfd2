// Reading checkpoints: one interface over every format (native, DeepSpeed), and the non-tensor
// state that travels with the tensors.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "reshard/plan.h"

namespace reshard {

/// State that is not a tensor. Global values must agree across all files (readers check this and
/// raise Error(kDataLoss) naming the files that disagree).
struct NonTensorState {
  int64_t iteration = -1;          // training iteration (-1: unknown)
  int64_t consumed_samples = -1;   // samples consumed (-1: unknown)
  int64_t step = -1;               // optimizer step (Adam bias correction); never incremented on load
  std::string json = "{}";         // loss scaler, LR scheduler, args, ...: one JSON object
  /// Per-rank opaque blobs (RNG state, sampler state) keyed by the source rank. They carry over
  /// only when the layout is identical (DESIGN.md; failures.md B19).
  std::map<int, std::string> per_rank;
  /// Why `per_rank` is empty although the writer saves it, for the load report's `not_carried`
  /// ("" otherwise). A DeepSpeed save with a model-states file missing carries none of it rather
  /// than some ranks' streams (every rank then reseeds alike).
  std::string per_rank_not_carried;
};

/// A stored checksum checked piece by piece: update() with the unit's bytes in file order (any
/// split), then finish() once. Lets a load check a unit while it copies it, in cache-sized steps,
/// instead of reading the unit from memory twice (once to check, once to copy).
class RangeCheck {
 public:
  virtual ~RangeCheck() = default;
  virtual void update(const void* data, size_t n) = 0;
  /// Empty when the bytes given match the stored checksum, else a message naming file, tensor or
  /// record, byte range, stored and computed values.
  virtual std::string finish() = 0;
  /// True when the stored checksum is XXH3-64 (seed 0, default secret) of the range's bytes, as
  /// the native format's are (docs/format.md): a caller that computes that digest itself (the
  /// executor, fused with its copy: csrc/core/xxh3_range.h) then calls finish_xxh3_64 instead of
  /// update() and finish().
  virtual bool is_xxh3_64() const { return false; }
  /// finish() for a digest the caller computed over the whole range: the same verdict and
  /// message. Only where is_xxh3_64(); elsewhere returns a message saying so (never "").
  virtual std::string finish_xxh3_64(uint64_t digest) {
    (void)digest;
    return "internal error: this checksum is not XXH3-64; the range must go through update()";
  }
};

/// A checkpoint opened for reading. Reads are positioned and thread-safe.
class CheckpointReader {
 public:
  virtual ~CheckpointReader() = default;
  /// "native", "deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3", "deepspeed-bf16", ...
  virtual std::string writer() const = 0;
  /// The step folder actually opened (after resolving `latest` or a step name).
  virtual std::string path() const = 0;
  /// Layout, files and buffer locations. Missing files have location.file == -1.
  virtual const SourceLayout& source() const = 0;
  virtual const NonTensorState& state() const = 0;
  /// Things worth a user's attention that are not errors (assumptions made, tensors inferred).
  virtual std::vector<std::string> notes() const = 0;
  /// Reads bytes of file `file` (index into source().files). Throws Error(kDataLoss) naming the
  /// file and byte range on a short read, Error(kNotFound) when the file is missing.
  virtual void read(int32_t file, uint64_t offset, uint64_t length, void* dst) const = 0;
  /// Size in bytes of file `file`; throws Error(kNotFound) naming the path when it is missing.
  /// Pre-flight uses it so that a missing or short file fails on every rank before any write.
  virtual uint64_t file_size(int32_t file) const = 0;
  /// A read-only mapping of the whole of file `file` (the same bytes read() returns), or nullptr
  /// where this reader has none; then executors use read(). Valid while the reader lives. Callers
  /// touch only ranges the pre-flight checked against file_size() (a byte past the end of a
  /// mapped file is SIGBUS, not an error). Loads drop their page mappings of bytes they have
  /// copied (io::drop_mapped_pages; a later touch faults the pages in again), so a reader kept
  /// open after a load does not hold the checkpoint in the process's RSS.
  virtual const uint8_t* mapped(int32_t file) const { return nullptr; }
  /// Drops this process's page mappings of every file mapped so far (the pages stay in the page
  /// cache; the mappings stay valid and a later touch maps them again). A load calls it when it
  /// ends, for what its own per-chunk drops left: pages another rank copied out of a unit this
  /// rank checked (verify="full"), pages at wave boundaries.
  virtual void drop_mapped_pages() const {}
  /// True when the format stores a checksum for exactly this byte range (a native piece, a
  /// DeepSpeed zip record).
  virtual bool has_checksum(int32_t file, uint64_t offset, uint64_t length) const { return false; }
  /// The check of exactly a range has_checksum() accepts, fed the range's bytes in order; nullptr
  /// for any other range. Formats implement their checksums here only.
  virtual std::unique_ptr<RangeCheck> begin_check(int32_t file, uint64_t offset, uint64_t length) const {
    return nullptr;
  }
  /// The same check on the whole range at once: empty when fine or when the range has no stored
  /// checksum, else begin_check's message.
  std::string verify_range(int32_t file, uint64_t offset, uint64_t length, const void* data) const {
    std::unique_ptr<RangeCheck> c = begin_check(file, offset, length);
    if (!c) return {};
    c->update(data, length);
    return c->finish();
  }
  /// Every byte range verify_range() can check, for load option verify="full".
  virtual std::vector<ChecksumUnit> checksum_units() const { return {}; }
  /// A short fingerprint of what this checkpoint holds, the same wherever it is mounted and
  /// different for another save: native, xxh3-64 of metadata.json (which records every piece's
  /// checksum and the training state); DeepSpeed, xxh3-64 over each file's name and the offset,
  /// length and zip CRC-32 of every record it holds. A load's pre-flight compares it across ranks
  /// (ranks that opened different steps, e.g. `latest` read while a save rewrote it, fail before
  /// any write). Empty where a reader has none (then only the iteration is compared).
  virtual std::string fingerprint() const { return {}; }
};

/// The step name that means "the newest complete step" (OpenOptions::newest_complete).
inline constexpr const char* kNewestStep = "newest";

struct OpenOptions {
  /// Step to open: "" = the one `latest` names; otherwise a step folder name ("global_step20",
  /// "step-20") or number ("20"). A missing step is an error, never a fallback (B20).
  std::string step;
  /// With `step` empty: open the newest step folder that is complete instead of the one `latest`
  /// names (an elastic restart after a kill: `latest` may lag a finished save, and a save killed
  /// midway leaves a step folder that must never load). Complete: it opens (every file whole,
  /// metadata readable) and its files cover every element of every tensor. Each newer folder
  /// skipped gets a note naming why; none complete is kNotFound listing each step and its reason.
  bool newest_complete = false;
  /// `step` = kNewestStep ("newest") asks for the same where no folder has that name.
  /// Model description to use where the files do not record it (DeepSpeed: QKV meaning, SwiGLU,
  /// tp > groups variant). Empty: native checkpoints carry their own; DeepSpeed ones need it or
  /// an `args` Namespace the reader can interpret.
  std::string model_path;
  /// The same description given as a value (a trainer that builds it from its live config needs
  /// no file); messages name it "the given model description". Giving both is kInvalidArgument.
  std::optional<ModelConfig> model;
};

/// Whether a reader's note says that a file the checkpoint names is missing (native "missing data
/// file ...", DeepSpeed "missing file: ..."): what `reshard verify` lists as missing and what makes
/// a step incomplete for OpenOptions::newest_complete.
bool is_missing_file_note(const std::string& note);

/// Whether `opt` gives a model description (model or model_path).
bool gives_model(const OpenOptions& opt);
/// The description `opt` gives: `model`, else the YAML at model_path (load_model_config's errors).
/// kInvalidArgument when both are set.
ModelConfig given_model(const OpenOptions& opt);
/// How messages name it: "the model file <path>" or "the given model description".
std::string given_model_name(const OpenOptions& opt);

/// Reads each unit whole (out of the reader's file mapping where it has one and the file is long
/// enough, else with positioned reads) and checks it with verify_range, on up to `threads`
/// threads. Returns the problems (a mismatch naming file and bytes, a short or missing file),
/// sorted and without repeats; empty when every unit passes. Used by a verify="full" load's
/// pre-flight, by `convert --verify full` and by `reshard verify`. `drop_pages`: drop this
/// process's mapping of each unit once it is checked (the pages stay in the page cache), so
/// checking a large checkpoint does not leave all of it in the process's RSS; a load's pre-flight
/// passes false, because its copy step reads the same pages next (and drops them as it goes).
std::vector<std::string> check_checksum_units(const CheckpointReader& reader, const std::vector<ChecksumUnit>& units,
                                              int threads, bool drop_pages = true);

/// Opens a checkpoint root or step folder of any supported format. Errors (before anything is
/// read beyond headers): Error(kNotFound) when the path does not exist, names no step, or the
/// named step is missing; Error(kInvalidArgument) when the path is a file or an empty or
/// unrecognised folder (each message names the path).
std::unique_ptr<CheckpointReader> open_checkpoint(const std::string& path, const OpenOptions& options = {});

}  // namespace reshard
