// Additive (Bahdanau) and Luong attention against float64 formulas, on every SIMD
// target; gradients by finite differences; masks over padded source positions.
#include <gtest/gtest.h>

#include <cmath>

#include "attn/error.hpp"
#include "attn/nn/rnn_attention.hpp"
#include "cpu/attention_forward.hpp"  // simd_targets, force_simd_target
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

// Reference context and weights in float64 for scores e(b, t, j).
template <class Score>
void reference_attention(int64_t B, int64_t T, int64_t S, int64_t Dk, const float* keys,
                         const std::vector<int32_t>& lengths, Score score, std::vector<double>& context,
                         std::vector<double>& weights) {
  context.assign(B * T * Dk, 0.0);
  weights.assign(B * T * S, 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t n = lengths[b];
      if (n == 0) continue;
      std::vector<double> e(n);
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j < n; ++j) mx = std::max(mx, e[j] = score(b, t, j));
      for (int64_t j = 0; j < n; ++j) sum += std::exp(e[j] - mx);
      for (int64_t j = 0; j < n; ++j) {
        const double a = std::exp(e[j] - mx) / sum;
        weights[(b * T + t) * S + j] = a;
        for (int64_t c = 0; c < Dk; ++c) context[(b * T + t) * Dk + c] += a * keys[(b * S + j) * Dk + c];
      }
    }
}

void expect_near_all(const Tensor& got, const std::vector<double>& want, double tol, const char* what) {
  double scale = 1e-30;
  for (double w : want) scale = std::max(scale, std::fabs(w));
  for (int64_t i = 0; i < got.numel(); ++i)
    ASSERT_NEAR(got.data_as<float>()[i], want[i], tol * scale) << what << " element " << i << " " << seed_note();
}

// Float64 score v·tanh(W_q·q + W_k·k + b) of additive attention, from the module's
// own parameters, for one query row q [Dq] and one key row k [Dk].
double additive_score(const nn::AdditiveAttention& att, const float* q, const float* k) {
  const int64_t A = att.attn_dim(), Dq = att.query_dim(), Dk = att.key_dim();
  double e = 0;
  for (int64_t a = 0; a < A; ++a) {
    double u = att.bias ? att.bias->value[a] : 0.0;
    for (int64_t i = 0; i < Dq; ++i) u += double(att.query_proj.value[a * Dq + i]) * q[i];
    for (int64_t i = 0; i < Dk; ++i) u += double(att.key_proj.value[a * Dk + i]) * k[i];
    e += att.v.value[a] * std::tanh(u);
  }
  return e;
}

// The module's forward of queries q [B, T, Dq] over keys k [B, S, Dk] (visible keys:
// `lengths`, passed to the module as `len`, which may be absent) against float64.
void expect_additive_matches(nn::AdditiveAttention& att, const Tensor& q, const Tensor& k,
                             const std::vector<int32_t>& lengths, const TensorView& len, double tol) {
  const int64_t B = q.shape()[0], T = q.shape()[1], S = k.shape()[1], Dq = att.query_dim(), Dk = att.key_dim();
  auto out = att.forward(q, k, len);
  auto score = [&](int64_t b, int64_t t, int64_t j) {
    return additive_score(att, q.data_as<float>() + (b * T + t) * Dq, k.data_as<float>() + (b * S + j) * Dk);
  };
  std::vector<double> context, weights;
  reference_attention(B, T, S, Dk, k.data_as<float>(), lengths, score, context, weights);
  expect_near_all(out.context, context, tol, "context");
  expect_near_all(out.weights, weights, tol, "weights");
}

TEST(AdditiveAttention, MatchesFloat64OnEverySimdTarget) {
  nn::Rng rng = nn_rng(71);
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    for (auto [A, Dq, Dk] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {17, 5, 9}, {64, 32, 48}, {100, 8, 3}}) {
      nn::AdditiveAttention att(Dq, Dk, A, /*bias=*/A != 64, rng);
      if (att.bias) init_uniform(*att.bias, 0.5f, rng);
      const int64_t B = 3, T = 2, S = 7;
      Tensor q = random_tensor({B, T, Dq}, rng), k = random_tensor({B, S, Dk}, rng);
      const std::vector<int32_t> lengths{7, 3, 0};
      expect_additive_matches(att, q, k, lengths, TensorView(lengths.data(), DType::i32, {B}), 2e-6);
    }
  }
  detail::force_simd_target(0);
}

