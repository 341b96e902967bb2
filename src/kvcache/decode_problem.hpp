// The checked, normalised description of one attention_with_kvcache call, built by
// make_decode_problem() (kvcache_args.cpp) after every check has passed; read by the
// append (kvcache_append.cpp) and by the decode kernel (cpu/attention_decode.cc).
#pragma once

#include <cstdint>
#include <vector>

#include "attn/kvcache.hpp"
#include "problem.hpp"
#include "tensor/convert.hpp"

namespace attn::detail {

/// Where one cache (k or v) lives: element (page, row, head, c) at
/// base + page·page_stride + row·row_stride + head·head_stride + c. A contiguous
/// cache is a paged one whose page is the batch row and whose page size is its
/// capacity.
struct CacheTensor {
  void* base = nullptr;
  int64_t page_stride = 0, row_stride = 0, head_stride = 0;
  // Quantized caches (i8, f8e4m3) only: the per-(page, row, head) scales.
  float* scale = nullptr;
  int64_t scale_page = 0, scale_row = 0, scale_head = 0;
};

/// Caches stored as codes with one f32 scale per token and head: value = scale · code.
inline bool is_quantized_cache(DType t) { return t == DType::i8 || t == DType::f8e4m3; }
/// The largest code magnitude such a cache uses: 127 (i8) or 448 (E4M3's largest).
inline float quantized_max(DType t) { return t == DType::i8 ? 127.0f : kF8E4M3Max; }

struct DecodeProblem {
  /// Scale, softcap, causal, window and ALiBi as for attention(), and per sequence
  /// Lq and Lk (= cache_seqlens[b] + Lnew); the tensor pointers of `attn` are unused.
  Problem attn;
  int B = 0, Lq = 0, Hq = 0, Hkv = 0, d = 0, dv = 0;

  DType q_dtype = DType::f32;  // q and out
  const void* q = nullptr;
  int64_t q_b = 0, q_row = 0, q_head = 0;
  void* out = nullptr;
  int64_t out_b = 0, out_row = 0, out_head = 0;
  float* lse = nullptr;  // [B, Hq, Lq] or nullptr
  int64_t lse_b = 0, lse_h = 0, lse_i = 0;

  DType cache_dtype = DType::f32;
  CacheTensor k, v;
  int page_size = 0;
  bool paged = false;
  /// Physical page of each logical page in use: pages[b][t / page_size].
  std::vector<std::vector<int32_t>> pages;
  std::vector<int32_t> cached;  // cache_seqlens, as given

  // The append (Lnew = 0: none).
  int Lnew = 0;
  DType new_dtype = DType::f32;  // of k_new and v_new
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t kn_b = 0, kn_row = 0, kn_head = 0, vn_b = 0, vn_row = 0, vn_head = 0;
  const float* rot_cos = nullptr;  // nullptr = no rotary
  const float* rot_sin = nullptr;
  int64_t cos_row = 0, sin_row = 0;
  int rotary_dim = 0;
  bool rotary_interleaved = true;

  int num_splits = 0;  // 0 = automatic

  int group() const { return Hq / Hkv; }
  /// The element offset of logical row t of sequence b, head h, in `c`.
  int64_t row_offset(const CacheTensor& c, int b, int t, int h) const {
    const int32_t page = pages[b][t / page_size];
    return page * c.page_stride + int64_t{t % page_size} * c.row_stride + int64_t{h} * c.head_stride;
  }
  int64_t scale_offset(const CacheTensor& c, int b, int t, int h) const {
    const int32_t page = pages[b][t / page_size];
    return page * c.scale_page + int64_t{t % page_size} * c.scale_row + int64_t{h} * c.scale_head;
  }
};

/// Checks every argument (throws attn::Error naming it) and builds the problem.
/// `attend` false: only the append is wanted (q, out, lse absent).
DecodeProblem make_decode_problem(const char* fn, const TensorView& q, const KVCache& cache,
                                  const TensorView& cache_seqlens, const TensorView& out,
                                  const AttentionOptions& options, const KVCacheOptions& kv,
                                  const TensorView& lse, bool attend);

/// Writes the new keys and values into the cache (rotated, rounded or quantized).
void append_to_cache(const DecodeProblem& p);

/// The queries as f32 [B][Hq][Lq][d_padded], rotated like the new keys and, when
/// `scaled`, multiplied by the scale (after the rotation); d_padded = d rounded up to
/// `multiple`, zero-filled.
std::vector<float> prepare_queries(const DecodeProblem& p, int multiple, bool scaled = true);

/// Computes out and lse (cpu/attention_decode.cc) with `threads` threads.
void attention_decode_cpu(const DecodeProblem& p, int threads);

}  // namespace attn::detail
