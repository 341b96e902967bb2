// Fused attention backward on the CPU: FlashAttention-2's algorithm, deterministic.
//
//   D_i = rowsum(dO ∘ O); scale·Q, dO packed per query tile    (phase 1)
//   softmax statistics of rows with huge |lse| (RowStats)       (phase 2)
//   for each key tile (a work item, owning its dK and dV):      (phase 3)
//     K, Kᵀ, Vᵀ packed into the item's scratch (PackKeyTile)
//     for each query head of its kv group, each query tile its band reaches:
//       S  = (scale·Q)·Kᵀ, modified and masked, P = exp(S − lse)  (recomputed, in
//            natural units: see BackwardTilePair on keeping P accurate)
//       dV += P'ᵀ·dO                     P' = P with dropout applied
//       dP = dO·Vᵀ (dropout applied), dS = P ∘ (dP − D)   (then softcap', score_mod')
//       dK += scale·dSᵀ·Q
//       dQ += scale·dS·K                  added in ascending key-tile order (below),
//                                          into the query tile's packed dQ sum
//   dq = each query tile's dQ sum                               (phase 4)
//
// Non-finite inputs: products with a zero factor of a key that takes no part
// (a removed key, score −∞) would turn a NaN or ∞ in q, k, v or dO into NaN
// gradients where the float64 reference has none; tile pairs holding such
// numbers take GEMMs that skip removed keys (PvRowsGated). Rows
// whose |lse| is so large that f32 rounding of lse would distort P = e^(S − lse)
// (huge finite masks on every key, as Hugging Face's padding masks put there)
// get their max and sum recomputed (RowStats).
//
// Determinism without atomics on data: every (query head, query tile) has a turn
// counter; key tile t adds its dQ contribution only when the counter says t, then
// passes it on, so dQ is summed in the same order for any number of threads. Work
// items are handed out in ascending order (OpenMP's monotonic dynamic schedule),
// so the tile whose turn it is has always been started: no deadlock. dK and dV
// are private to their item and summed in a fixed order.
//
// bf16/f16 calls run here too: rows are widened where they are packed (exactly) and
// the gradients rounded once where they are written (storage_rows-inl.h), so a call
// makes no f32 copy of a tensor; f32 rows under Precision::bf16 are rounded to bf16
// where they are packed.
#include "cpu/attention_backward.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <vector>

#include "cpu/thread_team.hpp"
#include "cpu/workspace.hpp"
#include "dropout/dropout_at.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_backward.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "cpu/score_mods-inl.h"
#include "cpu/storage_rows-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace {

/// Packed operands of a call, per query tile of each (sequence, query head): scale·Q
/// as [Bq][dp] rows and dO as [Bq][dvp] rows, zero padded, and the tile's dQ sum
/// [Bq][dp]. Every key tile pairs with each query tile of its band; when each pair
/// gathered and scaled its own query and dO rows from the strided tensors (rows
/// H·d floats apart), that copy took ~20% of the f32 backward's time on a Zen 1 core
/// (perf, d = 64), and adding its dQ into dq's strided rows another ~9%. Packed,
/// one contiguous block per query tile, they are read and summed in place.
/// Key tiles are packed by the work item that owns them (PackKeyTile), into its
/// thread's scratch: packing them all first wrote and read back 3·Lk·d floats per kv
/// head through L3 (12 MiB at 1,024 keys, 8 heads, d = 128), which cost a call with
/// few queries most of its time.
struct BwdPack {
  int dp = 0, dvp = 0;
  size_t total = 0;
  std::vector<size_t> q_seq_base;             // per sequence: offset of head 0's query tiles
  std::vector<size_t> q_tile_base;            // per sequence: index of head 0, query tile 0
  mutable std::vector<uint8_t> q_nonfinite;   // per query tile: Q or dO holds a NaN or ±∞
  uint8_t& QueryNonFinite(const Problem& p, int b, int h, int qt) const {
    return q_nonfinite[q_tile_base[b] + static_cast<size_t>(h) * QueryTiles(p.seqs[b].Lq) + qt];
  }
  size_t QueryTileFloats() const { return size_t{kBq} * (2 * dp + dvp); }
  /// Query tile qt of (b, h): scale·Q rows (row stride dp), dO rows (dvp), then
  /// the dQ sum's rows (dp).
  float* QueryTile(float* pack, const Problem& p, int b, int h, int qt) const {
    return pack + q_seq_base[b] +
           (static_cast<size_t>(h) * QueryTiles(p.seqs[b].Lq) + qt) * QueryTileFloats();
  }
};

BwdPack MakeBwdPack(const Problem& p) {
  BwdPack pk;
  pk.dp = RoundUp(p.d, kLanes);
  pk.dvp = RoundUp(p.dv, kLanes);
  pk.q_seq_base.resize(p.seqs.size());
  pk.q_tile_base.resize(p.seqs.size());
  size_t qtiles = 0;
  for (size_t b = 0; b < p.seqs.size(); ++b) {
    pk.q_seq_base[b] = pk.total;
    pk.total += static_cast<size_t>(p.Hq) * QueryTiles(p.seqs[b].Lq) * pk.QueryTileFloats();
    pk.q_tile_base[b] = qtiles;
    qtiles += static_cast<size_t>(p.Hq) * QueryTiles(p.seqs[b].Lq);
  }
  pk.q_nonfinite.assign(qtiles, 0);
  return pk;
}

