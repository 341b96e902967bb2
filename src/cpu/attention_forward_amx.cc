// bf16 attention forward on Intel AMX: FlashAttention-2's tiled online softmax with
// both products on the tile unit. On CPUs with AVX512-BF16 but no AMX (Zen 4/5) the
// same code runs with both products on vdpbf16ps (TileJob::tiles = false: VecGemm on
// the same packed operands, no overlap to arrange since one unit does everything).
//
// One work item is (sequence b, query head h, a group of blocks of kQ = 32 queries).
// Per query block and block of up to kW = 256 keys that the rows' bands reach:
//   S = Q·Kᵀ                 tdpbf16ps, 2×2 tiles of 16×16 (TileJob)
//   S = modifiers and masks  the f32 kernel's ApplyScoreMods, per 64 keys
//   P = e^(scale·S − m_new)  AVX-512, one row max over the whole block first, so
//                            that every P of the block shares one m (UpdateMaxima,
//                            Exponentials)
//   O = α·O + P·V            P rounded to bf16, O kept in f32 in memory and loaded
//                            into accumulator tiles; rows whose α is 1 (most, once
//                            the running max has settled) skip the rescale
//   out = O / l, lse = m + ln l
// The tile unit and AVX-512 work side by side: while the softmax of key block t
// runs, the tile products of blocks t+1 (scores) and t−1 (P·V) are issued between
// its rows (ForwardGroup). At long N a group's query blocks share one pipeline,
// panel by panel of keys, so that all of them read a head's K and V from L2.
// AMX and the bf16 conversions are intrinsics (Highway has no AMX target); the
// rest is Highway, compiled for its AVX3 target only.
// f16 inputs (AMX only) are packed as two bf16 pieces per value, hi + lo, exact; each
// product then takes three tile products (TileJob::pieces), and P is split likewise.
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
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "attn/error.hpp"
#include "cpu/isa.hpp"
#include "cpu/owned_ranges.hpp"
#include "cpu/thread_team.hpp"
#include "cpu/workspace.hpp"
#include "env_override.hpp"
#include "traffic.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_forward_amx.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "cpu/amx_tiles-inl.h"
#include "cpu/dropout_tile-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_kernels-inl.h"
#include "cpu/storage_rows-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace {

#if ATTN_AMX_KERNEL
constexpr int kQ = 32;           // queries per work item: two tile rows
constexpr int kW = 256;          // keys per block: the score buffer's width
static_assert(kW % kBk == 0, "score mods work on whole 64-key tiles");

/// Where each (sequence, head)'s packed operands start, in bf16 elements.
struct AmxLayout {
  int dp = 0, dvp = 0;  // d and dv rounded up to 32
  // 2 for f16 inputs: each q, k, v row is packed as [hi | lo], two bf16 pieces whose
  // sum is the f16 value exactly (SplitRow), and the products take three piece
  // products (TileJob); also for f32 inputs with Precision::bf16x3, whose pieces hold
  // 16 significant bits. 1 for bf16 (and f32 rounded to bf16).
  int pieces = 1;
  std::vector<size_t> q_base, kv_base;
  size_t total = 0;

