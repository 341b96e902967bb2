// Shared pieces of the bf16/f16 attention tests (attention_lowp_test.cc for the
// portable path, attention_amx_test.cc and attention_amx_backward_test.cc for the AMX
// kernels, cuda/cuda_attention_test.cc for the GPU): one call's tensors in a storage
// dtype with their exact f32 twins, the option cases that touch every part of the
// score path, the shapes, the comparisons with the float64 reference under
// FlashAttention's rule, and a guard that forces a kernel path via ATTN_ISA.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attn/attention.hpp"
#include "cpu/isa.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {

using detail::bf16_to_f32;
using detail::f16_to_f32;
using detail::f32_to_bf16;
using detail::f32_to_f16;

inline uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// Why this machine cannot run the bf16 kernel path `isa` ("amx" or "avx512bf16"),
/// or "" when it can.
inline std::string cannot_run_path(const std::string& isa) {
  const detail::CpuFeatures& f = detail::cpu_features();
  if (isa == "amx" && !f.amx_bf16) {
    return "this CPU (or OS) cannot run AMX: " + (f.amx_refused.empty() ? std::string("no AMX-BF16 in CPUID") : f.amx_refused);
  }
  if (isa == "avx512bf16" && !f.avx512_bf16) return "this CPU has no AVX512-BF16";
  return "";
}

/// Skips the current test, saying why, on machines that cannot run path `isa`.
#define SKIP_UNLESS_PATH(isa)                                                     \
  if (const std::string why = ::attn::testing::cannot_run_path(isa); !why.empty()) { \
    GTEST_SKIP() << why;                                                          \
  }

/// The bf16 kernel paths the kernel suites run on (each skipped where it cannot run).
inline const char* const kBf16KernelPaths[] = {"amx", "avx512bf16"};

/// Test-name suffix for a path parameter.
inline std::string PathName(const ::testing::TestParamInfo<const char*>& info) { return info.param; }

/// Sets ATTN_ISA for its lifetime (nullptr: unset), then restores the previous value.
/// A forced path also turns off the few-query route (ATTN_FEW_QUERIES=0,
/// kvcache/few_queries.hpp), so that short calls run on the forced kernel rather than
/// on the decode kernel.
class ScopedIsa {
 public:
  explicit ScopedIsa(const char* isa) : isa_("ATTN_ISA", isa) {
    if (isa != nullptr) few_queries_.emplace();
  }

 private:
  ScopedEnv isa_;
  std::optional<FewQueriesOff> few_queries_;
};

// One call's tensors in a storage dtype, with their exact f32 twins.
struct LowpCall {
  DType dt;
  int B, Lq, Lk, Hq, Hkv, d, dv;
  std::vector<uint16_t> q, k, v, out, dout, dq, dk, dv_;
  std::vector<float> q32, k32, v32, out32, dout32;
  std::vector<float> lse;

  uint16_t to(float f) const { return dt == DType::bf16 ? f32_to_bf16(f) : f32_to_f16(f); }
  float from(uint16_t h) const { return dt == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h); }
  void fill(std::vector<uint16_t>& h, std::vector<float>& f, size_t n, std::mt19937_64& rng, float scale) {
    std::uniform_real_distribution<float> u(-scale, scale);
    h.resize(n);
    f.resize(n);
    for (size_t i = 0; i < n; ++i) {
      h[i] = to(u(rng));
      f[i] = from(h[i]);
    }
  }
  LowpCall(DType t, int b, int lq, int lk, int hq, int hkv, int dd, int ddv, std::mt19937_64& rng)
      : dt(t), B(b), Lq(lq), Lk(lk), Hq(hq), Hkv(hkv), d(dd), dv(ddv) {
    fill(q, q32, size_t(B) * Lq * Hq * d, rng, 2.0f);
    fill(k, k32, size_t(B) * Lk * Hkv * d, rng, 2.0f);
    fill(v, v32, size_t(B) * Lk * Hkv * dv, rng, 1.0f);
    fill(dout, dout32, size_t(B) * Lq * Hq * dv, rng, 1.0f);
    out.assign(size_t(B) * Lq * Hq * dv, 0);
    lse.assign(size_t(B) * Hq * Lq, 0.0f);
  }
  TensorView view(const std::vector<uint16_t>& x, int L, int H, int D) const { return TensorView(x.data(), dt, {B, L, H, D}); }
  TensorView view32(const std::vector<float>& x, int L, int H, int D) const {
    return TensorView(x.data(), DType::f32, {B, L, H, D});
  }
  TensorView lse_view() const { return TensorView(lse.data(), DType::f32, {B, Hq, Lq}); }
};

