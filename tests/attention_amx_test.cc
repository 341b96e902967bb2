// The bf16 forward kernel (issue 11) on each of its paths, AMX tiles and AVX512-BF16's
// vdpbf16ps, forced with ATTN_ISA; each skipped with a message on machines that
// cannot run it. Every option and odd shapes against the float64 reference
// under FlashAttention's rule: the error is at most 2× that of a plain implementation
// with the same rounding (bf16 inputs, exact softmax, P rounded to bf16 before P·V,
// f32 accumulation, bf16 output), pooled per option, with a 10× screen per case.
// Also: lse, fully masked rows, thread independence, Precision::bf16, NaN inputs
// (declined to the portable path) and the ATTN_ISA errors. f16 inputs on the AMX
// path (hi + lo bf16 pieces) under the same rule with f16 rounding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "lowp_harness.hpp"

namespace attn::testing {
namespace {

// Shapes beyond the portable tests': several 128-key blocks, a partial last block,
// GQA, d = 256, and dv ≠ d.
const Shape kAmxShapes[] = {{1, 1, 1, 1, 1, 16, 16},      {2, 3, 17, 4, 2, 64, 64},   {1, 17, 3, 2, 1, 80, 48},
                            {1, 100, 100, 2, 2, 128, 128}, {2, 33, 65, 3, 1, 32, 40},  {1, 70, 1000, 2, 1, 64, 64},
                            {1, 129, 300, 1, 1, 256, 256}, {1, 1000, 37, 1, 1, 8, 24}};

// Squared errors of one case against the float64 reference.
// Runs one kernel call (path isa) and its yardsticks: the reference (float64 on the bf16 values,
// rounded to f32 once) and the plain bf16 implementation built from the reference's
// probabilities (every option included): out = bf16(Σ_j bf16(P_ij)·v_j), in f32.
CaseErrors run_kernel_case(const char* path, const Shape& s, const OptionCase& oc, std::mt19937_64& rng,
                           DType dtype = DType::bf16) {
  LowpCall c(dtype, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
  OptionStore store;
  const AttentionOptions o = oc.make(store, c, rng);
  const TensorView q = c.view(c.q, s.Lq, s.Hq, s.d), k = c.view(c.k, s.Lk, s.Hkv, s.d),
                   v = c.view(c.v, s.Lk, s.Hkv, s.dv), out = c.view(c.out, s.Lq, s.Hq, s.dv);
  {
    const ScopedIsa isa(path);
    attention(q, k, v, out, o, c.lse_view());
  }
  return compare_forward_with_reference(c, o, store);
}

// Parameter: the kernel path ("amx" or "avx512bf16"), forced with ATTN_ISA.
class Bf16KernelForward : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Paths, Bf16KernelForward, ::testing::ValuesIn(kBf16KernelPaths), PathName);

TEST_P(Bf16KernelForward, EveryOptionWithinTwiceThePlainBf16Error) {
  SKIP_UNLESS_PATH(GetParam());
  std::mt19937_64 rng = make_rng(21);
  for (const OptionCase& oc : option_cases()) {
    ExpectWithinPlainBf16Error(kAmxShapes, oc, [&](const Shape& s) { return run_kernel_case(GetParam(), s, oc, rng); });
  }
}

// Every option case on path `isa` in `dtype` (head dim d): out and lse on 2 threads equal
// those on 1 bit for bit.
void ExpectThreadCountDoesNotChangeABit(const char* isa, DType dtype, int d, std::mt19937_64 rng) {
  const ScopedIsa forced(isa);
  for (const OptionCase& oc : option_cases()) {
    LowpCall c(dtype, 2, 150, 333, 4, 2, d, d, rng);
    OptionStore store;
    const AttentionOptions o = oc.make(store, c, rng);
    const TensorView q = c.view(c.q, 150, 4, d), k = c.view(c.k, 333, 2, d), v = c.view(c.v, 333, 2, d),
                     out = c.view(c.out, 150, 4, d);
    with_threads(1, [&] { attention(q, k, v, out, o, c.lse_view()); });
    const std::vector<uint16_t> one = c.out;
    const std::vector<float> lse_one = c.lse;
    with_threads(2, [&] { attention(q, k, v, out, o, c.lse_view()); });
    EXPECT_EQ(one, c.out) << oc.name;
    EXPECT_EQ(lse_one, c.lse) << oc.name;
  }
}

TEST_P(Bf16KernelForward, ThreadCountDoesNotChangeABit) {
  SKIP_UNLESS_PATH(GetParam());
  ExpectThreadCountDoesNotChangeABit(GetParam(), DType::bf16, 64, make_rng(22));
}

// A work item chains a group of query blocks through one pipeline, panel by panel of
// keys (ATTN_AMX_GROUP and ATTN_AMX_PANEL override the choice): every grouping gives
// the bits of one block at a time, for every option case on path `isa` in `dtype`.
void ExpectGroupingDoesNotChangeABit(const char* isa, DType dtype, int d, std::mt19937_64 rng) {
  const ScopedIsa forced(isa);
  const int B = 2, Lq = 170, Lk = 1000, Hq = 4, Hkv = 2;  // 6 query blocks, 4 key blocks of 256
  const char* const plans[][2] = {{"4", "64"}, {"6", "300"}, {"16", "1000000"}, {"3", "1"}};
  for (const OptionCase& oc : option_cases()) {
    LowpCall c(dtype, B, Lq, Lk, Hq, Hkv, d, d, rng);
    OptionStore store;
    const AttentionOptions o = oc.make(store, c, rng);
    const TensorView q = c.view(c.q, Lq, Hq, d), k = c.view(c.k, Lk, Hkv, d), v = c.view(c.v, Lk, Hkv, d),
                     out = c.view(c.out, Lq, Hq, d);
    std::vector<uint16_t> one;
    std::vector<float> lse_one;
    {
      const ScopedEnv group("ATTN_AMX_GROUP", "1");
      attention(q, k, v, out, o, c.lse_view());
      one = c.out, lse_one = c.lse;
    }
    for (const auto& plan : plans) {
      const ScopedEnv group("ATTN_AMX_GROUP", plan[0]), panel("ATTN_AMX_PANEL", plan[1]);
      std::fill(c.out.begin(), c.out.end(), uint16_t{0});
      attention(q, k, v, out, o, c.lse_view());
      EXPECT_EQ(one, c.out) << oc.name << ", group " << plan[0] << ", panel " << plan[1];
      EXPECT_EQ(lse_one, c.lse) << oc.name << ", group " << plan[0] << ", panel " << plan[1];
    }
  }
}

TEST_P(Bf16KernelForward, GroupsOfQueryBlocksDoNotChangeABit) {
  SKIP_UNLESS_PATH(GetParam());
  ExpectGroupingDoesNotChangeABit(GetParam(), DType::bf16, 64, make_rng(27));
}

TEST_P(Bf16KernelForward, BadGroupingOverridesAreErrorsThatNameThem) {
  SKIP_UNLESS_PATH(GetParam());
  const ScopedIsa isa(GetParam());
  std::mt19937_64 rng = make_rng(28);
  LowpCall c(DType::bf16, 1, 40, 40, 1, 1, 32, 32, rng);
  auto call = [&] { attention(c.view(c.q, 40, 1, 32), c.view(c.k, 40, 1, 32), c.view(c.v, 40, 1, 32), c.view(c.out, 40, 1, 32)); };
  for (const char* bad : {"0", "17", "four", "4x"}) {
    const ScopedEnv group("ATTN_AMX_GROUP", bad);
    EXPECT_THROW(
        {
          try {
            call();
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find("ATTN_AMX_GROUP"), std::string::npos) << e.what();
            throw;
          }
        },
        Error)
        << bad;
  }
  const ScopedEnv panel("ATTN_AMX_PANEL", "-5");
  EXPECT_THROW(call(), Error);
}

TEST_P(Bf16KernelForward, Bf16PrecisionForF32InputsIsTheBf16KernelWithAnF32Output) {
  SKIP_UNLESS_PATH(GetParam());
  const ScopedIsa isa(GetParam());
  std::mt19937_64 rng = make_rng(23);
  const int B = 1, L = 77, H = 2, d = 64;
  std::vector<float> q(size_t(B) * L * H * d), k(q.size()), v(q.size()), out(q.size());
  std::uniform_real_distribution<float> u(-2, 2);
  for (auto* x : {&q, &k, &v})
    for (float& f : *x) f = u(rng);
  AttentionOptions o;
  o.precision = Precision::bf16;
  o.causal = Causal::BottomRight;
  auto view32 = [&](const std::vector<float>& x) { return TensorView(x.data(), DType::f32, {B, L, H, d}); };
  attention(view32(q), view32(k), view32(v), view32(out), o);
  std::vector<uint16_t> qh(q.size()), kh(q.size()), vh(q.size()), oh(q.size());
  for (size_t i = 0; i < q.size(); ++i) qh[i] = f32_to_bf16(q[i]), kh[i] = f32_to_bf16(k[i]), vh[i] = f32_to_bf16(v[i]);
  auto view16 = [&](const std::vector<uint16_t>& x) { return TensorView(x.data(), DType::bf16, {B, L, H, d}); };
  attention(view16(qh), view16(kh), view16(vh), view16(oh), o);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_EQ(f32_to_bf16(out[i]), oh[i]) << i;
}

// Runs c (1 sequence, 70 queries × 90 keys, 2 query heads on 1 kv head, d = 64,
// causal top-left; an input poisoned by the caller) on the portable path and then on
// `isa`, and expects the two outputs bit for bit equal (the kernel declines non-finite
// inputs). c.out holds the result.
void ExpectKernelMatchesThePortablePath(const char* isa, LowpCall& c) {
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  const TensorView q = c.view(c.q, 70, 2, 64), k = c.view(c.k, 90, 1, 64), v = c.view(c.v, 90, 1, 64),
                   out = c.view(c.out, 70, 2, 64);
  std::vector<uint16_t> portable;
  {
    const ScopedIsa f32("f32");
    attention(q, k, v, out, o, c.lse_view());
    portable = c.out;
  }
  const ScopedIsa kernel(isa);
  attention(q, k, v, out, o, c.lse_view());
  EXPECT_EQ(portable, c.out);
}

TEST_P(Bf16KernelForward, NonFiniteInputsTakeThePortablePathsSemantics) {
  SKIP_UNLESS_PATH(GetParam());
  std::mt19937_64 rng = make_rng(24);
  LowpCall c(DType::bf16, 1, 70, 90, 2, 1, 64, 64, rng);
  c.v[7 * 64 + 3] = f32_to_bf16(INFINITY);  // value 7: only rows that see key 7 are affected
  ExpectKernelMatchesThePortablePath(GetParam(), c);
  EXPECT_FALSE(std::isnan(bf16_to_f32(c.out[6 * 2 * 64 + 3]))) << "row 6 cannot see key 7";
  EXPECT_TRUE(std::isinf(bf16_to_f32(c.out[8 * 2 * 64 + 3])) || std::isnan(bf16_to_f32(c.out[8 * 2 * 64 + 3])));
}

TEST_P(Bf16KernelForward, NonFiniteMaskValuesFollowTheReference) {
  SKIP_UNLESS_PATH(GetParam());
  const ScopedIsa isa(GetParam());
  std::mt19937_64 rng = make_rng(26);
  const int L = 300, d = 64;  // several 256-key blocks
  LowpCall c(DType::bf16, 1, L, L, 1, 1, d, d, rng);
  std::vector<float> mask(size_t(L) * L, 0.0f);
  mask[3 * L + 5] = NAN;                                                   // NaN score: row NaN
  mask[7 * L + 2] = INFINITY;                                              // +∞ score: row NaN
  for (int j = 0; j < L; ++j) mask[9 * L + j] = mask[11 * L + j] = -INFINITY;
  mask[9 * L + 280] = NAN;                                                 // only a NaN left: NaN
  AttentionOptions o;                                                      // row 11: no key, 0
  o.mask = TensorView(mask.data(), DType::f32, {L, L});
  attention(c.view(c.q, L, 1, d), c.view(c.k, L, 1, d), c.view(c.v, L, 1, d), c.view(c.out, L, 1, d), o,
            c.lse_view());
  for (int i = 0; i < L; ++i) {
    const float x = bf16_to_f32(c.out[size_t(i) * d]);
    const bool want_nan = i == 3 || i == 7 || i == 9;
    EXPECT_EQ(std::isnan(x), want_nan) << "row " << i;
    EXPECT_EQ(std::isnan(c.lse[i]), want_nan) << "lse row " << i;
    if (i == 11) {
      EXPECT_EQ(x, 0.0f);
      EXPECT_EQ(c.lse[i], -INFINITY);
    }
  }
}

// f16 on the tiles: each value enters as hi + lo bf16 pieces (exact), three tile
// products per product, P split likewise. The yardstick is the plain f16
// implementation: P rounded to f16 before P·V, the output rounded to f16.
TEST(F16OnAmxTiles, EveryOptionWithinTwiceThePlainF16Error) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(31);
  for (const OptionCase& oc : option_cases()) {
    ExpectWithinPlainBf16Error(kAmxShapes, oc,
                               [&](const Shape& s) { return run_kernel_case("amx", s, oc, rng, DType::f16); });
  }
}

