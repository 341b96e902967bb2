// Incremental decoding in the nn modules on attn::attention_with_kvcache:
// MultiheadAttention::forward_cached and the Transformer decoder's forward_cached
// against their own full causal forward, for every cache storage (f32, bf16, f16, i8,
// f8e4m3; contiguous and paged with an odd page size), in fixed cases and in random
// ones (shapes, options, storage, chunks and masks drawn from the run's seed); the
// traffic a decoding run costs (each step reads the cache once and packs nothing);
// and the errors.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <memory>
#include <sstream>

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

// Two decoder layers (d_model 16, 4 query heads over 2 kv heads) and a final norm,
// random weights, in eval mode.
std::unique_ptr<nn::TransformerDecoder> small_decoder(nn::Rng& rng, bool batch_first, bool norm_first,
                                                      nn::RopeStyle rope) {
  nn::TransformerLayerConfig c;
  c.d_model = 16;
  c.nhead = 4;
  c.num_kv_heads = 2;
  c.rope = rope;
  c.dim_feedforward = 24;
  c.batch_first = batch_first;
  c.norm_first = norm_first;
  auto dec = std::make_unique<nn::TransformerDecoder>(c, 2, /*final_norm=*/true, rng);
  randomize(*dec, rng);
  dec->eval();
  return dec;
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
        auto dec = small_decoder(rng, batch_first, norm_first, nn::RopeStyle::interleaved);
        const int64_t B = 2, T = 11, S = 13;
        auto shape = [&](int64_t n) {
          return batch_first ? std::vector<int64_t>{B, n, 16} : std::vector<int64_t>{n, B, 16};
        };
        Tensor tgt = random_tensor(shape(T), rng), memory = random_tensor(shape(S), rng);
        Tensor full = dec->forward(tgt, memory, {}, {}, {}, {}, /*tgt_is_causal=*/true);
        std::vector<nn::DecoderLayerCache> caches = dec->make_cache(memory, T, st.config);
        ASSERT_EQ(caches.size(), 2u);
        EXPECT_EQ(caches[1].cross_attn.length, S);
        Tensor y = decode_in_chunks(tgt, batch_first, {1, 3, 1, 6},
                                    [&](const Tensor& chunk) { return dec->forward_cached(chunk, caches); });
        // The decoder's LayerNorms may amplify the cache's rounding a little.
        EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), 2 * st.tol)
            << st.name() << " norm_first " << norm_first << " batch_first " << batch_first << " " << seed_note();
        EXPECT_EQ(caches[0].self_attn.length, T);
      }
}

// A padded batch: key_padding_mask on the cached calls equals the same mask on the
// full forward, boolean (true = ignore) and f32 (−∞ or Hugging Face's −FLT_MAX on the
// pads, small values elsewhere). Sequence b has pads[b] leading pad positions; with
// causality a pad query sees only pads (boolean: none, so out_proj.bias).
TEST(Decoding, PaddingMasksEqualTheFullForwardsMasks) {
  nn::Rng rng = nn_rng(95);
  const int64_t B = 3, L = 17, pads[B] = {0, 4, 9};
  for (const Storage& st : {storages()[0], storages()[2], storages()[4]})
    for (int kind = 0; kind < 3; ++kind) {  // boolean, f32 with −∞, f32 with −FLT_MAX
      nn::MultiheadAttentionConfig cfg;
      cfg.embed_dim = 36;
      cfg.num_heads = 6;
      cfg.num_kv_heads = 2;
      cfg.batch_first = kind != 1;
      cfg.rope = nn::RopeStyle::half;
      nn::MultiheadAttention mha(cfg, rng);
      randomize(mha, rng);
      mha.eval();
      Tensor kpm(kind == 0 ? DType::boolean : DType::f32, {B, L});
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < L; ++t) {
          const bool pad = t < pads[b];
          if (kind == 0) kpm.data_as<uint8_t>()[b * L + t] = pad;
          else kpm.data_as<float>()[b * L + t] = pad ? (kind == 1 ? -INFINITY : -FLT_MAX) : rng.uniform(-0.5f, 0.5f);
        }
      Tensor x = random_tensor(cfg.batch_first ? std::vector<int64_t>{B, L, 36} : std::vector<int64_t>{L, B, 36}, rng);
      Tensor full = mha.forward(x, x, x, kpm, false, {}, true, /*is_causal=*/true).output;
      nn::KVCache cache = mha.make_cache(B, 20, st.config);
      Tensor y = decode_in_chunks(x, cfg.batch_first, {5, 1, 1, 3, 7},
                                  [&](const Tensor& chunk) { return mha.forward_cached(chunk, cache, kpm); });
      EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), st.tol)
          << st.name() << " kind " << kind << " " << seed_note();
      // Without the mask the pads would be seen: the comparison can fail.
      nn::KVCache bare = mha.make_cache(B, 20, st.config);
      Tensor unmasked = decode_in_chunks(x, cfg.batch_first, {L}, [&](const Tensor& chunk) { return mha.forward_cached(chunk, bare); });
      EXPECT_GT(max_rel_diff(unmasked.data_as<float>(), full.data_as<float>(), y.numel()), 10 * st.tol);
    }
}

