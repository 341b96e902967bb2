// Linear, Embedding, LayerNorm, RMSNorm, Dropout, activations, feed-forward.
#include "attn/nn/layers.hpp"

#include <cmath>
#include <cstring>

#include "attn/error.hpp"
#include "dropout/philox.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {
void expect_forward_done(bool done, const char* what) {
  if (!done) throw Error(std::string(what) + ": backward called before forward");
}
}  // namespace

// ---- Linear ----------------------------------------------------------------------

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, Rng& rng)
    : weight(register_parameter("weight", {out_features, in_features})),
      bias(bias ? &register_parameter("bias", {out_features}) : nullptr),
      in_(in_features),
      out_(out_features) {
  if (in_features < 1 || out_features < 1)
    throw Error("Linear: in_features and out_features must be ≥ 1, got " + std::to_string(in_features) + " and " +
                std::to_string(out_features));
  const float bound = 1.0f / std::sqrt(static_cast<float>(in_features));
  init_uniform(weight, bound, rng);
  if (this->bias) init_uniform(*this->bias, bound, rng);
}

Tensor Linear::forward(const TensorView& x) {
  ops::expect_last_dim(x, in_, "Linear.forward: x");
  x_ = clone(x);
  Tensor y(DType::f32, ops::with_last_dim(x, out_));
  ops::linear_forward(x_.data_as<float>(), ops::rows_of(x), in_, weight.value.data(),
                      bias ? bias->value.data() : nullptr, out_, y.data_as<float>());
  return y;
}

Tensor Linear::backward(const TensorView& dy) {
  expect_forward_done(!x_.shape().empty(), "Linear.backward");
  ops::expect_shape(dy, ops::with_last_dim(x_.view(), out_), "Linear.backward: dy");
  Tensor dx = zeros(x_.shape());
  ops::linear_backward(x_.data_as<float>(), dy.data_as<float>(), ops::rows_of(dy), in_, weight.value.data(), out_,
                       dx.data_as<float>(), weight.grad.data(), bias ? bias->grad.data() : nullptr);
  return dx;
}

// ---- Embedding ---------------------------------------------------------------------

Embedding::Embedding(int64_t num_embeddings, int64_t dim, Rng& rng, int64_t padding_idx)
    : weight(register_parameter("weight", {num_embeddings, dim})),
      num_(num_embeddings),
      dim_(dim),
      padding_idx_(padding_idx) {
  if (num_embeddings < 1 || dim < 1) throw Error("Embedding: num_embeddings and dim must be ≥ 1");
  if (padding_idx >= num_embeddings)
    throw Error("Embedding: padding_idx must be < num_embeddings (" + std::to_string(num_embeddings) + "), got " +
                std::to_string(padding_idx));
  init_normal(weight, 1.0f, rng);
  if (padding_idx >= 0) std::fill_n(weight.value.begin() + padding_idx * dim, dim, 0.0f);
}

Tensor Embedding::forward(const TensorView& ids) {
  if (ids.empty() || ids.dtype() != DType::i32 || !ids.is_contiguous())
    throw Error("Embedding.forward: ids must be a contiguous i32 tensor, got " +
                (ids.empty() ? std::string("none") : ids.describe()));
  const int32_t* p = ids.data_as<int32_t>();
  ids_.assign(p, p + ids.numel());
  for (int32_t id : ids_)
    if (id < 0 || id >= num_)
      throw Error("Embedding.forward: ids must lie in [0, " + std::to_string(num_) + "), got " + std::to_string(id));
  std::vector<int64_t> shape = ids.shape();
  shape.push_back(dim_);
  Tensor y(DType::f32, shape);
  float* out = y.data_as<float>();
  for (size_t r = 0; r < ids_.size(); ++r)
    std::memcpy(out + r * dim_, weight.value.data() + ids_[r] * dim_, sizeof(float) * dim_);
  return y;
}