TEST(F16OnAmxTiles, ThreadCountDoesNotChangeABit) {
  SKIP_UNLESS_PATH("amx");
  ExpectThreadCountDoesNotChangeABit("amx", DType::f16, 96, make_rng(32));
}

TEST(F16OnAmxTiles, GroupsOfQueryBlocksDoNotChangeABit) {
  SKIP_UNLESS_PATH("amx");
  ExpectGroupingDoesNotChangeABit("amx", DType::f16, 96, make_rng(34));
}

// The pieces hold f16 exactly, so the tile path is as accurate as the portable f32
// kernel on the same values, yet it is a different computation: on large random
// inputs the two agree to f16 rounding and differ somewhere (had ATTN_ISA=amx
// silently fallen back to the portable path, they would be bitwise equal).
TEST(F16OnAmxTiles, RunsOnTheTilesAtThePortablePathsAccuracy) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(33);
  const int L = 600, H = 2, d = 128;
  LowpCall c(DType::f16, 1, L, L, H, H, d, d, rng);
  const TensorView q = c.view(c.q, L, H, d), k = c.view(c.k, L, H, d), v = c.view(c.v, L, H, d),
                   out = c.view(c.out, L, H, d);
  AttentionOptions o;
  o.causal = Causal::BottomRight;
  std::vector<uint16_t> portable;
  {
    const ScopedIsa f32("f32");
    attention(q, k, v, out, o);
    portable = c.out;
  }
  const ScopedIsa amx("amx");
  attention(q, k, v, out, o);
  size_t differ = 0;
  for (size_t i = 0; i < portable.size(); ++i) {
    const float a = f16_to_f32(portable[i]), b = f16_to_f32(c.out[i]);
    ASSERT_NEAR(a, b, std::ldexp(std::max(std::fabs(a), 0.25f), -10)) << i;  // 1 ulp of f16 (2 below 1/4)
    differ += portable[i] != c.out[i];
  }
  EXPECT_GT(differ, 0u);
  EXPECT_LT(differ, portable.size() / 4) << "most outputs round to the same f16";
}

