// The decode kernel's reads of the cache (cpu/attention_decode.cc): its element types
// (f32, bf16 read in pairs, f16, i8, f8e4m3 with and without its NaN code), their
// widening to f32 vectors, and the software requests that bring rows into L2 ahead
// of the passes. Included once per Highway target (hence the toggling include guard).

#if defined(ATTN_CPU_DECODE_LOADS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DECODE_LOADS_INL_H_
#undef ATTN_CPU_DECODE_LOADS_INL_H_
#else
#define ATTN_CPU_DECODE_LOADS_INL_H_
#endif

#include <hwy/highway.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/storage_rows-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

/// An f8e4m3 cache element (OCP E4M3, tensor/convert.hpp): a distinct type for the
/// templates below, which read it as LoadF32 says. E4m3Nan is the same code read
/// with a check for the NaN code (S.1111.111), which adds 3 operations to the
/// widening's 4 per 16 codes (10–16% of a decoding step), so the kernel uses it only
/// for the passes of keys whose rows hold a NaN code (AnyE4m3Nan, a max per 64 codes).
struct E4m3 {
  uint8_t bits;
};
struct E4m3Nan {
  uint8_t bits;
};
template <typename T>
constexpr bool kIsE4m3 = std::is_same_v<T, E4m3> || std::is_same_v<T, E4m3Nan>;

/// A bf16 cache element read two at a time (LoadHalfF32): one 32-bit lane holds
/// elements 2i and 2i + 1, and a shift by 16 or a mask by 0xFFFF0000 makes each an
/// f32. So 2·kLanes elements widen in 2 operations, where PromoteTo takes 2 per
/// kLanes (a zero-extension and a shift: on Zen 1 the shift's one pipe was the
/// bottleneck of P·V). The kernel's columns are then in pair order within each run of
/// 2·kLanes: the even elements, then the odd ones (q is arranged so once per call, and O is put
/// back in order when the splits are combined). Used when d and dv are multiples of 2·kLanes.
struct Bf16Pairs {
  uint16_t bits;
};
template <typename T>
constexpr bool kPairs = std::is_same_v<T, Bf16Pairs>;

/// Cache elements that come with a per-token-per-head scale.
template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || kIsE4m3<T>;
/// What LoadF32's values are to be multiplied by, besides the scale (see LoadF32).
template <typename T>
constexpr float kLoadUnit = kIsE4m3<T> ? 256.0f : 1.0f;

/// True when one of the n E4M3 codes at p is the NaN code.
HWY_INLINE bool AnyE4m3Nan(const uint8_t* HWY_RESTRICT p, int64_t n) {
  const hn::ScalableTag<uint8_t> d8;
  const int64_t lanes = static_cast<int64_t>(hn::Lanes(d8));
  // The largest magnitude seen: the NaN code's, 0x7F, is the largest there is.
  const auto magnitude = hn::Set(d8, 0x7F);
  auto top = hn::Zero(d8);
  int64_t i = 0;
  for (; i + lanes <= n; i += lanes) top = hn::Max(top, hn::And(hn::LoadU(d8, p + i), magnitude));
  bool any = i > 0 && !hn::AllFalse(d8, hn::Eq(top, magnitude));
  for (; i < n; ++i) any |= (p[i] & 0x7F) == 0x7F;
  return any;
}

/// Calls f with a null pointer of the type the cache's elements are to be read as:
/// T, or for an E4M3 cache E4m3Nan when `nan_codes` (see E4m3Nan).
template <typename T, typename F>
HWY_INLINE void ReadAs(bool nan_codes, F&& f) {
  if constexpr (std::is_same_v<T, E4m3>) {
    if (nan_codes) return f(static_cast<const E4m3Nan*>(nullptr));
  }
  f(static_cast<const T*>(nullptr));
}

/// kLanes cache elements at p, as f32 — for E4M3, as the value · 2⁻⁸ (the kernel
/// folds 2⁸ into each key's and value's scale): E4M3's bits, shifted into f16's
/// layout, are an f16 of exactly that value, subnormals included, so the widening is
/// a shift, a mask and vcvtph2ps rather than a table. E4m3Nan turns the NaN code
/// into NaN; E4m3 would read it as 480 (the kernel only uses it on rows without).
template <typename T>
HWY_INLINE VF LoadF32(DF df, const T* HWY_RESTRICT p) {
  if constexpr (std::is_same_v<T, float>) {
    return hn::LoadU(df, p);
  } else if constexpr (kIsE4m3<T>) {
    const hn::Rebind<int8_t, DF> d8;
    const hn::Rebind<uint16_t, DF> d16;
    const hn::Rebind<int16_t, DF> di16;
    const hn::Rebind<hwy::float16_t, DF> dh;
    // s eeee mmm → s 0 eeee mmm 0000000: sign-extended to 16 bits and shifted left by
    // 7, bit 14 (a copy of the sign) cleared.
    const auto wide = hn::BitCast(d16, hn::PromoteTo(di16, hn::LoadU(d8, reinterpret_cast<const int8_t*>(p))));
    auto h = hn::And(hn::ShiftLeft<7>(wide), hn::Set(d16, 0xBFFF));
    if constexpr (std::is_same_v<T, E4m3Nan>) {
      const auto nan_bits = hn::Set(d16, 0x3F80);  // eeee mmm all ones: E4M3's NaN
      h = hn::IfThenElse(hn::Eq(hn::And(h, nan_bits), nan_bits), hn::Set(d16, 0x7E00), h);
    }
    return hn::PromoteTo(df, hn::BitCast(dh, h));
  } else if constexpr (kPairs<T>) {
    return LoadF32(df, reinterpret_cast<const hwy::bfloat16_t*>(p));
  } else if constexpr (std::is_same_v<T, int8_t>) {
    const hn::Rebind<int32_t, DF> di;
    const hn::Rebind<int8_t, DF> d8;
    return hn::ConvertTo(df, hn::PromoteTo(di, hn::LoadU(d8, p)));
  } else if constexpr (std::is_same_v<T, hwy::float16_t>) {
    return LoadF16AsF32(df, reinterpret_cast<const uint16_t*>(p));  // exact for ±∞ and NaN on every target
  } else {
    const hn::Rebind<T, DF> dh;
    return hn::PromoteTo(df, hn::LoadU(dh, p));
  }
}

