// Building blocks: Linear, Embedding, LayerNorm, RMSNorm, Dropout, activations
// and the position-wise feed-forward network. Each works on the last dimension
// of a contiguous f32 tensor [..., features], so [B, L, E] and [L, B, E] are the same
// to them. forward keeps what backward needs; backward returns d(input) and adds
// into the parameters' gradients (see module.hpp).
#pragma once

#include <cstdint>
#include <string>

#include "attn/nn/module.hpp"
#include "attn/tensor.hpp"

namespace attn::nn {

/// y = x·Wᵀ + b, PyTorch's nn.Linear: weight [out, in], bias [out].
/// Initialised as PyTorch: weight and bias ~ U(±1/√in).
class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, Rng& rng);
  /// x: [..., in] → [..., out].
  Tensor forward(const TensorView& x);
  /// dy: [..., out] → dx: [..., in].
  Tensor backward(const TensorView& dy);

  int64_t in_features() const { return in_; }
  int64_t out_features() const { return out_; }
  Parameter& weight;
  Parameter* bias;  // null without bias

 private:
  int64_t in_, out_;
  Tensor x_;
};

/// Row lookup, PyTorch's nn.Embedding: weight [num_embeddings, dim] ~ N(0, 1).
/// The row `padding_idx` (if ≥ 0) is zero and receives no gradient.
class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, Rng& rng, int64_t padding_idx = -1);
  /// ids: i32 [...] with values in [0, num_embeddings) → [..., dim].
  Tensor forward(const TensorView& ids);
  /// dy: [..., dim]; adds into weight.grad (nothing flows to integer ids).
  void backward(const TensorView& dy);

  Parameter& weight;

 private:
  int64_t num_, dim_, padding_idx_;
  std::vector<int32_t> ids_;
};

/// PyTorch's nn.LayerNorm over the last dimension: (x − mean)/√(var + eps)·weight + bias,
/// with the biased variance. weight = 1, bias = 0 initially.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(int64_t dim, float eps = 1e-5f, bool elementwise_affine = true);
  Tensor forward(const TensorView& x);
  Tensor backward(const TensorView& dy);

  Parameter* weight;  // null without elementwise_affine
  Parameter* bias;

 private:
  int64_t dim_;
  float eps_;
  Tensor xhat_;                 // normalised input
  std::vector<float> rstd_;     // 1/√(var + eps) per row
};

/// RMSNorm (Zhang & Sennrich 2019): x / √(mean(x²) + eps) · weight; weight = 1 initially.
class RMSNorm : public Module {
 public:
  explicit RMSNorm(int64_t dim, float eps = 1e-6f);
  Tensor forward(const TensorView& x);
  Tensor backward(const TensorView& dy);

  Parameter& weight;

 private:
  int64_t dim_;
  float eps_;
  Tensor x_;
  std::vector<float> rstd_;
};

/// Inverted dropout: in training mode each element is zeroed with probability p and
/// the survivors are scaled by 1/(1−p); in evaluation mode it is the identity.
/// Decisions come from a counter-based generator keyed by (seed, call number, element),
/// so a run is reproducible for a seed whatever the number of threads.
class Dropout : public Module {
 public:
  explicit Dropout(float p = 0.5f, uint64_t seed = 0);
  Tensor forward(const TensorView& x);
  Tensor backward(const TensorView& dy);
  float p() const { return p_; }
  /// Restarts the call counter and changes the seed.
  void reseed(uint64_t seed);

 private:
  float p_;
  uint64_t seed_, calls_ = 0;
  std::vector<uint8_t> keep_;  // empty when the last forward was the identity
};

/// Element-wise activations by name: "relu", "gelu" (exact, erf-based, PyTorch's
/// default) and "gelu_tanh" (the tanh approximation). Throws attn::Error for others.
enum class ActivationKind { relu, gelu, gelu_tanh };
ActivationKind activation_from_name(const std::string& name);
const char* activation_name(ActivationKind kind);

class Activation : public Module {
 public:
  explicit Activation(ActivationKind kind) : kind_(kind) {}
  Tensor forward(const TensorView& x);
  Tensor backward(const TensorView& dy);

 private:
  ActivationKind kind_;
  Tensor x_;
};

/// The position-wise feed-forward network of "Attention Is All You Need":
/// linear2(dropout(activation(linear1(x)))), with PyTorch's transformer names
/// linear1 [dim_feedforward, d_model] and linear2 [d_model, dim_feedforward].
/// Its parameters are named directly under the parent ("linear1.weight"), as in
/// nn.TransformerEncoderLayer.
class FeedForward : public Module {
 public:
  FeedForward(int64_t d_model, int64_t dim_feedforward, ActivationKind activation, float dropout,
              Rng& rng, uint64_t dropout_seed = 0);
  Tensor forward(const TensorView& x);
  Tensor backward(const TensorView& dy);

  Linear linear1, linear2;
  Activation activation;
  Dropout dropout;
};

}  // namespace attn::nn
