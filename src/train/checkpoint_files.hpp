// Reading a checkpoint directory and checking that its parts belong together, without
// building the model (so it can be fuzzed on its own: tests/fuzz/checkpoint_fuzz.cc).
//
// Layout (format "attn-checkpoint-2"):
//   model.safetensors      the parameters under their PyTorch names
//   optimizer.safetensors  the optimizer's moments, metadata "steps" = the step
//   config.json            task, step, training setup, model config, vocabularies and a
//                          manifest {"files": {name: {"bytes": n, "crc32": "8 hex"}}}
// config.json is written last and names the exact bytes of the other two, so a save that
// stopped part-way is detected on load, whatever the order the files reached the disk.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "attn/io/safetensors.hpp"
#include "attn/train/data.hpp"
#include "attn/train/models.hpp"
#include "attn/train/trainer.hpp"

namespace attn::train {

inline constexpr const char* kCheckpointFormat = "attn-checkpoint-2";
inline constexpr size_t kMaxConfigBytes = size_t{64} << 20;

/// The checked contents of a checkpoint directory.
struct CheckpointFiles {
  std::string task;
  int64_t step = 0;
  nlohmann::json training;  ///< validated: every field present has its type and range
  ModelConfig model;        ///< validated, vocabulary sizes equal to the tokenizers'
  Tokenizer src_tok, tgt_tok;
  io::SafeTensors weights;
  std::optional<io::SafeTensors> optimizer;  ///< read when asked for; its step equals `step`
};

/// Reads and checks `dir`: config.json's types and ranges, every part's size and CRC-32
/// against the manifest, the optimizer's step against config.json's. With
/// `with_optimizer` false, optimizer.safetensors is neither needed nor read. Throws
/// attn::Error naming the file and what is wrong (the parts disagreeing included).
CheckpointFiles read_checkpoint_files(const std::string& dir, bool with_optimizer);

/// Throws attn::Error unless `training` is an object whose fields, where present, are
/// valid: steps [1, kMaxSteps], lr finite in (0, 1000], batch_size [1, kMaxBatchSize],
/// data {task: a built-in task, seed, train_size, validation_size, test_size}.
void validate_training_json(const nlohmann::json& training, const std::string& context);

/// The manifest entry of `bytes`: {"bytes": n, "crc32": "8 hex digits"}.
nlohmann::json manifest_entry(const std::vector<uint8_t>& bytes);

}  // namespace attn::train
