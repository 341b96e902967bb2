// The Intel AMX pieces the bf16 kernels share (forward and backward): the tile
// configuration, bf16 rounding and packing into tdpbf16ps's operand layouts, a
// small tile GEMM and its twin on AVX512-BF16's vdpbf16ps (whose B operand has the
// same pair layout, one tile row per zmm, so CPUs without AMX run the same kernels),
// and the fast 2^x for probabilities. Per Highway target, hence
// the toggling include guard; the AMX code exists for the AVX3 target only (every
// AMX CPU has AVX-512), ATTN_AMX_KERNEL says whether this pass has it.
//
// Operand layouts. tdpbf16ps multiplies A (16 rows × 32 bf16) by B (16 rows of 16
// bf16 pairs): C[m][n] += Σ_kk A[m][2kk]·B[kk][n].lo + A[m][2kk+1]·B[kk][n].hi.
// A is plain row-major bf16. B for a logical [K][N] matrix X is "pair-packed":
// tile (k chunk kc of 32, column group g of 16) holds in row kk, column n the pair
// (X[32kc + 2kk][16g + n], X[32kc + 2kk + 1][16g + n]); where the tiles lie is the
// caller's choice, passed to TileGemm as the strides of kc and g.
// GCC 12 flags its own _mm512_undefined_ps idiom (inside _mm512_scalef_ps) here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#if defined(ATTN_CPU_AMX_TILES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_AMX_TILES_INL_H_
#undef ATTN_CPU_AMX_TILES_INL_H_
#else
#define ATTN_CPU_AMX_TILES_INL_H_
#endif

#include <hwy/highway.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu/tile_kernels-inl.h"
#include "problem.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#undef ATTN_AMX_KERNEL
#undef ATTN_AMX
#if HWY_TARGET == HWY_AVX3 && defined(__x86_64__)
#define ATTN_AMX_KERNEL 1
#define ATTN_AMX __attribute__((target("amx-tile,amx-bf16,avx512bf16")))
#else
#define ATTN_AMX_KERNEL 0
#endif

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

/// True when any score modifier or mask other than the band is on.
inline bool HasScoreMods(const Problem& p) {
  return p.softcap > 0.0f || p.alibi != nullptr || p.add_mask != nullptr || p.bool_mask != nullptr ||
         p.bm_blocks != nullptr || p.mods != nullptr;
}

#if ATTN_AMX_KERNEL
using bf16 = uint16_t;

constexpr int kPair = 32;       // the inner dimension of one tdpbf16ps (16 bf16 pairs)
constexpr int kTile = 16 * 32;  // bf16 elements in one 16×64-byte operand tile

/// n f32 values rounded to bf16 (vcvtneps2bf16: nearest even; like tdpbf16ps it
/// reads subnormals as zero, so nothing is lost that the tiles would have used).
inline ATTN_AMX void F32ToBf16(const float* src, int n, bf16* dst) {
  int c = 0;
  for (; c + 16 <= n; c += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + c))));
  }
  if (c < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - c)) - 1);
    _mm256_mask_storeu_epi16(dst + c, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + c))));
  }
}

/// True when any of n bf16 values (n a multiple of 32) is NaN or ±∞ (all
/// exponent bits set).
HWY_INLINE bool AnyNonFiniteBf16(const bf16* x, int n) {
  const hn::ScalableTag<uint16_t> du;
  const auto exp_mask = hn::Set(du, 0x7F80);
  auto bad = hn::Zero(du);
  for (int c = 0; c < n; c += static_cast<int>(hn::Lanes(du))) {
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Eq(hn::And(hn::LoadU(du, x + c), exp_mask), exp_mask)));
  }
  return !hn::AllTrue(du, hn::Eq(bad, hn::Zero(du)));
}


/// Row i of an input tensor (base + at, `width` elements) as dp bf16 values: the
/// row itself when it is already that (bf16, width = dp), else rounded / padded
/// with zeros into `staging`. Rows past the end (real = false) are all zeros.
inline ATTN_AMX const bf16* Bf16Row(const Problem& p, const float* base, int64_t at, int width, int dp, bool real,
                             bf16* staging) {
  if (real && p.dtype == DType::bf16 && width == dp) return reinterpret_cast<const bf16*>(base) + at;
  std::fill(staging, staging + dp, bf16{0});
  if (!real) return staging;
  if (p.dtype == DType::bf16) {
    std::memcpy(staging, reinterpret_cast<const bf16*>(base) + at, sizeof(bf16) * width);
  } else {
    F32ToBf16(base + at, width, staging);
  }
  return staging;
}


