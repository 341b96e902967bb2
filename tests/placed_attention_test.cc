// Attention over blocks of a sequence placed at their positions (src/placed_attention,
// the building block of ring and head-parallel attention): cut q and k into uneven
// blocks, attend each pair with the whole sequence's rules, merge by log-sum-exp, and
// the result must be one call over the whole sequence — causal (both alignments),
// windows, ALiBi, softcap, dropout at odd key offsets, key lengths, GQA, head slices,
// bf16 and f16 on every kernel path the CPU runs — and the blocks' gradients must sum
// to the whole call's gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_harness.hpp"
#include "lowp_harness.hpp"
#include "attn/attention.hpp"
#include "placed_attention.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {

struct Case {
  std::string name;
  int B = 1, Lq = 67, Lk = 67, Hq = 4, Hkv = 2, d = 16, dv = 12;
  std::vector<int> q_cuts, k_cuts;  // block boundaries, 0 … L
  AttentionOptions opt;
  bool alibi = false, key_lengths = false;
  int head_slice = 0;  // > 0: also run heads [head_slice, Hq) as a separate slice
  DType dtype = DType::f32;
};

// x as the bits of a 16-bit dtype (bf16, f16), and back.
uint16_t to16(DType dt, float x) {
  if (dt != DType::bf16 && dt != DType::f16) throw std::logic_error("to16: dt must be bf16 or f16");
  uint16_t h;
  detail::store_f32(dt, &h, 0, x);
  return h;
}
float from16(DType dt, uint16_t h) { return detail::load_f32(dt, &h, 0); }

// Whole-sequence tensors, and views of their blocks (rows [a, b) of dimension 1).
struct Inputs {
  const Case& c;
  std::vector<float> q, k, v, dout, alibi;
  std::vector<int32_t> key_lengths;
  std::vector<uint16_t> q16, k16, v16;  // 16-bit copies when c.dtype is bf16 or f16
  Inputs(const Case& cs, std::mt19937_64& rng) : c(cs) {
    std::uniform_real_distribution<float> u(-1.5f, 1.5f);
    q.resize(size_t(c.B) * c.Lq * c.Hq * c.d);
    k.resize(size_t(c.B) * c.Lk * c.Hkv * c.d);
    v.resize(size_t(c.B) * c.Lk * c.Hkv * c.dv);
    dout.resize(size_t(c.B) * c.Lq * c.Hq * c.dv);
    for (auto* t : {&q, &k, &v, &dout})
      for (float& x : *t) x = u(rng);
    if (c.dtype != DType::f32) {  // the f32 tensors hold the 16-bit values exactly
      for (auto [src, dst] : {std::pair{&q, &q16}, {&k, &k16}, {&v, &v16}}) {
        dst->resize(src->size());
        for (size_t i = 0; i < src->size(); ++i) {
          detail::store_f32(c.dtype, dst->data(), int64_t(i), (*src)[i]);
          (*src)[i] = detail::load_f32(c.dtype, dst->data(), int64_t(i));
        }
      }
    }
    if (c.alibi)
      for (int h = 0; h < c.Hq; ++h) alibi.push_back(0.05f + 0.3f * float(rng() % 100) / 100.0f);
    if (c.key_lengths)
      for (int b = 0; b < c.B; ++b) key_lengths.push_back(int32_t(rng() % (c.Lk + 1)));
  }
  // The values of `from` for case cs (same shapes; 16-bit copies made when cs wants them).
  Inputs(const Case& cs, const Inputs& from)
      : c(cs), q(from.q), k(from.k), v(from.v), dout(from.dout), alibi(from.alibi), key_lengths(from.key_lengths) {
    if (c.dtype != DType::f32) {
      for (auto [src, dst] : {std::pair{&q, &q16}, {&k, &k16}, {&v, &v16}}) {
        for (float x : *src) dst->push_back(to16(c.dtype, x));
      }
    }
  }
  TensorView view(const std::vector<float>& f32, const std::vector<uint16_t>& b16, int L, int H, int D, int a,
                  int b, int h0 = 0, int h1 = -1) const {
    if (h1 < 0) h1 = H;
    const std::vector<int64_t> strides{int64_t(L) * H * D, int64_t(H) * D, D, 1};
    const int64_t at = int64_t(a) * H * D + int64_t(h0) * D;
    if (c.dtype != DType::f32) return TensorView(b16.data() + at, c.dtype, {c.B, b - a, h1 - h0, D}, strides);
    return TensorView(f32.data() + at, DType::f32, {c.B, b - a, h1 - h0, D}, strides);
  }
  TensorView qv(int a, int b, int h0 = 0, int h1 = -1) const { return view(q, q16, c.Lq, c.Hq, c.d, a, b, h0, h1); }
  TensorView kv(int a, int b, int h0 = 0, int h1 = -1) const { return view(k, k16, c.Lk, c.Hkv, c.d, a, b, h0, h1); }
  TensorView vv(int a, int b, int h0 = 0, int h1 = -1) const { return view(v, v16, c.Lk, c.Hkv, c.dv, a, b, h0, h1); }
  AttentionOptions options(int h0 = 0, int h1 = -1) const {
    AttentionOptions o = c.opt;
    if (h1 < 0) h1 = c.Hq;
    if (c.alibi) o.alibi_slopes = TensorView(alibi.data() + h0, DType::f32, {h1 - h0});
    return o;
  }
};

