// Per-target SIMD building blocks of the fused attention forward: the two
// register-tiled matrix products (S = Q·Kᵀ and O = α·O + P·V) and the online
// softmax of a score tile. Included by src/cpu/attention_forward.cc once per
// Highway target (hence the toggling include guard, as in Highway's skeleton).
//
// Tile geometry (N = floats per vector: 16 on AVX-512, 8 on AVX2, 4 on SSE4):
//   Bk = 4·N keys per tile; Bq = 16·kRowsPerBlock queries per tile (64 on AVX-512, 48 on AVX2).
//   K is pre-packed per key tile as a [d][Bk] panel, so one row of the panel is
//   4 vectors and S's register tile is kRowsPerBlock rows × 4 vectors.
//   V is pre-packed as [Bk][dvp] (dvp = dv rounded up to N), zero padded.

#if defined(ATTN_CPU_TILE_KERNELS_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_TILE_KERNELS_INL_H_
#undef ATTN_CPU_TILE_KERNELS_INL_H_
#else
#define ATTN_CPU_TILE_KERNELS_INL_H_
#endif

#include <hwy/contrib/math/math-inl.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstring>

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

/// Floats per vector on this target.
constexpr int kLanes = static_cast<int>(HWY_LANES(float));
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
constexpr int kVectorRegisters = 32;
#else
constexpr int kVectorRegisters = 16;
#endif
/// Rows per register tile: 4×4 accumulators (16 independent FMA chains, twice
/// the 4-cycle latency × 2 pipes) leave AVX-512 registers for the loads; 64-query
/// tiles then align with 64-key tiles, which keeps causal diagonals cheap.
/// AVX2: 3×4 = 12 of its 16 registers.
constexpr int kRowsPerBlock = kVectorRegisters == 32 ? 4 : 3;
constexpr int kKeyVectors = 4;
constexpr int kBk = kKeyVectors * kLanes;        // keys per tile
constexpr int kBq = 16 * kRowsPerBlock;          // queries per tile
static_assert(kBq % kLanes == 0 || kLanes > kBq, "row vectors must tile Bq");

HWY_INLINE int RoundUp(int x, int m) { return (x + m - 1) / m * m; }

/// v, kept in a register by the compiler: an operand GCC would otherwise fold into
/// every FMA that uses it as a memory operand, loading it once per use. AVX2 cores
/// that split 256-bit loads in two (AMD Zen 1) are then bound by loads rather than
/// FMAs. AVX-512 targets (32 registers, full-width loads) are left to the compiler:
/// nothing was measured there.
HWY_INLINE VF InRegister(VF v) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_AVX3 && HWY_TARGET != HWY_AVX3_DL && HWY_TARGET != HWY_SCALAR && \
    HWY_TARGET != HWY_EMU128
  asm("" : "+x"(v.raw));
#endif
  return v;
}

/// Prefetches `lines` cache lines from `next` into L2 (not L1, which the running
/// product's own tiles fill), one every `steps / lines` calls of Step(): the forward
/// asks for the next phase's packed panel (up to 32 KiB) while the current phase's
/// products run, the backward for dO and the dQ sum of its tile pair (see
/// BackwardTilePair). Unrequested, that panel is one the previous query tile pushed out
/// of L2 (one head's K and V are 2 MiB at N = 2048, d = 128; Ice Lake's L2 is
/// 1.25 MiB), and the first row block that reads it waits on L3 line by line: ~3.1×
/// the time of the other blocks (rdtsc per block on a Xeon, family 6 model 106).
/// Spread, not in one burst at the start of a block: 32 prefetches in a row take every
/// fill buffer for an L3 latency and stall the block's own loads (+11–17% per block,
/// measured the same way), which cancelled the gain.
class SpreadPrefetch {
 public:
  SpreadPrefetch(const void* next, int lines, int steps)
      : next_(static_cast<const char*>(next)),
        left_(next == nullptr ? 0 : std::max(lines, 0)),
        gap_(left_ > 0 ? std::max(1, steps / left_) : 0),
        countdown_(gap_) {}
  SpreadPrefetch(const SpreadPrefetch&) = delete;
  SpreadPrefetch& operator=(const SpreadPrefetch&) = delete;
  /// The lines no step reached are requested at once.
  ~SpreadPrefetch() {
    while (left_ > 0) Issue();
  }

