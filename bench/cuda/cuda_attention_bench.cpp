// attention() and attention_backward() on a CUDA device (issue 13's tables): B·N = 16k
// tokens, H·d = 2048, bf16, non-causal and causal, d = 64 and 128. Times with CUDA events
// around repeated calls after warm-ups on random inputs (never constants) and prints one
// line per pass and shape: the median of the repeats in ms and TFLOP/s, counting
// 4·N²·d per head for the forward (half for causal) and 2.5× that for the backward. Run
// beside bench/peers/cuda_sdpa.py (PyTorch's SDPA, same shapes) in one command, so that
// the two tables come from one machine state (scripts/gpu-check.sh).
//
//   cuda_attention_bench [repeats=20] [forward]    (forward: the forward rows alone)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <random>
#include <vector>

#include "attn/attention.hpp"
#include "tensor/convert.hpp"

// A failing CUDA call ends the benchmark with status 1.
constexpr int kCheckCudaExit = 1;
#include "check_cuda.hpp"

// Median milliseconds of `repeats` timed calls of run() (CUDA events on the default
// stream) after three warm-ups.
template <class Run>
double median_ms(int repeats, const Run& run) {
  for (int w = 0; w < 3; ++w) run();
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int r = 0; r < repeats; ++r) {
    CHECK_CUDA(cudaEventRecord(start));
    run();
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 20;
  const bool forward_only = argc > 2 && std::string(argv[2]) == "forward";  // an A/B of forward kernels
  if (const std::string why = attn::cuda_status(0).unusable; !why.empty()) {
    std::fprintf(stderr, "cuda_attention_bench: no usable GPU: %s\n", why.c_str());
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("device: %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  std::printf("| pass | d | N | B | H | causal | ms (median of %d) | TFLOP/s |\n|---|---|---|---|---|---|---|---|\n",
              repeats);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  const int64_t tokens = 16384, width = 2048;
  for (int d : {64, 128}) {
    const int H = static_cast<int>(width / d);
    std::vector<uint16_t> host(static_cast<size_t>(tokens * width));
    void *q, *k, *v, *out, *dout, *dq, *dk, *dv, *lse;
    const size_t bytes = host.size() * 2;
    for (void** p : {&q, &k, &v, &out, &dout, &dq, &dk, &dv}) CHECK_CUDA(cudaMalloc(p, bytes));
    CHECK_CUDA(cudaMalloc(&lse, size_t(tokens) * H * sizeof(float)));
    for (void* p : {q, k, v, dout}) {
      for (auto& x : host) x = attn::detail::f32_to_bf16(u(rng));
      CHECK_CUDA(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
    }
    for (int N : {512, 1024, 2048, 4096, 8192, 16384}) {
      const int B = static_cast<int>(tokens / N);
      for (bool causal : {false, true}) {
        const attn::Device gpu = attn::Device::cuda(0);
        auto view = [&](void* p) { return attn::TensorView(p, attn::DType::bf16, {B, N, H, d}).on(gpu); };
        const attn::TensorView lse_view = attn::TensorView(lse, attn::DType::f32, {B, H, N}).on(gpu);
        attn::AttentionOptions o;
        o.causal = causal ? attn::Causal::TopLeft : attn::Causal::None;
        const double fwd_flops = 4.0 * double(N) * N * d * H * B * (causal ? 0.5 : 1.0);
        const double fwd = median_ms(repeats, [&] { attn::attention(view(q), view(k), view(v), view(out), o, lse_view); });
        const double bwd = forward_only ? 0.0 : median_ms(repeats, [&] {
          attn::attention_backward(view(q), view(k), view(v), view(out), lse_view, view(dout), view(dq), view(dk),
                                   view(dv), o);
        });
        for (int pass = 0; pass < (forward_only ? 1 : 2); ++pass) {
          const double ms = pass == 0 ? fwd : bwd, flops = pass == 0 ? fwd_flops : 2.5 * fwd_flops;
          std::printf("| %s | %d | %d | %d | %d | %s | %.3f | %.1f |\n", pass == 0 ? "forward" : "backward", d, N, B,
                      H, causal ? "yes" : "no", ms, flops / (ms * 1e-3) / 1e12);
        }
      }
    }
    for (void* p : {q, k, v, out, dout, dq, dk, dv, lse}) CHECK_CUDA(cudaFree(p));
  }
  return 0;
}
