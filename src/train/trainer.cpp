// Training loop, evaluation, translation (checkpoints: checkpoint.cpp).
#include "attn/train/trainer.hpp"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>

#include "attn/error.hpp"

namespace attn::train {

Session new_session(const TaskData& data, ModelConfig config, const TrainOptions& options) {
  Session s;
  s.task = data.task;
  std::vector<std::string> sources, targets;
  for (const Example& e : data.train) {
    sources.push_back(e.source);
    targets.push_back(e.target);
  }
  s.src_tok = Tokenizer::build(Tokenizer::Kind::character, sources);
  s.tgt_tok = Tokenizer::build(Tokenizer::Kind::character, targets);
  config.src_vocab = s.src_tok.size();
  config.tgt_vocab = s.tgt_tok.size();
  s.model = make_model(config);
  s.optimizer = std::make_unique<Adam>(parameters_of(s.model->module()), options.lr, 0.9, 0.999, 1e-8,
                                       options.weight_decay, /*decoupled=*/true);
  return s;
}

namespace {
uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9E3779B97F4A7C15ull + b + 0x632BE59BD9B4E019ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace

Progress train(Session& s, const TaskData& data, const TrainOptions& o) {
  if (data.train.empty()) throw Error("train: the training split is empty");
  if (o.batch_size < 1 || o.steps < 1) throw Error("train: batch_size and steps must be ≥ 1");
  if (o.batch_size > kMaxBatchSize || o.steps > kMaxSteps)
    throw Error("train: batch_size (at most " + std::to_string(kMaxBatchSize) + ") or steps (at most " +
                std::to_string(kMaxSteps) + ") is too large");
  if (!std::isfinite(o.lr) || o.lr <= 0) throw Error("train: lr must be a finite number > 0");
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  const int64_t first = s.step;
  std::vector<nn::Parameter*> params = parameters_of(s.model->module());
  s.model->module().train();
  Progress p;
  p.total_steps = o.steps;
  double loss_avg = 0;
  int64_t loss_n = 0;
  auto report = [&](bool final) {
    p.step = s.step;
    p.elapsed_seconds = std::chrono::duration<double>(clock::now() - t0).count();
    p.steps_per_second = p.elapsed_seconds > 0 ? double(s.step - first) / p.elapsed_seconds : 0;
    p.eta_seconds = p.steps_per_second > 0 ? double(o.steps - s.step) / p.steps_per_second : 0;
    p.loss = loss_avg;
    p.final = final;
    if (o.on_progress) o.on_progress(p);
  };
  std::vector<const Example*> batch(static_cast<size_t>(o.batch_size));
  while (s.step < o.steps) {
    // The batch of step n is a function of (seed, n): resuming reproduces the same run.
    const int64_t n = s.step + 1;
    for (int64_t b = 0; b < o.batch_size; ++b)
      batch[b] = &data.train[mix(mix(o.seed, uint64_t(n)), uint64_t(b)) % data.train.size()];
    Batch bt = make_batch(batch, s.src_tok, s.tgt_tok);
    s.model->module().zero_grad();
    Tensor logits = s.model->forward(bt);
    CrossEntropyResult ce = cross_entropy(logits, bt.tgt_out, kPad, o.label_smoothing);
    s.model->backward(ce.dlogits);
    if (o.clip > 0) clip_grad_norm(params, o.clip);
    p.lr = warmup_cosine_lr(n, o.lr, o.warmup, o.steps, o.lr * o.min_lr_ratio);
    s.optimizer->set_lr(p.lr);
    s.optimizer->step();
    s.step = n;
    loss_avg = loss_n == 0 ? ce.loss : 0.95 * loss_avg + 0.05 * ce.loss;
    ++loss_n;
    const bool eval_now = o.eval_every > 0 && n % o.eval_every == 0 && !data.validation.empty();
    if (eval_now) {
      p.accuracy = evaluate(s, data.validation, o.eval_examples);
      s.model->module().train();
    }
    if (n % 10 == 0 || eval_now) report(false);
    const double elapsed = std::chrono::duration<double>(clock::now() - t0).count();
    if ((o.max_seconds > 0 && elapsed >= o.max_seconds) || (eval_now && o.stop_accuracy > 0 && p.accuracy >= o.stop_accuracy))
      break;
  }
  s.model->module().eval();
  report(true);
  return p;
}

std::vector<Translation> translate(Session& s, const std::vector<std::string>& texts, int64_t* unknown) {
  if (texts.empty()) return {};
  std::vector<Example> ex;
  for (const std::string& t : texts) ex.push_back({t, ""});
  std::vector<const Example*> ptrs;
  for (const Example& e : ex) ptrs.push_back(&e);
  if (unknown)
    for (const std::string& t : texts) s.src_tok.encode(t, unknown);
  Batch b = make_batch(ptrs, s.src_tok, s.tgt_tok);
  s.model->module().eval();
  int64_t max_len = 1;
  for (const std::string& t : texts) max_len = std::max<int64_t>(max_len, 2 * static_cast<int64_t>(t.size()) + 10);
  return s.model->greedy(b.src, b.src_lengths, max_len);
}

double evaluate(Session& s, const std::vector<Example>& examples, int64_t limit, int64_t batch) {
  const int64_t n = limit > 0 ? std::min<int64_t>(limit, examples.size()) : static_cast<int64_t>(examples.size());
  if (n == 0) return 0;
  int64_t correct = 0;
  for (int64_t start = 0; start < n; start += batch) {
    std::vector<std::string> texts;
    for (int64_t i = start; i < std::min(n, start + batch); ++i) texts.push_back(examples[i].source);
    std::vector<Translation> out = translate(s, texts);
    for (size_t i = 0; i < out.size(); ++i)
      correct += s.tgt_tok.decode(out[i].tokens) == examples[start + i].target;
  }
  return double(correct) / double(n);
}

}  // namespace attn::train
