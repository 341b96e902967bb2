// bench/peak: prints this machine's f32 FMA, bf16 dot, AMX and int16 dot peaks, 1 thread and all.
#include <omp.h>

#include <cstdio>
#include <initializer_list>

#include "peak.hpp"

int main() {
  const int all = omp_get_num_procs();
  for (int threads : {1, all}) {
    const attn::bench::Peak p = attn::bench::measure_peak(threads);
    std::printf(
        "threads=%d isa=%s f32_fma_peak=%.1f GFLOP/s bf16_dot_peak=%.1f GFLOP/s amx_bf16_peak=%.1f GFLOP/s "
        "int16_dot_peak=%.1f GOP/s\n",
        threads, p.isa, p.f32_gflops, p.bf16_gflops, p.amx_bf16_gflops, p.int16_gops);
    if (all == 1) break;
  }
  return 0;
}
