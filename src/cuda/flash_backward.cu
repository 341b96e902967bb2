// The fused attention backward on NVIDIA GPUs (sm_80 and newer): FlashAttention-2's
// recomputation of P from lse, on mma.sync.m16n8k16 (bf16 or f16 operands, f32
// accumulation), deterministic by construction: no atomics, and every gradient
// element is summed by one thread block in a fixed order.
//
//   prep    per query row: D = rowsum(dO ∘ O), and the softmax statistics (m, 1/l)
//           P is recomputed with: (lse, 1), or recomputed from the scores for rows
//           whose |lse| is so large that f32 rounding of lse would distort P.
//   dq      per block of 64 query rows, over the key tiles of their band:
//           S = Q·Kᵀ → P, dP = dO·Vᵀ, dS = P ∘ (dP' − D) (∘ softcap'),
//           dQ += scale·dS·K.
//   dkdv    per block of 64 keys, over every query head of their kv group and the
//           query tiles whose band reaches them: Sᵀ = K·Qᵀ → Pᵀ, dPᵀ = V·dOᵀ,
//           dV += P'ᵀ·dO, dK += scale·dSᵀ·Q.
// Splitting dQ from dK/dV recomputes S and dP once more (FlashAttention-2 instead adds
// dQ with atomics, whose order, and so whose rounding, varies from run to run); it
// makes the backward bitwise reproducible, as attn's CPU backward.
//
// Tiles that the block-sparse mask empties are skipped, as in the forward. dbias (the
// additive mask's gradient): the dq kernel also stores dS before softcap' for every
// (b, h, i, j), and dbias_kernel sums it over the mask's broadcast dimensions in a fixed
// order (a workspace of B·Hq·Lq·Lk floats, the size of the mask's broadcast shape).
//
// Semantics, as the CPU backward (cpu/attention_backward.cc):
//   - a key removed for a row (band, mask, key length) has P = 0 and dS = 0, whatever
//     its scores, values or dO hold; a tile whose other operand (K for dQ, Q for dK,
//     dO for dV) holds a NaN or ±∞ is multiplied element by element skipping the
//     zeros, where the tensor cores would give 0·∞ = NaN;
//   - rows with no visible key (lse = −∞) get zero gradients and add nothing;
//   - dropout: P' = P·Z/(1 − p) and dP' = dP·Z/(1 − p), with the forward's decisions Z;
//   - rows and keys outside every sequence (packed batches, key lengths) get zero
//     gradients.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/flash_backward_wgmma.hpp"
#include "cuda/mma_fragments.cuh"
#include "cuda/backward_rows.cuh"
#include "cuda/nonfinite_tiles.cuh"
#include "cuda/score_mods.cuh"

namespace attn::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockRows = kWarps * 16;  // query rows of a dq block, keys of a dkdv block

/// |lse| from which the prep kernel recomputes a row's max and sum (the CPU
/// backward's threshold): f32 rounds lse by up to |lse|·2⁻²⁴, which P = e^(S − lse)
/// inherits as a relative error. Only rows whose every key carries a huge finite mask
/// get there.
constexpr float kLseRecompute = 128.0f;

template <class In>
__global__ void zero_kernel(In* ptr, GradExtent e, int d) {
  const int64_t total = e.n0 * e.n1 * e.n2 * d;
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total; x += int64_t{gridDim.x} * blockDim.x) {
    int64_t r = x;
    const int64_t c = r % d;
    r /= d;
    const int64_t i2 = r % e.n2;
    r /= e.n2;
    const int64_t i1 = r % e.n1, i0 = r / e.n1;
    ptr[i0 * e.s0 + i1 * e.s1 + i2 * e.s2 + c] = from_float<In>(0.0f);
  }
}

