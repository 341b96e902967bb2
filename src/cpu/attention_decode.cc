// Attention against a KV cache (decoding, chunked prefill): Flash-Decoding's split-KV
// online softmax, reading the cache in place in its own dtype (f32, bf16, f16, i8,
// f8e4m3), with Highway SIMD and OpenMP threads.
//
// Work item = (sequence b, the kv heads of a token range, row chunk, split). A row
// chunk is every query row that reads a kv head — the Lq queries of each of the
// group's query heads — up to kMaxRows, so each cached key and value row is read once
// for all of them (GQA/MQA decoding is bound by reading the cache, not by arithmetic).
// An item takes every kv head where a token's heads lie side by side, so it reads
// whole token rows, and one where they lie apart (ItemHeads). A split is a range of
// whole key blocks; for each block of kBk keys:
//   S = (scale·Q)·Kᵀ        4 rows × 4 keys per pass (2 keys where a vector has 8
//                           lanes), the key rows converted to f32 once for all rows
//                           (i8, f8e4m3: times the key's scale; bf16: two elements
//                           per 32-bit lane, see Bf16Pairs); bf16 keys and queries
//                           whose values are all bf16, where vdpbf16ps has the FMA's
//                           rate: S = scale·(Q·Kᵀ) on vdpbf16ps (DotRowsBf16)
//   S = modifiers (S)       ApplyScoreMods, shared with attention()
//   P = e^(S − m_new) …     SoftmaxTile, shared with attention()
//   O = α·O + P·V           16 keys per pass (8 below 4 rows), V rows converted once
//                           per chunk of dv; bf16 values read by bf16 queries or under
//                           Precision::bf16, where vdpbf16ps has the FMA's rate: P
//                           rounded to bf16, two keys per vdpbf16ps (PvRowsBf16)
// Splits are combined in split order as merge_attention_states does. The automatic
// split count depends on the key count only, so no result depends on the threads.
// Removed keys (score −∞) never contribute, even where the cache holds NaN or ±∞
// there: P·V skips them by their score. A seen key whose p underflows to 0 adds 0·v,
// NaN for a non-finite v, as in the float64 reference.
//
// This file schedules the work items and runs one (ComputeItem); the passes live in
// the per-target headers beside it: decode_loads-inl.h (the cache's element types,
// their widening, the row requests), decode_scores-inl.h (the f32 score pass),
// decode_values-inl.h (the f32 P·V pass), decode_bf16_products-inl.h (both products
// on vdpbf16ps), decode_fixed16-inl.h (i8 caches on int16 products under
// Precision::bf16) and decode_amx_i8-inl.h (i8 caches on AMX-INT8 tiles).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu/isa.hpp"
#include "cpu/thread_team.hpp"
#include "cpu/workspace.hpp"
#include "kvcache/decode_problem.hpp"
#include "tensor/convert.hpp"
#include "traffic.hpp"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/attention_decode.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <hwy/aligned_allocator.h>
#include <hwy/highway.h>

#include "cpu/decode_amx_i8-inl.h"
#include "cpu/decode_bf16_products-inl.h"
#include "cpu/decode_fixed16-inl.h"
#include "cpu/decode_loads-inl.h"
#include "cpu/decode_scores-inl.h"
#include "cpu/decode_values-inl.h"
#include "cpu/score_mods-inl.h"
#include "cpu/tile_kernels-inl.h"

