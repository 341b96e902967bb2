// Transformer encoder/decoder layers and stacks: residual wiring around the
// attention, feed-forward and norm modules, forward and backward.
#include "attn/nn/transformer.hpp"

#include <functional>

#include "attn/error.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {

MultiheadAttentionConfig attention_config(const TransformerLayerConfig& c, bool self, uint64_t seed) {
  MultiheadAttentionConfig m;
  m.embed_dim = c.d_model;
  m.num_heads = c.nhead;
  m.dropout = c.dropout;
  m.batch_first = c.batch_first;
  m.seed = seed;
  if (self) {
    m.num_kv_heads = c.num_kv_heads;
    m.rope = c.rope;
  }
  return m;
}

// a += b (same shapes), returned for chaining.
Tensor& add_into(Tensor& a, const Tensor& b) {
  float* x = a.data_as<float>();
  const float* y = b.data_as<float>();
  for (int64_t i = 0; i < a.numel(); ++i) x[i] += y[i];
  return a;
}

Tensor sum3(MultiheadAttentionGrads& g) {
  add_into(g.dquery, g.dkey);
  return std::move(add_into(g.dquery, g.dvalue));
}

// Distinct dropout streams per sublayer, derived from the layer's seed.
uint64_t stream(uint64_t seed, uint64_t k) { return seed * 0x9E3779B97F4A7C15ull + k + 1; }

}  // namespace

// ---- encoder layer -----------------------------------------------------------------

TransformerEncoderLayer::TransformerEncoderLayer(const TransformerLayerConfig& c, Rng& rng)
    : self_attn(attention_config(c, true, stream(c.seed, 0)), rng),
      ff(c.d_model, c.dim_feedforward, c.activation, c.dropout, rng, stream(c.seed, 1)),
      norm1(c.d_model, c.layer_norm_eps),
      norm2(c.d_model, c.layer_norm_eps),
      dropout1(c.dropout, stream(c.seed, 2)),
      dropout2(c.dropout, stream(c.seed, 3)),
      cfg_(c) {
  register_module("self_attn", self_attn);
  register_module("", ff);
  register_module("norm1", norm1);
  register_module("norm2", norm2);
  register_module("", dropout1);
  register_module("", dropout2);
}

Tensor TransformerEncoderLayer::forward(const TensorView& src, const TensorView& src_mask,
                                        const TensorView& kpm, bool is_causal) {
  expect_f32(src, 3, "TransformerEncoderLayer.forward: src");
  if (cfg_.norm_first) {
    Tensor a = norm1.forward(src);
    Tensor h1 = dropout1.forward(self_attn.forward(a, a, a, kpm, false, src_mask, true, is_causal).output);
    add_into(h1, clone(src));
    Tensor out = dropout2.forward(ff.forward(norm2.forward(h1)));
    return std::move(add_into(out, h1));
  }
  Tensor h1 = dropout1.forward(self_attn.forward(src, src, src, kpm, false, src_mask, true, is_causal).output);
  add_into(h1, clone(src));
  Tensor y1 = norm1.forward(h1);
  Tensor h2 = dropout2.forward(ff.forward(y1));
  return norm2.forward(add_into(h2, y1));
}

Tensor TransformerEncoderLayer::backward(const TensorView& dout) {
  if (cfg_.norm_first) {
    // out = h1 + ff(norm2(h1)), h1 = x + sa(norm1(x))
    Tensor dh1 = norm2.backward(ff.backward(dropout2.backward(dout)));
    add_into(dh1, clone(dout));
    MultiheadAttentionGrads g = self_attn.backward(dropout1.backward(dh1));
    Tensor dx = norm1.backward(sum3(g));
    return std::move(add_into(dx, dh1));
  }
  // out = norm2(y1 + ff(y1)), y1 = norm1(x + sa(x))
  Tensor dh2 = norm2.backward(dout);
  Tensor dy1 = ff.backward(dropout2.backward(dh2));
  add_into(dy1, dh2);
  Tensor dh1 = norm1.backward(dy1);
  MultiheadAttentionGrads g = self_attn.backward(dropout1.backward(dh1));
  Tensor dx = sum3(g);
  return std::move(add_into(dx, dh1));
}

