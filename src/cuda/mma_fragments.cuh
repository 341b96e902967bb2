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

/// 2^x by the special-function unit alone (ex2.approx.ftz: relative error ~2⁻²², results
/// below 2⁻¹²⁶ flush to 0, 2^−∞ = 0, NaN stays NaN). exp2f would add a range fix-up
/// of three instructions per call for denormal results, which a probability that small
/// does not need: it is below the f32 rounding of any sum it joins.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/// The shared-memory address of a generic pointer into shared memory (ldmatrix, cp.async).
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

/// ldmatrix.x4: lanes 8m … 8m + 7 give the 16-byte rows of 8×8 matrix m; each lane gets
/// r[m] = row lane / 4, elements 2·(lane % 4) and + 1 of matrix m (with `trans`, of its
/// transpose). One instruction replaces four or eight 32-bit shared loads, and the padded
/// rows (LD = D + 8) put the 8 rows of each matrix in 8 different 16-byte bank groups.
template <bool kTrans>
__device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void* row) {
  if constexpr (kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
  }
}

/// The A fragment of k-step kt (columns 16·kt …) of the 16 rows at `rows` (shared
/// memory, row stride LD, row-major: a tile whose rows are the product's rows): the four
/// 8×8 quarters (rows 0-7 | 8-15) × (columns 0-7 | 8-15) are a0 … a3.
template <class T, int LD>
__device__ __forceinline__ void a_fragment(const T* rows, int kt, uint32_t a[4]) {
  const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
  ldmatrix_x4<false>(a, rows + (r + (m & 1) * 8) * LD + kt * 16 + (m >> 1) * 8);
}

/// The B fragments of X·Yᵀ for n-tile nt (rows 8·nt … of Y, the output's columns) and
/// the two k-steps kt, kt + 1 (columns 16·kt … 16·kt + 31 of Y), Y row-major in shared
/// memory (row stride LD): b[0], b[1] of kt, then b[2], b[3] of kt + 1.
template <class T, int LD>
__device__ __forceinline__ void b_fragments_rows(const T* y, int nt, int kt, uint32_t b[4]) {
  const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
  ldmatrix_x4<false>(b, y + (nt * 8 + r) * LD + kt * 16 + m * 8);
}

/// The B fragments of P·Y for k-step kk (rows 16·kk … of Y, the contraction) and the
/// two n-tiles n, n + 1 (columns 8·n … 8·n + 15 of Y), Y row-major in shared memory:
/// b[0], b[1] of n, then b[2], b[3] of n + 1 (ldmatrix's transpose).
template <class T, int LD>
__device__ __forceinline__ void b_fragments_cols(const T* y, int kk, int n, uint32_t b[4]) {
  const int lane = threadIdx.x % 32, m = lane / 8, r = lane % 8;
  ldmatrix_x4<true>(b, y + (kk * 16 + (m & 1) * 8 + r) * LD + (n + (m >> 1)) * 8);
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
/// stride LD). Each acc[nt] sums its k-steps in order 0, 1, …; X's fragments are loaded
/// once per pair of k-steps, not once per n-tile.
template <class T, int LD, int kNt, int kKt>
__device__ __forceinline__ void product_rows(float (*acc)[4], const T* x, const T* y) {
  static_assert(kKt % 2 == 0, "k-steps come in pairs");
#pragma unroll
  for (int nt = 0; nt < kNt; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
#pragma unroll
  for (int kt = 0; kt < kKt; kt += 2) {
    uint32_t a0[4], a1[4];
    a_fragment<T, LD>(x, kt, a0);
    a_fragment<T, LD>(x, kt + 1, a1);
#pragma unroll
    for (int nt = 0; nt < kNt; ++nt) {
      uint32_t bf[4];
      b_fragments_rows<T, LD>(y, nt, kt, bf);
      mma16816<T>(acc[nt], a0, bf[0], bf[1]);
      mma16816<T>(acc[nt], a1, bf[2], bf[3]);
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
    static_assert(kDt % 2 == 0, "n-tiles come in pairs");
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
      uint32_t af[4];
      a_from_accumulator<T>(a, kk, af);
#pragma unroll
      for (int n = 0; n < kDt; n += 2) {
        uint32_t bf[4];
        b_fragments_cols<T, LD>(y, kk, n, bf);
        mma16816<T>(acc[n], af, bf[0], bf[1]);
        mma16816<T>(acc[n + 1], af, bf[2], bf[3]);
      }
    }
  } else {
    store_rounded<T, K>(a, pw);
    gated_accumulate<T, LD, kDt, K>(acc, pw, y);
  }
}

/// Writes this thread's rows row_a and row_b (those < rows) of a warp's accumulator (16
/// rows × 8·kDt columns, n-tiles in mma.sync's C layout) times `scale` to `out` (row
/// stride `row` elements), rounded to In: a gradient's last step.
template <class In, int kDt>
__device__ __forceinline__ void store_accumulator_rows(const float (*acc)[4], In* out, int64_t row, int row_a,
                                                       int row_b, int rows, float scale) {
  const int t = threadIdx.x % 4;
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {
    const int i = rr == 0 ? row_a : row_b;
    if (i >= rows) continue;
    In* r = out + int64_t{i} * row;
#pragma unroll
    for (int n = 0; n < kDt; ++n) {
      const int col = n * 8 + 2 * t;
      r[col] = from_float<In>(scale * acc[n][2 * rr]);
      r[col + 1] = from_float<In>(scale * acc[n][2 * rr + 1]);
    }
  }
}

/// Whether 8 operands (16 bytes) are all finite: an exponent field of all ones is ±∞ or NaN.
template <class T>
__device__ __forceinline__ bool chunk_finite(uint4 x) {
  constexpr uint32_t e = std::is_same_v<T, __nv_bfloat16> ? 0x7F80u : 0x7C00u;
  const uint32_t w[4] = {x.x, x.y, x.z, x.w};
  bool ok = true;
#pragma unroll
  for (int i = 0; i < 4; ++i) ok = ok && (w[i] & e) != e && ((w[i] >> 16) & e) != e;
  return ok;
}

/// Whether rows of `src` can be read as 16-byte chunks: In is the operand type, the head's
/// first element is 16-byte aligned and the row stride (elements) keeps every row so.
template <class T, class In>
__device__ __forceinline__ bool rows_vectorizable(const In* src, int64_t row) {
  return std::is_same_v<T, In> && reinterpret_cast<uintptr_t>(src) % 16 == 0 && row % 8 == 0;
}

/// 8 operands from memory (rounded to T for f32 inputs; one 16-byte load when `vec`).
template <class T, class In>
__device__ __forceinline__ uint4 load_chunk(const In* src, bool vec) {
  if (vec) return *reinterpret_cast<const uint4*>(src);
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) w[i] = pack2(load_operand<T>(src + 2 * i), load_operand<T>(src + 2 * i + 1));
  return make_uint4(w[0], w[1], w[2], w[3]);
}

/// Copies rows [r0, r0 + rows) of one head of a [L, H, D] tensor (row stride `row`)
/// into shared memory (row stride LD) as operands, by the block's `threads` threads, in
/// 16-byte chunks (chunk c: row c / (D / 8), columns 8·(c % (D / 8)) …, thread c mod
/// threads); rows ≥ valid are zeros. Returns whether this thread saw a NaN or ±∞ (when
/// check_finite).
template <class T, class In, int D, int LD, int kBlockThreads>
__device__ __forceinline__ bool load_rows(T* dst, const In* src, int64_t row, int r0, int rows, int valid,
                                          bool check_finite) {
  static_assert(D % 8 == 0 && LD % 8 == 0, "rows are whole 16-byte chunks");
  constexpr int kChunks = D / 8;
  const bool vec = rows_vectorizable<T>(src, row);
  bool bad = false;
  for (int c = threadIdx.x; c < rows * kChunks; c += kBlockThreads) {
    const int r = c / kChunks, col = (c - r * kChunks) * 8;
    uint4 x = make_uint4(0, 0, 0, 0);
    if (r0 + r < valid) {
      x = load_chunk<T>(src + (r0 + r) * row + col, vec);
      if (check_finite && !chunk_finite<T>(x)) bad = true;
    }
    *reinterpret_cast<uint4*>(dst + r * LD + col) = x;
  }
  return bad;
}

/// One 16-byte cp.async (global → shared, cached in L2 only), completed by a later
/// cp_async_wait.
__device__ __forceinline__ void cp_async_16(void* to, const void* from) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared_address(to)), "l"(from));
}

