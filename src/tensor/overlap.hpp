// Whether two strided views share memory: the attention entry points refuse an
// output that overlaps an input or another output (a kernel that reads q while
// writing out = q shifted by a row reads what it has just written), except the
// exact aliasing of out with q, k or v, which the forward supports.
#pragma once

#include "attn/tensor.hpp"

namespace attn::detail {

/// True when a and b (non-negative strides) have at least one byte in common.
/// Exact for views with a common stride structure, such as q, k and v sliced
/// from one packed [B, L, 3, H, d] buffer, and conservative (true) when the
/// strides are too irregular to decide cheaply.
bool views_overlap(const TensorView& a, const TensorView& b);

/// True when a and b are the same view: same data, dtype, shape and strides.
bool same_view(const TensorView& a, const TensorView& b);

/// True when two different indices of t address the same element (a stride of 0,
/// or strides that fold dimensions onto each other); such a view cannot be written.
bool self_overlapping(const TensorView& t);

}  // namespace attn::detail
