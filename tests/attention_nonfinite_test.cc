// Non-finite and extreme inputs (issue 10, items 1–3): NaN and ±∞ in q, k, v,
// masks and dO; scores and masks near ±FLT_MAX. The fused forward and backward
// must give what the float64 reference gives: non-finite exactly where it is
// non-finite, and close to it elsewhere. Every case runs on every SIMD target
// this CPU supports, for every option that touches scores.
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attention_harness.hpp"  // make_rng
#include "attn/attention.hpp"
#include "cpu/attention_forward.hpp"  // simd_targets, force_simd_target

namespace attn::testing {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

/// One problem, dense BSHD, with optional additive or boolean mask [Hq, Lq, Lk].
struct Case {
  int B = 1, Lq = 1, Lk = 2, Hq = 1, Hkv = 1, d = 1, dv = 1;
  std::vector<float> q, k, v, dout, add_mask, alibi;
  std::vector<uint8_t> bool_mask;
  AttentionOptions opt;

  void resize() {
    q.assign(size_t(B) * Lq * Hq * d, 0.0f);
    k.assign(size_t(B) * Lk * Hkv * d, 0.0f);
    v.assign(size_t(B) * Lk * Hkv * dv, 0.0f);
    dout.assign(size_t(B) * Lq * Hq * dv, 0.0f);
  }
  void randomize(std::mt19937_64& rng) {
    resize();
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (auto* t : {&q, &k, &v, &dout}) {
      for (float& x : *t) x = u(rng);
    }
  }
  void bind() {
    if (!add_mask.empty()) opt.mask = TensorView(add_mask.data(), DType::f32, {Hq, Lq, Lk});
    if (!bool_mask.empty()) opt.mask = TensorView(bool_mask.data(), DType::boolean, {Hq, Lq, Lk});
    if (!alibi.empty()) opt.alibi_slopes = TensorView(alibi.data(), DType::f32, {Hq});
  }
};

struct Outputs {
  std::vector<float> out, lse, dq, dk, dv, dbias;
};

/// Runs the fused kernels (reference = false) or the float64 reference.
Outputs run(Case& c, bool reference, bool backward) {
  c.bind();
  Outputs o;
  o.out.assign(size_t(c.B) * c.Lq * c.Hq * c.dv, -7.0f);
  o.lse.assign(size_t(c.B) * c.Hq * c.Lq, -7.0f);
  const TensorView q(c.q.data(), DType::f32, {c.B, c.Lq, c.Hq, c.d});
  const TensorView k(c.k.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.d});
  const TensorView v(c.v.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.dv});
  const TensorView out(o.out.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv});
  const TensorView lse(o.lse.data(), DType::f32, {c.B, c.Hq, c.Lq});
  if (reference) {
    attention_reference(q, k, v, out, c.opt, lse);
  } else {
    attention(q, k, v, out, c.opt, lse);
  }
  if (!backward) return o;
  // Both backward passes get the reference's forward outputs, so that they
  // differ only in the backward itself.
  Outputs ref = reference ? o : run(c, true, false);
  o.dq.assign(c.q.size(), -7.0f), o.dk.assign(c.k.size(), -7.0f), o.dv.assign(c.v.size(), -7.0f);
  const TensorView rout(ref.out.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv});
  const TensorView rlse(ref.lse.data(), DType::f32, {c.B, c.Hq, c.Lq});
  const TensorView dout(c.dout.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv});
  const TensorView dq(o.dq.data(), DType::f32, {c.B, c.Lq, c.Hq, c.d});
  const TensorView dk(o.dk.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.d});
  const TensorView dv(o.dv.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.dv});
  TensorView dbias;
  if (!c.add_mask.empty()) {
    o.dbias.assign(c.add_mask.size(), -7.0f);
    dbias = TensorView(o.dbias.data(), DType::f32, {c.Hq, c.Lq, c.Lk});
  }
  if (reference) {
    attention_backward_reference(q, k, v, rout, rlse, dout, dq, dk, dv, c.opt, dbias);
  } else {
    attention_backward(q, k, v, rout, rlse, dout, dq, dk, dv, c.opt, dbias);
  }
  return o;
}

