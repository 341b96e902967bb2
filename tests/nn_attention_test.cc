// MultiheadAttention beyond what PyTorch parity covers: grouped-query heads, RoPE,
// the KV cache, windows, gradients by finite differences, weights, errors.
#include <gtest/gtest.h>

#include <cstring>

#include "attn/error.hpp"
#include "attn/nn/multihead_attention.hpp"
#include "nn_test_util.hpp"

namespace attn::testing {
namespace {

nn::MultiheadAttentionConfig config(int64_t E, int64_t H, int64_t Hkv = 0, bool batch_first = true) {
  nn::MultiheadAttentionConfig c;
  c.embed_dim = E;
  c.num_heads = H;
  c.num_kv_heads = Hkv;
  c.batch_first = batch_first;
  return c;
}

void randomize(nn::Module& m, nn::Rng& rng) {
  for (auto& [name, p] : m.named_parameters()) init_uniform(*p, 0.5f, rng);
}

/// The gradient slots of every parameter of `mha` and of its inputs q, k and v, whose
/// analytic gradients its backward leaves in g.
std::vector<GradSlot> slots_with_inputs(nn::MultiheadAttention& mha, Tensor& q, Tensor& k, Tensor& v,
                                        nn::MultiheadAttentionGrads& g) {
  auto slots = parameter_slots(mha);
  slots.push_back({"query", q.data_as<float>(), q.numel(), [&g] { return g.dquery.data_as<float>(); }});
  slots.push_back({"key", k.data_as<float>(), k.numel(), [&g] { return g.dkey.data_as<float>(); }});
  slots.push_back({"value", v.data_as<float>(), v.numel(), [&g] { return g.dvalue.data_as<float>(); }});
  return slots;
}

TEST(MultiheadAttention, GroupedQueryEqualsRepeatedKeyValueHeads) {
  nn::Rng rng = nn_rng(41);
  const int64_t E = 16, H = 4, Hkv = 2, hd = 4, B = 2, L = 5, S = 7;
  nn::MultiheadAttention gqa(config(E, H, Hkv), rng), full(config(E, H), rng);
  randomize(gqa, rng);
  // full's k/v rows for head h are gqa's rows for kv head h / 2.
  const auto& w = gqa.in_proj_weight->value;
  const auto& b = gqa.in_proj_bias->value;
  auto& fw = full.in_proj_weight->value;
  auto& fb = full.in_proj_bias->value;
  std::copy(w.begin(), w.begin() + E * E, fw.begin());
  std::copy(b.begin(), b.begin() + E, fb.begin());
  for (int part = 0; part < 2; ++part)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t r = 0; r < hd; ++r) {
        const int64_t src = E + part * Hkv * hd + (h / 2) * hd + r, dst = E + part * E + h * hd + r;
        std::copy_n(w.begin() + src * E, E, fw.begin() + dst * E);
        fb[dst] = b[src];
      }
  full.out_proj.weight.value = gqa.out_proj.weight.value;
  full.out_proj.bias->value = gqa.out_proj.bias->value;
  Tensor q = random_tensor({B, L, E}, rng), kv = random_tensor({B, S, E}, rng);
  auto a = gqa.forward(q, kv, kv), c = full.forward(q, kv, kv);
  EXPECT_LT(max_rel_diff(a.output.data_as<float>(), c.output.data_as<float>(), a.output.numel()), 1e-5);
  EXPECT_LT(max_rel_diff(a.weights.data_as<float>(), c.weights.data_as<float>(), a.weights.numel()), 1e-5);
  Tensor g = random_tensor({B, L, E}, rng);
  gqa.zero_grad();
  full.zero_grad();
  auto ga = gqa.backward(g), gc = full.backward(g);
  EXPECT_LT(max_rel_diff(ga.dquery.data_as<float>(), gc.dquery.data_as<float>(), ga.dquery.numel()), 1e-5);
  EXPECT_LT(max_rel_diff(ga.dkey.data_as<float>(), gc.dkey.data_as<float>(), ga.dkey.numel()), 1e-5);
  // A kv head's weight gradient is the sum over the query heads that share it.
  for (int64_t r = 0; r < hd; ++r)
    for (int64_t col = 0; col < E; ++col) {
      const int64_t kv_row = E + 1 * hd + r;  // kv head 1 of the key projection
      const double want = double(full.in_proj_weight->grad[(E + 2 * hd + r) * E + col]) +
                          full.in_proj_weight->grad[(E + 3 * hd + r) * E + col];
      EXPECT_NEAR(gqa.in_proj_weight->grad[kv_row * E + col], want, 1e-4 * (1 + std::fabs(want)));
    }
}

TEST(MultiheadAttention, KvCacheDecodingEqualsTheFullCausalForward) {
  nn::Rng rng = nn_rng(42);
  for (auto rope : {nn::RopeStyle::none, nn::RopeStyle::half, nn::RopeStyle::interleaved})
    for (bool batch_first : {true, false}) {
      auto cfg = config(24, 6, 2, batch_first);
      cfg.rope = rope;
      cfg.window = {4, 0};
      nn::MultiheadAttention mha(cfg, rng);
      randomize(mha, rng);
      mha.eval();
      const int64_t B = 2, L = 9;
      Tensor x = random_tensor({B, L, 24}, rng);  // read as [L, B, E] when !batch_first: same numbers
      TensorView xv(x.data(), DType::f32, batch_first ? std::vector<int64_t>{B, L, 24} : std::vector<int64_t>{L, B, 24});
      Tensor full = mha.forward(xv, xv, xv, {}, false, {}, true, /*is_causal=*/true).output;
      nn::KVCache cache = mha.make_cache(B, 16);
      // Decode as 1 + 1 + 3 + 4 positions.
      int64_t t0 = 0;
      for (int64_t n : {1, 1, 3, 4}) {
        Tensor chunk(DType::f32, batch_first ? std::vector<int64_t>{B, n, 24} : std::vector<int64_t>{n, B, 24});
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < n; ++t) {
            const int64_t src = batch_first ? b * L + t0 + t : (t0 + t) * B + b;
            const int64_t dst = batch_first ? b * n + t : t * B + b;
            std::memcpy(chunk.data_as<float>() + dst * 24, x.data_as<float>() + src * 24, sizeof(float) * 24);
          }
        Tensor y = mha.forward_cached(chunk, cache);
        for (int64_t b = 0; b < B; ++b)
          for (int64_t t = 0; t < n; ++t) {
            const int64_t src = batch_first ? b * L + t0 + t : (t0 + t) * B + b;
            const int64_t dst = batch_first ? b * n + t : t * B + b;
            EXPECT_LT(max_rel_diff(y.data_as<float>() + dst * 24, full.data_as<float>() + src * 24, 24), 1e-5)
                << "position " << t0 + t << " rope " << int(rope) << " batch_first " << batch_first;
          }
        t0 += n;
      }
      EXPECT_EQ(cache.length, L);
      EXPECT_THROW(mha.forward_cached(random_tensor({B, 8, 24}, rng), cache), Error);  // 9 + 8 > 16
    }
}