// ---- decoder layer -----------------------------------------------------------------

TransformerDecoderLayer::TransformerDecoderLayer(const TransformerLayerConfig& c, Rng& rng)
    : self_attn(attention_config(c, true, stream(c.seed, 0)), rng),
      multihead_attn(attention_config(c, false, stream(c.seed, 1)), rng),
      ff(c.d_model, c.dim_feedforward, c.activation, c.dropout, rng, stream(c.seed, 2)),
      norm1(c.d_model, c.layer_norm_eps),
      norm2(c.d_model, c.layer_norm_eps),
      norm3(c.d_model, c.layer_norm_eps),
      dropout1(c.dropout, stream(c.seed, 3)),
      dropout2(c.dropout, stream(c.seed, 4)),
      dropout3(c.dropout, stream(c.seed, 5)),
      cfg_(c) {
  register_module("self_attn", self_attn);
  register_module("multihead_attn", multihead_attn);
  register_module("", ff);
  register_module("norm1", norm1);
  register_module("norm2", norm2);
  register_module("norm3", norm3);
  register_module("", dropout1);
  register_module("", dropout2);
  register_module("", dropout3);
}

Tensor TransformerDecoderLayer::forward(const TensorView& tgt, const TensorView& memory, const TensorView& tgt_mask,
                                        const TensorView& memory_mask, const TensorView& tgt_kpm,
                                        const TensorView& memory_kpm, bool tgt_is_causal) {
  expect_f32(tgt, 3, "TransformerDecoderLayer.forward: tgt");
  expect_f32(memory, 3, "TransformerDecoderLayer.forward: memory");
  auto cross = [&](const TensorView& x) {
    auto r = multihead_attn.forward(x, memory, memory, memory_kpm, keep_cross_weights_, memory_mask,
                                    average_cross_weights_);
    if (keep_cross_weights_) cross_weights_ = std::move(r.weights);
    return dropout2.forward(r.output);
  };
  if (cfg_.norm_first) {
    Tensor a = norm1.forward(tgt);
    Tensor h1 = dropout1.forward(self_attn.forward(a, a, a, tgt_kpm, false, tgt_mask, true, tgt_is_causal).output);
    add_into(h1, clone(tgt));
    Tensor h2 = cross(norm2.forward(h1));
    add_into(h2, h1);
    Tensor out = dropout3.forward(ff.forward(norm3.forward(h2)));
    return std::move(add_into(out, h2));
  }
  Tensor h1 = dropout1.forward(self_attn.forward(tgt, tgt, tgt, tgt_kpm, false, tgt_mask, true, tgt_is_causal).output);
  add_into(h1, clone(tgt));
  Tensor y1 = norm1.forward(h1);
  Tensor h2 = cross(y1);
  Tensor y2 = norm2.forward(add_into(h2, y1));
  Tensor h3 = dropout3.forward(ff.forward(y2));
  return norm3.forward(add_into(h3, y2));
}

DecoderLayerCache TransformerDecoderLayer::make_cache(const TensorView& memory, int64_t capacity,
                                                     const KVCacheConfig& storage) const {
  expect_f32(memory, 3, "TransformerDecoderLayer.make_cache: memory");
  DecoderLayerCache c;
  c.cross_attn = multihead_attn.make_memory_cache(memory, memory, storage);
  c.self_attn = self_attn.make_cache(c.cross_attn.batch, capacity, storage);
  return c;
}

