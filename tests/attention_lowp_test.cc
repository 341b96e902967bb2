// bf16 and f16 attention (issue 11, the portable path, forced with ATTN_ISA=f32): conversions against
// independent oracles, every option in both dtypes bitwise equal to the f32 kernel on
// the same (rounded) inputs followed by one rounding (contiguous and strided, with no
// f32 copies of the inputs), FlashAttention's ≤ 2× rule
// against a plain bf16 implementation, the backward, Precision::bf16, NaN semantics,
// thread independence and the dtype errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "lowp_harness.hpp"
#include "cpu/isa.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {


// The oracle for f32 → bf16: the two bf16 neighbours of f, the nearer in double
// arithmetic, ties to the even one.
uint16_t bf16_oracle(float f) {
  const uint32_t u = bits(f);
  const uint16_t lo = static_cast<uint16_t>(u >> 16), hi = static_cast<uint16_t>(lo + 1);
  if ((u & 0xffffu) == 0) return lo;
  const double dlo = std::fabs(double(f) - double(bf16_to_f32(lo)));
  // hi may be the bit pattern of ±inf when lo is the largest finite: its distance is
  // that of the rounding boundary (2^128 − 2^119·… ), which double holds exactly.
  const double hi_value = (hi & 0x7fffu) == 0x7f80u ? std::ldexp(1.0, 128) * (f < 0 ? -1 : 1) : bf16_to_f32(hi);
  const double dhi = std::fabs(hi_value - double(f));
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

TEST(LowPrecisionConvert, Bf16MatchesTheNearestEvenOracle) {
  std::mt19937_64 rng = make_rng(1);
  for (int n = 0; n < 2'000'000; ++n) {
    uint32_t u = static_cast<uint32_t>(rng());
    if (n % 4 == 0) u = (u & 0xffff0000u) | 0x8000u;  // exact ties
    const float f = from_bits(u);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    ASSERT_EQ(f32_to_bf16(f), bf16_oracle(f)) << std::hexfloat << f;
  }
  // Every bf16 value survives the round trip.
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = bf16_to_f32(static_cast<uint16_t>(h));
    if (!std::isnan(f)) ASSERT_EQ(f32_to_bf16(f), h);
  }
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(3.4e38f)), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f32_to_bf16(-0.0f), 0x8000u);
}

TEST(LowPrecisionConvert, F16MatchesTheCompilersFloat16) {
  std::mt19937_64 rng = make_rng(2);
  for (int n = 0; n < 2'000'000; ++n) {
    uint32_t u = static_cast<uint32_t>(rng());
    // Most random f32 are far outside f16's range: draw exponents near it too.
    if (n % 2 == 0) u = (u & 0x807fffffu) | ((100 + static_cast<uint32_t>(rng() % 50)) << 23);
    if (n % 8 == 0) u = (u & 0xffffe000u) | 0x1000u;  // ties
    const float f = from_bits(u);
    if (std::isnan(f)) continue;
    const _Float16 h = static_cast<_Float16>(f);
    uint16_t want;
    std::memcpy(&want, &h, 2);
    ASSERT_EQ(f32_to_f16(f), want) << std::hexfloat << f;
  }
  for (uint32_t h = 0; h < 65536; ++h) {
    _Float16 x;
    const uint16_t hh = static_cast<uint16_t>(h);
    std::memcpy(&x, &hh, 2);
    const float f = f16_to_f32(hh);
    if (std::isnan(static_cast<float>(x))) {
      ASSERT_TRUE(std::isnan(f));
      continue;
    }
    ASSERT_EQ(bits(f), bits(static_cast<float>(x))) << h;
    ASSERT_EQ(f32_to_f16(f), hh);
  }
}

// E4M3 against an oracle built from its definition: the value of each code from the
// formula in double, and encoding by searching every finite code for the nearest
// (ties to the even code, beyond 448 saturating).
using detail::f32_to_f8e4m3;
using detail::f8e4m3_to_f32;
using detail::kF8E4M3Max;

double E4m3Value(int c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const double mag = e == 0 ? m * std::ldexp(1.0, -9) : (1.0 + m / 8.0) * std::ldexp(1.0, e - 7);
  return (c & 0x80) ? -mag : mag;
}

uint8_t E4m3Nearest(float f) {
  const double a = std::fabs(double{f});
  int best = 0;
  for (int c = 1; c <= 0x7e; ++c) {
    const double dc = std::fabs(E4m3Value(c) - a), db = std::fabs(E4m3Value(best) - a);
    if (dc < db || (dc == db && c % 2 == 0)) best = c;
  }
  return static_cast<uint8_t>(best | (std::signbit(f) ? 0x80 : 0));
}