// Rows [t0, t0 + n) of a mask [L, K] or [BH, L, K], as their own contiguous tensor.
Tensor mask_rows(const Tensor& m, int64_t t0, int64_t n) {
  const auto& s = m.shape();
  const bool three = s.size() == 3;
  const int64_t BH = three ? s[0] : 1, L = s[s.size() - 2], K = s.back(), bytes = dtype_size(m.dtype());
  Tensor out(m.dtype(), three ? std::vector<int64_t>{BH, n, K} : std::vector<int64_t>{n, K});
  for (int64_t g = 0; g < BH; ++g)
    std::memcpy(static_cast<char*>(out.data()) + g * n * K * bytes, static_cast<const char*>(m.data()) + (g * L + t0) * K * bytes,
                n * K * bytes);
  return out;
}

// A random mask over positions in PyTorch's sense (boolean: true = not allowed, about
// a third; f32: added, −∞ about a third, small values elsewhere), [L, K] or [BH, L, K].
Tensor random_attn_mask(DType dt, std::vector<int64_t> shape, nn::Rng& rng) {
  Tensor m(dt, shape);
  for (int64_t n = 0; n < m.numel(); ++n) {
    const bool off = rng.uniform(0.0f, 1.0f) < 0.33f;
    if (dt == DType::boolean) m.data_as<uint8_t>()[n] = off;
    else m.data_as<float>()[n] = off ? -INFINITY : rng.uniform(-0.5f, 0.5f);
  }
  return m;
}

// attn_mask in forward_cached: each chunk passes its rows of the full forward's mask
// (e.g. a tree of draft tokens), with and without a padding mask, boolean and f32,
// [L, L] and [B·H, L, L]; rows that see no position (out_proj.bias in both) included.
TEST(Decoding, AttnMasksEqualTheFullForwardsRows) {
  nn::Rng rng = nn_rng(97);
  const int64_t B = 2, L = 17, H = 6;
  for (const Storage& st : {storages()[0], storages()[2], storages()[4]})
    for (int kind = 0; kind < 4; ++kind) {  // boolean 2-D; f32 3-D; boolean 3-D + f32 padding; f32 2-D + boolean padding
      nn::MultiheadAttentionConfig cfg;
      cfg.embed_dim = 36;
      cfg.num_heads = H;
      cfg.num_kv_heads = 3;
      cfg.batch_first = kind % 2 == 0;
      cfg.rope = nn::RopeStyle::interleaved;
      nn::MultiheadAttention mha(cfg, rng);
      randomize(mha, rng);
      mha.eval();
      const bool three = kind == 1 || kind == 2;
      const DType am_type = kind == 0 || kind == 2 ? DType::boolean : DType::f32;
      Tensor am = random_attn_mask(am_type, three ? std::vector<int64_t>{B * H, L, L} : std::vector<int64_t>{L, L}, rng);
      Tensor kpm_storage;
      if (kind >= 2) kpm_storage = random_attn_mask(kind == 2 ? DType::f32 : DType::boolean, {B, L}, rng);
      const TensorView kpm = kind >= 2 ? kpm_storage.view() : TensorView();
      Tensor x = random_tensor(cfg.batch_first ? std::vector<int64_t>{B, L, 36} : std::vector<int64_t>{L, B, 36}, rng);
      Tensor full = mha.forward(x, x, x, kpm, false, am.view(), true, /*is_causal=*/true).output;
      nn::KVCache cache = mha.make_cache(B, 20, st.config);
      Tensor y = decode_in_chunks(x, cfg.batch_first, {5, 1, 3, 8}, [&](const Tensor& chunk) {
        const int64_t n = chunk.shape()[cfg.batch_first ? 1 : 0];
        return mha.forward_cached(chunk, cache, kpm, mask_rows(am, cache.length, n).view());
      });
      EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), st.tol)
          << st.name() << " kind " << kind << " " << seed_note();
      // Without the attn_mask the masked positions would be seen: the comparison can fail.
      nn::KVCache bare = mha.make_cache(B, 20, st.config);
      Tensor unmasked = decode_in_chunks(x, cfg.batch_first, {L},
                                         [&](const Tensor& chunk) { return mha.forward_cached(chunk, bare, kpm); });
      EXPECT_GT(max_rel_diff(unmasked.data_as<float>(), full.data_as<float>(), y.numel()), 10 * st.tol);
    }
}

