// attention_with_kvcache (issue 12): decoding, speculative decoding and chunked prefill
// against contiguous and paged caches of every dtype, checked against the float64
// reference on the same logical keys and values (the cache read back after the call
// and dequantized), on fresh random inputs of odd shapes. Also: the append (rounding,
// i8 and f8e4m3 quantization, RoPE in both pairings), nothing else in the cache touched, garbage
// (NaN) in unused slots and in removed keys never read into a result, split counts,
// bitwise equality across thread counts, and every argument error.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/kvcache.hpp"
#include "cpu/attention_forward.hpp"  // simd_targets, force_simd_target
#include "cpu/isa.hpp"
#include "kvcache/prefill_on_tiles.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {

enum class Rope { none, interleaved, half };

/// options.mask in the cases: none, boolean (true = attend), additive f32, or additive
/// in q's dtype; laid out [B, Hq, Lq, K], [B, 1, 1, K] (a padding mask) or [Lq, K] (one
/// tree mask for the batch), K = the longest sequence's keys + 3.
enum class Mask { none, boolean, f32, q_dtype };
enum class MaskLayout { full, per_sequence_keys, shared_tree };

std::string seed_note() { return "ATTN_TEST_SEED=" + std::to_string(base_seed()); }

struct KvConfig {
  int B = 1, Hq = 4, Hkv = 2, d = 16, dv = 16, Lq = 1, Lnew = 1;
  std::vector<int> cached{5};
  int page = 0;  // 0 = contiguous
  bool pages_in_order = false;  // each sequence's pages follow one another in memory
  // Contiguous caches: > 0 = a pool of this many batch rows, each sequence's row picked
  // at random (cache.batch_idx): distinct ones, or with repeats when shared_rows.
  int pool = 0;
  bool shared_rows = false;
  DType cache_dtype = DType::f32, q_dtype = DType::f32;
  Causal causal = Causal::BottomRight;
  Window window;
  float softcap = 0.0f;
  bool alibi = false;
  Rope rope = Rope::none;
  int rotary_dim = 0;  // 0 = d
  int num_splits = 0;
  Mask mask = Mask::none;
  MaskLayout mask_layout = MaskLayout::full;
  Precision precision = Precision::f32;
  std::string name() const {
    std::string s = "B" + std::to_string(B) + " Hq" + std::to_string(Hq) + " Hkv" + std::to_string(Hkv) + " d" +
                    std::to_string(d) + " dv" + std::to_string(dv) + " Lq" + std::to_string(Lq) + " Lnew" +
                    std::to_string(Lnew) + " page" + std::to_string(page) + " cache " + dtype_name(cache_dtype) +
                    " q " + dtype_name(q_dtype) + " causal" + std::to_string(int(causal)) + " window " +
                    std::to_string(window.left) + "," + std::to_string(window.right) + " softcap" +
                    std::to_string(softcap) + (alibi ? " alibi" : "") + " rope" + std::to_string(int(rope)) +
                    " splits" + std::to_string(num_splits) + " mask" + std::to_string(int(mask)) + "/" +
                    std::to_string(int(mask_layout)) + (precision == Precision::bf16 ? " precision bf16" : "") +
                    (pool ? " pool" + std::to_string(pool) + (shared_rows ? " shared" : "") : "") + " cached";
    for (int c : cached) s += " " + std::to_string(c);
    return s;
  }
};

float read_elem(DType dt, const void* base, int64_t at) {
  switch (dt) {
    case DType::bf16: return detail::bf16_to_f32(static_cast<const uint16_t*>(base)[at]);
    case DType::f16: return detail::f16_to_f32(static_cast<const uint16_t*>(base)[at]);
    case DType::i8: return static_cast<const int8_t*>(base)[at];
    case DType::f8e4m3: return detail::f8e4m3_to_f32(static_cast<const uint8_t*>(base)[at]);
    default: return static_cast<const float*>(base)[at];
  }
}

void write_elem(DType dt, void* base, int64_t at, float x) {
  switch (dt) {
    case DType::bf16: static_cast<uint16_t*>(base)[at] = detail::f32_to_bf16(x); break;
    case DType::f16: static_cast<uint16_t*>(base)[at] = detail::f32_to_f16(x); break;
    case DType::i8: static_cast<int8_t*>(base)[at] = static_cast<int8_t>(x); break;
    case DType::f8e4m3: static_cast<uint8_t*>(base)[at] = detail::f32_to_f8e4m3(x); break;
    default: static_cast<float*>(base)[at] = x; break;
  }
}

// Everything one call needs, owned; the cache's unused slots hold NaN (float caches).
struct KvCase {
  KvConfig c;
  int pages_total = 0, page_size = 0, max_blocks = 0;
  std::vector<uint8_t> k_cache, v_cache;  // raw bytes
  std::vector<float> k_scale, v_scale;
  std::vector<int32_t> block_table, seqlens;
  std::vector<int32_t> batch_idx;  // c.pool > 0: each sequence's batch row
  std::vector<uint8_t> q, k_new, v_new;  // q dtype
  std::vector<float> cos_t, sin_t, slopes;
  std::vector<uint8_t> mask;          // options.mask's bytes, shape mask_shape
  std::vector<int64_t> mask_shape;
  int mask_keys = 0;                  // K, its last dimension

  explicit KvCase(const KvConfig& cfg, std::mt19937_64& rng) : c(cfg) {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    const int cap_needed = *std::max_element(c.cached.begin(), c.cached.end()) + c.Lnew;
    if (c.page == 0) {
      page_size = cap_needed + 3;  // spare rows at the end
      pages_total = c.pool > 0 ? c.pool : c.B;
      max_blocks = 1;
      if (c.pool > 0) {
        std::vector<int32_t> rows(c.pool);
        std::iota(rows.begin(), rows.end(), 0);
        std::shuffle(rows.begin(), rows.end(), rng);
        for (int b = 0; b < c.B; ++b) batch_idx.push_back(c.shared_rows ? rows[size_t(b) % 2] : rows[size_t(b)]);
      }
    } else {
      page_size = c.page;
      max_blocks = (cap_needed + page_size - 1) / page_size + 1;
      pages_total = c.B * max_blocks + 3;
      // Each sequence gets distinct random pages; spare pages are never listed.
      std::vector<int32_t> perm(pages_total);
      std::iota(perm.begin(), perm.end(), 0);
      if (!c.pages_in_order) std::shuffle(perm.begin(), perm.end(), rng);
      block_table.assign(perm.begin(), perm.begin() + c.B * max_blocks);
    }
    const size_t es = dtype_size(c.cache_dtype);
    k_cache.assign(size_t(pages_total) * page_size * c.Hkv * c.d * es, 0);
    v_cache.assign(size_t(pages_total) * page_size * c.Hkv * c.dv * es, 0);
    const bool i8 = c.cache_dtype == DType::i8, e4m3 = c.cache_dtype == DType::f8e4m3;
    if (i8 || e4m3) {
      const float top = i8 ? 127.0f : 448.0f;
      k_scale.assign(size_t(pages_total) * page_size * c.Hkv, 0.0f);
      v_scale.assign(size_t(pages_total) * page_size * c.Hkv, 0.0f);
      for (float& s : k_scale) s = (0.5f + u(rng) * 0.4f) / top;
      for (float& s : v_scale) s = (0.5f + u(rng) * 0.4f) / top;
    }
    // i8: any code; E4M3: any finite code (every binade and the subnormals alike).
    std::uniform_int_distribution<int> qi(-127, 127), qe(0, 253);
    auto random_code = [&] {
      if (i8) return float(qi(rng));
      const int c8 = qe(rng);
      return detail::f8e4m3_to_f32(static_cast<uint8_t>(c8 < 127 ? c8 : c8 + 1));  // skip 0x7F (NaN)
    };
    auto fill = [&](std::vector<uint8_t>& buf, int width) {
      const int64_t n = int64_t(buf.size() / es);
      for (int64_t i = 0; i < n; ++i) {
        (void)width;
        write_elem(c.cache_dtype, buf.data(), i, i8 ? float(qi(rng)) : NAN);
      }
    };
    fill(k_cache, c.d);
    fill(v_cache, c.dv);
    seqlens.assign(c.cached.begin(), c.cached.end());
    // Real tokens of the existing prefix: random values.
    for (int b = 0; b < c.B; ++b)
      for (int t = 0; t < c.cached[b]; ++t)
        for (int h = 0; h < c.Hkv; ++h) {
          for (int x = 0; x < c.d; ++x) write_elem(c.cache_dtype, k_cache.data(), k_at(b, t, h) + x, i8 || e4m3 ? random_code() : u(rng));
          for (int x = 0; x < c.dv; ++x) write_elem(c.cache_dtype, v_cache.data(), v_at(b, t, h) + x, i8 || e4m3 ? random_code() : u(rng));
        }
    const size_t qs = dtype_size(c.q_dtype);
    auto rand_q = [&](std::vector<uint8_t>& buf, size_t n) {
      buf.assign(n * qs, 0);
      for (size_t i = 0; i < n; ++i) write_elem(c.q_dtype, buf.data(), int64_t(i), 1.5f * u(rng));
    };
    rand_q(q, size_t(c.B) * c.Lq * c.Hq * c.d);
    rand_q(k_new, size_t(c.B) * c.Lnew * c.Hkv * c.d);
    rand_q(v_new, size_t(c.B) * c.Lnew * c.Hkv * c.dv);
    if (c.rope != Rope::none) {
      const int rd = c.rotary_dim ? c.rotary_dim : c.d;
      cos_t.resize(size_t(cap_needed) * rd / 2);
      sin_t.resize(cos_t.size());
      for (int pos = 0; pos < cap_needed; ++pos)
        for (int j = 0; j < rd / 2; ++j) {
          const double a = pos * std::pow(10000.0, -2.0 * j / rd);
          cos_t[size_t(pos) * rd / 2 + j] = float(std::cos(a));
          sin_t[size_t(pos) * rd / 2 + j] = float(std::sin(a));
        }
    }
    if (c.alibi) {
      slopes.resize(size_t(c.B) * c.Hq);
      for (float& s : slopes) s = 0.05f + 0.3f * std::fabs(u(rng));
    }
    if (c.mask != Mask::none) make_mask(cap_needed, rng);
  }

  DType mask_dtype() const {
    return c.mask == Mask::boolean ? DType::boolean : c.mask == Mask::f32 ? DType::f32 : c.q_dtype;
  }
  /// Element (b, h, i, j) of the mask as broadcast over [B, Hq, Lq, K].
  int64_t mask_at(int b, int h, int i, int j) const {
    switch (c.mask_layout) {
      case MaskLayout::full: return ((int64_t(b) * c.Hq + h) * c.Lq + i) * mask_keys + j;
      case MaskLayout::per_sequence_keys: return int64_t(b) * mask_keys + j;
      case MaskLayout::shared_tree: return int64_t(i) * mask_keys + j;
    }
    return 0;
  }
  /// Random entries over every sequence's keys; the 3 columns past the longest hold
  /// NaN (additive) or true (boolean), which no result may read. In the full layout,
  /// query 0 of sequence 0 sees no key at all (defined: output 0, lse −∞).
  void make_mask(int longest, std::mt19937_64& rng) {
    mask_keys = longest + 3;
    mask_shape = c.mask_layout == MaskLayout::full                ? std::vector<int64_t>{c.B, c.Hq, c.Lq, mask_keys}
                 : c.mask_layout == MaskLayout::per_sequence_keys ? std::vector<int64_t>{c.B, 1, 1, mask_keys}
                                                                  : std::vector<int64_t>{c.Lq, mask_keys};
    int64_t n = 1;
    for (int64_t x : mask_shape) n *= x;
    const DType dt = mask_dtype();
    mask.assign(size_t(n) * dtype_size(dt), 0);
    std::uniform_real_distribution<float> u(0.0f, 1.0f);
    for (int64_t at = 0; at < n; ++at) {
      const int j = int(at % mask_keys);
      const bool past = j >= longest;
      const float r = u(rng);
      if (dt == DType::boolean) {
        mask[size_t(at)] = past || r < 0.7f;
      } else {
        // Additive: mostly small, some −∞ (removed keys), NaN past the keys.
        write_elem(dt, mask.data(), at, past ? NAN : r < 0.2f ? -INFINITY : 4.0f * r - 3.0f);
      }
    }
    if (c.mask_layout == MaskLayout::full) {
      for (int h = 0; h < c.Hq; ++h)
        for (int j = 0; j < mask_keys; ++j) {
          const int64_t at = mask_at(0, h, 0, j);
          if (dt == DType::boolean) mask[size_t(at)] = 0;
          else write_elem(dt, mask.data(), at, -INFINITY);
        }
    }
  }
  /// Sequence b's mask over its lk keys, dense [1, Hq, Lq, lk], for the reference
  /// (widened exactly to f32 when additive).
  TensorView mask_of_sequence(int b, int lk, std::vector<uint8_t>& bytes, std::vector<float>& floats) const {
    const int64_t n = int64_t(c.Hq) * c.Lq * std::max(lk, 1);
    if (mask_dtype() == DType::boolean) bytes.assign(size_t(n), 1);
    else floats.assign(size_t(n), 0.0f);
    for (int h = 0; h < c.Hq; ++h)
      for (int i = 0; i < c.Lq; ++i)
        for (int j = 0; j < lk; ++j) {
          const size_t to = (size_t(h) * c.Lq + i) * lk + j;
          const int64_t from = mask_at(b, h, i, j);
          if (mask_dtype() == DType::boolean) bytes[to] = mask[size_t(from)];
          else floats[to] = read_elem(mask_dtype(), mask.data(), from);
        }
    if (mask_dtype() == DType::boolean) return TensorView(bytes.data(), DType::boolean, {1, c.Hq, c.Lq, std::max(lk, 1)});
    return TensorView(floats.data(), DType::f32, {1, c.Hq, c.Lq, std::max(lk, 1)});
  }

