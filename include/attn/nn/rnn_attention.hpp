// The attention of attention-augmented RNNs: additive (Bahdanau et al. 2014) and
// Luong et al. 2015 (dot, general, concat, with the attentional hidden state).
// Both attend from decoder states (queries) to encoder annotations (the memory,
// used as keys and values), masking each sequence's padded source positions.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "attn/nn/module.hpp"

namespace attn::nn {

/// e_tj = vᵀ·tanh(W_q·q_t + W_k·k_j + b), α_t = softmax over the visible j, context_t = Σ_j α_tj·k_j.
/// Parameters: query_proj.weight [A, Dq], key_proj.weight [A, Dk], bias [A] (optional), v [A].
/// The score loop is one fused, vectorised kernel per query (no [T, S, A] tensor is formed;
/// the backward recomputes the tanh), as Marian's Att / AttBack.
///
/// Decoders call it once per step with the same memory, so the key projection is done
/// once by encode(), each step by attend(), and the gradients flow back through
/// attend_backward() (per step, any order) then encode_backward() (once).
class AdditiveAttention : public Module {
 public:
  AdditiveAttention(int64_t query_dim, int64_t key_dim, int64_t attn_dim, bool bias, Rng& rng);

  /// The encoded memory and the gradients accumulated into it.
  struct Memory {
    Tensor keys;                   ///< [B, S, Dk], also the values
    Tensor kproj;                  ///< [B, S, A] = W_k·k_j + b
    std::vector<int32_t> lengths;  ///< keys j < lengths[b] are visible (0 allowed: context 0)
    Tensor dkproj, dkeys;          ///< filled by attend_backward
  };
  /// What attend_backward needs from one call to attend.
  struct Step {
    Tensor query, qproj, weights;  ///< [B, T, Dq], [B, T, A], [B, T, S]
  };

  /// keys [B, S, Dk]; lengths int32 [B] in [0, S], or absent (all visible).
  Memory encode(const TensorView& keys, const TensorView& lengths = {}) const;
  /// query [B, T, Dq] → context [B, T, Dk]; step.weights holds α (0 at masked keys).
  Tensor attend(const TensorView& query, const Memory& memory, Step& step) const;
  /// Given d(loss)/d(context) [B, T, Dk]: returns d(loss)/d(query), adds into memory's
  /// dkproj and dkeys and into the parameter gradients (v).
  Tensor attend_backward(const Step& step, Memory& memory, const TensorView& dcontext);
  /// Returns d(loss)/d(keys) [B, S, Dk] (the value path plus the key projection's) and
  /// adds into key_proj's and the bias's gradients.
  Tensor encode_backward(Memory& memory);

  struct Output {
    Tensor context, weights;
  };
  /// Module-style: one call with all queries; backward returns {dquery, dkeys}.
  Output forward(const TensorView& query, const TensorView& keys, const TensorView& lengths = {});
  std::pair<Tensor, Tensor> backward(const TensorView& dcontext);

  int64_t query_dim() const { return dq_; }
  int64_t key_dim() const { return dk_; }
  int64_t attn_dim() const { return a_; }
  Parameter &query_proj, &key_proj;
  Parameter* bias;
  Parameter& v;

 private:
  int64_t dq_, dk_, a_;
  Memory memory_;
  Step step_;
};

enum class LuongScore {
  dot,      ///< h_tᵀ·h̄_s (needs Dq == Dk)
  general,  ///< h_tᵀ·W_a·h̄_s, linear_in.weight [Dk, Dq]
  concat,   ///< v_aᵀ·tanh(W_a·[h_t; h̄_s]): the additive kernel without bias
};

/// Luong attention: scores by `score`, α = softmax over the visible source positions,
/// c_t = Σ_s α_ts·h̄_s, and the attentional hidden state h̃_t = tanh(W_c·[c_t; h_t])
/// with linear_out.weight [Dq, Dk + Dq] (OpenNMT's names). dot and general run on the
/// fused scaled-dot-product kernels (scale 1).
class LuongAttention : public Module {
 public:
  /// attn_dim is for concat only (0 = query_dim).
  LuongAttention(int64_t query_dim, int64_t key_dim, LuongScore score, Rng& rng, int64_t attn_dim = 0);

  struct Output {
    Tensor attentional;  ///< h̃ [B, T, Dq]
    Tensor context;      ///< [B, T, Dk]
    Tensor weights;      ///< [B, T, S]
  };
  /// queries [B, T, Dq], memory [B, S, Dk], lengths int32 [B] in [0, S] or absent.
  Output forward(const TensorView& queries, const TensorView& memory, const TensorView& lengths = {});
  /// Given d(loss)/d(attentional): returns {dqueries, dmemory}.
  std::pair<Tensor, Tensor> backward(const TensorView& dattentional);

  LuongScore score() const { return score_; }
  Parameter* linear_in;  ///< general only
  Parameter& linear_out;

 private:
  int64_t dq_, dk_;
  LuongScore score_;
  std::unique_ptr<AdditiveAttention> concat_;
  // Last forward.
  Tensor queries_, memory_, qk_, context_, lse_, attentional_;
  std::vector<int32_t> lengths_;
};

}  // namespace attn::nn
