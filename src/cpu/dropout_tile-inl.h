// Dropout on a tile of probabilities, shared by the f32 and the AMX forward kernels
// (per Highway target, hence the toggling include guard).

#if defined(ATTN_CPU_DROPOUT_TILE_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DROPOUT_TILE_INL_H_
#undef ATTN_CPU_DROPOUT_TILE_INL_H_
#else
#define ATTN_CPU_DROPOUT_TILE_INL_H_
#endif

#include <hwy/highway.h>

#include "cpu/tile_kernels-inl.h"
#include "dropout/dropout_at.hpp"
#include "problem.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

/// Dropout on `rows` rows × Bk probabilities at s (row stride ld): each is kept
/// with probability 1 − p and then scaled by 1/(1 − p), or zeroed; the decision is
/// Philox's for (b, h, i, j) at the positions of the whole sequence, whatever the
/// tiling or the thread. j0 is a multiple of 4.
HWY_INLINE void ApplyDropout(const Problem& p, int b, int h, int i0, int rows, int j0, float* s,
                             size_t ld) {
  const DropoutRng rng = dropout_rng(p);
  const float scale = 1.0f / (1.0f - p.dropout_p);
  for (int r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    for (int j = 0; j < kBk; j += 4) {
      const unsigned keep = keep4_at(rng, p, b, h, i0 + r, j0 + j);
      for (int n = 0; n < 4; ++n) row[j + n] = (keep >> n) & 1u ? row[j + n] * scale : 0.0f;
    }
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