/// 16 bf16 values (one __m256bh) widened exactly to f32.
HWY_INLINE ATTN_AMX __m512 Bf16ToF32(__m256bh x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(x)), 16));
}

/// Splits 16 f32 values into hi = bf16(x) (nearest even) and lo = bf16(x − hi). x − hi
/// is exact in f32 (hi lies within a factor of 2 of x), so hi + lo holds x to ~2⁻¹⁷
/// relative, and exactly whenever x has at most 16 significant bits: every f16 value
/// (11 bits, with exponents bf16 reaches).
HWY_INLINE ATTN_AMX void SplitBf16(__m512 x, bf16* hi, bf16* lo) {
  const __m256bh h = _mm512_cvtneps_pbh(x);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), reinterpret_cast<__m256i>(h));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo),
                      reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_sub_ps(x, Bf16ToF32(h)))));
}

/// Row i of an f16 or f32 input tensor (dtype dt; base + at, `width` elements) as two
/// bf16 pieces, staging[0, wp) = hi and staging[wp, 2·wp) = lo (SplitBf16): hi + lo
/// is an f16 value exactly, and an f32 value to 2⁻¹⁸ of its magnitude
/// (Precision::bf16x3). Columns beyond width and rows past the end (real = false) are
/// zero. A NaN or ±∞ input, or an f32 beyond bf16's range, gives a NaN or ±∞ hi.
inline ATTN_AMX const bf16* SplitRow(DType dt, const float* base, int64_t at, int width, int wp, bool real,
                                     bf16* staging) {
  std::fill(staging, staging + 2 * wp, bf16{0});
  if (!real) return staging;
  const uint16_t* src16 = reinterpret_cast<const uint16_t*>(base) + at;
  for (int c = 0; c < width; c += 16) {
    const int n = std::min(16, width - c);
    const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1);
    const __m512 x = dt == DType::f16 ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src16 + c))
                                      : _mm512_maskz_loadu_ps(m, base + at + c);
    alignas(32) bf16 hi[16], lo[16];
    SplitBf16(x, hi, lo);
    std::memcpy(staging + c, hi, sizeof(bf16) * n);
    std::memcpy(staging + wp + c, lo, sizeof(bf16) * n);
  }
  return staging;
}

/// One input row as packed bf16 pieces: `wp` values (Bf16Row) when pieces = 1, or for
/// f16 inputs and f32 ones with Precision::bf16x3 (pieces = 2) 2·wp, the [hi | lo]
/// pieces (SplitRow). staging holds pieces·wp values.
inline ATTN_AMX const bf16* PackedRow(const Problem& p, int pieces, const float* base, int64_t at, int width, int wp,
                                      bool real, bf16* staging) {
  if (pieces == 2) return SplitRow(p.dtype, base, at, width, wp, real, staging);
  return Bf16Row(p, base, at, width, wp, real, staging);
}

/// All eight tiles as 16 rows × 64 bytes (palette 1): 0–3 accumulators, 4–5 the
/// A operands (two row blocks), 6–7 the B operands (two column blocks).
inline ATTN_AMX void ConfigureTiles() {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  for (int t = 0; t < 8; ++t) {
    cfg[16 + 2 * t] = 64;  // bytes per row (little-endian uint16)
    cfg[48 + t] = 16;      // rows
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads only 8 bytes, so the
  // stores above would be dropped as dead (and the tiles left unconfigured: #UD)
  // without this barrier.
  __asm__ volatile("" : : "r"(cfg) : "memory");
  _tile_loadconfig(cfg);
}

inline ATTN_AMX void ReleaseTiles() { _tile_release(); }


/// Two vectors of f32 rounded to nearest even into 32 bf16 at dst.
HWY_INLINE ATTN_AMX void StoreBf16x2(VF lo, VF hi, bf16* dst) {
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi.raw, lo.raw)));
}

