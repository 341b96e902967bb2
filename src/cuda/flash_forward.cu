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
//   - a value tile holding a NaN or ±∞ is multiplied element by element, skipping
//     p = 0, so that the value of a removed key never reaches an output (the tensor
//     cores would give 0·∞ = NaN);
//   - a row with no visible key gives out = 0 and lse = −∞.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_check.hpp"
#include "dropout/philox.hpp"

namespace attn::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerBlock = kWarps * 16;  // Br
constexpr float kLog2e = 1.4426950408889634f;

// ---------------------------------------------------------------------------------
// Element conversions. T is the operand type of the tensor cores (bf16 or f16); In is
// the type in memory (T itself, or f32 rounded to bf16 for Precision::bf16).
template <class T> __device__ __forceinline__ T to_operand(float x);
template <> __device__ __forceinline__ __nv_bfloat16 to_operand<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half to_operand<__half>(float x) { return __float2half_rn(x); }

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

template <class In> __device__ __forceinline__ In from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// An element of memory as an operand: exact for In = T, rounded to nearest even for f32.
template <class T, class In>
__device__ __forceinline__ T load_operand(const In* p) {
  if constexpr (std::is_same_v<T, In>) {
    return *p;
  } else {
    return to_operand<T>(to_float(*p));
  }
}

// Two operands in one 32-bit register, the lower index in the lower half (the
// fragment layout of mma.sync).
template <class T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  const uint16_t a = *reinterpret_cast<const uint16_t*>(&lo);
  const uint16_t b = *reinterpret_cast<const uint16_t*>(&hi);
  return uint32_t{a} | (uint32_t{b} << 16);
}

// D = A·B + D for one 16×8×16 product; A: 4 registers (16×16 row-major), B: 2 (16×8
// column-major), D: 4 f32 (16×8).
template <class T>
__device__ __forceinline__ void mma16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// ---------------------------------------------------------------------------------
// The band of query row i (positions in the sequence): keys lo..hi survive causal,
// window and key length; lo > hi means none. attention()'s rule (cpu/score_mods-inl.h
// BandOfRow), in the whole sequence's positions for a placed call.
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

// Copies rows [r0, r0 + rows) of one head of a [L, H, D] tensor (row stride `row`)
// into shared memory (row stride LD), as operands; rows ≥ valid are zeros.
template <class T, class In, int D, int LD>
__device__ __forceinline__ bool load_rows(T* dst, const In* src, int64_t row, int r0, int rows, int valid,
                                          bool check_finite) {
  bool bad = false;
  for (int e = threadIdx.x; e < rows * D; e += kThreads) {
    const int r = e / D, c = e - r * D;
    T x = to_operand<T>(0.0f);
    if (r0 + r < valid) {
      x = load_operand<T>(src + (r0 + r) * row + c);
      if (check_finite && !isfinite(to_float(x))) bad = true;
    }
    dst[r * LD + c] = x;
  }
  return bad;
}

