// Elastic resume: the layout a restarting job takes when its world size changed, and the batch
// split that keeps the saved global batch. Pure: no I/O, no MPI, no torch.
//
// An elastic launcher (torchrun with --nnodes=MIN:MAX, a cluster scheduler) restarts the workers
// with the ranks that are left, or more. The trainer knows only the new world size; the layout it
// was saved under is in the checkpoint. choose_layout() decides the target layout by a declared
// policy and says why; plan_batch() recomputes micro-batch and gradient-accumulation steps so the
// global batch (and with it the data order and the LR schedule) stays the saved one.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "reshard/topology.h"

namespace reshard {

/// How a restart picks its layout.
struct ElasticPolicy {
  enum class Kind {
    kKeepModelParallel,  // "keep": tp, pp, vpp and the ZeRO stage stay, dp = world / (tp * pp) (default)
    kAllowedList,        // "list": the first of `allowed` whose world size is the job's and that fits
    kRefuse,             // "refuse": only the saved world size; any change is an error
  };
  Kind kind = Kind::kKeepModelParallel;
  /// kAllowedList: candidate layouts in order of preference (their dp may be 0 = world / (tp * pp)).
  std::vector<Topology> allowed;

  /// "keep" | "list" | "refuse".
  static Kind parse_kind(const std::string& name);
  static const char* kind_name(Kind k);
};

/// One candidate layout of an allowed list, as a resume config writes it ("tp=2,pp=1"): keys it
/// leaves out keep the saved layout's value (the ZeRO stage, vpp), except dp, which becomes 0
/// (world / (tp * pp) at choose time). Throws Error(kInvalidArgument) as Topology::parse does.
Topology parse_candidate(const std::string& text, const Topology& saved);

/// The chosen layout, why, and every candidate that was turned down with its reason.
struct LayoutChoice {
  Topology target;
  std::string reason;               // one sentence, e.g. "world size 8 -> 4: kept tp=2, pp=2; dp 2 -> 1"
  std::vector<std::string> tried;   // "tp=4,pp=1,...: world size 4 != 8" for each rejected candidate
};

/// Chooses the target layout for a job of `world` ranks resuming a checkpoint saved under `saved`.
/// `global_batch` > 0 also rejects a layout whose dp does not divide it (the saved global batch
/// must stay). `fits`, when given, is asked about each candidate and returns "" when the model
/// can be laid out that way (tp divides the heads, pp the layers, ...) or the reason it cannot.
/// Throws Error(kInvalidArgument) naming the world size, the policy and every candidate tried
/// with its reason when none fits, and for world < 1 or a malformed allowed layout.
LayoutChoice choose_layout(const Topology& saved, int64_t world, const ElasticPolicy& policy,
                           int64_t global_batch = 0,
                           const std::function<std::string(const Topology&)>& fits = nullptr);

/// Micro-batch and gradient-accumulation steps for `dp` data-parallel ranks that keep
/// `global_batch` (samples per optimizer step): micro_batch * grad_accum * dp == global_batch.
struct BatchPlan {
  int64_t global_batch = 0;
  int64_t micro_batch = 0;  // samples per rank per forward pass
  int64_t grad_accum = 0;   // gradient-accumulation steps per optimizer step
  std::string reason;       // "" when the wanted micro-batch was kept, else what changed and why
};

/// Largest global batch plan_batch takes (samples per optimizer step).
constexpr int64_t kMaxGlobalBatch = int64_t(1) << 40;

/// Keeps `micro_batch` when micro_batch * dp divides global_batch; otherwise takes the largest
/// smaller micro-batch that does (a rank never holds more activations than it was configured for).
/// Throws Error(kInvalidArgument) naming the global batch and dp when dp does not divide it, for
/// a value below 1 and for a global batch above kMaxGlobalBatch.
BatchPlan plan_batch(int64_t global_batch, int64_t micro_batch, int64_t dp);

}  // namespace reshard
