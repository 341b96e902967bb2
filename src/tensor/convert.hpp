// Conversions between the storage dtypes (bf16, f16) and f32, for the portable path of
// low-precision attention: rounding is IEEE round-to-nearest-even, NaN stays NaN (a
// quiet NaN of the same sign), ±inf and signed zeros are kept, and values beyond the
// target's range become ±inf — the same as PyTorch's .to(dtype).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::detail {

float bf16_to_f32(uint16_t h);
uint16_t f32_to_bf16(float f);
float f16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
/// OCP FP8 E4M3 ("e4m3fn"): bias 7, subnormals down to 2^−9, largest ±448, no
/// infinities; S.1111.111 is NaN. Encoding rounds to nearest even and saturates:
/// anything beyond ±448 (±inf included) becomes ±448, NaN stays NaN (0x7F | sign).
float f8e4m3_to_f32(uint8_t c);
uint8_t f32_to_f8e4m3(float f);
/// The largest finite E4M3 value.
inline constexpr float kF8E4M3Max = 448.0f;

/// Element `at` of an f32, bf16 or f16 array, as an f32.
inline float load_f32(DType dt, const void* base, int64_t at) {
  switch (dt) {
    case DType::bf16: return bf16_to_f32(static_cast<const uint16_t*>(base)[at]);
    case DType::f16: return f16_to_f32(static_cast<const uint16_t*>(base)[at]);
    default: return static_cast<const float*>(base)[at];
  }
}

/// Writes x into element `at` of an f32, bf16 or f16 array, rounding to its dtype.
inline void store_f32(DType dt, void* base, int64_t at, float x) {
  switch (dt) {
    case DType::bf16: static_cast<uint16_t*>(base)[at] = f32_to_bf16(x); break;
    case DType::f16: static_cast<uint16_t*>(base)[at] = f32_to_f16(x); break;
    default: static_cast<float*>(base)[at] = x; break;
  }
}

/// n consecutive elements from element `at` of an f32, bf16 or f16 array, as f32
/// (the same values as load_f32, in loops the compiler vectorises).
void load_f32_row(DType dt, const void* base, int64_t at, float* dst, int64_t n);

/// n f32 values into consecutive elements from `at` of an f32, bf16 or f16 array,
/// rounded as store_f32 rounds.
void store_f32_row(DType dt, void* base, int64_t at, const float* src, int64_t n);

/// n f32 values rounded to their nearest bf16 values (as f32_to_bf16 rounds), written
/// as f32 to dst (which may be src): Precision::bf16's rounding of f32 inputs, in a loop
/// the compiler vectorises, for the f32 kernel's packing step.
void round_f32_row_to_bf16(const float* src, float* dst, int64_t n);

/// f rounded to the nearest bf16 (or f16) value, as an f32.
inline float round_to_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }
inline float round_to_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

/// The elements of `src` (dtype f32, bf16 or f16; any non-negative strides) as a
/// contiguous row-major f32 array of the same shape. With `round_bf16`, each value is
/// also rounded to bf16 (the reduced-precision option for f32 inputs).
std::vector<float> to_f32_contiguous(const TensorView& src, bool round_bf16 = false);
/// The same into `dst` (src.numel() floats).
void to_f32_contiguous(const TensorView& src, float* dst, bool round_bf16 = false);

/// Writes a contiguous row-major f32 array of `dst`'s shape into `dst` (dtype f32, bf16
/// or f16; any non-negative strides), rounding to its dtype.
void from_f32_contiguous(const float* src, const TensorView& dst);

/// A contiguous f32 view of `data` with `like`'s shape.
TensorView contiguous_f32_view(const float* data, const TensorView& like);

}  // namespace attn::detail
