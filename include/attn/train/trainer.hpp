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
  double loss = 0;             ///< running mean of the recent training loss (0 until a step has run)
  double accuracy = -1;        ///< latest validation exact-match accuracy (−1 before the first)
  double steps_per_second = 0;
  double elapsed_seconds = 0, eta_seconds = 0;
  double lr = 0;
  bool final = false;
};

/// Limits that turn absurd settings into a clear error instead of an allocation failure.
inline constexpr int64_t kMaxSteps = 1'000'000'000;
inline constexpr int64_t kMaxBatchSize = 65536;

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
/// independent of the thread count. A session already at options.steps returns at once
/// (one final report, no step taken).
Progress train(Session& s, const TaskData& data, const TrainOptions& options);

/// Greedy exact-match accuracy on `examples` (up to `limit` of them; all when limit ≤ 0).
double evaluate(Session& s, const std::vector<Example>& examples, int64_t limit = 0, int64_t batch = 250);

/// Translates texts (greedy); characters outside the source vocabulary become <unk>, and
/// their count is added to *unknown.
std::vector<Translation> translate(Session& s, const std::vector<std::string>& texts, int64_t* unknown = nullptr);

/// What a checkpoint is loaded for: `resume` needs every part, the optimizer's state
/// included; `inference` (translate, plot) needs the model only.
enum class CheckpointUse { resume, inference };

/// Saves a checkpoint directory `dir` (created if needed): model.safetensors (PyTorch
/// parameter names), optimizer.safetensors and config.json (task, step, training setup,
/// model config, both vocabularies, and every other file's size and CRC-32).
/// All or nothing: the parts are written to temporary files and renamed into place only
/// when every one is on the disk, so a failed save (a full disk, an I/O error) leaves
/// the previous checkpoint whole, removes its temporary files and throws attn::Error
/// saying so. Other files in `dir` are left alone.
void save_checkpoint(const Session& s, const std::string& dir);

/// Reads a checkpoint and checks that its parts belong together (sizes, checksums,
/// steps, shapes); throws attn::Error naming the file and what is wrong with it. With
/// CheckpointUse::resume a missing optimizer.safetensors is an error; with `inference`
/// it is not read and the optimizer starts fresh.
Session load_checkpoint(const std::string& dir, const TrainOptions& options = {},
                        CheckpointUse use = CheckpointUse::resume);

}  // namespace attn::train