/// Zeros rows × heads × width elements of dtype dt from element `at` of base (row
/// and head strides in elements). Zero is all-zero bits in f32, bf16 and f16 alike.
void ZeroRows(DType dt, void* base, int64_t at, int64_t row_stride, int64_t head_stride, int64_t rows, int heads,
              int width) {
  const size_t elem = dtype_size(dt);
  char* bytes = static_cast<char*>(base);
  for (int64_t r = 0; r < rows; ++r) {
    for (int h = 0; h < heads; ++h) {
      std::memset(bytes + static_cast<size_t>(at + r * row_stride + h * head_stride) * elem, 0, elem * width);
    }
  }
}

/// Key rows of the dK and dV accumulators: the key-row GEMMs run in blocks of
/// kRowsPerBlock rows, which need not divide Bk (AVX2: 3 rows, 32 keys), so the
/// last block writes a padding row (discarded) and reads one float past its tile
/// (each tile has kLanes of slack).
constexpr int kBkRows = (kBk + kRowsPerBlock - 1) / kRowsPerBlock * kRowsPerBlock;

/// Per-item scratch, carved from the thread's reusable buffer.
struct BwdScratch {
  float *dk, *dv;        // [BkRows][dp], [BkRows][dvp]  the item's gradient accumulators
  float* q;              // [Bq][dp]             query tile, scaled (RowStats)
  float *s, *p, *ds;     // [Bq][Bk] each        scores → P, dropped P', dP → dS
  float* kept;           // [Bq][Bk]             final scores (−∞: removed key)
  float* drop;           // [Bq][Bk]             dropout multipliers: 0 or 1/(1 − p)
  float *raw, *pre_mod;  // [Bq][Bk] each        kept for softcap' / score_mod'
  float* dq;             // [Bq][dp]             this tile's dQ contribution
  float *lse, *dsum;     // [Bq]                 softmax max (lse) and D per row
  float* inv_l;          // [Bq]                 1 / softmax sum (1 when lse is used)
  float* key_tile;       // KeyTileFloats        the item's packed key tile (PackKeyTile)
  float* row;            // [max(dp, dvp)]       a bf16/f16 row widened (RowF32)
  int *lo, *hi, *first, *count;

  /// The packed key tile's floats: its K and V panels and K rows (d ≤ dp, dv ≤ dvp).
  static size_t KeyTileFloats(int dp, int dvp) { return size_t{kBk} * (2 * dp + dvp) + kLanes; }
  static size_t Floats(int dp, int dvp) {
    const size_t tile = size_t{kBq} * kBk + kLanes;
    return size_t{kBkRows} * (dp + dvp) + size_t{kBq} * 2 * dp + 7 * tile + 7 * size_t{kBq} +
           KeyTileFloats(dp, dvp) + std::max(dp, dvp) + 64;
  }
  BwdScratch(int dp, int dvp) {
    const size_t tile = size_t{kBq} * kBk + kLanes;
    float* x = thread_scratch(kSlotTile, Floats(dp, dvp));
    key_tile = x, x += KeyTileFloats(dp, dvp);
    row = x, x += std::max(dp, dvp);
    dk = x, x += size_t{kBkRows} * dp;
    dv = x, x += size_t{kBkRows} * dvp;
    q = x, x += size_t{kBq} * dp;
    dq = x, x += size_t{kBq} * dp;
    s = x, x += tile;
    p = x, x += tile;
    ds = x, x += tile;
    kept = x, x += tile;
    drop = x, x += tile;
    raw = x, x += tile;
    pre_mod = x, x += tile;
    lse = x, x += kBq;
    dsum = x, x += kBq;
    inv_l = x, x += kBq;
    lo = reinterpret_cast<int*>(x), hi = lo + kBq, first = hi + kBq, count = first + kBq;
  }
};

/// Everything a work item needs, shared by all items of a call.
struct BwdShared {
  const BackwardProblem& bp;
  const BwdPack& pack_layout;
  float* pack;
  const float* dsum;                           // D, per (sequence, head, row)
  float* row_m;                                // softmax max per row (= lse usually)
  float* row_inv_l;                            // and 1 / sum (= 1 usually): P = e^(S − m) / l
  const std::vector<size_t>& dsum_base;        // per sequence
  std::atomic<int>* turns;                     // per (sequence, head, query tile)
  const std::vector<size_t>& turn_base;        // per sequence
  const std::vector<std::vector<int>>& qt_first;  // per sequence, per query tile
  const std::vector<std::vector<int>>& qt_last;
};

/// Key tile kt of (sequence b, kv head hk), packed for its tile pairs: a [d][Bk] panel
/// of K (for S = Q·Kᵀ), a [dv][Bk] panel of V (for dP = dO·Vᵀ) and [Bk][dp] rows of K
/// (for dQ = dS·K), and whether K or V holds a NaN or ±∞.
struct KeyTile {
  const float *kpanel, *vpanel, *krows;
  bool nonfinite;
};

