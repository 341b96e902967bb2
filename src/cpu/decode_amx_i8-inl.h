// The decode kernel's AMX-INT8 path for i8 caches (cpu/attention_decode.cc): both
// products on tiles, with the cache's int8 codes as tile operands as they are, so no
// key or value element is widened to f32. Per Highway target, hence the toggling
// include guard; the tile code exists for the AVX3 target only (every AMX CPU has
// AVX-512), ATTN_DECODE_AMX_I8 says whether this pass has it.
//
// Exactness. The tiles multiply integers, so the f32 operands — the scaled queries
// for S = Q·Kᵀ, the probabilities (times the values' scales) for P·V — enter as
// fixed-point integers of 24 bits, relative to their row's largest magnitude, cut
// into three 8-bit digits. The digits' products are exact int32 sums; the three
// partial results are weighted by 1, 2⁸, 2¹⁶ and the row's unit in f32. A value
// thus carries an absolute error of at most 2⁻²⁴ of its row's largest (f32's own
// rounding is 2⁻²⁴ relative), so the kernel stays at f32 accuracy against the
// float64 reference on the dequantized cache (kvcache_test, bench/kvcache_error).
//
// Tiles (palette 1, all 16 rows × 64 bytes: amx_tiles-inl.h's ConfigureTiles), set once
// per thread and call:
//   scores  C 0 / 3 (16 keys × 16 int32 columns; column g·4 + r = digit g of query
//           row r), K 1 / 7 (16 key rows × 64 int8 dims, straight from the cache
//           when evenly strided: contiguous caches, pages of 16 or more), the query
//           digits 2 / 6 (dim quads × columns, tdpbssd's B layout);
//   P·V     C 0 / 3 (rows g·4 + r × 16 output dims), P digits 4 (rows g·4 + r × 64
//           keys, uint8), V 5 / 1 (16 key quads × 16 dims, a quad's 4 keys
//           interleaved per dim).
// The pairs alternate so that one tile's result is stored while the next computes;
// and each product runs one kv head ahead of the vector work that reads it.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#if defined(ATTN_CPU_DECODE_AMX_I8_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef ATTN_CPU_DECODE_AMX_I8_INL_H_
#undef ATTN_CPU_DECODE_AMX_I8_INL_H_
#else
#define ATTN_CPU_DECODE_AMX_I8_INL_H_
#endif

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu/amx_tiles-inl.h"  // ConfigureTiles, ReleaseTiles: the same 16 × 64-byte palette
#include "cpu/tile_kernels-inl.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#undef ATTN_DECODE_AMX_I8
#undef ATTN_AMX_INT8
#if HWY_TARGET == HWY_AVX3 && defined(__x86_64__)
#define ATTN_DECODE_AMX_I8 1
#define ATTN_AMX_INT8 __attribute__((target("amx-tile,amx-int8")))
#else
#define ATTN_DECODE_AMX_I8 0
#endif

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {

/// One thread's scratch for the tile path (allocated only where it runs). The
/// score and P·V buffers come in pairs: one kv head's tiles compute into one while
/// the vector units read the previous head's from the other.
struct DecodeTilesScratch {
  size_t qtile_bytes = 0;  // one kv head's query digit tiles
  size_t vtile_bytes = 0;  // one kv head's value tiles for a block
  int vtiles_n = 0;        // P·V output tiles per kv head: ⌈dv/64⌉·4
  int ldo = 0;             // row stride of o: dv rounded up to 64
  hwy::AlignedFreeUniquePtr<int8_t[]> qtiles, staging, vtiles;
  hwy::AlignedFreeUniquePtr<uint8_t[]> ptile;
  hwy::AlignedFreeUniquePtr<int32_t[]> cbuf_s, cbuf_pv;
  hwy::AlignedFreeUniquePtr<float[]> weights, o, units;
  DecodeTilesScratch(int d, int dv, int heads, int max_rows) {
    const int dchunks = (d + 63) / 64, vchunks = (dv + 63) / 64;
    qtile_bytes = static_cast<size_t>(dchunks) * 1024;
    vtiles_n = vchunks * 4;
    vtile_bytes = static_cast<size_t>(vtiles_n) * 1024;
    ldo = vchunks * 64;
    qtiles = hwy::AllocateAligned<int8_t>(qtile_bytes * heads);
    staging = hwy::AllocateAligned<int8_t>(static_cast<size_t>(4) * 16 * dchunks * 64);
    vtiles = hwy::AllocateAligned<int8_t>(2 * vtile_bytes);
    ptile = hwy::AllocateAligned<uint8_t>(2 * 1024);
    cbuf_s = hwy::AllocateAligned<int32_t>(2 * 4 * 256);
    cbuf_pv = hwy::AllocateAligned<int32_t>(static_cast<size_t>(2) * vtiles_n * 256);
    weights = hwy::AllocateAligned<float>(static_cast<size_t>(16) * heads);
    o = hwy::AllocateAligned<float>(static_cast<size_t>(max_rows) * ldo);
    units = hwy::AllocateAligned<float>(2 * 16);
  }
};

#if ATTN_DECODE_AMX_I8
static_assert(kBk == 64, "one tdpbusd covers a block's 64 keys");

/// Query rows per kv head the tiles take: 3 digits × 4 rows fill 12 of 16 columns.
constexpr int kTileRowsMax = 4;
/// A row's largest magnitude maps to this many units: below 2²³, so three balanced
/// signed digits (each in [−128, 127]) hold every value.
constexpr float kQueryUnits = 8.0e6f;
/// A probability row's largest maps to this many units: below 2²⁴ by a margin that
/// f32 rounding of p · (units / max) cannot cross, so three unsigned digits hold it.
constexpr float kProbUnits = 16.7e6f;

/// Bytes of one 16 × 64-byte tile.
constexpr int kTileBytes = 1024;

/// Where output dim x of a 64-dim chunk lands in the P·V result: the interleave
/// that builds V's tiles (PackValueQuad) puts dim ch·64 + L·16 + u·4 + j in tile
/// ch·4 + u, column L·4 + j, i.e. it swaps x's bit fields [2, 4) and [4, 6).
/// Its own inverse.
HWY_INLINE int PermutedColumn(int x) { return (x & ~63) | (((x >> 2) & 3) << 4) | (((x >> 4) & 3) << 2) | (x & 3); }

/// One kv head's query rows (q: `rows` ≤ 4 rows of dp floats, zero past d, dp a
/// multiple of 16) as digit tiles: for each 64-dim chunk a tile (kTileBytes) whose
/// row k, column g·4 + r holds digit g of fixed-point row r at dims 64·chunk + 4k …
/// 4k + 3; and the 16 lane weights w[g·4 + r] = 2^(8g) · unit_r that turn S's digit
/// columns back into f32. False when a query value is not finite (the vector path
/// handles those).
inline bool QueryDigitTiles(const float* q, size_t dp, int rows, int d, int8_t* tiles, float* weights) {
  const int chunks = (d + 63) / 64;
  std::memset(tiles, 0, static_cast<size_t>(chunks) * kTileBytes);
  std::fill(weights, weights + 16, 0.0f);
  const int n = static_cast<int>(dp);
  for (int r = 0; r < rows; ++r) {
    const float* qr = q + r * dp;
    __m512 top = _mm512_setzero_ps();
    __mmask16 bad = 0;
    for (int x = 0; x < n; x += 16) {
      const __m512 v = _mm512_load_ps(qr + x);
      bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(v, v), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // NaN or ±∞
      top = _mm512_max_ps(top, _mm512_abs_ps(v));
    }
    if (bad != 0) return false;
    const float m = hn::GetLane(hn::MaxOfLanes(DF(), VF{top}));
    if (m == 0.0f) continue;
    const float inv = kQueryUnits / m;
    const __m512 scale = _mm512_set1_ps(inv);
    for (int x = 0; x < n; x += 16) {
      // Balanced base-256 digits of v (|v| ≤ 8·10⁶): d0 = v's low byte, sign-extended;
      // d1 the same of (v − d0) / 256; d2 = the rest (|d2| ≤ 123).
      const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(qr + x), scale));
      const __m512i d0 = _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24);
      const __m512i t = _mm512_srai_epi32(_mm512_sub_epi32(v, d0), 8);
      const __m512i d1 = _mm512_srai_epi32(_mm512_slli_epi32(t, 24), 24);
      const __m512i d2 = _mm512_srai_epi32(_mm512_sub_epi32(t, d1), 8);
      // Dims x … x + 15 are 4 quads, tile rows (x % 64) / 4 …; each digit's quad is
      // one dword of its column.
      int8_t* at = tiles + (x / 64) * kTileBytes + (x % 64 / 4) * 64 + r * 4;
      const __m512i digits[3] = {d0, d1, d2};
      for (int g = 0; g < 3; ++g) {
        alignas(16) uint32_t quads[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(quads), _mm512_cvtepi32_epi8(digits[g]));
        for (int k = 0; k < 4; ++k) std::memcpy(at + k * 64 + g * 16, &quads[k], 4);
      }
    }
    const double unit = 1.0 / static_cast<double>(inv);
    for (int g = 0; g < 3; ++g) weights[g * 4 + r] = static_cast<float>(unit * static_cast<double>(1 << (8 * g)));
  }
  return true;
}

