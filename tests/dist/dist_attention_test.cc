// attn::dist under mpirun (ctest runs it with 2 and with 4 ranks): ring and
// head-parallel attention against single-process attention() over the whole
// sequence, forward and backward, for every option they support, both layouts and
// lengths that do not divide evenly (down to ranks holding no position); against the
// float64 reference (FlashAttention's 2× rule); bitwise repeatability; skipped ring
// steps; and the cross-rank argument checks, which must raise attn::Error on every
// rank rather than hang.
//
// Every rank draws the same inputs (rank 0's seed is broadcast) and computes the whole
// single-process answer itself, then compares its own rows. Assertions that could end
// a test on one rank only are avoided between collectives (a rank leaving early
// would leave the others waiting): checks are EXPECTs, made after the collectives.
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/dist.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {

using dist::Layout;

int world_rank() {
  int r = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  return r;
}
int world_size() {
  int n = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  return n;
}

uint64_t g_seed = 0;  // the same on every rank (broadcast in main)

enum class Strategy { ring, ulysses };
const char* name(Strategy s) { return s == Strategy::ring ? "ring" : "ulysses"; }
const char* name(Layout l) { return l == Layout::zigzag ? "zigzag" : "contiguous"; }

struct Case {
  std::string name;
  int B = 2, L = 67, Hq = 4, Hkv = 2, d = 16, dv = 24;
  AttentionOptions opt;
  bool alibi = false, key_lengths = false;
  DType dtype = DType::f32;
  bool reference = false;  // also hold both against the float64 reference
  bool wide_out = false;   // bf16/f16: out in f32 (the output before rounding; attention.hpp)
  float lo = -1.5f, hi = 1.5f;  // the values' range
  DType out_dtype() const { return wide_out ? DType::f32 : dtype; }
};

// Whole-sequence tensors (f32 values, exactly representable in the case's dtype)
// and the dtype copies the calls read.
struct Whole {
  const Case& c;
  std::vector<float> q, k, v, dout, alibi;
  std::vector<int32_t> key_lengths;
  Whole(const Case& cs, uint64_t salt) : c(cs) {
    std::mt19937_64 rng(g_seed * 0x9E3779B97F4A7C15ull + salt);
    std::uniform_real_distribution<float> u(c.lo, c.hi);
    q.resize(size_t(c.B) * c.L * c.Hq * c.d);
    k.resize(size_t(c.B) * c.L * c.Hkv * c.d);
    v.resize(size_t(c.B) * c.L * c.Hkv * c.dv);
    dout.resize(size_t(c.B) * c.L * c.Hq * c.dv);
    for (auto* t : {&q, &k, &v, &dout})
      for (float& x : *t) x = round(u(rng));
    if (c.alibi)
      for (int h = 0; h < c.Hq; ++h) alibi.push_back(0.02f + 0.2f * float(rng() % 100) / 100.0f);
    if (c.key_lengths)
      for (int b = 0; b < c.B; ++b) key_lengths.push_back(int32_t(rng() % (c.L + 1)));
  }
  float round(float x) const { return c.dtype == DType::bf16 ? detail::round_to_bf16(x) : x; }
  AttentionOptions options() const {
    AttentionOptions o = c.opt;
    if (c.alibi) o.alibi_slopes = TensorView(alibi.data(), DType::f32, {c.Hq});
    if (c.key_lengths) o.key_lengths = TensorView(key_lengths.data(), DType::i32, {c.B});
    return o;
  }
};

// A tensor in the case's dtype, stored as bytes, with f32 conversion both ways.
struct Buf {
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<char> bytes;
  Buf(DType t, std::vector<int64_t> s) : dtype(t), shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t x : shape) n *= x;
    bytes.assign(size_t(n) * dtype_size(t), 0);
  }
  TensorView view() const { return TensorView(bytes.data(), dtype, shape); }
  int64_t numel() const { return view().numel(); }
  void set(const std::vector<float>& f) { detail::from_f32_contiguous(f.data(), view()); }
  std::vector<float> get() const { return detail::to_f32_contiguous(view()); }
};

