// Positional information: sinusoidal table values, learned positions' gradient,
// RoPE against complex multiplication in float64 (both pairings), its relative-
// position property and backward, ALiBi slopes for any head count.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>

#include "attn/error.hpp"
#include "attn/nn/positional.hpp"
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

TEST(Sinusoidal, TableFollowsThePaper) {
  for (int64_t dim : {1, 4, 7, 64}) {
    Tensor t = nn::sinusoidal_table(50, dim);
    for (int64_t pos : {0, 1, 17, 49})
      for (int64_t i = 0; i < dim; ++i) {
        const double w = pos / std::pow(10000.0, double(2 * (i / 2)) / double(dim));
        EXPECT_NEAR(t.data_as<float>()[pos * dim + i], i % 2 == 0 ? std::sin(w) : std::cos(w), 1e-7);
      }
  }
}

TEST(Sinusoidal, AddsByPositionInBothLayouts) {
  nn::Rng rng = nn_rng(31);
  Tensor table = nn::sinusoidal_table(20, 6);
  Tensor x = random_tensor({2, 3, 6}, rng);  // [B=2, L=3] batch first; [L=2, B=3] otherwise
  nn::SinusoidalPositionalEncoding bf(6, 20, true), sf(6, 20, false);
  Tensor y = bf.forward(x, 5), z = sf.forward(x, 5);
  for (int a = 0; a < 2; ++a)
    for (int b = 0; b < 3; ++b)
      for (int c = 0; c < 6; ++c) {
        const float xv = x.data_as<float>()[(a * 3 + b) * 6 + c];
        EXPECT_FLOAT_EQ(y.data_as<float>()[(a * 3 + b) * 6 + c], xv + table.data_as<float>()[(5 + b) * 6 + c]);
        EXPECT_FLOAT_EQ(z.data_as<float>()[(a * 3 + b) * 6 + c], xv + table.data_as<float>()[(5 + a) * 6 + c]);
      }
  EXPECT_THROW(bf.forward(x, 18), Error);  // positions 18..20 exceed max_len 20
}

TEST(LearnedPositions, Gradients) {
  nn::Rng rng = nn_rng(32);
  nn::LearnedPositionalEmbedding pos(9, 4, rng, /*batch_first=*/false);
  Tensor x = random_tensor({3, 2, 4}, rng);
  Tensor dx;
  auto slots = parameter_slots(pos);
  slots.push_back({"x", x.data_as<float>(), x.numel(), [&] { return dx.data_as<float>(); }});
  pos.zero_grad();
  check_gradients([&] { return pos.forward(x, 2); }, [&](const Tensor& g) { dx = pos.backward(g); }, slots, rng);
  for (int c = 0; c < 4; ++c) EXPECT_EQ(pos.weight.grad[0 * 4 + c], 0.0f);  // position 0 unused (offset 2)
}

// RoPE in float64 as complex multiplication: plane p of position m times e^{i·m·θ_p}.
std::vector<double> rope_ref(const float* x, int64_t d, int64_t rot, nn::RopeStyle style, int64_t pos, double base) {
  std::vector<double> y(x, x + d);
  for (int64_t p = 0; p < rot / 2; ++p) {
    const int64_t i = style == nn::RopeStyle::half ? p : 2 * p;
    const int64_t j = style == nn::RopeStyle::half ? p + rot / 2 : 2 * p + 1;
    const std::complex<double> z(x[i], x[j]);
    const std::complex<double> r = z * std::polar(1.0, double(pos) * std::pow(base, -2.0 * double(p) / double(rot)));
    y[i] = r.real();
    y[j] = r.imag();
  }
  return y;
}

