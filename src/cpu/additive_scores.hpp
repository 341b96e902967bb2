// The inner loops of additive (Bahdanau) attention, fused and vectorised with
// Highway: e_j = vᵀ·tanh(qp + kp_j) over the keys of one query, and its backward,
// which recomputes the tanh rather than storing a [keys, attn_dim] tensor per query.
#pragma once

#include <cstdint>

namespace attn::detail {

/// e[j] = Σ_a v[a]·tanh(qp[a] + kp[j·A + a]) for j < S. qp [A], kp [S, A], v [A], e [S].
void additive_scores(const float* qp, const float* kp, const float* v, int64_t S, int64_t A, float* e);

/// Backward of additive_scores given de [S]. With t = tanh(qp + kp_j) and
/// g_ja = de_j·v_a·(1 − t_ja²), adds Σ_j g_j into dqp [A], g_j into dkp[j] [S, A] and
/// Σ_j de_j·t_j into dv [A].
void additive_scores_backward(const float* qp, const float* kp, const float* v, const float* de, int64_t S,
                              int64_t A, float* dqp, float* dkp, float* dv);

}  // namespace attn::detail
