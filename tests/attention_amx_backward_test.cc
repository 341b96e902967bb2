// The bf16 backward kernel (issue 11, item 3) on each of its paths, AMX tiles and
// AVX512-BF16's vdpbf16ps, forced with ATTN_ISA; each skipped with a message on
// machines that cannot run it. Gradients against the float64 reference under
// FlashAttention's rule: the error is at most 2× that of a plain implementation with
// the same rounding (bf16 inputs; P, dP, D and dS exact from those inputs; P' and dS
// rounded to bf16 before they multiply; f32-or-better sums; bf16 outputs), pooled
// per option, with a 10× screen per case. Also: thread independence, Precision::bf16,
// and the cases the kernel declines, which must equal the portable path bit for bit.
// f16 inputs on the AMX path (every operand as exact hi + lo bf16 pieces) under the
// same rule with f16 rounding.
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

// Odd sizes, one and several 64-key tiles, partial tiles, GQA, d = 8 … 256, dv ≠ d.
const Shape kBwdShapes[] = {{1, 1, 1, 1, 1, 16, 16},     {2, 3, 17, 4, 2, 64, 64},   {1, 17, 3, 2, 1, 80, 48},
                            {1, 100, 100, 2, 2, 128, 128}, {2, 33, 65, 3, 1, 32, 40}, {1, 70, 300, 2, 1, 64, 64},
                            {1, 129, 130, 1, 1, 256, 256}, {1, 200, 37, 1, 1, 8, 24}};

// One call's gradients in every form the test compares.
struct Grads {
  std::vector<uint16_t> dq, dk, dv;
};

Grads run_backward(LowpCall& c, const AttentionOptions& o) {
  const TensorView q = c.view(c.q, c.Lq, c.Hq, c.d), k = c.view(c.k, c.Lk, c.Hkv, c.d),
                   v = c.view(c.v, c.Lk, c.Hkv, c.dv), out = c.view(c.out, c.Lq, c.Hq, c.dv);
  Grads g;
  g.dq.assign(c.q.size(), 0xFFFF), g.dk.assign(c.k.size(), 0xFFFF), g.dv.assign(c.v.size(), 0xFFFF);  // NaN
  attention_backward(q, k, v, out, c.lse_view(), c.view(c.dout, c.Lq, c.Hq, c.dv),
                     TensorView(g.dq.data(), c.dt, {c.B, c.Lq, c.Hq, c.d}),
                     TensorView(g.dk.data(), c.dt, {c.B, c.Lk, c.Hkv, c.d}),
                     TensorView(g.dv.data(), c.dt, {c.B, c.Lk, c.Hkv, c.dv}), o);
  return g;
}

