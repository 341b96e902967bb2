// Attention against a KV cache: decoding (one or a few new queries against a long
// cache), speculative decoding and chunked prefill, with FlashAttention's
// flash_attn_with_kvcache semantics and names where they exist.
//
// Layouts (the last dimension contiguous, any other non-negative strides):
//   q            [B, Lq, Hq, d]          out [B, Lq, Hq, dv]     lse f32 [B, Hq, Lq]
//   contiguous:  cache.k [B, capacity, Hkv, d]        cache.v [B, capacity, Hkv, dv]
//   paged:       cache.k [num_blocks, page_size, Hkv, d] (and v), cache.block_table
//                int32 [B, max_blocks]: logical position t of sequence b lives in
//                page block_table[b][t / page_size], row t % page_size. Any page size ≥ 1.
//   quantized caches (i8, f8e4m3): cache.k_scale / v_scale f32 [B, capacity, Hkv] (or
//                [num_blocks, page_size, Hkv]): key row = k_scale · k (one scale per
//                token and head; f8e4m3 codes are OCP E4M3 "e4m3fn", attn/tensor.hpp).
//   cache_seqlens int32 [B]: tokens already in each sequence's cache.
//   cache.batch_idx int32 [B] (contiguous caches, optional): sequence b's row of
//                cache.k / cache.v, which may then hold any number of rows.
//   k_new, v_new [B, Lnew, Hkv, d / dv]: appended in place at positions
//                cache_seqlens[b] … cache_seqlens[b] + Lnew − 1 before attending.
//
// Sequence b then attends over Lk = cache_seqlens[b] + Lnew keys, with the options'
// semantics exactly as attention() with Lq queries and Lk keys: bottom-right causal
// (the last query sees every key; TopLeft is also accepted), window, softcap, ALiBi,
// GQA/MQA (Hq a multiple of Hkv), lse. cache_seqlens is read, not advanced: add Lnew
// yourself after the call (as with FlashAttention).
//
// Dtypes: q, out (and k_new, v_new) f32, bf16 or f16; the cache f32, bf16, f16, i8 or
// f8e4m3 (k and v alike). New keys and values are rounded once to the cache's dtype
// (bf16, f16: nearest even) or quantized with one scale per token and head (i8: scale
// = max|x| / 127, values round(x / scale); f8e4m3: scale = max|x| / 448, values
// x / scale rounded to the nearest E4M3, ties to even — a token of zeros gets scale
// 0). The kernel reads the cache in its own dtype, with f32 scores, softmax and
// accumulation; nothing is re-packed per call. An E4M3 NaN code the kernel reads
// gives NaN, as a NaN in a float cache does. On CPUs whose vdpbf16ps runs at the
// FMA's rate (AMD Zen 4/5; ATTN_ISA=avx512bf16 forces it, ATTN_ISA=f32 forbids it), a
// bf16 cache read by queries whose values are all bf16 (bf16 queries, rotated or not,
// for instance) gets Q·Kᵀ on vdpbf16ps: the same exact products, summed
// in f32 in another order, scaled after the sum rather than before, and bf16
// subnormals (below 1.2e-38) read as zero.
//
// Chunked prefill: a call with Lq ≥ max(24, ⌈128·Hkv/Hq⌉) queries runs on attention()'s
// tiled kernels, which pack the keys and values once for all those queries (on Zen 4,
// 0.57–0.81× the decode kernel's time at 32–512 queries; docs/PERFORMANCE.md), with
// attention()'s results for its inputs: an f32, bf16 or f16 cache read by queries of
// its dtype as attention() computes them (f32 at f32's accuracy, options.precision
// ignored; bf16 and f16 as its 16-bit kernels: bf16's P rounded to bf16, lse within 1e-4
// relative); f32 queries on a bf16 cache under Precision::bf16 as attention() computes
// f32 inputs under it (queries rounded to bf16, P too; the output f32); any other pair
// at f32's accuracy on the f32 kernel: an i8 or f8e4m3 cache dequantized to f32
// (scale · code), a bf16/f16 cache read by queries of another dtype (or an f16 cache by
// rotated f16 queries) widened to f32 exactly, from twice the threshold (the widening
// costs a copy per call), queries not in f32 widened and the output rounded once. A
// paged cache whose pages lie apart, and every widened cache, is gathered a sequence
// at a time into a contiguous buffer first. Staying on the decode kernel: i8 caches
// on its integer passes (under Precision::bf16, or read by bf16 queries), which are as
// fast; a forced num_splits. The tiled kernels' packed copy (and a
// gathered block) stays in buffers the calling thread keeps, so a call runs on them
// in blocks of at most 64 MiB of keys and values (16k tokens of bf16 at Hkv = 8,
// d = 128): a batch with more, sequence by sequence, a longer sequence block by block,
// merged by the blocks' lse as merge_attention_states() merges. ATTN_KVCACHE_TILES_FROM=n
// sets the threshold (0: never).
//
// Rotary embeddings on append (FlashAttention's rotary_cos/rotary_sin): f32
// [max_position, rotary_dim / 2]; the first rotary_dim dimensions of each new key
// (row t at position cache_seqlens[b] + t) and of each query (row i at position
// cache_seqlens[b] + Lnew − Lq + i, aligned with the new tokens) rotate by the table's
// angles; interleaved pairs (0,1), (2,3)… (GPT-J) or halves (i, i + rotary_dim/2)
// (GPT-NeoX, Llama). FlashAttention rotates every query of a non-causal call at
// cache_seqlens[b]; attn rotates each query at its own position. The rotation is
// computed in f32; rotated bf16 queries are then rounded to bf16 (nearest even), as
// FlashAttention's kernel writes them back in their dtype, so that they stay bf16
// inputs (bf16 products on a bf16 cache, on either kernel); rotated f16 queries stay
// in f32 (their rounding to f16 could overflow).
//
// Split-KV (Flash-Decoding): each sequence's keys are cut into splits that separate
// threads compute, and the partial results are combined in split order as
// merge_attention_states() does. The automatic split count depends on the sequence
// length only (never on the thread count), so results are bitwise identical for any
// number of threads; a forced num_splits is too.
#pragma once

