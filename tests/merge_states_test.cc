// merge_attention_states (issue 12's combine step, also ring attention's): attention
// over two disjoint key sets, merged, equals attention over their union — checked
// against the float64 reference on fresh random inputs of odd shapes, with fully
// masked parts, NaN and ±∞ lse, in-place merging, bf16/f16, packed sequences, and
// every argument error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {

struct Split {
  int B, Lq, Lk, Hq, Hkv, d, dv, cut;  // keys [0, cut) in part a, [cut, Lk) in part b
};

// q, k, v and a boolean mask [B, 1, Lq, Lk] that removes a fraction of the keys and, for
// some rows, every key of part a, or of part b, or of both.
struct SplitCase {
  Split s;
  std::vector<float> q, k, v, ka, kb, va, vb;
  std::vector<uint8_t> mask, mask_a, mask_b;

  SplitCase(const Split& sp, std::mt19937_64& rng) : s(sp) {
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    q.resize(size_t(s.B) * s.Lq * s.Hq * s.d);
    k.resize(size_t(s.B) * s.Lk * s.Hkv * s.d);
    v.resize(size_t(s.B) * s.Lk * s.Hkv * s.dv);
    for (auto* t : {&q, &k, &v})
      for (float& x : *t) x = u(rng);
    mask.resize(size_t(s.B) * s.Lq * s.Lk);
    for (int b = 0; b < s.B; ++b)
      for (int i = 0; i < s.Lq; ++i)
        for (int j = 0; j < s.Lk; ++j) {
          bool keep = rng() % 5 != 0;
          if (i % 7 == 3 && j < s.cut) keep = false;   // part a sees nothing
          if (i % 7 == 5 && j >= s.cut) keep = false;  // part b sees nothing
          if (i % 11 == 6) keep = false;               // nobody sees anything
          mask[(size_t(b) * s.Lq + i) * s.Lk + j] = keep;
        }
    // The parts: keys and values sliced along L, masks along their last dimension.
    auto slice = [&](const std::vector<float>& x, int width, int j0, int j1) {
      std::vector<float> out;
      for (int b = 0; b < s.B; ++b)
        for (int j = j0; j < j1; ++j) {
          const float* row = x.data() + (size_t(b) * s.Lk + j) * s.Hkv * width;
          out.insert(out.end(), row, row + size_t(s.Hkv) * width);
        }
      return out;
    };
    ka = slice(k, s.d, 0, s.cut), kb = slice(k, s.d, s.cut, s.Lk);
    va = slice(v, s.dv, 0, s.cut), vb = slice(v, s.dv, s.cut, s.Lk);
    for (int b = 0; b < s.B; ++b)
      for (int i = 0; i < s.Lq; ++i)
        for (int j = 0; j < s.Lk; ++j) (j < s.cut ? mask_a : mask_b).push_back(mask[(size_t(b) * s.Lq + i) * s.Lk + j]);
  }
  TensorView view(const std::vector<float>& x, int L, int H, int D) const {
    return TensorView(x.data(), DType::f32, {s.B, L, H, D});
  }
  // Attention (or the reference) over keys [j0, j1) into out, lse.
  void run(bool reference, int part, std::vector<float>& out, std::vector<float>& lse) const {
    const int lk = part == 0 ? s.cut : part == 1 ? s.Lk - s.cut : s.Lk;
    const std::vector<float>& kk = part == 0 ? ka : part == 1 ? kb : k;
    const std::vector<float>& vv = part == 0 ? va : part == 1 ? vb : v;
    const std::vector<uint8_t>& mm = part == 0 ? mask_a : part == 1 ? mask_b : mask;
    out.assign(size_t(s.B) * s.Lq * s.Hq * s.dv, 0.0f);
    lse.assign(size_t(s.B) * s.Hq * s.Lq, 0.0f);
    AttentionOptions o;
    o.mask = TensorView(mm.data(), DType::boolean, {s.B, 1, s.Lq, lk});
    const TensorView lv(lse.data(), DType::f32, {s.B, s.Hq, s.Lq});
    if (reference) {
      attention_reference(view(q, s.Lq, s.Hq, s.d), view(kk, lk, s.Hkv, s.d), view(vv, lk, s.Hkv, s.dv),
                          view(out, s.Lq, s.Hq, s.dv), o, lv);
    } else {
      attention(view(q, s.Lq, s.Hq, s.d), view(kk, lk, s.Hkv, s.d), view(vv, lk, s.Hkv, s.dv),
                view(out, s.Lq, s.Hq, s.dv), o, lv);
    }
  }
};

