// The decode kernel's i8-cache passes on 16-bit integer products, under
// Precision::bf16 (cpu/attention_decode.cc): queries and probabilities as
// fixed-point int16, the cache's codes widened to int16 only, both products exact
// in int32 (vpmaddwd, or vpdpwssd where the CPU has AVX512-VNNI). AVX2 and AVX-512
// targets only (ATTN_DECODE_FIXED16); elsewhere declared, never called. Included once
// per Highway target (hence the toggling include guard).

#if defined(ATTN_CPU_DECODE_FIXED16_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DECODE_FIXED16_INL_H_
#undef ATTN_CPU_DECODE_FIXED16_INL_H_
#else
#define ATTN_CPU_DECODE_FIXED16_INL_H_
#endif

#include <hwy/highway.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu/decode_loads-inl.h"
#include "cpu/decode_scores-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

// Precision::bf16 on i8 caches: both products on 16-bit integer multiply-adds
// (vpmaddwd: 2·kLanes products per instruction, where the f32 pass widens each key
// and value vector twice, to int32 and to f32, and takes 2 FMAs for them). The f32
// operands — a row's scaled query, a row's kFixedPvKeys probabilities (times the
// values' scales) of one P·V pass — enter as integers of 15 bits and a sign, relative to
// their largest magnitude: x ≈ unit·n, unit = max|x| / 32767, |x − unit·n| ≤ unit/2,
// an absolute error of at most 2⁻¹⁶ of the largest (bf16's rounding is 2⁻⁹ of each
// element). The integer sums are exact; one f32 multiply by the unit scales them.
// On AVX2 and AVX-512 only: there ReorderWidenMulAccumulate is vpmaddwd, whose lane i
// is a[2i]·b[2i] + a[2i+1]·b[2i+1] (the P·V pass's column order relies on it), and a
// block (kBk) holds a whole P·V pass.
#undef ATTN_DECODE_FIXED16
#if HWY_TARGET == HWY_AVX2 || HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
#define ATTN_DECODE_FIXED16 1
#else
#define ATTN_DECODE_FIXED16 0
#endif
constexpr bool kFixed16Target = ATTN_DECODE_FIXED16;
/// Whether this target's fixed-point passes can take vpdpwssd (MulPairsAdd).
constexpr bool kFixed16Vnni = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL;
/// What d and dv must be a multiple of: a whole int16 vector (kFixedVec) on every target.
constexpr int kFixedUnit = 32;
/// int16 lanes per vector (32 on AVX-512, 16 on AVX2): P·V's chunk of value columns.
constexpr int kFixedVec = 2 * kLanes;
/// The fixed-point integers' largest magnitude.
constexpr float kFixedMax = 32767.0f;
/// Keys per fixed-point P·V pass: their integers share a unit per row, and the pass
/// adds its sums to O once (at most 32·32767·128 in magnitude, well inside int32).
/// With 16 keys a pass, half its time went to converting the weights and adding to
/// O (perf annotate, Zen 4).
constexpr int kFixedPvKeys = 32;
#if ATTN_DECODE_FIXED16
using DI32 = hn::RebindToSigned<DF>;
using DI16 = hn::Repartition<int16_t, DF>;  // 2·kLanes lanes

/// acc + the pair sums of a·b (lane i: a[2i]·b[2i] + a[2i+1]·b[2i+1]), exact in
/// int32 for our operands (|a| ≤ 32767, |b| ≤ 128). kVnni (AVX-512 cores with VNNI:
/// Zen 4/5, Intel's since Ice Lake): one vpdpwssd, as an asm statement, which adds
/// in place. vpmaddwd + vpaddd (ReorderWidenMulAccumulate) leave GCC 12 a product
/// per accumulator to hold: with 16 accumulators it hoisted every product first,
/// spilled two and copied the rest at each iteration (perf annotate, Zen 4).
template <bool kVnni>
HWY_INLINE hn::Vec<DI32> MulPairsAdd(hn::Vec<DI16> a, hn::Vec<DI16> b, hn::Vec<DI32> acc) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if constexpr (kVnni) {
    asm("vpdpwssd %2, %1, %0" : "+v"(acc.raw) : "v"(a.raw), "v"(b.raw));
    return acc;
  }
#endif
  hn::Vec<DI32> unused = hn::Zero(DI32());
  return hn::ReorderWidenMulAccumulate(DI32(), a, b, acc, unused);
}

