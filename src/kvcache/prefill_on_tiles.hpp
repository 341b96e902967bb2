// attention_with_kvcache() calls with many queries per sequence — chunked prefill, a
// prompt's next few hundred tokens against the cache — run on attention()'s tiled
// kernels. The decode kernel reads each cached key once for up to 64 query rows and
// holds them in registers 4 at a time: at many rows it computes at ~0.5–0.7× the tiled
// kernels' rate (bf16 on Zen 4: 85 against 167 GFLOP/s at 512 queries), while the
// tiled kernels' one pass that packs the keys and values costs less the more rows
// share it (docs/PERFORMANCE.md, "Chunked prefill on the tiled kernels"). The
// opposite route, attention() with a few queries on the decode kernel, is
// few_queries.hpp.
#pragma once

#include <cstdint>

#include "attn/attention.hpp"
#include "kvcache/decode_problem.hpp"

namespace attn::detail {

/// The fewest queries per sequence (Lq) that take the tiled kernels, for Hq/Hkv =
/// `group`: max(24, ⌈128 / group⌉) — at least 128 query rows per kv head, and whole
/// query tiles mostly filled (measured crossovers on Zen 4, 512 and 4,096 keys, f32
/// and bf16). ATTN_KVCACHE_TILES_FROM=n overrides it (0 turns the route off), so that
/// tests run both kernels on the same calls.
int kvcache_tiles_from(int group);

/// Keys per block for a sequence whose keys and values take `bytes_per_key` bytes per
/// token as the tiled kernels read them (the cache's dtype; f32 for quantized caches):
/// 64 MiB of them, in whole 256-key panels (16,384 tokens of bf16 at Hkv = 8, d = 128).
/// A batch with more keys runs sequence by sequence, and a longer sequence block by
/// block, merged by the blocks' lse, so that the kernels' packed copy and a gathered
/// block, which stay in buffers the calling thread keeps, never hold more than a
/// block. ATTN_KVCACHE_TILES_BLOCK=n overrides it (tests).
int kvcache_tiles_block_keys(int64_t bytes_per_key);

/// Computes the attention part of p (checked by make_decode_problem, appended) on the
/// tiled kernels and returns true, or returns false without touching an output when
/// the call is not one they take: fewer queries than kvcache_tiles_from() (twice that
/// where a bf16/f16 cache is widened to f32, below), a forced num_splits (the decode
/// kernel's splits), or an i8 cache that the decode kernel reads on its integer passes
/// (under Precision::bf16, or for bf16 queries; d and dv multiples of 32), which are as
/// fast. The kernel and its inputs:
///   - queries and a cache of one float dtype: attention()'s kernel for that dtype,
///     the cache read in place (rotated bf16 queries are bf16 again: prepare_queries);
///   - f32 queries on a bf16 cache under Precision::bf16: the bf16 kernel, the queries
///     rounded to bf16 (as the decode kernel's bf16 products round them), out f32;
///   - otherwise the f32 kernel at f32's accuracy: a bf16/f16 cache read by queries of
///     another dtype, or an f16 cache read by rotated f16 queries (which stay f32), is
///     widened to f32 exactly; a quantized cache is dequantized (scale · code); queries
///     not in f32 are widened, and the output rounded once.
/// options.precision is otherwise ignored, as the decode kernel ignores it for f32
/// caches. A widened cache, and a paged cache whose pages for a sequence do not follow
/// one another in memory, is first copied, one sequence (or block of
/// kvcache_tiles_block_keys()) at a time, into a contiguous buffer.
bool attention_prefill_on_tiles(const DecodeProblem& p, int threads);

}  // namespace attn::detail
