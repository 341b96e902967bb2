// bf16 attention forward on Intel AMX: FlashAttention-2's tiled online softmax with
// both products on the tile unit.
//
// One work item is (sequence b, query head h, block of kQ = 32 queries). Per block
// of up to kW = 128 keys that the rows' bands reach:
//   S = Q·Kᵀ                 tdpbf16ps, 2×2 tiles of 16×16 (ScoresAmx)
//   S = modifiers and masks  the f32 kernel's ApplyScoreMods, per 64 keys
//   P = e^(scale·S − m_new)  AVX-512, one row max over the whole block first, so
//                            that every P of the block shares one m (SoftmaxBlock)
//   O = α·O + P·V            P rounded to bf16, O kept in f32 in memory and loaded
//                            into accumulator tiles (PvAmx); rows whose α is 1
//                            (most, once the running max has settled) skip the rescale
//   out = O / l, lse = m + ln l
// Operand layouts, packed once per call (bf16 as uint16_t):
//   Q  [b][h][Lq rounded to kQ][dp]                       rows, dp = d rounded to 32
//   K  [b][hk][key group of 16][d chunk of 32][16][16][2] tdpbf16ps's B operand:
//      row kk of a tile holds, for each of the 16 keys, the pair K[key][2kk..2kk+1]
//   V  [b][hk][key chunk of 32][column group of 16][16][16][2]  likewise, key pairs
// Everything the option semantics need (bands, masks, softcap, ALiBi, dropout, the
// user's mods) is the f32 kernel's code, applied to f32 score tiles; only the two
// products and the softmax are new. Calls with a NaN or ±∞ in q, k or v are declined
// (see attention_forward_amx.hpp) and take the portable path.
// GCC 12 flags its own _mm512_undefined_ps idiom (inside _mm512_scalef_ps) here.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "cpu/attention_forward_amx.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu/workspace.hpp"
#include "tensor/convert.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_forward_amx.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "cpu/dropout_tile-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_kernels-inl.h"

// The kernel is compiled for Highway's AVX3 target only (every AMX CPU has
// AVX-512); the other targets get a stub that is never called.
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
namespace {

#if ATTN_AMX_KERNEL
using bf16 = uint16_t;

constexpr int kQ = 32;           // queries per work item: two tile rows
constexpr int kW = 128;          // keys per block: the score buffer's width
constexpr int kPair = 32;        // the inner dimension of one tdpbf16ps (16 bf16 pairs)
constexpr int kTile = 16 * 32;   // bf16 elements in one 16×64-byte operand tile
static_assert(kW % kBk == 0, "score mods work on whole 64-key tiles");

/// Where each (sequence, head)'s packed operands start, in bf16 elements.
struct AmxLayout {
  int dp = 0, dvp = 0;  // d and dv rounded up to 32
  std::vector<size_t> q_base, kv_base;
  size_t total = 0;

  static int QRows(int lq) { return RoundUp(lq, kQ); }
  static int KRows(int lk) { return RoundUp(lk, kPair); }
  size_t QHead(const Sequence& s) const { return static_cast<size_t>(QRows(s.Lq)) * dp; }
  size_t KHead(const Sequence& s) const { return static_cast<size_t>(KRows(s.Lk)) * dp; }
  size_t VHead(const Sequence& s) const { return static_cast<size_t>(KRows(s.Lk)) * dvp; }

  bf16* Q(bf16* pack, const Problem& p, int b, int h) const {
    return pack + q_base[b] + h * QHead(p.seqs[b]);
  }
  bf16* K(bf16* pack, const Problem& p, int b, int hk) const {
    return pack + kv_base[b] + hk * (KHead(p.seqs[b]) + VHead(p.seqs[b]));
  }
  bf16* V(bf16* pack, const Problem& p, int b, int hk) const {
    return K(pack, p, b, hk) + KHead(p.seqs[b]);
  }
};

AmxLayout MakeAmxLayout(const Problem& p) {
  AmxLayout l;
  l.dp = RoundUp(p.d, kPair);
  l.dvp = RoundUp(p.dv, kPair);
  l.q_base.resize(p.seqs.size());
  l.kv_base.resize(p.seqs.size());
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    l.q_base[b] = l.total;
    l.total += p.Hq * l.QHead(p.seqs[b]);
    l.kv_base[b] = l.total;
    l.total += p.Hkv * (l.KHead(p.seqs[b]) + l.VHead(p.seqs[b]));
  }
  return l;
}

