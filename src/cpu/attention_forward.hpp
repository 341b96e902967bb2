// The fused CPU attention forward (FlashAttention-2's tiled online softmax).
#pragma once

#include <cstdint>
#include <vector>

#include "problem.hpp"

namespace attn::detail {

/// Computes p's outputs (out, and lse / probs when requested) with `threads`
/// OpenMP threads, on the best SIMD target this CPU supports. Bitwise identical
/// for any thread count: work items are (sequence, head, query tile) and each is
/// computed the same way whichever thread runs it. q, k, v, out f32, bf16 or f16
/// (p.dtype): bf16/f16 are widened exactly where K/V are packed and q tiles loaded,
/// and out rounded once, so the result equals the f32 kernel's on the same values.
/// f32 inputs under Precision::bf16 (p.round_bf16()) are rounded to bf16 at the same
/// places: the result equals the f32 kernel's on rounded copies, without the copies.
void attention_forward_cpu(const Problem& p, int threads);

/// Bytes of workspace attention_forward_cpu(p, threads) uses (packed K/V + tiles).
size_t attention_forward_workspace_bytes(const Problem& p, int threads);

/// Name of the SIMD target attention_forward_cpu uses now ("AVX3", "AVX2", ...).
const char* attention_forward_target();

/// out[i] = 2^x[i] for x[i] ≤ 0 or NaN, i < n, computed as the softmax of the f32
/// kernels computes it on the current SIMD target (Exp2NonPositive): for tests of
/// its accuracy and of its edge cases (0, −∞, NaN, subnormal results).
void softmax_exp2(const float* x, float* out, size_t n);

/// The Highway targets compiled into the library that this CPU supports (one bit
/// each, HWY_AVX3 etc.), and a switch to make dispatch use only `target` (0 =
/// back to the best). For tests that run every kernel on every target.
std::vector<int64_t> simd_targets();
void force_simd_target(int64_t target);

}  // namespace attn::detail
