// The decode kernel's f32 score pass (cpu/attention_decode.cc): S = Q·Kᵀ for a few
// query rows against a few cache rows at a time, each key row widened to f32 once
// for all rows, and the lane transposes that leave the dot products' accumulators.
// Included once per Highway target (hence the toggling include guard).

#if defined(ATTN_CPU_DECODE_SCORES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DECODE_SCORES_INL_H_
#undef ATTN_CPU_DECODE_SCORES_INL_H_
#else
#define ATTN_CPU_DECODE_SCORES_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <type_traits>

#include "cpu/decode_loads-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

#if HWY_TARGET != HWY_SCALAR
#if HWY_ARCH_X86
/// AVX2, 4 vectors x: each 128-bit half of the result holds that half's sums of
/// x[0] … x[3], in two rounds that stay within the halves (unpack, add): 10 operations.
HWY_INLINE VF HalfSums4(DF df, const VF* x) {
  const hn::Repartition<double, DF> dd;
  VF t[2];  // t[i], each half: [a0+a2, b0+b2, a1+a3, b1+b3] of a = x[2i], b = x[2i+1]
  for (int i = 0; i < 2; ++i) {
    t[i] = hn::Add(hn::InterleaveLower(df, x[2 * i], x[2 * i + 1]), hn::InterleaveUpper(df, x[2 * i], x[2 * i + 1]));
  }
  const auto lo = hn::BitCast(dd, t[0]), hi = hn::BitCast(dd, t[1]);
  return hn::Add(hn::BitCast(df, hn::InterleaveLower(dd, lo, hi)), hn::BitCast(df, hn::InterleaveUpper(dd, lo, hi)));
}
#endif

