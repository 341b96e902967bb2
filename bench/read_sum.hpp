// The summing loop of the read-bandwidth benchmarks (bench::measure_read_bandwidth,
// bench/read_overlap): a loop that waits on memory, not on its own adds.
#pragma once

#include <cstdint>

namespace attn::bench {

/// The sum of x[0 … n) (x 16-byte aligned) in 8 independent running sums of 16-byte
/// vectors (GCC's vector extension, so that the baseline SSE2 build keeps them in
/// registers). One running sum — an `omp simd` reduction in an SSE2 build is one
/// addps chain, 16 bytes per add's latency — capped the loop at ~20 GB/s on a Zen 4
/// core that reads ~32 GB/s, and every "of read bandwidth" figure measured against
/// it before 2026-11-29 was too high (docs/PERFORMANCE.md, "The read bandwidth was
/// an add chain's").
inline float sum_for_reading(const float* __restrict x, int64_t n) {
  typedef float V4 __attribute__((vector_size(16)));
  V4 a0 = {}, a1 = {}, a2 = {}, a3 = {}, a4 = {}, a5 = {}, a6 = {}, a7 = {};
  const V4* v = reinterpret_cast<const V4*>(x);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32, v += 8) {
    a0 += v[0], a1 += v[1], a2 += v[2], a3 += v[3], a4 += v[4], a5 += v[5], a6 += v[6], a7 += v[7];
  }
  const V4 all = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7));
  float s = (all[0] + all[1]) + (all[2] + all[3]);
  for (; i < n; ++i) s += x[i];
  return s;
}

}  // namespace attn::bench