// Shards a whole f32 tensor [B, L, ...] into this rank's rows, in dtype.
Buf local_of(const std::vector<float>& whole, DType dtype, std::vector<int64_t> shape, Layout layout, int seq_dim = 1) {
  Buf w(dtype, shape);
  w.set(whole);
  shape[size_t(seq_dim)] = dist::shard_length(shape[size_t(seq_dim)], world_rank(), world_size(), layout);
  Buf l(dtype, shape);
  dist::shard(w.view(), l.view(), world_rank(), world_size(), layout, seq_dim);
  return l;
}

// The single-process results (whole sequence) and the distributed ones (this rank's
// rows, unsharded back into whole-shaped arrays where this rank holds them).
struct Results {
  std::vector<float> out, lse, dq, dk, dv;
};

Results single_process(const Whole& w, bool reference) {
  const Case& c = w.c;
  Buf q(c.dtype, {c.B, c.L, c.Hq, c.d}), k(c.dtype, {c.B, c.L, c.Hkv, c.d}), v(c.dtype, {c.B, c.L, c.Hkv, c.dv}),
      out(c.out_dtype(), {c.B, c.L, c.Hq, c.dv}), dout(c.dtype, {c.B, c.L, c.Hq, c.dv}),
      dq(c.dtype, {c.B, c.L, c.Hq, c.d}), dk(c.dtype, {c.B, c.L, c.Hkv, c.d}), dv(c.dtype, {c.B, c.L, c.Hkv, c.dv});
  q.set(w.q), k.set(w.k), v.set(w.v), dout.set(w.dout);
  std::vector<float> lse(size_t(c.B) * c.Hq * c.L);
  const TensorView lv(lse.data(), DType::f32, {c.B, c.Hq, c.L});
  const AttentionOptions o = w.options();
  if (reference) {
    attention_reference(q.view(), k.view(), v.view(), out.view(), o, lv);
    attention_backward_reference(q.view(), k.view(), v.view(), out.view(), lv, dout.view(), dq.view(), dk.view(),
                                 dv.view(), o);
  } else {
    attention(q.view(), k.view(), v.view(), out.view(), o, lv);
    attention_backward(q.view(), k.view(), v.view(), out.view(), lv, dout.view(), dq.view(), dk.view(), dv.view(), o);
  }
  return {out.get(), lse, dq.get(), dk.get(), dv.get()};
}

// The distributed call; results are this rank's rows, gathered from every rank into
// whole-sequence arrays (so each rank can compare everything).
Results distributed(const Whole& w, Strategy s, Layout layout, dist::Stats* fwd_stats = nullptr) {
  const Case& c = w.c;
  const int64_t Lr = dist::shard_length(c.L, world_rank(), world_size(), layout);
  Buf q = local_of(w.q, c.dtype, {c.B, c.L, c.Hq, c.d}, layout);
  Buf k = local_of(w.k, c.dtype, {c.B, c.L, c.Hkv, c.d}, layout);
  Buf v = local_of(w.v, c.dtype, {c.B, c.L, c.Hkv, c.dv}, layout);
  Buf dout = local_of(w.dout, c.dtype, {c.B, c.L, c.Hq, c.dv}, layout);
  Buf out(c.out_dtype(), {c.B, Lr, c.Hq, c.dv}), dq(c.dtype, {c.B, Lr, c.Hq, c.d}), dk(c.dtype, {c.B, Lr, c.Hkv, c.d}),
      dv(c.dtype, {c.B, Lr, c.Hkv, c.dv});
  Buf lse(DType::f32, {c.B, c.Hq, Lr});
  const AttentionOptions o = w.options();
  if (s == Strategy::ring) {
    dist::ring_attention(MPI_COMM_WORLD, q.view(), k.view(), v.view(), out.view(), o, lse.view(), layout, fwd_stats);
    dist::ring_attention_backward(MPI_COMM_WORLD, q.view(), k.view(), v.view(), out.view(), lse.view(), dout.view(),
                                  dq.view(), dk.view(), dv.view(), o, layout);
  } else {
    dist::ulysses_attention(MPI_COMM_WORLD, q.view(), k.view(), v.view(), out.view(), o, lse.view(), layout,
                            fwd_stats);
    dist::ulysses_attention_backward(MPI_COMM_WORLD, q.view(), k.view(), v.view(), out.view(), lse.view(),
                                     dout.view(), dq.view(), dk.view(), dv.view(), o, layout);
  }
  auto gather = [&](const Buf& local, std::vector<int64_t> whole_shape, int seq_dim = 1) {
    Buf whole(local.dtype, whole_shape);
    dist::allgather_sequence(MPI_COMM_WORLD, local.view(), whole.view(), layout, seq_dim);
    return whole.get();
  };
  return {gather(out, {c.B, c.L, c.Hq, c.dv}), gather(lse, {c.B, c.Hq, c.L}, 2), gather(dq, {c.B, c.L, c.Hq, c.d}),
          gather(dk, {c.B, c.L, c.Hkv, c.d}), gather(dv, {c.B, c.L, c.Hkv, c.dv})};
}

