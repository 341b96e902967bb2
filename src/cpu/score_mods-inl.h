// The built-in score modifiers and mask predicates, applied to one score tile
// between S = Q·Kᵀ and the softmax (DESIGN.md's order of operations):
//   softcap → ALiBi → additive mask → boolean mask → block mask → band (causal, window, key
//   length) → the user's mask_mod / score_mod.
// Each is a per-tile runtime branch around a vector loop: the branch costs one
// test per 6×64-score tile, far below the 2·d FMAs each score needs, so the
// options need no template instantiations of their own. Tiles that the band rules
// out entirely are never computed (see attention_forward.cc).

#if defined(ATTN_CPU_SCORE_MODS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_SCORE_MODS_INL_H_
#undef ATTN_CPU_SCORE_MODS_INL_H_
#else
#define ATTN_CPU_SCORE_MODS_INL_H_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

#include "cpu/tile_kernels-inl.h"
#include "problem.hpp"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

/// Where a score tile sits: sequence b, query head h, query rows i0..i0+rows,
/// keys j0..j0+cols (cols = keys of the tile that exist, ≤ Bk). lo/hi: per row,
/// the first and last key the band (causal, window, key length) leaves visible.
struct TilePlace {
  int b, h;
  int i0, rows;
  int j0, cols;
  const int* lo;
  const int* hi;
};

/// The band of query i: keys lo..hi (inclusive) survive causal, window and key
/// length. lo > hi means none. The rules are those of the whole sequence when the
/// call is placed inside one (Problem.q_pos0, k_pos0; Sequence.align), so the band
/// is worked out in global positions and then clipped to this call's keys.
HWY_INLINE void BandOfRow(const Problem& p, const Sequence& seq, int i, int* lo, int* hi) {
  const int64_t at = int64_t{i} + p.q_pos0;       // global query position
  const int64_t shifted = at + seq.align;          // bottom-right aligned
  int64_t first = p.k_pos0, last = p.k_pos0 + seq.Lk - 1;
  if (p.causal == Causal::TopLeft) last = std::min(last, at);
  if (p.causal == Causal::BottomRight) last = std::min(last, shifted);
  if (p.window_left >= 0) first = std::max(first, shifted - p.window_left);
  if (p.window_right >= 0) last = std::min(last, shifted + p.window_right);
  first -= p.k_pos0, last -= p.k_pos0;
  if (first > last) first = 1, last = 0;  // empty; keep the values in int range
  *lo = static_cast<int>(first);
  *hi = static_cast<int>(last);
}

/// The key vectors of the tile [j0, j0+Bk) that rows r0..r0+kRowsPerBlock (of the
/// first `rows` real ones) can see through their bands lo/hi: vectors first ..
/// first+count−1 (count 0: none). Blocks compute only those (causal diagonals,
/// windows, padding rows).
HWY_INLINE void BlockKeyVectors(const int* lo, const int* hi, int r0, int rows, int j0,
                                int* first, int* count) {
  int block_lo = INT32_MAX, block_hi = -1;
  for (int i = r0; i < std::min(r0 + kRowsPerBlock, rows); ++i) {
    if (lo[i] <= hi[i]) block_lo = std::min(block_lo, lo[i]), block_hi = std::max(block_hi, hi[i]);
  }
  int f = 0, last = -1;
  if (block_hi >= j0 && block_lo < j0 + kBk) {
    f = std::max(0, block_lo - j0) / kLanes;
    last = std::min(kBk - 1, block_hi - j0) / kLanes;
  }
  *first = f;
  *count = last - f + 1;
}

/// True when some row of the tile loses keys of [j0, j0+Bk) to the band.
HWY_INLINE bool TileNeedsBand(const TilePlace& t) {
  for (int r = 0; r < t.rows; ++r) {
    if (t.lo[r] > t.j0 || t.hi[r] < t.j0 + kBk - 1) return true;
  }
  return false;
}

