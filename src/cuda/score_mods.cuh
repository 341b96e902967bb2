// The score of one (query row, key) as attention() defines it, and the dropout
// decisions, on the GPU: shared by the forward and the backward kernels so that both
// see the same scores. The CPU's rules (cpu/score_mods-inl.h, dropout/philox.hpp).
#pragma once

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/mma_fragments.cuh"
#include "dropout/philox.hpp"

namespace attn::cuda {

/// The band of query row i (positions in the sequence): keys lo..hi survive causal,
/// window and key length; lo > hi means none. attention()'s rule (BandOfRow), in the
/// whole sequence's positions for a placed call. lo and hi never decrease with i.
struct Band {
  int64_t lo, hi;
};
__device__ __forceinline__ Band band_of_row(const ForwardParams& p, const SeqDesc& s, int64_t i) {
  const int64_t at = i + p.q_pos0;
  const int64_t shifted = at + s.align;
  int64_t first = p.k_pos0, last = p.k_pos0 + s.Lk - 1;
  if (p.causal == 1) last = min(last, at);
  if (p.causal == 2) last = min(last, shifted);
  if (p.window_left >= 0) first = max(first, shifted - p.window_left);
  if (p.window_right >= 0) last = min(last, shifted + p.window_right);
  return {first - p.k_pos0, last - p.k_pos0};
}

/// The block-sparse mask's entry for (row i, key j) of (sequence b, head h).
__device__ __forceinline__ int32_t block_entry(const ForwardParams& p, int b, int h, int64_t i, int64_t j) {
  return p.bm_blocks[b * p.bm_b + h * p.bm_h + (i / p.bm_bq) * p.bm_qb + (j / p.bm_bk) * p.bm_kb];
}

/// Whether the block-sparse mask removes every key of rows [i0, i1] × keys [j0, j1] of
/// (sequence b, head h): then the tile is skipped. Every thread of the block must call
/// it (a vote across the block); false without a block mask.
template <int kBlockThreads>
__device__ __forceinline__ bool tile_blocked(const ForwardParams& p, int b, int h, int64_t i0, int64_t i1, int64_t j0,
                                             int64_t j1) {
  if (p.bm_blocks == nullptr || i1 < i0 || j1 < j0) return false;
  const int64_t qb0 = i0 / p.bm_bq, nqb = i1 / p.bm_bq - qb0 + 1;
  const int64_t kb0 = j0 / p.bm_bk, nkb = j1 / p.bm_bk - kb0 + 1;
  bool live = false;
  for (int64_t x = threadIdx.x; x < nqb * nkb && !live; x += kBlockThreads) {
    const int64_t qb = qb0 + x / nkb, kb = kb0 + x % nkb;
    live = p.bm_blocks[b * p.bm_b + h * p.bm_h + qb * p.bm_qb + kb * p.bm_kb] != -1;
  }
  return !__syncthreads_or(live);
}

/// The first key tile at or after key j (tiles of Bc keys, up to key_hi) that the
/// block-sparse mask leaves some key of for rows [i0, i1] of (sequence b, head h), or −1.
/// Every thread of the block must call it (tile_blocked votes).
template <int kBlockThreads, int Bc>
__device__ __forceinline__ int64_t first_live_tile(const ForwardParams& p, const SeqDesc& s, int b, int h, int64_t i0,
                                                   int64_t i1, int64_t j, int64_t key_hi) {
  for (; j <= key_hi; j += Bc) {
    if (!tile_blocked<kBlockThreads>(p, b, h, i0, i1, j, min(j + Bc, int64_t{s.Lk}) - 1)) return j;
  }
  return -1;
}

/// The score of row i and key j from the raw product q_i·k_j, in attention()'s order:
/// scale, softcap, ALiBi (slope of this head), masks, block mask, band (−∞ outside it).
/// *cap_grad receives ∂score/∂(scale·q·k): 1 − tanh² under softcap, else 1.
__device__ __forceinline__ float modified_score(const ForwardParams& p, const SeqDesc& s, int b, int h, float slope,
                                                int64_t i, int64_t j, const Band& band, float raw,
                                                float* cap_grad = nullptr) {
  float x = raw * p.scale;
  float grad = 1.0f;
  if (p.softcap > 0.0f) {
    const float th = tanhf(x / p.softcap);
    x = p.softcap * th;
    grad = 1.0f - th * th;
  }
  if (p.alibi != nullptr) x -= slope * fabsf(static_cast<float>(i + p.q_pos0 + s.align - (j + p.k_pos0)));
  if (i < s.Lq && j < s.Lk) {
    const int64_t at = b * p.mask_b + h * p.mask_h + i * p.mask_i + j * p.mask_j;
    if (p.add_mask != nullptr) x += p.add_mask[at];
    if (p.bool_mask != nullptr && p.bool_mask[at] == 0) x = -INFINITY;
    if (p.bm_blocks != nullptr) {
      const int32_t e = block_entry(p, b, h, i, j);
      if (e == -1 || (e >= 0 && p.bm_tiles[e * p.bm_t + (i % p.bm_bq) * p.bm_r + j % p.bm_bk] == 0)) x = -INFINITY;
    }
  }
  if (j < band.lo || j > band.hi) x = -INFINITY;
  if (cap_grad != nullptr) *cap_grad = grad;
  return x;
}

/// Whether the call modifies no score element by element (no softcap, ALiBi, mask or
/// block mask): then modified_score of a key inside its row's band is scale·raw, and a
/// tile inside every row's band (tile_inside_bands) takes the plain path.
__device__ __forceinline__ bool scores_plain(const ForwardParams& p) {
  return p.softcap <= 0.0f && p.alibi == nullptr && p.add_mask == nullptr && p.bool_mask == nullptr &&
         p.bm_blocks == nullptr;
}

/// Whether keys [j0, j1] lie inside the band of every row from `first` to `last`: the
/// bands' bounds never decrease with the row, so the last row's lo and the first row's
/// hi bound them all (and hi < Lk).
__device__ __forceinline__ bool tile_inside_bands(const Band& first, const Band& last, int64_t j0, int64_t j1) {
  return j0 >= last.lo && j1 <= first.hi;
}

/// The ALiBi slope of (sequence b, head h); 0 without ALiBi.
__device__ __forceinline__ float alibi_slope(const ForwardParams& p, int b, int h) {
  return p.alibi != nullptr ? p.alibi[b * p.alibi_b + h * p.alibi_h] : 0.0f;
}

/// The dropout generator of a call, keyed as the CPU's.
__device__ __forceinline__ detail::DropoutRng dropout_rng(const ForwardParams& p) {
  return detail::DropoutRng(p.dropout_p, p.seed, p.offset, p.heads_total);
}

/// Whether the probability of (row i, key j) of (sequence b, head h) is kept, at the
/// call's global positions.
__device__ __forceinline__ bool dropout_keep(const detail::DropoutRng& rng, const ForwardParams& p, int b, int h,
                                             int64_t i, int64_t j) {
  return rng.keep(b, h + p.h0, static_cast<int>(i + p.q_pos0), static_cast<int>(j + p.k_pos0));
}

/// The decisions of keys j (even) and j + 1 of one row: one Philox draw when both lie
/// in one group of four.
__device__ __forceinline__ void dropout_keep_pair(const detail::DropoutRng& rng, const ForwardParams& p, int b, int h,
                                                  int64_t i, int64_t j, bool& keep0, bool& keep1) {
  const int ig = static_cast<int>(i + p.q_pos0);
  const int64_t jg = j + p.k_pos0;
  const int hg = h + p.h0;
  if (jg % 2 == 0) {
    const unsigned bits = rng.keep4(b, hg, ig, static_cast<int>(jg / 4));
    const int at = static_cast<int>(jg % 4);
    keep0 = (bits >> at) & 1u, keep1 = (bits >> (at + 1)) & 1u;
  } else {
    keep0 = rng.keep(b, hg, ig, static_cast<int>(jg));
    keep1 = rng.keep(b, hg, ig, static_cast<int>(jg + 1));
  }
}

/// The max and sum of row i's softmax, exp(x − max) summed over its visible keys, by
/// one warp (lanes take every 32nd key; the result is the warp's, in every lane) from
/// the scores modified as modified_score does, with the products of the rounded
/// operands summed in f32. max = −∞ for a row with no visible key; a NaN score makes
/// the sum NaN. The backward uses it where lse is too large for f32 to carry P, and
/// the probs kernel for every row.
template <class T, class In>
__device__ __forceinline__ void row_max_sum(const ForwardParams& p, const SeqDesc& s, int b, int h, int64_t i,
                                            float& max_out, float& sum_out) {
  constexpr float kLog2e = 1.4426950408889634f;
  const int lane = threadIdx.x % 32;
  const int hk = h / (p.Hq / p.Hkv);
  const In* q = static_cast<const In*>(p.q) + s.q_offset + int64_t{h} * p.q_head + i * p.q_row;
  const In* k = static_cast<const In*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const Band band = band_of_row(p, s, i);
  const float slope = alibi_slope(p, b, h);
  float mx = -INFINITY, sum = 0.0f;
  for (int64_t j = max(int64_t{0}, band.lo) + lane; j <= min(int64_t{s.Lk} - 1, band.hi); j += 32) {
    float raw = 0.0f;
    for (int c = 0; c < p.d; ++c) {
      raw += to_float(load_operand<T>(q + c)) * to_float(load_operand<T>(k + j * p.k_row + c));
    }
    const float x = modified_score(p, s, b, h, slope, i, j, band, raw);
    if (x == -INFINITY) continue;
    if (x > mx) {
      sum = sum * exp2f((mx - x) * kLog2e) + 1.0f;
      mx = x;
    } else {
      sum += exp2f((x - mx) * kLog2e);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float omx = __shfl_xor_sync(0xffffffffu, mx, off), osum = __shfl_xor_sync(0xffffffffu, sum, off);
    const float nm = fmaxf(mx, omx);
    if (nm != -INFINITY) sum = sum * exp2f((mx - nm) * kLog2e) + osum * exp2f((omx - nm) * kLog2e);
    mx = nm;
  }
  max_out = mx, sum_out = sum;
}

/// The raw maxima of this thread's scores of rows A (sc[·][0..1]) and B (sc[·][2..3]).
template <int kNt>
__device__ __forceinline__ void raw_row_maxima(const float (*sc)[4], float& mx_a, float& mx_b) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    mx_a = fmaxf(mx_a, fmaxf(sc[nt][0], sc[nt][1]));
    mx_b = fmaxf(mx_b, fmaxf(sc[nt][2], sc[nt][3]));
  }
}