// Shapes drawn per run (1 to 70 wide, source lengths 1 to 40, lengths from 0 to S or
// absent, with and without bias), on every SIMD target: the vector loops' tails.
TEST(AdditiveAttention, RandomShapesMatchFloat64) {
  nn::Rng rng = nn_rng(74);
  auto draw = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng.next_u64() % (hi - lo + 1)); };
  for (int64_t target : detail::simd_targets()) {
    detail::force_simd_target(target);
    for (int trial = 0; trial < 6; ++trial) {
      const int64_t A = draw(1, 70), Dq = draw(1, 40), Dk = draw(1, 40);
      const int64_t B = draw(1, 4), T = draw(1, 5), S = draw(1, 40);
      const bool bias = rng.next_u64() % 2 == 0, all_visible = rng.next_u64() % 4 == 0;
      SCOPED_TRACE(::testing::Message() << "target " << target << " A " << A << " Dq " << Dq << " Dk " << Dk
                                        << " B " << B << " T " << T << " S " << S << " bias " << bias << " all "
                                        << all_visible);
      nn::AdditiveAttention att(Dq, Dk, A, bias, rng);
      if (att.bias) init_uniform(*att.bias, 0.5f, rng);
      Tensor q = random_tensor({B, T, Dq}, rng), k = random_tensor({B, S, Dk}, rng);
      std::vector<int32_t> lengths(B, static_cast<int32_t>(S));
      if (!all_visible)
        for (auto& n : lengths) n = static_cast<int32_t>(draw(0, S));
      const TensorView len = all_visible ? TensorView() : TensorView(lengths.data(), DType::i32, {B});
      expect_additive_matches(att, q, k, lengths, len, 4e-6);
    }
  }
  detail::force_simd_target(0);
  // Gradients on one drawn shape (small: finite differences run the forward per element).
  const int64_t A = draw(1, 20), Dq = draw(1, 9), Dk = draw(1, 9), B = draw(1, 3), T = draw(1, 3), S = draw(1, 9);
  SCOPED_TRACE(::testing::Message() << "gradients: A " << A << " Dq " << Dq << " Dk " << Dk << " B " << B << " T " << T
                                  << " S " << S);
  nn::AdditiveAttention att(Dq, Dk, A, true, rng);
  init_uniform(*att.bias, 0.5f, rng);
  Tensor q = random_tensor({B, T, Dq}, rng), k = random_tensor({B, S, Dk}, rng);
  std::vector<int32_t> lengths(B);
  for (auto& n : lengths) n = static_cast<int32_t>(draw(0, S));
  const TensorView len(lengths.data(), DType::i32, {B});
  std::pair<Tensor, Tensor> g;
  auto slots = parameter_slots(att);
  slots.push_back({"query", q.data_as<float>(), q.numel(), [&] { return g.first.data_as<float>(); }});
  slots.push_back({"keys", k.data_as<float>(), k.numel(), [&] { return g.second.data_as<float>(); }});
  att.zero_grad();
  check_gradients([&] { return att.forward(q, k, len).context; }, [&](const Tensor& d) { g = att.backward(d); }, slots,
                  rng);
}

TEST(AdditiveAttention, GradientsThroughSeveralStepsOnOneMemory) {
  nn::Rng rng = nn_rng(72);
  nn::AdditiveAttention att(6, 5, 19, true, rng);
  init_uniform(*att.bias, 0.5f, rng);
  const int64_t B = 2, S = 4;
  Tensor k = random_tensor({B, S, 5}, rng), q1 = random_tensor({B, 1, 6}, rng), q2 = random_tensor({B, 3, 6}, rng);
  const std::vector<int32_t> lengths{4, 2};
  const TensorView len(lengths.data(), DType::i32, {B});
  // Two decoder steps on the same memory; output = [context1, context2] flattened.
  nn::AdditiveAttention::Memory mem;
  nn::AdditiveAttention::Step s1, s2;
  Tensor dq1, dq2, dk;
  auto forward = [&] {
    mem = att.encode(k, len);
    Tensor c1 = att.attend(q1, mem, s1), c2 = att.attend(q2, mem, s2);
    Tensor y(DType::f32, {c1.numel() + c2.numel()});
    std::copy_n(c1.data_as<float>(), c1.numel(), y.data_as<float>());
    std::copy_n(c2.data_as<float>(), c2.numel(), y.data_as<float>() + c1.numel());
    return y;
  };
  auto backward = [&](const Tensor& g) {
    Tensor g1 = nn::clone(TensorView(g.data(), DType::f32, {B, 1, 5}));
    Tensor g2 = nn::clone(TensorView(g.data_as<float>() + B * 5, DType::f32, {B, 3, 5}));
    dq2 = att.attend_backward(s2, mem, g2);  // any order
    dq1 = att.attend_backward(s1, mem, g1);
    dk = att.encode_backward(mem);
  };
  auto slots = parameter_slots(att);
  slots.push_back({"q1", q1.data_as<float>(), q1.numel(), [&] { return dq1.data_as<float>(); }});
  slots.push_back({"q2", q2.data_as<float>(), q2.numel(), [&] { return dq2.data_as<float>(); }});
  slots.push_back({"keys", k.data_as<float>(), k.numel(), [&] { return dk.data_as<float>(); }});
  att.zero_grad();
  check_gradients(forward, backward, slots, rng);
  // Masked keys get no gradient.
  for (int64_t j = 2; j < S; ++j)
    for (int64_t c = 0; c < 5; ++c) EXPECT_EQ(dk.data_as<float>()[((1 * S) + j) * 5 + c], 0.0f);
}