/// Packs key tile kt of (b, hk) into dst (BwdScratch::KeyTileFloats floats). Only key
/// vectors that hold a key are read (QkRows stops at the last key's vector; the dQ
/// product reads nk rows), so a short tile zeros and scans no more than that vector's
/// padding, as the forward's PackTile. bf16/f16 rows (and f32 ones rounded under
/// Precision::bf16) are widened through buf (max(d, dv) floats) into rows, which the
/// panels are then transposed from (V through the K rows' space, where it fits).
KeyTile PackKeyTile(const Problem& p, int dp, int b, int hk, int kt, float* dst, float* buf) {
  const Sequence& seq = p.seqs[b];
  const int j0 = kt * kBk, nk = std::min(kBk, seq.Lk - j0);
  const int64_t k0 = seq.k_offset + hk * p.k_head + int64_t{j0} * p.k_row;
  const int64_t v0 = seq.v_offset + hk * p.v_head + int64_t{j0} * p.v_row;
  const int zero_to = RoundUp(nk, kLanes);
  float* vpanel = dst + size_t{kBk} * p.d;
  float* krows = vpanel + size_t{kBk} * p.dv;
  const bool round = p.round_bf16();
  if (p.dtype == DType::f32 && !round) {
    PackPanel(p.k + k0, p.k_row, nk, p.d, dst, zero_to);
    PackPanel(p.v + v0, p.v_row, nk, p.dv, vpanel, zero_to);
    PackRows(p.k + k0, p.k_row, nk, p.d, dp, krows, zero_to);
  } else {
    const auto k_row = [&](int j) { return RowF32(p.dtype, p.k, k0 + j * p.k_row, p.d, buf, round); };
    const auto v_row = [&](int j) { return RowF32(p.dtype, p.v, v0 + j * p.v_row, p.dv, buf, round); };
    if (p.dv <= dp) {
      // V widened into the K rows' space first, so that its panel is PackPanel's vector
      // transpose too rather than a float at a time.
      PackRowsFrom(v_row, nk, p.dv, dp, krows, zero_to);
      PackPanel(krows, dp, nk, p.dv, vpanel, zero_to);
    } else {
      PackPanelRows(v_row, nk, p.dv, vpanel, 0, zero_to);
    }
    PackRowsFrom(k_row, nk, p.d, dp, krows, zero_to);
    PackPanel(krows, dp, nk, p.d, dst, zero_to);
  }
  bool finite = AllFinite(krows, size_t(zero_to) * dp);  // K, row by row
  for (int c = 0; c < p.dv && finite; ++c) finite = AllFinite(vpanel + size_t(c) * kBk, zero_to);
  return {dst, vpanel, krows, !finite};
}

/// Waits until it is key tile kt's turn to add into dQ of (sequence b, head h, query
/// tile qt); the caller stores kt + 1 into the returned counter when done.
std::atomic<int>& WaitTurn(const BwdShared& sh, int b, int h, int kt, int qt) {
  std::atomic<int>& turn = sh.turns[sh.turn_base[b] + size_t(h) * QueryTiles(sh.bp.fwd.seqs[b].Lq) + qt];
  while (turn.load(std::memory_order_acquire) != kt) {
#if HWY_ARCH_X86
    __builtin_ia32_pause();
#endif
  }
  return turn;
}