  HWY_INLINE void Step() {
    if (left_ > 0 && --countdown_ == 0) {
      Issue();
      countdown_ = gap_;
    }
  }

 private:
  HWY_INLINE void Issue() {
    __builtin_prefetch(next_, 0, 2);  // locality 2: prefetcht1, to L2
    if (--left_ > 0) next_ += 64;     // never past the last line asked for
  }

  const char* next_ = nullptr;
  int left_ = 0, gap_ = 0, countdown_ = 0;
};

/// A packed panel of `bytes` bytes cut into one slice of cache lines per row block
/// of a tile: what each block of the current phase requests for the next, through
/// a SpreadPrefetch of its own.
struct PanelSlices {
  const char* base = nullptr;
  int lines = 0, per = 0;

  PanelSlices() = default;
  PanelSlices(const float* panel, size_t bytes, int blocks)
      : base(reinterpret_cast<const char*>(panel)),
        lines(static_cast<int>((bytes + 63) / 64)),
        per((lines + std::max(blocks, 1) - 1) / std::max(blocks, 1)) {}
  /// nullptr past the panel's last line (a pointer there would point past it).
  const char* Slice(int blk) const { return SliceLines(blk) == 0 ? nullptr : base + size_t{64} * blk * per; }
  int SliceLines(int blk) const { return base == nullptr ? 0 : std::clamp(lines - blk * per, 0, per); }
};

/// Key tiles covering lk keys, and query tiles covering lq queries.
HWY_INLINE int KeyTiles(int lk) { return (lk + kBk - 1) / kBk; }
HWY_INLINE int QueryTiles(int lq) { return (lq + kBq - 1) / kBq; }