  bool quantized() const { return c.cache_dtype == DType::i8 || c.cache_dtype == DType::f8e4m3; }
  int32_t page_of(int b, int t) const {
    if (c.page == 0) return batch_idx.empty() ? b : batch_idx[size_t(b)];
    return block_table[size_t(b) * max_blocks + t / page_size];
  }
  int64_t k_at(int b, int t, int h) const { return ((int64_t(page_of(b, t)) * page_size + t % page_size) * c.Hkv + h) * c.d; }
  int64_t v_at(int b, int t, int h) const { return ((int64_t(page_of(b, t)) * page_size + t % page_size) * c.Hkv + h) * c.dv; }
  int64_t s_at(int b, int t, int h) const { return (int64_t(page_of(b, t)) * page_size + t % page_size) * c.Hkv + h; }
  float k_value(int b, int t, int h, int x) const {
    const float v = read_elem(c.cache_dtype, k_cache.data(), k_at(b, t, h) + x);
    return quantized() ? v * k_scale[s_at(b, t, h)] : v;
  }
  float v_value(int b, int t, int h, int x) const {
    const float v = read_elem(c.cache_dtype, v_cache.data(), v_at(b, t, h) + x);
    return quantized() ? v * v_scale[s_at(b, t, h)] : v;
  }

  KVCache cache() {
    KVCache kc;
    kc.k = TensorView(k_cache.data(), c.cache_dtype, {pages_total, page_size, c.Hkv, c.d});
    kc.v = TensorView(v_cache.data(), c.cache_dtype, {pages_total, page_size, c.Hkv, c.dv});
    if (quantized()) {
      kc.k_scale = TensorView(k_scale.data(), DType::f32, {pages_total, page_size, c.Hkv});
      kc.v_scale = TensorView(v_scale.data(), DType::f32, {pages_total, page_size, c.Hkv});
    }
    if (c.page != 0) kc.block_table = TensorView(block_table.data(), DType::i32, {c.B, max_blocks});
    if (!batch_idx.empty()) kc.batch_idx = TensorView(batch_idx.data(), DType::i32, {c.B});
    return kc;
  }
  KVCacheOptions kv() {
    KVCacheOptions o;
    if (c.Lnew > 0) {
      o.k_new = TensorView(k_new.data(), c.q_dtype, {c.B, c.Lnew, c.Hkv, c.d});
      o.v_new = TensorView(v_new.data(), c.q_dtype, {c.B, c.Lnew, c.Hkv, c.dv});
    }
    if (c.rope != Rope::none) {
      const int rd = c.rotary_dim ? c.rotary_dim : c.d;
      const int64_t n = int64_t(cos_t.size()) / (rd / 2);
      o.rotary_cos = TensorView(cos_t.data(), DType::f32, {n, rd / 2});
      o.rotary_sin = TensorView(sin_t.data(), DType::f32, {n, rd / 2});
      o.rotary_interleaved = c.rope == Rope::interleaved;
    }
    o.num_splits = c.num_splits;
    return o;
  }
  AttentionOptions options() const {
    AttentionOptions o;
    o.causal = c.causal;
    o.window = c.window;
    o.softcap = c.softcap;
    o.precision = c.precision;
    if (c.alibi) o.alibi_slopes = TensorView(slopes.data(), DType::f32, {c.B, c.Hq});
    if (c.mask != Mask::none) o.mask = TensorView(mask.data(), mask_dtype(), mask_shape);
    return o;
  }
  TensorView seqlen_view() const { return TensorView(seqlens.data(), DType::i32, {c.B}); }
  TensorView q_view() const { return TensorView(q.data(), c.q_dtype, {c.B, c.Lq, c.Hq, c.d}); }

  // Rotates a row (double) at `pos` the way the tables say.
  void rotate(std::vector<double>& x, int pos) const {
    if (c.rope == Rope::none) return;
    const int rd = c.rotary_dim ? c.rotary_dim : c.d, half = rd / 2;
    for (int j = 0; j < half; ++j) {
      const int a = c.rope == Rope::interleaved ? 2 * j : j, b = c.rope == Rope::interleaved ? 2 * j + 1 : j + half;
      const double cs = cos_t[size_t(pos) * half + j], sn = sin_t[size_t(pos) * half + j];
      const double x0 = x[a], x1 = x[b];
      x[a] = x0 * cs - x1 * sn;
      x[b] = x0 * sn + x1 * cs;
    }
  }
};

struct Result {
  std::vector<uint8_t> out;
  std::vector<float> lse;
};

Result run(KvCase& kc) {
  const KvConfig& c = kc.c;
  Result r;
  r.out.assign(size_t(c.B) * c.Lq * c.Hq * c.dv * dtype_size(c.q_dtype), 0xAB);
  r.lse.assign(size_t(c.B) * c.Hq * c.Lq, 123.0f);
  attention_with_kvcache(kc.q_view(), kc.cache(), kc.seqlen_view(),
                         TensorView(r.out.data(), c.q_dtype, {c.B, c.Lq, c.Hq, c.dv}), kc.options(), kc.kv(),
                         TensorView(r.lse.data(), DType::f32, {c.B, c.Hq, c.Lq}));
  return r;
}

// Half an ulp of the cache dtype, relative (i8: absolute, from the scale).
double rounding(DType dt) { return dt == DType::bf16 ? 1.0 / 256 : dt == DType::f16 ? 1.0 / 2048 : 1e-7; }

// After the call: the appended rows hold the rotated new keys/values rounded once
// (or quantized), every other cache byte is unchanged.
void check_append(const KvCase& before, const KvCase& after, const std::string& name) {
  const KvConfig& c = after.c;
  std::vector<uint8_t> kexp = before.k_cache, vexp = before.v_cache;
  const size_t es = dtype_size(c.cache_dtype);
  for (int b = 0; b < c.B; ++b)
    for (int t = 0; t < c.Lnew; ++t) {
      const int pos = c.cached[b] + t;
      for (int h = 0; h < c.Hkv; ++h) {
        for (int which = 0; which < 2; ++which) {
          const int width = which == 0 ? c.d : c.dv;
          std::vector<double> x(width);
          const auto& src = which == 0 ? after.k_new : after.v_new;
          for (int e = 0; e < width; ++e)
            x[e] = read_elem(c.q_dtype, src.data(), ((int64_t(b) * c.Lnew + t) * c.Hkv + h) * width + e);
          if (which == 0) after.rotate(x, pos);
          double amax = 0;
          for (double e : x) amax = std::max(amax, std::fabs(e));
          for (int e = 0; e < width; ++e) {
            const float got = which == 0 ? after.k_value(b, pos, h, e) : after.v_value(b, pos, h, e);
            // E4M3: half an ulp, 2⁻⁴ relative, or half its subnormal step (2⁻¹⁰ of the scale).
            const double tol = c.cache_dtype == DType::i8       ? amax / 127 * 0.5 + 1e-6 * amax
                               : c.cache_dtype == DType::f8e4m3 ? std::max(std::fabs(x[e]) / 16, amax / 448 / 1024) + 1e-6 * amax
                                                                : rounding(c.cache_dtype) * std::fabs(x[e]) + 2e-7;
            ASSERT_NEAR(got, x[e], tol) << name << " appended " << (which ? "v" : "k") << " b" << b << " t" << t
                                        << " h" << h << " e" << e << " (" << seed_note() << ")";
          }
          if (after.quantized()) {
            const double top = c.cache_dtype == DType::i8 ? 127 : 448;
            const float s = (which == 0 ? after.k_scale : after.v_scale)[after.s_at(b, pos, h)];
            EXPECT_NEAR(s, amax / top, 1e-6 * amax + 1e-12) << name;
          }
          // Mark the row as expected-changed.
          const int64_t at = which == 0 ? after.k_at(b, pos, h) : after.v_at(b, pos, h);
          auto& exp = which == 0 ? kexp : vexp;
          const auto& got = which == 0 ? after.k_cache : after.v_cache;
          std::memcpy(exp.data() + at * es, got.data() + at * es, width * es);
        }
      }
    }
  EXPECT_TRUE(kexp == after.k_cache) << name << ": bytes outside the appended key rows changed";
  EXPECT_TRUE(vexp == after.v_cache) << name << ": bytes outside the appended value rows changed";
}

// Sequence b's logical values (the cache after the call, dequantized): [lk, Hkv, dv].
std::vector<float> logical_values(const KvCase& kc, int b) {
  const KvConfig& c = kc.c;
  const int lk = c.cached[b] + c.Lnew;
  std::vector<float> v(size_t(std::max(lk, 1)) * c.Hkv * c.dv);
  for (int t = 0; t < lk; ++t)
    for (int h = 0; h < c.Hkv; ++h)
      for (int e = 0; e < c.dv; ++e) v[(size_t(t) * c.Hkv + h) * c.dv + e] = kc.v_value(b, t, h, e);
  return v;
}

// The float64 reference for sequence b on its logical keys (the cache after the call,
// dequantized) and the values v ([lk, Hkv, dv]), the queries rotated in double (bf16
// ones then rounded to bf16, as the call rounds them): out [Lq, Hq, dv], lse [Hq, Lq].
void reference_of_sequence(const KvCase& kc, int b, const std::vector<float>& v, int dv, std::vector<float>& out,
                           std::vector<float>& lse) {
  const KvConfig& c = kc.c;
  const int lk = c.cached[b] + c.Lnew;
  std::vector<float> q(size_t(c.Lq) * c.Hq * c.d), k(size_t(std::max(lk, 1)) * c.Hkv * c.d);
  out.assign(size_t(c.Lq) * c.Hq * dv, 0.0f);
  lse.assign(size_t(c.Hq) * c.Lq, 0.0f);
  for (int i = 0; i < c.Lq; ++i)
    for (int h = 0; h < c.Hq; ++h) {
      std::vector<double> x(c.d);
      for (int e = 0; e < c.d; ++e) x[e] = read_elem(c.q_dtype, kc.q.data(), ((int64_t(b) * c.Lq + i) * c.Hq + h) * c.d + e);
      kc.rotate(x, lk - c.Lq + i);
      const bool rounded = c.rope != Rope::none && c.q_dtype == DType::bf16;
      for (int e = 0; e < c.d; ++e)
        q[(size_t(i) * c.Hq + h) * c.d + e] = rounded ? detail::bf16_to_f32(detail::f32_to_bf16(float(x[e]))) : float(x[e]);
    }
  for (int t = 0; t < lk; ++t)
    for (int h = 0; h < c.Hkv; ++h)
      for (int e = 0; e < c.d; ++e) k[(size_t(t) * c.Hkv + h) * c.d + e] = kc.k_value(b, t, h, e);
  AttentionOptions o = kc.options();
  o.precision = Precision::f32;
  if (c.alibi) o.alibi_slopes = TensorView(kc.slopes.data() + size_t(b) * c.Hq, DType::f32, {c.Hq});
  std::vector<uint8_t> mask_bytes;
  std::vector<float> mask_floats;
  if (c.mask != Mask::none) o.mask = kc.mask_of_sequence(b, lk, mask_bytes, mask_floats);
  attention_reference(TensorView(q.data(), DType::f32, {1, c.Lq, c.Hq, c.d}),
                      TensorView(k.data(), DType::f32, {1, lk, c.Hkv, c.d}),
                      TensorView(v.data(), DType::f32, {1, lk, c.Hkv, dv}),
                      TensorView(out.data(), DType::f32, {1, c.Lq, c.Hq, dv}), o,
                      TensorView(lse.data(), DType::f32, {1, c.Hq, c.Lq}));
}