// One warp per query row: D, and the statistics of P.
template <class T, class In>
__global__ void __launch_bounds__(kThreads)
    backward_prep_kernel(BackwardParams bp, const SeqDesc* seqs, const BackwardSeq* bseqs, RowStats st) {
  const ForwardParams& p = bp.fwd;
  const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const SeqDesc s = seqs[b];
  const int i = blockIdx.x * kWarps + warp;
  if (i >= s.Lq) return;
  const In* o = static_cast<const In*>(p.out) + s.out_offset + int64_t{h} * p.out_head + int64_t{i} * p.out_row;
  const In* g = static_cast<const In*>(bp.dout) + bseqs[b].dout_offset + int64_t{h} * bp.dout_head +
                int64_t{i} * bp.dout_row;
  float dsum = 0.0f;
  for (int c = lane; c < p.d; c += 32) dsum += to_float(o[c]) * to_float(g[c]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) dsum += __shfl_xor_sync(0xffffffffu, dsum, off);

  const float lse = p.lse[s.lse_offset + int64_t{h} * p.lse_h + int64_t{i} * p.lse_i];
  float m = lse, inv_l = 1.0f;
  if (isfinite(lse) && fabsf(lse) >= kLseRecompute) {
    // The forward's max and sum again, from the same rounded operands.
    float mx, sum;
    row_max_sum<T, In>(p, s, b, h, i, mx, sum);
    if (mx != -INFINITY) m = mx, inv_l = 1.0f / sum;
  }
  if (lane == 0) {
    const int64_t at = st.at(p.Hq, b, h, i);
    st.dsum[at] = dsum, st.m[at] = m, st.inv_l[at] = inv_l;
  }
}

// dQ of 64 query rows (4 warps × 16) of one (sequence, head), over Bc-key tiles. k_bad:
// the pre-pass's flag per Bc-key tile of K (nonfinite_tiles.cuh), k_tiles per head.
template <class T, class In, int D, int Bc>
__global__ void __launch_bounds__(kThreads)
    backward_dq_kernel(BackwardParams bp, const SeqDesc* seqs, const BackwardSeq* bseqs, RowStats st,
                       const uint8_t* k_bad, int k_tiles) {
  constexpr int LD = D + 8;
  constexpr int kNt = Bc / 8, kKt = D / 16, kDt = D / 8;
  const ForwardParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* q_s = reinterpret_cast<T*>(smem_raw);
  T* do_s = q_s + kBlockRows * LD;
  T* k_s = do_s + kBlockRows * LD;
  T* v_s = k_s + Bc * LD;
  float* pw_s = reinterpret_cast<float*>(v_s + Bc * LD);  // [kWarps][16][Bc], the gated path's dS

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int q0 = blockIdx.x * kBlockRows;
  if (q0 >= s.Lq) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int hk = h / (p.Hq / p.Hkv);
  const In* q = static_cast<const In*>(p.q) + s.q_offset + int64_t{h} * p.q_head;
  const In* k = static_cast<const In*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const In* v = static_cast<const In*>(p.v) + s.v_offset + int64_t{hk} * p.v_head;
  const In* dout = static_cast<const In*>(bp.dout) + bseqs[b].dout_offset + int64_t{h} * bp.dout_head;
  const uint8_t* k_bad_head = k_bad + (int64_t{b} * p.Hkv + hk) * k_tiles;
  load_rows<T, In, D, LD, kThreads>(q_s, q, p.q_row, q0, kBlockRows, s.Lq, false);
  load_rows<T, In, D, LD, kThreads>(do_s, dout, bp.dout_row, q0, kBlockRows, s.Lq, false);

  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const Band band_a = band_of_row(p, s, row_a), band_b = band_of_row(p, s, row_b);
  const int last_row = min(q0 + kBlockRows, s.Lq) - 1;
  const int64_t key_lo = max(int64_t{0}, band_of_row(p, s, q0).lo);
  const int64_t key_hi = min(int64_t{s.Lk} - 1, band_of_row(p, s, last_row).hi);
  float m_a, il_a, ds_a, m_b, il_b, ds_b;
  st.load(p.Hq, b, h, row_a, row_a < s.Lq, m_a, il_a, ds_a);
  st.load(p.Hq, b, h, row_b, row_b < s.Lq, m_b, il_b, ds_b);
  const float slope = alibi_slope(p, b, h);
  const bool dropout = p.dropout_p > 0.0f;
  const detail::DropoutRng rng = dropout_rng(p);
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);
  const Band band_first = band_of_row(p, s, q0), band_last = band_of_row(p, s, last_row);
  const bool plain = scores_plain(p) && !dropout && st.ds_all == nullptr;

  float dq[kDt][4];