// Tile numbers are immediates in the intrinsics (GCC pastes them into the asm), so
// the alternating tiles below are spelled out twice, once per tile pair.

/// One 16-key group's digit products: C[key][column] = Σ_dims K[key][dim] · the
/// query digits, into out (16 × 16 int32): K rows at base, `stride` bytes apart.
#define ATTN_SCORE_GROUP_TILES(C)                                        \
  do {                                                                   \
    _tile_zero(C);                                                       \
    for (int ch = 0; ch < chunks; ch += 2) {                             \
      _tile_loadd(1, base + ch * 64, stride);                            \
      _tile_loadd(2, qtiles + ch * kTileBytes, 64);                      \
      _tile_dpbssd(C, 1, 2);                                             \
      if (ch + 1 < chunks) {                                             \
        _tile_loadd(7, base + (ch + 1) * 64, stride);                    \
        _tile_loadd(6, qtiles + (ch + 1) * kTileBytes, 64);              \
        _tile_dpbssd(C, 7, 6);                                           \
      }                                                                  \
    }                                                                    \
    _tile_stored(C, out, 64);                                            \
  } while (0)

/// The tile half of one kv head's scores for a block: keys[c] + head_off is key
/// c's row (d int8 codes) for c < nvalid; for each 16-key group g the digit
/// products go to cbuf + 256·g. Groups whose rows are not evenly strided whole
/// chunks (pages under 16, odd d, the block's last keys) are copied to staging
/// (4 groups × 16 rows × ⌈d/64⌉·64 bytes) first, zero-padded.
template <class Pump>
inline ATTN_AMX_INT8 void ScoreTilesI8(const int8_t* const* keys, int64_t head_off, int nvalid, int d,
                                       const int8_t* qtiles, int8_t* staging, int32_t* cbuf, Pump&& pump) {
  const int chunks = (d + 63) / 64, width = chunks * 64;
  for (int g = 0; g * 16 < nvalid; ++g) {
    pump(g);
    const int nv = std::min(16, nvalid - 16 * g);
    const int8_t* const* kr = keys + 16 * g;
    bool direct = d % 64 == 0 && nv == 16;
    const int8_t* base = kr[0] + head_off;
    ptrdiff_t stride = direct ? kr[1] - kr[0] : 0;
    for (int i = 2; direct && i < 16; ++i) direct = kr[i] - kr[i - 1] == stride;
    if (!direct) {
      int8_t* rows = staging + static_cast<size_t>(g) * 16 * width;
      for (int i = 0; i < 16; ++i) {
        const int have = i < nv ? d : 0;
        if (have > 0) std::memcpy(rows + i * width, kr[i] + head_off, static_cast<size_t>(d));
        std::memset(rows + i * width + have, 0, static_cast<size_t>(width - have));
      }
      base = rows;
      stride = width;
    }
    int32_t* out = cbuf + 256 * g;
    if (g % 2 == 0) {
      ATTN_SCORE_GROUP_TILES(0);
    } else {
      ATTN_SCORE_GROUP_TILES(3);
    }
  }
}
#undef ATTN_SCORE_GROUP_TILES

