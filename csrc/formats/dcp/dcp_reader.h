// torch.distributed.checkpoint (DCP) folder reader: what open_checkpoint calls for a step folder
// holding a `.metadata` file.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "reshard/checkpoint.h"

namespace reshard {

/// Whether `dir` is a DCP checkpoint folder (it holds a regular file `.metadata`).
bool is_dcp_step(const std::string& dir);

/// Opens a DCP folder written by torch.distributed.checkpoint's FileSystemWriter (torch.save
/// serialization). The `.metadata` pickle goes through reshard's non-executing unpickler and only
/// the DCP metadata classes, torch.Size, torch dtypes and pathlib paths are accepted: any other
/// global is refused by name (kInvalidArgument) and nothing is ever called. Each tensor chunk is
/// located by the byte range the metadata gives in its `__R_C.distcp` file and checked against
/// the torch.save archive found there (dtype, shape, contiguity) before any read of data.
///
/// Keys map to tensors as the flat state_dict keys name them: the model's under a common prefix
/// ("model."), the optimizer's `<prefix>state.<fqn>.exp_avg|exp_avg_sq|step`; the prefixes are
/// inferred (a note says which). Step counters become NonTensorState::step when they agree; other
/// non-tensor entries (param_groups) are parsed with the same unpickler into the state JSON.
/// Errors: kDataLoss for a damaged `.metadata`, a truncated data file, a chunk outside its
/// tensor or overlapping another, an archive that disagrees with the metadata; kUnsupported for
/// transforms (compression) or another serialization; kInvalidArgument when a model description
/// is given (a DCP folder is read by its keys). A missing data file is a note ("missing file: ")
/// with its chunks' location -1, so the planner names the uncovered elements.
std::unique_ptr<CheckpointReader> open_dcp(const std::string& dir, const OpenOptions& options,
                                           std::vector<std::string> notes = {});

}  // namespace reshard
