// Dropout decisions of the fused kernels, at the positions of the whole sequence:
// a call placed inside a longer one (ring or head-parallel attention) draws exactly
// the decisions that one call over the whole sequence would.
#pragma once

#include <cstdint>

#include "dropout/philox.hpp"
#include "problem.hpp"

namespace attn::detail {

/// The generator of a problem's dropout (keyed by seed and offset; heads counted
/// over the whole call, so a head-parallel slice draws its heads' own numbers).
inline DropoutRng dropout_rng(const Problem& p) {
  return DropoutRng(p.dropout_p, p.seed, p.offset, p.heads_total);
}

/// The decisions for this call's keys j..j+3 of query row i, head h, sequence b:
/// bit n set = key j + n kept. One Philox call when the global key position is a
/// multiple of 4 (always, unless the call is placed at an odd key offset).
inline unsigned keep4_at(const DropoutRng& rng, const Problem& p, int b, int h, int i, int j) {
  const int hg = h + p.h0;
  const int ig = static_cast<int>(i + p.q_pos0);
  const int64_t jg = j + p.k_pos0;
  if (jg % 4 == 0) return rng.keep4(b, hg, ig, static_cast<int>(jg / 4));
  unsigned bits = 0;
  for (int n = 0; n < 4; ++n) bits |= unsigned{rng.keep(b, hg, ig, static_cast<int>(jg + n))} << n;
  return bits;
}

}  // namespace attn::detail
