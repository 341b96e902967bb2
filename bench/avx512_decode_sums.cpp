// avx512_decode_sums: what the decode kernel's score pass pays to sum its accumulators'
// lanes on an AVX-512 core with AVX512-BF16 (issue 12, Zen 4, 2026-11-29). Two parts:
//   1. Which shuffles share the pipes of vdpbf16ps: loops of 12 independent chains,
//      half vdpbf16ps and half another operation, timed against vdpbf16ps alone. A
//      pair that costs 1.0× a lone vdpbf16ps hides the other operation entirely; 2.0×
//      serialises it.
//   2. The kernel's bf16 pass of 4 query rows × 4 keys over d = 128 (64 vdpbf16ps, 16
//      accumulators; keys and queries in L1), with its 16 lane sums done three ways:
//      ConcatEven/ConcatOdd rounds (30 vpermt2ps, the kernel before), rounds within
//      128-bit blocks then block shuffles (24 interleaves + 6 vshuff32x4,
//      BlockTransposedSums in src/cpu/decode_scores-inl.h), and a chain of 15 adds
//      (wrong sums; the products' own time).
//
// usage: avx512_decode_sums   (x86 with AVX-512 F/BW and AVX512-BF16; one thread)
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "timing.hpp"

namespace {

using attn::bench::median;
using attn::bench::now_s;

#define BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// --- 1. pairing ------------------------------------------------------------------

enum class Op { dp, permt2, shuf, blend, unpck, permil, add };

template <Op kOp>
BF16 __attribute__((always_inline)) inline __m512 Apply(__m512 x, __m512 b, __m512i idx) {
  if constexpr (kOp == Op::dp) {
    return _mm512_dpbf16_ps(x, reinterpret_cast<__m512bh>(b), reinterpret_cast<__m512bh>(b));
  } else if constexpr (kOp == Op::permt2) {
    return _mm512_permutex2var_ps(x, idx, b);
  } else if constexpr (kOp == Op::shuf) {
    return _mm512_shuffle_f32x4(x, b, 0x4e);
  } else if constexpr (kOp == Op::blend) {
    return _mm512_mask_blend_ps(0xff00, x, b);
  } else if constexpr (kOp == Op::unpck) {
    return _mm512_unpacklo_ps(x, b);
  } else if constexpr (kOp == Op::permil) {
    return _mm512_permute_ps(x, 0xb1);
  } else {
    return _mm512_add_ps(x, b);
  }
}

/// Seconds per iteration of 6 `first` and 6 `second` operations on 12 chains. Named
/// variables, not an array: GCC stored an array's 12 vectors on every iteration.
template <Op kFirst, Op kSecond>
BF16 __attribute__((noinline)) double PairLoop(long iters) {
  const __m512 b = _mm512_set1_ps(0.5f);
  const __m512i idx = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  __m512 a0 = _mm512_set1_ps(1.0f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
         a10 = a0, a11 = a0;
  const double t0 = now_s();
  for (long it = 0; it < iters; ++it) {
    a0 = Apply<kFirst>(a0, b, idx), a1 = Apply<kSecond>(a1, b, idx);
    a2 = Apply<kFirst>(a2, b, idx), a3 = Apply<kSecond>(a3, b, idx);
    a4 = Apply<kFirst>(a4, b, idx), a5 = Apply<kSecond>(a5, b, idx);
    a6 = Apply<kFirst>(a6, b, idx), a7 = Apply<kSecond>(a7, b, idx);
    a8 = Apply<kFirst>(a8, b, idx), a9 = Apply<kSecond>(a9, b, idx);
    a10 = Apply<kFirst>(a10, b, idx), a11 = Apply<kSecond>(a11, b, idx);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                 "+v"(a9), "+v"(a10), "+v"(a11));
  }
  const double s = (now_s() - t0) / static_cast<double>(iters);
  const __m512 all = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                   _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  if (_mm512_reduce_add_ps(_mm512_add_ps(all, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)))) == 1234.5f) {
    std::printf(" ");
  }
  return s;
}

template <Op kSecond>
double PairCost(long iters) {
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) t.push_back(PairLoop<Op::dp, kSecond>(iters));
  return median(t);
}

// --- 2. the 4 x 4 score pass ---------------------------------------------------------

constexpr int kD = 128;
constexpr int kKeyStride = 1024;  // a token row of 8 kv heads

enum class Sums { permutes, blocks, chain };

BF16 __attribute__((always_inline)) inline __m512 PermuteSums(__m512* x) {
  const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
#pragma GCC unroll 16
  for (int n = 16; n > 1; n /= 2) {
#pragma GCC unroll 16
    for (int i = 0; i < n / 2; ++i) {
      x[i] = _mm512_add_ps(_mm512_permutex2var_ps(x[2 * i], even, x[2 * i + 1]),
                           _mm512_permutex2var_ps(x[2 * i], odd, x[2 * i + 1]));
    }
  }
  return x[0];
}