/// 2^x for probabilities that will be rounded to bf16 (8 bits), in 6 vector ops:
/// f = x − ⌊x⌋ by vreduceps, a degree-4 polynomial fitted to 2^f on [0, 1), and
/// vscalefps, which multiplies by 2^⌊x⌋ itself. The polynomial's minimax relative
/// error is 3.4e-6 with both ends exact, 2^0 = 1 and 2^1 = 2 (evaluated in f32), so
/// 2^x is continuous where ⌊x⌋ steps: the largest score of a row gives x = a rounding
/// residue of either sign, and a degree-3 fit pinned at 0 only (one op fewer) gave
/// 2^(−tiny) = 1 − 8.6e-5 there, an error that l, the f32 output (the backward's D),
/// lse and a one-key row's P then carried. −∞ gives exactly 0 (vreduceps(−∞) = 0 and
/// 2^−∞ = 0), NaN gives NaN, results below the normal range round into subnormals.
HWY_INLINE ATTN_AMX VF Exp2Probability(VF x) {
  const __m512 f = _mm512_reduce_ps(x.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 e = _mm512_set1_ps(0.0135557475f);
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.0520323701f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.241379768f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(0.693032146f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
  return VF{_mm512_scalef_ps(e, x.raw)};
}

/// One step of a 2×2 block of tdpbf16ps: loads A's two row tiles (a and 16 rows
/// below, row stride lda elements) and B's two column tiles (b0, b1; pair-packed, 64
/// bytes a row), and adds their four products into accumulators 0–3 (ConfigureTiles's
/// layout: 4–5 A, 6–7 B), so each loaded tile feeds two products.
HWY_INLINE ATTN_AMX void TileProducts2x2(const bf16* a, size_t lda, const bf16* b0, const bf16* b1) {
  const size_t a_ld = sizeof(bf16) * lda;
  _tile_loadd(4, a, a_ld);
  _tile_loadd(5, a + 16 * lda, a_ld);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  _tile_dpbf16ps(0, 4, 6);
  _tile_dpbf16ps(1, 4, 7);
  _tile_dpbf16ps(2, 5, 6);
  _tile_dpbf16ps(3, 5, 7);
}

/// How a product's operands are split. terms = 1: A and B are plain bf16. terms = 3:
/// both hold hi + lo bf16 pieces of each value (f16 inputs, SplitBf16), the lo pieces
/// a_lo / b_lo elements after the hi ones, in the same layout; the product is then
/// A_hi·B_hi + A_lo·B_hi + A_hi·B_lo, summed in that order per 32-wide chunk of the
/// inner dimension. The dropped A_lo·B_lo is below 2⁻¹⁸ of each term.
struct Pieces {
  int terms = 1;
  size_t a_lo = 0, b_lo = 0;
  // Offsets of term t's A and B pieces from the hi pieces.
  size_t A(int t) const { return t == 1 ? a_lo : 0; }
  size_t B(int t) const { return t == 2 ? b_lo : 0; }
};

/// C[M][N] (f32, row stride ldc floats) = A·B, or C + A·B when accumulate; M and N
/// multiples of 32, K of 32. A: bf16 rows (row stride lda elements); B: pair-packed,
/// tile (kc, g) at b + kc·b_kc + g·b_g. Blocks of 32×32 outputs (2×2 accumulator
/// tiles, so each loaded operand tile feeds two tdpbf16ps). Tiles as ConfigureTiles.
/// With pieces (pc.terms = 3) each chunk of the inner dimension takes its three piece
/// products in turn: as many tile loads per tdpbf16ps as one piece.
inline ATTN_AMX void TileGemm(const bf16* a, size_t lda, const bf16* b, size_t b_kc, size_t b_g, float* c,
                              size_t ldc, int M, int N, int K, bool accumulate, const Pieces& pc = {}) {
  const size_t c_ld = sizeof(float) * ldc;
  for (int m0 = 0; m0 < M; m0 += 32) {
    for (int n0 = 0; n0 < N; n0 += 32) {
      float* c0 = c + m0 * ldc + n0;
      float* c1 = c0 + 16 * ldc;
      if (accumulate) {
        _tile_loadd(0, c0, c_ld);
        _tile_loadd(1, c0 + 16, c_ld);
        _tile_loadd(2, c1, c_ld);
        _tile_loadd(3, c1 + 16, c_ld);
      } else {
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
      }
      const bf16* a0 = a + m0 * lda;
      const bf16* bg = b + (n0 / 16) * b_g;
      for (int kc = 0; kc < K / kPair; ++kc) {
        for (int t = 0; t < pc.terms; ++t) {
          const bf16* bt = bg + kc * b_kc + pc.B(t);
          TileProducts2x2(a0 + kc * kPair + pc.A(t), lda, bt, bt + b_g);
        }
      }
      _tile_stored(0, c0, c_ld);
      _tile_stored(1, c0 + 16, c_ld);
      _tile_stored(2, c1, c_ld);
      _tile_stored(3, c1 + 16, c_ld);
    }
  }
}

/// R rows × G column groups of 16 of VecGemm: the accumulators stay in registers
/// (R·G of 32 zmm) over the whole inner dimension; per pair of inner indices, G
/// loads of B (one row of a pair-packed tile is 16 pairs, one zmm), R broadcasts of
/// a 32-bit pair of A, R·G vdpbf16ps.
template <int R, int G>
HWY_INLINE ATTN_AMX void VecGemmBlock(const bf16* a, size_t lda, const bf16* b, size_t b_kc, size_t b_g, float* c,
                                      size_t ldc, int K, bool accumulate) {
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16 * g) : _mm512_setzero_ps();
  for (int kc = 0; kc < K / kPair; ++kc) {
    const bf16* bk = b + kc * b_kc;
    const bf16* ak = a + kc * kPair;
    for (int kk = 0; kk < 16; ++kk) {
      __m512i bv[G];
      for (int g = 0; g < G; ++g) bv[g] = _mm512_loadu_si512(bk + g * b_g + kk * 32);
      for (int r = 0; r < R; ++r) {
        uint32_t pair;
        std::memcpy(&pair, ak + r * lda + 2 * kk, sizeof pair);
        const __m512bh av = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], av, reinterpret_cast<__m512bh>(bv[g]));
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) _mm512_storeu_ps(c + r * ldc + 16 * g, acc[r][g]);
}

/// TileGemm's product (same arguments, same operand layouts) on AVX512-BF16's
/// vdpbf16ps instead of the tile unit, for CPUs without AMX (AMD Zen 4/5). Each
/// output is the same sum of the same bf16 products in f32, in pair order (no
/// bit-for-bit promise against TileGemm, whose internal order is the hardware's).
/// Column blocks outside, row blocks inside, so that a block of B (K × 64 columns)
/// stays in L1 while every row block passes over it.
inline ATTN_AMX void VecGemm(const bf16* a, size_t lda, const bf16* b, size_t b_kc, size_t b_g, float* c, size_t ldc,
                             int M, int N, int K, bool accumulate) {
  constexpr int kRows = 4;
  for (int n0 = 0; n0 < N; n0 += 64) {
    const bf16* bn = b + (n0 / 16) * b_g;
    for (int m0 = 0; m0 < M; m0 += kRows) {
      if (n0 + 64 <= N) {
        VecGemmBlock<kRows, 4>(a + m0 * lda, lda, bn, b_kc, b_g, c + m0 * ldc + n0, ldc, K, accumulate);
      } else {  // N is a multiple of 32: the last 32 columns
        VecGemmBlock<kRows, 2>(a + m0 * lda, lda, bn, b_kc, b_g, c + m0 * ldc + n0, ldc, K, accumulate);
      }
    }
  }
}

/// C = A·B (or C + A·B) on the unit `tiles` names: true, the AMX tile unit
/// (TileGemm; tiles configured by ConfigureTiles); false, vdpbf16ps (VecGemm, the
/// piece products one after another).
inline ATTN_AMX void Bf16Gemm(bool tiles, const bf16* a, size_t lda, const bf16* b, size_t b_kc, size_t b_g, float* c,
                              size_t ldc, int M, int N, int K, bool accumulate, const Pieces& pc = {}) {
  if (tiles) {
    TileGemm(a, lda, b, b_kc, b_g, c, ldc, M, N, K, accumulate, pc);
    return;
  }
  for (int t = 0; t < pc.terms; ++t) {
    VecGemm(a + pc.A(t), lda, b + pc.B(t), b_kc, b_g, c, ldc, M, N, K, accumulate || t > 0);
  }
}

/// One row of a pair-packed tile from two bf16 rows: dst[n] = (even[n], odd[n]),
/// n < 16.
HWY_INLINE ATTN_AMX void PairRow(const bf16* even, const bf16* odd, bf16* dst) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd)));
  _mm512_storeu_si512(dst, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
}