// The decoder's tgt_mask and memory_mask: rows of forward()'s masks, chunk by chunk.
TEST(Decoding, TransformerDecoderAttnMasksEqualTheFullForwards) {
  nn::Rng rng = nn_rng(98);
  for (const Storage& st : {storages()[0], storages()[3]})
    for (bool norm_first : {false, true}) {
      auto dec = small_decoder(rng, /*batch_first=*/true, norm_first, nn::RopeStyle::none);
      const int64_t B = 2, T = 11, S = 13;
      Tensor tgt = random_tensor({B, T, 16}, rng), memory = random_tensor({B, S, 16}, rng);
      Tensor tgt_mask = random_attn_mask(DType::boolean, {T, T}, rng);
      Tensor memory_mask = random_attn_mask(DType::f32, {B * 4, T, S}, rng);
      Tensor full = dec->forward(tgt, memory, tgt_mask.view(), memory_mask.view(), {}, {}, /*tgt_is_causal=*/true);
      std::vector<nn::DecoderLayerCache> caches = dec->make_cache(memory, T, st.config);
      Tensor y = decode_in_chunks(tgt, true, {1, 3, 1, 6}, [&](const Tensor& chunk) {
        const int64_t t0 = caches[0].self_attn.length, n = chunk.shape()[1];
        return dec->forward_cached(chunk, caches, {}, {}, mask_rows(tgt_mask, t0, n).view(),
                                   mask_rows(memory_mask, t0, n).view());
      });
      EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), 2 * st.tol)
          << st.name() << " norm_first " << norm_first << " " << seed_note();
    }
}

TEST(Decoding, TransformerDecoderPaddingMasksEqualTheFullForwards) {
  nn::Rng rng = nn_rng(96);
  for (const Storage& st : {storages()[0], storages()[1], storages()[3]})
    for (bool norm_first : {false, true}) {
      auto dec = small_decoder(rng, /*batch_first=*/true, norm_first, nn::RopeStyle::none);
      const int64_t B = 2, T = 11, S = 13;
      Tensor tgt = random_tensor({B, T, 16}, rng), memory = random_tensor({B, S, 16}, rng);
      // Target: sequence 0 left-padded by 3. Memory (the source): sequence 1 right-padded by 5.
      Tensor tgt_kpm(DType::boolean, {B, T}), mem_kpm(DType::f32, {B, S});
      for (int64_t t = 0; t < T; ++t) tgt_kpm.data_as<uint8_t>()[t] = t < 3, tgt_kpm.data_as<uint8_t>()[T + t] = 0;
      for (int64_t j = 0; j < S; ++j) mem_kpm.data_as<float>()[j] = 0.0f, mem_kpm.data_as<float>()[S + j] = j >= S - 5 ? -INFINITY : 0.0f;
      Tensor full = dec->forward(tgt, memory, {}, {}, tgt_kpm, mem_kpm, /*tgt_is_causal=*/true);
      std::vector<nn::DecoderLayerCache> caches = dec->make_cache(memory, T, st.config);
      Tensor y = decode_in_chunks(tgt, true, {1, 3, 1, 6},
                                  [&](const Tensor& chunk) { return dec->forward_cached(chunk, caches, tgt_kpm, mem_kpm); });
      EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), 2 * st.tol)
          << st.name() << " norm_first " << norm_first << " " << seed_note();
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

