#include "dist/ring_schedule.hpp"

#include <algorithm>

namespace attn::dist::detail {

RingSchedule::RingSchedule(const World& w, const AttentionOptions& o)
    : o_(o), keys_max_(w.length), align_min_(0), align_max_(0) {
  if (!w.key_lengths.empty()) {
    keys_max_ = *std::max_element(w.key_lengths.begin(), w.key_lengths.end());
    align_min_ = *std::min_element(w.key_lengths.begin(), w.key_lengths.end()) - w.length;
    align_max_ = keys_max_ - w.length;
  }
  for (int r = 0; r < w.ranks; ++r) {
    for (int t = 1; t < w.ranks; ++t) {
      for (const Segment& qs : w.segments(r)) {
        for (const Segment& ks : w.segments((r - t + w.ranks) % w.ranks)) {
          if (may_attend(qs, ks)) last_step = std::max(last_step, t);
        }
      }
    }
  }
}

bool RingSchedule::may_attend(const Segment& qs, const Segment& ks) const {
  if (qs.length == 0 || ks.length == 0) return false;
  const int64_t q_first = qs.position, q_last = qs.position + qs.length - 1;
  const int64_t k_first = ks.position, k_last = ks.position + ks.length - 1;
  if (k_first >= keys_max_) return false;
  // The largest key any query of qs may see, and the smallest.
  int64_t last = k_last;
  if (o_.causal == Causal::TopLeft) last = std::min(last, q_last);
  if (o_.causal == Causal::BottomRight) last = std::min(last, q_last + align_max_);
  if (o_.window.right >= 0) last = std::min(last, q_last + align_max_ + o_.window.right);
  if (last < k_first) return false;
  if (o_.window.left >= 0 && q_first + align_min_ - o_.window.left > k_last) return false;
  return true;
}

}  // namespace attn::dist::detail
