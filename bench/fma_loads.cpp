// fma_loads: what loads issued beside 512-bit FMAs cost in FMA throughput on this
// core — the reason (issue 11) why the f32 kernel's register-blocked products stay
// near 80% of the FMA peak on an Intel Xeon with AMX while they reach ~90% on Zen 5.
// Each row runs 16 independent FMA chains (enough to cover 4 cycles of latency on
// 2 pipes) and adds, per 16 FMAs, a number of 64-byte loads and of 4-byte broadcast
// loads from L1 that feed them; then the kernel's own shapes: an R-row × 4-vector
// register block of S = Q·Kᵀ over an L1-resident K panel (R = 4 is the kernel's,
// R = 6 the largest that fits 32 registers). Rates are relative to the
// register-only row of the same run, which is the FMA peak that bench/peak reports.
//
// usage: fma_loads   (AVX-512 CPUs only; one thread)
#include <immintrin.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include "timing.hpp"

namespace {

using attn::bench::now_s;

constexpr long kIters = 20'000'000;

/// FMA instructions per second for 16 chains per iteration with `vloads` vector
/// loads and `bloads` broadcasts (each at most 4) feeding them.
template <int kVLoads, int kBLoads>
__attribute__((target("avx512f"), noinline)) double ChainsWithLoads(const float* buf) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_ps(0.001f * static_cast<float>(i));
  const __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
  const double t0 = now_s();
  for (long it = 0; it < kIters; ++it) {
    // The address depends on the iteration so the loads cannot be hoisted.
    const float* p = buf + (it & 63) * 64;
    __m512 x[4] = {a, a, a, a}, y[4] = {b, b, b, b};
    for (int i = 0; i < kVLoads; ++i) x[i] = _mm512_load_ps(p + i * 16);
    for (int i = 0; i < kBLoads; ++i) y[i] = _mm512_set1_ps(p[1024 + i * 64 + (it & 15)]);  // < 8192 floats
    for (int r = 0; r < 4; ++r) {
      for (int v = 0; v < 4; ++v) acc[r * 4 + v] = _mm512_fmadd_ps(y[r], x[v], acc[r * 4 + v]);
    }
  }
  const double dt = now_s() - t0;
  __m512 s = acc[0];
  for (int i = 1; i < 16; ++i) s = _mm512_add_ps(s, acc[i]);
  volatile float sink = _mm512_reduce_add_ps(s);
  (void)sink;
  return 16.0 * kIters / dt;
}

/// FMA instructions per second of S[R][64] = Q[R][d]·K[d][64] (K an L1-resident
/// [d][64] panel, Q rows broadcast element by element), the f32 kernel's QkBlock.
template <int R>
__attribute__((target("avx512f"), noinline)) void ScoreBlock(const float* q, const float* k, int d, float* s) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  for (int c = 0; c < d; ++c) {
    __m512 kv[4];
    for (int v = 0; v < 4; ++v) kv[v] = _mm512_load_ps(k + c * 64 + v * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 qv = _mm512_set1_ps(q[r * d + c]);
      for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_fmadd_ps(qv, kv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) _mm512_store_ps(s + r * 64 + v * 16, acc[r][v]);
  }
}

template <int R>
double ScoreBlockRate(const float* q, const float* k, int d, float* s) {
  const long reps = kIters * 16 / (R * 4 * d);
  const double t0 = now_s();
  for (long i = 0; i < reps; ++i) ScoreBlock<R>(q, k, d, s);
  return static_cast<double>(reps) * R * 4 * d / (now_s() - t0);
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx512f")) {
    std::printf("fma_loads: this CPU has no AVX-512; nothing to measure\n");
    return 0;
  }
  // 64-byte aligned, L1-resident, random-ish values (never zeros: no shortcut).
  auto* buf = static_cast<float*>(std::aligned_alloc(64, 8192 * sizeof(float)));
  auto* q = static_cast<float*>(std::aligned_alloc(64, 6 * 128 * sizeof(float)));
  auto* k = static_cast<float*>(std::aligned_alloc(64, 128 * 64 * sizeof(float)));
  auto* s = static_cast<float*>(std::aligned_alloc(64, 6 * 64 * sizeof(float)));
  for (int i = 0; i < 8192; ++i) buf[i] = 0.5f + static_cast<float>(i % 97) / 97.0f;
  for (int i = 0; i < 6 * 128; ++i) q[i] = static_cast<float>(i % 13) / 13.0f - 0.5f;
  for (int i = 0; i < 128 * 64; ++i) k[i] = static_cast<float>(i % 31) / 31.0f - 0.5f;

  // Once to warm the core up to its AVX-512 clock, then the reference rate.
  ChainsWithLoads<0, 0>(buf);
  const double peak = ChainsWithLoads<0, 0>(buf);
  std::printf("1 thread, 512-bit FMAs; %% of the register-only rate (%.2f G FMA instr/s = %.1f GFLOP/s)\n",
              peak / 1e9, peak * 32 / 1e9);
  std::printf("%-44s %8s\n", "per 16 FMAs", "rate");
  auto row = [&](const char* what, double rate) { std::printf("%-44s %7.0f%%\n", what, 100.0 * rate / peak); };
  row("no loads", ChainsWithLoads<0, 0>(buf));
  row("4 vector loads", ChainsWithLoads<4, 0>(buf));
  row("4 broadcast loads", ChainsWithLoads<0, 4>(buf));
  row("2 vector + 2 broadcast loads", ChainsWithLoads<2, 2>(buf));
  row("4 vector + 4 broadcast loads", ChainsWithLoads<4, 4>(buf));
  for (int d : {64, 128}) {
    char label[64];
    std::snprintf(label, sizeof label, "score block 4 rows x 64 keys, d=%d", d);
    row(label, ScoreBlockRate<4>(q, k, d, s));
    std::snprintf(label, sizeof label, "score block 6 rows x 64 keys, d=%d", d);
    row(label, ScoreBlockRate<6>(q, k, d, s));
  }
  std::free(buf), std::free(q), std::free(k), std::free(s);
  return 0;
}