/// S[r][n·N ..] = Σ_c Q[r][c] · Kt[c][n·N ..] for kRowsPerBlock rows and NKV key
/// vectors. q: rows of d floats (row stride q_ld); kt: the [d][Bk] panel, offset
/// to the first key vector wanted; s: row stride s_ld, offset likewise.
template <int NKV>
HWY_INLINE void QkBlock(const float* HWY_RESTRICT q, size_t q_ld,
                        const float* HWY_RESTRICT kt, int d, float* HWY_RESTRICT s,
                        size_t s_ld, SpreadPrefetch* pf) {
  const DF df;
  VF acc[kRowsPerBlock][NKV];
  for (int r = 0; r < kRowsPerBlock; ++r) {
    for (int n = 0; n < NKV; ++n) acc[r][n] = hn::Zero(df);
  }
  for (int c = 0; c < d; ++c) {
    if (pf != nullptr) pf->Step();
    const float* HWY_RESTRICT panel_row = kt + static_cast<size_t>(c) * kBk;
    VF kv[NKV];
    for (int n = 0; n < NKV; ++n) kv[n] = hn::Load(df, panel_row + n * kLanes);
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const VF qv = hn::Set(df, q[r * q_ld + c]);
      for (int n = 0; n < NKV; ++n) acc[r][n] = hn::MulAdd(qv, kv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < kRowsPerBlock; ++r) {
    for (int n = 0; n < NKV; ++n) hn::Store(acc[r][n], df, s + r * s_ld + n * kLanes);
  }
}

/// Scores of kRowsPerBlock rows for the key vectors first..first+count−1 of the
/// tile (0 ≤ first, count ≤ kKeyVectors); every other score of those rows is
/// set to −∞ (the band rules those keys out for every row of the block).
/// pf (optional) is stepped once per inner step (d of them).
HWY_INLINE void QkRows(const float* HWY_RESTRICT q, size_t q_ld, const float* HWY_RESTRICT kt,
                       int d, float* HWY_RESTRICT s, size_t s_ld, int first, int count,
                       SpreadPrefetch* pf = nullptr) {
  const DF df;
  const float* k0 = kt + first * kLanes;
  float* s0 = s + first * kLanes;
  switch (count) {
    case 4: QkBlock<4>(q, q_ld, k0, d, s0, s_ld, pf); break;
    case 3: QkBlock<3>(q, q_ld, k0, d, s0, s_ld, pf); break;
    case 2: QkBlock<2>(q, q_ld, k0, d, s0, s_ld, pf); break;
    case 1: QkBlock<1>(q, q_ld, k0, d, s0, s_ld, pf); break;
    default: break;
  }
  for (int n = 0; n < kKeyVectors; ++n) {
    if (n >= first && n < first + count) continue;
    for (int r = 0; r < kRowsPerBlock; ++r) hn::Store(hn::Set(df, -HUGE_VALF), df, s + r * s_ld + n * kLanes);
  }
}

/// O[r][cols] = alpha[r]·O[r][cols] + Σ_{j<nk} A[r][j] · B[j][cols], for
/// kRowsPerBlock rows and NV vectors of columns. A[r][j] = a[r·a_row + j·a_inner]
/// (so Aᵀ of a stored matrix is a stride swap away); B: row stride b_ld, points at
/// the first column; o: row stride o_ld. alpha = nullptr means 1.
/// The forward's O = α·O + P·V; the backward's dV += Pᵀ·dO, dK += dSᵀ·Q, dQ = dS·K.
template <int NV>
HWY_INLINE void PvBlock(const float* HWY_RESTRICT a, size_t a_row, size_t a_inner,
                        const float* HWY_RESTRICT b, size_t b_ld, int nk,
                        const float* HWY_RESTRICT alpha, float* HWY_RESTRICT o, size_t o_ld,
                        SpreadPrefetch* pf) {
  const DF df;
  VF acc[kRowsPerBlock][NV];
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const VF al = hn::Set(df, alpha != nullptr ? alpha[r] : 1.0f);
    for (int n = 0; n < NV; ++n) acc[r][n] = hn::Mul(hn::Load(df, o + r * o_ld + n * kLanes), al);
  }
  for (int j = 0; j < nk; ++j) {
    if (pf != nullptr) pf->Step();
    const float* HWY_RESTRICT brow = b + static_cast<size_t>(j) * b_ld;
    VF bv[NV];
    for (int n = 0; n < NV; ++n) bv[n] = hn::Load(df, brow + n * kLanes);
    for (int r = 0; r < kRowsPerBlock; ++r) {
      const VF av = hn::Set(df, a[r * a_row + j * a_inner]);
      for (int n = 0; n < NV; ++n) acc[r][n] = hn::MulAdd(av, bv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < kRowsPerBlock; ++r) {
    for (int n = 0; n < NV; ++n) hn::Store(acc[r][n], df, o + r * o_ld + n * kLanes);
  }
}

/// Inner steps PvRows takes for `width` columns and nk inner steps: nk per block
/// of up to 4 vectors of columns (what a SpreadPrefetch it steps should spread over).
HWY_INLINE int PvSteps(int width, int nk) { return nk * ((width + 4 * kLanes - 1) / (4 * kLanes)); }

/// O = α·O + A·B over all `width` columns (a multiple of kLanes; B and O have that
/// row stride), for kRowsPerBlock rows and nk inner steps: columns in blocks of
/// up to 4 vectors (4 × 4 = 16 accumulators). pf (optional) is stepped once per
/// inner step of each column block: PvSteps(width, nk) in all.
HWY_INLINE void PvRows(const float* HWY_RESTRICT a, size_t a_row, size_t a_inner,
                       const float* HWY_RESTRICT b, int width, int nk,
                       const float* HWY_RESTRICT alpha, float* HWY_RESTRICT o,
                       SpreadPrefetch* pf = nullptr) {
  int c = 0;
  for (; c + 4 * kLanes <= width; c += 4 * kLanes) {
    PvBlock<4>(a, a_row, a_inner, b + c, width, nk, alpha, o + c, width, pf);
  }
  switch ((width - c) / kLanes) {
    case 3: PvBlock<3>(a, a_row, a_inner, b + c, width, nk, alpha, o + c, width, pf); break;
    case 2: PvBlock<2>(a, a_row, a_inner, b + c, width, nk, alpha, o + c, width, pf); break;
    case 1: PvBlock<1>(a, a_row, a_inner, b + c, width, nk, alpha, o + c, width, pf); break;
    default: break;
  }
}

/// PvRows for tiles holding non-finite numbers: the same O = α·O + A·B, except
/// that step j of row r is skipped where gate[r·g_row + j·g_inner] equals `skip`
/// (a removed key's −∞ score, or a zero probability), so that 0·NaN and 0·∞ from
/// keys that take no part cannot reach O. Row r's sum runs over j in the same
/// order, with the same fused multiply-adds, as PvBlock's.
HWY_INLINE void PvRowsGated(const float* HWY_RESTRICT a, size_t a_row, size_t a_inner,
                            const float* HWY_RESTRICT gate, size_t g_row, size_t g_inner,
                            float skip, const float* HWY_RESTRICT b, int width, int nk,
                            const float* HWY_RESTRICT alpha, float* HWY_RESTRICT o) {
  const DF df;
  for (int r = 0; r < kRowsPerBlock; ++r) {
    float* orow = o + static_cast<size_t>(r) * width;
    const VF al = hn::Set(df, alpha != nullptr ? alpha[r] : 1.0f);
    for (int c = 0; c < width; c += kLanes) hn::Store(hn::Mul(hn::Load(df, orow + c), al), df, orow + c);
    for (int j = 0; j < nk; ++j) {
      if (gate[r * g_row + j * g_inner] == skip) continue;
      const VF av = hn::Set(df, a[r * a_row + j * a_inner]);
      const float* brow = b + static_cast<size_t>(j) * width;
      for (int c = 0; c < width; c += kLanes) {
        hn::Store(hn::MulAdd(av, hn::Load(df, brow + c), hn::Load(df, orow + c)), df, orow + c);
      }
    }
  }
}

/// True when none of the n floats is NaN or ±∞.
HWY_INLINE bool AllFinite(const float* HWY_RESTRICT x, size_t n) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  const auto exp_mask = hn::Set(du, 0x7F800000u);
  auto bad = hn::Zero(du);
  size_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const auto bits = hn::BitCast(du, hn::LoadU(df, x + i));
    bad = hn::Or(bad, hn::VecFromMask(du, hn::Eq(hn::And(bits, exp_mask), exp_mask)));
  }
  bool ok = hn::AllTrue(du, hn::Eq(bad, hn::Zero(du)));
  for (; i < n; ++i) ok = ok && std::isfinite(x[i]);
  return ok;
}

