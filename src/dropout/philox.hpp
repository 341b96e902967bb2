// Philox-4x32-10 (Salmon et al., "Parallel Random Numbers: As Easy as 1, 2, 3",
// SC'11): a counter-based generator — a pure function of (counter, key) — so the
// dropout decision for a score is the same in the forward and the backward, in
// any tile order and on any number of threads.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>

// The CUDA kernels draw the same numbers from this same code (src/cuda/): under nvcc
// these functions are compiled for the device as well (std::array and std::min are
// constexpr there with --expt-relaxed-constexpr).
#if defined(__CUDACC__)
#define ATTN_HOST_DEVICE __host__ __device__
#else
#define ATTN_HOST_DEVICE
#endif

namespace attn::detail {

using PhiloxCounter = std::array<uint32_t, 4>;
using PhiloxKey = std::array<uint32_t, 2>;

/// Ten rounds of Philox-4x32: four 32-bit random words for one counter.
ATTN_HOST_DEVICE inline PhiloxCounter philox4x32_10(PhiloxCounter c, PhiloxKey k) {
  constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
  constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // Weyl key increments
  for (int round = 0; round < 10; ++round) {
    const uint64_t p0 = uint64_t{kM0} * c[0], p1 = uint64_t{kM1} * c[2];
    c = {static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k[0], static_cast<uint32_t>(p1),
         static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k[1], static_cast<uint32_t>(p0)};
    k = {k[0] + kW0, k[1] + kW1};
  }
  return c;
}

/// The dropout decision for score (b, h, i, j): one Philox call yields the words
/// of four consecutive keys, so the counter is (j / 4, i, b·H + h, offset) and
/// the key (seed, with offset's high half folded in). Dropped iff the word is
/// below p·2^32.
class DropoutRng {
 public:
  ATTN_HOST_DEVICE DropoutRng(float p, uint64_t seed, uint64_t offset, int num_heads)
      : threshold_(p <= 0.0f ? 0u
                             : static_cast<uint32_t>(std::min(4294967295.0, double(p) * 4294967296.0))),
        key_{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32) ^ static_cast<uint32_t>(offset >> 32)},
        offset_(static_cast<uint32_t>(offset)),
        heads_(num_heads) {}

  /// Four decisions (keys j4·4 … j4·4+3) as a bit mask: bit n set = kept.
  ATTN_HOST_DEVICE unsigned keep4(int b, int h, int i, int j4) const {
    const PhiloxCounter w = philox4x32_10(
        {static_cast<uint32_t>(j4), static_cast<uint32_t>(i),
         static_cast<uint32_t>(b) * static_cast<uint32_t>(heads_) + static_cast<uint32_t>(h), offset_},
        key_);
    return unsigned{w[0] >= threshold_} | unsigned{w[1] >= threshold_} << 1 |
           unsigned{w[2] >= threshold_} << 2 | unsigned{w[3] >= threshold_} << 3;
  }
  ATTN_HOST_DEVICE bool keep(int b, int h, int i, int j) const { return (keep4(b, h, i, j >> 2) >> (j & 3)) & 1u; }

 private:
  uint32_t threshold_;
  PhiloxKey key_;
  uint32_t offset_;
  int heads_;
};

}  // namespace attn::detail
