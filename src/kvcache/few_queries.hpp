// attention() calls with a few queries per sequence — a decoding step that passes the
// whole past as k and v, as PyTorch models do through scaled_dot_product_attention —
// run on the decode kernel (cpu/attention_decode.cc), which reads k and v where they
// lie. The tiled kernels pack every key and value into their tile layouts and pad the
// queries to a whole tile, so for one query they spend 3–4× the decode kernel's time
// on that (docs/PERFORMANCE.md, "Few queries").
#pragma once

#include "attn/attention.hpp"
#include "problem.hpp"

namespace attn::detail {

/// The most queries per sequence that take the decode kernel for keys of length
/// max_lk, inputs of `dtype` and Hq/Hkv = `group`: 4, or 8 from 256 keys on (measured
/// crossovers on the Intel Xeon with AMX, against the AMX and f32 tiled kernels). On
/// CPUs whose vdpbf16ps has the FMA's rate and that have no AMX (AMD Zen 4/5), from 256
/// keys on: 16 for bf16, and for f32 and f16 16 while Lq·group ≤ 64 (measured on Zen 4,
/// 1 and 2 threads, SDPA's and FlashAttention's layouts: the decode kernel took
/// 0.32–0.77× the tiled kernels' time at 9–16 queries; docs/PERFORMANCE.md, "A few
/// queries: up to 16 on Zen 4"). ATTN_FEW_QUERIES=n overrides it (0 turns the route
/// off), so that tests run both kernels on the same calls.
int few_queries_limit(int max_lk, DType dtype, int group);

/// Computes the forward of p (checked by make_problem) on the decode kernel and
/// returns true, or returns false without touching an output when the call is not
/// one the decode kernel computes: more queries than few_queries_limit(), sequences
/// of unequal query lengths, block masks (boolean and additive masks go along),
/// user modifiers, dropout, explicit
/// probabilities, a placed call, or f32 inputs with Precision::bf16 (which asks for
/// rounded inputs). The decode kernel's arithmetic is f32 throughout (bf16/f16 inputs
/// widened exactly, P kept in f32), at least as accurate as the tiled kernels'.
bool attention_few_queries(const Problem& p, int threads);

}  // namespace attn::detail
