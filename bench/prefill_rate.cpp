// prefill_rate: chunked prefill through attention_with_kvcache — a chunk of Lq new
// tokens appended to a cache of C tokens and attending to all C + Lq keys, causal
// (bottom-right) — on the kernel the call picks (the tiled kernels from
// kvcache_tiles_from() queries on) and, in the same run, on the decode kernel
// (ATTN_KVCACHE_TILES_FROM=0), the two alternating round by round.
//
// Shapes: B = 1, Hq = 32, Hkv = 8 (or --hkv), d = dv = 128; contiguous cache, or pages
// of --page tokens in shuffled order (read in place by the decode kernel, gathered
// per sequence by the tiled route). Flops: 4·Hq·d·(Lq·C + Lq·(Lq + 1)/2) per call
// (causal: each query sees the cache and the chunk up to itself). Fresh random keys,
// values and queries (never constants); the append rewrites the same C .. C + Lq − 1
// rows in every call. An i8 cache (scales ~1/127 per token and head) is read by f32
// queries; under --precision bf16 it stays on the decode kernel.
//
// usage: prefill_rate [f32|bf16|f16|i8 ...] [--cached C ...] [--chunks Lq ...] [--hkv H] [--page P]
//                     [--threads T] [--rounds R] [--rope] [--precision f32|bf16] [--f32-queries]
//        --rope: RoPE (halves, Llama's pairing) on the appended keys and the queries
//        --precision: options.precision (default f32)
//        --f32-queries: f32 queries (and new keys and values) on every cache dtype, as
//                       attn's modules compute (default: the cache's dtype; f32 for i8)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "attn/attn.hpp"
#include "attn/kvcache.hpp"
#include "tensor/convert.hpp"
#include "timing.hpp"

