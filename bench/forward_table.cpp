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

namespace attn::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

template <class Fn>
double time_ms(Fn&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ForwardRow time_forward(const ForwardConfig& c, const TableOptions& o) {
  const size_t n = static_cast<size_t>(c.B) * c.N * c.H * c.d;
  std::vector<float> q(n), k(n), v(n), out(n), out_base(n);
  std::mt19937 rng(1234 + c.N + c.d);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto* t : {&q, &k, &v}) {
    for (float& x : *t) x = u(rng);
  }
  const TensorView qv(q.data(), DType::f32, {c.B, c.N, c.H, c.d}),
      kv(k.data(), DType::f32, {c.B, c.N, c.H, c.d}), vv(v.data(), DType::f32, {c.B, c.N, c.H, c.d}),
      ov(out.data(), DType::f32, {c.B, c.N, c.H, c.d});
  AttentionOptions opt;
  opt.causal = c.causal ? Causal::TopLeft : Causal::None;

  ForwardRow row;
  row.config = c;
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
    const TensorView lv(lse.data(), DType::f32, {c.B, c.H, c.N});
    attention(qv, kv, vv, ov, opt, lv);
    auto view = [&](std::vector<float>& t) { return TensorView(t.data(), DType::f32, {c.B, c.N, c.H, c.d}); };
    run_attn = [&, lv] { attention_backward(qv, kv, vv, ov, lv, view(dout), view(dq), view(dk), view(dv), opt); };
    if (o.baseline) {
      probs.resize(static_cast<size_t>(c.B) * c.H * c.N * c.N);
      attention(qv, kv, vv, ov, opt, {}, TensorView(probs.data(), DType::f32, {c.B, c.H, c.N, c.N}));
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
  for (int threads : o.threads) {
    for (int N : o.sizes) {
      for (int d : o.head_dims) {
        for (bool causal : o.causal) {
          ForwardConfig c;
          c.N = N, c.d = d, c.causal = causal, c.threads = threads, c.backward = o.backward;
          rows.push_back(time_forward(c, o));
          const ForwardRow& r = rows.back();
          char line[200];
          std::snprintf(line, sizeof line,
                        "  N=%-5d d=%-3d %-6s threads=%d  attn %9.2f ms %6.1f GFLOP/s   baseline %9.2f ms %6.1f GFLOP/s\n",
                        N, d, causal ? "causal" : "full", threads, r.ms, r.gflops(), r.baseline_ms,
                        r.baseline_gflops());
          log << line << std::flush;
          if (r.baseline_difference > 1e-4) {
            log << "  WARNING: attn and the baseline disagree (relative difference "
                << r.baseline_difference << ")\n";
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
  os << "| N | d | mask | threads | attn ms | attn GFLOP/s | % of peak | baseline ms | baseline "
        "GFLOP/s | attn / baseline speed | attn extra MB | baseline extra MB |\n"
     << "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const ForwardRow& r : rows) {
    const double peak = r.config.threads == 1 ? peak1.f32_gflops : peak_all.f32_gflops;
    char line[400];
    std::snprintf(line, sizeof line,
                  "| %d | %d | %s | %d | %.2f | %.1f | %.0f%% | %.2f | %.1f | %.2f× | %.1f | %.1f |\n",
                  r.config.N, r.config.d, r.config.causal ? "causal" : "none", r.config.threads,
                  r.ms, r.gflops(), peak > 0 ? 100.0 * r.gflops() / peak : 0.0, r.baseline_ms,
                  r.baseline_gflops(), r.baseline_ms > 0 ? r.baseline_ms / r.ms : 0.0, r.extra_mb,
                  r.baseline_extra_mb);
    os << line;
  }
  return os.str();
}

}  // namespace attn::bench
