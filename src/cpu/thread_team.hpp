// Runs a kernel's parallel body on a team of OpenMP threads, or on the caller alone.
#pragma once

#include <omp.h>

namespace attn::detail {

/// Calls body() once on each thread of a new team of `threads` OpenMP threads, or
/// once on the calling thread when threads ≤ 1. The body may use orphaned
/// worksharing (`omp for`, `omp single`, `omp barrier`): outside a team they run on
/// the caller alone. Why not `#pragma omp parallel if (threads > 1)`: libgomp still
/// builds a team of one for it and wakes its barriers' futex, 3 system calls per
/// call — about 1 µs, a seventh of a 1-key decoding step on Zen 4 (measured with
/// strace and decode_rate, 2026-11-27).
/// A caller inside its own active parallel region (one attention call per thread of
/// the caller's team) always gets a team of its own: run on the caller, the body's
/// worksharing would bind to the caller's team, dealing this call's work out to
/// threads that are running other calls (wrong results, or a barrier never met).
/// Nested parallelism being off by default, that team has one thread.
template <class Body>
void RunOnThreads(int threads, Body&& body) {
  if (threads > 1 || omp_in_parallel()) {
#pragma omp parallel num_threads(threads > 1 ? threads : 1)
    body();
  } else {
    body();
  }
}

}  // namespace attn::detail
