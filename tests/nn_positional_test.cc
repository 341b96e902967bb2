// Positional information: sinusoidal table values, learned positions' gradient,
// RoPE against complex multiplication in float64 (both pairings; drawn shapes, far
// positions, concurrent calls), its relative-position property and backward, ALiBi
// slopes for any head count.
#include <gtest/gtest.h>

#include <cmath>
#include <complex>
#include <cstring>
#include <thread>

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
  // Positions past the table, including an offset whose sum with L overflows int64.
  EXPECT_NO_THROW(bf.forward(x, 17));
  EXPECT_THROW(bf.forward(x, -1), Error);
  EXPECT_THROW(bf.forward(x, INT64_MAX - 1), Error);
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

// Drawn head sizes, rotary widths, layouts ([B, L, H, d] or [B, H, L, d] storage) and
// offsets, from 0 to far past the cached positions (10¹²): each row against the
// float64 rotation, and the backward restores the input.
TEST(Rope, DrawnShapesAndPositionsMatchComplexRotation) {
  nn::Rng rng = nn_rng(36);
  auto draw = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng.next_u64() % (hi - lo + 1)); };
  const int64_t offsets[] = {0, 3, nn::RotaryEmbedding::kCachedPositions - 2, 100003, 50000000, 1000000000000};
  for (int trial = 0; trial < 24; ++trial) {
    const auto style = trial % 2 == 0 ? nn::RopeStyle::interleaved : nn::RopeStyle::half;
    const int64_t d = draw(1, 70), rot = 2 * draw(d >= 2 ? 1 : 0, d / 2);
    const int64_t B = draw(1, 3), L = draw(1, 9), H = draw(1, 4);
    const int64_t offset = offsets[trial % 6] + draw(0, 5);
    const double base = trial % 3 == 0 ? 500.0 : 10000.0;
    const bool heads_outer = rng.next_u64() % 2 == 0;
    SCOPED_TRACE(::testing::Message() << "d " << d << " rot " << rot << " B " << B << " L " << L << " H " << H
                                      << " offset " << offset << " heads_outer " << heads_outer << " " << seed_note());
    if (rot == 0) continue;  // style none or d = 1: nothing rotates (covered by the constructor)
    nn::RotaryEmbedding rope(d, style, base, rot);
    Tensor x = random_tensor({B, L, H, d}, rng);
    // The same values in the drawn storage order, seen as [B, L, H, d].
    const std::vector<int64_t> strides = heads_outer ? std::vector<int64_t>{H * L * d, d, L * d, 1}
                                                     : std::vector<int64_t>{L * H * d, H * d, d, 1};
    Tensor y(DType::f32, {B * L * H * d});
    auto at = [&](int64_t b, int64_t l, int64_t h) { return b * strides[0] + l * strides[1] + h * strides[2]; };
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t h = 0; h < H; ++h)
          std::memcpy(y.data_as<float>() + at(b, l, h), x.data_as<float>() + ((b * L + l) * H + h) * d,
                      d * sizeof(float));
    const TensorView yv(y.data(), DType::f32, {B, L, H, d}, strides);
    rope.apply(yv, offset);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t h = 0; h < H; ++h) {
          auto ref = rope_ref(x.data_as<float>() + ((b * L + l) * H + h) * d, d, rot, style, offset + l, base);
          for (int64_t c = 0; c < d; ++c)
            ASSERT_NEAR(y.data_as<float>()[at(b, l, h) + c], ref[c], 2e-6) << "column " << c;
        }
    rope.apply_backward(yv, offset);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c = 0; c < d; ++c)
            ASSERT_NEAR(y.data_as<float>()[at(b, l, h) + c], x.data_as<float>()[((b * L + l) * H + h) * d + c], 2e-6);
  }
}

// Rows past the cached positions are made per call with the same values the table
// holds: a call straddling the end of the cache rotates its first rows bitwise as a
// call inside it does.
TEST(Rope, RowsPastTheCacheEqualTheCachedOnes) {
  nn::Rng rng = nn_rng(37);
  const int64_t d = 64, edge = nn::RotaryEmbedding::kCachedPositions - 3;
  nn::RotaryEmbedding rope(d, nn::RopeStyle::half);
  Tensor x = random_tensor({1, 6, 2, d}, rng);
  Tensor inside = nn::clone(x), across = nn::clone(x);
  rope.apply(TensorView(inside.data(), DType::f32, {1, 3, 2, d}), edge);  // positions edge … edge + 2: cached
  rope.apply(across, edge);                                               // edge … edge + 5: made per call
  EXPECT_EQ(std::memcmp(inside.data(), across.data(), 3 * 2 * d * sizeof(float)), 0);
  // One token far out: only its rows are made (a table of every position before
  // 10¹¹ would need ~50 TB).
  Tensor one = random_tensor({1, 1, 1, d}, rng);
  rope.apply(one, 100000000000);
}

// One object, several threads, positions that make each grow the shared table: every
// thread's result equals the one-thread result bitwise.
TEST(Rope, ConcurrentCallsOnOneObject) {
  nn::Rng rng = nn_rng(38);
  const int64_t d = 32, L = 37;
  nn::RotaryEmbedding shared(d, nn::RopeStyle::interleaved), serial(d, nn::RopeStyle::interleaved);
  constexpr int kThreads = 4, kCalls = 60;
  std::vector<Tensor> inputs, want;
  for (int i = 0; i < kThreads * kCalls; ++i) {
    inputs.push_back(random_tensor({1, L, 2, d}, rng));
    want.push_back(nn::clone(inputs.back()));
    serial.apply(want.back(), int64_t{i} * 97);
  }
  std::vector<Tensor> got(inputs.size());
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int c = 0; c < kCalls; ++c) {
        const int i = c * kThreads + t;  // offsets rise in every thread
        got[i] = nn::clone(inputs[i]);
        shared.apply(got[i], int64_t{i} * 97);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t i = 0; i < got.size(); ++i)
    ASSERT_EQ(std::memcmp(got[i].data(), want[i].data(), want[i].numel() * sizeof(float)), 0) << "call " << i;
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
