// Precision::bf16x3: f32 inputs taken by the AMX tile kernels as two bf16 pieces,
// x ≈ hi + lo (16 significant bits), three tile products per product.
// Forward, every option and odd shapes, against the float64 reference on the f32
// inputs under FlashAttention's rule: the error is at most 2× that of a plain
// implementation with the same rounding (q, k, v and P as hi + lo, exact softmax, f32
// accumulation), pooled per option with a 10× screen per case. Backward against the
// reference, well inside Precision::bf16's error. Thread independence, the portable
// path (no tiles: the f32 kernel, bitwise), values the pieces cannot hold (declined to
// the f32 kernel, bitwise), and an out-of-range precision value.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "lowp_harness.hpp"

namespace attn::testing {
namespace {

// hi + lo of x: hi = bf16(x), lo = bf16(x − hi), both to nearest even.
float SplitSum(float x) {
  const float hi = bf16_to_f32(f32_to_bf16(x));
  return hi + bf16_to_f32(f32_to_bf16(x - hi));
}

// Bitwise equality (NaN included).
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
}

// One call's f32 tensors ([B, L, H, d]) and their split twins.
struct F32Call {
  Shape s;
  std::vector<float> q, k, v, dout, out, lse, q2, k2, v2;
  F32Call(const Shape& shape, std::mt19937_64& rng) : s(shape) {
    auto fill = [&](std::vector<float>& x, std::vector<float>& x2, size_t n, float scale) {
      std::uniform_real_distribution<float> u(-scale, scale);
      x.resize(n), x2.resize(n);
      for (size_t i = 0; i < n; ++i) x[i] = u(rng), x2[i] = SplitSum(x[i]);
    };
    std::vector<float> unused;
    fill(q, q2, size_t(s.B) * s.Lq * s.Hq * s.d, 2.0f);
    fill(k, k2, size_t(s.B) * s.Lk * s.Hkv * s.d, 2.0f);
    fill(v, v2, size_t(s.B) * s.Lk * s.Hkv * s.dv, 1.0f);
    fill(dout, unused, size_t(s.B) * s.Lq * s.Hq * s.dv, 1.0f);
    out.assign(size_t(s.B) * s.Lq * s.Hq * s.dv, 0.0f);
    lse.assign(size_t(s.B) * s.Hq * s.Lq, 0.0f);
  }
  TensorView Q(const std::vector<float>& x) const { return TensorView(x.data(), DType::f32, {s.B, s.Lq, s.Hq, s.d}); }
  TensorView K(const std::vector<float>& x) const { return TensorView(x.data(), DType::f32, {s.B, s.Lk, s.Hkv, s.d}); }
  TensorView V(const std::vector<float>& x) const { return TensorView(x.data(), DType::f32, {s.B, s.Lk, s.Hkv, s.dv}); }
  TensorView O(const std::vector<float>& x) const { return TensorView(x.data(), DType::f32, {s.B, s.Lq, s.Hq, s.dv}); }
  TensorView Lse(const std::vector<float>& x) const { return TensorView(x.data(), DType::f32, {s.B, s.Hq, s.Lq}); }
};

// The option cases for f32 inputs: all but a mask in the input dtype, which for f32
// inputs is the f32 additive mask case.
std::vector<OptionCase> F32OptionCases() {
  std::vector<OptionCase> cases;
  for (const OptionCase& oc : option_cases()) {
    if (std::string(oc.name) != "mask in the input dtype") cases.push_back(oc);
  }
  return cases;
}

// The options of an option case (its masks in bf16 where it asks for the input
// dtype), with the f32 twin for the reference in `twin`.
AttentionOptions CaseOptions(const OptionCase& oc, const Shape& s, OptionStore& store, AttentionOptions& twin,
                             std::mt19937_64& rng) {
  const LowpCall shapes(DType::bf16, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
  AttentionOptions o = oc.make(store, shapes, rng);
  twin = f32_twin(o, shapes, store.twin);
  return o;
}

// One forward case on the tiles: the kernel's squared error against the float64
// reference on the f32 inputs, and the yardstick's: the reference's probabilities on
// the split inputs, each split again, times the split values, summed in f32.
CaseErrors RunForwardCase(const Shape& s, const OptionCase& oc, std::mt19937_64& rng) {
  F32Call c(s, rng);
  OptionStore store;
  AttentionOptions twin;
  AttentionOptions o = CaseOptions(oc, s, store, twin, rng);
  o.precision = Precision::bf16x3;
  {
    const ScopedIsa isa("amx");
    attention(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), o, c.Lse(c.lse));
  }
  std::vector<float> ref(c.out.size()), ref_lse(c.lse.size()), out2(c.out.size()), lse2(c.lse.size()),
      probs(size_t(s.B) * s.Hq * s.Lq * s.Lk);
  attention_reference(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(ref), twin, c.Lse(ref_lse));
  attention_reference(c.Q(c.q2), c.K(c.k2), c.V(c.v2), c.O(out2), twin, c.Lse(lse2),
                      TensorView(probs.data(), DType::f32, {s.B, s.Hq, s.Lq, s.Lk}));
  CaseErrors e;
  const int group = s.Hq / s.Hkv;
  for (int b = 0; b < s.B; ++b)
    for (int i = 0; i < s.Lq; ++i)
      for (int h = 0; h < s.Hq; ++h) {
        const size_t row = (size_t(b) * s.Hq + h) * s.Lq + i;
        const float l = ref_lse[row], l_kernel = c.lse[row];
        EXPECT_EQ(std::isinf(l), std::isinf(l_kernel)) << "lse b=" << b << " h=" << h << " i=" << i;
        if (std::isfinite(l)) EXPECT_NEAR(l_kernel, l, 1e-4 * std::max(1.0f, std::fabs(l)));
        const float* p = probs.data() + row * s.Lk;
        for (int x = 0; x < s.dv; ++x) {
          float acc = 0;
          for (int j = 0; j < s.Lk; ++j) acc += SplitSum(p[j]) * c.v2[((size_t(b) * s.Lk + j) * s.Hkv + h / group) * s.dv + x];
          const size_t at = ((size_t(b) * s.Lq + i) * s.Hq + h) * s.dv + x;
          const double r = ref[at], got = c.out[at];
          EXPECT_FALSE(std::isnan(got)) << at;
          if (std::isinf(l)) EXPECT_EQ(got, 0.0) << "fully masked row b=" << b << " h=" << h << " i=" << i;
          e.fused += (got - r) * (got - r);
          e.plain += (acc - r) * (acc - r);
        }
      }
  return e;
}

// Shapes as the bf16 kernel's tests: several key blocks, a partial last block, GQA,
// d = 256, dv ≠ d, and sizes 1, 3, 17, 1000.
const Shape kShapesX3[] = {{1, 1, 1, 1, 1, 16, 16},      {2, 3, 17, 4, 2, 64, 64},  {1, 17, 3, 2, 1, 80, 48},
                           {1, 100, 100, 2, 2, 128, 128}, {2, 33, 65, 3, 1, 32, 40}, {1, 70, 1000, 2, 1, 64, 64},
                           {1, 129, 300, 1, 1, 256, 256}, {1, 1000, 37, 1, 1, 8, 24}};

TEST(Bf16x3Precision, EveryOptionWithinTwiceThePlainSplitError) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(71);
  for (const OptionCase& oc : F32OptionCases()) {
    double fused = 0, plain = 0;
    for (const Shape& s : kShapesX3) {
      SCOPED_TRACE(std::string(oc.name) + " Lq=" + std::to_string(s.Lq) + " Lk=" + std::to_string(s.Lk) +
                   " d=" + std::to_string(s.d));
      const CaseErrors e = RunForwardCase(s, oc, rng);
      // The screen's floor: one f32 rounding of outputs of size 1 (cases whose plain
      // error happens to be ~0, e.g. one key).
      EXPECT_LE(std::sqrt(e.fused), 10.0 * std::sqrt(e.plain) + 1e-6);
      fused += e.fused, plain += e.plain;
    }
    EXPECT_LE(std::sqrt(fused), 2.0 * std::sqrt(plain)) << oc.name;
    EXPECT_GT(plain, 0.0) << oc.name << ": the yardstick must measure something";
  }
}

