// attn against llama.cpp's CPU flash attention (ggml_flash_attn_ext), in one process,
// on the same numbers, the same layout and the same threads (issues 11 and 12's peer).
//
//   decode:  q [B, 1, Hq, d] against a full cache of L tokens, Hq = 32, Hkv = 8, d = 128,
//            no append on either side. attn: attention_with_kvcache on a contiguous cache
//            (or paged with --page); ggml: the flash-attention node llama.cpp builds,
//            K and V as llama.cpp's cache holds them (token-major rows of Hkv·d, viewed
//            as [d, L, Hkv]). Caches: f32↔f32, f16↔f16 (llama.cpp's default), bf16↔bf16,
//            i8 (one f32 scale per token and head)↔q8_0 (one f16 scale per 32 values).
//            Reports ms per step and GB/s of cache read (each library's own bytes).
//   forward: B = 1, H = 8, N×N self-attention (prefill), causal or not; q, k, v f32
//            (ggml: f32 q, f32 or f16 k/v; attn: the same dtype for q, k, v).
//            Reports GFLOP/s on 4·N²·d·H flops (half for causal).
//
// Each configuration times the two libraries alternately, call by call, so both see
// the same machine state; medians. Every row also gives each library's error against a
// float64 reference on the values that library stores (its own rounding or quantization
// of the same random inputs): max |out − ref| / max |ref| over sequence 0 (decode) or
// the first and last 16 queries of head 0 (forward). ggml's f16 path rounds q to f16
// and accumulates P·V in f16, which shows there.
//
//   bash bench/peers/ggml_setup.sh   # builds ggml from the llama-cpp-python sdist and this
//   build/release/bench/ggml_peer decode --sizes 8192,32768 --batches 1,8 --threads 1,2
//   build/release/bench/ggml_peer forward --sizes 2048 --dims 64,128 --threads 1
#include <ggml-cpu.h>
#include <ggml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "attn/tensor.hpp"
#include "tensor/convert.hpp"
#include "../timing.hpp"

namespace {

using attn::bench::median;
using attn::bench::now_s;

std::vector<float> random_floats(size_t n, uint32_t seed) {
  std::vector<float> x(n);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& v : x) v = u(gen);
  return x;
}

// A ggml context that owns its tensors' memory, the graph of one node and its plan.
struct GgmlGraph {
  ggml_context* ctx = nullptr;
  ggml_cgraph* graph = nullptr;
  ggml_cplan plan{};
  std::vector<uint8_t> work;
  explicit GgmlGraph(size_t bytes) {
    ggml_init_params p{bytes + (size_t{64} << 20), nullptr, false};
    ctx = ggml_init(p);
    if (!ctx) throw std::runtime_error("ggml_init failed: out of memory?");
  }
  ~GgmlGraph() { ggml_free(ctx); }
  void build(ggml_tensor* out, int threads) {
    graph = ggml_new_graph(ctx);
    ggml_build_forward_expand(graph, out);
    plan = ggml_graph_plan(graph, threads, nullptr);
    work.resize(plan.work_size);
    plan.work_data = work.data();
  }
  void compute() {
    if (ggml_graph_compute(graph, &plan) != GGML_STATUS_SUCCESS) throw std::runtime_error("ggml_graph_compute failed");
  }
};

// Writes rows of n floats into a ggml tensor of any type (quantized types row by row).
void ggml_fill(ggml_tensor* t, const std::vector<float>& x, int64_t n_per_row) {
  const int64_t rows = static_cast<int64_t>(x.size()) / n_per_row;
  switch (t->type) {
    case GGML_TYPE_F32: std::copy(x.begin(), x.end(), static_cast<float*>(t->data)); break;
    case GGML_TYPE_F16: ggml_fp32_to_fp16_row(x.data(), static_cast<ggml_fp16_t*>(t->data), x.size()); break;
    case GGML_TYPE_BF16: ggml_fp32_to_bf16_row(x.data(), static_cast<ggml_bf16_t*>(t->data), x.size()); break;
    default: ggml_quantize_chunk(t->type, x.data(), t->data, 0, rows, n_per_row, nullptr); break;
  }
}

