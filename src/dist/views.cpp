#include "dist/views.hpp"

#include <cstring>
#include <vector>

namespace attn::dist::detail {

TensorView narrow(const TensorView& t, int dim, int64_t start, int64_t length) {
  std::vector<int64_t> shape = t.shape();
  shape[static_cast<size_t>(dim)] = length;
  const char* base = static_cast<const char*>(t.data());
  const int64_t offset = length > 0 ? start * t.stride(dim) * static_cast<int64_t>(dtype_size(t.dtype())) : 0;
  return TensorView(base + offset, t.dtype(), shape, t.strides());
}

void copy_view(const TensorView& src, const TensorView& dst) {
  const int64_t n = src.numel();
  if (n == 0) return;
  const int r = src.rank();
  const size_t es = dtype_size(src.dtype());
  const int64_t inner = src.size(r - 1);
  const bool rows = src.stride(r - 1) == 1 && dst.stride(r - 1) == 1;
  std::vector<int64_t> idx(static_cast<size_t>(r), 0);
  const char* s = static_cast<const char*>(src.data());
  char* d = static_cast<char*>(dst.data());
  for (int64_t done = 0; done < n; done += inner) {
    int64_t at_s = 0, at_d = 0;
    for (int i = 0; i < r - 1; ++i) {
      at_s += idx[static_cast<size_t>(i)] * src.stride(i);
      at_d += idx[static_cast<size_t>(i)] * dst.stride(i);
    }
    if (rows) {
      std::memcpy(d + at_d * int64_t(es), s + at_s * int64_t(es), size_t(inner) * es);
    } else {
      for (int64_t j = 0; j < inner; ++j) {
        std::memcpy(d + (at_d + j * dst.stride(r - 1)) * int64_t(es), s + (at_s + j * src.stride(r - 1)) * int64_t(es), es);
      }
    }
    for (int i = r - 2; i >= 0; --i) {
      if (++idx[static_cast<size_t>(i)] < src.size(i)) break;
      idx[static_cast<size_t>(i)] = 0;
    }
  }
}

}  // namespace attn::dist::detail
