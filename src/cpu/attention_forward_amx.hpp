// The bf16 attention forward on Intel AMX tiles, or on AVX512-BF16's vdpbf16ps.
#pragma once

#include <cstddef>

#include "cpu/isa.hpp"
#include "problem.hpp"

namespace attn::detail {

/// Computes p's out (and lse) with bf16 products (bf16 operands, f32 accumulation)
/// and the online softmax in AVX-512. path: LowpPath::amx puts Q·Kᵀ and P·V on AMX
/// tiles; LowpPath::avx512bf16 computes the same products with vdpbf16ps. p.dtype is bf16, or f32 when the
/// caller asked for Precision::bf16 (q, k, v are then rounded to bf16 as they are
/// packed; out is written in f32). Every option of the f32 kernel except explicit
/// probabilities (p.probs must be null). Bitwise identical for any thread count.
/// p.dtype may also be f16 with LowpPath::amx: every value is packed as two bf16
/// pieces, hi + lo, that sum to it exactly, and each product takes three tile
/// products (hi·hi + lo·hi + hi·lo; P is split likewise), so the result keeps f16's
/// accuracy at a third of the bf16 speed. With LowpPath::avx512bf16 f16 is declined.
/// f32 inputs with Precision::bf16x3 (p.split_f32()) take the same pieces on
/// LowpPath::amx only, holding 16 significant bits of each value, with P from the f32
/// kernel's exponential; out is written in f32.
/// The caller checks that the CPU can run `path` (lowp_path() does).
/// Returns false, having written nothing, when q, k or v holds a NaN or ±∞ (after
/// rounding to bf16): tdpbf16ps and vdpbf16ps treat subnormals as zero, which would change how
/// 0·∞ and ∞ − ∞ come out, so those calls take the portable path for the reference's
/// exact semantics.
bool attention_forward_amx(const Problem& p, int threads, LowpPath path);

/// Bytes of workspace attention_forward_amx(p, threads, path) uses (packed Q/K/V +
/// per-thread score and output blocks; the same for either path).
size_t attention_forward_amx_workspace_bytes(const Problem& p, int threads);

/// out[i] = 2^x[i] by the bf16 kernels' exponential (Exp2Probability, amx_tiles-inl.h),
/// for its tests; false, writing nothing, where this CPU does not run those kernels.
bool probability_exp2(const float* x, float* out, size_t n);

}  // namespace attn::detail