TEST(Rope, MatchesComplexRotationForBothPairings) {
  nn::Rng rng = nn_rng(33);
  for (auto style : {nn::RopeStyle::interleaved, nn::RopeStyle::half})
    for (auto [d, rot] : {std::pair<int64_t, int64_t>{8, 8}, {64, 64}, {10, 6}, {2, 2}}) {
      const int64_t B = 2, L = 5, H = 3, offset = 7;
      nn::RotaryEmbedding rope(d, style, 500.0, rot);
      Tensor x = random_tensor({B, L, H, d}, rng);
      Tensor y = nn::clone(x);
      rope.apply(y, offset);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t l = 0; l < L; ++l)
          for (int64_t h = 0; h < H; ++h) {
            const int64_t row = ((b * L + l) * H + h) * d;
            auto ref = rope_ref(x.data_as<float>() + row, d, rot, style, offset + l, 500.0);
            for (int64_t c = 0; c < d; ++c) EXPECT_NEAR(y.data_as<float>()[row + c], ref[c], 2e-6);
          }
      rope.apply_backward(y, offset);  // the inverse rotation restores x
      EXPECT_LT(max_rel_diff(y.data_as<float>(), x.data_as<float>(), x.numel()), 1e-6);
    }
}

TEST(Rope, ScoresDependOnRelativePositionOnly) {
  nn::Rng rng = nn_rng(34);
  nn::RotaryEmbedding rope(16, nn::RopeStyle::half);
  Tensor q = random_tensor({1, 1, 1, 16}, rng), k = random_tensor({1, 1, 1, 16}, rng);
  auto score = [&](int64_t m, int64_t n) {
    Tensor a = nn::clone(q), b = nn::clone(k);
    rope.apply(a, m);
    rope.apply(b, n);
    double s = 0;
    for (int c = 0; c < 16; ++c) s += double(a.data_as<float>()[c]) * b.data_as<float>()[c];
    return s;
  };
  EXPECT_NEAR(score(3, 1), score(103, 101), 1e-4);
  EXPECT_NEAR(score(0, 9), score(40, 49), 1e-4);
}

TEST(Rope, WorksOnStridedViewsAndBackwardIsTheTranspose) {
  nn::Rng rng = nn_rng(35);
  const int64_t B = 2, L = 4, H = 3, d = 6;
  nn::RotaryEmbedding rope(d, nn::RopeStyle::interleaved);
  // Storage [B, H, L, d] seen as [B, L, H, d].
  Tensor x = random_tensor({B, H, L, d}, rng), g = random_tensor({B, H, L, d}, rng);
  const std::vector<int64_t> strides{H * L * d, d, L * d, 1};
  Tensor rx = nn::clone(x), rg = nn::clone(g);
  rope.apply(TensorView(rx.data(), DType::f32, {B, L, H, d}, strides), 0);
  rope.apply_backward(TensorView(rg.data(), DType::f32, {B, L, H, d}, strides), 0);
  double lhs = 0, rhs = 0;  // <R x, g> = <x, Rᵀ g>
  for (int64_t i = 0; i < x.numel(); ++i) {
    lhs += double(rx.data_as<float>()[i]) * g.data_as<float>()[i];
    rhs += double(x.data_as<float>()[i]) * rg.data_as<float>()[i];
  }
  EXPECT_NEAR(lhs, rhs, 1e-4 * (1 + std::fabs(lhs)));
  EXPECT_THROW(nn::RotaryEmbedding(6, nn::RopeStyle::half, 10000.0, 5), Error);
  EXPECT_THROW(rope.apply(TensorView(rx.data(), DType::f32, {B, L, H, 4}), 0), Error);
}

TEST(Alibi, SlopesForPowersOfTwoAndOthers) {
  const auto s8 = nn::alibi_slopes(8);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s8[h], std::pow(2.0f, -(h + 1.0f)));
  // 12 heads: the 8-head slopes, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5 (every other of 16).
  const auto s12 = nn::alibi_slopes(12);
  ASSERT_EQ(s12.size(), 12u);
  for (int h = 0; h < 8; ++h) EXPECT_FLOAT_EQ(s12[h], s8[h]);
  for (int i = 0; i < 4; ++i) EXPECT_FLOAT_EQ(s12[8 + i], std::pow(2.0f, -(0.5f + i)));
  EXPECT_FLOAT_EQ(nn::alibi_slopes(1)[0], 1.0f / 256);
  EXPECT_EQ(nn::alibi_slopes(5).size(), 5u);
  EXPECT_THROW(nn::alibi_slopes(0), Error);
}

}  // namespace
}  // namespace attn::testing
