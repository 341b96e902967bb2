// Bahdanau encoder–decoder: teacher-forced forward and backward through time,
// greedy and beam-search decoding.
#include "attn/nn/seq2seq.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "attn/error.hpp"
#include "nn/ops.hpp"

namespace attn::nn {

namespace {

RecurrentConfig encoder_config(const Seq2SeqConfig& c) {
  RecurrentConfig r;
  r.input_size = c.embed_dim;
  r.hidden_size = c.hidden_size;
  r.bidirectional = true;
  r.batch_first = true;
  return r;
}

float* f(Tensor& t) { return t.data_as<float>(); }

// Copies `n` floats per row from rows of `src` (row stride ss, offset so) to `dst` (ds, od).
void copy_rows(const float* src, int64_t ss, int64_t so, float* dst, int64_t ds, int64_t od, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ds + od, src + r * ss + so, sizeof(float) * n);
}
void add_rows(const float* src, int64_t ss, int64_t so, float* dst, int64_t ds, int64_t od, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < n; ++k) dst[r * ds + od + k] += src[r * ss + so + k];
}

std::vector<int32_t> ids_of(const TensorView& t, const char* what) {
  if (t.empty() || t.dtype() != DType::i32 || !t.is_contiguous())
    throw Error(std::string("AttentionSeq2Seq: ") + what + " must be a contiguous int32 tensor, got " +
                (t.empty() ? std::string("none") : t.describe()));
  return std::vector<int32_t>(t.data_as<int32_t>(), t.data_as<int32_t>() + t.numel());
}

}  // namespace

AttentionSeq2Seq::AttentionSeq2Seq(const Seq2SeqConfig& c, Rng& rng)
    : src_embed(c.src_vocab, c.embed_dim, rng, c.pad_id),
      encoder(encoder_config(c), rng),
      init(c.hidden_size, c.decoder_size, true, rng),
      tgt_embed(c.tgt_vocab, c.embed_dim, rng, c.pad_id),
      attention(c.decoder_size, 2 * c.hidden_size, c.attn_dim, true, rng),
      decoder(c.embed_dim + 2 * c.hidden_size, c.decoder_size, true, rng),
      out(c.decoder_size + 2 * c.hidden_size + c.embed_dim, c.tgt_vocab, true, rng),
      cfg_(c) {
  register_module("src_embed", src_embed);
  register_module("encoder", encoder);
  register_module("init", init);
  register_module("tgt_embed", tgt_embed);
  register_module("attention", attention);
  register_module("decoder", decoder);
  register_module("out", out);
}

AttentionSeq2Seq::Encoded AttentionSeq2Seq::encode(const TensorView& src, const TensorView& src_lengths) {
  if (src.rank() != 2) throw Error("AttentionSeq2Seq: src must be int32 [B, S], got " + src.describe());
  const int64_t B = src.size(0);
  if (src_lengths.empty() || src_lengths.rank() != 1 || src_lengths.size(0) != B)
    throw Error("AttentionSeq2Seq: src_lengths must be int32 [" + std::to_string(B) + "]");
  Tensor emb = src_embed.forward(src);
  RecurrentOutput r = encoder.forward(emb, {}, {}, src_lengths);  // checks lengths ∈ [1, S]
  Encoded e;
  e.memory = attention.encode(r.output, src_lengths);
  // s_0 = tanh(W_s·h←_1): the backward direction's final state (h_n[1]).
  e.s0 = init.forward(TensorView(f(r.h_n) + B * cfg_.hidden_size, DType::f32, {B, cfg_.hidden_size}));
  for (int64_t i = 0; i < e.s0.numel(); ++i) f(e.s0)[i] = std::tanh(f(e.s0)[i]);
  return e;
}

