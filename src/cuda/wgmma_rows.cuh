// What the wgmma kernels (flash_forward_wgmma.cu, flash_forward_ws.cu,
// flash_backward_wgmma.cu) share: the copy of a tile into the swizzled layout by one
// warpgroup; the online softmax of a score tile in a warp's accumulator layout, the
// rescale of O and the rows' final normalisation; A·V issued per 64-column panel of V,
// and its element-by-element form for a tile with a NaN or ±∞.
//
// A warpgroup's m64 accumulator gives each warp 16 rows in mma.sync's C layout: a
// thread holds rows A = g and B = g + 8 (g = lane / 4), columns 8·n + 2t and + 1
// (t = lane % 4) of n-tile n, as acc[n][0..1] (row A) and acc[n][2..3] (row B).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/mma_fragments.cuh"
#include "cuda/score_mods.cuh"
#include "cuda/wgmma.cuh"

namespace attn::cuda {

/// Keeps the compiler from moving reads or writes of accumulator registers across the
/// wgmma that writes them asynchronously (the asm statements around it are volatile; this
/// ties each register to that order).
template <int N>
__device__ __forceinline__ void pin_all(float (*acc)[4]) {
#pragma unroll
  for (int n = 0; n < N; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(acc[n][e])::"memory");
  }
}

/// Starts copying rows [r0, r0 + kTileRows) of one head of a [L, H, D] tensor (row
/// stride `row` elements; rows ≥ valid become zeros) into a swizzled tile, by the
/// warpgroup's 128 threads, one 16-byte chunk at a time: cp.async where the rows allow
/// it (`vec`, block-uniform; a later cp_async_wait completes them), plain loads otherwise.
/// A pass of the 128 threads covers 128 / (D / 8) = 8 or 16 whole rows, a multiple of the
/// swizzle's 8-row atom, so each thread's chunks keep their place within an atom and
/// are 1 or 2 atoms (1 KiB each) apart.
template <class T, int D, int kTileRows>
__device__ __forceinline__ void start_swizzled_tile(unsigned char* dst, const T* src, int64_t row, int r0, int valid,
                                                    bool vec) {
  constexpr int kChunks = D / 8;
  constexpr int kPassRows = 128 / kChunks;
  static_assert(kPassRows % 8 == 0 && kTileRows % kPassRows == 0, "passes of whole swizzle atoms");
  const int r_in = threadIdx.x / kChunks, ch = threadIdx.x % kChunks;
  const int panel = ch / 8, cc = ch % 8, r8 = r_in % 8;
  unsigned char* to = dst + panel * kTileRows * 128 + (r_in / 8) * 1024 + r8 * 128 + ((cc ^ r8) * 16);
  const T* from = src + int64_t{r0 + r_in} * row + ch * 8;
  const int64_t step = int64_t{kPassRows} * row;
#pragma unroll
  for (int u = 0; u < kTileRows / kPassRows; ++u) {
    const int r = r0 + r_in + u * kPassRows;
    unsigned char* at = to + u * (kPassRows / 8) * 1024;
    if (r >= valid) {
      *reinterpret_cast<uint4*>(at) = make_uint4(0, 0, 0, 0);
    } else if (vec) {
      cp_async_16(at, from);
    } else {
      *reinterpret_cast<uint4*>(at) = load_chunk<T>(from, false);
    }
    from += step;
  }
}

/// One thread's two rows in an online softmax in log2 units (scores · scale · log2 e,
/// p = 2^(x − m)): their bands, running maxima m and sums l (this thread's columns only
/// until finish()).
struct SoftmaxRows {
  Band band_a, band_b;         // rows A and B
  Band band_first, band_last;  // the warpgroup's first and last real rows: every row's band lies between
  float scale_log2;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  /// The scores of keys j0 … j0 + 8·kNt − 1 (sc: n-tiles, raw products) become
  /// probabilities; m and l move on; alpha is what each row's O must be scaled by. A tile
  /// inside every row's band keeps its raw products (scale > 0 keeps their order; the
  /// scaling joins each exponent's FFMA through `mul`); others remove the keys outside
  /// each row's band (which ends at the sequence's last key).
  template <int kNt>
  __device__ __forceinline__ void step(float (*sc)[4], int64_t j0, int t, float& alpha_a, float& alpha_b) {
    float mx_a = -INFINITY, mx_b = -INFINITY, mul = 1.0f;
    if (tile_inside_bands(band_first, band_last, j0, j0 + kNt * 8 - 1)) {
      raw_row_maxima<kNt>(sc, mx_a, mx_b);
      mul = scale_log2;
    } else {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const Band& band = e < 2 ? band_a : band_b;
          const int64_t j = j0 + nt * 8 + 2 * t + (e & 1);
          const float x = j >= band.lo && j <= band.hi ? sc[nt][e] * scale_log2 : -INFINITY;
          sc[nt][e] = x;
          if (e < 2) mx_a = fmaxf(mx_a, x); else mx_b = fmaxf(mx_b, x);
        }
      }
    }
    softmax_step<kNt>(sc, mx_a, mx_b, mul, m_a, m_b, l_a, l_b, alpha_a, alpha_b);
  }

  /// out = O / l and lse for rows row_a, row_b (those < s.Lq) of head h
  /// (finish_forward_rows).
  template <class T, int kDt>
  __device__ __forceinline__ void finish(const float (*o)[4], const ForwardParams& p, const SeqDesc& s, int h,
                                         int row_a, int row_b, int t) const {
    finish_forward_rows<T, kDt>(o, m_a, m_b, l_a, l_b, p, s, h, row_a, row_b, t);
  }
};