/// Same non-finite pattern (NaN and ±∞ count alike: f32 may underflow a
/// probability to 0 where float64 keeps 1e-60, turning ∞·p into 0·∞ = NaN), and
/// finite entries within 1e-4 of the reference, relative to the tensor's largest
/// finite reference magnitude (a screen for gross errors; accuracy is tested
/// elsewhere).
::testing::AssertionResult same(const char* what, const std::vector<float>& got,
                                const std::vector<float>& want, double floor = 0) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  double scale = 0;
  for (float x : want) {
    if (std::isfinite(x)) scale = std::max(scale, std::fabs(double{x}));
  }
  for (size_t n = 0; n < got.size(); ++n) {
    const bool gf = std::isfinite(got[n]), wf = std::isfinite(want[n]);
    bool ok = gf == wf;
    // When every finite reference value is 0 (a gradient that cancels exactly, e.g. dq
    // with one visible key, where P·(dP − D) is 0 in exact arithmetic), the kernel's
    // f32 rounding of dP and D leaves ~1e-9: allow 1e-6 absolute, a bound on that
    // rounding for the O(1) inputs of these cases.
    const double abs_tol = std::max(1e-4 * (scale > 0 ? scale : 1e-2), floor);
    if (ok && gf) ok = std::fabs(double{got[n]} - want[n]) <= abs_tol + 1e-5 * std::fabs(want[n]);
    if (ok && !gf && std::isinf(want[n]) && std::isinf(got[n])) ok = got[n] == want[n];
    if (!ok) {
      return ::testing::AssertionFailure() << what << "[" << n << "] = " << got[n] << ", reference "
                                           << want[n] << " (scale " << scale << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

/// The largest finite magnitude in t (0 if none).
double finite_max(const std::vector<float>& t) {
  double m = 0;
  for (float x : t) {
    if (std::isfinite(x)) m = std::max(m, std::fabs(double{x}));
  }
  return m;
}

::testing::AssertionResult agree(Case& c, bool backward) {
  const Outputs f = run(c, false, backward), r = run(c, true, backward);
  // dq and dk come from dS = P·(dP − D), a difference of two terms of size
  // |dout|·|v|·dv/(1 − dropout) that cancels exactly in some cases (one visible key),
  // where the reference gives 0 and f32 leaves its rounding of those terms. With a
  // sprinkled v of 1e30 that rounding is ~1e23, far above the 1e-6 `same` allows for
  // O(1) inputs: the floor below is 1e-6 of the cancelled terms (dbias is dS itself),
  // carried through k (for dq) or q (for dk) and summed over the keys or queries.
  const double cancelled = 1e-6 * finite_max(c.dout) * finite_max(c.v) * c.dv / (1.0 - c.opt.dropout_p);
  const double dq_floor = cancelled * finite_max(c.k) * c.Lk, dk_floor = cancelled * finite_max(c.q) * c.Lq;
  for (auto [name, a, b, floor] : {std::tuple{"out", &f.out, &r.out, 0.0}, {"lse", &f.lse, &r.lse, 0.0},
                                   {"dq", &f.dq, &r.dq, dq_floor}, {"dk", &f.dk, &r.dk, dk_floor},
                                   {"dv", &f.dv, &r.dv, 0.0}, {"dbias", &f.dbias, &r.dbias, cancelled}}) {
    auto res = same(name, *a, *b, floor);
    if (!res) return res;
  }
  return ::testing::AssertionSuccess();
}

/// Runs body() once per SIMD target the CPU supports.
template <class F>
void on_every_target(F body) {
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    SCOPED_TRACE(detail::attention_forward_target());
    body();
  }
  detail::force_simd_target(0);
}

// The example: a NaN key must not be dropped.
TEST(NonFinite, NanKeyMakesTheRowNan) {
  on_every_target([] {
    Case c;
    c.resize();
    c.q = {1}, c.k = {kNaN, 1}, c.v = {10, 20}, c.dout = {1};
    const Outputs f = run(c, false, true);
    EXPECT_TRUE(std::isnan(f.out[0])) << f.out[0];
    EXPECT_TRUE(std::isnan(f.lse[0])) << f.lse[0];
    EXPECT_TRUE(agree(c, true));
  });
}

// The softmax's row maximum may drop a NaN score (the max instructions do), which
// is harmless beside a finite score (the NaN's p turns the row NaN) but not where
// every other key of a tile is removed: the row would skip that tile. So a NaN
// key alone among removed keys, in the first key tile or a later one, after
// visible keys or none, must still make the row NaN. Lk = 130 spans three tiles
// on every target; keys 5 and 120 are NaN.
TEST(NonFinite, NanKeyAmongRemovedKeysMakesTheRowNan) {
  on_every_target([] {
    auto rng = make_rng(1250);
    Case c;
    c.Lq = 6, c.Lk = 130, c.d = 3, c.dv = 2;
    c.randomize(rng);
    for (int x = 0; x < c.d; ++x) c.k[5 * c.d + x] = kNaN, c.k[120 * c.d + x] = kNaN;
    const std::vector<std::vector<int>> kept = {
        {5, 100},    // NaN alone in tile 0, a finite key later
        {100, 120},  // a finite key beside the NaN in the same tile
        {100},       // no NaN
        {120},       // NaN alone, after tiles with nothing visible
        {7, 120},    // NaN alone in a later tile, after a finite key
        {5}};        // NaN the only key of the row
    c.bool_mask.assign(size_t(c.Hq) * c.Lq * c.Lk, 0);
    for (int i = 0; i < c.Lq; ++i) {
      for (int j : kept[i]) c.bool_mask[size_t(i) * c.Lk + j] = 1;
    }
    const Outputs f = run(c, false, false);
    for (int i = 0; i < c.Lq; ++i) {
      const bool want_nan = i != 2;
      EXPECT_EQ(std::isnan(f.out[size_t(i) * c.dv]), want_nan) << "row " << i << ": " << f.out[size_t(i) * c.dv];
      EXPECT_EQ(std::isnan(f.lse[i]), want_nan) << "row " << i << ": " << f.lse[i];
    }
    EXPECT_TRUE(agree(c, true));
  });
}

// A short last key tile packs (zeros) keys only up to its last key's vector, the
// last one the kernel reads; the rest of the packed tile keeps whatever an earlier
// call left there. So after a call whose keys and values past the first vector are
// NaN and ∞, a call with 5 keys (and then 21) must still be finite and right.
TEST(NonFinite, AShortCallReadsNothingAnEarlierCallLeftInThePacking) {
  // The tiled kernel's packing is what is tested: keep 3-query calls off the decode
  // kernel (kvcache/few_queries.hpp), which packs nothing.
  const FewQueriesOff tiled;
  on_every_target([] {
    auto rng = make_rng(1251);
    Case poison;
    poison.Lq = 3, poison.Lk = 64, poison.d = 8, poison.dv = 8;
    poison.randomize(rng);
    for (int j = 4; j < poison.Lk; ++j) {
      for (int x = 0; x < poison.d; ++x) poison.k[size_t(j) * poison.d + x] = j % 2 ? kNaN : kInf;
      for (int x = 0; x < poison.dv; ++x) poison.v[size_t(j) * poison.dv + x] = j % 3 ? -kInf : kNaN;
    }
    for (int lk : {5, 21}) {
      for (Causal causal : {Causal::None, Causal::BottomRight}) {
        run(poison, false, false);
        Case c;
        c.Lq = 3, c.Lk = lk, c.d = 8, c.dv = 8;
        c.opt.causal = causal;
        c.randomize(rng);
        const Outputs f = run(c, false, false);
        for (float x : f.out) ASSERT_TRUE(std::isfinite(x)) << "Lk " << lk;
        EXPECT_TRUE(agree(c, false)) << "Lk " << lk;
      }
    }
  });
}

// +∞ scores: the reference's softmax gives e^(∞ − ∞) = NaN, as PyTorch does.
TEST(NonFinite, InfiniteScoreMakesTheRowNan) {
  on_every_target([] {
    Case c;
    c.resize();
    c.q = {1}, c.k = {kInf, 1}, c.v = {10, 20}, c.dout = {1};
    const Outputs f = run(c, false, true);
    EXPECT_TRUE(std::isnan(f.out[0])) << f.out[0];
    EXPECT_TRUE(agree(c, true));
  });
}

// Finite scores above FLT_MAX / log₂e (2.4e38) are ordinary scores: the largest
// takes all the weight (today's base-2 folding overflowed them to +∞).
TEST(NonFinite, HugeFiniteScoresAreValues) {
  on_every_target([] {
    for (float big : {2.4e38f, 3.0e38f, FLT_MAX}) {
      Case c;
      c.resize();
      c.opt.scale = 1.0f;
      c.q = {1}, c.k = {big, 1}, c.v = {10, 20}, c.dout = {1};
      const Outputs f = run(c, false, false);
      EXPECT_EQ(10.0f, f.out[0]) << big;
      EXPECT_EQ(big, f.lse[0]) << big;
      EXPECT_TRUE(agree(c, true)) << big;
    }
  });
}

// Hugging Face's padding masks: −FLT_MAX on every key of a row is a value; the
// softmax over equal scores is the mean of v (today: 0 and lse −∞).
TEST(NonFinite, MinusFltMaxMaskOnEveryKeyGivesTheMean) {
  on_every_target([] {
    for (int lk : {2, 3, 17, 100, 1000}) {
      auto rng = make_rng(1000 + lk);
      Case c;
      c.Lq = 3, c.Lk = lk, c.d = 8, c.dv = 5;
      c.randomize(rng);
      c.add_mask.assign(size_t(c.Lq) * lk, 0.0f);
      for (int j = 0; j < lk; ++j) c.add_mask[j] = -FLT_MAX;  // row 0: every key
      for (int j = 0; j < lk; j += 2) c.add_mask[lk + j] = -FLT_MAX;  // row 1: half
      const Outputs f = run(c, false, false);
      for (int e = 0; e < c.dv; ++e) {
        double mean = 0;
        for (int j = 0; j < lk; ++j) mean += c.v[size_t(j) * c.dv + e];
        mean /= lk;
        EXPECT_NEAR(mean, f.out[e], 1e-5) << "Lk " << lk;
      }
      EXPECT_TRUE(agree(c, true)) << "Lk " << lk;
    }
  });
}

// Removed keys take no part: their values (NaN, ∞, FLT_MAX) never reach the
// output — in tiles that are skipped and in tiles that are computed — while a
// visible key's NaN value does. Masked keys' exponentials are exactly 0, not
// the ~2e-38 that once multiplied FLT_MAX into 8.
TEST(NonFinite, RemovedKeysValuesNeverReachTheOutput) {
  on_every_target([] {
    auto rng = make_rng(1100);
    for (float bad : {kNaN, kInf, -kInf, FLT_MAX, -FLT_MAX}) {
      for (int variant = 0; variant < 4; ++variant) {
        Case c;
        c.Lq = 70, c.Lk = 150, c.d = 16, c.dv = 16;
        c.randomize(rng);
        if (variant == 0) c.opt.causal = Causal::TopLeft;
        if (variant == 1) c.opt.window = {5, 3};
        if (variant == 2) {  // boolean mask removing keys 3 and 149 for every row
          c.bool_mask.assign(size_t(c.Lq) * c.Lk, 1);
          for (int i = 0; i < c.Lq; ++i) c.bool_mask[size_t(i) * c.Lk + 3] = c.bool_mask[size_t(i) * c.Lk + 149] = 0;
        }
        if (variant == 3) {  // −∞ additive mask on keys 3 and 149, and a −1e30 (visible) key 5
          c.add_mask.assign(size_t(c.Lq) * c.Lk, 0.0f);
          for (int i = 0; i < c.Lq; ++i) c.add_mask[size_t(i) * c.Lk + 3] = c.add_mask[size_t(i) * c.Lk + 149] = -kInf;
          for (int i = 0; i < c.Lq; ++i) c.add_mask[size_t(i) * c.Lk + 5] = -1e30f;
        }
        // Key 3 is removed for rows 0–2 under every variant; key 149 for row 0.
        for (int e = 0; e < c.dv; ++e) c.v[size_t(3) * c.dv + e] = bad;
        for (int e = 0; e < c.dv; ++e) c.v[size_t(149) * c.dv + e] = bad;
        const Outputs f = run(c, false, false);
        for (int e = 0; e < c.dv; ++e) EXPECT_TRUE(std::isfinite(f.out[e])) << bad << " variant " << variant;
        // (The backward of rows that do see a ±FLT_MAX value overflows f32 in
        // dP = dO·v, where float64 does not: forward only for those.)
        EXPECT_TRUE(agree(c, std::fabs(bad) != FLT_MAX)) << bad << " variant " << variant;
      }
    }
  });
}

// Every option that touches scores, with NaN, ±∞ and extreme finite numbers
// sprinkled into q, k, v, dO and the additive mask: the fused forward and
// backward agree with the reference element by element.
TEST(NonFinite, RandomSpecialsUnderEveryScoreOption) {
  on_every_target([] {
    auto rng = make_rng(1200);
    const float qk_specials[] = {kNaN, kInf, -kInf};
    const float mask_specials[] = {kNaN, kInf, -kInf, FLT_MAX, -FLT_MAX, -1e30f, 3e38f};
    const float v_specials[] = {kNaN, kInf, -kInf, 1e30f};
    std::uniform_real_distribution<double> u(0, 1);
    for (int option = 0; option < 7; ++option) {
      for (int rep = 0; rep < 3; ++rep) {
        Case c;
        const int sizes[][2] = {{1, 1}, {3, 17}, {17, 70}, {70, 131}};
        c.Lq = sizes[(option + rep) % 4][0], c.Lk = sizes[(option + rep) % 4][1];
        c.Hq = 2, c.Hkv = 1, c.d = 1 + (rep * 31) % 40, c.dv = 1 + (rep * 17) % 24;
        c.randomize(rng);
        const double rate = 0.5 / c.Lk;  // about one special per row of each tensor
        auto sprinkle = [&](std::vector<float>& t, const float* specials, int n) {
          for (float& x : t) {
            if (u(rng) < rate) x = specials[rng() % n];
          }
        };
        std::string name;
        switch (option) {
          case 0: name = "plain"; break;
          case 1:
            name = "additive mask";
            c.add_mask.assign(size_t(c.Hq) * c.Lq * c.Lk, 0.0f);
            for (float& x : c.add_mask) x = static_cast<float>(u(rng) * 4 - 2);
            sprinkle(c.add_mask, mask_specials, 7);
            break;
          case 2:
            name = "alibi";
            c.alibi = {0.5f, 0.0625f};
            break;
          case 3: name = "softcap"; c.opt.softcap = 3.0f; break;
          case 4: name = "dropout"; c.opt.dropout_p = 0.3f, c.opt.seed = rng(); break;
          case 5: name = "causal"; c.opt.causal = Causal::BottomRight; break;
          case 6:
            name = "boolean mask";
            c.bool_mask.assign(size_t(c.Hq) * c.Lq * c.Lk, 1);
            for (auto& x : c.bool_mask) x = u(rng) < 0.7;
            break;
        }
        sprinkle(c.q, qk_specials, 3);
        sprinkle(c.k, qk_specials, 3);
        sprinkle(c.v, v_specials, option == 2 ? 1 : 4);  // ALiBi: see below
        sprinkle(c.dout, qk_specials, 1);
        // (ALiBi biases of −100 … −700 leave probabilities that f32 flushes to
        // 0 and float64 does not; ∞·p then differs in kind, not in finiteness,
        // and only NaN values are sprinkled there.)
        EXPECT_TRUE(agree(c, true)) << name << " Lq " << c.Lq << " Lk " << c.Lk << " d " << c.d;
      }
    }
  });
}

// A user score_mod that returns NaN or −∞ for some pairs: NaN poisons the row,
// −∞ removes the key (forward; the backward needs score_grad).
TEST(NonFinite, UserScoreModNanAndMinusInfinity) {
  on_every_target([] {
    auto rng = make_rng(1300);
    Case c;
    c.Lq = 20, c.Lk = 90, c.d = 8, c.dv = 8;
    c.randomize(rng);
    std::vector<float> out(size_t(c.Lq) * c.dv), lse(c.Lq), rout(out.size()), rlse(lse.size());
    const TensorView q(c.q.data(), DType::f32, {1, c.Lq, 1, c.d});
    const TensorView k(c.k.data(), DType::f32, {1, c.Lk, 1, c.d});
    const TensorView v(c.v.data(), DType::f32, {1, c.Lk, 1, c.dv});
    auto mod = [](float s, int, int, int i, int j) {
      if (i == 3 && j == 40) return std::numeric_limits<float>::quiet_NaN();
      if (j % 7 == 0) return -std::numeric_limits<float>::infinity();
      return s;
    };
    auto keep = [](int, int, int, int) { return true; };
    attention(q, k, v, TensorView(out.data(), DType::f32, {1, c.Lq, 1, c.dv}), c.opt, mod, keep,
              TensorView(lse.data(), DType::f32, {1, 1, c.Lq}));
    attention_reference(q, k, v, TensorView(rout.data(), DType::f32, {1, c.Lq, 1, c.dv}), c.opt, mod,
                        keep, TensorView(rlse.data(), DType::f32, {1, 1, c.Lq}));
    EXPECT_TRUE(std::isnan(out[3 * c.dv])) << out[3 * c.dv];
    EXPECT_TRUE(same("out", out, rout));
    EXPECT_TRUE(same("lse", lse, rlse));
  });
}

// A fully masked row stays the defined 0 / −∞, and a row of only −FLT_MAX
// masks next to it is not mistaken for one.
TEST(NonFinite, FullyMaskedRowsStayZero) {
  on_every_target([] {
    auto rng = make_rng(1400);
    Case c;
    c.Lq = 2, c.Lk = 40, c.d = 4, c.dv = 4;
    c.randomize(rng);
    c.add_mask.assign(size_t(c.Lq) * c.Lk, -kInf);
    for (int j = 0; j < c.Lk; ++j) c.add_mask[c.Lk + j] = -FLT_MAX;
    const Outputs f = run(c, false, true);
    for (int e = 0; e < c.dv; ++e) EXPECT_EQ(0.0f, f.out[e]);
    EXPECT_EQ(-kInf, f.lse[0]);
    EXPECT_TRUE(std::isfinite(f.lse[1]) && f.lse[1] < -1e38f) << f.lse[1];
    EXPECT_TRUE(agree(c, true));
  });
}

}  // namespace
}  // namespace attn::testing