/// Half kHalf (0 or 1) of the 2·kLanes cache elements at p as f32, in the kernel's
/// column order: for Bf16Pairs the even (0) or odd (1) elements, else elements
/// kHalf·kLanes … kHalf·kLanes + kLanes − 1.
template <int kHalf, typename T>
HWY_INLINE VF LoadHalfF32(DF df, const T* HWY_RESTRICT p) {
  if constexpr (kPairs<T>) {
    const hn::Repartition<uint32_t, DF> du;
    const auto both = hn::LoadU(du, reinterpret_cast<const uint32_t*>(p));
    if constexpr (kHalf == 0) return hn::BitCast(df, hn::ShiftLeft<16>(both));
    return hn::BitCast(df, hn::And(both, hn::Set(du, 0xFFFF0000u)));
  } else {
    return LoadF32(df, p + kHalf * kLanes);
  }
}

/// The n < kLanes cache elements at p as f32, zeros after them (no read past p + n).
template <typename T>
HWY_INLINE VF LoadTailF32(DF df, const T* HWY_RESTRICT p, int n) {
  T buf[kLanes];
  std::memset(static_cast<void*>(buf), 0, sizeof(buf));
  std::memcpy(static_cast<void*>(buf), p, sizeof(T) * n);
  return LoadF32(df, buf);
}

/// The kLanes cache elements of the kernel's columns x … x + kLanes − 1 (x a multiple
/// of kLanes) as f32, in its column order (see Bf16Pairs); width < kLanes: a row's
/// last columns, zeros after them (never for Bf16Pairs, whose rows are whole pairs).
template <typename T>
HWY_INLINE VF LoadColumnsF32(DF df, const T* HWY_RESTRICT p, int x, int width) {
  if constexpr (kPairs<T>) {
    const int pair = x % (2 * kLanes);
    return pair == 0 ? LoadHalfF32<0>(df, p + x) : LoadHalfF32<1>(df, p + x - pair);
  } else {
    return width == kLanes ? LoadF32(df, p + x) : LoadTailF32(df, p + x, width);
  }
}

/// One cache line at p into L2. On x86 an asm statement: GCC 12 at -O3 emitted no
/// prefetch at all for __builtin_prefetch calls in the interleaved loops below
/// (objdump showed none), silently.
HWY_INLINE void PrefetchLineL2(const char* p) {
#if HWY_ARCH_X86
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

/// Asks for the n elements at p in L2 (prefetcht1), one request per cache line.
template <typename T>
HWY_INLINE void PrefetchRow(const T* p, int n) {
  const char* bytes = reinterpret_cast<const char*>(p);
  const int len = n * static_cast<int>(sizeof(T));
  for (int at = 0; at < len; at += 64) PrefetchLineL2(bytes + at);
  PrefetchLineL2(bytes + len - 1);  // a row that straddles one more line
}

/// How far ahead of its reads a P·V pass asks for each value row's lines, in bytes
/// (0: not at all), in its loop over chunks of 2 vectors. The pass reads its 16 (or 8)
/// rows a chunk at a time, the same line of every row, then the next line of every row;
/// the hardware prefetchers do not keep up with that many interleaved rows. Zen 1
/// (AVX2), B = 1, d = 128, one request per key and chunk: 512 bytes ahead took
/// 0.86–0.93x the time for f32 caches of 16–64 MiB, 0.89–0.96x for bf16 and
/// 0.93–0.96x for i8, and 0.95–1.01x for caches in L2 or L3; 256, 384 and 768 bytes
/// gained less, prefetcht0 no more, and asking only once per line (bf16 and i8
/// chunks are half and a quarter of one) was slower. Past a head's slice the lines are
/// those of the next heads of the same token, which the pass reads next. The wider
/// chunks of one- and two-row passes (8 keys, 2–4 lines of a row each) gained
/// nothing (Hq = Hkv = 32: 0.94–1.05x), so they go without. Zen 4 (AVX3), B = 1 and
/// 8, 8k and 32k keys, pages of 16 and 256: bf16 0.85–0.96x the time, i8 within the
/// noise. An f32 chunk there is two lines, and until 2026-11-29 only its first was
/// asked for (the rule was written for AVX2's one-line chunks; the f32 figures then
/// looked like the read bandwidth because that benchmark was add-bound): every line
/// of it, 0.91–0.94x the time on 1 thread. Intel's AVX-512 cores: unmeasured, so off
/// there (AskValuesAhead).
constexpr int kPvAheadBytes = HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL ? 512 : 0;
/// Where a head's values lie in a run of their own (PvAheadBytes), P·V asks for the
/// lines this many tokens further along the run instead, on the targets that ask at all.
constexpr int kHeadRunAheadTokens = 16;

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // ATTN_CPU_DECODE_LOADS_INL_H_