/// The key tiles query tile qt of sequence seq sees: [first, last] (empty when
/// last < first), from the rows' bands (causal, window, key length).
HWY_INLINE void QueryTileKeyRange(const Problem& p, const Sequence& seq, int qt, int* first, int* last) {
  int jmin = INT_MAX, jmax = -1;
  for (int i = qt * kBq; i < std::min(seq.Lq, (qt + 1) * kBq); ++i) {
    int lo, hi;
    BandOfRow(p, seq, i, &lo, &hi);
    if (lo <= hi) jmin = std::min(jmin, lo), jmax = std::max(jmax, hi);
  }
  *first = jmax < 0 ? 0 : jmin / kBk;
  *last = jmax < 0 ? -1 : jmax / kBk;
}

/// How options.block_mask covers a score tile.
enum class Cover { kEmpty, kFull, kPartial };

/// The cover of rows [i0, i0 + rows) × keys [j0, j0 + cols) of (b, h): kEmpty when
/// every block it touches is empty (the kernels skip the tile), kFull when every one
/// is full or there is no block mask, else kPartial. One lookup per block touched.
HWY_INLINE Cover BlockMaskCover(const Problem& p, int b, int h, int i0, int rows, int j0, int cols) {
  if (p.bm_blocks == nullptr) return Cover::kFull;
  if (rows <= 0 || cols <= 0) return Cover::kEmpty;
  bool kept = false, removed = false;
  const int64_t base = b * p.bm_b + h * p.bm_h;
  for (int qb = i0 / p.bm_bq; qb <= (i0 + rows - 1) / p.bm_bq; ++qb) {
    const int32_t* row = p.bm_blocks + base + qb * p.bm_qb;
    for (int kb = j0 / p.bm_bk; kb <= (j0 + cols - 1) / p.bm_bk; ++kb) {
      const int32_t e = row[kb * p.bm_kb];
      kept |= e != BlockMask::kEmpty;
      removed |= e != BlockMask::kFull;
      if (kept && removed) return Cover::kPartial;
    }
  }
  return kept ? Cover::kFull : Cover::kEmpty;
}

/// Removes (−∞) the scores of tile t that options.block_mask removes: whole runs of
/// an empty block, the false elements of a partial block's boolean tile (uint8
/// vectors widened to a lane mask, as the dense boolean mask).
HWY_INLINE void ApplyBlockMask(const Problem& p, const TilePlace& t, float* HWY_RESTRICT s, size_t ld) {
  if (t.rows <= 0 || t.cols <= 0) return;
  const DF df;
  const hn::RebindToSigned<DF> di;
  const hn::Rebind<uint8_t, DF> du8;
  const VF neg_inf = hn::Set(df, -HUGE_VALF);
  const int64_t base = t.b * p.bm_b + t.h * p.bm_h;
  for (int qb = t.i0 / p.bm_bq; qb <= (t.i0 + t.rows - 1) / p.bm_bq; ++qb) {
    const int r_lo = std::max(qb * p.bm_bq, t.i0) - t.i0;
    const int r_hi = std::min((qb + 1) * p.bm_bq, t.i0 + t.rows) - t.i0;
    const int32_t* entries = p.bm_blocks + base + qb * p.bm_qb;
    for (int kb = t.j0 / p.bm_bk; kb <= (t.j0 + t.cols - 1) / p.bm_bk; ++kb) {
      const int32_t e = entries[kb * p.bm_kb];
      if (e == BlockMask::kFull) continue;
      const int c_lo = std::max(kb * p.bm_bk, t.j0) - t.j0;
      const int c_hi = std::min((kb + 1) * p.bm_bk, t.j0 + t.cols) - t.j0;
      for (int r = r_lo; r < r_hi; ++r) {
        float* row = s + r * ld;
        if (e == BlockMask::kEmpty) {
          std::fill(row + c_lo, row + c_hi, -HUGE_VALF);
          continue;
        }
        const uint8_t* bits = p.bm_tiles + e * p.bm_t + (t.i0 + r - qb * p.bm_bq) * p.bm_r +
                              (t.j0 + c_lo - kb * p.bm_bk);
        int c = c_lo;
        for (; c + static_cast<int>(kLanes) <= c_hi; c += kLanes) {
          const auto wide = hn::PromoteTo(di, hn::LoadU(du8, bits + (c - c_lo)));
          const auto drop = hn::RebindMask(df, hn::Eq(wide, hn::Zero(di)));
          hn::StoreU(hn::IfThenElse(drop, neg_inf, hn::LoadU(df, row + c)), df, row + c);
        }
        for (; c < c_hi; ++c) {
          if (bits[c - c_lo] == 0) row[c] = -HUGE_VALF;
        }
      }
    }
  }
}

