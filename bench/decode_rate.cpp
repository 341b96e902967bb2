// decode_rate: the decode kernel's arithmetic rate, as a fraction of this core's FMA
// peak. `attn bench --decode` reports GB/s of cache read against the read bandwidth,
// which is the right bar where decoding is bound by memory; on a core where it is
// bound by arithmetic (Zen 1, AVX2: every cache dtype took the same time per token)
// the question is how close the kernel's loops come to the FMA units' rate. A small
// cache (L = 512 keys: 2 MiB of bf16 keys and values) stays in L2/L3, so this
// measures the arithmetic alone; a long one (L = 8192) adds the memory system back.
//
// Shapes as the decode table's: B = 1, Lq = 1, Hq = 32, Hkv = 8 (or --hkv), d = dv = 128,
// contiguous cache, one split (--splits to change it), 1 thread. Flops: 4·Hq·L·d per call (Q·Kᵀ and P·V).
// Fresh random keys, values, scales and queries (never constants).
//
// usage: decode_rate [f32|bf16|f16|i8 ...] [--lengths L ...] [--hkv H] [--calls N] [--precision f32|bf16] [--splits S]
//        --hkv: kv heads (default 8, 4 query rows per kv head; 32 = multi-head, 1 row)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/kvcache.hpp"
#include "peak.hpp"
#include "tensor/convert.hpp"
#include "timing.hpp"