TEST(LowPrecisionConvert, F8E4M3MatchesItsDefinition) {
  for (int c = 0; c < 256; ++c) {
    const float f = f8e4m3_to_f32(static_cast<uint8_t>(c));
    if ((c & 0x7f) == 0x7f) {
      ASSERT_TRUE(std::isnan(f)) << c;
      ASSERT_EQ(f32_to_f8e4m3(f) & 0x7f, 0x7f);
      continue;
    }
    ASSERT_EQ(double{f}, E4m3Value(c)) << c;
    ASSERT_EQ(f32_to_f8e4m3(f), c) << c;
    // Halfway to the next code up (ties) and just either side of it.
    if ((c & 0x7f) < 0x7e) {
      const double mid = (E4m3Value(c & 0x7f) + E4m3Value((c & 0x7f) + 1)) / 2 * ((c & 0x80) ? -1 : 1);
      for (float x : {static_cast<float>(mid), std::nextafter(static_cast<float>(mid), 0.0f),
                      std::nextafter(static_cast<float>(mid), static_cast<float>(2 * mid))}) {
        ASSERT_EQ(f32_to_f8e4m3(x), E4m3Nearest(x)) << std::hexfloat << x;
      }
    }
  }
  std::mt19937_64 rng = make_rng(4);
  std::uniform_real_distribution<float> exponent(-14.0f, 10.0f);
  for (int n = 0; n < 200'000; ++n) {
    const float x = std::exp2(exponent(rng)) * (rng() % 2 ? 1.0f : -1.0f);
    ASSERT_EQ(f32_to_f8e4m3(x), E4m3Nearest(x)) << std::hexfloat << x;
  }
  EXPECT_EQ(f32_to_f8e4m3(1e9f), 0x7e);  // saturates: E4M3 has no infinity
  EXPECT_EQ(f32_to_f8e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(f32_to_f8e4m3(-0.0f), 0x80);
  EXPECT_EQ(f8e4m3_to_f32(0x7e), kF8E4M3Max);
}

// Calls f(c, o, store, s) for a fresh call c in bf16 and in f16 of every shape s of
// kShapes under every option case o (its tensors in store), random values from `salt`.
template <class F>
void ForEveryDtypeShapeAndOption(uint64_t salt, F&& f) {
  std::mt19937_64 rng = make_rng(salt);
  for (const DType dt : {DType::bf16, DType::f16})
    for (const Shape& s : kShapes)
      for (const OptionCase& oc : option_cases()) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " " + oc.name + " Lq=" + std::to_string(s.Lq) +
                     " Lk=" + std::to_string(s.Lk) + " d=" + std::to_string(s.d));
        LowpCall c(dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
        OptionStore store;
        const AttentionOptions o = oc.make(store, c, rng);
        f(c, o, store, s);
      }
}

TEST(LowPrecisionAttention, EveryOptionEqualsTheF32KernelRoundedOnce) {
  const ScopedIsa portable("f32");  // the portable path (AMX: attention_amx_test.cc)
  ForEveryDtypeShapeAndOption(3, [](LowpCall& c, const AttentionOptions& o, OptionStore& store, const Shape& s) {
    const DType dt = c.dt;
    attention(c.view(c.q, s.Lq, s.Hq, s.d), c.view(c.k, s.Lk, s.Hkv, s.d), c.view(c.v, s.Lk, s.Hkv, s.dv),
              c.view(c.out, s.Lq, s.Hq, s.dv), o, c.lse_view());
    std::vector<float> out32(c.out.size()), lse32(c.lse.size());
    attention(c.view32(c.q32, s.Lq, s.Hq, s.d), c.view32(c.k32, s.Lk, s.Hkv, s.d),
              c.view32(c.v32, s.Lk, s.Hkv, s.dv), c.view32(out32, s.Lq, s.Hq, s.dv), f32_twin(o, c, store.twin),
              TensorView(lse32.data(), DType::f32, {s.B, s.Hq, s.Lq}));
    for (size_t i = 0; i < out32.size(); ++i) ASSERT_EQ(c.out[i], c.to(out32[i])) << "out " << i;
    for (size_t i = 0; i < lse32.size(); ++i) ASSERT_EQ(bits(c.lse[i]), bits(lse32[i])) << "lse " << i;
    // The reference takes the same dtypes and agrees within the output's rounding.
    std::vector<uint16_t> ref(c.out.size());
    attention_reference(c.view(c.q, s.Lq, s.Hq, s.d), c.view(c.k, s.Lk, s.Hkv, s.d),
                        c.view(c.v, s.Lk, s.Hkv, s.dv), c.view(ref, s.Lq, s.Hq, s.dv), o);
    const float ulp = dt == DType::bf16 ? 1.0f / 128 : 1.0f / 1024;
    for (size_t i = 0; i < ref.size(); ++i)
      ASSERT_LE(std::fabs(c.from(ref[i]) - c.from(c.out[i])), ulp * std::max(1.0f, std::fabs(c.from(ref[i]))))
          << i;
  });
}

