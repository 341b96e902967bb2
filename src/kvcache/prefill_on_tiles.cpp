// attention_with_kvcache() with many queries, on the tiled kernels (see prefill_on_tiles.hpp).
#include "kvcache/prefill_on_tiles.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention_lowp.hpp"
#include "cpu/storage_rows.hpp"
#include "cpu/thread_team.hpp"
#include "cpu/workspace.hpp"
#include "env_override.hpp"
#include "tensor/convert.hpp"

namespace attn::detail {
namespace {

/// Whether sequence b's rows of cache c lie at one stride from its first page on:
/// a contiguous cache, or pages that follow one another in memory.
bool rows_in_one_run(const DecodeProblem& p, const CacheTensor& c, int b) {
  const std::vector<int32_t>& pages = p.pages[static_cast<size_t>(b)];
  if (pages.size() <= 1) return true;
  if (c.page_stride != p.page_size * c.row_stride) return false;
  for (size_t j = 1; j < pages.size(); ++j) {
    if (pages[j] != pages[0] + static_cast<int32_t>(j)) return false;
  }
  return true;
}

/// Copies logical rows [first, first + keys) of sequence b of cache c, every head, into
/// dst laid out [keys][Hkv][width] (width = d or dv): in the cache's dtype, page by
/// page, a page's rows in one copy where its tokens' heads lie side by side; or, with
/// to_f32, widened to f32 (bf16, f16: exactly; a quantized cache's rows dequantized,
/// scale · code, one rounding, as the decode kernel widens them).
void gather_rows(const DecodeProblem& p, const CacheTensor& c, int b, int first, int keys, int width, bool to_f32,
                 uint8_t* dst, int threads) {
  const bool quantized = is_quantized_cache(p.cache_dtype);
  const size_t elt = dtype_size(p.cache_dtype), row = (to_f32 ? sizeof(float) : elt) * width;
  const auto* base = static_cast<const uint8_t*>(c.base);
  const bool packed_rows = c.head_stride == width && c.row_stride == int64_t{p.Hkv} * width;
  const int end = first + keys, page0 = first / p.page_size;
  const int pages = keys == 0 ? 0 : (end - 1) / p.page_size - page0 + 1;
  RunOnThreads(keys >= 1024 ? threads : 1, [&] {
#pragma omp for schedule(static)
    for (int n = 0; n < pages; ++n) {
      const int page = page0 + n;
      const int t0 = std::max(first, page * p.page_size), t1 = std::min(end, (page + 1) * p.page_size);
      if (packed_rows && !quantized) {  // the page's rows in one run
        uint8_t* to = dst + static_cast<size_t>(t0 - first) * p.Hkv * row;
        const int64_t at = p.row_offset(c, b, t0, 0);
        if (to_f32) {
          load_row_f32_cpu(p.cache_dtype, c.base, at, (t1 - t0) * p.Hkv * width, reinterpret_cast<float*>(to));
        } else {
          std::memcpy(to, base + at * elt, static_cast<size_t>(t1 - t0) * p.Hkv * row);
        }
        continue;
      }
      for (int t = t0; t < t1; ++t) {
        for (int h = 0; h < p.Hkv; ++h) {
          uint8_t* to = dst + (static_cast<size_t>(t - first) * p.Hkv + h) * row;
          const int64_t at = p.row_offset(c, b, t, h);
          if (!to_f32) {
            std::memcpy(to, base + at * elt, row);
            continue;
          }
          auto* out = reinterpret_cast<float*>(to);
          if (!quantized) {
            load_row_f32_cpu(p.cache_dtype, c.base, at, width, out);
            continue;
          }
          const uint8_t* from = base + at * elt;
          const float scale = c.scale[p.scale_offset(c, b, t, h)];
          if (p.cache_dtype == DType::i8) {
            for (int x = 0; x < width; ++x) out[x] = scale * static_cast<float>(reinterpret_cast<const int8_t*>(from)[x]);
          } else {
            for (int x = 0; x < width; ++x) out[x] = scale * f8e4m3_to_f32(from[x]);
          }
        }
      }
    }
  });
}

/// Sequence b of t alone (B = 1): its q, out, lse, ALiBi slopes and mask rows.
Problem sequence_problem(const Problem& t, int b) {
  Problem one = t;
  const Sequence& s = t.seqs[static_cast<size_t>(b)];
  one.B = 1, one.seqs = {s};
  one.seqs[0].q_offset = one.seqs[0].out_offset = one.seqs[0].lse_offset = 0;
  // q and out hold elements of the problem's dtype behind their float pointers (out:
  // f32 ones under out_f32).
  const int64_t q_elt = static_cast<int64_t>(dtype_size(t.dtype));
  const int64_t out_elt = t.out_f32 ? int64_t{sizeof(float)} : q_elt;
  one.q = reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(t.q) + s.q_offset * q_elt);
  one.out = reinterpret_cast<float*>(reinterpret_cast<uint8_t*>(t.out) + s.out_offset * out_elt);
  if (t.lse != nullptr) one.lse = t.lse + s.lse_offset;
  if (t.alibi != nullptr) one.alibi = t.alibi + b * t.alibi_b;
  if (t.bool_mask != nullptr) one.bool_mask = t.bool_mask + b * t.mask_b;
  if (t.add_mask != nullptr) one.add_mask = t.add_mask + b * t.mask_b;
  return one;
}

/// Merges a block's partial result (f32 out [Lq][Hq][dv], lse [Hq][Lq]) into the
/// running one (the same layout), as merge_attention_states() does: in place.
void merge_into(const DecodeProblem& p, const float* out_blk, const float* lse_blk, float* out_acc, float* lse_acc) {
  const TensorView ob(out_blk, DType::f32, {1, p.Lq, p.Hq, p.dv}), lb(lse_blk, DType::f32, {1, p.Hq, p.Lq});
  const TensorView oa(out_acc, DType::f32, {1, p.Lq, p.Hq, p.dv}), la(lse_acc, DType::f32, {1, p.Hq, p.Lq});
  merge_attention_states(oa, la, ob, lb, oa, la);
}

}  // namespace