const Split kSplits[] = {{1, 1, 2, 1, 1, 8, 8, 1},       {2, 17, 3, 2, 1, 16, 24, 1},   {1, 33, 100, 4, 2, 64, 64, 37},
                         {2, 20, 1000, 2, 2, 32, 17, 999}, {1, 64, 130, 3, 1, 128, 128, 64}};

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(MergeAttentionStates, MergedPartsOfTheReferenceEqualTheWholeReference) {
  std::mt19937_64 rng = make_rng(41);
  for (const Split& sp : kSplits) {
    SCOPED_TRACE("Lq=" + std::to_string(sp.Lq) + " Lk=" + std::to_string(sp.Lk) + " cut=" + std::to_string(sp.cut));
    const SplitCase c(sp, rng);
    std::vector<float> oa, la, ob, lb, whole, lwhole;
    c.run(true, 0, oa, la);
    c.run(true, 1, ob, lb);
    c.run(true, 2, whole, lwhole);
    std::vector<float> out(whole.size()), lse(lwhole.size());
    merge_attention_states(c.view(oa, sp.Lq, sp.Hq, sp.dv), TensorView(la.data(), DType::f32, {sp.B, sp.Hq, sp.Lq}),
                           c.view(ob, sp.Lq, sp.Hq, sp.dv), TensorView(lb.data(), DType::f32, {sp.B, sp.Hq, sp.Lq}),
                           c.view(out, sp.Lq, sp.Hq, sp.dv), TensorView(lse.data(), DType::f32, {sp.B, sp.Hq, sp.Lq}));
    // The parts are float64 results rounded to f32 once; merging adds a few roundings.
    for (size_t i = 0; i < out.size(); ++i) {
      ASSERT_NEAR(out[i], whole[i], 4e-7 * std::max(1.0f, std::fabs(whole[i]))) << i;
    }
    int no_key = 0;
    for (size_t i = 0; i < lse.size(); ++i) {
      if (std::isinf(lwhole[i])) {
        ASSERT_EQ(lse[i], -INFINITY) << i;
        ++no_key;
      } else {
        ASSERT_NEAR(lse[i], lwhole[i], 4e-7 * std::max(1.0f, std::fabs(lwhole[i]))) << i;
      }
    }
    if (sp.Lq > 11) EXPECT_GT(no_key, 0) << "the case must include rows with no visible key";
  }
}

TEST(MergeAttentionStates, MergedKernelPartsAreAsAccurateAsTheWholeKernel) {
  std::mt19937_64 rng = make_rng(42);
  double merged_err = 0, whole_err = 0;
  for (const Split& sp : kSplits) {
    const SplitCase c(sp, rng);
    std::vector<float> oa, la, ob, lb, fused, lfused, ref, lref;
    c.run(false, 0, oa, la);
    c.run(false, 1, ob, lb);
    c.run(false, 2, fused, lfused);
    c.run(true, 2, ref, lref);
    std::vector<float> out(ref.size());
    merge_attention_states(c.view(oa, sp.Lq, sp.Hq, sp.dv), TensorView(la.data(), DType::f32, {sp.B, sp.Hq, sp.Lq}),
                           c.view(ob, sp.Lq, sp.Hq, sp.dv), TensorView(lb.data(), DType::f32, {sp.B, sp.Hq, sp.Lq}),
                           c.view(out, sp.Lq, sp.Hq, sp.dv));
    for (size_t i = 0; i < ref.size(); ++i) {
      merged_err += std::pow(double(out[i]) - ref[i], 2);
      whole_err += std::pow(double(fused[i]) - ref[i], 2);
      ASSERT_NEAR(out[i], ref[i], 1e-5 * std::max(1.0f, std::fabs(ref[i]))) << i;
    }
  }
  // FlashAttention's rule, with the whole fused kernel as the plain yardstick.
  EXPECT_LE(std::sqrt(merged_err), 2.0 * std::sqrt(whole_err) + 1e-7);
}