// The portable path widens bf16/f16 rows where the f32 kernel packs K/V and loads
// query tiles, through the views' strides (no contiguous copy is made): buffers laid
// out [B, H, L, D] and seen as [B, L, H, D], head dims that leave a vector tail, GQA,
// causal and not. Bitwise the f32 kernel on the same values, rounded once.
TEST(LowPrecisionAttention, StridedInputsEqualTheF32KernelRoundedOnce) {
  const ScopedIsa portable("f32");
  std::mt19937_64 rng = make_rng(17);
  const Shape shapes[] = {{2, 37, 70, 4, 2, 19, 7}, {1, 65, 130, 2, 1, 64, 33}, {1, 1, 1000, 3, 3, 17, 1}};
  for (DType dt : {DType::bf16, DType::f16}) {
    for (const Shape& s : shapes) {
      for (bool causal : {false, true}) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " Lq=" + std::to_string(s.Lq) + " d=" + std::to_string(s.d) +
                     (causal ? " causal" : ""));
        LowpCall c(dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
        auto bhsd = [&](const void* data, DType t, int L, int H, int D) {
          return TensorView(data, t, {c.B, L, H, D}, {int64_t{H} * L * D, D, int64_t{L} * D, 1});
        };
        AttentionOptions o;
        o.causal = causal ? Causal::BottomRight : Causal::None;
        attention(bhsd(c.q.data(), dt, s.Lq, s.Hq, s.d), bhsd(c.k.data(), dt, s.Lk, s.Hkv, s.d),
                  bhsd(c.v.data(), dt, s.Lk, s.Hkv, s.dv), bhsd(c.out.data(), dt, s.Lq, s.Hq, s.dv), o, c.lse_view());
        std::vector<float> out32(c.out.size()), lse32(c.lse.size());
        attention(bhsd(c.q32.data(), DType::f32, s.Lq, s.Hq, s.d), bhsd(c.k32.data(), DType::f32, s.Lk, s.Hkv, s.d),
                  bhsd(c.v32.data(), DType::f32, s.Lk, s.Hkv, s.dv),
                  bhsd(out32.data(), DType::f32, s.Lq, s.Hq, s.dv), o,
                  TensorView(lse32.data(), DType::f32, {s.B, s.Hq, s.Lq}));
        for (size_t i = 0; i < out32.size(); ++i) ASSERT_EQ(c.out[i], c.to(out32[i])) << "out " << i;
        for (size_t i = 0; i < lse32.size(); ++i) ASSERT_EQ(bits(c.lse[i]), bits(lse32[i])) << "lse " << i;
      }
    }
  }
}

// The f32 kernel reads bf16/f16 in place, and rounds f32 inputs under Precision::bf16
// as it packs them: its workspace is the packed K/V and the tiles, with no f32 copy of
// q, k, v or out on top.
TEST(LowPrecisionAttention, PortablePathNeedsNoCopiesOfTheInputs) {
  const ScopedIsa portable("f32");
  std::mt19937_64 rng = make_rng(19);
  LowpCall c(DType::f16, 1, 300, 300, 4, 4, 64, 64, rng);
  const TensorView q = c.view(c.q, 300, 4, 64), k = c.view(c.k, 300, 4, 64), v = c.view(c.v, 300, 4, 64),
                   out = c.view(c.out, 300, 4, 64);
  const TensorView q32 = c.view32(c.q32, 300, 4, 64), k32 = c.view32(c.k32, 300, 4, 64),
                   v32 = c.view32(c.v32, 300, 4, 64);
  std::vector<float> o32(c.out.size());
  const TensorView out32 = c.view32(o32, 300, 4, 64);
  EXPECT_EQ(attention_workspace_bytes(q, k, v, out, {}, 1), attention_workspace_bytes(q32, k32, v32, out32, {}, 1));
  AttentionOptions rounded;
  rounded.precision = Precision::bf16;
  EXPECT_EQ(attention_workspace_bytes(q32, k32, v32, out32, rounded, 1),
            attention_workspace_bytes(q32, k32, v32, out32, {}, 1));
}