#pragma unroll
  for (int n = 0; n < kDt; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  const T* q_w = q_s + warp * 16 * LD;
  const T* do_w = do_s + warp * 16 * LD;

  // The next key tile from j on that the block mask leaves some key of (−1: none).
  auto live_tile = [&](int64_t j) { return first_live_tile<kThreads, Bc>(p, s, b, h, q0, last_row, j, key_hi); };
  // A pipeline as the forward's: V of a tile is needed first (dP = dO·Vᵀ), K after it
  // (S, dQ += dS·K). So the next V comes while S, dS and dQ are computed, and the next K
  // while the next dP is (cp.async where the rows allow 16-byte copies).
  const bool k_vec = rows_vectorizable<T>(k, p.k_row), v_vec = rows_vectorizable<T>(v, p.v_row);
  int64_t j0 = live_tile(key_lo <= key_hi ? (key_lo / Bc) * Bc : key_hi + 1);
  if (j0 >= 0) start_rows<T, In, D, LD, kThreads, Bc>(v_s, v, p.v_row, static_cast<int>(j0), s.Lk, v_vec);
  cp_async_commit();
  if (j0 >= 0) start_rows<T, In, D, LD, kThreads, Bc>(k_s, k, p.k_row, static_cast<int>(j0), s.Lk, k_vec);
  cp_async_commit();
  while (j0 >= 0) {
    // K's flag, read now so that its load's latency passes during dP, not before dQ.
    const bool gated = k_bad_head[j0 / Bc] != 0;
    cp_async_wait<1>();  // V of this tile (and Q, dO before the first)
    __syncthreads();

    // dP = dO·Vᵀ and S = Q·Kᵀ, 16 rows × Bc keys each.
    float dp[kNt][4], sc[kNt][4];
    product_rows<T, LD, kNt, kKt>(dp, do_w, v_s);
    __syncthreads();  // every warp has read V: the next tile's V may come
    const int64_t next = live_tile(j0 + Bc);
    if (next >= 0) start_rows<T, In, D, LD, kThreads, Bc>(v_s, v, p.v_row, static_cast<int>(next), s.Lk, v_vec);
    cp_async_commit();
    cp_async_wait<1>();  // K of this tile
    __syncthreads();
    product_rows<T, LD, kNt, kKt>(sc, q_w, k_s);

    // dS, in place of S: only scaled scores where the tile lies inside every row's band
    // and nothing else touches an element (the same numbers as the general path).
    if (plain && tile_inside_bands(band_first, band_last, j0, j0 + Bc - 1)) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float x = sc[nt][e] * p.scale;
          const float pr = e < 2 ? probability(x, m_a, il_a) : probability(x, m_b, il_b);
          sc[nt][e] = score_gradient(pr, dp[nt][e], 1.0f, e < 2 ? ds_a : ds_b, 1.0f);
        }
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int i = rr == 0 ? row_a : row_b;
          const int64_t j = j0 + nt * 8 + 2 * t;
          bool keep0 = true, keep1 = true;
          if (dropout) dropout_keep_pair(rng, p, b, h, i, j, keep0, keep1);
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int e = 2 * rr + c;
            float cap_grad;
            const float x = modified_score(p, s, b, h, slope, i, j + c, rr == 0 ? band_a : band_b, sc[nt][e], &cap_grad);
            const float pr = rr == 0 ? probability(x, m_a, il_a) : probability(x, m_b, il_b);
            const float keep = !dropout ? 1.0f : (c == 0 ? keep0 : keep1) ? keep_scale : 0.0f;
            const float g_mask = score_gradient(pr, dp[nt][e], keep, rr == 0 ? ds_a : ds_b, 1.0f);
            if (st.ds_all != nullptr && i < s.Lq && j + c < s.Lk) {
              st.ds_all[st.at(p.Hq, b, h, i) * st.max_lk + j + c] = g_mask;  // ∂L/∂mask: before softcap'
            }
            sc[nt][e] = g_mask * cap_grad;
          }
        }
      }
    }

    // dQ += dS·K (scaled once at the end).
    accumulate_product<T, LD, kDt, Bc>(dq, sc, k_s, gated, pw_s + warp * 16 * Bc);
    __syncthreads();  // every warp has read K: the next tile's K may come
    if (next >= 0) start_rows<T, In, D, LD, kThreads, Bc>(k_s, k, p.k_row, static_cast<int>(next), s.Lk, k_vec);
    cp_async_commit();
    j0 = next;
  }
  cp_async_wait<0>();

  In* dq_out = static_cast<In*>(bp.dq) + bseqs[b].dq_offset + int64_t{h} * bp.dq_head;
  store_accumulator_rows<In, kDt>(dq, dq_out, bp.dq_row, row_a, row_b, s.Lq, p.scale);
}

