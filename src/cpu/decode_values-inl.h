// The decode kernel's P·V passes in f32 (cpu/attention_decode.cc): O += P·V over a
// block's keys, 16 (or 8) keys per pass, each value row widened to f32 once per chunk
// of columns; removed keys (score −∞) are skipped by their bits (RemovedKeys), so a
// NaN or ±∞ the cache holds there never reaches O. bf16 values under Precision::bf16
// take decode_bf16_products-inl.h's pass. Included once per Highway target (hence
// the toggling include guard).

#if defined(ATTN_CPU_DECODE_VALUES_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DECODE_VALUES_INL_H_
#undef ATTN_CPU_DECODE_VALUES_INL_H_
#else
#define ATTN_CPU_DECODE_VALUES_INL_H_
#endif

#include <hwy/highway.h>

#include <cmath>
#include <cstddef>
#include <cstdint>

#include "cpu/decode_bf16_products-inl.h"
#include "cpu/decode_loads-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

static_assert(kBk <= 64, "a row's removed keys are the bits of one uint64_t");

/// Bit c set when score c of a row of kBk scores is −∞ (a removed key; a NaN is
/// not). Kept beside the row, since the softmax overwrites the scores with p, and
/// p = 0 does not tell a removed key from a seen one whose p underflowed.
HWY_INLINE uint64_t RemovedKeys(const float* HWY_RESTRICT s) {
  const DF df;
  uint64_t bits = 0;
  for (int n = 0; n < kKeyVectors; ++n) {
    uint8_t bytes[8] = {};
    hn::StoreMaskBits(df, hn::Eq(hn::Load(df, s + n * kLanes), hn::Set(df, -HUGE_VALF)), bytes);
    uint64_t v;
    std::memcpy(&v, bytes, sizeof v);
    bits |= v << (n * kLanes);
  }
  return bits;
}

/// The lanes of the vector of keys c … c + kLanes − 1 whose bit in `removed` is clear.
HWY_INLINE hn::Mask<DF> SeenLanes(uint64_t removed, int c) {
  const uint64_t seen = ~removed >> c;
  uint8_t bytes[8];
  std::memcpy(bytes, &seen, sizeof seen);
  return hn::LoadMaskBits(DF(), bytes);
}