  static int QRows(int lq) { return RoundUp(lq, kQ); }
  static int KRows(int lk) { return RoundUp(lk, kPair); }
  int QWidth() const { return pieces * dp; }   // bf16 per packed query row
  int KChunks() const { return pieces * dp / kPair; }  // 32-wide chunks per packed key row
  int VGroups() const { return pieces * dvp / 16; }    // 16-wide column groups per packed value row
  size_t QHead(const Sequence& s) const { return static_cast<size_t>(QRows(s.Lq)) * QWidth(); }
  size_t KHead(const Sequence& s) const { return static_cast<size_t>(KRows(s.Lk)) * pieces * dp; }
  size_t VHead(const Sequence& s) const { return static_cast<size_t>(KRows(s.Lk)) * pieces * dvp; }

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
  l.pieces = p.pieces();
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

/// Rows [t·count, t·count + count) of one head of q, k or v, below `limit`, into
/// the cache (PrefetchRows, storage_rows-inl.h).
inline void PrefetchBlock(const Problem& p, const float* base, int64_t at0, int64_t row, int width, int t, int count,
                          int limit) {
  PrefetchRows(p.dtype, base, at0, row, width, t * count, std::min(t * count + count, limit));
}

/// Packs query block qt of (b, h); rows beyond Lq and columns beyond d are zero.
/// Returns true when a packed value is NaN or ±∞.
ATTN_AMX bool PackQueries(const Problem& p, const AmxLayout& l, bf16* pack, int b, int h, int qt, bf16* staging) {
  const Sequence& seq = p.seqs[b];
  const int width = l.QWidth();
  bf16* dst = l.Q(pack, p, b, h) + static_cast<size_t>(qt) * kQ * width;
  bool bad = false;
  for (int r = 0; r < kQ; ++r) {
    const int i = qt * kQ + r;
    const int64_t at = seq.q_offset + h * p.q_head + int64_t{i} * p.q_row;
    const bf16* row = PackedRow(p, l.pieces, p.q, at, p.d, l.dp, i < seq.Lq, staging);
    bad |= AnyNonFiniteBf16(row, width);
    std::memcpy(dst + static_cast<size_t>(r) * width, row, sizeof(bf16) * width);
  }
  return bad;
}

/// Packs keys and values of chunk t (32 keys) of (b, hk) into the tile layouts;
/// keys beyond Lk and columns beyond d / dv are zero. Returns true when a packed
/// value is NaN or ±∞. staging: 32·pieces·(dp + dvp) bf16 of thread scratch.
/// With two pieces a packed row is [hi | lo], so the key chunks dc.. and the value
/// column groups vc.. (of the real dp / dvp) hold the lo pieces.
ATTN_AMX bool PackKeysValues(const Problem& p, const AmxLayout& l, bf16* pack, int b, int hk, int t,
                             bf16* staging) {
  const Sequence& seq = p.seqs[b];
  const int dc = l.KChunks(), vc = l.VGroups();
  const size_t kw = static_cast<size_t>(l.pieces) * l.dp, vw = static_cast<size_t>(l.pieces) * l.dvp;
  const bf16* krow[kPair];
  const bf16* vrow[kPair];
  bool bad = false;
  for (int n = 0; n < kPair; ++n) {
    const int j = t * kPair + n;
    krow[n] = PackedRow(p, l.pieces, p.k, seq.k_offset + hk * p.k_head + int64_t{j} * p.k_row, p.d, l.dp, j < seq.Lk,
                        staging + n * kw);
    vrow[n] = PackedRow(p, l.pieces, p.v, seq.v_offset + hk * p.v_head + int64_t{j} * p.v_row, p.dv, l.dvp, j < seq.Lk,
                        staging + kPair * kw + n * vw);
    bad |= AnyNonFiniteBf16(krow[n], static_cast<int>(kw)) || AnyNonFiniteBf16(vrow[n], static_cast<int>(vw));
  }
  TrafficCounters::add(traffic().packed_bytes,
                       static_cast<uint64_t>(std::max(0, std::min(kPair, seq.Lk - t * kPair))) * (p.d + p.dv) * sizeof(bf16));
  // K: tile (group, d chunk c) row kk, column n = the pair K[key n][c·32 + 2kk ..]:
  // a 16×16 transpose of 32-bit pairs.
  bf16* kdst = l.K(pack, p, b, hk) + static_cast<size_t>(t) * 2 * dc * kTile;
  for (int g = 0; g < 2; ++g) {
    for (int c = 0; c < dc; ++c) PairTileTransposed(krow + g * 16, c * kPair, kdst + (static_cast<size_t>(g) * dc + c) * kTile);
  }
  // V: tile (chunk, column group cc) row kk, column x = (V[2kk][x], V[2kk+1][x]).
  bf16* vdst = l.V(pack, p, b, hk) + static_cast<size_t>(t) * vc * kTile;
  for (int cc = 0; cc < vc; ++cc) {
    for (int kk = 0; kk < 16; ++kk) {
      PairRow(vrow[2 * kk] + cc * 16, vrow[2 * kk + 1] + cc * 16, vdst + (static_cast<size_t>(cc) * 16 + kk) * 32);
    }
  }
  return bad;
}

/// The tile products of one step of the pipeline, issued a few instructions at a
/// time so that they run on the tile unit while AVX-512 computes a softmax:
///   S[kQ][qk_width] (row stride kW) = Q·Kᵀ   (skipped when qk_width = 0)
///   O[kQ][dvp] += P·V for pv_width keys      (skipped when pv_width = 0)
/// One Step() is one 2×2 block of tdpbf16ps (64 cycles of the tile unit), plus the
/// zeroing, loading or storing of the accumulators at the ends of a block.
/// With two pieces (f16 inputs: x = x_hi + x_lo exactly, AmxLayout::pieces) each
/// product takes three piece products, hi·hi + lo·hi + hi·lo. The fourth, lo·lo, is
/// below 2⁻¹⁸ of each term's magnitude, about the size of the f32 accumulation's own
/// rounding over a row of d terms. For P·V, P is split likewise (SplitBf16: to ~2⁻¹⁷, finer than
/// the f16 rounding a plain implementation applies to P).
struct TileJob {
  // Q·Kᵀ: the packed query block, the packed key groups of the block, the scores.
  const bf16* q = nullptr;
  const bf16* k = nullptr;
  float* s = nullptr;
  int dp = 0, qk_width = 0;
  // P·V: the bf16 probabilities (row stride kW), the packed value chunks, O.
  const bf16* pb = nullptr;
  const bf16* v = nullptr;
  float* o = nullptr;
  int dvp = 0, pv_width = 0;
  bool o_fresh = false;  // O holds nothing yet: start the accumulators at zero

  // False on CPUs without AMX: both products run on vdpbf16ps (VecGemm) in Finish,
  // since they would share the vector unit with the softmax anyway.
  bool tiles = true;
  // 1, or 2 for hi/lo pieces (tiles only): q rows are [hi | lo] (2·dp), key groups
  // hold 2·dp/32 chunks (lo from dp/32 on), value chunks 2·dvp/16 column groups (lo
  // from dvp/16 on), and pb rows are [hi | lo] (2·kW).
  int pieces = 1;

  int qk_steps = 0, total = 0, done = 0;
  int i = 0, j = 0;  // position within the current part: (key group pair, d chunk) or (column pair, key chunk)