/// One (sequence b, kv head hk, key tile kt) item's work for query head h, tile qt.
void BackwardTilePair(const BwdShared& sh, BwdScratch& w, const KeyTile& key, int b, int h, int kt, int qt) {
  const BackwardProblem& bp = sh.bp;
  const Problem& p = bp.fwd;
  const Sequence& seq = p.seqs[b];
  const int dp = sh.pack_layout.dp, dvp = RoundUp(p.dv, kLanes);
  const int i0 = qt * kBq, rows = std::min(kBq, seq.Lq - i0);
  const int j0 = kt * kBk, nk = std::min(kBk, seq.Lk - j0);
  // Only whole row blocks up to the last query row, and key row blocks up to the
  // last key, carry anything (the rest are padding: no key, P = 0), so a short tile
  // skips the others, as the forward does.
  const int rows_used = RoundUp(rows, kRowsPerBlock), keys_used = RoundUp(nk, kRowsPerBlock);
  const float *kpanel = key.kpanel, *vpanel = key.vpanel, *krows = key.krows;
  // The query tile's scale·Q and dO rows, packed in phase 1 (padding rows are zero).
  float* const qtile = sh.pack_layout.QueryTile(sh.pack, p, b, h, qt);
  const float* q = qtile;
  const float* dout = q + size_t{kBq} * dp;
  const DF df;

  // Query rows: lse, D and the band. The backward works in natural units:
  // P = exp(S − lse) is formed as 2^((S − lse)·log₂e). S − lse is exact when the
  // two are close, so the rounding of the base-2 conversion applies to the small
  // difference; converting S and lse to base 2 first (as the forward does) would
  // cost eps·|lse| in every P, visible in dbias.
  const size_t row0 = sh.dsum_base[b] + size_t(h) * seq.Lq + i0;
  for (int r = 0; r < rows_used; ++r) {
    if (r < rows) {
      w.dsum[r] = sh.dsum[row0 + r];
      w.inv_l[r] = sh.row_inv_l[row0 + r];
      w.lse[r] = sh.row_m[row0 + r];
      BandOfRow(p, seq, i0 + r, &w.lo[r], &w.hi[r]);
    } else {
      w.lse[r] = -HUGE_VALF, w.dsum[r] = 0.0f, w.inv_l[r] = 1.0f;
    }
  }
  const bool careful = key.nonfinite || sh.pack_layout.QueryNonFinite(p, b, h, qt) != 0;

  // S (only the key vectors each 4-row block's band reaches), modifiers, masks.
  // Two products request what a later step reads first and the last pair pushed out
  // of L2 (SpreadPrefetch): this one dO for dV += P'ᵀ·dO, whose first block otherwise
  // waits on L3 for all of it (~3.5× the time of the others at d = 128 on an Ice Lake
  // Xeon, rdtsc per block), and dQ's the dQ sum it is added to (that addition took
  // twice as long unrequested). The next pair's Q, requested the same way, gained
  // nothing measurable: its rows are read in order, which the hardware follows.
  const int blocks = rows_used / kRowsPerBlock;
  const PanelSlices dout_slices(dout, sizeof(float) * rows_used * dvp, blocks);
  const TilePlace place{b, h, i0, rows, j0, nk, w.lo, w.hi};
  for (int r = 0, blk = 0; r < rows_used; r += kRowsPerBlock, ++blk) {
    SpreadPrefetch pf(dout_slices.Slice(blk), dout_slices.SliceLines(blk), p.d);
    BlockKeyVectors(w.lo, w.hi, r, rows, j0, &w.first[blk], &w.count[blk]);
    QkRows(q + size_t(r) * dp, dp, kpanel, p.d, w.s + r * kBk, kBk, w.first[blk], w.count[blk], &pf);
  }
  const bool save_raw = p.softcap > 0.0f;
  const bool save_pre = p.mods != nullptr && p.mods->grad_tile != nullptr;
  ApplyScoreMods(p, seq, place, w.s, kBk, TileNeedsBand(place), save_raw ? w.raw : nullptr,
                 save_pre ? w.pre_mod : nullptr);

  std::memcpy(w.kept, w.s, sizeof(float) * rows_used * kBk);
  // P = e^(S − m) / l (m = lse, l = 1 but for RowStats' rows); rows without a
  // visible key (lse = −∞) and padding: 0.
  for (int r = 0; r < rows_used; ++r) {
    float* row = w.s + r * kBk;
    if (w.lse[r] == -HUGE_VALF) {  // and every key of the row counts as removed
      for (int n = 0; n < kKeyVectors; ++n) {
        hn::Store(hn::Zero(df), df, row + n * kLanes);
        hn::Store(hn::Set(df, -HUGE_VALF), df, w.kept + r * kBk + n * kLanes);
      }
      continue;
    }
    const VF m = hn::Set(df, w.lse[r]), inv_l = hn::Set(df, w.inv_l[r]);
    for (int n = 0; n < kKeyVectors; ++n) {
      // Exact 0 for removed keys (−∞), as the reference.
      const VF x = hn::Load(df, row + n * kLanes);
      const VF e = hn::Mul(ExpNonPositive(df, hn::Sub(x, m)), inv_l);  // S ≤ m
      hn::Store(hn::IfThenZeroElse(hn::Eq(x, hn::Set(df, -HUGE_VALF)), e), df, row + n * kLanes);
    }
  }
  // Dropout: the forward's multipliers (0 or 1/(1 − p)) for this tile; P' = P·m
  // (what multiplied V) in w.p, and dP is scaled by the same m below.
  const bool dropout = p.dropout_p > 0.0f;
  const float* pd = w.s;
  if (dropout) {
    const DropoutRng rng = dropout_rng(p);
    const float inv_keep = 1.0f / (1.0f - p.dropout_p);
    std::fill(w.drop, w.drop + size_t(rows_used) * kBk, 0.0f);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < kBk; j += 4) {
        const unsigned keep = keep4_at(rng, p, b, h, i0 + r, j0 + j);
        for (int n = 0; n < 4; ++n) w.drop[r * kBk + j + n] = (keep >> n) & 1u ? inv_keep : 0.0f;
      }
    }
    for (size_t n = 0; n < size_t(rows_used) * kBk; ++n) w.p[n] = w.s[n] * w.drop[n];
    pd = w.p;
  }

  // dV += P'ᵀ·dO (rows: keys, inner: queries).
  for (int kr = 0; kr < keys_used; kr += kRowsPerBlock) {
    if (careful) {
      PvRowsGated(pd + kr, 1, kBk, w.kept + kr, 1, kBk, -HUGE_VALF, dout, dvp, rows, nullptr,
                  w.dv + size_t(kr) * dvp);
    } else {
      PvRows(pd + kr, 1, kBk, dout, dvp, rows, nullptr, w.dv + size_t(kr) * dvp);
    }
  }

  // dP = dO·Vᵀ over the same key vectors as S; dropout: dP ← dP·mask/(1 − p).
  for (int r = 0, blk = 0; r < rows_used; r += kRowsPerBlock, ++blk) {
    QkRows(dout + size_t(r) * dvp, dvp, vpanel, p.dv, w.ds + r * kBk, kBk, w.first[blk], w.count[blk]);
  }
  if (dropout) {  // −∞ (keys outside the block's vectors) times 0 is NaN: P = 0 there, masked below
    for (size_t n = 0; n < size_t(rows_used) * kBk; ++n) w.ds[n] *= w.drop[n];
  }

  // dS = P ∘ (dP − D), the gradient of the final scores; 0 for removed keys
  // (their dP may be −∞, outside a block's vectors, or NaN from a value), but
  // computed for a visible key whose P underflowed, as in the reference.
  const bool keep_raw = p.softcap > 0.0f;
  const bool keep_pre = p.mods != nullptr && p.mods->grad_tile != nullptr;
  for (int r = 0; r < rows_used; ++r) {
    float* dsr = w.ds + r * kBk;
    const float* pr = w.s + r * kBk;
    const float* kr = w.kept + r * kBk;
    const VF dsum = hn::Set(df, w.dsum[r]);
    for (int n = 0; n < kKeyVectors; ++n) {
      const VF pv = hn::Load(df, pr + n * kLanes);
      const VF g = hn::Mul(pv, hn::Sub(hn::Load(df, dsr + n * kLanes), dsum));
      const auto removed = hn::Eq(hn::Load(df, kr + n * kLanes), hn::Set(df, -HUGE_VALF));
      hn::Store(hn::IfThenZeroElse(removed, g), df, dsr + n * kLanes);
    }
  }
  if (keep_pre) {
    p.mods->grad_tile(p.mods->ctx, w.pre_mod, w.ds, kBk, b, h, i0, rows, j0, nk);
  }
  if (bp.dbias != nullptr) {  // the additive mask's gradient is dS here (before softcap')
    for (int r = 0; r < rows; ++r) {
      float* db = bp.dbias + b * bp.dbias_b + h * bp.dbias_h + int64_t{i0 + r} * bp.dbias_i;
      for (int j = 0; j < nk; ++j) {
        if (w.kept[r * kBk + j] != -HUGE_VALF) db[int64_t{j0 + j} * bp.dbias_j] += w.ds[r * kBk + j];
      }
    }
  }
  if (keep_raw) {  // s_capped = cap·tanh(s/cap): ds = ds_capped·(1 − tanh²(s/cap))
    for (int r = 0; r < rows; ++r) {
      for (int n = 0; n < kKeyVectors; ++n) {
        float* g = w.ds + r * kBk + n * kLanes;
        const VF deriv = SoftcapDerivative(df, hn::Load(df, w.raw + r * kBk + n * kLanes), p.softcap);
        hn::Store(hn::Mul(hn::Load(df, g), deriv), df, g);
      }
    }
  }
  // s = scale·q·k: dK += dSᵀ·(scale·Q), dQ = scale·(dS·K).
  std::fill(w.dq, w.dq + size_t(rows_used) * dp, 0.0f);
  if (careful) {
    for (int kr = 0; kr < keys_used; kr += kRowsPerBlock) {
      PvRowsGated(w.ds + kr, 1, kBk, w.kept + kr, 1, kBk, -HUGE_VALF, q, dp, rows, nullptr,
                  w.dk + size_t(kr) * dp);
    }
    for (int r = 0; r < rows_used; r += kRowsPerBlock) {
      PvRowsGated(w.ds + r * kBk, kBk, 1, w.kept + r * kBk, kBk, 1, -HUGE_VALF, krows, dp, nk, nullptr,
                  w.dq + size_t(r) * dp);
    }
  } else {
    for (int kr = 0; kr < keys_used; kr += kRowsPerBlock) {
      PvRows(w.ds + kr, 1, kBk, q, dp, rows, nullptr, w.dk + size_t(kr) * dp);
    }
    const PanelSlices dq_sum_slices(qtile + size_t{kBq} * (dp + dvp), sizeof(float) * rows * dp, blocks);
    for (int r = 0, blk = 0; r < rows_used; r += kRowsPerBlock, ++blk) {
      SpreadPrefetch pf(dq_sum_slices.Slice(blk), dq_sum_slices.SliceLines(blk), PvSteps(dp, nk));
      PvRows(w.ds + r * kBk, kBk, 1, krows, dp, nk, nullptr, w.dq + size_t(r) * dp, &pf);
    }
  }

  // Add this tile's dQ into the query tile's sum when it is this key tile's turn
  // for (h, qt); phase 4 copies the sums out.
  std::atomic<int>& turn = WaitTurn(sh, b, h, kt, qt);
  float* dq_sum = qtile + size_t{kBq} * (dp + dvp);
  const VF scale = hn::Set(df, p.scale);
  for (size_t x = 0; x < size_t(rows) * dp; x += kLanes) {
    hn::Store(hn::MulAdd(scale, hn::Load(df, w.dq + x), hn::Load(df, dq_sum + x)), df, dq_sum + x);
  }
  turn.store(kt + 1, std::memory_order_release);
}