/// The fixed-point scaling of values whose largest magnitude is `largest` (finite):
/// x ≈ unit·n with n = ToFixed(x, inv), |n| ≤ 32767, |x − unit·n| ≤ unit/2 (plus
/// f32 rounding); unit = inv = 0 when largest is 0 (every n is then 0).
struct FixedScale {
  float inv, unit;
};
HWY_INLINE FixedScale FixedScaleOf(float largest) {
  if (largest == 0.0f) return {0.0f, 0.0f};
  return {kFixedMax / largest, largest * (1.0f / kFixedMax)};
}

/// A vector of finite values as fixed-point integers (int32 lanes): round(x·inv),
/// clamped to ±32767 against the product's rounding.
HWY_INLINE hn::Vec<DI32> ToFixed(VF x, VF inv) {
  const VF lim = hn::Set(DF(), kFixedMax);
  return hn::NearestInt(hn::Clamp(hn::Mul(x, inv), hn::Neg(lim), lim));
}

/// s[r·ld + c] = Σ_x q[r][x]·k_c[x] in integers, for NR rows of fixed-point queries
/// (q: rows of dq int16, FixedQueries's) and NK i8 key rows, d a multiple of
/// kFixedUnit; the caller multiplies row r by its unit. The sums are exact integers
/// (at most 128·32767·d in magnitude), summed across lanes in int32 on AVX-512 (d ≤
/// 512), else converted to f32 first.
template <int NR, int NK, bool kVnni>
HWY_INLINE void DotRowsFixed16(const int16_t* HWY_RESTRICT q, size_t dq, const int8_t* const* keys, int d,
                               float* HWY_RESTRICT s, size_t ld) {
  const DF df;
  const DI32 di;
  const DI16 dw;
  const hn::Rebind<int8_t, DI16> d8;
  hn::Vec<DI32> acc[NR * NK];  // [r][c]
  for (int i = 0; i < NR * NK; ++i) acc[i] = hn::Zero(di);
  for (int x = 0; x < d; x += static_cast<int>(hn::Lanes(dw))) {
    hn::Vec<DI16> kv[NK];
    for (int c = 0; c < NK; ++c) kv[c] = hn::PromoteTo(dw, hn::LoadU(d8, keys[c] + x));
    for (int r = 0; r < NR; ++r) {
      const auto qv = hn::LoadU(dw, q + r * dq + x);
      for (int c = 0; c < NK; ++c) acc[r * NK + c] = MulPairsAdd<kVnni>(qv, kv[c], acc[r * NK + c]);
    }
  }
  if constexpr (NR * NK == kLanes && kLanes == 16) {
    // The 16 sums in integers (exact; at most 2³¹ − 1 in magnitude for d ≤ 512),
    // then one conversion, where converting each accumulator first took 16 (AVX2
    // keeps the f32 path: its TransposedSums has an in-half schedule).
    HWY_ALIGN float out[kLanes];
    hn::Store(hn::ConvertTo(df, TransposedSums<NR * NK>(di, acc)), df, out);
    for (int r = 0; r < NR; ++r) std::memcpy(s + r * ld, out + r * NK, NK * sizeof(float));
    return;
  }
  VF sums[NR * NK];
  for (int i = 0; i < NR * NK; ++i) sums[i] = hn::ConvertTo(df, acc[i]);
  if constexpr (NR * NK == kLanes) {
    HWY_ALIGN float out[kLanes];
    hn::Store(TransposedSums(df, sums), df, out);
    for (int r = 0; r < NR; ++r) std::memcpy(s + r * ld, out + r * NK, NK * sizeof(float));
    return;
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NK; ++c) s[r * ld + c] = hn::GetLane(hn::SumOfLanes(df, sums[r * NK + c]));
}

/// DotRowsFixed16 over `rows` rows: 4 at a time, or one where NK is a vector's lane
/// count (the one-row pass).
template <int NK, bool kVnni>
HWY_INLINE void DotRowGroupsFixed16Of(const int16_t* q, size_t dq, int rows, const int8_t* const* keys, int d,
                                      float* s, size_t ld) {
  if constexpr (NK > 4) {
    for (int r = 0; r < rows; ++r) DotRowsFixed16<1, NK, kVnni>(q + r * dq, dq, keys, d, s + r * ld, ld);
  } else {
    int r = 0;
    for (; r + 4 <= rows; r += 4) DotRowsFixed16<4, NK, kVnni>(q + r * dq, dq, keys, d, s + r * ld, ld);
    switch (rows - r) {
      case 3: DotRowsFixed16<3, NK, kVnni>(q + r * dq, dq, keys, d, s + r * ld, ld); break;
      case 2: DotRowsFixed16<2, NK, kVnni>(q + r * dq, dq, keys, d, s + r * ld, ld); break;
      case 1: DotRowsFixed16<1, NK, kVnni>(q + r * dq, dq, keys, d, s + r * ld, ld); break;
      default: break;
    }
  }
}

