// Attention over a block of a longer sequence, with the rules of the whole sequence:
// the building block of ring attention (a rank's queries against one key/value block
// at a time) and of head-parallel attention (a slice of the heads). Causal and window
// bands, ALiBi distances and dropout decisions are those of one call over the whole
// sequence, so the blocks' results, merged by their log-sum-exps, are that call's.
// Internal (src/dist/ uses it); not a public entry point.
#pragma once

#include <cstdint>
#include <vector>

#include "attn/attention.hpp"

namespace attn::detail {

/// Where the block sits. Query row i of the block is position q_pos0 + i of a
/// sequence of Lq_total queries; key row j is position k_pos0 + j of Lk_total keys.
struct Placement {
  int64_t q_pos0 = 0, k_pos0 = 0;
  int64_t Lq_total = 0, Lk_total = 0;
  /// Per batch, the keys in use in the whole sequence (options.key_lengths of the
  /// whole call); empty = Lk_total. Alignment (causal BottomRight, window) uses it.
  std::vector<int32_t> key_lengths;
  /// Query head h of the block is head h0 + h of heads_total (0 = the block's Hq).
  int h0 = 0, heads_total = 0;
};

/// attention() for the block: q [B, Lq, Hq, d], k [B, Lk, Hkv, d], v [B, Lk, Hkv, dv]
/// in one dtype (f32, bf16, f16). out [B, Lq, Hq, dv] is f32 (whatever the inputs'
/// dtype: partial results are merged before rounding); lse [B, Hq, Lq] f32 is
/// required (the merge needs it). options must not hold key_lengths (they are in
/// `where`), cu_seqlens, mask or user modifiers. Throws attn::Error on bad arguments.
void attention_placed(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& lse, const AttentionOptions& options, const Placement& where);

/// attention_backward() for the block, given the whole call's out and lse rows of
/// these queries (q's rows) and dout: writes this block's contribution to dq and its
/// keys' dk, dv. dq, dk, dv are f32 whatever the inputs' dtype (contributions are
/// summed before rounding); q, k, v, out, dout share one dtype.
void attention_backward_placed(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& lse, const TensorView& dout,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options, const Placement& where);

}  // namespace attn::detail
