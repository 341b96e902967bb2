// Reading and checking checkpoint directories (see checkpoint_files.hpp).
#include "train/checkpoint_files.hpp"

#include <cstdio>
#include <filesystem>

#include "attn/error.hpp"
#include "io/files.hpp"
#include "train/json_fields.hpp"

namespace attn::train {

namespace {

std::string hex32(uint32_t v) {
  char buf[9];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// The bytes of part `name`, checked against its manifest entry.
std::vector<uint8_t> read_part(const std::string& dir, const std::string& name, const nlohmann::json& files,
                               const std::string& cfg_path) {
  const std::string path = dir + "/" + name;
  const std::string ctx = "checkpoint: \"" + cfg_path + "\": files";
  if (!files.contains(name) || !files[name].is_object())
    throw Error(ctx + " has no entry for " + name);
  const nlohmann::json& entry = files[name];
  const int64_t want_bytes = json_int(entry, "bytes", 0, INT64_MAX, ctx + "." + name);
  const std::string want_crc = json_string(entry, "crc32", ctx + "." + name);
  std::error_code ec;
  if (!std::filesystem::exists(path, ec))
    throw Error("checkpoint: \"" + path + "\" is missing (config.json lists it; the checkpoint is incomplete)");
  const auto size = std::filesystem::file_size(path, ec);
  const std::string mixed = ": the checkpoint's parts come from different saves (was a save interrupted?); refusing "
                            "to use it";
  if (!ec && static_cast<int64_t>(size) != want_bytes)
    throw Error("checkpoint: \"" + path + "\" has " + std::to_string(size) + " bytes, config.json expects " +
                std::to_string(want_bytes) + mixed);
  std::vector<uint8_t> bytes = io::read_regular_file(path, static_cast<size_t>(want_bytes), "checkpoint");
  const std::string got_crc = hex32(io::crc32_of(bytes.data(), bytes.size()));
  if (got_crc != want_crc)
    throw Error("checkpoint: \"" + path + "\" has CRC-32 " + got_crc + ", config.json expects " +
                describe_json(entry["crc32"]) + mixed);
  return bytes;
}

io::SafeTensors parse_part(const std::vector<uint8_t>& bytes, const std::string& path) {
  try {
    return io::parse_safetensors(bytes.data(), bytes.size());
  } catch (const Error& e) {
    throw Error(std::string("checkpoint: ") + e.what() + " (in \"" + path + "\")");
  }
}

}  // namespace

nlohmann::json manifest_entry(const std::vector<uint8_t>& bytes) {
  return {{"bytes", bytes.size()}, {"crc32", hex32(io::crc32_of(bytes.data(), bytes.size()))}};
}

void validate_training_json(const nlohmann::json& t, const std::string& ctx) {
  if (!t.is_object()) throw Error(ctx + ": \"training\" must be an object, got " + describe_json(t));
  const std::string c = ctx + ": training";
  if (t.contains("steps")) json_int(t, "steps", 1, kMaxSteps, c);
  if (t.contains("lr")) json_number(t, "lr", 1e-30, 1000.0, c);
  if (t.contains("batch_size")) json_int(t, "batch_size", 1, kMaxBatchSize, c);
  if (t.contains("data")) {
    const nlohmann::json& d = t["data"];
    if (!d.is_object()) throw Error(c + ": \"data\" must be an object, got " + describe_json(d));
    const std::string dc = c + ".data";
    if (d.contains("task")) {
      const std::string task = json_string(d, "task", dc);
      bool known = false;
      std::string names;
      for (const std::string& n : task_names()) {
        known = known || n == task;
        names += (names.empty() ? "" : ", ") + n;
      }
      if (!known) throw Error(dc + ": unknown task \"" + task + "\" (expected one of: " + names + ")");
    }
    if (d.contains("seed")) json_seed(d, "seed", dc);
    if (d.contains("train_size")) json_int(d, "train_size", 1, kMaxSplitSize, dc);
    if (d.contains("validation_size")) json_int(d, "validation_size", 0, kMaxSplitSize, dc);
    if (d.contains("test_size")) json_int(d, "test_size", 0, kMaxSplitSize, dc);
  }
}

CheckpointFiles read_checkpoint_files(const std::string& dir, bool with_optimizer) {
  if (dir.empty()) throw Error("checkpoint: the directory name is empty");
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec))
    throw Error("checkpoint: cannot open \"" + dir + "\": no such directory");
  if (!std::filesystem::is_directory(dir, ec))
    throw Error("checkpoint: \"" + dir + "\" is not a directory (a checkpoint is a directory with config.json)");
  const std::string cfg_path = dir + "/config.json";
  if (!std::filesystem::exists(cfg_path, ec))
    throw Error("checkpoint: cannot open \"" + cfg_path + "\" (is \"" + dir + "\" a checkpoint directory?)");
  const std::vector<uint8_t> text = io::read_regular_file(cfg_path, kMaxConfigBytes, "checkpoint");
  const nlohmann::json j = nlohmann::json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) throw Error("checkpoint: \"" + cfg_path + "\" is not valid JSON");
  const nlohmann::json format = j.contains("format") ? j["format"] : nlohmann::json();
  if (format == "attn-checkpoint-1")
    throw Error("checkpoint: \"" + cfg_path + "\" is format attn-checkpoint-1, written before checkpoints carried "
                "checksums; its parts cannot be verified. Train it again with this version");
  if (format != kCheckpointFormat)
    throw Error("checkpoint: \"" + cfg_path + "\" is not an attn checkpoint (\"format\" must be \"" +
                kCheckpointFormat + "\", got " + describe_json(format) + ")");
  const std::string ctx = "checkpoint: \"" + cfg_path + "\"";
  CheckpointFiles c;
  c.task = json_string(j, "task", ctx);
  c.step = json_int(j, "step", 0, kMaxSteps, ctx);
  if (!j.contains("training")) throw Error(ctx + ": \"training\" is missing");
  validate_training_json(j["training"], ctx);
  c.training = j["training"];
  try {
    if (!j.contains("source_vocabulary") || !j.contains("target_vocabulary"))
      throw Error("the vocabularies are missing");
    c.src_tok = Tokenizer::from_json(j["source_vocabulary"]);
    c.tgt_tok = Tokenizer::from_json(j["target_vocabulary"]);
    if (!j.contains("model")) throw Error("\"model\" is missing");
    c.model = ModelConfig::from_json(j["model"]);
  } catch (const Error& e) {
    throw Error(ctx + ": " + e.what());
  }
  if (c.model.src_vocab != c.src_tok.size() || c.model.tgt_vocab != c.tgt_tok.size())
    throw Error(ctx + ": the model's vocabulary sizes (" + std::to_string(c.model.src_vocab) + ", " +
                std::to_string(c.model.tgt_vocab) + ") do not match the vocabularies (" +
                std::to_string(c.src_tok.size()) + ", " + std::to_string(c.tgt_tok.size()) + ")");
  if (!j.contains("files") || !j["files"].is_object()) throw Error(ctx + ": the manifest \"files\" is missing");
  const nlohmann::json& files = j["files"];
  c.weights = parse_part(read_part(dir, "model.safetensors", files, cfg_path), dir + "/model.safetensors");
  if (with_optimizer) {
    const std::string opt_path = dir + "/optimizer.safetensors";
    if (!std::filesystem::exists(opt_path, ec))
      throw Error("checkpoint: \"" + opt_path + "\" is missing: resuming needs the optimizer's state (restarting "
                  "Adam from zero would silently change the run)");
    c.optimizer = parse_part(read_part(dir, "optimizer.safetensors", files, cfg_path), opt_path);
    const auto it = c.optimizer->metadata.find("steps");
    if (it == c.optimizer->metadata.end()) throw Error("checkpoint: \"" + opt_path + "\" has no step count");
    const int64_t opt_step = parse_count(it->second, kMaxSteps, "checkpoint: \"" + opt_path + "\": the step count");
    if (opt_step != c.step)
      throw Error("checkpoint: the parts disagree: config.json is at step " + std::to_string(c.step) +
                  ", optimizer.safetensors at step " + std::to_string(opt_step));
  }
  return c;
}

}  // namespace attn::train
