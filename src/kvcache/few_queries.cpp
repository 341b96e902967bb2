// attention() with a few queries, on the decode kernel (see few_queries.hpp).
#include "kvcache/few_queries.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>

#include "cpu/isa.hpp"
#include "env_override.hpp"
#include "kvcache/decode_problem.hpp"

namespace attn::detail {
namespace {

/// Whether offset(b) = b·stride for every sequence b, and that stride: the decode
/// problem addresses batch rows by one stride per tensor. A packed (varlen) batch of
/// equal query lengths has that form for q, out and lse too.
template <class Offset>
bool batch_stride(const Problem& p, Offset offset, int64_t* stride) {
  *stride = p.B > 1 ? offset(p.seqs[1]) - offset(p.seqs[0]) : 0;
  for (int b = 0; b < p.B; ++b) {
    if (offset(p.seqs[static_cast<size_t>(b)]) != b * *stride) return false;
  }
  return true;
}

/// K and V as a decode cache of one page per sequence: sequence b's rows start at
/// page[b]·page_stride, for k and v with the same page numbers. For a padded batch
/// the pages are 0, 1, …, B − 1 (k.stride(0) apart); for a packed one, the first
/// token of each sequence (one row apart). Returns false when no such numbering exists.
bool bind_pages(const Problem& p, DecodeProblem& d) {
  int64_t gk = 0, gv = 0;
  for (const Sequence& s : p.seqs) gk = std::gcd(gk, s.k_offset), gv = std::gcd(gv, s.v_offset);
  if ((gk == 0) != (gv == 0)) return false;
  d.k.page_stride = gk, d.v.page_stride = gv;
  d.pages.assign(static_cast<size_t>(p.B), {});
  for (int b = 0; b < p.B; ++b) {
    const Sequence& s = p.seqs[static_cast<size_t>(b)];
    const int64_t page = gk == 0 ? 0 : s.k_offset / gk;
    if (page > std::numeric_limits<int32_t>::max() || (gv != 0 && s.v_offset != page * gv)) return false;
    d.pages[static_cast<size_t>(b)] = {static_cast<int32_t>(page)};
  }
  return true;
}

}  // namespace

int few_queries_limit(int max_lk, DType dtype, int group) {
  int limit = max_lk >= 256 ? 8 : 4;
  const CpuFeatures& cpu = cpu_features();
  if (max_lk >= 256 && cpu.bf16_dot_full_rate && !cpu.amx_bf16) {
    limit = dtype == DType::bf16 ? 16 : std::max(limit, std::min(16, 64 / std::max(1, group)));
  }
  return env_override("ATTN_FEW_QUERIES", 0, 64, limit);
}

bool attention_few_queries(const Problem& p, int threads) {
  // Masks go along, boolean and additive: the decode kernel applies them as the tiled
  // kernels do, and like them skips a key by its score (−∞), not by p = 0. A bf16/f16
  // additive mask comes back here once attention() has widened it to f32.
  if (p.B < 1 || p.seqs.empty() || p.probs != nullptr || p.mods != nullptr ||
      (p.add_mask != nullptr && p.mask_dtype != DType::f32) ||
      p.bm_blocks != nullptr || p.dropout_p != 0.0f || p.out_f32 || p.q_pos0 != 0 ||
      p.k_pos0 != 0 || p.h0 != 0 || (p.dtype == DType::f32 && p.precision == Precision::bf16)) {
    return false;
  }
  const int lq = p.seqs[0].Lq;
  int max_lk = 0, max_rows = 1;
  for (const Sequence& s : p.seqs) {
    if (s.Lq != lq) return false;
    max_lk = std::max(max_lk, s.Lk);
    max_rows = std::max(max_rows, s.Lk_rows);
  }
  if (lq < 1 || lq > few_queries_limit(max_lk, p.dtype, p.group())) return false;
  // The decode kernel has one path for every CPU, but a bad ATTN_ISA is still an
  // error on every bf16/f16 call, as it is where the call runs on the tiled kernels.
  if (p.dtype != DType::f32) (void)lowp_path();

  DecodeProblem d;
  const auto q_at = [](const Sequence& s) { return s.q_offset; };
  const auto out_at = [](const Sequence& s) { return s.out_offset; };
  const auto lse_at = [](const Sequence& s) { return s.lse_offset; };
  if (!batch_stride(p, q_at, &d.q_b) || !batch_stride(p, out_at, &d.out_b) ||
      (p.lse != nullptr && !batch_stride(p, lse_at, &d.lse_b)) || !bind_pages(p, d)) {
    return false;
  }
  d.attn = p;
  d.B = p.B, d.Lq = lq, d.Hq = p.Hq, d.Hkv = p.Hkv, d.d = p.d, d.dv = p.dv;
  d.q_dtype = p.dtype;
  d.q = p.q, d.q_row = p.q_row, d.q_head = p.q_head;
  d.out = p.out, d.out_row = p.out_row, d.out_head = p.out_head;
  d.lse = p.lse, d.lse_h = p.lse_h, d.lse_i = p.lse_i;
  d.cache_dtype = p.dtype;
  d.k.base = const_cast<float*>(p.k), d.k.row_stride = p.k_row, d.k.head_stride = p.k_head;
  d.v.base = const_cast<float*>(p.v), d.v.row_stride = p.v_row, d.v.head_stride = p.v_head;
  d.page_size = max_rows;  // one page spans a sequence's rows
  for (const Sequence& s : p.seqs) d.cached.push_back(s.Lk);
  attention_decode_cpu(d, threads);
  return true;
}

}  // namespace attn::detail