Tensor AttentionSeq2Seq::forward(const TensorView& src, const TensorView& src_lengths, const TensorView& tgt_in) {
  if (tgt_in.rank() != 2 || tgt_in.dtype() != DType::i32 || tgt_in.size(0) != src.size(0))
    throw Error("AttentionSeq2Seq.forward: tgt_in must be int32 [B, T] with src's B, got " + tgt_in.describe());
  enc_ = encode(src, src_lengths);
  B_ = src.size(0);
  S_ = src.size(1);
  T_ = tgt_in.size(1);
  const int64_t E = cfg_.embed_dim, H2 = 2 * cfg_.hidden_size, Hd = cfg_.decoder_size, F = Hd + H2 + E;
  tgt_emb_ = tgt_embed.forward(tgt_in);
  att_steps_.clear();
  att_steps_.resize(static_cast<size_t>(T_));
  cell_steps_.clear();
  cell_steps_.resize(static_cast<size_t>(T_));
  weights_ = Tensor(DType::f32, {B_, T_, S_});
  Tensor feat(DType::f32, {B_, T_, F});
  Tensor s = clone(enc_.s0), x(DType::f32, {B_, E + H2});
  for (int64_t i = 0; i < T_; ++i) {
    // c_i from s_{i−1}; s_i = GRU([y_{i−1} embedding; c_i], s_{i−1}); features [s_i; c_i; embedding].
    Tensor c = attention.attend(TensorView(f(s), DType::f32, {B_, 1, Hd}), enc_.memory, att_steps_[i]);
    copy_rows(f(att_steps_[i].weights), S_, 0, f(weights_) + i * S_, T_ * S_, 0, B_, S_);
    copy_rows(f(tgt_emb_) + i * E, T_ * E, 0, f(x), E + H2, 0, B_, E);
    copy_rows(f(c), H2, 0, f(x), E + H2, E, B_, H2);
    s = decoder.step(x, s, cell_steps_[i]);
    copy_rows(f(s), Hd, 0, f(feat) + i * F, T_ * F, 0, B_, Hd);
    copy_rows(f(c), H2, 0, f(feat) + i * F, T_ * F, Hd, B_, H2);
    copy_rows(f(tgt_emb_) + i * E, T_ * E, 0, f(feat) + i * F, T_ * F, Hd + H2, B_, E);
  }
  return out.forward(feat);
}

void AttentionSeq2Seq::backward(const TensorView& dlogits) {
  if (att_steps_.empty()) throw Error("AttentionSeq2Seq.backward: backward called before forward");
  const int64_t E = cfg_.embed_dim, H = cfg_.hidden_size, H2 = 2 * H, Hd = cfg_.decoder_size, F = Hd + H2 + E;
  Tensor dfeat = out.backward(dlogits);  // checks the shape
  Tensor demb = zeros({B_, T_, E});
  Tensor ds = zeros({B_, Hd});
  for (int64_t i = T_; i-- > 0;) {
    // features [s_i; c_i; e_i] → ds_i, dc_i, de_i
    add_rows(f(dfeat) + i * F, T_ * F, 0, f(ds), Hd, 0, B_, Hd);
    Tensor dc(DType::f32, {B_, 1, H2});
    copy_rows(f(dfeat) + i * F, T_ * F, Hd, f(dc), H2, 0, B_, H2);
    add_rows(f(dfeat) + i * F, T_ * F, Hd + H2, f(demb) + i * E, T_ * E, 0, B_, E);
    // s_i = GRU(x_i = [e_i; c_i], s_{i−1})
    Tensor dx = zeros({B_, E + H2}), ds_prev = zeros({B_, Hd});
    decoder.step_backward(cell_steps_[i], ds, dx, ds_prev);
    add_rows(f(dx), E + H2, 0, f(demb) + i * E, T_ * E, 0, B_, E);
    add_rows(f(dx), E + H2, E, f(dc), H2, 0, B_, H2);
    // c_i = attention(s_{i−1}, annotations)
    Tensor dq = attention.attend_backward(att_steps_[i], enc_.memory, dc);
    add_rows(f(dq), Hd, 0, f(ds_prev), Hd, 0, B_, Hd);
    ds = std::move(ds_prev);
  }
  tgt_embed.backward(demb);
  // s_0 = tanh(init(h←_1))
  for (int64_t k = 0; k < ds.numel(); ++k) f(ds)[k] *= 1.0f - f(enc_.s0)[k] * f(enc_.s0)[k];
  Tensor dh_back = init.backward(ds);
  Tensor dh_n = zeros({2, B_, H});
  std::memcpy(f(dh_n) + B_ * H, f(dh_back), sizeof(float) * B_ * H);
  Tensor dannotations = attention.encode_backward(enc_.memory);
  RecurrentGrads g = encoder.backward(dannotations, dh_n);
  src_embed.backward(g.dinput);
}