namespace {

using attn::DType;

struct Rate {
  double us_per_call, gflops;
};

/// Median over 7 rounds of `calls` decoding calls each (after 10 warm-up calls).
Rate time_decode(DType cache_dtype, int L, int Hkv, int calls, attn::Precision precision, int splits,
                 std::mt19937& rng) {
  constexpr int B = 1, Hq = 32, d = 128;
  const size_t n = static_cast<size_t>(B) * L * Hkv * d;
  const size_t bytes = cache_dtype == DType::f32 ? 4 : cache_dtype == DType::i8 ? 1 : 2;
  std::vector<uint8_t> k(n * bytes), v(n * bytes);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  for (size_t i = 0; i < n; ++i) {
    const float a = uniform(rng), b = uniform(rng);
    switch (cache_dtype) {
      case DType::f32:
        std::memcpy(&k[4 * i], &a, 4), std::memcpy(&v[4 * i], &b, 4);
        break;
      case DType::bf16:
      case DType::f16: {
        const uint16_t ka = cache_dtype == DType::bf16 ? attn::detail::f32_to_bf16(a) : attn::detail::f32_to_f16(a);
        const uint16_t vb = cache_dtype == DType::bf16 ? attn::detail::f32_to_bf16(b) : attn::detail::f32_to_f16(b);
        std::memcpy(&k[2 * i], &ka, 2), std::memcpy(&v[2 * i], &vb, 2);
        break;
      }
      default:
        k[i] = static_cast<uint8_t>(static_cast<int8_t>(a * 127.0f));
        v[i] = static_cast<uint8_t>(static_cast<int8_t>(b * 127.0f));
        break;
    }
  }
  std::vector<float> k_scale(static_cast<size_t>(B) * L * Hkv), v_scale(k_scale.size());
  for (float& s : k_scale) s = 0.01f * (1.0f + 0.1f * uniform(rng));
  for (float& s : v_scale) s = 0.01f * (1.0f + 0.1f * uniform(rng));
  std::vector<float> q(static_cast<size_t>(B) * Hq * d), out(q.size());
  for (float& x : q) x = uniform(rng);
  std::vector<int32_t> seqlens(B, L);

  attn::KVCache cache;
  cache.k = attn::TensorView(k.data(), cache_dtype, {B, L, Hkv, d});
  cache.v = attn::TensorView(v.data(), cache_dtype, {B, L, Hkv, d});
  if (cache_dtype == DType::i8) {
    cache.k_scale = attn::TensorView(k_scale.data(), DType::f32, {B, L, Hkv});
    cache.v_scale = attn::TensorView(v_scale.data(), DType::f32, {B, L, Hkv});
  }
  const attn::TensorView qv(q.data(), DType::f32, {B, 1, Hq, d}), ov(out.data(), DType::f32, {B, 1, Hq, d});
  const attn::TensorView lens(seqlens.data(), DType::i32, {B});
  attn::KVCacheOptions kv;
  kv.num_splits = splits;
  attn::AttentionOptions opt;
  opt.precision = precision;
  for (int i = 0; i < 10; ++i) attn::attention_with_kvcache(qv, cache, lens, ov, opt, kv);
  std::vector<double> per_call;
  for (int round = 0; round < 7; ++round) {
    const double t0 = attn::bench::now_s();
    for (int i = 0; i < calls; ++i) attn::attention_with_kvcache(qv, cache, lens, ov, opt, kv);
    per_call.push_back((attn::bench::now_s() - t0) / calls);
  }
  const double t = attn::bench::median(per_call);
  return {t * 1e6, 4.0 * B * Hq * L * d / t * 1e-9};
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<DType> dtypes;
  std::vector<int> lengths;
  int calls = 0, hkv = 8, splits = 1;
  attn::Precision precision = attn::Precision::f32;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--lengths") {
      while (i + 1 < argc && std::atoi(argv[i + 1]) > 0) lengths.push_back(std::atoi(argv[++i]));
    } else if (a == "--hkv" && i + 1 < argc) {
      hkv = std::atoi(argv[++i]);
      if (hkv < 1 || 32 % hkv != 0) {
        std::fprintf(stderr, "decode_rate: --hkv must divide 32\n");
        return 2;
      }
    } else if (a == "--precision" && i + 1 < argc) {
      const std::string want = argv[++i];
      if (want != "f32" && want != "bf16") {
        std::fprintf(stderr, "decode_rate: --precision must be f32 or bf16\n");
        return 2;
      }
      precision = want == "bf16" ? attn::Precision::bf16 : attn::Precision::f32;
    } else if (a == "--splits" && i + 1 < argc) {
      splits = std::atoi(argv[++i]);
      if (splits < 0) {
        std::fprintf(stderr, "decode_rate: --splits must be 0 (automatic) or more\n");
        return 2;
      }
    } else if (a == "--calls" && i + 1 < argc) {
      calls = std::atoi(argv[++i]);
    } else if (a == "f32" || a == "bf16" || a == "f16" || a == "i8") {
      dtypes.push_back(a == "f32" ? DType::f32 : a == "bf16" ? DType::bf16 : a == "f16" ? DType::f16 : DType::i8);
    } else {
      std::fprintf(stderr, "usage: decode_rate [f32|bf16|f16|i8 ...] [--lengths L ...] [--hkv H] [--calls N] [--precision f32|bf16] [--splits S]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (dtypes.empty()) dtypes = {DType::f32, DType::bf16, DType::i8};
  if (lengths.empty()) lengths = {512, 8192};
  attn::set_num_threads(1);
  const attn::bench::Peak peak = attn::bench::measure_peak(1);
  std::printf("decode_rate: B=1 Lq=1 Hq=32 Hkv=%d d=128, 1 thread, %d split(s) (0: automatic), precision %s; FMA peak %.1f GFLOP/s (%s)\n",
              hkv, splits, precision == attn::Precision::bf16 ? "bf16" : "f32", peak.f32_gflops, peak.isa);
  std::printf("| cache | L | us/call | GFLOP/s | of FMA peak |\n|---|---:|---:|---:|---:|\n");
  std::mt19937 rng(2026);
  for (DType dt : dtypes) {
    for (int L : lengths) {
      const int n = calls > 0 ? calls : std::max(3, 200 * 512 / L);
      const Rate r = time_decode(dt, L, hkv, n, precision, splits, rng);
      std::printf("| %s | %d | %.1f | %.1f | %.0f%% |\n", attn::dtype_name(dt), L, r.us_per_call, r.gflops,
                  100.0 * r.gflops / peak.f32_gflops);
    }
  }
}