/// Element `at` of an input tensor as bf16 bits: copied for bf16 inputs, rounded to
/// nearest even for f32 inputs (Precision::bf16).
HWY_INLINE bf16 InputBf16(const Problem& p, const float* base, int64_t at) {
  if (p.dtype == DType::bf16) return reinterpret_cast<const bf16*>(base)[at];
  return f32_to_bf16(base[at]);
}

/// bf16 bits of NaN or ±∞ (all exponent bits set).
HWY_INLINE bool NonFiniteBf16(bf16 x) { return (x & 0x7F80u) == 0x7F80u; }

/// Packs query block qt of (b, h); rows beyond Lq and columns beyond d are zero.
/// Returns true when a packed value is NaN or ±∞.
bool PackQueries(const Problem& p, const AmxLayout& l, bf16* pack, int b, int h, int qt) {
  const Sequence& seq = p.seqs[b];
  bf16* dst = l.Q(pack, p, b, h) + static_cast<size_t>(qt) * kQ * l.dp;
  bool bad = false;
  for (int r = 0; r < kQ; ++r) {
    const int i = qt * kQ + r;
    bf16* row = dst + static_cast<size_t>(r) * l.dp;
    std::fill(row, row + l.dp, bf16{0});
    if (i >= seq.Lq) continue;
    const int64_t at = seq.q_offset + h * p.q_head + int64_t{i} * p.q_row;
    for (int c = 0; c < p.d; ++c) {
      row[c] = InputBf16(p, p.q, at + c);
      bad |= NonFiniteBf16(row[c]);
    }
  }
  return bad;
}

/// Packs keys and values of chunk t (32 keys) of (b, hk) into the tile layouts;
/// keys beyond Lk and columns beyond d / dv are zero. Returns true when a packed
/// value is NaN or ±∞.
bool PackKeysValues(const Problem& p, const AmxLayout& l, bf16* pack, int b, int hk, int t) {
  const Sequence& seq = p.seqs[b];
  const int dc = l.dp / kPair, vc = l.dvp / 16;
  bf16* kdst = l.K(pack, p, b, hk);
  bf16* vdst = l.V(pack, p, b, hk) + static_cast<size_t>(t) * vc * kTile;
  bool bad = false;
  for (int n = 0; n < kPair; ++n) {
    const int j = t * kPair + n;
    const bool real = j < seq.Lk;
    // K: key j is column j % 16 of group j / 16; d pairs down the tile's rows.
    bf16* kg = kdst + static_cast<size_t>(j / 16) * dc * kTile + (j % 16) * 2;
    const int64_t kat = seq.k_offset + hk * p.k_head + int64_t{j} * p.k_row;
    for (int c = 0; c < l.dp; ++c) {
      const bf16 x = real && c < p.d ? InputBf16(p, p.k, kat + c) : bf16{0};
      bad |= NonFiniteBf16(x);
      kg[(c / kPair) * kTile + (c % kPair) / 2 * 32 + (c % 2)] = x;
    }
    // V: key n of the chunk is half (n % 2) of row n / 2; columns across.
    const int64_t vat = seq.v_offset + hk * p.v_head + int64_t{j} * p.v_row;
    for (int c = 0; c < l.dvp; ++c) {
      const bf16 x = real && c < p.dv ? InputBf16(p, p.v, vat + c) : bf16{0};
      bad |= NonFiniteBf16(x);
      vdst[(c / 16) * kTile + (n / 2) * 32 + (c % 16) * 2 + (n % 2)] = x;
    }
  }
  return bad;
}

