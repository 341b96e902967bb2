// `attn check`: runs the fused forward and backward against the float64 reference on random
// inputs of many shapes and options, in every dtype (and for f32 inputs, with every
// Precision) and on every kernel path this machine can run, and says whether it holds.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "commands.hpp"
#include "tensor/convert.hpp"

namespace attn::cli {
namespace {

struct CheckCase {
  const char* name;
  int Lq, Lk, H, Hkv, d;
  Causal causal;
  Window window;
  float softcap;
  /// A mask [1, 1, 1, Lk] over the first Lk / 8 keys (left padding): boolean, or
  /// additive with Hugging Face's −FLT_MAX (those keys stay seen, with p = 0).
  enum class Padding { none, boolean, additive } left_padding = Padding::none;
};

/// The case's padding mask in `storage`, or none.
TensorView padding_mask(const CheckCase& c, std::vector<uint8_t>& storage) {
  const size_t pads = size_t(c.Lk) / 8;
  switch (c.left_padding) {
    case CheckCase::Padding::none: return {};
    case CheckCase::Padding::boolean:
      storage.assign(size_t(c.Lk), 1);  // true = attend
      std::fill(storage.begin(), storage.begin() + pads, 0);
      return TensorView(storage.data(), DType::boolean, {1, 1, 1, c.Lk});
    case CheckCase::Padding::additive: {
      std::vector<float> add(size_t(c.Lk), 0.0f);
      std::fill(add.begin(), add.begin() + pads, -FLT_MAX);
      storage.resize(add.size() * sizeof(float));
      std::memcpy(storage.data(), add.data(), storage.size());
      return TensorView(storage.data(), DType::f32, {1, 1, 1, c.Lk});
    }
  }
  return {};
}

// Relative error ‖a − b‖ / ‖b‖.
double rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// One dtype on one kernel path (ATTN_ISA's value; "" = the default), and for f32
// inputs the arithmetic asked for (AttentionOptions::precision).
struct Variant {
  DType dtype;
  const char* isa;
  Precision precision = Precision::f32;
};

// Rounds x to the dtype (f32: unchanged).
float round_to(DType t, float x) {
  if (t == DType::bf16) return detail::round_to_bf16(x);
  if (t == DType::f16) return detail::round_to_f16(x);
  return x;
}

// The variant's name in the report: the dtype, or for f32 inputs computed in lower
// precision "f32→" and the precision.
std::string label(const Variant& var) {
  if (var.precision == Precision::bf16) return "f32→bf16";
  if (var.precision == Precision::bf16x3) return "f32→bf16x3";
  return dtype_name(var.dtype);
}

// Whether the variant's error is judged by FlashAttention's 2× rule (anything but
// f32 arithmetic on f32 inputs).
bool reduced(const Variant& var) { return var.dtype != DType::f32 || var.precision != Precision::f32; }

// x as the variant's products take it: rounded to the dtype (bf16/f16 inputs, and P
// or dS in those dtypes), to bf16 (Precision::bf16), or as the sum of its two bf16
// pieces, hi = bf16(x) and lo = bf16(x − hi) (Precision::bf16x3).
float as_operand(const Variant& var, float x) {
  if (var.precision == Precision::bf16) return detail::round_to_bf16(x);
  if (var.precision == Precision::bf16x3) {
    const float hi = detail::round_to_bf16(x);
    return hi + detail::round_to_bf16(x - hi);
  }
  return round_to(var.dtype, x);
}

// A [1, L, H, d] tensor's f32 values and, for bf16/f16, their storage twin.
struct Stored {
  DType dt;
  std::vector<float> f32;
  std::vector<uint16_t> half;
  std::vector<int64_t> shape;
  Stored(DType t, int L, int H, int d) : dt(t), f32(size_t(L) * H * d), shape{1, L, H, d} {
    if (dt != DType::f32) half.resize(f32.size());
  }
  void fill(std::mt19937& rng) {
    std::uniform_real_distribution<float> u(-1, 1);
    for (float& x : f32) x = round_to(dt, u(rng));
    narrow();
  }
  void narrow() {
    for (size_t i = 0; i < half.size(); ++i) {
      half[i] = dt == DType::bf16 ? detail::f32_to_bf16(f32[i]) : detail::f32_to_f16(f32[i]);
    }
  }
  void widen() {
    for (size_t i = 0; i < half.size(); ++i) {
      f32[i] = dt == DType::bf16 ? detail::bf16_to_f32(half[i]) : detail::f16_to_f32(half[i]);
    }
  }
  TensorView view() { return dt == DType::f32 ? view32() : TensorView(half.data(), dt, shape); }
  TensorView view32() { return TensorView(f32.data(), DType::f32, shape); }
  // An f32 copy with every value as the variant's products take it (as_operand).
  Stored operands(const Variant& var) const {
    Stored r(DType::f32, int(shape[1]), int(shape[2]), int(shape[3]));
    for (size_t i = 0; i < f32.size(); ++i) r.f32[i] = as_operand(var, f32[i]);
    return r;
  }
};

// Prints one case's line and returns ok.
bool report(const CheckCase& c, const Variant& var, double err, const char* bar, bool ok) {
  std::printf("  %-12s %-10s %-36s Lq=%-4d Lk=%-4d d=%-3d  rel. error %.2e  (%s)  %s\n", label(var).c_str(),
              var.isa[0] != '\0' ? var.isa : "f32", c.name, c.Lq, c.Lk, c.d, err, bar, ok ? "ok" : "FAIL");
  return ok;
}

// Runs one case in one variant: the fused output against the float64 reference on the
// same (stored) inputs. f32: relative error ≤ 1e-6. bf16/f16, and f32 inputs with a
// reduced precision: FlashAttention's rule, at most 2× the error of a plain
// implementation with the same rounding (q, k, v as the products take them, exact
// softmax, P rounded likewise before P·V, f32 sums, output rounded to the dtype).
bool run_case(const CheckCase& c, const Variant& var, std::mt19937& rng) {
  const DType dt = var.dtype;
  Stored q(dt, c.Lq, c.H, c.d), k(dt, c.Lk, c.Hkv, c.d), v(dt, c.Lk, c.Hkv, c.d), out(dt, c.Lq, c.H, c.d);
  for (Stored* t : {&q, &k, &v}) t->fill(rng);
  std::vector<float> ref(q.f32.size());
  // opt: the oracle's options (the reference honours a precision, so it has none);
  // run: the fused call's.
  AttentionOptions opt;
  std::vector<uint8_t> mask;
  opt.causal = c.causal, opt.window = c.window, opt.softcap = c.softcap, opt.mask = padding_mask(c, mask);
  AttentionOptions run = opt;
  run.precision = var.precision;
  attention_reference(q.view32(), k.view32(), v.view32(), TensorView(ref.data(), DType::f32, q.shape), opt);
  if (var.isa[0] != '\0') setenv("ATTN_ISA", var.isa, 1);
  attention(q.view(), k.view(), v.view(), out.view(), run);
  unsetenv("ATTN_ISA");
  out.widen();
  const double err = rel_error(out.f32, ref);
  bool ok = err <= 1e-6;
  char bar[64] = "bar 1e-6";
  if (reduced(var)) {
    Stored qo = q.operands(var), ko = k.operands(var), vo = v.operands(var), unused(DType::f32, c.Lq, c.H, c.d);
    std::vector<float> probs(size_t(c.H) * c.Lq * c.Lk), plain(ref.size());
    attention_reference(qo.view32(), ko.view32(), vo.view32(), unused.view32(), opt, {},
                        TensorView(probs.data(), DType::f32, {1, c.H, c.Lq, c.Lk}));
    const int group = c.H / c.Hkv;
    for (int i = 0; i < c.Lq; ++i) {
      for (int h = 0; h < c.H; ++h) {
        const float* p = probs.data() + (size_t(h) * c.Lq + i) * c.Lk;
        for (int x = 0; x < c.d; ++x) {
          float acc = 0;
          for (int j = 0; j < c.Lk; ++j) acc += as_operand(var, p[j]) * vo.f32[(size_t(j) * c.Hkv + h / group) * c.d + x];
          plain[(size_t(i) * c.H + h) * c.d + x] = round_to(var.dtype, acc);
        }
      }
    }
    const double plain_err = rel_error(plain, ref);
    ok = err <= 2 * plain_err + 1e-7;
    std::snprintf(bar, sizeof bar, "plain %.2e, bar 2x", plain_err);
  }
  return report(c, var, err, bar, ok);
}

// The backward of one case in one variant: the fused forward, then the fused backward,
// against the exact gradients at the same inputs (the float64 reference backward, with
// the reference's own out and lse). f32:
// relative error of (dq, dk, dv) ≤ 1e-5. bf16/f16, and f32 inputs with a reduced
// precision: at most 2× the error of a plain implementation with the same rounding
// (exact P, dP, D and dS from q, k, v and dout as the products take them; P and dS
// rounded likewise before they multiply; f32 sums; gradients rounded to the dtype).
bool run_backward_case(const CheckCase& c, const Variant& var, std::mt19937& rng) {
  const DType dt = var.dtype;
  Stored q(dt, c.Lq, c.H, c.d), k(dt, c.Lk, c.Hkv, c.d), v(dt, c.Lk, c.Hkv, c.d), out(dt, c.Lq, c.H, c.d),
      dout(dt, c.Lq, c.H, c.d), dq(dt, c.Lq, c.H, c.d), dk(dt, c.Lk, c.Hkv, c.d), dv(dt, c.Lk, c.Hkv, c.d);
  for (Stored* t : {&q, &k, &v, &dout}) t->fill(rng);
  std::vector<float> lse(size_t(c.H) * c.Lq);
  const TensorView lse_view(lse.data(), DType::f32, {1, c.H, c.Lq});
  // opt: the oracle's options (the reference honours a precision, so it has none);
  // run: the fused calls'.
  AttentionOptions opt;
  std::vector<uint8_t> mask;
  opt.causal = c.causal, opt.window = c.window, opt.softcap = c.softcap, opt.mask = padding_mask(c, mask);
  AttentionOptions run = opt;
  run.precision = var.precision;
  if (var.isa[0] != '\0') setenv("ATTN_ISA", var.isa, 1);
  attention(q.view(), k.view(), v.view(), out.view(), run, lse_view);
  attention_backward(q.view(), k.view(), v.view(), out.view(), lse_view, dout.view(), dq.view(), dk.view(), dv.view(),
                     run);
  unsetenv("ATTN_ISA");
  for (Stored* t : {&out, &dq, &dk, &dv}) t->widen();

  // The exact gradients at the stored inputs, from the reference's own out and lse.
  Stored rq(DType::f32, c.Lq, c.H, c.d), rk(DType::f32, c.Lk, c.Hkv, c.d), rv(DType::f32, c.Lk, c.Hkv, c.d),
      rout(DType::f32, c.Lq, c.H, c.d);
  std::vector<float> rlse(lse.size());
  const TensorView rlse_view(rlse.data(), DType::f32, {1, c.H, c.Lq});
  attention_reference(q.view32(), k.view32(), v.view32(), rout.view32(), opt, rlse_view);
  attention_backward_reference(q.view32(), k.view32(), v.view32(), rout.view32(), rlse_view, dout.view32(),
                               rq.view32(), rk.view32(), rv.view32(), opt);
  auto joined = [](std::initializer_list<const Stored*> parts) {
    std::vector<float> all;
    for (const Stored* t : parts) all.insert(all.end(), t->f32.begin(), t->f32.end());
    return all;
  };
  const std::vector<float> ref = joined({&rq, &rk, &rv});
  const double err = rel_error(joined({&dq, &dk, &dv}), ref);
  bool ok = err <= 1e-5;
  char bar[64] = "bar 1e-5";
  if (reduced(var)) {
    Stored qo = q.operands(var), ko = k.operands(var), vo = v.operands(var), go = dout.operands(var);
    std::vector<float> probs(size_t(c.H) * c.Lq * c.Lk), ref_out(q.f32.size());
    attention_reference(qo.view32(), ko.view32(), vo.view32(),
                        TensorView(ref_out.data(), DType::f32, q.shape), opt, {},
                        TensorView(probs.data(), DType::f32, {1, c.H, c.Lq, c.Lk}));
    const int group = c.H / c.Hkv, d = c.d;
    const double scale = 1.0 / std::sqrt(double(d));
    std::vector<double> gq(q.f32.size()), gk(k.f32.size()), gv(v.f32.size());
    for (int h = 0; h < c.H; ++h) {
      const int hk = h / group;
      for (int i = 0; i < c.Lq; ++i) {
        const float* qi = &qo.f32[(size_t(i) * c.H + h) * d];
        const float* oi = &out.f32[(size_t(i) * c.H + h) * d];
        const float* gi = &go.f32[(size_t(i) * c.H + h) * d];
        double D = 0;
        for (int x = 0; x < d; ++x) D += double(gi[x]) * oi[x];
        for (int j = 0; j < c.Lk; ++j) {
          const double p = probs[(size_t(h) * c.Lq + i) * c.Lk + j];
          if (p == 0) continue;
          const float* kj = &ko.f32[(size_t(j) * c.Hkv + hk) * d];
          const float* vj = &vo.f32[(size_t(j) * c.Hkv + hk) * d];
          double dp = 0, s = 0;
          for (int x = 0; x < d; ++x) dp += double(gi[x]) * vj[x], s += double(qi[x]) * kj[x];
          // Softcap's chain rule: d(c·tanh(x/c))/dx = 1 − tanh²(x/c).
          const double t = c.softcap > 0 ? std::tanh(s * scale / c.softcap) : 0.0;
          const double ds = as_operand(var, static_cast<float>(p * (dp - D) * (1 - t * t)));
          const double pr = as_operand(var, static_cast<float>(p));
          for (int x = 0; x < d; ++x) {
            gv[(size_t(j) * c.Hkv + hk) * d + x] += pr * gi[x];
            gk[(size_t(j) * c.Hkv + hk) * d + x] += scale * ds * qi[x];
            gq[(size_t(i) * c.H + h) * d + x] += scale * ds * kj[x];
          }
        }
      }
    }
    std::vector<float> plain;
    for (const auto* g : {&gq, &gk, &gv}) {
      for (double x : *g) plain.push_back(round_to(dt, static_cast<float>(x)));
    }
    const double plain_err = rel_error(plain, ref);
    ok = err <= 2 * plain_err + 1e-7;
    std::snprintf(bar, sizeof bar, "plain %.2e, bar 2x", plain_err);
  }
  return report(c, var, err, bar, ok);
}

}  // namespace

Command add_check_command(CLI::App& app) {
  auto seed = std::make_shared<unsigned>(std::random_device{}());
  CLI::App* sub = app.add_subcommand(
      "check", "Verify the fused forward and backward against the float64 reference on random inputs, in "
               "f32, bf16 and f16 and f32 with Precision::bf16 and bf16x3, on every kernel path this machine "
               "can run");
  sub->add_option("--seed", *seed, "random seed (default: a fresh one)");
  auto run = [seed]() -> int {
    const CheckCase cases[] = {
        {"plain", 100, 100, 4, 4, 64, Causal::None, {-1, -1}, 0},
        {"causal top-left, Lq<Lk", 65, 130, 4, 2, 128, Causal::TopLeft, {-1, -1}, 0},
        {"causal bottom-right, GQA 8:1", 63, 200, 8, 1, 80, Causal::BottomRight, {-1, -1}, 0},
        {"sliding window", 200, 200, 2, 2, 96, Causal::None, {16, 16}, 0},
        {"softcap", 64, 64, 2, 1, 256, Causal::None, {-1, -1}, 20},
        {"odd sizes", 17, 3, 3, 1, 7, Causal::BottomRight, {-1, -1}, 0},
        // A decoding step without a cache: the forward runs on the decode kernel on
        // every path (kvcache/few_queries.hpp), the backward on the path's kernel.
        {"one query, 300 keys (decode kernel)", 1, 300, 8, 2, 128, Causal::BottomRight, {-1, -1}, 0},
        // The same step with a padding mask, as models pass one to SDPA (the decode
        // kernel applies it).
        {"one query, padding mask (decode)", 1, 300, 8, 2, 128, Causal::None, {-1, -1}, 0,
         CheckCase::Padding::boolean},
        {"one query, -FLT_MAX padding (decode)", 1, 300, 8, 2, 128, Causal::None, {-1, -1}, 0,
         CheckCase::Padding::additive},
    };
    std::mt19937 rng(*seed);
    int failures = 0;
    const CpuInfo cpu = cpu_info();
    std::printf(
        "attn check (seed %u): fused forward and backward vs float64 reference; f32 kernel on %s, bf16 default "
        "path %s%s\n",
        *seed, cpu.simd_target.c_str(), cpu.bf16_path.c_str(),
        cpu.amx_bf16 ? ""
                     : (cpu.amx_refused.empty() ? " (no AMX)" : (" (AMX refused: " + cpu.amx_refused + ")").c_str()));
    // Every dtype on the portable path, bf16 on every bf16 path this machine can run,
    // and f16 on AMX tiles (as hi + lo bf16 pieces) where it has them. f32 inputs with
    // Precision::bf16 on every bf16 path, and with Precision::bf16x3 on the tiles and
    // on the portable path (where it is the f32 kernel).
    std::vector<Variant> variants = {{DType::f32, ""},
                                     {DType::bf16, "f32"},
                                     {DType::f16, "f32"},
                                     {DType::f32, "f32", Precision::bf16},
                                     {DType::f32, "f32", Precision::bf16x3}};
    if (cpu.amx_bf16) {
      variants.push_back({DType::bf16, "amx"});
      variants.push_back({DType::f16, "amx"});
      variants.push_back({DType::f32, "amx", Precision::bf16});
      variants.push_back({DType::f32, "amx", Precision::bf16x3});
    }
    if (cpu.avx512_bf16) {
      variants.push_back({DType::bf16, "avx512bf16"});
      variants.push_back({DType::f32, "avx512bf16", Precision::bf16});
    }
    std::printf("forward (out):\n");
    for (const Variant& var : variants) {
      for (const CheckCase& c : cases) failures += !run_case(c, var, rng);
    }
    std::printf("backward (dq, dk, dv):\n");
    for (const Variant& var : variants) {
      for (const CheckCase& c : cases) failures += !run_backward_case(c, var, rng);
    }
    std::printf("%s\n", failures ? "FAILED" : "all ok");
    return failures ? 1 : 0;
  };
  return {sub, run};
}

}  // namespace attn::cli
