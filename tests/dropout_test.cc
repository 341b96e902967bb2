// Dropout: Philox's known answers, the keep rate, agreement of the kernel with the
// reference and with dropout_mask, thread invariance, p = 0, and the expectation.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "attention_harness.hpp"
#include "cpu/attention_forward.hpp"  // simd_targets, force_simd_target
#include "dropout/philox.hpp"

namespace attn::testing {
namespace {

// Random123's published known-answer vectors for Philox-4x32-10.
TEST(Philox, KnownAnswers) {
  using detail::philox4x32_10;
  EXPECT_EQ(philox4x32_10({0, 0, 0, 0}, {0, 0}),
            (detail::PhiloxCounter{0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}));
  EXPECT_EQ(philox4x32_10({0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}, {0xffffffffu, 0xffffffffu}),
            (detail::PhiloxCounter{0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}));
  EXPECT_EQ(philox4x32_10({0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u}),
            (detail::PhiloxCounter{0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}));
}

TEST(Dropout, KeepRateWithinStatisticalBounds) {
  const int B = 2, H = 3, Lq = 100, Lk = 301;
  std::vector<uint8_t> mask(B * H * Lq * Lk);
  const TensorView mv(mask.data(), DType::boolean, {B, H, Lq, Lk});
  for (float p : {0.0f, 0.1f, 0.5f, 0.9f}) {
    dropout_mask(mv, p, /*seed=*/base_seed(), /*offset=*/7);
    double kept = 0;
    for (uint8_t x : mask) kept += x;
    const double n = static_cast<double>(mask.size()), rate = kept / n;
    const double sigma = std::sqrt(p * (1 - p) / n);
    EXPECT_NEAR(rate, 1.0 - p, 5 * sigma + 1e-12) << "p=" << p;
  }
  // Another offset draws another mask; the same one, the same mask.
  std::vector<uint8_t> a(mask.size()), b(mask.size()), c(mask.size());
  dropout_mask(TensorView(a.data(), DType::boolean, {B, H, Lq, Lk}), 0.5f, 42, 1);
  dropout_mask(TensorView(b.data(), DType::boolean, {B, H, Lq, Lk}), 0.5f, 42, 2);
  dropout_mask(TensorView(c.data(), DType::boolean, {B, H, Lq, Lk}), 0.5f, 42, 1);
  EXPECT_NE(a, b);
  EXPECT_EQ(a, c);
  EXPECT_THROW(dropout_mask(mv, 1.0f, 1), Error);
  EXPECT_THROW(dropout_mask(TensorView(a.data(), DType::f32, {4}), 0.5f, 1), Error);
}

using DropoutForward = PooledErrorTest;

TEST_F(DropoutForward, MatchesTheReferenceWithTheSameMask) {
  auto rng = make_rng(301);
  for (float p : {0.1f, 0.5f}) {
    for (Causal c : {Causal::None, Causal::BottomRight}) {
      Config s;
      s.B = 2, s.Hq = 4, s.Hkv = 2, s.Lq = 100, s.Lk = 130, s.d = 64, s.dv = 48, s.want_probs = true;
      s.opt.causal = c, s.opt.dropout_p = p, s.opt.seed = rng(), s.opt.offset = 3;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_case(s, rng)));
    }
  }
  Config v;  // varlen with a mask and ALiBi too
  v.Hq = 2, v.want_probs = true, v.opt.dropout_p = 0.3f, v.opt.seed = 99;
  v.set_varlen({17, 65}, {40, 100});
  v.set_alibi(false, rng);
  EXPECT_TRUE(ledger.check(run_case(v, rng)));
}

// Dropout's forward on every Highway target this CPU supports (issue 11, item 5): the
// tile shapes differ per target (AVX2's 48×32, AVX-512's 64×64), and the Philox
// decisions must land on the same (i, j) whatever the tiling.
TEST(DropoutTargets, EverySimdTargetMatchesTheReference) {
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    ErrorLedger ledger;
    auto rng = make_rng(320 + target);
    for (int d : {1, 40, 128}) {
      Config s;
      s.Lq = 70, s.Lk = 131, s.d = d, s.dv = d, s.Hq = 2, s.Hkv = 1, s.want_probs = true;
      s.opt.causal = d == 40 ? Causal::BottomRight : Causal::None;
      s.opt.dropout_p = 0.25f, s.opt.seed = rng(), s.opt.offset = 5;
      EXPECT_TRUE(ledger.check(run_case(s, rng)));
    }
    EXPECT_TRUE(ledger.pooled_within_factor_of_plain());
  }
  detail::force_simd_target(0);
}

TEST(Dropout, ZeroProbabilityIsBitwiseNoDropout) {
  Config s;
  s.Lq = 70, s.Lk = 90, s.Hq = 2, s.Hkv = 2, s.want_probs = true, s.opt.causal = Causal::TopLeft;
  const std::vector<float> plain = run_fused_raw(s, 5);
  s.opt.seed = 1234, s.opt.offset = 5;  // p = 0: the seed must not matter
  const std::vector<float> zero = run_fused_raw(s, 5);
  ASSERT_EQ(plain.size(), zero.size());
  EXPECT_EQ(0, std::memcmp(plain.data(), zero.data(), plain.size() * sizeof(float)));
}