// ‖a − b‖ / max(‖b‖, floor·√n), skipping ±∞ (lse of rows with no visible key).
double rel(const std::vector<float>& a, const std::vector<float>& b, double floor = 1e-3) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isinf(a[i]) && a[i] == b[i]) continue;
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(b[i]) * b[i];
  }
  return std::sqrt(num) / std::max(std::sqrt(den), floor * std::sqrt(double(a.size())));
}

bool any_nan(const Results& r) {
  for (const auto* t : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv})
    for (float x : *t)
      if (std::isnan(x)) return true;
  return false;
}

// Compares the distributed results with the single-process ones, and (for
// reference cases) both with the float64 reference: the distributed error must be
// within twice the single-process error plus a rounding floor.
void check_case(const Case& c, uint64_t salt, std::vector<Strategy> strategies = {Strategy::ring, Strategy::ulysses}) {
  const Whole w(c, salt);
  const Results one = single_process(w, false);
  const Results ref = c.reference ? single_process(w, true) : Results{};
  for (Strategy s : strategies) {
    if (s == Strategy::ulysses && c.Hq % world_size() != 0) continue;
    for (Layout layout : {Layout::zigzag, Layout::contiguous}) {
      SCOPED_TRACE(c.name + ", " + name(s) + ", " + name(layout) + ", " + std::to_string(world_size()) + " ranks");
      const Results got = distributed(w, s, layout);
      EXPECT_FALSE(any_nan(got));
      // f32 inputs under Precision::bf16 round each pass's probabilities to bf16: the
      // chunks' own maxima then round differently from the whole row's. bf16x3 (three
      // bf16 products) errs by a few f32 roundings more than f32's own products.
      const bool f32_math = c.dtype == DType::f32 && c.opt.precision != Precision::bf16;
      const double bar = !f32_math ? 1e-2 : c.opt.precision == Precision::bf16x3 ? 2e-5 : 2e-6;
      EXPECT_LE(rel(got.out, one.out), bar);
      EXPECT_LE(rel(got.lse, one.lse), f32_math ? bar : 1e-3);
      EXPECT_LE(rel(got.dq, one.dq, 1e-2), bar * 5);
      EXPECT_LE(rel(got.dk, one.dk, 1e-2), bar * 5);
      EXPECT_LE(rel(got.dv, one.dv, 1e-2), bar * 5);
      int inf_mismatch = 0;
      for (size_t i = 0; i < one.lse.size(); ++i) inf_mismatch += std::isinf(one.lse[i]) != std::isinf(got.lse[i]);
      EXPECT_EQ(inf_mismatch, 0) << "rows with no visible key must agree";
      if (c.reference) {
        // Rounding floor. f32: four epsilons (2^-21), for calls so small (L = 3) that a few
        // roundings more or less decide the ratio. 16-bit: one ulp more on the largest
        // element (a sum on the other side of a rounding midpoint, which decides small
        // calls), and for bf16 (or Precision::bf16) a plain bf16 pipeline's error, 2^-8:
        // the path a bf16 call takes depends on its shape (a call whose score tiles would
        // be mostly masked runs on the f32 kernel, attention_lowp_test), and the blocks of
        // a ring or Ulysses call have other shapes than the whole call, so one may round
        // the probabilities to bf16 (as the tiles do) where the other keeps them in f32.
        const double ulp = c.dtype == DType::bf16 ? 0x1p-7 : c.dtype == DType::f16 ? 0x1p-10 : 0.0;
        const double floor16 = c.dtype == DType::bf16 || c.opt.precision == Precision::bf16 ? 0x1p-8 : 1e-3;
        auto floor_of = [&](const std::vector<float>& r, double norm_floor) {
          if (f32_math) return 0x1p-21;
          double largest = 0, sq = 0;
          for (float x : r) largest = std::max(largest, double(std::fabs(x))), sq += double(x) * x;
          return std::max(floor16, ulp * largest / std::max(std::sqrt(sq), norm_floor * std::sqrt(double(r.size()))));
        };
        EXPECT_LE(rel(got.out, ref.out), 2 * rel(one.out, ref.out) + floor_of(ref.out, 1e-3));
        EXPECT_LE(rel(got.dq, ref.dq, 1e-2), 2 * rel(one.dq, ref.dq, 1e-2) + floor_of(ref.dq, 1e-2));
        EXPECT_LE(rel(got.dk, ref.dk, 1e-2), 2 * rel(one.dk, ref.dk, 1e-2) + floor_of(ref.dk, 1e-2));
        EXPECT_LE(rel(got.dv, ref.dv, 1e-2), 2 * rel(one.dv, ref.dv, 1e-2) + floor_of(ref.dv, 1e-2));
      }
    }
  }
}

