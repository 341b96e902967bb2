// Which (query segment, key segment) pairs of a distributed attention can see each
// other, from the options alone (causal, window, key lengths), and so how many ring
// steps the call needs. Every rank derives the same answer from the same World.
#pragma once

#include <cstdint>

#include "attn/attention.hpp"
#include "dist/agreement.hpp"

namespace attn::dist::detail {

class RingSchedule {
 public:
  RingSchedule(const World& w, const AttentionOptions& o);

  /// False only when no query of qs can see any key of ks in any sequence of the
  /// batch (then the pair's kernel call would return nothing and is skipped).
  bool may_attend(const Segment& qs, const Segment& ks) const;

  /// The last ring step any rank needs (0 … R − 1): at step t rank r attends to the
  /// block of rank r − t; later steps are not taken.
  int last_step = 0;

 private:
  const AttentionOptions& o_;
  int64_t keys_max_;              // the most keys any sequence uses
  int64_t align_min_, align_max_; // bottom-right shifts (key length − L) over the batch
};

}  // namespace attn::dist::detail
