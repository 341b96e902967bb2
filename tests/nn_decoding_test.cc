// Incremental decoding in the nn modules on attn::attention_with_kvcache:
// MultiheadAttention::forward_cached and the Transformer decoder's forward_cached
// against their own full causal forward, for every cache storage (f32, bf16, f16, i8,
// f8e4m3;
// contiguous and paged with an odd page size); the traffic a decoding run costs
// (each step reads the cache once and packs nothing); and the errors.
#include <gtest/gtest.h>

#include <cstring>

#include "attn/error.hpp"
#include "attn/nn/multihead_attention.hpp"
#include "attn/nn/transformer.hpp"
#include "nn_test_util.hpp"
#include "traffic.hpp"

namespace attn::testing {
namespace {

struct Storage {
  nn::KVCacheConfig config;
  double tol;  // of the cached output against the f32 full forward
  std::string name() const {
    return std::string(dtype_name(config.dtype)) + (config.page_size ? " pages of " + std::to_string(config.page_size) : " contiguous");
  }
};

// f32 is exact up to summation order; bf16 rounds k and v to 8 bits of mantissa,
// i8 to 1/254 of each row's largest magnitude, f8e4m3 to 3 bits of mantissa (2⁻⁴).
std::vector<Storage> storages() {
  // Observed worst: f32 3e-7, bf16 3e-3, i8 6e-3, f16 3e-4, f8e4m3 2.5e-2; the bars leave 3× or more.
  return {{{DType::f32, 0}, 1e-5}, {{DType::f32, 3}, 1e-5}, {{DType::bf16, 16}, 1e-2}, {{DType::i8, 0}, 2e-2},
          {{DType::i8, 5}, 2e-2}, {{DType::f16, 1}, 2e-3}, {{DType::f8e4m3, 0}, 8e-2}, {{DType::f8e4m3, 7}, 8e-2}};
}

void randomize(nn::Module& m, nn::Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) init_uniform(*p, 0.5f, rng);
}

// Rows [t0, t0 + n) of x ([B, L, E] batch-first or [L, B, E]) as their own tensor.
Tensor slice_positions(const Tensor& x, bool batch_first, int64_t t0, int64_t n) {
  const auto& s = x.shape();
  const int64_t B = batch_first ? s[0] : s[1], L = batch_first ? s[1] : s[0], E = s[2];
  Tensor out(DType::f32, batch_first ? std::vector<int64_t>{B, n, E} : std::vector<int64_t>{n, B, E});
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < n; ++t) {
      const int64_t src = batch_first ? b * L + t0 + t : (t0 + t) * B + b;
      const int64_t dst = batch_first ? b * n + t : t * B + b;
      std::memcpy(out.data_as<float>() + dst * E, x.data_as<float>() + src * E, sizeof(float) * E);
    }
  return out;
}

// Decodes x (all L positions) in the chunks given, returning the outputs at the
// same positions as one tensor shaped like x.
Tensor decode_in_chunks(const Tensor& x, bool batch_first, const std::vector<int64_t>& chunks,
                        const std::function<Tensor(const Tensor&)>& step) {
  Tensor y(DType::f32, x.shape());
  const auto& s = x.shape();
  const int64_t B = batch_first ? s[0] : s[1], L = batch_first ? s[1] : s[0], E = s[2];
  int64_t t0 = 0;
  for (int64_t n : chunks) {
    Tensor part = step(slice_positions(x, batch_first, t0, n));
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < n; ++t) {
        const int64_t dst = batch_first ? b * L + t0 + t : (t0 + t) * B + b;
        const int64_t src = batch_first ? b * n + t : t * B + b;
        std::memcpy(y.data_as<float>() + dst * E, part.data_as<float>() + src * E, sizeof(float) * E);
      }
    t0 += n;
  }
  return y;
}