// Random modules and calls: shapes (head dims 1 to 64, odd lengths, GQA and MQA), RoPE
// style, window, bias, layout, cache storage (every dtype, contiguous or pages of any
// size, spare capacity), the chunks the positions arrive in, and the masks (none,
// padding and/or attn_mask, boolean or f32, 2-D or 3-D), drawn afresh from the run's
// seed (ATTN_TEST_SEED reproduces a run; ATTN_DECODING_RANDOM_CASES sets how many per
// test, 24 by default, for campaigns). Weights are ~U(±1/√fan_in), as trained models'
// are, so the scores stay in the range where the caches' rounding is what the fixed
// cases above bound.
struct RandomDraw {
  explicit RandomDraw(uint64_t salt) : rng(nn_rng(salt)) {}
  int64_t below(int64_t n) { return int64_t(rng.next_u64() % uint64_t(n)); }
  bool chance(int percent) { return below(100) < percent; }
  template <class T>
  T pick(std::initializer_list<T> xs) { return xs.begin()[below(int64_t(xs.size()))]; }
  // Lengths summing to L, mostly short (decoding) with an occasional long chunk (prefill).
  std::vector<int64_t> chunks(int64_t L) {
    std::vector<int64_t> c;
    for (int64_t left = L; left > 0;) {
      const int64_t n = std::min(left, chance(70) ? 1 + below(3) : 1 + below(L));
      c.push_back(n);
      left -= n;
    }
    return c;
  }
  nn::KVCacheConfig storage(int64_t L) {
    nn::KVCacheConfig s;
    s.dtype = pick({DType::f32, DType::f32, DType::bf16, DType::f16, DType::i8, DType::f8e4m3});
    s.page_size = chance(40) ? 0 : pick<int64_t>({1, 2, 3, 16}) + (chance(50) ? below(L + 2) : 0);
    return s;
  }
  nn::Rng rng;
};

int random_cases() {
  const char* env = std::getenv("ATTN_DECODING_RANDOM_CASES");
  return env ? std::max(1, std::atoi(env)) : 24;
}

// Bars of the cached output against the f32 full forward, relative to its largest
// magnitude, per storage dtype: the fixed cases' (storages() above) with room for
// longer rows and wider heads.
double storage_tol(DType dt) {
  switch (dt) {
    case DType::f32: return 2e-5;
    case DType::f16: return 4e-3;
    case DType::bf16: return 2e-2;
    case DType::i8: return 3e-2;
    default: return 1e-1;  // f8e4m3
  }
}

void init_like_trained(nn::Module& m, nn::Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) {
    const int64_t fan_in = p->shape.size() >= 2 ? p->shape.back() : 16;
    init_uniform(*p, float(1.0 / std::sqrt(double(fan_in))), rng);
  }
}

// A random mask over the positions of a [B, L] batch in PyTorch's sense: kind 0 none,
// 1 boolean (true = ignore), 2 f32 (−∞ or small values); each position removed with
// probability `percent`.
Tensor random_mask(RandomDraw& d, int kind, std::vector<int64_t> shape, int percent) {
  if (kind == 0) return Tensor();
  Tensor m(kind == 1 ? DType::boolean : DType::f32, shape);
  for (int64_t n = 0; n < m.numel(); ++n) {
    const bool off = d.below(100) < percent;
    if (kind == 1) m.data_as<uint8_t>()[n] = off;
    else m.data_as<float>()[n] = off ? -INFINITY : d.rng.uniform(-0.5f, 0.5f);
  }
  return m;
}

TensorView view_or_empty(const Tensor& t) { return t.data() ? t.view() : TensorView(); }