// Squared errors of one case against the float64 reference.
// Runs the kernel's forward and backward (path isa) of one case and its yardsticks: the reference
// gradients (float64 on the bf16 values, rounded to f32 once) and the plain bf16
// implementation, built from the reference's probabilities (every option included).
CaseErrors run_case(const char* path, const Shape& s, const OptionCase& oc, std::mt19937_64& rng,
                    DType dtype = DType::bf16) {
  LowpCall c(dtype, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
  OptionStore store;
  const AttentionOptions o = oc.make(store, c, rng);
  const ScopedIsa isa(path);
  attention(c.view(c.q, s.Lq, s.Hq, s.d), c.view(c.k, s.Lk, s.Hkv, s.d), c.view(c.v, s.Lk, s.Hkv, s.dv),
            c.view(c.out, s.Lq, s.Hq, s.dv), o, c.lse_view());
  const Grads g = run_backward(c, o);

  return compare_backward_with_reference(c, o, store, g.dq, g.dk, g.dv);
}

// Parameter: the kernel path ("amx" or "avx512bf16"), forced with ATTN_ISA.
class Bf16KernelBackward : public ::testing::TestWithParam<const char*> {};
INSTANTIATE_TEST_SUITE_P(Paths, Bf16KernelBackward, ::testing::ValuesIn(kBf16KernelPaths), PathName);

TEST_P(Bf16KernelBackward, EveryOptionWithinTwiceThePlainBf16Error) {
  SKIP_UNLESS_PATH(GetParam());
  std::mt19937_64 rng = make_rng(31);
  for (const OptionCase& oc : option_cases()) {
    if (std::string(oc.name) == "softcap+scale") continue;  // declined: DeclinedCasesArePortableBitForBit
    ExpectWithinPlainBf16Error(kBwdShapes, oc, [&](const Shape& s) { return run_case(GetParam(), s, oc, rng); });
  }
}

// The kernel really runs (a declined call would equal the portable path exactly).
TEST_P(Bf16KernelBackward, DiffersFromThePortablePath) {
  SKIP_UNLESS_PATH(GetParam());
  std::mt19937_64 rng = make_rng(32);
  LowpCall c(DType::bf16, 1, 100, 150, 2, 1, 64, 64, rng);
  AttentionOptions o;
  o.causal = Causal::BottomRight;
  Grads kernel, portable;
  {
    const ScopedIsa isa(GetParam());
    attention(c.view(c.q, 100, 2, 64), c.view(c.k, 150, 1, 64), c.view(c.v, 150, 1, 64), c.view(c.out, 100, 2, 64), o,
              c.lse_view());
    kernel = run_backward(c, o);
  }
  {
    const ScopedIsa isa("f32");
    portable = run_backward(c, o);
  }
  EXPECT_NE(kernel.dk, portable.dk);
}

// Every option's gradients on 1 and 2 threads, bit for bit.
void ExpectThreadCountDoesNotChangeABit(const char* path, DType dtype, std::mt19937_64 rng) {
  const ScopedIsa isa(path);
  for (const OptionCase& oc : option_cases()) {
    LowpCall c(dtype, 2, 150, 333, 4, 2, 64, 64, rng);
    OptionStore store;
    const AttentionOptions o = oc.make(store, c, rng);
    attention(c.view(c.q, 150, 4, 64), c.view(c.k, 333, 2, 64), c.view(c.v, 333, 2, 64), c.view(c.out, 150, 4, 64), o,
              c.lse_view());
    Grads one, two;
    with_threads(1, [&] { one = run_backward(c, o); });
    with_threads(2, [&] { two = run_backward(c, o); });
    EXPECT_EQ(one.dq, two.dq) << oc.name;
    EXPECT_EQ(one.dk, two.dk) << oc.name;
    EXPECT_EQ(one.dv, two.dv) << oc.name;
  }
}

TEST_P(Bf16KernelBackward, ThreadCountDoesNotChangeABit) {
  SKIP_UNLESS_PATH(GetParam());
  ExpectThreadCountDoesNotChangeABit(GetParam(), DType::bf16, make_rng(33));
}

TEST_P(Bf16KernelBackward, Bf16PrecisionForF32InputsIsTheBf16KernelWithAnF32Output) {
  SKIP_UNLESS_PATH(GetParam());
  const ScopedIsa isa(GetParam());
  std::mt19937_64 rng = make_rng(34);
  const int B = 1, L = 77, H = 2, d = 64;
  LowpCall c(DType::bf16, B, L, L, H, H, d, d, rng);
  AttentionOptions o;
  o.causal = Causal::TopLeft;
  attention(c.view(c.q, L, H, d), c.view(c.k, L, H, d), c.view(c.v, L, H, d), c.view(c.out, L, H, d), o, c.lse_view());
  const Grads g = run_backward(c, o);
  // The same call on f32 tensors holding the bf16 values (exactly), Precision::bf16.
  std::vector<float> out32(c.out.size()), dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  for (size_t i = 0; i < out32.size(); ++i) out32[i] = bf16_to_f32(c.out[i]);
  o.precision = Precision::bf16;
  auto view32 = [&](const std::vector<float>& x) { return TensorView(x.data(), DType::f32, {B, L, H, d}); };
  attention_backward(view32(c.q32), view32(c.k32), view32(c.v32), view32(out32), c.lse_view(), view32(c.dout32),
                     view32(dq), view32(dk), view32(dv), o);
  for (size_t i = 0; i < dq.size(); ++i) ASSERT_EQ(f32_to_bf16(dq[i]), g.dq[i]) << "dq " << i;
  for (size_t i = 0; i < dk.size(); ++i) ASSERT_EQ(f32_to_bf16(dk[i]), g.dk[i]) << "dk " << i;
  for (size_t i = 0; i < dv.size(); ++i) ASSERT_EQ(f32_to_bf16(dv[i]), g.dv[i]) << "dv " << i;
}

TEST_P(Bf16KernelBackward, FullyMaskedRowsGetZeroGradients) {
  SKIP_UNLESS_PATH(GetParam());
  const ScopedIsa isa(GetParam());
  std::mt19937_64 rng = make_rng(35);
  const int L = 90, d = 32;
  LowpCall c(DType::bf16, 1, L, L, 1, 1, d, d, rng);
  std::vector<uint8_t> mask(size_t(L) * L, 1);
  for (int j = 0; j < L; ++j) mask[5 * L + j] = mask[70 * L + j] = 0;
  AttentionOptions o;
  o.mask = TensorView(mask.data(), DType::boolean, {L, L});
  attention(c.view(c.q, L, 1, d), c.view(c.k, L, 1, d), c.view(c.v, L, 1, d), c.view(c.out, L, 1, d), o, c.lse_view());
  const Grads g = run_backward(c, o);
  for (int x = 0; x < d; ++x) {
    EXPECT_EQ(bf16_to_f32(g.dq[5 * d + x]), 0.0f);
    EXPECT_EQ(bf16_to_f32(g.dq[70 * d + x]), 0.0f);
  }
  for (uint16_t h : g.dk) ASSERT_FALSE(std::isnan(bf16_to_f32(h)));
}

// Softcap, non-finite inputs and huge |lse| are left to the portable path.
void ExpectDeclinedCasesArePortableBitForBit(const char* path, DType dtype, std::mt19937_64 rng) {
  const int L = 80, d = 64;
  std::vector<float> huge(size_t(L) * L, 0.0f);
  for (int j = 0; j < L; ++j) huge[3 * L + j] = -1e9f;  // row 3: lse ≈ −1e9
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    LowpCall c(dtype, 1, L, L, 2, 2, d, d, rng);
    AttentionOptions o;
    if (variant == 0) o.softcap = 4.0f;
    if (variant == 1) o.mask = TensorView(huge.data(), DType::f32, {L, L});
    {
      const ScopedIsa isa(path);
      attention(c.view(c.q, L, 2, d), c.view(c.k, L, 2, d), c.view(c.v, L, 2, d), c.view(c.out, L, 2, d), o,
                c.lse_view());
    }
    if (variant == 2) c.dout[17] = c.to(NAN);
    Grads kernel, portable;
    {
      const ScopedIsa isa(path);
      kernel = run_backward(c, o);
    }
    {
      const ScopedIsa isa("f32");
      portable = run_backward(c, o);
    }
    EXPECT_EQ(kernel.dq, portable.dq);
    EXPECT_EQ(kernel.dk, portable.dk);
    EXPECT_EQ(kernel.dv, portable.dv);
  }
}