Tensor TransformerDecoderLayer::forward_cached(const TensorView& tgt, DecoderLayerCache& cache,
                                               const TensorView& tgt_key_padding_mask,
                                               const TensorView& memory_key_padding_mask, const TensorView& tgt_mask,
                                               const TensorView& memory_mask) {
  if (training())
    throw Error("TransformerDecoderLayer.forward_cached: decoding is inference; call eval() first (dropout is off there)");
  expect_f32(tgt, 3, "TransformerDecoderLayer.forward_cached: tgt");
  const int64_t position = cache.self_attn.length;  // of tgt's first row, before self_attn appends
  {  // Every mask checked before the self-attention appends to its cache.
    const int64_t B = tgt.size(cfg_.batch_first ? 0 : 1), T = tgt.size(cfg_.batch_first ? 1 : 0);
    const std::string name = "TransformerDecoderLayer.forward_cached: ";
    Tensor unused;
    cached_attention_mask(tgt_key_padding_mask, name + "tgt_key_padding_mask", tgt_mask, name + "tgt_mask", B,
                          self_attn.config().num_heads, T, position + T, unused);
    cached_attention_mask(memory_key_padding_mask, name + "memory_key_padding_mask", memory_mask, name + "memory_mask", B,
                          multihead_attn.config().num_heads, T, cache.cross_attn.length, unused);
  }
  auto cross = [&](const TensorView& x) {
    return multihead_attn.forward_memory_cached(x, cache.cross_attn, position, memory_key_padding_mask, memory_mask);
  };
  if (cfg_.norm_first) {
    Tensor a = norm1.forward(tgt);
    Tensor h1 = self_attn.forward_cached(a, cache.self_attn, tgt_key_padding_mask, tgt_mask);
    add_into(h1, clone(tgt));
    Tensor h2 = cross(norm2.forward(h1));
    add_into(h2, h1);
    Tensor out = ff.forward(norm3.forward(h2));
    return std::move(add_into(out, h2));
  }
  Tensor h1 = self_attn.forward_cached(tgt, cache.self_attn, tgt_key_padding_mask, tgt_mask);
  add_into(h1, clone(tgt));
  Tensor y1 = norm1.forward(h1);
  Tensor h2 = cross(y1);
  Tensor y2 = norm2.forward(add_into(h2, y1));
  Tensor h3 = ff.forward(y2);
  return norm3.forward(add_into(h3, y2));
}

DecoderGrads TransformerDecoderLayer::backward(const TensorView& dout) {
  DecoderGrads out;
  if (cfg_.norm_first) {
    // out = h2 + ff(norm3(h2)); h2 = h1 + ca(norm2(h1), m); h1 = x + sa(norm1(x))
    Tensor dh2 = norm3.backward(ff.backward(dropout3.backward(dout)));
    add_into(dh2, clone(dout));
    MultiheadAttentionGrads gc = multihead_attn.backward(dropout2.backward(dh2));
    Tensor dh1 = norm2.backward(gc.dquery);
    add_into(dh1, dh2);
    out.dmemory = std::move(add_into(gc.dkey, gc.dvalue));
    MultiheadAttentionGrads gs = self_attn.backward(dropout1.backward(dh1));
    out.dtgt = norm1.backward(sum3(gs));
    add_into(out.dtgt, dh1);
    return out;
  }
  // out = norm3(y2 + ff(y2)); y2 = norm2(y1 + ca(y1, m)); y1 = norm1(x + sa(x))
  Tensor dh3 = norm3.backward(dout);
  Tensor dy2 = ff.backward(dropout3.backward(dh3));
  add_into(dy2, dh3);
  Tensor dh2 = norm2.backward(dy2);
  MultiheadAttentionGrads gc = multihead_attn.backward(dropout2.backward(dh2));
  Tensor dy1 = std::move(add_into(gc.dquery, dh2));
  out.dmemory = std::move(add_into(gc.dkey, gc.dvalue));
  Tensor dh1 = norm1.backward(dy1);
  MultiheadAttentionGrads gs = self_attn.backward(dropout1.backward(dh1));
  out.dtgt = sum3(gs);
  add_into(out.dtgt, dh1);
  return out;
}

// ---- stacks ------------------------------------------------------------------------

// The layers of a stack ("layers.0" …, each with its own dropout stream from
// stream_base) and the optional final norm ("norm"), registered on `stack`.
template <class Layer>
void build_stack(const char* what, const TransformerLayerConfig& config, int64_t num_layers, bool final_norm,
                 uint64_t stream_base, Rng& rng, std::vector<std::unique_ptr<Layer>>& layers,
                 std::unique_ptr<LayerNorm>& norm, const std::function<void(const std::string&, Module&)>& add) {
  if (num_layers < 1) throw Error(std::string(what) + ": num_layers must be ≥ 1");
  for (int64_t i = 0; i < num_layers; ++i) {
    TransformerLayerConfig c = config;
    c.seed = stream(config.seed, stream_base + i);
    layers.push_back(std::make_unique<Layer>(c, rng));
    add("layers." + std::to_string(i), *layers.back());
  }
  if (final_norm) {
    norm = std::make_unique<LayerNorm>(config.d_model, config.layer_norm_eps);
    add("norm", *norm);
  }
}

