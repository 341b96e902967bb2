// Bytes the kernels move, counted where they move them, for tests that check how
// work scales with the problem: decoding N tokens must read each cached row once per
// step and re-pack nothing (O(N·L) traffic), where running attention() per token
// packs the whole cache every time (O(N·L) packing on top, O(N²) when L grows with N).
// Relaxed atomics added once per tile or work item: too rare to cost anything.
#pragma once

#include <atomic>
#include <cstdint>

namespace attn::detail {

struct TrafficCounters {
  std::atomic<uint64_t> packed_bytes{0};         ///< K/V copied into attention()'s tile layouts
  std::atomic<uint64_t> cache_read_bytes{0};     ///< KV-cache rows (and i8 scales) the decode kernel read
  std::atomic<uint64_t> cache_written_bytes{0};  ///< KV-cache rows (and scales) appended

  void reset() {
    packed_bytes = 0;
    cache_read_bytes = 0;
    cache_written_bytes = 0;
  }
  static void add(std::atomic<uint64_t>& counter, uint64_t bytes) { counter.fetch_add(bytes, std::memory_order_relaxed); }
};

/// The process's counters (one instance: an inline function's static).
inline TrafficCounters& traffic() {
  static TrafficCounters counters;
  return counters;
}

}  // namespace attn::detail