TEST_P(Bf16KernelBackward, DeclinedCasesArePortableBitForBit) {
  SKIP_UNLESS_PATH(GetParam());
  ExpectDeclinedCasesArePortableBitForBit(GetParam(), DType::bf16, make_rng(36));
}

// f16 on the tiles: q, k, v, dO, and P' and dS, enter as hi + lo bf16 pieces, three
// tile products per product. The yardstick is the plain f16 implementation: P' and dS
// rounded to f16 before they multiply, gradients rounded to f16.
TEST(F16BackwardOnAmxTiles, EveryOptionWithinTwiceThePlainF16Error) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(41);
  for (const OptionCase& oc : option_cases()) {
    if (std::string(oc.name) == "softcap+scale") continue;  // declined: DeclinedCasesArePortableBitForBit
    ExpectWithinPlainBf16Error(kBwdShapes, oc,
                               [&](const Shape& s) { return run_case("amx", s, oc, rng, DType::f16); });
  }
}

TEST(F16BackwardOnAmxTiles, ThreadCountDoesNotChangeABit) {
  SKIP_UNLESS_PATH("amx");
  ExpectThreadCountDoesNotChangeABit("amx", DType::f16, make_rng(42));
}

TEST(F16BackwardOnAmxTiles, DeclinedCasesArePortableBitForBit) {
  SKIP_UNLESS_PATH("amx");
  ExpectDeclinedCasesArePortableBitForBit("amx", DType::f16, make_rng(43));
}

// The pieces hold f16 exactly and P', dS to ~2⁻¹⁷, so the tile path is as accurate
// as the portable f32 kernel on the same values, yet a different computation: on
// large random inputs the gradients agree to f16 rounding and differ somewhere (had
// ATTN_ISA=amx fallen back to the portable path, they would be bitwise equal).
TEST(F16BackwardOnAmxTiles, RunsOnTheTilesAtThePortablePathsAccuracy) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(44);
  const int L = 300, H = 2, d = 128;
  LowpCall c(DType::f16, 1, L, L, H, H, d, d, rng);
  AttentionOptions o;
  o.causal = Causal::BottomRight;
  attention(c.view(c.q, L, H, d), c.view(c.k, L, H, d), c.view(c.v, L, H, d), c.view(c.out, L, H, d), o, c.lse_view());
  Grads tiles, portable;
  {
    const ScopedIsa isa("amx");
    tiles = run_backward(c, o);
  }
  {
    const ScopedIsa isa("f32");
    portable = run_backward(c, o);
  }
  auto expect_close = [](const std::vector<uint16_t>& a, const std::vector<uint16_t>& b, const char* name) {
    float largest = 0;
    for (uint16_t x : b) largest = std::max(largest, std::fabs(f16_to_f32(x)));
    size_t differ = 0;
    for (size_t i = 0; i < a.size(); ++i) {
      const float x = f16_to_f32(a[i]), y = f16_to_f32(b[i]);
      // A gradient is a sum of terms of either sign: its rounding is relative to the
      // largest gradient, not to itself (2 f16 ulps of the largest).
      ASSERT_NEAR(x, y, std::ldexp(largest, -9)) << name << " " << i;
      differ += a[i] != b[i];
    }
    EXPECT_GT(differ, 0u) << name;
  };
  expect_close(tiles.dq, portable.dq, "dq");
  expect_close(tiles.dk, portable.dk, "dk");
  expect_close(tiles.dv, portable.dv, "dv");
}

}  // namespace
}  // namespace attn::testing