/// Packs rows first..nk−1 of `width` floats (row j at row_at(j), called once per
/// row in order) transposed into a [width][Bk] panel; rows nk..zero_to−1 are zero
/// (zero_to = Bk, or for a reader that never reaches a key vector past the last
/// key, nk rounded up to whole vectors). (QkRows reads K, and V, this way.)
template <class RowAt>
HWY_INLINE void PackPanelRows(const RowAt& row_at, int nk, int width, float* dst, int first = 0,
                              int zero_to = kBk) {
  // The padding keys first, as whole vectors of each panel row from the one that
  // holds key max(first, nk) (the real keys among them are written below): one
  // store per float down a column cost a one-token call half its time.
  // (A fixed trip count with a test, not a loop from `pad`: GCC turns that loop
  // into a `rep stos` per row, which costs more than the stores.)
  const int pad = std::max(first, nk) / kLanes * kLanes;
  if (pad < zero_to) {
    const DF df;
    for (int c = 0; c < width; ++c) {
      for (int n = 0; n < kKeyVectors; ++n) {
        if (n * kLanes >= pad && n * kLanes < zero_to) {
          hn::StoreU(hn::Zero(df), df, dst + static_cast<size_t>(c) * kBk + n * kLanes);
        }
      }
    }
  }
  // Row by row: rows are often 4 KiB apart (H·d floats), so walking a column
  // would touch 64 lines of one L1 set; a row is contiguous, the panel is in L1.
  for (int j = first; j < nk; ++j) {
    const float* row = row_at(j);
    for (int c = 0; c < width; ++c) dst[static_cast<size_t>(c) * kBk + j] = row[c];
  }
}

