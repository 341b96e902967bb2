// The attention backward on Hopper's warpgroup products (wgmma, sm_90a), for the calls
// the wgmma forward takes (bf16/f16, d = 64 or 128, nothing but the band) without
// dropout or dbias; opt-in with ATTN_CUDA_WGMMA_BWD=1. The algorithm and its
// determinism are flash_backward.cu's (the prep kernel's statistics, dQ and dK/dV in two
// kernels, no atomics, every gradient element summed by one block in a fixed order);
// only the products move to wgmma, on the layouts the forward uses:
//
//   dq    one warpgroup per 64 query rows, over 64-key tiles (two cp.async stages):
//         S = Q·Kᵀ and dP = dO·Vᵀ as SS products issued together (Q, dO, K, V all
//         K-major tiles: rows of d), dS = P ∘ (dP − D) in the accumulators, then
//         dQ += dS·K with dS from registers and K as stored (MN-major, as V in P·V).
//   dkdv  one warpgroup per 64 keys, over every query head of the kv group and the
//         64-row query tiles whose band reaches them (two stages of Q and dO):
//         Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (SS), then dV += Pᵀ·dO and dK += dSᵀ·Q with Pᵀ
//         and dSᵀ from registers and dO, Q as stored.
// Each Q, dO, K or V tile thus serves as a K-major operand in one product and an
// MN-major one in another, in the one swizzled layout. A tile of the MN-major operand
// that holds a NaN or ±∞ takes the element-by-element product (the pre-pass flags:
// K for dq, Q and dO for dkdv), as in flash_backward.cu.
//
// UNVERIFIED: written and compiled for sm_90a on a machine without a GPU (2026-11-29).
// The next GPU session tests and times it against the mma.sync kernels in one call:
// `ATTN_AB_TESTS='*CudaBackward*' ATTN_AB_PASS=backward bash scripts/gpu-ab-env.sh NAME
// ATTN_CUDA_WGMMA_BWD 0 1` (docs/PERFORMANCE.md).
#include "cuda/flash_backward_wgmma.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/mma_fragments.cuh"
#include "cuda/nonfinite_tiles.cuh"
#include "cuda/score_mods.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/wgmma_rows.cuh"

