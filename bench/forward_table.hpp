// The forward benchmark table of the foundation issue: attn's fused forward beside
// the cblas baseline, for B=1, H=8, N ∈ {512, 2048, 8192}, d ∈ {64, 128}, causal
// or not, 1 thread and all threads. Used by `attn bench` and bench_attention.
#pragma once

#include <iosfwd>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/tensor.hpp"
#include "peak.hpp"

namespace attn::bench {

struct ForwardConfig {
  int B = 1, H = 8, N = 2048, d = 128;
  bool causal = false;
  int threads = 1;
  bool backward = false;  // time attention_backward (flops: 2.5× the forward's)
  DType dtype = DType::f32;  // of q, k, v, out (the baseline computes f32 on the same values)
  Precision precision = Precision::f32;  // AttentionOptions::precision (f32 inputs only)
};

/// The dtype column's text: the dtype, and for f32 inputs a precision other than f32
/// ("f32/bf16", "f32/bf16x3").
std::string dtype_label(const ForwardConfig& c);

struct ForwardRow {
  ForwardConfig config;
  double flops = 0;        // 4·N²·d·H·B, halved for causal (visible pairs only); ×2.5 backward
  double ms = 0;           // attn, median
  double baseline_ms = 0;  // cblas pipeline, median (0 = not run)
  double extra_mb = 0;     // attn's workspace
  double baseline_extra_mb = 0;
  double baseline_difference = 0;  // |out_attn - out_baseline| / |out_attn|: must be tiny
  std::string path = "f32";        // the kernel that ran: "f32", "amx" or "avx512bf16" (cpu_info())
  double gflops() const { return flops / (ms * 1e6); }
  double baseline_gflops() const { return baseline_ms > 0 ? flops / (baseline_ms * 1e6) : 0; }
};

struct TableOptions {
  std::vector<int> sizes = {512, 2048, 8192};
  std::vector<int> head_dims = {64, 128};
  std::vector<bool> causal = {false, true};
  std::vector<int> threads = {1};  // callers add "all cores"
  int min_reps = 5;
  double min_seconds = 1.0;  // per configuration and implementation
  bool baseline = true;
  bool backward = false;  // the backward table instead of the forward's
  std::vector<DType> dtypes = {DType::f32};
  Precision precision = Precision::f32;  // for the f32 rows
};

/// Times one configuration: attn and (optionally) the baseline interleaved, so
/// both see the same machine state; medians of the repetitions.
ForwardRow time_forward(const ForwardConfig& c, const TableOptions& o);

/// Runs the whole table, printing progress to `log`.
std::vector<ForwardRow> run_forward_table(const TableOptions& o, std::ostream& log);

/// Markdown table with GFLOP/s, fraction of the matching peak (1 thread or all; the
/// AMX peak for rows that ran on tiles, the vdpbf16ps peak for avx512bf16 rows) and the ratio to the baseline.
std::string format_forward_table(const std::vector<ForwardRow>& rows, const Peak& peak1,
                                 const Peak& peak_all);

}  // namespace attn::bench
