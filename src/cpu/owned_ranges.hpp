// Work sharing that keeps each thread on its own contiguous run of work items and
// still balances the end: items 0 … n−1 are cut into one range per thread; a thread
// takes the items of its own range from the front, and once it is empty takes items
// from the back of the others' ranges.
//
// Why not schedule(dynamic, 1): the attention kernels order items by (sequence,
// head, query block), and items of one head read the same packed K and V. Handed
// out one at a time, both threads of the Intel Xeon with AMX work on every head,
// so each core's L2 loads every head's K/V. With a range each, a core loads only its
// own heads' (measured on the bf16 forward at N = 2048, H = 8, 2 threads: see
// docs/PERFORMANCE.md). Unlike schedule(static), a thread slowed by another tenant
// of a shared machine does not hold the call up: the others finish its range, from
// its far end, which keeps the helper on heads the owner has not reached.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

namespace attn::detail {

class OwnedRanges {
 public:
  /// Items 0 … n−1 (n ≥ 0) in `ranges` contiguous ranges (at least 1), the first
  /// n % ranges of them one item longer.
  OwnedRanges(int n, int ranges) : count_(ranges < 1 ? 1 : ranges), ranges_(new Range[count_]) {
    const int per = n / count_, extra = n % count_;
    int at = 0;
    for (int r = 0; r < count_; ++r) {
      const int len = per + (r < extra ? 1 : 0);
      ranges_[r].span.store(Pack(at, at + len), std::memory_order_relaxed);
      at += len;
    }
  }

  /// Calls f(i) for the items the calling thread claims: its own range
  /// (`thread` % ranges) front first, then the other ranges from their backs. Every
  /// item is claimed exactly once over all the threads that call this.
  template <class F>
  void Run(int thread, F&& f) {
    const int own = thread % count_;
    for (int i; (i = Claim(ranges_[own], /*front=*/true)) >= 0;) f(i);
    for (int k = 1; k < count_; ++k) {
      Range& r = ranges_[(own + k) % count_];
      for (int i; (i = Claim(r, /*front=*/false)) >= 0;) f(i);
    }
  }

 private:
  // [front, back) of the items not yet claimed, in one word so that a claim from
  // either end is one compare-and-swap.
  struct alignas(64) Range {  // one cache line each: no false sharing between ranges
    std::atomic<uint64_t> span{0};
  };
  static uint64_t Pack(int front, int back) {
    return uint64_t{static_cast<uint32_t>(front)} << 32 | static_cast<uint32_t>(back);
  }
  /// The item taken from the front or the back of r, or −1 when r is empty.
  static int Claim(Range& r, bool front) {
    uint64_t s = r.span.load(std::memory_order_relaxed);
    for (;;) {
      const int f = static_cast<int>(s >> 32), b = static_cast<int>(s & 0xFFFFFFFFu);
      if (f >= b) return -1;
      const uint64_t next = front ? Pack(f + 1, b) : Pack(f, b - 1);
      if (r.span.compare_exchange_weak(s, next, std::memory_order_relaxed)) return front ? f : b - 1;
    }
  }
  int count_;
  std::unique_ptr<Range[]> ranges_;
};

}  // namespace attn::detail
