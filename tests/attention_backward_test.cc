// The fused backward against the float64 reference backward: every option alone
// and in combination, the forward tests' shapes, strided views, GQA, varlen,
// dbias, dropout, user modifiers; bitwise identical gradients on 1, 2, 3 threads.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "attention_harness.hpp"
#include "cpu/attention_forward.hpp"  // simd_targets, force_simd_target

namespace attn::testing {
namespace {

using AttentionBackward = PooledGradTest;

TEST_F(AttentionBackward, SizesAndCausalModes) {
  auto rng = make_rng(501);
  for (int lq : {1, 3, 17, 64, 65, 100}) {
    for (int lk : {1, 2, 63, 65, 130}) {
      for (Causal c : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
        Config s;
        s.Lq = lq, s.Lk = lk, s.d = 32, s.dv = 32, s.Hq = 2, s.Hkv = 1;
        s.opt.causal = c;
        SCOPED_TRACE(s.describe());
        EXPECT_TRUE(ledger.check(run_backward_case(s, rng)));
      }
    }
  }
}

TEST_F(AttentionBackward, HeadDims) {
  auto rng = make_rng(502);
  for (int d : {1, 7, 32, 64, 80, 96, 128, 256}) {
    for (int dv : {1, 64, 96, 256}) {
      Config s;
      s.Lq = 65, s.Lk = 100, s.d = d, s.dv = dv, s.opt.causal = d % 2 ? Causal::BottomRight : Causal::None;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_backward_case(s, rng)));
    }
  }
}

TEST_F(AttentionBackward, LongSequence) {
  auto rng = make_rng(503);
  Config s;
  s.Lq = 1000, s.Lk = 1000, s.d = 64, s.dv = 64, s.Hq = 2, s.Hkv = 1, s.opt.causal = Causal::TopLeft;
  EXPECT_TRUE(ledger.check(run_backward_case(s, rng)));
}

TEST_F(AttentionBackward, EveryOption) {
  auto rng = make_rng(504);
  auto base = [] {
    Config s;
    s.B = 2, s.Lq = 65, s.Lk = 130, s.Hq = 4, s.Hkv = 2, s.d = 64, s.dv = 48;
    return s;
  };
  std::vector<Config> cases;
  { Config s = base(); s.opt.window = {20, 5}; cases.push_back(s); }
  { Config s = base(); s.opt.softcap = 2.0f; cases.push_back(s); }
  { Config s = base(); s.set_alibi(true, rng); cases.push_back(s); }
  { Config s = base(); s.set_bool_mask({s.B, 1, s.Lq, s.Lk}, rng, 0.7); cases.push_back(s); }
  { Config s = base(); s.set_add_mask({1, s.Hq, s.Lq, s.Lk}, rng, 0.1); cases.push_back(s); }
  { Config s = base(); s.set_key_lengths(rng); s.opt.causal = Causal::BottomRight; cases.push_back(s); }
  { Config s = base(); s.bhsd = true; s.opt.causal = Causal::TopLeft; cases.push_back(s); }
  { Config s = base(); s.Hkv = 1; s.Hq = 8; cases.push_back(s); }  // MQA 8:1
  { Config s = base(); s.opt.scale = 0.3f; cases.push_back(s); }
  { Config s = base(); s.opt.dropout_p = 0.2f; s.opt.seed = 7; s.opt.offset = 1; cases.push_back(s); }
  {
    Config s = base();
    s.set_varlen({1, 17, 0, 100}, {3, 17, 5, 130});
    s.opt.causal = Causal::BottomRight;
    cases.push_back(s);
  }
  for (Config& s : cases) {
    // Re-point option views at this copy's storage.
    if (!s.bool_mask_data.empty()) s.opt.mask = TensorView(s.bool_mask_data.data(), DType::boolean, s.opt.mask.shape());
    if (!s.add_mask_data.empty()) s.opt.mask = TensorView(s.add_mask_data.data(), DType::f32, s.opt.mask.shape());
    if (!s.alibi_data.empty()) s.opt.alibi_slopes = TensorView(s.alibi_data.data(), DType::f32, s.opt.alibi_slopes.shape());
    if (!s.key_length_data.empty()) s.opt.key_lengths = TensorView(s.key_length_data.data(), DType::i32, {s.B});
    if (!s.cu_q_data.empty()) {
      s.opt.cu_seqlens_q = TensorView(s.cu_q_data.data(), DType::i32, {s.B + 1});
      s.opt.cu_seqlens_k = TensorView(s.cu_k_data.data(), DType::i32, {s.B + 1});
    }
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_backward_case(s, rng)));
  }
}