// A bf16 cache read by bf16 queries, or under Precision::bf16, may take P·V on
// vdpbf16ps with each p rounded to bf16 (relative error ≤ 2⁻⁸): an output element
// then errs by up to 2⁻⁸·Σ_j p_j·|v_j| more, which the reference computes on |v|.
bool may_round_p_to_bf16(const KvConfig& c) {
  return c.cache_dtype == DType::bf16 && (c.q_dtype == DType::bf16 || c.precision == Precision::bf16);
}

// The float64 reference on the logical keys and values (the cache after the call,
// dequantized), sequence by sequence, with the queries rotated in double.
// lse_tolerance: 0 = `tolerance`; attention()'s bf16/f16 tile kernels take 1e-4 (set when
// their exponential erred by up to 8.6e-5; 3.4e-6 since, bf16 queries' scores aside).
void check_against_reference(const KvCase& kc, const Result& r, const std::string& name, double tolerance = 2e-5,
                             double* worst_seen = nullptr, double lse_tolerance = 0) {
  const KvConfig& c = kc.c;
  double worst = 0, scale = 1e-30, worst_lse = 0;
  const double p_round = may_round_p_to_bf16(c) ? 1.0 / 256 : 0.0;
  for (int b = 0; b < c.B; ++b) {
    std::vector<float> out, lse, out_abs;
    std::vector<float> v = logical_values(kc, b);
    reference_of_sequence(kc, b, v, c.dv, out, lse);
    if (p_round > 0) {
      for (float& x : v) x = std::fabs(x);
      std::vector<float> lse_abs;
      reference_of_sequence(kc, b, v, c.dv, out_abs, lse_abs);
    }
    for (size_t n = 0; n < out.size(); ++n) {
      const float got = read_elem(c.q_dtype, r.out.data(), int64_t(b) * c.Lq * c.Hq * c.dv + int64_t(n));
      ASSERT_FALSE(std::isnan(got)) << name << ": NaN at b" << b << " element " << n << " (" << seed_note() << ")";
      const double p_err = p_round > 0 && std::isfinite(out_abs[n]) ? p_round * out_abs[n] : 0.0;
      worst = std::max(worst, std::fabs(double(got) - out[n]) - p_err);
      scale = std::max(scale, std::fabs(double(out[n])));
    }
    for (int h = 0; h < c.Hq; ++h)
      for (int i = 0; i < c.Lq; ++i) {
        const float ref = lse[size_t(h) * c.Lq + i], got = r.lse[(size_t(b) * c.Hq + h) * c.Lq + i];
        if (std::isinf(ref)) {
          EXPECT_EQ(got, ref) << name << " lse b" << b << " h" << h << " i" << i;
        } else {
          worst_lse = std::max(worst_lse, std::fabs(double(got) - ref) / std::max(1.0, std::fabs(double(ref))));
        }
      }
  }
  // f32 arithmetic on exactly the reference's inputs (dequantization and rotation
  // rounded the same way), then one rounding to the output dtype.
  const double out_round = c.q_dtype == DType::bf16 ? 1.0 / 256 : c.q_dtype == DType::f16 ? 1.0 / 2048 : 0.0;
  // An i8 cache read by bf16 queries (or under Precision::bf16) may take the integer
  // passes: their fixed point errs by up to 3e-4 (I8OnIntegerProductsUnderPrecisionBf16).
  const double integer = c.cache_dtype == DType::i8 && (c.q_dtype == DType::bf16 || c.precision == Precision::bf16)
                             ? 3e-4 : 0.0;
  EXPECT_LE(worst, std::max(tolerance, integer) * scale + out_round * scale) << name << " (" << seed_note() << ")";
  EXPECT_LE(worst_lse, std::max(lse_tolerance > 0 ? lse_tolerance : tolerance, integer))
      << name << " (" << seed_note() << ")";
  if (worst_seen != nullptr) *worst_seen = std::max(*worst_seen, worst / scale);
}

// FlashAttention's rule for results computed with bf16 products: squared errors
// against the float64 reference, the kernel's (r) and a plain bf16 pipeline's on the
// same inputs (out = Σ_j bf16(P_ij)·v_j summed in f32, P the reference's own
// probabilities, got as the reference's output on one-hot values), added to `pooled`.
struct PooledErrors {
  double fused = 0, plain = 0;
};
void add_plain_bf16_errors(const KvCase& kc, const Result& r, PooledErrors& pooled) {
  const KvConfig& c = kc.c;
  ASSERT_EQ(c.q_dtype, DType::f32) << "the yardstick compares f32 outputs";
  const int group = c.Hq / c.Hkv;
  for (int b = 0; b < c.B; ++b) {
    const int lk = c.cached[b] + c.Lnew;
    const std::vector<float> v = logical_values(kc, b);
    std::vector<float> one_hot(size_t(lk) * c.Hkv * lk, 0.0f), probs, ref, lse;
    for (int t = 0; t < lk; ++t)
      for (int h = 0; h < c.Hkv; ++h) one_hot[(size_t(t) * c.Hkv + h) * lk + t] = 1.0f;
    reference_of_sequence(kc, b, one_hot, lk, probs, lse);
    reference_of_sequence(kc, b, v, c.dv, ref, lse);
    for (int i = 0; i < c.Lq; ++i)
      for (int h = 0; h < c.Hq; ++h) {
        const float* p = &probs[(size_t(i) * c.Hq + h) * lk];
        for (int x = 0; x < c.dv; ++x) {
          float acc = 0;
          for (int t = 0; t < lk; ++t)
            acc += detail::bf16_to_f32(detail::f32_to_bf16(p[t])) * v[(size_t(t) * c.Hkv + h / group) * c.dv + x];
          const size_t at = (size_t(i) * c.Hq + h) * c.dv + x;
          const double want = ref[at];
          const double got = reinterpret_cast<const float*>(r.out.data())[int64_t(b) * c.Lq * c.Hq * c.dv + int64_t(at)];
          pooled.fused += (got - want) * (got - want);
          pooled.plain += (acc - want) * (acc - want);
        }
      }
  }
}

void run_and_check(const KvConfig& cfg, std::mt19937_64& rng) {
  KvCase kc(cfg, rng);
  const KvCase before = kc;
  const Result r = run(kc);
  check_append(before, kc, cfg.name());
  check_against_reference(kc, r, cfg.name());
}

TEST(KVCache, DecodingMatchesFloat64OnEveryCacheDtypeAndLayout) {
  auto rng = make_rng(1201);
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::i8, DType::f8e4m3}) {
    for (int page : {0, 1, 16, 64, 256, 7}) {
      KvConfig c;
      c.B = 3, c.Hq = 8, c.Hkv = 2, c.d = 64, c.dv = 64;
      c.cached = {0, 17, 1000};
      c.page = page;
      c.cache_dtype = dt;
      run_and_check(c, rng);
    }
  }
}

// f32 caches take score passes of 3 keys (AVX2) with a pass of 2 and single keys at a
// block's end, over groups of 4 query rows and a remainder of 1–3: every such count,
// with and without a partial last vector of d, against the float64 reference.
TEST(KVCache, F32ScorePassesOfEveryKeyAndRowCount) {
  auto rng = make_rng(1207);
  for (int group : {4, 5, 7}) {
    for (int d : {3, 17, 64}) {
      for (int lq : {1, 2}) {
        KvConfig c;
        c.B = 6, c.Hkv = 1, c.Hq = group, c.d = d, c.dv = d;
        c.Lq = c.Lnew = lq;
        c.cached = {0, 1, 2, 30, 34, 68};
        c.cache_dtype = DType::f32;
        run_and_check(c, rng);
      }
    }
  }
}

TEST(KVCache, OddShapesOptionsAndQueryDtypes) {
  auto rng = make_rng(1202);
  std::uniform_int_distribution<int> pick(0, 1 << 30);
  const int ds[] = {1, 3, 8, 17, 64, 80, 128};
  const DType dts[] = {DType::f32, DType::bf16, DType::f16, DType::i8, DType::f8e4m3};
  const DType qdts[] = {DType::f32, DType::bf16, DType::f16};
  const int pages[] = {0, 1, 3, 16, 64};
  for (int n = 0; n < 40; ++n) {
    KvConfig c;
    c.B = 1 + pick(rng) % 3;
    c.Hkv = 1 + pick(rng) % 3;
    c.Hq = c.Hkv * (1 + pick(rng) % 4);
    c.d = ds[pick(rng) % 7];
    c.dv = pick(rng) % 3 == 0 ? ds[pick(rng) % 7] : c.d;
    c.Lq = pick(rng) % 3 == 0 ? 1 + pick(rng) % 9 : 1;
    c.Lnew = pick(rng) % 4 == 0 ? 0 : c.Lq;
    c.cached.clear();
    for (int b = 0; b < c.B; ++b) c.cached.push_back(pick(rng) % 4 == 0 ? pick(rng) % 5 : pick(rng) % 300);
    if (c.Lnew == 0)
      for (int& x : c.cached) x = std::max(x, 1);
    c.page = pages[pick(rng) % 5];
    c.cache_dtype = dts[pick(rng) % 5];
    c.q_dtype = qdts[pick(rng) % 3];
    c.causal = pick(rng) % 3 == 0 ? Causal::None : pick(rng) % 5 == 0 ? Causal::TopLeft : Causal::BottomRight;
    if (pick(rng) % 3 == 0) c.window = {int(pick(rng) % 40), pick(rng) % 2 ? -1 : int(pick(rng) % 3)};
    if (pick(rng) % 4 == 0) c.softcap = 2.0f + float(pick(rng) % 20);
    c.alibi = pick(rng) % 4 == 0;
    if (c.Lnew > 0 && c.d >= 2 && pick(rng) % 2 == 0) {
      c.rope = pick(rng) % 2 ? Rope::interleaved : Rope::half;
      c.rotary_dim = pick(rng) % 2 ? c.d / 2 * 2 : std::max(2, c.d / 4 * 2);
      for (int& x : c.cached) x = std::max(x, c.Lq);  // queries' positions are >= 0
    }
    c.num_splits = pick(rng) % 3 == 0 ? 1 + pick(rng) % 9 : 0;
    run_and_check(c, rng);
  }
}

// The shapes and options the decode kernel's alternative passes are tested on (the bf16
// score pass, the i8 integer passes): 1 to 9 rows per kv head, d and dv multiples of 32
// and not, contiguous and paged; variant 1: softcap, ALiBi, a window, 3 splits; 2: an f32
// mask without causality; 3: rotary embedding on the appended keys and the queries.
struct PassShape {
  int Hq, Hkv, Lq, d, dv, page;
};
KvConfig pass_case(const PassShape& sh, DType cache, int variant) {
  KvConfig c;
  c.B = 2, c.Hq = sh.Hq, c.Hkv = sh.Hkv, c.Lq = c.Lnew = sh.Lq, c.d = sh.d, c.dv = sh.dv, c.page = sh.page;
  c.cached = {700, 93};
  c.cache_dtype = cache;
  if (variant == 1) c.softcap = 5.0f, c.alibi = true, c.window = {200, -1}, c.num_splits = 3;
  if (variant == 2) c.mask = Mask::f32, c.causal = Causal::None;
  if (variant == 3) c.rope = Rope::half, c.rotary_dim = sh.d;
  return c;
}