/// All eight tiles as 16 rows × 64 bytes (palette 1): 0–3 accumulators, 4–5 the
/// A operands (two row blocks), 6–7 the B operands (two column blocks).
ATTN_AMX void ConfigureTiles() {
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

ATTN_AMX void ReleaseTiles() { _tile_release(); }

/// S[kQ][width] (row stride kW floats) = Q·Kᵀ for the `width` keys (a multiple of
/// 32) of the packed groups starting at k. q: the packed [kQ][dp] query block.
ATTN_AMX void ScoresAmx(const bf16* q, int dp, const bf16* k, int width, float* s) {
  const int dc = dp / kPair;
  const size_t q_ld = sizeof(bf16) * dp, s_ld = sizeof(float) * kW;
  const bf16* q1 = q + 16 * dp;
  for (int g = 0; g < width / 16; g += 2) {
    const bf16* k0 = k + static_cast<size_t>(g) * dc * kTile;
    const bf16* k1 = k0 + static_cast<size_t>(dc) * kTile;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = 0; c < dc; ++c) {
      _tile_loadd(4, q + c * kPair, q_ld);
      _tile_loadd(5, q1 + c * kPair, q_ld);
      _tile_loadd(6, k0 + c * kTile, 64);
      _tile_loadd(7, k1 + c * kTile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    float* s0 = s + g * 16;
    _tile_stored(0, s0, s_ld);
    _tile_stored(1, s0 + 16, s_ld);
    _tile_stored(2, s0 + 16 * kW, s_ld);
    _tile_stored(3, s0 + 16 * kW + 16, s_ld);
  }
}

/// O[kQ][dvp] += P·V: P the bf16 [kQ][width] block (row stride kW), v the packed
/// value chunks of those keys.
ATTN_AMX void PvAmx(const bf16* pb, const bf16* v, int width, int dvp, float* o) {
  const int vc = dvp / 16;
  const size_t o_ld = sizeof(float) * dvp, p_ld = sizeof(bf16) * kW;
  const bf16* pb1 = pb + 16 * kW;
  float* o1 = o + 16 * dvp;
  for (int cc = 0; cc < vc; cc += 2) {
    _tile_loadd(0, o + cc * 16, o_ld);
    _tile_loadd(1, o + cc * 16 + 16, o_ld);
    _tile_loadd(2, o1 + cc * 16, o_ld);
    _tile_loadd(3, o1 + cc * 16 + 16, o_ld);
    for (int t = 0; t < width / kPair; ++t) {
      const bf16* vt = v + (static_cast<size_t>(t) * vc + cc) * kTile;
      _tile_loadd(4, pb + t * kPair, p_ld);
      _tile_loadd(5, pb1 + t * kPair, p_ld);
      _tile_loadd(6, vt, 64);
      _tile_loadd(7, vt + kTile, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o + cc * 16, o_ld);
    _tile_stored(1, o + cc * 16 + 16, o_ld);
    _tile_stored(2, o1 + cc * 16, o_ld);
    _tile_stored(3, o1 + cc * 16 + 16, o_ld);
  }
}

/// Two vectors of f32 rounded to nearest even into 32 bf16 at dst.
ATTN_AMX HWY_INLINE void StoreBf16x2(VF lo, VF hi, bf16* dst) {
  _mm512_storeu_si512(dst, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi.raw, lo.raw)));
}

/// The online-softmax step for a block of kQ rows × `width` scores (row stride kW),
/// SoftmaxTile's semantics (see tile_kernels-inl.h) over a block wider than one
/// tile. The natural-unit score is mult·s (mult = the scale when s holds raw dot
/// products, 1 after the modifiers). Writes p = e^(mult·s − m_new) as bf16 into pb
/// (or, with keep_f32, as f32 back into s for dropout), updates m and the partial
/// sums l ([kQ][kLanes], of the unrounded p), and alpha. Returns false when every
/// score is −∞ (nothing to add; alpha all 1).
ATTN_AMX bool SoftmaxBlock(float* s, int width, float mult, float* m, float* l, float* alpha,
                           float* row_max, bf16* pb, bool keep_f32) {
  const DF df;
  const VF neg_inf = hn::Set(df, -HUGE_VALF);
  const VF vmult = hn::Set(df, mult);
  bool any = false;
  for (int r = 0; r < kQ; ++r) {
    const float* row = s + r * kW;
    VF mx = hn::Load(df, row);
    auto nan = hn::IsNaN(mx);
    for (int c = kLanes; c < width; c += kLanes) {
      const VF x = hn::Load(df, row + c);
      mx = hn::Max(mx, x);
      nan = hn::Or(nan, hn::IsNaN(x));
    }
    // mult > 0, so the max of mult·s is mult·max(s), rounded the same way.
    row_max[r] = hn::AllFalse(df, nan) ? hn::GetLane(hn::MaxOfLanes(df, mx)) * mult : NAN;
    any |= row_max[r] != -HUGE_VALF;
  }
  if (!any) {
    std::fill(alpha, alpha + kQ, 1.0f);
    return false;
  }
  for (int r = 0; r < kQ; r += kLanes) {
    const VF m_old = hn::Load(df, m + r);
    const VF tile_max = hn::Load(df, row_max + r);
    const VF m_new = hn::IfThenElse(hn::Or(hn::IsNaN(m_old), hn::IsNaN(tile_max)), hn::Set(df, NAN),
                                    hn::Max(m_old, tile_max));
    const VF m_use = hn::IfThenZeroElse(hn::Eq(m_new, neg_inf), m_new);
    hn::Store(ExpNonPositive(df, hn::Sub(m_old, m_use)), df, alpha + r);
    hn::Store(m_new, df, m + r);
    hn::Store(m_use, df, row_max + r);
  }
  for (int r = 0; r < kQ; ++r) {
    float* row = s + r * kW;
    bf16* prow = pb + r * kW;
    if (m[r] == -HUGE_VALF) {  // no visible key yet: p = 0 exactly
      if (keep_f32) {
        std::fill(row, row + width, 0.0f);
      } else {
        std::fill(prow, prow + width, bf16{0});
      }
      continue;
    }
    const VF mu = hn::Set(df, row_max[r]);
    VF sum0 = hn::Zero(df), sum1 = hn::Zero(df);
    for (int c = 0; c < width; c += 2 * kLanes) {
      // mult·s − m, fused: the product is exact before the subtraction.
      const VF e0 = ExpNonPositive(df, hn::MulSub(hn::Load(df, row + c), vmult, mu));
      const VF e1 = ExpNonPositive(df, hn::MulSub(hn::Load(df, row + c + kLanes), vmult, mu));
      sum0 = hn::Add(sum0, e0);
      sum1 = hn::Add(sum1, e1);
      if (keep_f32) {
        hn::Store(e0, df, row + c);
        hn::Store(e1, df, row + c + kLanes);
      } else {
        StoreBf16x2(e0, e1, prow + c);
      }
    }
    float* lr = l + r * kLanes;
    hn::Store(hn::MulAdd(hn::Load(df, lr), hn::Set(df, alpha[r]), hn::Add(sum0, sum1)), df, lr);
  }
  return true;
}

/// Rounds kQ rows × width f32 probabilities (row stride kW) into pb.
ATTN_AMX void ProbabilitiesToBf16(const float* s, int width, bf16* pb) {
  const DF df;
  for (int r = 0; r < kQ; ++r) {
    for (int c = 0; c < width; c += 2 * kLanes) {
      StoreBf16x2(hn::Load(df, s + r * kW + c), hn::Load(df, s + r * kW + c + kLanes), pb + r * kW + c);
    }
  }
}

/// O rows whose α is not 1 are rescaled (NaN α makes the row NaN, as it must).
void RescaleRows(float* o, int dvp, const float* alpha) {
  const DF df;
  for (int r = 0; r < kQ; ++r) {
    if (alpha[r] == 1.0f) continue;
    const VF a = hn::Set(df, alpha[r]);
    float* row = o + static_cast<size_t>(r) * dvp;
    for (int c = 0; c < dvp; c += kLanes) hn::Store(hn::Mul(hn::Load(df, row + c), a), df, row + c);
  }
}

/// The per-thread workspace of one work item.
struct AmxScratch {
  float* s;     // [kQ][kW]  scores, then (with dropout) f32 probabilities
  bf16* pb;     // [kQ][kW]  probabilities rounded to bf16
  float* o;     // [kQ][dvp] output accumulator
  float* l;     // [kQ][kLanes]
  float* m;     // [kQ]
  float* alpha; // [kQ]
  float* tmp;   // [kQ]
  int* lo;      // [kQ]
  int* hi;      // [kQ]

  static size_t Floats(int dvp) {
    return size_t{kQ} * kW + size_t{kQ} * kW / 2 + size_t{kQ} * dvp + size_t{kQ} * kLanes + 5 * kQ;
  }
  explicit AmxScratch(int dvp) {
    s = thread_scratch(kSlotTile, Floats(dvp));
    pb = reinterpret_cast<bf16*>(s + kQ * kW);
    o = s + kQ * kW + kQ * kW / 2;
    l = o + static_cast<size_t>(kQ) * dvp;
    m = l + kQ * kLanes;
    alpha = m + kQ;
    tmp = alpha + kQ;
    lo = reinterpret_cast<int*>(tmp + kQ);
    hi = lo + kQ;
  }
};

/// True when any score modifier or mask other than the band is on.
bool HasScoreMods(const Problem& p) {
  return p.softcap > 0.0f || p.alibi != nullptr || p.add_mask != nullptr || p.bool_mask != nullptr ||
         p.mods != nullptr;
}

/// One work item: sequence b, query head h, query block qt.
ATTN_AMX void ForwardBlock(const Problem& p, const AmxLayout& lay, bf16* pack, int b, int h, int qt) {
  const Sequence& seq = p.seqs[b];
  const int hk = h / p.group();
  const int i0 = qt * kQ, rows = std::min(kQ, seq.Lq - i0);
  const int dvp = lay.dvp;
  AmxScratch w(dvp);

  int jmin = seq.Lk, jmax = -1;
  for (int r = 0; r < rows; ++r) {
    BandOfRow(p, seq, i0 + r, &w.lo[r], &w.hi[r]);
    if (w.lo[r] <= w.hi[r]) jmin = std::min(jmin, w.lo[r]), jmax = std::max(jmax, w.hi[r]);
  }
  std::fill(w.o, w.o + static_cast<size_t>(kQ) * dvp, 0.0f);
  std::fill(w.m, w.m + kQ, -HUGE_VALF);
  std::fill(w.l, w.l + kQ * kLanes, 0.0f);

  const bf16* q = lay.Q(pack, p, b, h) + static_cast<size_t>(i0) * lay.dp;
  const bf16* k = lay.K(pack, p, b, hk);
  const bf16* v = lay.V(pack, p, b, hk);
  const bool mods = HasScoreMods(p), dropout = p.dropout_p > 0.0f;
  const int dc = lay.dp / kPair, vc = dvp / 16;
  for (int j0 = jmax < 0 ? 0 : jmin / kPair * kPair; j0 <= jmax; j0 += kW) {
    const int width = std::min(kW, RoundUp(jmax + 1, kPair) - j0);
    ScoresAmx(q, lay.dp, k + static_cast<size_t>(j0 / 16) * dc * kTile, width, w.s);

    // Modifiers and masks on each 64-key tile that needs them, in natural units.
    bool band = false;
    for (int s0 = 0; s0 < width; s0 += kBk) {
      const TilePlace place{b, h, i0, rows, j0 + s0, std::min(kBk, seq.Lk - j0 - s0), w.lo, w.hi};
      band |= TileNeedsBand(place);
    }
    float mult = p.scale;
    if (mods || band) {
      const DF df;
      for (int r = 0; r < kQ; ++r) {
        float* row = w.s + r * kW;
        for (int c = 0; c < width; c += kLanes) {
          hn::Store(hn::Mul(hn::Load(df, row + c), hn::Set(df, p.scale)), df, row + c);
        }
      }
      mult = 1.0f;
      for (int s0 = 0; s0 < width; s0 += kBk) {
        const TilePlace place{b, h, i0, rows, j0 + s0, std::min(kBk, seq.Lk - j0 - s0), w.lo, w.hi};
        ApplyScoreMods(p, seq, place, w.s + s0, kW, TileNeedsBand(place));
      }
    }
    if (!SoftmaxBlock(w.s, width, mult, w.m, w.l, w.alpha, w.tmp, w.pb, dropout)) continue;
    if (dropout) {
      for (int s0 = 0; s0 < width; s0 += kBk) ApplyDropout(p, b, h, i0, rows, j0 + s0, w.s + s0, kW);
      ProbabilitiesToBf16(w.s, width, w.pb);
    }
    RescaleRows(w.o, dvp, w.alpha);
    PvAmx(w.pb, v + static_cast<size_t>(j0 / kPair) * vc * kTile, width, dvp, w.o);
  }

  // Normalise and write out, as the f32 kernel does.
  for (int r = 0; r < rows; ++r) {
    const int64_t at = seq.out_offset + h * p.out_head + int64_t{i0 + r} * p.out_row;
    const float* acc = w.o + static_cast<size_t>(r) * dvp;
    const float sum = RowSum(w.l, r);
    const bool none = w.m[r] == -HUGE_VALF;
    const bool nan = std::isnan(w.m[r]) || std::isnan(sum);
    const float inv = none ? 0.0f : nan ? NAN : 1.0f / sum;
    if (p.dtype == DType::bf16) {
      bf16* dst = reinterpret_cast<bf16*>(p.out) + at;
      for (int c = 0; c < p.dv; ++c) dst[c] = f32_to_bf16(nan ? NAN : acc[c] * inv);
    } else {
      float* dst = p.out + at;
      for (int c = 0; c < p.dv; ++c) dst[c] = nan ? NAN : acc[c] * inv;
    }
    if (p.lse != nullptr) {
      p.lse[seq.lse_offset + h * p.lse_h + int64_t{i0 + r} * p.lse_i] =
          none ? -HUGE_VALF : static_cast<float>(double{w.m[r]} + std::log(double{sum}));
    }
  }
}

bool ForwardAmxImpl(const Problem& p, int threads) {
  const AmxLayout lay = MakeAmxLayout(p);
  bf16* pack = reinterpret_cast<bf16*>(thread_scratch(kSlotPackedKv, (lay.total + 1) / 2));

  struct Item {
    int b, h, t;
  };
  std::vector<Item> qpacks, kvpacks, blocks;
  double flops = 0;
  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[b];
    for (int hk = 0; hk < p.Hkv; ++hk) {
      for (int t = 0; t < AmxLayout::KRows(seq.Lk) / kPair; ++t) kvpacks.push_back({b, hk, t});
    }
    for (int h = 0; h < p.Hq; ++h) {
      for (int t = 0; t < AmxLayout::QRows(seq.Lq) / kQ; ++t) {
        qpacks.push_back({b, h, t});
        blocks.push_back({b, h, t});
      }
    }
    flops += 2.0 * seq.Lq * seq.Lk * (p.d + p.dv) * p.Hq;
  }
  const int nt = flops < 2e6 ? 1 : std::max(1, threads);
  const int nq = static_cast<int>(qpacks.size()), nkv = static_cast<int>(kvpacks.size());
  const int nblocks = static_cast<int>(blocks.size());
  std::atomic<bool> nonfinite{false};
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    bool bad = false;
#pragma omp for schedule(static) nowait
    for (int i = 0; i < nq; ++i) bad |= PackQueries(p, lay, pack, qpacks[i].b, qpacks[i].h, qpacks[i].t);
#pragma omp for schedule(static)
    for (int i = 0; i < nkv; ++i) bad |= PackKeysValues(p, lay, pack, kvpacks[i].b, kvpacks[i].h, kvpacks[i].t);
    if (bad) nonfinite.store(true);
#pragma omp barrier
    // Every thread reads the same flag after the barrier, so all or none of them
    // reach the worksharing loop below.
    if (!nonfinite.load()) {
      ConfigureTiles();
#pragma omp for schedule(dynamic, 1)
      for (int i = 0; i < nblocks; ++i) ForwardBlock(p, lay, pack, blocks[i].b, blocks[i].h, blocks[i].t);
      ReleaseTiles();
    }
  }
  return !nonfinite.load();
}

size_t WorkspaceBytesImpl(const Problem& p, int threads) {
  const AmxLayout lay = MakeAmxLayout(p);
  return sizeof(bf16) * lay.total +
         sizeof(float) * static_cast<size_t>(std::max(1, threads)) * AmxScratch::Floats(lay.dvp);
}
#else
bool ForwardAmxImpl(const Problem&, int) { return false; }
size_t WorkspaceBytesImpl(const Problem&, int) { return 0; }
#endif  // ATTN_AMX_KERNEL

}  // namespace

bool ForwardAmx(const Problem& p, int threads) { return ForwardAmxImpl(p, threads); }
size_t AmxWorkspaceBytes(const Problem& p, int threads) { return WorkspaceBytesImpl(p, threads); }

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

bool attention_forward_amx(const Problem& p, int threads) {
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3)
  return N_AVX3::ForwardAmx(p, threads);
#else
  (void)p, (void)threads;
  return false;
#endif
}

size_t attention_forward_amx_workspace_bytes(const Problem& p, int threads) {
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3)
  return N_AVX3::AmxWorkspaceBytes(p, threads);
#else
  (void)p, (void)threads;
  return 0;
#endif
}

}  // namespace attn::detail
#endif  // HWY_ONCE
