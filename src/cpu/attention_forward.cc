// Fused attention forward on the CPU: FlashAttention-2's algorithm, with Highway
// SIMD (runtime dispatch) and OpenMP threads.
//
// For each work item (sequence b, query head h, tile of Bq queries):
//   O = 0, m = −∞, l = 0
//   for each key tile of Bk keys that the band leaves partly visible:
//     S = (scale·Q)·Kᵀ                QkBlock, K pre-packed as [d][Bk] panels
//     S = modifiers and masks (S)     ApplyScoreMods
//     P = e^(S − m_new), α = e^(m − m_new), l = α·l + rowsum(P)   SoftmaxTile
//     O = α·O + P·V                   PvRows, V pre-packed as [Bk][dvp]
//   out = O / l, lse = m + ln(l)      (rows with no visible key: 0 and −∞)
// Q·Kᵀ requests this tile's V panel into L2 while it runs, P·V the next K panel
// (SpreadPrefetch): at d = 128 one head's panels outgrow a 1.25 MiB L2.
// Non-finite inputs give the float64 reference's answer (see attention.hpp): NaN
// scores make their row NaN, removed keys never contribute — not even a NaN or
// infinite value, which a plain P·V would turn into 0·NaN — so key tiles whose
// V holds a non-finite number take a P·V that skips removed keys.
// The Lq×Lk matrix never exists; extra memory is the packed K/V (the size of k
// and v) plus one tile workspace per thread, both reused across calls.
#include "cpu/attention_forward.hpp"

#include <omp.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu/owned_ranges.hpp"
#include "cpu/thread_team.hpp"
#include "cpu/workspace.hpp"
#include "traffic.hpp"
#include "dropout/philox.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_forward.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "cpu/dropout_tile-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_kernels-inl.h"
#include "cpu/storage_rows-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace {

/// Where the packed K and V of each (sequence, kv head) start in the pack buffer.
struct PackLayout {
  int dvp = 0;                   // dv rounded up to a whole vector
  std::vector<size_t> seq_base;  // per sequence: offset of kv head 0's panels
  size_t total = 0;              // floats
  // Per (sequence, kv head, key tile): 1 when the tile's V holds a NaN or ±∞.
  std::vector<size_t> tile_base;  // per sequence: index of kv head 0, tile 0
  mutable std::vector<uint8_t> v_nonfinite;

  uint8_t& VNonFinite(const Problem& p, int b, int hk, int tile) const {
    return v_nonfinite[tile_base[b] + static_cast<size_t>(hk) * KeyTiles(p.seqs[b].Lk) + tile];
  }

  size_t HeadFloats(int lk, int d) const {
    return static_cast<size_t>(KeyTiles(lk)) * kBk * static_cast<size_t>(d + dvp);
  }
  float* K(float* pack, const Problem& p, int b, int hk) const {
    return pack + seq_base[b] + hk * HeadFloats(p.seqs[b].Lk, p.d);
  }
  float* V(float* pack, const Problem& p, int b, int hk) const {
    return K(pack, p, b, hk) + static_cast<size_t>(KeyTiles(p.seqs[b].Lk)) * kBk * p.d;
  }
};

PackLayout MakePackLayout(const Problem& p) {
  PackLayout pl;
  pl.dvp = RoundUp(p.dv, kLanes);
  pl.seq_base.resize(p.seqs.size());
  pl.tile_base.resize(p.seqs.size());
  size_t tiles = 0;
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    pl.seq_base[b] = pl.total;
    pl.total += p.Hkv * pl.HeadFloats(p.seqs[b].Lk, p.d);
    pl.tile_base[b] = tiles;
    tiles += static_cast<size_t>(p.Hkv) * KeyTiles(p.seqs[b].Lk);
  }
  pl.v_nonfinite.assign(tiles, 0);
  return pl;
}