// Drawn head counts and sizes (GQA groups 1–3, odd head sizes without RoPE), lengths,
// capacities, windows, page sizes (contiguous or paged), cache dtypes and chunkings of
// the positions: decoding chunk by chunk equals the full causal forward (f32 caches
// to f32 rounding, the others to their own rounding of K and V).
TEST(MultiheadAttention, KvCacheDecodingOnDrawnShapes) {
  nn::Rng rng = nn_rng(46);
  auto draw = [&](int64_t lo, int64_t hi) { return lo + static_cast<int64_t>(rng.next_u64() % (hi - lo + 1)); };
  for (int trial = 0; trial < 10; ++trial) {
    const auto rope = static_cast<nn::RopeStyle>(draw(0, 2));
    const int64_t Hkv = draw(1, 3), H = Hkv * draw(1, 3);
    const int64_t hd = rope == nn::RopeStyle::none ? draw(1, 20) : 2 * draw(1, 10), E = H * hd;
    const int64_t B = draw(1, 3), L = draw(1, 40), capacity = L + draw(0, 5), page = draw(0, 1) ? draw(1, 17) : 0;
    const bool batch_first = draw(0, 1) == 1;
    auto cfg = config(E, H, Hkv, batch_first);
    cfg.rope = rope;
    if (draw(0, 1)) cfg.window = {static_cast<int>(draw(0, L)), 0};
    SCOPED_TRACE(::testing::Message() << "H " << H << " Hkv " << Hkv << " hd " << hd << " B " << B << " L " << L
                                      << " capacity " << capacity << " page " << page << " rope " << int(rope)
                                      << " window " << cfg.window.left << " batch_first " << batch_first << " "
                                      << seed_note());
    nn::MultiheadAttention mha(cfg, rng);
    randomize(mha, rng);
    mha.eval();
    Tensor x = random_tensor({B, L, E}, rng);  // read as [L, B, E] when !batch_first
    TensorView xv(x.data(), DType::f32, batch_first ? std::vector<int64_t>{B, L, E} : std::vector<int64_t>{L, B, E});
    Tensor full = mha.forward(xv, xv, xv, {}, false, {}, true, /*is_causal=*/true).output;
    nn::KVCacheConfig storage;
    storage.page_size = page;
    // f32 caches most often; 16-bit and i8 ones round K and V, so their bar is their rounding's.
    const DType dtypes[] = {DType::f32, DType::f32, DType::bf16, DType::f16, DType::i8};
    storage.dtype = dtypes[draw(0, 4)];
    const double tol = storage.dtype == DType::f32    ? 2e-5
                       : storage.dtype == DType::f16  ? 4e-3
                       : storage.dtype == DType::bf16 ? 3e-2
                                                      : 8e-2;  // i8: 1/254 of each row's largest, before the softmax
    SCOPED_TRACE(::testing::Message() << "cache " << dtype_name(storage.dtype));
    nn::KVCache cache = mha.make_cache(B, capacity, storage);
    for (int64_t t0 = 0; t0 < L;) {
      const int64_t n = std::min(L - t0, draw(1, 8));
      Tensor chunk(DType::f32, batch_first ? std::vector<int64_t>{B, n, E} : std::vector<int64_t>{n, B, E});
      auto src_row = [&](int64_t b, int64_t t) { return batch_first ? b * L + t0 + t : (t0 + t) * B + b; };
      auto dst_row = [&](int64_t b, int64_t t) { return batch_first ? b * n + t : t * B + b; };
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < n; ++t)
          std::memcpy(chunk.data_as<float>() + dst_row(b, t) * E, x.data_as<float>() + src_row(b, t) * E,
                      sizeof(float) * E);
      Tensor y = mha.forward_cached(chunk, cache);
      for (int64_t b = 0; b < B; ++b)
        for (int64_t t = 0; t < n; ++t)
          ASSERT_LT(max_rel_diff(y.data_as<float>() + dst_row(b, t) * E, full.data_as<float>() + src_row(b, t) * E, E),
                    tol)
              << "position " << t0 + t << " of sequence " << b;
      t0 += n;
    }
    EXPECT_EQ(cache.length, L);
  }
}

