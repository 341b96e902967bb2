// Peak FMA / bf16-dot / AMX microbenchmark (see peak.hpp). Hand-written intrinsics on
// purpose: this must emit exactly one instruction per accumulator per step,
// whatever a SIMD library would choose. Behind CPU-feature checks, as the bf16
// instruction is not in Debian's Highway 1.0.3.
#include "peak.hpp"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <chrono>
#include <vector>

#include "attn/attention.hpp"

namespace attn::bench {
namespace {

constexpr int kChains = 16;  // independent accumulators: > latency (4) × pipes (2)

// Runs `iters` steps of kChains FMAs on 16-lane vectors; returns a value that
// depends on every chain so the compiler keeps them all.
__attribute__((target("avx512f"))) float fma_loop_avx512(long iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_fmadd_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

__attribute__((target("avx512f,avx512bf16"))) float bf16_loop_avx512(long iters) {
  __m512 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  const __m512bh a = (__m512bh)_mm512_set1_epi16(0x3f80);  // bf16 1.0
  const __m512bh b = (__m512bh)_mm512_set1_epi16(0x3380);  // bf16 ~6e-8
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
  }
  __m512 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_ps(s, acc[i]);
  return _mm512_reduce_add_ps(s);
}

// vpdpwssd, as an asm statement that adds in place, as the decode kernel's integer
// passes issue it (MulPairsAdd): through the intrinsic GCC 12 copied every accumulator
// and spilled one at each step (16 vpdpwssd and 17 moves per iteration), which
// reported 155–262 GOP/s on an Ice Lake Xeon that issues two vpdpwssd per cycle
// (~355 at 2.77 GHz). By value: an asm operand that is an array element kept the
// whole array on the stack.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

__attribute__((target("avx512f,avx512bw,avx512vnni"))) int int16_loop_avx512(long iters) {
  __m512i acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm512_set1_epi32(i);
  const __m512i a = _mm512_set1_epi16(3), b = _mm512_set1_epi16(-5);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = dpwssd(acc[i], a, b);
  }
  // Summed as unsigned: the sums wrap by design (vpdpwssd does), which is
  // undefined for the signed adds of _mm512_reduce_add_epi32 (UBSan said so).
  alignas(64) uint32_t lanes[16];
  __m512i s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm512_add_epi32(s, acc[i]);
  _mm512_store_si512(lanes, s);
  uint32_t total = 0;
  for (const uint32_t x : lanes) total += x;
  return static_cast<int>(total & 0x7FFFFFFFu);
}

// AMX: four independent accumulator tiles (tdpbf16ps has ~4× its issue interval of
// latency) fed by two A and two B tiles that stay in registers; each instruction is
// 16×16 outputs × 32 products × 2 flops.
__attribute__((target("amx-tile,amx-bf16"))) float amx_loop(long iters) {
  alignas(64) uint8_t cfg[64] = {};
  cfg[0] = 1;
  for (int t = 0; t < 8; ++t) cfg[16 + 2 * t] = 64, cfg[48 + t] = 16;
  __asm__ volatile("" : : "r"(cfg) : "memory");  // GCC 12: see attention_forward_amx.cc
  _tile_loadconfig(cfg);
  alignas(64) uint16_t a[16 * 32];
  alignas(64) float c[16 * 16];
  for (int i = 0; i < 16 * 32; ++i) a[i] = i % 3 == 0 ? 0x3f80 : 0x3380;  // bf16 1.0, ~6e-8
  _tile_loadd(4, a, 64);
  _tile_loadd(5, a, 64);
  _tile_loadd(6, a, 64);
  _tile_loadd(7, a, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long it = 0; it < iters; ++it) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float sum = 0;
  _tile_stored(0, c, 64);
  sum += c[0];
  _tile_stored(3, c, 64);
  sum += c[255];
  _tile_release();
  return sum;
}

__attribute__((target("avx2,fma"))) float fma_loop_avx2(long iters) {
  __m256 acc[kChains];
  for (int i = 0; i < kChains; ++i) acc[i] = _mm256_set1_ps(0.001f * i);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  for (long it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kChains; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
  }
  __m256 s = acc[0];
  for (int i = 1; i < kChains; ++i) s = _mm256_add_ps(s, acc[i]);
  float out[8];
  _mm256_storeu_ps(out, s);
  return out[0] + out[7];
}

volatile float g_sink;

// Median GFLOP/s of `fn` run by `threads` threads, each doing `iters` steps
// worth `flops_per_iter` flops.
template <class Fn>
double rate(Fn fn, double flops_per_iter, int threads, double seconds) {
  // Calibrate the iteration count to ~seconds/5 per run.
  long iters = 1 << 16;
  for (;;) {
    const auto t0 = std::chrono::steady_clock::now();
    g_sink = fn(iters);
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt > seconds / 5 || iters > (1L << 40)) break;
    iters *= 2;
  }
  std::vector<double> runs;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
    { g_sink = fn(iters); }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    runs.push_back(flops_per_iter * iters * threads / dt * 1e-9);
  }
  std::sort(runs.begin(), runs.end());
  return runs[runs.size() / 2];
}

}  // namespace

Peak measure_peak(int threads, double seconds) {
  Peak p;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) {
    p.isa = "avx512";
    p.f32_gflops = rate(fma_loop_avx512, kChains * 16 * 2.0, threads, seconds);
    if (__builtin_cpu_supports("avx512bf16")) {
      p.bf16_gflops = rate(bf16_loop_avx512, kChains * 16 * 4.0, threads, seconds);
    }
    if (__builtin_cpu_supports("avx512vnni")) p.int16_gops = rate(int16_loop_avx512, kChains * 16 * 4.0, threads, seconds);
    // cpu_info() also asks Linux for the tile state; without it tdpbf16ps faults.
    if (attn::cpu_info().amx_bf16) p.amx_bf16_gflops = rate(amx_loop, 4 * 16 * 16 * 32 * 2.0, threads, seconds);
  } else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    p.isa = "avx2";
    p.f32_gflops = rate(fma_loop_avx2, kChains * 8 * 2.0, threads, seconds);
  } else {
    p.isa = "scalar";
  }
  return p;
}

}  // namespace attn::bench
