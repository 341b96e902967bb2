// Element conversions and the mma.sync.m16n8k16 building blocks shared by the CUDA
// kernels (forward and backward).
//
// T is the operand type of the tensor cores (__nv_bfloat16 or __half); In is the type
// in memory: T itself, or f32 rounded to bf16 for Precision::bf16.
//
// Fragment layouts of m16n8k16 (PTX ISA, "Matrix Fragments for mma.m16n8k16"). Let
// g = lane / 4 and t = lane % 4.
//   A (16×16, row-major), 4 registers of two elements:
//     a0 = (g,     2t..2t+1)    a1 = (g + 8, 2t..2t+1)
//     a2 = (g,     2t+8..+9)    a3 = (g + 8, 2t+8..+9)
//   B (16×8, "col"), 2 registers: b0 = rows 2t..2t+1 of column g, b1 = rows 2t+8..+9.
//   C/D (16×8, f32): d0, d1 = (g, 2t..2t+1); d2, d3 = (g + 8, 2t..2t+1).
// Two adjacent n-tiles of an accumulator, as 16×16, have exactly the A layout, so a
// product's result is the next product's A operand without leaving the registers.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace attn::cuda {

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

/// An element of memory as an operand: exact for In = T, rounded to nearest even for f32.
template <class T, class In>
__device__ __forceinline__ T load_operand(const In* p) {
  if constexpr (std::is_same_v<T, In>) {
    return *p;
  } else {
    return to_operand<T>(to_float(*p));
  }
}

/// Two operands in one 32-bit register, the lower index in the lower half.
template <class T>
__device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  const uint16_t a = *reinterpret_cast<const uint16_t*>(&lo);
  const uint16_t b = *reinterpret_cast<const uint16_t*>(&hi);
  return uint32_t{a} | (uint32_t{b} << 16);
}

/// Two f32 values rounded to operands, packed (an accumulator pair as an A register).
template <class T>
__device__ __forceinline__ uint32_t pack2_rounded(float lo, float hi) {
  return pack2(to_operand<T>(lo), to_operand<T>(hi));
}

/// D = A·B + D for one 16×8×16 product; A: 4 registers, B: 2, D: 4 f32 (layouts above).
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

/// The A fragment of k-step kt (columns 16·kt …) of the 16 rows at `rows` (shared
/// memory, row stride LD, row-major: a tile whose rows are the product's rows).
template <class T, int LD>
__device__ __forceinline__ void a_fragment(const T* rows, int kt, uint32_t a[4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* r = rows + g * LD + 2 * t + kt * 16;
  a[0] = *reinterpret_cast<const uint32_t*>(r);
  a[1] = *reinterpret_cast<const uint32_t*>(r + 8 * LD);
  a[2] = *reinterpret_cast<const uint32_t*>(r + 8);
  a[3] = *reinterpret_cast<const uint32_t*>(r + 8 * LD + 8);
}

/// The B fragment of X·Yᵀ: n-tile nt (rows 8·nt … of Y, the output's columns) and
/// k-step kt (columns 16·kt … of Y), Y row-major in shared memory (row stride LD).
template <class T, int LD>
__device__ __forceinline__ void b_fragment_rows(const T* y, int nt, int kt, uint32_t& b0, uint32_t& b1) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* r = y + (nt * 8 + g) * LD + 2 * t + kt * 16;
  b0 = *reinterpret_cast<const uint32_t*>(r);
  b1 = *reinterpret_cast<const uint32_t*>(r + 8);
}

/// The B fragment of P·Y: k-step kk (rows 16·kk … of Y, the contraction) and n-tile n
/// (columns 8·n … of Y, the output's columns), Y row-major in shared memory.
template <class T, int LD>
__device__ __forceinline__ void b_fragment_cols(const T* y, int kk, int n, uint32_t& b0, uint32_t& b1) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const T* r = y + (kk * 16 + 2 * t) * LD + g + n * 8;
  b0 = pack2(r[0], r[LD]);
  b1 = pack2(r[8 * LD], r[9 * LD]);
}

/// The A fragment of k-step kk from an accumulator of 16 rows × (≥ 16·(kk+1)) columns
/// held as n-tiles acc[nt][4]: its n-tiles 2kk and 2kk+1, rounded to operands.
template <class T>
__device__ __forceinline__ void a_from_accumulator(const float (*acc)[4], int kk, uint32_t a[4]) {
  a[0] = pack2_rounded<T>(acc[2 * kk][0], acc[2 * kk][1]);
  a[1] = pack2_rounded<T>(acc[2 * kk][2], acc[2 * kk][3]);
  a[2] = pack2_rounded<T>(acc[2 * kk + 1][0], acc[2 * kk + 1][1]);
  a[3] = pack2_rounded<T>(acc[2 * kk + 1][2], acc[2 * kk + 1][3]);
}