TEST(MultiheadAttention, GradientsWithEveryFeature) {
  nn::Rng rng = nn_rng(43);
  auto cfg = config(16, 4, 2, /*batch_first=*/false);
  cfg.kdim = 5;
  cfg.vdim = 7;
  cfg.rope = nn::RopeStyle::half;
  nn::MultiheadAttention mha(cfg, rng);
  randomize(mha, rng);
  const int64_t B = 2, L = 4, S = 6;
  Tensor q = random_tensor({L, B, 16}, rng), k = random_tensor({S, B, 5}, rng), v = random_tensor({S, B, 7}, rng);
  Tensor kpm(DType::boolean, {B, S});
  for (int64_t i = 0; i < B * S; ++i) kpm.data_as<uint8_t>()[i] = (i % S) == 5 && i >= S;  // pad the last key of b=1
  Tensor am = random_tensor({L, S}, rng);  // additive
  nn::MultiheadAttentionGrads g;
  auto slots = slots_with_inputs(mha, q, k, v, g);
  mha.zero_grad();
  check_gradients([&] { return mha.forward(q, k, v, kpm, false, am, true, true).output; },
                  [&](const Tensor& dy) { g = mha.backward(dy); }, slots, rng);
}

/// A boolean (true = remove) or additive f32 tensor of this shape, entries drawn:
/// whole rows of keys may go, whose queries then output out_proj.bias.
Tensor drawn_mask(std::vector<int64_t> shape, bool boolean, nn::Rng& rng) {
  if (!boolean) return random_tensor(std::move(shape), rng, -2.0f, 2.0f);
  Tensor m(DType::boolean, std::move(shape));
  for (int64_t i = 0; i < m.numel(); ++i) m.data_as<uint8_t>()[i] = rng.next_u64() % 4 == 0;
  return m;
}