TEST_F(AttentionBackward, BiasGradientsReduceOverBroadcastDimensions) {
  auto rng = make_rng(505);
  const int B = 2, H = 3, Lq = 40, Lk = 70;
  const std::vector<std::vector<int64_t>> shapes = {{B, H, Lq, Lk}, {1, H, Lq, Lk}, {Lq, Lk}, {B, 1, 1, Lk}, {H, Lq, 1}};
  for (const auto& shape : shapes) {
    Config s;
    s.B = B, s.Hq = H, s.Hkv = H, s.Lq = Lq, s.Lk = Lk, s.opt.causal = Causal::BottomRight;
    s.set_add_mask(shape, rng, 0.05);
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_backward_case(s, rng, {}, /*want_dbias=*/true)));
  }
  EXPECT_TRUE(ledger.pooled_within_factor_of_plain());
}

TEST_F(AttentionBackward, UserScoreModWithItsDerivative) {
  auto rng = make_rng(506);
  auto sm = [](auto x, int, int h, int i, int j) { return x * (1 + 0.25 * h) - 0.02 * std::abs(i - j); };
  auto sg = [](auto, int, int h, int, int) { return 1 + 0.25 * h; };
  auto mm = [](int, int, int i, int j) { return (i / 8) != (j / 8) + 1; };
  const detail::ModTriple<decltype(sm), decltype(sg), decltype(mm)> triple{sm, sg, mm};
  const detail::UserMods mods = detail::make_user_mods(triple);
  Config s;
  s.B = 2, s.Hq = 2, s.Hkv = 1, s.Lq = 70, s.Lk = 90, s.opt.causal = Causal::BottomRight;
  EXPECT_TRUE(ledger.check(run_backward_case(s, rng, {&mods})));
}

// Pooled at 3× the plain f32 error, not 2×: the random draws include ALiBi and mask
// offsets of tens, and the backward (as FlashAttention's) recomputes P = exp(S − lse)
// from the f32 lse the forward returned, which carries 0.5 ulp of |lse| (a few e-6
// at |lse| ~ 40) into every P; the plain code takes S − max before the exp and never
// rounds a large lse. Measured over 100 runs: pooled ratios up to ~2.7×. Every
// option on its own (the tests above) stays within 2×.
TEST(AttentionBackwardCombinations, RandomCombinations) {
  GradLedger ledger(3.0);
  auto rng = make_rng(507);
  auto pick = [&](auto const& xs) { return xs[std::uniform_int_distribution<size_t>(0, std::size(xs) - 1)(rng)]; };
  auto coin = [&] { return std::bernoulli_distribution(0.5)(rng); };
  const int sizes[] = {1, 2, 3, 17, 63, 64, 65, 100};
  for (int iter = 0; iter < 40; ++iter) {
    Config s;
    s.Hkv = pick(std::vector<int>{1, 2}), s.Hq = s.Hkv * pick(std::vector<int>{1, 2, 4});
    s.d = pick(std::vector<int>{1, 7, 32, 64, 80}), s.dv = pick(std::vector<int>{1, 16, 64, 96});
    s.bhsd = coin();
    if (!s.bhsd && coin()) {
      s.set_varlen({pick(sizes), pick(sizes)}, {pick(sizes), pick(sizes)});
    } else {
      s.B = pick(std::vector<int>{1, 2}), s.Lq = pick(sizes), s.Lk = pick(sizes);
    }
    s.opt.causal = pick(std::vector<Causal>{Causal::None, Causal::TopLeft, Causal::BottomRight});
    if (coin()) s.opt.window = {pick(std::vector<int>{-1, 0, 5, 30}), pick(std::vector<int>{-1, 0, 7})};
    if (coin()) s.opt.softcap = pick(std::vector<float>{1.0f, 5.0f});
    if (coin()) s.set_alibi(coin(), rng);
    const bool dropout = coin();
    if (!dropout && coin() && s.seq_q.empty()) s.set_key_lengths(rng);
    if (!dropout && coin()) s.set_add_mask({1, s.Hq, s.Lq, s.Lk}, rng, 0.1);
    if (dropout) {
      // Rows with a single visible key have a gradient of exactly 0 that dropout
      // turns into ~1e-7 residues (DropoutSingleKeyRows below): keep every row
      // with several keys here, so that relative errors mean something.
      s.opt.dropout_p = 0.25f, s.opt.seed = rng();
      s.opt.window = {-1, -1};
      if (s.opt.causal == Causal::TopLeft) s.opt.causal = Causal::None;
      if (!s.seq_q.empty()) s.set_varlen({pick(sizes), pick(sizes)}, {65, 100});
      else s.Lk = std::max(s.Lk + 17, s.Lq + 17);
    }
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_backward_case(s, rng, {}, /*want_dbias=*/true)));
  }
  EXPECT_TRUE(ledger.pooled_within_factor_of_plain());
}

