// bf16 attention backward on Intel AMX: FlashAttention-2's backward with all five
// products on the tile unit, deterministic like the f32 kernel (attention_backward.cc,
// whose schedule this follows).
//
// One work item is (sequence b, kv head hk, a block of kItemTiles key tiles of 64
// keys); it owns dK and dV of its keys. For every query head h of the group, every
// 64-query tile qt whose band reaches the keys and every key tile of the block:
//   S   = Q·Kᵀ                    tiles, [64 q][64 k]
//   dP  = dO·Vᵀ                   tiles, [64 q][64 k]
//   P   = e^(scale·S (+ mods) − lse), P' = P·dropout      AVX-512, f32
//   dS  = scale · P ∘ (dP·dropout − D)                      AVX-512, f32
//   dVᵀ += dOᵀ·P'                 tiles, [dv][64 k]  (kept transposed: see below)
//   dKᵀ += Qᵀ·dS                  tiles, [d][64 k]
//   dQ  += dS·K                   tiles, [64 q][d], summed over the block's key tiles,
//                                 then added into an f32 dQ in key-block order (the
//                                 f32 kernel's turn counters)
// On CPUs with AVX512-BF16 but no AMX the five products run on vdpbf16ps instead
// (Bf16Gemm → VecGemm, same packed operands, same order of work: same determinism).
// Why dKᵀ and dVᵀ: tdpbf16ps's B operand takes pairs of rows of its [K][N] matrix,
// and for dK = dSᵀ·Q the inner dimension is the queries. With queries as the inner
// dimension and keys as columns, B is dS itself, packed by interleaving two of its
// rows (PairRowF32, two vector ops per 16 pairs), and A is Qᵀ, transposed once per
// call; the other orientation would transpose dS and P in every step. The
// accumulators are transposed back once per item.
//
// D = rowsum(dO ∘ O) and the packing of Q, Qᵀ, dO, dOᵀ (per query tile) and of K, V
// in both layouts (per key tile) run first; every value is rounded to bf16 once.
// Declines (returns false having written nothing; the caller takes the widened f32
// path, with its exact semantics): NaN or ±∞ in the packed inputs (tdpbf16ps reads
// subnormals as zero, so 0·∞ would come out differently), rows whose |lse| needs
// the f32 kernel's recomputation (RowStats), softcap, the user's score mods and a
// requested dbias (their derivatives live in the f32 kernel only).
#include "cpu/attention_backward_amx.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/thread_team.hpp"
#include "cpu/workspace.hpp"
#include "dropout/dropout_at.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_backward_amx.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/highway.h>

#include "cpu/amx_tiles-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace {

#if ATTN_AMX_KERNEL
static_assert(kBq == 64 && kBk == 64, "the AMX backward steps are the AVX3 f32 kernel's 64×64 tiles");

/// |lse| from which the f32 kernel recomputes a row's softmax statistics (see
/// kLseRecompute in attention_backward.cc); such calls are declined.
constexpr float kLseLimit = 128.0f;

/// Key tiles per work item. Each step streams its query tile's packed operands
/// (64 KiB at d = 128) and adds into the f32 dQ accumulator, both from L2 or
/// beyond; four key tiles share one pass (measured: 471 → see PERFORMANCE.md).
constexpr int kItemTiles = 4;
HWY_INLINE int KeyBlocks(int lk) { return (KeyTiles(lk) + kItemTiles - 1) / kItemTiles; }

/// Where the packed operands of each query tile and key tile lie (bf16 elements),
/// and the per-row f32 arrays (lse, D, the dQ accumulator).
/// With two pieces (f16 inputs, and f32 ones with Precision::bf16x3) every operand
/// holds hi and lo bf16 pieces whose sum is the value (exactly for f16; SplitBf16):
/// rows are [hi | lo] (QRows: [64][2·dp]), transposed rows likewise ([dp][hi 64 |
/// lo 64]), and pair-packed operands are followed by their lo pieces' tiles (the lo
/// tiles of KForS start 64·dp elements in).
struct BwdAmxLayout {
  int dp = 0, dvp = 0;  // d, dv rounded up to 32
  int pieces = 1;       // 2 for f16 inputs and split f32 ones
  std::vector<size_t> q_base, k_base, row_base;
  size_t total = 0, rows = 0;

  // Per query tile: Q rows [64][dp], Qᵀ [dp][64], dO rows [64][dvp], dOᵀ [dvp][64].
  size_t QTileElems() const { return size_t{2} * pieces * kBq * (dp + dvp); }
  // Per key tile: K for S (pair-packed Kᵀ: groups of 16 keys × d chunks), K for dQ
  // (pair-packed over keys: key chunks × column groups), V for dP (like the first).
  size_t KTileElems() const { return size_t{kBk} * pieces * (2 * dp + dvp); }