// dbias: one thread per element of the mask's shape, summing dS over the dimensions the
// mask broadcasts (size 1 where the call has more), in a fixed order.
__global__ void dbias_kernel(BackwardParams bp, RowStats st) {
  const ForwardParams& p = bp.fwd;
  const int64_t full[4] = {p.B, p.Hq, st.max_lq, st.max_lk};
  const int64_t* dims = bp.dbias_dims;
  const int64_t total = dims[0] * dims[1] * dims[2] * dims[3];
  for (int64_t x = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; x < total; x += int64_t{gridDim.x} * blockDim.x) {
    int64_t idx[4], r = x;
    for (int d = 3; d >= 0; --d) idx[d] = r % dims[d], r /= dims[d];
    int64_t lo[4], hi[4];
    for (int d = 0; d < 4; ++d) {
      const bool broadcast = dims[d] == 1 && full[d] > 1;
      lo[d] = broadcast ? 0 : idx[d];
      hi[d] = broadcast ? full[d] : min(idx[d] + 1, full[d]);  // varlen masks may be longer than any sequence
    }
    float sum = 0.0f;
    for (int64_t b = lo[0]; b < hi[0]; ++b)
      for (int64_t h = lo[1]; h < hi[1]; ++h)
        for (int64_t i = lo[2]; i < hi[2]; ++i)
          for (int64_t j = lo[3]; j < hi[3]; ++j) sum += st.ds_all[((b * p.Hq + h) * st.max_lq + i) * st.max_lk + j];
    bp.dbias[idx[0] * bp.dbias_stride[0] + idx[1] * bp.dbias_stride[1] + idx[2] * bp.dbias_stride[2] +
             idx[3] * bp.dbias_stride[3]] = sum;
  }
}

