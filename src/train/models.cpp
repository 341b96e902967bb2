// The RNN and Transformer translation models.
#include "attn/train/models.hpp"

#include <cmath>
#include <cstring>

#include "attn/error.hpp"
#include "attn/nn/positional.hpp"

namespace attn::train {

namespace {

// ---- the RNN ------------------------------------------------------------------------

class RnnModel : public TranslationModel {
 public:
  explicit RnnModel(const ModelConfig& c) : TranslationModel(c), rng_(c.seed), net_(seq_config(c), rng_) {}
  nn::Module& module() override { return net_; }
  Tensor forward(const Batch& b) override { return net_.forward(b.src, b.src_lengths, b.tgt_in); }
  void backward(const TensorView& dlogits) override { net_.backward(dlogits); }
  std::vector<Translation> greedy(const TensorView& src, const TensorView& lengths, int64_t max_len) override {
    std::vector<Translation> out;
    for (nn::Hypothesis& h : net_.greedy(src, lengths, max_len)) {
      Translation t;
      t.tokens = std::move(h.tokens);
      t.maps.push_back(std::move(h.attention));
      t.map_names.push_back("attention");
      out.push_back(std::move(t));
    }
    return out;
  }

 private:
  static nn::Seq2SeqConfig seq_config(const ModelConfig& c) {
    nn::Seq2SeqConfig s;
    s.src_vocab = c.src_vocab;
    s.tgt_vocab = c.tgt_vocab;
    s.embed_dim = c.embed_dim;
    s.hidden_size = c.hidden;
    s.decoder_size = c.hidden;
    s.attn_dim = c.attn_dim;
    s.pad_id = kPad;
    s.bos_id = kBos;
    s.eos_id = kEos;
    return s;
  }
  nn::Rng rng_;
  nn::AttentionSeq2Seq net_;
};

// ---- the Transformer ----------------------------------------------------------------

// Embeddings scaled by √d plus sinusoidal positions, an encoder and a decoder stack
// (pre-norm, GELU, final norms: trains stably without warm-up tricks), and a linear head.
class TransformerNet : public nn::Module {
 public:
  TransformerNet(const ModelConfig& c, nn::Rng& rng)
      : src_embed(c.src_vocab, c.embed_dim, rng, kPad),
        tgt_embed(c.tgt_vocab, c.embed_dim, rng, kPad),
        positions(c.embed_dim, 512, /*batch_first=*/true),
        encoder(layer_config(c), c.layers, true, rng),
        decoder(layer_config(c), c.layers, true, rng),
        out(c.embed_dim, c.tgt_vocab, true, rng),
        scale_(std::sqrt(float(c.embed_dim))) {
    // Embeddings ~ N(0, 1/d): with the √d scale the inputs have unit variance.
    for (nn::Parameter* p : {&src_embed.weight, &tgt_embed.weight}) {
      for (float& x : p->value) x /= scale_;
      std::fill_n(p->value.begin() + kPad * c.embed_dim, c.embed_dim, 0.0f);
    }
    register_module("src_embed", src_embed);
    register_module("tgt_embed", tgt_embed);
    register_module("encoder", encoder);
    register_module("decoder", decoder);
    register_module("out", out);
  }

  static nn::TransformerLayerConfig layer_config(const ModelConfig& c) {
    nn::TransformerLayerConfig l;
    l.d_model = c.embed_dim;
    l.nhead = c.heads;
    l.dim_feedforward = c.hidden;
    l.dropout = c.dropout;
    l.activation = nn::ActivationKind::gelu;
    l.batch_first = true;
    l.norm_first = true;
    l.seed = c.seed;
    return l;
  }

  Tensor embed(nn::Embedding& e, const TensorView& ids) {
    Tensor x = e.forward(ids);
    for (int64_t i = 0; i < x.numel(); ++i) x.data_as<float>()[i] *= scale_;
    return positions.forward(x);
  }
  void embed_backward(nn::Embedding& e, Tensor& dx) {
    for (int64_t i = 0; i < dx.numel(); ++i) dx.data_as<float>()[i] *= scale_;
    e.backward(dx);
  }

  // key_padding_mask [B, S]: true past each source's length (PyTorch's "ignore").
  static Tensor padding_mask(const TensorView& lengths, int64_t S) {
    const int64_t B = lengths.size(0);
    Tensor m(DType::boolean, {B, S});
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < S; ++j) m.data_as<uint8_t>()[b * S + j] = j >= lengths.data_as<int32_t>()[b];
    return m;
  }

  Tensor encode(const TensorView& src, const TensorView& lengths) {
    kpm_ = padding_mask(lengths, src.size(1));
    return encoder.forward(embed(src_embed, src), {}, kpm_);
  }
  Tensor decode(const TensorView& tgt_in, const Tensor& memory) {
    Tensor h = decoder.forward(embed(tgt_embed, tgt_in), memory, {}, {}, {}, kpm_, /*tgt_is_causal=*/true);
    return out.forward(h);
  }

