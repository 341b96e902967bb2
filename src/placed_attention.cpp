// Attention over a block of a longer sequence (see placed_attention.hpp): the checks
// and dispatch of attention(), with the placement written into the Problem that the
// kernels read (Problem.q_pos0, k_pos0, h0, heads_total; Sequence.Lk, align).
#include "placed_attention.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "attention_lowp.hpp"
#include "cpu/attention_backward.hpp"
#include "cpu/attention_backward_amx.hpp"
#include "problem.hpp"

namespace attn::detail {
namespace {

void check_options(const char* fn, const AttentionOptions& o) {
  auto fail = [fn](const char* what) { throw Error(std::string(fn) + ": " + what); };
  if (!o.key_lengths.empty()) fail("key_lengths belong in the Placement, not in the options");
  if (!o.cu_seqlens_q.empty() || !o.cu_seqlens_k.empty()) fail("packed sequences (cu_seqlens) cannot be placed");
  if (!o.mask.empty()) fail("a mask cannot be placed (its columns are those of one call)");
  if (!o.block_mask.empty()) fail("a block_mask cannot be placed (its blocks are those of one call)");
}

// Writes the placement into the problem: global positions for the band, ALiBi and
// dropout, and per sequence the keys of this block in use and the alignment.
void place(Problem& p, const Placement& w, const char* fn) {
  if (!w.key_lengths.empty() && static_cast<int>(w.key_lengths.size()) != p.B) {
    throw Error(std::string(fn) + ": the placement has " + std::to_string(w.key_lengths.size()) +
                " key lengths for a batch of " + std::to_string(p.B));
  }
  p.q_pos0 = w.q_pos0;
  p.k_pos0 = w.k_pos0;
  p.h0 = w.h0;
  p.heads_total = w.heads_total > 0 ? w.heads_total : p.Hq;
  for (int b = 0; b < p.B; ++b) {
    Sequence& s = p.seqs[static_cast<size_t>(b)];
    const int64_t keys = w.key_lengths.empty() ? w.Lk_total : w.key_lengths[static_cast<size_t>(b)];
    s.Lk = static_cast<int>(std::clamp<int64_t>(keys - w.k_pos0, 0, s.Lk_rows));
    s.align = keys - w.Lq_total;
  }
}

}  // namespace

void attention_placed(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& lse, const AttentionOptions& options, const Placement& where) {
  const char* fn = "attention_placed";
  check_options(fn, options);
  if (lse.empty()) throw Error(std::string(fn) + ": lse is required");
  // out stays f32 whatever the inputs' dtype (out_f32): both kernels write it so, and
  // read bf16/f16 inputs where they pack them, so no input is copied.
  Problem p = make_problem(fn, q, k, v, out, options, lse, {}, nullptr, /*on_device=*/false, /*out_f32=*/true);
  place(p, where, fn);
  forward_on_tiles(p, forward_tiles_path(p, options), num_threads());
}

void attention_backward_placed(const TensorView& q, const TensorView& k, const TensorView& v,
                               const TensorView& out, const TensorView& lse, const TensorView& dout,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const AttentionOptions& options, const Placement& where) {
  const char* fn = "attention_backward_placed";
  check_options(fn, options);
  // The gradients stay f32 (contributions are summed before rounding): the kernels
  // write them so (grads_f32), and read bf16/f16 inputs where they pack them, as
  // attention_backward does, so no input is copied.
  // out may be the f32 output of bf16/f16 inputs (wide_out): D is then read from it.
  BackwardProblem bp = make_backward_problem(fn, q, k, v, out, lse, dout, dq, dk, dv, options, {}, nullptr,
                                             /*on_device=*/false, /*grads_f32=*/true, wide_out(q, out));
  place(bp.fwd, where, fn);
  if (needs_widening(bp.fwd, options)) {
    if (const LowpPath path = lowp_kernel(bp.fwd, options, LowpPass::backward); path != LowpPath::f32) {
      if (attention_backward_amx(bp, num_threads(), path)) return;
      // Declined (see attention_backward_amx.hpp): the portable path.
    }
  }
  attention_backward_cpu(bp, num_threads());
}

}  // namespace attn::detail