namespace {

using attn::DType;

struct Shape {
  int cached, chunk, hkv, page;
  bool rope;  // RoPE (halves) on the appended keys and the queries
  attn::Precision precision;
  bool f32_queries;
};

/// Random values of dtype dt, n of them, as raw bytes.
std::vector<uint8_t> random_values(DType dt, size_t n, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  const size_t es = attn::dtype_size(dt);
  std::vector<uint8_t> bytes(n * es);
  for (size_t i = 0; i < n; ++i) {
    const float x = uniform(rng);
    if (dt == DType::f32) {
      std::memcpy(&bytes[4 * i], &x, 4);
    } else if (dt == DType::i8) {
      bytes[i] = static_cast<uint8_t>(static_cast<int8_t>(x * 127.0f));
    } else {
      const uint16_t h = dt == DType::bf16 ? attn::detail::f32_to_bf16(x) : attn::detail::f32_to_f16(x);
      std::memcpy(&bytes[2 * i], &h, 2);
    }
  }
  return bytes;
}

/// Median seconds per call of each route, rounds alternating between them.
void time_prefill(DType dt, const Shape& s, int rounds, std::mt19937& rng, double* tiles_s, double* decode_s) {
  constexpr int Hq = 32, d = 128;
  const int capacity = s.cached + s.chunk;
  const int page = s.page > 0 ? s.page : capacity;
  const int pages = (capacity + page - 1) / page;
  const size_t rows = static_cast<size_t>(pages) * page * s.hkv * d;
  // An i8 cache (one scale per token and head) is read by f32 queries.
  const DType qdt = dt == DType::i8 || s.f32_queries ? DType::f32 : dt;
  std::vector<uint8_t> k = random_values(dt, rows, rng), v = random_values(dt, rows, rng);
  std::vector<uint8_t> q = random_values(qdt, static_cast<size_t>(s.chunk) * Hq * d, rng);
  std::vector<uint8_t> k_new = random_values(qdt, static_cast<size_t>(s.chunk) * s.hkv * d, rng);
  std::vector<uint8_t> v_new = random_values(qdt, k_new.size() / attn::dtype_size(qdt), rng);
  std::uniform_real_distribution<float> around(0.8f, 1.2f);
  std::vector<float> k_scale(rows / d), v_scale(rows / d);
  for (float& x : k_scale) x = around(rng) / 127.0f;
  for (float& x : v_scale) x = around(rng) / 127.0f;
  std::vector<uint8_t> out(q.size());
  std::vector<int32_t> table(static_cast<size_t>(pages)), seqlens{s.cached};
  std::iota(table.begin(), table.end(), 0);
  std::shuffle(table.begin(), table.end(), rng);

  attn::KVCache cache;
  cache.k = attn::TensorView(k.data(), dt, {pages, page, s.hkv, d});
  cache.v = attn::TensorView(v.data(), dt, {pages, page, s.hkv, d});
  if (s.page > 0) cache.block_table = attn::TensorView(table.data(), DType::i32, {1, pages});
  if (dt == DType::i8) {
    cache.k_scale = attn::TensorView(k_scale.data(), DType::f32, {pages, page, s.hkv});
    cache.v_scale = attn::TensorView(v_scale.data(), DType::f32, {pages, page, s.hkv});
  }
  const attn::TensorView qv(q.data(), qdt, {1, s.chunk, Hq, d}), ov(out.data(), qdt, {1, s.chunk, Hq, d});
  const attn::TensorView lens(seqlens.data(), DType::i32, {1});
  attn::KVCacheOptions kv;
  kv.k_new = attn::TensorView(k_new.data(), qdt, {1, s.chunk, s.hkv, d});
  kv.v_new = attn::TensorView(v_new.data(), qdt, {1, s.chunk, s.hkv, d});
  std::vector<float> cos_t, sin_t;
  if (s.rope) {
    for (int pos = 0; pos < capacity; ++pos) {
      for (int j = 0; j < d / 2; ++j) {
        const double angle = pos * std::pow(10000.0, -2.0 * j / d);
        cos_t.push_back(static_cast<float>(std::cos(angle)));
        sin_t.push_back(static_cast<float>(std::sin(angle)));
      }
    }
    kv.rotary_cos = attn::TensorView(cos_t.data(), DType::f32, {capacity, d / 2});
    kv.rotary_sin = attn::TensorView(sin_t.data(), DType::f32, {capacity, d / 2});
    kv.rotary_interleaved = false;
  }
  attn::AttentionOptions opt;
  opt.causal = attn::Causal::BottomRight;
  opt.precision = s.precision;
  auto call = [&] { attn::attention_with_kvcache(qv, cache, lens, ov, opt, kv); };
  auto timed = [&](bool decode) {
    if (decode) {
      setenv("ATTN_KVCACHE_TILES_FROM", "0", 1);
    } else {
      unsetenv("ATTN_KVCACHE_TILES_FROM");
    }
    call();  // warm-up: the pages and the workspace
    const double t0 = attn::bench::now_s();
    call();
    return attn::bench::now_s() - t0;
  };
  std::vector<double> tiles, decode;
  for (int r = 0; r < rounds; ++r) {
    tiles.push_back(timed(false));
    decode.push_back(timed(true));
  }
  unsetenv("ATTN_KVCACHE_TILES_FROM");
  *tiles_s = attn::bench::median(tiles);
  *decode_s = attn::bench::median(decode);
}

std::vector<int> numbers_after(int& i, int argc, char** argv) {
  std::vector<int> v;
  while (i + 1 < argc && std::atoi(argv[i + 1]) > 0) v.push_back(std::atoi(argv[++i]));
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<DType> dtypes;
  std::vector<int> cached, chunks;
  int hkv = 8, page = 0, threads = 1, rounds = 5;
  bool rope = false, f32_queries = false;
  attn::Precision precision = attn::Precision::f32;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cached") {
      cached = numbers_after(i, argc, argv);
    } else if (a == "--chunks") {
      chunks = numbers_after(i, argc, argv);
    } else if (a == "--hkv" && i + 1 < argc) {
      hkv = std::atoi(argv[++i]);
    } else if (a == "--page" && i + 1 < argc) {
      page = std::atoi(argv[++i]);
    } else if (a == "--threads" && i + 1 < argc) {
      threads = std::atoi(argv[++i]);
    } else if (a == "--rope") {
      rope = true;
    } else if (a == "--f32-queries") {
      f32_queries = true;
    } else if (a == "--precision" && i + 1 < argc && (std::strcmp(argv[i + 1], "f32") == 0 ||
                                                      std::strcmp(argv[i + 1], "bf16") == 0)) {
      precision = std::strcmp(argv[++i], "bf16") == 0 ? attn::Precision::bf16 : attn::Precision::f32;
    } else if (a == "--rounds" && i + 1 < argc) {
      rounds = std::atoi(argv[++i]);
    } else if (a == "f32" || a == "bf16" || a == "f16" || a == "i8") {
      dtypes.push_back(a == "f32" ? DType::f32 : a == "bf16" ? DType::bf16 : a == "f16" ? DType::f16 : DType::i8);
    } else {
      std::fprintf(stderr,
                   "usage: prefill_rate [f32|bf16|f16|i8 ...] [--cached C ...] [--chunks Lq ...] [--hkv H] [--page P] "
                   "[--threads T] [--rounds R] [--rope] [--precision f32|bf16] [--f32-queries]\n");
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }
  if (hkv < 1 || 32 % hkv != 0 || page < 0 || threads < 1 || rounds < 1) {
    std::fprintf(stderr, "prefill_rate: --hkv must divide 32, --page be >= 0, --threads and --rounds >= 1\n");
    return 2;
  }
  if (dtypes.empty()) dtypes = {DType::f32, DType::bf16};
  if (cached.empty()) cached = {1024, 4096};
  if (chunks.empty()) chunks = {32, 64, 256, 512};
  attn::set_num_threads(threads);
  std::printf("prefill_rate: B=1 Hq=32 Hkv=%d d=128, causal, %s, %d thread(s), median of %d rounds%s%s%s\n", hkv,
              page > 0 ? ("shuffled pages of " + std::to_string(page)).c_str() : "contiguous cache", threads, rounds,
              rope ? ", RoPE" : "", precision == attn::Precision::bf16 ? ", Precision::bf16" : "",
              f32_queries ? ", f32 queries" : "");
  std::printf("| dtype | cached | chunk | picked: ms | GFLOP/s | decode kernel: ms | GFLOP/s | picked / decode |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---:|\n");
  std::mt19937 rng(2026);
  for (DType dt : dtypes) {
    for (int c : cached) {
      for (int lq : chunks) {
        double tiles = 0, decode = 0;
        time_prefill(dt, {c, lq, hkv, page, rope, precision, f32_queries}, rounds, rng, &tiles, &decode);
        const double flops = 4.0 * 32 * 128 * (double(lq) * c + double(lq) * (lq + 1) / 2);
        std::printf("| %s | %d | %d | %.2f | %.1f | %.2f | %.1f | %.2f |\n", attn::dtype_name(dt), c, lq, tiles * 1e3,
                    flops / tiles * 1e-9, decode * 1e3, flops / decode * 1e-9, tiles / decode);
        std::fflush(stdout);
      }
    }
  }
}