/// The vector half: S[r][c] (row stride ld, r < rows, c < nvalid rounded up to 16)
/// from ScoreTilesI8's digit products and QueryDigitTiles's weights. The keys'
/// scales are not applied.
inline void CombineScoresI8(const int32_t* cbuf, int nvalid, const float* weights, int rows, float* s, size_t ld) {
  const __m512 w = _mm512_loadu_ps(weights);
  // s4[j] lane kk·4 + r = key 4j + kk, row r; then rows 0/1 (2/3) of keys 0–7 and
  // 8–15, and each row's two halves.
  const __m512i rows01 = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i rows23 = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  for (int g = 0; g * 16 < nvalid; ++g) {
    const int32_t* c = cbuf + 256 * g;
    // Key i's 16 weighted columns are its 3 digit groups of 4 rows (and a zero
    // group): two rounds of 128-bit shuffles and adds sum the groups and gather 4
    // keys into one vector [key][row].
    __m512 s4[4];
    for (int j = 0; j < 4; ++j) {
      __m512 v[4];
      for (int i = 0; i < 4; ++i) v[i] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + (4 * j + i) * 16)), w);
      const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88), _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
      const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(v[2], v[3], 0x88), _mm512_shuffle_f32x4(v[2], v[3], 0xDD));
      s4[j] = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
    }
    const __m512 a01 = _mm512_permutex2var_ps(s4[0], rows01, s4[1]);
    const __m512 b01 = _mm512_permutex2var_ps(s4[2], rows01, s4[3]);
    const __m512 a23 = _mm512_permutex2var_ps(s4[0], rows23, s4[1]);
    const __m512 b23 = _mm512_permutex2var_ps(s4[2], rows23, s4[3]);
    const __m512 out[4] = {_mm512_shuffle_f32x4(a01, b01, 0x44), _mm512_shuffle_f32x4(a01, b01, 0xEE),
                           _mm512_shuffle_f32x4(a23, b23, 0x44), _mm512_shuffle_f32x4(a23, b23, 0xEE)};
    for (int r = 0; r < rows; ++r) _mm512_storeu_ps(s + r * ld + 16 * g, out[r]);
  }
}