/// Packs key tile `tile` of (b, hk): K transposed into a [d][Bk] panel, V into
/// [Bk][dvp] rows; keys beyond Lk up to the end of their vector, and columns
/// beyond dv, are zero (P is 0 there, and 0·0 keeps the products NaN-free).
/// bf16/f16 rows are widened here (f32 rows under Precision::bf16 rounded to bf16),
/// through `buf` (max(d, dv) floats): this is the only pass over K and V in their dtype.
/// The next kv head's rows of the same keys are requested meanwhile (PrefetchRows).
void PackTile(const Problem& p, const PackLayout& pl, float* pack, int b, int hk, int tile, float* buf) {
  const Sequence& seq = p.seqs[b];
  const int j0 = tile * kBk, nk = std::min(kBk, seq.Lk - j0);
  const int64_t k0 = seq.k_offset + hk * p.k_head + int64_t{j0} * p.k_row;
  const int64_t v0 = seq.v_offset + hk * p.v_head + int64_t{j0} * p.v_row;
  if (hk + 1 < p.Hkv) {
    PrefetchRows(p.dtype, p.k, k0 + p.k_head, p.k_row, p.d, 0, nk);
    PrefetchRows(p.dtype, p.v, v0 + p.v_head, p.v_row, p.dv, 0, nk);
  }
  // Only key vectors that hold a key are read (QkRows and PvRows stop at the last
  // key's vector), so a short last tile zeros no more than that vector's padding.
  const int zero_to = RoundUp(nk, kLanes);
  float* kt = pl.K(pack, p, b, hk) + static_cast<size_t>(tile) * kBk * p.d;
  const bool round = p.round_bf16();
  if (p.dtype == DType::f32 && !round) {
    PackPanel(p.k + k0, p.k_row, nk, p.d, kt, zero_to);
  } else {
    PackPanelRows([&](int j) { return RowF32(p.dtype, p.k, k0 + j * p.k_row, p.d, buf, round); }, nk, p.d, kt, 0,
                  zero_to);
  }
  float* v = pl.V(pack, p, b, hk) + static_cast<size_t>(j0) * pl.dvp;
  PackRowsFrom([&](int j) { return RowF32(p.dtype, p.v, v0 + j * p.v_row, p.dv, buf, round); }, nk, p.dv, pl.dvp, v,
               zero_to);
  pl.VNonFinite(p, b, hk, tile) = !AllFinite(v, static_cast<size_t>(zero_to) * pl.dvp);
  TrafficCounters::add(traffic().packed_bytes, static_cast<uint64_t>(nk) * (p.d + p.dv) * sizeof(float));
}

/// The per-thread tile workspace, carved from one reusable buffer.
struct TileScratch {
  float* q;      // [Bq][d]    scaled query rows (padding rows zero)
  float* s;      // [Bq][Bk]   scores, then probabilities
  float* kept;   // [Bq][Bk]   the scores before the softmax, for tiles whose V is not finite
  float* o;      // [Bq][dvp]  unnormalised output accumulator
  float* m;      // [Bq]       running max
  float* l;      // [Bq][N]    running sums, one vector of partial sums per row
  float* alpha;  // [Bq]       rescale factors of the current tile
  float* tmp;    // [Bq]       row maxima
  int* lo;       // [Bq]       band per row
  int* hi;       // [Bq]
  int* first;    // [Bq / kRowsPerBlock] per row block: first key vector of the tile it sees
  int* count;    // [Bq / kRowsPerBlock] and how many (0: none)
  float* row;    // [max(d, dvp)] one q row widened from bf16/f16, or one output row

  /// Floats of the workspace (what WorkspaceBytes counts per thread).
  static size_t Floats(int d, int dvp) {
    return RowFloats(d, dvp) + (size_t{kBq} * d + 15) / 16 * 16 + size_t{kBq} * (2 * kBk + dvp + 8 + kLanes) + 64;
  }
  static size_t RowFloats(int d, int dvp) { return (static_cast<size_t>(std::max(d, dvp)) + 15) / 16 * 16; }

  TileScratch(int d, int dvp) {
    const size_t qf = size_t{kBq} * d, sf = size_t{kBq} * kBk, of = size_t{kBq} * dvp;
    // Each piece starts on a 64-byte boundary (all sizes are multiples of 16 floats).
    const size_t qf16 = (qf + 15) / 16 * 16;
    float* base = thread_scratch(kSlotTile, Floats(d, dvp));
    row = base;
    q = row + RowFloats(d, dvp);
    s = q + qf16;
    kept = s + sf;
    o = kept + sf;
    l = o + of;
    m = l + kBq * kLanes;
    alpha = m + kBq;
    tmp = alpha + kBq;
    lo = reinterpret_cast<int*>(tmp + kBq);
    hi = lo + kBq;
    first = hi + kBq;
    count = first + kBq;
  }
};

/// Loads the query tile whose row 0 is element q0 of p.q, scaled by `scale` (so S
/// needs no extra multiply; bf16/f16 rows widened through buf); zeros the padding
/// rows up to `rows_used`, the rows the row blocks read.
void LoadQueryTile(const Problem& p, int64_t q0, int rows, int rows_used, float* dst, float* buf) {
  const float scale = p.scale;
  for (int r = 0; r < rows_used; ++r) {
    float* row = dst + static_cast<size_t>(r) * p.d;
    if (r < rows) {
      const float* src = RowF32(p.dtype, p.q, q0 + int64_t{r} * p.q_row, p.d, buf, p.round_bf16());
      for (int c = 0; c < p.d; ++c) row[c] = src[c] * scale;
    } else {
      std::fill(row, row + p.d, 0.0f);
    }
  }
}