  bf16* QTile(bf16* pack, const Problem& p, int b, int h, int qt) const {
    return pack + q_base[b] + (static_cast<size_t>(h) * QueryTiles(p.seqs[b].Lq) + qt) * QTileElems();
  }
  bf16* KTile(bf16* pack, const Problem& p, int b, int hk, int kt) const {
    return pack + k_base[b] + (static_cast<size_t>(hk) * KeyTiles(p.seqs[b].Lk) + kt) * KTileElems();
  }
  bf16* QRows(bf16* t) const { return t; }
  bf16* QCols(bf16* t) const { return t + size_t{kBq} * pieces * dp; }
  bf16* GRows(bf16* t) const { return t + size_t{2} * kBq * pieces * dp; }
  bf16* GCols(bf16* t) const { return GRows(t) + size_t{kBq} * pieces * dvp; }
  bf16* KForS(bf16* t) const { return t; }
  bf16* KForDq(bf16* t) const { return t + size_t{kBk} * pieces * dp; }
  bf16* VForDp(bf16* t) const { return t + size_t{2} * kBk * pieces * dp; }
  // The piece products of S = Q·Kᵀ, dP = dO·Vᵀ, dQ = dS·K (B = KForDq), and of the
  // products whose inner dimension is the 64 queries (A = Qᵀ or dOᵀ, B = dS or P').
  Pieces ForS() const { return Split(dp, size_t{kBk} * dp); }
  Pieces ForDp() const { return Split(dvp, size_t{kBk} * dvp); }
  Pieces ForDq() const { return Split(kBk, size_t{kBk} * dp); }
  Pieces OverQueries() const { return Split(kBq, size_t{kBq} * kBk); }
  Pieces Split(size_t a_lo, size_t b_lo) const { return pieces == 2 ? Pieces{3, a_lo, b_lo} : Pieces{}; }
  // Row r (< 64·tiles) of (b, h) in the per-row arrays.
  size_t Row(const Problem& p, int b, int h, int i) const {
    return row_base[b] + static_cast<size_t>(h) * QueryTiles(p.seqs[b].Lq) * kBq + i;
  }
};

BwdAmxLayout MakeBwdAmxLayout(const Problem& p) {
  BwdAmxLayout l;
  l.dp = RoundUp(p.d, kPair);
  l.dvp = RoundUp(p.dv, kPair);
  l.pieces = p.pieces();
  for (const Sequence& seq : p.seqs) {
    l.q_base.push_back(l.total);
    l.total += static_cast<size_t>(p.Hq) * QueryTiles(seq.Lq) * l.QTileElems();
    l.k_base.push_back(l.total);
    l.total += static_cast<size_t>(p.Hkv) * KeyTiles(seq.Lk) * l.KTileElems();
    l.row_base.push_back(l.rows);
    l.rows += static_cast<size_t>(p.Hq) * QueryTiles(seq.Lq) * kBq;
  }
  return l;
}

/// 16 bf16 (in the low halves of 32-bit lanes' worth of memory) widened to f32.
HWY_INLINE ATTN_AMX __m512 Bf16x16ToF32(__m256i x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(x), 16));
}

/// 16 values (masked by m) of a bf16, f16 or f32 tensor at element at, as f32.
HWY_INLINE ATTN_AMX __m512 LoadAsF32(DType dt, const float* base, int64_t at, __mmask16 m) {
  if (dt == DType::f32) return _mm512_maskz_loadu_ps(m, base + at);
  const __m256i x = _mm256_maskz_loadu_epi16(m, reinterpret_cast<const bf16*>(base) + at);
  return dt == DType::f16 ? _mm512_cvtph_ps(x) : Bf16x16ToF32(x);
}

