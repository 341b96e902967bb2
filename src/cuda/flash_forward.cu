// The fused attention forward on NVIDIA GPUs (sm_80 and newer): FlashAttention-2's
// algorithm on the tensor cores' mma.sync.m16n8k16 (bf16 or f16 operands, f32
// accumulation), with attention()'s every built-in option.
//
// One thread block of 4 warps owns 64 query rows of one (sequence, head); each warp
// owns 16 of them and keeps its Q fragments, its output accumulator and its softmax
// state (row max m, row sum l) in registers. Key tiles of Bc keys stream through shared
// memory. The score accumulator of Q·Kᵀ has exactly the register layout of the A
// operand of P·V, so P never leaves the registers (FlashAttention-2's trick).
//
// Semantics that cost a branch here and nothing on well-formed inputs:
//   - a key removed for a row (band, mask, key length) scores −∞ and gets p = 0;
//   - a value tile holding a NaN or ±∞ (found once per call by a pre-pass,
//     nonfinite_tiles.cuh) is multiplied element by element, skipping p = 0, so that
//     the value of a removed key never reaches an output (the tensor cores would give
//     0·∞ = NaN);
//   - a row with no visible key gives out = 0 and lse = −∞.
// `probs`, when wanted, comes from a second, row-wise kernel (probs_kernel).
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/flash_forward_wgmma.hpp"
#include "cuda/mma_fragments.cuh"
#include "cuda/nonfinite_tiles.cuh"
#include "cuda/score_mods.cuh"

namespace attn::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = kWarps * 16;  // Br
constexpr float kLog2e = 1.4426950408889634f;

