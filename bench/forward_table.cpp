// Forward benchmark table (see forward_table.hpp).
#include "forward_table.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <cstdio>
#include <ostream>
#include <random>
#include <sstream>
#include <thread>

#include "attn/attention.hpp"
#include "baseline.hpp"
#include "tensor/convert.hpp"
#include "timing.hpp"

namespace attn::bench {
namespace {

template <class Fn>
double time_ms(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

std::string dtype_label(const ForwardConfig& c) {
  if (c.dtype != DType::f32 || c.precision == Precision::f32) return dtype_name(c.dtype);
  return c.precision == Precision::bf16 ? "f32/bf16" : "f32/bf16x3";
}

ForwardRow time_forward(const ForwardConfig& c, const TableOptions& o) {
  const size_t n = static_cast<size_t>(c.B) * c.N * c.H * c.d;
  std::vector<float> q(n), k(n), v(n), out(n), out_base(n);
  std::mt19937 rng(1234 + c.N + c.d);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = u(rng);
  }
  // bf16 / f16: the inputs rounded to the dtype, and the baseline (f32) given the
  // same rounded values, so that both compute the same attention.
  const bool lowp = c.dtype != DType::f32;
  std::vector<uint16_t> q16, k16, v16, out16, dout16, dq16, dk16, dv16;
  auto to16 = [&](float x) { return c.dtype == DType::bf16 ? detail::f32_to_bf16(x) : detail::f32_to_f16(x); };
  auto from16 = [&](uint16_t x) { return c.dtype == DType::bf16 ? detail::bf16_to_f32(x) : detail::f16_to_f32(x); };
  auto narrow = [&](std::vector<float>& f, std::vector<uint16_t>& h) {
    h.resize(f.size());
    for (size_t i = 0; i < f.size(); ++i) h[i] = to16(f[i]), f[i] = from16(h[i]);
  };
  if (lowp) narrow(q, q16), narrow(k, k16), narrow(v, v16), out16.resize(n);
  auto view = [&](std::vector<float>& f, std::vector<uint16_t>& h) {
    return lowp ? TensorView(h.data(), c.dtype, {c.B, c.N, c.H, c.d}) : TensorView(f.data(), DType::f32, {c.B, c.N, c.H, c.d});
  };
  const TensorView qv = view(q, q16), kv = view(k, k16), vv = view(v, v16), ov = view(out, out16);
  AttentionOptions opt;
  opt.causal = c.causal ? Causal::TopLeft : Causal::None;
  opt.precision = c.precision;

  ForwardRow row;
  row.config = c;
  // bf16 (and f32 with Precision::bf16) runs where cpu_info() says; f16 and f32 with
  // Precision::bf16x3 on AMX tiles (as hi + lo bf16 pieces) where there are tiles,
  // else on the f32 kernel.
  const std::string bf16_path = cpu_info().bf16_path;
  const bool f32_in = c.dtype == DType::f32;
  const bool pieces = c.dtype == DType::f16 || (f32_in && c.precision == Precision::bf16x3);
  const bool rounded = c.dtype == DType::bf16 || (f32_in && c.precision == Precision::bf16);
  row.path = rounded ? bf16_path : pieces && bf16_path == "amx" ? "amx" : "f32";
  row.flops = 4.0 * c.N * c.N * c.d * c.H * c.B * (c.causal ? 0.5 : 1.0) * (c.backward ? 2.5 : 1.0);
  row.extra_mb = attention_workspace_bytes(qv, kv, vv, ov, opt, c.threads) / 1e6;
  row.baseline_extra_mb = baseline_extra_bytes(c.N, c.threads) / 1e6;

  set_num_threads(c.threads);
  baseline_configure(c.threads);
  std::function<void()> run_attn = [&] { attention(qv, kv, vv, ov, opt); };
  std::function<void()> run_base = [&] {
    baseline_attention(q.data(), k.data(), v.data(), out_base.data(), c.B, c.N, c.H, c.d, c.causal);
  };
  // Backward: the forward's out, lse (attn) and P (baseline) are computed once,
  // untimed; dq, dk, dv are compared as out is for the forward.
  std::vector<float> lse, dout, dq, dk, dv, probs, bq, bk, bv;
  if (c.backward) {
    lse.resize(static_cast<size_t>(c.B) * c.H * c.N);
    dout.resize(n), dq.resize(n), dk.resize(n), dv.resize(n), bq.resize(n), bk.resize(n), bv.resize(n);
    for (float& x : dout) x = u(rng);
    if (lowp) narrow(dout, dout16), dq16.resize(n), dk16.resize(n), dv16.resize(n);
    const TensorView lv(lse.data(), DType::f32, {c.B, c.H, c.N});
    attention(qv, kv, vv, ov, opt, lv);
    const TensorView dov = view(dout, dout16), dqv = view(dq, dq16), dkv = view(dk, dk16), dvv = view(dv, dv16);
    row.extra_mb = attention_backward_workspace_bytes(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, opt, c.threads) / 1e6;
    run_attn = [&, lv, dov, dqv, dkv, dvv] { attention_backward(qv, kv, vv, ov, lv, dov, dqv, dkv, dvv, opt); };
    if (o.baseline) {
      probs.resize(static_cast<size_t>(c.B) * c.H * c.N * c.N);
      const TensorView q32(q.data(), DType::f32, {c.B, c.N, c.H, c.d}), k32(k.data(), DType::f32, {c.B, c.N, c.H, c.d}),
          v32(v.data(), DType::f32, {c.B, c.N, c.H, c.d}), o32(out_base.data(), DType::f32, {c.B, c.N, c.H, c.d});
      attention(q32, k32, v32, o32, opt, {}, TensorView(probs.data(), DType::f32, {c.B, c.H, c.N, c.N}));
    }
    run_base = [&] {
      baseline_attention_backward(q.data(), k.data(), v.data(), probs.data(), dout.data(), bq.data(),
                                  bk.data(), bv.data(), c.B, c.N, c.H, c.d);
    };
    row.baseline_extra_mb = (probs.size() * sizeof(float) + baseline_extra_bytes(c.N, c.threads)) / 1e6;
  }
  // Each implementation in its own phase: after a parallel region, libgomp's and
  // OpenBLAS's idle threads spin for milliseconds, and interleaved runs would
  // spend the other core fighting them. A pause between phases lets them sleep.
  auto phase = [&](auto&& run) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    run();  // warm-up: workspaces, thread pool, caches
    std::vector<double> t;
    double spent = 0;
    while ((static_cast<int>(t.size()) < o.min_reps || spent < o.min_seconds) && t.size() < 50) {
      t.push_back(time_ms(run));
      spent += t.back() / 1e3;
    }
    return median(t);
  };
  row.ms = phase(run_attn);
  if (lowp) {
    for (size_t i = 0; i < n; ++i) out[i] = from16(out16[i]);
    if (c.backward) {
      for (size_t i = 0; i < n; ++i) dq[i] = from16(dq16[i]), dk[i] = from16(dk16[i]), dv[i] = from16(dv16[i]);
    }
  }
  if (o.baseline) {
    row.baseline_ms = phase(run_base);
    double num = 0, den = 0;
    auto compare = [&](const std::vector<float>& a, const std::vector<float>& b) {
      for (size_t i = 0; i < n; ++i) num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]), den += double(a[i]) * a[i];
    };
    if (c.backward) {
      compare(dq, bq), compare(dk, bk), compare(dv, bv);
    } else {
      compare(out, out_base);
    }
    row.baseline_difference = den > 0 ? std::sqrt(num / den) : 0;
  }
  return row;
}

