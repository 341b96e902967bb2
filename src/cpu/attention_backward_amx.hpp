// The bf16 attention backward on Intel AMX tiles.
#pragma once

#include <cstddef>

#include "problem.hpp"

namespace attn::detail {

/// Computes bp's dq, dk, dv with AMX: S, dP, dV, dK and dQ on tiles (bf16
/// operands, f32 accumulation), softmax and dS in AVX-512. bp.fwd.dtype is bf16,
/// or f32 with Precision::bf16 (q, k, v and dout are then rounded to bf16 as they
/// are packed; the gradients are written in f32). Bitwise identical for any thread
/// count. The caller checks cpu_features().amx_bf16 first.
/// Returns false, having written nothing, for what it leaves to the widened f32
/// path: a NaN or ±∞ in q, k, v or dout (after rounding), an lse whose magnitude
/// is 128 or more (the f32 kernel recomputes those rows' statistics), softcap, the
/// user's score mods, or a requested dbias.
bool attention_backward_amx(const BackwardProblem& bp, int threads);

}  // namespace attn::detail
