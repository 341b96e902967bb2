// attention_workspace_bytes and attention_backward_workspace_bytes against what the
// kernels really allocate. The oracle is independent of the formulas: each call runs
// on a fresh thread (so its reusable scratch starts empty) with one kernel thread, and
// its memory is the scratch it asked for (thread_scratch_needed_bytes) plus the peak
// of what it held through operator new, counted by the replacements below.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <new>
#include <random>
#include <thread>
#include <vector>

#include "attn/attention.hpp"
#include "cpu/isa.hpp"
#include "cpu/workspace.hpp"
#include "attention_harness.hpp"
#include "lowp_harness.hpp"

namespace {

// Bytes held through operator new by this thread while counting, and their peak.
thread_local bool t_counting = false;
thread_local int64_t t_live = 0, t_peak = 0;

// Every block carries its size in front, so that delete can count it.
constexpr size_t kHeader = alignof(std::max_align_t);

void* counted_new(size_t n) {
  void* block = std::malloc(n + kHeader);
  if (block == nullptr) throw std::bad_alloc();
  *static_cast<size_t*>(block) = n;
  if (t_counting) {
    t_live += static_cast<int64_t>(n);
    t_peak = std::max(t_peak, t_live);
  }
  return static_cast<char*>(block) + kHeader;
}

void counted_delete(void* p) noexcept {
  if (p == nullptr) return;
  char* block = static_cast<char*>(p) - kHeader;
  if (t_counting) t_live -= static_cast<int64_t>(*reinterpret_cast<size_t*>(block));
  std::free(block);
}

}  // namespace

void* operator new(size_t n) { return counted_new(n); }
void* operator new[](size_t n) { return counted_new(n); }
void operator delete(void* p) noexcept { counted_delete(p); }
void operator delete[](void* p) noexcept { counted_delete(p); }
void operator delete(void* p, size_t) noexcept { counted_delete(p); }
void operator delete[](void* p, size_t) noexcept { counted_delete(p); }

namespace attn::testing {
namespace {

// The bytes `call` needs: run on a fresh thread, its scratch requests plus the peak of
// its operator-new allocations.
template <class Call>
size_t measured_bytes(const Call& call) {
  size_t bytes = 0;
  const int before = num_threads();
  set_num_threads(1);
  std::thread worker([&] {
    t_live = t_peak = 0;
    t_counting = true;
    call();
    t_counting = false;
    bytes = detail::thread_scratch_needed_bytes() + static_cast<size_t>(t_peak);
  });
  worker.join();
  set_num_threads(before);
  return bytes;
}

// The reported bytes match the measured ones up to the small bookkeeping vectors the
// formulas leave out (work item lists, per-sequence offsets: ~1–2 KiB here).
void expect_reported_matches(size_t reported, size_t measured, const std::string& what) {
  const double slack = 8 * 1024 + measured / 200.0;
  EXPECT_LE(std::abs(static_cast<double>(reported) - static_cast<double>(measured)), slack)
      << what << ": reported " << reported << " bytes, measured " << measured;
}

struct Shape {
  int B, Lq, Lk, Hq, Hkv, d, dv;
};

const Shape kShapes[] = {{1, 300, 300, 4, 4, 64, 64}, {2, 17, 1000, 4, 2, 128, 96}, {1, 129, 65, 3, 1, 80, 48}};

std::string describe(const Shape& s) {
  return "Lq=" + std::to_string(s.Lq) + " Lk=" + std::to_string(s.Lk) + " d=" + std::to_string(s.d);
}

// One forward and backward call's tensors, in the storage dtype or as f32 (the
// LowpCall's exact f32 twins), with its gradients' buffers.
struct Call {
  LowpCall c;  // its dq, dk, dv_ hold the gradients in the storage dtype
  std::vector<float> out32, dq32, dk32, dv32;
  TensorView q, k, v, out, lse, dout, dqv, dkv, dvv;