// The values rounded once to t's dtype (f32, bf16, f16: nearest even), as attn's callers store them.
void to_dtype(const std::vector<float>& x, attn::Tensor& t) {
  for (size_t i = 0; i < x.size(); ++i) {
    switch (t.dtype()) {
      case attn::DType::bf16: t.data_as<uint16_t>()[i] = attn::detail::f32_to_bf16(x[i]); break;
      case attn::DType::f16: t.data_as<uint16_t>()[i] = attn::detail::f32_to_f16(x[i]); break;
      default: t.data_as<float>()[i] = x[i]; break;
    }
  }
}

float to_f32(const attn::Tensor& t, size_t i) {
  switch (t.dtype()) {
    case attn::DType::bf16: return attn::detail::bf16_to_f32(t.data_as<uint16_t>()[i]);
    case attn::DType::f16: return attn::detail::f16_to_f32(t.data_as<uint16_t>()[i]);
    default: return t.data_as<float>()[i];
  }
}

// The first `count` values of an attn cache as f32 (i8: value · its row's scale; rows of d).
std::vector<float> attn_cache_f32(const attn::Tensor& t, const attn::Tensor& scale, size_t count, int d) {
  std::vector<float> x(count);
  for (size_t i = 0; i < count; ++i)
    x[i] = t.dtype() == attn::DType::i8 ? t.data_as<int8_t>()[i] * scale.data_as<float>()[i / d] : to_f32(t, i);
  return x;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

// Float64 attention for the query rows `rows` of one head: query i (row q + i·q_stride)
// sees keys 0 … nk − 1 (causal: 0 … i), rows K / V + j·kv_stride. Returns the largest
// |out − reference| over those rows (out row i at out + i·out_stride) relative to the
// largest |reference|. Each library is checked on its own inputs: the values it stores.
struct RefError {
  double diff = 0, scale = 1e-300;
  double value() const { return diff / scale; }
};

void check_rows(RefError& e, const std::vector<int>& rows, const float* out, size_t out_stride, const float* q,
                size_t q_stride, const float* K, const float* V, size_t kv_stride, int nk, int d, bool causal) {
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> s(static_cast<size_t>(nk)), o(static_cast<size_t>(d));
  for (int i : rows) {
    const int n = causal ? i + 1 : nk;
    double m = -INFINITY;
    for (int j = 0; j < n; ++j) {
      double dot = 0;
      for (int c = 0; c < d; ++c) dot += static_cast<double>(q[i * q_stride + c]) * K[j * kv_stride + c];
      s[j] = dot * scale;
      m = std::max(m, s[j]);
    }
    double l = 0;
    std::fill(o.begin(), o.end(), 0.0);
    for (int j = 0; j < n; ++j) {
      const double p = std::exp(s[j] - m);
      l += p;
      for (int c = 0; c < d; ++c) o[c] += p * V[j * kv_stride + c];
    }
    for (int c = 0; c < d; ++c) {
      const double ref = o[c] / l;
      e.diff = std::max(e.diff, std::fabs(out[i * out_stride + c] - ref));
      e.scale = std::max(e.scale, std::fabs(ref));
    }
  }
}

// A ggml tensor's rows of n values as f32 (its own dequantization).
std::vector<float> ggml_rows_f32(const ggml_tensor* t, int64_t rows, int64_t n) {
  std::vector<float> x(static_cast<size_t>(rows * n));
  const auto* traits = ggml_get_type_traits(t->type);
  const size_t row_bytes = ggml_row_size(t->type, n);
  if (t->type == GGML_TYPE_F32) {
    std::copy_n(static_cast<const float*>(t->data), x.size(), x.data());
    return x;
  }
  for (int64_t r = 0; r < rows; ++r)
    traits->to_float(static_cast<const char*>(t->data) + r * row_bytes, x.data() + r * n, n);
  return x;
}

// Times a() and g() alternately: at least `reps` pairs and `seconds` in all, after one
// untimed call of each (workspaces, thread pools, first touches). Medians in ms.
template <class A, class G>
std::pair<double, double> time_pair(A&& a, G&& g, int reps, double seconds) {
  a();
  g();
  std::vector<double> ta, tg;
  const double start = now_s();
  while (static_cast<int>(ta.size()) < reps || now_s() - start < seconds) {
    double t0 = now_s();
    g();
    tg.push_back((now_s() - t0) * 1e3);
    t0 = now_s();
    a();
    ta.push_back((now_s() - t0) * 1e3);
    if (ta.size() >= 2000) break;
  }
  return {median(ta), median(tg)};
}

struct CachePair {
  const char* name;  // as printed: attn's dtype / ggml's type
  attn::DType attn_dtype;
  ggml_type ggml_dtype;
};

const std::vector<CachePair> kCachePairs = {
    {"f32", attn::DType::f32, GGML_TYPE_F32},
    {"f16", attn::DType::f16, GGML_TYPE_F16},
    {"bf16", attn::DType::bf16, GGML_TYPE_BF16},
    {"i8/q8_0", attn::DType::i8, GGML_TYPE_Q8_0},
};

std::string decode_row(const CachePair& cp, int B, int L, int page, int threads, int reps, double seconds) {
  const int Hq = 32, Hkv = 8, d = 128;
  const size_t n_cache = static_cast<size_t>(B) * L * Hkv * d;
  const std::vector<float> kf = random_floats(n_cache, 1 + L), vf = random_floats(n_cache, 2 + L);
  const std::vector<float> qf = random_floats(static_cast<size_t>(B) * Hq * d, 3 + L);

  // attn: a cache of the dtype, written by its own append (i8 quantized there), then
  // attended with nothing appended.
  const int pg = page > 0 ? page : L;
  const int blocks = (L + pg - 1) / pg;
  attn::Tensor kc(cp.attn_dtype, {int64_t{B} * blocks, pg, Hkv, d}), vc(cp.attn_dtype, {int64_t{B} * blocks, pg, Hkv, d});
  attn::Tensor ks, vs, table(attn::DType::i32, {B, blocks});
  attn::KVCache cache;
  cache.k = kc;
  cache.v = vc;
  if (cp.attn_dtype == attn::DType::i8) {
    ks = attn::Tensor(attn::DType::f32, {int64_t{B} * blocks, pg, Hkv});
    vs = attn::Tensor(attn::DType::f32, {int64_t{B} * blocks, pg, Hkv});
    cache.k_scale = ks;
    cache.v_scale = vs;
  }
  for (int i = 0; i < B * blocks; ++i) table.data_as<int32_t>()[i] = i;
  if (page > 0) cache.block_table = table;
  attn::Tensor seqlens(attn::DType::i32, {B});
  std::fill_n(seqlens.data_as<int32_t>(), B, 0);
  attn::KVCacheOptions append;
  append.k_new = attn::TensorView(kf.data(), attn::DType::f32, {B, L, Hkv, d});
  append.v_new = attn::TensorView(vf.data(), attn::DType::f32, {B, L, Hkv, d});
  attn::kvcache_append(cache, seqlens, append);
  std::fill_n(seqlens.data_as<int32_t>(), B, L);
  const attn::TensorView q(qf.data(), attn::DType::f32, {B, 1, Hq, d});
  std::vector<float> out_attn(qf.size());
  const attn::TensorView out(out_attn.data(), attn::DType::f32, {B, 1, Hq, d});

  // ggml: llama.cpp's cache rows [B][L][Hkv·d], viewed as [d, L, Hkv, B].
  GgmlGraph g(2 * ggml_row_size(cp.ggml_dtype, n_cache) + qf.size() * 8);
  ggml_tensor* kg = ggml_new_tensor_4d(g.ctx, cp.ggml_dtype, d, Hkv, L, B);
  ggml_tensor* vg = ggml_new_tensor_4d(g.ctx, cp.ggml_dtype, d, Hkv, L, B);
  ggml_tensor* qg = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F32, d, Hq, 1, B);
  ggml_fill(kg, kf, d);
  ggml_fill(vg, vf, d);
  ggml_fill(qg, qf, d);
  ggml_tensor* og = ggml_flash_attn_ext(g.ctx, ggml_permute(g.ctx, qg, 0, 2, 1, 3), ggml_permute(g.ctx, kg, 0, 2, 1, 3),
                                        ggml_permute(g.ctx, vg, 0, 2, 1, 3), nullptr, 1.0f / std::sqrt(float(d)), 0.0f,
                                        0.0f);
  g.build(og, threads);

  attn::set_num_threads(threads);
  auto run_attn = [&] { attn::attention_with_kvcache(q, cache, seqlens, out); };
  auto run_ggml = [&] { g.compute(); };
  const auto [ms_attn, ms_ggml] = time_pair(run_attn, run_ggml, reps, seconds);
  // Sequence 0, every head, against float64 on each library's stored cache.
  const size_t seq0 = static_cast<size_t>(L) * Hkv * d;
  const std::vector<float> ka = attn_cache_f32(kc, ks, seq0, d), va = attn_cache_f32(vc, vs, seq0, d);
  const std::vector<float> kq = ggml_rows_f32(kg, int64_t{L} * Hkv, d), vq = ggml_rows_f32(vg, int64_t{L} * Hkv, d);
  RefError ea, eg;
  for (int h = 0; h < Hq; ++h) {
    const size_t kv_off = static_cast<size_t>(h / (Hq / Hkv)) * d;
    check_rows(ea, {0}, out_attn.data() + h * d, 0, qf.data() + h * d, 0, ka.data() + kv_off, va.data() + kv_off,
               size_t{Hkv} * d, L, d, false);
    check_rows(eg, {0}, static_cast<const float*>(og->data) + h * d, 0, qf.data() + h * d, 0, kq.data() + kv_off,
               vq.data() + kv_off, size_t{Hkv} * d, L, d, false);
  }

  const double attn_bytes = 2.0 * n_cache * attn::dtype_size(cp.attn_dtype) +
                            (cp.attn_dtype == attn::DType::i8 ? 2.0 * B * L * Hkv * sizeof(float) : 0.0);
  const double ggml_bytes = 2.0 * ggml_row_size(cp.ggml_dtype, n_cache);
  char line[320];
  std::snprintf(line, sizeof line, "| %s | %d | %d | %s | %d | %.3f | %.1f | %.3f | %.1f | %.2f× | %.1e | %.1e |", cp.name, B,
                L, page > 0 ? std::to_string(page).c_str() : "contiguous", threads, ms_ggml,
                ggml_bytes / (ms_ggml * 1e6), ms_attn, attn_bytes / (ms_attn * 1e6), ms_ggml / ms_attn, eg.value(),
                ea.value());
  return line;
}

