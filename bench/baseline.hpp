// The baseline a C++ user would write without attn: per (batch, head)
// S = Q·Kᵀ with cblas_sgemm, a row softmax, O = P·V with cblas_sgemm. It keeps
// the L×L score matrix (4·L² bytes) and, for causal, computes it in full and
// masks it, as such code usually does.
#pragma once

#include <cstddef>

namespace attn::bench {

/// q, k, v, out: BSHD [B, L, H, d], contiguous. With several threads (see
/// baseline_configure) the heads run in parallel on single-threaded sgemm.
void baseline_attention(const float* q, const float* k, const float* v, float* out, int B,
                        int L, int H, int d, bool causal);

/// The backward a C++ user would write for that pipeline, given P (the forward's
/// softmax, [B, H, L, L], kept from the forward as such code does): per (b, h)
///   dV = Pᵀ·dO, dP = dO·Vᵀ, dS = P ∘ (dP − rowsum(P ∘ dP)), dQ = scale·dS·K,
///   dK = scale·dSᵀ·Q    (four cblas_sgemm calls and one elementwise pass).
void baseline_attention_backward(const float* q, const float* k, const float* v, const float* probs,
                                 const float* dout, float* dq, float* dk, float* dv, int B, int L,
                                 int H, int d);

/// Bytes of score matrices the baseline holds (L×L floats per thread).
size_t baseline_extra_bytes(int L, int threads);

/// Sets the baseline's thread count; returns OpenBLAS's core name ("SkylakeX", ...).
const char* baseline_configure(int threads);

/// Debian's OpenBLAS 0.3.21 does not recognise Zen 5 and falls back to its AVX2
/// kernels at half speed (and some images pin OPENBLAS_CORETYPE=Haswell). Call
/// first thing in main(): on an AVX-512 CPU whose OPENBLAS_CORETYPE is not an
/// AVX-512 core, sets it to SkylakeX and re-executes the program (OpenBLAS reads
/// it when it loads, before main). ATTN_KEEP_OPENBLAS_CORETYPE=1 keeps the
/// user's choice. Returns normally when nothing needs doing.
void ensure_fast_openblas(char** argv);

}  // namespace attn::bench