// Float64 score e(b, t, j) of Luong attention's three forms, from the module's own
// parameters; queries [B, T, Dq] and memory [B, S, Dk] as floats.
double luong_score(nn::LuongAttention& att, const float* h, const float* hs, int64_t Dq, int64_t Dk) {
  double s = 0;
  if (att.score() == nn::LuongScore::dot) {
    for (int64_t c = 0; c < Dk; ++c) s += double(h[c]) * hs[c];
  } else if (att.score() == nn::LuongScore::general) {
    for (int64_t r = 0; r < Dk; ++r) {
      double wh = 0;
      for (int64_t c = 0; c < Dq; ++c) wh += double(att.linear_in->value[r * Dq + c]) * h[c];
      s += wh * hs[r];
    }
  } else {
    const nn::Parameter* wq = nullptr;
    const nn::Parameter* wk = nullptr;
    const nn::Parameter* v = nullptr;
    for (auto& [n, ptr] : att.named_parameters()) {
      if (n == "query_proj.weight") wq = ptr;
      if (n == "key_proj.weight") wk = ptr;
      if (n == "v") v = ptr;
    }
    const int64_t A = v->numel();
    for (int64_t a = 0; a < A; ++a) {
      double u = 0;
      for (int64_t c = 0; c < Dq; ++c) u += double(wq->value[a * Dq + c]) * h[c];
      for (int64_t c = 0; c < Dk; ++c) u += double(wk->value[a * Dk + c]) * hs[c];
      s += v->value[a] * std::tanh(u);
    }
  }
  return s;
}

// Luong's attentional vector h̃ = tanh(W_c·[c; h]) of `rows` rows against float64,
// from the float64 contexts c [rows, Dk] and the queries h [rows, Dq].
void expect_attentional(nn::LuongAttention& att, const Tensor& got, const std::vector<double>& context,
                        const float* h, int64_t rows, int64_t Dq, int64_t Dk, double tol) {
  const auto& w = att.linear_out.value;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t o = 0; o < Dq; ++o) {
      double pre = 0;
      for (int64_t c = 0; c < Dk; ++c) pre += double(w[o * (Dk + Dq) + c]) * context[r * Dk + c];
      for (int64_t c = 0; c < Dq; ++c) pre += double(w[o * (Dk + Dq) + Dk + c]) * h[r * Dq + c];
      ASSERT_NEAR(got.data_as<float>()[r * Dq + o], std::tanh(pre), tol) << "row " << r << " " << seed_note();
    }
}

// Finite differences of the attentional output against backward, for the
// parameters, the queries and the memory.
void check_luong_gradients(nn::LuongAttention& att, Tensor& q, Tensor& m, const TensorView& len, nn::Rng& rng) {
  std::pair<Tensor, Tensor> g;
  auto slots = parameter_slots(att);
  slots.push_back({"queries", q.data_as<float>(), q.numel(), [&] { return g.first.data_as<float>(); }});
  slots.push_back({"memory", m.data_as<float>(), m.numel(), [&] { return g.second.data_as<float>(); }});
  att.zero_grad();
  check_gradients([&] { return att.forward(q, m, len).attentional; }, [&](const Tensor& d) { g = att.backward(d); },
                  slots, rng);
}

TEST(LuongAttention, EveryScoreMatchesFloat64AndHasGradients) {
  nn::Rng rng = nn_rng(73);
  for (auto score : {nn::LuongScore::dot, nn::LuongScore::general, nn::LuongScore::concat}) {
    const int64_t Dq = 6, Dk = score == nn::LuongScore::dot ? 6 : 4, B = 3, T = 5, S = 6;
    nn::LuongAttention att(Dq, Dk, score, rng, 7);
    Tensor q = random_tensor({B, T, Dq}, rng), m = random_tensor({B, S, Dk}, rng);
    const std::vector<int32_t> lengths{6, 1, 4};
    const TensorView len(lengths.data(), DType::i32, {B});
    auto out = att.forward(q, m, len);
    const float* qd = q.data_as<float>();
    const float* md = m.data_as<float>();
    auto e = [&](int64_t b, int64_t t, int64_t j) {
      return luong_score(att, qd + (b * T + t) * Dq, md + (b * S + j) * Dk, Dq, Dk);
    };
    std::vector<double> context, weights;
    reference_attention(B, T, S, Dk, md, lengths, e, context, weights);
    expect_near_all(out.context, context, 2e-6, "context");
    expect_near_all(out.weights, weights, 2e-6, "weights");
    expect_attentional(att, out.attentional, context, qd, B * T, Dq, Dk, 2e-6);
    check_luong_gradients(att, q, m, len, rng);
  }
}