std::string forward_row(const CachePair& cp, int N, int d, bool causal, int threads, int reps, double seconds) {
  const int H = 8;
  const size_t n = static_cast<size_t>(N) * H * d;
  const std::vector<float> qf = random_floats(n, 11 + N + d), kf = random_floats(n, 12 + N + d),
                           vf = random_floats(n, 13 + N + d);

  // attn: q, k, v [1, N, H, d] in the dtype (rounded once, outside the timing).
  attn::Tensor q(cp.attn_dtype, {1, N, H, d}), k(cp.attn_dtype, {1, N, H, d}), v(cp.attn_dtype, {1, N, H, d}),
      out(cp.attn_dtype, {1, N, H, d});
  to_dtype(qf, q);
  to_dtype(kf, k);
  to_dtype(vf, v);
  attn::AttentionOptions opt;
  opt.causal = causal ? attn::Causal::TopLeft : attn::Causal::None;

  // ggml: token-major [N][H][d] viewed as [d, N, H]; causal as llama.cpp does it, an f16
  // mask of 0 / −inf [N, N].
  GgmlGraph g(2 * ggml_row_size(cp.ggml_dtype, n) + n * 8 + size_t(N) * N * 2);
  ggml_tensor* qg = ggml_new_tensor_4d(g.ctx, GGML_TYPE_F32, d, H, N, 1);
  ggml_tensor* kg = ggml_new_tensor_4d(g.ctx, cp.ggml_dtype, d, H, N, 1);
  ggml_tensor* vg = ggml_new_tensor_4d(g.ctx, cp.ggml_dtype, d, H, N, 1);
  ggml_fill(qg, qf, d);
  ggml_fill(kg, kf, d);
  ggml_fill(vg, vf, d);
  ggml_tensor* mask = nullptr;
  if (causal) {
    mask = ggml_new_tensor_2d(g.ctx, GGML_TYPE_F16, N, N);
    auto* m = static_cast<ggml_fp16_t*>(mask->data);
    for (int i = 0; i < N; ++i)
      for (int j = 0; j < N; ++j) m[size_t(i) * N + j] = ggml_fp32_to_fp16(j <= i ? 0.0f : -INFINITY);
  }
  ggml_tensor* og = ggml_flash_attn_ext(g.ctx, ggml_permute(g.ctx, qg, 0, 2, 1, 3), ggml_permute(g.ctx, kg, 0, 2, 1, 3),
                                        ggml_permute(g.ctx, vg, 0, 2, 1, 3), mask, 1.0f / std::sqrt(float(d)), 0.0f,
                                        0.0f);
  g.build(og, threads);

  attn::set_num_threads(threads);
  auto run_attn = [&] { attn::attention(q, k, v, out, opt); };
  auto run_ggml = [&] { g.compute(); };
  const auto [ms_attn, ms_ggml] = time_pair(run_attn, run_ggml, reps, seconds);
  // Head 0, the first and last 16 queries, against float64 on each library's inputs.
  const attn::Tensor none;
  const std::vector<float> qa = attn_cache_f32(q, none, n, d), ka = attn_cache_f32(k, none, n, d),
                           va = attn_cache_f32(v, none, n, d), oa = attn_cache_f32(out, none, n, d);
  const std::vector<float> kq = ggml_rows_f32(kg, int64_t{N} * H, d), vq = ggml_rows_f32(vg, int64_t{N} * H, d);
  std::vector<int> rows;
  for (int i = 0; i < std::min(N, 16); ++i) rows.push_back(i);
  for (int i = std::max(16, N - 16); i < N; ++i) rows.push_back(i);
  const size_t stride = size_t{H} * d;
  RefError ea, eg;
  check_rows(ea, rows, oa.data(), stride, qa.data(), stride, ka.data(), va.data(), stride, N, d, causal);
  check_rows(eg, rows, static_cast<const float*>(og->data), stride, qf.data(), stride, kq.data(), vq.data(), stride, N,
             d, causal);

  const double flops = 4.0 * N * N * d * H * (causal ? 0.5 : 1.0);
  char line[320];
  std::snprintf(line, sizeof line, "| %s | %d | %d | %s | %d | %.2f | %.1f | %.2f | %.1f | %.2f× | %.1e | %.1e |", cp.name, N,
                d, causal ? "yes" : "no", threads, ms_ggml, flops / (ms_ggml * 1e6), ms_attn, flops / (ms_attn * 1e6),
                ms_ggml / ms_attn, eg.value(), ea.value());
  return line;
}

