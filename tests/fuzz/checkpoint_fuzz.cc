// libFuzzer target for the checkpoint reader: any config.json, model.safetensors and
// optimizer.safetensors must either be accepted or refused with attn::Error — never a
// crash, a hang, an over-read, a json exception or an unbounded allocation.
// Built and run by scripts/fuzz-checkpoint.sh (clang, -fsanitize=fuzzer,address,undefined).
//
// Input: [flags u8][config length u16 LE][model length u16 LE][config][model][optimizer].
// With flags bit 0 set, the harness rewrites config.json's manifest to match the parts
// first, so the fuzzer also reaches the code behind the checksums.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "attn/error.hpp"
#include "train/checkpoint_files.hpp"

namespace {

const std::string& fuzz_dir() {
  static const std::string dir = [] {
    const std::string d = (std::filesystem::temp_directory_path() / ("attn-fuzz-ckpt-" + std::to_string(getpid()))).string();
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

void write(const std::string& name, const uint8_t* p, size_t n) {
  std::ofstream(fuzz_dir() + "/" + name, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(p), n);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 5) return 0;
  const uint8_t flags = data[0];
  size_t config_len = data[1] | size_t(data[2]) << 8, model_len = data[3] | size_t(data[4]) << 8;
  data += 5, size -= 5;
  config_len = std::min(config_len, size);
  model_len = std::min(model_len, size - config_len);
  const uint8_t* config = data;
  const uint8_t* model = config + config_len;
  const uint8_t* optimizer = model + model_len;
  const size_t optimizer_len = size - config_len - model_len;
  std::string config_text(reinterpret_cast<const char*>(config), config_len);
  if (flags & 1) {
    nlohmann::json j = nlohmann::json::parse(config_text, nullptr, false);
    if (j.is_object()) {
      // The fuzzed config may hold "files" as any JSON value; the rewrite needs an object.
      if (!j["files"].is_object()) j["files"] = nlohmann::json::object();
      j["files"]["model.safetensors"] = attn::train::manifest_entry(std::vector<uint8_t>(model, model + model_len));
      j["files"]["optimizer.safetensors"] =
          attn::train::manifest_entry(std::vector<uint8_t>(optimizer, optimizer + optimizer_len));
      config_text = j.dump();
    }
  }
  write("config.json", reinterpret_cast<const uint8_t*>(config_text.data()), config_text.size());
  write("model.safetensors", model, model_len);
  if (!(flags & 2)) write("optimizer.safetensors", optimizer, optimizer_len);
  else std::filesystem::remove(fuzz_dir() + "/optimizer.safetensors");
  try {
    (void)attn::train::read_checkpoint_files(fuzz_dir(), /*with_optimizer=*/!(flags & 4));
  } catch (const attn::Error&) {
  }
  return 0;
}