/// S for the tile plus modifiers and masks. Each block of kRowsPerBlock rows
/// computes only the key vectors its rows' bands reach (on a causal diagonal,
/// about 5/8 of the tile) and records that range for the P·V product; the other
/// scores are −∞. Only the first rows_used rows (whole blocks) are written.
void ScoreTile(const Problem& p, const Sequence& seq, const TileScratch& w, const float* kt,
               const TilePlace& place, int rows_used, const PanelSlices& prefetch = {}) {
  for (int r = 0, blk = 0; r < rows_used; r += kRowsPerBlock, ++blk) {
    SpreadPrefetch pf(prefetch.Slice(blk), prefetch.SliceLines(blk), p.d);
    BlockKeyVectors(w.lo, w.hi, r, place.rows, place.j0, &w.first[blk], &w.count[blk]);
    QkRows(w.q + static_cast<size_t>(r) * p.d, p.d, kt, p.d, w.s + r * kBk, kBk, w.first[blk],
           w.count[blk], &pf);
  }
  ApplyScoreMods(p, seq, place, w.s, kBk, TileNeedsBand(place));
}

/// One work item: sequence b, query head h, query tile qt.
void ForwardTile(const Problem& p, const PackLayout& pl, float* pack, int b, int h, int qt) {
  const Sequence& seq = p.seqs[b];
  const int hk = h / p.group();
  const int i0 = qt * kBq, rows = std::min(kBq, seq.Lq - i0);
  // Whole row blocks past the last real row see no key (their scores are −∞ and
  // P·V skips them), so a short tile does only its own blocks' work: the softmax,
  // the zeroing and the query load of 64 rows were most of a one-token call.
  const int rows_used = RoundUp(rows, kRowsPerBlock);
  const int dvp = pl.dvp;
  TileScratch w(p.d, dvp);

  // Band per row; the tile's key range is the union of the rows' bands.
  int jmin = seq.Lk, jmax = -1;
  for (int r = 0; r < rows; ++r) {
    BandOfRow(p, seq, i0 + r, &w.lo[r], &w.hi[r]);
    if (w.lo[r] <= w.hi[r]) jmin = std::min(jmin, w.lo[r]), jmax = std::max(jmax, w.hi[r]);
  }
  LoadQueryTile(p, seq.q_offset + h * p.q_head + int64_t{i0} * p.q_row, rows, rows_used, w.q, w.row);
  std::fill(w.o, w.o + static_cast<size_t>(rows_used) * dvp, 0.0f);
  std::fill(w.m, w.m + kBq, -HUGE_VALF);
  std::fill(w.l, w.l + rows_used * kLanes, 0.0f);

  const float* kpack = pl.K(pack, p, b, hk);
  const float* vpack = pl.V(pack, p, b, hk);
  const int t_first = jmax < 0 ? 0 : jmin / kBk, t_last = jmax < 0 ? -1 : jmax / kBk;
  for (int t = t_first; t <= t_last; ++t) {
    const int j0 = t * kBk;
    const TilePlace place{b, h, i0, rows, j0, std::min(kBk, seq.Lk - j0), w.lo, w.hi};
    // A tile the block mask removes whole adds nothing (as a tile of −∞ would not).
    if (BlockMaskCover(p, b, h, i0, rows, j0, place.cols) == Cover::kEmpty) continue;
    // Each phase requests the next one's panel (SpreadPrefetch): the products of
    // Q·Kᵀ this tile's V, those of P·V the next K panel, or after the last tile this
    // head's first again, which the next query tile (of the same head, in the order
    // the tiles are dealt) starts on.
    const int blocks = rows_used / kRowsPerBlock;
    const float* vt = vpack + static_cast<size_t>(j0) * dvp;
    const PanelSlices v_slices(vt, sizeof(float) * kBk * dvp, blocks);
    const PanelSlices k_next_slices(kpack + static_cast<size_t>(t < t_last ? t + 1 : t_first) * kBk * p.d,
                                    sizeof(float) * kBk * p.d, blocks);
    ScoreTile(p, seq, w, kpack + static_cast<size_t>(t) * kBk * p.d, place, rows_used, v_slices);
    const bool careful = pl.VNonFinite(p, b, hk, t) != 0;
    if (careful) std::memcpy(w.kept, w.s, sizeof(float) * rows_used * kBk);
    if (!SoftmaxTile(w.s, kBk, rows_used, w.m, w.l, w.alpha, w.tmp)) continue;
    if (p.dropout_p > 0.0f) ApplyDropout(p, b, h, i0, rows, j0, w.s, kBk);
    for (int r = 0, blk = 0; r < rows_used; r += kRowsPerBlock, ++blk) {
      const int jb = w.first[blk] * kLanes, nk = w.count[blk] * kLanes;
      SpreadPrefetch pf(k_next_slices.Slice(blk), k_next_slices.SliceLines(blk), PvSteps(dvp, nk));
      // A block that saw no key of this tile kept its max: α = 1, nothing to add.
      if (w.count[blk] <= 0) continue;
      if (careful) {
        PvRowsGated(w.s + r * kBk + jb, kBk, 1, w.kept + r * kBk + jb, kBk, 1, -HUGE_VALF,
                    vt + static_cast<size_t>(jb) * dvp, dvp, nk, w.alpha + r,
                    w.o + static_cast<size_t>(r) * dvp);
      } else {
        PvRows(w.s + r * kBk + jb, kBk, 1, vt + static_cast<size_t>(jb) * dvp, dvp, nk,
               w.alpha + r, w.o + static_cast<size_t>(r) * dvp, &pf);
      }
    }
  }

  // Normalise and write out; rows that saw no visible key give 0 and lse −∞;
  // rows whose max or sum is NaN (a NaN score) give NaN.
  const DType out_dtype = p.out_f32 ? DType::f32 : p.dtype;
  for (int r = 0; r < rows; ++r) {
    const float* acc = w.o + static_cast<size_t>(r) * dvp;
    const float sum = RowSum(w.l, r);
    const bool none = w.m[r] == -HUGE_VALF;
    const bool nan = std::isnan(w.m[r]) || std::isnan(sum);
    const float inv = none ? 0.0f : nan ? NAN : 1.0f / sum;
    for (int c = 0; c < p.dv; ++c) w.row[c] = acc[c] * inv;
    if (nan) std::fill(w.row, w.row + p.dv, NAN);
    StoreRowF32(out_dtype, p.out, seq.out_offset + h * p.out_head + int64_t{i0 + r} * p.out_row, w.row, p.dv);
    if (p.lse != nullptr) {
      // In double, so that m (a score, exact) is not rounded against ln(l).
      p.lse[seq.lse_offset + h * p.lse_h + int64_t{i0 + r} * p.lse_i] =
          none ? -HUGE_VALF : static_cast<float>(double{w.m[r]} + std::log(double{sum}));
    }
    w.alpha[r] = inv;  // kept for the probabilities below
  }

  // Explicit probabilities (for pictures / need_weights): recompute each visible
  // tile's scores and write 2^(s − m)/l, as a plain softmax would; everything
  // else is 0. (exp(s − lse) would be cheaper but carries lse's absolute rounding,
  // eps·|lse|, into every probability.) Highway's Exp here: masked keys give 0
  // exactly, where the softmax's fast exp gives ~1e-38.
  if (p.probs != nullptr) {
    const DF df;
    for (int r = 0; r < rows; ++r) {
      float* dst = p.probs + seq.probs_offset + h * p.probs_h + int64_t{i0 + r} * p.probs_i;
      std::fill(dst, dst + p.probs_cols, 0.0f);
    }
    for (int t = t_first; t <= t_last; ++t) {
      const int j0 = t * kBk, cols = std::min(kBk, seq.Lk - j0);
      const TilePlace place{b, h, i0, rows, j0, cols, w.lo, w.hi};
      if (BlockMaskCover(p, b, h, i0, rows, j0, cols) == Cover::kEmpty) continue;
      ScoreTile(p, seq, w, kpack + static_cast<size_t>(t) * kBk * p.d, place, rows_used);
      for (int r = 0; r < rows; ++r) {
        if (w.m[r] == -HUGE_VALF) continue;  // no visible key: the row stays 0
        float* row = w.s + r * kBk;
        const VF m = hn::Set(df, w.m[r]), inv_l = hn::Set(df, w.alpha[r]);
        for (int n = 0; n < kKeyVectors; ++n) {
          const VF x = hn::Load(df, row + n * kLanes);
          const VF e = hn::IfThenZeroElse(hn::Eq(x, hn::Set(df, -HUGE_VALF)), hn::Exp(df, hn::Sub(x, m)));
          hn::Store(hn::Mul(e, inv_l), df, row + n * kLanes);
        }
      }
      if (p.dropout_p > 0.0f) ApplyDropout(p, b, h, i0, rows, j0, w.s, kBk);
      for (int r = 0; r < rows; ++r) {
        float* dst = p.probs + seq.probs_offset + h * p.probs_h + int64_t{i0 + r} * p.probs_i + j0;
        if (w.m[r] != -HUGE_VALF) std::memcpy(dst, w.s + r * kBk, sizeof(float) * cols);
      }
    }
  }
}

}  // namespace