TEST(Decoding, MultiheadAttentionEveryStorageEqualsTheFullCausalForward) {
  nn::Rng rng = nn_rng(91);
  for (const Storage& st : storages())
    for (auto rope : {nn::RopeStyle::none, nn::RopeStyle::half})
      for (bool batch_first : {true, false}) {
        nn::MultiheadAttentionConfig cfg;
        cfg.embed_dim = 36;
        cfg.num_heads = 6;
        cfg.num_kv_heads = 3;
        cfg.batch_first = batch_first;
        cfg.rope = rope;
        cfg.window = {7, 0};
        nn::MultiheadAttention mha(cfg, rng);
        randomize(mha, rng);
        mha.eval();
        const int64_t B = 3, L = 17;
        Tensor x = random_tensor(batch_first ? std::vector<int64_t>{B, L, 36} : std::vector<int64_t>{L, B, 36}, rng);
        Tensor full = mha.forward(x, x, x, {}, false, {}, true, /*is_causal=*/true).output;
        nn::KVCache cache = mha.make_cache(B, 20, st.config);
        Tensor y = decode_in_chunks(x, batch_first, {1, 1, 5, 1, 9},
                                    [&](const Tensor& chunk) { return mha.forward_cached(chunk, cache); });
        EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), st.tol)
            << st.name() << " rope " << int(rope) << " batch_first " << batch_first << " " << seed_note();
        EXPECT_EQ(cache.length, L);
        EXPECT_EQ(cache.seqlens.data_as<int32_t>()[B - 1], L);
      }
}

TEST(Decoding, TransformerDecoderEqualsItsFullCausalForward) {
  nn::Rng rng = nn_rng(92);
  for (const Storage& st : {storages()[0], storages()[1], storages()[2], storages()[4]})
    for (bool norm_first : {false, true})
      for (bool batch_first : {true, false}) {
        nn::TransformerLayerConfig c;
        c.d_model = 16;
        c.nhead = 4;
        c.num_kv_heads = 2;
        c.rope = nn::RopeStyle::interleaved;
        c.dim_feedforward = 24;
        c.batch_first = batch_first;
        c.norm_first = norm_first;
        nn::TransformerDecoder dec(c, 2, /*final_norm=*/true, rng);
        randomize(dec, rng);
        dec.eval();
        const int64_t B = 2, T = 11, S = 13;
        auto shape = [&](int64_t n) {
          return batch_first ? std::vector<int64_t>{B, n, 16} : std::vector<int64_t>{n, B, 16};
        };
        Tensor tgt = random_tensor(shape(T), rng), memory = random_tensor(shape(S), rng);
        Tensor full = dec.forward(tgt, memory, {}, {}, {}, {}, /*tgt_is_causal=*/true);
        std::vector<nn::DecoderLayerCache> caches = dec.make_cache(memory, T, st.config);
        ASSERT_EQ(caches.size(), 2u);
        EXPECT_EQ(caches[1].cross_attn.length, S);
        Tensor y = decode_in_chunks(tgt, batch_first, {1, 3, 1, 6},
                                    [&](const Tensor& chunk) { return dec.forward_cached(chunk, caches); });
        // The decoder's LayerNorms may amplify the cache's rounding a little.
        EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), 2 * st.tol)
            << st.name() << " norm_first " << norm_first << " batch_first " << batch_first << " " << seed_note();
        EXPECT_EQ(caches[0].self_attn.length, T);
      }
}

