// safetensors parsing and writing, defensive: the input may be anything.
#include "attn/io/safetensors.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <set>
#include <string>
#include <nlohmann/json.hpp>

#include "attn/error.hpp"
#include "io/files.hpp"
#include "tensor/convert.hpp"
#include "tensor/view_util.hpp"

namespace attn::io {

namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference implementation's limit

// Bytes per element of a file dtype, or 0 when unknown.
size_t dtype_bytes(const std::string& d) {
  if (d == "F64" || d == "I64" || d == "U64") return 8;
  if (d == "F32" || d == "I32" || d == "U32") return 4;
  if (d == "F16" || d == "BF16" || d == "I16" || d == "U16") return 2;
  if (d == "I8" || d == "U8" || d == "BOOL") return 1;
  return 0;
}

[[noreturn]] void fail(const std::string& why) { throw Error("safetensors: " + why); }

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);  // zero or subnormal
    return sign ? -f : f;
  }
  const uint32_t bits = exp == 31 ? (sign | 0x7F800000u | (mant << 13)) : (sign | ((exp + 112) << 23) | (mant << 13));
  std::memcpy(&f, &bits, 4);
  return f;
}

template <class T>
T load_le(const uint8_t* p) {  // the format is little-endian, as is every target we build for
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

double element(const SafeTensor& t, int64_t i) {
  const uint8_t* p = t.bytes.data() + i * dtype_bytes(t.dtype);
  const std::string& d = t.dtype;
  if (d == "F32") return load_le<float>(p);
  if (d == "F64") return load_le<double>(p);
  if (d == "F16") return half_to_float(load_le<uint16_t>(p));
  if (d == "BF16") {
    const uint32_t bits = uint32_t(load_le<uint16_t>(p)) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
  if (d == "I64") return static_cast<double>(load_le<int64_t>(p));
  if (d == "U64") return static_cast<double>(load_le<uint64_t>(p));
  if (d == "I32") return load_le<int32_t>(p);
  if (d == "U32") return load_le<uint32_t>(p);
  if (d == "I16") return load_le<int16_t>(p);
  if (d == "U16") return load_le<uint16_t>(p);
  if (d == "I8") return load_le<int8_t>(p);
  return *p;  // U8, BOOL
}

}  // namespace

int64_t SafeTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

namespace {
void expect_consistent(const SafeTensor& t) {
  if (dtype_bytes(t.dtype) == 0) fail("unsupported dtype \"" + t.dtype + "\"");
  if (static_cast<uint64_t>(t.numel()) * dtype_bytes(t.dtype) != t.bytes.size())
    fail("a " + t.dtype + " tensor's byte count does not match its shape");
}
}  // namespace

std::vector<float> SafeTensor::to_f32() const {
  expect_consistent(*this);
  std::vector<float> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = static_cast<float>(element(*this, i));
  return out;
}

std::vector<int32_t> SafeTensor::to_i32() const {
  if (dtype[0] == 'F' || dtype == "BF16" || dtype_bytes(dtype) == 0)
    fail("expected an integer or BOOL tensor, got dtype \"" + dtype + "\"");
  expect_consistent(*this);
  std::vector<int32_t> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = static_cast<int32_t>(element(*this, i));
  return out;
}

SafeTensor SafeTensor::from_f32(std::vector<int64_t> shape, const float* data, const std::string& dtype) {
  if (dtype != "F32" && dtype != "BF16" && dtype != "F16") {
    fail("from_f32: dtype must be F32, BF16 or F16, got \"" + dtype + "\"");
  }
  SafeTensor t{dtype, std::move(shape), {}};
  const size_t n = static_cast<size_t>(t.numel());
  t.bytes.resize(n * dtype_bytes(dtype));
  if (dtype == "F32") {
    if (n != 0) std::memcpy(t.bytes.data(), data, t.bytes.size());
  } else {
    for (size_t i = 0; i < n; ++i) {
      const uint16_t h = dtype == "BF16" ? detail::f32_to_bf16(data[i]) : detail::f32_to_f16(data[i]);
      std::memcpy(t.bytes.data() + 2 * i, &h, 2);  // little-endian host, as the file
    }
  }
  return t;
}

SafeTensor SafeTensor::from_view(const TensorView& v) {
  const char* names[] = {"F32", "BF16", "F16", "BOOL", "I32"};  // DType's order
  SafeTensor t{names[static_cast<int>(v.dtype())], v.shape(), {}};
  const size_t esize = dtype_size(v.dtype());
  t.bytes.resize(static_cast<size_t>(v.numel()) * esize);
  const uint8_t* base = static_cast<const uint8_t*>(v.data());
  detail::for_each_element(v, [&](int64_t at, int64_t i) {
    std::memcpy(t.bytes.data() + static_cast<size_t>(i) * esize, base + at * static_cast<int64_t>(esize), esize);
  });
  return t;
}

SafeTensor SafeTensor::from_i32(std::vector<int64_t> shape, const int32_t* data) {
  SafeTensor t{"I32", std::move(shape), {}};
  t.bytes.resize(static_cast<size_t>(t.numel()) * 4);
  if (!t.bytes.empty()) std::memcpy(t.bytes.data(), data, t.bytes.size());
  return t;
}

const SafeTensor& SafeTensors::at(const std::string& name) const {
  auto it = tensors.find(name);
  if (it == tensors.end()) fail("no tensor named \"" + name + "\"");
  return it->second;
}

SafeTensors parse_safetensors(const uint8_t* data, size_t size) {
  if (size < 8) fail("file is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  const uint64_t n = load_le<uint64_t>(data);
  if (n > kMaxHeaderBytes) fail("header length " + std::to_string(n) + " exceeds the 100 MB limit");
  if (n > size - 8)
    fail("header length " + std::to_string(n) + " runs past the end of the file (" + std::to_string(size) +
         " bytes): truncated?");
  const char* header = reinterpret_cast<const char*>(data + 8);
  if (n == 0 || header[0] != '{') fail("the header must be a JSON object starting with '{'");
  // JSON objects keep one value per key, so a repeated tensor name would vanish
  // silently in parsing: catch it as the keys go by.
  std::set<std::string> top_keys;
  std::string duplicate;
  const nlohmann::json::parser_callback_t on_key = [&](int depth, nlohmann::json::parse_event_t event,
                                                       nlohmann::json& parsed) {
    if (event == nlohmann::json::parse_event_t::key && depth == 1 && duplicate.empty() &&
        !top_keys.insert(parsed.get<std::string>()).second) {
      duplicate = parsed.get<std::string>();
    }
    return true;
  };
  const nlohmann::json j = nlohmann::json::parse(header, header + n, on_key, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) fail("the header is not valid JSON object text");
  if (!duplicate.empty()) fail("the header names \"" + duplicate + "\" more than once");

  const uint8_t* payload = data + 8 + n;
  const uint64_t payload_size = size - 8 - n;
  SafeTensors file;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    const std::string& name = it.key();
    const nlohmann::json& e = it.value();
    if (name == "__metadata__") {
      if (!e.is_object()) fail("__metadata__ must be an object of strings");
      for (auto m = e.begin(); m != e.end(); ++m) {
        if (!m.value().is_string()) fail("__metadata__[\"" + m.key() + "\"] must be a string");
        file.metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor \"" + name + "\": ";
    if (!e.is_object() || !e.contains("dtype") || !e.contains("shape") || !e.contains("data_offsets"))
      fail(where + "expected an object with dtype, shape and data_offsets");
    if (!e["dtype"].is_string()) fail(where + "dtype must be a string");
    SafeTensor t;
    t.dtype = e["dtype"].get<std::string>();
    const size_t esize = dtype_bytes(t.dtype);
    if (esize == 0) fail(where + "unknown dtype \"" + t.dtype + "\"");
    if (!e["shape"].is_array()) fail(where + "shape must be an array");
    uint64_t count = 1;
    for (const auto& s : e["shape"]) {
      if (!s.is_number_unsigned()) fail(where + "shape entries must be non-negative integers");
      const uint64_t v = s.get<uint64_t>();
      if (v > (uint64_t{1} << 62) || __builtin_mul_overflow(count, v, &count))
        fail(where + "shape is too large (element count overflows)");
      t.shape.push_back(static_cast<int64_t>(v));
    }
    const auto& off = e["data_offsets"];
    if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      fail(where + "data_offsets must be [begin, end] with non-negative integers");
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > payload_size)
      fail(where + "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
           "] lie outside the data section of " + std::to_string(payload_size) + " bytes");
    uint64_t bytes;
    if (__builtin_mul_overflow(count, esize, &bytes) || bytes != end - begin)
      fail(where + "holds " + std::to_string(end - begin) + " bytes, but shape × " + t.dtype + " needs " +
           std::to_string(count) + " × " + std::to_string(esize));
    t.bytes.assign(payload + begin, payload + end);
    ranges.emplace_back(begin, end);
    file.tensors.emplace(name, std::move(t));
  }
  // The data section must be covered exactly: no overlaps, no holes (the format's rule).
  std::sort(ranges.begin(), ranges.end());
  uint64_t covered = 0;
  for (const auto& [b, e] : ranges) {
    if (b != covered) fail(b < covered ? "tensor data ranges overlap" : "the data section has a hole");
    covered = e;
  }
  if (covered != payload_size)
    fail("the data section has " + std::to_string(payload_size - covered) + " bytes that no tensor uses");
  return file;
}

SafeTensors load_safetensors(const std::string& path) {
  const std::vector<uint8_t> bytes = read_regular_file(path, SIZE_MAX / 2, "safetensors");
  try {
    return parse_safetensors(bytes.data(), bytes.size());
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (in \"" + path + "\")");
  }
}

std::vector<uint8_t> serialize_safetensors(const SafeTensors& file) {
  nlohmann::json header = nlohmann::json::object();
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    if (dtype_bytes(t.dtype) == 0) fail("tensor \"" + name + "\": unknown dtype \"" + t.dtype + "\"");
    if (static_cast<uint64_t>(t.numel()) * dtype_bytes(t.dtype) != t.bytes.size())
      fail("tensor \"" + name + "\": byte count does not match its shape and dtype");
    header[name] = {{"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  std::vector<uint8_t> out;
  out.reserve(8 + text.size() + offset);
  const uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<uint8_t>(n >> (8 * i)));  // little-endian
  out.insert(out.end(), text.begin(), text.end());
  for (const auto& [name, t] : file.tensors) out.insert(out.end(), t.bytes.begin(), t.bytes.end());
  return out;
}

void save_safetensors(const std::string& path, const SafeTensors& file) {
  const std::vector<uint8_t> bytes = serialize_safetensors(file);
  try {
    write_file_atomically(path, bytes.data(), bytes.size());
  } catch (const Error& e) {
    fail(e.what());
  }
}

SafeTensors module_state(nn::Module& module, const std::string& dtype) {
  SafeTensors file;
  for (auto& [name, p] : module.named_parameters())
    file.tensors[name] = SafeTensor::from_f32(p->shape, p->value.data(), dtype);
  return file;
}

void load_module_state(nn::Module& module, const SafeTensors& state, bool strict) {
  std::string missing, unexpected;
  auto params = module.named_parameters();
  for (auto& [name, p] : params) {
    auto it = state.tensors.find(name);
    if (it == state.tensors.end()) {
      missing += (missing.empty() ? "" : ", ") + name;
      continue;
    }
    if (it->second.shape != p->shape) {
      std::string want, got;
      for (int64_t s : p->shape) want += (want.empty() ? "" : ", ") + std::to_string(s);
      for (int64_t s : it->second.shape) got += (got.empty() ? "" : ", ") + std::to_string(s);
      fail("tensor \"" + name + "\" has shape [" + got + "], the parameter is [" + want + "]");
    }
  }
  if (strict) {
    for (const auto& [name, t] : state.tensors) {
      bool found = false;
      for (auto& [pname, p] : params) found = found || pname == name;
      if (!found) unexpected += (unexpected.empty() ? "" : ", ") + name;
    }
    if (!missing.empty() || !unexpected.empty())
      fail("state does not match the module: missing [" + missing + "], unexpected [" + unexpected + "]");
  }
  for (auto& [name, p] : params) {  // all checks passed: now copy
    auto it = state.tensors.find(name);
    if (it != state.tensors.end()) p->value = it->second.to_f32();
  }
}

}  // namespace attn::io
