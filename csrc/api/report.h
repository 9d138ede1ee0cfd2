// Internal: the LoadReport every load path (CPU executor, CUDA loader) fills the same way.
#pragma once

#include "exec/executor.h"
#include "reshard/reshard.h"

namespace reshard {

/// Collective: one all-gather of every rank's byte counts, peaks and `local_seconds` (this
/// rank's wall time of the load so far). Fills the report, seconds (max over ranks) and gbps
/// (target_bytes / seconds / 1e9) included. Throws Error(kInternal) if a rank's totals arrive
/// malformed.
LoadReport assemble_load_report(const Plan& plan, const Layout& target, const CheckpointReader& ckpt,
                                const ExecStats& st, uint64_t peak_staging_bytes, ReplicaPolicy policy,
                                double local_seconds, Communicator& comm);

}  // namespace reshard
