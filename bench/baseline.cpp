// The cblas baseline (see baseline.hpp).
#include "baseline.hpp"

#include <cblas.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" {
void openblas_set_num_threads(int);
char* openblas_get_corename(void);
}

namespace attn::bench {

namespace {

int g_threads = 1;  // set by baseline_configure

// One softmax row, vectorised the way a careful user would get it: glibc's
// libmvec expf through -ffast-math + OpenMP SIMD (see CMakeLists), cloned for
// AVX-512 and AVX2 so the portable build still uses the wide units.
__attribute__((target_clones("avx512f", "avx2", "default"))) void softmax_row(float* row,
                                                                            int visible, int L) {
  float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
  for (int j = 0; j < visible; ++j) mx = std::max(mx, row[j]);
  float sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int j = 0; j < visible; ++j) {
    row[j] = expf(row[j] - mx);
    sum += row[j];
  }
  const float inv = 1.0f / sum;
#pragma omp simd
  for (int j = 0; j < visible; ++j) row[j] *= inv;
  for (int j = visible; j < L; ++j) row[j] = 0.0f;
}

}  // namespace

void baseline_attention(const float* q, const float* k, const float* v, float* out, int B,
                        int L, int H, int d, bool causal) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int ld = H * d;  // row stride of BSHD
  // With several threads, heads run in parallel, each on single-threaded sgemm
  // with its own score matrix: on this machine that beats OpenBLAS's own threads
  // (whose idle spinning fights any OpenMP softmax) — the best a user gets here.
#pragma omp parallel for schedule(dynamic, 1) num_threads(g_threads) if (g_threads > 1)
  for (int bh = 0; bh < B * H; ++bh) {
    static thread_local std::vector<float> scores;  // reused: first touch is expensive here
    scores.resize(static_cast<size_t>(L) * L);
    const int b = bh / H, h = bh % H;
    const size_t off = static_cast<size_t>(b) * L * ld + static_cast<size_t>(h) * d;
    float* S = scores.data();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, L, L, d, scale, q + off, ld, k + off, ld,
                0.0f, S, L);
    for (int i = 0; i < L; ++i) softmax_row(S + static_cast<size_t>(i) * L, causal ? i + 1 : L, L);
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, d, L, 1.0f, S, L, v + off, ld, 0.0f,
                out + off, ld);
  }
}

void baseline_attention_backward(const float* q, const float* k, const float* v, const float* probs,
                                 const float* dout, float* dq, float* dk, float* dv, int B, int L,
                                 int H, int d) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  const int ld = H * d;
#pragma omp parallel for schedule(dynamic, 1) num_threads(g_threads) if (g_threads > 1)
  for (int bh = 0; bh < B * H; ++bh) {
    static thread_local std::vector<float> ds;
    ds.resize(static_cast<size_t>(L) * L);
    const int b = bh / H, h = bh % H;
    const size_t off = static_cast<size_t>(b) * L * ld + static_cast<size_t>(h) * d;
    const float* P = probs + static_cast<size_t>(bh) * L * L;
    float* dS = ds.data();
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, L, d, L, 1.0f, P, L, dout + off, ld, 0.0f,
                dv + off, ld);  // dV = Pᵀ·dO
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, L, L, d, 1.0f, dout + off, ld, v + off, ld,
                0.0f, dS, L);  // dP = dO·Vᵀ
    for (int i = 0; i < L; ++i) {  // dS = P ∘ (dP − rowsum(P ∘ dP))
      float* g = dS + static_cast<size_t>(i) * L;
      const float* pr = P + static_cast<size_t>(i) * L;
      float dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int j = 0; j < L; ++j) dot += pr[j] * g[j];
#pragma omp simd
      for (int j = 0; j < L; ++j) g[j] = pr[j] * (g[j] - dot);
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, L, d, L, scale, dS, L, k + off, ld, 0.0f,
                dq + off, ld);  // dQ = scale·dS·K
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, L, d, L, scale, dS, L, q + off, ld, 0.0f,
                dk + off, ld);  // dK = scale·dSᵀ·Q
  }
}

size_t baseline_extra_bytes(int L, int threads) {
  return sizeof(float) * static_cast<size_t>(L) * L * static_cast<size_t>(std::max(1, threads));
}

const char* baseline_configure(int threads) {
  openblas_set_num_threads(1);  // threads go to heads (see baseline_attention)
  g_threads = threads;
  return openblas_get_corename();
}

void ensure_fast_openblas(char** argv) {
  if (std::getenv("ATTN_KEEP_OPENBLAS_CORETYPE") != nullptr) return;
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512f")) return;
  // Some images pin OPENBLAS_CORETYPE to an AVX2 core (Haswell, Zen); on an AVX-512
  // CPU the baseline would then run at half speed and flatter attn.
  const char* now = std::getenv("OPENBLAS_CORETYPE");
  for (const char* good : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    if (now != nullptr && std::strcmp(now, good) == 0) return;
  }
  setenv("OPENBLAS_CORETYPE", "SkylakeX", 1);
  execv("/proc/self/exe", argv);  // returns only on failure: carry on as we are
}

}  // namespace attn::bench