#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
/// Transposes the 16 × 16 floats in r (r[i] = row i) in place: 64 shuffles, where
/// the scalar transpose takes 256 loads and 256 stores (packing K was 3% of the f32
/// forward at d = 64, and twice that for causal masks).
HWY_INLINE void Transpose16x16(__m512 r[16]) {
  __m512 t[16];
  for (int k = 0; k < 8; ++k) {  // 32-bit pairs of rows 2k, 2k + 1
    t[2 * k] = _mm512_unpacklo_ps(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_ps(r[2 * k], r[2 * k + 1]);
  }
  for (int k = 0; k < 4; ++k) {  // 64-bit quads of rows 4k … 4k + 3
    const __m512d a = _mm512_castps_pd(t[4 * k]), b = _mm512_castps_pd(t[4 * k + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * k + 2]), d = _mm512_castps_pd(t[4 * k + 3]);
    r[4 * k] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * k + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * k + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * k + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int k = 0; k < 2; ++k) {  // 128-bit blocks of rows 8k … 8k + 7
    for (int i = 0; i < 4; ++i) {
      t[8 * k + i] = _mm512_shuffle_f32x4(r[8 * k + i], r[8 * k + 4 + i], 0x88);
      t[8 * k + 4 + i] = _mm512_shuffle_f32x4(r[8 * k + i], r[8 * k + 4 + i], 0xdd);
    }
  }
  for (int i = 0; i < 8; ++i) {  // and of all 16
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
  }
}
#endif

/// PackPanelRows of rows src + j·src_ld (f32 rows in place), by 16 × 16 blocks
/// where AVX-512 has them.
HWY_INLINE void PackPanel(const float* src, int64_t src_ld, int nk, int width, float* dst, int zero_to = kBk) {
  int first = 0;
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  const int full_cols = width / 16 * 16;
  for (; first + 16 <= nk; first += 16) {
    const float* rows = src + int64_t{first} * src_ld;
    for (int c = 0; c < full_cols; c += 16) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(rows + i * src_ld + c);
      Transpose16x16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(dst + static_cast<size_t>(c + i) * kBk + first, r[i]);
    }
    for (int i = 0; i < 16; ++i) {
      for (int c = full_cols; c < width; ++c) dst[static_cast<size_t>(c) * kBk + first + i] = rows[i * src_ld + c];
    }
  }
#endif
  PackPanelRows([&](int j) { return src + int64_t{j} * src_ld; }, nk, width, dst, first, zero_to);
}

/// Copies nk rows of `width` floats (row j at row_at(j)) into Bk rows of `padded`
/// floats (a multiple of kLanes); the padding columns and rows nk..zero_to−1 are
/// zero (0·0 keeps products of padding NaN-free; zero_to as for PackPanelRows).
template <class RowAt>
HWY_INLINE void PackRowsFrom(const RowAt& row_at, int nk, int width, int padded, float* dst, int zero_to = kBk) {
  for (int j = 0; j < zero_to; ++j) {
    float* row = dst + static_cast<size_t>(j) * padded;
    if (j < nk) {
      std::memcpy(row, row_at(j), sizeof(float) * width);
      std::fill(row + width, row + padded, 0.0f);
    } else {
      std::fill(row, row + padded, 0.0f);
    }
  }
}

/// PackRowsFrom of rows src + j·src_ld.
HWY_INLINE void PackRows(const float* src, int64_t src_ld, int nk, int width, int padded, float* dst,
                         int zero_to = kBk) {
  PackRowsFrom([&](int j) { return src + int64_t{j} * src_ld; }, nk, width, padded, dst, zero_to);
}

/// max(x, lo) that keeps NaN: x86's maxps returns its second operand when either
/// is NaN; Highway's scalar Max returns the other operand, so use a select there.
HWY_INLINE VF ClampBelow(DF df, VF x, float lo) {
#if HWY_ARCH_X86 && HWY_TARGET != HWY_SCALAR && HWY_TARGET != HWY_EMU128
  return hn::Max(hn::Set(df, lo), x);
#else
  return hn::IfThenElse(hn::Lt(x, hn::Set(df, lo)), hn::Set(df, lo), x);
#endif
}