TEST(DistAttention, NoMaskOddLengthGqa) {
  Case c;
  c.name = "no mask, L 67, GQA 2";
  c.reference = true;
  check_case(c, 1);
}

TEST(DistAttention, CausalTopLeft) {
  Case c;
  c.name = "causal top-left, L 301";
  c.L = 301, c.B = 1, c.d = 32, c.dv = 32;
  c.opt.causal = Causal::TopLeft;
  c.reference = true;
  check_case(c, 2);
}

TEST(DistAttention, CausalBottomRightWithKeyPadding) {
  Case c;
  c.name = "causal bottom-right, key lengths, B 3";
  c.B = 3, c.L = 90;
  c.opt.causal = Causal::BottomRight;
  c.key_lengths = true;
  c.reference = true;
  check_case(c, 3);
}

TEST(DistAttention, SlidingWindow) {
  Case c;
  c.name = "sliding window 13/0 (causal band)";
  c.L = 203;
  c.opt.window = {13, 0};
  check_case(c, 4);
}

TEST(DistAttention, TwoSidedWindowWithPadding) {
  Case c;
  c.name = "window 20/7, key lengths";
  c.L = 150;
  c.opt.window = {20, 7};
  c.key_lengths = true;
  check_case(c, 5);
}

TEST(DistAttention, AlibiAndSoftcap) {
  Case c;
  c.name = "ALiBi, softcap 4, causal";
  c.L = 111;
  c.alibi = true;
  c.opt.softcap = 4.0f;
  c.opt.causal = Causal::TopLeft;
  c.reference = true;
  check_case(c, 6);
}

TEST(DistAttention, DropoutMatchesTheSingleProcessDecisions) {
  Case c;
  c.name = "dropout 0.25, causal";
  c.L = 157;  // chunk boundaries at key positions that are not multiples of 4
  c.opt.dropout_p = 0.25f, c.opt.seed = 77, c.opt.offset = 5;
  c.opt.causal = Causal::TopLeft;
  check_case(c, 7);
}

TEST(DistAttention, GqaKvHeadsSharedBetweenRanks) {
  Case c;
  c.name = "Hq 8, Hkv 2 (Ulysses ranks share kv heads at 4 ranks)";
  c.Hq = 8, c.Hkv = 2, c.L = 64, c.B = 1;
  c.opt.causal = Causal::TopLeft;
  check_case(c, 8);
}

TEST(DistAttention, Bf16) {
  Case c;
  c.name = "bf16, causal, ALiBi";
  c.dtype = DType::bf16;
  c.L = 130, c.d = 32, c.dv = 32;
  c.alibi = true;
  c.opt.causal = Causal::TopLeft;
  c.reference = true;
  check_case(c, 9);
}

