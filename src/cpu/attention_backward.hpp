// The fused CPU attention backward (FlashAttention-2's algorithm, deterministic).
#pragma once

#include "problem.hpp"

namespace attn::detail {

/// Computes dq, dk, dv (and dbias when requested) of `bp` with `threads` OpenMP
/// threads on the best SIMD target this CPU supports. Bitwise identical for any
/// thread count (see attention_backward.cc for how dQ's sum order is fixed).
void attention_backward_cpu(const BackwardProblem& bp, int threads);

}  // namespace attn::detail