Tensor AttentionSeq2Seq::step(const Encoded& enc, const std::vector<int32_t>& y, Tensor& s, Tensor* weights) {
  const int64_t B = static_cast<int64_t>(y.size());
  const int64_t E = cfg_.embed_dim, H2 = 2 * cfg_.hidden_size, Hd = cfg_.decoder_size, F = Hd + H2 + E;
  Tensor emb = tgt_embed.forward(TensorView(y.data(), DType::i32, {B}));
  AdditiveAttention::Step att;
  Tensor c = attention.attend(TensorView(f(s), DType::f32, {B, 1, Hd}), enc.memory, att);
  Tensor x(DType::f32, {B, E + H2});
  copy_rows(f(emb), E, 0, f(x), E + H2, 0, B, E);
  copy_rows(f(c), H2, 0, f(x), E + H2, E, B, H2);
  GRUCell::Cache cache;
  s = decoder.step(x, s, cache);
  Tensor feat(DType::f32, {B, F});
  copy_rows(f(s), Hd, 0, f(feat), F, 0, B, Hd);
  copy_rows(f(c), H2, 0, f(feat), F, Hd, B, H2);
  copy_rows(f(emb), E, 0, f(feat), F, Hd + H2, B, E);
  Tensor logits(DType::f32, {B, cfg_.tgt_vocab});
  ops::linear_forward(f(feat), B, F, out.weight.value.data(), out.bias->value.data(), cfg_.tgt_vocab, f(logits));
  if (weights) *weights = std::move(att.weights);
  return logits;
}

namespace {
// log-softmax of one row, in double.
std::vector<double> log_softmax(const float* x, int64_t n) {
  double mx = -std::numeric_limits<double>::infinity(), sum = 0;
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, double(x[i]));
  for (int64_t i = 0; i < n; ++i) sum += std::exp(x[i] - mx);
  std::vector<double> out(static_cast<size_t>(n));
  const double lse = mx + std::log(sum);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] - lse;
  return out;
}
}  // namespace

std::vector<Hypothesis> AttentionSeq2Seq::greedy(const TensorView& src, const TensorView& src_lengths,
                                                 int64_t max_len) {
  const std::vector<int32_t> lengths = ids_of(src_lengths, "src_lengths");
  Encoded enc = encode(src, src_lengths);
  const int64_t B = src.size(0), S = src.size(1), V = cfg_.tgt_vocab;
  std::vector<Hypothesis> hyps(static_cast<size_t>(B));
  std::vector<int32_t> y(static_cast<size_t>(B), cfg_.bos_id);
  std::vector<bool> done(static_cast<size_t>(B), false);
  Tensor s = clone(enc.s0), w;
  for (int64_t t = 0; t < max_len; ++t) {
    Tensor logits = step(enc, y, s, &w);
    bool all_done = true;
    for (int64_t b = 0; b < B; ++b) {
      if (done[b]) continue;
      const std::vector<double> lp = log_softmax(f(logits) + b * V, V);
      const int32_t best = static_cast<int32_t>(std::max_element(lp.begin(), lp.end()) - lp.begin());
      hyps[b].log_prob += lp[best];
      hyps[b].attention.emplace_back(f(w) + b * S, f(w) + b * S + lengths[b]);
      if (best == cfg_.eos_id) {
        done[b] = true;
      } else {
        hyps[b].tokens.push_back(best);
        all_done = false;
      }
      y[b] = best;
    }
    if (all_done) break;
  }
  return hyps;
}