// bf16 with the f32 out (the output before rounding), as attention() takes it: the
// backward reads D = rowsum(dO ∘ O) from it on every rank. On sharply peaked rows (scale
// 1 on values in [−2, 2], d = 64) D from the rounded out dominates dq and dk; from the
// f32 out they stay near the single call's, which is near the float64 gradient.
TEST(DistAttention, Bf16WithTheF32Output) {
  Case c;
  c.name = "bf16, f32 out, peaked rows, causal";
  c.dtype = DType::bf16;
  c.L = 70, c.d = 64, c.dv = 32, c.lo = -2.0f, c.hi = 2.0f;
  c.opt.scale = 1.0f;
  c.opt.causal = Causal::TopLeft;
  c.reference = true;
  c.wide_out = true;
  check_case(c, 14);

  // Against the same calls with the rounded out: the f32 out must do clearly better.
  Case rounded = c;
  rounded.wide_out = false;
  rounded.reference = false;
  const Whole w(c, 14), w_rounded(rounded, 14);
  const Results ref = single_process(w, true);
  for (Strategy s : {Strategy::ring, Strategy::ulysses}) {
    for (Layout layout : {Layout::zigzag, Layout::contiguous}) {
      SCOPED_TRACE(std::string(name(s)) + ", " + name(layout) + ", " + std::to_string(world_size()) + " ranks");
      const Results wide = distributed(w, s, layout), narrow = distributed(w_rounded, s, layout);
      EXPECT_EQ(wide.lse, narrow.lse) << "the out's dtype changes nothing in the forward but the rounding";
      for (size_t i = 0; i < wide.out.size(); ++i) {
        ASSERT_EQ(detail::round_to_bf16(wide.out[i]), narrow.out[i]) << "element " << i;
      }
      const double dq_wide = rel(wide.dq, ref.dq, 1e-2), dq_narrow = rel(narrow.dq, ref.dq, 1e-2);
      const double dk_wide = rel(wide.dk, ref.dk, 1e-2), dk_narrow = rel(narrow.dk, ref.dk, 1e-2);
      EXPECT_LT(dq_wide * 1.5, dq_narrow) << dq_wide << " against " << dq_narrow;
      EXPECT_LT(dk_wide * 1.5, dk_narrow) << dk_wide << " against " << dk_narrow;
    }
  }
}

// Random whole calls: shapes (odd lengths and head dims, dv ≠ d, GQA), dtype, the f32
// out of 16-bit inputs, the precision of f32 ones, and any mix of the options ring and
// Ulysses take, drawn afresh from the run's seed (ATTN_TEST_SEED reproduces a run;
// ATTN_DIST_RANDOM_CASES sets how many, 8 by default, for campaigns).
Case random_case(uint64_t salt) {
  std::mt19937_64 rng(g_seed * 0xD1B54A32D192ED03ull + salt);
  auto pick = [&rng](std::initializer_list<int> xs) { return xs.begin()[rng() % xs.size()]; };
  auto chance = [&rng](int percent) { return int(rng() % 100) < percent; };
  auto uniform = [&rng](double lo, double hi) { return float(lo + (hi - lo) * double(rng() % 10001) / 10000.0); };
  Case c;
  c.B = 1 + int(rng() % 3);
  c.L = chance(25) ? pick({1, 2, 3, 5, 8, 17}) : 20 + int(rng() % 230);
  c.Hkv = pick({1, 2, 4});
  c.Hq = c.Hkv * pick({1, 2, 4});
  c.d = pick({3, 8, 16, 17, 32, 40, 64, 80, 128});
  c.dv = chance(50) ? c.d : pick({5, 16, 24, 64, 96});
  c.dtype = pick({0, 1, 2}) == 0 ? DType::f32 : (chance(50) ? DType::bf16 : DType::f16);
  c.wide_out = c.dtype != DType::f32 && chance(50);
  if (c.dtype == DType::f32 && chance(30)) c.opt.precision = chance(50) ? Precision::bf16 : Precision::bf16x3;
  c.hi = pick({1, 2, 3}) * 0.5f, c.lo = -c.hi;
  c.opt.causal = pick({0, 1, 2}) == 0 ? Causal::None : (chance(50) ? Causal::TopLeft : Causal::BottomRight);
  if (chance(30)) c.opt.window = {chance(25) ? -1 : int(rng() % (c.L + 1)), chance(50) ? -1 : int(rng() % (c.L + 1))};
  if (chance(25)) c.opt.softcap = uniform(2, 30);
  if (chance(30)) c.opt.scale = uniform(0.3, 2) / std::sqrt(float(c.d));
  c.alibi = chance(25);
  c.key_lengths = chance(30);
  if (chance(15)) c.opt.dropout_p = pick({1, 3}) * 0.1f, c.opt.seed = rng(), c.opt.offset = rng() % 1000;
  c.reference = c.opt.dropout_p == 0;
  c.name = "random case " + std::to_string(salt) + ": B " + std::to_string(c.B) + ", L " + std::to_string(c.L) +
           ", Hq " + std::to_string(c.Hq) + ", Hkv " + std::to_string(c.Hkv) + ", d " + std::to_string(c.d) + ", dv " +
           std::to_string(c.dv) + ", " + dtype_name(c.dtype) + (c.wide_out ? " (f32 out)" : "") + ", precision " +
           std::to_string(int(c.opt.precision)) + ", causal " + std::to_string(int(c.opt.causal)) + ", window " +
           std::to_string(c.opt.window.left) + "/" + std::to_string(c.opt.window.right) + ", softcap " +
           std::to_string(c.opt.softcap) + ", scale " + (c.opt.scale ? std::to_string(*c.opt.scale) : "default") +
           ", ALiBi " + std::to_string(c.alibi) + ", key lengths " + std::to_string(c.key_lengths) + ", dropout " +
           std::to_string(c.opt.dropout_p) + ", values ±" + std::to_string(c.hi);
  return c;
}