// Two lse rows and outputs, dv = 3, for the special cases.
struct Pair {
  std::vector<float> oa{0.5f, -1.0f, 2.0f}, ob{0.25f, 4.0f, -3.0f}, out = std::vector<float>(3), la{0.0f}, lb{0.0f},
      lse{0.0f};
  void merge() {
    merge_attention_states(TensorView(oa.data(), DType::f32, {1, 1, 1, 3}), TensorView(la.data(), DType::f32, {1, 1, 1}),
                           TensorView(ob.data(), DType::f32, {1, 1, 1, 3}), TensorView(lb.data(), DType::f32, {1, 1, 1}),
                           TensorView(out.data(), DType::f32, {1, 1, 1, 3}), TensorView(lse.data(), DType::f32, {1, 1, 1}));
  }
};

TEST(MergeAttentionStates, SpecialLseValues) {
  Pair p;
  p.la = {1.25f}, p.lb = {-INFINITY}, p.ob = {NAN, INFINITY, NAN};  // part b saw no key: never read
  p.merge();
  for (int c = 0; c < 3; ++c) EXPECT_EQ(bits(p.out[c]), bits(p.oa[c])) << c;
  EXPECT_EQ(p.lse[0], 1.25f);
  p = Pair{};
  p.la = {-INFINITY}, p.lb = {-INFINITY};
  p.merge();
  EXPECT_EQ(p.out, std::vector<float>(3, 0.0f));
  EXPECT_EQ(p.lse[0], -INFINITY);
  for (float bad : {NAN, INFINITY}) {
    p = Pair{};
    p.la = {bad}, p.lb = {0.5f};
    p.merge();
    for (float x : p.out) EXPECT_TRUE(std::isnan(x)) << bad;
    EXPECT_TRUE(std::isnan(p.lse[0])) << bad;
  }
  // Equal lse: the mean, and lse + ln 2 exactly rounded.
  p = Pair{};
  p.la = {3.0f}, p.lb = {3.0f};
  p.merge();
  for (int c = 0; c < 3; ++c) EXPECT_EQ(p.out[c], (p.oa[c] + p.ob[c]) / 2) << c;
  EXPECT_EQ(p.lse[0], static_cast<float>(3.0 + std::log(2.0)));
  // Very different lse: the smaller part's weight underflows without harm.
  p = Pair{};
  p.la = {200.0f}, p.lb = {-900.0f};
  p.merge();
  for (int c = 0; c < 3; ++c) EXPECT_EQ(p.out[c], p.oa[c]) << c;
  EXPECT_EQ(p.lse[0], 200.0f);
}