// Relative RMS error of x against the reference r.
double RelativeRms(const std::vector<float>& x, const std::vector<float>& r) {
  double num = 0, den = 0;
  for (size_t i = 0; i < x.size(); ++i) num += (double(x[i]) - r[i]) * (double(x[i]) - r[i]), den += double(r[i]) * r[i];
  return std::sqrt(num / den);
}

// The forward's and backward's relative errors under one precision on path isa.
struct Errors {
  double out = 0, dq = 0, dk = 0, dv = 0;
};
Errors ForwardBackwardErrors(const F32Call& c0, Precision precision, const AttentionOptions& base) {
  F32Call c = c0;
  AttentionOptions o = base;
  o.precision = precision;
  std::vector<float> dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  {
    const ScopedIsa isa("amx");
    attention(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), o, c.Lse(c.lse));
    attention_backward(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), c.Lse(c.lse), c.O(c.dout), c.Q(dq), c.K(dk), c.V(dv),
                       o);
  }
  std::vector<float> ref(c.out.size()), rq(dq.size()), rk(dk.size()), rv(dv.size());
  attention_reference(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(ref), base);
  attention_backward_reference(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), c.Lse(c.lse), c.O(c.dout), c.Q(rq), c.K(rk),
                               c.V(rv), base);
  return {RelativeRms(c.out, ref), RelativeRms(dq, rq), RelativeRms(dk, rk), RelativeRms(dv, rv)};
}