// The whole call (out, lse in f32; out rounded to the inputs' dtype) and its gradients.
struct Whole {
  std::vector<float> out, lse, dq, dk, dv;
};

Whole run_whole(const Inputs& in) {
  const Case& c = in.c;
  Whole w;
  w.out.resize(size_t(c.B) * c.Lq * c.Hq * c.dv);
  w.lse.resize(size_t(c.B) * c.Hq * c.Lq);
  w.dq.resize(in.q.size()), w.dk.resize(in.k.size()), w.dv.resize(in.v.size());
  AttentionOptions o = in.options();
  if (c.key_lengths) o.key_lengths = TensorView(in.key_lengths.data(), DType::i32, {c.B});
  const TensorView lse(w.lse.data(), DType::f32, {c.B, c.Hq, c.Lq});
  const TensorView out(w.out.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv});
  if (c.dtype != DType::f32) {
    // Outputs in the inputs' dtype as attention() gives them, widened for comparison.
    std::vector<uint16_t> o16(w.out.size()), dout16(in.dout.size()), g[3];
    for (size_t i = 0; i < in.dout.size(); ++i) dout16[i] = to16(c.dtype, in.dout[i]);
    const TensorView ov(o16.data(), c.dtype, {c.B, c.Lq, c.Hq, c.dv});
    attention(in.qv(0, c.Lq), in.kv(0, c.Lk), in.vv(0, c.Lk), ov, o, lse);
    g[0].resize(w.dq.size()), g[1].resize(w.dk.size()), g[2].resize(w.dv.size());
    attention_backward(in.qv(0, c.Lq), in.kv(0, c.Lk), in.vv(0, c.Lk), ov, lse,
                       TensorView(dout16.data(), c.dtype, {c.B, c.Lq, c.Hq, c.dv}),
                       TensorView(g[0].data(), c.dtype, {c.B, c.Lq, c.Hq, c.d}),
                       TensorView(g[1].data(), c.dtype, {c.B, c.Lk, c.Hkv, c.d}),
                       TensorView(g[2].data(), c.dtype, {c.B, c.Lk, c.Hkv, c.dv}), o);
    for (size_t i = 0; i < o16.size(); ++i) w.out[i] = from16(c.dtype, o16[i]);
    for (auto [src, dst] : {std::pair{&g[0], &w.dq}, {&g[1], &w.dk}, {&g[2], &w.dv}})
      for (size_t i = 0; i < src->size(); ++i) (*dst)[i] = from16(c.dtype, (*src)[i]);
    return w;
  }
  attention(in.qv(0, c.Lq), in.kv(0, c.Lk), in.vv(0, c.Lk), out, o, lse);
  attention_backward(in.qv(0, c.Lq), in.kv(0, c.Lk), in.vv(0, c.Lk), out, lse,
                     TensorView(in.dout.data(), DType::f32, {c.B, c.Lq, c.Hq, c.dv}),
                     TensorView(w.dq.data(), DType::f32, {c.B, c.Lq, c.Hq, c.d}),
                     TensorView(w.dk.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.d}),
                     TensorView(w.dv.data(), DType::f32, {c.B, c.Lk, c.Hkv, c.dv}), o);
  return w;
}

