// What the backward kernels (flash_backward.cu, flash_backward_wgmma.cu) share: the
// per-row statistics the prep kernel writes, P and dS of one score from them, and the
// query rows a key block gets gradient from.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/mma_fragments.cuh"
#include "cuda/score_mods.cuh"

namespace attn::cuda {

/// Per query row (b, h, i) at ((b·Hq + h)·max_lq + i): D and the statistics of P.
struct RowStats {
  float* dsum = nullptr;
  float* m = nullptr;      // P = e^(S − m) · inv_l; −∞ for a row with no visible key
  float* inv_l = nullptr;
  int max_lq = 0;
  // dbias only: dS before softcap' of every (b, h, i, j) at ((b·Hq + h)·max_lq + i)·max_lk + j,
  // zero where no tile wrote it; summed over the mask's broadcast dimensions afterwards.
  float* ds_all = nullptr;
  int max_lk = 0;
  __device__ int64_t at(int Hq, int b, int h, int i) const {
    return (int64_t{b} * Hq + h) * max_lq + i;
  }
  /// Row i's m, 1/l and D, or a row's with no visible key (P = 0) where `real` is false
  /// (a row past its sequence's end).
  __device__ void load(int Hq, int b, int h, int i, bool real, float& m_i, float& inv_l_i, float& dsum_i) const {
    if (real) {
      const int64_t x = at(Hq, b, h, i);
      m_i = m[x], inv_l_i = inv_l[x], dsum_i = dsum[x];
    } else {
      m_i = -INFINITY, inv_l_i = 0.0f, dsum_i = 0.0f;
    }
  }
};

/// P of one score from its row's statistics: exact 0 for a removed key (−∞) and for
/// a row with no visible key.
__device__ __forceinline__ float probability(float x, float m, float inv_l) {
  if (x == -INFINITY || m == -INFINITY) return 0.0f;
  return fast_exp2((x - m) * 1.4426950408889634f) * inv_l;
}

/// dS of one score: P ∘ (dP' − D) ∘ softcap'; exactly 0 where P is (a removed key
/// contributes nothing, even where its dP is NaN or ±∞).
__device__ __forceinline__ float score_gradient(float pr, float dp, float keep, float dsum, float cap_grad) {
  return pr == 0.0f ? 0.0f : pr * cap_grad * (dp * keep - dsum);
}


/// The first query row whose band reaches key j0 (hi ≥ j0), and the last whose band
/// starts at or before key j1 (lo ≤ j1): the rows a key block can get gradient from.
/// Both bounds never decrease with the row, so a binary search finds each.
__device__ __forceinline__ void rows_reaching(const ForwardParams& p, const SeqDesc& s, int64_t j0, int64_t j1,
                                              int& first, int& last) {
  int lo = 0, hi = s.Lq;  // first: smallest i with band.hi ≥ j0, or Lq
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (band_of_row(p, s, mid).hi >= j0) hi = mid; else lo = mid + 1;
  }
  first = lo;
  lo = -1, hi = s.Lq - 1;  // last: largest i with band.lo ≤ j1, or −1
  while (lo < hi) {
    const int mid = hi - (hi - lo) / 2;
    if (band_of_row(p, s, mid).lo <= j1) lo = mid; else hi = mid - 1;
  }
  last = lo;
}

}  // namespace attn::cuda
