// libFuzzer target for the safetensors parser: any byte string must either parse
// or throw attn::Error — never crash, hang, over-read or allocate without bound.
// Built and run by scripts/fuzz-safetensors.sh (clang, -fsanitize=fuzzer,address,undefined).
#include <cstddef>
#include <cstdint>

#include "attn/error.hpp"
#include "attn/io/safetensors.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const attn::io::SafeTensors f = attn::io::parse_safetensors(data, size);
    for (const auto& [name, t] : f.tensors) (void)t.to_f32();  // conversions read every byte
    (void)attn::io::serialize_safetensors(f);
  } catch (const attn::Error&) {
  }
  return 0;
}