void Embedding::backward(const TensorView& dy) {
  ops::expect_last_dim(dy, dim_, "Embedding.backward: dy");
  if (ops::rows_of(dy) != static_cast<int64_t>(ids_.size()))
    throw Error("Embedding.backward: dy has " + std::to_string(ops::rows_of(dy)) + " rows, the forward had " +
                std::to_string(ids_.size()) + " ids");
  const float* g = dy.data_as<float>();
  for (size_t r = 0; r < ids_.size(); ++r) {
    if (ids_[r] == padding_idx_) continue;  // PyTorch: the padding row gets no gradient
    float* dw = weight.grad.data() + ids_[r] * dim_;
    for (int64_t c = 0; c < dim_; ++c) dw[c] += g[r * dim_ + c];
  }
}

// ---- LayerNorm ---------------------------------------------------------------------

LayerNorm::LayerNorm(int64_t dim, float eps, bool elementwise_affine)
    : weight(elementwise_affine ? &register_parameter("weight", {dim}) : nullptr),
      bias(elementwise_affine ? &register_parameter("bias", {dim}) : nullptr),
      dim_(dim),
      eps_(eps) {
  if (dim < 1) throw Error("LayerNorm: dim must be ≥ 1");
  if (!(eps > 0.0f)) throw Error("LayerNorm: eps must be > 0");
  if (weight) init_constant(*weight, 1.0f);
}

Tensor LayerNorm::forward(const TensorView& x) {
  ops::expect_last_dim(x, dim_, "LayerNorm.forward: x");
  const int64_t rows = ops::rows_of(x);
  xhat_ = Tensor(DType::f32, x.shape());
  rstd_.assign(static_cast<size_t>(rows), 0.0f);
  Tensor y(DType::f32, x.shape());
  const float* in = x.data_as<float>();
  float* xh = xhat_.data_as<float>();
  float* out = y.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = in + r * dim_;
    double mean = 0.0, var = 0.0;  // two passes in double: no cancellation
    for (int64_t c = 0; c < dim_; ++c) mean += row[c];
    mean /= dim_;
    for (int64_t c = 0; c < dim_; ++c) var += (row[c] - mean) * (row[c] - mean);
    var /= dim_;
    const float rstd = static_cast<float>(1.0 / std::sqrt(var + eps_));
    rstd_[r] = rstd;
    for (int64_t c = 0; c < dim_; ++c) {
      const float h = static_cast<float>(row[c] - mean) * rstd;
      xh[r * dim_ + c] = h;
      out[r * dim_ + c] = weight ? h * weight->value[c] + bias->value[c] : h;
    }
  }
  return y;
}

Tensor LayerNorm::backward(const TensorView& dy) {
  expect_forward_done(!xhat_.shape().empty(), "LayerNorm.backward");
  ops::expect_shape(dy, xhat_.shape(), "LayerNorm.backward: dy");
  const int64_t rows = ops::rows_of(dy);
  Tensor dx(DType::f32, xhat_.shape());
  const float* g = dy.data_as<float>();
  const float* xh = xhat_.data_as<float>();
  float* out = dx.data_as<float>();
  std::vector<float> dxhat(static_cast<size_t>(dim_));
  for (int64_t r = 0; r < rows; ++r) {
    // forward: y = xhat·w + b, xhat = (x − μ)·rstd. With g = dL/dxhat = dy·w:
    // dL/dx = rstd·(g − mean(g) − xhat·mean(g·xhat)).
    double mean_g = 0.0, mean_gx = 0.0;
    for (int64_t c = 0; c < dim_; ++c) {
      const float gy = g[r * dim_ + c];
      dxhat[c] = weight ? gy * weight->value[c] : gy;
      mean_g += dxhat[c];
      mean_gx += double(dxhat[c]) * xh[r * dim_ + c];
      if (weight) {
        weight->grad[c] += gy * xh[r * dim_ + c];
        bias->grad[c] += gy;
      }
    }
    mean_g /= dim_;
    mean_gx /= dim_;
    for (int64_t c = 0; c < dim_; ++c)
      out[r * dim_ + c] =
          rstd_[r] * static_cast<float>(dxhat[c] - mean_g - xh[r * dim_ + c] * mean_gx);
  }
  return dx;
}

// ---- RMSNorm -----------------------------------------------------------------------

RMSNorm::RMSNorm(int64_t dim, float eps) : weight(register_parameter("weight", {dim})), dim_(dim), eps_(eps) {
  if (dim < 1) throw Error("RMSNorm: dim must be ≥ 1");
  if (!(eps > 0.0f)) throw Error("RMSNorm: eps must be > 0");
  init_constant(weight, 1.0f);
}