/// |lse| from which a row's softmax statistics are recomputed: f32 rounds lse
/// by up to |lse|·2^−24, and P = e^(S − lse) inherits that as a relative error
/// (7.6e-6 at 128). Ordinary rows stay far below (scores of a few tens plus
/// ln Lk); rows whose every key carries a huge finite mask (−1e9, −FLT_MAX) sit
/// far above, where the rounding can swallow ln Lk whole.
constexpr float kLseRecompute = 128.0f;

/// Recomputes max and sum of the softmax of rows of (sequence b, head h, query
/// tile qt) whose |lse| ≥ kLseRecompute, as the forward does (same tiles, same
/// order), into sh.row_m and sh.row_inv_l, packing each key tile it reads.
void RowStats(const BwdShared& sh, int b, int h, int qt) {
  const Problem& p = sh.bp.fwd;
  const Sequence& seq = p.seqs[b];
  const int dp = sh.pack_layout.dp, dvp = RoundUp(p.dv, kLanes);
  BwdScratch w(dp, dvp);
  const int i0 = qt * kBq, rows = std::min(kBq, seq.Lq - i0);
  float* m = w.raw;              // [Bq]
  float* alpha = w.raw + kBq;    // [Bq]
  float* tmp = w.raw + 2 * kBq;  // [Bq]
  float* l = w.p;                // [Bq][kLanes]
  for (int r = 0; r < kBq; ++r) {
    float* qr = w.q + size_t(r) * dp;
    std::fill(qr, qr + dp, 0.0f);
    if (r < rows) {
      const float* src = RowF32(p.dtype, p.q, seq.q_offset + h * p.q_head + int64_t{i0 + r} * p.q_row, p.d, w.row,
                                p.round_bf16());
      for (int c = 0; c < p.d; ++c) qr[c] = src[c] * p.scale;
      BandOfRow(p, seq, i0 + r, &w.lo[r], &w.hi[r]);
    }
  }
  std::fill(m, m + kBq, -HUGE_VALF);
  std::fill(l, l + kBq * kLanes, 0.0f);
  for (int kt = sh.qt_first[b][qt]; kt <= sh.qt_last[b][qt]; ++kt) {
    const int j0 = kt * kBk;
    const TilePlace place{b, h, i0, rows, j0, std::min(kBk, seq.Lk - j0), w.lo, w.hi};
    if (BlockMaskCover(p, b, h, i0, rows, j0, place.cols) == Cover::kEmpty) continue;
    const float* kpanel = PackKeyTile(p, dp, b, h / p.group(), kt, w.key_tile, w.row).kpanel;
    for (int r = 0, blk = 0; r < kBq; r += kRowsPerBlock, ++blk) {
      BlockKeyVectors(w.lo, w.hi, r, rows, j0, &w.first[blk], &w.count[blk]);
      QkRows(w.q + size_t(r) * dp, dp, kpanel, p.d, w.s + r * kBk, kBk, w.first[blk], w.count[blk]);
    }
    ApplyScoreMods(p, seq, place, w.s, kBk, TileNeedsBand(place));
    SoftmaxTile(w.s, kBk, kBq, m, l, alpha, tmp);
  }
  for (int r = 0; r < rows; ++r) {
    const size_t at = sh.dsum_base[b] + size_t(h) * seq.Lq + i0 + r;
    const float lse = p.lse[seq.lse_offset + h * p.lse_h + int64_t{i0 + r} * p.lse_i];
    if (std::isfinite(lse) && std::fabs(lse) >= kLseRecompute && m[r] != -HUGE_VALF) {
      sh.row_m[at] = m[r];
      sh.row_inv_l[at] = 1.0f / RowSum(l, r);
    }
  }
}

