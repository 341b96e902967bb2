// Additive (Bahdanau) attention: projections with CBLAS, the score loop fused and
// vectorised (cpu/additive_scores), softmax and context per query.
#include <cmath>
#include <cstring>
#include <limits>

#include "attn/error.hpp"
#include "attn/nn/rnn_attention.hpp"
#include "cpu/additive_scores.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {
std::string str(int64_t v) { return std::to_string(v); }

// lengths int32 [B] in [0, S], or all S when absent.
std::vector<int32_t> read_lengths(const TensorView& lengths, int64_t B, int64_t S, const char* what) {
  std::vector<int32_t> out(static_cast<size_t>(B), static_cast<int32_t>(S));
  if (lengths.empty()) return out;
  if (lengths.dtype() != DType::i32 || lengths.rank() != 1 || lengths.size(0) != B || !lengths.is_contiguous())
    throw Error(std::string(what) + ": lengths must be int32 [" + str(B) + "], got " + lengths.describe());
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = lengths.data_as<int32_t>()[b];
    if (n < 0 || n > S)
      throw Error(std::string(what) + ": lengths[" + str(b) + "] must be in [0, " + str(S) + "], got " + str(n));
    out[b] = n;
  }
  return out;
}
}  // namespace

AdditiveAttention::AdditiveAttention(int64_t query_dim, int64_t key_dim, int64_t attn_dim, bool with_bias, Rng& rng)
    : query_proj(register_parameter("query_proj.weight", {attn_dim, query_dim})),
      key_proj(register_parameter("key_proj.weight", {attn_dim, key_dim})),
      bias(with_bias ? &register_parameter("bias", {attn_dim}) : nullptr),
      v(register_parameter("v", {attn_dim})),
      dq_(query_dim),
      dk_(key_dim),
      a_(attn_dim) {
  if (query_dim < 1 || key_dim < 1 || attn_dim < 1)
    throw Error("AdditiveAttention: query_dim, key_dim and attn_dim must be ≥ 1");
  init_uniform(query_proj, 1.0f / std::sqrt(float(query_dim)), rng);
  init_uniform(key_proj, 1.0f / std::sqrt(float(key_dim)), rng);
  init_uniform(v, 1.0f / std::sqrt(float(attn_dim)), rng);
}

AdditiveAttention::Memory AdditiveAttention::encode(const TensorView& keys, const TensorView& lengths) const {
  expect_f32(keys, 3, "AdditiveAttention.encode: keys");
  if (keys.size(2) != dk_)
    throw Error("AdditiveAttention.encode: keys' last dimension must be key_dim " + str(dk_) + ", got " + keys.describe());
  const int64_t B = keys.size(0), S = keys.size(1);
  Memory m;
  m.lengths = read_lengths(lengths, B, S, "AdditiveAttention.encode");
  m.keys = clone(keys);
  m.kproj = Tensor(DType::f32, {B, S, a_});
  ops::linear_forward(keys.data_as<float>(), B * S, dk_, key_proj.value.data(), bias ? bias->value.data() : nullptr,
                      a_, m.kproj.data_as<float>());
  return m;
}

Tensor AdditiveAttention::attend(const TensorView& query, const Memory& m, Step& step) const {
  expect_f32(query, 3, "AdditiveAttention.attend: query");
  const int64_t B = m.keys.shape()[0], S = m.keys.shape()[1], T = query.size(1);
  if (query.size(0) != B || query.size(2) != dq_)
    throw Error("AdditiveAttention.attend: query must be [" + str(B) + ", T, " + str(dq_) + "], got " +
                query.describe());
  step.query = clone(query);
  step.qproj = Tensor(DType::f32, {B, T, a_});
  ops::linear_forward(query.data_as<float>(), B * T, dq_, query_proj.value.data(), nullptr, a_,
                      step.qproj.data_as<float>());
  step.weights = zeros({B, T, S});
  Tensor context = zeros({B, T, dk_});
  const float* kp = m.kproj.data_as<float>();
  const float* keys = m.keys.data_as<float>();
  // Rows are independent (each writes its own weights and context): threads cannot
  // change the result.
#pragma omp parallel for schedule(static) if (B * T * S * a_ > (1 << 16))
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, n = m.lengths[b];
    if (n == 0) continue;  // nothing visible: weights and context stay 0
    float* w = step.weights.data_as<float>() + bt * S;
    detail::additive_scores(step.qproj.data_as<float>() + bt * a_, kp + b * S * a_, v.value.data(), n, a_, w);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, w[j]);
    double sum = 0;
    for (int64_t j = 0; j < n; ++j) sum += (w[j] = std::exp(w[j] - mx));
    const float inv = static_cast<float>(1.0 / sum);
    float* c = context.data_as<float>() + bt * dk_;
    for (int64_t j = 0; j < n; ++j) {
      w[j] *= inv;
      const float* k = keys + (b * S + j) * dk_;
      for (int64_t e = 0; e < dk_; ++e) c[e] += w[j] * k[e];
    }
  }
  return context;
}