// dK and dV of 64 keys (4 warps × 16) of one (sequence, kv head), over every query
// head of the group and the Br-row query tiles whose band reaches them. Q and dO tiles
// come through two shared-memory buffers: the next tile's cp.async is in flight while
// this one is used. q_bad, do_bad: the pre-pass's flags per Br-row tile of Q and dO
// (nonfinite_tiles.cuh), q_tiles per head.
template <class T, class In, int D, int Br>
__global__ void __launch_bounds__(kThreads)
    backward_dkdv_kernel(BackwardParams bp, const SeqDesc* seqs, const BackwardSeq* bseqs, RowStats st,
                         const uint8_t* q_bad, const uint8_t* do_bad, int q_tiles) {
  constexpr int LD = D + 8;
  constexpr int kNt = Br / 8, kKt = D / 16, kDt = D / 8;
  const ForwardParams& p = bp.fwd;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + kBlockRows * LD;
  T* q_s = v_s + kBlockRows * LD;  // [2][Br][LD]: the tile in use and the next
  T* do_s = q_s + 2 * Br * LD;      // [2][Br][LD]
  float* pw_s = reinterpret_cast<float*>(do_s + 2 * Br * LD);  // [kWarps][16][Br], the gated path's P' or dS
  float* m_s = pw_s + kWarps * 16 * Br;                    // [Br] statistics of the tile's rows
  float* il_s = m_s + Br;
  float* dsum_s = il_s + Br;

  const int b = blockIdx.z, hk = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int j0 = blockIdx.x * kBlockRows;
  if (j0 >= s.Lk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int group = p.Hq / p.Hkv;
  const In* k = static_cast<const In*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const In* v = static_cast<const In*>(p.v) + s.v_offset + int64_t{hk} * p.v_head;
  load_rows<T, In, D, LD, kThreads>(k_s, k, p.k_row, j0, kBlockRows, s.Lk, false);
  load_rows<T, In, D, LD, kThreads>(v_s, v, p.v_row, j0, kBlockRows, s.Lk, false);
  // (The first barrier of the loop below orders these stores before their reads.)

  const int key_a = j0 + warp * 16 + g, key_b = key_a + 8;
  int row_first, row_last;
  rows_reaching(p, s, j0, min(j0 + kBlockRows, s.Lk) - 1, row_first, row_last);
  const bool dropout = p.dropout_p > 0.0f;
  const detail::DropoutRng rng = dropout_rng(p);
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);
  const bool plain = scores_plain(p) && !dropout;
  const T* k_w = k_s + warp * 16 * LD;
  const T* v_w = v_s + warp * 16 * LD;

  float dk[kDt][4], dv[kDt][4];
#pragma unroll
  for (int n = 0; n < kDt; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  }

  // The steps: (query head h of the group, row tile i0) for every tile whose band
  // reaches the block's keys, less those the block mask empties. live_step gives the
  // step after (h, i0), or the first for h < 0 (every thread calls it: tile_blocked
  // votes across the block).
  const int h_end = (hk + 1) * group;
  const int i_first = row_first <= row_last ? (row_first / Br) * Br : row_last + 1;
  auto live_step = [&](int h, int i0, int& nh, int& ni) -> bool {
    if (h < 0) h = hk * group, i0 = i_first; else i0 += Br;
    for (; h < h_end; ++h, i0 = i_first) {
      for (; i0 <= row_last; i0 += Br) {
        if (!tile_blocked<kThreads>(p, b, h, i0, min(i0 + Br, s.Lq) - 1, j0, min(j0 + kBlockRows, s.Lk) - 1)) {
          nh = h, ni = i0;
          return true;
        }
      }
    }
    return false;
  };
  auto start_tile = [&](int h, int i0, int buf) {
    const In* q = static_cast<const In*>(p.q) + s.q_offset + int64_t{h} * p.q_head;
    const In* dout = static_cast<const In*>(bp.dout) + bseqs[b].dout_offset + int64_t{h} * bp.dout_head;
    start_rows<T, In, D, LD, kThreads, Br>(q_s + buf * Br * LD, q, p.q_row, i0, s.Lq, rows_vectorizable<T>(q, p.q_row));
    start_rows<T, In, D, LD, kThreads, Br>(do_s + buf * Br * LD, dout, bp.dout_row, i0, s.Lq,
                                           rows_vectorizable<T>(dout, bp.dout_row));
  };

  // Thread r < Br holds row i0 + r's statistics of the next step in registers, loaded a
  // step ahead so that their global loads' latency passes during a step's products.
  static_assert(Br <= kThreads, "one thread per row of a step");
  float next_m = -INFINITY, next_il = 0.0f, next_ds = 0.0f;
  auto load_stats = [&](int h, int i0) {
    const int i = i0 + threadIdx.x;
    st.load(p.Hq, b, h, i, threadIdx.x < Br && i < s.Lq, next_m, next_il, next_ds);
  };

  int h = -1, i0 = 0, buf = 0;
  bool have = live_step(h, i0, h, i0);
  if (have) start_tile(h, i0, 0), load_stats(h, i0);
  cp_async_commit();
  while (have) {
    if (threadIdx.x < Br) m_s[threadIdx.x] = next_m, il_s[threadIdx.x] = next_il, dsum_s[threadIdx.x] = next_ds;
    // The flags too are read before they are needed.
    const int64_t tile = (int64_t{b} * p.Hq + h) * q_tiles + i0 / Br;
    const bool gated_dk = q_bad[tile] != 0, gated_dv = do_bad[tile] != 0;
    int nh = h, ni = i0;
    const bool more = live_step(h, i0, nh, ni);
    if (more) start_tile(nh, ni, buf ^ 1), load_stats(nh, ni);  // its buffer was last read before the previous step's end barrier
    cp_async_commit();
    cp_async_wait<1>();  // this step's Q and dO
    __syncthreads();
    const T* qt = q_s + buf * Br * LD;
    const T* dot = do_s + buf * Br * LD;
    const float slope = alibi_slope(p, b, h);
    {
      // dPᵀ = V·dOᵀ and Sᵀ = K·Qᵀ: 16 keys × Br rows each.
      float dp[kNt][4], sc[kNt][4];
      product_rows<T, LD, kNt, kKt>(dp, v_w, dot);
      product_rows<T, LD, kNt, kKt>(sc, k_w, qt);

      // P' (in sc) and dS (in dp), element (key, row) at (e < 2 ? key_a : key_b,
      // i0 + 8·nt + 2t + (e & 1)); only scaled scores where the key block lies inside
      // every row's band and nothing else touches an element.
      if (plain && tile_inside_bands(band_of_row(p, s, i0), band_of_row(p, s, min(i0 + Br, s.Lq) - 1), j0,
                                     j0 + kBlockRows - 1)) {
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = nt * 8 + 2 * t + (e & 1);
            const float pr = probability(sc[nt][e] * p.scale, m_s[r], il_s[r]);
            dp[nt][e] = score_gradient(pr, dp[nt][e], 1.0f, dsum_s[r], 1.0f);
            sc[nt][e] = pr;
          }
        }
      } else {
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = nt * 8 + 2 * t + (e & 1);
            const int i = i0 + r;
            const int64_t j = e < 2 ? key_a : key_b;
            float cap_grad;
            const float x = modified_score(p, s, b, h, slope, i, j, band_of_row(p, s, i), sc[nt][e], &cap_grad);
            const float pr = probability(x, m_s[r], il_s[r]);
            const float keep = !dropout ? 1.0f : dropout_keep(rng, p, b, h, i, j) ? keep_scale : 0.0f;
            dp[nt][e] = score_gradient(pr, dp[nt][e], keep, dsum_s[r], cap_grad);
            sc[nt][e] = pr * keep;
          }
        }
      }

      // dV += P'ᵀ·dO and dK += dSᵀ·Q (scaled once at the end).
      float* pw = pw_s + warp * 16 * Br;
      accumulate_product<T, LD, kDt, Br>(dv, sc, dot, gated_dv, pw);
      accumulate_product<T, LD, kDt, Br>(dk, dp, qt, gated_dk, pw);
    }
    __syncthreads();  // before the next step's statistics, and the copy after it, overwrite this one's
    h = nh, i0 = ni, have = more, buf ^= 1;
  }
  cp_async_wait<0>();

  In* dk_out = static_cast<In*>(bp.dk) + bseqs[b].dk_offset + int64_t{hk} * bp.dk_head;
  In* dv_out = static_cast<In*>(bp.dv) + bseqs[b].dv_offset + int64_t{hk} * bp.dv_head;
  store_accumulator_rows<In, kDt>(dk, dk_out, bp.dk_row, key_a, key_b, s.Lk, p.scale);
  store_accumulator_rows<In, kDt>(dv, dv_out, bp.dv_row, key_a, key_b, s.Lk, 1.0f);
}

