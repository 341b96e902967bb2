// safetensors files (https://github.com/huggingface/safetensors): an 8-byte
// little-endian header length N, N bytes of JSON
//   {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, …,
//    "__metadata__": {"key": "value"}}
// then the raw little-endian data, offsets relative to its start. PyTorch
// parameter names are used as the tensor names, so weights move both ways.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "attn/nn/module.hpp"
#include "attn/tensor.hpp"

namespace attn::io {

/// One tensor of a file: dtype as written in the file ("F32", "F64", "F16", "BF16",
/// "I64", "I32", "I16", "I8", "U8", "BOOL"), shape, and its raw bytes.
struct SafeTensor {
  std::string dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const;
  /// The values converted to f32 (every dtype above); throws attn::Error for others.
  std::vector<float> to_f32() const;
  /// The values converted to i32 (integer and BOOL dtypes); throws attn::Error otherwise.
  std::vector<int32_t> to_i32() const;

  /// f32 values stored as `dtype`: "F32" (exact), "BF16" or "F16" (rounded to nearest
  /// even, as PyTorch's .to(dtype)); any other dtype throws attn::Error.
  static SafeTensor from_f32(std::vector<int64_t> shape, const float* data, const std::string& dtype = "F32");
  static SafeTensor from_i32(std::vector<int64_t> shape, const int32_t* data);
  /// A copy of a tensor in its own dtype (f32 → F32, bf16 → BF16, f16 → F16, i32 →
  /// I32, boolean → BOOL), read through its strides, stored contiguously.
  static SafeTensor from_view(const TensorView& t);
};

/// A whole file: tensors by name (sorted) and the optional string metadata.
struct SafeTensors {
  std::map<std::string, SafeTensor> tensors;
  std::map<std::string, std::string> metadata;

  /// The tensor with this name; throws attn::Error naming it when missing.
  const SafeTensor& at(const std::string& name) const;
};

/// Parses a file held in memory. Every malformation (short buffer, header length
/// past the end or above 100 MB, bad JSON, unknown dtype, negative or overflowing
/// shape, offsets out of range, overlapping or leaving holes, size not matching
/// shape × dtype) throws attn::Error with the reason; nothing crashes.
SafeTensors parse_safetensors(const uint8_t* data, size_t size);
/// Reads and parses `path`; throws attn::Error if it cannot be read or is malformed.
SafeTensors load_safetensors(const std::string& path);
/// The file's bytes: header padded with spaces to a multiple of 8, tensors in name order.
std::vector<uint8_t> serialize_safetensors(const SafeTensors& file);
/// Writes `file` to `path` (through a temporary file and a rename, so a reader never
/// sees half a file); throws attn::Error on I/O failure.
void save_safetensors(const std::string& path, const SafeTensors& file);

/// Every parameter of `module` under its PyTorch name, as `dtype`: "F32" (default),
/// "BF16" or "F16" (rounded; loading converts back to f32, the modules' dtype).
SafeTensors module_state(nn::Module& module, const std::string& dtype = "F32");
/// Copies tensors into `module`'s parameters by name. Shapes must match. With `strict`,
/// every parameter must be present and every tensor must name a parameter (as
/// PyTorch's load_state_dict); throws attn::Error listing what is missing or unexpected.
void load_module_state(nn::Module& module, const SafeTensors& state, bool strict = true);

}  // namespace attn::io