// Every score form on shapes drawn per run, every SIMD target, lengths from 0 to S
// or absent; gradients on one small drawn shape per form.
TEST(LuongAttention, RandomShapesMatchFloat64) {
  nn::Rng rng = nn_rng(75);
  auto draw = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng.next_u64() % (hi - lo + 1)); };
  for (auto score : {nn::LuongScore::dot, nn::LuongScore::general, nn::LuongScore::concat}) {
    for (int64_t target : detail::simd_targets()) {
      detail::force_simd_target(target);
      for (int trial = 0; trial < 3; ++trial) {
        const int64_t Dq = draw(1, 40), Dk = score == nn::LuongScore::dot ? Dq : draw(1, 40), A = draw(1, 30);
        const int64_t B = draw(1, 4), T = draw(1, 6), S = draw(1, 40);
        const bool all_visible = rng.next_u64() % 4 == 0;
        SCOPED_TRACE(::testing::Message() << "score " << static_cast<int>(score) << " target " << target << " Dq " << Dq
                                        << " Dk " << Dk << " A " << A << " B " << B << " T " << T << " S " << S);
        nn::LuongAttention att(Dq, Dk, score, rng, A);
        Tensor q = random_tensor({B, T, Dq}, rng), m = random_tensor({B, S, Dk}, rng);
        std::vector<int32_t> lengths(B, static_cast<int32_t>(S));
        if (!all_visible)
          for (auto& n : lengths) n = static_cast<int32_t>(draw(0, S));
        const TensorView len = all_visible ? TensorView() : TensorView(lengths.data(), DType::i32, {B});
        auto out = att.forward(q, m, len);
        const float* qd = q.data_as<float>();
        const float* md = m.data_as<float>();
        std::vector<double> context, weights;
        reference_attention(B, T, S, Dk, md, lengths,
                            [&](int64_t b, int64_t t, int64_t j) {
                              return luong_score(att, qd + (b * T + t) * Dq, md + (b * S + j) * Dk, Dq, Dk);
                            },
                            context, weights);
        expect_near_all(out.context, context, 4e-6, "context");
        expect_near_all(out.weights, weights, 4e-6, "weights");
        expect_attentional(att, out.attentional, context, qd, B * T, Dq, Dk, 4e-6);
      }
    }
    detail::force_simd_target(0);
    const int64_t Dq = draw(1, 8), Dk = score == nn::LuongScore::dot ? Dq : draw(1, 8), A = draw(1, 9);
    const int64_t B = draw(1, 3), T = draw(1, 3), S = draw(1, 8);
    SCOPED_TRACE(::testing::Message() << "gradients: score " << static_cast<int>(score) << " Dq " << Dq << " Dk " << Dk
                                    << " A " << A << " B " << B << " T " << T << " S " << S);
    nn::LuongAttention att(Dq, Dk, score, rng, A);
    Tensor q = random_tensor({B, T, Dq}, rng), m = random_tensor({B, S, Dk}, rng);
    std::vector<int32_t> lengths(B);
    for (auto& n : lengths) n = static_cast<int32_t>(draw(0, S));
    const TensorView len(lengths.data(), DType::i32, {B});
    check_luong_gradients(att, q, m, len, rng);
  }
}

TEST(RnnAttention, Errors) {
  nn::Rng rng(1);
  EXPECT_THROW(nn::LuongAttention(4, 5, nn::LuongScore::dot, rng), Error);
  nn::AdditiveAttention att(3, 4, 5, true, rng);
  Tensor k = random_tensor({2, 3, 4}, rng);
  const int32_t bad[] = {4, 1};
  EXPECT_THROW(att.encode(k, TensorView(bad, DType::i32, {2})), Error);
  EXPECT_THROW(att.encode(random_tensor({2, 3, 5}, rng)), Error);
  auto mem = att.encode(k);
  nn::AdditiveAttention::Step step;
  EXPECT_THROW(att.attend(random_tensor({3, 1, 3}, rng), mem, step), Error);
  EXPECT_THROW(att.backward(random_tensor({2, 1, 4}, rng)), Error);
}

}  // namespace
}  // namespace attn::testing
