// The bf16 (and f16) attention backward on Intel AMX tiles, or on AVX512-BF16's vdpbf16ps.
#pragma once

#include <cstddef>

#include "cpu/isa.hpp"
#include "problem.hpp"

namespace attn::detail {

/// Computes bp's dq, dk, dv with bf16 products: S, dP, dV, dK and dQ on AMX tiles
/// (path LowpPath::amx) or on vdpbf16ps (LowpPath::avx512bf16), bf16 operands and
/// f32 accumulation either way; softmax and dS in AVX-512. bp.fwd.dtype is bf16,
/// or f32 with Precision::bf16 (q, k, v and dout are then rounded to bf16 as they
/// are packed; the gradients are written in f32), or f16 on LowpPath::amx only
/// (every operand, P' and dS included, as exact hi + lo bf16 pieces, three tile
/// products per product; gradients written in f16), or f32 with Precision::bf16x3 on
/// LowpPath::amx only (the same pieces, holding 16 bits; gradients in f32). Bitwise
/// identical for any thread count. The caller checks that the CPU can run `path` (lowp_path() does).
/// Returns false, having written nothing, for what it leaves to the widened f32
/// path: a NaN or ±∞ in q, k, v or dout (after rounding), an lse whose magnitude
/// is 128 or more (the f32 kernel recomputes those rows' statistics), softcap, the
/// user's score mods, or a requested dbias.
bool attention_backward_amx(const BackwardProblem& bp, int threads, LowpPath path);

/// True when attention_backward_amx declines bp whatever its values: a requested
/// dbias, softcap, the user's score mods, or pieces (f16, Precision::bf16x3) off the
/// tile unit.
inline bool amx_backward_declines_options(const BackwardProblem& bp, LowpPath path) {
  return bp.dbias != nullptr || bp.fwd.softcap > 0.0f || bp.fwd.mods != nullptr ||
         (bp.fwd.pieces() == 2 && path != LowpPath::amx);
}

/// Bytes attention_backward_amx allocates for bp with `threads` threads: q, k, v and
/// dout packed as bf16 tiles (two pieces each for f16), one scratch per thread, and
/// the call's per-row lse, D and f32 dQ accumulator.
size_t attention_backward_amx_workspace_bytes(const BackwardProblem& bp, int threads);

}  // namespace attn::detail
