// The f32 kernels' row conversions (storage_rows-inl.h) on the best SIMD target this
// CPU supports, callable from outside the kernels: the tests check every target's
// widening and rounding against the scalar conversions of tensor/convert.hpp.
#pragma once

#include <cstdint>

#include "attn/tensor.hpp"

namespace attn::detail {

/// `width` elements from element `offset` of `base` (dtype f32, bf16 or f16) as f32
/// into dst (width floats), as the kernels widen rows where they pack them (RowF32).
void load_row_f32_cpu(DType dt, const void* base, int64_t offset, int width, float* dst);

/// `width` f32 values from src into elements offset … offset + width − 1 of `base`
/// (dtype f32, bf16 or f16), rounded to nearest even as the kernels round output
/// rows (StoreRowF32).
void store_row_f32_cpu(DType dt, void* base, int64_t offset, const float* src, int width);

}  // namespace attn::detail