/// The same from two f32 rows, rounded to bf16 (nearest even).
HWY_INLINE ATTN_AMX void PairRowF32(const float* even, const float* odd, bf16* dst) {
  // cvtne2ps puts even's 16 values in the low half and odd's in the high half;
  // the permutation interleaves them.
  const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(odd), _mm512_loadu_ps(even)));
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(interleave, both));
}

/// PairRowF32 into hi pieces (hi) and lo pieces (lo): the pairs of bf16(x) and of
/// bf16(x − bf16(x)) (SplitBf16), for operands that enter the tiles as two pieces.
HWY_INLINE ATTN_AMX void PairRowF32Pieces(const float* even, const float* odd, bf16* hi, bf16* lo) {
  const __m512 e = _mm512_loadu_ps(even), o = _mm512_loadu_ps(odd);
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(o, e));
  const __m512 e_lo = _mm512_sub_ps(e, Bf16ToF32(reinterpret_cast<__m256bh>(_mm512_castsi512_si256(h))));
  const __m512 o_lo = _mm512_sub_ps(o, Bf16ToF32(reinterpret_cast<__m256bh>(_mm512_extracti64x4_epi64(h, 1))));
  const __m512i l = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(o_lo, e_lo));
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(hi, _mm512_permutexvar_epi16(interleave, h));
  _mm512_storeu_si512(lo, _mm512_permutexvar_epi16(interleave, l));
}

