// Public entry points: check the arguments, then run the fused kernel or the
// float64 reference.
#include <algorithm>
#include <vector>

#include "attn/attention.hpp"
#include "attention_lowp.hpp"
#include "cpu/attention_backward.hpp"
#include "cpu/attention_backward_amx.hpp"
#include "cpu/attention_forward.hpp"
#include "cpu/attention_forward_amx.hpp"
#include "cpu/isa.hpp"
#include "device.hpp"
#include "kvcache/few_queries.hpp"
#include "problem.hpp"
#include "reference/attention_backward_reference.hpp"
#include "reference/attention_reference.hpp"

namespace attn {
namespace detail {

namespace {

/// The bf16 tile kernels' query and key tiles (kBq, kBk on their AVX-512 target,
/// static_asserted in attention_forward_amx.cc and attention_backward_amx.cc).
constexpr int64_t kLowpTile = 64;

/// Whether the vdpbf16ps tile kernels would spend a call mostly on padding: its
/// scores fill less than `fill` of the 64×64 tile pairs they are computed on. Those
/// kernels compute whole tiles (all five backward products on them), where the f32
/// kernel's work follows the rows and keys there are. Measured on Zen 4
/// (docs/PERFORMANCE.md, "Short bf16 calls on the f32 kernel" and "The bf16 backward
/// on the f32 kernel without copies"), 1 and 2 threads:
///  - backward, any shape: the f32 path took 0.34–0.87× the time up to a quarter of
///    the pairs (1–16 queries against 1,024–4,096 keys, the same transposed, and one
///    tile pair), 0.68–1.06× at 0.375–0.39 (2 rows of 28 over 1.0×), 0.88–1.14× at a
///    half and 0.94–1.63× from 0.56 on;
///  - forward, every sequence in one tile pair (Lq, Lk ≤ 64): it gained only below a
///    twentieth (0.6–0.8×) and lost from 8·32 on; with 4,096 keys it lost at every
///    Lq from 1 to 16 (1.17–1.50×).
bool TilesMostlyPadding(const Problem& p, LowpPass pass) {
  const double fill = pass == LowpPass::backward ? 0.4 : 0.05;
  double scores = 0.0, tile_scores = 0.0;
  for (const Sequence& s : p.seqs) {
    if (pass == LowpPass::forward && (s.Lq > kLowpTile || s.Lk > kLowpTile)) return false;
    if (s.Lq == 0 || s.Lk == 0) continue;
    scores += static_cast<double>(s.Lq) * s.Lk;
    tile_scores += static_cast<double>(kLowpTile * ((s.Lq + kLowpTile - 1) / kLowpTile)) * kLowpTile *
                   ((s.Lk + kLowpTile - 1) / kLowpTile);
  }
  return scores < fill * tile_scores;
}

}  // namespace

// bf16 (or f32 rounded to bf16) runs on AMX tiles or vdpbf16ps when the CPU has
// them, f16 on AMX tiles only; explicit probabilities take the portable path (see
// cpu/isa.hpp).
LowpPath lowp_kernel(const Problem& p, const AttentionOptions& options, LowpPass pass) {
  if (!needs_widening(p, options) || p.probs != nullptr) return LowpPath::f32;
  const LowpPath path = lowp_path();
  // Two pieces (f16, and f32 with Precision::bf16x3) take three products each: only
  // the tile unit makes that pay.
  if (p.pieces() == 2) return path == LowpPath::amx ? LowpPath::amx : LowpPath::f32;
  // AMX: its tiles are several times the f32 kernel's rate, and short calls there are
  // unmeasured, so they keep the tiles.
  if (path == LowpPath::avx512bf16 && !lowp_path_forced() && TilesMostlyPadding(p, pass)) return LowpPath::f32;
  return path;
}

void attention_with_mods(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const AttentionOptions& options,
                         const TensorView& lse, const TensorView& probs, const UserMods* mods) {
  if (q.device().is_cuda()) {
    attention_forward_cuda("attention", q, k, v, out, options, lse, probs, mods);
    return;
  }
  // on_device: the call runs where q is (here the CPU), so that a device tensor among the
  // others is reported as a mix of devices.
  const Problem p =
      make_problem("attention", q, k, v, out, options, lse, probs, mods, /*on_device=*/true, wide_out(q, out));
  // A few queries per sequence (a decoding step given the whole past as k and v): the
  // decode kernel reads k and v in place, where the tiled kernels would pack them all.
  if (attention_few_queries(p, num_threads())) return;
  // The kernels read f32 masks: a bf16/f16 mask is widened (it is one copy, read
  // once per tile), then the call starts again.
  if (p.mask_dtype == DType::bf16 || p.mask_dtype == DType::f16) {
    std::vector<float> mask32;
    const AttentionOptions o = with_f32_mask(options, mask32);
    attention_with_mods(q, k, v, out, o, lse, probs, mods);
    return;
  }
  forward_on_tiles(p, forward_tiles_path(p, options), num_threads());
}

LowpPath forward_tiles_path(const Problem& p, const AttentionOptions& options) {
  return needs_widening(p, options) ? lowp_kernel(p, options, LowpPass::forward) : LowpPath::f32;
}

void forward_on_tiles(const Problem& p, LowpPath path, int threads) {
  if (path != LowpPath::f32 && attention_forward_amx(p, threads, path)) return;
  // The portable path, also where the tile kernel declined (a NaN or ±∞ in q, k or v:
  // the portable path's exact semantics): the f32 kernel widens bf16/f16 rows in its
  // packing step, rounds f32 inputs to bf16 there under Precision::bf16, and takes f32
  // inputs with Precision::bf16x3 as they are (more accurate than asked).
  attention_forward_cpu(p, threads);
}

namespace {

// Number of elements from a view's first element to its last, inclusive.
int64_t span(const TensorView& t) {
  if (t.empty() || t.numel() == 0) return 0;
  int64_t last = 0;
  for (int i = 0; i < t.rank(); ++i) last += (t.size(i) - 1) * t.stride(i);
  return last + 1;
}

// Calls visit(at) with the offset of every element of `view`, through its strides.
template <class Visit>
void for_each_offset(const TensorView& view, Visit visit) {
  if (view.empty() || view.numel() == 0) return;
  std::vector<int64_t> idx(static_cast<size_t>(view.rank()), 0);
  for (int64_t n = 0; n < view.numel(); ++n) {
    int64_t at = 0;
    for (int i = 0; i < view.rank(); ++i) at += idx[static_cast<size_t>(i)] * view.stride(i);
    visit(at);
    for (int i = view.rank() - 1; i >= 0; --i) {
      if (++idx[static_cast<size_t>(i)] < view.size(i)) break;
      idx[static_cast<size_t>(i)] = 0;
    }
  }
}

// Copies a float64 buffer laid out like `view` into the view (f32), element by
// element through the view's strides.
void round_into(const TensorView& view, const std::vector<double>& src) {
  if (view.empty()) return;
  float* dst = view.data_as<float>();
  for_each_offset(view, [&](int64_t at) { dst[at] = static_cast<float>(src[static_cast<size_t>(at)]); });
}

// Sets every element of an f32 view to 0 through its strides.
void zero_view(const TensorView& view) {
  if (view.empty()) return;
  float* dst = view.data_as<float>();
  for_each_offset(view, [&](int64_t at) { dst[at] = 0.0f; });
}

}  // namespace

void attention_reference_with_mods(const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& out,
                                   const AttentionOptions& options, const TensorView& lse,
                                   const TensorView& probs, const UserMods* mods) {
  const Problem p =
      make_problem("attention_reference", q, k, v, out, options, lse, probs, mods, false, wide_out(q, out));
  if (needs_widening(p, options)) {
    forward_widened(q, k, v, out, options, [&](auto& q32, auto& k32, auto& v32, auto& out32, auto& o) {
      attention_reference_with_mods(q32, k32, v32, out32, o, lse, probs, mods);
    });
    return;
  }
  std::vector<double> o(static_cast<size_t>(span(out))), l(static_cast<size_t>(span(lse))),
      pr(static_cast<size_t>(span(probs)));
  reference_forward<double>(p, o.data(), lse.empty() ? nullptr : l.data(),
                            probs.empty() ? nullptr : pr.data());
  round_into(out, o);
  round_into(lse, l);
  round_into(probs, pr);
}

void attention_backward_with_mods(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options, const TensorView& dbias,
                                  const UserMods* mods) {
  if (q.device().is_cuda()) {
    attention_backward_cuda("attention_backward", q, k, v, out, lse, dout, dq, dk, dv, options, dbias, mods);
    return;
  }
  // on_device: the call runs where q is (the CPU), so that a device tensor among the
  // others is reported as a mix of devices.
  const BackwardProblem bp = make_backward_problem("attention_backward", q, k, v, out, lse, dout, dq, dk, dv, options,
                                                   dbias, mods, /*on_device=*/true, false, wide_out(q, out));
  if (needs_widening(bp.fwd, options)) {
    // The kernels read f32 masks: a bf16/f16 mask is widened (one copy, read once per
    // tile), then the call starts again.
    if (bp.fwd.mask_dtype == DType::bf16 || bp.fwd.mask_dtype == DType::f16) {
      std::vector<float> mask32;
      const AttentionOptions o = with_f32_mask(options, mask32);
      attention_backward_with_mods(q, k, v, out, lse, dout, dq, dk, dv, o, dbias, mods);
      return;
    }
    if (const LowpPath path = lowp_kernel(bp.fwd, options, LowpPass::backward); path != LowpPath::f32) {
      if (attention_backward_amx(bp, num_threads(), path)) return;
      // Declined (see attention_backward_amx.hpp): the portable path.
    }
    // The portable path: the f32 kernel widens bf16/f16 rows where it packs them and
    // rounds the gradients where it writes them (f32 rows under Precision::bf16 are
    // rounded to bf16 there), so no tensor is copied.
  }
  if (!dbias.empty()) zero_view(dbias);  // accumulated by the kernel
  attention_backward_cpu(bp, num_threads());
}

void attention_backward_reference_with_mods(const TensorView& q, const TensorView& k,
                                            const TensorView& v, const TensorView& out,
                                            const TensorView& lse, const TensorView& dout,
                                            const TensorView& dq, const TensorView& dk,
                                            const TensorView& dv, const AttentionOptions& options,
                                            const TensorView& dbias, const UserMods* mods) {
  const BackwardProblem bp = make_backward_problem("attention_backward_reference", q, k, v, out, lse, dout, dq, dk,
                                                   dv, options, dbias, mods, false, false, wide_out(q, out));
  if (needs_widening(bp.fwd, options)) {
    backward_widened(q, k, v, out, dout, dq, dk, dv, options,
                     [&](auto& q32, auto& k32, auto& v32, auto& out32, auto& dout32, auto& dq32, auto& dk32,
                         auto& dv32, auto& o) {
                       attention_backward_reference_with_mods(q32, k32, v32, out32, lse, dout32, dq32, dk32, dv32,
                                                              o, dbias, mods);
                     });
    return;
  }
  std::vector<double> gq(static_cast<size_t>(span(dq))), gk(static_cast<size_t>(span(dk))),
      gv(static_cast<size_t>(span(dv))), gb(static_cast<size_t>(span(dbias)));
  reference_backward<double>(bp, gq.data(), gk.data(), gv.data(), dbias.empty() ? nullptr : gb.data(),
                             gq.size(), gk.size(), gv.size(), gb.size());
  round_into(dq, gq);
  round_into(dk, gk);
  round_into(dv, gv);
  round_into(dbias, gb);
}

}  // namespace detail

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse, const TensorView& dout,
                        const TensorView& dq, const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options, const TensorView& dbias) {
  detail::attention_backward_with_mods(q, k, v, out, lse, dout, dq, dk, dv, options, dbias, nullptr);
}

