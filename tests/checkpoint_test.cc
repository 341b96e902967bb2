// Checkpoints are all or nothing (issue 10, item 4): a save that fails part-way leaves the
// previous checkpoint whole and no temporary file; a checkpoint whose parts come from
// different saves, or that lacks the optimizer's state, is refused on resume; malformed
// config.json fields give one clear error each. (The full-disk case on a real file
// system is tests/checkpoint_full_disk_test.sh.)
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "attn/error.hpp"
#include "attn/io/heatmap.hpp"
#include "attn/train/trainer.hpp"
#include "io/files.hpp"
#include "nn_test_util.hpp"
#include "train/checkpoint_files.hpp"

namespace attn::testing {
namespace {
namespace fs = std::filesystem;
using nlohmann::json;

std::string temp_dir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("attn_ckpt_" + name + "_" + std::to_string(base_seed() % 100000));
  fs::remove_all(p);
  return p.string();
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// A small RNN session trained `steps` steps on the sort task.
struct SmallRun {
  train::TaskData data = train::make_task("sort", 5, 200, 0, 0);
  train::TrainOptions options;
  train::Session session;
  explicit SmallRun(uint64_t seed) {
    train::ModelConfig mc;
    mc.embed_dim = 8, mc.hidden = 16, mc.attn_dim = 8, mc.seed = seed;
    options.steps = 1;
    options.batch_size = 8;
    options.eval_every = 0;
    session = train::new_session(data, mc, options);
    session.training = {{"steps", 100}, {"lr", options.lr}, {"batch_size", 8}};
  }
  void train_to(int64_t step) {
    options.steps = step;
    train::train(session, data, options);
  }
};

void expect_error(const std::function<void()>& f, const std::vector<std::string>& needles, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << what << ": no error";
  } catch (const Error& e) {
    for (const std::string& n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << what << ": \"" << e.what() << "\" lacks \"" << n << "\"";
  }
}

struct InjectionGuard {
  ~InjectionGuard() { io::testing::inject_write_failure({}); }
};

TEST(Checkpoint, AFailedSaveLeavesThePreviousCheckpointWhole) {
  nn::set_blas_threads(1);
  for (const char* failing : {"model.safetensors", "optimizer.safetensors", "config.json"}) {
    SCOPED_TRACE(failing);
    SmallRun run(3);
    run.train_to(2);
    const std::string dir = temp_dir(std::string("fail_") + failing);
    train::save_checkpoint(run.session, dir);
    std::map<std::string, std::string> before;
    for (const std::string& n : files_in(dir)) before[n] = read_text(dir + "/" + n);
    run.train_to(5);
    {
      InjectionGuard guard;
      io::testing::inject_write_failure(
          [&](const std::string& path) { return path == dir + "/" + failing + ".tmp"; });
      expect_error([&] { train::save_checkpoint(run.session, dir); },
                   {"checkpoint not saved", failing, "No space left on device", "unchanged", "temporary files removed"},
                   failing);
    }
    // Every file byte for byte as before, nothing added.
    ASSERT_EQ(files_in(dir).size(), before.size());
    for (const auto& [name, text] : before) EXPECT_EQ(read_text(dir + "/" + name), text) << name;
    const train::Session back = train::load_checkpoint(dir, run.options);
    EXPECT_EQ(back.step, 2);
    // The next save succeeds and replaces everything.
    train::save_checkpoint(run.session, dir);
    EXPECT_EQ(train::load_checkpoint(dir, run.options).step, 5);
    fs::remove_all(dir);
  }
}

TEST(Checkpoint, AFailedFirstSaveSaysThereIsNoCheckpoint) {
  nn::set_blas_threads(1);
  SmallRun run(4);
  const std::string dir = temp_dir("first");
  InjectionGuard guard;
  io::testing::inject_write_failure([](const std::string& path) { return path.find("optimizer") != std::string::npos; });
  expect_error([&] { train::save_checkpoint(run.session, dir); }, {"holds no checkpoint"}, "first save");
  EXPECT_TRUE(files_in(dir).empty());
  fs::remove_all(dir);
}

TEST(Checkpoint, PartsFromDifferentSavesAreRefused) {
  nn::set_blas_threads(1);
  SmallRun a(5), b(6);
  a.train_to(2);
  b.train_to(3);
  const std::string da = temp_dir("mix_a"), db = temp_dir("mix_b");
  train::save_checkpoint(a.session, da);
  train::save_checkpoint(b.session, db);
  for (const char* part : {"model.safetensors", "optimizer.safetensors"}) {
    fs::copy_file(da + "/" + part, da + "/saved", fs::copy_options::overwrite_existing);
    fs::copy_file(db + "/" + part, da + "/" + part, fs::copy_options::overwrite_existing);
    expect_error([&] { train::load_checkpoint(da, a.options); }, {part, "different saves", "refusing"}, part);
    fs::rename(da + "/saved", da + "/" + part);
  }
  // A model part of the same size but other bytes: the checksum catches it.
  {
    std::string bytes = read_text(da + "/model.safetensors");
    bytes[bytes.size() - 3] ^= 0x40;
    std::ofstream(da + "/model.safetensors", std::ios::binary) << bytes;
    expect_error([&] { train::load_checkpoint(da, a.options, train::CheckpointUse::inference); },
                 {"CRC-32", "different saves"}, "flipped bit");
  }
  fs::remove_all(da);
  fs::remove_all(db);
}

// Rewrites config.json's manifest so that the files pass their checksums: what a
// consistent-looking but disagreeing checkpoint would be.
void rewrite_manifest(const std::string& dir) {
  json j = json::parse(read_text(dir + "/config.json"));
  for (const char* part : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string text = read_text(dir + "/" + part);
    j["files"][part] = train::manifest_entry(std::vector<uint8_t>(text.begin(), text.end()));
  }
  std::ofstream(dir + "/config.json") << j.dump();
}

TEST(Checkpoint, StepsAndShapesMustAgreeEvenWithAValidManifest) {
  nn::set_blas_threads(1);
  SmallRun a(7);
  a.train_to(2);
  const std::string dir = temp_dir("agree");
  train::save_checkpoint(a.session, dir);
  // The optimizer at another step.
  io::SafeTensors opt = io::load_safetensors(dir + "/optimizer.safetensors");
  for (const auto& [steps, needle] : std::vector<std::pair<std::string, std::string>>{
           {"7", "parts disagree"}, {"abc", "whole number"}, {"1e30", "whole number"}, {"-1", "whole number"},
           {"99999999999999999999", "whole number"}, {"1000000000000", "too large"}}) {
    opt.metadata["steps"] = steps;
    io::save_safetensors(dir + "/optimizer.safetensors", opt);
    rewrite_manifest(dir);
    expect_error([&] { train::load_checkpoint(dir, a.options); }, {"optimizer.safetensors", needle}, "steps " + steps);
  }
  train::save_checkpoint(a.session, dir);
  // Weights of another model's shapes.
  SmallRun other(8);
  train::ModelConfig bigger = other.session.model->config();
  bigger.hidden = 20;
  other.session = train::new_session(other.data, bigger, other.options);
  io::save_safetensors(dir + "/model.safetensors", io::module_state(other.session.model->module()));
  rewrite_manifest(dir);
  expect_error([&] { train::load_checkpoint(dir, a.options); }, {"model.safetensors", "shape"}, "shapes");
  fs::remove_all(dir);
}

TEST(Checkpoint, ResumingWithoutTheOptimizerIsAnError) {
  nn::set_blas_threads(1);
  SmallRun a(9);
  a.train_to(2);
  const std::string dir = temp_dir("noopt");
  train::save_checkpoint(a.session, dir);
  fs::remove(dir + "/optimizer.safetensors");
  expect_error([&] { train::load_checkpoint(dir, a.options); }, {"optimizer.safetensors", "missing", "resuming"},
               "resume");
  // Translating needs the model only.
  EXPECT_EQ(train::load_checkpoint(dir, a.options, train::CheckpointUse::inference).step, 2);
  fs::remove_all(dir);
}

TEST(Checkpoint, MalformedConfigFieldsGiveOneClearErrorEach) {
  nn::set_blas_threads(1);
  SmallRun a(10);
  a.train_to(1);
  const std::string dir = temp_dir("malformed");
  train::save_checkpoint(a.session, dir);
  const json good = json::parse(read_text(dir + "/config.json"));
  const struct {
    const char* pointer;
    json value;
    const char* needle;
  } cases[] = {
      {"/format", 1, "not an attn checkpoint"},
      {"/format", "attn-checkpoint-1", "cannot be verified"},
      {"/training", 5, "\"training\" must be an object"},
      {"/training/steps", "x", "\"steps\" must be an integer"},
      {"/training/steps", 0, "\"steps\" must be ≥ 1"},
      {"/training/lr", "nan", "\"lr\" must be a number"},
      {"/training/lr", -1.0, "\"lr\" must be a finite number"},
      {"/training/batch_size", 1e12, "\"batch_size\" is too large"},
      {"/training/batch_size", 2.5, "\"batch_size\" must be an integer"},
      {"/training/data", json::object({{"task", 7}}), "\"task\" must be a string"},
      {"/training/data", json::object({{"task", "poetry"}}), "unknown task"},
      {"/training/data", json::object({{"train_size", 1e12}}), "\"train_size\" is too large"},
      {"/step", "x", "\"step\" must be an integer"},
      {"/step", -3, "\"step\" must be ≥ 0"},
      {"/task", json::array(), "\"task\" must be a string"},
      {"/model/hidden", 1e9, "\"hidden\" is too large"},
      {"/model/hidden", 1000000000, "\"hidden\" is too large"},
      {"/model/hidden", 60000, "the model is too large"},
      {"/model/hidden", "64", "\"hidden\" must be an integer"},
      {"/model/hidden", 0, "\"hidden\" must be ≥ 1"},
      {"/model/dropout", 1.5, "\"dropout\" must be a finite number"},
      {"/model/seed", -1, "\"seed\" must be a non-negative integer"},
      {"/model/kind", 3, "\"kind\" must be a string"},
      {"/files", json::object(), "no entry for model.safetensors"},
      {"/files/model.safetensors/bytes", "many", "\"bytes\" must be an integer"},
      {"/files/model.safetensors/crc32", "00000000", "CRC-32"},
  };
  for (const auto& c : cases) {
    json j = good;
    j[json::json_pointer(c.pointer)] = c.value;
    std::ofstream(dir + "/config.json") << j.dump();
    expect_error([&] { train::load_checkpoint(dir, a.options); }, {c.needle}, std::string(c.pointer) + " = " + c.value.dump());
  }
  // A directory where a file belongs.
  std::ofstream(dir + "/config.json") << good.dump();
  fs::rename(dir + "/model.safetensors", dir + "/model.bak");
  fs::create_directory(dir + "/model.safetensors");
  expect_error([&] { train::load_checkpoint(dir, a.options); }, {"model.safetensors"}, "model is a directory");
  fs::remove(dir + "/model.safetensors");
  fs::rename(dir + "/model.bak", dir + "/model.safetensors");
  fs::rename(dir + "/config.json", dir + "/config.bak");
  fs::create_directory(dir + "/config.json");
  expect_error([&] { train::load_checkpoint(dir, a.options); }, {"config.json\" is a directory"}, "config is a directory");
  fs::remove(dir + "/config.json");
  fs::rename(dir + "/config.bak", dir + "/config.json");
  EXPECT_NO_THROW(train::load_checkpoint(dir, a.options));
  // The checkpoint names a file, or nothing.
  expect_error([&] { train::load_checkpoint(dir + "/config.json"); }, {"not a directory"}, "file as directory");
  expect_error([&] { train::load_checkpoint(""); }, {"empty"}, "empty name");
  fs::remove_all(dir);
}

TEST(Checkpoint, AbsurdSizesAreTooLargeNotAnAllocationFailure) {
  train::ModelConfig mc;
  mc.src_vocab = mc.tgt_vocab = 10;
  mc.hidden = 1'000'000;
  EXPECT_THROW(train::make_model(mc), Error);
  mc.hidden = 40000;
  expect_error([&] { train::make_model(mc); }, {"the model is too large"}, "hidden");
  train::Session s;
  train::TrainOptions o;
  o.batch_size = int64_t{1} << 40;
  const train::TaskData data = train::make_task("sort", 1, 10, 0, 0);
  expect_error([&] { train::train(s, data, o); }, {"too large"}, "batch");
  expect_error([&] { train::make_task("sort", 1, int64_t{1} << 40, 0, 0); }, {"too large"}, "split size");
}

TEST(Checkpoint, AFailedMapWriteKeepsTheOldPicture) {
  const std::string dir = temp_dir("maps");
  fs::create_directories(dir);
  io::Heatmap h{{{0.25f, 0.75f}, {0.5f, 0.5f}}, {"a", "b"}, {"x", "y"}, "attention"};
  io::write_heatmap_png(dir + "/m.png", {h}, 1, "before");
  io::write_heatmap_svg(dir + "/m.svg", {h}, 1, "before");
  const std::string png = read_text(dir + "/m.png"), svg = read_text(dir + "/m.svg");
  InjectionGuard guard;
  io::testing::inject_write_failure([](const std::string&) { return true; });
  h.values[0][0] = 1.0f;
  expect_error([&] { io::write_heatmap_png(dir + "/m.png", {h}, 1, "after"); }, {"m.png", "No space left"}, "png");
  expect_error([&] { io::write_heatmap_svg(dir + "/m.svg", {h}, 1, "after"); }, {"m.svg", "No space left"}, "svg");
  EXPECT_EQ(read_text(dir + "/m.png"), png);
  EXPECT_EQ(read_text(dir + "/m.svg"), svg);
  EXPECT_EQ(files_in(dir), (std::vector<std::string>{"m.png", "m.svg"}));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace attn::testing
