// The fused CPU attention backward (FlashAttention-2's algorithm, deterministic).
#pragma once

#include <cstddef>

#include "problem.hpp"

namespace attn::detail {

/// Computes dq, dk, dv (and dbias when requested) of `bp` with `threads` OpenMP
/// threads on the best SIMD target this CPU supports, in f32 arithmetic: bf16/f16
/// problems (an f32 mask, if any) are widened row by row where the kernel packs
/// them and their gradients rounded once where it writes them; f32 problems under
/// Precision::bf16 have q, k and v rounded to bf16 where they are packed. Bitwise
/// identical for any thread count (see attention_backward.cc for how dQ's sum order
/// is fixed).
void attention_backward_cpu(const BackwardProblem& bp, int threads);

/// Bytes attention_backward_cpu allocates for `p` with `threads`
/// threads: the packed key/value tiles, one tile scratch per thread, and the per-row
/// statistics and per-tile counters of the call.
size_t attention_backward_workspace_bytes_cpu(const Problem& p, int threads);

}  // namespace attn::detail