std::vector<int> parse_ints(const std::string& s) {
  std::vector<int> v;
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t comma = s.find(',', pos);
    v.push_back(std::stoi(s.substr(pos, comma - pos)));
    pos = comma == std::string::npos ? s.size() : comma + 1;
  }
  return v;
}

std::vector<CachePair> parse_dtypes(const std::string& s) {
  std::vector<CachePair> v;
  for (const CachePair& cp : kCachePairs)
    if (("," + s + ",").find("," + std::string(cp.name).substr(0, std::string(cp.name).find('/')) + ",") !=
        std::string::npos)
      v.push_back(cp);
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attn against llama.cpp's CPU flash attention (ggml_flash_attn_ext), same process, same data"};
  app.require_subcommand(1);
  std::string sizes, batches = "1,8", threads = "1,2", dims = "64,128", dtypes, markdown;
  int page = 0, reps = 5;
  double seconds = 1.0;
  CLI::App* dec = app.add_subcommand("decode", "Lq = 1 against a full KV cache (Hq 32, Hkv 8, d 128)");
  dec->add_option("--sizes", sizes, "cache lengths, comma-separated")->default_str("8192,32768");
  dec->add_option("--batches", batches, "batch sizes")->capture_default_str();
  dec->add_option("--page", page, "attn's page size (0: contiguous; ggml is always contiguous)")->capture_default_str();
  dec->add_option("--dtypes", dtypes, "caches: f32,f16,bf16,i8 (i8 runs against ggml's q8_0)")
      ->default_str("f32,f16,bf16,i8");
  CLI::App* fwd = app.add_subcommand("forward", "prefill self-attention, B 1, H 8, causal and not");
  fwd->add_option("--sizes", sizes, "sequence lengths")->default_str("2048");
  fwd->add_option("--dims", dims, "head dims")->capture_default_str();
  fwd->add_option("--dtypes", dtypes, "k/v dtypes: f32,f16")->default_str("f32,f16");
  for (CLI::App* sub : {dec, fwd}) {
    sub->add_option("--threads", threads, "thread counts")->capture_default_str();
    sub->add_option("--reps", reps, "at least this many timed calls of each")->capture_default_str();
    sub->add_option("--seconds", seconds, "and at least this long per configuration")->capture_default_str();
    sub->add_option("--markdown", markdown, "also write the table to this file");
  }
  CLI11_PARSE(app, argc, argv);
  const bool decode = dec->parsed();
  if (sizes.empty()) sizes = decode ? "8192,32768" : "2048";
  if (dtypes.empty()) dtypes = decode ? "f32,f16,bf16,i8" : "f32,f16";

  ggml_cpu_init();
  std::vector<std::string> table;
  if (decode) {
    table = {"| cache | B | L | attn page | threads | ggml ms | ggml GB/s | attn ms | attn GB/s | attn speed-up | ggml error | attn error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"};
    for (const CachePair& cp : parse_dtypes(dtypes))
      for (int B : parse_ints(batches))
        for (int L : parse_ints(sizes))
          for (int t : parse_ints(threads)) {
            table.push_back(decode_row(cp, B, L, page, t, reps, seconds));
            std::printf("%s\n", table.back().c_str());
            std::fflush(stdout);
          }
  } else {
    table = {"| k/v | N | d | causal | threads | ggml ms | ggml GFLOP/s | attn ms | attn GFLOP/s | attn speed-up | ggml error | attn error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"};
    for (const CachePair& cp : parse_dtypes(dtypes))
      for (int N : parse_ints(sizes))
        for (int d : parse_ints(dims))
          for (bool causal : {false, true})
            for (int t : parse_ints(threads)) {
              table.push_back(forward_row(cp, N, d, causal, t, reps, seconds));
              std::printf("%s\n", table.back().c_str());
              std::fflush(stdout);
            }
  }
  std::printf("\n%s (%s)\n", cpu_model().c_str(), "ggml from llama-cpp-python's sdist");
  for (const std::string& s : table) std::printf("%s\n", s.c_str());
  if (!markdown.empty()) {
    std::ofstream f(markdown);
    for (const std::string& s : table) f << s << "\n";
  }
  return 0;
}
