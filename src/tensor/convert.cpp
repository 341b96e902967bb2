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

inline uint16_t bf16_of(float f) {
  const uint32_t u = bits_of(f);
  // Round to nearest, ties to even: add 0x7fff plus the lowest kept bit. Overflow
  // carries into the exponent and gives ±inf, as it should. NaN stays a quiet NaN.
  // (A select, not an early return, so that rows of it vectorise.)
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet : rounded);
}
}  // namespace

float bf16_to_f32(uint16_t h) { return float_of(uint32_t{h} << 16); }

uint16_t f32_to_bf16(float f) { return bf16_of(f); }

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

float f8e4m3_to_f32(uint8_t c) {
  const uint32_t sign = uint32_t{c & 0x80u} << 24;
  const uint32_t exp = (c >> 3) & 0xfu, mant = c & 0x7u;
  if (exp == 0xf && mant == 0x7) return float_of(sign | 0x7fc00000u);  // NaN
  if (exp != 0) return float_of(sign | ((exp + 120) << 23) | (mant << 20));
  // Zero or subnormal: mant · 2^−9, exact in f32.
  const float mag = static_cast<float>(mant) * 0.001953125f;
  return sign ? -mag : mag;
}

uint8_t f32_to_f8e4m3(float f) {
  const uint32_t u = bits_of(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);  // NaN
  // Beyond 448 (0x43e00000) saturates: the next step up, 480, would be the NaN code.
  if (a >= 0x43e00000u) return static_cast<uint8_t>(sign | 0x7eu);
  if (a < 0x3c800000u) {
    // Below the smallest normal (2^−6): a multiple of 2^−9, rounded to nearest even.
    // Adding 2^14 (whose f32 ulp is 2^−9) leaves exactly those bits in the mantissa;
    // 8 · 2^−9 is the smallest normal, whose code is 8 as well.
    const float scaled = float_of(a) + 16384.0f;
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(bits_of(scaled) - bits_of(16384.0f)));
  }
  // Normal: rebias the exponent (127 → 7) and round the mantissa 23 → 3 bits.
  const uint32_t r = a - (uint32_t{120} << 23);
  return static_cast<uint8_t>(sign | ((r + 0x7ffffu + ((r >> 20) & 1u)) >> 20));
}

void load_f32_row(DType dt, const void* base, int64_t at, float* dst, int64_t n) {
  switch (dt) {
    case DType::bf16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = float_of(uint32_t{p[i]} << 16);
      break;
    }
    case DType::f16: {
      const uint16_t* p = static_cast<const uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(p[i]);
      break;
    }
    default: std::memcpy(dst, static_cast<const float*>(base) + at, sizeof(float) * static_cast<size_t>(n));
  }
}

void round_f32_row_to_bf16(const float* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = float_of(uint32_t{bf16_of(src[i])} << 16);
}

void store_f32_row(DType dt, void* base, int64_t at, const float* src, int64_t n) {
  switch (dt) {
    case DType::bf16: {
      uint16_t* p = static_cast<uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) p[i] = bf16_of(src[i]);
      break;
    }
    case DType::f16: {
      uint16_t* p = static_cast<uint16_t*>(base) + at;
      for (int64_t i = 0; i < n; ++i) p[i] = f32_to_f16(src[i]);
      break;
    }
    default: std::memcpy(static_cast<float*>(base) + at, src, sizeof(float) * static_cast<size_t>(n));
  }
}

namespace {

// Calls f(at, i, n) for each run of n elements that lie consecutively both in `t`
// (from element `at`) and in a contiguous row-major array of t's shape (from element
// `i`): whole rows when t's last dimension is contiguous, as attention's tensors are,
// so that the row loops vectorise; single elements otherwise.
template <class F>
void for_each_run(const TensorView& t, F&& f) {
  const int r = t.rank();
  if (t.empty() || t.numel() == 0) return;
  if (r == 0 || t.stride(r - 1) != 1) {
    for_each_element(t, [&](int64_t at, int64_t i) { f(at, i, 1); });
    return;
  }
  std::vector<int64_t> rows_shape = t.shape();
  const int64_t n = rows_shape.back();
  rows_shape.back() = 1;
  const TensorView rows(t.data(), t.dtype(), rows_shape, t.strides());
  for_each_element(rows, [&](int64_t at, int64_t row) { f(at, row * n, n); });
}

}  // namespace

void to_f32_contiguous(const TensorView& src, float* dst, bool round_bf16) {
  const bool round = round_bf16 && src.dtype() == DType::f32;
  for_each_run(src, [&](int64_t at, int64_t i, int64_t n) {
    load_f32_row(src.dtype(), src.data(), at, dst + i, n);
    if (round) round_f32_row_to_bf16(dst + i, dst + i, n);
  });
}

std::vector<float> to_f32_contiguous(const TensorView& src, bool round_bf16) {
  std::vector<float> out(static_cast<size_t>(src.empty() ? 0 : src.numel()));
  to_f32_contiguous(src, out.data(), round_bf16);
  return out;
}

void from_f32_contiguous(const float* src, const TensorView& dst) {
  for_each_run(dst, [&](int64_t at, int64_t i, int64_t n) { store_f32_row(dst.dtype(), dst.data(), at, src + i, n); });
}

TensorView contiguous_f32_view(const float* data, const TensorView& like) {
  return TensorView(data, DType::f32, like.shape());
}

}  // namespace attn::detail