// The same through blocks, for heads [h0, h1) (kv heads follow: h1 − h0 must be a
// multiple of the group size), written into the whole-shaped outputs of `w`.
void run_blocks(const Inputs& in, const Whole& whole, Whole& w, int h0, int h1) {
  const Case& c = in.c;
  const int group = c.Hq / c.Hkv, H = h1 - h0, kh0 = h0 / group, kh1 = h1 / group, Hk = kh1 - kh0;
  detail::Placement where;
  where.Lq_total = c.Lq, where.Lk_total = c.Lk;
  where.key_lengths = in.key_lengths;
  where.h0 = h0, where.heads_total = c.Hq;
  const AttentionOptions o = in.options(h0, h1);
  // Whole-call out (in the inputs' dtype) and lse for the backward's blocks.
  std::vector<uint16_t> out16, dout16;
  if (c.dtype != DType::f32) {
    for (float x : whole.out) out16.push_back(to16(c.dtype, x));
    for (float x : in.dout) dout16.push_back(to16(c.dtype, x));
  }
  const std::vector<float> no_f32;
  const std::vector<uint16_t> no_b16;
  for (size_t qb = 0; qb + 1 < c.q_cuts.size(); ++qb) {
    const int qa = c.q_cuts[qb], qe = c.q_cuts[qb + 1], n = qe - qa;
    std::vector<float> acc(size_t(c.B) * n * H * c.dv, 0.0f), acc_lse(size_t(c.B) * H * n, -INFINITY);
    std::vector<float> part(acc.size()), part_lse(acc_lse.size());
    const TensorView accv(acc.data(), DType::f32, {c.B, n, H, c.dv}), acc_lv(acc_lse.data(), DType::f32, {c.B, H, n});
    const TensorView partv(part.data(), DType::f32, {c.B, n, H, c.dv}), part_lv(part_lse.data(), DType::f32, {c.B, H, n});
    // This q block's rows of the whole out, lse, dout.
    std::vector<float> lse_rows(size_t(c.B) * H * n);
    for (int b = 0; b < c.B; ++b)
      for (int h = 0; h < H; ++h)
        for (int i = 0; i < n; ++i)
          lse_rows[(size_t(b) * H + h) * n + i] = whole.lse[(size_t(b) * c.Hq + h0 + h) * c.Lq + qa + i];
    const TensorView lse_rows_v(lse_rows.data(), DType::f32, {c.B, H, n});
    std::vector<float> dq(size_t(c.B) * n * H * c.d);
    for (size_t kb = 0; kb + 1 < c.k_cuts.size(); ++kb) {
      const int ka = c.k_cuts[kb], ke = c.k_cuts[kb + 1], m = ke - ka;
      where.q_pos0 = qa, where.k_pos0 = ka;
      detail::attention_placed(in.qv(qa, qe, h0, h1), in.kv(ka, ke, kh0, kh1), in.vv(ka, ke, kh0, kh1), partv, part_lv, o,
                               where);
      merge_attention_states(accv, acc_lv, partv, part_lv, accv, acc_lv);
      // Backward of the block: dq contribution, and the block's dk, dv.
      std::vector<float> dk(size_t(c.B) * m * Hk * c.d), dv(size_t(c.B) * m * Hk * c.dv);
      const TensorView outv = c.dtype != DType::f32
                                  ? in.view(no_f32, out16, c.Lq, c.Hq, c.dv, qa, qe, h0, h1)
                                  : in.view(whole.out, no_b16, c.Lq, c.Hq, c.dv, qa, qe, h0, h1);
      const TensorView doutv = c.dtype != DType::f32
                                   ? in.view(no_f32, dout16, c.Lq, c.Hq, c.dv, qa, qe, h0, h1)
                                   : in.view(in.dout, no_b16, c.Lq, c.Hq, c.dv, qa, qe, h0, h1);
      detail::attention_backward_placed(in.qv(qa, qe, h0, h1), in.kv(ka, ke, kh0, kh1), in.vv(ka, ke, kh0, kh1), outv,
                                        lse_rows_v, doutv, TensorView(dq.data(), DType::f32, {c.B, n, H, c.d}),
                                        TensorView(dk.data(), DType::f32, {c.B, m, Hk, c.d}),
                                        TensorView(dv.data(), DType::f32, {c.B, m, Hk, c.dv}), o, where);
      for (int b = 0; b < c.B; ++b)
        for (int i = 0; i < n; ++i)
          for (int h = 0; h < H; ++h)
            for (int x = 0; x < c.d; ++x)
              w.dq[((size_t(b) * c.Lq + qa + i) * c.Hq + h0 + h) * c.d + x] += dq[((size_t(b) * n + i) * H + h) * c.d + x];
      for (int b = 0; b < c.B; ++b)
        for (int j = 0; j < m; ++j)
          for (int h = 0; h < Hk; ++h) {
            for (int x = 0; x < c.d; ++x)
              w.dk[((size_t(b) * c.Lk + ka + j) * c.Hkv + kh0 + h) * c.d + x] += dk[((size_t(b) * m + j) * Hk + h) * c.d + x];
            for (int x = 0; x < c.dv; ++x)
              w.dv[((size_t(b) * c.Lk + ka + j) * c.Hkv + kh0 + h) * c.dv + x] +=
                  dv[((size_t(b) * m + j) * Hk + h) * c.dv + x];
          }
    }
    for (int b = 0; b < c.B; ++b)
      for (int i = 0; i < n; ++i)
        for (int h = 0; h < H; ++h) {
          for (int x = 0; x < c.dv; ++x)
            w.out[((size_t(b) * c.Lq + qa + i) * c.Hq + h0 + h) * c.dv + x] = acc[((size_t(b) * n + i) * H + h) * c.dv + x];
          w.lse[(size_t(b) * c.Hq + h0 + h) * c.Lq + qa + i] = acc_lse[(size_t(b) * H + h) * n + i];
        }
  }
}