// Every feature drawn at once, 12 calls per run: 1–4 heads of 1–5 dimensions (RoPE of
// either pairing where they are even), kv heads dividing the heads, key and value
// widths of their own, with or without bias, either layout or unbatched, a window,
// causal or not, key padding and an attention mask of [L, S] or [B·H, L, S], each
// boolean or additive, lengths 1–7 — and every parameter's and input's gradient
// checked by central differences.
TEST(MultiheadAttention, GradientsOnDrawnShapes) {
  nn::Rng rng = nn_rng(47);
  const int64_t lengths[] = {1, 2, 3, 5, 7};
  auto pick = [&](int64_t n) { return static_cast<int64_t>(rng.next_u64() % n); };
  for (int draw = 0; draw < 12; ++draw) {
    const int64_t H = 1 + pick(4), hd = 1 + pick(5), E = H * hd;
    std::vector<int64_t> divisors;
    for (int64_t k = 1; k <= H; ++k)
      if (H % k == 0) divisors.push_back(k);
    auto cfg = config(E, H, divisors[pick(divisors.size())], pick(2) == 1);
    cfg.kdim = pick(2) ? 0 : 1 + pick(7);
    cfg.vdim = pick(2) ? 0 : 1 + pick(7);
    cfg.bias = pick(3) != 0;
    cfg.rope = hd % 2 == 0 ? static_cast<nn::RopeStyle>(pick(3)) : nn::RopeStyle::none;
    if (pick(3) == 0) cfg.window = Window{static_cast<int>(pick(4)), pick(2) ? -1 : static_cast<int>(pick(3))};
    const bool unbatched = pick(6) == 0;
    const int64_t B = unbatched ? 1 : 1 + pick(3), L = lengths[pick(5)], S = lengths[pick(5)];
    const bool causal = pick(2), need_weights = pick(2), average = pick(2);
    const int padding = static_cast<int>(pick(3)), mask = static_cast<int>(pick(5));  // 0: none
    const int64_t kd = cfg.kdim ? cfg.kdim : E, vd = cfg.vdim ? cfg.vdim : E;
    SCOPED_TRACE("E " + std::to_string(E) + ", heads " + std::to_string(H) + "/" + std::to_string(cfg.num_kv_heads) +
                 " kv, kdim " + std::to_string(kd) + ", vdim " + std::to_string(vd) + ", bias " +
                 std::to_string(cfg.bias) + ", rope " + std::to_string(static_cast<int>(cfg.rope)) + ", window " +
                 std::to_string(cfg.window.left) + "/" + std::to_string(cfg.window.right) + ", batch_first " +
                 std::to_string(cfg.batch_first) + ", unbatched " + std::to_string(unbatched) + ", B " +
                 std::to_string(B) + ", L " + std::to_string(L) + ", S " + std::to_string(S) + ", causal " +
                 std::to_string(causal) + ", padding " + std::to_string(padding) + ", mask " + std::to_string(mask) +
                 " (" + seed_note() + ")");
    nn::MultiheadAttention mha(cfg, rng);
    randomize(mha, rng);
    mha.eval();
    auto shape = [&](int64_t len, int64_t width) {
      if (unbatched) return std::vector<int64_t>{len, width};
      return cfg.batch_first ? std::vector<int64_t>{B, len, width} : std::vector<int64_t>{len, B, width};
    };
    Tensor q = random_tensor(shape(L, E), rng), k = random_tensor(shape(S, kd), rng),
           v = random_tensor(shape(S, vd), rng);
    const std::vector<int64_t> kpm_shape = unbatched ? std::vector<int64_t>{S} : std::vector<int64_t>{B, S};
    Tensor kpm = padding == 0 ? Tensor() : drawn_mask(kpm_shape, padding == 1, rng);
    Tensor am = mask == 0   ? Tensor()
                : mask <= 2 ? drawn_mask({L, S}, mask == 1, rng)
                            : drawn_mask({B * H, L, S}, mask == 3, rng);
    nn::MultiheadAttentionGrads g;
    auto slots = slots_with_inputs(mha, q, k, v, g);
    mha.zero_grad();
    check_gradients(
        [&] {
          return mha.forward(q, k, v, padding ? TensorView(kpm) : TensorView(), need_weights,
                             mask ? TensorView(am) : TensorView(), average, causal)
              .output;
        },
        [&](const Tensor& dy) { g = mha.backward(dy); }, slots, rng, 3e-3f, 1e-2, 1e-3);
  }
}

