// A Transformer encoder layer and an attention-augmented GRU in a few lines:
// forward, backward, a look at the attention weights, incremental decoding of a
// padded batch with a KV cache, and the weights saved as safetensors under
// PyTorch's names (loadable with torch's load_state_dict).
#include <attn/nn.hpp>

#include <algorithm>
#include <cmath>
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

  // Incremental decoding of a padded batch with a KV cache: sequence 0's target is
  // left-padded by 2 positions, sequence 1's source (the memory) right-padded by 3.
  attn::nn::TransformerDecoder decoder(cfg, /*num_layers=*/2, /*final_norm=*/true, rng);
  decoder.eval();
  const int64_t T = 7, S = 9;
  attn::Tensor tgt(attn::DType::f32, {2, T, 32}), memory(attn::DType::f32, {2, S, 32});
  for (attn::Tensor* t : {&tgt, &memory})
    for (int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = rng.uniform(-1, 1);
  attn::Tensor tgt_pad(attn::DType::boolean, {2, T}), memory_pad(attn::DType::boolean, {2, S});  // true = ignore
  for (int64_t t = 0; t < T; ++t) tgt_pad.data_as<uint8_t>()[t] = t < 2, tgt_pad.data_as<uint8_t>()[T + t] = 0;
  for (int64_t j = 0; j < S; ++j) memory_pad.data_as<uint8_t>()[j] = 0, memory_pad.data_as<uint8_t>()[S + j] = j >= S - 3;
  attn::Tensor full = decoder.forward(tgt, memory, {}, {}, tgt_pad, memory_pad, /*tgt_is_causal=*/true);
  auto caches = decoder.make_cache(memory, /*capacity=*/T, {attn::DType::bf16, /*page_size=*/4});
  float worst = 0;
  for (int64_t t = 0; t < T; ++t) {  // one position per step, each reading the cache once
    attn::Tensor step(attn::DType::f32, {2, 1, 32});
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t e = 0; e < 32; ++e) step.data_as<float>()[b * 32 + e] = tgt.data_as<float>()[(b * T + t) * 32 + e];
    attn::Tensor y_t = decoder.forward_cached(step, caches, tgt_pad, memory_pad);
    for (int64_t b = 0; b < 2; ++b)
      for (int64_t e = 0; e < 32; ++e)
        worst = std::max(worst, std::abs(y_t.data_as<float>()[b * 32 + e] - full.data_as<float>()[(b * T + t) * 32 + e]));
  }
  std::printf("decoder, %lld steps on a bf16 paged cache: largest difference from the full forward %.1e\n",
              static_cast<long long>(T), worst);

  attn::io::save_safetensors("encoder_layer.safetensors", attn::io::module_state(layer));
  std::printf("wrote encoder_layer.safetensors (self_attn.in_proj_weight, linear1.weight, ...)\n");
  return 0;
}