// What an option case's tensors live in: f32 (masks, slopes), boolean masks, masks in
// the input dtype, and the f32 twin of the latter.
struct OptionStore {
  std::vector<float> f32, twin;
  std::vector<uint8_t> boolean;
  std::vector<uint16_t> lowp;
};

// Options that touch every part of the score path, for a call's shapes.
struct OptionCase {
  const char* name;
  std::function<void(AttentionOptions&, std::vector<float>&, std::vector<uint8_t>&, std::vector<uint16_t>&,
                     const LowpCall&, std::mt19937_64&)>
      set;
  AttentionOptions make(OptionStore& st, const LowpCall& c, std::mt19937_64& rng) const {
    AttentionOptions o;
    set(o, st.f32, st.boolean, st.lowp, c, rng);
    return o;
  }
};

inline std::vector<OptionCase> option_cases() {
  return {
      {"plain", [](auto&, auto&, auto&, auto&, auto&, auto&) {}},
      {"causal", [](AttentionOptions& o, auto&, auto&, auto&, auto&, auto&) { o.causal = Causal::TopLeft; }},
      {"bottom-right window", [](AttentionOptions& o, auto&, auto&, auto&, auto&, auto&) {
         o.causal = Causal::BottomRight;
         o.window = {5, 0};
       }},
      {"softcap+scale", [](AttentionOptions& o, auto&, auto&, auto&, auto&, auto&) {
         o.softcap = 5.0f;
         o.scale = 0.3f;
       }},
      {"f32 additive mask", [](AttentionOptions& o, std::vector<float>& m, auto&, auto&, const LowpCall& c,
                               std::mt19937_64& rng) {
         m.resize(size_t(c.Lq) * c.Lk);
         std::uniform_real_distribution<float> u(-3, 3);
         for (float& x : m) x = rng() % 10 == 0 ? -INFINITY : u(rng);
         o.mask = TensorView(m.data(), DType::f32, {c.Lq, c.Lk});
       }},
      {"mask in the input dtype", [](AttentionOptions& o, std::vector<float>&, auto&, std::vector<uint16_t>& m,
                                     const LowpCall& c, std::mt19937_64& rng) {
         m.resize(size_t(c.Hq) * c.Lq * c.Lk);
         std::uniform_real_distribution<float> u(-3, 3);
         for (uint16_t& x : m) x = c.to(rng() % 10 == 0 ? -INFINITY : u(rng));
         o.mask = TensorView(m.data(), c.dt, {c.Hq, c.Lq, c.Lk});
       }},
      {"boolean mask", [](AttentionOptions& o, auto&, std::vector<uint8_t>& m, auto&, const LowpCall& c,
                          std::mt19937_64& rng) {
         m.resize(size_t(c.B) * c.Lq * c.Lk);
         for (uint8_t& x : m) x = rng() % 4 != 0;
         o.mask = TensorView(m.data(), DType::boolean, {c.B, 1, c.Lq, c.Lk});
       }},
      {"alibi", [](AttentionOptions& o, std::vector<float>& m, auto&, auto&, const LowpCall& c, auto&) {
         m.resize(size_t(c.Hq));
         for (int h = 0; h < c.Hq; ++h) m[h] = std::pow(2.0f, -1.0f - h);
         o.alibi_slopes = TensorView(m.data(), DType::f32, {c.Hq});
       }},
      {"dropout", [](AttentionOptions& o, auto&, auto&, auto&, auto&, auto&) {
         o.dropout_p = 0.2f;
         o.seed = 42;
       }},
  };
}

