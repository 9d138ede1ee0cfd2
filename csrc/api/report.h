// Internal: the LoadReport every load path (CPU executor, CUDA loader) fills the same way.
#pragma once

#include "exec/executor.h"
#include "reshard/reshard.h"

namespace reshard {

/// Collective (all-reduces the byte counts). Fills everything but seconds and gbps, which the
/// caller sets from its own clock with finish_load_report.
LoadReport assemble_load_report(const Plan& plan, const Layout& target, const CheckpointReader& ckpt,
                                const ExecStats& st, uint64_t peak_staging_bytes, ReplicaPolicy policy,
                                Communicator& comm);

/// Sets seconds (max over ranks of `local_seconds`) and gbps. Collective.
void finish_load_report(LoadReport& r, double local_seconds, Communicator& comm);

}  // namespace reshard