// Tiles per head dimension, for registers: the dq kernel's key tile (as the forward's)
// and the dkdv kernel's query tile, whose block holds dK and dV of 16 keys per warp.
template <int D> constexpr int kDqKeyTile = D >= 256 ? 32 : 64;
template <int D> constexpr int kDkdvRowTile = D >= 256 ? 16 : D >= 96 ? 32 : 64;

template <class Kernel>
cudaError_t allow_shared_memory(Kernel* kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <class In>
cudaError_t zero(void* ptr, const GradExtent& e, int d, cudaStream_t stream) {
  const int64_t total = e.n0 * e.n1 * e.n2 * d;
  if (total == 0) return cudaSuccess;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 4096);
  zero_kernel<In><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(static_cast<In*>(ptr), e, d);
  return cudaGetLastError();
}

template <class T, class In, int D>
cudaError_t launch(const BackwardParams& bp, const SeqDesc* seqs, const BackwardSeq* bseqs, const RowStats& st,
                   cudaStream_t stream) {
  const ForwardParams& p = bp.fwd;
  cudaError_t e;
  if ((e = zero<In>(bp.dq, bp.dq_extent, D, stream)) != cudaSuccess) return e;
  if ((e = zero<In>(bp.dk, bp.dk_extent, D, stream)) != cudaSuccess) return e;
  if ((e = zero<In>(bp.dv, bp.dv_extent, D, stream)) != cudaSuccess) return e;

  const dim3 rows_grid((p.max_lq + kWarps - 1) / kWarps, p.Hq, p.B);
  backward_prep_kernel<T, In><<<rows_grid, kThreads, 0, stream>>>(bp, seqs, bseqs, st);
  if ((e = cudaGetLastError()) != cudaSuccess) return e;
  if (wgmma_backward_applies(bp)) return wgmma_backward(bp, seqs, bseqs, st, stream);

  constexpr int Bc = kDqKeyTile<D>;
  auto* dq_kernel = &backward_dq_kernel<T, In, D, Bc>;
  const size_t dq_smem = (2 * kBlockRows + 2 * Bc) * size_t{D + 8} * sizeof(T) + size_t{kWarps} * 16 * Bc * sizeof(float);
  if ((e = allow_shared_memory(dq_kernel, dq_smem)) != cudaSuccess) return e;
  // The K tiles holding a NaN or ±∞, one flag each (stream-ordered scratch).
  NonfiniteTiles k_bad;
  e = k_bad.make<T, In, D, Bc>(p, seqs, bseqs, TileSource::keys, p.k, p.k_row, p.k_head, p.Hkv, stream);
  if (e == cudaSuccess) {
    const dim3 dq_grid((p.max_lq + kBlockRows - 1) / kBlockRows, p.Hq, p.B);
    dq_kernel<<<dq_grid, kThreads, dq_smem, stream>>>(bp, seqs, bseqs, st, k_bad.flags, k_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f = k_bad.free(stream);
  if (e != cudaSuccess || (e = f) != cudaSuccess) return e;

  constexpr int Br = kDkdvRowTile<D>;
  auto* dkdv_kernel = &backward_dkdv_kernel<T, In, D, Br>;
  const size_t dkdv_smem = (2 * kBlockRows + 4 * Br) * size_t{D + 8} * sizeof(T) +
                           (size_t{kWarps} * 16 * Br + 3 * Br) * sizeof(float);
  if ((e = allow_shared_memory(dkdv_kernel, dkdv_smem)) != cudaSuccess) return e;
  const dim3 dkdv_grid((bp.max_lk + kBlockRows - 1) / kBlockRows, p.Hkv, p.B);
  // The Q and dO tiles holding a NaN or ±∞, one flag each (stream-ordered scratch).
  NonfiniteTiles q_bad, do_bad;
  e = q_bad.make<T, In, D, Br>(p, seqs, bseqs, TileSource::queries, p.q, p.q_row, p.q_head, p.Hq, stream);
  if (e == cudaSuccess) {
    e = do_bad.make<T, In, D, Br>(p, seqs, bseqs, TileSource::dout, bp.dout, bp.dout_row, bp.dout_head, p.Hq, stream);
  }
  if (e == cudaSuccess) {
    dkdv_kernel<<<dkdv_grid, kThreads, dkdv_smem, stream>>>(bp, seqs, bseqs, st, q_bad.flags, do_bad.flags, q_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f1 = q_bad.free(stream), f2 = do_bad.free(stream);
  if (e != cudaSuccess || (e = f1) != cudaSuccess || (e = f2) != cudaSuccess || bp.dbias == nullptr) return e;
  const int64_t n = bp.dbias_dims[0] * bp.dbias_dims[1] * bp.dbias_dims[2] * bp.dbias_dims[3];
  if (n == 0) return cudaSuccess;
  dbias_kernel<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 4096)), 256, 0, stream>>>(bp, st);
  return cudaGetLastError();
}

template <class T, class In>
cudaError_t launch_for_dim(const BackwardParams& bp, const SeqDesc* seqs, const BackwardSeq* bseqs,
                           const RowStats& st, cudaStream_t stream) {
  switch (bp.fwd.d) {
    case 64: return launch<T, In, 64>(bp, seqs, bseqs, st, stream);
    case 96: return launch<T, In, 96>(bp, seqs, bseqs, st, stream);
    case 128: return launch<T, In, 128>(bp, seqs, bseqs, st, stream);
    case 256: return launch<T, In, 256>(bp, seqs, bseqs, st, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

std::string backward(const BackwardParams& bp) {
  const ForwardParams& p = bp.fwd;
  if (!supported_head_dim(p.d)) return "head dim " + std::to_string(p.d) + " is not compiled";
  if (p.B == 0 || p.Hq == 0) return "";
  const DeviceScope scope(p.device);
  if (!scope.ok()) return scope.error();
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  // One stream-ordered allocation: the sequence tables, then D, m and 1/l per row.
  const size_t seq_bytes = sizeof(SeqDesc) * size_t(p.B), bseq_bytes = sizeof(BackwardSeq) * size_t(p.B);
  const size_t rows = size_t(p.B) * p.Hq * size_t(std::max(p.max_lq, 1));
  const size_t ds_elems = bp.dbias != nullptr ? rows * size_t(std::max(bp.max_lk, 1)) : 0;
  const size_t bytes = seq_bytes + bseq_bytes + (3 * rows + ds_elems) * sizeof(float);
  unsigned char* work = nullptr;
  ATTN_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&work), bytes, stream));
  SeqDesc* seqs = reinterpret_cast<SeqDesc*>(work);
  BackwardSeq* bseqs = reinterpret_cast<BackwardSeq*>(work + seq_bytes);
  RowStats st;
  st.dsum = reinterpret_cast<float*>(work + seq_bytes + bseq_bytes);
  st.m = st.dsum + rows;
  st.inv_l = st.m + rows;
  st.max_lq = std::max(p.max_lq, 1);
  st.max_lk = std::max(bp.max_lk, 1);
  cudaError_t e = cudaMemcpyAsync(seqs, p.seqs_host, seq_bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess && ds_elems > 0) {
    st.ds_all = st.inv_l + rows;
    e = cudaMemsetAsync(st.ds_all, 0, ds_elems * sizeof(float), stream);
  }
  if (e == cudaSuccess) e = cudaMemcpyAsync(bseqs, bp.bseqs_host, bseq_bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) {
    switch (p.in) {
      case Elem::bf16: e = launch_for_dim<__nv_bfloat16, __nv_bfloat16>(bp, seqs, bseqs, st, stream); break;
      case Elem::f16: e = launch_for_dim<__half, __half>(bp, seqs, bseqs, st, stream); break;
      case Elem::f32: e = launch_for_dim<__nv_bfloat16, float>(bp, seqs, bseqs, st, stream); break;
    }
  }
  const cudaError_t f = cudaFreeAsync(work, stream);
  if (e != cudaSuccess) return cuda_error_text("the backward kernels", e);
  if (f != cudaSuccess) return cuda_error_text("cudaFreeAsync", f);
  return "";
}

}  // namespace attn::cuda