// FlashAttention's yardstick: bf16 inputs, f32 scores and softmax, P rounded to bf16
// before P·V, f32 accumulation, output rounded to bf16.
std::vector<float> plain_lowp(const LowpCall& c, bool causal) {
  std::vector<float> out(c.out.size());
  const float scale = 1.0f / std::sqrt(float(c.d));
  for (int b = 0; b < c.B; ++b)
    for (int h = 0; h < c.Hq; ++h) {
      const int hk = h / (c.Hq / c.Hkv);
      for (int i = 0; i < c.Lq; ++i) {
        std::vector<float> s(c.Lk, -INFINITY);
        float m = -INFINITY;
        for (int j = 0; j < c.Lk && (!causal || j <= i); ++j) {
          float acc = 0;
          for (int x = 0; x < c.d; ++x)
            acc += c.q32[((size_t(b) * c.Lq + i) * c.Hq + h) * c.d + x] * c.k32[((size_t(b) * c.Lk + j) * c.Hkv + hk) * c.d + x];
          s[j] = acc * scale;
          m = std::max(m, s[j]);
        }
        float l = 0;
        for (float& x : s) {
          x = std::isinf(x) ? 0.0f : std::exp(x - m);
          l += x;
        }
        for (int y = 0; y < c.dv; ++y) {
          float acc = 0;
          for (int j = 0; j < c.Lk; ++j)
            acc += c.from(c.to(s[j])) * c.v32[((size_t(b) * c.Lk + j) * c.Hkv + hk) * c.dv + y];
          out[((size_t(b) * c.Lq + i) * c.Hq + h) * c.dv + y] = c.from(c.to(acc / l));
        }
      }
    }
  return out;
}

