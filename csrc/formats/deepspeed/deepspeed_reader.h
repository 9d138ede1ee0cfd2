// DeepSpeed / Megatron-DeepSpeed checkpoint reader (owned by the DeepSpeed reader's author; this
// declaration is what open_checkpoint calls).
#pragma once

#include <memory>
#include <vector>
#include <string>

#include "reshard/checkpoint.h"

namespace reshard {

/// Opens one DeepSpeed step folder (e.g. ROOT/global_step20, holding *_model_states.pt and the
/// optimizer shard files). open_checkpoint resolves `latest` / the asked step before calling it.
/// `notes` (how the step was chosen) come first in the reader's notes.
std::unique_ptr<CheckpointReader> open_deepspeed(const std::string& step_dir, const OpenOptions& options,
                                                 std::vector<std::string> notes = {});

}  // namespace reshard
