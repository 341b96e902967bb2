// Small operations on strided views for the distributed layer: slicing a view along
// one dimension and copying between views of one shape.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::dist::detail {

/// The view of elements [start, start + length) along dimension `dim` (same strides).
TensorView narrow(const TensorView& t, int dim, int64_t start, int64_t length);

/// Copies src into dst, element for element: same shape and dtype, any strides.
void copy_view(const TensorView& src, const TensorView& dst);

}  // namespace attn::dist::detail