/// The online softmax's step after the scores of a tile are known: sc holds this thread's
/// scores of rows A (sc[·][0..1]) and B (sc[·][2..3]) in log2 units once multiplied by
/// `mul`, mx_a and mx_b their raw maxima. Takes the row maxima over the quad that shares a
/// row (fmaxf skips NaN; a NaN score still makes its row NaN through the sum), moves m and
/// l on, turns the scores into probabilities p = 2^(x − m) and returns in alpha what
/// each row's O must be scaled by. A row that has seen only −∞ so far subtracts 0
/// (e^(−∞ − 0) = 0, not NaN).
template <int kNt>
__device__ __forceinline__ void softmax_step(float (*sc)[4], float mx_a, float mx_b, float mul, float& m_a,
                                             float& m_b, float& l_a, float& l_b, float& alpha_a, float& alpha_b) {
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
    mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
  }
  const float mn_a = fmaxf(m_a, mx_a * mul), mn_b = fmaxf(m_b, mx_b * mul);
  const float ref_a = mn_a == -INFINITY ? 0.0f : mn_a, ref_b = mn_b == -INFINITY ? 0.0f : mn_b;
  alpha_a = fast_exp2(m_a - ref_a), alpha_b = fast_exp2(m_b - ref_b);
  m_a = mn_a, m_b = mn_b;
  float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float pr = fast_exp2(fmaf(sc[nt][e], mul, -(e < 2 ? ref_a : ref_b)));
      if (e < 2) sum_a += pr; else sum_b += pr;
      sc[nt][e] = pr;
    }
  }
  l_a = l_a * alpha_a + sum_a;
  l_b = l_b * alpha_b + sum_b;
}

