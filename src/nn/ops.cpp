// Dense kernels over CBLAS (OpenBLAS by default).
#include "nn/ops.hpp"

#include <cblas.h>

#include <cmath>

#include "attn/error.hpp"
#include "attn/nn/module.hpp"

namespace attn::nn {
void set_blas_threads(int n) { openblas_set_num_threads(n < 1 ? 1 : n); }
}  // namespace attn::nn

namespace attn::nn::ops {

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k == 0) {  // CBLAS leaves C alone only for beta == 1; make the empty product explicit
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.0f ? 0.0f : beta * c[i * ldc + j];
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
              static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
}

void linear_forward(const float* x, int64_t rows, int64_t in, const float* w, const float* b, int64_t out,
                    float* y) {
  if (b) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) y[r * out + o] = b[o];
  }
  gemm(false, true, rows, out, in, 1.0f, x, in, w, in, b ? 1.0f : 0.0f, y, out);
}

void linear_backward(const float* x, const float* dy, int64_t rows, int64_t in, const float* w, int64_t out,
                     float* dx, float* dw, float* db) {
  if (dx) gemm(false, false, rows, in, out, 1.0f, dy, out, w, in, 1.0f, dx, in);
  if (dw) gemm(true, false, out, in, rows, 1.0f, dy, out, x, in, 1.0f, dw, in);
  if (db) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t o = 0; o < out; ++o) db[o] += dy[r * out + o];
  }
}

int64_t rows_of(const TensorView& t) {
  const int64_t last = t.rank() == 0 ? 1 : t.size(t.rank() - 1);
  return last == 0 ? 0 : t.numel() / last;
}

std::vector<int64_t> with_last_dim(const TensorView& t, int64_t last) {
  std::vector<int64_t> s = t.shape();
  s.back() = last;
  return s;
}

void expect_last_dim(const TensorView& t, int64_t last, const char* what) {
  expect_f32(t, -1, what);
  if (t.rank() < 1 || t.size(t.rank() - 1) != last)
    throw Error(std::string(what) + ": expected last dimension " + std::to_string(last) + ", got " +
                t.describe());
}

void expect_shape(const TensorView& dy, const std::vector<int64_t>& shape, const char* what) {
  expect_f32(dy, static_cast<int>(shape.size()), what);
  if (dy.shape() != shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    throw Error(std::string(what) + ": expected shape " + s + "] (the forward output's), got " + dy.describe());
  }
}

}  // namespace attn::nn::ops
