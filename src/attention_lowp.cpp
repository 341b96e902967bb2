// The widening path for bf16/f16 inputs and Precision::bf16 (see attention_lowp.hpp).
#include "attention_lowp.hpp"

#include <vector>

#include "tensor/convert.hpp"

namespace attn::detail {

namespace {

bool is_lowp(DType t) { return t == DType::bf16 || t == DType::f16; }

// An f32 copy of a tensor and a contiguous view of it.
struct Widened {
  std::vector<float> data;
  TensorView view;
  Widened() = default;
  Widened(const TensorView& t, bool round_bf16) : data(to_f32_contiguous(t, round_bf16)) {
    view = contiguous_f32_view(data.data(), t);
  }
  // A zeroed f32 buffer shaped like t (for outputs).
  static Widened output_like(const TensorView& t) {
    Widened w;
    w.data.assign(static_cast<size_t>(t.numel()), 0.0f);
    w.view = contiguous_f32_view(w.data.data(), t);
    return w;
  }
};

// The options with an f32 mask in place of a bf16/f16 one, and precision consumed.
AttentionOptions widen_options(const AttentionOptions& options, Widened& mask) {
  AttentionOptions o = options;
  o.precision = Precision::f32;
  if (!options.mask.empty() && is_lowp(options.mask.dtype())) {
    mask = Widened(options.mask, false);
    o.mask = mask.view;
  }
  return o;
}

}  // namespace

bool needs_widening(const Problem& p, const AttentionOptions& options) {
  return is_lowp(p.dtype) || is_lowp(p.mask_dtype) || (p.dtype == DType::f32 && options.precision != Precision::f32);
}

size_t mask_widening_bytes(const AttentionOptions& options) {
  return !options.mask.empty() && is_lowp(options.mask.dtype()) ? sizeof(float) * options.mask.numel() : 0;
}

size_t backward_widening_bytes(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& dout, const TensorView& dq, const TensorView& dk,
                               const TensorView& dv, const AttentionOptions& options) {
  int64_t n = 0;
  for (const TensorView* t : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) n += t->numel();
  return static_cast<size_t>(n) * sizeof(float) + mask_widening_bytes(options);
}

AttentionOptions with_f32_mask(const AttentionOptions& options, std::vector<float>& storage) {
  AttentionOptions o = options;
  if (!options.mask.empty() && is_lowp(options.mask.dtype())) {
    storage = to_f32_contiguous(options.mask);
    o.mask = contiguous_f32_view(storage.data(), options.mask);
  }
  return o;
}

void forward_widened(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                     const AttentionOptions& options, const ForwardF32& compute) {
  const bool round = q.dtype() == DType::f32 && options.precision == Precision::bf16;
  const Widened wq(q, round), wk(k, round), wv(v, round);
  Widened wout = Widened::output_like(out), wmask;
  const AttentionOptions o = widen_options(options, wmask);
  compute(wq.view, wk.view, wv.view, wout.view, o);
  from_f32_contiguous(wout.data.data(), out);
}

void backward_widened(const TensorView& q, const TensorView& k, const TensorView& v, const TensorView& out,
                      const TensorView& dout, const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const AttentionOptions& options, const BackwardF32& compute) {
  const bool round = q.dtype() == DType::f32 && options.precision == Precision::bf16;
  const Widened wq(q, round), wk(k, round), wv(v, round), wout(out, false), wdout(dout, false);
  Widened wdq = Widened::output_like(dq), wdk = Widened::output_like(dk), wdv = Widened::output_like(dv), wmask;
  const AttentionOptions o = widen_options(options, wmask);
  compute(wq.view, wk.view, wv.view, wout.view, wdout.view, wdq.view, wdk.view, wdv.view, o);
  from_f32_contiguous(wdq.data.data(), dq);
  from_f32_contiguous(wdk.data.data(), dk);
  from_f32_contiguous(wdv.data.data(), dv);
}

}  // namespace attn::detail