TEST(MergeAttentionStates, InPlaceBf16F16AndPackedLayouts) {
  std::mt19937_64 rng = make_rng(43);
  std::uniform_real_distribution<float> u(-2, 2);
  const int B = 2, L = 5, H = 3, dv = 7;
  std::vector<float> oa(size_t(B) * L * H * dv), ob(oa.size()), la(size_t(B) * H * L), lb(la.size());
  for (auto* t : {&oa, &ob, &la, &lb})
    for (float& x : *t) x = u(rng);
  la[4] = -INFINITY;
  auto v4 = [&](std::vector<float>& x) { return TensorView(x.data(), DType::f32, {B, L, H, dv}); };
  auto l3 = [&](std::vector<float>& x) { return TensorView(x.data(), DType::f32, {B, H, L}); };
  std::vector<float> out(oa.size()), lse(la.size());
  merge_attention_states(v4(oa), l3(la), v4(ob), l3(lb), v4(out), l3(lse));
  // In place: out is out_a, lse is lse_b.
  std::vector<float> oa2 = oa, lb2 = lb;
  merge_attention_states(v4(oa2), l3(la), v4(ob), l3(lb2), v4(oa2), l3(lb2));
  EXPECT_EQ(oa2, out);
  EXPECT_EQ(lb2, lse);
  // bf16 and f16: the f32 merge of the same values, rounded to the dtype.
  for (DType dt : {DType::bf16, DType::f16}) {
    auto to = [&](float x) { return dt == DType::bf16 ? detail::f32_to_bf16(x) : detail::f32_to_f16(x); };
    auto from = [&](uint16_t x) { return dt == DType::bf16 ? detail::bf16_to_f32(x) : detail::f16_to_f32(x); };
    std::vector<uint16_t> ha(oa.size()), hb(ob.size()), ho(oa.size());
    std::vector<float> wa(oa.size()), wb(ob.size()), wo(oa.size());
    for (size_t i = 0; i < oa.size(); ++i) ha[i] = to(oa[i]), hb[i] = to(ob[i]), wa[i] = from(ha[i]), wb[i] = from(hb[i]);
    auto h4 = [&](std::vector<uint16_t>& x) { return TensorView(x.data(), dt, {B, L, H, dv}); };
    merge_attention_states(h4(ha), l3(la), h4(hb), l3(lb), h4(ho));
    merge_attention_states(v4(wa), l3(la), v4(wb), l3(lb), v4(wo));
    for (size_t i = 0; i < ho.size(); ++i) ASSERT_EQ(ho[i], to(wo[i])) << dtype_name(dt) << " " << i;
  }
  // Packed sequences: out [total, H, dv], lse [H, total]; the same numbers as batch 0.
  std::vector<float> pa(oa.begin(), oa.begin() + L * H * dv), pb(ob.begin(), ob.begin() + L * H * dv), po(pa.size());
  std::vector<float> pla(la.begin(), la.begin() + H * L), plb(lb.begin(), lb.begin() + H * L), plo(pla.size());
  auto p3 = [&](std::vector<float>& x) { return TensorView(x.data(), DType::f32, {L, H, dv}); };
  auto p2 = [&](std::vector<float>& x) { return TensorView(x.data(), DType::f32, {H, L}); };
  merge_attention_states(p3(pa), p2(pla), p3(pb), p2(plb), p3(po), p2(plo));
  EXPECT_EQ(po, std::vector<float>(out.begin(), out.begin() + L * H * dv));
  EXPECT_EQ(plo, std::vector<float>(lse.begin(), lse.begin() + H * L));
}

TEST(MergeAttentionStates, ArgumentErrorsNameTheArgument) {
  std::vector<float> o(2 * 3 * 4 * 5), o2(o.size()), o3(o.size()), l(2 * 4 * 3), l2(l.size()), l3(l.size());
  std::vector<uint16_t> h(o.size());
  auto v4 = [](std::vector<float>& x) { return TensorView(x.data(), DType::f32, {2, 3, 4, 5}); };
  auto lv = [](std::vector<float>& x) { return TensorView(x.data(), DType::f32, {2, 4, 3}); };
  const auto expect = expect_attn_error;
  expect([&] { merge_attention_states(v4(o), lv(l), TensorView(h.data(), DType::bf16, {2, 3, 4, 5}), lv(l2), v4(o3)); },
         "out_b must have dtype f32 (the dtype of out_a), got bf16");
  expect([&] { merge_attention_states(v4(o), lv(l), TensorView(o2.data(), DType::f32, {2, 3, 4, 4}), lv(l2), v4(o3)); },
         "out_b must have out_a's shape [2, 3, 4, 5], got [2, 3, 4, 4]");
  expect([&] { merge_attention_states(v4(o), TensorView(l.data(), DType::f32, {2, 3, 4}), v4(o2), lv(l2), v4(o3)); },
         "lse_a must be [B, H, L] = [2, 4, 3] for out_a [2, 3, 4, 5], got [2, 3, 4]");
  expect([&] { merge_attention_states(TensorView(o.data(), DType::f32, {120}), lv(l), v4(o2), lv(l2), v4(o3)); },
         "out_a must be [B, L, H, dv]");
  expect([&] { merge_attention_states(v4(o), lv(l), v4(o2), lv(l2), TensorView(o.data() + 1, DType::f32, {2, 3, 4, 5})); },
         "out overlaps an input without being exactly it");
  expect([&] { merge_attention_states(v4(o), lv(l), v4(o2), lv(l2), v4(o3), TensorView(o3.data(), DType::f32, {2, 4, 3})); },
         "out and lse overlap");
  expect([&] { merge_attention_states(v4(o), lv(l), v4(o2), {}, v4(o3)); }, "lse_b is required");
}

}  // namespace
}  // namespace attn::testing
