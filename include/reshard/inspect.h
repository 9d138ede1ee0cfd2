// `reshard inspect DIR --json`: what a checkpoint holds, generic over CheckpointReader.
#pragma once

#include <string>

#include "reshard/checkpoint.h"

namespace reshard {

/// One JSON object (UTF-8, pretty-printed):
///   {path, writer, topology: {tp, pp, vpp, dp, zero}, iteration, step, consumed_samples,
///    model: {...}, tensors: [{name, shape, dtype, split, real_rows?}] (canonical names, global
///    shapes), files: [paths], problems: [strings], notes: [strings], stats?: {...}}
/// problems: replicated copies that differ (tensor, state kind, max |diff|) found by planning to
/// tp=1,pp=1,dp=1 with replica comparison on, and coverage errors (missing files). With `stats`:
/// per tensor of the consolidated 16-bit weights {mean, std, min, max, zero_fraction} (replicas:
/// the first copy). Errors reading the checkpoint's bytes propagate.
std::string inspect_json(const CheckpointReader& reader, bool stats);

}  // namespace reshard