#include <cstdint>

#include "attn/attention.hpp"
#include "attn/tensor.hpp"

namespace attn {

/// A KV cache in the caller's memory (see the layouts above). block_table empty =
/// contiguous; k_scale and v_scale are required for i8 and f8e4m3 caches and refused
/// otherwise.
struct KVCache {
  TensorView k, v;
  TensorView k_scale, v_scale;
  TensorView block_table;
  /// Contiguous caches only (FlashAttention's cache_batch_idx): int32 [B], the batch
  /// row of cache.k / cache.v (and of the scales) that sequence b reads and appends
  /// to; empty = row b. The cache may then hold any number of rows ≥ 1 (a pool of
  /// slots that requests come and go in). Rows may repeat for reading; a call that
  /// appends may not write a row twice (attn::Error, naming both sequences).
  TensorView batch_idx;
};

/// What attention_with_kvcache appends and how it splits.
struct KVCacheOptions {
  /// New keys and values, appended before attending; give both or neither.
  TensorView k_new, v_new;
  /// Rotary tables (both or neither; need k_new): f32 [max_position, rotary_dim / 2].
  TensorView rotary_cos, rotary_sin;
  /// Rotary pairing: true = (0,1), (2,3)… (FlashAttention's default); false = halves.
  bool rotary_interleaved = true;
  /// Splits per sequence: 0 = automatic (by length), else 1 … kMaxKVSplits.
  int num_splits = 0;
};

/// The most splits num_splits accepts.
inline constexpr int kMaxKVSplits = 256;

/// Appends k_new / v_new (and rotates the keys if kv gives rotary tables) into the
/// cache, then computes out (and lse if given) for q against each sequence's
/// cache_seqlens[b] + Lnew keys. options: scale, causal, window, softcap,
/// alibi_slopes apply as in attention(); options.mask too (boolean, true = attend, or
/// additive in f32 or q's dtype), broadcast over [B, Hq, Lq, K] where K ≥ the longest
/// sequence's cache_seqlens[b] + Lnew: key j of sequence b (its position in the cache)
/// reads column j, and columns past a sequence's keys are not read (tree masks for
/// speculative decoding, padding masks carried over from a padded batch). NaN and ±∞
/// as in attention(): only a −∞ score (or `false`) removes a key, whose cached values
/// are then never read into the output; a seen key whose probability underflows to 0
/// (e.g. under a −FLT_MAX mask entry) still passes a NaN or ±∞ value on. block_mask,
/// cu_seqlens, key_lengths and dropout are attn::Errors here. options.precision:
/// f32 (and bf16x3) compute at f32's accuracy on every cache dtype; bf16 lets an i8
/// cache take both products on 16-bit integers (the scaled queries, and each pass of
/// 32 keys' probabilities times the values' scales, as fixed point: 2⁻¹⁶ of their
/// largest), where d and dv are multiples of 32 on AVX2/AVX-512 (vpdpwssd on CPUs with
/// AVX512-VNNI) and the CPU does not take its AMX-INT8 tile path: on Zen 4, 0.67–0.84x
/// the time of the f32 passes from DRAM, with errors ~1/100 of a plain bf16
/// implementation's (docs/PERFORMANCE.md); bf16 queries take them whatever the
/// precision (their output is bf16, rounded 2⁻⁹ of itself), f16 ones the exact passes.
/// A bf16 cache, where vdpbf16ps has the
/// FMA's rate (AMD Zen 4/5; d and dv multiples of 32), takes both products on it: f32
/// queries rounded to bf16 (as attention() rounds f32 inputs) for Q·Kᵀ, and P·V with
/// each pass's probabilities rounded to bf16 (FlashAttention's plain bf16 pipeline
/// rounds P so too; its error, with sharp attention, ~0.4x that pipeline's). Other
/// caches ignore it. bf16 queries on a bf16 cache are bf16 inputs, and take both
/// bf16 products whatever the precision (as attention()'s bf16 kernels do: P
/// rounded to bf16; the output is bf16 anyway); f16 queries keep f32 P·V. Throws
/// attn::Error, naming the argument, before writing anything: shapes, dtypes, a
/// block_table entry out of range or repeated within a sequence, a page another
/// sequence uses that this call would write, a cache.batch_idx row out of range (or
/// written twice, or given with a block_table), cache_seqlens + Lnew beyond the
/// capacity, a non-finite new value for a quantized cache, overlapping outputs.
void attention_with_kvcache(const TensorView& q, const KVCache& cache, const TensorView& cache_seqlens,
                            const TensorView& out, const AttentionOptions& options = {},
                            const KVCacheOptions& kv = {}, const TensorView& lse = {});

/// Only the append of attention_with_kvcache (for prefill: write a prompt's keys and
/// values, rotated and quantized, without attending). Same checks and semantics;
/// kv.num_splits is ignored.
void kvcache_append(const KVCache& cache, const TensorView& cache_seqlens, const KVCacheOptions& kv);

}  // namespace attn
