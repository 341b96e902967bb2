// The decode kernel's bf16 passes on vdpbf16ps (cpu/attention_decode.cc), on AVX-512
// targets: the score pass for bf16 keys and bf16-valued queries (exact products,
// summed in f32), and P·V for bf16 values under Precision::bf16 (P rounded to bf16).
// Elsewhere they are declared only, never called (kBf16DotTarget). Included once
// per Highway target (hence the toggling include guard).

#if defined(ATTN_CPU_DECODE_BF16_PRODUCTS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DECODE_BF16_PRODUCTS_INL_H_
#undef ATTN_CPU_DECODE_BF16_PRODUCTS_INL_H_
#else
#define ATTN_CPU_DECODE_BF16_PRODUCTS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>

#include "cpu/decode_loads-inl.h"
#include "cpu/decode_scores-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
/// Whether this target has the bf16 score pass (DotRowsBf16): AVX-512, where a CPU
/// with AVX512-BF16 runs vdpbf16ps.
constexpr bool kBf16DotTarget = true;
#define ATTN_BF16_DOT __attribute__((target("avx512bf16")))

/// s[r·ld + c] = Σ_x q[r][x]·k_c[x] for NR rows of bf16 queries (qb: rows of dp bf16
/// in their own order, zero past d) and NK bf16 key rows, d a multiple of 32, on
/// vdpbf16ps: 32 products per instruction where the f32 pass widens each key vector
/// and takes 2 FMAs for them. The products of bf16 values are exact in f32 and are
/// summed in f32, in pairs first: the f32 pass's sums in another order. (vdpbf16ps
/// reads subnormal bf16 inputs as zero, terms below 1.2e-38 the f32 pass keeps.)
template <int NR, int NK>
HWY_INLINE ATTN_BF16_DOT void DotRowsBf16(const uint16_t* HWY_RESTRICT qb, size_t dp, const uint16_t* const* keys,
                                          int d, float* HWY_RESTRICT s, size_t ld) {
  VF acc[NR * NK];  // [r][c]
#pragma GCC unroll 16
  for (int i = 0; i < NR * NK; ++i) acc[i] = hn::Zero(DF());
  for (int x = 0; x < d; x += 32) {
    __m512bh kv[NK];
#pragma GCC unroll 16
    for (int c = 0; c < NK; ++c) kv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(keys[c] + x));
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(qb + r * dp + x));
#pragma GCC unroll 16
      for (int c = 0; c < NK; ++c) acc[r * NK + c] = VF{_mm512_dpbf16_ps(acc[r * NK + c].raw, qv, kv[c])};
    }
  }
  if constexpr (NR * NK == kLanes) {
    HWY_ALIGN float sums[kLanes];
    hn::Store(TransposedSums(DF(), acc), DF(), sums);
    for (int r = 0; r < NR; ++r) std::memcpy(s + r * ld, sums + r * NK, NK * sizeof(float));
  } else {
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < NK; ++c) s[r * ld + c] = hn::GetLane(hn::SumOfLanes(DF(), acc[r * NK + c]));
  }
}