/// n (a whole number in int32's range, or NaN) as int32: NaN gives INT_MIN on x86,
/// 0 elsewhere (either shifts to 0 in Exp2NonPositive). On x86 the bare truncation:
/// Highway's ConvertTo adds 3-4 ops that map positive overflow (and positive NaN) to
/// INT_MAX, which the softmax neither needs nor survives.
template <class DI>
HWY_INLINE hn::Vec<DI> WholeToInt(DI di, VF n) {
#if HWY_ARCH_X86 && HWY_TARGET == HWY_AVX2
  (void)di;
  return hn::Vec<DI>{_mm256_cvttps_epi32(n.raw)};
#elif HWY_ARCH_X86 && (HWY_TARGET == HWY_SSE4 || HWY_TARGET == HWY_SSSE3)
  (void)di;
  return hn::Vec<DI>{_mm_cvttps_epi32(n.raw)};
#else
  return hn::ConvertTo(di, hn::IfThenZeroElse(hn::IsNaN(n), n));
#endif
}

/// 2^x for x ≤ 0 (or NaN), within 2 ulp down to the smallest normal, correctly
/// scaled into the subnormals below it, exactly 0 below −150 (so for x = −∞),
/// and NaN for NaN: the softmax's exponential.
/// AVX-512, 8 vector ops (each one counts: they share the two FMA ports with the
/// products, and the softmax is 15% of the f32 kernel's time at d = 64):
///   f = x − ⌊x⌋ by vreduceps       (f ∈ [0, 1], exact but for x just below an
///                                  integer, where f rounds up to 1; −∞ gives 0)
///   2^f by a degree-6 polynomial   (minimax on [0, 1), 9.0e-8; 2^0 = 1 exactly)
///   2^⌊x⌋ by vscalefps             (one rounding, into the subnormals; 2^−∞ = 0)
/// Elsewhere, 12 ops (AVX2: the f32 softmax was ~18% of the forward's time at d = 64
/// on a Zen 1 core with the 20 this once took, two scalings by 2^n included):
///   x = max(x, −151)              (NaN stays NaN; 2^−151 rounds to 0, as all below)
///   n = round(x), f = x − n       (exact; |f| ≤ 1/2)
///   2^(f+25) by a degree-5 polynomial whose coefficients carry the 2^25 (minimax
///                                 on [−1/2, 1/2]; error ≤ 1.7e-7 with fused
///                                 multiply-adds, 1.9e-7 without them (SSE4, scalar);
///                                 scaling by 2^25 is exact)
///   2^(n+f+25) by adding n to its exponent field (an integer add: the value is a
///                                 normal number, n + 25 ≥ −126), then × 2^−25: the
///                                 one product that can leave the normal range, so
///                                 it rounds once, into the subnormals or to 0.
/// Exact zeros matter: a removed key's p multiplies its value, and a value near
/// FLT_MAX times a "tiny" 2^−125 would add ~8 to the output. And 2^0 must be 1
/// exactly: α = 1 tells the callers that a row's max did not move.
HWY_INLINE VF Exp2NonPositive(DF df, VF x) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  (void)df;
  const __m512 f = _mm512_reduce_ps(x.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  // Minimax for 2^f on [0, 1) (relative error), constant term 1.
  __m512 e = _mm512_set1_ps(2.161291988e-4f);
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.246784514e-3f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(9.675451694e-3f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(5.548528056e-2f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(2.402293056e-1f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(6.931470444e-1f));
  e = _mm512_fmadd_ps(e, f, _mm512_set1_ps(1.0f));
  return VF{_mm512_scalef_ps(e, x.raw)};
#else
  x = ClampBelow(df, x, -151.0f);
  const VF n = hn::Round(x);
  const VF f = hn::Sub(x, n);
  // 2^25 · c_k, k = 5 … 0 (Horner): c_k minimise the relative error of 2^f on
  // [−1/2, 1/2] with c_0 = 1 fixed (9.1e-8; 1.6e-7 with f32 rounding, against 2.1e-7
  // for the degree-6 Taylor series this replaced, which took one more FMA; its root
  // mean square error is larger, 6.6e-8 against 4.2e-8, which raised the f32 output's
  // error against float64 by up to 13% in `attn check`'s cases, for 2-4% of the time at
  // d = 64 on Zen 1; tests/softmax_exp_test.cc measures it on every target). Each
  // step's value is the unscaled one times 2^25 exactly, so e = 2^25 · 2^f bit for
  // bit as without the factor.
  constexpr float kUp = 33554432.0f;  // 2^25
  VF e = hn::Set(df, kUp * 1.3264727224e-3f);
  e = hn::MulAdd(e, f, hn::Set(df, kUp * 9.6715126711e-3f));
  e = hn::MulAdd(e, f, hn::Set(df, kUp * 5.5507337435e-2f));
  e = hn::MulAdd(e, f, hn::Set(df, kUp * 2.4022242085e-1f));
  e = hn::MulAdd(e, f, hn::Set(df, kUp * 6.9314697760e-1f));
  e = hn::MulAdd(e, f, hn::Set(df, kUp));
  // e ∈ [2^24.5, 2^25.5], n ∈ [−151, 0], and n = −151 only with f ≥ 0 (e ≥ 2^25),
  // so e · 2^n ≥ 2^−126 is normal and adding n to the exponent field multiplies by
  // 2^n exactly. NaN: e is NaN (Max returns its second operand for a NaN first one,
  // on x86 and Highway's scalar target alike); WholeToInt gives INT_MIN or 0 for
  // n = NaN, whose shift is 0, so the sum keeps e's NaN bits.
  const hn::RebindToSigned<DF> di;
  const auto scaled = hn::Add(hn::BitCast(di, e), hn::ShiftLeft<23>(WholeToInt(di, n)));
  return hn::Mul(hn::BitCast(df, scaled), hn::Set(df, 1.0f / kUp));
#endif
}

/// e^x for x ≤ 0 (or NaN) through Exp2NonPositive: scores and maxima stay in
/// natural units (no log₂e folded into the query, which would overflow f32 for
/// finite scores above FLT_MAX / log₂e ≈ 2.4e38); the difference x = s − m is
/// formed first, so only it is scaled.
HWY_INLINE VF ExpNonPositive(DF df, VF x) {
  return Exp2NonPositive(df, hn::Mul(x, hn::Set(df, 1.44269504088896341f)));
}

/// The maximum of a row of Bk scores for the softmax. A NaN score may be dropped
/// by the max instructions (they return their second operand when one is NaN),
/// which is harmless when the row has a finite max: the NaN's p is NaN, so the row's
/// l and output turn NaN. A row whose other scores are all −∞ would skip its
/// exponentials, so only then is it searched for a NaN (rare: fully masked rows),
/// and NaN returned. Testing each vector for NaN instead costs two of the ~13
/// vector ops the softmax spends per vector of scores.
HWY_INLINE float RowMaxForSoftmax(DF df, const float* HWY_RESTRICT row) {
  VF mx = hn::Load(df, row);
  for (int n = 1; n < kKeyVectors; ++n) mx = hn::Max(mx, hn::Load(df, row + n * kLanes));
  const float max = hn::GetLane(hn::MaxOfLanes(df, mx));
  if (max != -HUGE_VALF) return max;
  // Padding rows of every tile come here too, so the search is vectorised.
  auto nan = hn::IsNaN(hn::Load(df, row));
  for (int n = 1; n < kKeyVectors; ++n) nan = hn::Or(nan, hn::IsNaN(hn::Load(df, row + n * kLanes)));
  return hn::AllFalse(df, nan) ? max : NAN;
}

/// Online-softmax step for a tile of `rows` rows × Bk scores (row stride ld),
/// FlashAttention-2 style. On entry s holds the final scores in natural units
/// (−∞ = removed); on exit it holds p = e^(s − m_new). Updates the running max m
/// per row and the running sums l — one vector of kLanes partial sums per row
/// ([rows][kLanes]), reduced only at the end (RowSum), which saves a horizontal
/// add per row per tile — and writes alpha = e^(m_old − m_new), the factor the
/// output rows must be rescaled by. m, alpha and row_max hold `rows` rounded up to
/// a multiple of kLanes (the padding lanes are scratch). Returns false
/// when every score of the tile is −∞ (then m and l are unchanged and alpha is
/// all 1, so the P·V product may be skipped).
/// Non-finite scores follow the float64 reference: a NaN score makes the row's
/// l NaN (and its max too, or not: RowMaxForSoftmax), and from then on its l and
/// output are NaN; a +∞ score makes the max +∞ and its own p = e^(∞ − ∞) = NaN,
/// as in any softmax.
HWY_INLINE bool SoftmaxTile(float* HWY_RESTRICT s, size_t ld, int rows, float* HWY_RESTRICT m,
                            float* HWY_RESTRICT l, float* HWY_RESTRICT alpha,
                            float* HWY_RESTRICT row_max) {
  const DF df;
  const VF neg_inf = hn::Set(df, -HUGE_VALF);
  bool any = false;
  for (int r = 0; r < rows; ++r) {
    row_max[r] = RowMaxForSoftmax(df, s + r * ld);
    any |= row_max[r] != -HUGE_VALF;  // true for NaN too
  }
  if (!any) {
    for (int r = 0; r < rows; ++r) alpha[r] = 1.0f;
    return false;
  }
  // Rows past `rows` in the last vector are padding: −∞ keeps their lanes inert.
  for (int r = rows; r < RoundUp(rows, kLanes); ++r) row_max[r] = -HUGE_VALF;
  // Per row, vectorised over rows: the new max (NaN sticks), the max actually
  // subtracted (0 for a row that has seen only −∞, so exp gives 0 rather than
  // NaN) and alpha.
  for (int r = 0; r < rows; r += kLanes) {
    const VF m_old = hn::Load(df, m + r);
    const VF tile_max = hn::Load(df, row_max + r);
    const VF m_new = hn::IfThenElse(hn::Or(hn::IsNaN(m_old), hn::IsNaN(tile_max)),
                                    hn::Set(df, NAN), hn::Max(m_old, tile_max));
    const VF m_use = hn::IfThenZeroElse(hn::Eq(m_new, neg_inf), m_new);
    // e^(m_old − m_use): 1 exactly when the max did not move (blocks that saw no
    // key of the tile rely on that); 0 exactly when m_old = −∞ (O and l are 0).
    hn::Store(ExpNonPositive(df, hn::Sub(m_old, m_use)), df, alpha + r);
    hn::Store(m_new, df, m + r);
    hn::Store(m_use, df, row_max + r);  // reused below as the max to subtract
  }
  for (int r = 0; r < rows; ++r) {
    float* row = s + r * ld;
    if (m[r] == -HUGE_VALF) {  // no visible key yet: p = 0 exactly
      for (int n = 0; n < kKeyVectors; ++n) hn::Store(hn::Zero(df), df, row + n * kLanes);
      continue;
    }
    const VF mu = hn::Set(df, row_max[r]);
    VF sum[kKeyVectors];
    for (int n = 0; n < kKeyVectors; ++n) {
      // s − m ≤ 0; it may round to −∞ (s = −FLT_MAX, m = FLT_MAX), where e^x is 0.
      sum[n] = ExpNonPositive(df, hn::Sub(hn::Load(df, row + n * kLanes), mu));
      hn::Store(sum[n], df, row + n * kLanes);
    }
    float* lr = l + r * kLanes;
    const VF tile_sum = hn::Add(hn::Add(sum[0], sum[1]), hn::Add(sum[2], sum[3]));
    hn::Store(hn::MulAdd(hn::Load(df, lr), hn::Set(df, alpha[r]), tile_sum), df, lr);
  }
  return true;
}

/// The total of row r's partial sums kept by SoftmaxTile.
HWY_INLINE float RowSum(const float* HWY_RESTRICT l, int r) {
  const DF df;
  return hn::GetLane(hn::SumOfLanes(df, hn::Load(df, l + r * kLanes)));
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