/// Work item: key tile kt of (sequence b, kv head hk), over every query head of
/// the group and every query tile whose band reaches it.
void BackwardItem(const BwdShared& sh, int b, int hk, int kt) {
  const Problem& p = sh.bp.fwd;
  const Sequence& seq = p.seqs[b];
  const int dp = sh.pack_layout.dp, dvp = RoundUp(p.dv, kLanes);
  BwdScratch w(dp, dvp);
  // Key rows past the last key's row block get nothing (BackwardTilePair's keys_used).
  const int keys_used = RoundUp(std::min(kBk, seq.Lk - kt * kBk), kRowsPerBlock);
  std::fill(w.dk, w.dk + size_t(keys_used) * dp, 0.0f);
  std::fill(w.dv, w.dv + size_t(keys_used) * dvp, 0.0f);
  const KeyTile key = PackKeyTile(p, dp, b, hk, kt, w.key_tile, w.row);
  const int nqt = QueryTiles(seq.Lq);
  for (int h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    for (int qt = 0; qt < nqt; ++qt) {
      if (kt < sh.qt_first[b][qt] || kt > sh.qt_last[b][qt]) continue;
      const int i0 = qt * kBq, j0 = kt * kBk;
      if (BlockMaskCover(p, b, h, i0, std::min(kBq, seq.Lq - i0), j0, std::min(kBk, seq.Lk - j0)) ==
          Cover::kEmpty) {
        // Nothing to add, but dQ's order of additions must not depend on it.
        WaitTurn(sh, b, h, kt, qt).store(kt + 1, std::memory_order_release);
        continue;
      }
      BackwardTilePair(sh, w, key, b, h, kt, qt);
    }
  }
  const BackwardProblem& bp = sh.bp;
  const int j0 = kt * kBk, nk = std::min(kBk, seq.Lk - j0);
  for (int j = 0; j < nk; ++j) {
    StoreRowF32(bp.grad_dtype(), bp.dk, seq.dk_offset + hk * bp.dk_head + int64_t{j0 + j} * bp.dk_row, w.dk + size_t(j) * dp,
                p.d);
    StoreRowF32(bp.grad_dtype(), bp.dv, seq.dv_offset + hk * bp.dv_head + int64_t{j0 + j} * bp.dv_row, w.dv + size_t(j) * dvp,
                p.dv);
  }
}

}  // namespace