#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
/// AVX-512, 16 vectors x of f32 or int32: lane i of the result is the sum of x[i]'s
/// lanes. ConcatEven/ConcatOdd rounds would take 30 two-source permutes (vpermt2ps),
/// which on Zen 4 share the pipes of the score passes' products: a 4 × 4 bf16 pass
/// took the time of 93 vdpbf16ps where its 64 alone take 64. Here two rounds stay
/// within each 128-bit block (32-bit, then 64-bit interleaves, cheap there), and two
/// rounds of block shuffles (6 in all) end it: 75 (bench/avx512_decode_sums). The
/// same count of shuffles on Intel, where each takes port 5 either way.
template <class D>
HWY_INLINE hn::Vec<D> BlockTransposedSums(D d, hn::Vec<D>* x) {
  using V = hn::Vec<D>;
  const hn::Repartition<uint64_t, D> d64;
  V t[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {  // per block: [a0+a2, b0+b2, a1+a3, b1+b3] of a = x[2i], b = x[2i+1]
    t[i] = hn::Add(hn::InterleaveLower(d, x[2 * i], x[2 * i + 1]), hn::InterleaveUpper(d, x[2 * i], x[2 * i + 1]));
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // per block: the block's sums of x[4i] … x[4i+3]
    const auto lo = hn::BitCast(d64, t[2 * i]), hi = hn::BitCast(d64, t[2 * i + 1]);
    u[i] = hn::Add(hn::BitCast(d, hn::InterleaveLower(d64, lo, hi)), hn::BitCast(d, hn::InterleaveUpper(d64, lo, hi)));
  }
  // Blocks (0, 2) + (1, 3) of each pair, twice: block k of the result holds x[4k] … x[4k+3].
  // (GCC 12's vshuff32x4 intrinsics pass an undefined vector as the unused merge
  // source, which -Wuninitialized reports; Highway's own calls of them are in system
  // headers, where it is silent.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
  auto pair_blocks = [](V a, V b) {
    if constexpr (std::is_same_v<hn::TFromD<D>, float>) {
      return V{_mm512_add_ps(_mm512_shuffle_f32x4(a.raw, b.raw, 0x88), _mm512_shuffle_f32x4(a.raw, b.raw, 0xDD))};
    } else {
      return V{_mm512_add_epi32(_mm512_shuffle_i32x4(a.raw, b.raw, 0x88), _mm512_shuffle_i32x4(a.raw, b.raw, 0xDD))};
    }
  };
  const V sums = pair_blocks(pair_blocks(u[0], u[1]), pair_blocks(u[2], u[3]));
#pragma GCC diagnostic pop
  return sums;
}
#endif

/// Lane i of the result is the sum of the lanes of x[i], for kLanes vectors x:
/// log₂(kLanes) rounds of pairwise sums, each halving the vector count while the
/// partial sums of x[i] stay in lanes [i·w, (i+1)·w) of w = kLanes/count. About
/// 3 operations per sum where SumOfLanes costs 2·log₂(kLanes) for each.
/// The rounds are unrolled at compile time (N a template argument): with the trip
/// counts left to the optimiser GCC kept x, the caller's accumulators, on the stack.
/// D: f32 (DF) or int32 lanes of the same width.
template <int N = kLanes, class D>
HWY_INLINE hn::Vec<D> TransposedSums(D df, hn::Vec<D>* x) {
#if HWY_ARCH_X86 && (HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL)
  if constexpr (N == 16) return BlockTransposedSums(df, x);
#endif
#if HWY_ARCH_X86
  if constexpr (N == 8 && kLanes == 8 && std::is_same_v<hn::TFromD<D>, float>) {
    // AVX2: ConcatEven/ConcatOdd cross the 128-bit halves (a vpermq each, 3 µops on
    // Zen 1): 35 operations for 8 sums. Here two rounds stay within each half, and
    // one exchange of halves ends it: 21 operations.
    const VF u0 = HalfSums4(df, x), u1 = HalfSums4(df, x + 4);
    return hn::Add(hn::ConcatLowerLower(df, u1, u0), hn::ConcatUpperUpper(df, u1, u0));
  }
#endif
  if constexpr (N == 1) {
    return x[0];
  } else {
#pragma GCC unroll 16
    for (int i = 0; i < N / 2; ++i)
      x[i] = hn::Add(hn::ConcatEven(df, x[2 * i + 1], x[2 * i]), hn::ConcatOdd(df, x[2 * i + 1], x[2 * i]));
    return TransposedSums<N / 2>(df, x);
  }
}

#if HWY_ARCH_X86
/// AVX2: lane i of the 4-lane result is the sum of the lanes of x[i], for 4 vectors
/// x: HalfSums4, then the two halves added (11 operations).
HWY_INLINE hn::Vec<hn::Half<DF>> TransposedSums4(DF df, const VF* x) {
  const VF u = HalfSums4(df, x);
  const hn::Half<DF> dh;
  return hn::Add(hn::LowerHalf(dh, u), hn::UpperHalf(dh, u));
}
#endif
#endif

/// s[r·ld + c] = Σ_x q[r][x]·k_c[x] for NR rows (q: rows of dp floats, zero past d)
/// and NK keys. When NR·NK is a vector's lane count the NR·NK dot products leave
/// their accumulators through one TransposedSums, else one SumOfLanes each.
/// kTail: d is not a whole number of vectors. It is a template argument because a
/// conditional last step, or a memcpy call (LoadTailF32) while the accumulators are
/// live, makes GCC keep them on the stack: each pass then stored and reloaded all
/// 16 (perf: a fifth of an i8 score pass at d = 128, which has no tail at all).
template <typename T, int NR, int NK, bool kTail>
HWY_INLINE void DotRows(const float* HWY_RESTRICT q, size_t dp, const T* const* keys, int d, float* HWY_RESTRICT s,
                        size_t ld) {
  const DF df;
  const int full = d / kLanes * kLanes;
  VF tail[NK];
  if constexpr (kTail) {  // before the accumulators are live
    for (int c = 0; c < NK; ++c) tail[c] = LoadTailF32(df, keys[c] + full, d - full);
  }
  VF acc[NR * NK];  // [r][c]
  for (int i = 0; i < NR * NK; ++i) acc[i] = hn::Zero(df);
  auto accumulate = [&](const VF* kv, int x) {
    for (int r = 0; r < NR; ++r) {
      // An f32 cache's key loads are plain loads, and GCC folded each query vector
      // into its NK FMAs as a memory operand: on AVX2 a Zen 1 core then waited on
      // loads (InRegister: f32 decoding 6-9% faster there). Widened bf16/i8 keys
      // need the registers: there it measured 1-3% slower, so they keep the fold —
      // but for Bf16Pairs, whose widening needs none, it is faster again.
      VF qv = hn::Load(df, q + r * dp + x);
      if constexpr (std::is_same_v<T, float> || kPairs<T>) qv = InRegister(qv);
      for (int c = 0; c < NK; ++c) acc[r * NK + c] = hn::MulAdd(qv, kv[c], acc[r * NK + c]);
    }
  };
  if constexpr (kPairs<T>) {  // d is a multiple of 2·kLanes; q in pair order
    for (int x = 0; x < full; x += 2 * kLanes) {
      VF kv[NK];
      for (int c = 0; c < NK; ++c) kv[c] = LoadHalfF32<0>(df, keys[c] + x);
      accumulate(kv, x);
      for (int c = 0; c < NK; ++c) kv[c] = LoadHalfF32<1>(df, keys[c] + x);
      accumulate(kv, x + kLanes);
    }
  } else {
    for (int x = 0; x < full; x += kLanes) {
      VF kv[NK];
      for (int c = 0; c < NK; ++c) kv[c] = LoadF32(df, keys[c] + x);
      accumulate(kv, x);
    }
  }
  if constexpr (kTail) accumulate(tail, full);
#if HWY_TARGET != HWY_SCALAR
  if constexpr (NR * NK == kLanes) {
    HWY_ALIGN float sums[kLanes];
    hn::Store(TransposedSums(df, acc), df, sums);
    for (int r = 0; r < NR; ++r) std::memcpy(s + r * ld, sums + r * NK, NK * sizeof(float));
    return;
  }
#if HWY_ARCH_X86
  if constexpr (kLanes == 8 && NR * NK == 12) {  // AVX2, 4 rows × 3 keys
    HWY_ALIGN float sums[12];
    hn::Store(TransposedSums(df, acc), df, sums);
    hn::Store(TransposedSums4(df, acc + 8), hn::Half<DF>(), sums + 8);
    for (int r = 0; r < NR; ++r) std::memcpy(s + r * ld, sums + r * NK, NK * sizeof(float));
    return;
  }
#endif
#endif
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NK; ++c) s[r * ld + c] = hn::GetLane(hn::SumOfLanes(df, acc[r * NK + c]));
}

