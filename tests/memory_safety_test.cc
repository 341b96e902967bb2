// Memory safety and limits (issue 10, items 8–12): size products that overflow,
// batch and row counts beyond 32 bits, negative strides, thread counts, windows
// near INT_MAX, workspace growth, and outputs that overlap inputs.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "cpu/workspace.hpp"

namespace attn::testing {
namespace {

template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  } catch (const std::exception& e) {
    return std::string("not attn::Error: ") + e.what();
  }
  return "(no error)";
}

std::vector<float> random_floats(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> x(n);
  for (float& y : x) y = u(rng);
  return x;
}

// Item 8: {1<<62} allocated 64 bytes, {2^32, 2^32} had numel 0.
TEST(MemorySafety, TensorSizeOverflowIsAnError) {
  EXPECT_NE(std::string::npos, error_of([] { Tensor t(DType::f32, {int64_t{1} << 62}); }).find("too large"));
  EXPECT_NE(std::string::npos,
            error_of([] { Tensor t(DType::f32, {int64_t{1} << 32, int64_t{1} << 32}); }).find("too large"));
  EXPECT_NE(std::string::npos, error_of([] {
              TensorView v(reinterpret_cast<void*>(64), DType::f32, {int64_t{1} << 32, int64_t{1} << 32});
            }).find("too large"));
  // A zero dimension makes any shape empty, whatever the others.
  EXPECT_EQ("(no error)", error_of([] { Tensor t(DType::f32, {int64_t{1} << 62, 0}); }));
}

// Item 8: B = 2^32 + 1 with stride-0 views computed only batch 0; B = 2^31
// threw std::length_error.
TEST(MemorySafety, BatchAndRowCountsBeyond32BitsAreErrors) {
  float x = 1.0f, o = 0.0f;
  for (int64_t B : {(int64_t{1} << 32) + 1, int64_t{1} << 31}) {
    const TensorView in(&x, DType::f32, {B, 1, 1, 1}, {0, 0, 0, 1});
    const TensorView out(&o, DType::f32, {B, 1, 1, 1}, {1, 1, 1, 1});
    const std::string e = error_of([&] { attention(in, in, in, out, {}); });
    EXPECT_NE(std::string::npos, e.find("below 2^31")) << e;
  }
  // B·Lq·Hq beyond 2^31 rows of work.
  const TensorView in(&x, DType::f32, {1 << 16, 1 << 16, 1, 1}, {0, 0, 0, 1});
  const std::string e = error_of([&] { attention(in, in, in, in, {}); });
  EXPECT_NE(std::string::npos, e.find("2^31")) << e;
}

// Item 9: negative strides overflowed the reference's heap (ASan) and made the
// backward with a negatively strided dbias segfault; every entry point rejects them.
TEST(MemorySafety, NegativeStridesAreRejectedEverywhere) {
  auto rng = make_rng(2000);
  const int L = 4, d = 3;
  std::vector<float> q = random_floats(L * d, rng), k = random_floats(L * d, rng),
                     v = random_floats(L * d, rng), out(L * d), lse(L), g = random_floats(L * d, rng),
                     dq(L * d), dk(L * d), dv(L * d), mask = random_floats(L * L, rng), dbias(L * L);
  const TensorView qv(q.data(), DType::f32, {1, L, 1, d}), kv(k.data(), DType::f32, {1, L, 1, d}),
      vv(v.data(), DType::f32, {1, L, 1, d}), ov(out.data(), DType::f32, {1, L, 1, d}),
      lv(lse.data(), DType::f32, {1, 1, L}), gv(g.data(), DType::f32, {1, L, 1, d}),
      dqv(dq.data(), DType::f32, {1, L, 1, d}), dkv(dk.data(), DType::f32, {1, L, 1, d}),
      dvv(dv.data(), DType::f32, {1, L, 1, d});
  // k reversed along the sequence: the last row first.
  const TensorView k_rev(k.data() + (L - 1) * d, DType::f32, {1, L, 1, d}, {L * d, -d, d, 1});
  AttentionOptions opt;
  for (bool reference : {false, true}) {
    const std::string e = error_of([&] {
      reference ? attention_reference(qv, k_rev, vv, ov, opt, lv) : attention(qv, k_rev, vv, ov, opt, lv);
    });
    EXPECT_NE(std::string::npos, e.find("k must have non-negative strides")) << e;
  }
  attention(qv, kv, vv, ov, opt, lv);
  opt.mask = TensorView(mask.data(), DType::f32, {L, L});
  attention(qv, kv, vv, ov, opt, lv);
  const TensorView dbias_rev(dbias.data() + (L - 1) * L, DType::f32, {L, L}, {-L, 1});
  for (bool reference : {false, true}) {
    const std::string e = error_of([&] {
      reference ? attention_backward_reference(qv, kv, vv, ov, lv, gv, dqv, dkv, dvv, opt, dbias_rev)
                : attention_backward(qv, kv, vv, ov, lv, gv, dqv, dkv, dvv, opt, dbias_rev);
    });
    EXPECT_NE(std::string::npos, e.find("dbias must have non-negative strides")) << e;
  }
  const TensorView mask_rev(mask.data() + (L - 1) * L, DType::f32, {L, L}, {-L, 1});
  opt.mask = mask_rev;
  EXPECT_NE(std::string::npos, error_of([&] { attention(qv, kv, vv, ov, opt); }).find("mask must have non-negative"));
}