TEST(MultiheadAttention, WeightsAreDistributionsAndAverageOverHeads) {
  nn::Rng rng = nn_rng(44);
  nn::MultiheadAttention mha(config(8, 2), rng);
  Tensor x = random_tensor({3, 5, 8}, rng);
  auto per_head = mha.forward(x, x, x, {}, true, {}, /*average=*/false, /*causal=*/true);
  auto averaged = mha.forward(x, x, x, {}, true, {}, true, true);
  ASSERT_EQ(per_head.weights.shape(), (std::vector<int64_t>{3, 2, 5, 5}));
  ASSERT_EQ(averaged.weights.shape(), (std::vector<int64_t>{3, 5, 5}));
  for (int64_t b = 0; b < 3; ++b)
    for (int64_t i = 0; i < 5; ++i) {
      double row = 0;
      for (int64_t j = 0; j < 5; ++j) {
        const float* p = per_head.weights.data_as<float>();
        const double mean = (p[((b * 2 + 0) * 5 + i) * 5 + j] + p[((b * 2 + 1) * 5 + i) * 5 + j]) / 2.0;
        EXPECT_NEAR(averaged.weights.data_as<float>()[(b * 5 + i) * 5 + j], mean, 1e-7);
        if (j > i) EXPECT_EQ(averaged.weights.data_as<float>()[(b * 5 + i) * 5 + j], 0.0f);  // causal
        row += averaged.weights.data_as<float>()[(b * 5 + i) * 5 + j];
      }
      EXPECT_NEAR(row, 1.0, 1e-6);
    }
  // Unbatched input: [L, E] in, [L, E] and [L, S] out.
  Tensor u = random_tensor({4, 8}, rng);
  auto r = mha.forward(u, u, u);
  EXPECT_EQ(r.output.shape(), (std::vector<int64_t>{4, 8}));
  EXPECT_EQ(r.weights.shape(), (std::vector<int64_t>{4, 4}));
}

TEST(MultiheadAttention, FullyMaskedQueryGivesTheOutputBiasNotNaN) {
  nn::Rng rng = nn_rng(45);
  nn::MultiheadAttention mha(config(4, 1), rng);
  randomize(mha, rng);
  Tensor x = random_tensor({1, 2, 4}, rng);
  uint8_t all[2] = {1, 1};  // every key ignored
  auto r = mha.forward(x, x, x, TensorView(all, DType::boolean, {1, 2}));
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(r.output.data_as<float>()[i], mha.out_proj.bias->value[i % 4]);
  auto g = mha.backward(random_tensor({1, 2, 4}, rng));
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(g.dquery.data_as<float>()[i], 0.0f);
}

TEST(MultiheadAttention, DropoutOnlyInTrainingAndReproducible) {
  nn::Rng rng = nn_rng(46);
  auto cfg = config(8, 2);
  cfg.dropout = 0.5f;
  cfg.seed = 7;
  nn::Rng r1(1), r2(1);
  nn::MultiheadAttention a(cfg, r1), b(cfg, r2);
  Tensor x = random_tensor({2, 6, 8}, rng);
  Tensor ya = a.forward(x, x, x).output, yb = b.forward(x, x, x).output;
  EXPECT_EQ(std::memcmp(ya.data(), yb.data(), sizeof(float) * ya.numel()), 0);
  a.eval();
  Tensor ye = a.forward(x, x, x).output;
  EXPECT_NE(std::memcmp(ya.data(), ye.data(), sizeof(float) * ya.numel()), 0);
}

TEST(MultiheadAttention, ErrorsNameTheArgument) {
  nn::Rng rng(5);
  EXPECT_THROW(nn::MultiheadAttention(config(10, 3), rng), Error);
  EXPECT_THROW(nn::MultiheadAttention(config(12, 4, 3), rng), Error);
  auto odd = config(12, 4);
  odd.rope = nn::RopeStyle::half;
  EXPECT_THROW(nn::MultiheadAttention(odd, rng), Error);  // head_dim 3
  nn::MultiheadAttention mha(config(8, 2), rng);
  Tensor x = random_tensor({2, 3, 8}, rng), y = random_tensor({2, 3, 6}, rng), z = random_tensor({3, 3, 8}, rng);
  auto message = [&](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(message([&] { mha.forward(y, y, y); }).find("embed_dim 8"), std::string::npos);
  EXPECT_NE(message([&] { mha.forward(x, z, z); }).find("batch size"), std::string::npos);
  Tensor kpm(DType::boolean, {2, 4});
  EXPECT_NE(message([&] { mha.forward(x, x, x, kpm); }).find("key_padding_mask must be [2, 3]"), std::string::npos);
  Tensor am = random_tensor({3, 4}, rng);
  EXPECT_NE(message([&] { mha.forward(x, x, x, {}, true, am); }).find("attn_mask must be [3, 3] or [4, 3, 3]"),
            std::string::npos);
  nn::MultiheadAttention fresh(config(8, 2), rng);
  EXPECT_THROW(fresh.backward(x), Error);
}

}  // namespace
}  // namespace attn::testing