void attention_backward_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                                  const TensorView& out, const TensorView& lse,
                                  const TensorView& dout, const TensorView& dq,
                                  const TensorView& dk, const TensorView& dv,
                                  const AttentionOptions& options, const TensorView& dbias) {
  detail::attention_backward_reference_with_mods(q, k, v, out, lse, dout, dq, dk, dv, options,
                                                 dbias, nullptr);
}

void attention(const TensorView& q, const TensorView& k, const TensorView& v,
               const TensorView& out, const AttentionOptions& options, const TensorView& lse,
               const TensorView& probs) {
  detail::attention_with_mods(q, k, v, out, options, lse, probs, nullptr);
}

size_t attention_workspace_bytes(const TensorView& q, const TensorView& k, const TensorView& v,
                                 const TensorView& out, const AttentionOptions& options,
                                 int threads) {
  const detail::Problem p =
      detail::make_problem("attention_workspace_bytes", q, k, v, out, options, {}, {}, nullptr, false,
                           detail::wide_out(q, out));
  // The bf16 kernels' packed operands replace the f32 copies (they decline only
  // inputs holding NaN or ±∞, which then take the portable path's copies).
  if (detail::lowp_kernel(p, options, detail::LowpPass::forward) != detail::LowpPath::f32) {
    return detail::attention_forward_amx_workspace_bytes(p, threads);
  }
  // The f32 kernel widens bf16/f16 inputs and rounds f32 ones under Precision::bf16
  // as it packs them; only a bf16/f16 mask is copied.
  return detail::attention_forward_workspace_bytes(p, threads) + detail::mask_widening_bytes(options);
}