template <class T, class In, int D, int Bc>
__global__ void __launch_bounds__(kThreads) flash_forward_kernel(ForwardParams p, const SeqDesc* seqs) {
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

  // Q: held as A fragments in registers, or (d = 256, where registers run out) kept
  // in shared memory and read per tile. Staged through the K/V buffer (2·Bc ≥ 64 rows)
  // when it stays in registers.
  constexpr bool kQInSmem = D > 128;
  T* q_s = kQInSmem ? reinterpret_cast<T*>(p_s + kWarps * 16 * Bc) : k_s;
  uint32_t qa[kQInSmem ? 1 : kKt][4];
  load_rows<T, In, D, LD>(q_s, q, p.q_row, q0, kRowsPerBlock, s.Lq, false);
  __syncthreads();
  const T* q_frag = q_s + (warp * 16 + g) * LD + 2 * t;
  auto q_fragment = [&](int kt, uint32_t a[4]) {
    a[0] = *reinterpret_cast<const uint32_t*>(q_frag + kt * 16);
    a[1] = *reinterpret_cast<const uint32_t*>(q_frag + 8 * LD + kt * 16);
    a[2] = *reinterpret_cast<const uint32_t*>(q_frag + kt * 16 + 8);
    a[3] = *reinterpret_cast<const uint32_t*>(q_frag + 8 * LD + kt * 16 + 8);
  };
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
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;

  float slope = 0.0f;
  if (p.alibi != nullptr) slope = p.alibi[b * p.alibi_b + h * p.alibi_h];
  const bool dropout = p.dropout_p > 0.0f;
  const detail::DropoutRng rng(p.dropout_p, p.seed, p.offset, p.heads_total);
  const float keep_scale = 1.0f / (1.0f - p.dropout_p);

  for (int64_t j0 = key_lo <= key_hi ? (key_lo / Bc) * Bc : 1; j0 <= key_hi; j0 += Bc) {
    load_rows<T, In, D, LD>(k_s, k, p.k_row, static_cast<int>(j0), Bc, s.Lk, false);
    const bool v_bad = load_rows<T, In, D, LD>(v_s, v, p.v_row, static_cast<int>(j0), Bc, s.Lk, true);
    const bool slow = __syncthreads_or(v_bad);

    // S = Q·Kᵀ for the warp's 16 rows × Bc keys.
    float sc[kNt][4];
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      sc[nt][0] = sc[nt][1] = sc[nt][2] = sc[nt][3] = 0.0f;
      const T* kr = k_s + (nt * 8 + g) * LD + 2 * t;
#pragma unroll
      for (int kt = 0; kt < kKt; ++kt) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + kt * 16);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + kt * 16 + 8);
        if constexpr (kQInSmem) {
          uint32_t a[4];
          q_fragment(kt, a);
          mma16816<T>(sc[nt], a, b0, b1);
        } else {
          mma16816<T>(sc[nt], qa[kt], b0, b1);
        }
      }
    }

    // Modifiers and masks, attention()'s order: scale, softcap, ALiBi, masks, band.
    float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e < 2 ? row_a : row_b;
        const int64_t j = j0 + nt * 8 + 2 * t + (e & 1);
        const Band& bd = e < 2 ? band_a : band_b;
        float x = sc[nt][e] * p.scale;
        if (p.softcap > 0.0f) x = p.softcap * tanhf(x / p.softcap);
        if (p.alibi != nullptr) {
          x -= slope * fabsf(static_cast<float>(i + p.q_pos0 + s.align - (j + p.k_pos0)));
        }
        if (i < s.Lq && j < s.Lk) {
          const int64_t at = b * p.mask_b + h * p.mask_h + i * p.mask_i + j * p.mask_j;
          if (p.add_mask != nullptr) x += p.add_mask[at];
          if (p.bool_mask != nullptr && p.bool_mask[at] == 0) x = -INFINITY;
        }
        if (j < bd.lo || j > bd.hi) x = -INFINITY;
        sc[nt][e] = x;
        if (e < 2) mx_a = fmaxf(mx_a, x); else mx_b = fmaxf(mx_b, x);
      }
    }
    // Row maxima over the quad that shares a row (fmaxf skips NaN; a NaN score still
    // makes its row NaN through the sum below).
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
    }
    const float mn_a = fmaxf(m_a, mx_a), mn_b = fmaxf(m_b, mx_b);
    // A row that has seen only −∞ so far subtracts 0 (e^(−∞ − 0) = 0, not NaN).
    const float ref_a = mn_a == -INFINITY ? 0.0f : mn_a, ref_b = mn_b == -INFINITY ? 0.0f : mn_b;
    const float alpha_a = exp2f((m_a - ref_a) * kLog2e), alpha_b = exp2f((m_b - ref_b) * kLog2e);
    m_a = mn_a, m_b = mn_b;
    float sum_a = 0.0f, sum_b = 0.0f;
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float pr = exp2f((sc[nt][e] - (e < 2 ? ref_a : ref_b)) * kLog2e);
        if (e < 2) sum_a += pr; else sum_b += pr;
        sc[nt][e] = pr;
      }
    }
    l_a = l_a * alpha_a + sum_a;
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int n = 0; n < kDt; ++n) {
      o[n][0] *= alpha_a, o[n][1] *= alpha_a;
      o[n][2] *= alpha_b, o[n][3] *= alpha_b;
    }
    // Dropout after the sums (lse is that of the scores before dropout).
    if (dropout) {
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
          const int i = rr == 0 ? row_a : row_b;
          const int64_t j = j0 + nt * 8 + 2 * t;  // even: keys j and j + 1
          const int ig = static_cast<int>(i + p.q_pos0);
          const int64_t jg = j + p.k_pos0;
          const int hg = h + p.h0;
          bool keep0, keep1;
          if (jg % 2 == 0) {  // both in one Philox group of 4
            const unsigned bits = rng.keep4(b, hg, ig, static_cast<int>(jg / 4));
            const int at = static_cast<int>(jg % 4);
            keep0 = (bits >> at) & 1u, keep1 = (bits >> (at + 1)) & 1u;
          } else {
            keep0 = rng.keep(b, hg, ig, static_cast<int>(jg));
            keep1 = rng.keep(b, hg, ig, static_cast<int>(jg + 1));
          }
          float& x0 = sc[nt][2 * rr];
          float& x1 = sc[nt][2 * rr + 1];
          x0 = keep0 ? x0 * keep_scale : 0.0f;
          x1 = keep1 ? x1 * keep_scale : 0.0f;
        }
      }
    }

    if (!slow) {
      // O += P·V on the tensor cores; P's score fragments are its A fragments.
#pragma unroll
      for (int kk = 0; kk < Bc / 16; ++kk) {
        uint32_t pa[4];
        pa[0] = pack2(to_operand<T>(sc[2 * kk][0]), to_operand<T>(sc[2 * kk][1]));
        pa[1] = pack2(to_operand<T>(sc[2 * kk][2]), to_operand<T>(sc[2 * kk][3]));
        pa[2] = pack2(to_operand<T>(sc[2 * kk + 1][0]), to_operand<T>(sc[2 * kk + 1][1]));
        pa[3] = pack2(to_operand<T>(sc[2 * kk + 1][2]), to_operand<T>(sc[2 * kk + 1][3]));
        const T* vr = v_s + (kk * 16 + 2 * t) * LD + g;
#pragma unroll
        for (int n = 0; n < kDt; ++n) {
          const uint32_t b0 = pack2(vr[n * 8], vr[LD + n * 8]);
          const uint32_t b1 = pack2(vr[8 * LD + n * 8], vr[9 * LD + n * 8]);
          mma16816<T>(o[n], pa, b0, b1);
        }
      }
    } else {
      // A value in this tile is NaN or ±∞: multiply element by element, skipping the
      // keys whose probability is 0 (removed or dropped), with P rounded as above.
      float* pw = p_s + warp * 16 * Bc;
#pragma unroll
      for (int nt = 0; nt < kNt; ++nt) {
        const int c = nt * 8 + 2 * t;
        pw[g * Bc + c] = to_float(to_operand<T>(sc[nt][0]));
        pw[g * Bc + c + 1] = to_float(to_operand<T>(sc[nt][1]));
        pw[(g + 8) * Bc + c] = to_float(to_operand<T>(sc[nt][2]));
        pw[(g + 8) * Bc + c + 1] = to_float(to_operand<T>(sc[nt][3]));
      }
      __syncwarp();
      // (Unrolled, so that o stays in registers: a dynamic index would put it in
      // local memory for the whole kernel.)
#pragma unroll
      for (int n = 0; n < kDt; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = g + (e < 2 ? 0 : 8), col = n * 8 + 2 * t + (e & 1);
          float acc = 0.0f;
          for (int j = 0; j < Bc; ++j) {
            const float pr = pw[r * Bc + j];
            if (pr != 0.0f) acc += pr * to_float(v_s[j * LD + col]);
          }
          o[n][e] += acc;
        }
      }
      __syncwarp();
    }
    __syncthreads();  // before the next tile overwrites K and V
  }

  // Finalise: the quad's partial sums, then out = O / l and lse = m + ln l.
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
      p.lse[s.lse_offset + int64_t{h} * p.lse_h + int64_t{i} * p.lse_i] = empty ? -INFINITY : m + logf(l);
    }
  }
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
  const dim3 grid((p.max_lq + kRowsPerBlock - 1) / kRowsPerBlock, p.Hq, p.B);
  kernel<<<grid, kThreads, smem, stream>>>(p, seqs);
  return cudaGetLastError();
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
  if (e == cudaSuccess) {
    switch (p.in) {
      case Elem::bf16: e = launch_for_dim<__nv_bfloat16, __nv_bfloat16>(p, seqs, stream); break;
      case Elem::f16: e = launch_for_dim<__half, __half>(p, seqs, stream); break;
      case Elem::f32: e = launch_for_dim<__nv_bfloat16, float>(p, seqs, stream); break;
    }
  }
  const cudaError_t f = cudaFreeAsync(seqs, stream);
  if (e != cudaSuccess) return cuda_error_text("the forward kernel", e);
  if (f != cudaSuccess) return cuda_error_text("cudaFreeAsync", f);
  return "";
}

}  // namespace attn::cuda