/// Writes a warp's accumulator of 16 rows × K columns (n-tiles acc[K / 8][4]) to
/// `pw` ([16][K] f32, shared memory), each value rounded to an operand as the tensor
/// cores would take it: the input of gated_accumulate.
template <class T, int K>
__device__ __forceinline__ void store_rounded(const float (*acc)[4], float* pw) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt) {
    const int c = nt * 8 + 2 * t;
    pw[g * K + c] = to_float(to_operand<T>(acc[nt][0]));
    pw[g * K + c + 1] = to_float(to_operand<T>(acc[nt][1]));
    pw[(g + 8) * K + c] = to_float(to_operand<T>(acc[nt][2]));
    pw[(g + 8) * K + c + 1] = to_float(to_operand<T>(acc[nt][3]));
  }
  __syncwarp();
}

/// acc (16 rows × 8·kDt columns, n-tiles) += Pw·Y element by element, skipping the
/// zeros of Pw ([16][K] from store_rounded; Y: [K][LD] operands in shared memory). The
/// tensor cores would give 0·∞ = NaN where a factor that takes no part (a removed key,
/// a dropped probability) meets a NaN or ±∞ in Y; the float64 reference never forms
/// that product.
template <class T, int LD, int kDt, int K>
__device__ __forceinline__ void gated_accumulate(float (*acc)[4], const float* pw, const T* y) {
  const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  // One pass over Pw's rows g and g + 8 per n-tile, for this lane's four outputs. (The
  // n-tiles are unrolled so that acc stays in registers: a dynamic index would put it
  // in local memory for the whole kernel; the key loop is not, which keeps this rare
  // path's code small.)
#pragma unroll
  for (int n = 0; n < kDt; ++n) {
    const int col = n * 8 + 2 * t;
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma unroll 1
    for (int j = 0; j < K; ++j) {
      const float pa = pw[g * K + j], pb = pw[(g + 8) * K + j];
      if (pa == 0.0f && pb == 0.0f) continue;
      const float y0 = to_float(y[j * LD + col]), y1 = to_float(y[j * LD + col + 1]);
      if (pa != 0.0f) s0 += pa * y0, s1 += pa * y1;
      if (pb != 0.0f) s2 += pb * y0, s3 += pb * y1;
    }
    acc[n][0] += s0, acc[n][1] += s1, acc[n][2] += s2, acc[n][3] += s3;
  }
  __syncwarp();
}

/// acc (16 rows × 8·kNt columns, n-tiles) = X·Yᵀ, contracting 16·kKt columns: X is this
/// warp's 16 rows and Y has 8·kNt rows, both row-major operands in shared memory (row
/// stride LD).
template <class T, int LD, int kNt, int kKt>
__device__ __forceinline__ void product_rows(float (*acc)[4], const T* x, const T* y) {
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) {
    acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
    for (int kt = 0; kt < kKt; ++kt) {
      uint32_t a[4], b0, b1;
      a_fragment<T, LD>(x, kt, a);
      b_fragment_rows<T, LD>(y, nt, kt, b0, b1);
      mma16816<T>(acc[nt], a, b0, b1);
    }
  }
}

/// acc (16 rows × 8·kDt columns) += A·Y: A is a warp's accumulator of 16 rows × K columns
/// (n-tiles a[K / 8][4]), rounded to operands on the way, and Y [K][LD] operands in
/// shared memory. On the tensor cores, or, when `gated` (Y holds a NaN or ±∞), element
/// by element skipping A's zeros through pw (this warp's [16][K] f32 scratch).
template <class T, int LD, int kDt, int K>
__device__ __forceinline__ void accumulate_product(float (*acc)[4], const float (*a)[4], const T* y, bool gated,
                                                   float* pw) {
  if (!gated) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t af[4];
      a_from_accumulator<T>(a, kk, af);
#pragma unroll
      for (int n = 0; n < kDt; ++n) {
        uint32_t b0, b1;
        b_fragment_cols<T, LD>(y, kk, n, b0, b1);
        mma16816<T>(acc[n], af, b0, b1);
      }
    }
  } else {
    store_rounded<T, K>(a, pw);
    gated_accumulate<T, LD, kDt, K>(acc, pw, y);
  }
}

/// Copies rows [r0, r0 + rows) of one head of a [L, H, D] tensor (row stride `row`)
/// into shared memory (row stride LD) as operands, by the block's `threads` threads;
/// rows ≥ valid are zeros. Returns whether this thread saw a NaN or ±∞ (when
/// check_finite).
template <class T, class In, int D, int LD, int kBlockThreads>
__device__ __forceinline__ bool load_rows(T* dst, const In* src, int64_t row, int r0, int rows, int valid,
                                          bool check_finite) {
  bool bad = false;
  for (int e = threadIdx.x; e < rows * D; e += kBlockThreads) {
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

}  // namespace attn::cuda