TransformerEncoder::TransformerEncoder(const TransformerLayerConfig& config, int64_t num_layers, bool final_norm,
                                       Rng& rng) {
  build_stack("TransformerEncoder", config, num_layers, final_norm, 100, rng, layers, norm,
              [this](const std::string& n, Module& m) { register_module(n, m); });
}

Tensor TransformerEncoder::forward(const TensorView& src, const TensorView& mask, const TensorView& kpm,
                                   bool is_causal) {
  Tensor x = layers[0]->forward(src, mask, kpm, is_causal);
  for (size_t i = 1; i < layers.size(); ++i) x = layers[i]->forward(x, mask, kpm, is_causal);
  return norm ? norm->forward(x) : std::move(x);
}

Tensor TransformerEncoder::backward(const TensorView& dout) {
  Tensor d = norm ? norm->backward(dout) : clone(dout);
  for (size_t i = layers.size(); i-- > 0;) d = layers[i]->backward(d);
  return d;
}

TransformerDecoder::TransformerDecoder(const TransformerLayerConfig& config, int64_t num_layers, bool final_norm,
                                       Rng& rng) {
  build_stack("TransformerDecoder", config, num_layers, final_norm, 200, rng, layers, norm,
              [this](const std::string& n, Module& m) { register_module(n, m); });
}

Tensor TransformerDecoder::forward(const TensorView& tgt, const TensorView& memory, const TensorView& tgt_mask,
                                   const TensorView& memory_mask, const TensorView& tgt_kpm,
                                   const TensorView& memory_kpm, bool tgt_is_causal) {
  Tensor x = layers[0]->forward(tgt, memory, tgt_mask, memory_mask, tgt_kpm, memory_kpm, tgt_is_causal);
  for (size_t i = 1; i < layers.size(); ++i)
    x = layers[i]->forward(x, memory, tgt_mask, memory_mask, tgt_kpm, memory_kpm, tgt_is_causal);
  return norm ? norm->forward(x) : std::move(x);
}

std::vector<DecoderLayerCache> TransformerDecoder::make_cache(const TensorView& memory, int64_t capacity,
                                                             const KVCacheConfig& storage) const {
  std::vector<DecoderLayerCache> caches;
  caches.reserve(layers.size());
  for (const auto& layer : layers) caches.push_back(layer->make_cache(memory, capacity, storage));
  return caches;
}

Tensor TransformerDecoder::forward_cached(const TensorView& tgt, std::vector<DecoderLayerCache>& caches,
                                          const TensorView& tgt_key_padding_mask,
                                          const TensorView& memory_key_padding_mask, const TensorView& tgt_mask,
                                          const TensorView& memory_mask) {
  if (caches.size() != layers.size())
    throw Error("TransformerDecoder.forward_cached: caches must hold one cache per layer (" + std::to_string(layers.size()) +
                "), got " + std::to_string(caches.size()) + "; use make_cache");
  Tensor x = layers[0]->forward_cached(tgt, caches[0], tgt_key_padding_mask, memory_key_padding_mask, tgt_mask, memory_mask);
  for (size_t i = 1; i < layers.size(); ++i)
    x = layers[i]->forward_cached(x, caches[i], tgt_key_padding_mask, memory_key_padding_mask, tgt_mask, memory_mask);
  return norm ? norm->forward(x) : std::move(x);
}

DecoderGrads TransformerDecoder::backward(const TensorView& dout) {
  DecoderGrads g;
  Tensor d = norm ? norm->backward(dout) : clone(dout);
  for (size_t i = layers.size(); i-- > 0;) {
    DecoderGrads gi = layers[i]->backward(d);
    d = std::move(gi.dtgt);
    if (g.dmemory.shape().empty()) g.dmemory = std::move(gi.dmemory);
    else add_into(g.dmemory, gi.dmemory);
  }
  g.dtgt = std::move(d);
  return g;
}

}  // namespace attn::nn