namespace attn::cuda {
namespace {

namespace wg = wgmma;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kTile = 64;      // dq: query rows per block, keys per step; dkdv: keys per block, rows per step

template <int D>
constexpr uint32_t kTileBytes = kTile * D * 2;

#ifdef ATTN_HAVE_WGMMA
/// The swizzled layout's descriptor of a tile at `at`, and one `bytes` further into it.
__device__ __forceinline__ uint64_t tile_desc(const unsigned char* at) {
  return wg::descriptor(shared_address(at), wg::kSw128Lbo, wg::kSw128Sbo, wg::kSwizzle128);
}
__device__ __forceinline__ uint64_t advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

/// acc (m64n64) = A·Bᵀ over d for two K-major tiles of 64 rows × D (k-step ks: columns
/// 16·ks …, 32 bytes further along a swizzled row, a panel further every 4 steps).
/// Issued, not committed.
template <bool kHalf, int D>
__device__ __forceinline__ void issue_rows_product(float (*acc)[4], uint64_t a, uint64_t b) {
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const uint32_t at = (ks / 4) * kTile * 128 + (ks % 4) * 32;
    wg::ss_m64n64k16<kHalf>(&acc[0][0], advance(a, at), advance(b, at), ks > 0 ? 1 : 0);
  }
}

/// sc = A·Bᵀ and dp = C·Dᵀ (issue_rows_product, both in flight together), waited for.
template <bool kHalf, int D>
__device__ __forceinline__ void scores_and_gradients(float (*sc)[4], uint64_t a, uint64_t b, float (*dp)[4],
                                                     uint64_t c, uint64_t d) {
  wg::fence();
  issue_rows_product<kHalf, D>(sc, a, b);
  issue_rows_product<kHalf, D>(dp, c, d);
  wg::commit();
  wg::wait<0>();
  pin_all<kTile / 8>(sc);
  pin_all<kTile / 8>(dp);
}
#endif

// dQ of 64 query rows of one (sequence, head). k_bad: the pre-pass's flag per 64-key
// tile of K, k_tiles per head.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    wgmma_dq_kernel(BackwardParams bp, const SeqDesc* seqs, const BackwardSeq* bseqs, RowStats st,
                    const uint8_t* k_bad, int k_tiles) {
#ifdef ATTN_HAVE_WGMMA
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr int kNt = kTile / 8, kDt = D / 8;
  const ForwardParams& p = bp.fwd;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_at = shared_address(smem_raw);
  unsigned char* q_s = smem_raw + ((1024 - raw_at % 1024) % 1024);
  unsigned char* do_s = q_s + kTileBytes<D>;
  unsigned char* kv_s = do_s + kTileBytes<D>;  // [stage][K, V]
  T* pw_s = reinterpret_cast<T*>(kv_s + 4 * kTileBytes<D>);  // [4 warps][16][64], the gated path's dS
  auto k_s = [&](int stage) { return kv_s + (2 * stage) * kTileBytes<D>; };
  auto v_s = [&](int stage) { return kv_s + (2 * stage + 1) * kTileBytes<D>; };

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int q0 = blockIdx.x * kTile;
  if (q0 >= s.Lq) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int hk = h / (p.Hq / p.Hkv);
  const T* q = static_cast<const T*>(p.q) + s.q_offset + int64_t{h} * p.q_head;
  const T* k = static_cast<const T*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const T* v = static_cast<const T*>(p.v) + s.v_offset + int64_t{hk} * p.v_head;
  const T* dout = static_cast<const T*>(bp.dout) + bseqs[b].dout_offset + int64_t{h} * bp.dout_head;
  const uint8_t* k_bad_head = k_bad + (int64_t{b} * p.Hkv + hk) * k_tiles;
  start_swizzled_tile<T, D, kTile>(q_s, q, p.q_row, q0, s.Lq, rows_vectorizable<T>(q, p.q_row));
  start_swizzled_tile<T, D, kTile>(do_s, dout, bp.dout_row, q0, s.Lq, rows_vectorizable<T>(dout, bp.dout_row));
  cp_async_commit();

  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const Band band_a = band_of_row(p, s, row_a), band_b = band_of_row(p, s, row_b);
  const int last_row = min(q0 + kTile, s.Lq) - 1;
  const Band band_first = band_of_row(p, s, q0), band_last = band_of_row(p, s, last_row);
  const int64_t key_lo = max(int64_t{0}, band_first.lo);
  const int64_t key_hi = min(int64_t{s.Lk} - 1, band_last.hi);
  float m_a, il_a, ds_a, m_b, il_b, ds_b;
  st.load(p.Hq, b, h, row_a, row_a < s.Lq, m_a, il_a, ds_a);
  st.load(p.Hq, b, h, row_b, row_b < s.Lq, m_b, il_b, ds_b);

  const bool k_vec = rows_vectorizable<T>(k, p.k_row), v_vec = rows_vectorizable<T>(v, p.v_row);
  auto start_keys = [&](int64_t j, int stage) {
    start_swizzled_tile<T, D, kTile>(k_s(stage), k, p.k_row, static_cast<int>(j), s.Lk, k_vec);
    start_swizzled_tile<T, D, kTile>(v_s(stage), v, p.v_row, static_cast<int>(j), s.Lk, v_vec);
  };
  int64_t j0 = key_lo <= key_hi ? (key_lo / kTile) * kTile : -1;
  if (j0 >= 0) start_keys(j0, 0);
  cp_async_commit();

  float dq[kDt][4];
#pragma unroll
  for (int n = 0; n < kDt; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.0f;
  const uint64_t q_desc = tile_desc(q_s), do_desc = tile_desc(do_s);
  int stage = 0;
  while (j0 >= 0) {
    // The next tile's K and V go to the other stage, last read before the barrier that
    // ended the previous step.
    const int64_t next = j0 + kTile <= key_hi ? j0 + kTile : -1;
    if (next >= 0) start_keys(next, stage ^ 1);
    cp_async_commit();
    const bool gated = k_bad_head[j0 / kTile] != 0;
    cp_async_wait<1>();  // this tile's K and V (and Q, dO before the first)
    wg::fence_shared_for_async();
    __syncthreads();

    // S = Q·Kᵀ and dP = dO·Vᵀ, then dS in place of S.
    float sc[kNt][4], dp[kNt][4];
    scores_and_gradients<kHalf, D>(sc, q_desc, tile_desc(k_s(stage)), dp, do_desc, tile_desc(v_s(stage)));
    const bool inside = tile_inside_bands(band_first, band_last, j0, j0 + kTile - 1);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const Band& band = e < 2 ? band_a : band_b;
        const int64_t j = j0 + nt * 8 + 2 * t + (e & 1);
        const float x = inside || (j >= band.lo && j <= band.hi) ? sc[nt][e] * p.scale : -INFINITY;
        const float pr = e < 2 ? probability(x, m_a, il_a) : probability(x, m_b, il_b);
        sc[nt][e] = score_gradient(pr, dp[nt][e], 1.0f, e < 2 ? ds_a : ds_b, 1.0f);
      }
    }

    // dQ += dS·K (scaled once at the end).
    uint32_t pa[kTile / 16][4];
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) a_from_accumulator<T>(sc, kk, pa[kk]);
    if (!gated) {
      accumulate_values<kHalf, D, kTile>(dq, pa, tile_desc(k_s(stage)));
    } else {
      gated_values<T, D, kTile>(dq, pa, pw_s + warp * 16 * kTile, k_s(stage));
    }
    __syncthreads();  // every warp is done with this stage before the tile after next comes
    j0 = next;
    stage ^= 1;
  }
  cp_async_wait<0>();

  T* dq_out = static_cast<T*>(bp.dq) + bseqs[b].dq_offset + int64_t{h} * bp.dq_head;
  store_accumulator_rows<T, kDt>(dq, dq_out, bp.dq_row, row_a, row_b, s.Lq, p.scale);