/// o[r] += Σ_k p[r][k]·v_k for NR rows and NK (8 or 16) bf16 value rows, dv a
/// multiple of 32, on vdpbf16ps (Precision::bf16 on CPUs where it has the FMA's
/// rate): each p rounded to bf16 (to nearest even; FlashAttention's plain bf16
/// pipeline rounds P so too), two keys per instruction, 32 products where the f32
/// pass widens two value vectors and takes 2 FMAs per row for 16 products each. The
/// products are exact and summed in f32, key pairs first. O stays in the f32 pass's
/// pair order (Bf16Pairs: a 32-column run's even columns, then its odd ones), so the
/// passes this one cannot take (removed keys, a block's short last pass) add into the
/// same O: values a (key 2j) and b (key 2j + 1) are interleaved as
/// (a[2i], b[2i]) for the evens and (a[2i+1], b[2i+1]) for the odds, a shift and a
/// word blend each. vdpbf16ps reads subnormal bf16 values (below 1.2e-38) as zero.
template <int NK, int NR>
HWY_INLINE ATTN_BF16_DOT void PvRowsBf16(const float* HWY_RESTRICT p, size_t ld, const uint16_t* const* vals, int dv,
                                         float* HWY_RESTRICT o, size_t o_ld, int64_t ahead_bytes) {
  static_assert(NK == 8 || NK == 16, "whole key pairs, one vector of p per row");
  HWY_ALIGN uint32_t pairs[NR][NK / 2];  // row r's p of keys 2j and 2j + 1 as one bf16 pair
  for (int r = 0; r < NR; ++r) {
    if constexpr (NK == 16) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(pairs[r]),
                         reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(p + r * ld))));
    } else {
      _mm_store_si128(reinterpret_cast<__m128i*>(pairs[r]),
                      reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(_mm256_loadu_ps(p + r * ld))));
    }
  }
  constexpr __mmask32 kOddWords = 0xAAAAAAAAu;
  for (int x = 0; x < dv; x += 32) {
    __m512 even[NR], odd[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      even[r] = _mm512_loadu_ps(o + r * o_ld + x);
      odd[r] = _mm512_loadu_ps(o + r * o_ld + x + 16);
    }
#pragma GCC unroll 8
    for (int j = 0; j < NK / 2; ++j) {
      const uint16_t* a_row = vals[2 * j] + x;
      const uint16_t* b_row = vals[2 * j + 1] + x;
      if (ahead_bytes > 0) {
        PrefetchLineL2(reinterpret_cast<const char*>(a_row) + ahead_bytes);
        PrefetchLineL2(reinterpret_cast<const char*>(b_row) + ahead_bytes);
      }
      const __m512i a = _mm512_loadu_si512(a_row), b = _mm512_loadu_si512(b_row);
      const __m512bh evens = reinterpret_cast<__m512bh>(_mm512_mask_blend_epi16(kOddWords, a, _mm512_slli_epi32(b, 16)));
      const __m512bh odds = reinterpret_cast<__m512bh>(_mm512_mask_blend_epi16(kOddWords, _mm512_srli_epi32(a, 16), b));
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) {
        const __m512bh pp = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pairs[r][j])));
        even[r] = _mm512_dpbf16_ps(even[r], evens, pp);
        odd[r] = _mm512_dpbf16_ps(odd[r], odds, pp);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      _mm512_storeu_ps(o + r * o_ld + x, even[r]);
      _mm512_storeu_ps(o + r * o_ld + x + 16, odd[r]);
    }
  }
}

/// PvRowsBf16 for every row, 4 at a time. Not always_inline: its target
/// (avx512bf16) is more than its callers'.
template <int NK>
inline ATTN_BF16_DOT void PvRowGroupsBf16(const float* p, size_t ld, int rows, const uint16_t* const* vals, int dv,
                                          float* o, size_t o_ld, int64_t ahead_bytes) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) PvRowsBf16<NK, 4>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes);
  switch (rows - r) {
    case 3: PvRowsBf16<NK, 3>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes); break;
    case 2: PvRowsBf16<NK, 2>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes); break;
    case 1: PvRowsBf16<NK, 1>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes); break;
    default: break;
  }
}

/// DotRowGroups for bf16 queries and keys (DotRowsBf16), 4 rows at a time, or one
/// where NK is a vector's lane count (the one-row pass). Not always_inline: its
/// target (avx512bf16) is more than its callers'.
template <int NK>
inline ATTN_BF16_DOT void DotRowGroupsBf16(const uint16_t* qb, size_t dp, int rows, const uint16_t* const* keys,
                                           int d, float* s, size_t ld) {
  if constexpr (NK > 4) {
    for (int r = 0; r < rows; ++r) DotRowsBf16<1, NK>(qb + r * dp, dp, keys, d, s + r * ld, ld);
  } else {
    int r = 0;
    for (; r + 4 <= rows; r += 4) DotRowsBf16<4, NK>(qb + r * dp, dp, keys, d, s + r * ld, ld);
    switch (rows - r) {
      case 3: DotRowsBf16<3, NK>(qb + r * dp, dp, keys, d, s + r * ld, ld); break;
      case 2: DotRowsBf16<2, NK>(qb + r * dp, dp, keys, d, s + r * ld, ld); break;
      case 1: DotRowsBf16<1, NK>(qb + r * dp, dp, keys, d, s + r * ld, ld); break;
      default: break;
    }
  }
}
#else
constexpr bool kBf16DotTarget = false;
// Never called (kBf16DotTarget): declared so that the callers' discarded branches compile.
template <int NR, int NK>
void DotRowsBf16(const uint16_t*, size_t, const uint16_t* const*, int, float*, size_t) {}
template <int NK>
void DotRowGroupsBf16(const uint16_t*, size_t, int, const uint16_t* const*, int, float*, size_t) {}
template <int NK>
void PvRowGroupsBf16(const float*, size_t, int, const uint16_t* const*, int, float*, size_t, int64_t) {}
#endif

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // ATTN_CPU_DECODE_BF16_PRODUCTS_INL_H_
