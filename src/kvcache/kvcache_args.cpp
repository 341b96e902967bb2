// Argument checking for attention_with_kvcache() and kvcache_append(): every invalid
// argument becomes an attn::Error naming it, before the cache or any output is touched.
#include <algorithm>
#include <cmath>
#include <string>
#include <unordered_map>
#include <vector>

#include "arg_checker.hpp"
#include "kvcache/decode_problem.hpp"
#include "tensor/convert.hpp"
#include "tensor/view_util.hpp"

namespace attn::detail {
namespace {

bool is_float(DType t) { return t == DType::f32 || t == DType::bf16 || t == DType::f16; }

std::string str(int64_t x) { return std::to_string(x); }

// A float tensor of rank 4 with a contiguous last dimension, present.
void float4(const Checker& c, const TensorView& t, const char* name, const char* layout) {
  c.require(!t.empty(), [&] { return std::string(name) + " is required, got none"; });
  c.require(is_float(t.dtype()),
            [&] { return std::string(name) + " must have dtype f32, bf16 or f16, got " + dtype_name(t.dtype()); });
  c.tensor(t, name, t.dtype(), 4, layout);
  c.last_contiguous(t, name);
}

// A quantized cache (i8, f8e4m3) stores finite values only: a NaN or ±∞ new key or
// value is an error.
void require_finite(const Checker& c, const TensorView& t, const char* name, DType cache_dtype) {
  for (int64_t b = 0; b < t.size(0); ++b)
    for (int64_t r = 0; r < t.size(1); ++r)
      for (int64_t h = 0; h < t.size(2); ++h)
        for (int64_t x = 0; x < t.size(3); ++x) {
          const int64_t at = b * t.stride(0) + r * t.stride(1) + h * t.stride(2) + x * t.stride(3);
          if (!std::isfinite(load_f32(t.dtype(), t.data(), at))) {
            c.fail(std::string(name) + "[" + str(b) + ", " + str(r) + ", " + str(h) + ", " + str(x) +
                   "] is " + std::to_string(load_f32(t.dtype(), t.data(), at)) + ": an " + dtype_name(cache_dtype) + " cache holds finite values only");
          }
        }
}

void check_cache(const Checker& c, const KVCache& cache, DecodeProblem& p, int64_t B) {
  c.require(!cache.k.empty(), "cache.k is required, got none");
  c.require(!cache.v.empty(), "cache.v is required, got none");
  const DType dt = cache.k.dtype();
  c.require(is_float(dt) || is_quantized_cache(dt),
            [&] { return std::string("cache.k must have dtype f32, bf16, f16, i8 or f8e4m3, got ") + dtype_name(dt); });
  c.require(cache.v.dtype() == dt, [&] {
    return std::string("cache.v must have the dtype of cache.k (") + dtype_name(dt) + "), got " +
           dtype_name(cache.v.dtype());
  });
  const char* layout = cache.block_table.empty() ? "[B, capacity, Hkv, d]" : "[num_blocks, page_size, Hkv, d]";
  c.tensor(cache.k, "cache.k", dt, 4, layout);
  c.tensor(cache.v, "cache.v", dt, 4, layout);
  c.last_contiguous(cache.k, "cache.k");
  c.last_contiguous(cache.v, "cache.v");
  c.writable(cache.k, "cache.k");
  c.writable(cache.v, "cache.v");
  c.disjoint(cache.k, "cache.k", cache.v, "cache.v");
  c.dim_equals(cache.v, "cache.v", 0, cache.k.size(0), cache.block_table.empty() ? "B, as cache.k" : "num_blocks, as cache.k");
  if (cache.v.size(1) != cache.k.size(1)) {
    c.fail(std::string(cache.block_table.empty() ? "cache.v's capacity" : "page size mismatch: cache.v's page size") +
           " (shape[1]) must equal cache.k's, " + str(cache.k.size(1)) + ", got " + cache.v.describe());
  }
  c.dim_equals(cache.v, "cache.v", 2, cache.k.size(2), "Hkv, as cache.k");
  c.require(cache.k.size(1) >= 1, [&] {
    return std::string("cache.k's ") + (cache.block_table.empty() ? "capacity" : "page size") +
           " (shape[1]) must be >= 1, got " + cache.k.describe();
  });
  c.require(cache.k.size(2) >= 1 && cache.k.size(3) >= 1 && cache.v.size(3) >= 1, [&] {
    return "cache.k and cache.v need Hkv >= 1 and d, dv >= 1, got " + cache.k.describe() + " and " + cache.v.describe();
  });
  c.require(cache.k.size(1) <= INT32_MAX, [&] { return "cache.k.shape[1] must fit int32, got " + cache.k.describe(); });

  p.cache_dtype = dt;
  p.Hkv = static_cast<int>(cache.k.size(2));
  p.d = static_cast<int>(cache.k.size(3));
  p.dv = static_cast<int>(cache.v.size(3));
  p.page_size = static_cast<int>(cache.k.size(1));
  p.paged = !cache.block_table.empty();
  auto place = [](const TensorView& t, CacheTensor& ct) {
    ct.base = t.data();
    ct.page_stride = t.stride(0);
    ct.row_stride = t.stride(1);
    ct.head_stride = t.stride(2);
  };
  place(cache.k, p.k);
  place(cache.v, p.v);

  const bool quantized = is_quantized_cache(dt);
  const std::vector<int64_t> scale_shape{cache.k.size(0), cache.k.size(1), cache.k.size(2)};
  for (auto [t, name, ct] : {std::tuple{&cache.k_scale, "cache.k_scale", &p.k}, {&cache.v_scale, "cache.v_scale", &p.v}}) {
    if (!quantized) {
      c.require(t->empty(), [&] {
        return std::string(name) + " is for quantized (i8, f8e4m3) caches only; this cache is " + dtype_name(dt);
      });
      continue;
    }
    c.require(!t->empty(), [&] {
      return std::string(name) + " is required for an " + dtype_name(dt) + " cache (f32 [" +
             (p.paged ? "num_blocks, page_size" : "B, capacity") + ", Hkv]), got none";
    });
    c.tensor(*t, name, DType::f32, 3, "[pages, page_size, Hkv]");
    c.require(t->shape() == scale_shape, [&] {
      return std::string(name) + " must have shape " + shape_string(scale_shape) +
             " (cache.k's first three dimensions), got " + t->describe();
    });
    c.writable(*t, name);
    c.disjoint(*t, name, cache.k, "cache.k");
    c.disjoint(*t, name, cache.v, "cache.v");
    ct->scale = t->data_as<float>();
    ct->scale_page = t->stride(0);
    ct->scale_row = t->stride(1);
    ct->scale_head = t->stride(2);
  }
  if (quantized) c.disjoint(cache.k_scale, "cache.k_scale", cache.v_scale, "cache.v_scale");

  if (!p.paged) {
    if (cache.batch_idx.empty()) {
      c.dim_equals(cache.k, "cache.k", 0, B, "B, the batch of cache_seqlens (or give cache.batch_idx)");
      return;
    }
    c.tensor(cache.batch_idx, "cache.batch_idx", DType::i32, 1, "[B]");
    c.dim_equals(cache.batch_idx, "cache.batch_idx", 0, B, "B, the batch of cache_seqlens");
    c.require(cache.k.size(0) >= 1, [&] { return "cache.k must hold at least one batch row, got " + cache.k.describe(); });
    return;
  }
  c.require(cache.batch_idx.empty(),
            "cache.batch_idx is for contiguous caches: a paged cache's block_table already maps each sequence");
  const TensorView& bt = cache.block_table;
  c.tensor(bt, "cache.block_table", DType::i32, 2, "[B, max_blocks]");
  c.dim_equals(bt, "cache.block_table", 0, B, "B, the batch of cache_seqlens");
}

// Reads the pages each sequence uses and checks them: in range, no repeats within
// a sequence, and no page written by this call's append that another sequence uses.
// Runs on every call, before the kernel and on one thread, over B·L/page_size entries
// (65,536 at B = 8, 128k tokens, pages of 16), so it costs a few operations per entry:
// marks in a bitmap of num_blocks bits, and messages built only on failure. (A
// hash-set insert and eagerly built message strings per entry cost ~0.4 µs each:
// 6–15 ms of a 2-thread B = 8 step at 32k–128k tokens, 7–15% of it.)
void read_pages(const Checker& c, const KVCache& cache, DecodeProblem& p) {
  const int64_t num_blocks = cache.k.size(0);
  p.pages.assign(p.B, {});
  if (!p.paged) {
    // Sequence b's batch row: b, or cache.batch_idx[b] (in range; written at most once
    // when the call appends).
    const TensorView& bi = cache.batch_idx;
    std::vector<int> writer;
    if (!bi.empty() && p.Lnew > 0) writer.assign(static_cast<size_t>(num_blocks), -1);
    for (int b = 0; b < p.B; ++b) {
      int32_t row = b;
      if (!bi.empty()) {
        row = bi.data_as<const int32_t>()[b * bi.stride(0)];
        if (row < 0 || row >= num_blocks) {
          c.fail("cache.batch_idx[" + str(b) + "] = " + str(row) + " is out of range: cache.k holds batch rows 0 .. " +
                 str(num_blocks - 1));
        }
        if (!writer.empty()) {
          int& w = writer[static_cast<size_t>(row)];
          if (w >= 0) {
            c.fail("cache.batch_idx: sequences " + str(w) + " and " + str(b) + " both use cache row " + str(row) +
                   ", and this call appends into it (a shared row must be read-only)");
          }
          w = b;
        }
      }
      const int64_t used = (int64_t{p.cached[b]} + p.Lnew + p.page_size - 1) / p.page_size;
      p.pages[b].assign(static_cast<size_t>(used), row);
    }
    return;
  }
  const TensorView& bt = cache.block_table;
  const int32_t* table = bt.data_as<const int32_t>();
  const auto at = [&](int b, int64_t j) { return "cache.block_table[" + str(b) + ", " + str(j) + "]"; };
  std::vector<uint64_t> seen(static_cast<size_t>((num_blocks + 63) / 64), 0);  // the pages of sequence b so far
  for (int b = 0; b < p.B; ++b) {
    const int64_t used = (int64_t{p.cached[b]} + p.Lnew + p.page_size - 1) / p.page_size;
    std::vector<int32_t>& pages = p.pages[b];
    pages.resize(static_cast<size_t>(used));
    for (int64_t j = 0; j < used; ++j) {
      const int32_t page = table[b * bt.stride(0) + j * bt.stride(1)];
      if (page < 0 || page >= num_blocks) {
        c.fail(at(b, j) + " = " + str(page) + " is out of range: pages are 0 .. " + str(num_blocks - 1));
      }
      uint64_t& word = seen[static_cast<size_t>(page) / 64];
      const uint64_t bit = uint64_t{1} << (page % 64);
      if (word & bit) c.fail(at(b, j) + " = " + str(page) + " repeats a page sequence " + str(b) + " already uses");
      word |= bit;
      pages[static_cast<size_t>(j)] = page;
    }
    for (int32_t page : pages) seen[static_cast<size_t>(page) / 64] = 0;  // clean for the next sequence
  }
  if (p.Lnew == 0) return;
  // The pages this call's append writes (a few per sequence), each with its writer.
  std::unordered_map<int32_t, int> writer;
  std::vector<uint64_t>& written = seen;  // all zero again
  for (int b = 0; b < p.B; ++b) {
    for (int64_t t = p.cached[b]; t < int64_t{p.cached[b]} + p.Lnew; t += 1) {
      const int32_t page = p.pages[b][t / p.page_size];
      writer.emplace(page, b);
      written[static_cast<size_t>(page) / 64] |= uint64_t{1} << (page % 64);
    }
  }
  for (int b = 0; b < p.B; ++b) {
    for (int32_t page : p.pages[b]) {
      if (!(written[static_cast<size_t>(page) / 64] >> (page % 64) & 1)) continue;
      const int w = writer.at(page);
      if (w != b) {
        c.fail("cache.block_table: page " + str(page) + " is used by sequences " + str(std::min(b, w)) + " and " +
               str(std::max(b, w)) + ", and this call appends into it for sequence " + str(w) +
               " (shared pages must be read-only)");
      }
    }
  }
}

void check_append(const Checker& c, const KVCacheOptions& kv, const KVCache& cache, DecodeProblem& p) {
  if (kv.k_new.empty() != kv.v_new.empty()) {
    c.fail(std::string("kv.k_new and kv.v_new go together: got ") + (kv.k_new.empty() ? "v_new only" : "k_new only"));
  }
  if (kv.k_new.empty()) {
    c.require(kv.rotary_cos.empty() && kv.rotary_sin.empty(),
              "kv.rotary_cos/rotary_sin rotate appended keys (and the queries at their positions): they need "
              "kv.k_new, got none");
    return;
  }
  float4(c, kv.k_new, "kv.k_new", "[B, Lnew, Hkv, d]");
  float4(c, kv.v_new, "kv.v_new", "[B, Lnew, Hkv, dv]");
  c.require(kv.v_new.dtype() == kv.k_new.dtype(), [&] {
    return std::string("kv.v_new must have the dtype of kv.k_new (") + dtype_name(kv.k_new.dtype()) + "), got " +
           dtype_name(kv.v_new.dtype());
  });
  c.dim_equals(kv.k_new, "kv.k_new", 0, p.B, "B");
  c.dim_equals(kv.v_new, "kv.v_new", 0, p.B, "B");
  c.dim_equals(kv.v_new, "kv.v_new", 1, kv.k_new.size(1), "Lnew, as kv.k_new");
  c.dim_equals(kv.k_new, "kv.k_new", 2, p.Hkv, "Hkv, as the cache");
  c.dim_equals(kv.v_new, "kv.v_new", 2, p.Hkv, "Hkv, as the cache");
  c.dim_equals(kv.k_new, "kv.k_new", 3, p.d, "d, as cache.k");
  c.dim_equals(kv.v_new, "kv.v_new", 3, p.dv, "dv, as cache.v");
  c.require(kv.k_new.size(1) <= INT32_MAX,
            [&] { return "kv.k_new.shape[1] must fit int32, got " + kv.k_new.describe(); });
  for (const auto& [t, name] : {std::pair{&cache.k, "cache.k"}, {&cache.v, "cache.v"}, {&cache.k_scale, "cache.k_scale"},
                                {&cache.v_scale, "cache.v_scale"}}) {
    c.disjoint(*t, name, kv.k_new, "kv.k_new");
    c.disjoint(*t, name, kv.v_new, "kv.v_new");
  }
  if (is_quantized_cache(p.cache_dtype)) {
    require_finite(c, kv.k_new, "kv.k_new", p.cache_dtype);
    require_finite(c, kv.v_new, "kv.v_new", p.cache_dtype);
  }
  p.Lnew = static_cast<int>(kv.k_new.size(1));
  p.new_dtype = kv.k_new.dtype();
  p.k_new = kv.k_new.data();
  p.v_new = kv.v_new.data();
  p.kn_b = kv.k_new.stride(0), p.kn_row = kv.k_new.stride(1), p.kn_head = kv.k_new.stride(2);
  p.vn_b = kv.v_new.stride(0), p.vn_row = kv.v_new.stride(1), p.vn_head = kv.v_new.stride(2);

  if (kv.rotary_cos.empty() != kv.rotary_sin.empty()) c.fail("kv.rotary_cos and kv.rotary_sin go together");
  if (kv.rotary_cos.empty()) return;
  c.tensor(kv.rotary_cos, "kv.rotary_cos", DType::f32, 2, "[max_position, rotary_dim / 2]");
  c.tensor(kv.rotary_sin, "kv.rotary_sin", DType::f32, 2, "[max_position, rotary_dim / 2]");
  c.last_contiguous(kv.rotary_cos, "kv.rotary_cos");
  c.last_contiguous(kv.rotary_sin, "kv.rotary_sin");
  c.require(kv.rotary_sin.shape() == kv.rotary_cos.shape(), [&] {
    return "kv.rotary_sin must have kv.rotary_cos's shape " + kv.rotary_cos.describe() + ", got " +
           kv.rotary_sin.describe();
  });
  const int64_t rd = 2 * kv.rotary_cos.size(1);
  c.require(rd >= 2 && rd <= p.d, [&] {
    return "kv.rotary_cos.shape[1] (rotary_dim / 2) must be in 1 .. d/2 = " + str(p.d / 2) + ", got " +
           kv.rotary_cos.describe();
  });
  int64_t need = 0;
  for (int b = 0; b < p.B; ++b) need = std::max<int64_t>(need, int64_t{p.cached[b]} + p.Lnew);
  c.require(kv.rotary_cos.size(0) >= need, [&] {
    return "kv.rotary_cos has " + str(kv.rotary_cos.size(0)) + " positions, but the appended tokens reach position " +
           str(need - 1) + " (need shape[0] >= " + str(need) + ")";
  });
  p.rot_cos = kv.rotary_cos.data_as<const float>();
  p.rot_sin = kv.rotary_sin.data_as<const float>();
  p.cos_row = kv.rotary_cos.stride(0);
  p.sin_row = kv.rotary_sin.stride(0);
  p.rotary_dim = static_cast<int>(rd);
  p.rotary_interleaved = kv.rotary_interleaved;
}

void check_options(const Checker& c, const AttentionOptions& o, DecodeProblem& p) {
  c.require(o.block_mask.empty(),
            "options.block_mask is not supported with a KV cache (use options.mask, causal, window or ALiBi)");
  c.require(o.cu_seqlens_q.empty() && o.cu_seqlens_k.empty(),
            "options.cu_seqlens_q/k are not supported with a KV cache (cache_seqlens gives the lengths)");
  c.require(o.key_lengths.empty(), "options.key_lengths is not supported with a KV cache (cache_seqlens gives them)");
  c.require(o.dropout_p == 0.0f, [&] {
    return "options.dropout_p must be 0 with a KV cache (inference), got " + std::to_string(o.dropout_p);
  });
  Problem& a = p.attn;
  const float scale = o.scale.value_or(static_cast<float>(1.0 / std::sqrt(static_cast<double>(p.d))));
  c.require(std::isfinite(scale) && scale > 0.0f,
            [&] { return "options.scale must be finite and > 0, got " + std::to_string(scale); });
  c.require(std::isfinite(o.softcap) && o.softcap >= 0.0f,
            [&] { return "options.softcap must be 0 (off) or finite and > 0, got " + std::to_string(o.softcap); });
  c.require(o.window.left >= -1 && o.window.right >= -1, [&] {
    return "options.window sides must be >= -1 (-1 = unbounded), got {" + str(o.window.left) + ", " +
           str(o.window.right) + "}";
  });
  c.require(o.precision == Precision::f32 || o.precision == Precision::bf16 || o.precision == Precision::bf16x3, [&] {
    return "options.precision must be Precision::f32, Precision::bf16 or Precision::bf16x3, got " +
           std::to_string(static_cast<int>(o.precision));
  });
  a.precision = o.precision;
  a.scale = scale;
  a.softcap = o.softcap;
  a.causal = o.causal;
  a.window_left = o.window.left;
  a.window_right = o.window.right;
  if (!o.alibi_slopes.empty()) {
    const TensorView& s = o.alibi_slopes;
    c.require(s.dtype() == DType::f32,
              [&] { return std::string("options.alibi_slopes must have dtype f32, got ") + dtype_name(s.dtype()); });
    c.require((s.rank() == 1 && s.size(0) == p.Hq) || (s.rank() == 2 && s.size(0) == p.B && s.size(1) == p.Hq), [&] {
      return "options.alibi_slopes must be [Hq] = [" + str(p.Hq) + "] or [B, Hq] = [" + str(p.B) + ", " + str(p.Hq) +
             "], got " + s.describe();
    });
    c.nonnegative_strides(s, "options.alibi_slopes");
    c.on_device(s, "options.alibi_slopes");
    a.alibi = s.data_as<const float>();
    a.alibi_b = s.rank() == 2 ? s.stride(0) : 0;
    a.alibi_h = s.stride(s.rank() - 1);
  }
}

// options.mask over the keys of the cache: broadcast over [B, Hq, Lq, K] by NumPy's
// rules, where K (the last dimension) reaches at least the longest sequence's keys,
// cache_seqlens[b] + Lnew; key j of sequence b (its position in the cache) reads
// column j, so one mask serves a batch whose sequences have different lengths (the
// columns past a sequence's own keys are never read). Boolean (true = attend) or
// additive f32, or additive in q's dtype (bf16/f16), which attention_with_kvcache
// widens to f32 before the kernel reads it (mask_dtype says so).
void bind_mask(const Checker& c, const TensorView& m, DecodeProblem& p) {
  if (m.empty()) return;
  const DType qt = p.q_dtype;
  c.require(m.dtype() == DType::boolean || m.dtype() == DType::f32 || m.dtype() == qt, [&] {
    return std::string("options.mask must be boolean (true = attend) or additive in f32") +
           (qt != DType::f32 ? std::string(" or ") + dtype_name(qt) : std::string()) + ", got " +
           dtype_name(m.dtype());
  });
  c.require(m.rank() >= 1 && m.rank() <= 4, [&] {
    return "options.mask must have rank 1 .. 4 (broadcast over [B, Hq, Lq, K]), got " + m.describe();
  });
  c.require(m.data() != nullptr || m.numel() == 0, "options.mask has a null data pointer");
  c.nonnegative_strides(m, "options.mask");
  c.on_device(m, "options.mask");
  int64_t keys = 0;
  for (int b = 0; b < p.B; ++b) keys = std::max<int64_t>(keys, int64_t{p.cached[b]} + p.Lnew);
  const int64_t full[3] = {p.B, p.Hq, p.Lq};
  const char* names[4] = {"B", "Hq", "Lq", "K"};
  for (int i = 0; i < m.rank(); ++i) {
    const int dim = 4 - m.rank() + i;
    const int64_t sz = m.size(i);
    const bool ok = sz == 1 || (dim < 3 ? sz == full[dim] : sz >= keys);
    if (!ok) {
      c.fail("options.mask " + m.describe() + " is not broadcastable to [B, Hq, Lq, K] = [" + str(p.B) + ", " +
             str(p.Hq) + ", " + str(p.Lq) + ", K >= " + str(keys) + "]: dimension " + str(i) + " (" + names[dim] +
             ") must be 1 or " + (dim < 3 ? str(full[dim]) : "at least " + str(keys) + " (max cache_seqlens[b] + Lnew)") +
             ", got " + str(sz));
    }
  }
  bind_mask_layout(c, m, "options.mask", &p.attn);
}

}  // namespace

DecodeProblem make_decode_problem(const char* fn, const TensorView& q, const KVCache& cache,
                                  const TensorView& cache_seqlens, const TensorView& out,
                                  const AttentionOptions& options, const KVCacheOptions& kv,
                                  const TensorView& lse, bool attend) {
  const Checker c(fn);
  DecodeProblem p;
  c.tensor(cache_seqlens, "cache_seqlens", DType::i32, 1, "[B]");
  c.require(cache_seqlens.size(0) >= 1,
            [&] { return "cache_seqlens must hold B >= 1 lengths, got " + cache_seqlens.describe(); });
  c.require(cache_seqlens.size(0) <= INT32_MAX, "cache_seqlens: B must fit int32");
  p.B = static_cast<int>(cache_seqlens.size(0));
  check_cache(c, cache, p, p.B);
  c.disjoint(cache.k, "cache.k", cache_seqlens, "cache_seqlens");
  c.disjoint(cache.v, "cache.v", cache_seqlens, "cache_seqlens");

  if (attend) {
    float4(c, q, "q", "[B, Lq, Hq, d]");
    c.dim_equals(q, "q", 0, p.B, "B, the batch of cache_seqlens");
    c.dim_equals(q, "q", 3, p.d, "d, as cache.k");
    c.require(q.size(1) >= 1 && q.size(1) <= INT32_MAX,
              [&] { return "q needs 1 .. 2^31-1 queries (shape[1]), got " + q.describe(); });
    c.require(q.size(2) >= 1 && q.size(2) % p.Hkv == 0, [&] {
      return "q.shape[2] (Hq) must be a positive multiple of the cache's Hkv = " + str(p.Hkv) + ", got " + q.describe();
    });
    p.Lq = static_cast<int>(q.size(1));
    p.Hq = static_cast<int>(q.size(2));
    p.q_dtype = q.dtype();
    p.q = q.data();
    p.q_b = q.stride(0), p.q_row = q.stride(1), p.q_head = q.stride(2);
    c.tensor(out, "out", q.dtype(), 4, "[B, Lq, Hq, dv]");
    c.require(out.shape() == std::vector<int64_t>{p.B, p.Lq, p.Hq, p.dv}, [&] {
      return "out must have shape " + shape_string({p.B, p.Lq, p.Hq, p.dv}) + " ([B, Lq, Hq, dv]), got " +
             out.describe();
    });
    c.last_contiguous(out, "out");
    c.writable(out, "out");
    p.out = out.data();
    p.out_b = out.stride(0), p.out_row = out.stride(1), p.out_head = out.stride(2);
    if (!lse.empty()) {
      c.tensor(lse, "lse", DType::f32, 3, "[B, Hq, Lq]");
      c.require(lse.shape() == std::vector<int64_t>{p.B, p.Hq, p.Lq}, [&] {
        return "lse must have shape " + shape_string({p.B, p.Hq, p.Lq}) + " ([B, Hq, Lq]), got " + lse.describe();
      });
      c.writable(lse, "lse");
      p.lse = lse.data_as<float>();
      p.lse_b = lse.stride(0), p.lse_h = lse.stride(1), p.lse_i = lse.stride(2);
    }
    check_options(c, options, p);
    c.require(kv.num_splits >= 0 && kv.num_splits <= kMaxKVSplits, [&] {
      return "kv.num_splits must be 0 (automatic) .. " + str(kMaxKVSplits) + ", got " + str(kv.num_splits);
    });
    p.num_splits = kv.num_splits;
  }
  // Every input may be read after an output is written, so outputs overlap nothing.
  const std::pair<const TensorView*, const char*> inputs[] = {
      {&q, "q"}, {&cache.k, "cache.k"}, {&cache.v, "cache.v"}, {&cache.k_scale, "cache.k_scale"},
      {&cache.v_scale, "cache.v_scale"}, {&cache.block_table, "cache.block_table"},
      {&cache.batch_idx, "cache.batch_idx"}, {&cache_seqlens, "cache_seqlens"},
      {&kv.k_new, "kv.k_new"}, {&kv.v_new, "kv.v_new"}, {&kv.rotary_cos, "kv.rotary_cos"},
      {&kv.rotary_sin, "kv.rotary_sin"}, {&options.alibi_slopes, "options.alibi_slopes"},
      {&options.mask, "options.mask"}};
  for (const auto& [t, name] : inputs) {
    c.disjoint(out, "out", *t, name);
    c.disjoint(lse, "lse", *t, name);
    c.disjoint(cache.k, "cache.k", *t, name, /*exact_alias_ok=*/t == &cache.k);
    c.disjoint(cache.v, "cache.v", *t, name, /*exact_alias_ok=*/t == &cache.v);
  }
  c.disjoint(out, "out", lse, "lse");

  p.cached.resize(p.B);
  for (int b = 0; b < p.B; ++b) {
    const int32_t n = cache_seqlens.data_as<const int32_t>()[b * cache_seqlens.stride(0)];
    c.require(n >= 0, [&] { return "cache_seqlens[" + str(b) + "] must be >= 0, got " + str(n); });
    p.cached[b] = n;
  }
  check_append(c, kv, cache, p);
  const int64_t capacity =
      p.paged ? cache.block_table.size(1) * int64_t{p.page_size} : int64_t{p.page_size};
  for (int b = 0; b < p.B; ++b) {
    const int32_t n = p.cached[b];
    c.require(int64_t{n} + p.Lnew <= capacity, [&] {
      return "cache_seqlens[" + str(b) + "] + Lnew = " + str(n) + " + " + str(p.Lnew) +
             " exceeds the cache's capacity " + str(capacity) +
             (p.paged ? " (max_blocks × page_size)" : " (cache.k.shape[1])");
    });
  }
  read_pages(c, cache, p);
  if (attend && p.rot_cos != nullptr) {
    for (int b = 0; b < p.B; ++b) {
      c.require(int64_t{p.cached[b]} + p.Lnew >= p.Lq, [&] {
        return "kv.rotary_cos: query i of sequence b rotates at position cache_seqlens[b] + Lnew - Lq + i, which is "
               "negative for b = " +
               str(b) + " (" + str(p.cached[b]) + " + " + str(p.Lnew) + " - " + str(p.Lq) + ")";
      });
    }
  }

  if (attend) {
    p.attn.B = p.B;
    p.attn.Hq = p.Hq;
    p.attn.heads_total = p.Hq;
    p.attn.Hkv = p.Hkv;
    p.attn.d = p.d;
    p.attn.dv = p.dv;
    p.attn.seqs.resize(p.B);
    for (int b = 0; b < p.B; ++b) {
      p.attn.seqs[b].Lq = p.Lq;
      p.attn.seqs[b].Lk = p.cached[b] + p.Lnew;
      p.attn.seqs[b].Lk_rows = p.attn.seqs[b].Lk;
      p.attn.seqs[b].align = int64_t{p.attn.seqs[b].Lk} - p.Lq;
    }
    bind_mask(c, options.mask, p);
  }
  return p;
}

}  // namespace attn::detail