TEST(Dropout, SameMaskAndOutputsOnAnyThreadCount) {
  const int saved = num_threads();
  Config s;
  s.Hq = 4, s.Hkv = 1, s.d = 32, s.dv = 32, s.want_probs = true;
  s.set_varlen({200, 33}, {250, 64});
  s.opt.dropout_p = 0.25f, s.opt.seed = 2024, s.opt.offset = 11;
  std::vector<float> results[3];
  for (int t = 1; t <= 3; ++t) {
    set_num_threads(t);
    results[t - 1] = run_fused_raw(s, 77);
  }
  set_num_threads(saved);
  for (int t = 2; t <= 3; ++t) {
    EXPECT_EQ(0, std::memcmp(results[0].data(), results[t - 1].data(), results[0].size() * sizeof(float)));
  }
}

// The probabilities the kernel returns are zero exactly where dropout_mask says.
TEST(Dropout, KernelAgreesWithDropoutMask) {
  const int B = 2, H = 3, Lq = 33, Lk = 70, d = 16;
  auto rng = make_rng(302);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(B * Lq * H * d), k(B * Lk * H * d), v(B * Lk * H * d), out(B * Lq * H * d);
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = u(rng);
  }
  std::vector<float> probs(B * H * Lq * Lk);
  std::vector<uint8_t> mask(probs.size());
  AttentionOptions opt;
  opt.dropout_p = 0.4f, opt.seed = rng(), opt.offset = 5;
  attention(TensorView(q.data(), DType::f32, {B, Lq, H, d}), TensorView(k.data(), DType::f32, {B, Lk, H, d}),
            TensorView(v.data(), DType::f32, {B, Lk, H, d}), TensorView(out.data(), DType::f32, {B, Lq, H, d}),
            opt, {}, TensorView(probs.data(), DType::f32, {B, H, Lq, Lk}));
  dropout_mask(TensorView(mask.data(), DType::boolean, {B, H, Lq, Lk}), opt.dropout_p, opt.seed, opt.offset);
  for (size_t n = 0; n < probs.size(); ++n) {
    ASSERT_EQ(probs[n] != 0.0f, mask[n] != 0) << "at flat index " << n;
  }
}

// E[dropout output] = the output without dropout: the mean over many seeds
// converges to it (and a single draw is far from it, so the test can fail).
TEST(Dropout, ExpectationOverSeedsIsTheNoDropoutOutput) {
  const int Lq = 20, Lk = 50, d = 16, seeds = 1000;
  auto rng = make_rng(303);
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(Lq * d), k(Lk * d), v(Lk * d), out(Lq * d), exact(Lq * d);
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = u(rng);
  }
  const TensorView qv(q.data(), DType::f32, {1, Lq, 1, d}), kv(k.data(), DType::f32, {1, Lk, 1, d}),
      vv(v.data(), DType::f32, {1, Lk, 1, d}), ov(out.data(), DType::f32, {1, Lq, 1, d});
  attention(qv, kv, vv, TensorView(exact.data(), DType::f32, {1, Lq, 1, d}));
  std::vector<double> mean(out.size(), 0.0);
  double single_err = 0, norm = 0;
  for (int s = 0; s < seeds; ++s) {
    AttentionOptions opt;
    opt.dropout_p = 0.3f, opt.seed = 12345, opt.offset = static_cast<uint64_t>(s);
    attention(qv, kv, vv, ov, opt);
    for (size_t n = 0; n < out.size(); ++n) {
      mean[n] += out[n] / seeds;
      if (s == 0) single_err += (out[n] - exact[n]) * (out[n] - exact[n]), norm += exact[n] * exact[n];
    }
  }
  double err = 0;
  for (size_t n = 0; n < out.size(); ++n) err += (mean[n] - exact[n]) * (mean[n] - exact[n]);
  const double rel = std::sqrt(err / norm), rel_single = std::sqrt(single_err / norm);
  // One draw's relative deviation is ~0.7 here; the mean of 1000 shrinks it ~30×.
  EXPECT_LT(rel, 0.1) << "single draw " << rel_single;
  EXPECT_GT(rel_single, 3 * rel);
}

}  // namespace
}  // namespace attn::testing

namespace attn::testing {
namespace {

TEST(Dropout, ZeroProbabilityBackwardIsBitwiseNoDropout) {
  Config s;
  s.Lq = 70, s.Lk = 90, s.Hq = 2, s.Hkv = 1, s.opt.causal = Causal::BottomRight;
  const std::vector<float> plain = run_backward_raw(s, 6);
  s.opt.seed = 99, s.opt.offset = 4;  // p = 0: the seed must not matter
  const std::vector<float> zero = run_backward_raw(s, 6);
  ASSERT_EQ(plain.size(), zero.size());
  EXPECT_EQ(0, std::memcmp(plain.data(), zero.data(), plain.size() * sizeof(float)));
}

}  // namespace
}  // namespace attn::testing
