// The bf16 attention forward on Intel AMX tiles.
#pragma once

#include <cstddef>

#include "problem.hpp"

namespace attn::detail {

/// Computes p's out (and lse) with AMX: Q·Kᵀ and P·V on tiles (bf16 operands, f32
/// accumulation), the online softmax in AVX-512. p.dtype is bf16, or f32 when the
/// caller asked for Precision::bf16 (q, k, v are then rounded to bf16 as they are
/// packed; out is written in f32). Every option of the f32 kernel except explicit
/// probabilities (p.probs must be null). Bitwise identical for any thread count.
/// The caller checks cpu_features().amx_bf16 first.
/// Returns false, having written nothing, when q, k or v holds a NaN or ±∞ (after
/// rounding to bf16): tdpbf16ps treats subnormals as zero, which would change how
/// 0·∞ and ∞ − ∞ come out, so those calls take the portable path for the reference's
/// exact semantics.
bool attention_forward_amx(const Problem& p, int threads);

/// Bytes of workspace attention_forward_amx(p, threads) uses (packed Q/K/V + tiles).
size_t attention_forward_amx_workspace_bytes(const Problem& p, int threads);

}  // namespace attn::detail
