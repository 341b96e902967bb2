// Transformer encoder and decoder layers and their stacks, with the semantics and
// parameter names of PyTorch's nn.TransformerEncoderLayer / DecoderLayer /
// TransformerEncoder / TransformerDecoder (post-norm by default, norm_first for
// pre-norm), plus GQA and RoPE in the attention.
#pragma once

#include <memory>
#include <vector>

#include "attn/nn/layers.hpp"
#include "attn/nn/multihead_attention.hpp"

namespace attn::nn {

struct TransformerLayerConfig {
  int64_t d_model = 0;
  int64_t nhead = 1;
  int64_t dim_feedforward = 2048;
  float dropout = 0.1f;  ///< after attention, inside and after the feed-forward, and on the probabilities
  ActivationKind activation = ActivationKind::relu;
  float layer_norm_eps = 1e-5f;
  bool batch_first = false;
  bool norm_first = false;
  // Beyond PyTorch (self-attention only):
  int64_t num_kv_heads = 0;
  RopeStyle rope = RopeStyle::none;
  uint64_t seed = 0;  ///< dropout streams
};

/// src [B, L, E] ([L, B, E] unless batch_first). Post-norm:
///   x = norm1(x + dropout1(self_attn(x))); x = norm2(x + dropout2(ff(x)))
/// pre-norm (norm_first):
///   x = x + dropout1(self_attn(norm1(x))); x = x + dropout2(ff(norm2(x)))
/// with ff = linear2(dropout(activation(linear1(·)))). Parameters: self_attn.*,
/// linear1.*, linear2.*, norm1.*, norm2.*.
class TransformerEncoderLayer : public Module {
 public:
  TransformerEncoderLayer(const TransformerLayerConfig& config, Rng& rng);
  /// Masks as MultiheadAttention's (src_mask = attn_mask, true = not allowed).
  Tensor forward(const TensorView& src, const TensorView& src_mask = {}, const TensorView& src_key_padding_mask = {},
                 bool is_causal = false);
  /// d(loss)/d(src) given d(loss)/d(output).
  Tensor backward(const TensorView& doutput);

  MultiheadAttention self_attn;
  FeedForward ff;  // linear1, linear2 (named flat, as PyTorch)
  LayerNorm norm1, norm2;
  Dropout dropout1, dropout2;

 private:
  TransformerLayerConfig cfg_;
};

struct DecoderGrads {
  Tensor dtgt, dmemory;
};

/// One decoder layer's state for incremental decoding: the keys and values of the
/// target positions decoded so far (self-attention) and the memory's keys and values,
/// projected once (cross-attention).
struct DecoderLayerCache {
  KVCache self_attn, cross_attn;
};

/// tgt [B, T, E], memory [B, S, E] (sequence-first unless batch_first). Post-norm:
///   x = norm1(x + dropout1(self_attn(x))); x = norm2(x + dropout2(multihead_attn(x, memory)));
///   x = norm3(x + dropout3(ff(x)))
/// pre-norm applies each norm to the sublayer's input instead. Parameters: self_attn.*,
/// multihead_attn.*, linear1.*, linear2.*, norm1.*, norm2.*, norm3.*.
class TransformerDecoderLayer : public Module {
 public:
  TransformerDecoderLayer(const TransformerLayerConfig& config, Rng& rng);
  Tensor forward(const TensorView& tgt, const TensorView& memory, const TensorView& tgt_mask = {},
                 const TensorView& memory_mask = {}, const TensorView& tgt_key_padding_mask = {},
                 const TensorView& memory_key_padding_mask = {}, bool tgt_is_causal = false);
  DecoderGrads backward(const TensorView& doutput);

