// bf16/f16 ↔ f32 conversions (see convert.hpp). Scalar bit manipulation: exact and
// portable; the fast kernels convert inside their packing steps instead.
#include "tensor/convert.hpp"
#include "tensor/view_util.hpp"

#include <cstring>

namespace attn::detail {

namespace {
uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

float bf16_to_f32(uint16_t h) { return float_of(uint32_t{h} << 16); }

uint16_t f32_to_bf16(float f) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit. Overflow
  // carries into the exponent and gives ±inf, as it should.
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0x1f) return float_of(sign | 0x7f800000u | (mant << 13));  // inf, NaN
  if (exp != 0) return float_of(sign | ((exp + 112) << 23) | (mant << 13));
  // Zero or subnormal: mant · 2^−24, exact in f32.
  const float mag = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return sign ? -mag : mag;
}

uint16_t f32_to_f16(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));  // quiet NaN
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520 rounds to inf (and inf)
  if (a < 0x38800000u) {
    // Below the smallest normal (2^−14): a multiple of 2^−24, rounded to nearest even.
    // Adding 0.5 (2^−1) aligns the f32 mantissa so its low bits are the f16 ones.
    const float scaled = float_of(a) + 0.5f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(bits_of(scaled) - bits_of(0.5f)));
  }
  // Normal: rebias the exponent (127 → 15) and round the mantissa 23 → 10 bits.
  const uint32_t r = a - (uint32_t{112} << 23);
  return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}


std::vector<float> to_f32_contiguous(const TensorView& src, bool round_bf16) {
  std::vector<float> out(static_cast<size_t>(src.empty() ? 0 : src.numel()));
  switch (src.dtype()) {
    case DType::bf16: {
      const uint16_t* p = src.data_as<const uint16_t>();
      for_each_element(src, [&](int64_t at, int64_t i) { out[static_cast<size_t>(i)] = bf16_to_f32(p[at]); });
      break;
    }
    case DType::f16: {
      const uint16_t* p = src.data_as<const uint16_t>();
      for_each_element(src, [&](int64_t at, int64_t i) { out[static_cast<size_t>(i)] = f16_to_f32(p[at]); });
      break;
    }
    default: {
      const float* p = src.data_as<const float>();
      if (round_bf16)
        for_each_element(src, [&](int64_t at, int64_t i) { out[static_cast<size_t>(i)] = round_to_bf16(p[at]); });
      else
        for_each_element(src, [&](int64_t at, int64_t i) { out[static_cast<size_t>(i)] = p[at]; });
    }
  }
  return out;
}

void from_f32_contiguous(const float* src, const TensorView& dst) {
  switch (dst.dtype()) {
    case DType::bf16: {
      uint16_t* p = dst.data_as<uint16_t>();
      for_each_element(dst, [&](int64_t at, int64_t i) { p[at] = f32_to_bf16(src[i]); });
      break;
    }
    case DType::f16: {
      uint16_t* p = dst.data_as<uint16_t>();
      for_each_element(dst, [&](int64_t at, int64_t i) { p[at] = f32_to_f16(src[i]); });
      break;
    }
    default: {
      float* p = dst.data_as<float>();
      for_each_element(dst, [&](int64_t at, int64_t i) { p[at] = src[i]; });
    }
  }
}

TensorView contiguous_f32_view(const float* data, const TensorView& like) {
  return TensorView(data, DType::f32, like.shape());
}

}  // namespace attn::detail