// The f32 twin of `o`: a mask in the input dtype becomes its exact f32 copy.
inline AttentionOptions f32_twin(const AttentionOptions& o, const LowpCall& c, std::vector<float>& storage) {
  AttentionOptions t = o;
  if (!o.mask.empty() && o.mask.dtype() == c.dt) {
    const uint16_t* m = o.mask.data_as<const uint16_t>();
    storage.resize(static_cast<size_t>(o.mask.numel()));
    for (size_t i = 0; i < storage.size(); ++i) storage[i] = c.from(m[i]);
    t.mask = TensorView(storage.data(), DType::f32, o.mask.shape());
  }
  return t;
}

struct Shape {
  int B, Lq, Lk, Hq, Hkv, d, dv;
};
inline const Shape kShapes[] = {{1, 1, 1, 1, 1, 16, 16},   {2, 3, 17, 4, 2, 64, 64}, {1, 17, 3, 2, 1, 80, 48},
                         {1, 100, 100, 2, 2, 128, 128}, {2, 33, 65, 3, 1, 32, 40}};

/// Squared errors of one case against the float64 reference: the kernel's, and the
/// plain bf16 pipeline's (the yardstick).
struct CaseErrors {
  double fused = 0, plain = 0;
};

/// A kernel's out and lse (c.out, c.lse) against the reference's (ref, ref_lse, and its
/// probabilities probs [B, Hq, Lq, Lk]), with the yardstick built from those probabilities
/// (every option included): out = round(Σ_j round(P_ij)·v_j) in f32, rounded to c's dtype.
/// Checks lse (the same −∞ rows, f32 rounding at most) and that fully masked rows are 0;
/// returns the kernel's and the yardstick's squared errors.
inline CaseErrors compare_with_reference(const LowpCall& c, const std::vector<float>& ref,
                                         const std::vector<float>& ref_lse, const std::vector<float>& probs) {
  double fused = 0, plain_sq = 0;
  const int group = c.Hq / c.Hkv;
  // Rows on several threads: the yardstick costs Lk·dv per row (minutes on one core for
  // the GPU tests' 4097-long sequences). GoogleTest's assertions are thread-safe here.
  const int64_t row_count = int64_t{c.B} * c.Lq * c.Hq;
#pragma omp parallel for schedule(static) reduction(+ : fused, plain_sq) if (row_count * c.Lk * c.dv >= (int64_t{1} << 22))
  for (int64_t row = 0; row < row_count; ++row) {
    const int h = static_cast<int>(row % c.Hq), i = static_cast<int>(row / c.Hq % c.Lq),
              b = static_cast<int>(row / c.Hq / c.Lq);
    const float* p = probs.data() + ((size_t(b) * c.Hq + h) * c.Lq + i) * c.Lk;
    const float l = ref_lse[(size_t(b) * c.Hq + h) * c.Lq + i];
    const float l_kernel = c.lse[(size_t(b) * c.Hq + h) * c.Lq + i];
    EXPECT_EQ(std::isinf(l), std::isinf(l_kernel)) << "lse b=" << b << " h=" << h << " i=" << i;
    if (std::isfinite(l)) EXPECT_NEAR(l_kernel, l, 1e-4 * std::max(1.0f, std::fabs(l)));
    for (int x = 0; x < c.dv; ++x) {
      float acc = 0;
      for (int j = 0; j < c.Lk; ++j)
        acc += c.from(c.to(p[j])) * c.v32[((size_t(b) * c.Lk + j) * c.Hkv + h / group) * c.dv + x];
      const size_t at = ((size_t(b) * c.Lq + i) * c.Hq + h) * c.dv + x;
      const double r = ref[at], got = c.from(c.out[at]), plain = c.from(c.to(acc));
      EXPECT_FALSE(std::isnan(got)) << at;
      if (std::isinf(l)) EXPECT_EQ(got, 0.0) << "fully masked row b=" << b << " h=" << h << " i=" << i;
      fused += (got - r) * (got - r);
      plain_sq += (plain - r) * (plain - r);
    }
  }
  CaseErrors e;
  e.fused = fused, e.plain = plain_sq;
  return e;
}

