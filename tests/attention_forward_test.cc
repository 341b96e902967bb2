// The fused forward against the float64 reference: sizes, head dims, every option
// alone and in random combinations, on fresh random inputs.
#include <gtest/gtest.h>

#include <cmath>

#include "attention_harness.hpp"

namespace attn::testing {
namespace {

using AttentionForward = PooledErrorTest;

const int kSizes[] = {1, 2, 3, 17, 63, 64, 65, 100, 1000};
const int kHeadDims[] = {1, 7, 32, 64, 80, 96, 128, 256};

TEST_F(AttentionForward, EverySizePairUnderEveryCausalMode) {
  auto rng = make_rng(1);
  for (int lq : kSizes) {
    for (int lk : kSizes) {
      for (Causal c : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
        Config s;
        s.Lq = lq, s.Lk = lk, s.d = 32, s.dv = 32, s.Hq = 2, s.Hkv = 2;
        s.opt.causal = c;
        s.want_probs = lq * lk <= 100 * 100;
        SCOPED_TRACE(s.describe());
        EXPECT_TRUE(ledger.check(run_case(s, rng)));
      }
    }
  }
}

TEST_F(AttentionForward, EveryHeadDimPair) {
  auto rng = make_rng(2);
  for (int d : kHeadDims) {
    for (int dv : kHeadDims) {
      Config s;
      s.Lq = 65, s.Lk = 100, s.d = d, s.dv = dv;
      s.opt.causal = (d + dv) % 3 == 0 ? Causal::BottomRight : Causal::None;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_case(s, rng)));
    }
  }
}

TEST_F(AttentionForward, LongSequencesAtLargeHeadDims) {
  auto rng = make_rng(3);
  for (int d : {64, 128, 256}) {
    Config s;
    s.Lq = 1000, s.Lk = 1000, s.d = d, s.dv = d;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, CustomScale) {
  auto rng = make_rng(4);
  for (float scale : {0.01f, 0.3f, 2.0f}) {
    Config s;
    s.Lq = 63, s.Lk = 65, s.opt.scale = scale;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, CausalAlignmentsWithUnequalLengths) {
  auto rng = make_rng(5);
  for (auto [lq, lk] : {std::pair{17, 100}, {100, 17}, {64, 1000}, {1000, 63}, {1, 65}, {65, 1}}) {
    for (Causal c : {Causal::TopLeft, Causal::BottomRight}) {
      Config s;
      s.Lq = lq, s.Lk = lk, s.opt.causal = c, s.want_probs = true;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_case(s, rng)));
    }
  }
}

TEST_F(AttentionForward, SlidingWindows) {
  auto rng = make_rng(6);
  const Window windows[] = {{0, 0}, {5, -1}, {-1, 5}, {16, 16}, {64, 0}, {100, 3}, {0, -1}};
  for (Window w : windows) {
    for (auto [lq, lk] : {std::pair{100, 100}, {65, 200}, {200, 65}}) {
      for (Causal c : {Causal::None, Causal::BottomRight, Causal::TopLeft}) {
        Config s;
        s.Lq = lq, s.Lk = lk, s.opt.window = w, s.opt.causal = c;
        s.want_probs = true;
        SCOPED_TRACE(s.describe());
        EXPECT_TRUE(ledger.check(run_case(s, rng)));
      }
    }
  }
}

TEST_F(AttentionForward, BooleanMasksInEveryBroadcastShape) {
  auto rng = make_rng(7);
  const int B = 2, H = 3, Lq = 65, Lk = 100;
  const std::vector<std::vector<int64_t>> shapes = {
      {B, H, Lq, Lk}, {B, 1, Lq, Lk}, {1, H, Lq, Lk}, {Lq, Lk}, {Lk}, {B, 1, 1, Lk},
      {B, H, Lq, 1},  {1, 1, 1, 1},   {H, 1, Lk}};
  for (const auto& shape : shapes) {
    Config s;
    s.B = B, s.Hq = H, s.Hkv = H, s.Lq = Lq, s.Lk = Lk, s.want_probs = true;
    s.set_bool_mask(shape, rng);
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, AdditiveMasksInEveryBroadcastShape) {
  auto rng = make_rng(8);
  const int B = 2, H = 3, Lq = 64, Lk = 129;
  const std::vector<std::vector<int64_t>> shapes = {
      {B, H, Lq, Lk}, {B, 1, Lq, Lk}, {1, H, Lq, Lk}, {Lq, Lk}, {Lk}, {B, 1, 1, Lk}, {B, H, Lq, 1}};
  for (const auto& shape : shapes) {
    Config s;
    s.B = B, s.Hq = H, s.Hkv = H, s.Lq = Lq, s.Lk = Lk, s.want_probs = true;
    s.set_add_mask(shape, rng);
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, AlibiPerHeadAndPerBatch) {
  auto rng = make_rng(9);
  for (bool per_batch : {false, true}) {
    for (Causal c : {Causal::None, Causal::BottomRight}) {
      Config s;
      s.B = 2, s.Hq = 4, s.Hkv = 2, s.Lq = 65, s.Lk = 130, s.opt.causal = c;
      s.set_alibi(per_batch, rng);
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_case(s, rng)));
    }
  }
}