// Item 10: set_num_threads(100000) and (2^30) crashed.
TEST(MemorySafety, ThreadCountsAreCapped) {
  const int saved = num_threads();
  for (int n : {100000, 1 << 30, 0, -1}) {
    const std::string e = error_of([&] { set_num_threads(n); });
    EXPECT_NE(std::string::npos, e.find("set_num_threads: n must be in [1, 4096]")) << e;
  }
  EXPECT_EQ(saved, num_threads());
  set_num_threads(kMaxThreads);
  set_num_threads(saved);
}

// Item 11: window sizes near INT_MAX overflowed int arithmetic in the reference
// (UBSan, in the sanitizer build); both paths agree with "unbounded".
TEST(MemorySafety, WindowsNearIntMax) {
  auto rng = make_rng(2001);
  const int Lq = 5, Lk = 9, d = 4;
  std::vector<float> q = random_floats(Lq * d, rng), k = random_floats(Lk * d, rng),
                     v = random_floats(Lk * d, rng);
  const TensorView qv(q.data(), DType::f32, {1, Lq, 1, d}), kv(k.data(), DType::f32, {1, Lk, 1, d}),
      vv(v.data(), DType::f32, {1, Lk, 1, d});
  std::vector<float> unbounded(Lq * d), a(Lq * d), b(Lq * d);
  attention_reference(qv, kv, vv, TensorView(unbounded.data(), DType::f32, {1, Lq, 1, d}), {});
  for (Window w : {Window{INT_MAX, INT_MAX}, Window{INT_MAX - 1, -1}, Window{-1, INT_MAX}}) {
    AttentionOptions opt;
    opt.window = w;
    attention_reference(qv, kv, vv, TensorView(a.data(), DType::f32, {1, Lq, 1, d}), opt);
    attention(qv, kv, vv, TensorView(b.data(), DType::f32, {1, Lq, 1, d}), opt);
    for (int n = 0; n < Lq * d; ++n) {
      EXPECT_FLOAT_EQ(unbounded[n], a[n]);
      EXPECT_NEAR(unbounded[n], b[n], 1e-6);
    }
  }
}

// Item 11: the per-thread workspace grew by 1.5× even when only the exact size
// fitted (24 GiB asked where 16 would do). Under an address-space limit, a
// request that fits must succeed. (Not under ASan, whose shadow memory needs
// far more address space than any limit small enough to test with.)
TEST(MemorySafety, WorkspaceGrowsToWhatFitsWhenOneAndAHalfDoesNot) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "address-space limits do not mix with AddressSanitizer";
#else
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    rlimit lim{};
    getrlimit(RLIMIT_AS, &lim);
    // What this process has mapped now, plus 1.25 GiB of room.
    long pages = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
      std::fclose(f);
    }
    const size_t room = size_t(pages) * size_t(sysconf(_SC_PAGESIZE)) + (size_t{5} << 28);
    lim.rlim_cur = room;
    if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    try {
      // 1 GiB fits; 1.5 GiB does not.
      float* p = detail::thread_scratch(detail::kSlotTile, (size_t{1} << 30) / sizeof(float));
      _exit(p != nullptr ? 0 : 1);
    } catch (...) {
      _exit(2);
    }
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(0, WEXITSTATUS(status)) << "1: null, 2: threw, 3: setrlimit failed";
#endif
}

