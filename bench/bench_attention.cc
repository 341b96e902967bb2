// Google Benchmark suite for the fused forward: the forward table's shapes, with
// GFLOP/s as a counter, 1 thread and all cores. `bench_attention --benchmark_filter=N:2048`.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <random>
#include <thread>
#include <vector>

#include "attn/attention.hpp"
#include "baseline.hpp"

namespace {

// Args: N, d, causal, threads.
void BM_AttentionForward(benchmark::State& state) {
  const int N = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const bool causal = state.range(2) != 0;
  const int H = 8;
  const size_t n = static_cast<size_t>(N) * H * d;
  std::vector<float> q(n), k(n), v(n), out(n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = u(rng);
  }
  const attn::TensorView qv(q.data(), attn::DType::f32, {1, N, H, d}),
      kv(k.data(), attn::DType::f32, {1, N, H, d}), vv(v.data(), attn::DType::f32, {1, N, H, d}),
      ov(out.data(), attn::DType::f32, {1, N, H, d});
  attn::AttentionOptions opt;
  opt.causal = causal ? attn::Causal::TopLeft : attn::Causal::None;
  attn::set_num_threads(static_cast<int>(state.range(3)));
  for (auto _ : state) attn::attention(qv, kv, vv, ov, opt);
  const double flops = 4.0 * N * N * d * H * (causal ? 0.5 : 1.0);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

// The backward (forward run once outside the timing); GFLOP/s count 2.5× the forward's.
void BM_AttentionBackward(benchmark::State& state) {
  const int N = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const bool causal = state.range(2) != 0;
  const int H = 8;
  const size_t n = static_cast<size_t>(N) * H * d;
  std::vector<float> q(n), k(n), v(n), out(n), dout(n), dq(n), dk(n), dv(n), lse(static_cast<size_t>(H) * N);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* t : {&q, &k, &v, &dout}) {
    for (float& x : *t) x = u(rng);
  }
  auto view = [&](std::vector<float>& t) { return attn::TensorView(t.data(), attn::DType::f32, {1, N, H, d}); };
  const attn::TensorView lv(lse.data(), attn::DType::f32, {1, H, N});
  attn::AttentionOptions opt;
  opt.causal = causal ? attn::Causal::TopLeft : attn::Causal::None;
  attn::set_num_threads(static_cast<int>(state.range(3)));
  attn::attention(view(q), view(k), view(v), view(out), opt, lv);
  for (auto _ : state) {
    attn::attention_backward(view(q), view(k), view(v), view(out), lv, view(dout), view(dq), view(dk), view(dv), opt);
  }
  const double flops = 2.5 * 4.0 * N * N * d * H * (causal ? 0.5 : 1.0);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void BM_BaselineSgemm(benchmark::State& state) {
  const int N = static_cast<int>(state.range(0)), d = static_cast<int>(state.range(1));
  const bool causal = state.range(2) != 0;
  const int H = 8;
  const size_t n = static_cast<size_t>(N) * H * d;
  std::vector<float> q(n, 0.5f), k(n), v(n), out(n);
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = u(rng);
  }
  attn::bench::baseline_configure(static_cast<int>(state.range(3)));
  for (auto _ : state) {
    attn::bench::baseline_attention(q.data(), k.data(), v.data(), out.data(), 1, N, H, d, causal);
  }
  const double flops = 4.0 * N * N * d * H * (causal ? 0.5 : 1.0);
  state.counters["GFLOP/s"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}

void Shapes(benchmark::internal::Benchmark* b) {
  b->ArgNames({"N", "d", "causal", "threads"});
  const int all = std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  std::vector<int> thread_counts = {1};
  if (all > 1) thread_counts.push_back(all);
  for (int threads : thread_counts) {
    for (int N : {512, 2048, 8192}) {
      for (int d : {64, 128}) {
        for (int causal : {0, 1}) b->Args({N, d, causal, threads});
      }
    }
  }
  b->Unit(benchmark::kMillisecond)->UseRealTime();
}

BENCHMARK(BM_AttentionForward)->Apply(Shapes);
BENCHMARK(BM_AttentionBackward)->Apply(Shapes);
BENCHMARK(BM_BaselineSgemm)->Apply(Shapes);

}  // namespace

int main(int argc, char** argv) {
  attn::bench::ensure_fast_openblas(argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