  nn::Embedding src_embed, tgt_embed;
  nn::SinusoidalPositionalEncoding positions;
  nn::TransformerEncoder encoder;
  nn::TransformerDecoder decoder;
  nn::Linear out;

 private:
  float scale_;
  Tensor kpm_;
};

class TransformerModel : public TranslationModel {
 public:
  explicit TransformerModel(const ModelConfig& c) : TranslationModel(c), rng_(c.seed), net_(c, rng_) {
    if (c.embed_dim % c.heads != 0)
      throw Error("model config: embed_dim (" + std::to_string(c.embed_dim) + ") must be a multiple of heads (" +
                  std::to_string(c.heads) + ")");
  }
  nn::Module& module() override { return net_; }
  Tensor forward(const Batch& b) override {
    Tensor memory = net_.encode(b.src, b.src_lengths);
    return net_.decode(b.tgt_in, memory);
  }
  void backward(const TensorView& dlogits) override {
    Tensor dh = net_.out.backward(dlogits);
    nn::DecoderGrads g = net_.decoder.backward(dh);
    net_.embed_backward(net_.tgt_embed, g.dtgt);
    Tensor dsrc = net_.encoder.backward(g.dmemory);
    net_.embed_backward(net_.src_embed, dsrc);
  }
  std::vector<Translation> greedy(const TensorView& src, const TensorView& lengths, int64_t max_len) override {
    const int64_t B = src.size(0), S = src.size(1), V = cfg_.tgt_vocab, L = cfg_.layers, H = cfg_.heads;
    Tensor memory = net_.encode(src, lengths);
    std::vector<std::vector<int32_t>> tokens(B, std::vector<int32_t>{kBos});
    std::vector<bool> done(B, false);
    for (auto& layer : net_.decoder.layers) layer->set_keep_cross_weights(true, /*average=*/false);
    int64_t T = 0;
    for (; T < max_len; ++T) {
      Tensor in(DType::i32, {B, T + 1});
      for (int64_t b = 0; b < B; ++b) std::copy(tokens[b].begin(), tokens[b].end(), in.data_as<int32_t>() + b * (T + 1));
      Tensor logits = net_.decode(in, memory);  // [B, T+1, V]: the last row predicts the next token
      bool all = true;
      for (int64_t b = 0; b < B; ++b) {
        const float* row = logits.data_as<float>() + (b * (T + 1) + T) * V;
        const int32_t next = done[b] ? kPad : static_cast<int32_t>(std::max_element(row, row + V) - row);
        tokens[b].push_back(next);
        if (!done[b] && next == kEos) done[b] = true;
        all = all && done[b];
      }
      if (all) {
        ++T;
        break;
      }
    }
    // The last decode saw every step: its cross-attention weights are the maps.
    std::vector<Translation> out(B);
    for (int64_t b = 0; b < B; ++b) {
      const int32_t len = lengths.data_as<int32_t>()[b];
      int64_t steps = 0;
      while (steps < T && tokens[b][steps + 1] != kEos && tokens[b][steps + 1] != kPad) {
        out[b].tokens.push_back(tokens[b][steps + 1]);
        ++steps;
      }
      if (steps < T) ++steps;  // the step that produced eos has a map row too
      for (int64_t l = 0; l < L; ++l) {
        const Tensor& w = net_.decoder.layers[l]->cross_attention_weights();  // [B, H, T', S]
        const int64_t Tw = w.shape()[2];
        for (int64_t h = 0; h < H; ++h) {
          std::vector<std::vector<float>> map;
          for (int64_t t = 0; t < std::min(steps, Tw); ++t) {
            const float* r = w.data_as<float>() + ((b * H + h) * Tw + t) * S;
            map.emplace_back(r, r + len);
          }
          out[b].maps.push_back(std::move(map));
          out[b].map_names.push_back("layer " + std::to_string(l + 1) + " head " + std::to_string(h + 1));
        }
      }
    }
    for (auto& layer : net_.decoder.layers) layer->set_keep_cross_weights(false);
    return out;
  }

 private:
  nn::Rng rng_;
  TransformerNet net_;
};

}  // namespace

std::unique_ptr<TranslationModel> make_model(const ModelConfig& config) {
  config.validate();
  if (config.src_vocab < 5 || config.tgt_vocab < 5)
    throw Error("model config: vocabularies must hold the 4 special tokens and at least one more");
  if (config.kind == "rnn") return std::make_unique<RnnModel>(config);
  if (config.kind == "transformer") return std::make_unique<TransformerModel>(config);
  throw Error("model config: unknown kind \"" + config.kind + "\" (expected rnn or transformer)");
}

}  // namespace attn::train