void BackwardF32(const BackwardProblem& bp, int threads) {
  const Problem& p = bp.fwd;
  const BwdPack pk = MakeBwdPack(p);
  float* pack = thread_scratch(kSlotPackedKv, pk.total);

  // Layout of D, the turn counters and the query tiles' key ranges.
  std::vector<size_t> dsum_base(p.seqs.size()), turn_base(p.seqs.size());
  std::vector<std::vector<int>> qt_first(p.seqs.size()), qt_last(p.seqs.size());
  size_t dsum_total = 0, turn_total = 0;
  double flops = 0;
  struct Item {
    int b, h, t;
  };
  std::vector<Item> rows_items, tile_items, items;
  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[b];
    dsum_base[b] = dsum_total, dsum_total += size_t(p.Hq) * seq.Lq;
    turn_base[b] = turn_total, turn_total += size_t(p.Hq) * QueryTiles(seq.Lq);
    qt_first[b].resize(QueryTiles(seq.Lq)), qt_last[b].resize(QueryTiles(seq.Lq));
    for (int qt = 0; qt < QueryTiles(seq.Lq); ++qt) {
      QueryTileKeyRange(p, seq, qt, &qt_first[b][qt], &qt_last[b][qt]);
      for (int h = 0; h < p.Hq; ++h) rows_items.push_back({b, h, qt});
    }
    for (int hk = 0; hk < p.Hkv; ++hk) {
      for (int t = 0; t < KeyTiles(seq.Lk); ++t) tile_items.push_back({b, hk, t});
    }
    flops += 5.0 * seq.Lq * seq.Lk * (p.d + p.dv) * p.Hq;
  }
  std::vector<float> dsum(dsum_total), row_m(dsum_total), row_inv_l(dsum_total, 1.0f);
  // Query tiles with rows whose softmax statistics are recomputed (RowStats).
  std::vector<Item> stats_items;
  for (const Item& it : rows_items) {
    const Sequence& seq = p.seqs[it.b];
    bool recompute = false;
    for (int i = it.t * kBq; i < std::min(seq.Lq, (it.t + 1) * kBq); ++i) {
      const float lse = p.lse[seq.lse_offset + it.h * p.lse_h + int64_t{i} * p.lse_i];
      row_m[dsum_base[it.b] + size_t(it.h) * seq.Lq + i] = lse;
      recompute = recompute || (std::isfinite(lse) && std::fabs(lse) >= kLseRecompute);
    }
    if (recompute) stats_items.push_back(it);
  }
  std::unique_ptr<std::atomic<int>[]> turns(new std::atomic<int>[std::max<size_t>(1, turn_total)]);
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      for (int qt = 0; qt < QueryTiles(p.seqs[b].Lq); ++qt) {
        turns[turn_base[b] + size_t(h) * QueryTiles(p.seqs[b].Lq) + qt].store(qt_first[b][qt]);
      }
    }
  }
  // Items: (b, kv head, key tile), in that order; when dbias is shared across
  // batch or heads, one item per key tile index covers every (b, kv head), so
  // each dbias column has a single writer.
  int max_tiles = 0;
  for (const Sequence& seq : p.seqs) max_tiles = std::max(max_tiles, KeyTiles(seq.Lk));
  if (bp.dbias_shared) {
    for (int t = 0; t < max_tiles; ++t) items.push_back({-1, -1, t});
  } else {
    items = tile_items;
  }

  const int nt = flops < 4e6 ? 1 : std::max(1, threads);
  const BwdShared sh{bp,        pk,        pack,     dsum.data(), row_m.data(), row_inv_l.data(),
                    dsum_base, turns.get(), turn_base, qt_first,  qt_last};
  const int n_rows = static_cast<int>(rows_items.size()), n_items = static_cast<int>(items.size()), n_stats = static_cast<int>(stats_items.size());
  RunOnThreads(nt, [&] {
    float* const out_row = BwdScratch(pk.dp, pk.dvp).row;  // a bf16/f16 row of out, widened (or f32 out as is)
    // Phase 1: per query tile, D = rowsum(dO ∘ O) of each row; scale·Q and dO
    // packed (widened there from bf16/f16); the dQ sum zeroed.
#pragma omp for schedule(static)
    for (int n = 0; n < n_rows; ++n) {
      const auto [b, h, qt] = rows_items[n];
      const Sequence& seq = p.seqs[b];
      float* qpack = pk.QueryTile(pack, p, b, h, qt);
      float* gpack = qpack + size_t{kBq} * pk.dp;
      const int i0 = qt * kBq, rows = std::min(kBq, seq.Lq - i0);
      for (int r = 0; r < rows; ++r) {
        const int i = i0 + r;
        float* gr = gpack + size_t(r) * pk.dvp;
        const float* o = RowF32(p.out_dtype(), p.out, seq.out_offset + h * p.out_head + int64_t{i} * p.out_row, p.dv, out_row);
        const float* g = RowF32(p.dtype, bp.dout, seq.dout_offset + h * bp.dout_head + int64_t{i} * bp.dout_row, p.dv, gr);
        // The same fused multiply-adds, in the same order, as QkRows accumulates
        // dP = dO·Vᵀ: when a row has one visible key (O = v), dP − D is then 0
        // exactly, as it is in exact arithmetic, not an f32 residue.
        float acc = 0.0f;
        for (int c = 0; c < p.dv; ++c) acc = std::fma(g[c], o[c], acc);
        dsum[dsum_base[b] + size_t(h) * seq.Lq + i] = acc;
        float* qr = qpack + size_t(r) * pk.dp;
        const float* src = RowF32(p.dtype, p.q, seq.q_offset + h * p.q_head + int64_t{i} * p.q_row, p.d, qr,
                                  p.round_bf16());
        for (int c = 0; c < p.d; ++c) qr[c] = src[c] * p.scale;
        std::fill(qr + p.d, qr + pk.dp, 0.0f);
        if (g != gr) std::memcpy(gr, g, sizeof(float) * p.dv);
        std::fill(gr + p.dv, gr + pk.dvp, 0.0f);
      }
      // BackwardTilePair reads rows up to the last row block (rows_used) and adds dQ
      // into the first `rows` rows of the sum, which phase 4 copies out: a short tile
      // (one query: 1 row of 64) touches only those, not the whole tile (at N = 1,
      // H = 8 the fills and the scan of whole tiles were half of a call).
      const int rows_used = RoundUp(rows, kRowsPerBlock);
      std::fill(qpack + size_t(rows) * pk.dp, qpack + size_t(rows_used) * pk.dp, 0.0f);
      std::fill(gpack + size_t(rows) * pk.dvp, gpack + size_t(rows_used) * pk.dvp, 0.0f);
      pk.QueryNonFinite(p, b, h, qt) =
          !AllFinite(qpack, size_t(rows_used) * pk.dp) || !AllFinite(gpack, size_t(rows_used) * pk.dvp);
      float* dq_sum = gpack + size_t{kBq} * pk.dvp;
      std::fill(dq_sum, dq_sum + size_t(rows) * pk.dp, 0.0f);
    }
    // Phase 2: softmax statistics of rows with huge |lse|; zero the rows of dk, dv
    // beyond each key length.
#pragma omp for schedule(dynamic, 1)
    for (int n = 0; n < n_stats; ++n) RowStats(sh, stats_items[n].b, stats_items[n].h, stats_items[n].t);
#pragma omp single
    {
      if (bp.varlen_q_tokens > 0 || bp.varlen_k_tokens > 0) {  // tokens outside every sequence: 0
        ZeroRows(bp.grad_dtype(), bp.dq, 0, bp.dq_row, bp.dq_head, bp.varlen_q_tokens, p.Hq, p.d);
        ZeroRows(bp.grad_dtype(), bp.dk, 0, bp.dk_row, bp.dk_head, bp.varlen_k_tokens, p.Hkv, p.d);
        ZeroRows(bp.grad_dtype(), bp.dv, 0, bp.dv_row, bp.dv_head, bp.varlen_k_tokens, p.Hkv, p.dv);
      }
      for (int b = 0; b < p.B; ++b) {  // keys beyond key_lengths[b] get no gradient
        const Sequence& seq = p.seqs[b];
        const int64_t extra = seq.Lk_rows - seq.Lk;
        ZeroRows(bp.grad_dtype(), bp.dk, seq.dk_offset + int64_t{seq.Lk} * bp.dk_row, bp.dk_row, bp.dk_head, extra, p.Hkv,
                 p.d);
        ZeroRows(bp.grad_dtype(), bp.dv, seq.dv_offset + int64_t{seq.Lk} * bp.dv_row, bp.dv_row, bp.dv_head, extra, p.Hkv,
                 p.dv);
      }
    }
    // Phase 3: the key-tile items (see the top of the file for the dQ order).
#pragma omp for schedule(monotonic : dynamic, 1)
    for (int n = 0; n < n_items; ++n) {
      const Item it = items[n];
      if (it.b >= 0) {
        BackwardItem(sh, it.b, it.h, it.t);
      } else {
        for (int b = 0; b < p.B; ++b) {
          if (it.t >= KeyTiles(p.seqs[b].Lk)) continue;
          for (int hk = 0; hk < p.Hkv; ++hk) BackwardItem(sh, b, hk, it.t);
        }
      }
    }
    // Phase 4: dq, from each query tile's sum (complete once phase 3 is).
#pragma omp for schedule(static)
    for (int n = 0; n < n_rows; ++n) {
      const auto [b, h, qt] = rows_items[n];
      const Sequence& seq = p.seqs[b];
      const float* dq_sum = pk.QueryTile(pack, p, b, h, qt) + size_t{kBq} * (pk.dp + pk.dvp);
      for (int r = 0, i0 = qt * kBq; r < std::min(kBq, seq.Lq - i0); ++r) {
        StoreRowF32(bp.grad_dtype(), bp.dq, seq.dq_offset + h * bp.dq_head + int64_t{i0 + r} * bp.dq_row,
                    dq_sum + size_t(r) * pk.dp, p.d);
      }
    }
  });
}

