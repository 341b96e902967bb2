// avx2_decode_loops: the decode kernel's two inner loops (src/cpu/attention_decode.cc)
// in isolation on an AVX2 core, on L1-resident data, as a fraction of the FMA peak —
// the ceiling each loop shape can reach before memory or the code around it counts.
// It is how the shapes the kernel uses on AVX2 were chosen (issue 12, Zen 1 2026-11-26):
//   P·V   o[r] += Σ_k p[r][k]·v_k, 4 query rows (a GQA group of 4), 128 columns:
//         every row's accumulators in registers (4 rows × 2 vectors), NK keys a pass;
//   Q·Kᵀ  4 rows × NK keys of dot products over d = 128, one accumulator each.
// bf16 values are widened either as PromoteTo does (vpmovzxwd + vpslld per 8) or two
// per 32-bit lane (shift / mask per 16: "pairs", the kernel's Bf16Pairs); query
// vectors either folded into the FMAs as memory operands or kept in a register.
//
// usage: avx2_decode_loops   (x86 with AVX2 and FMA; one thread)
#include <immintrin.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "peak.hpp"
#include "timing.hpp"

namespace {

constexpr int kD = 128;        // head dim
constexpr int kRowStride = kD; // query / output rows
constexpr int kKeyStride = 1024;  // elements between key rows (a token row of 8 heads)

#define AVX2 __attribute__((noinline, target("avx2,fma")))

__attribute__((target("avx2,fma"), always_inline)) inline __m256 WidenBf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

__attribute__((target("avx2,fma,f16c"), always_inline)) inline __m256 WidenF16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

/// P·V with f16 values (vcvtph2ps per 8), 4 rows × 2 vectors of accumulators.
template <int NK>
__attribute__((noinline, target("avx2,fma,f16c"))) void PvF16(const float* p, const uint16_t* vals, float* o, int passes) {
  for (int pass = 0; pass < passes; ++pass) {
    for (int x = 0; x < kD; x += 16) {
      __m256 a0[4], a1[4];
      for (int r = 0; r < 4; ++r) a0[r] = _mm256_loadu_ps(o + r * kRowStride + x), a1[r] = _mm256_loadu_ps(o + r * kRowStride + x + 8);
      for (int k = 0; k < NK; ++k) {
        const __m256 v0 = WidenF16(vals + k * kKeyStride + x), v1 = WidenF16(vals + k * kKeyStride + x + 8);
        for (int r = 0; r < 4; ++r) {
          const __m256 pk = _mm256_broadcast_ss(p + r * 64 + k);
          a0[r] = _mm256_fmadd_ps(pk, v0, a0[r]), a1[r] = _mm256_fmadd_ps(pk, v1, a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + r * kRowStride + x, a0[r]), _mm256_storeu_ps(o + r * kRowStride + x + 8, a1[r]);
    }
  }
}

/// Q·Kᵀ with f16 keys, 4 rows × 2 keys; q folded or in a register.
template <bool kInRegister>
__attribute__((noinline, target("avx2,fma,f16c"))) void ScoreF16(const float* q, const uint16_t* keys, float* s, int passes) {
  for (int pass = 0; pass < passes; ++pass) {
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int x = 0; x < kD; x += 8) {
      const __m256 k0 = WidenF16(keys + x), k1 = WidenF16(keys + kKeyStride + x);
      for (int r = 0; r < 4; ++r) {
        __m256 qv = _mm256_loadu_ps(q + r * kRowStride + x);
        if constexpr (kInRegister) asm("" : "+x"(qv));
        acc[2 * r] = _mm256_fmadd_ps(qv, k0, acc[2 * r]), acc[2 * r + 1] = _mm256_fmadd_ps(qv, k1, acc[2 * r + 1]);
      }
    }
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(s + i * 8, acc[i]);
  }
}

/// P·V with PromoteTo-style widening (or f32 values), 4 rows × 2 vectors of accumulators.
template <int NK, bool kBf16>
AVX2 void PvPromote(const float* p, const void* vals, float* o, int passes) {
  for (int pass = 0; pass < passes; ++pass) {
    for (int x = 0; x < kD; x += 16) {
      __m256 a0[4], a1[4];
      for (int r = 0; r < 4; ++r) a0[r] = _mm256_loadu_ps(o + r * kRowStride + x), a1[r] = _mm256_loadu_ps(o + r * kRowStride + x + 8);
      for (int k = 0; k < NK; ++k) {
        __m256 v0, v1;
        if constexpr (kBf16) {
          const uint16_t* v = static_cast<const uint16_t*>(vals) + k * kKeyStride + x;
          v0 = WidenBf16(v), v1 = WidenBf16(v + 8);
        } else {
          const float* v = static_cast<const float*>(vals) + k * kKeyStride + x;
          v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8);
        }
        for (int r = 0; r < 4; ++r) {
          const __m256 pk = _mm256_broadcast_ss(p + r * 64 + k);
          a0[r] = _mm256_fmadd_ps(pk, v0, a0[r]), a1[r] = _mm256_fmadd_ps(pk, v1, a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + r * kRowStride + x, a0[r]), _mm256_storeu_ps(o + r * kRowStride + x + 8, a1[r]);
    }
  }
}

/// P·V on bf16 pairs: 16 values per load, even ones by a shift, odd ones by a mask.
template <int NK>
AVX2 void PvPairs(const float* p, const void* vals, float* o, int passes) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int pass = 0; pass < passes; ++pass) {
    for (int x = 0; x < kD; x += 16) {
      __m256 a0[4], a1[4];
      for (int r = 0; r < 4; ++r) a0[r] = _mm256_loadu_ps(o + r * kRowStride + x), a1[r] = _mm256_loadu_ps(o + r * kRowStride + x + 8);
      for (int k = 0; k < NK; ++k) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(vals) + k * kKeyStride + x));
        const __m256 v0 = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16)), v1 = _mm256_castsi256_ps(_mm256_and_si256(both, high));
        for (int r = 0; r < 4; ++r) {
          const __m256 pk = _mm256_broadcast_ss(p + r * 64 + k);
          a0[r] = _mm256_fmadd_ps(pk, v0, a0[r]), a1[r] = _mm256_fmadd_ps(pk, v1, a1[r]);
        }
      }
      for (int r = 0; r < 4; ++r) _mm256_storeu_ps(o + r * kRowStride + x, a0[r]), _mm256_storeu_ps(o + r * kRowStride + x + 8, a1[r]);
    }
  }
}

