// What the benchmarks share for timing: a monotonic clock in seconds and the median of
// repeated measurements (the figure every table quotes: machines here are noisy).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace attn::bench {

/// Seconds on the steady clock (differences only).
inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// The median of v (the upper one for an even count); 0 for none.
inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace attn::bench
