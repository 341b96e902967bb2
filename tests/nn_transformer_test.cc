// Transformer layers with what PyTorch lacks (GQA, RoPE), by finite differences;
// cross-attention weights; errors. PyTorch parity is in nn_parity_test.
#include <gtest/gtest.h>

#include "attn/error.hpp"
#include "attn/nn/transformer.hpp"
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

nn::TransformerLayerConfig small(bool norm_first) {
  nn::TransformerLayerConfig c;
  c.d_model = 8;
  c.nhead = 4;
  c.num_kv_heads = 2;
  c.rope = nn::RopeStyle::interleaved;
  c.dim_feedforward = 12;
  c.activation = nn::ActivationKind::gelu;
  c.batch_first = true;
  c.norm_first = norm_first;
  return c;
}

TEST(TransformerEncoder, GradientsWithGqaAndRope) {
  nn::Rng rng = nn_rng(51);
  for (bool norm_first : {false, true}) {
    nn::TransformerEncoder enc(small(norm_first), 2, /*final_norm=*/true, rng);
    enc.eval();
    Tensor x = random_tensor({2, 5, 8}, rng);
    Tensor dx;
    auto slots = parameter_slots(enc);
    slots.push_back({"src", x.data_as<float>(), x.numel(), [&] { return dx.data_as<float>(); }});
    enc.zero_grad();
    check_gradients([&] { return enc.forward(x, {}, {}, /*is_causal=*/true); },
                    [&](const Tensor& g) { dx = enc.backward(g); }, slots, rng, 3e-3f);
  }
}

TEST(TransformerDecoder, GradientsAndCrossWeights) {
  nn::Rng rng = nn_rng(52);
  for (bool norm_first : {false, true}) {
    nn::TransformerDecoderLayer dec(small(norm_first), rng);
    dec.eval();
    dec.set_keep_cross_weights(true);
    Tensor tgt = random_tensor({2, 4, 8}, rng), mem = random_tensor({2, 6, 8}, rng);
    nn::DecoderGrads g;
    auto slots = parameter_slots(dec);
    slots.push_back({"tgt", tgt.data_as<float>(), tgt.numel(), [&] { return g.dtgt.data_as<float>(); }});
    slots.push_back({"memory", mem.data_as<float>(), mem.numel(), [&] { return g.dmemory.data_as<float>(); }});
    dec.zero_grad();
    check_gradients([&] { return dec.forward(tgt, mem, {}, {}, {}, {}, true); },
                    [&](const Tensor& dy) { g = dec.backward(dy); }, slots, rng, 3e-3f);
    const Tensor& w = dec.cross_attention_weights();
    ASSERT_EQ(w.shape(), (std::vector<int64_t>{2, 4, 6}));
    for (int64_t r = 0; r < 8; ++r) {
      double s = 0;
      for (int64_t j = 0; j < 6; ++j) s += w.data_as<float>()[r * 6 + j];
      EXPECT_NEAR(s, 1.0, 1e-5);
    }
  }
}

/// A layer configuration drawn for the shape tests below: 1–4 heads of 2, 4 or 6
/// dims, d_model ≥ 6 (with 4 features, a row whose LayerNorm input has a tiny variance
/// amplified gradients ~100× and curved the loss enough to miss by 1–15% at a step of
/// 3e-3, shrinking to 0 with the step: seed 13 once), a kv-head count dividing the heads, any RoPE pairing, both norm
/// placements and layouts. GELU only: ReLU's kink sits inside a finite difference's
/// step for some drawn values.
nn::TransformerLayerConfig drawn_config(nn::Rng& rng) {
  nn::TransformerLayerConfig c;
  for (;;) {
    c.nhead = 1 + static_cast<int64_t>(rng.next_u64() % 4);
    c.d_model = c.nhead * 2 * (1 + static_cast<int64_t>(rng.next_u64() % 3));
    if (c.d_model >= 6) break;
  }
  std::vector<int64_t> divisors;
  for (int64_t k = 1; k <= c.nhead; ++k)
    if (c.nhead % k == 0) divisors.push_back(k);
  c.num_kv_heads = divisors[rng.next_u64() % divisors.size()];
  c.rope = static_cast<nn::RopeStyle>(rng.next_u64() % 3);
  c.dim_feedforward = 3 + static_cast<int64_t>(rng.next_u64() % 6);
  c.activation = rng.next_u64() % 2 ? nn::ActivationKind::gelu : nn::ActivationKind::gelu_tanh;
  c.batch_first = rng.next_u64() % 2;
  c.norm_first = rng.next_u64() % 2;
  return c;
}

std::string describe(const nn::TransformerLayerConfig& c, int64_t B, int64_t L) {
  return "d_model " + std::to_string(c.d_model) + ", heads " + std::to_string(c.nhead) + "/" +
         std::to_string(c.num_kv_heads) + " kv, rope " + std::to_string(static_cast<int>(c.rope)) + ", ff " +
         std::to_string(c.dim_feedforward) + ", batch_first " + std::to_string(c.batch_first) + ", norm_first " +
         std::to_string(c.norm_first) + ", B " + std::to_string(B) + ", L " + std::to_string(L) + " (" + seed_note() +
         ")";
}

/// [B, L] boolean key padding (true = ignore), each key out with probability 1/4:
/// whole rows may go, whose outputs are then defined (DESIGN.md) and constant.
Tensor drawn_padding(int64_t B, int64_t L, nn::Rng& rng) {
  Tensor m(DType::boolean, {B, L});
  for (int64_t i = 0; i < B * L; ++i) m.data_as<bool>()[i] = rng.next_u64() % 4 == 0;
  return m;
}