// Decoding N positions one at a time: step t reads exactly the t + 1 cached rows of
// every sequence and kv head once, appends one, and packs nothing — O(N·L) traffic
// in all. attention() on the same cache (what forward_cached ran before) packs every
// cached row on every step; the same counter sees that, so it is live.
TEST(Decoding, EachStepReadsTheCacheOnceAndPacksNothing) {
  nn::Rng rng = nn_rng(93);
  nn::MultiheadAttentionConfig cfg;
  cfg.embed_dim = 32;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.batch_first = true;
  nn::MultiheadAttention mha(cfg, rng);
  randomize(mha, rng);
  mha.eval();
  const int64_t B = 2, N = 150, Hkv = 2, hd = 8;
  for (const Storage& st : {storages()[1], storages()[3]}) {
    nn::KVCache cache = mha.make_cache(B, N, st.config);
    const uint64_t row_bytes = 2 * hd * dtype_size(st.config.dtype) + (st.config.dtype == DType::i8 || st.config.dtype == DType::f8e4m3 ? 8 : 0);
    auto& counters = detail::traffic();
    uint64_t total_read = 0;
    for (int64_t t = 0; t < N; ++t) {
      Tensor x = random_tensor({B, 1, 32}, rng);
      counters.reset();
      mha.forward_cached(x, cache);
      const uint64_t rows = uint64_t(B) * Hkv * (t + 1);
      ASSERT_EQ(counters.cache_read_bytes.load(), rows * row_bytes) << st.name() << " step " << t;
      ASSERT_EQ(counters.cache_written_bytes.load(), uint64_t(B) * Hkv * row_bytes) << st.name() << " step " << t;
      ASSERT_EQ(counters.packed_bytes.load(), 0u) << st.name() << " step " << t;
      total_read += counters.cache_read_bytes.load();
    }
    EXPECT_EQ(total_read, uint64_t(B) * Hkv * row_bytes * N * (N + 1) / 2);
  }
  // The counter is live: attention() of 16 queries over a 150-row f32 cache packs all
  // of it (a few queries read it in place: FewQueries tests in attention_few_queries_test.cc).
  nn::KVCache cache = mha.make_cache(B, N, {});
  mha.forward_cached(random_tensor({B, N, 32}, rng), cache);
  Tensor q = random_tensor({B, 16, 4, hd}, rng), out(DType::f32, {B, 16, 4, hd});
  detail::traffic().reset();
  attention(q, cache.k, cache.v, out);
  EXPECT_GE(detail::traffic().packed_bytes.load(), uint64_t(B) * Hkv * N * 2 * hd * sizeof(float));
}

TEST(Decoding, ErrorsNameTheArgument) {
  nn::Rng rng = nn_rng(94);
  nn::MultiheadAttentionConfig cfg;
  cfg.embed_dim = 16;
  cfg.num_heads = 4;
  cfg.batch_first = true;
  nn::MultiheadAttention mha(cfg, rng);
  auto throws_with = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
      return;
    }
    ADD_FAILURE() << "no attn::Error mentioning " << part;
  };
  throws_with([&] { mha.make_cache(2, 0); }, "capacity");
  throws_with([&] { mha.make_cache(2, 8, {DType::i32, 0}); }, "dtype");
  throws_with([&] { mha.make_cache(2, 8, {DType::f32, -1}); }, "page_size");
  nn::KVCache cache = mha.make_cache(2, 4, {DType::bf16, 3});
  throws_with([&] { mha.forward_cached(random_tensor({3, 1, 16}, rng), cache); }, "sequences");
  throws_with([&] { mha.forward_cached(random_tensor({2, 1, 12}, rng), cache); }, "last dimension");
  mha.forward_cached(random_tensor({2, 3, 16}, rng), cache);
  throws_with([&] { mha.forward_cached(random_tensor({2, 2, 16}, rng), cache); }, "no room");
  nn::KVCache stranger;
  throws_with([&] { mha.forward_cached(random_tensor({2, 1, 16}, rng), stranger); }, "make_cache");
  throws_with([&] { mha.forward_memory_cached(random_tensor({2, 1, 16}, rng), cache, -1); }, "position");

  nn::TransformerLayerConfig c;
  c.d_model = 16;
  c.nhead = 4;
  c.dim_feedforward = 8;
  c.batch_first = true;
  nn::TransformerDecoder dec(c, 2, true, rng);
  Tensor memory = random_tensor({2, 5, 16}, rng);
  auto caches = dec.make_cache(memory, 4);
  throws_with([&] { dec.forward_cached(random_tensor({2, 1, 16}, rng), caches); }, "eval()");  // still training
  dec.eval();
  caches.pop_back();
  throws_with([&] { dec.forward_cached(random_tensor({2, 1, 16}, rng), caches); }, "one cache per layer");
}

}  // namespace
}  // namespace attn::testing
