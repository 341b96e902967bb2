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
