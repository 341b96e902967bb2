// Luong attention: dot/general scores on the fused scaled-dot-product kernels
// (scale 1, per-sequence key lengths), concat on the additive kernel, then the
// attentional hidden state tanh(W_c·[c; h]).
#include <cmath>
#include <cstring>

#include "attn/attention.hpp"
#include "attn/error.hpp"
#include "attn/nn/rnn_attention.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {
std::string str(int64_t v) { return std::to_string(v); }
}  // namespace

LuongAttention::LuongAttention(int64_t query_dim, int64_t key_dim, LuongScore score, Rng& rng, int64_t attn_dim)
    : linear_in(score == LuongScore::general ? &register_parameter("linear_in.weight", {key_dim, query_dim}) : nullptr),
      linear_out(register_parameter("linear_out.weight", {query_dim, key_dim + query_dim})),
      dq_(query_dim),
      dk_(key_dim),
      score_(score) {
  if (query_dim < 1 || key_dim < 1) throw Error("LuongAttention: query_dim and key_dim must be ≥ 1");
  if (score == LuongScore::dot && query_dim != key_dim)
    throw Error("LuongAttention: the dot score needs query_dim == key_dim, got " + str(query_dim) + " and " +
                str(key_dim) + " (use general or concat)");
  if (linear_in) init_uniform(*linear_in, 1.0f / std::sqrt(float(query_dim)), rng);
  init_uniform(linear_out, 1.0f / std::sqrt(float(key_dim + query_dim)), rng);
  if (score == LuongScore::concat) {
    concat_ = std::make_unique<AdditiveAttention>(query_dim, key_dim, attn_dim > 0 ? attn_dim : query_dim, false, rng);
    register_module("", *concat_);
  }
}

LuongAttention::Output LuongAttention::forward(const TensorView& queries, const TensorView& memory,
                                               const TensorView& lengths) {
  expect_f32(queries, 3, "LuongAttention.forward: queries");
  expect_f32(memory, 3, "LuongAttention.forward: memory");
  const int64_t B = queries.size(0), T = queries.size(1), S = memory.size(1);
  if (queries.size(2) != dq_ || memory.size(0) != B || memory.size(2) != dk_)
    throw Error("LuongAttention.forward: expected queries [B, T, " + str(dq_) + "] and memory [B, S, " + str(dk_) +
                "] with the same B, got " + queries.describe() + " and " + memory.describe());
  queries_ = clone(queries);
  memory_ = clone(memory);
  Output out;
  if (concat_) {
    auto r = concat_->forward(queries, memory, lengths);
    context_ = std::move(r.context);
    out.weights = std::move(r.weights);
  } else {
    lengths_.clear();
    AttentionOptions opt;
    opt.scale = 1.0f;  // Luong's scores are not scaled
    if (!lengths.empty()) {
      if (lengths.dtype() != DType::i32 || lengths.rank() != 1 || lengths.size(0) != B || !lengths.is_contiguous())
        throw Error("LuongAttention.forward: lengths must be int32 [" + str(B) + "], got " + lengths.describe());
      lengths_.assign(lengths.data_as<int32_t>(), lengths.data_as<int32_t>() + B);
      opt.key_lengths = TensorView(lengths_.data(), DType::i32, {B});
    }
    if (linear_in) {
      qk_ = Tensor(DType::f32, {B, T, dk_});
      ops::linear_forward(queries_.data_as<float>(), B * T, dq_, linear_in->value.data(), nullptr, dk_,
                          qk_.data_as<float>());
    } else {
      qk_ = clone(queries);
    }
    context_ = Tensor(DType::f32, {B, T, dk_});
    lse_ = Tensor(DType::f32, {B, 1, T});
    out.weights = Tensor(DType::f32, {B, T, S});
    attention(TensorView(qk_.data(), DType::f32, {B, T, 1, dk_}), TensorView(memory_.data(), DType::f32, {B, S, 1, dk_}),
              TensorView(memory_.data(), DType::f32, {B, S, 1, dk_}),
              TensorView(context_.data(), DType::f32, {B, T, 1, dk_}), opt, lse_.view(),
              TensorView(out.weights.data(), DType::f32, {B, 1, T, S}));
  }
  // h̃ = tanh(W_c·[c; h])
  Tensor cat(DType::f32, {B * T, dk_ + dq_});
  for (int64_t r = 0; r < B * T; ++r) {
    std::memcpy(cat.data_as<float>() + r * (dk_ + dq_), context_.data_as<float>() + r * dk_, sizeof(float) * dk_);
    std::memcpy(cat.data_as<float>() + r * (dk_ + dq_) + dk_, queries_.data_as<float>() + r * dq_, sizeof(float) * dq_);
  }
  attentional_ = Tensor(DType::f32, {B, T, dq_});
  ops::linear_forward(cat.data_as<float>(), B * T, dk_ + dq_, linear_out.value.data(), nullptr, dq_,
                      attentional_.data_as<float>());
  for (int64_t i = 0; i < attentional_.numel(); ++i)
    attentional_.data_as<float>()[i] = std::tanh(attentional_.data_as<float>()[i]);
  out.attentional = clone(attentional_);
  out.context = clone(context_);
  return out;
}