// With dropout, a row with one visible key has dS = P(dP − D) = 0 exactly, but
// D = rowsum(dO ∘ O) (FlashAttention's way; O carries the rounded 1/(1 − p)) and
// dP·m round differently: dq and dk get f32 residues instead of 0 (the plain
// code, taking D from its own dP, cancels exactly). Relative error means nothing
// against 0, so these rows are held to an absolute bound.
TEST(AttentionBackwardDropout, SingleKeyRowsLeaveOnlyRoundingResidues) {
  auto rng = make_rng(509);
  for (int lq : {1, 17, 100}) {
    Config s;
    s.B = 2, s.Lq = lq, s.Lk = 1, s.Hq = 4, s.Hkv = 1, s.d = 64, s.dv = 96;
    s.opt.dropout_p = 0.25f, s.opt.seed = rng();
    const GradErrors e = run_backward_case(s, rng);
    EXPECT_FALSE(e.nan);
    // Absolute RMS error per element (the reference is 0 for dq and dk here): a
    // dq element carries one row's residue (~1e-7, bounded by 1e-6); a dk element
    // sums those of the Lq·(Hq/Hkv) rows that see its key. Rounding residues have
    // random signs, so the sum grows like the square root of their number (a
    // linear 1e-7 per row was too tight: 4.7e-7 for 4 rows under some seeds).
    EXPECT_LE(std::sqrt(e.dq.fused / e.dq.count), 1e-6) << e.summary();
    EXPECT_LE(std::sqrt(e.dk.fused / e.dk.count), 1e-6 * std::sqrt(double(lq) * (s.Hq / s.Hkv))) << e.summary();
    EXPECT_LE(e.dv.fused_rel(), 1e-5) << e.summary();
  }
}

TEST(AttentionBackwardThreads, BitwiseIdenticalGradientsForAnyThreadCount) {
  const int saved = num_threads();
  auto rng = make_rng(508);
  Config s;
  s.Hq = 4, s.Hkv = 2, s.d = 64, s.dv = 48;
  s.set_varlen({300, 17, 129}, {400, 65, 129});
  s.opt.causal = Causal::BottomRight, s.opt.dropout_p = 0.1f, s.opt.seed = 3;
  s.set_alibi(false, rng);
  std::vector<float> results[3];
  for (int t = 1; t <= 3; ++t) {
    set_num_threads(t);
    results[t - 1] = run_backward_raw(s, 99);
  }
  set_num_threads(saved);
  for (int t = 2; t <= 3; ++t) {
    ASSERT_EQ(results[0].size(), results[t - 1].size());
    EXPECT_EQ(0, std::memcmp(results[0].data(), results[t - 1].data(), results[0].size() * sizeof(float)))
        << "1 thread and " << t << " threads differ";
  }
}

// The backward on every Highway target this CPU supports, every option that
// changes the tile code: AVX2's 48×32 tiles (3-row blocks that do not divide 32
// keys) once wrote a padding key row over the query tile, and AVX-512 machines
// never ran them.
TEST(AttentionBackwardTargets, EverySimdTargetMatchesTheReference) {
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    std::printf("[ target   ] %s\n", detail::attention_forward_target());
    GradLedger ledger(3.0);
    auto rng = make_rng(510 + target);
    for (int d : {1, 33, 64, 128}) {
      Config s;
      s.Lq = 70, s.Lk = 131, s.d = d, s.dv = d == 33 ? 80 : d, s.Hq = 2, s.Hkv = 1;
      s.opt.causal = d % 2 ? Causal::BottomRight : Causal::None;
      s.opt.window = {d == 64 ? 40 : -1, -1};
      if (d == 128) s.set_bool_mask({s.Lq, s.Lk}, rng), s.set_alibi(false, rng), s.opt.softcap = 5.0f;
      if (d == 33) s.set_add_mask({1, s.Hq, s.Lq, s.Lk}, rng);
      if (d == 1) s.opt.dropout_p = 0.2f, s.opt.seed = rng();
      EXPECT_TRUE(ledger.check(run_backward_case(s, rng, {}, d == 33)));
    }
    EXPECT_TRUE(ledger.pooled_within_factor_of_plain());
  }
  detail::force_simd_target(0);
}

}  // namespace
}  // namespace attn::testing
