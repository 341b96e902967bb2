// `attn bench`: the forward table of docs/PERFORMANCE.md, measured here.
#include <omp.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "baseline.hpp"
#include "decode_table.hpp"
#include "commands.hpp"
#include "forward_table.hpp"
#include "peak.hpp"

namespace attn::cli {

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  }
  return "unknown CPU";
}

namespace {
struct BenchArgs {
  bool quick = false;
  bool no_baseline = false;
  bool backward = false;
  bool decode = false;
  bool pages_in_order = false;
  double max_cache_gb = 6.0;
  int splits = 0;
  std::vector<int> sizes, dims, threads, batches, pages;
  std::vector<std::string> dtypes;
  std::string precision = "f32";
  std::string markdown, json;
};

// `attn bench --decode`: the decode table of issue 12.
template <class Write>
int run_decode(const BenchArgs& a, int all, const Write& write) {
  bench::DecodeOptions o;
  o.threads = {1};
  if (all > 1) o.threads.push_back(all);
  if (!a.sizes.empty()) o.lengths = a.sizes;
  if (!a.threads.empty()) o.threads = a.threads;
  if (!a.batches.empty()) o.batches = a.batches;
  if (!a.pages.empty()) o.pages = a.pages;
  o.max_cache_gb = a.max_cache_gb;
  o.pages_in_order = a.pages_in_order;
  o.splits = a.splits;
  o.precision = a.precision == "bf16" ? Precision::bf16 : a.precision == "bf16x3" ? Precision::bf16x3 : Precision::f32;
  if (a.quick) o.lengths = {1024, 8192}, o.batches = {1}, o.min_reps = 3, o.min_seconds = 0.2;
  if (!a.dtypes.empty()) {
    o.dtypes.clear();
    for (const std::string& t : a.dtypes) {
      o.dtypes.push_back(t == "bf16"     ? DType::bf16
                         : t == "f16"    ? DType::f16
                         : t == "i8"     ? DType::i8
                         : t == "f8e4m3" ? DType::f8e4m3
                                         : DType::f32);
    }
  }
  std::printf("attn bench --decode on %s (%d cores)\n", cpu_model().c_str(), all);
  int most = 1;
  for (int t : o.threads) most = std::max(most, t);
  std::vector<double> bw(static_cast<size_t>(most) + 1, 0.0);
  // The table's reference is the huge-page figure (what the machine can read); the
  // 4 KiB-page one is printed beside it, as earlier tables used it.
  for (int t : o.threads) {
    bw[t] = bench::measure_read_bandwidth(t);
    const double small = bench::measure_read_bandwidth(t, size_t{1} << 30, false);
    std::printf("  read bandwidth (1 GiB sum), %d thread(s): %.1f GB/s on huge pages, %.1f on 4 KiB pages\n", t,
                bw[t], small);
  }
  const auto rows = bench::run_decode_table(o, std::cout);
  const std::string table = bench::format_decode_table(rows, bw);
  std::printf("\n%s", table.c_str());
  if (!a.markdown.empty()) write(a.markdown, table);
  if (!a.json.empty()) {
    nlohmann::json j;
    j["cpu"] = cpu_model();
    j["pass"] = "decode";
    for (int t : o.threads) j["read_bandwidth_gbps"][std::to_string(t)] = bw[t];
    for (const auto& r : rows) {
      j["rows"].push_back({{"cache", dtype_name(r.config.cache)}, {"B", r.config.B}, {"L", r.config.L},
                           {"page", r.config.page}, {"pages_in_order", r.config.pages_in_order},
                           {"precision", a.precision}, {"splits", r.config.splits},
                           {"Hq", r.config.Hq}, {"Hkv", r.config.Hkv}, {"d", r.config.d},
                           {"threads", r.config.threads}, {"ms", r.ms}, {"bytes", r.bytes}, {"gbps", r.gbps()}});
    }
    write(a.json, j.dump(2) + "\n");
  }
  return 0;
}
}  // namespace

