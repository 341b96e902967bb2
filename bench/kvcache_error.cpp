// What a quantized KV cache costs in accuracy (issue 12, item 4), two figures per
// cache dtype: the kernel's error against the float64 reference on the values the
// cache holds (dequantized: the kernel's own exactness), and the error against the
// float64 reference on the keys and values before they were stored (what the
// storage's rounding or quantization costs). Decoding shapes: Hq = 32, Hkv = 8,
// d = 128, one query per sequence, bottom-right causal; keys and values standard
// normal, then again with two outlier dimensions ×20 in every key head (as LLM keys
// have), appended with attn::kvcache_append. Errors are max |out − ref| / max |ref|
// over the batch.
//
//   ./build/release/bench/kvcache_error [--length L] [--batch B]
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "attn/tensor.hpp"
#include "tensor/convert.hpp"

namespace {

using attn::DType;
using attn::Tensor;
using attn::TensorView;

constexpr int kHq = 32, kHkv = 8, kD = 128;

// The cache's element `at` (a quantized one times its scale), as a double.
double stored_value(const Tensor& t, const Tensor& scale, int64_t at) {
  const void* base = t.data();
  switch (t.dtype()) {
    case DType::i8: return static_cast<double>(static_cast<const int8_t*>(base)[at]) * scale.data_as<float>()[at / kD];
    case DType::f8e4m3:
      return double{attn::detail::f8e4m3_to_f32(static_cast<const uint8_t*>(base)[at])} * scale.data_as<float>()[at / kD];
    default: return attn::detail::load_f32(t.dtype(), base, at);
  }
}

double max_error(const std::vector<float>& got, const std::vector<float>& ref) {
  double err = 0, top = 1e-30;
  for (size_t i = 0; i < got.size(); ++i) {
    err = std::max(err, std::fabs(double{got[i]} - ref[i]));
    top = std::max(top, std::fabs(double{ref[i]}));
  }
  return err / top;
}

}  // namespace

int main(int argc, char** argv) {
  int64_t L = 4096, B = 4;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--length") == 0) L = std::atol(argv[i + 1]);
    else if (std::strcmp(argv[i], "--batch") == 0) B = std::atol(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: %s [--length L] [--batch B]\n", argv[0]);
      return 2;
    }
  }
  for (bool outliers : {false, true}) {
    std::mt19937_64 rng(20261123);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_int_distribution<int> dim(0, kD - 1);
    // Keys and values f32 [B, L, Hkv, d]; queries f32 [B, 1, Hq, d].
    std::vector<float> k(static_cast<size_t>(B * L * kHkv * kD)), v(k.size()), q(static_cast<size_t>(B * kHq * kD));
    for (float& x : k) x = normal(rng);
    for (float& x : v) x = normal(rng);
    for (float& x : q) x = normal(rng);
    // Two outlier dimensions per head, ×20, as in LLM keys (one scale per token and
    // head has to span them).
    for (int h = 0; h < kHkv && outliers; ++h) {
      for (int n = 0; n < 2; ++n) {
        const int x = dim(rng);
        for (int64_t t = 0; t < B * L; ++t) k[static_cast<size_t>((t * kHkv + h) * kD + x)] *= 20.0f;
      }
    }
    const TensorView qv(q.data(), DType::f32, {B, 1, kHq, kD});
    std::vector<float> ref_orig(q.size()), ref_lse(static_cast<size_t>(B * kHq));
    attn::AttentionOptions opt;
    opt.causal = attn::Causal::BottomRight;
    attn::attention_reference(qv, TensorView(k.data(), DType::f32, {B, L, kHkv, kD}),
                              TensorView(v.data(), DType::f32, {B, L, kHkv, kD}),
                              TensorView(ref_orig.data(), DType::f32, {B, 1, kHq, kD}), opt);

    std::printf("\nattn KV-cache error: B=%lld L=%lld Hq=%d Hkv=%d d=%d, %s\n", static_cast<long long>(B),
                static_cast<long long>(L), kHq, kHkv, kD,
                outliers ? "keys with 2 outlier dims x20 per head" : "keys and values standard normal");
    std::printf("| cache | bytes per token-head (k + v) | vs float64 on the stored values | vs float64 on the values before storage |\n");
    std::printf("|---|---:|---:|---:|\n");
    for (DType dt : {DType::f32, DType::bf16, DType::f16, DType::i8, DType::f8e4m3}) {
      attn::KVCache cache;
      Tensor kc(dt, {B, L, kHkv, kD}), vc(dt, {B, L, kHkv, kD}), ks, vs;
      cache.k = kc;
      cache.v = vc;
      const bool quantized = dt == DType::i8 || dt == DType::f8e4m3;
      if (quantized) {
        ks = Tensor(DType::f32, {B, L, kHkv});
        vs = Tensor(DType::f32, {B, L, kHkv});
        cache.k_scale = ks;
        cache.v_scale = vs;
      }
      std::vector<int32_t> zeros(static_cast<size_t>(B), 0), lens(static_cast<size_t>(B), static_cast<int32_t>(L));
      attn::KVCacheOptions kv;
      kv.k_new = TensorView(k.data(), DType::f32, {B, L, kHkv, kD});
      kv.v_new = TensorView(v.data(), DType::f32, {B, L, kHkv, kD});
      attn::kvcache_append(cache, TensorView(zeros.data(), DType::i32, {B}), kv);

      std::vector<float> out(q.size());
      attn::attention_with_kvcache(qv, cache, TensorView(lens.data(), DType::i32, {B}),
                                   TensorView(out.data(), DType::f32, {B, 1, kHq, kD}), opt);
      // The reference on what the cache holds.
      std::vector<float> ks32(k.size()), vs32(v.size()), ref_stored(q.size());
      for (size_t i = 0; i < k.size(); ++i) {
        ks32[i] = static_cast<float>(stored_value(kc, ks, static_cast<int64_t>(i)));
        vs32[i] = static_cast<float>(stored_value(vc, vs, static_cast<int64_t>(i)));
      }
      attn::attention_reference(qv, TensorView(ks32.data(), DType::f32, {B, L, kHkv, kD}),
                                TensorView(vs32.data(), DType::f32, {B, L, kHkv, kD}),
                                TensorView(ref_stored.data(), DType::f32, {B, 1, kHq, kD}), opt);
      const double bytes = 2.0 * kD * attn::dtype_size(dt) + (quantized ? 2 * sizeof(float) : 0);
      std::printf("| %s | %.0f | %.1e | %.1e |\n", attn::dtype_name(dt), bytes, max_error(out, ref_stored),
                  max_error(out, ref_orig));
    }
  }
  return 0;
}
