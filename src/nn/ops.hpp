// The dense kernels the modules are made of, on raw row-major f32 arrays (llm.c
// style), for modules that call them many times per forward (recurrent cells,
// decoder steps) and keep their own caches. CBLAS does the matrix products.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attn/tensor.hpp"

namespace attn::nn::ops {

/// y[rows, out] = x[rows, in]·w[out, in]ᵀ + b[out] (b may be null). Overwrites y.
void linear_forward(const float* x, int64_t rows, int64_t in, const float* w, const float* b, int64_t out,
                    float* y);

/// Backward of linear_forward given dy[rows, out]. Each output pointer may be null
/// (not wanted); every one that is given is *added* into:
///   dx[rows, in] += dy·w,  dw[out, in] += dyᵀ·x,  db[out] += Σ_rows dy.
void linear_backward(const float* x, const float* dy, int64_t rows, int64_t in, const float* w, int64_t out,
                     float* dx, float* dw, float* db);

/// C[m, n] = alpha·op(A)·op(B) + beta·C for row-major matrices (a thin CBLAS wrapper).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
          const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

/// Rows of a tensor seen as [rows, last]: numel / size(last dimension).
int64_t rows_of(const TensorView& t);
/// Shape of `t` with its last dimension replaced by `last`.
std::vector<int64_t> with_last_dim(const TensorView& t, int64_t last);
/// Throws attn::Error unless `t` is contiguous f32 with last dimension `last`.
void expect_last_dim(const TensorView& t, int64_t last, const char* what);
/// Throws attn::Error unless `dy` has exactly `shape` (what backward expects).
void expect_shape(const TensorView& dy, const std::vector<int64_t>& shape, const char* what);

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

}  // namespace attn::nn::ops