/// A kernel's forward results (c.out, c.lse) against the float64 reference on c's inputs
/// under the call's options `o` (a mask in the input dtype becomes its f32 twin, kept in
/// `store`): compare_with_reference with the reference's probabilities.
inline CaseErrors compare_forward_with_reference(const LowpCall& c, const AttentionOptions& o, OptionStore& store) {
  const AttentionOptions t = f32_twin(o, c, store.twin);
  std::vector<float> ref(c.out.size()), lse(c.lse.size()), probs(size_t(c.B) * c.Hq * c.Lq * c.Lk);
  attention_reference(c.view32(c.q32, c.Lq, c.Hq, c.d), c.view32(c.k32, c.Lk, c.Hkv, c.d),
                      c.view32(c.v32, c.Lk, c.Hkv, c.dv), c.view32(ref, c.Lq, c.Hq, c.dv), t,
                      TensorView(lse.data(), DType::f32, {c.B, c.Hq, c.Lq}),
                      TensorView(probs.data(), DType::f32, {c.B, c.Hq, c.Lq, c.Lk}));
  return compare_with_reference(c, ref, lse, probs);
}

/// A kernel's gradients (dq, dk, dv in c's dtype, from c.out, c.lse and c.dout of the
/// kernel's own forward) against the float64 reference's, with FlashAttention's
/// yardstick for the backward: a plain implementation with the same rounding (P, dP, D
/// and dS exact from the rounded inputs; P' and dS rounded to c's dtype before they
/// multiply; f32-or-better sums; outputs in c's dtype). `o` and `store` are the call's
/// options (OptionCase::make). Returns the kernel's and the yardstick's squared errors.
inline CaseErrors compare_backward_with_reference(const LowpCall& c, const AttentionOptions& o, OptionStore& store,
                                                  const std::vector<uint16_t>& dq, const std::vector<uint16_t>& dk,
                                                  const std::vector<uint16_t>& dv) {
  std::vector<float> out32(c.out.size());
  for (size_t i = 0; i < out32.size(); ++i) out32[i] = c.from(c.out[i]);
  const AttentionOptions t = f32_twin(o, c, store.twin);
  std::vector<float> rq(c.q.size()), rk(c.k.size()), rv(c.v.size());
  attention_backward_reference(c.view32(c.q32, c.Lq, c.Hq, c.d), c.view32(c.k32, c.Lk, c.Hkv, c.d),
                               c.view32(c.v32, c.Lk, c.Hkv, c.dv), c.view32(out32, c.Lq, c.Hq, c.dv), c.lse_view(),
                               c.view32(c.dout32, c.Lq, c.Hq, c.dv), c.view32(rq, c.Lq, c.Hq, c.d),
                               c.view32(rk, c.Lk, c.Hkv, c.d), c.view32(rv, c.Lk, c.Hkv, c.dv), t);

  // P without dropout, and the dropout multipliers.
  AttentionOptions no_drop = t;
  no_drop.dropout_p = 0.0f;
  std::vector<float> ref_out(out32.size()), lse(c.lse.size()), probs(size_t(c.B) * c.Hq * c.Lq * c.Lk);
  attention_reference(c.view32(c.q32, c.Lq, c.Hq, c.d), c.view32(c.k32, c.Lk, c.Hkv, c.d),
                      c.view32(c.v32, c.Lk, c.Hkv, c.dv), c.view32(ref_out, c.Lq, c.Hq, c.dv), no_drop,
                      TensorView(lse.data(), DType::f32, {c.B, c.Hq, c.Lq}),
                      TensorView(probs.data(), DType::f32, {c.B, c.Hq, c.Lq, c.Lk}));
  std::vector<uint8_t> keep(probs.size(), 1);
  if (o.dropout_p > 0.0f) {
    dropout_mask(TensorView(keep.data(), DType::boolean, {c.B, c.Hq, c.Lq, c.Lk}), o.dropout_p, o.seed);
  }
  const double inv_keep = 1.0 / (1.0 - o.dropout_p);
  const double scale = o.scale ? double(*o.scale) : 1.0 / std::sqrt(double(c.d));
  auto rounded = [&](double x) { return double(c.from(c.to(float(x)))); };

  std::vector<double> pq(c.q.size()), pk(c.k.size()), pv(c.v.size());
  const int group = c.Hq / c.Hkv;
  auto qat = [&](int b, int i, int h) { return ((size_t(b) * c.Lq + i) * c.Hq + h); };
  auto kat = [&](int b, int j, int hk) { return ((size_t(b) * c.Lk + j) * c.Hkv + hk); };
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.Hq; ++h)
      for (int i = 0; i < c.Lq; ++i) {
        const float* prow = probs.data() + ((size_t(b) * c.Hq + h) * c.Lq + i) * c.Lk;
        const uint8_t* krow = keep.data() + ((size_t(b) * c.Hq + h) * c.Lq + i) * c.Lk;
        double dsum = 0;
        for (int x = 0; x < c.dv; ++x) dsum += double(c.dout32[qat(b, i, h) * c.dv + x]) * out32[qat(b, i, h) * c.dv + x];
        for (int j = 0; j < c.Lk; ++j) {
          const double m = krow[j] ? (o.dropout_p > 0.0f ? inv_keep : 1.0) : 0.0;
          const double p = prow[j];
          const float* vj = c.v32.data() + kat(b, j, h / group) * c.dv;
          const float* gi = c.dout32.data() + qat(b, i, h) * c.dv;
          double dp = 0;
          for (int x = 0; x < c.dv; ++x) dp += double(gi[x]) * vj[x];
          const double pd = rounded(p * m);
          for (int x = 0; x < c.dv; ++x) pv[kat(b, j, h / group) * c.dv + x] += pd * gi[x];
          const double ds = rounded(scale * p * (dp * m - dsum));
          const float* qi = c.q32.data() + qat(b, i, h) * c.d;
          const float* kj = c.k32.data() + kat(b, j, h / group) * c.d;
          for (int x = 0; x < c.d; ++x) {
            pk[kat(b, j, h / group) * c.d + x] += ds * qi[x];
            pq[qat(b, i, h) * c.d + x] += ds * kj[x];
          }
        }
      }
  CaseErrors e;
  auto add = [&](const std::vector<uint16_t>& fused, const std::vector<float>& ref, const std::vector<double>& plain,
                 const char* what) {
    for (size_t n = 0; n < ref.size(); ++n) {
      const double f = c.from(fused[n]), r = ref[n], pl = rounded(plain[n]);
      ASSERT_FALSE(std::isnan(f)) << what << " " << n;
      e.fused += (f - r) * (f - r);
      e.plain += (pl - r) * (pl - r);
    }
  };
  add(dq, rq, pq, "dq");
  add(dk, rk, pk, "dk");
  add(dv, rv, pv, "dv");
  return e;
}

/// Runs run(shape) for every shape of one option case and checks the kernel's error
/// against the yardstick: per case within 10× the plain error (plus one bf16
/// rounding of an output of size 1, for cases whose plain error happens to be ~0),
/// and over all shapes within 2×; the yardstick must measure something.
template <class Shapes, class Run>
void ExpectWithinPlainBf16Error(const Shapes& shapes, const OptionCase& oc, const Run& run) {
  double fused = 0, plain = 0;
  for (const Shape& s : shapes) {
    SCOPED_TRACE(std::string(oc.name) + " Lq=" + std::to_string(s.Lq) + " Lk=" + std::to_string(s.Lk) +
                 " d=" + std::to_string(s.d));
    const CaseErrors e = run(s);
    EXPECT_LE(std::sqrt(e.fused), 10.0 * std::sqrt(e.plain) + 1.0 / 256);
    fused += e.fused, plain += e.plain;
  }
  EXPECT_LE(std::sqrt(fused), 2.0 * std::sqrt(plain)) << oc.name;
  EXPECT_GT(plain, 0.0) << oc.name << ": the yardstick must measure something";
}

}  // namespace attn::testing