std::pair<Tensor, Tensor> LuongAttention::backward(const TensorView& datt) {
  if (attentional_.shape().empty()) throw Error("LuongAttention.backward: backward called before forward");
  ops::expect_shape(datt, attentional_.shape(), "LuongAttention.backward: dattentional");
  const int64_t B = queries_.shape()[0], T = queries_.shape()[1], S = memory_.shape()[1], n = B * T;
  // forward: h̃ = tanh(pre), pre = [c; h]·W_cᵀ
  Tensor dpre(DType::f32, {n, dq_});
  for (int64_t i = 0; i < dpre.numel(); ++i) {
    const float a = attentional_.data_as<float>()[i];
    dpre.data_as<float>()[i] = datt.data_as<float>()[i] * (1.0f - a * a);
  }
  Tensor cat(DType::f32, {n, dk_ + dq_}), dcat = zeros({n, dk_ + dq_});
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(cat.data_as<float>() + r * (dk_ + dq_), context_.data_as<float>() + r * dk_, sizeof(float) * dk_);
    std::memcpy(cat.data_as<float>() + r * (dk_ + dq_) + dk_, queries_.data_as<float>() + r * dq_, sizeof(float) * dq_);
  }
  ops::linear_backward(cat.data_as<float>(), dpre.data_as<float>(), n, dk_ + dq_, linear_out.value.data(), dq_,
                       dcat.data_as<float>(), linear_out.grad.data(), nullptr);
  Tensor dcontext(DType::f32, {B, T, dk_}), dqueries(DType::f32, {B, T, dq_});
  for (int64_t r = 0; r < n; ++r) {
    std::memcpy(dcontext.data_as<float>() + r * dk_, dcat.data_as<float>() + r * (dk_ + dq_), sizeof(float) * dk_);
    std::memcpy(dqueries.data_as<float>() + r * dq_, dcat.data_as<float>() + r * (dk_ + dq_) + dk_, sizeof(float) * dq_);
  }
  Tensor dmemory;
  auto add = [](Tensor& a, const Tensor& b) {
    for (int64_t i = 0; i < a.numel(); ++i) a.data_as<float>()[i] += b.data_as<float>()[i];
  };
  if (concat_) {
    auto [dq, dm] = concat_->backward(dcontext);
    add(dqueries, dq);
    dmemory = std::move(dm);
  } else {
    AttentionOptions opt;
    opt.scale = 1.0f;
    if (!lengths_.empty()) opt.key_lengths = TensorView(lengths_.data(), DType::i32, {B});
    Tensor dqk = zeros({B, T, dk_}), dk = zeros({B, S, dk_}), dv = zeros({B, S, dk_});
    const TensorView mem(memory_.data(), DType::f32, {B, S, 1, dk_});
    attention_backward(TensorView(qk_.data(), DType::f32, {B, T, 1, dk_}), mem, mem,
                       TensorView(context_.data(), DType::f32, {B, T, 1, dk_}), lse_.view(),
                       TensorView(dcontext.data(), DType::f32, {B, T, 1, dk_}),
                       TensorView(dqk.data(), DType::f32, {B, T, 1, dk_}), TensorView(dk.data(), DType::f32, {B, S, 1, dk_}),
                       TensorView(dv.data(), DType::f32, {B, S, 1, dk_}), opt);
    add(dk, dv);  // the memory is both keys and values
    dmemory = std::move(dk);
    if (linear_in)  // forward: qk = queries·W_inᵀ
      ops::linear_backward(queries_.data_as<float>(), dqk.data_as<float>(), n, dq_, linear_in->value.data(), dk_,
                           dqueries.data_as<float>(), linear_in->grad.data(), nullptr);
    else
      add(dqueries, dqk);
  }
  return {std::move(dqueries), std::move(dmemory)};
}

}  // namespace attn::nn