TEST(Bf16x3Precision, ForwardAndBackwardAreFarMoreAccurateThanBf16) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(72);
  for (const Shape& s : {Shape{1, 130, 257, 4, 2, 64, 64}, Shape{2, 65, 97, 2, 1, 128, 96}}) {
    for (const bool causal : {false, true}) {
      SCOPED_TRACE("d=" + std::to_string(s.d) + (causal ? " causal" : ""));
      const F32Call c(s, rng);
      AttentionOptions o;
      o.causal = causal ? Causal::TopLeft : Causal::None;
      const Errors x3 = ForwardBackwardErrors(c, Precision::bf16x3, o);
      const Errors b16 = ForwardBackwardErrors(c, Precision::bf16, o);
      // 16 bits per operand: ~1e-5 where bf16's 8 bits give ~1e-3.
      for (const auto& [name, e3, e1] : {std::tuple{"out", x3.out, b16.out}, std::tuple{"dq", x3.dq, b16.dq},
                                          std::tuple{"dk", x3.dk, b16.dk}, std::tuple{"dv", x3.dv, b16.dv}}) {
        EXPECT_LT(e3, 5e-5) << name;
        EXPECT_LT(e3 * 50, e1) << name << ": bf16x3 " << e3 << ", bf16 " << e1;
        EXPECT_GT(e3, 0.0) << name << ": the tiles ran (the f32 kernel would be ~1e-7, not 0, but never exact)";
      }
    }
  }
}

