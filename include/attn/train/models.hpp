// The two translation models the tasks train: the attention-augmented RNN
// encoder–decoder (Bahdanau et al. 2014) and a small Transformer encoder–decoder,
// behind one interface, with their configuration as JSON.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/nn/seq2seq.hpp"
#include "attn/nn/transformer.hpp"
#include "attn/train/data.hpp"

namespace attn::train {

struct ModelConfig {
  std::string kind = "rnn";  ///< "rnn" or "transformer"
  int64_t src_vocab = 0, tgt_vocab = 0;
  int64_t embed_dim = 32;    ///< rnn: embeddings; transformer: d_model
  int64_t hidden = 64;       ///< rnn: encoder GRU per direction and decoder state; transformer: FFN size
  int64_t attn_dim = 64;     ///< rnn: additive attention size
  int64_t layers = 2;        ///< transformer: encoder and decoder layers
  int64_t heads = 4;         ///< transformer
  float dropout = 0.0f;      ///< transformer
  uint64_t seed = 1;

  nlohmann::json to_json() const;
  /// Throws attn::Error naming the bad field: a wrong JSON type, a size outside
  /// [1, its limit], a dropout outside [0, 1), or a model too large to build.
  static ModelConfig from_json(const nlohmann::json& j);
  /// Throws attn::Error when a size is below 1 or above its limit (vocabularies 2^24,
  /// widths 65536, 256 layers, 1024 heads) or the model would hold more than
  /// kMaxParameters weights: a clear "too large" instead of an allocation failure.
  void validate() const;
  /// An upper bound on the number of weights of the model this config builds.
  double parameter_bound() const;
  static constexpr double kMaxParameters = 1u << 30;
};

/// A decoded sequence with its attention maps: one [steps, source length] map for the
/// RNN; one per (layer, head) of the decoder's cross-attention for the Transformer.
struct Translation {
  std::vector<int32_t> tokens;
  std::vector<std::vector<std::vector<float>>> maps;  ///< [map][step][source position]
  std::vector<std::string> map_names;                ///< "attention", "layer 1 head 2", …
};

class TranslationModel {
 public:
  virtual ~TranslationModel() = default;
  virtual nn::Module& module() = 0;
  /// Teacher-forced logits [B, T, tgt_vocab] for a batch; keeps what backward needs.
  virtual Tensor forward(const Batch& batch) = 0;
  virtual void backward(const TensorView& dlogits) = 0;
  /// Greedy decoding of src [B, S] (lengths [B]) for up to max_len tokens.
  virtual std::vector<Translation> greedy(const TensorView& src, const TensorView& lengths, int64_t max_len) = 0;
  const ModelConfig& config() const { return cfg_; }

 protected:
  explicit TranslationModel(const ModelConfig& c) : cfg_(c) {}
  ModelConfig cfg_;
};

/// Builds the model a config names (weights initialised from config.seed).
std::unique_ptr<TranslationModel> make_model(const ModelConfig& config);

}  // namespace attn::train