/// O's rows scaled by alpha, skipped where no row's max moved (x·1 = x: no bit changes).
template <int kDt>
__device__ __forceinline__ void rescale_rows(float (*o)[4], float alpha_a, float alpha_b) {
  if (alpha_a != 1.0f || alpha_b != 1.0f) {
#pragma unroll
    for (int n = 0; n < kDt; ++n) {
      o[n][0] *= alpha_a, o[n][1] *= alpha_a;
      o[n][2] *= alpha_b, o[n][3] *= alpha_b;
    }
  }
}

#ifdef ATTN_HAVE_WGMMA
/// O (D columns) += P·V on the tensor cores, issued and not waited for: V a swizzled
/// [kKeys][D] tile at descriptor v_desc (D / 64 panels of kKeys rows), P as A fragments
/// (k-step kk: keys 16·kk …, 2 swizzle atoms, 2 KiB, further into each panel).
template <bool kHalf, int D, int kKeys>
__device__ __forceinline__ void issue_values(float (*o)[4], const uint32_t (*pa)[4], uint64_t v_desc) {
#pragma unroll
  for (int pn = 0; pn < D / 64; ++pn) {
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      wgmma::rs_m64n64k16_tb<kHalf>(&o[8 * pn][0], pa[kk], v_desc + ((pn * kKeys * 128 + kk * 2048) >> 4), 1);
    }
  }
}

/// issue_values, waited for: O += P·V complete on return.
template <bool kHalf, int D, int kKeys>
__device__ __forceinline__ void accumulate_values(float (*o)[4], const uint32_t (*pa)[4], uint64_t v_desc) {
  pin_all<D / 8>(o);
  wgmma::fence();
  issue_values<kHalf, D, kKeys>(o, pa, v_desc);
  wgmma::commit();
  wgmma::wait<0>();
  pin_all<D / 8>(o);
}
#endif

/// O (a warp's 16 rows × D columns) += P·V element by element, skipping p = 0, for a
/// value tile with a NaN or ±∞, where the tensor cores would give 0·∞ = NaN for a
/// removed key (gated_accumulate's rule, for the swizzled layout): P as A fragments
/// (already rounded operands) through pw, this warp's [16][kKeys] scratch; V a swizzled
/// [kKeys][D] tile.
template <class T, int D, int kKeys>
__device__ __forceinline__ void gated_values(float (*o)[4], const uint32_t (*pa)[4], T* pw, const unsigned char* v) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int kk = 0; kk < kKeys / 16; ++kk) {
    const int c = kk * 16 + 2 * t;
    *reinterpret_cast<uint32_t*>(pw + g * kKeys + c) = pa[kk][0];
    *reinterpret_cast<uint32_t*>(pw + (g + 8) * kKeys + c) = pa[kk][1];
    *reinterpret_cast<uint32_t*>(pw + g * kKeys + c + 8) = pa[kk][2];
    *reinterpret_cast<uint32_t*>(pw + (g + 8) * kKeys + c + 8) = pa[kk][3];
  }
  __syncwarp();
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = n * 8 + 2 * t;
    const unsigned char* panel = v + (col / 64) * kKeys * 128;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll 1
    for (int j = 0; j < kKeys; ++j) {
      const float pa_j = to_float(pw[g * kKeys + j]), pb_j = to_float(pw[(g + 8) * kKeys + j]);
      if (pa_j == 0.0f && pb_j == 0.0f) continue;
      const T* y = reinterpret_cast<const T*>(panel + wgmma::sw128_offset(j, col % 64));
      const float y0 = to_float(y[0]), y1 = to_float(y[1]);
      if (pa_j != 0.0f) s0 += pa_j * y0, s1 += pa_j * y1;
      if (pb_j != 0.0f) s2 += pb_j * y0, s3 += pb_j * y1;
    }
    o[n][0] += s0, o[n][1] += s1, o[n][2] += s2, o[n][3] += s3;
  }
  __syncwarp();
}

}  // namespace attn::cuda
