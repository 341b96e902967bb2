// A Transformer encoder layer and an attention-augmented GRU in a few lines:
// forward, backward, a look at the attention weights, and the weights saved as
// safetensors under PyTorch's names (loadable with torch's load_state_dict).
#include <attn/nn.hpp>

#include <cstdio>
#include <vector>

int main() {
  attn::nn::Rng rng(2026);

  // A post-norm encoder layer, batch first: x [B=2, L=6, E=32].
  attn::nn::TransformerLayerConfig cfg;
  cfg.d_model = 32;
  cfg.nhead = 4;
  cfg.dim_feedforward = 64;
  cfg.batch_first = true;
  attn::nn::TransformerEncoderLayer layer(cfg, rng);
  layer.eval();  // dropout off
  attn::Tensor x(attn::DType::f32, {2, 6, 32});
  for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] = rng.uniform(-1, 1);
  attn::Tensor y = layer.forward(x, {}, {}, /*is_causal=*/true);

  // Backward of L = Σ y: d(L)/d(y) = 1 everywhere.
  attn::Tensor dy(attn::DType::f32, y.shape());
  for (int64_t i = 0; i < dy.numel(); ++i) dy.data_as<float>()[i] = 1.0f;
  layer.zero_grad();
  attn::Tensor dx = layer.backward(dy);
  std::printf("encoder layer: %lld parameters, |dL/dx[0]| = %.4f, dL/d(linear1.bias[0]) = %.4f\n",
              static_cast<long long>(layer.num_parameters()), std::abs(dx.data_as<float>()[0]),
              layer.parameter("linear1.bias").grad[0]);

  // Additive attention from 3 decoder states to 5 annotations, the last two padded away.
  attn::nn::AdditiveAttention additive(/*query_dim=*/8, /*key_dim=*/16, /*attn_dim=*/12, /*bias=*/true, rng);
  attn::Tensor queries(attn::DType::f32, {1, 3, 8}), annotations(attn::DType::f32, {1, 5, 16});
  for (attn::Tensor* t : {&queries, &annotations})
    for (int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = rng.uniform(-1, 1);
  const int32_t length = 3;
  auto att = additive.forward(queries, annotations, attn::TensorView(&length, attn::DType::i32, {1}));
  std::printf("additive attention weights (rows: queries, columns: source positions):\n");
  for (int t = 0; t < 3; ++t) {
    for (int j = 0; j < 5; ++j) std::printf(" %.3f", att.weights.data_as<float>()[t * 5 + j]);
    std::printf("\n");
  }

  attn::io::save_safetensors("encoder_layer.safetensors", attn::io::module_state(layer));
  std::printf("wrote encoder_layer.safetensors (self_attn.in_proj_weight, linear1.weight, ...)\n");
  return 0;
}