// bf16 caches read by queries whose values are all bf16 take the bf16 score pass where
// vdpbf16ps has the FMA's rate (AMD Zen 4/5: Q·Kᵀ on vdpbf16ps, S scaled afterwards);
// ATTN_ISA=f32 forces the f32 pass. Both against float64 at f32's tolerance: f32
// queries rounded to bf16 values (so the output is f32, not rounded to bf16), d a
// multiple of 32 (the pass's unit) and not, 1 to 9 rows per kv head, every score
// option, masks, splits; rotated f32 queries are not bf16 and take the f32 pass.
TEST(KVCache, Bf16ScorePassOnBf16ValuedQueries) {
  auto rng = make_rng(1211);
  const PassShape shapes[] = {{32, 8, 1, 128, 128, 0}, {8, 2, 1, 64, 64, 16}, {4, 4, 1, 32, 96, 256},
                              {18, 2, 1, 96, 64, 7},   {2, 1, 3, 256, 32, 1}, {4, 2, 2, 48, 48, 0}};
  for (const char* isa : {"", "f32"}) {
    const ScopedEnv forced("ATTN_ISA", *isa != '\0' ? isa : nullptr);
    for (const PassShape& sh : shapes) {
      for (int variant = 0; variant < 4; ++variant) {
        const KvConfig c = pass_case(sh, DType::bf16, variant);
        KvCase kc(c, rng);
        float* q = reinterpret_cast<float*>(kc.q.data());
        for (size_t n = 0; n < kc.q.size() / sizeof(float); ++n) q[n] = detail::bf16_to_f32(detail::f32_to_bf16(q[n]));
        const Result r = run(kc);
        check_against_reference(kc, r, c.name() + " bf16-valued q, ATTN_ISA=" + isa);
      }
    }
  }
}

// The decode kernel on every Highway target this CPU supports (an AVX-512 machine runs
// AVX2's 8-lane passes only here): each cache dtype at f32's tolerance, and i8 on the
// integer passes (Precision::bf16; ATTN_ISA=f32 keeps AMX machines off their tiles).
TEST(KVCache, EverySimdTargetMatchesTheReference) {
  const ScopedEnv forced("ATTN_ISA", "f32");
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    auto rng = make_rng(1214 + target % 1000);
    const PassShape shapes[] = {{8, 2, 1, 128, 128, 16}, {6, 2, 2, 64, 96, 7}, {4, 4, 1, 40, 40, 0}};
    for (const PassShape& sh : shapes) {
      for (DType dt : {DType::f32, DType::bf16, DType::i8, DType::f8e4m3}) {
        for (int variant = 0; variant < 3; ++variant) {
          KvConfig c = pass_case(sh, dt, variant);
          KvCase kc(c, rng);
          const Result r = run(kc);
          check_against_reference(kc, r, c.name() + " target " + detail::attention_forward_target());
          if (dt != DType::i8) continue;
          KvCase fast = kc;
          fast.c.precision = Precision::bf16;
          const Result rf = run(fast);
          check_against_reference(fast, rf, fast.c.name() + " target " + detail::attention_forward_target(), 3e-4);
        }
      }
    }
  }
  detail::force_simd_target(0);
}

// Precision::bf16 on bf16 caches, where vdpbf16ps has the FMA's rate: f32 queries are
// rounded to bf16 for the score pass, and P·V runs on vdpbf16ps with P rounded to
// bf16. Against the float64 reference on the rounded queries: FlashAttention's rule,
// pooled over the test (the kernel's error at most twice a plain bf16 pipeline's,
// add_plain_bf16_errors), and a per-case screen at 2⁻⁸ of the output's largest. Where
// the passes do not run (ATTN_ISA=f32, a CPU without full-rate vdpbf16ps, d or dv not
// a multiple of 32) precision changes nothing: bitwise the Precision::f32 result.
TEST(KVCache, Bf16CachesOnBf16ProductsUnderPrecisionBf16) {
  auto rng = make_rng(1213);
  const PassShape shapes[] = {{32, 8, 1, 128, 128, 0}, {8, 2, 1, 64, 64, 16}, {18, 2, 1, 96, 64, 7},
                              {2, 1, 3, 256, 32, 1},   {4, 2, 2, 48, 48, 0},  {5, 1, 9, 64, 160, 3}};
  PooledErrors pooled;
  for (const char* isa : {"", "f32"}) {
    const ScopedEnv forced("ATTN_ISA", *isa != '\0' ? isa : nullptr);
    const bool pass = detail::lowp_path() == detail::LowpPath::avx512bf16;
    for (const PassShape& sh : shapes) {
      for (int variant = 0; variant < 3; ++variant) {
        KvConfig c = pass_case(sh, DType::bf16, variant);
        c.precision = Precision::bf16;
        KvCase kc(c, rng);
        KvCase exact_case = kc;
        exact_case.c.precision = Precision::f32;
        const Result r = run(kc), exact = run(exact_case);
        const std::string name = c.name() + " f32 q, ATTN_ISA=" + isa;
        if (pass && sh.d % 32 == 0 && sh.dv % 32 == 0) {
          KvCase rounded = kc;
          float* q = reinterpret_cast<float*>(rounded.q.data());
          for (size_t n = 0; n < rounded.q.size() / sizeof(float); ++n) q[n] = detail::bf16_to_f32(detail::f32_to_bf16(q[n]));
          check_against_reference(rounded, r, name + " against bf16-rounded q", 1.0 / 256);
          add_plain_bf16_errors(rounded, r, pooled);
          EXPECT_NE(r.out, exact.out) << name << ": the bf16 passes did not run";
          // bf16-valued queries take the same score pass under Precision::f32, with
          // P·V in f32: the two differ only by the bf16 P·V pass. Variant 2's random
          // mask removes a key from nearly every pass, and those passes keep f32 P·V.
          KvCase rounded_f32 = rounded;
          rounded_f32.c.precision = Precision::f32;
          if (variant != 2) EXPECT_NE(r.out, run(rounded_f32).out) << name << ": P·V did not run on bf16 products";
        } else {
          EXPECT_EQ(r.out, exact.out) << name << ": must be the Precision::f32 result";
        }
      }
    }
  }
  if (pooled.plain > 0) {
    std::printf("bf16 caches on bf16 products: RMS error %.3g of the plain bf16 pipeline's\n",
                std::sqrt(pooled.fused / pooled.plain));
    EXPECT_LE(pooled.fused, 4.0 * pooled.plain) << "FlashAttention's rule: at most twice the plain error";
  }
}

// bf16 queries are bf16 inputs: on a bf16 cache they take both bf16 products by
// default, P rounded to bf16 as attention()'s bf16 kernels round it, rotated ones
// too (rounded back to bf16 after the rotation), so the result is bitwise the
// Precision::bf16 one (that test holds it to FlashAttention's rule), and it is within
// the P rounding's bound of float64 (check_against_reference). f16 queries keep the
// f32 passes: bitwise the ATTN_ISA=f32 result.
TEST(KVCache, Bf16QueriesOnBf16CachesTakeBf16ProductsByDefault) {
  auto rng = make_rng(1215);
  const PassShape shapes[] = {{32, 8, 1, 128, 128, 0}, {8, 2, 1, 64, 64, 16}, {18, 2, 1, 96, 64, 7},
                              {5, 1, 9, 64, 160, 3},   {4, 2, 2, 48, 48, 0}};
  const bool pass = detail::lowp_path() == detail::LowpPath::avx512bf16;
  for (const PassShape& sh : shapes) {
    for (int variant = 0; variant < 4; ++variant) {
      for (DType qt : {DType::bf16, DType::f16}) {
        KvConfig c = pass_case(sh, DType::bf16, variant);
        c.q_dtype = qt;
        KvCase kc(c, rng);
        KvCase as_bf16 = kc;
        as_bf16.c.precision = Precision::bf16;
        const Result r = run(kc);
        check_against_reference(kc, r, c.name());
        Result exact;
        {
          const ScopedEnv forced("ATTN_ISA", "f32");
          KvCase again = kc;
          exact = run(again);
        }
        const bool whole_units = sh.d % 32 == 0 && sh.dv % 32 == 0;
        if (qt == DType::f16 || !pass || !whole_units) {
          EXPECT_EQ(r.out, exact.out) << c.name() << ": must be the f32 passes' result";
          continue;
        }
        EXPECT_EQ(r.out, run(as_bf16).out) << c.name() << ": not the Precision::bf16 result";
        // Variant 2's random mask removes a key from nearly every pass (f32 P·V there).
        if (variant != 2) EXPECT_NE(r.out, exact.out) << c.name() << ": the bf16 passes did not run";
      }
    }
  }
}

// options.mask over the cache's keys: boolean and additive (f32 and q's dtype), a full
// [B, Hq, Lq, K] mask with a query that sees no key, a padding mask [B, 1, 1, K] and one
// tree mask [Lq, K] shared by the batch (speculative decoding), on sequences of
// different lengths, every cache dtype, contiguous and paged (odd page sizes), split
// and unsplit, with and without appends; the mask's columns past the longest
// sequence hold NaN, which no output may read.
TEST(KVCache, MasksOverTheCacheKeys) {
  auto rng = make_rng(1301);
  struct Case {
    DType cache, q;
    Mask mask;
    MaskLayout layout;
    int page, Lq, Lnew, splits, Hq, Hkv, d;
    Causal causal;
  };
  const Case cases[] = {
      {DType::f32, DType::f32, Mask::boolean, MaskLayout::full, 0, 1, 1, 0, 8, 2, 64, Causal::BottomRight},
      {DType::f32, DType::f32, Mask::f32, MaskLayout::full, 16, 4, 4, 3, 8, 2, 17, Causal::BottomRight},
      {DType::f32, DType::f32, Mask::f32, MaskLayout::full, 0, 1, 1, 2, 4, 4, 32, Causal::None},  // one row per kv head
      {DType::bf16, DType::bf16, Mask::q_dtype, MaskLayout::shared_tree, 3, 4, 4, 1, 8, 2, 64, Causal::None},
      {DType::bf16, DType::f32, Mask::boolean, MaskLayout::per_sequence_keys, 0, 1, 0, 2, 8, 2, 128, Causal::None},
      {DType::i8, DType::f32, Mask::f32, MaskLayout::full, 16, 2, 1, 0, 8, 2, 64, Causal::BottomRight},
      {DType::f16, DType::f16, Mask::q_dtype, MaskLayout::full, 1, 3, 3, 5, 6, 3, 24, Causal::BottomRight},
      {DType::f8e4m3, DType::f32, Mask::boolean, MaskLayout::shared_tree, 0, 5, 5, 0, 8, 2, 64, Causal::None},
      {DType::i8, DType::bf16, Mask::boolean, MaskLayout::per_sequence_keys, 7, 1, 1, 4, 8, 1, 64, Causal::None},
  };
  for (const Case& k : cases) {
    KvConfig c;
    c.B = 3, c.Hq = k.Hq, c.Hkv = k.Hkv, c.d = k.d, c.dv = k.d;
    c.cached = {37, 5, 100};
    c.page = k.page, c.Lq = k.Lq, c.Lnew = k.Lnew, c.num_splits = k.splits;
    c.cache_dtype = k.cache, c.q_dtype = k.q;
    c.mask = k.mask, c.mask_layout = k.layout;
    c.causal = k.causal;
    run_and_check(c, rng);
  }
}

TEST(KVCache, LongCachesAcrossSplitCounts) {
  auto rng = make_rng(1203);
  for (int splits : {0, 1, 2, 5, 64}) {
    KvConfig c;
    c.B = 2, c.Hq = 8, c.Hkv = 1, c.d = 32, c.dv = 48;
    c.cached = {4000, 2345};
    c.page = 16;
    c.cache_dtype = DType::bf16;
    c.num_splits = splits;
    c.window = {1500, -1};
    run_and_check(c, rng);
  }
}

TEST(KVCache, ChunkedPrefillAndSpeculativeDecoding) {
  auto rng = make_rng(1204);
  for (int lq : {3, 70, 200}) {
    KvConfig c;
    c.B = 2, c.Hq = 4, c.Hkv = 2, c.d = 24, c.dv = 24;
    c.Lq = c.Lnew = lq;
    c.page = 16;
    c.rope = Rope::half;
    c.cached = {100, lq};
    run_and_check(c, rng);
  }
}

// attention() on the same logical keys and values: a contiguous [B, longest, Hkv, d]
// copy of the cache after the call, key_lengths = cache_seqlens + Lnew, the mask's
// columns cut to the longest sequence. Queries unrotated (call it without rotary).
Result attention_on_logical_cache(const KvCase& kc) {
  const KvConfig& c = kc.c;
  int longest = 0;
  std::vector<int32_t> lengths;
  for (int b = 0; b < c.B; ++b) lengths.push_back(c.cached[b] + c.Lnew), longest = std::max(longest, lengths.back());
  // A quantized cache's rows dequantized (f32), a float cache read by queries of
  // another dtype widened to f32, others copied in their dtype.
  const bool widened = kc.quantized() || c.cache_dtype != c.q_dtype;
  const DType kv_dtype = widened ? DType::f32 : c.cache_dtype;
  const size_t es = dtype_size(kv_dtype);
  std::vector<uint8_t> k(size_t(c.B) * longest * c.Hkv * c.d * es, 0), v(size_t(c.B) * longest * c.Hkv * c.dv * es, 0);
  for (int b = 0; b < c.B; ++b)
    for (int t = 0; t < lengths[b]; ++t)
      for (int h = 0; h < c.Hkv; ++h) {
        const size_t kt = ((size_t(b) * longest + t) * c.Hkv + h) * c.d, vt = ((size_t(b) * longest + t) * c.Hkv + h) * c.dv;
        if (widened) {
          for (int x = 0; x < c.d; ++x) reinterpret_cast<float*>(k.data())[kt + x] = kc.k_value(b, t, h, x);
          for (int x = 0; x < c.dv; ++x) reinterpret_cast<float*>(v.data())[vt + x] = kc.v_value(b, t, h, x);
          continue;
        }
        std::memcpy(&k[kt * es], &kc.k_cache[kc.k_at(b, t, h) * es], c.d * es);
        std::memcpy(&v[vt * es], &kc.v_cache[kc.v_at(b, t, h) * es], c.dv * es);
      }
  AttentionOptions o = kc.options();
  o.precision = Precision::f32;
  o.key_lengths = TensorView(lengths.data(), DType::i32, {c.B});
  if (c.mask != Mask::none) {
    std::vector<int64_t> shape = o.mask.shape(), strides;
    for (int i = 0; i < o.mask.rank(); ++i) strides.push_back(o.mask.stride(i));
    shape.back() = longest;
    o.mask = TensorView(o.mask.data(), o.mask.dtype(), shape, strides);
  }
  Result r;
  r.out.assign(size_t(c.B) * c.Lq * c.Hq * c.dv * dtype_size(c.q_dtype), 0xAB);
  r.lse.assign(size_t(c.B) * c.Hq * c.Lq, 123.0f);
  attention(kc.q_view(), TensorView(k.data(), kv_dtype, {c.B, longest, c.Hkv, c.d}),
            TensorView(v.data(), kv_dtype, {c.B, longest, c.Hkv, c.dv}),
            TensorView(r.out.data(), c.q_dtype, {c.B, c.Lq, c.Hq, c.dv}), o,
            TensorView(r.lse.data(), DType::f32, {c.B, c.Hq, c.Lq}));
  return r;
}

bool same_result(const Result& a, const Result& b) {
  return a.out == b.out && std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * sizeof(float)) == 0;
}

// Rotated bf16 queries are rounded back to bf16 after the rotation (as FlashAttention's
// kernel stores them): a call with rotary embedding gives bitwise the result of the
// same call on the cache it leaves, with the queries rotated and rounded beforehand
// and no rotary. The tables and queries are chosen so that the rotation is exact in
// f32 (multiples of 1/8 times multiples of 1/64), and the rotated values have up to
// 11 significant bits, so rounding them to bf16 changes many. On the decode kernel
// (3 queries; bf16 and f32 passes) and the tiled kernels (chunked prefill), pairs and
// halves, contiguous and paged.
TEST(KVCache, RotatedBf16QueriesAreRoundedBackToBf16) {
  auto rng = make_rng(1217);
  std::uniform_int_distribution<int> q_steps(-96, 96), angle_steps(-8, 8);
  for (const char* isa : {"", "f32"}) {
    const ScopedEnv forced("ATTN_ISA", *isa != '\0' ? isa : nullptr);
    for (int lq : {3, detail::kvcache_tiles_from(4) + 5}) {
      for (Rope rope : {Rope::half, Rope::interleaved}) {
        KvConfig c;
        c.B = 2, c.Hq = 8, c.Hkv = 2, c.d = c.dv = 64, c.Lq = c.Lnew = lq;
        c.cached = {150, 37};
        c.page = rope == Rope::half ? 0 : 16;
        c.cache_dtype = c.q_dtype = DType::bf16;
        c.rope = rope;
        KvCase a(c, rng);
        for (float& x : a.cos_t) x = angle_steps(rng) / 8.0f;
        for (float& x : a.sin_t) x = angle_steps(rng) / 8.0f;
        for (size_t n = 0; n < a.q.size() / 2; ++n) write_elem(DType::bf16, a.q.data(), int64_t(n), q_steps(rng) / 64.0f);
        const KvCase before = a;
        const Result got = run(a);
        // The same keys, already in the cache; the queries rotated here (exactly) and rounded.
        KvCase b = a;
        b.c.Lnew = 0, b.c.rope = Rope::none;
        int changed = 0;
        for (int s = 0; s < c.B; ++s) {
          b.c.cached[s] += lq, b.seqlens[s] += lq;
          for (int i = 0; i < lq; ++i)
            for (int h = 0; h < c.Hq; ++h) {
              const int64_t at = ((int64_t(s) * lq + i) * c.Hq + h) * c.d;
              std::vector<double> x(c.d);
              for (int e = 0; e < c.d; ++e) x[e] = read_elem(DType::bf16, before.q.data(), at + e);
              a.rotate(x, c.cached[s] + i);
              for (int e = 0; e < c.d; ++e) {
                write_elem(DType::bf16, b.q.data(), at + e, float(x[e]));
                changed += read_elem(DType::bf16, b.q.data(), at + e) != float(x[e]);
              }
            }
        }
        const std::string name = c.name() + " ATTN_ISA=" + isa;
        EXPECT_GT(changed, 100) << name << ": the rounding changes few queries; the test would not see it";
        EXPECT_TRUE(same_result(got, run(b))) << name << ": not the result of the rounded rotated queries";
        check_against_reference(a, got, name, 2e-5, nullptr, 1e-4);
      }
    }
  }
}

// cache.batch_idx (FlashAttention's cache_batch_idx): each sequence of a contiguous
// cache reads and appends to the row it names in a pool of rows, in any order; rows
// nobody names hold NaN and stay untouched (check_append compares every byte). Every
// cache dtype, decoding and chunked prefill (the tiled route), with and without an
// append and rotary embedding, forced splits, 2 threads bitwise; rows shared by
// sequences that only read them; and the errors: a row out of range, a row two
// sequences append to, batch_idx with a block_table, a wrong shape or dtype.
TEST(KVCache, BatchIdxPicksEachSequencesCacheRow) {
  auto rng = make_rng(1218);
  std::uniform_int_distribution<int> pick(0, 1 << 30);
  int n = 0;
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::i8, DType::f8e4m3}) {
    for (int lq : {1, 4, detail::kvcache_tiles_from(4) + 3}) {
      for (bool shared : {false, true}) {
        KvConfig c;
        c.B = 3, c.Hq = 8, c.Hkv = 2, c.d = c.dv = 32;
        c.Lq = lq;
        c.Lnew = shared ? 0 : lq;
        c.cached = {40 + pick(rng) % 60, 7, 90};
        if (c.Lnew == 0)
          for (int& x : c.cached) x = std::max(x, lq);
        c.pool = 5, c.shared_rows = shared;
        c.cache_dtype = dt;
        c.q_dtype = dt == DType::bf16 || dt == DType::f16 ? dt : DType::f32;
        if (c.Lnew > 0 && n % 2 == 0) c.rope = Rope::half;
        if (n % 3 == 1) c.num_splits = 3;
        ++n;
        KvCase kc(c, rng);
        const KvCase before = kc;
        KvCase two = kc;
        const Result r = run(kc);
        check_append(before, kc, "batch_idx " + c.name());
        const bool tiles16 = lq > 16 && (dt == DType::bf16 || dt == DType::f16);
        check_against_reference(kc, r, "batch_idx " + c.name(), 2e-5, nullptr, tiles16 ? 1e-4 : 0);
        Result r2;
        with_threads(2, [&] { r2 = run(two); });
        EXPECT_TRUE(same_result(r, r2)) << "batch_idx " << c.name() << ": 2 threads differ";
      }
    }
  }
  // Errors, before anything is written.
  KvConfig c;
  c.B = 3, c.cached = {4, 5, 6};
  c.pool = 4;
  KvCase kc(c, rng);
  const KvCase untouched = kc;
  Result r;
  r.out.assign(size_t(c.B) * c.Lq * c.Hq * c.dv * 4, 0);
  auto call = [&](const KVCache& cache) {
    attention_with_kvcache(kc.q_view(), cache, kc.seqlen_view(), TensorView(r.out.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv}),
                           kc.options(), kc.kv());
  };
  std::vector<int32_t> rows = {0, 4, 1};
  KVCache bad = kc.cache();
  bad.batch_idx = TensorView(rows.data(), DType::i32, {3});
  expect_attn_error([&] { call(bad); }, "cache.batch_idx[1] = 4 is out of range");
  rows = {2, 1, 2};
  expect_attn_error([&] { call(bad); }, "sequences 0 and 2 both use cache row 2");
  rows = {-1, 0, 1};
  expect_attn_error([&] { call(bad); }, "cache.batch_idx[0] = -1");
  std::vector<float> rows_f = {0, 1, 2};
  bad.batch_idx = TensorView(rows_f.data(), DType::f32, {3});
  expect_attn_error([&] { call(bad); }, "cache.batch_idx");
  bad.batch_idx = TensorView(rows.data(), DType::i32, {2});
  expect_attn_error([&] { call(bad); }, "cache.batch_idx");
  KVCache no_idx = kc.cache();
  no_idx.batch_idx = {};
  expect_attn_error([&] { call(no_idx); }, "or give cache.batch_idx");
  std::vector<int32_t> table = {0, 1, 2};
  KVCache paged = kc.cache();
  paged.block_table = TensorView(table.data(), DType::i32, {3, 1});
  expect_attn_error([&] { call(paged); }, "cache.batch_idx is for contiguous caches");
  EXPECT_TRUE(kc.k_cache == untouched.k_cache && kc.v_cache == untouched.v_cache) << "a rejected call wrote the cache";
}