TEST(Decoding, RandomMultiheadAttentionCallsEqualTheFullForward) {
  const int cases = random_cases();
  for (int i = 0; i < cases; ++i) {
    RandomDraw d(uint64_t(1000 + i));
    nn::MultiheadAttentionConfig cfg;
    const int64_t hd = d.pick<int64_t>({1, 2, 3, 4, 6, 8, 16, 18, 32, 64});
    cfg.num_kv_heads = d.pick<int64_t>({1, 1, 2, 3});
    cfg.num_heads = cfg.num_kv_heads * d.pick<int64_t>({1, 2, 4});
    cfg.embed_dim = hd * cfg.num_heads;
    cfg.batch_first = d.chance(50);
    cfg.bias = d.chance(75);
    cfg.rope = hd % 2 ? nn::RopeStyle::none : d.pick({nn::RopeStyle::none, nn::RopeStyle::half, nn::RopeStyle::interleaved});
    const int64_t B = 1 + d.below(3), L = d.chance(20) ? 1 + d.below(3) : 4 + d.below(37);
    if (d.chance(35)) cfg.window = {int(d.below(L + 1)), 0};
    nn::MultiheadAttention mha(cfg, d.rng);
    init_like_trained(mha, d.rng);
    mha.eval();
    const nn::KVCacheConfig st = d.storage(L);
    const int64_t capacity = L + (d.chance(50) ? d.below(9) : 0), E = cfg.embed_dim, H = cfg.num_heads;
    // Masks of the final length K ≥ L serve every step (forward_cached's contract).
    const int64_t K = L + (d.chance(30) ? d.below(4) : 0);
    const int kpm_kind = int(d.below(3)), am_kind = int(d.below(3));
    const bool am_3d = d.chance(50);
    Tensor kpm = random_mask(d, kpm_kind, {B, K}, d.pick({10, 30, 90}));
    Tensor am = random_mask(d, am_kind, am_3d ? std::vector<int64_t>{B * H, L, K} : std::vector<int64_t>{L, K}, d.pick({10, 30}));
    Tensor x = random_tensor(cfg.batch_first ? std::vector<int64_t>{B, L, E} : std::vector<int64_t>{L, B, E}, d.rng);
    // forward() takes masks of exactly S = L columns: the first L of each.
    auto first_columns = [&](const Tensor& m) {
      if (!m.data()) return Tensor();
      const auto& s = m.shape();
      std::vector<int64_t> shape = s;
      shape.back() = L;
      Tensor out(m.dtype(), shape);
      const int64_t rows = m.numel() / K, bytes = dtype_size(m.dtype());
      for (int64_t r = 0; r < rows; ++r)
        std::memcpy(static_cast<char*>(out.data()) + r * L * bytes, static_cast<const char*>(m.data()) + r * K * bytes, L * bytes);
      return out;
    };
    const Tensor kpm_L = first_columns(kpm), am_L = first_columns(am);
    Tensor full = mha.forward(x, x, x, view_or_empty(kpm_L), false, view_or_empty(am_L), true, /*is_causal=*/true).output;
    nn::KVCache cache = mha.make_cache(B, capacity, st);
    const std::vector<int64_t> chunks = d.chunks(L);
    Tensor y = decode_in_chunks(x, cfg.batch_first, chunks, [&](const Tensor& chunk) {
      const int64_t n = chunk.shape()[cfg.batch_first ? 1 : 0];
      const Tensor rows = !am.data() ? Tensor() : mask_rows(am, cache.length, n);
      return mha.forward_cached(chunk, cache, view_or_empty(kpm), view_or_empty(rows));
    });
    std::ostringstream what;
    what << "case " << i << ": hd " << hd << " H " << H << "/" << cfg.num_kv_heads << " B " << B << " L " << L
         << " capacity " << capacity << " K " << K << " window " << cfg.window.left << " rope " << int(cfg.rope)
         << " bias " << cfg.bias << " batch_first " << cfg.batch_first << " storage " << dtype_name(st.dtype)
         << " pages " << st.page_size << " masks " << kpm_kind << "/" << am_kind << (am_3d ? " 3-D" : "") << " chunks";
    for (int64_t n : chunks) what << " " << n;
    EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), storage_tol(st.dtype))
        << what.str() << " " << seed_note();
    for (int64_t n = 0; n < y.numel(); ++n) ASSERT_TRUE(std::isfinite(y.data_as<float>()[n])) << what.str() << " " << seed_note();
    EXPECT_EQ(cache.length, L) << what.str();
  }
}

