// Reference attention forward (see attention_reference.hpp).
#include "attention_reference.hpp"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../dropout/philox.hpp"

namespace attn::detail {

bool reference_visible(const Problem& p, int b, int h, int i, int j) {
  const Sequence& s = p.seqs[static_cast<size_t>(b)];
  if (j < 0 || j >= s.Lk) return false;
  // i aligned to the bottom-right corner; in 64 bits, as windows reach INT_MAX.
  const int64_t shifted_i = int64_t{i} + s.Lk - s.Lq;
  if (p.causal == Causal::TopLeft && j > i) return false;
  if (p.causal == Causal::BottomRight && j > shifted_i) return false;
  if (p.window_left >= 0 && j < shifted_i - p.window_left) return false;
  if (p.window_right >= 0 && j > shifted_i + p.window_right) return false;
  if (p.bool_mask != nullptr) {
    const int64_t at = b * p.mask_b + h * p.mask_h + i * p.mask_i + j * p.mask_j;
    if (p.bool_mask[at] == 0) return false;
  }
  if (p.bm_blocks != nullptr) {
    const int32_t e = p.BlockEntry(b, h, i, j);
    if (e == BlockMask::kEmpty) return false;
    if (e >= 0 && p.bm_tiles[e * p.bm_t + (i % p.bm_bq) * p.bm_r + j % p.bm_bk] == 0) return false;
  }
  return true;
}

template <class T>
void reference_forward(const Problem& p, T* out, T* lse, T* probs) {
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const DropoutRng dropout(p.dropout_p, p.seed, p.offset, p.Hq);
  const T keep_p = T(1) - static_cast<T>(p.dropout_p);
  for (int b = 0; b < p.B; ++b) {
    const Sequence& seq = p.seqs[static_cast<size_t>(b)];
    for (int h = 0; h < p.Hq; ++h) {
      const int hk = h / p.group();
      const float* q = p.q + seq.q_offset + h * p.q_head;
      const float* k = p.k + seq.k_offset + hk * p.k_head;
      const float* v = p.v + seq.v_offset + hk * p.v_head;
      // Rows are independent, so they may run on several threads (the tests' long
      // sequences take minutes on one core); not with user modifiers, which need not be
      // thread-safe (a Python mask_mod holds the GIL).
#pragma omp parallel if (p.mods == nullptr && int64_t{seq.Lq} * seq.Lk * p.d >= (int64_t{1} << 22))
      {
      std::vector<T> score(static_cast<size_t>(seq.Lk));
      std::vector<char> removed(static_cast<size_t>(seq.Lk));
      std::vector<T> acc(static_cast<size_t>(p.dv));
#pragma omp for schedule(static)
      for (int i = 0; i < seq.Lq; ++i) {
        // 1. Scores, modified and masked; −∞ marks a removed key.
        T max_score = neg_inf;
        for (int j = 0; j < seq.Lk; ++j) {
          T s = neg_inf;
          if (reference_visible(p, b, h, i, j)) {
            T dot = 0;
            for (int c = 0; c < p.d; ++c) {
              dot += static_cast<T>(q[i * p.q_row + c]) * static_cast<T>(k[j * p.k_row + c]);
            }
            s = static_cast<T>(p.scale) * dot;
            if (p.softcap > 0) {
              const T cap = static_cast<T>(p.softcap);
              s = cap * std::tanh(s / cap);
            }
            if (p.alibi != nullptr) {
              const T slope = static_cast<T>(p.alibi[b * p.alibi_b + h * p.alibi_h]);
              s -= slope * static_cast<T>(std::abs(i + seq.Lk - seq.Lq - j));
            }
            if (p.add_mask != nullptr) {
              s += static_cast<T>(p.add_mask[b * p.mask_b + h * p.mask_h + i * p.mask_i +
                                             j * p.mask_j]);
            }
            if (p.mods != nullptr && s != neg_inf) {
              if (!p.mods->mask(p.mods->ctx, b, h, i, j)) {
                s = neg_inf;
              } else {
                s = static_cast<T>(p.mods->score(p.mods->ctx, static_cast<double>(s), b, h, i, j));
              }
            }
          }
          score[static_cast<size_t>(j)] = s;
          removed[static_cast<size_t>(j)] = s == neg_inf;
          // NaN anywhere makes the max, and so the whole row, NaN (a plain
          // `s > max` would skip it).
          if (std::isnan(s) || std::isnan(max_score)) {
            max_score = std::numeric_limits<T>::quiet_NaN();
          } else if (s > max_score) {
            max_score = s;
          }
        }

        // 2. Softmax over the visible keys (lse is that of the scores before
        //    dropout), dropout on the probabilities, weighted sum of the values.
        T row_lse = neg_inf;
        for (T& a : acc) a = 0;
        if (max_score != neg_inf) {
          T sum = 0;
          for (int j = 0; j < seq.Lk; ++j) {
            // A removed key's probability is 0 whatever the max (even +∞ or NaN).
            const T e = removed[static_cast<size_t>(j)] ? T(0) : std::exp(score[static_cast<size_t>(j)] - max_score);
            score[static_cast<size_t>(j)] = e;
            sum += e;
          }
          row_lse = max_score + std::log(sum);
          for (int j = 0; j < seq.Lk; ++j) {
            T& prob = score[static_cast<size_t>(j)];
            prob /= sum;
            // Removed keys take no part: their values are never read, so a NaN
            // or ∞ there cannot reach the output (0·NaN would).
            if (removed[static_cast<size_t>(j)]) continue;
            // Dropout multiplies (as PyTorch's does): a dropped NaN stays NaN.
            if (p.dropout_p > 0) prob *= dropout.keep(b, h, i, j) ? T(1) / keep_p : T(0);
            for (int c = 0; c < p.dv; ++c) acc[static_cast<size_t>(c)] += prob * static_cast<T>(v[j * p.v_row + c]);
          }
        } else {
          for (T& s : score) s = 0;  // no visible key: output 0, lse −∞
        }

        // 3. Outputs.
        if (out != nullptr) {
          T* o = out + seq.out_offset + i * p.out_row + h * p.out_head;
          for (int c = 0; c < p.dv; ++c) o[c] = acc[static_cast<size_t>(c)];
        }
        if (lse != nullptr) lse[seq.lse_offset + h * p.lse_h + i * p.lse_i] = row_lse;
        if (probs != nullptr) {
          T* pr = probs + seq.probs_offset + h * p.probs_h + i * p.probs_i;
          for (int j = 0; j < p.probs_cols; ++j) {
            pr[j] = j < seq.Lk ? score[static_cast<size_t>(j)] : T(0);
          }
        }
      }
      }  // omp parallel
    }
  }
}

template void reference_forward<double>(const Problem&, double*, double*, double*);
template void reference_forward<float>(const Problem&, float*, float*, float*);

}  // namespace attn::detail