// v_bad: the pre-pass's flag per Bc-key tile of V (nonfinite_tiles.cuh), v_tiles per head.
template <class T, class In, int D, int Bc>
__global__ void __launch_bounds__(kThreads)
    flash_forward_kernel(ForwardParams p, const SeqDesc* seqs, const uint8_t* v_bad, int v_tiles) {
  constexpr int LD = D + 8;  // padded rows: the fragment loads hit 32 different banks
  constexpr int kNt = Bc / 8;   // n-tiles of a score row
  constexpr int kKt = D / 16;   // k-steps of Q·Kᵀ
  constexpr int kDt = D / 8;    // n-tiles of an output row
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* k_s = reinterpret_cast<T*>(smem_raw);
  T* v_s = k_s + Bc * LD;
  float* p_s = reinterpret_cast<float*>(v_s + Bc * LD);  // [kWarps][16][Bc], the slow path's P

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int q0 = blockIdx.x * kRowsPerBlock;
  if (q0 >= s.Lq) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;  // fragment row group and column pair
  const int hk = h / (p.Hq / p.Hkv);

  const In* q = static_cast<const In*>(p.q) + s.q_offset + int64_t{h} * p.q_head;
  const In* k = static_cast<const In*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const In* v = static_cast<const In*>(p.v) + s.v_offset + int64_t{hk} * p.v_head;
  const uint8_t* v_bad_head = v_bad + (int64_t{b} * p.Hkv + hk) * v_tiles;

  // Q: held as A fragments in registers, or (d = 256, where registers run out) kept
  // in shared memory and read per tile. Staged through the K/V buffer (2·Bc ≥ 64 rows)
  // when it stays in registers.
  constexpr bool kQInSmem = D > 128;
  T* q_s = kQInSmem ? reinterpret_cast<T*>(p_s + kWarps * 16 * Bc) : k_s;
  uint32_t qa[kQInSmem ? 1 : kKt][4];
  load_rows<T, In, D, LD, kThreads>(q_s, q, p.q_row, q0, kRowsPerBlock, s.Lq, false);
  __syncthreads();
  auto q_fragment = [&](int kt, uint32_t a[4]) { a_fragment<T, LD>(q_s + warp * 16 * LD, kt, a); };
  if constexpr (!kQInSmem) {
#pragma unroll
    for (int kt = 0; kt < kKt; ++kt) q_fragment(kt, qa[kt]);
    __syncthreads();
  }

  // This thread's two rows: A = row g, B = row g + 8 of the warp's 16.
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const Band band_a = band_of_row(p, s, row_a), band_b = band_of_row(p, s, row_b);
  // The block's keys: the band's bounds grow with the row, so the first row's lo and
  // the last real row's hi bound every row's.
  const int last_row = min(q0 + kRowsPerBlock, s.Lq) - 1;
  const int64_t key_lo = max(int64_t{0}, band_of_row(p, s, q0).lo);
  const int64_t key_hi = min(int64_t{s.Lk} - 1, band_of_row(p, s, last_row).hi);

  float o[kDt][4];
#pragma unroll
  for (int n = 0; n < kDt; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  // The running maxima m are in log2 units (scores · log2 e), so that each probability is
  // one exp2 of a difference: p = 2^(x − m).
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;
  const float scale_log2 = p.scale * kLog2e;

  const float slope = alibi_slope(p, b, h);
  const bool dropout = p.dropout_p > 0.0f;
  const detail::DropoutRng rng = dropout_rng(p);
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);

  const Band band_first = band_of_row(p, s, q0), band_last = band_of_row(p, s, last_row);
  const bool plain = scores_plain(p);
  // The next key tile from j on that the block mask leaves some key of (−1: none).
  auto live_tile = [&](int64_t j) { return first_live_tile<kThreads, Bc>(p, s, b, h, q0, last_row, j, key_hi); };
  // FlashAttention-2's pipeline: V of this tile is in flight during S = Q·Kᵀ, and K of
  // the next during the softmax and P·V (cp.async where the rows allow 16-byte copies).
  const bool k_vec = rows_vectorizable<T>(k, p.k_row), v_vec = rows_vectorizable<T>(v, p.v_row);
  int64_t j0 = live_tile(key_lo <= key_hi ? (key_lo / Bc) * Bc : key_hi + 1);
  if (j0 >= 0) start_rows<T, In, D, LD, kThreads, Bc>(k_s, k, p.k_row, static_cast<int>(j0), s.Lk, k_vec);
  cp_async_commit();
  while (j0 >= 0) {
    start_rows<T, In, D, LD, kThreads, Bc>(v_s, v, p.v_row, static_cast<int>(j0), s.Lk, v_vec);
    cp_async_commit();
    // V's flag, read now so that its load's latency passes during S, not before P·V.
    const bool slow = v_bad_head[j0 / Bc] != 0;
    cp_async_wait<1>();  // K of this tile
    __syncthreads();

    // S = Q·Kᵀ for the warp's 16 rows × Bc keys.
    float sc[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
#pragma unroll
      for (int kt = 0; kt < kKt; kt += 2) {
        uint32_t bf[4];
        b_fragments_rows<T, LD>(k_s, nt, kt, bf);
        if constexpr (kQInSmem) {
          uint32_t a[4];
          q_fragment(kt, a);
          mma16816<T>(sc[nt], a, bf[0], bf[1]);
          q_fragment(kt + 1, a);
          mma16816<T>(sc[nt], a, bf[2], bf[3]);
        } else {
          mma16816<T>(sc[nt], qa[kt], bf[0], bf[1]);
          mma16816<T>(sc[nt], qa[kt + 1], bf[2], bf[3]);
        }
      }
    }
    __syncthreads();  // every warp has read K: the next tile's K may come
    const int64_t next = live_tile(j0 + Bc);
    if (next >= 0) start_rows<T, In, D, LD, kThreads, Bc>(k_s, k, p.k_row, static_cast<int>(next), s.Lk, k_vec);
    cp_async_commit();

    // Modifiers and masks, attention()'s order: scale, softcap, ALiBi, masks, band. A
    // tile inside every row's band without element-wise modifiers keeps its raw products:
    // scale > 0 keeps their order, so the row max is taken raw and scaled once, and each
    // score's scaling joins its exponent's subtraction in one FFMA below (`mul`).
    float mx_a = -INFINITY, mx_b = -INFINITY, mul = 1.0f;
    if (plain && tile_inside_bands(band_first, band_last, j0, j0 + Bc - 1)) {
      raw_row_maxima<kNt>(sc, mx_a, mx_b);
      mul = scale_log2;
    } else {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e < 2 ? row_a : row_b;
          const int64_t j = j0 + nt * 8 + 2 * t + (e & 1);
          const float x = modified_score(p, s, b, h, slope, i, j, e < 2 ? band_a : band_b, sc[nt][e]) * kLog2e;
          sc[nt][e] = x;
          if (e < 2) mx_a = fmaxf(mx_a, x); else mx_b = fmaxf(mx_b, x);
        }
      }
    }
    float alpha_a, alpha_b;
    softmax_step<kNt>(sc, mx_a, mx_b, mul, m_a, m_b, l_a, l_b, alpha_a, alpha_b);
    // Rescale O only when a row's max moved (alpha ≠ 1; x·1 = x for every x, so skipping
    // changes no bit): after the first tiles it rarely does on real data.
    if (alpha_a != 1.0f || alpha_b != 1.0f) {
#pragma unroll
      for (int n = 0; n < kDt; ++n) {
        o[n][0] *= alpha_a, o[n][1] *= alpha_a;
        o[n][2] *= alpha_b, o[n][3] *= alpha_b;
      }
    }
    // Dropout after the sums (lse is that of the scores before dropout).
    if (dropout) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int i = rr == 0 ? row_a : row_b;
          const int64_t j = j0 + nt * 8 + 2 * t;  // even: keys j and j + 1
          bool keep0, keep1;
          dropout_keep_pair(rng, p, b, h, i, j, keep0, keep1);
          float& x0 = sc[nt][2 * rr];
          float& x1 = sc[nt][2 * rr + 1];
          x0 = keep0 ? x0 * keep_scale : 0.0f;
          x1 = keep1 ? x1 * keep_scale : 0.0f;
        }
      }
    }

    // O += P·V; P's score fragments are its A fragments. A value in this tile that is
    // NaN or ±∞ takes the element-by-element path, skipping the keys whose probability
    // is 0 (removed or dropped), with P rounded as on the tensor cores.
    cp_async_wait<1>();  // V of this tile
    __syncthreads();
    accumulate_product<T, LD, kDt, Bc>(o, sc, v_s, slow, p_s + warp * 16 * Bc);
    __syncthreads();  // before the next tile overwrites V
    j0 = next;
  }
  cp_async_wait<0>();

  finish_forward_rows<In, kDt>(o, m_a, m_b, l_a, l_b, p, s, h, row_a, row_b, t);
}