Tensor RMSNorm::forward(const TensorView& x) {
  ops::expect_last_dim(x, dim_, "RMSNorm.forward: x");
  const int64_t rows = ops::rows_of(x);
  x_ = clone(x);
  rstd_.assign(static_cast<size_t>(rows), 0.0f);
  Tensor y(DType::f32, x.shape());
  const float* in = x_.data_as<float>();
  float* out = y.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0.0;
    for (int64_t c = 0; c < dim_; ++c) ms += double(in[r * dim_ + c]) * in[r * dim_ + c];
    const float rstd = static_cast<float>(1.0 / std::sqrt(ms / dim_ + eps_));
    rstd_[r] = rstd;
    for (int64_t c = 0; c < dim_; ++c) out[r * dim_ + c] = in[r * dim_ + c] * rstd * weight.value[c];
  }
  return y;
}

Tensor RMSNorm::backward(const TensorView& dy) {
  expect_forward_done(!x_.shape().empty(), "RMSNorm.backward");
  ops::expect_shape(dy, x_.shape(), "RMSNorm.backward: dy");
  const int64_t rows = ops::rows_of(dy);
  Tensor dx(DType::f32, x_.shape());
  const float* g = dy.data_as<float>();
  const float* in = x_.data_as<float>();
  float* out = dx.data_as<float>();
  for (int64_t r = 0; r < rows; ++r) {
    // forward: y = x·r·w with r = (mean(x²) + eps)^(−1/2), so dr/dx = −r³·x/dim and
    // dL/dx = r·(g·w) − x·r³·mean(g·w·x).
    const float rs = rstd_[r];
    double mean_gwx = 0.0;
    for (int64_t c = 0; c < dim_; ++c) {
      mean_gwx += double(g[r * dim_ + c]) * weight.value[c] * in[r * dim_ + c];
      weight.grad[c] += g[r * dim_ + c] * in[r * dim_ + c] * rs;
    }
    mean_gwx /= dim_;
    const float k = static_cast<float>(mean_gwx) * rs * rs * rs;
    for (int64_t c = 0; c < dim_; ++c)
      out[r * dim_ + c] = rs * g[r * dim_ + c] * weight.value[c] - in[r * dim_ + c] * k;
  }
  return dx;
}

// ---- Dropout -----------------------------------------------------------------------

Dropout::Dropout(float p, uint64_t seed) : p_(p), seed_(seed) {
  if (!(p >= 0.0f && p < 1.0f)) throw Error("Dropout: p must be in [0, 1), got " + std::to_string(p));
}

void Dropout::reseed(uint64_t seed) {
  seed_ = seed;
  calls_ = 0;
}

Tensor Dropout::forward(const TensorView& x) {
  expect_f32(x, -1, "Dropout.forward: x");
  Tensor y = clone(x);
  keep_.clear();
  if (!training() || p_ == 0.0f) return y;
  const int64_t n = x.numel();
  keep_.resize(static_cast<size_t>(n));
  const uint32_t threshold = static_cast<uint32_t>(double(p_) * 4294967296.0);
  const float scale = 1.0f / (1.0f - p_);
  const uint64_t call = calls_++;
  const detail::PhiloxKey key{static_cast<uint32_t>(seed_), static_cast<uint32_t>(seed_ >> 32)};
  float* out = y.data_as<float>();
  for (int64_t i = 0; i < n; i += 4) {
    const uint64_t block = static_cast<uint64_t>(i / 4);
    const detail::PhiloxCounter w = detail::philox4x32_10(
        {static_cast<uint32_t>(block), static_cast<uint32_t>(block >> 32), static_cast<uint32_t>(call),
         static_cast<uint32_t>(call >> 32) ^ 0x6E6E5A5Au},
        key);
    for (int64_t e = i; e < std::min(n, i + 4); ++e) {
      const bool keep = w[e - i] >= threshold;
      keep_[e] = keep;
      out[e] = keep ? out[e] * scale : 0.0f;
    }
  }
  return y;
}