  Call(DType dt, const Shape& s, std::mt19937_64& rng)
      : c(dt == DType::f32 ? DType::bf16 : dt, s.B, s.Lq, s.Lk, s.Hq, s.Hkv, s.d, s.dv, rng) {
    lse = c.lse_view();
    if (dt == DType::f32) {
      out32.resize(c.dout32.size()), dq32.resize(c.q32.size()), dk32.resize(c.k32.size()), dv32.resize(c.v32.size());
      q = c.view32(c.q32, s.Lq, s.Hq, s.d), k = c.view32(c.k32, s.Lk, s.Hkv, s.d), v = c.view32(c.v32, s.Lk, s.Hkv, s.dv);
      out = c.view32(out32, s.Lq, s.Hq, s.dv), dout = c.view32(c.dout32, s.Lq, s.Hq, s.dv);
      dqv = c.view32(dq32, s.Lq, s.Hq, s.d), dkv = c.view32(dk32, s.Lk, s.Hkv, s.d), dvv = c.view32(dv32, s.Lk, s.Hkv, s.dv);
    } else {
      c.dq.resize(c.q.size()), c.dk.resize(c.k.size()), c.dv_.resize(c.v.size());
      q = c.view(c.q, s.Lq, s.Hq, s.d), k = c.view(c.k, s.Lk, s.Hkv, s.d), v = c.view(c.v, s.Lk, s.Hkv, s.dv);
      out = c.view(c.out, s.Lq, s.Hq, s.dv), dout = c.view(c.dout, s.Lq, s.Hq, s.dv);
      dqv = c.view(c.dq, s.Lq, s.Hq, s.d), dkv = c.view(c.dk, s.Lk, s.Hkv, s.d), dvv = c.view(c.dv_, s.Lk, s.Hkv, s.dv);
    }
  }

  // Both functions' reports against what attention() and attention_backward() allocate.
  void expect_reports_match(const AttentionOptions& opt, const std::string& what) const {
    expect_reported_matches(attention_workspace_bytes(q, k, v, out, opt, 1),
                            measured_bytes([&] { attention(q, k, v, out, opt, lse); }), what + " forward");
    expect_reported_matches(attention_backward_workspace_bytes(q, k, v, out, lse, dout, dqv, dkv, dvv, opt, 1),
                            measured_bytes([&] { attention_backward(q, k, v, out, lse, dout, dqv, dkv, dvv, opt); }),
                            what + " backward");
  }
};

std::vector<const char*> isas() {
  std::vector<const char*> out = {"f32"};
  if (detail::cpu_features().amx_bf16) out.push_back("amx");
  if (detail::cpu_features().avx512_bf16) out.push_back("avx512bf16");
  return out;
}

TEST(WorkspaceBytes, ForwardAndBackwardReportWhatF32CallsAllocate) {
  std::mt19937_64 rng(41);
  for (const Shape& s : kShapes) {
    const Call call(DType::f32, s, rng);
    for (Causal causal : {Causal::None, Causal::TopLeft}) {
      AttentionOptions opt;
      opt.causal = causal;
      call.expect_reports_match(opt, "f32 " + describe(s) + (causal == Causal::None ? "" : " causal"));
    }
  }
}

// bf16 and f16 on every path this CPU can run (the tile and vdpbf16ps kernels' packs,
// the portable path's f32 copies), and f32 inputs rounded to bf16 or split into two
// bf16 pieces in the call.
TEST(WorkspaceBytes, ForwardAndBackwardReportWhatLowPrecisionCallsAllocate) {
  std::mt19937_64 rng(43);
  for (const char* isa : isas()) {
    const ScopedIsa forced(isa);
    for (const Shape& s : kShapes) {
      for (DType dt : {DType::bf16, DType::f16}) {
        Call(dt, s, rng).expect_reports_match({}, std::string(isa) + " " + dtype_name(dt) + " " + describe(s));
      }
      AttentionOptions rounded;
      rounded.precision = Precision::bf16;
      Call(DType::f32, s, rng).expect_reports_match(rounded, std::string(isa) + " f32 as bf16 " + describe(s));
      AttentionOptions split;
      split.precision = Precision::bf16x3;
      Call(DType::f32, s, rng).expect_reports_match(split, std::string(isa) + " f32 as bf16x3 " + describe(s));
    }
  }
}

TEST(WorkspaceBytes, BackwardChecksItsArgumentsAsTheBackwardDoes) {
  const size_t n = 2 * 8 * 2 * 16;
  std::vector<float> x(n, 0.5f), dq(n), dk(n), dv(n), lse(2 * 2 * 8);
  auto view = [](std::vector<float>& b, int d) { return TensorView(b.data(), DType::f32, {2, 8, 2, d}); };
  const TensorView t = view(x, 16), l(lse.data(), DType::f32, {2, 2, 8});
  EXPECT_GT(attention_backward_workspace_bytes(t, t, t, t, l, t, view(dq, 16), view(dk, 16), view(dv, 16), {}, 2), 0u);
  expect_attn_error(
      [&] {
        (void)attention_backward_workspace_bytes(t, t, t, t, l, t, view(dq, 8), view(dk, 16), view(dv, 16), {}, 1);
      },
      "attention_backward_workspace_bytes: dq");
}

}  // namespace
}  // namespace attn::testing