// probs: the probabilities after dropout, one warp per query row, after the forward
// (a debugging and teaching output: it re-reads K twice, first for the row's max and
// sum, then for every column). Columns past the sequence's keys are 0; a NaN row is NaN
// as in the reference.
template <class T, class In>
__global__ void __launch_bounds__(kThreads) probs_kernel(ForwardParams p, const SeqDesc* seqs) {
  const int b = blockIdx.z, h = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const SeqDesc s = seqs[b];
  const int i = blockIdx.x * kWarps + warp;
  if (i >= s.Lq) return;
  float mx, sum;
  row_max_sum<T, In>(p, s, b, h, i, mx, sum);
  const int hk = h / (p.Hq / p.Hkv);
  const In* q = static_cast<const In*>(p.q) + s.q_offset + int64_t{h} * p.q_head + int64_t{i} * p.q_row;
  const In* k = static_cast<const In*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const Band band = band_of_row(p, s, i);
  const float slope = alibi_slope(p, b, h), inv = 1.0f / sum;
  const detail::DropoutRng rng = dropout_rng(p);
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);
  float* row = p.probs + s.probs_offset + int64_t{h} * p.probs_h + int64_t{i} * p.probs_i;
  for (int64_t j = lane; j < p.probs_cols; j += 32) {
    float pr = 0.0f;
    if (j < s.Lk && isnan(sum)) {
      pr = NAN;
    } else if (j < s.Lk && mx != -INFINITY && j >= band.lo && j <= band.hi) {
      float raw = 0.0f;
      for (int c = 0; c < p.d; ++c) {
        raw += to_float(load_operand<T>(q + c)) * to_float(load_operand<T>(k + j * p.k_row + c));
      }
      const float x = modified_score(p, s, b, h, slope, i, j, band, raw);
      if (x != -INFINITY) {
        pr = exp2f((x - mx) * kLog2e) * inv;
        if (p.dropout_p > 0.0f) pr = dropout_keep(rng, p, b, h, i, j) ? pr * keep_scale : 0.0f;
      }
    }
    row[j] = pr;
  }
}