std::vector<ForwardRow> run_forward_table(const TableOptions& o, std::ostream& log) {
  std::vector<ForwardRow> rows;
  for (DType dtype : o.dtypes) {
  for (int threads : o.threads) {
    for (int N : o.sizes) {
      for (int d : o.head_dims) {
        for (bool causal : o.causal) {
          ForwardConfig c;
          c.N = N, c.d = d, c.causal = causal, c.threads = threads, c.backward = o.backward, c.dtype = dtype;
          c.precision = o.precision;
          rows.push_back(time_forward(c, o));
          const ForwardRow& r = rows.back();
          char line[200];
          std::snprintf(line, sizeof line,
                        "  %-4s (%s) N=%-5d d=%-3d %-6s threads=%d  attn %9.2f ms %7.1f GFLOP/s   baseline %9.2f ms %6.1f GFLOP/s\n",
                        dtype_label(c).c_str(), r.path.c_str(), N, d, causal ? "causal" : "full", threads, r.ms, r.gflops(), r.baseline_ms,
                        r.baseline_gflops());
          log << line << std::flush;
          // bf16 rounds P (and out) to 8 bits: the two differ by ~1e-3 there.
          const bool eight_bits = dtype != DType::f32 || c.precision == Precision::bf16;
          if (r.baseline_difference > (eight_bits ? 2e-2 : 1e-4)) {
            log << "  WARNING: attn and the baseline disagree (relative difference "
                << r.baseline_difference << ")\n";
          }
        }
      }
    }
  }
  }
  return rows;
}

std::string format_forward_table(const std::vector<ForwardRow>& rows, const Peak& peak1,
                                 const Peak& peak_all) {
  std::ostringstream os;
  os << "| dtype (path) | N | d | mask | threads | attn ms | attn GFLOP/s | % of peak | baseline ms | baseline "
        "GFLOP/s | attn / baseline speed | attn extra MB | baseline extra MB |\n"
     << "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const ForwardRow& r : rows) {
    const Peak& pk = r.config.threads == 1 ? peak1 : peak_all;
    const double peak = r.path == "amx"          ? pk.amx_bf16_gflops
                        : r.path == "avx512bf16" ? pk.bf16_gflops
                                                 : pk.f32_gflops;
    // Without a baseline (--no-baseline) its cells say so instead of showing zeros.
    char base[120] = "— | — | —", base_mb[40] = "—";
    if (r.baseline_ms > 0) {
      std::snprintf(base, sizeof base, "%.2f | %.1f | %.2f×", r.baseline_ms, r.baseline_gflops(), r.baseline_ms / r.ms);
      std::snprintf(base_mb, sizeof base_mb, "%.1f", r.baseline_extra_mb);
    }
    char line[400];
    std::snprintf(line, sizeof line, "| %s (%s) | %d | %d | %s | %d | %.2f | %.1f | %.0f%% | %s | %.1f | %s |\n",
                  dtype_label(r.config).c_str(), r.path.c_str(), r.config.N, r.config.d,
                  r.config.causal ? "causal" : "none", r.config.threads, r.ms, r.gflops(),
                  peak > 0 ? 100.0 * r.gflops() / peak : 0.0, base, r.extra_mb, base_mb);
    os << line;
  }
  return os.str();
}

}  // namespace attn::bench
