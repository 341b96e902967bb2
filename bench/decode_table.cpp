// See decode_table.hpp.
#include "decode_table.hpp"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>

#include "attn/kvcache.hpp"
#include "read_sum.hpp"
#include "tensor/convert.hpp"
#include "timing.hpp"

namespace attn::bench {
namespace {

// Random values in [-1, 1) (i8: -127 .. 127, f8e4m3: -448 .. 448) from a per-index hash,
// filled in parallel.
void fill_random(void* base, int64_t n, DType dt, uint64_t salt) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    uint64_t x = (static_cast<uint64_t>(i) + salt) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    const float u = static_cast<float>(x >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f;
    switch (dt) {
      case DType::bf16: static_cast<uint16_t*>(base)[i] = detail::f32_to_bf16(u); break;
      case DType::f16: static_cast<uint16_t*>(base)[i] = detail::f32_to_f16(u); break;
      case DType::i8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(u * 127.0f); break;
      case DType::f8e4m3: static_cast<uint8_t*>(base)[i] = detail::f32_to_f8e4m3(u * detail::kF8E4M3Max); break;
      default: static_cast<float*>(base)[i] = u; break;
    }
  }
}

void fill_random(Tensor& t, uint64_t salt) { fill_random(t.data(), t.numel(), t.dtype(), salt); }


// A row's label beside its cache dtype: nothing for the default precision.
const char* precision_note(Precision p) {
  return p == Precision::bf16 ? " (precision bf16)" : p == Precision::bf16x3 ? " (precision bf16x3)" : "";
}

// And nothing for the automatic split count.
std::string splits_note(int splits) {
  return splits <= 0 ? "" : " (" + std::to_string(splits) + (splits == 1 ? " split)" : " splits)");
}

}  // namespace

double measure_read_bandwidth(int threads, size_t bytes, bool huge_pages) {
  const int64_t n = static_cast<int64_t>(bytes / sizeof(float));
  // A Tensor this large lies on huge pages (tensor/storage.hpp); plain malloc'd memory
  // gets 4 KiB pages unless the system's THP mode is "always".
  Tensor on_huge = huge_pages ? Tensor(DType::f32, {n}) : Tensor();
  std::unique_ptr<float[]> on_small(huge_pages ? nullptr : new float[static_cast<size_t>(n)]);
  float* data = huge_pages ? on_huge.data_as<float>() : on_small.get();
  fill_random(data, n, DType::f32, 7);
  const float* x = data;
  std::vector<double> gbps;
  double sink = 0;
  for (int rep = 0; rep < 7; ++rep) {
    const double t0 = now_s();
    double total = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : total)
    for (int64_t blk = 0; blk < n; blk += 4096) total += sum_for_reading(x + blk, std::min<int64_t>(4096, n - blk));
    const double dt = now_s() - t0;
    sink += total;
    if (rep > 0) gbps.push_back(static_cast<double>(n) * sizeof(float) / dt / 1e9);  // rep 0 warms up
  }
  if (sink == 12345.678) std::printf(" ");  // keep the sums alive
  return median(gbps);
}