/// S rows of every kv head for one block: keys[c] + hh·head_stride is key c's row of
/// head hh (c < nvalid); head hh's rows at s + hh·s_head, stride ld. Head hh's
/// tiles run while the vector units combine head hh − 1's. pump(hh, g) runs before
/// each 16-key group g of head hh (the caller's prefetches, spread through the work).
template <class Pump>
inline ATTN_AMX_INT8 void ScoresBlockI8(const int8_t* const* keys, int64_t head_stride, int heads, int nvalid, int d,
                                        int rows, DecodeTilesScratch& w, float* s, size_t s_head, size_t ld,
                                        Pump&& pump) {
  for (int hh = 0; hh <= heads; ++hh) {
    if (hh < heads) {
      ScoreTilesI8(keys, hh * head_stride, nvalid, d, w.qtiles.get() + hh * w.qtile_bytes, w.staging.get(),
                   w.cbuf_s.get() + (hh % 2) * 1024, [&](int g) { pump(hh, g); });
    }
    if (hh > 0) {
      const int prev = hh - 1;
      CombineScoresI8(w.cbuf_s.get() + (prev % 2) * 1024, nvalid, w.weights.get() + 16 * prev, rows,
                      s + prev * s_head, ld);
    }
  }
}

/// Key quad k's 64-dim chunk ch of V, interleaved for tdpbusd's B operand: rows
/// (4 keys' chunk, zeros where a row is null or past dv) become four 64-byte tile
/// rows, one per output tile ch·4 + u (see PermutedColumn).
inline void PackValueQuad(const int8_t* const* rows, int ch, int dv, int8_t* tiles, int k) {
  const int have = std::min(64, dv - ch * 64);
  const __mmask64 mask = have == 64 ? ~__mmask64{0} : (__mmask64{1} << have) - 1;
  __m512i x[4];
  for (int i = 0; i < 4; ++i) {
    x[i] = rows[i] == nullptr ? _mm512_setzero_si512() : _mm512_maskz_loadu_epi8(mask, rows[i] + ch * 64);
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(x[0], x[1]), hi01 = _mm512_unpackhi_epi8(x[0], x[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(x[2], x[3]), hi23 = _mm512_unpackhi_epi8(x[2], x[3]);
  int8_t* at = tiles + static_cast<size_t>(ch * 4) * kTileBytes + k * 64;
  _mm512_store_si512(at, _mm512_unpacklo_epi16(lo01, lo23));
  _mm512_store_si512(at + kTileBytes, _mm512_unpackhi_epi16(lo01, lo23));
  _mm512_store_si512(at + 2 * kTileBytes, _mm512_unpacklo_epi16(hi01, hi23));
  _mm512_store_si512(at + 3 * kTileBytes, _mm512_unpackhi_epi16(hi01, hi23));
}

/// One kv head's probabilities (p rows, stride ld, r < rows: already times the
/// values' scales, 0 for removed keys) as a P tile: row g·4 + r, column c = digit g
/// of p[r][c] in units of units[r] (rows 12–15 and absent rows zero). Returns 0 when
/// no p is positive (nothing to add), 1 when ready, −1 when a p is negative or not
/// finite (scales the append never writes; the caller adds such blocks in f32).
inline int ProbabilityDigitsI8(const float* p, size_t ld, int rows, uint8_t* ptile, float* units) {
  std::memset(ptile, 0, kTileBytes);
  int status = 0;
  for (int r = 0; r < rows; ++r) {
    units[r] = 0.0f;
    const float* pr = p + r * ld;
    __m512 top = _mm512_setzero_ps(), low = _mm512_setzero_ps();
    __mmask16 nan = 0;  // max and min would drop a NaN operand
    for (int j = 0; j < 4; ++j) {
      const __m512 x = _mm512_loadu_ps(pr + 16 * j);
      top = _mm512_max_ps(top, x);
      low = _mm512_min_ps(low, x);
      nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    }
    // (Highway's reductions: GCC 12's _mm512_reduce_*_ps warn of an uninitialised value.)
    const float hi = hn::GetLane(hn::MaxOfLanes(DF(), VF{top})), lo = hn::GetLane(hn::MinOfLanes(DF(), VF{low}));
    if (nan != 0 || !(hi <= 3.0e38f) || lo < 0.0f) return -1;
    if (hi == 0.0f) continue;
    const float inv = kProbUnits / hi;
    units[r] = static_cast<float>(1.0 / static_cast<double>(inv));
    status = 1;
    const __m512 scale = _mm512_set1_ps(inv);
    for (int j = 0; j < 4; ++j) {
      const __m512i x = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(pr + 16 * j), scale));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ptile + (0 * 4 + r) * 64 + 16 * j), _mm512_cvtepi32_epi8(x));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ptile + (1 * 4 + r) * 64 + 16 * j),
                       _mm512_cvtepi32_epi8(_mm512_srli_epi32(x, 8)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(ptile + (2 * 4 + r) * 64 + 16 * j),
                       _mm512_cvtepi32_epi8(_mm512_srli_epi32(x, 16)));
    }
  }
  return status;
}

