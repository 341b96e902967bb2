// The attention-augmented RNN encoder–decoder of Bahdanau, Cho & Bengio (2014):
// a bidirectional GRU reads the source into annotations h_j = [h→_j; h←_j]; at each
// output step the decoder scores every annotation against its previous state,
// takes the attention-weighted average as the context c_i, and updates its GRU
// state from (previous token, c_i). Teacher-forced training with an explicit
// backward, greedy and beam-search decoding, and the per-step attention weights.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/nn/layers.hpp"
#include "attn/nn/recurrent.hpp"
#include "attn/nn/rnn_attention.hpp"

namespace attn::nn {

struct Seq2SeqConfig {
  int64_t src_vocab = 0;
  int64_t tgt_vocab = 0;
  int64_t embed_dim = 64;
  int64_t hidden_size = 64;   ///< encoder GRU, per direction (annotations are 2·hidden_size)
  int64_t decoder_size = 64;  ///< decoder GRU state
  int64_t attn_dim = 64;      ///< additive attention's hidden size
  int32_t pad_id = 0, bos_id = 1, eos_id = 2;
};

/// A decoded sequence: tokens (without bos, up to and without eos), its total log-probability,
/// and the attention weights of each output step over the source [steps][source length].
struct Hypothesis {
  std::vector<int32_t> tokens;
  double log_prob = 0;
  std::vector<std::vector<float>> attention;
};

/// Parameters: src_embed.weight, encoder.{weight,bias}_{ih,hh}_l0[_reverse], init.weight/bias
/// (s_0 = tanh(init(h←_1))), tgt_embed.weight, attention.* (AdditiveAttention), decoder.*
/// (GRUCell over [embedding; context]), out.weight/bias (logits from [s_i; c_i; embedding]).
class AttentionSeq2Seq : public Module {
 public:
  AttentionSeq2Seq(const Seq2SeqConfig& config, Rng& rng);

  /// Teacher forcing. src int32 [B, S] (padded with anything past src_lengths), src_lengths
  /// int32 [B] in [1, S], tgt_in int32 [B, T] (bos then the target without its last token).
  /// Returns logits [B, T, tgt_vocab]; keeps what backward needs.
  Tensor forward(const TensorView& src, const TensorView& src_lengths, const TensorView& tgt_in);
  /// Adds the parameter gradients for d(loss)/d(logits) [B, T, tgt_vocab].
  void backward(const TensorView& dlogits);
  /// The attention weights of the last forward: [B, T, S].
  const Tensor& attention_weights() const { return weights_; }

  /// Greedy decoding of each source (up to max_len tokens).
  std::vector<Hypothesis> greedy(const TensorView& src, const TensorView& src_lengths, int64_t max_len);
  /// Beam search with `beam` hypotheses per source; finished hypotheses are ranked by
  /// log_prob / length^length_penalty (0 = raw log-probability; length counts eos). The
  /// search ends when no live hypothesis could still beat the best finished one, or at
  /// max_len; each result ended with eos (fewer than max_len tokens) or has max_len tokens.
  std::vector<Hypothesis> beam_search(const TensorView& src, const TensorView& src_lengths, int64_t beam,
                                      int64_t max_len, double length_penalty = 0.0);

  const Seq2SeqConfig& config() const { return cfg_; }

  Embedding src_embed;
  GRU encoder;
  Linear init;
  Embedding tgt_embed;
  AdditiveAttention attention;
  GRUCell decoder;
  Linear out;

 private:
  struct Encoded {
    AdditiveAttention::Memory memory;
    Tensor s0;  // [B, decoder_size]
  };
  Encoded encode(const TensorView& src, const TensorView& src_lengths);
  /// One decoder step for tokens y [B] from state s: returns the logits [B, V] and the new
  /// state; weights [B, S] when asked.
  Tensor step(const Encoded& enc, const std::vector<int32_t>& y, Tensor& s, Tensor* weights);

  Seq2SeqConfig cfg_;
  // Last teacher-forced forward.
  int64_t B_ = 0, S_ = 0, T_ = 0;
  Encoded enc_;
  Tensor tgt_emb_, weights_;
  std::vector<AdditiveAttention::Step> att_steps_;
  std::vector<GRUCell::Cache> cell_steps_;
};

}  // namespace attn::nn