#endif
}

// dK and dV of 64 keys of one (sequence, kv head), over every query head of the group
// and the 64-row query tiles whose band reaches them. q_bad, do_bad: the pre-pass's flags
// per 64-row tile of Q and dO, q_tiles per head.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    wgmma_dkdv_kernel(BackwardParams bp, const SeqDesc* seqs, const BackwardSeq* bseqs, RowStats st,
                      const uint8_t* q_bad, const uint8_t* do_bad, int q_tiles) {
#ifdef ATTN_HAVE_WGMMA
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr int kNt = kTile / 8, kDt = D / 8;
  const ForwardParams& p = bp.fwd;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_at = shared_address(smem_raw);
  unsigned char* k_s = smem_raw + ((1024 - raw_at % 1024) % 1024);
  unsigned char* v_s = k_s + kTileBytes<D>;
  unsigned char* qdo_s = v_s + kTileBytes<D>;  // [stage][Q, dO]
  T* pw_s = reinterpret_cast<T*>(qdo_s + 4 * kTileBytes<D>);  // [4 warps][16][64], the gated paths' Pᵀ or dSᵀ
  float* m_s = reinterpret_cast<float*>(pw_s + 4 * 16 * kTile);  // the step's rows' statistics
  float* il_s = m_s + kTile;
  float* ds_s = il_s + kTile;
  auto q_s = [&](int stage) { return qdo_s + (2 * stage) * kTileBytes<D>; };
  auto do_s = [&](int stage) { return qdo_s + (2 * stage + 1) * kTileBytes<D>; };

  const int b = blockIdx.z, hk = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int j0 = blockIdx.x * kTile;
  if (j0 >= s.Lk) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group = p.Hq / p.Hkv;
  const T* k = static_cast<const T*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const T* v = static_cast<const T*>(p.v) + s.v_offset + int64_t{hk} * p.v_head;
  start_swizzled_tile<T, D, kTile>(k_s, k, p.k_row, j0, s.Lk, rows_vectorizable<T>(k, p.k_row));
  start_swizzled_tile<T, D, kTile>(v_s, v, p.v_row, j0, s.Lk, rows_vectorizable<T>(v, p.v_row));
  cp_async_commit();

  const int key_a = j0 + warp * 16 + g, key_b = key_a + 8;
  const int key_last = min(j0 + kTile, s.Lk) - 1;
  int row_first, row_last;
  rows_reaching(p, s, j0, key_last, row_first, row_last);
  const int h_end = (hk + 1) * group;
  const int i_first = row_first <= row_last ? (row_first / kTile) * kTile : row_last + 1;
  // The step after (h, i0), or the first for h < 0: every query head of the group, and
  // its row tiles from i_first to row_last.
  auto next_step = [&](int h, int i0, int& nh, int& ni) -> bool {
    if (h < 0) {
      nh = hk * group, ni = i_first;
    } else if (i0 + kTile <= row_last) {
      nh = h, ni = i0 + kTile;
    } else {
      nh = h + 1, ni = i_first;
    }
    return nh < h_end && ni <= row_last;
  };
  float next_m = -INFINITY, next_il = 0.0f, next_ds = 0.0f;  // thread r < 64: row r of the next step
  auto start_step = [&](int h, int i0, int stage) {
    const T* q = static_cast<const T*>(p.q) + s.q_offset + int64_t{h} * p.q_head;
    const T* dout = static_cast<const T*>(bp.dout) + bseqs[b].dout_offset + int64_t{h} * bp.dout_head;
    start_swizzled_tile<T, D, kTile>(q_s(stage), q, p.q_row, i0, s.Lq, rows_vectorizable<T>(q, p.q_row));
    start_swizzled_tile<T, D, kTile>(do_s(stage), dout, bp.dout_row, i0, s.Lq, rows_vectorizable<T>(dout, bp.dout_row));
    const int i = i0 + threadIdx.x;
    st.load(p.Hq, b, h, i, threadIdx.x < kTile && i < s.Lq, next_m, next_il, next_ds);
  };

  float dk[kDt][4], dv[kDt][4];
#pragma unroll
  for (int n = 0; n < kDt; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;
  }
  const uint64_t k_desc = tile_desc(k_s), v_desc = tile_desc(v_s);
  int h = -1, i0 = 0, stage = 0;
  bool have = next_step(h, i0, h, i0);
  if (have) start_step(h, i0, 0);
  cp_async_commit();
  while (have) {
    if (threadIdx.x < kTile) m_s[threadIdx.x] = next_m, il_s[threadIdx.x] = next_il, ds_s[threadIdx.x] = next_ds;
    const int64_t tile = (int64_t{b} * p.Hq + h) * q_tiles + i0 / kTile;
    const bool gated_dk = q_bad[tile] != 0, gated_dv = do_bad[tile] != 0;
    int nh = h, ni = i0;
    const bool more = next_step(h, i0, nh, ni);
    if (more) start_step(nh, ni, stage ^ 1);  // that stage was last read before the previous step's end barrier
    cp_async_commit();
    cp_async_wait<1>();  // this step's Q and dO (and K, V before the first)
    wg::fence_shared_for_async();
    __syncthreads();

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: element (key, row) at (e < 2 ? key_a : key_b,
    // i0 + 8·nt + 2t + (e & 1)).
    float sc[kNt][4], dp[kNt][4];
    scores_and_gradients<kHalf, D>(sc, k_desc, tile_desc(q_s(stage)), dp, v_desc, tile_desc(do_s(stage)));
    // Pᵀ in sc, dSᵀ in dp; only scaled scores where the key block lies inside every
    // row's band.
    const bool inside = tile_inside_bands(band_of_row(p, s, i0), band_of_row(p, s, min(i0 + kTile, s.Lq) - 1), j0,
                                          j0 + kTile - 1);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int r = nt * 8 + 2 * t + c;
        const Band band = inside ? Band{0, 0} : band_of_row(p, s, i0 + r);
#pragma unroll
        for (int kr = 0; kr < 2; ++kr) {
          const int e = 2 * kr + c;
          const int key = kr == 0 ? key_a : key_b;
          const float x = inside || (key >= band.lo && key <= band.hi) ? sc[nt][e] * p.scale : -INFINITY;
          const float pr = probability(x, m_s[r], il_s[r]);
          dp[nt][e] = score_gradient(pr, dp[nt][e], 1.0f, ds_s[r], 1.0f);
          sc[nt][e] = pr;
        }
      }
    }

    // dV += Pᵀ·dO and dK += dSᵀ·Q (dK scaled once at the end).
    uint32_t pa[kTile / 16][4], da[kTile / 16][4];
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      a_from_accumulator<T>(sc, kk, pa[kk]);
      a_from_accumulator<T>(dp, kk, da[kk]);
    }
    pin_all<kDt>(dv);
    pin_all<kDt>(dk);
    wg::fence();
    if (!gated_dv) issue_values<kHalf, D, kTile>(dv, pa, tile_desc(do_s(stage)));
    if (!gated_dk) issue_values<kHalf, D, kTile>(dk, da, tile_desc(q_s(stage)));
    wg::commit();
    wg::wait<0>();
    pin_all<kDt>(dv);
    pin_all<kDt>(dk);
    T* pw = pw_s + warp * 16 * kTile;
    if (gated_dv) gated_values<T, D, kTile>(dv, pa, pw, do_s(stage));
    if (gated_dk) gated_values<T, D, kTile>(dk, da, pw, q_s(stage));
    __syncthreads();  // before the next step's statistics, and the copy after it, overwrite this one's
    h = nh, i0 = ni, have = more, stage ^= 1;
  }
  cp_async_wait<0>();

  T* dk_out = static_cast<T*>(bp.dk) + bseqs[b].dk_offset + int64_t{hk} * bp.dk_head;
  T* dv_out = static_cast<T*>(bp.dv) + bseqs[b].dv_offset + int64_t{hk} * bp.dv_head;
  store_accumulator_rows<T, kDt>(dk, dk_out, bp.dk_row, key_a, key_b, s.Lk, p.scale);
  store_accumulator_rows<T, kDt>(dv, dv_out, bp.dv_row, key_a, key_b, s.Lk, 1.0f);