/// Applies f (a function of a float64 vector) to each lane of x in float64 and
/// rounds the result once to f32. For softcap's tanh: Highway's f32 Tanh errs by
/// up to ~4 ulp, which made softcapped scores (and so P and dS) measurably less
/// accurate than a plain f32 implementation with libm's tanh.
template <class F>
HWY_INLINE VF InFloat64(DF df, VF x, F f) {
#if HWY_TARGET == HWY_SCALAR
  const hn::Sisd<double> dd;
  return hn::Set(df, static_cast<float>(hn::GetLane(f(dd, hn::Set(dd, double{hn::GetLane(x)})))));
#else
  const hn::Half<DF> dh;
  const hn::Rebind<double, decltype(dh)> dd;
  const auto lo = f(dd, hn::PromoteTo(dd, hn::LowerHalf(dh, x)));
  const auto hi = f(dd, hn::PromoteTo(dd, hn::UpperHalf(dh, x)));
  return hn::Combine(df, hn::DemoteTo(dh, hi), hn::DemoteTo(dh, lo));
#endif
}

/// Softcap: cap·tanh(s / cap), evaluated in float64.
HWY_INLINE VF Softcap(DF df, VF s, double cap) {
  return InFloat64(df, s, [cap](auto dd, auto x) {
    return hn::Mul(hn::Set(dd, cap), hn::Tanh(dd, hn::Div(x, hn::Set(dd, cap))));
  });
}

/// Softcap's derivative 1 − tanh²(s / cap), in float64 (no cancellation near ±1).
HWY_INLINE VF SoftcapDerivative(DF df, VF s, double cap) {
  return InFloat64(df, s, [cap](auto dd, auto x) {
    const auto t = hn::Tanh(dd, hn::Div(x, hn::Set(dd, cap)));
    return hn::NegMulAdd(t, t, hn::Set(dd, 1.0));
  });
}