/// kVnni: vpdpwssd (where the target has AVX-512 and the CPU VNNI; see MulPairsAdd).
template <int NK>
HWY_INLINE void DotRowGroupsFixed16(bool vnni, const int16_t* q, size_t dq, int rows, const int8_t* const* keys,
                                    int d, float* s, size_t ld) {
  if (kFixed16Vnni && vnni) {
    DotRowGroupsFixed16Of<NK, kFixed16Vnni>(q, dq, rows, keys, d, s, ld);
  } else {
    DotRowGroupsFixed16Of<NK, false>(q, dq, rows, keys, d, s, ld);
  }
}
#else
// Never called (kFixed16Target): declared so that the callers' discarded branches compile.
template <int NK>
void DotRowGroupsFixed16(bool, const int16_t*, size_t, int, const int8_t* const*, int, float*, size_t) {}
#endif

#if ATTN_DECODE_FIXED16
static_assert(kFixedPvKeys <= kBk, "a pass lies within a block");

/// The column of O's row buffer that holds output column u of a kFixedVec chunk on
/// the fixed-point P·V pass (PvRowsFixed16): a chunk's two keys' value vectors,
/// interleaved element by element (InterleaveLower/Upper, within each 128-bit
/// block β of 8 columns), give vpmaddwd pairs whose sums land in lanes 4β + i for
/// columns 8β + i of the lower interleave and 8β + 4 + i of the upper, i < 4; the
/// lower's lanes fill the chunk's first kLanes floats, the upper's the next.
/// Put back in order once per output row, when the splits are combined (FinishRows).
HWY_INLINE int Fixed16Column(int u) {
  const int block = u / 8, i = u % 8;
  return i < 4 ? 4 * block + i : kLanes + 4 * block + i - 4;
}

