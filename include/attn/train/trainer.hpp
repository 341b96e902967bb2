// The training loop, evaluation and checkpoints for the translation tasks.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "attn/train/data.hpp"
#include "attn/train/models.hpp"
#include "attn/train/optim.hpp"

namespace attn::train {

struct Progress {
  int64_t step = 0, total_steps = 0;
  double loss = 0;             ///< running mean of the recent training loss
  double accuracy = -1;        ///< latest validation exact-match accuracy (−1 before the first)
  double steps_per_second = 0;
  double elapsed_seconds = 0, eta_seconds = 0;
  double lr = 0;
  bool final = false;
};

struct TrainOptions {
  int64_t steps = 3000;          ///< total optimizer steps (the schedule's length)
  double max_seconds = 0;        ///< stop early after this long (0 = no limit)
  double stop_accuracy = 0;      ///< stop early once validation accuracy reaches this (0 = never)
  int64_t batch_size = 64;
  double lr = 3e-3;
  int64_t warmup = 100;
  double min_lr_ratio = 0.05;    ///< cosine decays to lr·min_lr_ratio
  double clip = 1.0;
  float label_smoothing = 0.0f;
  double weight_decay = 0.0;     ///< AdamW's decoupled decay
  int64_t eval_every = 250;
  int64_t eval_examples = 300;   ///< validation examples per evaluation
  uint64_t seed = 1;             ///< batch order
  std::function<void(const Progress&)> on_progress;  ///< called every few steps and at the end
};

/// Everything a run needs and a checkpoint holds.
struct Session {
  std::string task;
  Tokenizer src_tok, tgt_tok;
  std::unique_ptr<TranslationModel> model;
  std::unique_ptr<Adam> optimizer;
  int64_t step = 0;
  nlohmann::json training = nlohmann::json::object();  ///< how the run was set up (saved, for resuming)
};

/// A new session for `task` data: tokenizers from the training split, a model of `config`
/// (its vocabulary sizes filled in) and AdamW.
Session new_session(const TaskData& data, ModelConfig config, const TrainOptions& options);

/// Trains from session.step to options.steps (or until a stop condition). Deterministic
/// for a seed: batches are drawn from the seed and the step, and every kernel is
/// independent of the thread count.
Progress train(Session& s, const TaskData& data, const TrainOptions& options);

/// Greedy exact-match accuracy on `examples` (up to `limit` of them; all when limit ≤ 0).
double evaluate(Session& s, const std::vector<Example>& examples, int64_t limit = 0, int64_t batch = 250);

/// Translates texts (greedy); characters outside the source vocabulary become <unk>, and
/// their count is added to *unknown.
std::vector<Translation> translate(Session& s, const std::vector<std::string>& texts, int64_t* unknown = nullptr);

/// A checkpoint directory: model.safetensors (PyTorch parameter names), optimizer.safetensors
/// and config.json (task, step, model config, both vocabularies). Written atomically per file.
void save_checkpoint(const Session& s, const std::string& dir);
/// Reads a checkpoint; throws attn::Error naming the file and what is wrong with it.
Session load_checkpoint(const std::string& dir, const TrainOptions& options = {});

}  // namespace attn::train
