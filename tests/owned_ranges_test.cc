// OwnedRanges (src/cpu/owned_ranges.hpp), the kernels' work sharing: every item is
// claimed exactly once, however many threads call it; a thread starts on its own
// range, in order.
#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

#include "cpu/owned_ranges.hpp"

namespace attn::detail {
namespace {

TEST(OwnedRanges, EveryItemOnceForAnyThreadAndRangeCount) {
  for (int n : {0, 1, 3, 17, 1000}) {
    for (int ranges : {1, 2, 3, 7}) {
      for (int threads : {1, 2, 4, 9}) {
        OwnedRanges work(n, ranges);
        std::vector<std::atomic<int>> claims(static_cast<size_t>(n));
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
          pool.emplace_back([&, t] {
            work.Run(t, [&](int i) {
              ASSERT_GE(i, 0);
              ASSERT_LT(i, n);
              claims[static_cast<size_t>(i)].fetch_add(1);
            });
          });
        }
        for (std::thread& th : pool) th.join();
        for (int i = 0; i < n; ++i) {
          ASSERT_EQ(claims[static_cast<size_t>(i)].load(), 1)
              << "item " << i << " of " << n << ", " << ranges << " ranges, " << threads << " threads";
        }
      }
    }
  }
}

// Alone, a thread takes its own range front first, then the next ranges back first:
// 17 items in 3 ranges are [0, 6), [6, 12), [12, 17).
TEST(OwnedRanges, OwnRangeFrontFirstThenTheOthersFromTheBack) {
  OwnedRanges work(17, 3);
  std::vector<int> order;
  work.Run(1, [&](int i) { order.push_back(i); });
  const std::vector<int> expected = {6, 7, 8, 9, 10, 11, 16, 15, 14, 13, 12, 5, 4, 3, 2, 1, 0};
  EXPECT_EQ(order, expected);
}

}  // namespace
}  // namespace attn::detail