void ForwardF32(const Problem& p, int threads) {
  const PackLayout pl = MakePackLayout(p);
  float* pack = thread_scratch(kSlotPackedKv, pl.total);

  // Work lists: key tiles to pack, and (sequence, head, query tile) items.
  struct Item {
    int b, h, t;
  };
  std::vector<Item> packs, tiles;
  double flops = 0;
  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[b];
    // Tile by tile, and within a tile head by head, so that PackTile can request
    // the next head's rows of the same keys while it packs this head's.
    for (int t = 0; t < KeyTiles(seq.Lk); ++t) {
      for (int hk = 0; hk < p.Hkv; ++hk) packs.push_back({b, hk, t});
    }
    const int qtiles = QueryTiles(seq.Lq);
    for (int h = 0; h < p.Hq; ++h) {
      for (int t = 0; t < qtiles; ++t) tiles.push_back({b, h, t});
    }
    flops += 2.0 * seq.Lq * seq.Lk * (p.d + p.dv) * p.Hq;
  }
  // Threads cost a few microseconds to wake; tiny problems run on the caller.
  const int nt = flops < 2e6 ? 1 : std::max(1, threads);
  const int npacks = static_cast<int>(packs.size()), ntiles = static_cast<int>(tiles.size());
  // Tiles are ordered by (b, h, t): each thread's range is a few heads, whose packed
  // K/V stay in its L2; the ranges' ends are shared out as causal and windowed tiles
  // differ in cost. Each item is computed the same way on any thread, so the
  // schedule cannot change any bit of the result.
  OwnedRanges ranges(ntiles, nt);
  RunOnThreads(nt, [&] {
    float* row_buf = TileScratch(p.d, pl.dvp).row;  // this thread's tile workspace, reused below
#pragma omp for schedule(static)
    for (int i = 0; i < npacks; ++i) PackTile(p, pl, pack, packs[i].b, packs[i].h, packs[i].t, row_buf);
    ranges.Run(omp_get_thread_num(), [&](int i) { ForwardTile(p, pl, pack, tiles[i].b, tiles[i].h, tiles[i].t); });
  });
}

