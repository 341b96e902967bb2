// safetensors: round trips, files written by other tools' rules, and every kind
// of malformed input giving attn::Error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "attn/error.hpp"
#include "attn/io/safetensors.hpp"
#include "attn/nn/layers.hpp"
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

using io::SafeTensor;
using io::SafeTensors;

// A file built by hand from header text and payload bytes.
std::vector<uint8_t> raw_file(const std::string& header, const std::vector<uint8_t>& payload) {
  std::vector<uint8_t> out(8);
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out.insert(out.end(), header.begin(), header.end());
  out.insert(out.end(), payload.begin(), payload.end());
  return out;
}

std::string parse_error(const std::vector<uint8_t>& bytes) {
  try {
    io::parse_safetensors(bytes.data(), bytes.size());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Safetensors, RoundTripKeepsNamesShapesValuesAndMetadata) {
  nn::Rng rng = nn_rng(21);
  SafeTensors f;
  Tensor a = random_tensor({3, 1, 5}, rng);
  const int32_t ids[] = {4, -2, 7};
  f.tensors["layer.weight"] = SafeTensor::from_f32({3, 1, 5}, a.data_as<float>());
  f.tensors["ids"] = SafeTensor::from_i32({3}, ids);
  f.tensors["empty"] = SafeTensor::from_f32({0, 4}, nullptr);
  f.metadata["format"] = "pt";
  const std::vector<uint8_t> bytes = io::serialize_safetensors(f);
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  EXPECT_EQ(n % 8, 0u);  // data section aligned
  SafeTensors g = io::parse_safetensors(bytes.data(), bytes.size());
  EXPECT_EQ(g.metadata.at("format"), "pt");
  EXPECT_EQ(g.at("layer.weight").shape, (std::vector<int64_t>{3, 1, 5}));
  const std::vector<float> back = g.at("layer.weight").to_f32();
  EXPECT_EQ(std::memcmp(back.data(), a.data(), sizeof(float) * 15), 0);
  EXPECT_EQ(g.at("ids").to_i32(), (std::vector<int32_t>{4, -2, 7}));
  EXPECT_EQ(g.at("empty").numel(), 0);
  EXPECT_THROW(g.at("nope"), Error);
  EXPECT_THROW(g.at("layer.weight").to_i32(), Error);
}

TEST(Safetensors, ConvertsEveryDtype) {
  // F64 1.5, F16 -2.0 (0xC000), BF16 3.0 (0x4040), I64 -7, U8 200, BOOL 1.
  std::vector<uint8_t> payload(8 + 2 + 2 + 8 + 1 + 1);
  const double d = 1.5;
  const uint16_t h = 0xC000, b = 0x4040;
  const int64_t i = -7;
  std::memcpy(&payload[0], &d, 8);
  std::memcpy(&payload[8], &h, 2);
  std::memcpy(&payload[10], &b, 2);
  std::memcpy(&payload[12], &i, 8);
  payload[20] = 200;
  payload[21] = 1;
  const std::string header =
      R"({"d":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},"h":{"dtype":"F16","shape":[],"data_offsets":[8,10]},)"
      R"("b":{"dtype":"BF16","shape":[1],"data_offsets":[10,12]},"i":{"dtype":"I64","shape":[1],"data_offsets":[12,20]},)"
      R"("u":{"dtype":"U8","shape":[1],"data_offsets":[20,21]},"t":{"dtype":"BOOL","shape":[1],"data_offsets":[21,22]}})";
  const auto bytes = raw_file(header, payload);
  SafeTensors f = io::parse_safetensors(bytes.data(), bytes.size());
  EXPECT_EQ(f.at("d").to_f32()[0], 1.5f);
  EXPECT_EQ(f.at("h").to_f32()[0], -2.0f);
  EXPECT_EQ(f.at("b").to_f32()[0], 3.0f);
  EXPECT_EQ(f.at("i").to_i32()[0], -7);
  EXPECT_EQ(f.at("u").to_f32()[0], 200.0f);
  EXPECT_EQ(f.at("t").to_i32()[0], 1);
}

TEST(Safetensors, MalformedFilesGiveClearErrors) {
  const std::vector<uint8_t> four(4, 0);
  const std::string ok = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})";
  struct Case {
    std::vector<uint8_t> bytes;
    const char* expect;
  };
  std::vector<uint8_t> huge_header(8, 0xFF);
  std::vector<uint8_t> truncated = raw_file(ok, four);
  truncated.resize(truncated.size() - 30);
  const std::vector<Case> cases = {
      {{1, 2, 3}, "shorter than the 8-byte header"},
      {huge_header, "100 MB"},
      {truncated, "truncated"},
      {raw_file("[1,2]", {}), "JSON object"},
      {raw_file("{\"a\": ", {}), "not valid JSON"},
      {raw_file(R"({"a":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", four), "unknown dtype"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", four), "non-negative"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,4]}})", four), "too large"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})", four), "outside the data section"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}})", four), "outside the data section"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}})", four), "needs 2"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", four), "overlap"},
      {raw_file(ok, std::vector<uint8_t>(8, 0)), "no tensor uses"},
      {raw_file(R"({"a":{"dtype":"F32","shape":[1]}})", four), "data_offsets"},
      {raw_file(R"({"__metadata__":{"k":3}})", {}), "must be a string"},
      // Issue 10 item 17: the same name twice over the same range was accepted.
      {raw_file(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", four), "names \"a\" more than once"},
  };
  for (const Case& c : cases) {
    const std::string msg = parse_error(c.bytes);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected \"" << c.expect << "\", got \"" << msg << "\"";
  }
  EXPECT_THROW(io::load_safetensors("/nonexistent/file.safetensors"), Error);
}