DecodeRow time_decode(const DecodeConfig& c, const DecodeOptions& o) {
  const bool paged = c.page > 0;
  const int page = paged ? c.page : c.L;
  const int blocks_per_seq = (c.L + page - 1) / page;
  const int64_t num_blocks = int64_t{c.B} * blocks_per_seq;
  Tensor kc(c.cache, {num_blocks, page, c.Hkv, c.d}), vc(c.cache, {num_blocks, page, c.Hkv, c.d});
  fill_random(kc, 1);
  fill_random(vc, 2);
  Tensor ks, vs;
  KVCache cache;
  cache.k = kc;
  cache.v = vc;
  const bool quantized = c.cache == DType::i8 || c.cache == DType::f8e4m3;
  if (quantized) {
    const float top = c.cache == DType::i8 ? 127.0f : detail::kF8E4M3Max;
    ks = Tensor(DType::f32, {num_blocks, page, c.Hkv});
    vs = Tensor(DType::f32, {num_blocks, page, c.Hkv});
    fill_random(ks, 3);
    fill_random(vs, 4);
    for (Tensor* t : {&ks, &vs})
      for (int64_t i = 0; i < t->numel(); ++i) t->data_as<float>()[i] = (1.5f + t->data_as<float>()[i]) / top;
    cache.k_scale = ks;
    cache.v_scale = vs;
  }
  // Pages of a sequence are scattered (as a serving engine's allocator leaves them),
  // unless c.pages_in_order.
  Tensor table(DType::i32, {c.B, blocks_per_seq});
  std::vector<int32_t> perm(static_cast<size_t>(num_blocks));
  for (int64_t i = 0; i < num_blocks; ++i) perm[i] = static_cast<int32_t>(i);
  uint64_t r = 88172645463325252ull;
  for (int64_t i = num_blocks - 1; i > 0; --i) {
    r ^= r << 13, r ^= r >> 7, r ^= r << 17;
    std::swap(perm[i], perm[r % static_cast<uint64_t>(i + 1)]);
  }
  if (c.pages_in_order) std::sort(perm.begin(), perm.end());
  std::copy(perm.begin(), perm.end(), table.data_as<int32_t>());
  if (paged) cache.block_table = table;

  // One decoding step: the token at position L − 1 is appended, then attended with
  // the L − 1 before it. Each repetition rewrites the same slot, so every call is alike.
  Tensor seqlens(DType::i32, {c.B});
  for (int b = 0; b < c.B; ++b) seqlens.data_as<int32_t>()[b] = c.L - 1;
  const DType qt = c.cache == DType::f32 ? DType::f32 : DType::bf16;
  Tensor q(qt, {c.B, 1, c.Hq, c.d}), kn(qt, {c.B, 1, c.Hkv, c.d}), vn(qt, {c.B, 1, c.Hkv, c.d}),
      out(qt, {c.B, 1, c.Hq, c.d});
  fill_random(q, 5);
  fill_random(kn, 6);
  fill_random(vn, 7);
  KVCacheOptions kv;
  kv.k_new = kn;
  kv.v_new = vn;
  kv.num_splits = c.splits;
  AttentionOptions opt;
  opt.causal = Causal::BottomRight;
  opt.precision = c.precision;

  const int before = num_threads();
  set_num_threads(c.threads);
  std::vector<double> ms;
  const double start = now_s();
  attention_with_kvcache(q, cache, seqlens, out, opt, kv);  // warm-up
  while (static_cast<int>(ms.size()) < o.min_reps || now_s() - start < o.min_seconds) {
    const double t0 = now_s();
    attention_with_kvcache(q, cache, seqlens, out, opt, kv);
    ms.push_back((now_s() - t0) * 1e3);
    if (ms.size() >= 10000) break;
  }
  set_num_threads(before);
  DecodeRow row;
  row.config = c;
  const double per_token = static_cast<double>(c.Hkv) * 2 * c.d * dtype_size(c.cache) +
                           (quantized ? 2.0 * c.Hkv * sizeof(float) : 0.0);
  row.bytes = per_token * c.L * c.B;
  row.ms = median(ms);
  return row;
}

std::vector<DecodeRow> run_decode_table(const DecodeOptions& o, std::ostream& log) {
  std::vector<DecodeRow> rows;
  for (DType dt : o.dtypes)
    for (int B : o.batches)
      for (int L : o.lengths)
        for (int page : o.pages) {
          DecodeConfig c;
          c.B = B, c.L = L, c.page = page, c.cache = dt, c.pages_in_order = o.pages_in_order;
          c.precision = o.precision;
          c.splits = o.splits;
          const double gb = 2.0 * B * L * c.Hkv * c.d * dtype_size(dt) / 1e9;
          if (gb > o.max_cache_gb) {
            log << "  skip B=" << B << " L=" << L << " " << dtype_name(dt) << ": cache " << gb << " GB > "
                << o.max_cache_gb << " GB (--max-cache-gb)\n";
            continue;
          }
          for (int t : o.threads) {
            c.threads = t;
            rows.push_back(time_decode(c, o));
            const DecodeRow& r = rows.back();
            char line[200];
            std::snprintf(line, sizeof line, "  %-4s%s%s B=%d L=%-6d page=%-3d threads=%d: %8.3f ms  %6.1f GB/s\n",
                          dtype_name(dt), precision_note(c.precision), splits_note(c.splits).c_str(), B, L, page, t,
                          r.ms, r.gbps());
            log << line << std::flush;
          }
        }
  return rows;
}

std::string format_decode_table(const std::vector<DecodeRow>& rows, const std::vector<double>& bandwidth) {
  std::ostringstream s;
  s << "| cache | B | L | page | threads | ms/token | GB/s read | of read bandwidth |\n"
       "|---|---|---|---|---|---|---|---|\n";
  for (const DecodeRow& r : rows) {
    const DecodeConfig& c = r.config;
    const double bw = c.threads < static_cast<int>(bandwidth.size()) ? bandwidth[c.threads] : 0.0;
    const std::string page =
        c.page == 0 ? "contiguous" : std::to_string(c.page) + (c.pages_in_order ? " in order" : "");
    char line[200];
    std::snprintf(line, sizeof line, "| %s%s%s | %d | %d | %s | %d | %.3f | %.1f | %s |\n", dtype_name(c.cache),
                  precision_note(c.precision), splits_note(c.splits).c_str(), c.B, c.L,
                  page.c_str(), c.threads, r.ms, r.gbps(),
                  bw > 0 ? (std::to_string(static_cast<int>(100 * r.gbps() / bw + 0.5)) + "%").c_str() : "-");
    s << line;
  }
  return s.str();
}

}  // namespace attn::bench