Command add_bench_command(CLI::App& app) {
  auto args = std::make_shared<BenchArgs>();
  CLI::App* sub = app.add_subcommand(
      "bench", "Time the fused forward (B=1, H=8) against this machine's FMA peak and the cblas "
               "baseline; medians of repeated runs");
  sub->add_flag("--quick", args->quick, "N in {512, 2048} only, fewer repetitions (~30 s)");
  sub->add_option("--sizes", args->sizes, "sequence lengths N (default 512 2048 8192)")
      ->check(CLI::Range(1, 1 << 20));
  sub->add_option("--dims", args->dims, "head dims d (default 64 128)")->check(CLI::PositiveNumber);
  sub->add_option("--threads", args->threads, "thread counts (default: 1 and all cores)")
      ->check(CLI::Range(1, attn::kMaxThreads));
  sub->add_option("--dtype", args->dtypes,
                  "dtypes of q, k, v, out: f32, bf16, f16 (default f32); bf16 runs on AMX tiles where "
                  "the CPU has them (ATTN_ISA forces a path)")
      ->check(CLI::IsMember({"f32", "bf16", "f16", "i8", "f8e4m3"}));
  sub->add_option("--precision", args->precision,
                  "arithmetic for the f32 rows (AttentionOptions::precision): f32 (default), bf16 (inputs "
                  "rounded to bf16, the bf16 kernels), bf16x3 (each input as two bf16 pieces, three tile "
                  "products per product; AMX only, else the f32 kernel); with --decode, of every call "
                  "(bf16: i8 caches on 16-bit integer products)")
      ->check(CLI::IsMember({"f32", "bf16", "bf16x3"}));
  sub->add_flag("--no-baseline", args->no_baseline, "skip the cblas baseline");
  sub->add_flag("--backward", args->backward,
                "time attention_backward (GFLOP/s count 2.5× the forward's flops); the baseline "
                "is the explicit N×N backward with cblas, given the forward's P");
  sub->add_flag("--decode", args->decode,
                "the decode table instead: attention_with_kvcache, Lq=1, Hq=32, Hkv=8, d=128, one token "
                "appended per call; GB/s of cache read beside the measured read bandwidth. --sizes are "
                "cache lengths (default 1024 8192 32768 131072), --dtype f32/bf16/f16/i8/f8e4m3 the cache's");
  sub->add_option("--batches", args->batches, "decode: batch sizes (default 1 8)")->check(CLI::Range(1, 4096));
  sub->add_option("--pages", args->pages, "decode: page sizes, 0 = contiguous (default 16 256)")
      ->check(CLI::Range(0, 1 << 20));
  sub->add_flag("--pages-in-order", args->pages_in_order,
                "decode: each sequence's pages in order rather than scattered at random (the layout of a "
                "contiguous cache, to tell the memory system's cost of scattered pages from the kernel's)");
  sub->add_option("--max-cache-gb", args->max_cache_gb, "decode: skip rows whose cache is larger (default 6)");
  sub->add_option("--splits", args->splits,
                  "decode: splits per sequence (KVCacheOptions::num_splits; default 0 = automatic, one per "
                  "256 keys up to 64)")
      ->check(CLI::Range(0, attn::kMaxKVSplits));
  sub->add_option("--markdown", args->markdown, "also write the table to this file");
  sub->add_option("--json", args->json, "also write all figures to this JSON file");

  auto run = [args]() -> int {
    // Fail before minutes of timing, not after, when an output cannot be written.
    for (const std::string* path : {&args->markdown, &args->json}) {
      if (!path->empty() && !std::ofstream(*path, std::ios::app)) {
        throw attn::Error("bench: cannot write " + *path);
      }
    }
    auto write = [](const std::string& path, const std::string& text) {
      std::ofstream f(path);
      f << text;
      f.flush();
      if (!f) throw attn::Error("bench: writing " + path + " failed");
      std::printf("wrote %s\n", path.c_str());
    };
    const int all = omp_get_num_procs();
    if (args->decode) return run_decode(*args, all, write);
    for (const std::string& t : args->dtypes) {
      if (t == "i8" || t == "f8e4m3")
        throw attn::Error("bench: --dtype " + t + " is a KV cache dtype; use it with --decode");
    }
    bench::TableOptions o;
    o.threads = {1};
    if (all > 1) o.threads.push_back(all);
    if (args->quick) o.sizes = {512, 2048}, o.min_reps = 3, o.min_seconds = 0.3;
    if (!args->sizes.empty()) o.sizes = args->sizes;
    if (!args->dims.empty()) o.head_dims = args->dims;
    if (!args->threads.empty()) o.threads = args->threads;
    o.baseline = !args->no_baseline;
    o.backward = args->backward;
    o.precision = args->precision == "bf16"     ? Precision::bf16
                  : args->precision == "bf16x3" ? Precision::bf16x3
                                                : Precision::f32;
    if (!args->dtypes.empty()) {
      o.dtypes.clear();
      for (const std::string& t : args->dtypes) {
        o.dtypes.push_back(t == "bf16" ? DType::bf16 : t == "f16" ? DType::f16 : DType::f32);
      }
    }
    const CpuInfo cpu = cpu_info();  // also checks ATTN_ISA before any timing

    std::printf("attn bench on %s (%d cores)\n", cpu_model().c_str(), all);
    std::printf("measuring the FMA peak (bench/peak) ...\n");
    const bench::Peak p1 = bench::measure_peak(1);
    const bench::Peak pall = all > 1 ? bench::measure_peak(all) : p1;
    std::printf("  f32 FMA peak: %.1f GFLOP/s on 1 thread, %.1f on %d (%s); bf16 dot: %.1f, %.1f; "
                "AMX bf16: %.1f, %.1f\n",
                p1.f32_gflops, pall.f32_gflops, all, p1.isa, p1.bf16_gflops, pall.bf16_gflops,
                p1.amx_bf16_gflops, pall.amx_bf16_gflops);
    std::printf("  kernels: f32 on %s; bf16 on %s\n", cpu.simd_target.c_str(), cpu.bf16_path.c_str());
    std::printf("  baseline BLAS: OpenBLAS, core %s\n", bench::baseline_configure(1));
    std::printf("timing %s (flops = 4·N²·d·H, halved for causal%s) ...\n",
                o.backward ? "the backward" : "the forward", o.backward ? ", times 2.5" : "");
    const auto rows = bench::run_forward_table(o, std::cout);
    const std::string table = bench::format_forward_table(rows, p1, pall);
    std::printf("\n%s", table.c_str());
    if (!args->markdown.empty()) {
      write(args->markdown, table);
    }
    if (!args->json.empty()) {
      nlohmann::json j;
      j["cpu"] = cpu_model();
      j["pass"] = o.backward ? "backward" : "forward";
      j["peak"] = {{"f32_gflops_1thread", p1.f32_gflops}, {"f32_gflops_all", pall.f32_gflops},
                   {"bf16_gflops_1thread", p1.bf16_gflops}, {"bf16_gflops_all", pall.bf16_gflops},
                   {"amx_bf16_gflops_1thread", p1.amx_bf16_gflops}, {"amx_bf16_gflops_all", pall.amx_bf16_gflops},
                   {"threads_all", all}};
      for (const auto& r : rows) {
        j["rows"].push_back({{"dtype", dtype_name(r.config.dtype)}, {"precision", dtype_label(r.config)}, {"path", r.path}, {"N", r.config.N}, {"d", r.config.d}, {"H", r.config.H},
                                {"causal", r.config.causal}, {"threads", r.config.threads},
                                {"ms", r.ms}, {"gflops", r.gflops()},
                                {"baseline_ms", r.baseline_ms},
                                {"baseline_gflops", r.baseline_gflops()},
                                {"extra_mb", r.extra_mb}, {"baseline_extra_mb", r.baseline_extra_mb},
                                {"baseline_relative_difference", r.baseline_difference}});
      }
      write(args->json, j.dump(2) + "\n");
    }
    return 0;
  };
  return {sub, run};
}

}  // namespace attn::cli