size_t BackwardWorkspaceBytes(const Problem& p, int threads) {
  const BwdPack pk = MakeBwdPack(p);
  size_t rows = 0, turns = 0;
  for (const Sequence& seq : p.seqs) {
    rows += static_cast<size_t>(p.Hq) * seq.Lq;
    turns += static_cast<size_t>(p.Hq) * QueryTiles(seq.Lq);
  }
  // The packed query tiles, one scratch per thread (with its packed key tile), and the
  // call's D, row maxima and 1/l per query row and turn counter per query tile.
  const size_t floats = pk.total + static_cast<size_t>(std::max(1, threads)) *
                                       BwdScratch::Floats(pk.dp, RoundUp(p.dv, kLanes)) + 3 * rows;
  return sizeof(float) * floats + sizeof(std::atomic<int>) * std::max<size_t>(1, turns);
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(BackwardF32);
HWY_EXPORT(BackwardWorkspaceBytes);

size_t attention_backward_workspace_bytes_cpu(const Problem& p, int threads) {
  return HWY_DYNAMIC_DISPATCH(BackwardWorkspaceBytes)(p, threads);
}

void attention_backward_cpu(const BackwardProblem& bp, int threads) {
  const DType dt = bp.fwd.dtype;
  if (dt != DType::f32 && dt != DType::bf16 && dt != DType::f16) {
    throw std::logic_error("attention_backward_cpu: f32, bf16 or f16 problems only");
  }
  if (bp.fwd.mask_dtype == DType::bf16 || bp.fwd.mask_dtype == DType::f16) throw std::logic_error("attention_backward_cpu: widen bf16/f16 masks first");
  HWY_DYNAMIC_DISPATCH(BackwardF32)(bp, threads);
}

}  // namespace attn::detail
#endif  // HWY_ONCE
