// Overlap tests for strided views (see overlap.hpp).
#include "tensor/overlap.hpp"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace attn::detail {
namespace {

struct Dim {
  int64_t stride;  // bytes
  int64_t a_size, b_size;
};

// Is there c_k ∈ (−b_size_k, a_size_k) with Σ c_k·stride_k = r, over dims[k..]?
// (Element n of a equals element m of b iff a0 + Σ n_k s_k = b0 + Σ m_k s_k, i.e.
// Σ (n_k − m_k) s_k = b0 − a0.) dims are sorted by decreasing stride; inner_a[k]
// and inner_b[k] bound what the dims after k can add. Depth-first, pruned by those
// bounds: for nested strides at most two candidates per level. `budget` caps the
// work; when it runs out the answer is "maybe" (true).
bool representable(const std::vector<Dim>& dims, const std::vector<int64_t>& inner_a,
                   const std::vector<int64_t>& inner_b, size_t k, int64_t r, int& budget) {
  if (--budget < 0) return true;
  if (k == dims.size()) return r == 0;
  const Dim& d = dims[k];
  // r − c·s must lie in [−inner_b[k], inner_a[k]]: c ∈ [ceil((r − ia)/s), floor((r + ib)/s)].
  auto floor_div = [](int64_t x, int64_t y) { return x >= 0 ? x / y : -((-x + y - 1) / y); };
  auto ceil_div = [&](int64_t x, int64_t y) { return -floor_div(-x, y); };
  const int64_t lo = std::max(ceil_div(r - inner_a[k], d.stride), -(d.b_size - 1));
  const int64_t hi = std::min(floor_div(r + inner_b[k], d.stride), d.a_size - 1);
  if (hi - lo > 8) return true;  // irregular strides: give up, say "maybe"
  for (int64_t c = lo; c <= hi; ++c) {
    if (representable(dims, inner_a, inner_b, k + 1, r - c * d.stride, budget)) return true;
  }
  return false;
}

// First and one-past-last byte a view touches (non-negative strides).
void byte_range(const TensorView& t, int64_t* lo, int64_t* hi) {
  const int64_t elem = static_cast<int64_t>(dtype_size(t.dtype()));
  int64_t last = 0;
  for (int i = 0; i < t.rank(); ++i) last += (t.size(i) - 1) * t.stride(i) * elem;
  *lo = reinterpret_cast<intptr_t>(t.data());
  *hi = *lo + last + elem;
}

}  // namespace

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data() == b.data() && a.dtype() == b.dtype() && a.shape() == b.shape() &&
         a.strides() == b.strides();
}

bool views_overlap(const TensorView& a, const TensorView& b) {
  if (a.empty() || b.empty() || a.numel() == 0 || b.numel() == 0) return false;
  int64_t alo, ahi, blo, bhi;
  byte_range(a, &alo, &ahi);
  byte_range(b, &blo, &bhi);
  if (ahi <= blo || bhi <= alo) return false;
  // Element-exact test in bytes: every element of either is a byte run of its
  // dtype's size, modelled as one more dimension of stride 1.
  std::vector<Dim> dims;
  for (int i = 0; i < a.rank(); ++i) {
    if (a.size(i) > 1) dims.push_back({a.stride(i) * int64_t(dtype_size(a.dtype())), a.size(i), 1});
  }
  for (int i = 0; i < b.rank(); ++i) {
    if (b.size(i) > 1) dims.push_back({b.stride(i) * int64_t(dtype_size(b.dtype())), 1, b.size(i)});
  }
  dims.push_back({1, int64_t(dtype_size(a.dtype())), int64_t(dtype_size(b.dtype()))});
  // Merge dims of equal stride (a's and b's index ranges combine).
  std::sort(dims.begin(), dims.end(), [](const Dim& x, const Dim& y) { return x.stride > y.stride; });
  std::vector<Dim> merged;
  for (const Dim& d : dims) {
    if (d.stride == 0) continue;
    if (!merged.empty() && merged.back().stride == d.stride) {
      merged.back().a_size = std::max(merged.back().a_size, d.a_size);
      merged.back().b_size = std::max(merged.back().b_size, d.b_size);
    } else {
      merged.push_back(d);
    }
  }
  std::vector<int64_t> inner_a(merged.size() + 1, 0), inner_b(merged.size() + 1, 0);
  for (size_t k = merged.size(); k-- > 0;) {
    inner_a[k] = inner_a[k + 1] + (merged[k].a_size - 1) * merged[k].stride;
    inner_b[k] = inner_b[k + 1] + (merged[k].b_size - 1) * merged[k].stride;
  }
  // inner_x[k] must bound the dims after k: shift by one.
  std::vector<int64_t> after_a(merged.size(), 0), after_b(merged.size(), 0);
  for (size_t k = 0; k < merged.size(); ++k) after_a[k] = inner_a[k + 1], after_b[k] = inner_b[k + 1];
  int budget = 4096;
  return representable(merged, after_a, after_b, 0, blo - alo, budget);
}

bool self_overlapping(const TensorView& t) {
  if (t.empty() || t.numel() <= 1) return false;
  std::vector<std::pair<int64_t, int64_t>> dims;  // (stride, size) of dims with size > 1
  for (int i = 0; i < t.rank(); ++i) {
    if (t.size(i) > 1) dims.push_back({t.stride(i), t.size(i)});
  }
  std::sort(dims.begin(), dims.end());
  // Distinct elements iff each stride exceeds the span of all smaller ones
  // (sufficient; views that interleave otherwise are rejected too).
  int64_t span = 0;
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return true;
    span += (size - 1) * stride;
  }
  return false;
}

}  // namespace attn::detail