TEST(Safetensors, ModuleStateRoundTripAndStrictLoading) {
  nn::Rng rng = nn_rng(22);
  nn::FeedForward a(4, 6, nn::ActivationKind::relu, 0.0f, rng), b(4, 6, nn::ActivationKind::relu, 0.0f, rng);
  const std::string path = (std::filesystem::temp_directory_path() / ("attn_st_" + std::to_string(rng.next_u64()))).string();
  io::save_safetensors(path, io::module_state(a));
  io::load_module_state(b, io::load_safetensors(path));
  std::filesystem::remove(path);
  EXPECT_EQ(a.linear2.weight.value, b.linear2.weight.value);
  SafeTensors state = io::module_state(a);
  state.tensors.erase("linear1.bias");
  state.tensors["extra"] = state.tensors["linear2.bias"];
  try {
    io::load_module_state(b, state);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing [linear1.bias], unexpected [extra]"), std::string::npos) << e.what();
  }
  io::load_module_state(b, state, /*strict=*/false);
  SafeTensors wrong = io::module_state(a);
  wrong.tensors["linear1.weight"].shape = {4, 6};
  EXPECT_THROW(io::load_module_state(b, wrong), Error);
}

TEST(Safetensors, Bf16AndF16ModuleStatesRoundOnceAndLoadBackIntoF32) {
  nn::Rng rng = nn_rng(23);
  nn::FeedForward a(5, 7, nn::ActivationKind::relu, 0.0f, rng), b(5, 7, nn::ActivationKind::relu, 0.0f, rng);
  for (const char* dtype : {"BF16", "F16"}) {
    SCOPED_TRACE(dtype);
    const SafeTensors state = io::module_state(a, dtype);
    EXPECT_EQ(state.at("linear1.weight").dtype, dtype);
    EXPECT_EQ(state.at("linear1.weight").bytes.size(), 2u * 5 * 7);
    const SafeTensors reread = io::parse_safetensors(io::serialize_safetensors(state).data(),
                                                     io::serialize_safetensors(state).size());
    io::load_module_state(b, reread);
    const std::vector<float>& w = a.linear1.weight.value;
    const std::vector<float>& got = b.linear1.weight.value;
    ASSERT_EQ(w.size(), got.size());
    bool changed = false;
    for (size_t i = 0; i < w.size(); ++i) {
      // Independent oracle: the nearest value with 8 (bf16) or 11 (f16) significant
      // bits, from frexp/ldexp in double, ties to even; f16 subnormals are multiples
      // of 2^-24.
      int e = 0;
      const double m = std::frexp(double(w[i]), &e);
      const bool f16 = std::string(dtype) == "F16";
      const int bits = f16 ? 11 : 8;
      const double want = f16 && std::fabs(w[i]) < std::ldexp(1.0, -14)
                              ? std::ldexp(std::nearbyint(std::ldexp(double(w[i]), 24)), -24)
                              : std::ldexp(std::nearbyint(std::ldexp(m, bits)), e - bits);
      ASSERT_EQ(double(got[i]), want) << i << " " << w[i];
      changed |= got[i] != w[i];
    }
    EXPECT_TRUE(changed) << "f32 weights should not all be exact in " << dtype;
  }
  EXPECT_THROW(SafeTensor::from_f32({1}, a.linear1.weight.value.data(), "F64"), Error);
}

TEST(Safetensors, FromViewCopiesATensorInItsOwnDtypeThroughItsStrides) {
  // A [3, 2] bf16 view with a row stride of 5 elements (every other row of a buffer).
  std::vector<uint16_t> buf(15);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<uint16_t>(0x3f80 + i);
  const TensorView v(buf.data(), DType::bf16, {3, 2}, {5, 1});
  const SafeTensor t = SafeTensor::from_view(v);
  EXPECT_EQ(t.dtype, "BF16");
  EXPECT_EQ(t.shape, (std::vector<int64_t>{3, 2}));
  ASSERT_EQ(t.bytes.size(), 12u);
  const size_t want[] = {0, 1, 5, 6, 10, 11};
  for (int i = 0; i < 6; ++i) {
    uint16_t h;
    std::memcpy(&h, t.bytes.data() + 2 * i, 2);
    EXPECT_EQ(h, buf[want[i]]) << i;
  }
  const std::vector<float> f = t.to_f32();
  EXPECT_EQ(f[0], 1.0f);
}

}  // namespace
}  // namespace attn::testing