Tensor Dropout::backward(const TensorView& dy) {
  expect_f32(dy, -1, "Dropout.backward: dy");
  Tensor dx = clone(dy);
  if (keep_.empty()) return dx;
  if (dy.numel() != static_cast<int64_t>(keep_.size()))
    throw Error("Dropout.backward: dy has " + std::to_string(dy.numel()) + " elements, the forward had " +
                std::to_string(keep_.size()));
  const float scale = 1.0f / (1.0f - p_);
  float* g = dx.data_as<float>();
  for (size_t e = 0; e < keep_.size(); ++e) g[e] = keep_[e] ? g[e] * scale : 0.0f;
  return dx;
}

// ---- activations -------------------------------------------------------------------

ActivationKind activation_from_name(const std::string& name) {
  if (name == "relu") return ActivationKind::relu;
  if (name == "gelu") return ActivationKind::gelu;
  if (name == "gelu_tanh") return ActivationKind::gelu_tanh;
  throw Error("activation: expected \"relu\", \"gelu\" or \"gelu_tanh\", got \"" + name + "\"");
}

const char* activation_name(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::relu: return "relu";
    case ActivationKind::gelu: return "gelu";
    case ActivationKind::gelu_tanh: return "gelu_tanh";
  }
  return "?";
}

namespace {
constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kInvSqrt2 = 0.7071067811865476;

// Value and derivative in double: a few ops per element, and exact enough that
// the f32 result is the correctly rounded one in practice.
double act(ActivationKind k, double x) {
  switch (k) {
    case ActivationKind::relu: return x > 0 ? x : 0;
    case ActivationKind::gelu: return 0.5 * x * (1.0 + std::erf(x * kInvSqrt2));
    case ActivationKind::gelu_tanh:
      return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + 0.044715 * x * x * x)));
  }
  return 0;
}
double act_grad(ActivationKind k, double x) {
  switch (k) {
    case ActivationKind::relu: return x > 0 ? 1 : 0;
    case ActivationKind::gelu:  // Φ(x) + x·φ(x)
      return 0.5 * (1.0 + std::erf(x * kInvSqrt2)) + x * std::exp(-0.5 * x * x) * 0.3989422804014327;
    case ActivationKind::gelu_tanh: {
      const double u = kSqrt2OverPi * (x + 0.044715 * x * x * x);
      const double t = std::tanh(u);
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3 * 0.044715 * x * x);
    }
  }
  return 0;
}
}  // namespace

Tensor Activation::forward(const TensorView& x) {
  x_ = clone(x);
  Tensor y(DType::f32, x.shape());
  const float* in = x_.data_as<float>();
  float* out = y.data_as<float>();
  for (int64_t i = 0; i < x.numel(); ++i) out[i] = static_cast<float>(act(kind_, in[i]));
  return y;
}

Tensor Activation::backward(const TensorView& dy) {
  expect_forward_done(!x_.shape().empty(), "Activation.backward");
  ops::expect_shape(dy, x_.shape(), "Activation.backward: dy");
  Tensor dx(DType::f32, x_.shape());
  const float* in = x_.data_as<float>();
  const float* g = dy.data_as<float>();
  float* out = dx.data_as<float>();
  for (int64_t i = 0; i < dy.numel(); ++i) out[i] = static_cast<float>(g[i] * act_grad(kind_, in[i]));
  return dx;
}

// ---- FeedForward -------------------------------------------------------------------

FeedForward::FeedForward(int64_t d_model, int64_t dim_feedforward, ActivationKind activation_kind, float p,
                         Rng& rng, uint64_t dropout_seed)
    : linear1(d_model, dim_feedforward, true, rng),
      linear2(dim_feedforward, d_model, true, rng),
      activation(activation_kind),
      dropout(p, dropout_seed) {
  register_module("linear1", linear1);
  register_module("linear2", linear2);
  register_module("", activation);
  register_module("", dropout);
}

Tensor FeedForward::forward(const TensorView& x) {
  Tensor h = linear1.forward(x);
  Tensor a = activation.forward(h);
  Tensor d = dropout.forward(a);
  return linear2.forward(d);
}

Tensor FeedForward::backward(const TensorView& dy) {
  Tensor dd = linear2.backward(dy);
  Tensor da = dropout.backward(dd);
  Tensor dh = activation.backward(da);
  return linear1.backward(dh);
}

}  // namespace attn::nn