/// The input's shape in the layer's layout.
std::vector<int64_t> layout(const nn::TransformerLayerConfig& c, int64_t B, int64_t L) {
  return c.batch_first ? std::vector<int64_t>{B, L, c.d_model} : std::vector<int64_t>{L, B, c.d_model};
}

/// The drawn tests' absolute floor: an f32 forward's rounding over a few dozen outputs
/// moves a central difference at a step of 3e-3 by up to ~1e-4 per element, ~4e-4 over
/// 24 of them, which sank slots with gradients of ~1e-2 (a cross-attention query norm
/// against two memory positions) under the default 1e-4. A wrong formula misses by
/// O(|gradient|), and other draws give the same slot gradients far above the floor.
constexpr double kDrawnAtol = 1e-3;

TEST(TransformerEncoder, GradientsOnDrawnShapes) {
  nn::Rng rng = nn_rng(54);
  const int64_t lengths[] = {1, 2, 3, 5, 7};
  for (int draw = 0; draw < 8; ++draw) {
    const nn::TransformerLayerConfig c = drawn_config(rng);
    const int64_t B = 1 + static_cast<int64_t>(rng.next_u64() % 3), L = lengths[rng.next_u64() % 5];
    const int64_t layers = 1 + static_cast<int64_t>(rng.next_u64() % 2);
    const bool final_norm = rng.next_u64() % 2, causal = rng.next_u64() % 2, padded = rng.next_u64() % 2;
    SCOPED_TRACE(describe(c, B, L) + ", layers " + std::to_string(layers) + ", causal " + std::to_string(causal) +
                 ", padded " + std::to_string(padded));
    nn::TransformerEncoder enc(c, layers, final_norm, rng);
    enc.eval();
    Tensor x = random_tensor(layout(c, B, L), rng);
    Tensor padding = padded ? drawn_padding(B, L, rng) : Tensor();
    Tensor dx;
    auto slots = parameter_slots(enc);
    slots.push_back({"src", x.data_as<float>(), x.numel(), [&] { return dx.data_as<float>(); }});
    enc.zero_grad();
    check_gradients([&] { return enc.forward(x, {}, padded ? TensorView(padding) : TensorView(), causal); },
                    [&](const Tensor& g) { dx = enc.backward(g); }, slots, rng, 3e-3f, 1e-2, kDrawnAtol);
  }
}

TEST(TransformerDecoder, GradientsOnDrawnShapes) {
  nn::Rng rng = nn_rng(55);
  const int64_t lengths[] = {1, 2, 3, 5, 7};
  for (int draw = 0; draw < 8; ++draw) {
    const nn::TransformerLayerConfig c = drawn_config(rng);
    const int64_t B = 1 + static_cast<int64_t>(rng.next_u64() % 3);
    const int64_t T = lengths[rng.next_u64() % 5], S = lengths[rng.next_u64() % 5];
    const bool causal = rng.next_u64() % 2, padded = rng.next_u64() % 2;
    SCOPED_TRACE(describe(c, B, T) + ", S " + std::to_string(S) + ", causal " + std::to_string(causal) +
                 ", memory padded " + std::to_string(padded));
    nn::TransformerDecoderLayer dec(c, rng);
    dec.eval();
    Tensor tgt = random_tensor(layout(c, B, T), rng), mem = random_tensor(layout(c, B, S), rng);
    Tensor padding = padded ? drawn_padding(B, S, rng) : Tensor();
    nn::DecoderGrads g;
    auto slots = parameter_slots(dec);
    slots.push_back({"tgt", tgt.data_as<float>(), tgt.numel(), [&] { return g.dtgt.data_as<float>(); }});
    slots.push_back({"memory", mem.data_as<float>(), mem.numel(), [&] { return g.dmemory.data_as<float>(); }});
    dec.zero_grad();
    check_gradients(
        [&] { return dec.forward(tgt, mem, {}, {}, {}, padded ? TensorView(padding) : TensorView(), causal); },
        [&](const Tensor& dy) { g = dec.backward(dy); }, slots, rng, 3e-3f, 1e-2, kDrawnAtol);
  }
}

TEST(TransformerLayers, DropoutIsReproducibleForASeedAndOffInEval) {
  nn::Rng rng = nn_rng(53);
  auto c = small(false);
  c.dropout = 0.3f;
  c.seed = 11;
  nn::Rng r1(3), r2(3);
  nn::TransformerEncoderLayer a(c, r1), b(c, r2);
  Tensor x = random_tensor({1, 6, 8}, rng);
  Tensor ya = a.forward(x), yb = b.forward(x);
  EXPECT_EQ(std::memcmp(ya.data(), yb.data(), sizeof(float) * ya.numel()), 0);
  a.eval();
  b.eval();
  Tensor ea = a.forward(x);
  EXPECT_NE(std::memcmp(ya.data(), ea.data(), sizeof(float) * ya.numel()), 0);
}

TEST(TransformerLayers, NamesAndErrors) {
  nn::Rng rng(1);
  nn::TransformerDecoder dec(small(false), 2, true, rng);
  std::vector<std::string> names;
  for (auto& [n, p] : dec.named_parameters()) names.push_back(n);
  EXPECT_EQ(names.front(), "layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(names.back(), "norm.bias");
  EXPECT_NE(std::find(names.begin(), names.end(), "layers.1.multihead_attn.out_proj.weight"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "layers.1.norm3.weight"), names.end());
  Tensor bad = random_tensor({2, 3, 7}, rng);
  EXPECT_THROW(dec.forward(bad, bad), Error);
  EXPECT_THROW(nn::TransformerEncoder(small(false), 0, false, rng), Error);
}

}  // namespace
}  // namespace attn::testing