int kvcache_tiles_from(int group) {
  const int from = std::max(24, (128 + group - 1) / group);
  return env_override("ATTN_KVCACHE_TILES_FROM", 0, 1 << 30, from);
}

int kvcache_tiles_block_keys(int64_t bytes_per_key) {
  const int64_t keys = (int64_t{64} << 20) / std::max<int64_t>(1, bytes_per_key) / 256 * 256;
  return env_override("ATTN_KVCACHE_TILES_BLOCK", 1, 1 << 30, static_cast<int>(std::clamp<int64_t>(keys, 256, 1 << 30)));
}

bool attention_prefill_on_tiles(const DecodeProblem& p, int threads) {
  const int from = kvcache_tiles_from(p.group());
  // The tiled kernels take one dtype. Queries and a cache of the same float dtype are
  // read as they are, and so are f32 queries on a bf16 cache under Precision::bf16,
  // which lets the call round them to bf16 (the decode kernel's bf16 products round
  // them so; the output stays f32). Anything else runs on the f32 kernel: a bf16/f16
  // cache read by queries of another dtype is widened to f32 (exactly) as it is
  // gathered, and so is an f16 cache read by rotated f16 queries (the rotation keeps
  // them in f32, as the decode kernel does; rotated bf16 ones are rounded back to bf16
  // by prepare_queries); a quantized cache is dequantized to f32. Queries not in f32
  // are then widened, and the output rounded once at the end.
  const bool quantized = is_quantized_cache(p.cache_dtype);
  // Not where an i8 cache takes the decode kernel's integer passes (under
  // Precision::bf16, or for bf16 queries; d and dv multiples of 32), which are as fast
  // (the route took 1.06–1.16× their time on Zen 4 at 64–256 queries).
  if (p.cache_dtype == DType::i8 && (p.attn.precision == Precision::bf16 || p.q_dtype == DType::bf16) &&
      p.d % 32 == 0 && p.dv % 32 == 0) {
    return false;
  }
  const bool rounded_f32 =
      p.q_dtype == DType::f32 && p.cache_dtype == DType::bf16 && p.attn.precision == Precision::bf16;
  const bool rotated_f16 = p.rot_cos != nullptr && p.q_dtype == DType::f16;
  const bool f32_tiles = !rounded_f32 && (quantized || p.q_dtype != p.cache_dtype || rotated_f16);
  const bool cache_to_f32 = f32_tiles && p.cache_dtype != DType::f32;
  // A bf16/f16 cache widened per call costs its f32 copy's writes: from twice the
  // queries (measured on Zen 4: 0.9–1.05× the decode kernel's time at 32 queries
  // over 1,024–4,096 keys, 0.74–1.01× at 64, 0.67–0.81× at 256).
  const int widened_from = cache_to_f32 && !quantized ? 2 * from : from;
  if (from == 0 || p.Lq < widened_from || p.num_splits != 0) return false;
  const size_t elt = cache_to_f32 ? sizeof(float) : dtype_size(p.cache_dtype);  // of the kernels' keys and values
  const int block = kvcache_tiles_block_keys(static_cast<int64_t>(elt) * p.Hkv * (p.d + p.dv));
  Problem t = p.attn;
  t.dtype = f32_tiles ? DType::f32 : rounded_f32 ? DType::bf16 : p.q_dtype;
  t.out_f32 = rounded_f32;
  t.precision = Precision::f32;
  t.out = static_cast<float*>(p.out);
  t.out_row = p.out_row, t.out_head = p.out_head;
  t.lse = p.lse, t.lse_h = p.lse_h, t.lse_i = p.lse_i;
  int64_t out_b = p.out_b;
  std::vector<float> out32;  // [B][Lq][Hq][dv]: the f32 kernel's output for bf16/f16 queries
  if (f32_tiles && p.q_dtype != DType::f32) {
    out32.resize(static_cast<size_t>(p.B) * p.Lq * p.Hq * p.dv);
    t.out = out32.data(), t.out_row = int64_t{p.Hq} * p.dv, t.out_head = p.dv, out_b = t.out_row * p.Lq;
  }
  // Rotated queries (and widened ones) are f32 [B][Hq][Lq][d], unscaled (the kernels
  // scale the scores), and bf16 again for the bf16 kernel.
  std::vector<float> rotated;
  std::vector<uint16_t> rotated16;
  int64_t q_b = p.q_b;
  if (p.rot_cos != nullptr || t.dtype != p.q_dtype) {
    rotated = prepare_queries(p, 1, /*scaled=*/false);
    t.q = rotated.data();
    if (t.dtype == DType::bf16) {
      rotated16.resize(rotated.size());
      store_f32_row(DType::bf16, rotated16.data(), 0, rotated.data(), static_cast<int64_t>(rotated.size()));
      t.q = reinterpret_cast<const float*>(rotated16.data());
    }
    t.q_row = p.d, t.q_head = int64_t{p.Lq} * p.d, q_b = t.q_head * p.Hq;
  } else {
    t.q = static_cast<const float*>(p.q);
    t.q_row = p.q_row, t.q_head = p.q_head;
  }
  t.k = static_cast<const float*>(p.k.base), t.k_row = p.k.row_stride, t.k_head = p.k.head_stride;
  t.v = static_cast<const float*>(p.v.base), t.v_row = p.v.row_stride, t.v_head = p.v.head_stride;
  // The whole batch in one call where its keys fit in a block and lie in place.
  bool in_place = !cache_to_f32;
  int64_t total_keys = 0;
  for (int b = 0; b < p.B; ++b) {
    Sequence& s = t.seqs[static_cast<size_t>(b)];
    s.q_offset = b * q_b, s.out_offset = b * out_b, s.lse_offset = b * p.lse_b;
    const std::vector<int32_t>& pages = p.pages[static_cast<size_t>(b)];
    s.k_offset = pages.empty() ? 0 : pages[0] * p.k.page_stride;
    s.v_offset = pages.empty() ? 0 : pages[0] * p.v.page_stride;
    in_place = in_place && rows_in_one_run(p, p.k, b) && rows_in_one_run(p, p.v, b);
    total_keys += s.Lk;
  }
  in_place = in_place && total_keys <= block;
  // The kernel is chosen for the whole batch, as attention() chooses it.
  const LowpPath path = forward_tiles_path(t, AttentionOptions{});
  if (in_place) {
    forward_on_tiles(t, path, threads);
  } else {
    // One sequence at a time, in blocks of keys the tiled kernels read at one stride:
    // in place, or gathered into a buffer the thread keeps from call to call (a fresh
    // buffer's first touch would cost more than the copy; the tiled kernels use other
    // slots). A sequence longer than a block takes its keys block by block, each a
    // call placed at its keys' positions (as ring attention's blocks are), merged by
    // their lse: the packed and gathered copies stay within a block's size. A sequence
    // whose inputs hold a NaN or ±∞ alone takes the portable path, where attention()
    // would send the whole batch there: the same semantics, other roundings.
    std::vector<float> out_blk, lse_blk, out_acc, lse_acc;
    for (int b = 0; b < p.B; ++b) {
      const Problem one = sequence_problem(t, b);
      const int lk = one.seqs[0].Lk;
      const bool blocks = lk > block;
      if (blocks) {
        out_blk.resize(static_cast<size_t>(p.Lq) * p.Hq * p.dv), lse_blk.resize(static_cast<size_t>(p.Hq) * p.Lq);
        out_acc.resize(out_blk.size()), lse_acc.resize(lse_blk.size());
      }
      const bool here = !cache_to_f32 && rows_in_one_run(p, p.k, b) && rows_in_one_run(p, p.v, b);
      for (int k0 = 0; k0 < std::max(lk, 1); k0 += block) {
        const int keys = std::min(block, lk - k0);
        Problem part = one;
        part.seqs[0].Lk = part.seqs[0].Lk_rows = std::max(keys, 0);
        if (here) {
          part.seqs[0].k_offset += k0 * p.k.row_stride, part.seqs[0].v_offset += k0 * p.v.row_stride;
        } else {
          const size_t key_bytes = elt * std::max(keys, 0) * p.Hkv * p.d;
          const size_t bytes = key_bytes + elt * std::max(keys, 0) * p.Hkv * p.dv;
          auto* kv = reinterpret_cast<uint8_t*>(thread_scratch(kSlotGatheredKv, (bytes + 3) / 4));
          gather_rows(p, p.k, b, k0, std::max(keys, 0), p.d, cache_to_f32, kv, threads);
          gather_rows(p, p.v, b, k0, std::max(keys, 0), p.dv, cache_to_f32, kv + key_bytes, threads);
          part.seqs[0].k_offset = part.seqs[0].v_offset = 0;
          part.k = reinterpret_cast<const float*>(kv), part.k_row = int64_t{p.Hkv} * p.d, part.k_head = p.d;
          part.v = reinterpret_cast<const float*>(kv + key_bytes), part.v_row = int64_t{p.Hkv} * p.dv;
          part.v_head = p.dv;
        }
        if (blocks) {
          // Keys at their positions k0 + j (bands, ALiBi); mask columns from k0; the
          // block's f32 result and lse into the first or the running buffers.
          part.k_pos0 = k0;
          if (part.bool_mask != nullptr) part.bool_mask += k0 * part.mask_j;
          if (part.add_mask != nullptr) part.add_mask += k0 * part.mask_j;
          const bool first = k0 == 0;
          part.out_f32 = true;
          part.out = first ? out_acc.data() : out_blk.data();
          part.out_row = int64_t{p.Hq} * p.dv, part.out_head = p.dv;
          part.lse = first ? lse_acc.data() : lse_blk.data(), part.lse_h = p.Lq, part.lse_i = 1;
        }
        forward_on_tiles(part, path, threads);
        if (blocks && k0 > 0) merge_into(p, out_blk.data(), lse_blk.data(), out_acc.data(), lse_acc.data());
      }
      if (blocks) {  // the merged result into the sequence's out (rounded once) and lse
        for (int i = 0; i < p.Lq; ++i) {
          for (int h = 0; h < p.Hq; ++h) {
            const float* row = out_acc.data() + (static_cast<size_t>(i) * p.Hq + h) * p.dv;
            if (one.dtype == DType::f32 || one.out_f32 || !out32.empty()) {
              std::memcpy(one.out + i * one.out_row + h * one.out_head, row, sizeof(float) * p.dv);
            } else {
              store_f32_row(one.dtype, one.out, i * one.out_row + h * one.out_head, row, p.dv);
            }
            if (one.lse != nullptr) one.lse[h * one.lse_h + i * one.lse_i] = lse_acc[static_cast<size_t>(h) * p.Lq + i];
          }
        }
      }
    }
  }
  if (!out32.empty()) {  // rounded once into q's dtype
    for (int b = 0; b < p.B; ++b) {
      for (int i = 0; i < p.Lq; ++i) {
        for (int h = 0; h < p.Hq; ++h) {
          store_f32_row(p.q_dtype, p.out, b * p.out_b + i * p.out_row + h * p.out_head,
                        out32.data() + ((static_cast<size_t>(b) * p.Lq + i) * p.Hq + h) * p.dv, p.dv);
        }
      }
    }
  }
  return true;
}

}  // namespace attn::detail