/// n f32 values into a gradient tensor of dtype dt (BackwardProblem::grad_dtype):
/// bf16 or f16 (rounded to nearest even) or f32, at element at.
inline ATTN_AMX void StoreAs(DType dt, float* base, int64_t at, const float* src, int n) {
  if (dt == DType::bf16) {
    F32ToBf16(src, n, reinterpret_cast<bf16*>(base) + at);
  } else if (dt == DType::f16) {
    bf16* dst = reinterpret_cast<bf16*>(base) + at;
    for (int c = 0; c < n; c += 16) {
      const __mmask16 m = static_cast<__mmask16>(n - c >= 16 ? 0xFFFFu : (1u << (n - c)) - 1);
      _mm256_mask_storeu_epi16(dst + c, m,
                               _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, src + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
  } else {
    std::memcpy(base + at, src, sizeof(float) * n);
  }
}

/// Zeros n elements of a gradient tensor of dtype dt (bf16, f16 or f32) at element at.
inline void ZeroAs(DType dt, float* base, int64_t at, int n) {
  if (dt != DType::f32) {  // +0 is all zero bits in both 16-bit formats
    std::fill_n(reinterpret_cast<bf16*>(base) + at, n, bf16{0});
  } else {
    std::fill_n(base + at, n, 0.0f);
  }
}

/// Everything the work items share.
struct BwdAmxShared {
  const BackwardProblem& bp;
  const BwdAmxLayout& lay;
  bf16* pack;
  float* lse;     // per row: lse (−∞ for rows without keys and for padding)
  float* dsum;    // per row: D
  float* dq;      // per row: dp floats of the f32 dQ accumulator
  std::atomic<int>* turns;  // per (sequence, head, query tile)
  const std::vector<size_t>& turn_base;
  const std::vector<std::vector<int>>& qt_first;
  const std::vector<std::vector<int>>& qt_last;
  bool tiles;  // products on AMX tiles (true) or on vdpbf16ps
};

/// Packs query tile qt of (b, h): Q and dO as rows and transposed, rounded to bf16
/// (or split into exact hi + lo pieces); D = Σ dO·O per row (on the dO the tiles
/// multiply: rounded to bf16, or the f16 value itself); lse; zeroes the rows' dQ
/// accumulator. Returns false when a value is NaN or ±∞ or an lse is outside what
/// the kernel handles.
ATTN_AMX bool PackQueryTile(const BwdAmxShared& sh, int b, int h, int qt, bf16* staging) {
  const BackwardProblem& bp = sh.bp;
  const Problem& p = bp.fwd;
  const Sequence& seq = p.seqs[b];
  const BwdAmxLayout& l = sh.lay;
  const int dp = l.dp, dvp = l.dvp, pieces = l.pieces, qw = pieces * dp, gw = pieces * dvp;
  bf16* t = l.QTile(sh.pack, p, b, h, qt);
  bf16 *qr = l.QRows(t), *qc = l.QCols(t), *gr = l.GRows(t), *gc = l.GCols(t);
  bool ok = true;
  for (int r = 0; r < kBq; ++r) {
    const int i = qt * kBq + r;
    const bool real = i < seq.Lq;
    const bf16* q = PackedRow(p, pieces, p.q, seq.q_offset + h * p.q_head + int64_t{i} * p.q_row, p.d, dp, real, staging);
    const bf16* g = PackedRow(p, pieces, bp.dout, seq.dout_offset + h * bp.dout_head + int64_t{i} * bp.dout_row, p.dv,
                              dvp, real, staging + qw);
    ok &= !AnyNonFiniteBf16(q, qw) && !AnyNonFiniteBf16(g, gw);
    std::memcpy(qr + static_cast<size_t>(r) * qw, q, sizeof(bf16) * qw);
    std::memcpy(gr + static_cast<size_t>(r) * gw, g, sizeof(bf16) * gw);
    const size_t row = l.Row(p, b, h, i);
    std::fill_n(sh.dq + row * dp, dp, 0.0f);
    if (!real) {
      sh.lse[row] = -HUGE_VALF, sh.dsum[row] = 0.0f;
      continue;
    }
    const float lse = p.lse[seq.lse_offset + h * p.lse_h + int64_t{i} * p.lse_i];
    ok &= lse == -HUGE_VALF || (std::isfinite(lse) && std::fabs(lse) < kLseLimit);
    sh.lse[row] = lse;
    // 16 columns at a time (masked past dv): g as packed (hi + lo is exact), O as stored
    // (f32 where the caller kept the output before rounding).
    const int64_t o_at = seq.out_offset + h * p.out_head + int64_t{i} * p.out_row;
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < p.dv; c += 16) {
      const __mmask16 m = static_cast<__mmask16>(p.dv - c >= 16 ? 0xFFFFu : (1u << (p.dv - c)) - 1);
      __m512 gv = Bf16x16ToF32(_mm256_maskz_loadu_epi16(m, g + c));
      if (pieces == 2) gv = _mm512_add_ps(gv, Bf16x16ToF32(_mm256_maskz_loadu_epi16(m, g + dvp + c)));
      sum = _mm512_fmadd_ps(gv, LoadAsF32(p.out_dtype(), p.out, o_at + c, m), sum);
    }
    const float acc = _mm512_reduce_add_ps(sum);
    sh.dsum[row] = acc;
  }
  // The transposes, piece by piece, written in order (strided reads of the rows just
  // packed, in L1; strided 2-byte writes cost several times more). Rows past Lq are
  // zero (PackedRow), so their columns are filled, not copied: a one-token tile spent
  // a third of its backward here.
  const int tw = pieces * kBq;  // a transposed row: [hi 64 | lo 64]
  const int rows = std::clamp(seq.Lq - qt * kBq, 0, kBq);
  for (int piece = 0; piece < pieces; ++piece) {
    for (int c = 0; c < dp; ++c) {
      bf16* dst = qc + static_cast<size_t>(c) * tw + piece * kBq;
      for (int r = 0; r < rows; ++r) dst[r] = qr[static_cast<size_t>(r) * qw + piece * dp + c];
      std::fill(dst + rows, dst + kBq, bf16{0});
    }
    for (int c = 0; c < dvp; ++c) {
      bf16* dst = gc + static_cast<size_t>(c) * tw + piece * kBq;
      for (int r = 0; r < rows; ++r) dst[r] = gr[static_cast<size_t>(r) * gw + piece * dvp + c];
      std::fill(dst + rows, dst + kBq, bf16{0});
    }
  }
  return ok;
}

/// Packs key tile kt of (b, hk): K as the B operand of S = Q·Kᵀ and of dQ = dS·K,
/// V as the B operand of dP = dO·Vᵀ, each piece's tiles after the other's. Returns
/// false when a value is NaN or ±∞.
ATTN_AMX bool PackKeyTile(const BwdAmxShared& sh, int b, int hk, int kt, bf16* staging) {
  const Problem& p = sh.bp.fwd;
  const Sequence& seq = p.seqs[b];
  const BwdAmxLayout& l = sh.lay;
  const int dp = l.dp, dvp = l.dvp, dc = dp / kPair, vc = dvp / kPair, pieces = l.pieces;
  const size_t kw = size_t(pieces) * dp, vw = size_t(pieces) * dvp;
  const bf16* krow[kBk];
  const bf16* vrow[kBk];
  bool ok = true;
  for (int n = 0; n < kBk; ++n) {
    const int j = kt * kBk + n;
    krow[n] = PackedRow(p, pieces, p.k, seq.k_offset + hk * p.k_head + int64_t{j} * p.k_row, p.d, dp, j < seq.Lk,
                        staging + n * kw);
    vrow[n] = PackedRow(p, pieces, p.v, seq.v_offset + hk * p.v_head + int64_t{j} * p.v_row, p.dv, dvp, j < seq.Lk,
                        staging + kBk * kw + n * vw);
    ok &= !AnyNonFiniteBf16(krow[n], static_cast<int>(kw)) && !AnyNonFiniteBf16(vrow[n], static_cast<int>(vw));
  }
  bf16* t = l.KTile(sh.pack, p, b, hk, kt);
  for (int piece = 0; piece < pieces; ++piece) {
    bf16* ks = l.KForS(t) + size_t{kBk} * dp * piece;
    bf16* kq = l.KForDq(t) + size_t{kBk} * dp * piece;
    bf16* vp = l.VForDp(t) + size_t{kBk} * dvp * piece;
    // Kᵀ and Vᵀ ([d][keys]): tile (d chunk c, key group g) at (g·chunks + c)·kTile.
    for (int g = 0; g < kBk / 16; ++g) {
      for (int c = 0; c < dc; ++c)
        PairTileTransposed(krow + g * 16, piece * dp + c * kPair, ks + (static_cast<size_t>(g) * dc + c) * kTile);
      for (int c = 0; c < vc; ++c)
        PairTileTransposed(vrow + g * 16, piece * dvp + c * kPair, vp + (static_cast<size_t>(g) * vc + c) * kTile);
    }
    // K ([keys][d]): tile (key chunk kc, column group g) at (kc·dp/16 + g)·kTile.
    for (int kc = 0; kc < kBk / kPair; ++kc) {
      for (int g = 0; g < dp / 16; ++g) {
        bf16* tile = kq + (static_cast<size_t>(kc) * (dp / 16) + g) * kTile;
        const int col = piece * dp + g * 16;
        for (int kk = 0; kk < 16; ++kk) PairRow(krow[kc * kPair + 2 * kk] + col, krow[kc * kPair + 2 * kk + 1] + col, tile + kk * 32);
      }
    }
  }
  return ok;
}

/// Per-thread buffers of a work item.
struct BwdAmxScratch {
  float* s;      // [64][64]  scores, then P' (P with dropout)
  float* dp;     // [64][64]  dP, then dS
  float* drop;   // [64][64]  dropout multipliers
  float* dq;     // [64][dp]  this step's dQ
  float* dkt;    // [kItemTiles][dp][64]  the item's dKᵀ, per key tile
  float* dvt;    // [kItemTiles][dvp][64] the item's dVᵀ
  bf16* p_pairs;   // P' pair-packed over queries (B of dVᵀ), then its lo pieces
  bf16* ds_pairs;  // dS likewise (B of dKᵀ)
  bf16* ds_rows;   // dS rows (A of dQ): [64][pieces·64]
  int *lo, *hi;

  static size_t Floats(int dp, int dvp, int pieces) {
    const size_t tile = size_t{kBq} * kBk;
    return 3 * tile + 3 * pieces * tile / 2 + size_t{kBq} * dp + size_t{kItemTiles} * kBk * (dp + dvp) + 2 * kBq;
  }
  BwdAmxScratch(int dp_, int dvp_, int pieces) {
    const size_t tile = size_t{kBq} * kBk;
    float* x = thread_scratch(kSlotTile, Floats(dp_, dvp_, pieces));
    s = x, x += tile;
    dp = x, x += tile;
    drop = x, x += tile;
    dq = x, x += size_t{kBq} * dp_;
    dkt = x, x += size_t{kItemTiles} * kBk * dp_;
    dvt = x, x += size_t{kItemTiles} * kBk * dvp_;
    p_pairs = reinterpret_cast<bf16*>(x), x += pieces * tile / 2;
    ds_pairs = reinterpret_cast<bf16*>(x), x += pieces * tile / 2;
    ds_rows = reinterpret_cast<bf16*>(x), x += pieces * tile / 2;
    lo = reinterpret_cast<int*>(x), hi = lo + kBq;
  }
};

/// Waits until it is key block kb's turn to add into dQ of (b, h, query tile qt).
std::atomic<int>& WaitTurn(const BwdAmxShared& sh, int b, int h, int kb, int qt) {
  std::atomic<int>& turn = sh.turns[sh.turn_base[b] + size_t(h) * QueryTiles(sh.bp.fwd.seqs[b].Lq) + qt];
  while (turn.load(std::memory_order_acquire) != kb) __builtin_ia32_pause();
  return turn;
}

/// P', dS (scaled) from S and dP for one step, in place (s ← P', dp ← dS), and
/// their bf16 forms for the tiles (hi and lo pieces with two pieces).
ATTN_AMX void SoftmaxGradient(const BwdAmxShared& sh, BwdAmxScratch& w, int b, int h, int i0, int rows, int j0,
                              bool natural) {
  const Problem& p = sh.bp.fwd;
  const DF df;
  constexpr float kLog2e = 1.44269504088896341f;
  const bool dropout = p.dropout_p > 0.0f, accurate = p.split_f32();
  if (dropout) {
    const DropoutRng rng = dropout_rng(p);
    const float inv_keep = 1.0f / (1.0f - p.dropout_p);
    for (int r = 0; r < rows; ++r) {
      for (int j = 0; j < kBk; j += 4) {
        const unsigned keep = keep4_at(rng, p, b, h, i0 + r, j0 + j);
        for (int n = 0; n < 4; ++n) w.drop[r * kBk + j + n] = (keep >> n) & 1u ? inv_keep : 0.0f;
      }
    }
  }
  const VF scale = hn::Set(df, p.scale), log2e = hn::Set(df, kLog2e);
  for (int r = 0; r < kBq; ++r) {
    float* sr = w.s + r * kBk;
    float* gr = w.dp + r * kBk;
    const size_t row = sh.lay.Row(p, b, h, i0 + r);
    const float lse = sh.lse[row];
    if (r >= rows || lse == -HUGE_VALF) {  // no key (or padding): P = dS = 0
      std::fill(sr, sr + kBk, 0.0f);
      std::fill(gr, gr + kBk, 0.0f);
      continue;
    }
    const VF m = hn::Set(df, lse), dsum = hn::Set(df, sh.dsum[row]);
    for (int c = 0; c < kBk; c += kLanes) {
      const VF s = hn::Load(df, sr + c);
      // natural: s is already scale·score with the modifiers; else the raw dot
      // product, and scale·s − lse is one rounding (removed keys: −∞ → P = 0).
      const VF x = natural ? hn::Sub(s, m) : hn::MulSub(s, scale, m);
      // f32 inputs as pieces keep 16 bits of P (Exp2Accurate).
      const VF prob = accurate ? Exp2Accurate(hn::Mul(x, log2e)) : Exp2Probability(hn::Mul(x, log2e));
      VF g = hn::Load(df, gr + c);
      VF pd = prob;
      if (dropout) {
        const VF keep = hn::Load(df, w.drop + r * kBk + c);
        pd = hn::Mul(prob, keep);
        g = hn::Mul(g, keep);
      }
      hn::Store(pd, df, sr + c);
      hn::Store(hn::Mul(hn::Mul(prob, hn::Sub(g, dsum)), scale), df, gr + c);
    }
  }
  constexpr size_t kLo = size_t{kBq} * kBk;  // where the lo pieces start
  for (int r = 0; r < kBq; r += 2) {
    // Pair-packed over queries: tile (query chunk r/32, key group g), row (r % 32)/2.
    for (int g = 0; g < kBk / 16; ++g) {
      const size_t at = (static_cast<size_t>(r / kPair) * (kBk / 16) + g) * kTile + (r % kPair) / 2 * 32;
      const float *s0 = w.s + r * kBk + g * 16, *d0 = w.dp + r * kBk + g * 16;
      if (sh.lay.pieces == 2) {
        PairRowF32Pieces(s0, s0 + kBk, w.p_pairs + at, w.p_pairs + kLo + at);
        PairRowF32Pieces(d0, d0 + kBk, w.ds_pairs + at, w.ds_pairs + kLo + at);
      } else {
        PairRowF32(s0, s0 + kBk, w.p_pairs + at);
        PairRowF32(d0, d0 + kBk, w.ds_pairs + at);
      }
    }
  }
  for (int r = 0; r < kBq; ++r) {
    if (sh.lay.pieces == 2) {  // a row of [hi 64 | lo 64]
      bf16* row = w.ds_rows + r * 2 * kBk;
      for (int c = 0; c < kBk; c += 16) SplitBf16(_mm512_load_ps(w.dp + r * kBk + c), row + c, row + kBk + c);
      continue;
    }
    for (int c = 0; c < kBk; c += 2 * kLanes) {
      StoreBf16x2(hn::Load(df, w.dp + r * kBk + c), hn::Load(df, w.dp + r * kBk + c + kLanes), w.ds_rows + r * kBk + c);
    }
  }
}

/// Key tile kt of (b, hk) against query tile qt of head h: adds into the item's
/// dKᵀ, dVᵀ of the tile (slot u) and, accumulate or not, this step's dQ.
ATTN_AMX void TilePair(const BwdAmxShared& sh, BwdAmxScratch& w, int b, int h, int hk, int kt, int u, int qt,
                       bool accumulate) {
  const Problem& p = sh.bp.fwd;
  const Sequence& seq = p.seqs[b];
  const BwdAmxLayout& l = sh.lay;
  const int dp = l.dp, dvp = l.dvp, pieces = l.pieces;
  const int i0 = qt * kBq, rows = std::min(kBq, seq.Lq - i0);
  const int j0 = kt * kBk, nk = std::min(kBk, seq.Lk - j0);
  bf16* qtile = l.QTile(sh.pack, p, b, h, qt);
  bf16* ktile = l.KTile(sh.pack, p, b, hk, kt);

  // S = Q·Kᵀ and dP = dO·Vᵀ: B tiles (chunk c, key group g) at (g·chunks + c)·kTile.
  Bf16Gemm(sh.tiles, l.QRows(qtile), size_t(pieces) * dp, l.KForS(ktile), kTile, size_t{dp / kPair} * kTile, w.s, kBk,
           kBq, kBk, dp, false, l.ForS());
  Bf16Gemm(sh.tiles, l.GRows(qtile), size_t(pieces) * dvp, l.VForDp(ktile), kTile, size_t{dvp / kPair} * kTile, w.dp,
           kBk, kBq, kBk, dvp, false, l.ForDp());

  const TilePlace place{b, h, i0, rows, j0, nk, w.lo, w.hi};
  const bool band = TileNeedsBand(place);
  const bool natural = band || HasScoreMods(p);
  if (natural) {
    const DF df;
    const VF scale = hn::Set(df, p.scale);
    for (int n = 0; n < kBq * kBk; n += kLanes) hn::Store(hn::Mul(hn::Load(df, w.s + n), scale), df, w.s + n);
    ApplyScoreMods(p, seq, place, w.s, kBk, band);
  }
  SoftmaxGradient(sh, w, b, h, i0, rows, j0, natural);

  // dVᵀ += dOᵀ·P', dKᵀ += Qᵀ·dS: B tiles (query chunk, key group g) at (chunk·4 + g)·kTile.
  Bf16Gemm(sh.tiles, l.GCols(qtile), size_t(pieces) * kBq, w.p_pairs, size_t{kBk / 16} * kTile, kTile,
           w.dvt + static_cast<size_t>(u) * dvp * kBk, kBk, dvp, kBk, kBq, true, l.OverQueries());
  Bf16Gemm(sh.tiles, l.QCols(qtile), size_t(pieces) * kBq, w.ds_pairs, size_t{kBk / 16} * kTile, kTile,
           w.dkt + static_cast<size_t>(u) * dp * kBk, kBk, dp, kBk, kBq, true, l.OverQueries());
  // dQ (+)= dS·K: B tiles (key chunk, column group g) at (chunk·dp/16 + g)·kTile.
  Bf16Gemm(sh.tiles, w.ds_rows, size_t(pieces) * kBk, l.KForDq(ktile), size_t{dp / 16} * kTile, kTile, w.dq, dp, kBq, dp,
           kBk, accumulate, l.ForDq());
}

/// Writes the first nk columns of acc ([width][64] f32, transposed) as nk rows of
/// `width` elements into a gradient tensor (element at + j·row for row j), through
/// buf (2·64·64 floats), 128 columns at a time.
ATTN_AMX void WriteTransposed(DType dt, const float* acc, int width, int nk, float* buf, float* base,
                              int64_t at, int64_t row) {
  constexpr int kChunk = 2 * kBk;
  for (int c0 = 0; c0 < width; c0 += kChunk) {
    const int n = std::min(kChunk, width - c0);
    // 16 × 16 blocks (acc has rows up to dp, a multiple of 32, and 64 columns; buf
    // takes 64 rows of kChunk): a scalar gather down acc's 256-byte stride took 15%
    // of a 64-query backward on Zen 4.
    for (int cb = 0; cb < n; cb += 16) {
      for (int jb = 0; jb < nk; jb += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(acc + static_cast<size_t>(c0 + cb + i) * kBk + jb);
        Transpose16x16(r);
        for (int k = 0; k < 16; ++k) _mm512_storeu_si512(buf + (jb + k) * kChunk + cb, r[k]);
      }
    }
    for (int j = 0; j < nk; ++j) StoreAs(dt, base, at + j * row + c0, buf + j * kChunk, n);
  }
}

/// Work item: key block kb (kItemTiles key tiles) of (b, hk) over every query head of
/// the group and every query tile whose band reaches it; writes dK and dV of its keys.
ATTN_AMX void BackwardItem(const BwdAmxShared& sh, int b, int hk, int kb) {
  const BackwardProblem& bp = sh.bp;
  const Problem& p = bp.fwd;
  const Sequence& seq = p.seqs[b];
  const int dp = sh.lay.dp, dvp = sh.lay.dvp;
  BwdAmxScratch w(dp, dvp, sh.lay.pieces);
  const int kt0 = kb * kItemTiles, kt1 = std::min(KeyTiles(seq.Lk), kt0 + kItemTiles);
  // The accumulators of the item's own key tiles (a short last block has fewer).
  std::fill(w.dkt, w.dkt + size_t(kt1 - kt0) * kBk * dp, 0.0f);
  std::fill(w.dvt, w.dvt + size_t(kt1 - kt0) * kBk * dvp, 0.0f);
  const DF df;
  for (int h = hk * p.group(); h < (hk + 1) * p.group(); ++h) {
    for (int qt = 0; qt < QueryTiles(seq.Lq); ++qt) {
      const int first = std::max(kt0, sh.qt_first[b][qt]), last = std::min(kt1 - 1, sh.qt_last[b][qt]);
      if (first > last) continue;  // not one of qt's blocks: no turn to pass
      const int i0 = qt * kBq, rows = std::min(kBq, seq.Lq - i0);
      for (int r = 0; r < rows; ++r) BandOfRow(p, seq, i0 + r, &w.lo[r], &w.hi[r]);
      bool any = false;
      for (int kt = first; kt <= last; ++kt) {
        if (BlockMaskCover(p, b, h, i0, rows, kt * kBk, std::min(kBk, seq.Lk - kt * kBk)) == Cover::kEmpty) continue;
        TilePair(sh, w, b, h, hk, kt, kt - kt0, qt, any);
        any = true;
      }
      // Added in ascending key-block order whatever the thread; blocks with nothing
      // to add pass the turn on all the same.
      std::atomic<int>& turn = WaitTurn(sh, b, h, kb, qt);
      for (int r = 0; any && r < rows; ++r) {
        float* acc = sh.dq + sh.lay.Row(p, b, h, i0 + r) * dp;
        const float* add = w.dq + static_cast<size_t>(r) * dp;
        for (int c = 0; c < dp; c += kLanes) hn::StoreU(hn::Add(hn::LoadU(df, acc + c), hn::Load(df, add + c)), df, acc + c);
      }
      turn.store(kb + 1, std::memory_order_release);
    }
  }
  // dK, dV rows from the transposed accumulators, through w.s/w.dp (64 rows of up to
  // 128 floats each; wider rows take several passes): reading the accumulators
  // column by column would touch a new cache line per element.
  for (int kt = kt0; kt < kt1; ++kt) {
    const int nk = std::min(kBk, seq.Lk - kt * kBk);
    const int64_t key0 = int64_t{kt} * kBk;
    WriteTransposed(bp.grad_dtype(), w.dkt + static_cast<size_t>(kt - kt0) * dp * kBk, p.d, nk, w.s,
                    bp.dk + 0, seq.dk_offset + hk * bp.dk_head + key0 * bp.dk_row, bp.dk_row);
    WriteTransposed(bp.grad_dtype(), w.dvt + static_cast<size_t>(kt - kt0) * dvp * kBk, p.dv, nk, w.s,
                    bp.dv + 0, seq.dv_offset + hk * bp.dv_head + key0 * bp.dv_row, bp.dv_row);
  }
}

/// Floats of the staging rows that packing reads K and V through: 64 rows of each as
/// packed (pieces·(dp + dvp) bf16 per key).
size_t StagingFloats(const BwdAmxLayout& lay) { return static_cast<size_t>(kBk) * lay.pieces * (lay.dp + lay.dvp) / 2; }

bool BackwardAmxImpl(const BackwardProblem& bp, int threads, bool tiles) {
  const Problem& p = bp.fwd;
  // What the portable path does instead (f16's pieces take three products each: only
  // the tile unit makes that pay).
  if (amx_backward_declines_options(bp, tiles ? LowpPath::amx : LowpPath::avx512bf16)) return false;
  const BwdAmxLayout lay = MakeBwdAmxLayout(p);
  bf16* pack = reinterpret_cast<bf16*>(thread_scratch(kSlotPackedKv, (lay.total + 1) / 2));
  std::vector<float> lse(lay.rows), dsum(lay.rows), dq(lay.rows * lay.dp);

  struct Item {
    int b, h, t;
  };
  std::vector<Item> qpacks, kpacks, items;
  std::vector<size_t> turn_base(p.seqs.size());
  std::vector<std::vector<int>> qt_first(p.seqs.size()), qt_last(p.seqs.size());
  size_t turn_total = 0;
  double flops = 0;
  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[b];
    turn_base[b] = turn_total, turn_total += size_t(p.Hq) * QueryTiles(seq.Lq);
    qt_first[b].resize(QueryTiles(seq.Lq)), qt_last[b].resize(QueryTiles(seq.Lq));
    for (int qt = 0; qt < QueryTiles(seq.Lq); ++qt) {
      QueryTileKeyRange(p, seq, qt, &qt_first[b][qt], &qt_last[b][qt]);
      for (int h = 0; h < p.Hq; ++h) qpacks.push_back({b, h, qt});
    }
    for (int hk = 0; hk < p.Hkv; ++hk) {
      for (int t = 0; t < KeyTiles(seq.Lk); ++t) kpacks.push_back({b, hk, t});
      for (int kb = 0; kb < KeyBlocks(seq.Lk); ++kb) items.push_back({b, hk, kb});
    }
    flops += 5.0 * seq.Lq * seq.Lk * (p.d + p.dv) * p.Hq;
  }
  std::unique_ptr<std::atomic<int>[]> turns(new std::atomic<int>[std::max<size_t>(1, turn_total)]);
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      for (int qt = 0; qt < QueryTiles(p.seqs[b].Lq); ++qt) {
        turns[turn_base[b] + size_t(h) * QueryTiles(p.seqs[b].Lq) + qt].store(qt_first[b][qt] / kItemTiles);
      }
    }
  }
  const BwdAmxShared sh{bp, lay, pack, lse.data(), dsum.data(), dq.data(), turns.get(), turn_base, qt_first, qt_last, tiles};
  const int nt = flops < 4e6 ? 1 : std::max(1, threads);
  const int nq = static_cast<int>(qpacks.size()), nk = static_cast<int>(kpacks.size()),
            ni = static_cast<int>(items.size());
  std::atomic<bool> declined{false};
  RunOnThreads(nt, [&] {
    bool ok = true;
    // 64 rows of K and of V as packed (pieces·(dp + dvp) bf16 each), as floats.
    bf16* staging = reinterpret_cast<bf16*>(thread_scratch(kSlotTile, StagingFloats(lay)));
#pragma omp for schedule(static) nowait
    for (int n = 0; n < nq; ++n) ok &= PackQueryTile(sh, qpacks[n].b, qpacks[n].h, qpacks[n].t, staging);
#pragma omp for schedule(static)
    for (int n = 0; n < nk; ++n) ok &= PackKeyTile(sh, kpacks[n].b, kpacks[n].h, kpacks[n].t, staging);
    if (!ok) declined.store(true);
#pragma omp barrier
    // Every thread reads the same flag after the barrier: all or none go on.
    if (!declined.load()) {
#pragma omp single
      {
        if (bp.varlen_q_tokens > 0 || bp.varlen_k_tokens > 0) {  // tokens outside every sequence: 0
          for (int64_t t = 0; t < bp.varlen_q_tokens; ++t)
            for (int h = 0; h < p.Hq; ++h) ZeroAs(bp.grad_dtype(), bp.dq, t * bp.dq_row + h * bp.dq_head, p.d);
          for (int64_t t = 0; t < bp.varlen_k_tokens; ++t)
            for (int hk = 0; hk < p.Hkv; ++hk) {
              ZeroAs(bp.grad_dtype(), bp.dk, t * bp.dk_row + hk * bp.dk_head, p.d);
              ZeroAs(bp.grad_dtype(), bp.dv, t * bp.dv_row + hk * bp.dv_head, p.dv);
            }
        }
        for (int b = 0; b < p.B; ++b) {  // keys beyond key_lengths[b] get no gradient
          const Sequence& seq = p.seqs[b];
          for (int64_t j = seq.Lk; j < seq.Lk_rows; ++j)
            for (int hk = 0; hk < p.Hkv; ++hk) {
              ZeroAs(bp.grad_dtype(), bp.dk, seq.dk_offset + hk * bp.dk_head + j * bp.dk_row, p.d);
              ZeroAs(bp.grad_dtype(), bp.dv, seq.dv_offset + hk * bp.dv_head + j * bp.dv_row, p.dv);
            }
        }
      }
      if (tiles) ConfigureTiles();
#pragma omp for schedule(monotonic : dynamic, 1)
      for (int n = 0; n < ni; ++n) BackwardItem(sh, items[n].b, items[n].h, items[n].t);
      if (tiles) ReleaseTiles();
      // dQ out of its accumulator, in the gradients' dtype.
#pragma omp for schedule(static)
      for (int n = 0; n < nq; ++n) {
        const auto [b, h, qt] = qpacks[n];
        const Sequence& seq = p.seqs[b];
        for (int i = qt * kBq; i < std::min(seq.Lq, (qt + 1) * kBq); ++i) {
          StoreAs(bp.grad_dtype(), bp.dq, seq.dq_offset + h * bp.dq_head + int64_t{i} * bp.dq_row, sh.dq + lay.Row(p, b, h, i) * lay.dp,
                  p.d);
        }
      }
    }
  });
  return !declined.load();
}