/// One P·V output tile: C = P digits · V tile t, into out (16 × 16 int32).
#define ATTN_PV_TILE(C, B)                                          \
  do {                                                              \
    _tile_zero(C);                                                  \
    _tile_loadd(B, vtiles + static_cast<size_t>(t) * kTileBytes, 64); \
    _tile_dpbusd(C, 4, B);                                          \
    _tile_stored(C, cbuf + 256 * t, 64);                            \
  } while (0)

/// The tile half of one kv head's P·V for a block: every output tile's digit
/// products (ntiles × 16 × 16 int32) into cbuf.
inline ATTN_AMX_INT8 void PvTilesI8(const uint8_t* ptile, const int8_t* vtiles, int ntiles, int32_t* cbuf) {
  _tile_loadd(4, ptile, 64);
  for (int t = 0; t < ntiles; ++t) {
    if (t % 2 == 0) {
      ATTN_PV_TILE(0, 5);
    } else {
      ATTN_PV_TILE(3, 1);
    }
  }
}
#undef ATTN_PV_TILE

/// The vector half: O[r] += units[r] · (C[r] + 2⁸·C[4 + r] + 2¹⁶·C[8 + r]) for every
/// output tile (O's columns permuted, PermutedColumn).
inline void CombinePvI8(const int32_t* cbuf, int ntiles, const float* units, int rows, float* o, size_t ldo) {
  for (int r = 0; r < rows; ++r) {
    if (units[r] == 0.0f) continue;
    const __m512 w0 = _mm512_set1_ps(units[r]), w1 = _mm512_set1_ps(units[r] * 256.0f),
                 w2 = _mm512_set1_ps(units[r] * 65536.0f);
    float* orow = o + r * ldo;
    for (int t = 0; t < ntiles; ++t) {
      const int32_t* c = cbuf + 256 * t;
      __m512 acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + r * 16)), w0,
                                   _mm512_loadu_ps(orow + t * 16));
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + (4 + r) * 16)), w1, acc);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(c + (8 + r) * 16)), w2, acc);
      _mm512_storeu_ps(orow + t * 16, acc);
    }
  }
}