size_t WorkspaceBytes(const Problem& p, int threads) {
  const PackLayout pl = MakePackLayout(p);
  return sizeof(float) * (pl.total + static_cast<size_t>(std::max(1, threads)) * TileScratch::Floats(p.d, pl.dvp));
}

const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

void SoftmaxExp2(const float* x, float* out, size_t n) {
  const DF df;
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) hn::StoreU(Exp2NonPositive(df, hn::LoadU(df, x + i)), df, out + i);
  if (i < n) {  // the tail through one padded vector, as the kernels see whole vectors
    alignas(64) float buf[kLanes];
    std::fill(buf, buf + kLanes, 0.0f);
    std::copy(x + i, x + n, buf);
    hn::Store(Exp2NonPositive(df, hn::Load(df, buf)), df, buf);
    std::copy(buf, buf + (n - i), out + i);
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(ForwardF32);
HWY_EXPORT(TargetName);
HWY_EXPORT(SoftmaxExp2);
HWY_EXPORT(WorkspaceBytes);

size_t attention_forward_workspace_bytes(const Problem& p, int threads) {
  return HWY_DYNAMIC_DISPATCH(WorkspaceBytes)(p, threads);
}

void attention_forward_cpu(const Problem& p, int threads) {
  if (p.dtype != DType::f32 && p.dtype != DType::bf16 && p.dtype != DType::f16)
    throw std::logic_error("attention_forward_cpu: q, k, v must be f32, bf16 or f16");
  HWY_DYNAMIC_DISPATCH(ForwardF32)(p, threads);
}

const char* attention_forward_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

void softmax_exp2(const float* x, float* out, size_t n) { HWY_DYNAMIC_DISPATCH(SoftmaxExp2)(x, out, n); }

std::vector<int64_t> simd_targets() {
  std::vector<int64_t> out;
  for (int64_t t = hwy::SupportedTargets() & HWY_TARGETS; t != 0; t &= t - 1) out.push_back(t & -t);
  return out;
}

void force_simd_target(int64_t target) { hwy::SetSupportedTargetsForTest(target); }

}  // namespace attn::detail
#endif  // HWY_ONCE