size_t WorkspaceBytesImpl(const BackwardProblem& bp, int threads) {
  const Problem& p = bp.fwd;
  const BwdAmxLayout lay = MakeBwdAmxLayout(p);
  size_t turns = 0;
  for (const Sequence& seq : p.seqs) turns += static_cast<size_t>(p.Hq) * QueryTiles(seq.Lq);
  // The tile slot serves the staging rows while packing, then the items' scratch.
  const size_t per_thread = std::max(StagingFloats(lay), BwdAmxScratch::Floats(lay.dp, lay.dvp, lay.pieces));
  return sizeof(bf16) * lay.total + sizeof(float) * (static_cast<size_t>(std::max(1, threads)) * per_thread +
                                                     lay.rows * (2 + static_cast<size_t>(lay.dp))) +
         sizeof(std::atomic<int>) * std::max<size_t>(1, turns);
}
#else
bool BackwardAmxImpl(const BackwardProblem&, int, bool) { return false; }
size_t WorkspaceBytesImpl(const BackwardProblem&, int) { return 0; }
#endif  // ATTN_AMX_KERNEL

}  // namespace

bool BackwardAmx(const BackwardProblem& bp, int threads, bool tiles) { return BackwardAmxImpl(bp, threads, tiles); }
size_t BackwardAmxWorkspaceBytes(const BackwardProblem& bp, int threads) { return WorkspaceBytesImpl(bp, threads); }

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

bool attention_backward_amx(const BackwardProblem& bp, int threads, LowpPath path) {
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3)
  return N_AVX3::BackwardAmx(bp, threads, path == LowpPath::amx);
#else
  (void)bp, (void)threads, (void)path;
  return false;
#endif
}

size_t attention_backward_amx_workspace_bytes(const BackwardProblem& bp, int threads) {
#if defined(__x86_64__) && (HWY_TARGETS & HWY_AVX3)
  return N_AVX3::BackwardAmxWorkspaceBytes(bp, threads);
#else
  (void)bp, (void)threads;
  return 0;
#endif
}

}  // namespace attn::detail
#endif  // HWY_ONCE