size_t attention_backward_workspace_bytes(const TensorView& q, const TensorView& k, const TensorView& v,
                                          const TensorView& out, const TensorView& lse, const TensorView& dout,
                                          const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                          const AttentionOptions& options, int threads, const TensorView& dbias) {
  const detail::BackwardProblem bp = detail::make_backward_problem(
      "attention_backward_workspace_bytes", q, k, v, out, lse, dout, dq, dk, dv, options, dbias, nullptr, false, false,
      detail::wide_out(q, out));
  // The f32 kernel's bytes depend on the shapes only: it widens bf16/f16 rows (and
  // rounds f32 ones under Precision::bf16) as it packs them.
  const size_t f32_kernel = detail::attention_backward_workspace_bytes_cpu(bp.fwd, threads);
  if (!detail::needs_widening(bp.fwd, options)) return f32_kernel;
  if (const detail::LowpPath path = detail::lowp_kernel(bp.fwd, options, detail::LowpPass::backward);
      path != detail::LowpPath::f32 && !detail::amx_backward_declines_options(bp, path)) {
    return detail::attention_backward_amx_workspace_bytes(bp, threads) + detail::mask_widening_bytes(options);
  }
  return f32_kernel + detail::mask_widening_bytes(options);  // only a bf16/f16 mask is copied
}

void attention_reference(const TensorView& q, const TensorView& k, const TensorView& v,
                         const TensorView& out, const AttentionOptions& options,
                         const TensorView& lse, const TensorView& probs) {
  detail::attention_reference_with_mods(q, k, v, out, options, lse, probs, nullptr);
}

}  // namespace attn