TEST(Decoding, RandomTransformerDecodersEqualTheirFullForward) {
  const int cases = random_cases();
  for (int i = 0; i < cases; ++i) {
    RandomDraw d(uint64_t(2000 + i));
    nn::TransformerLayerConfig c;
    const int64_t hd = d.pick<int64_t>({2, 3, 4, 8, 16});
    c.num_kv_heads = d.pick<int64_t>({1, 2});
    c.nhead = c.num_kv_heads * d.pick<int64_t>({1, 2, 3});
    // A LayerNorm over fewer features amplifies rounding without bound (over 2 it
    // outputs ±1 from the sign of a difference), so d_model ≥ 8.
    while (hd * c.nhead < 8) c.nhead += c.num_kv_heads;
    c.d_model = hd * c.nhead;
    c.dim_feedforward = 1 + d.below(40);
    c.batch_first = d.chance(50);
    c.norm_first = d.chance(50);
    c.activation = d.pick({nn::ActivationKind::relu, nn::ActivationKind::gelu});
    c.rope = hd % 2 ? nn::RopeStyle::none : d.pick({nn::RopeStyle::none, nn::RopeStyle::half, nn::RopeStyle::interleaved});
    const int64_t layers = 1 + d.below(3);
    nn::TransformerDecoder dec(c, layers, /*final_norm=*/d.chance(60), d.rng);
    init_like_trained(dec, d.rng);
    dec.eval();
    const int64_t B = 1 + d.below(3), T = 1 + d.below(24), S = 1 + d.below(24), E = c.d_model, H = c.nhead;
    auto shape = [&](int64_t n) { return c.batch_first ? std::vector<int64_t>{B, n, E} : std::vector<int64_t>{n, B, E}; };
    Tensor tgt = random_tensor(shape(T), d.rng), memory = random_tensor(shape(S), d.rng);
    const int tgt_kpm_kind = int(d.below(3)), mem_kpm_kind = int(d.below(3)), tgt_mask_kind = int(d.below(3)),
              mem_mask_kind = int(d.below(3));
    Tensor tgt_kpm = random_mask(d, tgt_kpm_kind, {B, T}, 20), mem_kpm = random_mask(d, mem_kpm_kind, {B, S}, 30);
    Tensor tgt_mask = random_mask(d, tgt_mask_kind, d.chance(50) ? std::vector<int64_t>{T, T} : std::vector<int64_t>{B * H, T, T}, 20);
    Tensor mem_mask = random_mask(d, mem_mask_kind, d.chance(50) ? std::vector<int64_t>{T, S} : std::vector<int64_t>{B * H, T, S}, 20);
    Tensor full = dec.forward(tgt, memory, view_or_empty(tgt_mask), view_or_empty(mem_mask), view_or_empty(tgt_kpm),
                              view_or_empty(mem_kpm), /*tgt_is_causal=*/true);
    const nn::KVCacheConfig st = d.storage(std::max(T, S));
    std::vector<nn::DecoderLayerCache> caches = dec.make_cache(memory, T + d.below(4), st);
    const std::vector<int64_t> chunks = d.chunks(T);
    Tensor y = decode_in_chunks(tgt, c.batch_first, chunks, [&](const Tensor& chunk) {
      const int64_t t0 = caches[0].self_attn.length, n = chunk.shape()[c.batch_first ? 1 : 0];
      const Tensor tm = !tgt_mask.data() ? Tensor() : mask_rows(tgt_mask, t0, n);
      const Tensor mm = !mem_mask.data() ? Tensor() : mask_rows(mem_mask, t0, n);
      return dec.forward_cached(chunk, caches, view_or_empty(tgt_kpm), view_or_empty(mem_kpm), view_or_empty(tm),
                                view_or_empty(mm));
    });
    std::ostringstream what;
    what << "case " << i << ": hd " << hd << " H " << H << "/" << c.num_kv_heads << " layers " << layers << " ff "
         << c.dim_feedforward << " B " << B << " T " << T << " S " << S << " rope " << int(c.rope) << " norm_first "
         << c.norm_first << " batch_first " << c.batch_first << " storage " << dtype_name(st.dtype) << " pages "
         << st.page_size << " masks " << tgt_kpm_kind << mem_kpm_kind << tgt_mask_kind << mem_mask_kind << " chunks";
    for (int64_t n : chunks) what << " " << n;
    // The layers' norms and residuals carry the caches' rounding through every layer.
    EXPECT_LT(max_rel_diff(y.data_as<float>(), full.data_as<float>(), y.numel()), double(layers) * storage_tol(st.dtype))
        << what.str() << " " << seed_note();
    for (int64_t n = 0; n < y.numel(); ++n) ASSERT_TRUE(std::isfinite(y.data_as<float>()[n])) << what.str() << " " << seed_note();
  }
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
  {  // key_padding_mask: [B, K ≥ positions], boolean or f32, contiguous; nothing appended first
    Tensor none(DType::boolean, {2, 0}), short_mask(DType::boolean, {2, 3}), wrong_batch(DType::boolean, {3, 8});
    Tensor ints(DType::i32, {2, 8});
    Tensor strided(DType::f32, {8, 2});
    const int64_t before = cache.length;
    nn::KVCache room = mha.make_cache(2, 8);
    throws_with([&] { mha.forward_cached(random_tensor({2, 1, 16}, rng), room, none.view()); }, "key_padding_mask must be [2, K] with K ≥ 1");
    room.set_length(3);
    throws_with([&] { mha.forward_cached(random_tensor({2, 1, 16}, rng), room, short_mask.view()); }, "K ≥ 4");
    throws_with([&] { mha.forward_cached(random_tensor({2, 1, 16}, rng), room, wrong_batch.view()); }, "key_padding_mask");
    throws_with([&] { mha.forward_cached(random_tensor({2, 1, 16}, rng), room, ints.view()); }, "boolean or f32");
    const TensorView transposed(strided.data(), DType::f32, {2, 8}, {1, 2});
    throws_with([&] { mha.forward_cached(random_tensor({2, 1, 16}, rng), room, transposed); }, "contiguous");
    throws_with([&] { mha.forward_memory_cached(random_tensor({2, 1, 16}, rng), cache, 0, none.view()); }, "forward_memory_cached: key_padding_mask must be [2, K] with K ≥ 3");
    // attn_mask: [T, K] or [B·H, T, K], K ≥ positions and key_padding_mask's K, boolean or f32, contiguous
    Tensor rows_wrong(DType::boolean, {2, 8}), narrow(DType::boolean, {1, 3}), heads_wrong(DType::f32, {4, 1, 8});
    Tensor am_ints(DType::i32, {1, 8}), wide(DType::boolean, {1, 9}), kpm8(DType::boolean, {2, 8}), am_strided(DType::f32, {8, 2});
    const TensorView am_transposed(am_strided.data(), DType::f32, {1, 8}, {1, 2});
    auto x1 = [&] { return random_tensor({2, 1, 16}, rng); };
    throws_with([&] { mha.forward_cached(x1(), room, {}, rows_wrong.view()); }, "forward_cached: attn_mask must be [1, K] or [8, 1, K] with K ≥ 4");
    throws_with([&] { mha.forward_cached(x1(), room, {}, narrow.view()); }, "K ≥ 4");
    throws_with([&] { mha.forward_cached(x1(), room, {}, heads_wrong.view()); }, "attn_mask must be [1, K] or [8, 1, K]");
    throws_with([&] { mha.forward_cached(x1(), room, {}, am_ints.view()); }, "attn_mask must be boolean or f32");
    throws_with([&] { mha.forward_cached(x1(), room, {}, am_transposed); }, "attn_mask must be contiguous");
    throws_with([&] { mha.forward_cached(x1(), room, kpm8.view(), wide.view()); }, "as many columns");
    Tensor narrower(DType::boolean, {1, 2});
    throws_with([&] { mha.forward_memory_cached(x1(), cache, 0, {}, narrower.view()); }, "forward_memory_cached: attn_mask must be [1, K] or [8, 1, K] with K ≥ 3");
    EXPECT_EQ(room.length, 3);
    EXPECT_EQ(cache.length, before);
  }

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
  {  // a bad memory mask is found before any layer appends
    Tensor mem_short(DType::boolean, {2, 4});
    throws_with([&] { dec.forward_cached(random_tensor({2, 1, 16}, rng), caches, {}, mem_short.view()); }, "memory_key_padding_mask must be [2, K] with K ≥ 5");
    Tensor tgt_short(DType::boolean, {2, 0});
    throws_with([&] { dec.forward_cached(random_tensor({2, 2, 16}, rng), caches, tgt_short.view()); }, "tgt_key_padding_mask");
    Tensor tgt_mask_short(DType::boolean, {2, 1}), mem_mask_rows(DType::f32, {3, 5});
    throws_with([&] { dec.forward_cached(random_tensor({2, 2, 16}, rng), caches, {}, {}, tgt_mask_short.view()); }, "tgt_mask must be [2, K] or [8, 2, K] with K ≥ 2");
    throws_with([&] { dec.forward_cached(random_tensor({2, 2, 16}, rng), caches, {}, {}, {}, mem_mask_rows.view()); }, "memory_mask must be [2, K] or [8, 2, K] with K ≥ 5");
    EXPECT_EQ(caches[0].self_attn.length, 0);
  }
  caches.pop_back();
  throws_with([&] { dec.forward_cached(random_tensor({2, 1, 16}, rng), caches); }, "one cache per layer");
}

}  // namespace
}  // namespace attn::testing