TEST(DistAttention, RandomCases) {
  const char* env = std::getenv("ATTN_DIST_RANDOM_CASES");
  const int n = env ? std::atoi(env) : 8;
  for (int i = 0; i < n; ++i) check_case(random_case(uint64_t(100 + i)), uint64_t(100 + i));
}

TEST(DistAttention, FewerPositionsThanChunks) {
  Case c;
  c.name = "L 3 (some ranks hold nothing)";
  c.L = 3, c.B = 2;
  c.opt.causal = Causal::TopLeft;
  check_case(c, 10);
}

TEST(DistAttention, OnePosition) {
  Case c;
  c.name = "L 1";
  c.L = 1;
  check_case(c, 11);
}

TEST(DistAttention, RepeatedCallsAreBitwiseIdentical) {
  Case c;
  c.name = "repeat";
  c.L = 97;
  c.opt.causal = Causal::TopLeft;
  c.opt.dropout_p = 0.1f;
  const Whole w(c, 12);
  for (Strategy s : {Strategy::ring, Strategy::ulysses}) {
    const Results a = distributed(w, s, Layout::zigzag), b = distributed(w, s, Layout::zigzag);
    for (auto [x, y] : {std::pair{&a.out, &b.out}, {&a.lse, &b.lse}, {&a.dq, &b.dq}, {&a.dk, &b.dk}, {&a.dv, &b.dv}}) {
      EXPECT_EQ(0, std::memcmp(x->data(), y->data(), x->size() * sizeof(float))) << name(s);
    }
  }
}

TEST(DistAttention, RingSkipsStepsOutsideTheWindow) {
  Case c;
  c.name = "window 5, contiguous";
  c.L = 40 * world_size();
  c.opt.window = {5, 0};
  const Whole w(c, 13);
  dist::Stats st;
  const Results got = distributed(w, Strategy::ring, Layout::contiguous, &st);
  const Results one = single_process(w, false);
  EXPECT_LE(rel(got.out, one.out), 2e-6);
  // Rank r needs its own block and rank r − 1's: one step, the rest skipped.
  EXPECT_EQ(st.steps_skipped, world_size() - 2);
  EXPECT_EQ(st.steps, world_rank() == 0 ? 1 : 2);
}

// --- arguments -------------------------------------------------------------------