  /// Incremental decoding, step 1: the caches for `memory` [B, S, E] ([S, B, E]
  /// unless batch_first) and up to `capacity` target positions.
  DecoderLayerCache make_cache(const TensorView& memory, int64_t capacity, const KVCacheConfig& storage = {}) const;
  /// Incremental decoding, step 2 (inference: eval mode): the next T target
  /// positions tgt [B, T, E] ([T, B, E]). Equals the last T rows of forward(all
  /// positions so far, memory, tgt_is_causal = true, with the same padding masks)
  /// up to rounding, at O(T·length) attention cost instead of O(length²): the
  /// self-attention appends to cache.self_attn and reads it in place, the
  /// cross-attention reads cache.cross_attn (see MultiheadAttention::forward_cached).
  /// tgt_key_padding_mask [B, K ≥ positions so far + T] and memory_key_padding_mask
  /// [B, K ≥ S]: boolean, true = ignore that position, or f32, added (as forward()'s).
  /// tgt_mask [T, K] or [B·H, T, K] (K ≥ positions so far + T) and memory_mask [T, K]
  /// or [B·H, T, K] (K ≥ S): the rows of forward()'s masks for these T positions
  /// (see MultiheadAttention::forward_cached); tgt_mask applies with the causal order.
  Tensor forward_cached(const TensorView& tgt, DecoderLayerCache& cache, const TensorView& tgt_key_padding_mask = {},
                        const TensorView& memory_key_padding_mask = {}, const TensorView& tgt_mask = {},
                        const TensorView& memory_mask = {});

  /// The cross-attention weights of the last forward, averaged over heads [B, T, S],
  /// or per head [B, H, T, S] when set_keep_cross_weights(true, false) was called.
  const Tensor& cross_attention_weights() const { return cross_weights_; }
  void set_keep_cross_weights(bool keep, bool average = true) {
    keep_cross_weights_ = keep;
    average_cross_weights_ = average;
  }

  MultiheadAttention self_attn, multihead_attn;
  FeedForward ff;
  LayerNorm norm1, norm2, norm3;
  Dropout dropout1, dropout2, dropout3;

 private:
  TransformerLayerConfig cfg_;
  bool keep_cross_weights_ = false, average_cross_weights_ = true;
  Tensor cross_weights_;
};

/// num_layers encoder layers ("layers.0" …) and an optional final LayerNorm ("norm").
class TransformerEncoder : public Module {
 public:
  TransformerEncoder(const TransformerLayerConfig& config, int64_t num_layers, bool final_norm, Rng& rng);
  Tensor forward(const TensorView& src, const TensorView& mask = {}, const TensorView& src_key_padding_mask = {},
                 bool is_causal = false);
  Tensor backward(const TensorView& doutput);

  std::vector<std::unique_ptr<TransformerEncoderLayer>> layers;
  std::unique_ptr<LayerNorm> norm;
};

/// num_layers decoder layers ("layers.0" …) and an optional final LayerNorm ("norm").
class TransformerDecoder : public Module {
 public:
  TransformerDecoder(const TransformerLayerConfig& config, int64_t num_layers, bool final_norm, Rng& rng);
  Tensor forward(const TensorView& tgt, const TensorView& memory, const TensorView& tgt_mask = {},
                 const TensorView& memory_mask = {}, const TensorView& tgt_key_padding_mask = {},
                 const TensorView& memory_key_padding_mask = {}, bool tgt_is_causal = false);
  DecoderGrads backward(const TensorView& doutput);

  /// Incremental decoding: one cache per layer (TransformerDecoderLayer::make_cache).
  std::vector<DecoderLayerCache> make_cache(const TensorView& memory, int64_t capacity,
                                            const KVCacheConfig& storage = {}) const;
  /// The next T target positions through every layer and the final norm
  /// (TransformerDecoderLayer::forward_cached, with the same masks);
  /// caches.size() must be the layer count.
  Tensor forward_cached(const TensorView& tgt, std::vector<DecoderLayerCache>& caches,
                        const TensorView& tgt_key_padding_mask = {}, const TensorView& memory_key_padding_mask = {},
                        const TensorView& tgt_mask = {}, const TensorView& memory_mask = {});

  std::vector<std::unique_ptr<TransformerDecoderLayer>> layers;
  std::unique_ptr<LayerNorm> norm;
};

}  // namespace attn::nn