/// Q·Kᵀ, NR rows × NK keys, PromoteTo-style widening (or f32 keys); q folded by GCC.
template <int NR, int NK, bool kBf16>
AVX2 void ScorePromote(const float* q, const void* keys, float* s, int passes) {
  for (int pass = 0; pass < passes; ++pass) {
    __m256 acc[NR * NK];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int x = 0; x < kD; x += 8) {
      __m256 kv[NK];
      for (int c = 0; c < NK; ++c) {
        kv[c] = kBf16 ? WidenBf16(static_cast<const uint16_t*>(keys) + c * kKeyStride + x)
                      : _mm256_loadu_ps(static_cast<const float*>(keys) + c * kKeyStride + x);
      }
      for (int r = 0; r < NR; ++r) {
        const __m256 qv = _mm256_loadu_ps(q + r * kRowStride + x);
        for (int c = 0; c < NK; ++c) acc[r * NK + c] = _mm256_fmadd_ps(qv, kv[c], acc[r * NK + c]);
      }
    }
    for (int i = 0; i < NR * NK; ++i) _mm256_storeu_ps(s + i * 8, acc[i]);
  }
}

/// Q·Kᵀ on bf16 pairs (q in pair order), the even halves then the odd ones;
/// kInRegister: each query vector loaded once into a register (an empty asm that GCC
/// cannot fold), else GCC folds it into every FMA as a memory operand.
template <int NR, int NK, bool kInRegister>
AVX2 void ScorePairs(const float* q, const void* keys, float* s, int passes) {
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  const uint16_t* k16 = static_cast<const uint16_t*>(keys);
  for (int pass = 0; pass < passes; ++pass) {
    __m256 acc[NR * NK];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int x = 0; x < kD; x += 16) {
      for (int half = 0; half < 2; ++half) {
        __m256 kv[NK];
        for (int c = 0; c < NK; ++c) {
          const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(k16 + c * kKeyStride + x));
          kv[c] = _mm256_castsi256_ps(half == 0 ? _mm256_slli_epi32(both, 16) : _mm256_and_si256(both, high));
        }
        for (int r = 0; r < NR; ++r) {
          __m256 qv = _mm256_loadu_ps(q + r * kRowStride + x + 8 * half);
          if constexpr (kInRegister) asm("" : "+x"(qv));
          for (int c = 0; c < NK; ++c) acc[r * NK + c] = _mm256_fmadd_ps(qv, kv[c], acc[r * NK + c]);
        }
      }
    }
    for (int i = 0; i < NR * NK; ++i) _mm256_storeu_ps(s + i * 8, acc[i]);
  }
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("avx2_decode_loops: this CPU has no AVX2/FMA\n");
    return 0;
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> small(0.0f, 0.02f), unit(-1.0f, 1.0f);
  std::vector<float> p(4 * 64), o(4 * kRowStride), q(4 * kRowStride), s(64 * 8);
  for (float& x : p) x = small(rng);  // softmax weights: no growth over the passes
  for (float& x : q) x = unit(rng);
  std::vector<float> vf(16 * kKeyStride);
  std::vector<uint16_t> vb(16 * kKeyStride);
  for (size_t i = 0; i < vf.size(); ++i) {
    vf[i] = unit(rng);
    uint32_t bits;
    std::memcpy(&bits, &vf[i], 4);
    vb[i] = static_cast<uint16_t>(bits >> 16);
  }
  const double peak = attn::bench::measure_peak(1).f32_gflops;
  std::printf("avx2_decode_loops: FMA peak %.1f GFLOP/s, 1 thread; median of 7 runs\n", peak);
  constexpr int kPasses = 200000;
  auto run = [&](const char* name, auto loop, double flops) {
    loop();
    std::vector<double> t;
    for (int i = 0; i < 7; ++i) {
      std::fill(o.begin(), o.end(), 0.0f);
      const double t0 = attn::bench::now_s();
      loop();
      t.push_back(attn::bench::now_s() - t0);
    }
    const double rate = flops / attn::bench::median(t) * 1e-9;
    std::printf("%-44s %6.1f GFLOP/s  %3.0f%%\n", name, rate, 100.0 * rate / peak);
  };
  const double pv8 = 2.0 * kPasses * 8 * 4 * kD, sc = 2.0 * kPasses * kD;  // one dot product a pass
  run("P·V f32, 8 keys a pass", [&] { PvPromote<8, false>(p.data(), vf.data(), o.data(), kPasses); }, pv8);
  run("P·V bf16 PromoteTo, 8 keys a pass", [&] { PvPromote<8, true>(p.data(), vb.data(), o.data(), kPasses); }, pv8);
  run("P·V bf16 pairs, 8 keys a pass", [&] { PvPairs<8>(p.data(), vb.data(), o.data(), kPasses); }, pv8);
  run("P·V bf16 pairs, 16 keys a pass", [&] { PvPairs<16>(p.data(), vb.data(), o.data(), kPasses / 2); }, pv8);
  run("P·V f16, 8 keys a pass", [&] { PvF16<8>(p.data(), vb.data(), o.data(), kPasses); }, pv8);
  run("P·V f16, 16 keys a pass", [&] { PvF16<16>(p.data(), vb.data(), o.data(), kPasses / 2); }, pv8);
  run("Q·Kᵀ f16, 4 x 2, q folded", [&] { ScoreF16<false>(q.data(), vb.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ f16, 4 x 2, q in a register", [&] { ScoreF16<true>(q.data(), vb.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ f32, 4 rows x 2 keys", [&] { ScorePromote<4, 2, false>(q.data(), vf.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ f32, 4 rows x 3 keys", [&] { ScorePromote<4, 3, false>(q.data(), vf.data(), s.data(), kPasses); }, sc * 12);
  run("Q·Kᵀ bf16 PromoteTo, 4 rows x 2 keys", [&] { ScorePromote<4, 2, true>(q.data(), vb.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ bf16 PromoteTo, 2 rows x 4 keys", [&] { ScorePromote<2, 4, true>(q.data(), vb.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ bf16 pairs, 4 x 2, q folded", [&] { ScorePairs<4, 2, false>(q.data(), vb.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ bf16 pairs, 4 x 2, q in a register", [&] { ScorePairs<4, 2, true>(q.data(), vb.data(), s.data(), kPasses); }, sc * 8);
  run("Q·Kᵀ bf16 pairs, 4 x 3, q in a register", [&] { ScorePairs<4, 3, true>(q.data(), vb.data(), s.data(), kPasses); }, sc * 12);
}
