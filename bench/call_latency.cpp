// call_latency [--threads T]: what one call costs at short lengths, where the fixed work
// around a kernel (argument checks, packing, padding, finishing rows) is most of it.
// Per call, in µs, medians of 7 batches after a warm-up batch, on random inputs:
//   forward and backward, f32 and bf16, B = 1, H = 8, d = 64, N in {1, 16, 64, 256};
//   attention_with_kvcache, Lq = 1, Hq = 32, Hkv = 8, d = 128, a contiguous cache of
//   L in {64, 256, 1024} tokens (bf16, i8, f32), one split, no append;
//   with --few-queries instead: attention() with Lq in {1, 4, 8} queries against
//   Lk in {64, 256, 1024, 4096} keys (B = 1, H = 8, d = 64 and 128, f32 and bf16), on
//   the decode kernel (the default for these calls, kvcache/few_queries.hpp) and on
//   the tiled kernels (ATTN_FEW_QUERIES=0), the two alternating row by row.
// docs/PERFORMANCE.md ("Short sequences: the work around the kernels") quotes it; the
// kernels' own rates are `attn bench` and bench_decode.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "attn/tensor.hpp"
#include "timing.hpp"

namespace {

using attn::DType;
using attn::Tensor;

/// Uniform values in [-1, 1) in t's dtype (f32 or bf16), i8 codes in [-127, 127].
void fill(Tensor& t, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float x = u(rng);
    if (t.dtype() == DType::f32) {
      t.data_as<float>()[i] = x;
    } else if (t.dtype() == DType::bf16) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      static_cast<uint16_t*>(t.data())[i] = static_cast<uint16_t>(bits >> 16);
    } else {
      static_cast<int8_t*>(t.data())[i] = static_cast<int8_t>(x * 127.0f);
    }
  }
}

/// Median µs per call of fn over 7 batches of `calls` calls, after one warm-up batch.
double per_call_us(const std::function<void()>& fn, int calls) {
  std::vector<double> batches;
  for (int batch = 0; batch < 8; ++batch) {
    const double t0 = attn::bench::now_s();
    for (int i = 0; i < calls; ++i) fn();
    if (batch > 0) batches.push_back((attn::bench::now_s() - t0) / calls * 1e6);
  }
  return attn::bench::median(batches);
}

void attention_rows(std::mt19937& rng) {
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int n : {1, 16, 64, 256}) {
      const std::vector<int64_t> shape{1, n, 8, 64};
      Tensor q(dt, shape), k(dt, shape), v(dt, shape), out(dt, shape), dout(dt, shape);
      Tensor dq(dt, shape), dk(dt, shape), dv(dt, shape), lse(DType::f32, {1, 8, n});
      for (Tensor* t : {&q, &k, &v, &dout}) fill(*t, rng);
      const int calls = std::max(10, 20000 / n);
      const double fwd = per_call_us([&] { attn::attention(q, k, v, out, {}, lse); }, calls);
      const double bwd = per_call_us([&] { attn::attention_backward(q, k, v, out, lse, dout, dq, dk, dv); }, calls);
      std::printf("| attention | %s | N = %d | %.2f | %.2f |\n", attn::dtype_name(dt), n, fwd, bwd);
    }
  }
}

void decode_rows(std::mt19937& rng) {
  for (DType cache : {DType::bf16, DType::i8, DType::f32}) {
    for (int len : {64, 256, 1024}) {
      Tensor kc(cache, {1, len, 8, 128}), vc(cache, {1, len, 8, 128});
      fill(kc, rng);
      fill(vc, rng);
      attn::KVCache kv;
      kv.k = kc;
      kv.v = vc;
      Tensor ks, vs;
      if (cache == DType::i8) {
        ks = Tensor(DType::f32, {1, len, 8});
        vs = Tensor(DType::f32, {1, len, 8});
        for (Tensor* t : {&ks, &vs}) {
          for (int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = 0.01f * static_cast<float>(1 + i % 7);
        }
        kv.k_scale = ks;
        kv.v_scale = vs;
      }
      Tensor seqlens(DType::i32, {1});
      seqlens.data_as<int32_t>()[0] = len;
      const DType qt = cache == DType::f32 ? DType::f32 : DType::bf16;
      Tensor q(qt, {1, 1, 32, 128}), out(qt, {1, 1, 32, 128});
      fill(q, rng);
      attn::KVCacheOptions opt;
      opt.num_splits = 1;
      attn::AttentionOptions ao;
      ao.causal = attn::Causal::BottomRight;
      const double us = per_call_us([&] { attn::attention_with_kvcache(q, kv, seqlens, out, ao, opt); },
                                    std::max(10, 100000 / len));
      std::printf("| attention_with_kvcache | %s cache | L = %d | %.2f | |\n", attn::dtype_name(cache), len, us);
    }
  }
}

/// attention() with a few queries, on the decode kernel and on the tiled kernels.
void few_query_rows(std::mt19937& rng) {
  std::printf("| dtype | d | Lk | Lq | decode kernel µs | tiled kernels µs | tiled / decode |\n"
              "|---|---:|---:|---:|---:|---:|---:|\n");
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int d : {64, 128}) {
      for (int lk : {64, 256, 1024, 4096}) {
        for (int lq : {1, 4, 8}) {
          Tensor q(dt, {1, lq, 8, d}), k(dt, {1, lk, 8, d}), v(dt, {1, lk, 8, d}), out(dt, {1, lq, 8, d});
          Tensor lse(DType::f32, {1, 8, lq});
          for (Tensor* t : {&q, &k, &v}) fill(*t, rng);
          const int calls = std::max(5, 400000 / (lk * (lq + 16)));
          auto run = [&] { attn::attention(q, k, v, out, {}, lse); };
          // 8 queries take the decode kernel from 256 keys on; below that both columns
          // are the tiled kernels.
          const double decode = per_call_us(run, calls);
          setenv("ATTN_FEW_QUERIES", "0", 1);
          const double tiled = per_call_us(run, calls);
          unsetenv("ATTN_FEW_QUERIES");
          std::printf("| %s | %d | %d | %d | %.1f | %.1f | %.2f |\n", attn::dtype_name(dt), d, lk, lq, decode, tiled,
                      tiled / decode);
        }
      }
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  bool few_queries = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (arg == "--few-queries") {
      few_queries = true;
    } else {
      std::fprintf(stderr, "usage: call_latency [--threads T] [--few-queries]  (default 1 thread)\n");
      return arg == "--help" || arg == "-h" ? 0 : 2;
    }
  }
  if (threads < 1) {
    std::fprintf(stderr, "call_latency: --threads must be >= 1\n");
    return 2;
  }
  attn::set_num_threads(threads);
  std::mt19937 rng(20261125);
  std::printf("threads %d; µs per call\n\n", threads);
  if (few_queries) {
    few_query_rows(rng);
    return 0;
  }
  std::printf("| call | dtype | size | forward (or step) | backward |\n|---|---|---|---:|---:|\n");
  attention_rows(rng);
  decode_rows(rng);
}
