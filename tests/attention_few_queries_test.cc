// attention() with a few queries per sequence runs on the decode kernel, which reads k
// and v where they lie (kvcache/few_queries.hpp). Checked here: which calls take it
// (the traffic counters tell the decode kernel's reads from the tiled kernels'
// packing), every option it takes (masks too) against the float64 reference in f32, bf16 and f16,
// results that do not depend on the thread count, and the ATTN_FEW_QUERIES override.
// The harness's run_case also runs every short case of the other forward suites on
// both kernels.
#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "cpu/isa.hpp"
#include "kvcache/few_queries.hpp"
#include "lowp_harness.hpp"
#include "traffic.hpp"

namespace attn::testing {
namespace {

using FewQueries = PooledErrorTest;

/// Runs s through run_case (both kernels, see the harness) and reports whether the
/// default call read k and v in place (the decode kernel's counter moved; so every
/// call here must leave some key visible).
bool took_the_decode_kernel(Config& s, std::mt19937_64& rng, ErrorLedger& ledger) {
  detail::traffic().reset();
  const Errors e = run_case(s, rng);
  EXPECT_TRUE(ledger.check(e));
  return detail::traffic().cache_read_bytes.load() > 0;
}

TEST_F(FewQueries, EveryOptionItTakesAgainstTheReference) {
  auto rng = make_rng(3001);
  for (int lq : {1, 2, 3, 4}) {
    for (int lk : {1, 3, 17, 300, 1000}) {
      for (Causal c : {Causal::None, Causal::TopLeft, Causal::BottomRight}) {
        Config s;
        s.B = 2, s.Lq = lq, s.Lk = lk, s.Hq = 6, s.Hkv = 2, s.d = 40, s.dv = 24;
        s.opt.causal = c;
        const int variant = (lq + lk + static_cast<int>(c)) % 5;
        // (A bottom-right window beside top-left causality would hide every key here:
        // the counters could not tell a route that read nothing from one not taken.)
        if (variant == 1 && c != Causal::TopLeft) s.opt.window = {7, 2};
        if (variant == 2) s.set_alibi(lk % 2 == 0, rng);
        if (variant == 3) s.opt.softcap = 3.0f, s.opt.scale = 0.4f;
        if (variant == 4) s.set_key_lengths(rng, 1);
        s.bhsd = lk % 2 == 1;
        SCOPED_TRACE(s.describe());
        EXPECT_TRUE(took_the_decode_kernel(s, rng, ledger));
      }
    }
  }
  // 9–16 queries: the decode kernel's on AMD Zen 4/5 (few_queries_limit), else the tiled
  // kernels'; the harness runs both either way.
  for (int lq : {12, 16}) {
    for (int lk : {300, 1000}) {
      for (Causal c : {Causal::None, Causal::BottomRight}) {
        Config s;
        s.B = 2, s.Lq = lq, s.Lk = lk, s.Hq = 6, s.Hkv = 2, s.d = 40, s.dv = 24;
        s.opt.causal = c;
        if (lk == 1000) s.opt.window = {300, 0};
        if (c == Causal::None) s.set_alibi(true, rng), s.opt.softcap = 3.0f;
        s.bhsd = lq == 12;
        SCOPED_TRACE(s.describe());
        EXPECT_EQ(took_the_decode_kernel(s, rng, ledger), lq <= detail::few_queries_limit(lk, DType::f32, 3));
      }
    }
  }
}

TEST_F(FewQueries, HeadDimsAndGroups) {
  auto rng = make_rng(3002);
  for (int d : {1, 7, 64, 128, 256}) {
    for (int group : {1, 4, 8}) {
      Config s;
      s.Lq = 1 + d % 4, s.Lk = 333, s.Hq = 8, s.Hkv = 8 / group, s.d = d, s.dv = d == 7 ? 9 : d;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(took_the_decode_kernel(s, rng, ledger));
    }
  }
}

TEST_F(FewQueries, PackedBatchesOfEqualQueryLengths) {
  auto rng = make_rng(3003);
  for (Causal c : {Causal::None, Causal::BottomRight}) {
    Config s;
    s.Hq = 4, s.Hkv = 2;
    s.set_varlen({2, 2, 2, 2}, {3, 0, 300, 17});
    s.opt.causal = c;
    SCOPED_TRACE(s.describe());
    EXPECT_TRUE(took_the_decode_kernel(s, rng, ledger));
  }
}

// Boolean and additive masks of every broadcast shape, with GQA, causality, key
// lengths and BHSD views: the decode kernel applies them (decoding steps that carry a
// padding mask, as models pass one to SDPA on every step).
TEST_F(FewQueries, MasksTakeTheDecodeKernel) {
  auto rng = make_rng(3006);
  const std::vector<std::vector<int64_t>> shapes = {{2, 6, 2, 300}, {2, 1, 1, 300}, {2, 300}, {300}, {6, 1, 300}};
  int n = 0;
  for (const auto& shape : shapes) {
    for (int variant = 0; variant < 4; ++variant) {
      Config s;
      s.B = 2, s.Lq = 2, s.Lk = 300, s.Hq = 6, s.Hkv = 2, s.d = 40, s.dv = 24;
      if (variant < 2) {
        s.set_bool_mask(shape, rng);
      } else {
        s.set_add_mask(shape, rng);
      }
      s.opt.causal = n % 3 == 0 ? Causal::BottomRight : Causal::None;
      if (n % 4 == 1) s.set_key_lengths(rng, 1);
      s.bhsd = n % 2 == 1;
      ++n;
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(took_the_decode_kernel(s, rng, ledger));
    }
  }
}

// bf16 and f16 inputs with a boolean mask, or an additive one in the input dtype,
// take the decode kernel (k and v read in place, nothing packed).
TEST(FewQueriesTraffic, MasksWithLowPrecisionInputsTakeTheDecodeKernel) {
  std::mt19937_64 rng = make_rng(3007);
  for (DType dt : {DType::bf16, DType::f16}) {
    const int B = 2, Lk = 300, Hq = 8, Hkv = 2, d = 64;
    LowpCall c(dt, B, 1, Lk, Hq, Hkv, d, d, rng);
    std::vector<uint8_t> keep(size_t(B) * Lk);
    for (uint8_t& x : keep) x = rng() % 10 != 0;
    AttentionOptions o;
    o.mask = TensorView(keep.data(), DType::boolean, {B, 1, 1, Lk});
    auto call = [&] {
      attention(c.view(c.q, 1, Hq, d), c.view(c.k, Lk, Hkv, d), c.view(c.v, Lk, Hkv, d), c.view(c.out, 1, Hq, d), o);
    };
    detail::traffic().reset();
    call();
    EXPECT_EQ(detail::traffic().cache_read_bytes.load(), uint64_t(B) * Lk * Hkv * 2 * d * dtype_size(dt));
    EXPECT_EQ(detail::traffic().packed_bytes.load(), 0u);
    std::vector<uint16_t> additive(size_t(B) * Lk);
    for (size_t i = 0; i < additive.size(); ++i) additive[i] = c.to(keep[i] ? 0.0f : -INFINITY);
    o.mask = TensorView(additive.data(), dt, {B, 1, 1, Lk});
    detail::traffic().reset();
    call();
    EXPECT_EQ(detail::traffic().cache_read_bytes.load(), uint64_t(B) * Lk * Hkv * 2 * d * dtype_size(dt));
    EXPECT_EQ(detail::traffic().packed_bytes.load(), 0u);
  }
}

TEST_F(FewQueries, CallsItDoesNotTakeRunOnTheTiledKernels) {
  auto rng = make_rng(3004);
  auto expect_tiled = [&](Config& s) {
    SCOPED_TRACE(s.describe());
    EXPECT_FALSE(took_the_decode_kernel(s, rng, ledger));
  };
  {
    Config s;  // more queries than the limit: 8 from 256 keys (16 on AMD Zen 4/5), else 4
    s.Lq = detail::few_queries_limit(300, DType::f32, 1) + 1, s.Lk = 300;
    expect_tiled(s);
    s.Lq = 5, s.Lk = 255;
    expect_tiled(s);
  }
  {
    Config s;  // unequal query lengths
    s.set_varlen({1, 2}, {30, 40});
    expect_tiled(s);
  }
  {
    Config s;
    s.Lq = 2, s.Lk = 50, s.want_probs = true;
    expect_tiled(s);
  }
  {
    Config s;
    s.Lq = 1, s.Lk = 50;
    auto score_mod = [](float x, int, int, int i, int j) { return x + 0.1f * static_cast<float>(i - j); };
    const detail::ModPair<decltype(score_mod), NoMaskMod> mod{score_mod, {}};
    const detail::UserMods um = detail::make_user_mods(mod);
    SCOPED_TRACE(s.describe());
    detail::traffic().reset();
    EXPECT_TRUE(ledger.check(run_case(s, rng, {&um})));
    EXPECT_EQ(detail::traffic().cache_read_bytes.load(), 0u);
  }
}

// What the route saves, and that the counters tell the kernels apart: one query over
// 300 keys reads each key and value row once and packs nothing; with the route off,
// the same call packs them all.
TEST(FewQueriesTraffic, OneQueryReadsTheKeysOnceAndPacksNothing) {
  std::mt19937_64 rng = make_rng(3005);
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int B = 2, Lk = 300, Hq = 8, Hkv = 2, d = 64;
    LowpCall c(dt == DType::f32 ? DType::bf16 : dt, B, 1, Lk, Hq, Hkv, d, d, rng);
    const TensorView q = dt == DType::f32 ? c.view32(c.q32, 1, Hq, d) : c.view(c.q, 1, Hq, d);
    const TensorView k = dt == DType::f32 ? c.view32(c.k32, Lk, Hkv, d) : c.view(c.k, Lk, Hkv, d);
    const TensorView v = dt == DType::f32 ? c.view32(c.v32, Lk, Hkv, d) : c.view(c.v, Lk, Hkv, d);
    std::vector<float> out32(size_t(B) * Hq * d);
    const TensorView out = dt == DType::f32 ? c.view32(out32, 1, Hq, d) : c.view(c.out, 1, Hq, d);
    const uint64_t rows = uint64_t(B) * Lk * Hkv * 2 * d * dtype_size(dt);
    detail::traffic().reset();
    attention(q, k, v, out);
    EXPECT_EQ(detail::traffic().cache_read_bytes.load(), rows);
    EXPECT_EQ(detail::traffic().packed_bytes.load(), 0u);
    const FewQueriesOff off;
    detail::traffic().reset();
    attention(q, k, v, out);
    EXPECT_EQ(detail::traffic().cache_read_bytes.load(), 0u);
    EXPECT_GT(detail::traffic().packed_bytes.load(), 0u);
  }
}

// A −FLT_MAX mask entry leaves its key seen with p = 0: a NaN in its value makes that
// column NaN on both kernels, as in the float64 reference; a NaN value under a −∞
// entry (removed) reaches nothing. Scores ~100 apart underflow the same way.
TEST(FewQueriesNonFinite, SeenKeysWhosePUnderflowsPassNaNValuesOn) {
  std::mt19937_64 rng = make_rng(3008);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int Lk = 300, Hq = 4, Hkv = 2, d = 24;
  std::vector<float> q(size_t(Hq) * d), k(size_t(Lk) * Hkv * d), v(k.size()), out(q.size()), mask(Lk, 0.0f);
  for (float& x : q) x = u(rng);
  for (float& x : k) x = u(rng);
  for (float& x : v) x = u(rng);
  std::copy(q.begin(), q.begin() + d, q.begin() + d);  // heads 0 and 1 (kv head 0) alike
  mask[77] = -FLT_MAX;
  mask[130] = -INFINITY;
  v[(size_t(77) * Hkv + 1) * d + 9] = NAN;        // kv head 1, seen: column 9 of heads 2, 3
  v[(size_t(130) * Hkv + 0) * d + 3] = NAN;       // removed
  v[(size_t(200) * Hkv + 0) * d + 5] = INFINITY;  // kv head 0, key 200's score ~2000 below the rest
  for (int x = 0; x < d; ++x) k[(size_t(200) * Hkv + 0) * d + x] = q[x] < 0 ? 1e3f : -1e3f;
  AttentionOptions o;
  o.mask = TensorView(mask.data(), DType::f32, {Lk});
  for (bool decode_kernel : {true, false}) {
    SCOPED_TRACE(decode_kernel ? "decode kernel" : "tiled kernels");
    std::unique_ptr<FewQueriesOff> off(decode_kernel ? nullptr : new FewQueriesOff);
    detail::traffic().reset();
    attention(TensorView(q.data(), DType::f32, {1, 1, Hq, d}), TensorView(k.data(), DType::f32, {1, Lk, Hkv, d}),
              TensorView(v.data(), DType::f32, {1, Lk, Hkv, d}), TensorView(out.data(), DType::f32, {1, 1, Hq, d}), o);
    EXPECT_EQ(detail::traffic().cache_read_bytes.load() > 0, decode_kernel);
    for (int h = 0; h < Hq; ++h) {
      for (int x = 0; x < d; ++x) {
        const bool want_nan = (h >= 2 && x == 9) || (h < 2 && x == 5);
        ASSERT_EQ(std::isnan(out[size_t(h) * d + x]), want_nan) << "head " << h << " x " << x;
      }
    }
  }
}

// bf16 and f16 inputs on the default path (the decode kernel for these shapes) under
// FlashAttention's rule against the plain low-precision implementation.
TEST(FewQueriesLowPrecision, WithinTwiceThePlainError) {
  const Shape shapes[] = {{1, 1, 1, 1, 1, 16, 16},
                          {2, 3, 17, 4, 2, 64, 64},
                          {1, 4, 300, 2, 1, 80, 48},
                          {2, 8, 1000, 8, 2, 128, 128},
                          {1, 2, 65, 3, 1, 32, 40},
                          {2, 16, 1000, 8, 2, 128, 128}};  // the decode kernel's on AMD Zen 4/5
  for (DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    std::mt19937_64 rng = make_rng(3006);
    for (const OptionCase& oc : option_cases()) {
      ExpectWithinPlainBf16Error(shapes, oc, [&](const Shape& s) {
        LowpCall c(dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng);
        OptionStore store;
        const AttentionOptions o = oc.make(store, c, rng);
        attention(c.view(c.q, s.Lq, s.Hq, s.d), c.view(c.k, s.Lk, s.Hkv, s.d), c.view(c.v, s.Lk, s.Hkv, s.dv),
                  c.view(c.out, s.Lq, s.Hq, s.dv), o, c.lse_view());
        return compare_forward_with_reference(c, o, store);
      });
    }
  }
}

// The split count follows the key count only, so a call's result does not depend on
// the thread count: 1000 keys make 4 splits, merged in split order.
TEST(FewQueriesThreads, BitwiseIdenticalForAnyThreadCount) {
  for (Causal c : {Causal::None, Causal::BottomRight}) {
    Config s;
    s.B = 2, s.Lq = 3, s.Lk = 1000, s.Hq = 4, s.Hkv = 2, s.d = 64, s.dv = 64;
    s.opt.causal = c;
    std::vector<float> one, two, three;
    with_threads(1, [&] { one = run_fused_raw(s, 77); });
    with_threads(2, [&] { two = run_fused_raw(s, 77); });
    with_threads(3, [&] { three = run_fused_raw(s, 77); });
    ASSERT_EQ(one.size(), two.size());
    EXPECT_EQ(std::memcmp(one.data(), two.data(), one.size() * sizeof(float)), 0);
    EXPECT_EQ(std::memcmp(one.data(), three.data(), one.size() * sizeof(float)), 0);
  }
}

TEST(FewQueriesOverride, SetsTheLimitAndBadValuesNameTheVariable) {
  // AMD Zen 4/5 (vdpbf16ps at the FMA's rate, no AMX) keep up to 16 from 256 keys on.
  const bool zen = detail::cpu_features().bf16_dot_full_rate && !detail::cpu_features().amx_bf16;
  for (DType dt : {DType::f32, DType::bf16, DType::f16}) EXPECT_EQ(detail::few_queries_limit(255, dt, 4), 4);
  EXPECT_EQ(detail::few_queries_limit(256, DType::bf16, 8), zen ? 16 : 8);
  EXPECT_EQ(detail::few_queries_limit(256, DType::f32, 4), zen ? 16 : 8);
  EXPECT_EQ(detail::few_queries_limit(256, DType::f16, 1), zen ? 16 : 8);
  EXPECT_EQ(detail::few_queries_limit(256, DType::f32, 8), 8);
  {
    const ScopedEnv limit("ATTN_FEW_QUERIES", "16");
    EXPECT_EQ(detail::few_queries_limit(10, DType::f32, 1), 16);
  }
  for (const char* bad : {"many", "-1", "65", "3x"}) {
    const ScopedEnv limit("ATTN_FEW_QUERIES", bad);
    std::vector<float> q(8), k(8), v(8), out(8);
    const TensorView qv(q.data(), DType::f32, {1, 1, 1, 8}), kv(k.data(), DType::f32, {1, 1, 1, 8}),
        vv(v.data(), DType::f32, {1, 1, 1, 8}), ov(out.data(), DType::f32, {1, 1, 1, 8});
    expect_attn_error([&] { attention(qv, kv, vv, ov); },
                      std::string("ATTN_FEW_QUERIES must be an integer in [0, 64], got \"") + bad + "\"");
  }
}

}  // namespace
}  // namespace attn::testing