/// load_rows without waiting, for a tile of kRows rows (a compile-time count, so each
/// thread's kRows·D/8/threads chunks unroll): where the rows are vectorizable (`vec`,
/// block-uniform) each chunk is a cp.async that a later cp_async_wait completes; other
/// rows are loaded and stored at once. Rows ≥ valid are zeroed by plain stores. The same
/// chunks per thread as load_rows.
///
/// A whole tile of vectorizable rows (every call but a sequence's last tile) takes a
/// branch-free path: when a pass of the block covers whole rows (D = 64, 128, 256), the
/// thread's chunks are one row stride apart in memory and LD apart in shared memory, so
/// each costs one pointer increment and one cp.async with an immediate offset, not the
/// 64-bit row arithmetic (~20 instructions) the general path spends per chunk.
template <class T, class In, int D, int LD, int kBlockThreads, int kRows>
__device__ __forceinline__ void start_rows(T* dst, const In* src, int64_t row, int r0, int valid, bool vec) {
  constexpr int kChunks = D / 8;
  static_assert(kRows * kChunks % kBlockThreads == 0, "every thread copies the same number of chunks");
  constexpr int kPerThread = kRows * kChunks / kBlockThreads;
  const bool whole = r0 + kRows <= valid;  // block-uniform: no row past the end
  if constexpr (kBlockThreads % kChunks == 0) {
    if (whole && vec) {
      constexpr int kPassRows = kBlockThreads / kChunks;  // rows one pass of the block copies
      const int r = threadIdx.x / kChunks, col = (threadIdx.x % kChunks) * 8;
      T* to = dst + r * LD + col;
      const In* from = src + int64_t{r0 + r} * row + col;
      const int64_t step = int64_t{kPassRows} * row;
#pragma unroll
      for (int u = 0; u < kPerThread; ++u) {
        cp_async_16(to + u * kPassRows * LD, from);
        from += step;
      }
      return;
    }
  }
#pragma unroll
  for (int u = 0; u < kPerThread; ++u) {
    const int c = threadIdx.x + u * kBlockThreads;
    const int r = c / kChunks, col = (c - r * kChunks) * 8;
    T* to = dst + r * LD + col;
    const In* from = src + (r0 + r) * row + col;
    if (r0 + r >= valid) {
      *reinterpret_cast<uint4*>(to) = make_uint4(0, 0, 0, 0);
    } else if (vec) {
      cp_async_16(to, from);
    } else {
      *reinterpret_cast<uint4*>(to) = load_chunk<T>(from, false);
    }
  }
}

/// Closes the group of cp.async issued since the last commit (an empty group is fine).
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

/// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

}  // namespace attn::cuda