HWY_BEFORE_NAMESPACE();
namespace attn::detail::HWY_NAMESPACE {
namespace {

/// Query rows per work item: S is kMaxRows × kBk floats, O kMaxRows × dv.
constexpr int kMaxRows = 64;
/// Keys per split when the count is automatic: a split's partial result (rows × dv
/// floats) costs far less than reading this many keys, and 256 keys of every kv head
/// is enough work to hide a thread's wake-up while a 1k cache still gives 4 splits.
constexpr int kAutoSplitKeys = 256;
constexpr int kAutoMaxSplits = 64;


/// The query rows of one work item: query heads g0 … g0+heads−1 of the kv head's
/// group, queries i0 … i0+count−1 of each; row r = (r / count)-th head, query
/// i0 + r % count.
struct RowChunk {
  int g0, heads, i0, count;
  int rows() const { return heads * count; }
};

std::vector<RowChunk> RowChunks(int group, int lq) {
  std::vector<RowChunk> chunks;
  if (lq <= kMaxRows) {
    const int per = std::max(1, kMaxRows / lq);
    for (int g = 0; g < group; g += per) chunks.push_back({g, std::min(per, group - g), 0, lq});
  } else {
    for (int g = 0; g < group; ++g)
      for (int i = 0; i < lq; i += kMaxRows) chunks.push_back({g, 1, i, std::min(kMaxRows, lq - i)});
  }
  return chunks;
}

/// The most query rows of one work item, over all its kv heads (kv heads × their
/// chunk's rows).
constexpr int kMaxItemRows = 256;
/// Rows of a group that FinishRows combines at once: it reads each split's partial
/// kMergeRows rows at a time, in address order (8 KiB at dv = 128), where a row at a
/// time read 512 bytes of each split, each from another 16 KiB partial: with 64 splits
/// of a B = 8 call merging took ~6% of the time (perf, Zen 4, from DRAM).
constexpr int kMergeRows = 8;

/// One thread's scratch, carved from its reusable buffer (workspace.hpp, kSlotDecode):
/// a work item's running state, per kv head its rows' queries, O, m, l, a score
/// tile and which of its keys are removed (RemovedKeys), sized for the call's largest
/// item (item_rows rows, item_pad_rows once each head's rows are rounded up to whole
/// vectors); FinishRows's row buffers. Allocated
/// per call, sized for any item (1.3 MiB), these were ~20% of a one-token call.
struct Scratch {
  float *q, *s, *o, *m, *l, *alpha, *row_max, *row;
  double* acc;
  int lo[kMaxRows], hi[kMaxRows];
  uint64_t removed[kMaxItemRows];  // kv head hh's row r at hh·rows + r
  float qunit[kMaxItemRows];        // the fixed-point queries' units (FixedQueries), same order
  Scratch(int dp, int dvp, int item_rows, int item_pad_rows) {
    auto whole = [](size_t floats) { return (floats + 15) / 16 * 16; };  // 64-byte pieces
    const size_t fq = whole(static_cast<size_t>(item_rows) * dp), fs = whole(static_cast<size_t>(item_pad_rows) * kBk),
                 fo = whole(static_cast<size_t>(item_rows) * dvp), fm = whole(item_pad_rows),
                 fl = whole(static_cast<size_t>(item_pad_rows) * kLanes), fmax = whole(kMaxRows + kLanes),
                 frow = whole(dvp), facc = whole(2 * static_cast<size_t>(kMergeRows) * dvp);
    q = thread_scratch(kSlotDecode, fq + fs + fo + 2 * fm + fl + fmax + frow + facc);
    s = q + fq;
    o = s + fs;
    m = o + fo;
    alpha = m + fm;
    l = alpha + fm;
    row_max = l + fl;
    row = row_max + fmax;
    acc = reinterpret_cast<double*>(row + frow);
  }
};

/// The split's partial result: unnormalised O (rows × dvp), m and l per row, for
/// the item's rows in order (kv head by kv head).
struct Partial {
  float* o;
  float* m;
  float* l;
};

/// A work item: sequence b, kv heads hk0 … hk0+heads−1, a row chunk, keys [t0, t1).
/// Taking every kv head of a token at once reads the cache in whole token rows
/// (Hkv·d contiguous elements) rather than one head's slice of each.
struct Item {
  int b, hk0, heads, chunk, t0, t1;
  size_t part;  // offset of the partial result
};

/// Whether a token's kv heads lie apart (the [B, Hkv, L, d] tensors PyTorch passes to
/// SDPA: each head's keys and values a run of their own) rather than side by side in
/// token rows (a [B, L, Hkv, d] cache).
bool SplitHeads(const DecodeProblem& p) { return p.k.head_stride != p.d || p.v.head_stride != p.dv; }

/// Whether P·V asks for value lines ahead on this CPU: on the targets that may
/// (kPvAheadBytes), except on Intel's cores with AMX, where it was never measured.
/// On an Ice Lake Xeon (AVX-512 without AMX; B = 1, Hq = 32, Hkv = 8, d = 128,
/// bench/decode_rate, 5–6 alternating rounds) it took 0.92–0.97x the time with i8
/// caches at 32k keys, 0.95–0.96x with f32 and 0.96–0.99x with bf16; at 4k keys
/// (from L3) 0.87–1.02x.
bool AskValuesAhead() {
  if constexpr (kPvAheadBytes == 0) return false;
  return HWY_TARGET == HWY_AVX2 || !cpu_features().intel || !cpu_features().amx_int8;
}

/// How far ahead P·V asks for value lines, in bytes (kPvAheadBytes). In token rows,
/// 512 bytes ahead are the next heads' values of the same token, which the pass reads
/// next. Where each head's values are a run (split heads, or one kv head) that pages
/// do not cut short, 512 bytes are the next token, so the request goes
/// kHeadRunAheadTokens tokens along the run. Zen 1, f32, Hkv = 8, d = 128, 4k keys
/// from DRAM: 16 tokens (8 KiB) took 0.78–0.82x the time of 512 bytes, 8 tokens
/// 0.96x, 32 tokens no less than 16; asking for the keys 16 or 32 tokens ahead in the
/// score pass gained nothing.
template <typename T>
int64_t PvAheadBytes(const DecodeProblem& p) {
  if (!AskValuesAhead()) return 0;
  const bool runs = (SplitHeads(p) || p.Hkv == 1) && p.page_size >= 4 * kHeadRunAheadTokens;
  if (!runs) return kPvAheadBytes;
  // Zen 4 (AVX3), f32 [B, Hkv, L, d], 1 thread: 0.93x the time at 4k keys, but 1.19x
  // at 16k (from DRAM), where its hardware prefetchers follow the runs unaided.
  return HWY_TARGET == HWY_AVX2 ? kHeadRunAheadTokens * p.v.row_stride * static_cast<int64_t>(sizeof(T)) : 0;
}

/// The call's choice of passes beyond the f32 ones (see Decode).
struct Paths {
  bool bf16_dot = false;      // bf16 score pass (DotRowsBf16): q holds bf16 rows, S is scaled after
  bool fixed_scores = false;  // i8 score pass on integers (DotRowsFixed16): q holds int16 rows
  bool fixed_pv = false;      // i8 P·V on integers (PvKeysFixed16): O in Fixed16Column order
  bool bf16_pv = false;       // bf16 P·V on vdpbf16ps (PvRowsBf16), p rounded to bf16 (bf16 q, or Precision::bf16)
  bool vnni = false;             // the fixed-point passes on vpdpwssd (MulPairsAdd)
  const int16_t* q16 = nullptr;  // fixed_scores: the queries' rows as integers (FixedQueries)
  const float* qunit = nullptr;  // and each row's unit
  // The queries' rows in the order and format the item's score pass reads (bf16 bits
  // for bf16_dot, pair order for bf16/f16 keys on the f32 pass), made once per call
  // (in Decode): each item then copies whole rows.
  const void* qitem = nullptr;
  size_t qitem_row_bytes = 0;
};

/// The order of the columns of O in a split's partial result. Items store O as their
/// passes leave it, and FinishRows puts it in order once per row (not once per split).
enum class ColumnOrder { kNatural, kPairs, kFixed16 };


/// How many keys ahead of its work ComputeItem asks for a key's rows (at most kBk).
/// 8 keys (two score passes), measured on the Intel Xeon with AMX at 32k bf16 and i8
/// tokens with head-by-head requests: 6 to 16 keys within 3%, 4 keys 5–12% slower.
/// A request for key c + n on head hh goes out beside key c's work on that head, so it
/// has n keys of one head's work to arrive: the faster the passes, the further ahead.
/// On AMD's AVX-512 cores (Zen 4, from DRAM: B = 1 and 8, 8k and 32k keys, pages of 16
/// and 256, 1 and 2 threads, 3 alternating rounds each):
///   i8 on the integer passes (fixed_pv): 32 keys, 0.74–0.91x the time of 8 (an i8
///     key and value row of 8 heads is 2 KiB, so 8 keys asked 16 KiB ahead, ~1.3 µs of
///     those passes' work); 24, 48 and 64 gained no more;
///   other caches narrower than f32: 16 keys. bf16 on both bf16 products 0.86–0.95x
///     the time of 8 in most rows, f16 0.93–1.01x, i8 on the f32 passes 0.91–0.98x,
///     f8e4m3 0.87–1.03x; 32 keys gained no more, and cost up to 1.08x on 2 threads;
///   f32: 8. 16 keys took 0.94–1.04x, 32 keys up to 1.25x on 2 threads.
/// On an Intel Ice Lake core (no AMX, so i8 takes the integer passes rather than the
/// tiles under Precision::bf16), calls alternating 8 and 32 keys in one process, B = 1
/// and 8, 8k and 32k keys, pages of 16 and contiguous, 1 and 2 threads: 32 keys
/// 0.93–1.01x the time of 8 for those passes (0.93–0.96x from DRAM on 1 thread); for
/// i8 and bf16 on the f32 passes 16 and 32 keys took 1.01–1.06x, so Intel keeps 8 there.
constexpr int kMostPrefetchKeys = HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL ? 32 : 8;
template <typename T>
int PrefetchKeys(const Paths& paths) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  if (paths.fixed_pv) return kMostPrefetchKeys;
  if (!cpu_features().intel && sizeof(T) < sizeof(float)) return 16;
#else
  (void)paths;
#endif
  return 8;
}

template <typename T>
void ComputeItem(const DecodeProblem& p, int dp, int dvp, const Item& it, const RowChunk& rc,
                 Scratch& w, Partial out, bool prefetch, DecodeTilesScratch* tiles, const Paths& paths) {
  const bool bf16_dot = paths.bf16_dot, fixed_scores = paths.fixed_scores, fixed_pv = paths.fixed_pv;
  const Sequence& seq = p.attn.seqs[it.b];
  const int b = it.b, t0 = it.t0, t1 = it.t1;
  const int rows = rc.rows(), rows_pad = RoundUp(rows, kLanes);
  const int group = p.group();
  // The queries' bands; the item's keys are [t0, t1) ∩ their union.
  int lo_all = INT32_MAX, hi_all = -1;
  for (int i = 0; i < rc.count; ++i) {
    BandOfRow(p.attn, seq, rc.i0 + i, &w.lo[i], &w.hi[i]);
    if (w.lo[i] <= w.hi[i]) lo_all = std::min(lo_all, w.lo[i]), hi_all = std::max(hi_all, w.hi[i]);
  }
  std::fill(w.m, w.m + static_cast<size_t>(it.heads) * rows_pad, -HUGE_VALF);
  std::fill(w.l, w.l + static_cast<size_t>(kLanes) * it.heads * rows_pad, 0.0f);
  // Rows of kv head hh, contiguous: q of head g0 + r / count, query i0 + r % count.
  for (int hh = 0; hh < it.heads; ++hh) {
    for (int r = 0; r < rows; ++r) {
      const int h = (it.hk0 + hh) * group + rc.g0 + r / rc.count, i = rc.i0 + r % rc.count;
      const size_t row = (static_cast<size_t>(b) * p.Hq + h) * p.Lq + i, at = static_cast<size_t>(hh) * rows + r;
      std::memcpy(reinterpret_cast<char*>(w.q) + at * paths.qitem_row_bytes,
                  static_cast<const char*>(paths.qitem) + row * paths.qitem_row_bytes, paths.qitem_row_bytes);
      if (fixed_scores) w.qunit[at] = paths.qunit[row];
    }
  }
  // The tile path (i8 caches on AMX-INT8, decode_amx_i8-inl.h) for up to 4 rows per
  // kv head, finite queries: O then lives in tiles->o, columns permuted.
  bool on_tiles = false;
#if ATTN_DECODE_AMX_I8
  if constexpr (std::is_same_v<T, int8_t>) {
    on_tiles = tiles != nullptr && rows <= kTileRowsMax;
    for (int hh = 0; on_tiles && hh < it.heads; ++hh) {
      on_tiles = QueryDigitTiles(&w.q[static_cast<size_t>(hh) * rows * dp], dp, rows, p.d,
                                 tiles->qtiles.get() + hh * tiles->qtile_bytes, tiles->weights.get() + 16 * hh);
    }
  }
#endif
  float* const obase = on_tiles ? tiles->o.get() : w.o;
  const int ldo = on_tiles ? tiles->ldo : dvp;
  std::fill(obase, obase + static_cast<size_t>(it.heads) * rows * ldo, 0.0f);
  const T* kbase = static_cast<const T*>(p.k.base);
  const T* vbase = static_cast<const T*>(p.v.base);
  const bool quantized = kQuantized<T>;
  const int first = std::max(t0, lo_all), last = std::min(t1 - 1, hi_all);
  // Token rows of the item's heads: one span when the heads are adjacent.
  const int64_t k_span = p.k.head_stride == p.d ? int64_t{it.heads} * p.d : p.d;
  const int64_t v_span = p.v.head_stride == p.dv ? int64_t{it.heads} * p.dv : p.dv;
  // Rows of keys j0 … j0 + kBk + kPrefetchKeys − 1 (this block and the prefetch
  // distance past it, PrefetchKeys), from one walk over the pages: a division per
  // block rather than four per key (a page-16 cache spent ~15% of its time in them).
  // The tile path walks the next block too: it requests that block's rows while this
  // one computes (see pump_next below).
  const int kPrefetchKeys = PrefetchKeys<T>(paths);
  constexpr int kRows = std::max(2 * kBk, kBk + kMostPrefetchKeys);
  const T* keys0[kRows];
  const T* vals0[kRows];
  int64_t k_scale_at[kRows], v_scale_at[kRows];
  auto walk_rows = [&](int j, int n) {
    int page = j / p.page_size, within = j % p.page_size;
    for (int c = 0; c < n; ++c) {
      const int64_t pg = p.pages[b][page];
      keys0[c] = kbase + pg * p.k.page_stride + int64_t{within} * p.k.row_stride + int64_t{it.hk0} * p.k.head_stride;
      vals0[c] = vbase + pg * p.v.page_stride + int64_t{within} * p.v.row_stride + int64_t{it.hk0} * p.v.head_stride;
      if constexpr (kQuantized<T>) {
        k_scale_at[c] = pg * p.k.scale_page + int64_t{within} * p.k.scale_row;
        v_scale_at[c] = pg * p.v.scale_page + int64_t{within} * p.v.scale_row;
      }
      if (++within == p.page_size) within = 0, ++page;
    }
  };
  int64_t keys_read = 0;
  for (int j0 = first <= last ? t0 + (first - t0) / kBk * kBk : t1; j0 <= last; j0 += kBk) {
    const int cols = std::min(kBk, t1 - j0);
    keys_read += cols;
    // Requests run past the item's end into the next split's keys (the band's, within
    // the sequence): the item that reads them next starts with them on the way.
    const int ahead = std::max(0, std::min(kBk, std::min(seq.Lk, hi_all + 1) - (j0 + kPrefetchKeys)));
    // Keys of the next block the tile path will read (its rows are keys0[kBk + i]).
    const int next_n = on_tiles && prefetch && cols == kBk ? std::max(0, std::min(kBk, std::min(t1, last + 1) - (j0 + kBk))) : 0;
    walk_rows(j0, next_n > 0 ? kBk + next_n : std::max(cols, ahead > 0 ? kPrefetchKeys + ahead : 0));
    // Key c + kPrefetchKeys's rows of kv head hh, into L2 while this block computes,
    // when `prefetch` (see kPrefetchMinBytes): requested beside key c's work on head hh
    // (K in the score loop, V in the P·V loop), one head's slice at a time. Larger
    // bursts (a key's rows of every head, or a block's) fill the line-fill buffers,
    // which software requests hold until DRAM answers, and stall the core until
    // memory delivers, serialising memory and math (measured: see PrefetchKeys).
    // With head 0, the keys' scales too (i8, f8e4m3): a page's scales lie apart from
    // its rows, so at small pages each page would start with a scale read from DRAM.
    auto prefetch_head = [&](const CacheTensor& ct, const T* const* rows0, const int64_t* scale_at, int hh, int width,
                             int c0, int nk) {
      if (!prefetch) return;
      for (int c = c0; c < std::min(c0 + nk, ahead); ++c) {
        PrefetchRow(rows0[kPrefetchKeys + c] + hh * ct.head_stride, width);
        if constexpr (kQuantized<T>) {
          const float* scales = ct.scale + scale_at[kPrefetchKeys + c] + int64_t{it.hk0} * ct.scale_head;
          if (hh == 0) PrefetchLineL2(reinterpret_cast<const char*>(scales));
        }
      }
    };
    // E4M3 caches: whether keys c … c + nk − 1 hold a NaN code in the item's heads.
    auto nan_codes = [&](const CacheTensor& ct, const T* const* rows0, int64_t span, int64_t width, int c, int nk) {
      if constexpr (!std::is_same_v<T, E4m3>) {
        return false;
      } else {
        bool any = false;
        for (int k = c; k < c + nk; ++k) {
          for (int hh = 0; hh < it.heads; hh += static_cast<int>(span / width)) {
            any |= AnyE4m3Nan(reinterpret_cast<const uint8_t*>(rows0[k] + hh * ct.head_stride), span);
          }
        }
        return any;
      }
    };
    // Scores of every head, key by key (token order: each token's heads are adjacent).
    auto head_keys = [&](int c, int hh, int nk, const T** out_keys) {
      for (int k = 0; k < nk; ++k) out_keys[k] = keys0[c + k] + hh * p.k.head_stride;
    };
    if (on_tiles) {
#if ATTN_DECODE_AMX_I8
      if constexpr (std::is_same_v<T, int8_t>) {
        ScoresBlockI8(keys0, p.k.head_stride, it.heads, cols, p.d, rows, *tiles, w.s,
                      static_cast<size_t>(rows_pad) * kBk, kBk, [&](int hh, int g) {
                        if (!prefetch) return;
                        for (int c = 16 * g; c < std::min(16 * g + 16, cols); ++c) {
                          PrefetchRow(vals0[c] + hh * p.v.head_stride, p.dv);
                        }
                      });
      }
#endif
    } else {
      // 4 keys per pass where a vector has 16 lanes (4 rows × 4 keys: one TransposedSums), else 2
      // (or 3, below); then the rest.
      // f32 keys on AVX2: 4 rows × 3 keys, the 12 accumulators, 3 keys and a query
      // vector in the 16 registers (Zen 1, L1-resident: 96% of the FMA peak against
      // 77% for 4 × 2; bench/avx2_decode_loops). Widened keys need registers of
      // their own, so other dtypes keep 2.
      constexpr bool kThreeKeys = HWY_ARCH_X86 && kLanes == 8 && std::is_same_v<T, float>;
      constexpr int kKeysPerPass = kLanes == 16 ? 4 : kThreeKeys ? 3 : 2;
      const T* kk[kKeysPerPass];
      auto scores = [&](auto nk_tag, int c) {
        constexpr int nk = decltype(nk_tag)::value;
        ReadAs<T>(nan_codes(p.k, keys0, k_span, p.d, c, nk), [&](auto tag) {
          using U = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
          for (int hh = 0; hh < it.heads; ++hh) {
            prefetch_head(p.k, keys0, k_scale_at, hh, p.d, c, nk);
            head_keys(c, hh, nk, kk);
            if constexpr (std::is_same_v<T, int8_t> && kFixed16Target) {
              if (fixed_scores) {
                DotRowGroupsFixed16<nk>(paths.vnni, reinterpret_cast<const int16_t*>(w.q) + static_cast<size_t>(hh) * rows * dp, dp,
                                        rows, reinterpret_cast<const int8_t* const*>(kk), p.d,
                                        &w.s[static_cast<size_t>(hh) * rows_pad * kBk] + c, kBk);
                continue;
              }
            }
            if constexpr (kPairs<T> && kBf16DotTarget) {
              if (bf16_dot) {
                DotRowGroupsBf16<nk>(reinterpret_cast<const uint16_t*>(w.q) + static_cast<size_t>(hh) * rows * dp, dp,
                                     rows, reinterpret_cast<const uint16_t* const*>(kk), p.d,
                                     &w.s[static_cast<size_t>(hh) * rows_pad * kBk] + c, kBk);
                continue;
              }
            }
            DotRowGroups<U, nk>(&w.q[static_cast<size_t>(hh) * rows * dp], dp, rows,
                                reinterpret_cast<const U* const*>(kk), p.d,
                                &w.s[static_cast<size_t>(hh) * rows_pad * kBk] + c, kBk);
          }
        });
      };
      int c = 0;
#if HWY_TARGET != HWY_SCALAR
      if (rows == 1) {  // one row per kv head (multi-head decoding): kLanes keys a pass,
        // kLanes independent chains that leave through one TransposedSums, where 2 keys
        // a pass gave 2 chains, each with its own SumOfLanes
        for (; c + kLanes <= cols; c += kLanes) {
          ReadAs<T>(nan_codes(p.k, keys0, k_span, p.d, c, kLanes), [&](auto tag) {
            using U = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
            const T* wide[kLanes];
            for (int hh = 0; hh < it.heads; ++hh) {
              // Half the pass's requests before its dot products, half after (see
              // PrefetchKeys on bursts).
              prefetch_head(p.k, keys0, k_scale_at, hh, p.d, c, kLanes / 2);
              head_keys(c, hh, kLanes, wide);
              const float* q1 = &w.q[static_cast<size_t>(hh) * dp];
              float* s1 = &w.s[static_cast<size_t>(hh) * rows_pad * kBk] + c;
              const U* const* ku = reinterpret_cast<const U* const*>(wide);
              if constexpr (std::is_same_v<T, int8_t> && kFixed16Target) {
                if (fixed_scores) {
                  DotRowGroupsFixed16<kLanes>(paths.vnni, reinterpret_cast<const int16_t*>(w.q) + static_cast<size_t>(hh) * dp, dp, 1,
                                              reinterpret_cast<const int8_t* const*>(wide), p.d, s1, kBk);
                  prefetch_head(p.k, keys0, k_scale_at, hh, p.d, c + kLanes / 2, kLanes / 2);
                  continue;
                }
              }
              if constexpr (kPairs<T> && kBf16DotTarget) {
                if (bf16_dot) {
                  DotRowGroupsBf16<kLanes>(reinterpret_cast<const uint16_t*>(w.q) + static_cast<size_t>(hh) * dp, dp, 1,
                                           reinterpret_cast<const uint16_t* const*>(wide), p.d, s1, kBk);
                  prefetch_head(p.k, keys0, k_scale_at, hh, p.d, c + kLanes / 2, kLanes / 2);
                  continue;
                }
              }
              if (p.d % kLanes == 0) {
                DotRows<U, 1, kLanes, false>(q1, dp, ku, p.d, s1, kBk);
              } else {
                DotRows<U, 1, kLanes, true>(q1, dp, ku, p.d, s1, kBk);
              }
              prefetch_head(p.k, keys0, k_scale_at, hh, p.d, c + kLanes / 2, kLanes / 2);
            }
          });
        }
      }
#endif
      for (; c + kKeysPerPass <= cols; c += kKeysPerPass) scores(std::integral_constant<int, kKeysPerPass>(), c);
      if constexpr (kThreeKeys) {
        if (c + 2 <= cols) scores(std::integral_constant<int, 2>(), c), c += 2;
      }
      for (; c < cols; ++c) scores(std::integral_constant<int, 1>(), c);
    }
    bool active[kMaxItemRows];
    // The block's keys' (values') scales of one kv head, times kLoadUnit (a power of
    // two, so the product is exact), and 1 for the columns from `cols` on: one vector
    // of them multiplies a vector of a row of S or P.
    HWY_ALIGN float scales[kBk];
    // The block's scale offsets relative to its first key's, as one gather index per
    // key when they fit int32 (they do unless pages lie over 8 GiB of scales apart):
    // a vector gather per 16 keys instead of a scalar load and store per key and head
    // (perf: ~10% of an i8 step on the tile path).
    HWY_ALIGN int32_t k_idx[kBk], v_idx[kBk];
    bool gather = false;
    if constexpr (kQuantized<T>) {
      gather = cols > 0;
      for (int cc = 0; cc < kBk; ++cc) {
        const int64_t dk = cc < cols ? k_scale_at[cc] - k_scale_at[0] : 0;
        const int64_t dv = cc < cols ? v_scale_at[cc] - v_scale_at[0] : 0;
        gather &= dk == static_cast<int32_t>(dk) && dv == static_cast<int32_t>(dv);
        k_idx[cc] = static_cast<int32_t>(dk);
        v_idx[cc] = static_cast<int32_t>(dv);
      }
    }
    auto gather_scales = [&](const CacheTensor& ct, const int64_t* scale_at, const int32_t* idx, int hk) {
      if (!gather) {
        for (int cc = 0; cc < cols; ++cc) scales[cc] = ct.scale[scale_at[cc] + int64_t{hk} * ct.scale_head] * kLoadUnit<T>;
        for (int cc = cols; cc < kBk; ++cc) scales[cc] = 1.0f;
        return;
      }
      const DF df;
      const hn::RebindToSigned<DF> di;
      const float* base = ct.scale + scale_at[0] + int64_t{hk} * ct.scale_head;
      for (int cc = 0; cc < kBk; cc += kLanes) {
        const VF g = hn::Mul(hn::GatherIndex(df, base, hn::Load(di, idx + cc)), hn::Set(df, kLoadUnit<T>));
        const auto real = hn::Lt(hn::Iota(di, cc), hn::Set(di, cols));
        hn::Store(hn::IfThenElse(hn::RebindMask(df, real), g, hn::Set(df, 1.0f)), df, scales + cc);
      }
    };
    for (int hh = 0; hh < it.heads; ++hh) {
      const int hk = it.hk0 + hh;
      float* s = &w.s[static_cast<size_t>(hh) * rows_pad * kBk];
      float* m = &w.m[static_cast<size_t>(hh) * rows_pad];
      float* l = &w.l[static_cast<size_t>(hh) * rows_pad * kLanes];
      float* alpha = &w.alpha[static_cast<size_t>(hh) * rows_pad];
      float* o = obase + static_cast<size_t>(hh) * rows * ldo;
      if (bf16_dot) {  // the scale the f32 pass folds into q (prepare_queries)
        const VF scale = hn::Set(DF(), p.attn.scale);
        for (int r = 0; r < rows; ++r) {
          for (int x = 0; x < kBk; x += kLanes) hn::Store(hn::Mul(hn::Load(DF(), s + r * kBk + x), scale), DF(), s + r * kBk + x);
        }
      }
      if (fixed_scores) {  // the integer sums times their rows' units
        for (int r = 0; r < rows; ++r) {
          const VF unit = hn::Set(DF(), w.qunit[static_cast<size_t>(hh) * rows + r]);
          for (int x = 0; x < kBk; x += kLanes) hn::Store(hn::Mul(hn::Load(DF(), s + r * kBk + x), unit), DF(), s + r * kBk + x);
        }
      }
      if (quantized) {  // S · the keys' scales, a row of vectors at a time
        gather_scales(p.k, k_scale_at, k_idx, hk);
        for (int r = 0; r < rows; ++r) {
          for (int x = 0; x < kBk; x += kLanes) {
            hn::Store(hn::Mul(hn::Load(DF(), s + r * kBk + x), hn::Load(DF(), scales + x)), DF(), s + r * kBk + x);
          }
        }
      }
      for (int r = 0; r < rows; ++r) std::fill(s + r * kBk + cols, s + (r + 1) * kBk, -HUGE_VALF);
      for (int g = 0; g < rc.heads; ++g) {
        const TilePlace t{b, hk * group + rc.g0 + g, rc.i0, rc.count, j0, cols, w.lo, w.hi};
        ApplyScoreMods(p.attn, seq, t, s + static_cast<size_t>(g) * rc.count * kBk, kBk,
                       cols < kBk || TileNeedsBand(t));
      }
      // P·V skips a key by its score (−∞ = removed), not by p = 0, which a seen key
      // far below its row's max also gets.
      uint64_t* removed = &w.removed[hh * rows];
      for (int r = 0; r < rows; ++r) removed[r] = RemovedKeys(s + r * kBk);
      active[hh] = SoftmaxTile(s, kBk, rows, m, l, alpha, w.row_max);
      if (!active[hh]) continue;
      for (int r = 0; r < rows; ++r) {  // O = α·O before this block's P·V
        if (alpha[r] == 1.0f) continue;
        const VF a = hn::Set(DF(), alpha[r]);
        for (int x = 0; x < ldo; x += kLanes) hn::Store(hn::Mul(a, hn::Load(DF(), o + r * ldo + x)), DF(), o + r * ldo + x);
      }
      if (quantized) {  // P · the values' scales; a removed key's p stays 0 whatever its scale
        gather_scales(p.v, v_scale_at, v_idx, hk);
        for (int r = 0; r < rows; ++r) {
          for (int x = 0; x < kBk; x += kLanes) {
            const VF pv = hn::Load(DF(), s + r * kBk + x);
            const VF scaled = hn::Mul(pv, hn::Load(DF(), scales + x));
            hn::Store(hn::IfThenElseZero(SeenLanes(removed[r], x), scaled), DF(), s + r * kBk + x);
          }
        }
      }
    }
    if (on_tiles) {
#if ATTN_DECODE_AMX_I8
      if constexpr (std::is_same_v<T, int8_t>) {
        // The next block's key and value rows of head hh, keys 4k … 4k + 3, into L2
        // (and with head 0 their scales): called once per key quad of each head's
        // P·V, so the block's ~2,000 line requests are spread through its work
        // rather than issued in bursts, which stall the core (see PrefetchKeys).
        auto pump_next = [&](int hh, int k) {
          for (int i = 4 * k; i < std::min(4 * k + 4, next_n); ++i) {
            PrefetchRow(keys0[kBk + i] + hh * p.k.head_stride, p.d);
            if (hh == 0) {
              PrefetchLineL2(reinterpret_cast<const char*>(p.k.scale + k_scale_at[kBk + i] + int64_t{it.hk0} * p.k.scale_head));
              PrefetchLineL2(reinterpret_cast<const char*>(p.v.scale + v_scale_at[kBk + i] + int64_t{it.hk0} * p.v.scale_head));
            }
          }
        };
        PvBlockI8(w.s, static_cast<size_t>(rows_pad) * kBk, kBk, active, vals0, p.v.head_stride, it.heads, cols,
                  rows, p.dv, obase, static_cast<size_t>(rows) * ldo, ldo, *tiles, pump_next);
      }
#endif
    } else {
      // P·V, key by key again, 16 keys per pass: each O chunk is loaded and stored
      // once per 16 keys rather than once per key (Zen 1, bf16 values: 8 keys per
      // pass reached 74% of the FMA peak in isolation, 16 keys 80%). The values'
      // prefetches still go out 8 keys at a time, half before and half after the
      // pass (see PrefetchKeys on bursts).
      // With fewer than 4 rows per kv head the pass is bound by reading V, and there
      // 16 token rows at once, head by head, read slower than 8: f32 multi-head
      // decoding from DRAM took 1.04–1.22x the time on Zen 1.
      const int pv_keys = rows >= 4 ? kPvKeysMax : kPvKeysMax / 2;
      // f32 values where the pass asks for its own lines ahead (kPvAheadBytes; 3 or
      // more rows): the head-by-head requests only competed with those (Zen 1, B = 1,
      // 8k and 32k tokens: 0.91–0.93x the time without them), so they stay off. bf16
      // values keep them (1.01–1.04x without).
      const int64_t pv_ahead = PvAheadBytes<T>(p);
      const bool request_values = !(pv_ahead > 0 && std::is_same_v<T, float> && rows >= 3);
      const T* vv[kPvKeysMax];
      // i8 values on integers (fixed_pv): kFixedPvKeys keys a pass, value requests
      // 8 keys at a time through it.
      for (int c = 0; fixed_pv && c < cols; c += kFixedPvKeys) {
        const int nk = std::min(kFixedPvKeys, cols - c);
        const int8_t* vi[kFixedPvKeys];
        for (int k = 0; k < kFixedPvKeys; ++k) vi[k] = reinterpret_cast<const int8_t*>(vals0[c + (k < nk ? k : 0)]);
        for (int hh = 0; hh < it.heads; ++hh) {
          if (active[hh]) {
            PvKeysFixed16(paths.vnni, &w.s[static_cast<size_t>(hh) * rows_pad * kBk] + c, kBk, rows, vi,
                          hh * p.v.head_stride, nk, p.dv, &w.o[static_cast<size_t>(hh) * rows * dvp], dvp, pv_ahead);
          }
          for (int k = 0; request_values && k < nk; k += 8) prefetch_head(p.v, vals0, v_scale_at, hh, p.dv, c + k, std::min(8, nk - k));
        }
      }
      for (int c = 0; !fixed_pv && c < cols; c += pv_keys) {
        const int nk = std::min(pv_keys, cols - c);
        ReadAs<T>(nan_codes(p.v, vals0, v_span, p.dv, c, nk), [&](auto tag) {
          using U = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
          const U* const* vu = reinterpret_cast<const U* const*>(vv);
          for (int hh = 0; hh < it.heads; ++hh) {
            if (request_values) prefetch_head(p.v, vals0, v_scale_at, hh, p.dv, c, std::min(nk, 8));
            if (active[hh]) {
              for (int k = 0; k < nk; ++k) vv[k] = vals0[c + k] + hh * p.v.head_stride;
              const float* s = &w.s[static_cast<size_t>(hh) * rows_pad * kBk] + c;
              const uint64_t* removed = &w.removed[hh * rows];
              float* o = &w.o[static_cast<size_t>(hh) * rows * dvp];
              // Whole passes of 16 or 8 on the register-blocked loops, a block's
              // shorter last pass on PvKeysSkippingRemoved: each column still sums its
              // keys in order, so the result does not depend on the pieces.
              if (nk == 16) {
                PvKeys<U, 16>(s, kBk, removed, c, rows, vu, p.dv, o, dvp, pv_ahead, paths.bf16_pv);
              } else if (nk == 8) {
                PvKeys<U, 8>(s, kBk, removed, c, rows, vu, p.dv, o, dvp, pv_ahead, paths.bf16_pv);
              } else {
                PvKeysSkippingRemoved(s, kBk, removed, c, rows, vu, nk, p.dv, o, dvp);
              }
            }
            if (request_values && nk > 8) prefetch_head(p.v, vals0, v_scale_at, hh, p.dv, c + 8, nk - 8);
          }
        });
      }
    }
  }
  TrafficCounters::add(traffic().cache_read_bytes,
                       static_cast<uint64_t>(keys_read) * it.heads *
                           ((p.d + p.dv) * sizeof(T) + (quantized ? 2 * sizeof(float) : 0)));
  for (int hh = 0; hh < it.heads; ++hh) {
    for (int r = 0; r < rows; ++r) {
      const size_t at = static_cast<size_t>(hh) * rows + r;
      out.m[at] = w.m[static_cast<size_t>(hh) * rows_pad + r];
      out.l[at] = RowSum(&w.l[static_cast<size_t>(hh) * rows_pad * kLanes], r);
      if (!on_tiles) {  // in the passes' column order (FinishRows puts it in order)
        std::memcpy(out.o + at * dvp, &w.o[at * dvp], sizeof(float) * dvp);
        continue;
      }
#if ATTN_DECODE_AMX_I8
      for (int x = 0; x < p.dv; ++x) out.o[at * dvp + x] = obase[at * ldo + PermutedColumn(x)];
      std::fill(out.o + at * dvp + p.dv, out.o + (at + 1) * dvp, 0.0f);
#endif
    }
  }
}

/// Writes row o (dv floats) to out in the queries' dtype, and its lse.
void StoreRow(const DecodeProblem& p, int b, int i, int h, const float* o, float lse_value) {
  store_f32_row(p.q_dtype, p.out, b * p.out_b + i * p.out_row + h * p.out_head, o, p.dv);
  if (p.lse != nullptr) p.lse[b * p.lse_b + h * p.lse_h + i * p.lse_i] = lse_value;
}

/// The column of a partial O that holds output column x (see ColumnOrder): pair order
/// takes each run of 2·kLanes columns as its even columns, then its odd ones
/// (Bf16Pairs); Fixed16 order permutes each run of kFixedVec (Fixed16Column).
int PartialColumn(ColumnOrder order, int x) {
  switch (order) {
    case ColumnOrder::kPairs: {
      const int run = x / (2 * kLanes) * (2 * kLanes), u = x % (2 * kLanes);
      return run + (u % 2) * kLanes + u / 2;
    }
    case ColumnOrder::kFixed16:
#if ATTN_DECODE_FIXED16
      return x / kFixedVec * kFixedVec + Fixed16Column(x % kFixedVec);
#else
      return x;  // not taken: no fixed-point passes on this target
#endif
    case ColumnOrder::kNatural:
      break;
  }
  return x;
}

/// row[x] = o[col_src[x]] / l for x < n: the output row in column order (the
/// partial's columns in `order`), each quotient rounded once. A vector at a time: a
/// scalar gather and `vdivss` per element took ~3.5 µs of a 64-key bf16 decoding
/// call's ~17 µs (Zen 4, 32 query rows). Division is correctly rounded in every lane,
/// so the row is bitwise the scalar one. Pair order (evens of a 2-vector run, then
/// odds) goes back by interleaved stores (vector gathers still took ~2 µs), the
/// fixed-point passes' order by 16-byte blocks.
void DivideInColumnOrder(const float* HWY_RESTRICT o, ColumnOrder order, const int* HWY_RESTRICT col_src, float l,
                         int n, float* HWY_RESTRICT row) {
  const DF df;
  const hn::RebindToSigned<DF> di;
  const auto vl = hn::Set(df, l);
  int x = 0;
  if (order == ColumnOrder::kNatural) {
    for (; x + kLanes <= n; x += kLanes) hn::StoreU(hn::Div(hn::LoadU(df, o + x), vl), df, row + x);
  } else if (order == ColumnOrder::kPairs) {
    for (; x + 2 * kLanes <= n; x += 2 * kLanes) {
      hn::StoreInterleaved2(hn::Div(hn::LoadU(df, o + x), vl), hn::Div(hn::LoadU(df, o + x + kLanes), vl), df, row + x);
    }
#if ATTN_DECODE_FIXED16
  } else if (order == ColumnOrder::kFixed16) {
    // Fixed16Column: output columns 8β … 8β+3 of a 2-vector chunk are its first
    // vector's lanes 4β … 4β+3, columns 8β+4 … 8β+7 its second's: 16-byte blocks.
    HWY_ALIGN float chunk[2 * kLanes];
    for (; x + 2 * kLanes <= n; x += 2 * kLanes) {
      hn::Store(hn::Div(hn::LoadU(df, o + x), vl), df, chunk);
      hn::Store(hn::Div(hn::LoadU(df, o + x + kLanes), vl), df, chunk + kLanes);
      for (int b = 0; b < kLanes / 4; ++b) {
        std::memcpy(row + x + 8 * b, chunk + 4 * b, 4 * sizeof(float));
        std::memcpy(row + x + 8 * b + 4, chunk + kLanes + 4 * b, 4 * sizeof(float));
      }
    }
#endif
  } else {
    for (; x + kLanes <= n; x += kLanes) {
      hn::StoreU(hn::Div(hn::GatherIndex(df, o, hn::LoadU(di, col_src + x)), vl), df, row + x);
    }
  }
  for (; x < n; ++x) row[x] = o[col_src[x]] / l;
}

/// a[x] /= total for x < n, in double, a vector at a time (the merged rows' division,
/// bitwise the scalar one for the same reason).
void DivideInPlace(double* HWY_RESTRICT a, double total, int n) {
  int x = 0;
#if HWY_HAVE_FLOAT64
  const hn::ScalableTag<double> dd;
  const auto vt = hn::Set(dd, total);
  for (; x + static_cast<int>(hn::Lanes(dd)) <= n; x += static_cast<int>(hn::Lanes(dd))) {
    hn::StoreU(hn::Div(hn::LoadU(dd, a + x), vt), dd, a + x);
  }
#endif
  for (; x < n; ++x) a[x] /= total;
}

/// Combines the splits' partial results of rows r0 … r0+nr−1 (nr ≤ kMergeRows) of a
/// group whose first item is `it` (merge_attention_states's rule, each row's splits in
/// split order) and writes out and lse. The partials' O columns are in the passes'
/// order (`order`): output column x is column col_src[x] (PartialColumn). acc:
/// kMergeRows·dvp doubles, row: dv floats of the thread's scratch.
void FinishRows(const DecodeProblem& p, const Item& it, const RowChunk& rc, const Partial* parts, int nsplits, int r0,
                int nr, int dvp, ColumnOrder order, const int* HWY_RESTRICT col_src, double* HWY_RESTRICT acc,
                float* HWY_RESTRICT row) {
  float mx[kMergeRows];
  double total[kMergeRows];
  bool merge[kMergeRows];
  auto store = [&](int k, const float* o, float lse_value) {
    const int r = (r0 + k) % rc.rows(), hh = (r0 + k) / rc.rows();
    const int h = (it.hk0 + hh) * p.group() + rc.g0 + r / rc.count, i = rc.i0 + r % rc.count;
    StoreRow(p, it.b, i, h, o, lse_value);
  };
  for (int k = 0; k < nr; ++k) {
    const int r = r0 + k;
    bool nan = false;
    float m_all = -HUGE_VALF;
    for (int s = 0; s < nsplits; ++s) {
      const float m = parts[s].m[r];
      nan |= std::isnan(m);
      m_all = std::max(m_all, m);
    }
    mx[k] = nan ? NAN : m_all;
    merge[k] = false;
    if (mx[k] == -HUGE_VALF) {  // no visible key in any split: out 0, lse −∞
      std::fill(row, row + p.dv, 0.0f);
      store(k, row, -HUGE_VALF);
    } else if (nsplits == 1 && !nan) {
      // One split: its weight is e^0 = 1 and the total is its l, so the double
      // division below is o / l rounded once to f32, which f32 division gives exactly.
      const float* HWY_RESTRICT o = parts[0].o + static_cast<size_t>(r) * dvp;
      const float l = parts[0].l[r];
      DivideInColumnOrder(o, order, col_src, l, p.dv, row);
      store(k, row, static_cast<float>(mx[k] + std::log(static_cast<double>(l))));
    } else {
      merge[k] = true;
      total[k] = 0;
      std::fill(acc + static_cast<size_t>(k) * dvp, acc + static_cast<size_t>(k + 1) * dvp, 0.0);
    }
  }
  for (int s = 0; s < nsplits; ++s) {
    for (int k = 0; k < nr; ++k) {
      const float m = parts[s].m[r0 + k];
      if (!merge[k] || m == -HUGE_VALF) continue;  // this split saw no key: weight 0, O not read
      const double w = std::exp(static_cast<double>(m) - mx[k]);
      total[k] += w * parts[s].l[r0 + k];
      const float* HWY_RESTRICT o = parts[s].o + static_cast<size_t>(r0 + k) * dvp;
      double* HWY_RESTRICT a = acc + static_cast<size_t>(k) * dvp;
      for (int x = 0; x < dvp; ++x) a[x] += w * o[x];
    }
  }
  for (int k = 0; k < nr; ++k) {
    if (!merge[k]) continue;
    double* a = acc + static_cast<size_t>(k) * dvp;
    DivideInPlace(a, total[k], dvp);
    for (int x = 0; x < p.dv; ++x) row[x] = static_cast<float>(a[col_src[x]]);
    store(k, row, static_cast<float>(mx[k] + std::log(total[k])));
  }
}

/// ComputeItem asks for cache rows ahead in software only when the call reads at
/// least this many bytes of cache, or more than the last-level cache holds where that
/// is smaller (PrefetchMinBytes). Measured on the Intel Xeon with AMX (2026-11-23,
/// B = 1, 1 and 2 threads, head-by-head requests 8 keys ahead): from DRAM they gain
/// 28–40% for bf16, 15–21% for i8, 19–28% for f8e4m3 and 7–13% for f32 (32k and 128k
/// tokens); from L3 (1k–8k tokens of bf16 or i8) they cost 0–4%, each request holding
/// a line-fill buffer through L3's latency. On Zen 1 (8 MiB of L3) an 8k bf16 cache
/// (34 MB) comes from DRAM, and the requests made it 0.94x the time (i8: 0.89x); f32
/// caches of 16–32 MiB there were 1.0–1.08x (4 rows per kv head) and 1.25x (1 row)
/// the time with them, so f32 keeps the 48 MiB rule. On Zen 4 (AVX-512, 32 MiB of L3
/// shared with other tenants' cores) caches of half the L3 and more are read from
/// DRAM in good part, and the requests pay from there: B = 1, 1 and 2 threads, 3–5
/// alternating rounds, f32 16 MiB 0.73–0.96x the time, 32 MiB 0.71–0.75x; bf16 16 MiB
/// 0.54–0.90x; i8 16 MiB 0.76–0.81x; 8 MiB (bf16, i8) 0.92–1.02x; 4 MiB 0.92–1.23x. So
/// AMD's AVX-512 cores ask from half the L3 on, whatever the dtype.
constexpr double kPrefetchMinBytes = 48.0 * (1 << 20);

double PrefetchMinBytes(size_t element_bytes) {
  const double l3 = static_cast<double>(l3_cache_bytes());
  if ((HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL) && !cpu_features().intel && l3 > 0) return l3 / 2;
  if (element_bytes >= 4 || l3 <= 0) return kPrefetchMinBytes;
  return std::min(kPrefetchMinBytes, std::max(l3, 4.0 * (1 << 20)));
}

int SplitsOf(const DecodeProblem& p, int lk) {
  if (p.num_splits > 0) return p.num_splits;
  return std::clamp((lk + kAutoSplitKeys - 1) / kAutoSplitKeys, 1, kAutoMaxSplits);
}

/// The kv heads one work item takes, for row chunks of `rows` rows. Where a token's
/// heads lie side by side (a [B, L, Hkv, d] cache), every head of a token at once,
/// so the cache is read in whole token rows. Where they lie apart (SplitHeads), one
/// head per item, which reads two runs, its keys and its values, where every head at
/// once read 2·Hkv runs side by side (Zen 1, f32, Hkv = 8, 4k keys from DRAM: 0.85x
/// the time).
int ItemHeads(const DecodeProblem& p, int rows) {
  return SplitHeads(p) ? 1 : std::max(1, std::min(p.Hkv, kMaxItemRows / rows));
}

/// True when every value of q (the rotated, unscaled queries) is a bf16: f32 whose
/// low 16 bits are zero. Then DotRowsBf16 takes them as they are, exactly. bf16
/// queries without rotary embedding always are; f32 queries widened from bf16 too.
bool AllBf16(const std::vector<float>& q) {
  uint32_t low = 0;
  for (const float x : q) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    low |= bits & 0xFFFFu;
  }
  return low == 0;
}