std::vector<Hypothesis> AttentionSeq2Seq::beam_search(const TensorView& src, const TensorView& src_lengths,
                                                      int64_t beam, int64_t max_len, double length_penalty) {
  if (beam < 1) throw Error("AttentionSeq2Seq.beam_search: beam must be ≥ 1, got " + std::to_string(beam));
  const std::vector<int32_t> all_src = ids_of(src, "src");
  const std::vector<int32_t> lengths = ids_of(src_lengths, "src_lengths");
  const int64_t B = src.size(0), S = src.size(1), V = cfg_.tgt_vocab;
  std::vector<Hypothesis> results;
  for (int64_t b = 0; b < B; ++b) {
    // The source repeated once per beam, so each beam is one row of the batch.
    std::vector<int32_t> rep_src, rep_len(static_cast<size_t>(beam), lengths[b]);
    for (int64_t k = 0; k < beam; ++k) rep_src.insert(rep_src.end(), all_src.begin() + b * S, all_src.begin() + (b + 1) * S);
    Encoded enc = encode(TensorView(rep_src.data(), DType::i32, {beam, S}), TensorView(rep_len.data(), DType::i32, {beam}));
    struct Beam {
      Hypothesis hyp;
      int32_t last;
    };
    std::vector<Beam> live{{Hypothesis{}, cfg_.bos_id}};
    std::vector<Hypothesis> finished;
    Tensor s = clone(enc.s0), w;
    auto normalised = [&](const Hypothesis& h) {
      return h.log_prob / std::pow(double(h.tokens.size() + 1), length_penalty);
    };
    // The best normalised score a live hypothesis could still finish with: its
    // log-probability only falls as it grows, so over the longest length it may reach
    // (length_penalty ≥ 0) or the shortest (< 0).
    auto best_reachable = [&](const Hypothesis& h) {
      const double len = length_penalty >= 0 ? double(max_len + 1) : double(h.tokens.size() + 1);
      return h.log_prob / std::pow(len, length_penalty);
    };
    for (int64_t t = 0; t < max_len && !live.empty(); ++t) {
      std::vector<int32_t> y(static_cast<size_t>(beam), cfg_.bos_id);
      for (size_t k = 0; k < live.size(); ++k) y[k] = live[k].last;
      Tensor logits = step(enc, y, s, &w);
      struct Candidate {
        double score;
        size_t from;
        int32_t token;
      };
      std::vector<Candidate> cands;
      for (size_t k = 0; k < live.size(); ++k) {
        const std::vector<double> lp = log_softmax(f(logits) + k * V, V);
        for (int32_t v = 0; v < V; ++v) cands.push_back({live[k].hyp.log_prob + lp[v], k, v});
      }
      const size_t keep = std::min<size_t>(cands.size(), static_cast<size_t>(2 * beam));
      std::partial_sort(cands.begin(), cands.begin() + keep, cands.end(),
                        [](const Candidate& a, const Candidate& c) { return a.score > c.score; });
      std::vector<Beam> next;
      Tensor s_next = clone(s);
      for (size_t n = 0; n < keep && static_cast<int64_t>(next.size()) < beam; ++n) {
        const Candidate& c = cands[n];
        Beam nb{live[c.from].hyp, c.token};
        nb.hyp.log_prob = c.score;
        nb.hyp.attention.emplace_back(f(w) + c.from * S, f(w) + c.from * S + lengths[b]);
        if (c.token == cfg_.eos_id) {
          finished.push_back(std::move(nb.hyp));
          continue;
        }
        nb.hyp.tokens.push_back(c.token);
        std::memcpy(f(s_next) + next.size() * cfg_.decoder_size, f(s) + c.from * cfg_.decoder_size,
                    sizeof(float) * cfg_.decoder_size);
        next.push_back(std::move(nb));
      }
      s = std::move(s_next);
      live = std::move(next);
      // Stop once the best finished hypothesis is at least what any live one could still
      // reach. (Stopping after `beam` finished ones, as some implementations do, could
      // leave a better hypothesis unfinished.)
      if (!finished.empty()) {
        double best = -std::numeric_limits<double>::infinity();
        for (const Hypothesis& h : finished) best = std::max(best, normalised(h));
        if (std::all_of(live.begin(), live.end(), [&](const Beam& lb) { return best_reachable(lb.hyp) <= best; }))
          live.clear();
      }
    }
    // Live hypotheses left here reached max_len without eos: they compete as they are.
    // (None is left unfinished short of max_len: a partial one would win on a
    // log-probability its remaining tokens have not yet lowered.)
    for (Beam& lb : live) finished.push_back(std::move(lb.hyp));
    auto best = std::max_element(finished.begin(), finished.end(), [&](const Hypothesis& a, const Hypothesis& c) {
      return normalised(a) < normalised(c);
    });
    results.push_back(std::move(*best));
  }
  return results;
}

}  // namespace attn::nn