/// Applies every enabled modifier and mask to the tile's real rows (row stride
/// ld). Scores stay in natural units throughout (the softmax converts s − m).
/// For the backward's chain rule, `raw` (if not null) receives the scores before
/// softcap and `pre_mod` those before the user's score_mod (same layout as s).
HWY_INLINE void ApplyScoreMods(const Problem& p, const Sequence& seq, const TilePlace& t,
                               float* HWY_RESTRICT s, size_t ld, bool band,
                               float* HWY_RESTRICT raw = nullptr,
                               float* HWY_RESTRICT pre_mod = nullptr) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const VF neg_inf = hn::Set(df, -HUGE_VALF);
  const VF iota = hn::Iota(df, 0.0f);
  if (raw != nullptr) std::memcpy(raw, s, sizeof(float) * ld * t.rows);

  if (p.softcap > 0.0f) {
    for (int r = 0; r < t.rows; ++r) {
      float* row = s + r * ld;
      for (int n = 0; n < kKeyVectors; ++n) {
        hn::Store(Softcap(df, hn::Load(df, row + n * kLanes), p.softcap), df, row + n * kLanes);
      }
    }
  }
  if (p.alibi != nullptr) {
    // s −= slope·|i' − j| with i' = i + Lk − Lq (bottom-right aligned), in the
    // positions of the whole sequence for a placed call. The distance from the
    // tile's first key is formed in integers; distances below 2^24 are exact in f32.
    const VF slope = hn::Set(df, p.alibi[t.b * p.alibi_b + t.h * p.alibi_h]);
    for (int r = 0; r < t.rows; ++r) {
      float* row = s + r * ld;
      const float base = static_cast<float>(t.i0 + r + p.q_pos0 + seq.align - (t.j0 + p.k_pos0));
      for (int n = 0; n < kKeyVectors; ++n) {
        const VF j = hn::Add(iota, hn::Set(df, static_cast<float>(n * kLanes)));
        const VF dist = hn::Abs(hn::Sub(hn::Set(df, base), j));
        hn::Store(hn::NegMulAdd(slope, dist, hn::Load(df, row + n * kLanes)), df,
                  row + n * kLanes);
      }
    }
  }
  if (p.add_mask != nullptr || p.bool_mask != nullptr) {
    const int64_t base = t.b * p.mask_b + t.h * p.mask_h + int64_t{t.j0} * p.mask_j;
    const bool vector_path = p.mask_j == 1 && t.cols == kBk;
    for (int r = 0; r < t.rows; ++r) {
      float* row = s + r * ld;
      const int64_t at = base + int64_t{t.i0 + r} * p.mask_i;
      if (p.add_mask != nullptr) {
        const float* mrow = p.add_mask + at;
        if (vector_path) {
          for (int n = 0; n < kKeyVectors; ++n) {
            hn::Store(hn::Add(hn::Load(df, row + n * kLanes), hn::LoadU(df, mrow + n * kLanes)),
                      df, row + n * kLanes);
          }
        } else {
          for (int c = 0; c < t.cols; ++c) row[c] += mrow[c * p.mask_j];
        }
      } else {
        const uint8_t* mrow = p.bool_mask + at;
        if (vector_path) {
          const hn::Rebind<uint8_t, DF> du8;
          for (int n = 0; n < kKeyVectors; ++n) {
            const auto wide = hn::PromoteTo(di, hn::LoadU(du8, mrow + n * kLanes));
            const auto drop = hn::RebindMask(df, hn::Eq(wide, hn::Zero(di)));
            hn::Store(hn::IfThenElse(drop, neg_inf, hn::Load(df, row + n * kLanes)), df,
                      row + n * kLanes);
          }
        } else {
          for (int c = 0; c < t.cols; ++c) {
            if (mrow[c * p.mask_j] == 0) row[c] = -HUGE_VALF;
          }
        }
      }
    }
  }
  if (p.bm_blocks != nullptr) ApplyBlockMask(p, t, s, ld);
  if (band) {
    for (int r = 0; r < t.rows; ++r) {
      float* row = s + r * ld;
      const VF lo = hn::Set(df, static_cast<float>(t.lo[r] - t.j0));
      const VF hi = hn::Set(df, static_cast<float>(t.hi[r] - t.j0));
      for (int n = 0; n < kKeyVectors; ++n) {
        const VF j = hn::Add(iota, hn::Set(df, static_cast<float>(n * kLanes)));
        const auto drop = hn::Or(hn::Lt(j, lo), hn::Gt(j, hi));
        hn::Store(hn::IfThenElse(drop, neg_inf, hn::Load(df, row + n * kLanes)), df,
                  row + n * kLanes);
      }
    }
  }
  if (pre_mod != nullptr) std::memcpy(pre_mod, s, sizeof(float) * ld * t.rows);
  if (p.mods != nullptr) {
    p.mods->tile(p.mods->ctx, s, static_cast<int64_t>(ld), t.b, t.h, t.i0, t.rows, t.j0, t.cols);
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
