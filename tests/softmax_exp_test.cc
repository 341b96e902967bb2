// The f32 kernels' softmax exponential (Exp2NonPositive in src/cpu/tile_kernels-inl.h)
// against std::exp2 in long double, on every SIMD target this CPU supports: its
// relative error over the normal range, its rounding into the subnormals, and the
// exact values the kernels rely on (2^0 = 1, which tells them a row's max did not
// move; 0 for −∞ and below 2^−150, which keeps removed keys out of P·V; NaN kept).
// Also the bf16 kernels' exponential (Exp2Probability), where the CPU runs them.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <vector>

#include "cpu/attention_forward.hpp"
#include "cpu/attention_forward_amx.hpp"

namespace attn::testing {
namespace {

std::vector<float> Exp2(const std::vector<float>& x) {
  std::vector<float> out(x.size(), -1.0f);
  detail::softmax_exp2(x.data(), out.data(), x.size());
  return out;
}

/// The largest relative error of got[i] against 2^x[i] (long double), and where.
double WorstRelativeError(const std::vector<float>& x, const std::vector<float>& got, float* worst_x) {
  double worst = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    const long double exact = std::exp2(static_cast<long double>(x[i]));
    const double rel = static_cast<double>(std::fabs((got[i] - exact) / exact));
    if (rel > worst) worst = rel, *worst_x = x[i];
  }
  return worst;
}

/// Runs `check` once per SIMD target, with dispatch forced to that target.
template <class Check>
void OnEveryTarget(const Check& check) {
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    std::printf("[ target   ] %s\n", detail::attention_forward_target());
    check(target);
  }
  detail::force_simd_target(0);
}

// Measured: 1.64e-7 on AVX2, 1.89e-7 on SSE4 and the scalar target (no fused
// multiply-add), ~8e-8 for AVX-512's own polynomial (emulated, not run here); 2^-22
// leaves a little room and still fails a polynomial one degree short (~3e-6 for the
// degree-5 Taylor series).
constexpr double kMaxRelativeError = 2.4e-7;

TEST(SoftmaxExp2, RelativeErrorOverTheNormalRange) {
  OnEveryTarget([](int64_t target) {
    std::mt19937_64 rng(1234 + target);
    std::vector<float> x;
    // Random arguments over the whole normal range, small ones (where 2^x ≈ 1 + x·ln 2),
    // and arguments just above and below whole numbers (f = x − round(x) near ±1/2 and 0).
    std::uniform_real_distribution<float> wide(-126.0f, 0.0f), narrow(-1.0f, 0.0f);
    for (int i = 0; i < 200000; ++i) x.push_back(wide(rng));
    for (int i = 0; i < 50000; ++i) x.push_back(narrow(rng));
    for (int k = 0; k <= 125; ++k) {
      for (float frac : {0.5f, 0.4999999f, 0.5000001f, 1e-6f, 0.999999f}) x.push_back(-(k + frac));
    }
    x.push_back(-1e-30f), x.push_back(-1e-7f), x.push_back(-std::numeric_limits<float>::denorm_min());
    const std::vector<float> got = Exp2(x);
    float worst_x = 0.0f;
    const double worst = WorstRelativeError(x, got, &worst_x);
    std::printf("[ exp2     ] worst relative error %.3g at x = %.9g\n", worst, worst_x);
    EXPECT_LE(worst, kMaxRelativeError) << "at x = " << worst_x;
  });
}

TEST(SoftmaxExp2, RoundsIntoTheSubnormalsOnce) {
  OnEveryTarget([](int64_t target) {
    std::mt19937_64 rng(99 + target);
    std::uniform_real_distribution<float> sub(-149.5f, -126.0f);
    std::vector<float> x;
    for (int i = 0; i < 50000; ++i) x.push_back(sub(rng));
    const std::vector<float> got = Exp2(x);
    const long double tiny = std::numeric_limits<float>::denorm_min();  // 2^-149
    for (size_t i = 0; i < x.size(); ++i) {
      const long double exact = std::exp2(static_cast<long double>(x[i]));
      // One rounding to the subnormal grid (half a step) on top of the normal-range
      // error: a second rounding, or a flush to zero, would miss this.
      const long double allowed = tiny / 2 + exact * kMaxRelativeError;
      ASSERT_LE(std::fabs(got[i] - exact), allowed) << "x = " << x[i] << ": got " << got[i];
    }
  });
}

