// The one way reshard runs work on several threads, and the one setting for how many.
#pragma once

#include <cstddef>
#include <functional>

namespace reshard {

/// Threads an operation uses where its caller does not say (checksum passes, `reshard verify`,
/// synth, `inspect --stats`, and a load's io_threads = 0): $RESHARD_THREADS when set (an integer
/// 1..1024; anything else is Error(kInvalidArgument) naming the variable), else the machine's
/// cores, at most 8 (more threads did not read faster on the machines measured: docs/benchmarks.md).
int default_threads();

/// Calls fn(i, worker) for every i in [0, n), handing out one index at a time to the calling
/// thread and up to threads - 1 more (never more threads than items; threads <= 0 means
/// default_threads()). `worker` in [0, threads) names the thread, for per-thread scratch.
/// The first exception fn throws stops the handing out of further indices and is rethrown, with
/// its type, once every thread has finished. A thread the system cannot start leaves the work to
/// the others.
void parallel_for(size_t n, int threads, const std::function<void(size_t i, int worker)>& fn);

}  // namespace reshard
