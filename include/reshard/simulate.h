// Executes a whole plan in one process: every rank's reads, exchanges and writes, with the bytes
// coming from a read callback and the target buffers given as pointers. Used by the single-process
// `convert`, by the property tests (an in-memory executor for A->B->A checks) and as the reference
// the distributed executor is tested against. Pure: all I/O goes through the callbacks.
#pragma once

#include <functional>
#include <vector>

#include "reshard/plan.h"

namespace reshard {

/// Reads `length` bytes of source file `file` at `offset` into dst; throws reshard::Error on failure.
using ReadFn = std::function<void(int32_t file, uint64_t offset, uint64_t length, void* dst)>;

/// Replica comparison outcome for one ReplicaCompare entry.
struct ReplicaResult {
  size_t compare = 0;   // index into Plan::replica_compares
  double max_abs_diff = 0;
};

/// Runs the plan: replica comparisons first (returns their results; with policy kError a
/// difference above atol throws Error(kDataLoss) naming the tensor and max |diff| before any
/// target byte is written), then every fragment, then the fills. target_buffers[i] points at the
/// memory of target layout buffer i (numel * dtype_size bytes).
std::vector<ReplicaResult> simulate_plan(const Plan& plan, const Layout& target, const ReadFn& read,
                                         const std::vector<void*>& target_buffers,
                                         ReplicaPolicy policy = ReplicaPolicy::kError, double atol = 0.0);

/// Max |a - b| over a box read from two replica locations (values converted to double; equal values,
/// equal infinities and two NaNs count as equal, a NaN against a number as +inf). Reads and compares slab by slab (at most 2^18
/// elements at a time; bitwise-equal slabs of one dtype are 0 without conversion), so memory stays
/// small for any box. Errors: whatever `read` throws.
double replica_max_abs_diff(const ReplicaCompare& c, const ReadFn& read);

/// Replica policy kAverage: replaces the packed box of fragment `f` (row-major, dtype f.src_dtype,
/// already read into `packed`) by the element-wise mean over its own copy and every
/// Plan::replica_sources entry of the fragment holding that element (float dtypes only; the
/// planner gives integer arrays no replica sources). The sum is taken in double and rounded to
/// f.src_dtype (16-bit types via fp32, as everywhere in reshard), so copies that agree give back
/// exactly the same bits. Returns
/// the bytes read for the replicas. Errors: whatever `read` throws (nothing in `packed` changes
/// before every replica has been read).
uint64_t average_replicas(const Plan& plan, const Fragment& f, const ReadFn& read, void* packed);

/// Reads a strided source box into a packed row-major buffer of its source dtype, issuing one
/// read per contiguous run (runs adjacent in the file are merged by for_each_run).
void read_box(int32_t file, uint64_t byte_base, DType dtype, const Box& box,
              const std::array<int64_t, kMaxDims>& strides, const ReadFn& read, void* packed);

}  // namespace reshard