/// True when no value of q is NaN or ±∞ (an exponent of all ones), in one pass
/// without branches (std::all_of with std::isfinite took 2% of a 512-key call).
bool AllFinite(const std::vector<float>& q) {
  uint32_t all_ones = 0;
  for (const float x : q) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    all_ones |= (bits & 0x7F800000u) == 0x7F800000u;
  }
  return all_ones == 0;
}

/// Rounds every value of q (a whole number of vectors) to bf16, to nearest even, as
/// f32_to_bf16 does (overflow to ±∞; NaN stays NaN), in place.
void RoundToBf16(std::vector<float>& q) {
  const DF df;
  const hn::RebindToUnsigned<DF> du;
  for (size_t i = 0; i < q.size(); i += kLanes) {
    const VF v = hn::LoadU(df, &q[i]);
    const auto u = hn::BitCast(du, v);
    const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
    const auto rounded = hn::And(hn::Add(u, hn::Add(hn::Set(du, 0x7FFFu), odd)), hn::Set(du, 0xFFFF0000u));
    hn::StoreU(hn::IfThenElse(hn::IsNaN(v), v, hn::BitCast(df, rounded)), df, &q[i]);
  }
}

template <typename T>
void Decode(const DecodeProblem& p, int threads) {
  const int dp = RoundUp(p.d, kLanes), dvp = RoundUp(p.dv, kLanes);
  // bf16 caches on CPUs whose vdpbf16ps has the FMA's rate take the bf16 score pass
  // when every query value is a bf16 (AllBf16); it scales S, not q.
  bool bf16_dot = kPairs<T> && kBf16DotTarget && lowp_path() == LowpPath::avx512bf16;
  std::vector<float> qs = prepare_queries(p, kLanes, /*scaled=*/!bf16_dot);
  // Precision::bf16 rounds the (rotated) queries to bf16 for that pass, as attention()
  // rounds f32 inputs under it.
  if (bf16_dot && p.attn.precision == Precision::bf16) RoundToBf16(qs);
  if (bf16_dot && !AllBf16(qs)) {
    bf16_dot = false;
    for (float& x : qs) x *= p.attn.scale;  // as prepare_queries would have
  }
  const std::vector<RowChunk> chunks = RowChunks(p.group(), p.Lq);
  struct Group {  // the items of one (b, kv heads, chunk), in split order
    int first, count;
  };
  std::vector<Item> items;
  std::vector<Group> groups;
  size_t floats = 0;
  for (int b = 0; b < p.B; ++b) {
    const int lk = p.attn.seqs[b].Lk;
    const int nsplit = SplitsOf(p, lk);
    const int blocks = (lk + kBk - 1) / kBk;
    const int per = std::max(1, (blocks + nsplit - 1) / nsplit);
    for (int ch = 0; ch < static_cast<int>(chunks.size()); ++ch) {
      const int rows = chunks[ch].rows();
      const int heads = ItemHeads(p, rows);
      for (int hk0 = 0; hk0 < p.Hkv; hk0 += heads) {
        const int nh = std::min(heads, p.Hkv - hk0);
        groups.push_back({static_cast<int>(items.size()), nsplit});
        for (int s = 0; s < nsplit; ++s) {
          const int t0 = std::min(lk, s * per * kBk), t1 = std::min(lk, (s + 1) * per * kBk);
          items.push_back({b, hk0, nh, ch, t0, t1, floats});
          floats += static_cast<size_t>(rows) * nh * (dvp + 2);
        }
      }
    }
  }
  // Every item writes all of its partial, so the buffer is not cleared (a vector here
  // cleared 4 MiB per call at B = 8, 8k keys, 32 splits).
  float* const parts = thread_scratch(kSlotDecodeParts, floats);
  auto partial = [&](const Item& it) {
    const size_t rows = static_cast<size_t>(chunks[it.chunk].rows()) * it.heads;
    float* base = parts + it.part;
    return Partial{base, base + rows * dvp, base + rows * (dvp + 1)};
  };
  double bytes = 0;
  for (int b = 0; b < p.B; ++b) bytes += double(p.attn.seqs[b].Lk) * p.Hkv * (p.d + p.dv);
  const int nt = bytes < 1e5 ? 1 : std::max(1, threads);
  const bool prefetch = bytes * sizeof(T) >= PrefetchMinBytes(sizeof(T));
  const int nitems = static_cast<int>(items.size()), ngroups = static_cast<int>(groups.size());
  bool on_tiles = false;
#if ATTN_DECODE_AMX_I8
  if constexpr (std::is_same_v<T, int8_t>) {
    on_tiles = decode_i8_on_tiles() &&
               std::any_of(chunks.begin(), chunks.end(), [](const RowChunk& rc) { return rc.rows() <= kTileRowsMax; });
  }
#endif
  // Precision::bf16 lets i8 caches take both products on integers (kFixed16Target),
  // where d and dv are whole units; the score pass only for finite queries. Not
  // where the AMX-INT8 tiles run (their digits keep f32's accuracy at tile speed).
  // bf16 queries take them whatever the precision: their output is rounded to bf16
  // (2⁻⁹ of itself), and the fixed point errs by ~1e-4 of the output's largest, 1/100
  // of a plain bf16 pipeline's error (docs/PERFORMANCE.md). f16 queries keep the f32
  // passes: their output rounds 8× finer.
  Paths paths;
  paths.bf16_dot = bf16_dot;
  // bf16 caches: P·V on vdpbf16ps too, p rounded to bf16, for bf16 queries (bf16
  // inputs: attention()'s bf16 kernels round P so, as FlashAttention's plain bf16
  // pipeline does) and for f32 ones under Precision::bf16. f16 queries keep f32 P·V:
  // their output's rounding is 8× finer than bf16's.
  paths.bf16_pv = kPairs<T> && kBf16DotTarget && lowp_path() == LowpPath::avx512bf16 &&
                  (p.attn.precision == Precision::bf16 || p.q_dtype == DType::bf16);
  if constexpr (std::is_same_v<T, int8_t> && kFixed16Target) {
    paths.fixed_pv = (p.attn.precision == Precision::bf16 || p.q_dtype == DType::bf16) && !on_tiles &&
                     p.d % kFixedUnit == 0 && p.dv % kFixedUnit == 0;
    // d ≤ 512: a score's integer sum, at most d·32767·128, stays inside int32.
    paths.fixed_scores = paths.fixed_pv && p.d <= 512 && AllFinite(qs);
    paths.vnni = kFixed16Vnni && cpu_features().avx512_vnni;
  }
  std::vector<int16_t> q16;
  std::vector<float> qunit;
  if (paths.fixed_scores) {
    FixedQueries(qs, dp, p.d, q16, qunit);
    paths.q16 = q16.data();
    paths.qunit = qunit.data();
  }
  // The rows each item copies (before, each item converted its own: ~2 µs per item of
  // 32 rows, 5% of a 256-key split's time from cache).
  std::vector<uint16_t> q_bits;
  std::vector<float> q_pairs;
  if (paths.fixed_scores) {
    paths.qitem = q16.data(), paths.qitem_row_bytes = sizeof(int16_t) * dp;
  } else if (bf16_dot) {  // bf16 rows in their own order, unscaled (see AllBf16)
    q_bits.resize(qs.size());
    for (size_t x = 0; x < qs.size(); ++x) {
      uint32_t bits;
      std::memcpy(&bits, &qs[x], sizeof bits);
      q_bits[x] = static_cast<uint16_t>(bits >> 16);
    }
    paths.qitem = q_bits.data(), paths.qitem_row_bytes = sizeof(uint16_t) * dp;
  } else if (kPairs<T>) {  // pair order (see Bf16Pairs): evens, then odds
    q_pairs.resize(qs.size());
    for (size_t x = 0; x < qs.size(); x += 2 * kLanes) {
      for (int j = 0; j < kLanes; ++j) q_pairs[x + j] = qs[x + 2 * j], q_pairs[x + kLanes + j] = qs[x + 2 * j + 1];
    }
    paths.qitem = q_pairs.data(), paths.qitem_row_bytes = sizeof(float) * dp;
  } else {
    paths.qitem = qs.data(), paths.qitem_row_bytes = sizeof(float) * dp;
  }
  // Where each output column lies in a partial O (see ColumnOrder): out column x is
  // partial column col_src[x].
  const ColumnOrder order = on_tiles         ? ColumnOrder::kNatural
                            : paths.fixed_pv ? ColumnOrder::kFixed16
                            : kPairs<T>      ? ColumnOrder::kPairs
                                             : ColumnOrder::kNatural;
  std::vector<int> col_src(p.dv);
  for (int x = 0; x < p.dv; ++x) col_src[x] = PartialColumn(order, x);
  int item_rows = 0, item_pad_rows = 0;  // the largest item's (see Scratch)
  for (const RowChunk& rc : chunks) {
    const int heads = ItemHeads(p, rc.rows());
    item_rows = std::max(item_rows, heads * rc.rows());
    item_pad_rows = std::max(item_pad_rows, heads * RoundUp(rc.rows(), kLanes));
  }
  RunOnThreads(nt, [&] {
    Scratch w(dp, dvp, item_rows, item_pad_rows);
    std::vector<Partial> ps;
    std::unique_ptr<DecodeTilesScratch> tiles;
    if (on_tiles) {
      tiles = std::make_unique<DecodeTilesScratch>(p.d, p.dv, p.Hkv, kMaxItemRows);
#if ATTN_DECODE_AMX_I8
      ConfigureTiles();
#endif
    }
#pragma omp for schedule(dynamic, 1)
    for (int n = 0; n < nitems; ++n) {
      ComputeItem<T>(p, dp, dvp, items[n], chunks[items[n].chunk], w, partial(items[n]), prefetch,
                     tiles.get(), paths);
    }
#if ATTN_DECODE_AMX_I8
    if (on_tiles) ReleaseTiles();
#endif
#pragma omp for schedule(static)
    for (int n = 0; n < ngroups; ++n) {
      const Group& g = groups[n];
      const Item& it = items[g.first];
      const RowChunk& rc = chunks[it.chunk];
      ps.clear();
      for (int s = 0; s < g.count; ++s) ps.push_back(partial(items[g.first + s]));
      const int nrows = it.heads * rc.rows();
      for (int r0 = 0; r0 < nrows; r0 += kMergeRows) {
        FinishRows(p, it, rc, ps.data(), g.count, r0, std::min(kMergeRows, nrows - r0), dvp, order, col_src.data(),
                   w.acc, w.row);
      }
    }
  });
}

}  // namespace

void DecodeDispatch(const DecodeProblem& p, int threads) {
  switch (p.cache_dtype) {
    case DType::bf16:
      if (p.d % (2 * kLanes) == 0 && p.dv % (2 * kLanes) == 0) {
        Decode<Bf16Pairs>(p, threads);
      } else {
        Decode<hwy::bfloat16_t>(p, threads);
      }
      break;
    case DType::f16: Decode<hwy::float16_t>(p, threads); break;
    case DType::i8: Decode<int8_t>(p, threads); break;
    case DType::f8e4m3: Decode<E4m3>(p, threads); break;
    default: Decode<float>(p, threads); break;
  }
}

}  // namespace attn::detail::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace attn::detail {

HWY_EXPORT(DecodeDispatch);

void attention_decode_cpu(const DecodeProblem& p, int threads) { HWY_DYNAMIC_DISPATCH(DecodeDispatch)(p, threads); }

}  // namespace attn::detail
#endif  // HWY_ONCE