#endif
}

template <class T, int D>
cudaError_t launch(const BackwardParams& bp, const SeqDesc* seqs, const BackwardSeq* bseqs, const RowStats& st,
                   cudaStream_t stream) {
  const ForwardParams& p = bp.fwd;
  // Q, dO and two stages of K and V (dq) or K, V and two stages of Q and dO (dkdv), the
  // gated path's operands, the statistics (dkdv), and 1 KiB to align the swizzled tiles.
  const size_t smem = 1024 + 6 * size_t{kTileBytes<D>} + 4 * 16 * kTile * sizeof(T) + 3 * kTile * sizeof(float);
  auto* dq_kernel = &wgmma_dq_kernel<T, D>;
  auto* dkdv_kernel = &wgmma_dkdv_kernel<T, D>;
  cudaError_t e = cudaFuncSetAttribute(dq_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e == cudaSuccess) e = cudaFuncSetAttribute(dkdv_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;

  NonfiniteTiles k_bad;
  e = k_bad.make<T, T, D, kTile>(p, seqs, bseqs, TileSource::keys, p.k, p.k_row, p.k_head, p.Hkv, stream);
  if (e == cudaSuccess) {
    const dim3 grid((p.max_lq + kTile - 1) / kTile, p.Hq, p.B);
    dq_kernel<<<grid, kThreads, smem, stream>>>(bp, seqs, bseqs, st, k_bad.flags, k_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f = k_bad.free(stream);
  if (e != cudaSuccess || (e = f) != cudaSuccess) return e;

  NonfiniteTiles q_bad, do_bad;
  e = q_bad.make<T, T, D, kTile>(p, seqs, bseqs, TileSource::queries, p.q, p.q_row, p.q_head, p.Hq, stream);
  if (e == cudaSuccess) {
    e = do_bad.make<T, T, D, kTile>(p, seqs, bseqs, TileSource::dout, bp.dout, bp.dout_row, bp.dout_head, p.Hq,
                                    stream);
  }
  if (e == cudaSuccess) {
    const dim3 grid((bp.max_lk + kTile - 1) / kTile, p.Hkv, p.B);
    dkdv_kernel<<<grid, kThreads, smem, stream>>>(bp, seqs, bseqs, st, q_bad.flags, do_bad.flags, q_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f1 = q_bad.free(stream), f2 = do_bad.free(stream);
  return e != cudaSuccess ? e : f1 != cudaSuccess ? f1 : f2;
}

}  // namespace

bool wgmma_backward_applies(const BackwardParams& bp) {
#ifndef ATTN_CUDA_SM90A
  (void)bp;
  return false;
#else
  const ForwardParams& p = bp.fwd;
  const char* env = std::getenv("ATTN_CUDA_WGMMA_BWD");
  if (env == nullptr || std::strcmp(env, "1") != 0) return false;
  if (p.in == Elem::f32 || (p.d != 64 && p.d != 128)) return false;
  if (p.softcap > 0.0f || p.alibi != nullptr || p.add_mask != nullptr || p.bool_mask != nullptr ||
      p.bm_blocks != nullptr || p.dropout_p > 0.0f || bp.dbias != nullptr) {
    return false;
  }
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device) != cudaSuccess) return false;
  return major == 9;
#endif
}

cudaError_t wgmma_backward(const BackwardParams& bp, const SeqDesc* seqs, const BackwardSeq* bseqs,
                           const RowStats& st, cudaStream_t stream) {
  const bool half = bp.fwd.in == Elem::f16;
  if (bp.fwd.d == 64) {
    return half ? launch<__half, 64>(bp, seqs, bseqs, st, stream) : launch<__nv_bfloat16, 64>(bp, seqs, bseqs, st, stream);
  }
  return half ? launch<__half, 128>(bp, seqs, bseqs, st, stream) : launch<__nv_bfloat16, 128>(bp, seqs, bseqs, st, stream);
}

}  // namespace attn::cuda