/// Transposes 16 × 16 32-bit elements in registers: r[n] holds row n on entry and
/// column n on return. 32- and 64-bit interleaves within 128-bit blocks, then two
/// rounds of block shuffles: 64 shuffles, where a scalar gather of the 256 elements
/// took ~4× the instructions.
HWY_INLINE ATTN_AMX void Transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // block j: elements 4j, 4j+1 (lo) and 4j+2, 4j+3 (hi) of rows 2i, 2i+1
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], block j: element 4j + c of rows 4i … 4i+3
    for (int h = 0; h < 2; ++h) {
      u[4 * i + 2 * h] = _mm512_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
      u[4 * i + 2 * h + 1] = _mm512_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
    }
  }
  for (int c = 0; c < 4; ++c) {  // column 4j + c: block j of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i x0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), x1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i x2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), x3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(x0, x2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(x1, x3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
  }
}

/// A pair-packed tile of Xᵀ from 16 bf16 rows of X: row kk, column n holds the pair
/// (rows[n][col0 + 2kk], rows[n][col0 + 2kk + 1]) — a 16×16 transpose of 32-bit
/// pairs, each row's 64 bytes one load. (X = K gives the B operand of S = Q·Kᵀ.)
HWY_INLINE ATTN_AMX void PairTileTransposed(const bf16* const* rows, int col0, bf16* tile) {
  __m512i r[16];
  for (int n = 0; n < 16; ++n) r[n] = _mm512_loadu_si512(rows[n] + col0);
  Transpose16x16(r);
  for (int kk = 0; kk < 16; ++kk) _mm512_storeu_si512(tile + kk * 32, r[kk]);
}

/// 2^x as Exp2Probability, for probabilities that keep 16 bits (f32 inputs as two
/// bf16 pieces, Precision::bf16x3): Exp2NonPositive's AVX-512 form (tile_kernels-inl.h),
/// a degree-6 polynomial fitted to 2^f on [0, 1) for the least maximum relative error,
/// 9.0e-8 (evaluated in f32; 2^0 = 1 exact), under the pieces' own 2⁻¹⁸ = 3.8e-6.
/// 8 vector ops; the same −∞, NaN and subnormal behaviour as Exp2Probability.
HWY_INLINE ATTN_AMX VF Exp2Accurate(VF x) { return Exp2NonPositive(DF(), x); }

#endif  // ATTN_AMX_KERNEL

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