template <class T, class In>
cudaError_t launch_probs(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  const dim3 grid((p.max_lq + kWarps - 1) / kWarps, p.Hq, p.B);
  probs_kernel<T, In><<<grid, kThreads, 0, stream>>>(p, seqs);
  return cudaGetLastError();
}

// Key tile per head dimension: 64 keys, 32 at d = 256 (registers and shared memory).
template <int D> constexpr int kKeyTile = D >= 256 ? 32 : 64;

template <class T, class In, int D>
cudaError_t launch(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  constexpr int Bc = kKeyTile<D>;
  auto* kernel = &flash_forward_kernel<T, In, D, Bc>;
  // K and V tiles, the slow path's P, and Q where it stays in shared memory (d > 128).
  const size_t smem = 2 * Bc * (D + 8) * sizeof(T) + size_t{kWarps} * 16 * Bc * sizeof(float) +
                      (D > 128 ? size_t{kRowsPerBlock} * (D + 8) * sizeof(T) : 0);
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (e != cudaSuccess) return e;
  }
  // The V tiles holding a NaN or ±∞, one flag each (stream-ordered scratch).
  NonfiniteTiles v_bad;
  cudaError_t e = v_bad.make<T, In, D, Bc>(p, seqs, nullptr, TileSource::values, p.v, p.v_row, p.v_head, p.Hkv, stream);
  if (e == cudaSuccess) {
    const dim3 grid((p.max_lq + kRowsPerBlock - 1) / kRowsPerBlock, p.Hq, p.B);
    kernel<<<grid, kThreads, smem, stream>>>(p, seqs, v_bad.flags, v_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f = v_bad.free(stream);
  return e != cudaSuccess ? e : f;
}

template <class T, class In>
cudaError_t launch_for_dim(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  switch (p.d) {
    case 64: return launch<T, In, 64>(p, seqs, stream);
    case 96: return launch<T, In, 96>(p, seqs, stream);
    case 128: return launch<T, In, 128>(p, seqs, stream);
    case 256: return launch<T, In, 256>(p, seqs, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

bool supported_head_dim(int d) { return d == 64 || d == 96 || d == 128 || d == 256; }

std::string forward(const ForwardParams& p) {
  if (!supported_head_dim(p.d)) return "head dim " + std::to_string(p.d) + " is not compiled";
  if (p.B == 0 || p.max_lq == 0 || p.Hq == 0) return "";
  const DeviceScope scope(p.device);
  if (!scope.ok()) return scope.error();
  cudaStream_t stream = static_cast<cudaStream_t>(p.stream);
  // The sequence table travels to the device with the work (stream-ordered memory).
  SeqDesc* seqs = nullptr;
  const size_t bytes = sizeof(SeqDesc) * size_t(p.B);
  ATTN_CUDA_TRY(cudaMallocAsync(reinterpret_cast<void**>(&seqs), bytes, stream));
  cudaError_t e = cudaMemcpyAsync(seqs, p.seqs_host, bytes, cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess && wgmma_forward_applies(p)) {
    e = ws_forward_wanted() ? ws_forward(p, seqs, stream) : cudaErrorNotSupported;
    if (e == cudaErrorNotSupported) e = wgmma_forward(p, seqs, stream);
  } else if (e == cudaSuccess) {
    switch (p.in) {
      case Elem::bf16: e = launch_for_dim<__nv_bfloat16, __nv_bfloat16>(p, seqs, stream); break;
      case Elem::f16: e = launch_for_dim<__half, __half>(p, seqs, stream); break;
      case Elem::f32: e = launch_for_dim<__nv_bfloat16, float>(p, seqs, stream); break;
    }
  }
  if (e == cudaSuccess && p.probs != nullptr) {
    switch (p.in) {
      case Elem::bf16: e = launch_probs<__nv_bfloat16, __nv_bfloat16>(p, seqs, stream); break;
      case Elem::f16: e = launch_probs<__half, __half>(p, seqs, stream); break;
      case Elem::f32: e = launch_probs<__nv_bfloat16, float>(p, seqs, stream); break;
    }
  }
  const cudaError_t f = cudaFreeAsync(seqs, stream);
  if (e != cudaSuccess) return cuda_error_text("the forward kernel", e);
  if (f != cudaSuccess) return cuda_error_text("cudaFreeAsync", f);
  return "";
}

}  // namespace attn::cuda
