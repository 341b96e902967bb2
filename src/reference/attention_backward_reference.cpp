// Reference attention backward (see attention_backward_reference.hpp).
//
// The forward, per (b, h, i) and visible key j (reference_forward):
//   (1) s_ij  = scale · q_i·k_j
//   (2) c_ij  = cap · tanh(s_ij / cap)            (softcap; else c = s)
//   (3) t_ij  = c_ij + alibi_ij + mask_ij
//   (4) u_ij  = score_mod(t_ij)                   (user; else u = t)
//   (5) P_ij  = exp(u_ij − lse_i),  lse_i = log Σ_j exp(u_ij)
//   (6) P'_ij = P_ij · z_ij / (1 − p)             (dropout; z ∈ {0, 1}; else P' = P)
//   (7) O_i   = Σ_j P'_ij v_j
#include "attention_backward_reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../dropout/philox.hpp"
#include "attention_reference.hpp"

namespace attn::detail {

template <class T>
void reference_backward(const BackwardProblem& bp, T* dq, T* dk, T* dv, T* dbias,
                        size_t dq_span, size_t dk_span, size_t dv_span, size_t dbias_span) {
  const Problem& p = bp.fwd;
  std::fill(dq, dq + dq_span, T(0));
  std::fill(dk, dk + dk_span, T(0));
  std::fill(dv, dv + dv_span, T(0));
  if (dbias != nullptr) std::fill(dbias, dbias + dbias_span, T(0));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const DropoutRng dropout(p.dropout_p, p.seed, p.offset, p.Hq);
  const T keep_p = T(1) - static_cast<T>(p.dropout_p);
  const T scale = static_cast<T>(p.scale), cap = static_cast<T>(p.softcap);

  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[static_cast<size_t>(b)];
    std::vector<T> s(seq.Lk), t(seq.Lk), u(seq.Lk), prob(seq.Lk), dprob(seq.Lk);
    for (int h = 0; h < p.Hq; ++h) {
      const int hk = h / p.group();
      const float* q = p.q + seq.q_offset + h * p.q_head;
      const float* k = p.k + seq.k_offset + hk * p.k_head;
      const float* v = p.v + seq.v_offset + hk * p.v_head;
      const float* dout = bp.dout + seq.dout_offset + h * bp.dout_head;
      T* dqh = dq + seq.dq_offset + h * bp.dq_head;
      T* dkh = dk + seq.dk_offset + hk * bp.dk_head;
      T* dvh = dv + seq.dv_offset + hk * bp.dv_head;
      for (int i = 0; i < seq.Lq; ++i) {
        // Recompute the forward of row i: (1)–(5).
        T max_u = neg_inf;
        for (int j = 0; j < seq.Lk; ++j) {
          u[j] = neg_inf;
          if (!reference_visible(p, b, h, i, j)) continue;
          T dot = 0;
          for (int c = 0; c < p.d; ++c) dot += T(q[i * p.q_row + c]) * T(k[j * p.k_row + c]);
          s[j] = scale * dot;
          t[j] = p.softcap > 0 ? cap * std::tanh(s[j] / cap) : s[j];
          if (p.alibi != nullptr) {
            t[j] -= T(p.alibi[b * p.alibi_b + h * p.alibi_h]) * T(std::abs(i + seq.Lk - seq.Lq - j));
          }
          if (p.add_mask != nullptr) {
            t[j] += T(p.add_mask[b * p.mask_b + h * p.mask_h + i * p.mask_i + j * p.mask_j]);
          }
          u[j] = t[j];
          if (p.mods != nullptr && t[j] != neg_inf) {
            u[j] = p.mods->mask(p.mods->ctx, b, h, i, j)
                       ? T(p.mods->score(p.mods->ctx, double(t[j]), b, h, i, j))
                       : neg_inf;
          }
          // NaN makes the max, and so the row, NaN (std::max would skip it).
          max_u = std::isnan(u[j]) || std::isnan(max_u) ? std::numeric_limits<T>::quiet_NaN()
                                                        : std::max(max_u, u[j]);
        }
        if (max_u == neg_inf) continue;  // no visible key: output 0, zero gradients
        T sum = 0;
        for (int j = 0; j < seq.Lk; ++j) sum += (prob[j] = u[j] == neg_inf ? T(0) : std::exp(u[j] - max_u));
        for (int j = 0; j < seq.Lk; ++j) prob[j] /= sum;  // (5): P_ij

        // D_i = Σ_j P_ij · dP_ij, the softmax backward's row term.
        T D = 0;
        for (int j = 0; j < seq.Lk; ++j) {
          if (u[j] == neg_inf) {  // removed: takes no part (its v, dO products unread)
            dprob[j] = 0;
            continue;
          }
          const T kept = p.dropout_p > 0 ? (dropout.keep(b, h, i, j) ? T(1) / keep_p : T(0)) : T(1);
          // (7) O_i += P'_ij v_j, so dP'_ij = dO_i·v_j and dv_j += P'_ij dO_i.
          T dp = 0;
          for (int c = 0; c < p.dv; ++c) {
            dp += T(dout[i * bp.dout_row + c]) * T(v[j * p.v_row + c]);
            dvh[j * bp.dv_row + c] += prob[j] * kept * T(dout[i * bp.dout_row + c]);
          }
          // (6) P'_ij = P_ij · kept, so dP_ij = dP'_ij · kept.
          dprob[j] = dp * kept;
          D += prob[j] * dprob[j];
        }
        for (int j = 0; j < seq.Lk; ++j) {
          if (u[j] == neg_inf) continue;
          // (5) softmax: du_ij = P_ij (dP_ij − D_i).
          T g = prob[j] * (dprob[j] - D);
          // (4) u = score_mod(t): dt = du · score_mod'(t).
          if (p.mods != nullptr && p.mods->score_grad != nullptr) {
            g *= T(p.mods->score_grad(p.mods->ctx, double(t[j]), b, h, i, j));
          }
          // (3) t = c + alibi + mask: dmask = dt (summed over broadcast dims by stride 0).
          if (dbias != nullptr) {
            dbias[b * bp.dbias_b + h * bp.dbias_h + i * bp.dbias_i + j * bp.dbias_j] += g;
          }
          // (2) c = cap·tanh(s/cap): ds = dc · (1 − tanh²(s/cap)).
          if (p.softcap > 0) {
            const T th = std::tanh(s[j] / cap);
            g *= T(1) - th * th;
          }
          // (1) s = scale · q_i·k_j: dq_i += scale·ds·k_j, dk_j += scale·ds·q_i.
          for (int c = 0; c < p.d; ++c) {
            dqh[i * bp.dq_row + c] += scale * g * T(k[j * p.k_row + c]);
            dkh[j * bp.dk_row + c] += scale * g * T(q[i * p.q_row + c]);
          }
        }
      }
    }
  }
}

template void reference_backward<double>(const BackwardProblem&, double*, double*, double*, double*,
                                         size_t, size_t, size_t, size_t);
template void reference_backward<float>(const BackwardProblem&, float*, float*, float*, float*,
                                        size_t, size_t, size_t, size_t);

}  // namespace attn::detail