Tensor AdditiveAttention::attend_backward(const Step& step, Memory& m, const TensorView& dcontext) {
  const int64_t B = m.keys.shape()[0], S = m.keys.shape()[1], T = step.query.shape()[1];
  ops::expect_shape(dcontext, {B, T, dk_}, "AdditiveAttention.attend_backward: dcontext");
  if (m.dkproj.shape().empty()) m.dkproj = zeros({B, S, a_});
  if (m.dkeys.shape().empty()) m.dkeys = zeros({B, S, dk_});
  Tensor dqp = zeros({B, T, a_});
  std::vector<float> de(static_cast<size_t>(S));
  const float* keys = m.keys.data_as<float>();
  for (int64_t bt = 0; bt < B * T; ++bt) {
    const int64_t b = bt / T, n = m.lengths[b];
    const float* w = step.weights.data_as<float>() + bt * S;
    const float* dc = dcontext.data_as<float>() + bt * dk_;
    // forward: c = Σ_j α_j·k_j, so dα_j = dc·k_j and dk_j += α_j·dc (the value path);
    // α = softmax(e), so de_j = α_j·(dα_j − Σ_k α_k·dα_k).
    double s = 0;
    for (int64_t j = 0; j < n; ++j) {
      const float* k = keys + (b * S + j) * dk_;
      float* dk = m.dkeys.data_as<float>() + (b * S + j) * dk_;
      double da = 0;
      for (int64_t e = 0; e < dk_; ++e) {
        da += double(dc[e]) * k[e];
        dk[e] += w[j] * dc[e];
      }
      de[j] = static_cast<float>(da);
      s += w[j] * da;
    }
    for (int64_t j = 0; j < n; ++j) de[j] = w[j] * static_cast<float>(de[j] - s);
    detail::additive_scores_backward(step.qproj.data_as<float>() + bt * a_, m.kproj.data_as<float>() + b * S * a_,
                                     v.value.data(), de.data(), n, a_, dqp.data_as<float>() + bt * a_,
                                     m.dkproj.data_as<float>() + b * S * a_, v.grad.data());
  }
  // forward: qproj = query·W_qᵀ
  Tensor dquery = zeros({B, T, dq_});
  ops::linear_backward(step.query.data_as<float>(), dqp.data_as<float>(), B * T, dq_, query_proj.value.data(), a_,
                       dquery.data_as<float>(), query_proj.grad.data(), nullptr);
  return dquery;
}

Tensor AdditiveAttention::encode_backward(Memory& m) {
  const int64_t B = m.keys.shape()[0], S = m.keys.shape()[1];
  Tensor dkeys = m.dkeys.shape().empty() ? zeros({B, S, dk_}) : std::move(m.dkeys);
  if (!m.dkproj.shape().empty())  // forward: kproj = keys·W_kᵀ + b
    ops::linear_backward(m.keys.data_as<float>(), m.dkproj.data_as<float>(), B * S, dk_, key_proj.value.data(), a_,
                         dkeys.data_as<float>(), key_proj.grad.data(), bias ? bias->grad.data() : nullptr);
  m.dkproj = Tensor();
  m.dkeys = Tensor();
  return dkeys;
}

AdditiveAttention::Output AdditiveAttention::forward(const TensorView& query, const TensorView& keys,
                                                     const TensorView& lengths) {
  memory_ = encode(keys, lengths);
  Output out;
  out.context = attend(query, memory_, step_);
  out.weights = clone(step_.weights);
  return out;
}

std::pair<Tensor, Tensor> AdditiveAttention::backward(const TensorView& dcontext) {
  if (step_.query.shape().empty()) throw Error("AdditiveAttention.backward: backward called before forward");
  Tensor dquery = attend_backward(step_, memory_, dcontext);
  return {std::move(dquery), encode_backward(memory_)};
}

}  // namespace attn::nn