/// The blocks ProbabilityDigitsI8 refuses, in f32: every p ≠ 0 times its value row,
/// into the permuted O (a NaN or ∞ p reaches O as the vector kernel lets it).
inline void PvBlockI8Scalar(const float* p, size_t ld, int rows, const int8_t* const* vals, int64_t head_off,
                            int nvalid, int dv, float* o, size_t ldo) {
  for (int r = 0; r < rows; ++r) {
    for (int c = 0; c < nvalid; ++c) {
      const float pc = p[r * ld + c];
      if (pc == 0.0f) continue;
      for (int x = 0; x < dv; ++x) o[r * ldo + PermutedColumn(x)] += pc * static_cast<float>(vals[c][head_off + x]);
    }
  }
}

/// O += P·V of every kv head for one block: head hh's probabilities at
/// s + hh·s_head (stride ld, see ProbabilityDigitsI8), its value rows
/// vals[c] + hh·head_stride (c < nvalid), its O at o + hh·o_head (stride ldo,
/// columns permuted); heads with active[hh] false are skipped. Head hh's tiles run
/// while the vector units prepare head hh + 1's P digits and value tiles.
/// pump(hh, k) runs once for each of head hh's 16 key quads (the caller's
/// prefetches, spread through the work).
template <class Pump>
inline ATTN_AMX_INT8 void PvBlockI8(const float* s, size_t s_head, size_t ld, const bool* active,
                                    const int8_t* const* vals, int64_t head_stride, int heads, int nvalid, int rows,
                                    int dv, float* o, size_t o_head, size_t ldo, DecodeTilesScratch& w, Pump&& pump) {
  const int ntiles = w.vtiles_n;
  auto prepare = [&](int hh) {
    const int buf = hh % 2;
    const int status = active[hh] ? ProbabilityDigitsI8(s + hh * s_head, ld, rows, w.ptile.get() + buf * kTileBytes,
                                                        w.units.get() + 16 * buf)
                                   : 0;
    if (status != 1) {
      for (int k = 0; k < 16; ++k) pump(hh, k);
      return status;
    }
    int8_t* vt = w.vtiles.get() + buf * w.vtile_bytes;
    const int chunks = (dv + 63) / 64;
    for (int k = 0; k < 16; ++k) {
      pump(hh, k);
      const int8_t* quad[4];
      for (int i = 0; i < 4; ++i) quad[i] = 4 * k + i < nvalid ? vals[4 * k + i] + hh * head_stride : nullptr;
      for (int ch = 0; ch < chunks; ++ch) PackValueQuad(quad, ch, dv, vt, k);
    }
    return 1;
  };
  int next = heads > 0 ? prepare(0) : 0;
  for (int hh = 0; hh < heads; ++hh) {
    const int status = next, buf = hh % 2;
    int32_t* cbuf = w.cbuf_pv.get() + static_cast<size_t>(buf) * ntiles * 256;
    if (status == 1) PvTilesI8(w.ptile.get() + buf * kTileBytes, w.vtiles.get() + buf * w.vtile_bytes, ntiles, cbuf);
    if (hh + 1 < heads) next = prepare(hh + 1);
    if (status == 1) {
      CombinePvI8(cbuf, ntiles, w.units.get() + 16 * buf, rows, o + hh * o_head, ldo);
    } else if (status == -1) {
      PvBlockI8Scalar(s + hh * s_head, ld, rows, vals, hh * head_stride, nvalid, dv, o + hh * o_head, ldo);
    }
  }
}
#endif  // ATTN_DECODE_AMX_I8

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard
