// The KV cache's write side: new keys and values rotated (RoPE), then rounded to the
// cache's dtype or quantized (i8, f8e4m3) with one scale per token and head; and the
// queries' f32 copy (scaled, rotated) that the decode kernel reads. New tokens are
// few per call (one per sequence when decoding), so this is plain code, but rows are
// widened and rounded by the kernels' vector conversions: element by element, a
// decoding step of 8 bf16 heads spent ~10 µs in function calls (Zen 4).
#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/storage_rows.hpp"
#include "kvcache/decode_problem.hpp"
#include "tensor/convert.hpp"
#include "traffic.hpp"

namespace attn::detail {
namespace {

// Rotates the first rotary_dim entries of x (position pos) by the tables' angles, in
// double: products of two floats are exact there, so each result is the float of one
// correctly rounded sum, whether or not the compiler fuses it into an FMA, and a
// float64 reference reproduces it bit for bit (a rotated bf16 query is then rounded to
// bf16, where a result off by an ulp could round the other way).
void rotate(const DecodeProblem& p, float* x, int64_t pos) {
  if (p.rot_cos == nullptr) return;
  const float* cs = p.rot_cos + pos * p.cos_row;
  const float* sn = p.rot_sin + pos * p.sin_row;
  const int half = p.rotary_dim / 2;
  for (int j = 0; j < half; ++j) {
    float& a = x[p.rotary_interleaved ? 2 * j : j];
    float& b = x[p.rotary_interleaved ? 2 * j + 1 : j + half];
    const double x0 = a, x1 = b, c = cs[j], s = sn[j];
    a = static_cast<float>(x0 * c - x1 * s);
    b = static_cast<float>(x0 * s + x1 * c);
  }
}

// Writes one row (n values) into the cache row at `at`, in the cache's dtype.
void store_row(const DecodeProblem& p, const CacheTensor& c, int64_t at, int64_t scale_at, const float* x, int n) {
  switch (p.cache_dtype) {
    case DType::f32:
    case DType::bf16:
    case DType::f16:
      store_row_f32_cpu(p.cache_dtype, c.base, at, x, n);
      break;
    default: {  // i8, f8e4m3: symmetric, one scale per row; the checks made x finite
      float amax = 0.0f;
      for (int i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
      const float scale = amax / quantized_max(p.cache_dtype);
      if (p.cache_dtype == DType::i8) {
        int8_t* dst = static_cast<int8_t*>(c.base) + at;
        for (int i = 0; i < n; ++i) {
          const float r = scale > 0.0f ? std::nearbyint(x[i] / scale) : 0.0f;
          dst[i] = static_cast<int8_t>(std::clamp(r, -127.0f, 127.0f));
        }
      } else {  // nearest even E4M3; x / scale can exceed 448 by a rounding, which saturates
        uint8_t* dst = static_cast<uint8_t*>(c.base) + at;
        for (int i = 0; i < n; ++i) dst[i] = f32_to_f8e4m3(scale > 0.0f ? x[i] / scale : 0.0f);
      }
      c.scale[scale_at] = scale;
      break;
    }
  }
}

}  // namespace

void append_to_cache(const DecodeProblem& p) {
  if (p.Lnew == 0) return;
  std::vector<float> row(static_cast<size_t>(std::max(p.d, p.dv)));
  for (int b = 0; b < p.B; ++b) {
    for (int t = 0; t < p.Lnew; ++t) {
      const int pos = p.cached[b] + t;
      for (int h = 0; h < p.Hkv; ++h) {
        const int64_t k_at = b * p.kn_b + t * p.kn_row + h * p.kn_head;
        load_row_f32_cpu(p.new_dtype, p.k_new, k_at, p.d, row.data());
        rotate(p, row.data(), pos);
        store_row(p, p.k, p.row_offset(p.k, b, pos, h), p.scale_offset(p.k, b, pos, h), row.data(), p.d);
        const int64_t v_at = b * p.vn_b + t * p.vn_row + h * p.vn_head;
        load_row_f32_cpu(p.new_dtype, p.v_new, v_at, p.dv, row.data());
        store_row(p, p.v, p.row_offset(p.v, b, pos, h), p.scale_offset(p.v, b, pos, h), row.data(), p.dv);
      }
    }
  }
  const bool quantized = is_quantized_cache(p.cache_dtype);
  TrafficCounters::add(traffic().cache_written_bytes,
                       static_cast<uint64_t>(p.B) * p.Lnew * p.Hkv *
                           ((p.d + p.dv) * dtype_size(p.cache_dtype) + (quantized ? 2 * sizeof(float) : 0)));
}

std::vector<float> prepare_queries(const DecodeProblem& p, int multiple, bool scaled) {
  const int dp = (p.d + multiple - 1) / multiple * multiple;
  std::vector<float> qs(static_cast<size_t>(p.B) * p.Hq * p.Lq * dp, 0.0f);
  for (int b = 0; b < p.B; ++b) {
    for (int h = 0; h < p.Hq; ++h) {
      for (int i = 0; i < p.Lq; ++i) {
        float* dst = qs.data() + ((static_cast<size_t>(b) * p.Hq + h) * p.Lq + i) * dp;
        const int64_t at = b * p.q_b + i * p.q_row + h * p.q_head;
        load_row_f32_cpu(p.q_dtype, p.q, at, p.d, dst);
        rotate(p, dst, int64_t{p.cached[b]} + p.Lnew - p.Lq + i);
        // Rotated bf16 queries are bf16 inputs again, as in FlashAttention, whose kernel
        // writes them back in their dtype: so they take bf16 products on the decode
        // kernel and the tiled kernels alike, and a call's result does not depend on
        // which of the two runs it. (f16 ones stay f32: rounding to f16 could overflow.)
        if (p.rot_cos != nullptr && p.q_dtype == DType::bf16) round_f32_row_to_bf16(dst, dst, p.d);
        if (scaled) for (int x = 0; x < p.d; ++x) dst[x] *= p.attn.scale;
      }
    }
  }
  return qs;
}

}  // namespace attn::detail
