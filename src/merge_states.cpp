// merge_attention_states: the exact combination of two attentions over disjoint key
// sets from their outputs and log-sum-exps (see attn/attention.hpp). Split-KV decoding
// and ring attention reduce their partial results with it.
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "tensor/convert.hpp"
#include "tensor/overlap.hpp"
#include "tensor/view_util.hpp"

namespace attn {
namespace {

[[noreturn]] void fail(const std::string& what) { throw Error("merge_attention_states: " + what); }

std::string shape_string(const TensorView& t) { return detail::shape_string(t.shape()); }

double load(const TensorView& t, int64_t at) { return detail::load_f32(t.dtype(), t.data(), at); }

void store(const TensorView& t, int64_t at, double x) {
  detail::store_f32(t.dtype(), t.data(), at, static_cast<float>(x));
}

// Checks the arguments; returns the lse shape that goes with out's.
std::vector<int64_t> check(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                           const TensorView& lse_b, const TensorView& out, const TensorView& lse) {
  if (out_a.empty()) fail("out_a is required, got none");
  if (out_a.rank() != 4 && out_a.rank() != 3) {
    fail("out_a must be [B, L, H, dv] or, for packed sequences, [total, H, dv]; got rank " +
         std::to_string(out_a.rank()) + " " + shape_string(out_a));
  }
  const DType dt = out_a.dtype();
  if (dt != DType::f32 && dt != DType::bf16 && dt != DType::f16) {
    fail(std::string("out_a must have dtype f32, bf16 or f16, got ") + dtype_name(dt));
  }
  std::vector<int64_t> lse_shape;
  if (out_a.rank() == 4) {
    lse_shape = {out_a.size(0), out_a.size(2), out_a.size(1)};
  } else {
    lse_shape = {out_a.size(1), out_a.size(0)};
  }
  const std::string lse_form = out_a.rank() == 4 ? "[B, H, L]" : "[H, total]";
  auto on_cpu = [](const TensorView& t, const char* name) {
    if (!t.device().is_cpu()) {
      fail(std::string(name) + " is on " + t.device().describe() +
           ", but merge_attention_states takes tensors in host memory (device cpu) only");
    }
  };
  auto check_out = [&](const TensorView& t, const char* name) {
    if (t.empty()) fail(std::string(name) + " is required, got none");
    on_cpu(t, name);
    if (t.dtype() != dt) {
      fail(std::string(name) + " must have dtype " + dtype_name(dt) + " (the dtype of out_a), got " +
           dtype_name(t.dtype()));
    }
    if (t.shape() != out_a.shape()) {
      fail(std::string(name) + " must have out_a's shape " + shape_string(out_a) + ", got " + shape_string(t));
    }
    for (int i = 0; i < t.rank(); ++i) {
      if (t.stride(i) < 0) fail(std::string(name) + " has a negative stride");
    }
    if (t.numel() > 0 && t.data() == nullptr) fail(std::string(name) + " has a null data pointer");
  };
  auto check_lse = [&](const TensorView& t, const char* name) {
    if (t.empty()) fail(std::string(name) + " is required, got none");
    on_cpu(t, name);
    if (t.dtype() != DType::f32) fail(std::string(name) + " must have dtype f32, got " + dtype_name(t.dtype()));
    if (t.shape() != lse_shape) {
      fail(std::string(name) + " must be " + lse_form + " = " + detail::shape_string(lse_shape) + " for out_a " +
           shape_string(out_a) +
           ", got " + shape_string(t));
    }
    for (int i = 0; i < t.rank(); ++i) {
      if (t.stride(i) < 0) fail(std::string(name) + " has a negative stride");
    }
    if (t.numel() > 0 && t.data() == nullptr) fail(std::string(name) + " has a null data pointer");
  };
  check_out(out_a, "out_a");
  check_out(out_b, "out_b");
  check_out(out, "out");
  check_lse(lse_a, "lse_a");
  check_lse(lse_b, "lse_b");
  if (!lse.empty()) check_lse(lse, "lse");

  // Outputs may be exactly an input of their kind (merging in place); nothing else
  // may share memory with them.
  auto check_output = [&](const TensorView& t, const char* name, const TensorView& a, const TensorView& b,
                          const TensorView& other_a, const TensorView& other_b) {
    if (detail::self_overlapping(t)) fail(std::string(name) + " has strides that make elements overlap");
    for (const TensorView* in : {&a, &b}) {
      if (!detail::same_view(t, *in) && detail::views_overlap(t, *in)) {
        fail(std::string(name) + " overlaps an input without being exactly it (in-place merging must pass the "
                                 "same view)");
      }
    }
    for (const TensorView* in : {&other_a, &other_b}) {
      if (detail::views_overlap(t, *in)) fail(std::string(name) + " overlaps an input of the other kind");
    }
  };
  check_output(out, "out", out_a, out_b, lse_a, lse_b);
  if (!lse.empty()) {
    check_output(lse, "lse", lse_a, lse_b, out_a, out_b);
    if (detail::views_overlap(out, lse)) fail("out and lse overlap");
  }
  return lse_shape;
}

}  // namespace

void merge_attention_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                            const TensorView& lse_b, const TensorView& out, const TensorView& lse) {
  check(out_a, lse_a, out_b, lse_b, out, lse);
  const bool packed = out_a.rank() == 3;
  const int64_t B = packed ? 1 : out_a.size(0), L = packed ? out_a.size(0) : out_a.size(1);
  const int64_t H = out_a.size(packed ? 1 : 2), dv = out_a.size(packed ? 2 : 3);
  const int ob = packed ? -1 : 0, ol = packed ? 0 : 1, oh = packed ? 1 : 2, oc = packed ? 2 : 3;
  auto out_offset = [&](const TensorView& t, int64_t b, int64_t l, int64_t h) {
    return (ob >= 0 ? b * t.stride(ob) : 0) + l * t.stride(ol) + h * t.stride(oh);
  };
  auto lse_offset = [&](const TensorView& t, int64_t b, int64_t l, int64_t h) {
    return packed ? h * t.stride(0) + l * t.stride(1) : b * t.stride(0) + h * t.stride(1) + l * t.stride(2);
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t h = 0; h < H; ++h) {
        const double la = static_cast<const float*>(lse_a.data())[lse_offset(lse_a, b, l, h)];
        const double lb = static_cast<const float*>(lse_b.data())[lse_offset(lse_b, b, l, h)];
        // Weights relative to the larger lse: one of them is 1, the other e^(−|la − lb|).
        // A part with lse −∞ saw no key: weight 0, and its output is never read. A NaN
        // lse, or +∞ (a +∞ score, whose own output is NaN), makes the row NaN.
        const double m = std::fmax(la, lb);
        const bool nan = std::isnan(la) || std::isnan(lb) || m == HUGE_VAL;
        const bool none = m == -HUGE_VAL;
        const double wa = none || nan ? 0.0 : std::exp(la - m), wb = none || nan ? 0.0 : std::exp(lb - m);
        const double sum = wa + wb;
        const int64_t at_a = out_offset(out_a, b, l, h), at_b = out_offset(out_b, b, l, h),
                      at = out_offset(out, b, l, h);
        // Element by element, each read before it is written: out may be out_a or out_b.
        for (int64_t c = 0; c < dv; ++c) {
          double x;
          if (nan) {
            x = NAN;
          } else if (none) {
            x = 0.0;
          } else {
            x = 0.0;
            if (wa > 0) x += wa / sum * load(out_a, at_a + c * out_a.stride(oc));
            if (wb > 0) x += wb / sum * load(out_b, at_b + c * out_b.stride(oc));
          }
          store(out, at + c * out.stride(oc), x);
        }
        if (!lse.empty()) {
          // m + ln(wa + wb) = m + log1p(the smaller weight): no rounding of the 1.
          const double merged = nan ? NAN : none ? -HUGE_VAL : m + std::log1p(std::fmin(wa, wb));
          static_cast<float*>(lse.data())[lse_offset(lse, b, l, h)] = static_cast<float>(merged);
        }
      }
    }
  }
}

}  // namespace attn