// Chunked prefill (Lq ≥ max(24, 128 / group) queries) on an f32, bf16 or f16 cache
// read by queries of its dtype, or on a quantized cache (dequantized to f32 as it is
// gathered), runs on attention()'s tiled kernels: against float64, bitwise attention()'s
// result on the same logical cache (so it is that kernel, with its semantics; not for
// bf16 queries on a quantized cache, which attention() cannot mix), and bitwise the same
// on 1 and 2 threads. Contiguous caches, pages that follow one another (read in place)
// and shuffled pages of 16 and 5 (gathered), every score option and mask, an empty
// sequence. Mixed float dtypes (the cache widened to f32) and rotated f16 queries take
// the route from twice the threshold, f32 queries on a bf16 cache under
// Precision::bf16 from the threshold (on the bf16 kernel). Below the thresholds,
// forced splits and calls past the size bound stay on the decode kernel.
TEST(KVCache, ChunkedPrefillRunsOnTheTiledKernels) {
  auto rng = make_rng(1216);
  std::uniform_int_distribution<int> pick(0, 1 << 30);
  // (cache, queries): a bf16/f16 cache read by queries of another dtype is widened
  // to f32 per call, and takes the route from twice the threshold.
  const std::pair<DType, DType> dtypes[] = {{DType::f32, DType::f32},    {DType::bf16, DType::bf16},
                                            {DType::f16, DType::f16},    {DType::i8, DType::f32},
                                            {DType::f8e4m3, DType::f32}, {DType::f8e4m3, DType::bf16},
                                            {DType::bf16, DType::f32},   {DType::f16, DType::f32},
                                            {DType::f32, DType::bf16},   {DType::f16, DType::bf16}};
  for (const auto& [dt, qdt] : dtypes) {
    const bool widened = dt != qdt && (dt == DType::bf16 || dt == DType::f16);
    for (int n = 0; n < 8; ++n) {
      KvConfig c;
      c.B = 1 + n % 3;
      c.Hkv = 1 + pick(rng) % 2;
      c.Hq = c.Hkv * (n % 2 == 0 ? 1 : 4);
      c.d = n % 4 == 3 ? 40 : 64, c.dv = n % 4 == 2 ? 48 : c.d;
      c.Lq = detail::kvcache_tiles_from(c.Hq / c.Hkv) * (widened ? 2 : 1) + pick(rng) % 40;
      c.Lnew = n % 4 == 1 ? 0 : c.Lq;
      c.cached.clear();
      // Sequence 1 sees only the new tokens (none without an append), sequence 2 fewer
      // keys than queries without one (bottom-right: its first rows see nothing).
      for (int b = 0; b < c.B; ++b) c.cached.push_back(b == 1 ? 0 : b == 2 ? 5 : 30 + pick(rng) % 400);
      if (c.Lnew == 0) c.cached[0] = std::max(c.cached[0], c.Lq);
      c.page = (int[]){0, 16, 5, 16}[n % 4];
      c.pages_in_order = n % 4 == 3;
      c.cache_dtype = dt, c.q_dtype = qdt;
      c.causal = n % 3 == 0 ? Causal::BottomRight : n % 3 == 1 ? Causal::TopLeft : Causal::None;
      if (n % 4 == 2) c.window = {60, 5};
      if (n % 5 == 1) c.softcap = 8.0f;
      c.alibi = n % 3 == 2;
      c.mask = (Mask[]){Mask::none, Mask::boolean, Mask::f32, Mask::q_dtype}[n % 4];
      c.mask_layout = (MaskLayout[]){MaskLayout::full, MaskLayout::per_sequence_keys, MaskLayout::shared_tree}[n % 3];
      const std::string name = "tiles " + c.name();
      KvCase kc(c, rng);
      const KvCase before = kc;
      const Result r = run(kc);
      check_append(before, kc, name);
      const bool tiles16 = dt == qdt && (dt == DType::bf16 || dt == DType::f16);  // attention()'s 16-bit kernels
      check_against_reference(kc, r, name, 2e-5, nullptr, tiles16 ? 1e-4 : 0);
      if (dt == qdt || qdt == DType::f32) {
        EXPECT_TRUE(same_result(r, attention_on_logical_cache(kc))) << name << ": not attention()'s result";
      } else {
        const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
        KvCase decode = before;
        EXPECT_FALSE(same_result(r, run(decode))) << name << ": the route did not run";
      }
      // The cache as it now is, without the append, on 2 threads.
      KvConfig again = c;
      again.Lnew = 0;
      for (int b = 0; b < c.B; ++b) again.cached[b] += c.Lnew;
      KvCase kc2 = kc;
      kc2.c = again;
      kc2.seqlens.assign(again.cached.begin(), again.cached.end());
      Result two;
      with_threads(2, [&] { two = run(kc2); });
      EXPECT_TRUE(same_result(r, two)) << name << ": 2 threads differ";
    }
  }
  // f32 with rotary embedding and Precision::bf16 (ignored, as for f32 caches).
  KvConfig c;
  c.B = 2, c.Hq = 8, c.Hkv = 2, c.d = c.dv = 64, c.Lq = c.Lnew = 40;
  c.cached = {300, 41};
  c.page = 16;
  c.rope = Rope::interleaved;
  c.precision = Precision::bf16;
  KvCase kc(c, rng);
  const KvCase rope_case = kc;
  const Result r = run(kc);
  check_against_reference(kc, r, "tiles rope " + c.name());
  {
    KvCase f32 = rope_case;
    f32.c.precision = Precision::f32;
    EXPECT_TRUE(same_result(r, run(f32))) << "Precision::bf16 changed an f32 cache's result";
    KvCase decode = rope_case;
    const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
    EXPECT_FALSE(same_result(r, run(decode))) << "the route did not run";
  }
  // Pages laid out [num_blocks, Hkv, page_size, d] (vLLM's order, a permuted view):
  // gathered head by head, bitwise the result of the same values in FlashAttention's order.
  {
    KvConfig h = c;
    h.rope = Rope::none, h.precision = Precision::f32, h.Lnew = 0, h.cache_dtype = h.q_dtype = DType::bf16;
    KvCase a(h, rng);
    const Result want = run(a);
    const int64_t P = a.pages_total, S = a.page_size, H = h.Hkv;
    std::vector<uint16_t> k(a.k_cache.size() / 2), v(a.v_cache.size() / 2);
    const auto* k0 = reinterpret_cast<const uint16_t*>(a.k_cache.data());
    const auto* v0 = reinterpret_cast<const uint16_t*>(a.v_cache.data());
    for (int64_t pg = 0; pg < P; ++pg)
      for (int64_t r = 0; r < S; ++r)
        for (int64_t hh = 0; hh < H; ++hh) {
          std::memcpy(&k[((pg * H + hh) * S + r) * h.d], &k0[((pg * S + r) * H + hh) * h.d], 2 * h.d);
          std::memcpy(&v[((pg * H + hh) * S + r) * h.dv], &v0[((pg * S + r) * H + hh) * h.dv], 2 * h.dv);
        }
    KVCache cache = a.cache();
    cache.k = TensorView(k.data(), DType::bf16, {P, S, H, h.d}, {H * S * h.d, h.d, S * h.d, 1});
    cache.v = TensorView(v.data(), DType::bf16, {P, S, H, h.dv}, {H * S * h.dv, h.dv, S * h.dv, 1});
    Result got;
    got.out.assign(want.out.size(), 0xAB);
    got.lse.assign(want.lse.size(), 123.0f);
    attention_with_kvcache(a.q_view(), cache, a.seqlen_view(),
                           TensorView(got.out.data(), DType::bf16, {h.B, h.Lq, h.Hq, h.dv}), a.options(), a.kv(),
                           TensorView(got.lse.data(), DType::f32, {h.B, h.Hq, h.Lq}));
    EXPECT_TRUE(same_result(want, got)) << "head-major pages differ";
  }
  // NaN and ∞ in keys and values no query sees (outside the window), in place and
  // gathered, on the tile kernels (which decline such inputs) and on the f32 kernel.
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int page : {0, 16}) {
      KvConfig g;
      g.B = 2, g.Hq = 8, g.Hkv = 2, g.d = g.dv = 32, g.Lq = g.Lnew = 40;
      g.cached = {300, 90};
      g.page = page;
      g.window = {50, -1};
      g.cache_dtype = g.q_dtype = dt;
      KvCase a(g, rng);
      for (int b = 0; b < g.B; ++b)
        for (int t = 0; t < 10; ++t) {
          write_elem(dt, a.k_cache.data(), a.k_at(b, t, 1), NAN);
          write_elem(dt, a.v_cache.data(), a.v_at(b, t, 0) + 3, INFINITY);
        }
      const Result on = run(a);
      check_against_reference(a, on, "tiles, garbage outside the window " + g.name(), 2e-5, nullptr,
                              dt == DType::f32 ? 0 : 1e-4);
    }
  }
  // What stays on the decode kernel: bitwise the ATTN_KVCACHE_TILES_FROM=0 result.
  auto stays = [&](KvConfig s, const char* what, double tolerance = 2e-5) {
    KvCase a(s, rng);
    KvCase b = a;
    const Result on = run(a);
    check_against_reference(a, on, std::string(what) + " " + s.name(), tolerance);
    const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
    EXPECT_TRUE(same_result(on, run(b))) << what << ": left the decode kernel";
  };
  KvConfig below = c;
  below.rope = Rope::none, below.precision = Precision::f32;
  below.Lq = below.Lnew = detail::kvcache_tiles_from(4) - 1;
  stays(below, "below the threshold");
  // Rotated f16 queries stay f32, so they read an f16 cache widened to f32, from
  // twice the threshold.
  KvConfig rotated = c;
  rotated.cache_dtype = rotated.q_dtype = DType::f16, rotated.precision = Precision::f32;
  stays(rotated, "rotated f16 queries below twice the threshold");
  {
    KvConfig r16 = rotated;
    r16.Lq = r16.Lnew = 2 * detail::kvcache_tiles_from(4) + 3;
    r16.cached = {300, 80};
    KvCase a(r16, rng);
    KvCase b = a;
    const Result on = run(a);
    check_against_reference(a, on, "rotated f16 queries " + r16.name());
    const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
    EXPECT_FALSE(same_result(on, run(b))) << "rotated f16 queries " << r16.name() << ": the route did not run";
  }
  // Rotated bf16 queries are rounded back to bf16 after the rotation, so they take the
  // route whatever the precision (against float64 on the rounded queries).
  for (Precision precision : {Precision::f32, Precision::bf16}) {
    KvConfig r16 = rotated;
    r16.cache_dtype = r16.q_dtype = DType::bf16, r16.precision = precision;
    KvCase a(r16, rng);
    KvCase b = a, two = a;
    const Result on = run(a);
    check_against_reference(a, on, "rotated bf16 queries " + r16.name(), 2e-5, nullptr, 1e-4);
    Result t2;
    with_threads(2, [&] { t2 = run(two); });
    EXPECT_TRUE(same_result(on, t2)) << "rotated bf16 queries: 2 threads differ";
    const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
    EXPECT_FALSE(same_result(on, run(b))) << "rotated bf16 queries " << r16.name() << ": the route did not run";
  }
  KvConfig mixed = below;
  mixed.Lq = mixed.Lnew = 2 * detail::kvcache_tiles_from(4) - 1;
  mixed.cache_dtype = DType::bf16;  // f32 queries
  stays(mixed, "f32 queries on a bf16 cache below twice the threshold");
  // Under Precision::bf16 they are rounded to bf16 and read the cache in place on the
  // bf16 kernel, from the threshold on, the output f32: against float64 on the rounded
  // queries at bf16's tolerance (P is rounded to bf16 too), as the decode kernel's bf16
  // products under it.
  for (int page : {0, 16}) {
    KvConfig r32 = below;
    r32.Lq = r32.Lnew = detail::kvcache_tiles_from(4) + 7;
    r32.cache_dtype = DType::bf16, r32.precision = Precision::bf16, r32.page = page;
    KvCase a(r32, rng);
    KvCase b = a, two = a;
    const Result on = run(a);
    KvCase rounded = a;
    float* q = reinterpret_cast<float*>(rounded.q.data());
    for (size_t n = 0; n < rounded.q.size() / sizeof(float); ++n) q[n] = detail::bf16_to_f32(detail::f32_to_bf16(q[n]));
    check_against_reference(rounded, on, "f32 queries on a bf16 cache under Precision::bf16 " + r32.name(), 1.0 / 256,
                            nullptr, 1e-4);
    Result t2;
    with_threads(2, [&] { t2 = run(two); });
    EXPECT_TRUE(same_result(on, t2)) << "f32 queries on a bf16 cache under Precision::bf16: 2 threads differ";
    const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
    EXPECT_FALSE(same_result(on, run(b))) << r32.name() << ": the route did not run";
  }
  KvConfig integer = mixed;
  integer.cache_dtype = DType::i8, integer.precision = Precision::bf16;
  stays(integer, "an i8 cache under Precision::bf16", 3e-4);  // the integer passes' bound
  KvConfig integer_bf16 = integer;
  integer_bf16.precision = Precision::f32, integer_bf16.q_dtype = DType::bf16;
  stays(integer_bf16, "an i8 cache read by bf16 queries", 3e-4);
  KvConfig split = mixed;
  split.cache_dtype = DType::f32, split.num_splits = 2;
  stays(split, "forced splits");
  // Blocks of 37 and 100 keys: a batch whose keys exceed a block runs sequence by
  // sequence, a longer sequence block by block, each block a call placed at its keys'
  // positions, merged by their lse. Against float64, 1 against 2 threads, and the route
  // ran: contiguous f32 with ALiBi, a window and an f32 mask; shuffled bf16 pages with
  // top-left causality, softcap and a boolean padding mask; an i8 cache without causality;
  // f32 queries on a bf16 cache under Precision::bf16 (the bf16 kernel, out f32); bf16
  // queries on an f16 cache (widened to f32, from twice the threshold).
  for (const char* keys : {"37", "100"}) {
    const ScopedEnv blocks("ATTN_KVCACHE_TILES_BLOCK", keys);
    for (int n = 0; n < 5; ++n) {
      KvConfig g;
      g.B = 2, g.Hq = 8, g.Hkv = 2, g.d = g.dv = 64, g.Lq = g.Lnew = 40;
      g.cached = {300, 41};
      if (n == 0) g.alibi = true, g.window = {150, 3}, g.mask = Mask::f32;
      if (n == 1) {
        g.page = 16, g.cache_dtype = g.q_dtype = DType::bf16, g.causal = Causal::TopLeft, g.softcap = 8.0f;
        g.mask = Mask::boolean, g.mask_layout = MaskLayout::per_sequence_keys;
      }
      if (n == 2) g.page = 5, g.cache_dtype = DType::i8, g.causal = Causal::None, g.alibi = true, g.Lnew = 0;
      if (n == 3) g.page = 16, g.cache_dtype = DType::bf16, g.precision = Precision::bf16, g.window = {90, -1};
      if (n == 4) g.cache_dtype = DType::f16, g.q_dtype = DType::bf16, g.Lq = g.Lnew = 2 * detail::kvcache_tiles_from(4) + 1;
      const std::string name = std::string("blocks of ") + keys + " " + g.name();
      KvCase a(g, rng);
      KvCase two = a, decode = a;
      const Result on = run(a);
      if (n == 3) {  // against float64 on the rounded queries, at bf16's tolerance
        KvCase rounded = a;
        float* q = reinterpret_cast<float*>(rounded.q.data());
        for (size_t e = 0; e < rounded.q.size() / sizeof(float); ++e) q[e] = detail::bf16_to_f32(detail::f32_to_bf16(q[e]));
        check_against_reference(rounded, on, name, 1.0 / 256, nullptr, 1e-4);
      } else {
        check_against_reference(a, on, name, 2e-5, nullptr, n == 1 ? 1e-4 : 0);
      }
      Result t2;
      with_threads(2, [&] { t2 = run(two); });
      EXPECT_TRUE(same_result(on, t2)) << name << ": 2 threads differ";
      const ScopedEnv off("ATTN_KVCACHE_TILES_FROM", "0");
      EXPECT_FALSE(same_result(on, run(decode))) << name << ": the route did not run";
    }
  }
}

