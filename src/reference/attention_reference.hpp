// The reference attention forward: the plainest possible code, computing every
// score of every (query, key) pair explicitly. It is the oracle for the fused
// kernels, so it favours being obviously right over being fast: no tiling, no
// SIMD, no threads, and visibility decided per (i, j) straight from the options.
//
// Instantiated for T = double (the oracle) and T = float (a "plain f32
// implementation", the yardstick of FlashAttention's ≤ 2× error rule).
#pragma once

#include "../problem.hpp"

namespace attn::detail {

/// Computes the forward of `p` in precision T. Outputs are written to `out`, `lse`
/// and `probs` (each may be nullptr) at the offsets and strides of p's views, i.e.
/// `out` must span as many elements as the `out` view does.
template <class T>
void reference_forward(const Problem& p, T* out, T* lse, T* probs);

/// True when key j is visible to query i of sequence b, head h, before the additive
/// parts (scores of −∞ are removed later) and before the user's mask_mod.
bool reference_visible(const Problem& p, int b, int h, int i, int j);

}  // namespace attn::detail