// ‖a − b‖ / max(‖b‖, floor·√n)
double rel(const std::vector<float>& a, const std::vector<float>& b, double floor) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) || std::isinf(b[i])) continue;  // lse of rows with no key: checked apart
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), floor * std::sqrt(double(a.size())));
}

void check(const Case& c, uint64_t salt) {
  SCOPED_TRACE(c.name);
  std::mt19937_64 rng = make_rng(salt);
  const Inputs in(c, rng);
  const Whole whole = run_whole(in);
  Whole blocks{std::vector<float>(whole.out.size()), std::vector<float>(whole.lse.size()),
               std::vector<float>(whole.dq.size()), std::vector<float>(whole.dk.size()),
               std::vector<float>(whole.dv.size())};
  if (c.head_slice > 0) {
    run_blocks(in, whole, blocks, 0, c.head_slice);
    run_blocks(in, whole, blocks, c.head_slice, c.Hq);
  } else {
    run_blocks(in, whole, blocks, 0, c.Hq);
  }
  // f32: the same arithmetic up to the merge's roundings. bf16/f16: whole-call outputs
  // are rounded to the dtype, the blocks' stay f32 until compared (and the bf16 tile
  // paths round P).
  const double bar = c.dtype == DType::bf16 ? 1e-2 : c.dtype == DType::f16 ? 2e-3 : 2e-6;
  EXPECT_LE(rel(blocks.out, whole.out, 1e-3), bar);
  EXPECT_LE(rel(blocks.lse, whole.lse, 1e-3), c.dtype == DType::f32 ? 2e-6 : 1e-3);
  for (size_t i = 0; i < whole.lse.size(); ++i) {
    ASSERT_EQ(std::isinf(whole.lse[i]), std::isinf(blocks.lse[i])) << "lse " << i;
  }
  EXPECT_LE(rel(blocks.dq, whole.dq, 1e-2), bar * 5);
  EXPECT_LE(rel(blocks.dk, whole.dk, 1e-2), bar * 5);
  EXPECT_LE(rel(blocks.dv, whole.dv, 1e-2), bar * 5);
}

Case base(const char* name) {
  Case c;
  c.name = name;
  c.q_cuts = {0, 13, 40, 67};
  c.k_cuts = {0, 5, 30, 31, 67};
  return c;
}

TEST(PlacedAttention, CausalTopLeftBlocksEqualTheWholeCall) {
  Case c = base("causal top-left");
  c.opt.causal = Causal::TopLeft;
  check(c, 1);
}

TEST(PlacedAttention, CausalBottomRightWithMoreKeysThanQueries) {
  Case c = base("causal bottom-right, Lq 23, Lk 61");
  c.B = 2, c.Lq = 23, c.Lk = 61;
  c.q_cuts = {0, 9, 23};
  c.k_cuts = {0, 17, 18, 50, 61};
  c.opt.causal = Causal::BottomRight;
  check(c, 2);
}

TEST(PlacedAttention, SlidingWindowBothSides) {
  Case c = base("window 7/3");
  c.opt.window = {7, 3};
  check(c, 3);
}

TEST(PlacedAttention, AlibiAndSoftcapWithCausal) {
  Case c = base("alibi, softcap 5, causal");
  c.alibi = true;
  c.opt.softcap = 5.0f;
  c.opt.causal = Causal::BottomRight;
  check(c, 4);
}