// Item 12: out = q shifted by a row, or dq = q / dk = k, gave wrong results
// silently; now attn::Error. Exact aliasing of out with q still works.
TEST(MemorySafety, OverlappingOutputsAreErrors) {
  auto rng = make_rng(2002);
  const int L = 7, H = 2, d = 8;
  std::vector<float> buf = random_floats(size_t(L + 1) * H * d, rng), k = random_floats(L * H * d, rng),
                     v = random_floats(L * H * d, rng), lse(H * L), g = random_floats(L * H * d, rng);
  const TensorView q(buf.data(), DType::f32, {1, L, H, d}), kv(k.data(), DType::f32, {1, L, H, d}),
      vv(v.data(), DType::f32, {1, L, H, d}), lv(lse.data(), DType::f32, {1, H, L}),
      gv(g.data(), DType::f32, {1, L, H, d});
  const TensorView shifted(buf.data() + H * d, DType::f32, {1, L, H, d});
  std::string e = error_of([&] { attention(q, kv, vv, shifted, {}); });
  EXPECT_NE(std::string::npos, e.find("out overlaps q")) << e;
  e = error_of([&] { attention(q, kv, vv, TensorView(k.data(), DType::f32, {1, L, H, d}), {}, lv); });
  EXPECT_EQ("(no error)", e);  // out = k exactly: allowed
  e = error_of([&] { attention(q, kv, vv, vv, {}, TensorView(v.data(), DType::f32, {1, H, L})); });
  EXPECT_NE(std::string::npos, e.find("lse overlaps")) << e;

  // Exact aliasing out = q gives the same result as separate memory.
  std::vector<float> qcopy(buf.begin(), buf.begin() + L * H * d), sep(L * H * d);
  const TensorView q2(qcopy.data(), DType::f32, {1, L, H, d});
  attention(q2, kv, vv, TensorView(sep.data(), DType::f32, {1, L, H, d}), {});
  attention(q2, kv, vv, q2, {});
  for (int n = 0; n < L * H * d; ++n) EXPECT_EQ(sep[n], qcopy[n]);

  // Backward: dq = q, dk = k, dq overlapping dk.
  std::vector<float> qb = random_floats(L * H * d, rng), out(L * H * d), dq(L * H * d), dk(L * H * d),
                     dv(L * H * d);
  const TensorView qbv(qb.data(), DType::f32, {1, L, H, d}), ov(out.data(), DType::f32, {1, L, H, d});
  attention(qbv, kv, vv, ov, {}, lv);
  const TensorView dqv(dq.data(), DType::f32, {1, L, H, d}), dkv(dk.data(), DType::f32, {1, L, H, d}),
      dvv(dv.data(), DType::f32, {1, L, H, d});
  e = error_of([&] { attention_backward(qbv, kv, vv, ov, lv, gv, qbv, dkv, dvv, {}); });
  EXPECT_NE(std::string::npos, e.find("dq overlaps q")) << e;
  e = error_of([&] { attention_backward(qbv, kv, vv, ov, lv, gv, dqv, kv, dvv, {}); });
  EXPECT_NE(std::string::npos, e.find("dk overlaps k")) << e;
  e = error_of([&] { attention_backward(qbv, kv, vv, ov, lv, gv, dqv, dqv, dvv, {}); });
  EXPECT_NE(std::string::npos, e.find("dq overlaps dk")) << e;
  e = error_of([&] { attention_backward(qbv, kv, vv, ov, lv, gv, dqv, dkv, dvv, {}); });
  EXPECT_EQ("(no error)", e);
}

// Views that interleave without sharing an element are not overlaps: q, k, v
// and dq, dk, dv sliced from packed [B, L, 3, H, d] buffers (FlashAttention's
// qkv-packed layout), against separate buffers.
TEST(MemorySafety, PackedQkvBuffersAreNotOverlaps) {
  auto rng = make_rng(2003);
  const int B = 2, L = 9, H = 2, d = 8;
  std::vector<float> qkv = random_floats(size_t(B) * L * 3 * H * d, rng), dqkv(qkv.size());
  std::vector<float> out(size_t(B) * L * H * d), lse(size_t(B) * H * L), g = random_floats(out.size(), rng);
  const std::vector<int64_t> shape = {B, L, H, d}, strides = {L * 3 * H * d, 3 * H * d, d, 1};
  auto slice = [&](std::vector<float>& t, int which) {
    return TensorView(t.data() + which * H * d, DType::f32, shape, strides);
  };
  const TensorView ov(out.data(), DType::f32, {B, L, H, d}), lv(lse.data(), DType::f32, {B, H, L}),
      gv(g.data(), DType::f32, {B, L, H, d});
  AttentionOptions opt;
  opt.causal = Causal::TopLeft;
  attention(slice(qkv, 0), slice(qkv, 1), slice(qkv, 2), ov, opt, lv);
  attention_backward(slice(qkv, 0), slice(qkv, 1), slice(qkv, 2), ov, lv, gv, slice(dqkv, 0),
                     slice(dqkv, 1), slice(dqkv, 2), opt);
  // The same with separate gradient buffers gives the same numbers.
  std::vector<float> dq(out.size()), dk(out.size()), dv(out.size());
  attention_backward(slice(qkv, 0), slice(qkv, 1), slice(qkv, 2), ov, lv, gv,
                     TensorView(dq.data(), DType::f32, {B, L, H, d}), TensorView(dk.data(), DType::f32, {B, L, H, d}),
                     TensorView(dv.data(), DType::f32, {B, L, H, d}), opt);
  for (int b = 0; b < B; ++b) {
    for (int l = 0; l < L; ++l) {
      for (int x = 0; x < H * d; ++x) {
        const size_t packed = (size_t(b) * L + l) * 3 * H * d + x, flat = (size_t(b) * L + l) * H * d + x;
        EXPECT_EQ(dq[flat], dqkv[packed]);
        EXPECT_EQ(dk[flat], dqkv[packed + H * d]);
        EXPECT_EQ(dv[flat], dqkv[packed + 2 * H * d]);
      }
    }
  }
  // A stride-0 (broadcast) output would have many writers per element.
  std::vector<float> one_row(d);
  const std::string e = error_of([&] {
    attention(slice(qkv, 0), slice(qkv, 1), slice(qkv, 2),
              TensorView(one_row.data(), DType::f32, shape, {0, 0, 0, 1}), opt);
  });
  EXPECT_NE(std::string::npos, e.find("out is an output, so its elements must not overlap")) << e;
}

}  // namespace
}  // namespace attn::testing