TEST(SoftmaxExp2, ExactValuesTheKernelsRelyOn) {
  OnEveryTarget([](int64_t) {
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> x = {0.0f, -0.0f, -inf, -151.0f, -160.5f, -1e30f, -std::numeric_limits<float>::max(),
                            std::numeric_limits<float>::quiet_NaN()};
    for (int k = 1; k <= 149; ++k) x.push_back(static_cast<float>(-k));  // whole powers of two, subnormal ones too
    const std::vector<float> got = Exp2(x);
    EXPECT_EQ(got[0], 1.0f);
    EXPECT_EQ(got[1], 1.0f);
    for (int i = 2; i <= 6; ++i) EXPECT_EQ(got[i], 0.0f) << "x = " << x[i];
    EXPECT_TRUE(std::isnan(got[7]));
    for (int k = 1; k <= 149; ++k) EXPECT_EQ(got[7 + k], std::ldexp(1.0f, -k)) << "x = " << -k;
  });
}

TEST(SoftmaxExp2, NeverAboveOne) {
  // p = 2^(s − m) ≤ 1 is what keeps the running sums and the output in range; the
  // arguments just below 0 are where a polynomial could round above it.
  OnEveryTarget([](int64_t target) {
    std::vector<float> x;
    float v = -0.0f;
    for (int i = 0; i < 20000; ++i) x.push_back(v = std::nextafter(v, -1.0f));
    for (float y = -1e-6f; x.size() < 40000;) x.push_back(y = std::nextafter(y, -1.0f));
    std::mt19937_64 rng(7 + target);
    std::uniform_real_distribution<float> near(-0.6f, 0.0f);
    for (int i = 0; i < 20000; ++i) x.push_back(near(rng));
    const std::vector<float> got = Exp2(x);
    for (size_t i = 0; i < x.size(); ++i) ASSERT_LE(got[i], 1.0f) << "x = " << x[i];
  });
}

// The bf16 kernels' exponential (Exp2Probability in src/cpu/amx_tiles-inl.h, AVX-512):
// within 3.4e-6 over the normal range, exact at 2^0, continuous below every whole
// number (a row's largest score gives x = ±a rounding residue: the degree-3 fit it
// replaced returned 1 − 8.6e-5 for x = −tiny), 0 for −∞, NaN kept.
TEST(ProbabilityExp2, WithinItsBoundAndContinuousAtWholeNumbers) {
  std::vector<float> x;
  std::mt19937_64 rng(99);
  std::uniform_real_distribution<float> wide(-126.0f, 0.0f), narrow(-1.0f, 0.0f);
  for (int i = 0; i < 100000; ++i) x.push_back(wide(rng)), x.push_back(narrow(rng));
  for (int k = 0; k <= 125; ++k) {
    for (float below : {1e-7f, 1e-6f, 1e-3f}) x.push_back(-static_cast<float>(k) - below);
    x.push_back(-static_cast<float>(k));
    x.push_back(std::nextafter(-static_cast<float>(k), -200.0f));
  }
  x.push_back(-std::numeric_limits<float>::denorm_min());
  std::vector<float> got(x.size(), -1.0f);
  if (!detail::probability_exp2(x.data(), got.data(), x.size())) GTEST_SKIP() << "this CPU does not run the bf16 kernels";
  float worst_x = 0.0f;
  const double worst = WorstRelativeError(x, got, &worst_x);
  EXPECT_LE(worst, 3.6e-6) << "at x = " << worst_x;
  const float special[] = {0.0f, -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  float out[3];
  ASSERT_TRUE(detail::probability_exp2(special, out, 3));
  EXPECT_EQ(out[0], 1.0f);
  EXPECT_EQ(out[1], 0.0f);
  EXPECT_TRUE(std::isnan(out[2]));
}

}  // namespace
}  // namespace attn::testing