template <typename T, int NK, bool kTail>
HWY_INLINE void DotRowGroupsOf(const float* q, size_t dp, int rows, const T* const* keys, int d, float* s, size_t ld) {
  int r = 0;
  for (; r + 4 <= rows; r += 4) DotRows<T, 4, NK, kTail>(q + r * dp, dp, keys, d, s + r * ld, ld);
  switch (rows - r) {
    case 3:
      DotRows<T, 3, NK, kTail>(q + r * dp, dp, keys, d, s + r * ld, ld);
      break;
    case 2:
      DotRows<T, 2, NK, kTail>(q + r * dp, dp, keys, d, s + r * ld, ld);
      break;
    case 1:
      DotRows<T, 1, NK, kTail>(q + r * dp, dp, keys, d, s + r * ld, ld);
      break;
    default: break;
  }
}

template <typename T, int NK>
HWY_INLINE void DotRowGroups(const float* q, size_t dp, int rows, const T* const* keys, int d, float* s, size_t ld) {
  if (d % kLanes == 0) {
    DotRowGroupsOf<T, NK, false>(q, dp, rows, keys, d, s, ld);
  } else {
    DotRowGroupsOf<T, NK, true>(q, dp, rows, keys, d, s, ld);
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // ATTN_CPU_DECODE_SCORES_INL_H_