TEST(KVCache, BitwiseIdenticalForAnyThreadCount) {
  auto rng = make_rng(1205);
  for (int splits : {0, 3}) {
    KvConfig c;
    c.B = 2, c.Hq = 8, c.Hkv = 2, c.d = 64, c.dv = 64;
    c.cached = {3000, 5000};
    c.page = 64;
    c.cache_dtype = DType::i8;
    c.num_splits = splits;
    c.Lnew = 1;
    const KvCase base(c, rng);
    std::vector<Result> results;
    for (int t : {1, 2, 3}) {
      KvCase kc = base;
      with_threads(t, [&] { results.push_back(run(kc)); });
    }
    for (size_t n = 1; n < results.size(); ++n) {
      EXPECT_TRUE(results[n].out == results[0].out) << "threads differ, splits " << splits;
      EXPECT_TRUE(std::memcmp(results[n].lse.data(), results[0].lse.data(), results[0].lse.size() * 4) == 0);
    }
  }
}

// i8 caches take AMX-INT8 tiles where the CPU has them (up to 4 query rows per kv
// head; digits of the queries and probabilities, src/cpu/decode_amx_i8-inl.h) and
// the vector kernel otherwise; ATTN_ISA=f32 forces the vector kernel. Both against
// float64, over the tile path's cases: rows 1–4 and more, evenly strided key rows
// (contiguous, pages ≥ 16) and staged ones (odd pages, d not a multiple of 64, a
// block's last keys), dv under and over 64, and negative value scales (which the
// append never writes: the tile path adds those blocks in f32).
TEST(KVCache, I8CachesOnTilesAndOnTheVectorKernel) {
  auto rng = make_rng(1210);
  struct Shape {
    int Hq, Hkv, Lq, d, dv, page;
  };
  const Shape shapes[] = {{8, 2, 1, 128, 128, 0},  {8, 2, 1, 64, 64, 16},  {4, 4, 1, 128, 128, 256},
                          {6, 2, 1, 80, 48, 7},    {8, 2, 1, 17, 130, 1},  {4, 1, 2, 64, 64, 16},
                          {2, 1, 3, 32, 32, 3},    {16, 2, 1, 64, 64, 64}, {8, 8, 1, 256, 96, 0}};
  for (const char* isa : {"", "f32"}) {
    const ScopedEnv forced("ATTN_ISA", *isa != '\0' ? isa : nullptr);
    for (const Shape& sh : shapes) {
      for (bool negative_scales : {false, true}) {
        KvConfig c;
        c.B = 2, c.Hq = sh.Hq, c.Hkv = sh.Hkv, c.Lq = c.Lnew = sh.Lq, c.d = sh.d, c.dv = sh.dv, c.page = sh.page;
        c.cached = {1000, 77};
        c.cache_dtype = DType::i8;
        KvCase kc(c, rng);
        if (negative_scales)
          for (size_t n = 0; n < kc.v_scale.size(); n += 5) kc.v_scale[n] = -kc.v_scale[n];
        const Result r = run(kc);
        check_against_reference(kc, r, c.name() + " ATTN_ISA=" + isa + (negative_scales ? " negative v scales" : ""));
      }
    }
  }
}

// Precision::bf16 lets i8 caches take both products on 16-bit integers (queries and
// each pass's probabilities as fixed point, 2⁻¹⁶ of their largest): against float64
// on the dequantized cache at 3e-4 of the output's largest (f32's own bar is 2e-5; the
// worst seen over 30 seeds, f32 outputs, was 1e-4; python/tests/test_kvcache.py holds
// it to FlashAttention's bf16 rule on sharper scores). ATTN_ISA=f32 keeps AMX machines off the tiles, so every
// x86 machine runs the integer passes there: their result must differ from the
// exact path's. d or dv not a multiple of 32, and non-finite queries (score pass),
// fall back to f32; NaN and ±∞ weights (a value scale of ∞) take f32 per row. bf16
// queries take the same passes under Precision::f32 (bitwise the same result).
TEST(KVCache, I8OnIntegerProductsUnderPrecisionBf16) {
  auto rng = make_rng(1212);
  const PassShape shapes[] = {{32, 8, 1, 128, 128, 0}, {8, 2, 1, 64, 64, 16}, {4, 4, 1, 32, 96, 256},
                              {18, 2, 1, 96, 64, 7},   {2, 1, 3, 256, 32, 1}, {5, 1, 2, 64, 160, 3},
                              {4, 2, 2, 48, 48, 0},    {6, 2, 1, 64, 40, 16}};
  double worst = 0;
  for (const char* isa : {"", "f32"}) {
    const ScopedEnv forced("ATTN_ISA", *isa != '\0' ? isa : nullptr);
    for (const PassShape& sh : shapes) {
      for (int variant = 0; variant < 4; ++variant) {
        KvConfig c = pass_case(sh, DType::i8, variant);
        c.precision = Precision::bf16;
        if (variant == 3) c.q_dtype = DType::bf16;
        KvCase kc(c, rng);
        if (variant == 2)
          for (size_t n = 0; n < kc.v_scale.size(); n += 7) kc.v_scale[n] = -kc.v_scale[n];
        KvCase exact_case = kc;
        exact_case.c.precision = Precision::f32;
        const Result r = run(kc), exact = run(exact_case);
        const std::string name = c.name() + " ATTN_ISA=" + isa;
        check_against_reference(kc, r, name, 3e-4, c.q_dtype == DType::f32 ? &worst : nullptr);
        const bool integer_path = sh.d % 32 == 0 && sh.dv % 32 == 0;
        if (c.q_dtype == DType::bf16) {  // bf16 queries take the integer passes whatever the precision
          KvCase as_default = exact_case;
          EXPECT_EQ(r.out, run(as_default).out) << name << ": bf16 queries must take the same passes by default";
          continue;
        }
        if (*isa != '\0' && integer_path) EXPECT_NE(r.out, exact.out) << name << ": the integer passes did not run";
        if (!integer_path) EXPECT_EQ(r.out, exact.out) << name << ": must fall back to the exact path";
      }
    }
  }
  std::printf("i8 on integer products: worst error %.2e of the output's largest\n", worst);
  // Non-finite weights: one visible key's value scale ∞ gives the f32 path's NaN/±∞
  // pattern, column by column; a NaN query row takes the f32 score pass.
  for (int which = 0; which < 2; ++which) {
    KvConfig c;
    c.B = 1, c.Hq = 8, c.Hkv = 2, c.d = 64, c.dv = 64, c.cached = {90};
    c.cache_dtype = DType::i8;
    c.precision = Precision::bf16;
    KvCase kc(c, rng);
    if (which == 0) kc.v_scale[kc.s_at(0, 40, 1)] = HUGE_VALF;
    if (which == 1) reinterpret_cast<float*>(kc.q.data())[3 * c.d + 5] = NAN;
    KvCase exact_case = kc;
    exact_case.c.precision = Precision::f32;
    const Result r = run(kc), exact = run(exact_case);
    const float* got = reinterpret_cast<const float*>(r.out.data());
    const float* want = reinterpret_cast<const float*>(exact.out.data());
    int nonfinite = 0;
    for (size_t n = 0; n < r.out.size() / sizeof(float); ++n) {
      nonfinite += !std::isfinite(want[n]);
      if (std::isfinite(want[n])) {
        EXPECT_NEAR(got[n], want[n], 1e-3) << "element " << n;
      } else if (std::isnan(want[n])) {
        EXPECT_TRUE(std::isnan(got[n])) << "element " << n;
      } else {
        EXPECT_EQ(got[n], want[n]) << "element " << n;
      }
    }
    EXPECT_GT(nonfinite, 0) << "the case must reach the output";
  }
}

TEST(KVCache, GarbageInRemovedKeysAndUnusedSlotsNeverReachTheOutput) {
  auto rng = make_rng(1206);
  KvConfig c;
  c.B = 2, c.Hq = 4, c.Hkv = 1, c.d = 16, c.dv = 16;
  c.cached = {300, 90};
  c.page = 16;
  c.window = {50, -1};
  for (DType dt : {DType::f32, DType::bf16, DType::f8e4m3}) {  // E4M3 has a NaN code, and no ∞
    c.cache_dtype = dt;
    KvCase kc(c, rng);
    // Keys 0..9 are outside every query's window: put NaN and ∞ there.
    for (int b = 0; b < c.B; ++b)
      for (int t = 0; t < 10; ++t) {
        write_elem(c.cache_dtype, kc.k_cache.data(), kc.k_at(b, t, 0), NAN);
        write_elem(c.cache_dtype, kc.v_cache.data(), kc.v_at(b, t, 0) + 3, dt == DType::f8e4m3 ? NAN : INFINITY);
      }
    const KvCase before = kc;
    const Result r = run(kc);
    check_append(before, kc, std::string("garbage ") + dtype_name(dt));
    check_against_reference(kc, r, std::string("garbage ") + dtype_name(dt));
  }
  c.cache_dtype = DType::f32;
  // A fully removed row: out 0, lse −∞.
  KvConfig e = c;
  e.window = {-1, -1};
  e.causal = Causal::TopLeft;  // with Lq = 1, query 0 sees key 0 only
  e.Lnew = 0;
  e.cached = {1, 1};
  KvCase ek(e, rng);
  const Result er = run(ek);
  check_against_reference(ek, er, "top-left");
}

// E4M3's NaN code in a key a query sees makes that query's row NaN, in a value the
// same column of it, as a NaN in a float cache does; the other kv head's rows stay
// finite.
TEST(KVCache, E4m3NanCodeInAVisibleKeyOrValueGivesNaN) {
  auto rng = make_rng(1208);
  for (int which = 0; which < 2; ++which) {
    KvConfig c;
    c.B = 1, c.Hq = 4, c.Hkv = 2, c.d = 48, c.dv = 48;
    c.cached = {200};
    c.Lnew = 0;
    c.page = 16;
    c.cache_dtype = DType::f8e4m3;
    KvCase kc(c, rng);
    if (which == 0) {
      static_cast<uint8_t*>(static_cast<void*>(kc.k_cache.data()))[kc.k_at(0, 77, 1) + 5] = 0x7F;
    } else {
      static_cast<uint8_t*>(static_cast<void*>(kc.v_cache.data()))[kc.v_at(0, 130, 1) + 9] = 0xFF;
    }
    const Result r = run(kc);
    for (int h = 0; h < c.Hq; ++h) {
      const bool nan_head = h / (c.Hq / c.Hkv) == 1;
      for (int x = 0; x < c.dv; ++x) {
        const float got = read_elem(c.q_dtype, r.out.data(), int64_t(h) * c.dv + x);
        if (nan_head && (which == 0 || x == 9)) {
          ASSERT_TRUE(std::isnan(got)) << (which ? "v" : "k") << " head " << h << " x " << x;
        } else {
          ASSERT_FALSE(std::isnan(got)) << (which ? "v" : "k") << " head " << h << " x " << x;
        }
      }
    }
  }
}