TEST(PlacedAttention, DropoutAtKeyOffsetsThatAreNotMultiplesOfFour) {
  Case c = base("dropout 0.3 at odd offsets");
  c.opt.dropout_p = 0.3f, c.opt.seed = 1234, c.opt.offset = 77;
  c.opt.causal = Causal::TopLeft;
  check(c, 5);
}

TEST(PlacedAttention, KeyLengthsAlignTheBandToEachSequence) {
  Case c = base("key lengths, causal bottom-right, window");
  c.B = 3;
  c.key_lengths = true;
  c.opt.causal = Causal::BottomRight;
  c.opt.window = {20, -1};
  check(c, 6);
}

TEST(PlacedAttention, HeadSlicesDrawTheirOwnHeadsDropoutAndSlopes) {
  Case c = base("head slices [0, 2) and [2, 4), dropout, alibi");
  c.head_slice = 2;
  c.alibi = true;
  c.opt.dropout_p = 0.2f, c.opt.seed = 9;
  check(c, 7);
}

// bf16 and f16 blocks on every kernel path this CPU runs ("f32": the portable kernel,
// which reads the 16-bit rows where it packs them; "amx", "avx512bf16": the tile
// kernels, f16 on AMX only), partial results and gradients kept in f32.
struct LowpPlacement {
  const char* path;
  DType dtype;
};
class PlacedLowp : public ::testing::TestWithParam<LowpPlacement> {};
INSTANTIATE_TEST_SUITE_P(Paths, PlacedLowp,
                         ::testing::Values(LowpPlacement{"f32", DType::bf16}, LowpPlacement{"f32", DType::f16},
                                           LowpPlacement{"amx", DType::bf16}, LowpPlacement{"amx", DType::f16},
                                           LowpPlacement{"avx512bf16", DType::bf16}),
                         [](const ::testing::TestParamInfo<LowpPlacement>& info) {
                           return std::string(info.param.path) + "_" + dtype_name(info.param.dtype);
                         });

TEST_P(PlacedLowp, BlocksKeepF32PartialResults) {
  SKIP_UNLESS_PATH(GetParam().path);
  const ScopedIsa isa(GetParam().path);
  Case c = base("causal, window");
  c.dtype = GetParam().dtype;
  c.d = 32, c.dv = 32;
  c.opt.causal = Causal::TopLeft;
  c.opt.window = {30, 0};
  check(c, 8);
}

TEST_P(PlacedLowp, LongBlocksWithGqaDropoutAlibiAndKeyLengths) {
  SKIP_UNLESS_PATH(GetParam().path);
  const ScopedIsa isa(GetParam().path);
  Case c = base("Lq = 150, Lk = 333, bottom-right causal, GQA 2, dropout, alibi, key lengths, head slices");
  c.dtype = GetParam().dtype;
  c.B = 2, c.Lq = 150, c.Lk = 333, c.Hq = 4, c.Hkv = 2, c.d = 64, c.dv = 64;
  c.q_cuts = {0, 64, 71, 150};
  c.k_cuts = {0, 17, 128, 200, 333};
  c.opt.causal = Causal::BottomRight;
  c.opt.dropout_p = 0.1f, c.opt.seed = 21;
  c.alibi = c.key_lengths = true;
  c.head_slice = 2;
  check(c, 10);
}

// Whole's shape with zero gradients: run_blocks sums the blocks' into them.
Whole zeroed_like(const Whole& w) {
  Whole z = w;
  for (auto* g : {&z.dq, &z.dk, &z.dv}) std::fill(g->begin(), g->end(), 0.0f);
  return z;
}

Case portable_case() {
  Case c = base("Lq = 90, Lk = 140, bottom-right causal, GQA 2, dropout");
  c.Lq = 90, c.Lk = 140, c.Hq = 4, c.Hkv = 2, c.d = 48, c.dv = 40;
  c.q_cuts = {0, 33, 90};
  c.k_cuts = {0, 70, 71, 140};
  c.opt.causal = Causal::BottomRight;
  c.opt.dropout_p = 0.15f, c.opt.seed = 5;
  return c;
}

void expect_same_blocks(const Whole& a, const Whole& b) {
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.lse, b.lse);
  EXPECT_EQ(a.dq, b.dq);
  EXPECT_EQ(a.dk, b.dk);
  EXPECT_EQ(a.dv, b.dv);
}