TEST(F16OnAmxTiles, NonFiniteInputsTakeThePortablePathsSemantics) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(34);
  LowpCall c(DType::f16, 1, 70, 90, 2, 1, 64, 64, rng);
  c.k[11 * 64 + 5] = f32_to_f16(NAN);  // key 11: only rows that see it turn NaN
  ExpectKernelMatchesThePortablePath("amx", c);
  EXPECT_FALSE(std::isnan(f16_to_f32(c.out[10 * 2 * 64]))) << "row 10 cannot see key 11";
  EXPECT_TRUE(std::isnan(f16_to_f32(c.out[12 * 2 * 64])));
}

TEST(Bf16Kernel, IsaVariableIsCheckedAndNamesThePaths) {
  std::mt19937_64 rng = make_rng(25);
  LowpCall c(DType::bf16, 1, 4, 4, 1, 1, 8, 8, rng);
  const TensorView q = c.view(c.q, 4, 1, 8), k = c.view(c.k, 4, 1, 8), v = c.view(c.v, 4, 1, 8),
                   out = c.view(c.out, 4, 1, 8);
  auto message = [&] {
    try {
      attention(q, k, v, out);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  {
    const ScopedIsa bad("sse9");
    EXPECT_EQ(message(), "ATTN_ISA must be amx, avx512bf16 or f32, got \"sse9\"");
  }
  {
    const ScopedIsa f32("f32");
    EXPECT_EQ(message(), "no error");
    EXPECT_EQ(cpu_info().bf16_path, "f32");
  }
  const detail::CpuFeatures& f = detail::cpu_features();
  {
    // The default: AMX; else vdpbf16ps where it runs at full rate (AMD, not Intel);
    // else f32.
    const ScopedIsa unset(nullptr);
    const char* want = f.amx_bf16 ? "amx" : f.bf16_dot_full_rate ? "avx512bf16" : "f32";
    EXPECT_EQ(cpu_info().bf16_path, want);
    EXPECT_EQ(cpu_info().amx_bf16, f.amx_bf16);
  }
  {
    const ScopedIsa isa("avx512bf16");
    if (f.avx512_bf16) {
      EXPECT_EQ(message(), "no error");
      EXPECT_EQ(cpu_info().bf16_path, "avx512bf16");
    } else {
      EXPECT_NE(message().find("ATTN_ISA=avx512bf16, but this CPU has no AVX512-BF16"), std::string::npos)
          << message();
    }
  }
  const ScopedIsa amx("amx");
  if (f.amx_bf16) {
    EXPECT_EQ(message(), "no error");
    EXPECT_EQ(cpu_info().bf16_path, "amx");
  } else {
    EXPECT_NE(message().find("ATTN_ISA=amx, but this machine cannot run AMX"), std::string::npos) << message();
  }
}

}  // namespace
}  // namespace attn::testing