// Runs `call` on every rank; every rank must throw attn::Error containing `needle`.
void expect_error_everywhere(const std::function<void()>& call, const std::string& needle) {
  std::string what = "no error";
  try {
    call();
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_NE(what.find(needle), std::string::npos) << "rank " << world_rank() << ": " << what;
}

struct Small {
  std::vector<float> q, k, v, out;
  std::vector<float> lse;
  int64_t Lr;
  explicit Small(int64_t L = 10, int Hq = 4, int Hkv = 2)
      : Lr(dist::shard_length(L, world_rank(), world_size(), Layout::zigzag)) {
    q.assign(size_t(Lr) * Hq * 8, 0.5f), k.assign(size_t(Lr) * Hkv * 8, 0.25f);
    v.assign(size_t(Lr) * Hkv * 8, 1.0f), out.assign(q.size(), 0.0f), lse.assign(size_t(Hq) * Lr, 0.0f);
  }
  TensorView qv(int Hq = 4) const { return TensorView(q.data(), DType::f32, {1, Lr, Hq, 8}); }
  TensorView kv(int Hkv = 2) const { return TensorView(k.data(), DType::f32, {1, Lr, Hkv, 8}); }
  TensorView vv(int Hkv = 2) const { return TensorView(v.data(), DType::f32, {1, Lr, Hkv, 8}); }
  TensorView ov(int Hq = 4) const { return TensorView(out.data(), DType::f32, {1, Lr, Hq, 8}); }
};

TEST(DistAttentionArgs, OptionsThatDifferBetweenRanksAreAnErrorOnEveryRank) {
  Small s;
  AttentionOptions o;
  o.causal = world_rank() == world_size() - 1 ? Causal::TopLeft : Causal::None;
  expect_error_everywhere([&] { dist::ring_attention(MPI_COMM_WORLD, s.qv(), s.kv(), s.vv(), s.ov(), o); },
                          "the ranks disagree on options.causal");
  AttentionOptions p;
  p.seed = 1 + world_rank();
  p.dropout_p = 0.1f;
  expect_error_everywhere([&] { dist::ulysses_attention(MPI_COMM_WORLD, s.qv(), s.kv(), s.vv(), s.ov(), p); },
                          "the ranks disagree on options.seed");
}

TEST(DistAttentionArgs, OneRanksBadShapeIsAnErrorOnEveryRank) {
  Small s;
  const int bad = world_size() - 1;
  // The last rank passes out with the wrong value dimension.
  const TensorView out = world_rank() == bad ? TensorView(s.out.data(), DType::f32, {1, s.Lr, 4, 4}) : s.ov();
  expect_error_everywhere([&] { dist::ring_attention(MPI_COMM_WORLD, s.qv(), s.kv(), s.vv(), out); },
                          "ring_attention: rank " + std::to_string(bad) + ": out");
}

TEST(DistAttentionArgs, LengthsThatDoNotFitTheZigzagLayout) {
  // Rank r holds 5 + 3r positions: no zigzag split of their sum gives rank 0 five
  // (2 ranks: L 13 → 4 + 3; 4 ranks: L 38 → 5 + 4).
  const int64_t Lr = 5 + 3 * world_rank();
  std::vector<float> q(size_t(Lr) * 4 * 8, 0.5f), o(q.size());
  const TensorView qv(q.data(), DType::f32, {1, Lr, 4, 8}), ov(o.data(), DType::f32, {1, Lr, 4, 8});
  expect_error_everywhere([&] { dist::ring_attention(MPI_COMM_WORLD, qv, qv, qv, ov); }, "with Layout::zigzag");
  // The contiguous layout takes any lengths.
  std::string what = "ok";
  try {
    dist::ring_attention(MPI_COMM_WORLD, qv, qv, qv, ov, {}, {}, Layout::contiguous);
  } catch (const Error& e) {
    what = e.what();
  }
  EXPECT_EQ(what, "ok");
}

TEST(DistAttentionArgs, UnsupportedOptions) {
  Small s;
  std::vector<uint8_t> m(100, 1);
  AttentionOptions o;
  o.mask = TensorView(m.data(), DType::boolean, {10, 10});
  expect_error_everywhere([&] { dist::ring_attention(MPI_COMM_WORLD, s.qv(), s.kv(), s.vv(), s.ov(), o); },
                          "options.mask is not supported");
  std::vector<int32_t> kl{11};
  AttentionOptions p;
  p.key_lengths = TensorView(kl.data(), DType::i32, {1});
  expect_error_everywhere([&] { dist::ring_attention(MPI_COMM_WORLD, s.qv(), s.kv(), s.vv(), s.ov(), p); },
                          "options.key_lengths[0] must be in [0, 10]");
}

TEST(DistAttentionArgs, UlyssesNeedsHeadsDivisibleByRanks) {
  Small s(10, 3, 1);
  if (3 % world_size() == 0) GTEST_SKIP();
  expect_error_everywhere(
      [&] { dist::ulysses_attention(MPI_COMM_WORLD, s.qv(3), s.kv(1), s.vv(1), s.ov(3)); },
      "must be divisible by the number of ranks");
}

TEST(DistAttentionArgs, KeysMustHoldTheQueriesPositions) {
  Small s;
  const TensorView k(s.k.data(), DType::f32, {1, s.Lr > 0 ? s.Lr - 1 : 0, 2, 8});
  expect_error_everywhere([&] { dist::ring_attention(MPI_COMM_WORLD, s.qv(), k, s.vv(), s.ov()); },
                          "k and v must hold the positions q holds");
}

TEST(DistShard, ShardUnshardAndGatherRoundTrip) {
  const int R = world_size();
  for (int64_t L : {1, 3, 8, 17, 100}) {
    for (Layout layout : {Layout::zigzag, Layout::contiguous}) {
      std::vector<float> whole(size_t(2) * L * 3), back(whole.size(), -1.0f), all(whole.size(), -1.0f);
      for (size_t i = 0; i < whole.size(); ++i) whole[i] = float(i) * 0.5f + 1;
      const TensorView wv(whole.data(), DType::f32, {2, L, 3});
      int64_t total = 0;
      for (int r = 0; r < R; ++r) total += dist::shard_length(L, r, R, layout);
      EXPECT_EQ(total, L);
      const int64_t Lr = dist::shard_length(L, world_rank(), R, layout);
      std::vector<float> local(size_t(2) * Lr * 3);
      const TensorView lv(local.data(), DType::f32, {2, Lr, 3});
      dist::shard(wv, lv, world_rank(), R, layout);
      dist::unshard(lv, TensorView(back.data(), DType::f32, {2, L, 3}), world_rank(), R, layout);
      for (const dist::Segment& s : dist::shard_segments(L, world_rank(), R, layout))
        for (int64_t i = s.position; i < s.position + s.length; ++i) EXPECT_EQ(back[size_t(i) * 3], whole[size_t(i) * 3]);
      dist::allgather_sequence(MPI_COMM_WORLD, lv, TensorView(all.data(), DType::f32, {2, L, 3}), layout);
      EXPECT_EQ(all, whole) << "L " << L << " " << name(layout);
    }
  }
  // Zigzag: rank r holds chunk r and chunk 2R − 1 − r.
  const auto segs = dist::shard_segments(8 * R, world_rank(), R, Layout::zigzag);
  ASSERT_EQ(segs.size(), 2u);
  EXPECT_EQ(segs[0].position, 4 * world_rank());
  EXPECT_EQ(segs[1].position, 4 * (2 * R - 1 - world_rank()));
}

}  // namespace
}  // namespace attn::testing

// MPI around GoogleTest: one seed for all ranks; only rank 0 prints the usual
// report, the others print their failures (prefixed with the rank).
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed()) std::printf("[rank %d] %s:%d: %s\n", rank_, r.file_name(), r.line_number(), r.summary());
  }

 private:
  int rank_;
};

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int rank = attn::testing::world_rank();
  uint64_t seed = 0;
  if (rank == 0) {
    const char* env = std::getenv("ATTN_TEST_SEED");
    seed = env ? std::strtoull(env, nullptr, 10) : std::random_device{}() * 0x100000001ull;
    std::printf("ATTN_TEST_SEED=%llu (%d ranks)\n", static_cast<unsigned long long>(seed),
                attn::testing::world_size());
  }
  MPI_Bcast(&seed, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
  attn::testing::g_seed = seed;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(rank));
  }
  int failed = RUN_ALL_TESTS();
  // Every rank must know whether any rank failed (mpirun reports the first exit code).
  MPI_Allreduce(MPI_IN_PLACE, &failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return failed;
}