/// o[r] += Σ_k p[r][k]·v_k for NK consecutive keys and NR rows, no removed key among them:
/// each value chunk converted once and used by every row. Every row's accumulators
/// stay in registers across the NK keys (NR × 2 vectors), so the FMA units see 2·NR
/// independent chains: with one row's chains at a time (the old loop) they waited on
/// the FMA latency (Zen 1: 46% of the FMA peak in this loop, and the 16 converted
/// value vectors spilled). Each sum still adds the keys in order: bitwise the
/// one-key-at-a-time result.
template <typename T, int NK, int NR>
HWY_INLINE void PvRowsDense(const float* HWY_RESTRICT p, size_t ld, const T* const* vals, int dv,
                            float* HWY_RESTRICT o, size_t o_ld, int64_t ahead_bytes) {
  const DF df;
  int x = 0;
  // One or two rows (multi-head decoding, few queries): more vectors of each row, so
  // there are still 8 independent chains (2 rows × 4 or 1 × 8 vectors).
  constexpr int kWide = NR == 1 ? 8 : NR == 2 ? 4 : 0;
  if constexpr (kWide > 0) {
    for (; x + kWide * kLanes <= dv; x += kWide * kLanes) {
      VF acc[NR][kWide];
      for (int r = 0; r < NR; ++r) {
        for (int j = 0; j < kWide; ++j) acc[r][j] = hn::Load(df, o + r * o_ld + x + j * kLanes);
      }
      for (int k = 0; k < NK; ++k) {
        VF v[kWide];
        for (int j = 0; j < kWide; j += 2) {
          v[j] = LoadHalfF32<0>(df, vals[k] + x + j * kLanes);
          v[j + 1] = LoadHalfF32<1>(df, vals[k] + x + j * kLanes);
        }
        for (int r = 0; r < NR; ++r) {
          const VF pk = hn::Set(df, p[r * ld + k]);
          for (int j = 0; j < kWide; ++j) acc[r][j] = hn::MulAdd(pk, v[j], acc[r][j]);
        }
      }
      for (int r = 0; r < NR; ++r) {
        for (int j = 0; j < kWide; ++j) hn::Store(acc[r][j], df, o + r * o_ld + x + j * kLanes);
      }
    }
  }
  for (; x + 2 * kLanes <= dv; x += 2 * kLanes) {
    VF acc0[NR], acc1[NR];
    for (int r = 0; r < NR; ++r) {
      acc0[r] = hn::Load(df, o + r * o_ld + x);
      acc1[r] = hn::Load(df, o + r * o_ld + x + kLanes);
    }
    for (int k = 0; k < NK; ++k) {
      if constexpr (kPvAheadBytes > 0) {
        if (ahead_bytes > 0) {
          // Every line of the chunk: an f32 chunk on AVX-512 is two.
          const char* line = reinterpret_cast<const char*>(vals[k] + x) + ahead_bytes;
          for (size_t at = 0; at < 2 * kLanes * sizeof(T); at += 64) PrefetchLineL2(line + at);
        }
      }
      const VF v0 = LoadHalfF32<0>(df, vals[k] + x), v1 = LoadHalfF32<1>(df, vals[k] + x);
      for (int r = 0; r < NR; ++r) {
        const VF pk = hn::Set(df, p[r * ld + k]);
        acc0[r] = hn::MulAdd(pk, v0, acc0[r]);
        acc1[r] = hn::MulAdd(pk, v1, acc1[r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      hn::Store(acc0[r], df, o + r * o_ld + x);
      hn::Store(acc1[r], df, o + r * o_ld + x + kLanes);
    }
  }
  for (; x < dv; x += kLanes) {
    const int width = std::min(kLanes, dv - x);
    VF acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = hn::Load(df, o + r * o_ld + x);
    for (int k = 0; k < NK; ++k) {
      const VF vv = width == kLanes ? LoadF32(df, vals[k] + x) : LoadTailF32(df, vals[k] + x, width);
      for (int r = 0; r < NR; ++r) acc[r] = hn::MulAdd(hn::Set(df, p[r * ld + k]), vv, acc[r]);
    }
    for (int r = 0; r < NR; ++r) hn::Store(acc[r], df, o + r * o_ld + x);
  }
}

/// The most keys one P·V pass takes.
constexpr int kPvKeysMax = 16;

/// o[r] += Σ_k p[r][k]·v_k for nk ≤ kPvKeysMax keys and every row, one row and one
/// vector of dv at a time, each removed key (bit c + k of removed[r], RemovedKeys)
/// skipped: the path for passes with removed keys, and for the short passes at a
/// block's end (one instance for every key count, where templates on the count
/// multiplied the file's compile time). Each column adds the keys in order, as
/// PvRowsDense does, so the two agree bitwise.
template <typename T>
HWY_INLINE void PvKeysSkippingRemoved(const float* HWY_RESTRICT p, size_t ld, const uint64_t* removed, int c,
                                      int rows, const T* const* vals, int nk, int dv, float* HWY_RESTRICT o,
                                      size_t o_ld) {
  const DF df;
  for (int r = 0; r < rows; ++r) {
    const uint64_t gone = removed[r] >> c;
    const uint64_t keys = (uint64_t{1} << nk) - 1;  // nk ≤ kPvKeysMax
    if ((gone & keys) == keys) continue;  // every key removed
    float coef[kPvKeysMax];
    for (int k = 0; k < nk; ++k) coef[k] = p[r * ld + k];
    float* orow = o + r * o_ld;
    for (int x = 0; x < dv; x += kLanes) {
      const int width = std::min(kLanes, dv - x);
      VF acc = hn::Load(df, orow + x);
      for (int k = 0; k < nk; ++k) {
        if ((gone >> k) & 1) continue;
        acc = hn::MulAdd(hn::Set(df, coef[k]), LoadColumnsF32(df, vals[k], x, width), acc);
      }
      hn::Store(acc, df, orow + x);
    }
  }
}

/// o[r] += Σ_k p[r][k]·v_k for NK consecutive keys, from key c of the block (p:
/// row stride ld; removed: the block's RemovedKeys per row), and every row, the
/// cache read in token order; value lines asked for ahead_bytes ahead (see
/// kPvAheadBytes). A removed key (score −∞) is skipped, so a NaN or ±∞ the cache
/// holds there never reaches o (0·NaN would). A key that is seen but whose p
/// underflowed to 0 (a score ~104 below its row's max, e.g. under a −FLT_MAX mask)
/// is not removed: it adds 0·v, which is NaN for a non-finite v, as in the float64
/// reference. bf16_pv: bf16 values on vdpbf16ps where no key is removed (PvRowsBf16).
template <typename T, int NK>
HWY_INLINE void PvKeys(const float* HWY_RESTRICT p, size_t ld, const uint64_t* removed, int c, int rows,
                       const T* const* vals, int dv, float* HWY_RESTRICT o, size_t o_ld, int64_t ahead_bytes,
                       bool bf16_pv) {
  constexpr uint64_t kKeys = (uint64_t{1} << NK) - 1;
  uint64_t any_removed = 0;  // among these keys and rows; none: the plain loop
  for (int r = 0; r < rows; ++r) any_removed |= (removed[r] >> c) & kKeys;
  if constexpr (kPairs<T> && kBf16DotTarget) {
    if (bf16_pv && any_removed == 0) {
      PvRowGroupsBf16<NK>(p, ld, rows, reinterpret_cast<const uint16_t* const*>(vals), dv, o, o_ld, ahead_bytes);
      return;
    }
  }
  if (any_removed == 0) {
    int r = 0;
    for (; r + 4 <= rows; r += 4) PvRowsDense<T, NK, 4>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes);
    switch (rows - r) {
      case 3: PvRowsDense<T, NK, 3>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes); break;
      case 2: PvRowsDense<T, NK, 2>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes); break;
      case 1: PvRowsDense<T, NK, 1>(p + r * ld, ld, vals, dv, o + r * o_ld, o_ld, ahead_bytes); break;
      default: break;
    }
    return;
  }
  PvKeysSkippingRemoved(p, ld, removed, c, rows, vals, NK, dv, o, o_ld);
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // ATTN_CPU_DECODE_VALUES_INL_H_
