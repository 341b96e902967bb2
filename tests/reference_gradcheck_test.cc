// The reference backward against central finite differences of the reference
// forward, in float64, on tiny shapes, for every option: the check of the oracle
// itself. Loss L = Σ out ⊙ G for a random G; each input element is moved by an
// exactly representable step and the difference quotient uses the step taken.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "attention_harness.hpp"
#include "problem.hpp"
#include "reference/attention_backward_reference.hpp"
#include "reference/attention_reference.hpp"

namespace attn::testing {
namespace {

struct GradCase {
  Config cfg;
  const detail::UserMods* mods = nullptr;
};

// Relative error ‖a − b‖ / ‖b‖.
double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

void check_gradients(Config& s, std::mt19937_64& rng, const detail::UserMods* mods = nullptr) {
  SCOPED_TRACE(s.describe());
  const bool varlen = !s.seq_q.empty();
  int64_t nq = int64_t{s.B} * s.Lq, nk = int64_t{s.B} * s.Lk;
  if (varlen) {
    nq = nk = 0;
    for (int x : s.seq_q) nq += x;
    for (int x : s.seq_k) nk += x;
  }
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(nq * s.Hq * s.d), k(nk * s.Hkv * s.d), v(nk * s.Hkv * s.dv);
  std::vector<float> out(nq * s.Hq * s.dv), lse(nq * s.Hq), g(out.size());
  for (auto* t : {&q, &k, &v, &g}) {
    for (float& x : *t) x = u(rng);
  }
  auto view = [&](std::vector<float>& t, int64_t n, int h, int x) {
    return varlen ? TensorView(t.data(), DType::f32, {n, h, x})
                  : TensorView(t.data(), DType::f32, {s.B, n / s.B, h, x});
  };
  const TensorView qv = view(q, nq, s.Hq, s.d), kv = view(k, nk, s.Hkv, s.d), vv = view(v, nk, s.Hkv, s.dv),
                   ov = view(out, nq, s.Hq, s.dv), gv = view(g, nq, s.Hq, s.dv);
  const TensorView lv = varlen ? TensorView(lse.data(), DType::f32, {s.Hq, nq})
                               : TensorView(lse.data(), DType::f32, {s.B, s.Hq, s.Lq});
  const bool with_bias = !s.add_mask_data.empty();
  std::vector<float> dbias_view_storage(with_bias ? s.add_mask_data.size() : 0);
  const TensorView dbv = with_bias ? TensorView(dbias_view_storage.data(), DType::f32, s.opt.mask.shape())
                                   : TensorView();

  // Analytic gradients from the reference backward (float64).
  // (The gradient views only describe the layout; the float64 results go to the
  // vectors below. They must not overlap the inputs.)
  std::vector<float> gq(q.size()), gk(k.size()), gvv(v.size());
  const detail::BackwardProblem bp = detail::make_backward_problem(
      "test", qv, kv, vv, ov, lv, gv, view(gq, nq, s.Hq, s.d), view(gk, nk, s.Hkv, s.d),
      view(gvv, nk, s.Hkv, s.dv), s.opt, dbv, mods);
  std::vector<double> dq(q.size()), dk(k.size()), dv(v.size()), db(dbias_view_storage.size());
  detail::reference_backward<double>(bp, dq.data(), dk.data(), dv.data(), with_bias ? db.data() : nullptr,
                                     dq.size(), dk.size(), dv.size(), db.size());

  // L(inputs) in float64 through the reference forward.
  auto loss = [&]() {
    const detail::Problem p = detail::make_problem("test", qv, kv, vv, ov, s.opt, {}, {}, mods);
    std::vector<double> o(out.size());
    detail::reference_forward<double>(p, o.data(), nullptr, nullptr);
    double L = 0;
    for (size_t n = 0; n < o.size(); ++n) L += o[n] * g[n];
    return L;
  };
  // Central differences for every element of one input.
  auto numeric = [&](std::vector<float>& x) {
    std::vector<double> grad(x.size());
    for (size_t n = 0; n < x.size(); ++n) {
      const float x0 = x[n];
      const float h = std::ldexp(1.0f, -11) * std::max(1.0f, std::abs(x0));
      x[n] = x0 + h;
      const double up = loss(), xu = x[n];
      x[n] = x0 - h;
      const double down = loss(), xd = x[n];
      x[n] = x0;
      grad[n] = (up - down) / (xu - xd);
    }
    return grad;
  };
  EXPECT_LE(rel(dq, numeric(q)), 2e-5) << "dq";
  EXPECT_LE(rel(dk, numeric(k)), 2e-5) << "dk";
  EXPECT_LE(rel(dv, numeric(v)), 2e-5) << "dv";
  if (with_bias) {
    // Finite entries of the mask only (−∞ entries have no gradient).
    std::vector<double> num = numeric(s.add_mask_data), ana = db;
    for (size_t n = 0; n < num.size(); ++n) {
      if (std::isinf(s.add_mask_data[n]) || std::isnan(num[n])) num[n] = ana[n] = 0;
    }
    EXPECT_LE(rel(db, num), 2e-5) << "dbias";
  }
}

TEST(ReferenceGradients, MatchFiniteDifferencesForEveryOption) {
  auto rng = make_rng(401);
  auto base = [] {
    Config s;
    s.B = 2, s.Lq = 5, s.Lk = 7, s.Hq = 2, s.Hkv = 1, s.d = 3, s.dv = 4;
    return s;
  };
  {
    Config s = base();
    check_gradients(s, rng);
  }
  for (Causal c : {Causal::TopLeft, Causal::BottomRight}) {
    Config s = base();
    s.opt.causal = c;
    check_gradients(s, rng);
  }
  {
    Config s = base();
    s.opt.window = {2, 1};
    check_gradients(s, rng);
  }
  {
    Config s = base();
    s.opt.softcap = 0.7f;
    s.input_scale = 2.0f;
    check_gradients(s, rng);
  }
  {
    Config s = base();
    s.set_alibi(true, rng);
    check_gradients(s, rng);
  }
  {
    Config s = base();
    s.set_bool_mask({s.B, 1, s.Lq, s.Lk}, rng, 0.6);
    check_gradients(s, rng);
  }
  {  // additive mask broadcast over heads: dbias sums over them
    Config s = base();
    s.set_add_mask({s.B, 1, s.Lq, s.Lk}, rng, 0.15);
    check_gradients(s, rng);
  }
  {
    Config s = base();
    s.set_key_lengths(rng, 1);
    s.opt.causal = Causal::BottomRight;
    check_gradients(s, rng);
  }
  {
    Config s = base();
    s.set_varlen({3, 4}, {5, 2});
    check_gradients(s, rng);
  }
  {  // dropout with a fixed seed: the same mask in every evaluation
    Config s = base();
    s.opt.dropout_p = 0.3f, s.opt.seed = 77, s.opt.offset = 2;
    check_gradients(s, rng);
  }
  {  // a user score_mod with its derivative, and a mask_mod. Generic lambdas:
     // the reference evaluates them in double (a float parameter would round
     // every score to f32 and drown the finite differences in noise).
    auto sm = [](auto x, int, int h, int i, int j) { return x * (1 + 0.1 * h) - 0.05 * std::abs(i - j); };
    auto sg = [](auto, int, int h, int, int) { return 1 + 0.1 * h; };
    auto mm = [](int, int, int i, int j) { return (i + j) % 4 != 1; };
    const detail::ModTriple<decltype(sm), decltype(sg), decltype(mm)> triple{sm, sg, mm};
    const detail::UserMods mods = detail::make_user_mods(triple);
    Config s = base();
    check_gradients(s, rng, &mods);
  }
  {  // everything at once
    Config s = base();
    s.opt.causal = Causal::BottomRight, s.opt.softcap = 2.0f, s.opt.dropout_p = 0.2f, s.opt.seed = 5;
    s.set_alibi(false, rng);
    s.set_add_mask({s.Lq, s.Lk}, rng, 0.1);
    check_gradients(s, rng);
  }
}

}  // namespace
}  // namespace attn::testing