/// The forward's last step for this thread's rows row_a and row_b of a warp's 16 (those
/// < s.Lq) of head h: the quad's partial sums l, then out = O / l (rounded to In) and
/// lse = m·ln 2 + ln l, m in log2 units; a row with no visible key (l = 0) gets 0 and −∞.
/// o: the rows' output accumulator (n-tiles, mma.sync's C layout); t = lane % 4.
template <class In, int kDt>
__device__ __forceinline__ void finish_forward_rows(const float (*o)[4], float m_a, float m_b, float l_a, float l_b,
                                                    const ForwardParams& p, const SeqDesc& s, int h, int row_a,
                                                    int row_b, int t) {
  constexpr float kLn2 = 0.6931471805599453f;
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  In* out = static_cast<In*>(p.out) + s.out_offset + int64_t{h} * p.out_head;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int i = rr == 0 ? row_a : row_b;
    if (i >= s.Lq) continue;
    const float l = rr == 0 ? l_a : l_b, m = rr == 0 ? m_a : m_b;
    const bool empty = l == 0.0f;  // no visible key (NaN compares false: stays NaN)
    const float inv = empty ? 0.0f : 1.0f / l;
    In* orow = out + int64_t{i} * p.out_row;
#pragma unroll
    for (int n = 0; n < kDt; ++n) {
      const int col = n * 8 + 2 * t;
      orow[col] = from_float<In>(empty ? 0.0f : o[n][2 * rr] * inv);
      orow[col + 1] = from_float<In>(empty ? 0.0f : o[n][2 * rr + 1] * inv);
    }
    if (p.lse != nullptr && t == 0) {
      p.lse[s.lse_offset + int64_t{h} * p.lse_h + int64_t{i} * p.lse_i] = empty ? -INFINITY : m * kLn2 + logf(l);
    }
  }
}

}  // namespace attn::cuda