/// o[r] += unit_r·Σ_k n[r][k]·v_k for NR rows over the value rows vals[0 … 2·npairs)
/// + head (the keys of one pass in pairs; head: the kv head's offset in a token row),
/// dv a multiple of kFixedVec, o in Fixed16Column order. pairs[r·kFixedPvKeys/2 + j]:
/// row r's integers for keys 2j and 2j+1 in the low and high 16 bits. Each pair of
/// keys is one vpmaddwd per row and 16 columns. The integer sums are exact (at most
/// 16·32767·128 in magnitude); one conversion and FMA per vector adds them to O.
template <int NR, int kChunks, bool kVnni>
HWY_INLINE void PvRowsFixed16Chunks(const int32_t* HWY_RESTRICT pairs, const float* HWY_RESTRICT unit, int npairs,
                                    const int8_t* const* vals, int64_t head, int x, float* HWY_RESTRICT o,
                                    size_t o_ld, int64_t ahead_bytes) {
  const DF df;
  const DI32 di;
  const DI16 dw;
  const hn::Rebind<int8_t, DI16> d8;
  constexpr int kW = kFixedVec;
  hn::Vec<DI32> acc[NR][2 * kChunks];
  for (int r = 0; r < NR; ++r)
    for (int j = 0; j < 2 * kChunks; ++j) acc[r][j] = hn::Zero(di);
  for (int j = 0; j < npairs; ++j) {
    const int8_t* a = vals[2 * j] + head;
    const int8_t* b = vals[2 * j + 1] + head;
    if constexpr (kPvAheadBytes > 0) {
      if (ahead_bytes > 0) {
        PrefetchLineL2(reinterpret_cast<const char*>(a + x) + ahead_bytes);
        PrefetchLineL2(reinterpret_cast<const char*>(b + x) + ahead_bytes);
      }
    }
    hn::Vec<DI16> lo[kChunks], hi[kChunks];
    for (int ch = 0; ch < kChunks; ++ch) {
      const auto va = hn::PromoteTo(dw, hn::LoadU(d8, a + x + ch * kW));
      const auto vb = hn::PromoteTo(dw, hn::LoadU(d8, b + x + ch * kW));
      lo[ch] = hn::InterleaveLower(dw, va, vb);
      hi[ch] = hn::InterleaveUpper(dw, va, vb);
    }
    for (int r = 0; r < NR; ++r) {
      const auto w = hn::BitCast(dw, hn::Set(di, pairs[r * (kFixedPvKeys / 2) + j]));
      for (int ch = 0; ch < kChunks; ++ch) {
        acc[r][2 * ch] = MulPairsAdd<kVnni>(lo[ch], w, acc[r][2 * ch]);
        acc[r][2 * ch + 1] = MulPairsAdd<kVnni>(hi[ch], w, acc[r][2 * ch + 1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r) {
    const VF u = hn::Set(df, unit[r]);
    for (int j = 0; j < 2 * kChunks; ++j) {
      float* at = o + r * o_ld + x + j * kLanes;
      hn::Store(hn::MulAdd(hn::ConvertTo(df, acc[r][j]), u, hn::Load(df, at)), df, at);
    }
  }
}

template <int NR, bool kVnni>
HWY_INLINE void PvRowsFixed16(const int32_t* pairs, const float* unit, int npairs, const int8_t* const* vals,
                              int64_t head, int dv, float* o, size_t o_ld, int64_t ahead_bytes) {
  int x = 0;
  // Two chunks (64 columns) at once where 32 registers hold their 4·NR sums.
  if constexpr (kLanes == 16) {
    for (; x + 2 * kFixedVec <= dv; x += 2 * kFixedVec)
      PvRowsFixed16Chunks<NR, 2, kVnni>(pairs, unit, npairs, vals, head, x, o, o_ld, ahead_bytes);
  }
  for (; x < dv; x += kFixedVec) {
    PvRowsFixed16Chunks<NR, 1, kVnni>(pairs, unit, npairs, vals, head, x, o, o_ld, ahead_bytes);
  }
}

/// o[r] += Σ_k w[r][k]·v_k for nk ≤ kFixedPvKeys keys of a block (w = p times the
/// values' scales, removed keys' already 0; row stride ld) and every row, on
/// PvRowsFixed16 (O in Fixed16Column order). vals: kFixedPvKeys pointers, those past
/// nk any readable value row (their weights are 0), each plus `head` (the kv head's
/// offset in a token row, so that the caller makes the pointers once per pass, not
/// once per head). A row whose weights are not all finite (a NaN or ±∞ score or
/// scale) takes them in f32, one product at a time, so NaN and ±∞ reach O as on the
/// f32 pass.
template <bool kVnni>
HWY_INLINE void PvKeysFixed16Of(const float* HWY_RESTRICT w, size_t ld, int rows, const int8_t* const* vals,
                                int64_t head, int nk, int dv, float* HWY_RESTRICT o, size_t o_ld,
                                int64_t ahead_bytes) {
  const DF df;
  const hn::Rebind<int16_t, DF> dn;  // kLanes int16
  // Each row slot's integers, key by key as int16, read as int32 pairs of keys (the
  // vector stores may alias; scalar code touches them as int32 only).
  HWY_ALIGN int32_t pairs[4 * (kFixedPvKeys / 2)];
  float unit[4];
  const int npairs = (nk + 1) / 2;
  // Row r's weights into slot `slot`: w rows hold kBk floats, so a whole vector past
  // nk is readable; the keys from nk on count as 0.
  auto one_row = [&](int r, int slot) {
    const float* wr = w + r * ld;
    constexpr int kVecs = kFixedPvKeys / kLanes;
    VF v[kVecs];
    VF top = hn::Zero(df);
    auto finite = hn::IsFinite(top);
    for (int i = 0; i < kVecs; ++i) {
      v[i] = hn::IfThenElseZero(hn::FirstN(df, static_cast<size_t>(std::max(0, nk - i * kLanes))), hn::LoadU(df, wr + i * kLanes));
      top = hn::Max(top, hn::Abs(v[i]));
      finite = hn::And(finite, hn::IsFinite(v[i]));
    }
    int32_t* pr = pairs + slot * (kFixedPvKeys / 2);
    if (!hn::AllTrue(df, finite)) {  // NaN or ±∞: in f32, not through the integers
      float* orow = o + r * o_ld;
      for (int k = 0; k < nk; ++k) {
        for (int u = 0; u < dv; ++u) {
          float& at = orow[u / kFixedVec * kFixedVec + Fixed16Column(u % kFixedVec)];
          at = std::fma(wr[k], static_cast<float>(vals[k][head + u]), at);
        }
      }
      std::fill(pr, pr + kFixedPvKeys / 2, 0);
      unit[slot] = 0.0f;
      return;
    }
    // All zero (every key removed or underflowed): integers 0, unit 0.
    const FixedScale fs = FixedScaleOf(hn::GetLane(hn::MaxOfLanes(df, top)));
    unit[slot] = fs.unit;
    for (int i = 0; i < kVecs; ++i) {
      hn::Store(hn::DemoteTo(dn, ToFixed(v[i], hn::Set(df, fs.inv))), dn, reinterpret_cast<int16_t*>(pr) + i * kLanes);
    }
  };
  int r = 0;
  for (; r + 4 <= rows; r += 4) {
    for (int i = 0; i < 4; ++i) one_row(r + i, i);
    PvRowsFixed16<4, kVnni>(pairs, unit, npairs, vals, head, dv, o + r * o_ld, o_ld, ahead_bytes);
  }
  const int left = rows - r;
  for (int i = 0; i < left; ++i) one_row(r + i, i);
  switch (left) {
    case 3: PvRowsFixed16<3, kVnni>(pairs, unit, npairs, vals, head, dv, o + r * o_ld, o_ld, ahead_bytes); break;
    case 2: PvRowsFixed16<2, kVnni>(pairs, unit, npairs, vals, head, dv, o + r * o_ld, o_ld, ahead_bytes); break;
    case 1: PvRowsFixed16<1, kVnni>(pairs, unit, npairs, vals, head, dv, o + r * o_ld, o_ld, ahead_bytes); break;
    default: break;
  }
}

/// PvKeysFixed16Of on vpdpwssd where `vnni` (see MulPairsAdd).
HWY_INLINE void PvKeysFixed16(bool vnni, const float* w, size_t ld, int rows, const int8_t* const* vals, int64_t head,
                              int nk, int dv, float* o, size_t o_ld, int64_t ahead_bytes) {
  if (kFixed16Vnni && vnni) {
    PvKeysFixed16Of<kFixed16Vnni>(w, ld, rows, vals, head, nk, dv, o, o_ld, ahead_bytes);
  } else {
    PvKeysFixed16Of<false>(w, ld, rows, vals, head, nk, dv, o, o_ld, ahead_bytes);
  }
}
#else
// Never called (kFixed16Target).
inline void PvKeysFixed16(bool, const float*, size_t, int, const int8_t* const*, int64_t, int, int, float*, size_t,
                          int64_t) {}
inline int Fixed16Column(int u) { return u; }
#endif

#if ATTN_DECODE_FIXED16
/// The queries' rows (qs: rows of dp floats, d ≤ dp a multiple of kFixedUnit, all
/// finite) as fixed-point integers (ToFixed) into q16 (rows of dp), each row's unit
/// into unit. Once per call: the work items of a row share them.
inline void FixedQueries(const std::vector<float>& qs, int dp, int d, std::vector<int16_t>& q16,
                         std::vector<float>& unit) {
  const DF df;
  const hn::Rebind<int16_t, DF> dn;  // kLanes int16
  const size_t rows = qs.size() / dp;
  q16.assign(qs.size(), 0);
  unit.resize(rows);
  for (size_t r = 0; r < rows; ++r) {
    const float* x = &qs[r * dp];
    VF top = hn::Zero(df);
    for (int j = 0; j < d; j += kLanes) top = hn::Max(top, hn::Abs(hn::LoadU(df, x + j)));
    const FixedScale fs = FixedScaleOf(hn::GetLane(hn::MaxOfLanes(df, top)));
    unit[r] = fs.unit;
    for (int j = 0; j < d; j += kLanes) {
      hn::StoreU(hn::DemoteTo(dn, ToFixed(hn::LoadU(df, x + j), hn::Set(df, fs.inv))), dn, &q16[r * dp + j]);
    }
  }
}
#else
inline void FixedQueries(const std::vector<float>&, int, int, std::vector<int16_t>&, std::vector<float>&) {}
#endif

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // ATTN_CPU_DECODE_FIXED16_INL_H_
