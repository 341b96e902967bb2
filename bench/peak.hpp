// This machine's arithmetic roof: the f32 FMA rate, the bf16 dot-product rate
// (vdpbf16ps), the AMX tile rate (tdpbf16ps) and the int16 dot-product rate (vpdpwssd), measured with independent accumulator chains so neither latency
// nor memory limits them. Every kernel figure is quoted as a fraction of these.
#pragma once

namespace attn::bench {

struct Peak {
  double f32_gflops = 0;   // FMA: 2 flops per lane
  double bf16_gflops = 0;  // vdpbf16ps: 4 flops per f32 lane; 0 if the CPU lacks it
  double amx_bf16_gflops = 0;  // tdpbf16ps on tiles; 0 without usable AMX
  /// vpdpwssd (AVX512-VNNI: 32 int16 products into int32 per instruction, 2 ops each):
  /// the decode kernel's integer passes (Precision::bf16 on i8 caches); 0 without it.
  double int16_gops = 0;
  const char* isa = "";    // "avx512", "avx2" or "scalar"
};

/// Measures the peak with `threads` threads (each runs the loop; rates add up).
/// Takes about `seconds` of wall time per figure; the median of several runs.
Peak measure_peak(int threads, double seconds = 0.3);

}  // namespace attn::bench
