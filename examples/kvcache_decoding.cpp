// Serving two sequences from one paged KV cache: each prompt is prefilled in chunks
// (one sequence at a time, through a one-row view of the block table), then both
// sequences decode together, one token per step. The last step is checked against
// the float64 reference on the keys and values the cache holds.
//
//   cmake --build build/release && ./build/release/examples/kvcache_decoding
//
// Random numbers stand in for a model's projections. Options the cache API also takes:
// RoPE on append (kv.rotary_cos/sin), bf16/f16/i8/fp8 caches, windows, ALiBi, masks.
#include <attn/kvcache.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

namespace {

constexpr int kHq = 8, kHkv = 2, kD = 64, kPage = 16, kPages = 64, kMaxBlocks = 16;

std::mt19937 rng(7);

std::vector<float> random_rows(int tokens, int heads) {
  std::normal_distribution<float> normal;
  std::vector<float> x(static_cast<size_t>(tokens) * heads * kD);
  for (float& e : x) e = normal(rng);
  return x;
}

}  // namespace

int main() {
  using attn::DType;
  using attn::TensorView;
  // The cache: 64 pages of 16 tokens; sequence b owns the pages its block-table row lists.
  std::vector<float> k_pages(static_cast<size_t>(kPages) * kPage * kHkv * kD), v_pages(k_pages.size());
  std::vector<int32_t> table(2 * kMaxBlocks);
  for (int j = 0; j < kMaxBlocks; ++j) table[j] = 2 * j, table[kMaxBlocks + j] = 2 * j + 1;  // interleaved pages
  attn::KVCache cache;
  cache.k = TensorView(k_pages.data(), DType::f32, {kPages, kPage, kHkv, kD});
  cache.v = TensorView(v_pages.data(), DType::f32, {kPages, kPage, kHkv, kD});
  attn::AttentionOptions causal;
  causal.causal = attn::Causal::BottomRight;  // each new token sees the cache and itself

  // Prefill: prompts of 100 and 37 tokens, in chunks of up to 64 (a chunk of 24 or more
  // queries runs on the tiled kernels, a shorter one on the decode kernel).
  const int prompt[2] = {100, 37};
  std::vector<int32_t> seqlens = {0, 0};
  for (int b = 0; b < 2; ++b) {
    attn::KVCache one = cache;
    one.block_table = TensorView(table.data() + b * kMaxBlocks, DType::i32, {1, kMaxBlocks});
    while (seqlens[b] < prompt[b]) {
      const int n = std::min(64, prompt[b] - seqlens[b]);
      std::vector<float> q = random_rows(n, kHq), k = random_rows(n, kHkv), v = random_rows(n, kHkv), out(q.size());
      attn::KVCacheOptions kv;
      kv.k_new = TensorView(k.data(), DType::f32, {1, n, kHkv, kD});
      kv.v_new = TensorView(v.data(), DType::f32, {1, n, kHkv, kD});
      attn::attention_with_kvcache(TensorView(q.data(), DType::f32, {1, n, kHq, kD}), one,
                                   TensorView(&seqlens[b], DType::i32, {1}),
                                   TensorView(out.data(), DType::f32, {1, n, kHq, kD}), causal, kv);
      seqlens[b] += n;  // the caller advances cache_seqlens, as with FlashAttention
    }
  }

  // Decode: both sequences at once, one new token each per step.
  cache.block_table = TensorView(table.data(), DType::i32, {2, kMaxBlocks});
  std::vector<float> q, out(2 * kHq * kD), lse(2 * kHq);
  for (int step = 0; step < 20; ++step) {
    q = random_rows(2, kHq);
    std::vector<float> k = random_rows(2, kHkv), v = random_rows(2, kHkv);
    attn::KVCacheOptions kv;
    kv.k_new = TensorView(k.data(), DType::f32, {2, 1, kHkv, kD});
    kv.v_new = TensorView(v.data(), DType::f32, {2, 1, kHkv, kD});
    attn::attention_with_kvcache(TensorView(q.data(), DType::f32, {2, 1, kHq, kD}), cache,
                                 TensorView(seqlens.data(), DType::i32, {2}),
                                 TensorView(out.data(), DType::f32, {2, 1, kHq, kD}), causal, kv,
                                 TensorView(lse.data(), DType::f32, {2, kHq, 1}));
    for (int32_t& n : seqlens) ++n;
  }

  // The last step against float64: each sequence's keys and values read back through
  // its block table, key_lengths = the tokens each sequence holds.
  const int longest = std::max(seqlens[0], seqlens[1]);
  std::vector<float> keys(2 * static_cast<size_t>(longest) * kHkv * kD, 0.0f), values(keys.size(), 0.0f);
  for (int b = 0; b < 2; ++b) {
    for (int t = 0; t < seqlens[b]; ++t) {
      const size_t from = (static_cast<size_t>(table[b * kMaxBlocks + t / kPage]) * kPage + t % kPage) * kHkv * kD;
      const size_t to = (static_cast<size_t>(b) * longest + t) * kHkv * kD;
      std::copy_n(&k_pages[from], kHkv * kD, &keys[to]);
      std::copy_n(&v_pages[from], kHkv * kD, &values[to]);
    }
  }
  attn::AttentionOptions ref_opt = causal;
  ref_opt.key_lengths = TensorView(seqlens.data(), DType::i32, {2});
  std::vector<float> ref(out.size());
  attn::attention_reference(TensorView(q.data(), DType::f32, {2, 1, kHq, kD}),
                            TensorView(keys.data(), DType::f32, {2, longest, kHkv, kD}),
                            TensorView(values.data(), DType::f32, {2, longest, kHkv, kD}),
                            TensorView(ref.data(), DType::f32, {2, 1, kHq, kD}), ref_opt);
  double worst = 0;
  for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(double(out[i]) - ref[i]));
  std::printf("2 sequences, %d and %d tokens in pages of %d: last step's largest error vs float64 %.2e, lse[0] %.4f\n",
              seqlens[0], seqlens[1], kPage, worst, lse[0]);
  return worst < 1e-4 ? 0 : 1;
}