TEST_F(AttentionForward, Softcap) {
  auto rng = make_rng(10);
  for (float cap : {0.5f, 5.0f, 50.0f}) {
    Config s;
    s.Lq = 100, s.Lk = 100, s.opt.softcap = cap;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
    s.input_scale = 3.0f;  // logits up to ~20: capped hard
    EXPECT_TRUE(ledger.check(run_case(s, rng), /*absolute_bar=*/false));
  }
}

// Logits of tens: f32 rounds each score to eps·|s|, so only the 2× rule applies.
TEST_F(AttentionForward, LargeLogitsKeepTheTwiceThePlainErrorBar) {
  auto rng = make_rng(18);
  for (int d : {7, 64, 127}) {
    for (Causal c : {Causal::None, Causal::BottomRight}) {
      Config s;
      s.Lq = 100, s.Lk = 300, s.Hq = 2, s.Hkv = 1, s.d = d, s.dv = 33, s.input_scale = 3.0f;
      s.opt.scale = 1.5f, s.opt.causal = c, s.want_probs = true;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_case(s, rng), /*absolute_bar=*/false));
    }
  }
}

TEST_F(AttentionForward, GroupedAndMultiQueryHeads) {
  auto rng = make_rng(11);
  for (int hkv : {8, 2, 1}) {
    Config s;
    s.Hq = 8, s.Hkv = hkv, s.Lq = 63, s.Lk = 65, s.d = 64, s.dv = 64;
    s.opt.causal = Causal::BottomRight;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, StridedBhsdViews) {
  auto rng = make_rng(12);
  for (Causal c : {Causal::None, Causal::TopLeft}) {
    Config s;
    s.B = 2, s.Hq = 4, s.Hkv = 2, s.Lq = 65, s.Lk = 100, s.d = 80, s.dv = 96, s.bhsd = true;
    s.opt.causal = c;
    s.want_probs = true;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, BatchesAndVariableLengths) {
  auto rng = make_rng(13);
  {
    Config s;
    s.B = 3, s.Lq = 17, s.Lk = 65, s.Hq = 2, s.Hkv = 1;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
  for (Causal c : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
    Config s;
    s.Hq = 4, s.Hkv = 2;
    s.set_varlen({1, 17, 0, 100, 64}, {3, 17, 5, 65, 130});
    s.opt.causal = c;
    s.want_probs = true;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, PerBatchKeyLengths) {
  auto rng = make_rng(14);
  for (Causal c : {Causal::None, Causal::BottomRight}) {
    Config s;
    s.B = 4, s.Lq = 17, s.Lk = 100, s.opt.causal = c, s.want_probs = true;
    s.set_key_lengths(rng);
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

TEST_F(AttentionForward, UserScoreModAndMaskMod) {
  auto rng = make_rng(15);
  // A relative-position bias and a "document" mask, as FlexAttention's examples.
  auto score_mod = [](float s, int b, int h, int i, int j) {
    return s + 0.05f * static_cast<float>((h + 1) * (i - j) % 7) - 0.01f * b;
  };
  auto mask_mod = [](int, int, int i, int j) { return (i / 10) == (j / 13) || j % 5 == 0; };
  const detail::ModPair<decltype(score_mod), decltype(mask_mod)> both{score_mod, mask_mod};
  const detail::ModPair<decltype(score_mod), NoMaskMod> score_only{score_mod, {}};
  const detail::ModPair<NoScoreMod, decltype(mask_mod)> mask_only{{}, mask_mod};
  const detail::UserMods all[] = {detail::make_user_mods(both), detail::make_user_mods(score_only),
                                  detail::make_user_mods(mask_only)};
  for (const auto& m : all) {
    Config s;
    s.B = 2, s.Hq = 2, s.Hkv = 1, s.Lq = 100, s.Lk = 130, s.want_probs = true;
    s.opt.causal = Causal::BottomRight;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng, {&m})));
  }
}

TEST_F(AttentionForward, UserModsThroughThePublicTemplate) {
  // The public overload must agree with the reference overload on the same mods.
  auto rng = make_rng(16);
  const int Lq = 40, Lk = 70, d = 16;
  std::vector<float> q(Lq * d), k(Lk * d), v(Lk * d), out(Lq * d), ref(Lq * d);
  std::uniform_real_distribution<float> u(-1, 1);
  for (auto* vec : {&q, &k, &v}) {
    for (float& x : *vec) x = u(rng);
  }
  const TensorView qv(q.data(), DType::f32, {1, Lq, 1, d}), kv(k.data(), DType::f32, {1, Lk, 1, d}),
      vv(v.data(), DType::f32, {1, Lk, 1, d});
  auto sm = [](float s, int, int, int i, int j) { return s - 0.1f * std::abs(i - j); };
  auto mm = [](int, int, int i, int j) { return (i + j) % 3 != 0; };
  attention(qv, kv, vv, TensorView(out.data(), DType::f32, {1, Lq, 1, d}), {}, sm, mm);
  attention_reference(qv, kv, vv, TensorView(ref.data(), DType::f32, {1, Lq, 1, d}), {}, sm, mm);
  double num = 0, den = 0;
  for (size_t i = 0; i < out.size(); ++i) num += (out[i] - ref[i]) * (out[i] - ref[i]), den += ref[i] * ref[i];
  EXPECT_LE(std::sqrt(num / den), 1e-6);
}

// Every option at once, drawn at random, many times.
TEST_F(AttentionForward, RandomCombinationsOfEveryOption) {
  auto rng = make_rng(17);
  auto pick = [&](auto const& xs) { return xs[std::uniform_int_distribution<size_t>(0, std::size(xs) - 1)(rng)]; };
  auto coin = [&] { return std::bernoulli_distribution(0.5)(rng); };
  const int small_sizes[] = {1, 2, 3, 17, 63, 64, 65, 100};
  for (int iter = 0; iter < 120; ++iter) {
    Config s;
    const int hkv = pick(std::vector<int>{1, 2, 3});
    s.Hkv = hkv, s.Hq = hkv * pick(std::vector<int>{1, 2, 4});
    s.d = pick(kHeadDims) % 129, s.dv = pick(kHeadDims) % 129;
    s.d = std::max(s.d, 1), s.dv = std::max(s.dv, 1);
    s.bhsd = coin();
    const bool varlen = !s.bhsd && coin();
    if (varlen) {
      std::vector<int> lq, lk;
      const int nb = pick(std::vector<int>{1, 2, 3});
      for (int b = 0; b < nb; ++b) lq.push_back(pick(small_sizes)), lk.push_back(pick(small_sizes));
      s.set_varlen(lq, lk);
    } else {
      s.B = pick(std::vector<int>{1, 2});
      s.Lq = pick(small_sizes), s.Lk = pick(small_sizes);
    }
    s.opt.causal = pick(std::vector<Causal>{Causal::None, Causal::TopLeft, Causal::BottomRight});
    if (coin()) s.opt.window = {pick(std::vector<int>{-1, 0, 3, 20}), pick(std::vector<int>{-1, 0, 4, 30})};
    if (coin()) s.opt.scale = pick(std::vector<float>{0.05f, 0.1f, 0.3f});
    if (coin()) s.opt.softcap = pick(std::vector<float>{1.0f, 10.0f});
    if (coin()) s.set_alibi(coin(), rng);
    if (coin() && !varlen) s.set_key_lengths(rng);
    const int mask_kind = pick(std::vector<int>{0, 1, 2});
    if (mask_kind == 1) s.set_bool_mask({s.B, 1, s.Lq, s.Lk}, rng);
    if (mask_kind == 2) s.set_add_mask({1, s.Hq, s.Lq, s.Lk}, rng);
    s.want_probs = coin();
    s.input_scale = pick(std::vector<float>{0.5f, 1.0f});
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(ledger.check(run_case(s, rng)));
  }
}

}  // namespace
}  // namespace attn::testing