TEST(Bf16x3Precision, ThreadCountDoesNotChangeABit) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(73);
  const F32Call c0({2, 77, 300, 4, 2, 64, 64}, rng);
  for (const OptionCase& oc : F32OptionCases()) {
    SCOPED_TRACE(oc.name);
    OptionStore store;
    AttentionOptions twin;
    AttentionOptions o = CaseOptions(oc, c0.s, store, twin, rng);
    o.precision = Precision::bf16x3;
    F32Call one = c0, two = c0;
    std::vector<float> dq1(c0.q.size()), dk1(c0.k.size()), dv1(c0.v.size()), dq2 = dq1, dk2 = dk1, dv2 = dv1;
    const ScopedIsa isa("amx");
    with_threads(1, [&] {
      attention(one.Q(one.q), one.K(one.k), one.V(one.v), one.O(one.out), o, one.Lse(one.lse));
      attention_backward(one.Q(one.q), one.K(one.k), one.V(one.v), one.O(one.out), one.Lse(one.lse), one.O(one.dout),
                         one.Q(dq1), one.K(dk1), one.V(dv1), o);
    });
    with_threads(2, [&] {
      attention(two.Q(two.q), two.K(two.k), two.V(two.v), two.O(two.out), o, two.Lse(two.lse));
      attention_backward(two.Q(two.q), two.K(two.k), two.V(two.v), two.O(two.out), two.Lse(two.lse), two.O(two.dout),
                         two.Q(dq2), two.K(dk2), two.V(dv2), o);
    });
    EXPECT_TRUE(same_bits(one.out, two.out));
    EXPECT_TRUE(same_bits(one.lse, two.lse));
    EXPECT_TRUE(same_bits(dq1, dq2) && same_bits(dk1, dk2) && same_bits(dv1, dv2));
  }
}

// Runs forward and backward under `precision` on path isa; returns out, lse, dq, dk, dv.
std::vector<std::vector<float>> RunBoth(const F32Call& c0, Precision precision, const char* isa) {
  F32Call c = c0;
  AttentionOptions o;
  o.causal = Causal::BottomRight;
  o.precision = precision;
  std::vector<float> dq(c.q.size()), dk(c.k.size()), dv(c.v.size());
  const ScopedIsa scoped(isa);
  attention(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), o, c.Lse(c.lse));
  attention_backward(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), c.Lse(c.lse), c.O(c.dout), c.Q(dq), c.K(dk), c.V(dv), o);
  return {c.out, c.lse, dq, dk, dv};
}

// Without tiles the call is the f32 kernel's: more accurate than asked, never less.
TEST(Bf16x3Precision, WithoutTilesItIsTheF32KernelBitwise) {
  std::mt19937_64 rng = make_rng(74);
  const F32Call c({1, 50, 70, 2, 1, 64, 64}, rng);
  for (const char* isa : {"f32", "avx512bf16"}) {
    if (!cannot_run_path(isa).empty()) continue;
    SCOPED_TRACE(isa);
    const auto x3 = RunBoth(c, Precision::bf16x3, isa), f32 = RunBoth(c, Precision::f32, isa);
    for (size_t n = 0; n < x3.size(); ++n) EXPECT_TRUE(same_bits(x3[n], f32[n])) << "tensor " << n;
  }
}

// A NaN, or an f32 beyond bf16's range (its hi piece would be ∞), is declined by the
// tiles: the f32 kernel's answer, bitwise.
TEST(Bf16x3Precision, ValuesThePiecesCannotHoldTakeTheF32Kernel) {
  SKIP_UNLESS_PATH("amx");
  std::mt19937_64 rng = make_rng(75);
  for (const float bad : {NAN, 3.4e38f}) {
    SCOPED_TRACE(bad);
    F32Call c({1, 40, 40, 2, 1, 64, 64}, rng);
    c.v[5 * 64 + 3] = bad;
    const auto x3 = RunBoth(c, Precision::bf16x3, "amx"), f32 = RunBoth(c, Precision::f32, "amx");
    for (size_t n = 0; n < x3.size(); ++n) EXPECT_TRUE(same_bits(x3[n], f32[n])) << "tensor " << n;
  }
}

TEST(Bf16x3Precision, AnUnknownPrecisionIsAnErrorThatNamesIt) {
  std::mt19937_64 rng = make_rng(76);
  F32Call c({1, 4, 4, 1, 1, 16, 16}, rng);
  AttentionOptions o;
  o.precision = static_cast<Precision>(7);
  expect_attn_error([&] { attention(c.Q(c.q), c.K(c.k), c.V(c.v), c.O(c.out), o); }, "precision");
}

}  // namespace
}  // namespace attn::testing