BF16 __attribute__((always_inline)) inline __m512 BlockSums(const __m512* x) {
  __m512 t[8], u[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) t[i] = _mm512_add_ps(_mm512_unpacklo_ps(x[2 * i], x[2 * i + 1]), _mm512_unpackhi_ps(x[2 * i], x[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(t[2 * i]), hi = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Blocks (0, 2) + (1, 3) of each pair, twice.
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

template <Sums kSums>
BF16 __attribute__((noinline)) void Pass(const uint16_t* q, const uint16_t* const* keys, float* s) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int x = 0; x < kD; x += 32) {
    __m512bh kv[4];
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) kv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(keys[c] + x));
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + r * kD + x));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) acc[r * 4 + c] = _mm512_dpbf16_ps(acc[r * 4 + c], qv, kv[c]);
    }
  }
  __m512 sums;
  if constexpr (kSums == Sums::permutes) {
    sums = PermuteSums(acc);
  } else if constexpr (kSums == Sums::blocks) {
    sums = BlockSums(acc);
  } else {
    sums = acc[0];
    for (int i = 1; i < 16; ++i) sums = _mm512_add_ps(sums, acc[i]);
  }
  _mm512_storeu_ps(s, sums);
}

/// Nanoseconds per pass, over 16 tokens × 8 heads of keys (32 KiB, in L1; the heads
/// rotate as the kernel's do), median of 5.
template <Sums kSums>
double PassTime(const std::vector<uint16_t>& keys, const std::vector<uint16_t>& q, float* s, long passes) {
  std::vector<double> t;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now_s();
    for (long it = 0; it < passes; ++it) {
      const int tok = static_cast<int>((it * 4) & 15), head = static_cast<int>((it >> 2) & 7);
      const uint16_t* k[4];
      for (int c = 0; c < 4; ++c) k[c] = keys.data() + (tok + c) * kKeyStride + head * kD;
      Pass<kSums>(q.data(), k, s + (it & 15) * 16);
    }
    t.push_back((now_s() - t0) / static_cast<double>(passes) * 1e9);
  }
  return median(t);
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
      !__builtin_cpu_supports("avx512bf16")) {
    std::fprintf(stderr, "avx512_decode_sums: this CPU has no AVX-512 F/BW with AVX512-BF16\n");
    return 2;
  }
  constexpr long kIters = 20'000'000;
  const double dp = PairCost<Op::dp>(kIters);
  const double dp_ns = dp / 12 * 1e9;  // one vdpbf16ps
  std::printf("1. vdpbf16ps + X on 12 chains, against vdpbf16ps alone (%.3f ns each):\n\n", dp_ns);
  std::printf("| X | time of the pair / two vdpbf16ps | X's cost in vdpbf16ps slots |\n|---|---:|---:|\n");
  const auto row = [&](const char* name, double t) { std::printf("| %s | %.2f | %.2f |\n", name, t / dp, 2 * t / dp - 1); };
  row("vdpbf16ps", dp);
  row("vpermt2ps", PairCost<Op::permt2>(kIters));
  row("vshuff32x4", PairCost<Op::shuf>(kIters));
  row("vblendmps", PairCost<Op::blend>(kIters));
  row("vunpcklps", PairCost<Op::unpck>(kIters));
  row("vpermilps", PairCost<Op::permil>(kIters));
  row("vaddps", PairCost<Op::add>(kIters));

  std::vector<uint16_t> keys(16 * kKeyStride), q(4 * kD);
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = static_cast<uint16_t>(0x3f80 + (i * 7919) % 127);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint16_t>(0xbf00 + (i * 104729) % 255);
  std::vector<float> s(16 * 16);
  // The two real sums agree (up to the order of f32 additions).
  std::vector<float> a(16), b(16);
  const uint16_t* k0[4] = {keys.data(), keys.data() + kKeyStride, keys.data() + 2 * kKeyStride, keys.data() + 3 * kKeyStride};
  Pass<Sums::permutes>(q.data(), k0, a.data());
  Pass<Sums::blocks>(q.data(), k0, b.data());
  for (int i = 0; i < 16; ++i) {
    if (std::abs(a[i] - b[i]) > 1e-4f * (1.0f + std::abs(a[i]))) {
      std::fprintf(stderr, "avx512_decode_sums: the two sums disagree at lane %d: %g vs %g\n", i, a[i], b[i]);
      return 1;
    }
  }
  constexpr long kPasses = 4'000'000;
  const double chain = PassTime<Sums::chain>(keys, q, s.data(), kPasses);
  std::printf("\n2. The bf16 score pass, 4 rows x 4 keys, d = 128 (64 vdpbf16ps), keys in L1:\n\n");
  std::printf("| lane sums | ns per pass | in vdpbf16ps slots |\n|---|---:|---:|\n");
  const auto pass_row = [&](const char* name, double ns) { std::printf("| %s | %.1f | %.0f |\n", name, ns, ns / dp_ns); };
  pass_row("ConcatEven/ConcatOdd rounds (30 vpermt2ps)", PassTime<Sums::permutes>(keys, q, s.data(), kPasses));
  pass_row("128-bit-block rounds + 6 vshuff32x4 (the kernel's)", PassTime<Sums::blocks>(keys, q, s.data(), kPasses));
  pass_row("a chain of adds (wrong sums: the products alone)", chain);
  return 0;
}