// Only a −∞ score removes a key. Under a −FLT_MAX mask entry a key is seen, and its p
// underflows to 0: a NaN or ∞ in its value still reaches the output as 0·NaN = NaN,
// as in the float64 reference and attention()'s tiled kernels. A NaN value under a
// −∞ entry does not. Every cache dtype with a non-finite value (E4M3: its NaN code;
// i8: a NaN value scale), contiguous and paged, one split and several.
TEST(KVCache, ASeenKeyWhosePUnderflowsStillPassesANonFiniteValueOn) {
  auto rng = make_rng(1209);
  for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::f8e4m3, DType::i8}) {
    for (int splits : {1, 3}) {
      KvConfig c;
      c.B = 1, c.Hq = 8, c.Hkv = 2, c.d = 48, c.dv = 40;
      c.cached = {200};
      c.Lnew = 0;
      c.page = splits == 1 ? 0 : 16;
      c.num_splits = splits;
      c.cache_dtype = dt;
      c.mask = Mask::f32, c.mask_layout = MaskLayout::per_sequence_keys;
      KvCase kc(c, rng);
      for (int j = 0; j < kc.mask_keys; ++j) write_elem(DType::f32, kc.mask.data(), kc.mask_at(0, 0, 0, j), 0.0f);
      write_elem(DType::f32, kc.mask.data(), kc.mask_at(0, 0, 0, 77), -FLT_MAX);
      write_elem(DType::f32, kc.mask.data(), kc.mask_at(0, 0, 0, 130), -INFINITY);
      auto poison = [&](int t, int h, int x) {
        if (dt == DType::i8) {  // the whole dequantized row: code × NaN
          kc.v_scale[size_t(kc.v_at(0, t, h) / c.dv)] = NAN;
        } else if (dt == DType::f8e4m3) {
          static_cast<uint8_t*>(static_cast<void*>(kc.v_cache.data()))[kc.v_at(0, t, h) + x] = 0xFF;
        } else {
          write_elem(dt, kc.v_cache.data(), kc.v_at(0, t, h) + x, dt == DType::f32 ? INFINITY : NAN);
        }
      };
      poison(77, 1, 9);   // seen, p = 0: NaN in column 9 of kv head 1's rows
      poison(130, 0, 3);  // removed: never read into the output
      poison(130, 1, 5);
      const Result r = run(kc);
      for (int h = 0; h < c.Hq; ++h) {
        const bool poisoned_head = h / (c.Hq / c.Hkv) == 1;
        for (int x = 0; x < c.dv; ++x) {
          const float got = read_elem(c.q_dtype, r.out.data(), int64_t(h) * c.dv + x);
          const bool want_nan = poisoned_head && (x == 9 || dt == DType::i8);
          ASSERT_EQ(std::isnan(got), want_nan) << dtype_name(dt) << " splits " << splits << " head " << h << " x " << x;
        }
      }
    }
  }
}

TEST(KVCache, AppendOnlyWritesWhatAttentionWouldSee) {
  auto rng = make_rng(1207);
  for (DType dt : {DType::f32, DType::bf16, DType::i8, DType::f8e4m3}) {
    KvConfig c;
    c.B = 2, c.Hkv = 3, c.d = 10, c.dv = 6, c.Lnew = 5;
    c.cached = {7, 0};
    c.page = 4;
    c.cache_dtype = dt;
    c.rope = Rope::interleaved;
    KvCase kc(c, rng);
    const KvCase before = kc;
    kvcache_append(kc.cache(), kc.seqlen_view(), kc.kv());
    check_append(before, kc, std::string("append ") + dtype_name(dt));
  }
}

TEST(KVCache, ErrorsNameTheArgument) {
  auto rng = make_rng(1208);
  KvConfig c;
  c.B = 2, c.Hq = 4, c.Hkv = 2, c.d = 8, c.dv = 8;
  c.cached = {5, 9};
  c.page = 4;
  KvCase kc(c, rng);
  std::vector<float> out(size_t(2) * 1 * 4 * 8), lse(8);
  const TensorView ov(out.data(), DType::f32, {2, 1, 4, 8});
  auto call = [&](const KVCache& cache, const TensorView& seqlens, const KVCacheOptions& kv,
                  const AttentionOptions& o = {}, const TensorView& q = {}, const TensorView& out_v = {}) {
    return [=, &kc] { attention_with_kvcache(q.empty() ? kc.q_view() : q, cache, seqlens, out_v.empty() ? ov : out_v, o, kv); };
  };
  const KVCache good = kc.cache();
  const KVCacheOptions kv = kc.kv();
  const std::vector<uint8_t> k_before = kc.k_cache, v_before = kc.v_cache;
  // block_table out of range and repeated.
  std::vector<int32_t> bt = kc.block_table;
  bt[1] = kc.pages_total;
  KVCache bad = good;
  bad.block_table = TensorView(bt.data(), DType::i32, {2, kc.max_blocks});
  expect_attn_error(call(bad, kc.seqlen_view(), kv), "out of range");
  bt = kc.block_table;
  bt[1] = bt[0];
  expect_attn_error(call(bad, kc.seqlen_view(), kv), "repeats a page");
  // A page that sequence 1 reads and sequence 0's append writes.
  bt = kc.block_table;
  bt[size_t(kc.max_blocks) + 0] = bt[1];  // seq 0 appends at t = 5, page index 1
  expect_attn_error(call(bad, kc.seqlen_view(), kv), "shared pages must be read-only");
  // Without an append that page may be shared; a repeat within sequence 1 alone is
  // still caught (the check's marks of sequence 0 must not leak into sequence 1's).
  EXPECT_NO_THROW(call(bad, kc.seqlen_view(), KVCacheOptions{})());
  bt = kc.block_table;
  bt[size_t(kc.max_blocks) + 2] = bt[size_t(kc.max_blocks) + 0];
  expect_attn_error(call(bad, kc.seqlen_view(), kv), "cache.block_table[1, 2]");
  expect_attn_error(call(bad, kc.seqlen_view(), kv), "repeats a page sequence 1 already uses");
  // Capacity.
  std::vector<int32_t> long_lens = {5, kc.max_blocks * 4};
  expect_attn_error(call(good, TensorView(long_lens.data(), DType::i32, {2}), kv), "exceeds the cache's capacity");
  std::vector<int32_t> neg = {-1, 3};
  expect_attn_error(call(good, TensorView(neg.data(), DType::i32, {2}), kv), "cache_seqlens[0] must be >= 0");
  // Page size and dtype mismatches.
  KVCache mism = good;
  // Its own buffer: a view of v_cache with pages of 8 would reach past it, and could
  // overlap cache.k (then that is the error reported), depending on the heap.
  std::vector<float> v_pages8(size_t(kc.pages_total) * 8 * c.Hkv * c.dv);
  mism.v = TensorView(v_pages8.data(), DType::f32, {kc.pages_total, 8, c.Hkv, c.dv});
  expect_attn_error(call(mism, kc.seqlen_view(), kv), "page size mismatch");
  mism = good;
  mism.v = TensorView(kc.v_cache.data(), DType::bf16, {kc.pages_total, 4, c.Hkv, c.dv});
  expect_attn_error(call(mism, kc.seqlen_view(), kv), "cache.v must have the dtype of cache.k");
  std::vector<uint16_t> qb(size_t(2) * 4 * 8);
  expect_attn_error(call(good, kc.seqlen_view(), kv, {}, TensorView(qb.data(), DType::bf16, {2, 1, 4, 8})),
                    "out must have dtype bf16");
  // i8 without scales, scales on a float cache.
  std::vector<int8_t> k8(kc.k_cache.size() / 4), v8(kc.v_cache.size() / 4);
  KVCache i8 = good;
  i8.k = TensorView(k8.data(), DType::i8, {kc.pages_total, 4, c.Hkv, c.d});
  i8.v = TensorView(v8.data(), DType::i8, {kc.pages_total, 4, c.Hkv, c.dv});
  expect_attn_error(call(i8, kc.seqlen_view(), kv), "cache.k_scale is required");
  KVCache scaled = good;
  std::vector<float> sc(size_t(kc.pages_total) * 4 * c.Hkv);
  scaled.k_scale = TensorView(sc.data(), DType::f32, {kc.pages_total, 4, c.Hkv});
  expect_attn_error(call(scaled, kc.seqlen_view(), kv), "for quantized (i8, f8e4m3) caches only");
  // A NaN new key into an i8 cache.
  std::vector<float> sc2(sc.size());
  i8.k_scale = TensorView(sc.data(), DType::f32, {kc.pages_total, 4, c.Hkv});
  i8.v_scale = TensorView(sc2.data(), DType::f32, {kc.pages_total, 4, c.Hkv});
  std::vector<float> knan(size_t(2) * 1 * 2 * 8, 0.5f);
  knan[3] = NAN;
  KVCacheOptions kvn = kv;
  kvn.k_new = TensorView(knan.data(), DType::f32, {2, 1, 2, 8});
  expect_attn_error(call(i8, kc.seqlen_view(), kvn), "an i8 cache holds finite values only");
  // Options the cache path does not take; rotary without new keys; splits.
  // Masks: K must reach the longest sequence's 9 + 1 keys; other dimensions broadcast.
  AttentionOptions o;
  std::vector<uint8_t> m(160, 1);  // the largest view below: a view past its buffer could overlap another input
  o.mask = TensorView(m.data(), DType::boolean, {1, 1, 1, 9});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "dimension 3 (K) must be 1 or at least 10");
  o.mask = TensorView(m.data(), DType::boolean, {2, 3, 1, 10});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "dimension 1 (Hq) must be 1 or 4");
  o.mask = TensorView(m.data(), DType::boolean, {2, 4, 2, 10});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "dimension 2 (Lq) must be 1 or 1");
  o.mask = TensorView(m.data(), DType::boolean, {1, 1, 1, 1, 10});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "options.mask must have rank 1 .. 4");
  o.mask = TensorView(m.data(), DType::i32, {1, 10});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "options.mask must be boolean");
  o.mask = TensorView(m.data(), DType::bf16, {1, 10});  // q is f32
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "additive in f32, got bf16");
  o.mask = TensorView(m.data(), DType::boolean, {1, 10}, {10, 2});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "options.mask must have a contiguous last dimension");
  o.mask = TensorView(out.data(), DType::f32, {1, 10});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "out overlaps options.mask");
  o.mask = {};
  std::vector<int32_t> blocks(4, 1);
  o.block_mask.blocks = TensorView(blocks.data(), DType::i32, {1, 1, 2, 2});
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "options.block_mask is not supported");
  o = {};
  o.dropout_p = 0.1f;
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "dropout_p must be 0");
  o = {};
  o.precision = static_cast<Precision>(7);
  expect_attn_error(call(good, kc.seqlen_view(), kv, o), "options.precision must be Precision::f32");
  KVCacheOptions rot;
  std::vector<float> cs(64 * 4, 1.0f);
  rot.rotary_cos = TensorView(cs.data(), DType::f32, {64, 4});
  rot.rotary_sin = TensorView(cs.data(), DType::f32, {64, 4});
  expect_attn_error(call(good, kc.seqlen_view(), rot), "need kv.k_new");
  KVCacheOptions sp = kv;
  sp.num_splits = kMaxKVSplits + 1;
  expect_attn_error(call(good, kc.seqlen_view(), sp), "kv.num_splits must be");
  KVCacheOptions half = kv;
  half.v_new = {};
  expect_attn_error(call(good, kc.seqlen_view(), half), "go together");
  // Hq not a multiple of Hkv; out overlapping the cache.
  std::vector<float> q3(size_t(2) * 3 * 8);
  std::vector<float> o3(size_t(2) * 3 * 8);
  expect_attn_error(call(good, kc.seqlen_view(), kv, {}, TensorView(q3.data(), DType::f32, {2, 1, 3, 8}),
                         TensorView(o3.data(), DType::f32, {2, 1, 3, 8})),
                    "multiple of the cache's Hkv");
  expect_attn_error(call(good, kc.seqlen_view(), kv, {}, {}, TensorView(kc.k_cache.data(), DType::f32, {2, 1, 4, 8})),
                    "out overlaps cache.k");
  // No failed call wrote anything.
  EXPECT_TRUE(k_before == kc.k_cache && v_before == kc.v_cache);
}

}  // namespace
}  // namespace attn::testing
