// Small helpers over TensorView shared inside the library: walking a strided view's
// elements and printing a shape in messages.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::detail {

// Calls f(offset of the element in the view, index in row-major order) for every element.
template <class F>
inline void for_each_element(const TensorView& t, F&& f) {
  const int64_t n = t.numel();
  if (t.empty() || n == 0) return;
  const int r = t.rank();
  std::vector<int64_t> idx(static_cast<size_t>(r), 0);
  int64_t at = 0;
  const int64_t last = r > 0 ? t.size(r - 1) : 1, step = r > 0 ? t.stride(r - 1) : 0;
  for (int64_t flat = 0; flat < n;) {
    for (int64_t j = 0; j < last; ++j) f(at + j * step, flat + j);
    flat += last;
    // Advance the outer index (dimensions 0 … r−2).
    for (int i = r - 2; i >= 0; --i) {
      at += t.stride(i);
      if (++idx[static_cast<size_t>(i)] < t.size(i)) break;
      at -= t.stride(i) * t.size(i);
      idx[static_cast<size_t>(i)] = 0;
    }
  }
}

/// "[2, 3, 4]".
std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace attn::detail