TEST(LowPrecisionAttention, WithinTwiceThePlainLowPrecisionError) {
  const ScopedIsa portable("f32");  // the portable path (AMX: attention_amx_test.cc)
  std::mt19937_64 rng = make_rng(4);
  for (DType dt : {DType::bf16, DType::f16}) {
    double fused = 0, plain = 0;
    for (const Shape& s : kShapes)
      for (bool causal : {false, true}) {
        LowpCall c(dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
        AttentionOptions o;
        o.causal = causal ? Causal::TopLeft : Causal::None;
        attention(c.view(c.q, s.Lq, s.Hq, s.d), c.view(c.k, s.Lk, s.Hkv, s.d), c.view(c.v, s.Lk, s.Hkv, s.dv),
                  c.view(c.out, s.Lq, s.Hq, s.dv), o);
        std::vector<float> ref(c.out.size());
        attention_reference(c.view32(c.q32, s.Lq, s.Hq, s.d), c.view32(c.k32, s.Lk, s.Hkv, s.d),
                            c.view32(c.v32, s.Lk, s.Hkv, s.dv), c.view32(ref, s.Lq, s.Hq, s.dv), o);
        const std::vector<float> p = plain_lowp(c, causal);
        double f2 = 0, p2 = 0, r2 = 0;
        for (size_t i = 0; i < ref.size(); ++i) {
          f2 += std::pow(double(c.from(c.out[i])) - ref[i], 2);
          p2 += std::pow(double(p[i]) - ref[i], 2);
          r2 += double(ref[i]) * ref[i];
        }
        EXPECT_LE(f2, 4.0 * p2 + 1e-30) << dtype_name(dt) << " case Lq=" << s.Lq << " causal=" << causal;
        fused += f2, plain += p2;
        (void)r2;
      }
    EXPECT_LE(std::sqrt(fused), 2.0 * std::sqrt(plain)) << dtype_name(dt);
    EXPECT_GT(plain, 0.0);
  }
}

TEST(LowPrecisionAttention, BackwardEqualsTheF32KernelRoundedOnce) {
  const ScopedIsa portable("f32");  // the portable path (AMX: attention_amx_test.cc)
  std::mt19937_64 rng = make_rng(5);
  for (DType dt : {DType::bf16, DType::f16})
    for (const Shape& s : kShapes)
      for (const OptionCase& oc : option_cases()) {
        SCOPED_TRACE(std::string(dtype_name(dt)) + " " + oc.name + " Lq=" + std::to_string(s.Lq));
        LowpCall c(dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
        OptionStore store;
        const AttentionOptions o = oc.make(store, c, rng);
        const TensorView q = c.view(c.q, s.Lq, s.Hq, s.d), k = c.view(c.k, s.Lk, s.Hkv, s.d),
                         v = c.view(c.v, s.Lk, s.Hkv, s.dv), out = c.view(c.out, s.Lq, s.Hq, s.dv);
        attention(q, k, v, out, o, c.lse_view());
        c.dq.assign(c.q.size(), 0);
        c.dk.assign(c.k.size(), 0);
        c.dv_.assign(c.v.size(), 0);
        attention_backward(q, k, v, out, c.lse_view(), c.view(c.dout, s.Lq, s.Hq, s.dv), c.view(c.dq, s.Lq, s.Hq, s.d),
                           c.view(c.dk, s.Lk, s.Hkv, s.d), c.view(c.dv_, s.Lk, s.Hkv, s.dv), o);
        std::vector<float> out32(c.out.size()), dq32(c.q.size()), dk32(c.k.size()), dv32(c.v.size());
        for (size_t i = 0; i < out32.size(); ++i) out32[i] = c.from(c.out[i]);
        const AttentionOptions t = f32_twin(o, c, store.twin);
        attention_backward(c.view32(c.q32, s.Lq, s.Hq, s.d), c.view32(c.k32, s.Lk, s.Hkv, s.d),
                           c.view32(c.v32, s.Lk, s.Hkv, s.dv), c.view32(out32, s.Lq, s.Hq, s.dv), c.lse_view(),
                           c.view32(c.dout32, s.Lq, s.Hq, s.dv), c.view32(dq32, s.Lq, s.Hq, s.d),
                           c.view32(dk32, s.Lk, s.Hkv, s.d), c.view32(dv32, s.Lk, s.Hkv, s.dv), t);
        for (size_t i = 0; i < dq32.size(); ++i) ASSERT_EQ(c.dq[i], c.to(dq32[i])) << "dq " << i;
        for (size_t i = 0; i < dk32.size(); ++i) ASSERT_EQ(c.dk[i], c.to(dk32[i])) << "dk " << i;
        for (size_t i = 0; i < dv32.size(); ++i) ASSERT_EQ(c.dv_[i], c.to(dv32[i])) << "dv " << i;
      }
}

// The f32 kernel rounds f32 inputs to bf16 where it packs K/V and loads q tiles: the
// result is bitwise the f32 kernel's on rounded copies, for odd head dims, ties, values
// that round up to infinity, NaN, and any thread count.
TEST(LowPrecisionAttention, Bf16PrecisionRoundsF32InputsInside) {
  const ScopedIsa portable("f32");  // the portable path (AMX: attention_amx_test.cc)
  std::mt19937_64 rng = make_rng(6);
  struct Shape {
    int B, Lq, Lk, H, d;
  };
  for (const Shape s : {Shape{2, 37, 37, 2, 64}, Shape{1, 130, 67, 3, 17}, Shape{1, 9, 300, 1, 128}}) {
    SCOPED_TRACE(::testing::Message() << "B " << s.B << " Lq " << s.Lq << " Lk " << s.Lk << " d " << s.d);
    std::vector<float> q(size_t(s.B) * s.Lq * s.H * s.d), k(size_t(s.B) * s.Lk * s.H * s.d), v(k.size());
    std::uniform_real_distribution<float> u(-2, 2);
    for (auto* x : {&q, &k, &v})
      for (float& f : *x) f = u(rng);
    k[3] = 1.0f + 0x1p-8f;  // a tie: rounds to even (1.0)
    v[5] = 3.3999e38f;      // rounds up to +inf: its column is inf or NaN
    q[q.size() - 1] = NAN;  // the last query row is NaN
    AttentionOptions o;
    o.precision = Precision::bf16;
    o.causal = s.Lq <= s.Lk ? Causal::BottomRight : Causal::TopLeft;
    auto view = [&](const std::vector<float>& x, int L) {
      return TensorView(x.data(), DType::f32, {s.B, L, s.H, s.d});
    };
    std::vector<float> out(q.size()), out2(q.size()), want(q.size());
    with_threads(1, [&] { attention(view(q, s.Lq), view(k, s.Lk), view(v, s.Lk), view(out, s.Lq), o); });
    with_threads(2, [&] { attention(view(q, s.Lq), view(k, s.Lk), view(v, s.Lk), view(out2, s.Lq), o); });
    std::vector<float> qr = q, kr = k, vr = v;
    for (auto* x : {&qr, &kr, &vr})
      for (float& f : *x) f = detail::round_to_bf16(f);
    ASSERT_TRUE(std::isinf(vr[5]));
    AttentionOptions exact_options = o;
    exact_options.precision = Precision::f32;
    attention(view(qr, s.Lq), view(kr, s.Lk), view(vr, s.Lk), view(want, s.Lq), exact_options);
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_EQ(bits(out[i]), bits(want[i])) << i;
      ASSERT_EQ(bits(out2[i]), bits(want[i])) << i;
    }
    EXPECT_TRUE(std::isnan(out.back()));
    // Not a no-op: the inputs were not bf16 values.
    std::vector<float> exact(q.size());
    attention(view(q, s.Lq), view(k, s.Lk), view(v, s.Lk), view(exact, s.Lq), exact_options);
    int differ = 0;
    for (size_t i = 0; i < out.size(); ++i) differ += std::isfinite(out[i]) && out[i] != exact[i];
    EXPECT_GT(differ, int(out.size() / 2));
  }
}

TEST(LowPrecisionAttention, NanInAKeyMakesTheRowNanAndThreadsDoNotMatter) {
  std::mt19937_64 rng = make_rng(7);
  for (DType dt : {DType::bf16, DType::f16}) {
    LowpCall c(dt, 1, 70, 90, 2, 1, 64, 64, rng);
    c.k[5 * 64 + 3] = c.to(NAN);  // key 5
    AttentionOptions o;
    o.causal = Causal::TopLeft;  // rows 0–4 cannot see key 5
    const TensorView q = c.view(c.q, 70, 2, 64), k = c.view(c.k, 90, 1, 64), v = c.view(c.v, 90, 1, 64),
                     out = c.view(c.out, 70, 2, 64);
    with_threads(1, [&] { attention(q, k, v, out, o, c.lse_view()); });
    const std::vector<uint16_t> one = c.out;
    with_threads(2, [&] { attention(q, k, v, out, o, c.lse_view()); });
    EXPECT_EQ(one, c.out);
    for (int i = 0; i < 70; ++i)
      for (int h = 0; h < 2; ++h) {
        const float x = c.from(c.out[(size_t(i) * 2 + h) * 64]);
        EXPECT_EQ(std::isnan(x), i >= 5) << "row " << i << " head " << h;
      }
  }
}

// Views of a LowpCall's tensors, and one pass under `isa` (nullptr: the default
// choice) with `threads` threads.
struct CallViews {
  TensorView q, k, v, out, lse, dout, dq, dk, dv;
  explicit CallViews(LowpCall& c)
      : q(c.view(c.q, c.Lq, c.Hq, c.d)), k(c.view(c.k, c.Lk, c.Hkv, c.d)), v(c.view(c.v, c.Lk, c.Hkv, c.dv)),
        out(c.view(c.out, c.Lq, c.Hq, c.dv)), lse(c.lse_view()), dout(c.view(c.dout, c.Lq, c.Hq, c.dv)),
        dq(c.view(c.dq, c.Lq, c.Hq, c.d)), dk(c.view(c.dk, c.Lk, c.Hkv, c.d)), dv(c.view(c.dv_, c.Lk, c.Hkv, c.dv)) {}
};

// out (and lse) of the forward.
std::vector<uint16_t> ForwardUnder(LowpCall& c, const AttentionOptions& o, const char* isa, int threads) {
  const ScopedEnv path("ATTN_ISA", isa);
  const CallViews t(c);
  with_threads(threads, [&] { attention(t.q, t.k, t.v, t.out, o, t.lse); });
  return c.out;
}

// dq, dk, dv of the backward on c's out and lse, one after the other.
std::vector<uint16_t> BackwardUnder(LowpCall& c, const AttentionOptions& o, const char* isa, int threads) {
  const ScopedEnv path("ATTN_ISA", isa);
  c.dq.assign(c.q.size(), 0);
  c.dk.assign(c.k.size(), 0);
  c.dv_.assign(c.v.size(), 0);
  const CallViews t(c);
  with_threads(threads, [&] { attention_backward(t.q, t.k, t.v, t.out, t.lse, t.dout, t.dq, t.dk, t.dv, o); });
  std::vector<uint16_t> all = c.dq;
  all.insert(all.end(), c.dk.begin(), c.dk.end());
  all.insert(all.end(), c.dv_.begin(), c.dv_.end());
  return all;
}

// Where vdpbf16ps is the default path (AMD Zen 4/5), a bf16 call whose scores fill its
// tile pairs in small part runs on the f32 kernel (attention.cpp, TilesMostlyPadding:
// the backward below two fifths of the pairs, the forward below a twentieth when every
// sequence fits in one tile pair), and every
// other call on the tiles: each pass is bitwise
// the result of the path ATTN_ISA forces, for 1 and 2 threads alike, and the
// workspace estimates are that path's.
TEST(LowPrecisionAttention, ShortCallsOnVdpbf16psTakeTheF32KernelByShape) {
  {
    const ScopedEnv unset("ATTN_ISA", nullptr);
    if (detail::lowp_path() != detail::LowpPath::avx512bf16) {
      GTEST_SKIP() << "the default bf16 path here is " << detail::lowp_path_name(detail::lowp_path());
    }
  }
  const FewQueriesOff tiled;  // Lq = 3 below would otherwise take the decode kernel
  std::mt19937_64 rng = make_rng(9);
  struct Case {
    int B, Lq, Lk;
    bool forward_f32, backward_f32;
  };
  const Case cases[] = {
      {2, 12, 17, true, true},    // 204 of 4096 scores: both passes on the f32 kernel
      {1, 3, 64, true, true},     // 192
      {1, 16, 16, false, true},   // 256, a sixteenth: the forward keeps the tiles
      {3, 32, 32, false, true},   // 1024, a quarter
      {1, 40, 40, false, true},   // 1600, just under two fifths
      {2, 41, 40, false, false},  // 1640, just over: the tiles
      {1, 65, 3, false, true},    // 195 of 2 pairs' 8192: the backward on f32, not the forward
      {1, 7, 200, false, true},   // 1400 of 4 pairs' 16384
      {2, 25, 300, false, true},  // 0.366 of 5 pairs
      {1, 28, 300, false, false}, // 0.410 of 5 pairs: the tiles
      {1, 150, 26, false, true},  // 0.317 of 3 pairs (more queries would put ALiBi rows past the
                                  // tiles' |lse| limit, where they decline)
      {1, 70, 70, false, true},   // 0.299 of 4 pairs
      {2, 90, 90, false, false},  // 0.494 of 4 pairs: the tiles
  };
  for (const Case& cs : cases)
    for (const OptionCase& oc : option_cases()) {
      SCOPED_TRACE(std::string(oc.name) + " B=" + std::to_string(cs.B) + " Lq=" + std::to_string(cs.Lq) +
                   " Lk=" + std::to_string(cs.Lk));
      LowpCall c(DType::bf16, cs.B, cs.Lq, cs.Lk, 4, 2, 64, 64, rng);
      OptionStore store;
      const AttentionOptions o = oc.make(store, c, rng);
      const char* forward_path = cs.forward_f32 ? "f32" : "avx512bf16";
      // The tile backward declines softcap (attention_backward_amx.hpp): f32 on every path.
      const bool tiles_decline = o.softcap > 0.0f;
      const char* backward_path = cs.backward_f32 || tiles_decline ? "f32" : "avx512bf16";
      const char* other_backward = cs.backward_f32 ? "avx512bf16" : "f32";

      const std::vector<uint16_t> out = ForwardUnder(c, o, nullptr, 1);
      const std::vector<float> lse = c.lse;
      EXPECT_EQ(out, ForwardUnder(c, o, nullptr, 2)) << "forward, 2 threads";
      EXPECT_EQ(out, ForwardUnder(c, o, forward_path, 1)) << "forward against ATTN_ISA=" << forward_path;
      ASSERT_NE(out, ForwardUnder(c, o, cs.forward_f32 ? "avx512bf16" : "f32", 1)) << "the forward paths must differ";

      c.out = out;  // every backward reads the default forward's out and lse
      c.lse = lse;
      const std::vector<uint16_t> grads = BackwardUnder(c, o, nullptr, 1);
      EXPECT_EQ(grads, BackwardUnder(c, o, nullptr, 2)) << "backward, 2 threads";
      EXPECT_EQ(grads, BackwardUnder(c, o, backward_path, 1)) << "backward against ATTN_ISA=" << backward_path;
      if (!tiles_decline) {
        ASSERT_NE(grads, BackwardUnder(c, o, other_backward, 1)) << "the paths must differ for the test to tell";
      }

      const CallViews t(c);
      const auto forward_bytes = [&](const char* isa) {
        const ScopedEnv path("ATTN_ISA", isa);
        return attention_workspace_bytes(t.q, t.k, t.v, t.out, o, 1);
      };
      const auto backward_bytes = [&](const char* isa) {
        const ScopedEnv path("ATTN_ISA", isa);
        return attention_backward_workspace_bytes(t.q, t.k, t.v, t.out, t.lse, t.dout, t.dq, t.dk, t.dv, o, 1);
      };
      EXPECT_EQ(forward_bytes(nullptr), forward_bytes(forward_path));
      EXPECT_EQ(backward_bytes(nullptr), backward_bytes(backward_path));
      if (!tiles_decline) EXPECT_NE(backward_bytes(nullptr), backward_bytes(other_backward));
    }
}

// The portable path (the f32 kernel: ATTN_ISA=f32, and f16 where the CPU has no AMX)
// widens bf16/f16 rows where it packs them and rounds the gradients once where it
// writes them, so that no tensor is copied: bitwise the f32 backward of the exact f32
// twins, each gradient rounded to the dtype, on 1 and 2 threads, for every shape and
// option case; and its workspace is the f32 call's, plus the copy of a mask in the
// input dtype.
TEST(LowPrecisionAttention, PortableBackwardIsTheF32BackwardOfTheWidenedInputs) {
  ForEveryDtypeShapeAndOption(31, [](LowpCall& c, const AttentionOptions& o, OptionStore& store, const Shape&) {
    const DType dt = c.dt;
    const AttentionOptions o32 = f32_twin(o, c, store.twin);
    ForwardUnder(c, o, "f32", 1);  // out and lse, as the backward reads them
    std::vector<float> out32(c.out.size()), dq32(c.q.size()), dk32(c.k.size()), dv32(c.v.size());
    for (size_t i = 0; i < out32.size(); ++i) out32[i] = c.from(c.out[i]);
    const TensorView q32 = c.view32(c.q32, c.Lq, c.Hq, c.d), k32 = c.view32(c.k32, c.Lk, c.Hkv, c.d),
                     v32 = c.view32(c.v32, c.Lk, c.Hkv, c.dv), o32v = c.view32(out32, c.Lq, c.Hq, c.dv),
                     g32 = c.view32(c.dout32, c.Lq, c.Hq, c.dv), dq = c.view32(dq32, c.Lq, c.Hq, c.d),
                     dk = c.view32(dk32, c.Lk, c.Hkv, c.d), dv = c.view32(dv32, c.Lk, c.Hkv, c.dv);
    attention_backward(q32, k32, v32, o32v, c.lse_view(), g32, dq, dk, dv, o32);
    std::vector<uint16_t> want;
    for (const std::vector<float>* g : {&dq32, &dk32, &dv32})
      for (const float x : *g) want.push_back(c.to(x));
    for (const int threads : {1, 2}) EXPECT_EQ(BackwardUnder(c, o, "f32", threads), want) << threads << " threads";

    const CallViews t(c);
    const ScopedEnv path("ATTN_ISA", "f32");
    const size_t mask_copy = !o.mask.empty() && o.mask.dtype() == dt ? sizeof(float) * o.mask.numel() : 0;
    EXPECT_EQ(attention_backward_workspace_bytes(t.q, t.k, t.v, t.out, t.lse, t.dout, t.dq, t.dk, t.dv, o, 1),
              attention_backward_workspace_bytes(q32, k32, v32, o32v, c.lse_view(), g32, dq, dk, dv, o32, 1) +
                  mask_copy);
  });
}

TEST(LowPrecisionAttention, MixedDtypesAreErrors) {
  std::mt19937_64 rng = make_rng(8);
  LowpCall c(DType::bf16, 1, 4, 4, 1, 1, 8, 8, rng);
  std::vector<float> f(64);
  std::vector<uint16_t> h(64);
  const TensorView q = c.view(c.q, 4, 1, 8), k = c.view(c.k, 4, 1, 8), v = c.view(c.v, 4, 1, 8),
                   out = c.view(c.out, 4, 1, 8);
  const auto expect = expect_attn_error;
  expect([&] { attention(q, TensorView(f.data(), DType::f32, {1, 4, 1, 8}), v, out); },
         "k must have dtype bf16 (the dtype of q; mixed dtypes are an error), got f32");
  expect([&] { attention(q, k, v, TensorView(h.data(), DType::f16, {1, 4, 1, 8})); },
         "out must have dtype bf16");
  AttentionOptions o;
  o.mask = TensorView(h.data(), DType::f16, {4, 4});
  expect([&] { attention(q, k, v, out, o); }, "mask must be boolean (true = attend) or additive in f32 or bf16, got f16");
  expect([&] { attention(q, k, v, out, {}, TensorView(h.data(), DType::bf16, {1, 1, 4})); }, "lse must have dtype f32");
  std::vector<float> lse(4);
  attention(q, k, v, out, {}, TensorView(lse.data(), DType::f32, {1, 1, 4}));
  expect([&] {
    attention_backward(q, k, v, out, TensorView(lse.data(), DType::f32, {1, 1, 4}), out,
                       TensorView(f.data(), DType::f32, {1, 4, 1, 8}), k, v);
  }, "dq must have dtype bf16");
}

}  // namespace
}  // namespace attn::testing
