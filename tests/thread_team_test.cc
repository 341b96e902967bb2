// Calls made from inside the caller's own OpenMP parallel region (one call per thread
// of the caller's team, as an inference server parallel over requests makes them):
// each must give bitwise what the same call gives alone. Until RunOnThreads gave such
// calls a team of their own, the kernels' worksharing bound to the caller's team and
// dealt one call's work out to threads running other calls: calls small enough for
// one thread came out wrong (found 2026-11-29).
#include <gtest/gtest.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "attn/kvcache.hpp"

namespace attn {
namespace {

constexpr int kCallers = 4;  // threads of the caller's team, each with its own problem

/// Random values (normal), as f32, or as bf16 bit patterns when bf16.
std::vector<float> Random(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> x(n);
  for (float& e : x) e = normal(rng);
  return x;
}
std::vector<uint16_t> ToBf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    uint32_t u;
    std::memcpy(&u, &x[i], 4);
    y[i] = static_cast<uint16_t>(u >> 16);
  }
  return y;
}

/// call(t, out) computes problem t into out (bytes); every problem alone, then all of
/// them at once from a parallel region of kCallers threads, on `threads` kernel threads.
void ExpectSameInsideAParallelRegion(int threads, size_t out_bytes,
                                     const std::function<void(int, std::vector<unsigned char>&)>& call) {
  std::vector<std::vector<unsigned char>> alone(kCallers, std::vector<unsigned char>(out_bytes)), inside = alone;
  testing::with_threads(threads, [&] {
    for (int t = 0; t < kCallers; ++t) call(t, alone[t]);
    for (int rep = 0; rep < 5; ++rep) {
#pragma omp parallel num_threads(kCallers)
      call(omp_get_thread_num(), inside[omp_get_thread_num()]);
      for (int t = 0; t < kCallers; ++t) EXPECT_EQ(alone[t], inside[t]) << "caller " << t << ", round " << rep;
    }
  });
}

TEST(CallsFromTheCallersParallelRegion, ForwardAndBackwardGiveWhatTheyGiveAlone) {
  for (DType dt : {DType::f32, DType::bf16}) {
    for (int L : {1, 3, 20, 64, 300}) {
      for (int threads : {1, 2}) {
        const int H = 2, d = 32;
        const size_t n = size_t(L) * H * d, es = dt == DType::f32 ? 4 : 2;
        std::vector<std::vector<float>> x(kCallers);
        std::vector<std::vector<uint16_t>> xb(kCallers);
        for (int t = 0; t < kCallers; ++t) {
          x[t] = Random(4 * n, 100 * L + t);
          xb[t] = ToBf16(x[t]);
        }
        auto view = [&](int t, int i) {
          void* base = dt == DType::f32 ? static_cast<void*>(x[t].data() + i * n) : xb[t].data() + i * n;
          return TensorView(base, dt, {1, L, H, d});
        };
        SCOPED_TRACE(::testing::Message() << (dt == DType::f32 ? "f32" : "bf16") << " L=" << L << " threads=" << threads);
        AttentionOptions o;
        o.causal = Causal::TopLeft;
        // Forward: out and lse.
        ExpectSameInsideAParallelRegion(threads, n * es + size_t(H) * L * 4, [&](int t, std::vector<unsigned char>& r) {
          attention(view(t, 0), view(t, 1), view(t, 2), TensorView(r.data(), dt, {1, L, H, d}), o,
                    TensorView(r.data() + n * es, DType::f32, {1, H, L}));
        });
        // Backward: dq, dk, dv from each problem's own forward.
        ExpectSameInsideAParallelRegion(threads, 3 * n * es, [&](int t, std::vector<unsigned char>& r) {
          std::vector<unsigned char> out(n * es);
          std::vector<float> lse(size_t(H) * L);
          const TensorView ov(out.data(), dt, {1, L, H, d}), lv(lse.data(), DType::f32, {1, H, L});
          attention(view(t, 0), view(t, 1), view(t, 2), ov, o, lv);
          auto grad = [&](int i) { return TensorView(r.data() + i * n * es, dt, {1, L, H, d}); };
          attention_backward(view(t, 0), view(t, 1), view(t, 2), ov, lv, view(t, 3), grad(0), grad(1), grad(2), o);
        });
      }
    }
  }
}

TEST(CallsFromTheCallersParallelRegion, KVCacheDecodingGivesWhatItGivesAlone) {
  for (int len : {1, 40, 3000}) {
    for (int threads : {1, 2}) {
      const int B = 2, Hq = 8, Hkv = 2, d = 64, cap = len + 1;
      SCOPED_TRACE(::testing::Message() << "len=" << len << " threads=" << threads);
      std::vector<std::vector<float>> q(kCallers), kc(kCallers), vc(kCallers), kn(kCallers), vn(kCallers);
      for (int t = 0; t < kCallers; ++t) {
        q[t] = Random(size_t(B) * Hq * d, 7 * len + t);
        kn[t] = Random(size_t(B) * Hkv * d, 11 * len + t);
        vn[t] = Random(size_t(B) * Hkv * d, 13 * len + t);
        kc[t] = Random(size_t(B) * cap * Hkv * d, 17 * len + t);
        vc[t] = Random(size_t(B) * cap * Hkv * d, 19 * len + t);
      }
      const std::vector<int32_t> seqlens = {len, len - 1 > 0 ? len - 1 : 0};
      ExpectSameInsideAParallelRegion(threads, size_t(B) * Hq * d * 4, [&](int t, std::vector<unsigned char>& r) {
        std::vector<float> k = kc[t], v = vc[t];  // each call appends into its own copy
        KVCache cache;
        cache.k = TensorView(k.data(), DType::f32, {B, cap, Hkv, d});
        cache.v = TensorView(v.data(), DType::f32, {B, cap, Hkv, d});
        KVCacheOptions kv;
        kv.k_new = TensorView(kn[t].data(), DType::f32, {B, 1, Hkv, d});
        kv.v_new = TensorView(vn[t].data(), DType::f32, {B, 1, Hkv, d});
        AttentionOptions o;
        o.causal = Causal::BottomRight;
        attention_with_kvcache(TensorView(q[t].data(), DType::f32, {B, 1, Hq, d}), cache,
                               TensorView(const_cast<int32_t*>(seqlens.data()), DType::i32, {B}),
                               TensorView(r.data(), DType::f32, {B, 1, Hq, d}), o, kv);
      });
    }
  }
}

}  // namespace
}  // namespace attn