// On the portable path a bf16 (or f16) block is bitwise the f32 block of its widened
// values, forward and backward: the kernel widens the rows where it packs them, with
// the result the f32 copies it once made gave.
TEST(PlacedAttention, PortableLowpBlocksEqualTheirWidenedF32Blocks) {
  const ScopedIsa isa("f32");
  for (const DType dt : {DType::bf16, DType::f16}) {
    SCOPED_TRACE(dtype_name(dt));
    Case c = portable_case();
    c.dtype = dt;
    std::mt19937_64 rng = make_rng(11);
    const Inputs in(c, rng);  // values exact in dt
    const Whole whole = run_whole(in);  // out holds dt's values
    Case c32 = c;
    c32.dtype = DType::f32;
    Inputs wide(c32, in);
    for (float& x : wide.dout) x = from16(dt, to16(dt, x));  // as run_blocks hands dout to 16-bit blocks
    Whole a = zeroed_like(whole), b = zeroed_like(whole);
    run_blocks(in, whole, a, 0, c.Hq);
    run_blocks(wide, whole, b, 0, c.Hq);
    expect_same_blocks(a, b);
  }
}

// Likewise f32 blocks under Precision::bf16 (rounded where packed) against blocks of
// inputs rounded to bf16 beforehand.
TEST(PlacedAttention, PrecisionBf16BlocksEqualBlocksOfRoundedInputs) {
  const ScopedIsa isa("f32");
  Case c = portable_case();
  c.opt.precision = Precision::bf16;
  std::mt19937_64 rng = make_rng(12);
  const Inputs raw(c, rng);
  Case c_rounded = c;
  c_rounded.opt.precision = Precision::f32;
  Inputs rounded(c_rounded, raw);
  for (auto* t : {&rounded.q, &rounded.k, &rounded.v})
    for (float& x : *t) x = detail::round_to_bf16(x);
  ASSERT_NE(rounded.q, raw.q);
  const Whole whole = run_whole(raw);
  Whole a = zeroed_like(whole), b = zeroed_like(whole);
  run_blocks(raw, whole, a, 0, c.Hq);
  run_blocks(rounded, whole, b, 0, c.Hq);
  expect_same_blocks(a, b);
}

TEST(PlacedAttention, LongerBlocksThanOneTile) {
  Case c = base("Lq = Lk = 300, causal, GQA 3");
  c.Lq = c.Lk = 300, c.Hq = 3, c.Hkv = 1, c.d = 64, c.dv = 64;
  c.q_cuts = {0, 130, 300};
  c.k_cuts = {0, 67, 201, 300};
  c.opt.causal = Causal::TopLeft;
  check(c, 9);
}

// Placed outputs are f32 whatever the inputs' dtype; the checks see them as they
// are: a 16-bit out is refused, and an f32 out is checked for overlap over its 4-byte
// elements (its upper half over k is caught, which a 2-byte reading would miss).
TEST(PlacedAttention, OutIsCheckedAsF32) {
  const int B = 1, L = 8, H = 2, d = 16;
  std::vector<uint16_t> q16(B * L * H * d, 0x3f80), k16(q16), v16(q16), o16(q16.size());
  std::vector<float> lse(B * H * L), out(B * L * H * d);
  auto t16 = [&](std::vector<uint16_t>& x) { return TensorView(x.data(), DType::bf16, {B, L, H, d}); };
  const TensorView lv(lse.data(), DType::f32, {B, H, L});
  detail::Placement where;
  where.Lq_total = where.Lk_total = L;
  auto message = [&](const TensorView& q, const TensorView& k, const TensorView& o) -> std::string {
    try {
      detail::attention_placed(q, k, t16(v16), o, lv, {}, where);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message(t16(q16), t16(k16), t16(o16)).find("out"), std::string::npos);
  EXPECT_EQ(message(t16(q16), t16(k16), TensorView(out.data(), DType::f32, {B, L, H, d})), "");
  // k laid in the upper half of an f32 out's bytes: disjoint as 2-byte elements, not as 4.
  std::vector<float> shared(B * L * H * d);
  const TensorView k_inside(reinterpret_cast<uint16_t*>(shared.data()) + B * L * H * d, DType::bf16, {B, L, H, d});
  const std::string overlap = message(t16(q16), k_inside, TensorView(shared.data(), DType::f32, {B, L, H, d}));
  EXPECT_NE(overlap.find("overlap"), std::string::npos) << overlap;
}

}  // namespace
}  // namespace attn::testing
