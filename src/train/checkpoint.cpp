// Saving and loading checkpoints. A save writes every part to a temporary file first;
// only when all of them are on the disk are they renamed into place, config.json (the
// manifest) last. A save that fails leaves the previous checkpoint as it was; a save cut
// short between renames is caught on load by the manifest's sizes and checksums.
#include <filesystem>

#include "attn/error.hpp"
#include "attn/train/trainer.hpp"
#include "io/files.hpp"
#include "train/checkpoint_files.hpp"

namespace attn::train {

namespace {
namespace fs = std::filesystem;

struct Part {
  std::string name;
  std::vector<uint8_t> bytes;
};

void remove_quietly(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
}
}  // namespace

void save_checkpoint(const Session& s, const std::string& dir) {
  if (dir.empty()) throw Error("checkpoint: the directory name is empty");
  if (!s.model || !s.optimizer) throw Error("checkpoint: the session has no model or optimizer");
  validate_training_json(s.training, "checkpoint: session");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw Error("checkpoint: cannot create directory \"" + dir + "\"" + (ec ? ": " + ec.message() : ": a file is there"));
  std::vector<Part> parts;
  parts.push_back({"model.safetensors", io::serialize_safetensors(io::module_state(s.model->module()))});
  parts.push_back({"optimizer.safetensors", io::serialize_safetensors(s.optimizer->state())});
  nlohmann::json files = nlohmann::json::object();
  for (const Part& p : parts) files[p.name] = manifest_entry(p.bytes);
  const nlohmann::json config = {{"format", kCheckpointFormat},
                                 {"task", s.task},
                                 {"step", s.step},
                                 {"training", s.training},
                                 {"model", s.model->config().to_json()},
                                 {"source_vocabulary", s.src_tok.to_json()},
                                 {"target_vocabulary", s.tgt_tok.to_json()},
                                 {"files", files}};
  const std::string text = config.dump(2) + "\n";
  parts.push_back({"config.json", std::vector<uint8_t>(text.begin(), text.end())});

  const bool had_checkpoint = fs::exists(dir + "/config.json", ec);
  const std::string unchanged = had_checkpoint ? "the checkpoint in \"" + dir + "\" is unchanged"
                                               : "\"" + dir + "\" holds no checkpoint";
  auto remove_temporaries = [&](size_t from) {
    for (size_t i = from; i < parts.size(); ++i) remove_quietly(dir + "/" + parts[i].name + ".tmp");
  };
  try {
    for (const Part& p : parts) io::write_file_synced(dir + "/" + p.name + ".tmp", p.bytes.data(), p.bytes.size());
  } catch (const Error& e) {
    remove_temporaries(0);
    throw Error(std::string("checkpoint not saved: ") + e.what() + "; " + unchanged + " (temporary files removed)");
  }
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string from = dir + "/" + parts[i].name + ".tmp", to = dir + "/" + parts[i].name;
    fs::rename(from, to, ec);
    if (ec) {
      remove_temporaries(i);
      throw Error("checkpoint: cannot rename \"" + from + "\" to \"" + to + "\": " + ec.message() +
                  (i == 0 ? "; " + unchanged : "; the checkpoint is now incomplete and will be refused on load"));
    }
  }
  io::sync_directory(dir);
}

Session load_checkpoint(const std::string& dir, const TrainOptions& options, CheckpointUse use) {
  CheckpointFiles c = read_checkpoint_files(dir, use == CheckpointUse::resume);
  Session s;
  s.task = std::move(c.task);
  s.step = c.step;
  s.training = std::move(c.training);
  s.src_tok = std::move(c.src_tok);
  s.tgt_tok = std::move(c.tgt_tok);
  try {
    s.model = make_model(c.model);
    io::load_module_state(s.model->module(), c.weights);
  } catch (const Error& e) {
    throw Error("checkpoint: \"" + dir + "/model.safetensors\": " + e.what());
  }
  s.model->module().eval();
  s.optimizer = std::make_unique<Adam>(parameters_of(s.model->module()), options.lr, 0.9, 0.999, 1e-8,
                                       options.weight_decay, true);
  if (c.optimizer) {
    try {
      s.optimizer->load_state(*c.optimizer);
    } catch (const Error& e) {
      throw Error("checkpoint: \"" + dir + "/optimizer.safetensors\": " + e.what());
    }
  }
  return s;
}

}  // namespace attn::train
