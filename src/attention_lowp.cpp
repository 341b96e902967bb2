// The widening path for bf16/f16 inputs and Precision::bf16 (see attention_lowp.hpp).
#include "attention_lowp.hpp"

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "cpu/workspace.hpp"
#include "tensor/convert.hpp"

namespace attn::detail {

namespace {

bool is_lowp(DType t) { return t == DType::bf16 || t == DType::f16; }

// Where one call's f32 copies live: consecutive pieces of the calling thread's
// reusable scratch. On these machines the first touch of freshly mapped pages costs
// more than the conversion itself: with a new std::vector per copy, page faults took
// ~8% of a bf16 backward on the portable path. (The kernels the copies are handed to
// use other scratch slots; none of them widens again.)
class CopyArena {
 public:
  explicit CopyArena(size_t floats) : next_(thread_scratch(kSlotWidened, floats)), left_(floats) {}
  float* take(const TensorView& t) {
    const size_t n = floats_of(t);
    if (n > left_) throw std::logic_error("CopyArena: more copies than counted");
    float* at = next_;
    next_ += n, left_ -= n;
    return at;
  }
  static size_t floats_of(const TensorView& t) { return static_cast<size_t>(t.empty() ? 0 : t.numel()); }

 private:
  float* next_;
  size_t left_;
};

// An f32 copy of a tensor (rounded to bf16 with round_bf16) and a contiguous view of it.
struct Widened {
  float* data = nullptr;
  TensorView view;
  Widened() = default;
  Widened(CopyArena& arena, const TensorView& t, bool round_bf16) : data(arena.take(t)) {
    to_f32_contiguous(t, data, round_bf16);
    view = contiguous_f32_view(data, t);
  }
  // A zeroed f32 buffer shaped like t (for outputs).
  static Widened output_like(CopyArena& arena, const TensorView& t) {
    Widened w;
    w.data = arena.take(t);
    std::fill(w.data, w.data + CopyArena::floats_of(t), 0.0f);
    w.view = contiguous_f32_view(w.data, t);
    return w;
  }
};

bool lowp_mask(const AttentionOptions& options) { return !options.mask.empty() && is_lowp(options.mask.dtype()); }

// The options with an f32 mask in place of a bf16/f16 one, and precision consumed.
AttentionOptions widen_options(CopyArena& arena, const AttentionOptions& options, Widened& mask) {
  AttentionOptions o = options;
  o.precision = Precision::f32;
  if (lowp_mask(options)) {
    mask = Widened(arena, options.mask, false);
    o.mask = mask.view;
  }
  return o;
}

}  // namespace

bool needs_widening(const Problem& p, const AttentionOptions& options) {
  return is_lowp(p.dtype) || is_lowp(p.mask_dtype) || (p.dtype == DType::f32 && options.precision != Precision::f32);
}

size_t mask_widening_bytes(const AttentionOptions& options) {
  return lowp_mask(options) ? sizeof(float) * options.mask.numel() : 0;
}

AttentionOptions with_f32_mask(const AttentionOptions& options, std::vector<float>& storage) {
  AttentionOptions o = options;
  if (lowp_mask(options)) {
    storage = to_f32_contiguous(options.mask);
    o.mask = contiguous_f32_view(storage.data(), options.mask);
  }
  return o;
}

void forward_widened(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const AttentionOptions& options, const ForwardF32& compute) {
  const bool round = q.dtype() == DType::f32 && options.precision == Precision::bf16;
  size_t floats = lowp_mask(options) ? CopyArena::floats_of(options.mask) : 0;
  for (const TensorView* t : {&q, &k, &v, &out}) floats += CopyArena::floats_of(*t);
  CopyArena arena(floats);
  const Widened wq(arena, q, round), wk(arena, k, round), wv(arena, v, round);
  Widened wout = Widened::output_like(arena, out), wmask;
  const AttentionOptions o = widen_options(arena, options, wmask);
  compute(wq.view, wk.view, wv.view, wout.view, o);
  from_f32_contiguous(wout.data, out);
}

void backward_widened(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const AttentionOptions& options, const BackwardF32& compute) {
  const bool round = q.dtype() == DType::f32 && options.precision == Precision::bf16;
  size_t floats = lowp_mask(options) ? CopyArena::floats_of(options.mask) : 0;
  for (const TensorView* t : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) floats += CopyArena::floats_of(*t);
  CopyArena arena(floats);
  const Widened wq(arena, q, round), wk(arena, k, round), wv(arena, v, round), wout(arena, out, false),
      wdout(arena, dout, false);
  Widened wdq = Widened::output_like(arena, dq), wdk = Widened::output_like(arena, dk),
          wdv = Widened::output_like(arena, dv), wmask;
  const AttentionOptions o = widen_options(arena, options, wmask);
  compute(wq.view, wk.view, wv.view, wout.view, wdout.view, wdq.view, wdk.view, wdv.view, o);
  from_f32_contiguous(wdq.data, dq);
  from_f32_contiguous(wdk.data, dk);
  from_f32_contiguous(wdv.data, dv);
}

}  // namespace attn::detail