  // Piece products per product: 1, or 3 with two pieces.
  int Terms() const { return pieces == 2 ? 3 : 1; }
  void Start() {
    qk_steps = qk_width / kPair * (dp / kPair) * Terms();
    total = qk_steps + (dvp / kPair) * (pv_width / kPair) * Terms();
    done = i = j = 0;
  }
  ATTN_AMX void Step();
  /// Runs steps until numerator / denominator of the job is done.
  ATTN_AMX void RunTo(int numerator, int denominator) {
    if (!tiles) return;
    const int until = total * numerator / denominator;
    while (done < until) Step();
  }
  ATTN_AMX void Finish() {
    if (!tiles) return FinishOnVectors();
    while (done < total) Step();
  }
  ATTN_AMX void FinishOnVectors();
};

ATTN_AMX void TileJob::FinishOnVectors() {
  if (done == total) return;
  if (qk_width > 0) {
    VecGemm(q, dp, k, kTile, static_cast<size_t>(dp / kPair) * kTile, s, kW, kQ, qk_width, dp, false);
  }
  if (pv_width > 0) {
    VecGemm(pb, kW, v, static_cast<size_t>(dvp / 16) * kTile, kTile, o, dvp, kQ, dvp, pv_width, !o_fresh);
  }
  done = total;
}

ATTN_AMX void TileJob::Step() {
  if (done < qk_steps) {
    const int dc = dp / kPair, kdc = pieces * dc;
    const bf16* k0 = k + static_cast<size_t>(2 * i) * kdc * kTile;
    const bf16* k1 = k0 + static_cast<size_t>(kdc) * kTile;
    const int q_width = pieces * dp;
    if (j == 0) {
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
    }
    // Step j's (query chunk, key chunk): j < dc hi·hi; then lo·hi; then hi·lo.
    const int qc = j < 2 * dc ? j : j - 2 * dc, kc = j < dc ? j : j - dc;
    TileProducts2x2(q + qc * kPair, q_width, k0 + kc * kTile, k1 + kc * kTile);
    if (++j == dc * Terms()) {
      float* s0 = s + i * kPair;
      const size_t s_ld = sizeof(float) * kW;
      _tile_stored(0, s0, s_ld);
      _tile_stored(1, s0 + 16, s_ld);
      _tile_stored(2, s0 + 16 * kW, s_ld);
      _tile_stored(3, s0 + 16 * kW + 16, s_ld);
      j = 0;
      ++i;
    }
    if (++done == qk_steps) i = j = 0;
    return;
  }
  const int terms = Terms(), chunks = pv_width / kPair * terms, vc = dvp / 16, pw = pieces * kW;
  const size_t o_ld = sizeof(float) * dvp;
  float* o0 = o + i * kPair;
  float* o1 = o0 + 16 * dvp;
  if (j == 0 && o_fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else if (j == 0) {
    _tile_loadd(0, o0, o_ld);
    _tile_loadd(1, o0 + 16, o_ld);
    _tile_loadd(2, o1, o_ld);
    _tile_loadd(3, o1 + 16, o_ld);
  }
  // Step j: key chunk j / terms, and of its pieces Phi·Vhi, Plo·Vhi, Phi·Vlo.
  const int kc = j / terms, piece = j % terms;
  const bf16* vt = v + (static_cast<size_t>(kc) * pieces * vc + 2 * i + (piece == 2 ? vc : 0)) * kTile;
  const bf16* pt = pb + (piece == 1 ? kW : 0) + kc * kPair;
  TileProducts2x2(pt, pw, vt, vt + kTile);
  if (++j == chunks) {
    _tile_stored(0, o0, o_ld);
    _tile_stored(1, o0 + 16, o_ld);
    _tile_stored(2, o1, o_ld);
    _tile_stored(3, o1 + 16, o_ld);
    j = 0;
    ++i;
  }
  ++done;
}

/// The first half of the online-softmax step for a block of kQ rows × `width`
/// scores (row stride kW), SoftmaxTile's semantics (tile_kernels-inl.h) over a block
/// wider than one tile: the row maxima of mult·s (mult = the scale for raw dot
/// products, 1 after the modifiers), the new running max m, alpha = e^(m_old − m_new),
/// and in row_max the max each row subtracts. Returns false when every score is −∞.
/// Runs the first half of `job` (the second runs in Exponentials).
ATTN_AMX bool UpdateMaxima(const float* s, int width, float mult, float* m, float* alpha, float* row_max,
                           TileJob& job) {
  const DF df;
  const VF neg_inf = hn::Set(df, -HUGE_VALF);
  bool any = false;
  for (int r = 0; r < kQ; ++r) {
    const float* row = s + r * kW;
    VF mx = hn::Load(df, row);
    for (int c = kLanes; c < width; c += kLanes) mx = hn::Max(mx, hn::Load(df, row + c));
    // mult > 0, so the max of mult·s is mult·max(s), rounded the same way.
    row_max[r] = hn::GetLane(hn::MaxOfLanes(df, mx)) * mult;
    // Max may drop a NaN score. That is harmless when the row has a finite max: the
    // NaN's p is NaN, so l and the row turn NaN. A row whose max is −∞ would skip
    // its exponentials, so look for a NaN there (rare: only masked rows are −∞).
    if (row_max[r] == -HUGE_VALF) {
      for (int c = 0; c < width; ++c) {
        if (std::isnan(row[c])) row_max[r] = NAN;
      }
    }
    any |= row_max[r] != -HUGE_VALF;
    job.RunTo(r + 1, 2 * kQ);
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
    // Exactly 1 when the max did not move (RescaleRows then skips the row).
    hn::Store(ExpNonPositive(df, hn::Sub(m_old, m_use)), df, alpha + r);
    hn::Store(m_new, df, m + r);
    hn::Store(m_use, df, row_max + r);
  }
  return true;
}

/// Stores 32 probabilities as bf16 at row + c: rounded (one piece; row stride kW), or
/// split into hi at row + c and lo at row + kW + c (two pieces; row stride 2·kW).
template <int kPieces>
HWY_INLINE ATTN_AMX void StoreProbabilities(VF e0, VF e1, bf16* row, int c) {
  if (kPieces == 1) {
    StoreBf16x2(e0, e1, row + c);
  } else {
    SplitBf16(e0.raw, row + c, row + kW + c);
    SplitBf16(e1.raw, row + c + kLanes, row + kW + c + kLanes);
  }
}

/// The second half: p = e^(mult·s − m) per row, as bf16 into pb (kPieces per value,
/// StoreProbabilities; or, with keep_f32, as f32 back into s, for dropout), the sums l
/// ([kQ][kLanes], of the unrounded p) updated with alpha; between rows, the second
/// half of `job` keeps the tile unit busy. kAccurate: Exp2Accurate (9e-8) for f32
/// inputs taken as pieces, whose P keeps 16 bits; otherwise Exp2Probability (3.4e-6),
/// ample for P rounded to bf16 or f16.
template <int kPieces, bool kAccurate = false>
ATTN_AMX void Exponentials(float* s, int width, float mult, const float* m, const float* row_max,
                           const float* alpha, float* l, bf16* pb, bool keep_f32, TileJob& job) {
  const DF df;
  constexpr float kLog2e = 1.44269504088896341f;
  for (int r = 0; r < kQ; ++r) {
    float* row = s + r * kW;
    bf16* prow = pb + r * kPieces * kW;
    if (m[r] == -HUGE_VALF) {  // no visible key yet: p = 0 exactly
      if (keep_f32) {
        std::fill(row, row + width, 0.0f);
      } else {
        for (int piece = 0; piece < kPieces; ++piece) std::fill(prow + piece * kW, prow + piece * kW + width, bf16{0});
      }
      job.RunTo(kQ + r + 1, 2 * kQ);
      continue;
    }
    // In base 2 with one FMA, (s·mult·log2e) − m·log2e, when m·log2e is finite;
    // else (s·mult − m)·log2e, which cannot overflow.
    const float m2 = row_max[r] * kLog2e;
    const bool fused = std::isfinite(m2) || std::isnan(m2);
    const VF c1 = hn::Set(df, fused ? mult * kLog2e : mult), c0 = hn::Set(df, fused ? m2 : row_max[r]);
    VF sum0 = hn::Zero(df), sum1 = hn::Zero(df);
    for (int c = 0; c < width; c += 2 * kLanes) {
      VF x0 = hn::MulSub(hn::Load(df, row + c), c1, c0);
      VF x1 = hn::MulSub(hn::Load(df, row + c + kLanes), c1, c0);
      if (!fused) x0 = hn::Mul(x0, hn::Set(df, kLog2e)), x1 = hn::Mul(x1, hn::Set(df, kLog2e));
      const VF e0 = kAccurate ? Exp2Accurate(x0) : Exp2Probability(x0);
      const VF e1 = kAccurate ? Exp2Accurate(x1) : Exp2Probability(x1);
      sum0 = hn::Add(sum0, e0);
      sum1 = hn::Add(sum1, e1);
      if (keep_f32) {
        hn::Store(e0, df, row + c);
        hn::Store(e1, df, row + c + kLanes);
      } else {
        StoreProbabilities<kPieces>(e0, e1, prow, c);
      }
    }
    float* lr = l + r * kLanes;
    hn::Store(hn::MulAdd(hn::Load(df, lr), hn::Set(df, alpha[r]), hn::Add(sum0, sum1)), df, lr);
    job.RunTo(kQ + r + 1, 2 * kQ);
  }
}

/// Rounds (or splits) kQ rows × width f32 probabilities (row stride kW) into pb.
template <int kPieces>
ATTN_AMX void ProbabilitiesToBf16(const float* s, int width, bf16* pb) {
  const DF df;
  for (int r = 0; r < kQ; ++r) {
    for (int c = 0; c < width; c += 2 * kLanes) {
      StoreProbabilities<kPieces>(hn::Load(df, s + r * kW + c), hn::Load(df, s + r * kW + c + kLanes),
                                  pb + r * kPieces * kW, c);
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

/// out[c] = acc[c]·inv for c < dv (NaN everywhere when nan), in `to` (bf16 or f16,
/// rounded to nearest even, into out16) or f32 (into out32). acc holds dv rounded up
/// to 32 floats.
ATTN_AMX void WriteOutputRow(float* acc, int dv, float inv, bool nan, DType to, float* out32, bf16* out16) {
  const __m512 scale = _mm512_set1_ps(inv);
  for (int c = 0; c < dv; c += 16) {
    const __mmask16 m = static_cast<__mmask16>(dv - c >= 16 ? 0xFFFFu : (1u << (dv - c)) - 1);
    const __m512 x = nan ? _mm512_set1_ps(NAN) : _mm512_mul_ps(_mm512_loadu_ps(acc + c), scale);
    if (to == DType::bf16) {
      _mm256_mask_storeu_epi16(out16 + c, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)));
    } else if (to == DType::f16) {
      _mm256_mask_storeu_epi16(out16 + c, m, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    } else {
      _mm512_mask_storeu_ps(out32 + c, m, x);
    }
  }
}

/// The most query blocks one work item chains through its pipeline (ForwardGroup).
constexpr int kMaxGroup = 16;

/// The per-thread workspace of one work item: a group of up to kMaxGroup query
/// blocks. Scores and probabilities are double buffered: the tile unit fills one
/// block's scores and multiplies the previous block's probabilities while AVX-512
/// exponentiates the current one. O, l, m and the bands are per query block.
struct AmxScratch {
  float* s[2];   // [kQ][kW]  scores, then (with dropout) f32 probabilities
  bf16* pb[2];   // [kQ][pieces·kW]  probabilities as bf16 pieces
  float* o;      // [kMaxGroup][kQ][dvp] output accumulators
  float* l;      // [kMaxGroup][kQ][kLanes]
  float* m;      // [kMaxGroup][kQ]
  int* lo;       // [kMaxGroup][kQ]
  int* hi;       // [kMaxGroup][kQ]
  float* alpha;  // [kQ]  of the block being exponentiated
  float* tmp;    // [kQ]

  static size_t Floats(int dvp, int pieces) {
    return (2 + pieces) * size_t{kQ} * kW + size_t{kMaxGroup} * kQ * (dvp + kLanes + 3) + 2 * kQ;
  }
  AmxScratch(int dvp, int pieces) {
    float* base = thread_scratch(kSlotTile, Floats(dvp, pieces));
    s[0] = base;
    s[1] = base + kQ * kW;
    pb[0] = reinterpret_cast<bf16*>(base + 2 * kQ * kW);
    pb[1] = pb[0] + pieces * kQ * kW;
    o = base + (2 + pieces) * kQ * kW;
    l = o + static_cast<size_t>(kMaxGroup) * kQ * dvp;
    m = l + kMaxGroup * kQ * kLanes;
    lo = reinterpret_cast<int*>(m + kMaxGroup * kQ);
    hi = lo + kMaxGroup * kQ;
    alpha = reinterpret_cast<float*>(hi + kMaxGroup * kQ);
    tmp = alpha + kQ;
  }
};

/// How a head's query blocks are grouped into work items, and the order of each
/// group's key blocks.
struct GroupPlan {
  int group = 1;       // query blocks per work item (≤ kMaxGroup)
  int panel = 1 << 30; // keys per panel: a group visits panel by panel, every query block in turn
};

/// One block of keys [start, start + width) for query block g of the group.
struct KeyTask {
  int g, start, width;
};

/// One work item: query blocks qt0 … qt0 + count − 1 of sequence b, query head h.
/// The key blocks of all of them form one task list that runs through a two-stage
/// pipeline: while AVX-512 turns task t's scores into probabilities, the tile unit
/// computes task t+1's scores and adds task t−1's P·V into its block's O (both
/// interleaved row by row with the softmax, so neither unit waits for the other); O
/// is rescaled by task t's α once that P·V is in. Chaining the query blocks fills
/// and drains the pipeline once per group, not once per block, and ordering the
/// tasks panel by panel lets the blocks share each panel of K and V while it is in
/// L2. Each query block still sees its key blocks in the same order, so the result
/// is bitwise that of one block at a time.
ATTN_AMX void ForwardGroup(const Problem& p, const AmxLayout& lay, bf16* pack, int b, int h, int qt0, int count,
                           const GroupPlan& plan, bool tiles) {
  const Sequence& seq = p.seqs[b];
  const int hk = h / p.group();
  const int dvp = lay.dvp;
  AmxScratch w(dvp, lay.pieces);
  int slots = count;  // O accumulators in use: query block g takes slot g % slots
  auto o_of = [&](int g) { return w.o + static_cast<size_t>(g % slots) * kQ * dvp; };
  auto rows_of = [&](int g) { return std::min(kQ, seq.Lq - (qt0 + g) * kQ); };

  // Each query block's key blocks: every span of kW keys of its band but those
  // options.block_mask removes whole (thread-local, reused: an item may see
  // thousands of spans).
  thread_local std::vector<KeyTask> own, tasks;
  thread_local std::vector<int> own_end, cursor;
  own.clear(), own_end.clear();
  for (int g = 0; g < count; ++g) {
    const int i0 = (qt0 + g) * kQ, rows = rows_of(g);
    int* lo = w.lo + g * kQ;
    int* hi = w.hi + g * kQ;
    int jmin = seq.Lk, jmax = -1;
    for (int r = 0; r < rows; ++r) {
      BandOfRow(p, seq, i0 + r, &lo[r], &hi[r]);
      if (lo[r] <= hi[r]) jmin = std::min(jmin, lo[r]), jmax = std::max(jmax, hi[r]);
    }
    if (jmax >= 0) {
      const int first = jmin / kPair * kPair, end = RoundUp(jmax + 1, kPair);
      for (int j0 = first; j0 < end; j0 += kW) {
        const int width = std::min(kW, end - j0);
        if (BlockMaskCover(p, b, h, i0, rows, j0, std::min(width, seq.Lk - j0)) != Cover::kEmpty) {
          own.push_back({g, j0, width});
        }
      }
    }
    own_end.push_back(static_cast<int>(own.size()));
  }
  // Panel by panel, and within a panel query block by query block.
  tasks.clear();
  cursor.assign(count, 0);
  for (int g = 1; g < count; ++g) cursor[g] = own_end[g - 1];
  int panels = 0;
  for (; static_cast<int>(tasks.size()) < static_cast<int>(own.size()); ++panels) {
    for (int g = 0; g < count; ++g) {
      while (cursor[g] < own_end[g] && own[cursor[g]].start / plan.panel <= panels) tasks.push_back(own[cursor[g]++]);
    }
  }
  // With one panel the blocks run one after the other, and a block's O is written
  // out as soon as its last P·V is in (Finalize), so two slots take turns: the
  // accumulators stay in L1 as they would for one block at a time.
  if (panels <= 1) slots = std::min(count, 2);
  thread_local std::vector<int> last_task;
  last_task.assign(count, -1);
  for (int t = 0; t < static_cast<int>(tasks.size()); ++t) last_task[tasks[t].g] = t;
  // O of a query block is written by its first P·V (TileJob::o_fresh), not zeroed
  // here: a group's O is up to 256 KiB, and zeroing all of it up front evicts what
  // the first blocks need from L1 and L2.
  bool written[kMaxGroup] = {};
  std::fill(w.m, w.m + count * kQ, -HUGE_VALF);
  std::fill(w.l, w.l + count * kQ * kLanes, 0.0f);

  const bf16* k = lay.K(pack, p, b, hk);
  const bf16* v = lay.V(pack, p, b, hk);
  const bool mods = HasScoreMods(p), dropout = p.dropout_p > 0.0f;
  const int dc = lay.KChunks(), vc = lay.VGroups();
  const int ntasks = static_cast<int>(tasks.size());
  auto qk_job = [&](TileJob& job, int t) {
    job.tiles = tiles, job.pieces = lay.pieces;
    job.q = lay.Q(pack, p, b, h) + static_cast<size_t>(qt0 + tasks[t].g) * kQ * lay.QWidth();
    job.dp = lay.dp, job.s = w.s[t % 2];
    job.k = k + static_cast<size_t>(tasks[t].start / 16) * dc * kTile;
    job.qk_width = tasks[t].width;
  };
  auto pv_job = [&](TileJob& job, int t) {
    job.tiles = tiles, job.pieces = lay.pieces;
    job.pb = w.pb[t % 2], job.o = o_of(tasks[t].g), job.dvp = dvp;
    job.o_fresh = !written[tasks[t].g];
    written[tasks[t].g] = true;
    job.v = v + static_cast<size_t>(tasks[t].start / kPair) * vc * kTile;
    job.pv_width = tasks[t].width;
  };

  // Normalises block g's O and writes its rows out, as the f32 kernel does; once
  // its last P·V is in.
  auto Finalize = [&](int g) {
    // A block that saw no key has no O (its slot may be another block's): rows of 0.
    thread_local std::vector<float> zero_row;
    if (!written[g]) zero_row.assign(dvp, 0.0f);
    const int i0 = (qt0 + g) * kQ;
    const float* m = w.m + g * kQ;
    const float* l = w.l + g * kQ * kLanes;
    for (int r = 0; r < rows_of(g); ++r) {
      const int64_t at = seq.out_offset + h * p.out_head + int64_t{i0 + r} * p.out_row;
      const float sum = RowSum(l, r);
      const bool none = m[r] == -HUGE_VALF;
      const bool nan = std::isnan(m[r]) || std::isnan(sum);
      const float inv = none ? 0.0f : nan ? NAN : 1.0f / sum;
      float* acc = written[g] ? o_of(g) + static_cast<size_t>(r) * dvp : zero_row.data();
      const DType to = p.out_f32 ? DType::f32 : p.dtype;
      const bool out16 = to != DType::f32;
      WriteOutputRow(acc, p.dv, inv, nan, to, p.out + (out16 ? 0 : at),
                     reinterpret_cast<bf16*>(p.out) + (out16 ? at : 0));
      if (p.lse != nullptr) {
        p.lse[seq.lse_offset + h * p.lse_h + int64_t{i0 + r} * p.lse_i] =
            none ? -HUGE_VALF : static_cast<float>(double{m[r]} + std::log(double{sum}));
      }
    }
  };

  if (ntasks > 0) {
    TileJob first_scores;
    qk_job(first_scores, 0);
    first_scores.Start();
    first_scores.Finish();
  }
  int pending_pv = -1;  // a task whose P·V is still to be added
  for (int t = 0; t < ntasks; ++t) {
    const int g = tasks[t].g, j0 = tasks[t].start, width = tasks[t].width;
    const int i0 = (qt0 + g) * kQ, rows = rows_of(g);
    float* m = w.m + g * kQ;
    float* sc = w.s[t % 2];
    TileJob job;
    job.tiles = tiles, job.pieces = lay.pieces;
    if (t + 1 < ntasks) qk_job(job, t + 1);
    if (pending_pv >= 0) pv_job(job, pending_pv);
    job.Start();
    pending_pv = -1;

    // Modifiers and masks on each 64-key tile, in natural units. Without modifiers
    // only the band can remove keys, and −∞ is −∞ in any units: it masks the raw
    // products of the tiles it cuts (a causal diagonal's one or two) and the scale
    // is left to the softmax.
    float mult = p.scale;
    if (mods) {
      const DF df;
      for (int r = 0; r < kQ; ++r) {
        float* row = sc + r * kW;
        for (int c = 0; c < width; c += kLanes) {
          hn::Store(hn::Mul(hn::Load(df, row + c), hn::Set(df, p.scale)), df, row + c);
        }
      }
      mult = 1.0f;
    }
    for (int s0 = 0; s0 < width; s0 += kBk) {
      const TilePlace place{b, h, i0, rows, j0 + s0, std::min(kBk, seq.Lk - j0 - s0), w.lo + g * kQ, w.hi + g * kQ};
      const bool band = TileNeedsBand(place);
      if (mods || band) ApplyScoreMods(p, seq, place, sc + s0, kW, band);
    }
    const bool visible = UpdateMaxima(sc, width, mult, m, w.alpha, w.tmp, job);
    if (visible) {
      float* l = w.l + g * kQ * kLanes;
      if (p.split_f32()) {
        Exponentials<2, true>(sc, width, mult, m, w.tmp, w.alpha, l, w.pb[t % 2], dropout, job);
      } else if (lay.pieces == 2) {
        Exponentials<2>(sc, width, mult, m, w.tmp, w.alpha, l, w.pb[t % 2], dropout, job);
      } else {
        Exponentials<1>(sc, width, mult, m, w.tmp, w.alpha, l, w.pb[t % 2], dropout, job);
      }
      if (dropout) {
        for (int s0 = 0; s0 < width; s0 += kBk) ApplyDropout(p, b, h, i0, rows, j0 + s0, sc + s0, kW);
        if (lay.pieces == 2) {
          ProbabilitiesToBf16<2>(sc, width, w.pb[t % 2]);
        } else {
          ProbabilitiesToBf16<1>(sc, width, w.pb[t % 2]);
        }
      }
      pending_pv = t;
    }
    job.Finish();
    // O of block g now holds its key blocks before task t; scale it to t's maxima
    // (nothing to scale before g's first P·V).
    if (visible && written[g]) RescaleRows(o_of(g), dvp, w.alpha);
    // If task t − 1 was its block's last, that block is complete: the task's P·V
    // (if any) ran in this step.
    if (t > 0 && last_task[tasks[t - 1].g] == t - 1) Finalize(tasks[t - 1].g);
  }
  if (pending_pv >= 0) {
    TileJob last;
    pv_job(last, pending_pv);
    last.Start();
    last.Finish();
  }

  // The last task's block, and the blocks that had no task at all.
  for (int g = 0; g < count; ++g) {
    if (last_task[g] == ntasks - 1 || last_task[g] < 0) Finalize(g);
  }
}

/// Query blocks per work item and keys per panel for this call. A panel's packed K
/// and V take half of this core's L2 (the rest holds the scores, O and the query
/// blocks). When a head's K and V fit in one panel, each item is one query block, as
/// grouping gains nothing there (measured: level to a few percent slower at N ≤ 2048
/// in bf16, and coarser items balance causal work worse on 2 threads). Otherwise up to
/// kMaxGroup blocks share each panel, so a head's K and V are read from L3 once per
/// group instead of once per block, while every thread still gets ~8 items.
/// ATTN_AMX_GROUP and ATTN_AMX_PANEL override both (tests and measurements; the
/// results do not depend on them).
GroupPlan PlanGroups(const Problem& p, const AmxLayout& lay, int threads) {
  GroupPlan plan;
  int64_t qblocks = 0;
  int max_lk = 0;
  for (const Sequence& seq : p.seqs) {
    qblocks += int64_t{AmxLayout::QRows(seq.Lq) / kQ} * p.Hq;
    max_lk = std::max(max_lk, seq.Lk);
  }
  const size_t key_bytes = sizeof(bf16) * lay.pieces * (lay.dp + lay.dvp);
  plan.panel = static_cast<int>(std::clamp<size_t>(l2_cache_bytes() / 2 / key_bytes / kW, 1, 1 << 16)) * kW;
  if (max_lk > plan.panel) {
    plan.group = static_cast<int>(std::clamp<int64_t>(qblocks / (8 * int64_t{threads}), 1, kMaxGroup));
  }
  plan.group = env_override("ATTN_AMX_GROUP", 1, kMaxGroup, plan.group);
  plan.panel = env_override("ATTN_AMX_PANEL", 1, 1 << 30, plan.panel);
  return plan;
}

bool ForwardAmxImpl(const Problem& p, int threads, bool tiles) {
  const AmxLayout lay = MakeAmxLayout(p);
  // f16's hi/lo pieces take three products each: only the tile unit makes that pay.
  if (lay.pieces == 2 && !tiles) return false;
  bf16* pack = reinterpret_cast<bf16*>(thread_scratch(kSlotPackedKv, (lay.total + 1) / 2));

  struct Item {
    int b, h, t;
  };
  std::vector<Item> qpacks, kvpacks, blocks;
  double flops = 0;
  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[b];
    // Packing items cover every head of a chunk of tokens: the heads of a token
    // are adjacent in memory, so the reads stream instead of striding by H·d.
    for (int t = 0; t < AmxLayout::KRows(seq.Lk) / kPair; ++t) kvpacks.push_back({b, 0, t});
    for (int t = 0; t < AmxLayout::QRows(seq.Lq) / kQ; ++t) qpacks.push_back({b, 0, t});
    flops += 2.0 * seq.Lq * seq.Lk * (p.d + p.dv) * p.Hq;
  }
  const int nt = flops < 2e6 ? 1 : std::max(1, threads);
  const GroupPlan plan = PlanGroups(p, lay, nt);
  for (int b = 0; b < p.B; ++b) {
    const int nqt = AmxLayout::QRows(p.seqs[b].Lq) / kQ;
    for (int h = 0; h < p.Hq; ++h) {
      for (int t = 0; t < nqt; t += plan.group) blocks.push_back({b, h, t});
    }
  }
  const int nq = static_cast<int>(qpacks.size()), nkv = static_cast<int>(kvpacks.size());
  const bool heads_apart = p.k_head > p.k_row && p.v_head > p.v_row;
  const int nblocks = static_cast<int>(blocks.size());
  std::atomic<bool> nonfinite{false};
  OwnedRanges ranges(nblocks, nt);  // blocks are ordered by (b, h, t): a range is a few heads
  RunOnThreads(nt, [&] {
    bool bad = false;
    // Staging rows for inputs that need rounding or padding (thread scratch; the
    // work items below reuse the slot once packing is done).
    bf16* staging = reinterpret_cast<bf16*>(
        thread_scratch(kSlotTile, static_cast<size_t>(kPair) * lay.pieces * (lay.dp + lay.dvp)));
#pragma omp for schedule(static) nowait
    for (int i = 0; i < nq; ++i) {
      const Sequence& seq = p.seqs[qpacks[i].b];
      for (int h = 0; h < p.Hq; ++h) {
        if (h + 1 < p.Hq) PrefetchBlock(p, p.q, seq.q_offset + (h + 1) * p.q_head, p.q_row, p.d, qpacks[i].t, kQ, seq.Lq);
        bad |= PackQueries(p, lay, pack, qpacks[i].b, h, qpacks[i].t, staging);
      }
    }
    // This thread's chunks, as `omp for schedule(static)` would deal them.
    const int tid = omp_get_thread_num(), team = omp_get_num_threads();
    const int first = static_cast<int>(int64_t{nkv} * tid / team), last = static_cast<int>(int64_t{nkv} * (tid + 1) / team);
    if (heads_apart) {
      // [B, H, L, d] (SDPA's layout): a head's rows are contiguous, so each head's
      // chunks in turn read two streams the hardware prefetcher follows.
      for (int hk = 0; hk < p.Hkv; ++hk) {
        for (int i = first; i < last; ++i) bad |= PackKeysValues(p, lay, pack, kvpacks[i].b, hk, kvpacks[i].t, staging);
      }
    } else {
      for (int i = first; i < last; ++i) {
        const Sequence& seq = p.seqs[kvpacks[i].b];
        for (int hk = 0; hk < p.Hkv; ++hk) {
          if (hk + 1 < p.Hkv) {
            PrefetchBlock(p, p.k, seq.k_offset + (hk + 1) * p.k_head, p.k_row, p.d, kvpacks[i].t, kPair, seq.Lk);
            PrefetchBlock(p, p.v, seq.v_offset + (hk + 1) * p.v_head, p.v_row, p.dv, kvpacks[i].t, kPair, seq.Lk);
          }
          bad |= PackKeysValues(p, lay, pack, kvpacks[i].b, hk, kvpacks[i].t, staging);
        }
      }
    }
    if (bad) nonfinite.store(true);
#pragma omp barrier
    // Every thread reads the same flag after the barrier, so all or none of them
    // reach the work loop below.
    if (!nonfinite.load()) {
      if (tiles) ConfigureTiles();
      ranges.Run(omp_get_thread_num(),
                 [&](int i) {
                   const Item& it = blocks[i];
                   const int count = std::min(plan.group, AmxLayout::QRows(p.seqs[it.b].Lq) / kQ - it.t);
                   ForwardGroup(p, lay, pack, it.b, it.h, it.t, count, plan, tiles);
                 });
      if (tiles) ReleaseTiles();
    }
  });
  return !nonfinite.load();
}

size_t WorkspaceBytesImpl(const Problem& p, int threads) {
  const AmxLayout lay = MakeAmxLayout(p);
  return sizeof(bf16) * lay.total +
         sizeof(float) * static_cast<size_t>(std::max(1, threads)) * AmxScratch::Floats(lay.dvp, lay.pieces);
}

ATTN_AMX void ProbabilityExp2Impl(const float* x, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 m = static_cast<__mmask16>(n - i >= 16 ? 0xFFFFu : (1u << (n - i)) - 1);
    const VF e = Exp2Probability(VF{_mm512_maskz_loadu_ps(m, x + i)});
    _mm512_mask_storeu_ps(out + i, m, e.raw);
  }
}
#else
bool ForwardAmxImpl(const Problem&, int, bool) { return false; }
size_t WorkspaceBytesImpl(const Problem&, int) { return 0; }
void ProbabilityExp2Impl(const float*, float*, size_t) {}
#endif  // ATTN_AMX_KERNEL

}  // namespace

bool ForwardAmx(const Problem& p, int threads, bool tiles) { return ForwardAmxImpl(p, threads, tiles); }
size_t AmxWorkspaceBytes(const Problem& p, int threads) { return WorkspaceBytesImpl(p, threads); }
bool ProbabilityExp2(const float* x, float* out, size_t n) {
  if (!ATTN_AMX_KERNEL) return false;
  ProbabilityExp2Impl(x, out, n);
  return true;
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

bool attention_forward_amx(const Problem& p, int threads, LowpPath path) {
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3)
  return N_AVX3::ForwardAmx(p, threads, path == LowpPath::amx);
#else
  (void)p, (void)threads, (void)path;
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

bool probability_exp2(const float* x, float* out, size_t n) {
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3)
  const CpuFeatures& f = cpu_features();
  return (f.avx512_bf16 || f.amx_bf16) && N_AVX3::ProbabilityExp2(x, out, n);
#else
  (void)x, (void)out, (void)n;
  return false;
#endif
}

}  // namespace attn::detail
#endif  // HWY_ONCE
