// options.block_mask (FlexAttention-style block sparsity): the fused kernels against
// the float64 reference on random block tables (empty, full and partial blocks of odd
// sizes, broadcast over batch and heads) combined with every other option; the same
// calls with the block mask expanded by this test into a dense boolean mask (bitwise
// equal, forward and backward, f32 and bf16); proof that removed tiles are skipped;
// and the argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <set>
#include <utility>
#include <vector>

#include "attention_harness.hpp"
#include "attn/attention.hpp"
#include "attn/kvcache.hpp"
#include "lowp_harness.hpp"
#include "tensor/convert.hpp"

namespace attn::testing {
namespace {

// A block table and its partial tiles, owning the storage BlockMask views.
struct OwnedBlockMask {
  int Bm = 1, Hm = 1, nqb = 0, nkb = 0, bq = 1, bk = 1;
  std::vector<int32_t> blocks;
  std::vector<uint8_t> tiles;  // [T][bq][bk]

  int32_t& at(int b, int h, int qb, int kb) {
    return blocks[((size_t(b) * Hm + h) * nqb + qb) * nkb + kb];
  }
  BlockMask view() const {
    BlockMask m;
    m.block_q = bq, m.block_k = bk;
    m.blocks = TensorView(blocks.data(), DType::i32, {Bm, Hm, nqb, nkb});
    const int64_t T = int64_t(tiles.size()) / (int64_t(bq) * bk);
    if (T > 0) m.tiles = TensorView(tiles.data(), DType::boolean, {T, bq, bk});
    return m;
  }
  // The mask it stands for, element by element (this test's own reading of the
  // contract, independent of the library's): true = may attend.
  bool allows(int b, int h, int i, int j) const {
    const int32_t e = blocks[((size_t(Bm == 1 ? 0 : b) * Hm + (Hm == 1 ? 0 : h)) * nqb + i / bq) * nkb + j / bk];
    if (e == BlockMask::kFull) return true;
    if (e == BlockMask::kEmpty) return false;
    return tiles[(size_t(e) * bq + i % bq) * bk + j % bk] != 0;
  }
};

// Random table: each block empty, full or partial with the given odds; partial tiles
// hold random bits (some rows all false, so that whole rows can end up masked).
OwnedBlockMask random_block_mask(std::mt19937_64& rng, int Bm, int Hm, int Lq, int Lk, int bq, int bk,
                                 double p_empty = 0.3, double p_full = 0.3) {
  OwnedBlockMask m;
  m.Bm = Bm, m.Hm = Hm, m.bq = bq, m.bk = bk;
  m.nqb = (Lq + bq - 1) / bq, m.nkb = (Lk + bk - 1) / bk;
  m.blocks.resize(size_t(Bm) * Hm * m.nqb * m.nkb);
  std::uniform_real_distribution<double> u(0, 1);
  int32_t T = 0;
  for (int32_t& e : m.blocks) {
    const double x = u(rng);
    if (x < p_empty) {
      e = BlockMask::kEmpty;
    } else if (x < p_empty + p_full) {
      e = BlockMask::kFull;
    } else {
      e = T++;
      for (int r = 0; r < bq; ++r) {
        const bool dead_row = u(rng) < 0.1;
        for (int c = 0; c < bk; ++c) m.tiles.push_back(!dead_row && u(rng) < 0.6);
      }
    }
  }
  return m;
}

// The dense boolean mask [Bm, Hm, Lq, Lk] this block mask stands for.
std::vector<uint8_t> expand(const OwnedBlockMask& m, int Lq, int Lk) {
  std::vector<uint8_t> dense(size_t(m.Bm) * m.Hm * Lq * Lk);
  size_t n = 0;
  for (int b = 0; b < m.Bm; ++b)
    for (int h = 0; h < m.Hm; ++h)
      for (int i = 0; i < Lq; ++i)
        for (int j = 0; j < Lk; ++j) dense[n++] = m.allows(b, h, i, j);
  return dense;
}

struct Shape {
  int B, Lq, Lk, Hq, Hkv, d, bq, bk;
};

class BlockMaskTest : public PooledErrorTest {};

TEST_F(BlockMaskTest, MatchesFloat64ReferenceWithEveryOption) {
  auto rng = make_rng(0xb10c);
  const Shape shapes[] = {
      {1, 1, 1, 1, 1, 8, 1, 1},       {2, 3, 17, 2, 1, 16, 1, 5},     {1, 17, 3, 3, 3, 33, 3, 2},
      {2, 67, 130, 4, 2, 16, 64, 64}, {1, 100, 1000, 2, 1, 24, 17, 100}, {1, 130, 257, 2, 2, 64, 64, 256},
      {3, 65, 65, 2, 1, 20, 100, 37}, {1, 200, 180, 1, 1, 40, 128, 128},
  };
  for (const Shape& sh : shapes) {
    for (int variant = 0; variant < 6; ++variant) {
      Config s;
      s.B = sh.B, s.Lq = sh.Lq, s.Lk = sh.Lk, s.Hq = sh.Hq, s.Hkv = sh.Hkv, s.d = sh.d, s.dv = sh.d + 3;
      const int Bm = variant % 2 ? s.B : 1, Hm = variant % 3 ? s.Hq : 1;
      const OwnedBlockMask m = random_block_mask(rng, Bm, Hm, s.Lq, s.Lk, sh.bq, sh.bk);
      s.opt.block_mask = m.view();
      switch (variant) {
        case 1: s.opt.causal = Causal::TopLeft; break;
        case 2: s.opt.window = {7, 3}, s.opt.softcap = 4.0f; s.set_alibi(true, rng); break;
        case 3: s.set_bool_mask({s.Lq, s.Lk}, rng, 0.8); s.want_probs = s.Lq * s.Lk < 50000; break;
        case 4: s.set_add_mask({1, s.Hq, s.Lq, s.Lk}, rng), s.set_key_lengths(rng); break;
        case 5: s.opt.causal = Causal::BottomRight, s.opt.dropout_p = 0.2f, s.opt.seed = rng(); break;
        default: break;
      }
      SCOPED_TRACE(s.describe() + " block " + std::to_string(sh.bq) + "x" + std::to_string(sh.bk) +
                   " variant " + std::to_string(variant));
      EXPECT_TRUE(ledger.check(run_case(s, rng)));
    }
  }
}

TEST_F(BlockMaskTest, PackedSequencesIndexTheirOwnPositions) {
  auto rng = make_rng(0xb10d);
  Config s;
  s.Hq = 2, s.Hkv = 1, s.d = 16, s.dv = 16;
  s.set_varlen({5, 70, 33}, {9, 64, 131});
  // Blocks for the longest sequences, plus extra rows and columns (accepted, unused).
  const OwnedBlockMask m = random_block_mask(rng, 3, 1, 70 + 20, 131 + 9, 16, 9);
  s.opt.block_mask = m.view();
  EXPECT_TRUE(ledger.check(run_case(s, rng)));
  s.opt.causal = Causal::BottomRight;
  EXPECT_TRUE(ledger.check(run_case(s, rng)));
}

TEST_F(BlockMaskTest, EveryBlockEmptyGivesMaskedRows) {
  auto rng = make_rng(0xb10e);
  Config s;
  s.Lq = 70, s.Lk = 90, s.Hq = 2, s.d = 8, s.dv = 8;
  OwnedBlockMask m = random_block_mask(rng, 1, 1, s.Lq, s.Lk, 32, 32, 1.0, 0.0);
  s.opt.block_mask = m.view();
  const Errors e = run_case(s, rng);  // the harness checks out = 0 and lse = −∞ per row
  EXPECT_FALSE(e.masked_rows_not_zero);
  EXPECT_FALSE(e.lse_inf_mismatch);
  EXPECT_TRUE(ledger.check(e));
}

// The block mask and the dense mask it stands for give the same bits: empty tiles
// skipped add nothing that a tile of −∞ would have added.
TEST(BlockMaskEquivalence, BitwiseEqualToItsDenseMaskF32ForwardAndBackward) {
  auto rng = make_rng(0xb10f);
  for (const Shape& sh : {Shape{2, 130, 200, 4, 2, 32, 64, 64}, Shape{1, 77, 301, 2, 1, 48, 13, 29},
                          Shape{1, 256, 256, 2, 2, 64, 128, 32}}) {
    for (int threads : {1, 2}) {
      Config blocked;
      blocked.B = sh.B, blocked.Lq = sh.Lq, blocked.Lk = sh.Lk, blocked.Hq = sh.Hq, blocked.Hkv = sh.Hkv;
      blocked.d = blocked.dv = sh.d;
      blocked.want_probs = true;
      const OwnedBlockMask m = random_block_mask(rng, sh.B, sh.Hq, sh.Lq, sh.Lk, sh.bq, sh.bk, 0.45, 0.3);
      blocked.opt.block_mask = m.view();
      blocked.opt.causal = threads == 2 ? Causal::BottomRight : Causal::None;
      Config dense = blocked;
      dense.opt.block_mask = {};
      const std::vector<uint8_t> bits = expand(m, sh.Lq, sh.Lk);
      dense.opt.mask = TensorView(bits.data(), DType::boolean, {sh.B, sh.Hq, sh.Lq, sh.Lk});
      const uint64_t seed = rng();
      with_threads(threads, [&] {
        const std::vector<float> a = run_fused_raw(blocked, seed), b = run_fused_raw(dense, seed);
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) {
          ASSERT_TRUE(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i]))) << "forward element " << i;
        }
        const std::vector<float> ga = run_backward_raw(blocked, seed), gb = run_backward_raw(dense, seed);
        for (size_t i = 0; i < ga.size(); ++i) ASSERT_EQ(ga[i], gb[i]) << "gradient element " << i;
      });
    }
  }
}

// bf16 inputs take the AMX kernel where the CPU has it (256-key spans skipped whole),
// else the portable path; either way the block mask equals its dense mask bitwise.
TEST(BlockMaskEquivalence, BitwiseEqualToItsDenseMaskBf16) {
  auto rng = make_rng(0xb110);
  const int B = 1, Lq = 200, Lk = 700, H = 2, d = 64;
  std::uniform_real_distribution<float> u(-2, 2);
  std::vector<uint16_t> q(size_t(B) * Lq * H * d), k(size_t(B) * Lk * H * d), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (uint16_t& x : *t) x = detail::f32_to_bf16(u(rng));
  OwnedBlockMask m = random_block_mask(rng, 1, H, Lq, Lk, 64, 64, 0.5, 0.25);
  // Queries 64 … 127 of head 0 see no key: whole query blocks of the kernel with no
  // key block to visit.
  for (int kb = 0; kb < m.nkb; ++kb) m.at(0, 0, 1, kb) = BlockMask::kEmpty;
  const std::vector<uint8_t> bits = expand(m, Lq, Lk);
  SCOPED_TRACE("bf16 path: " + cpu_info().bf16_path);
  // The AMX kernel's own choice of query blocks per work item, and forced groupings
  // (ATTN_AMX_GROUP, ATTN_AMX_PANEL; ignored by the other paths).
  const char* const plans[][2] = {{nullptr, nullptr}, {"3", "64"}, {"7", "1000000"}, {"2", "128"}};
  for (const auto& plan : plans) {
    const ScopedEnv group("ATTN_AMX_GROUP", plan[0]), panel("ATTN_AMX_PANEL", plan[1]);
    std::vector<uint16_t> out[2];
    std::vector<float> lse[2];
    for (int which = 0; which < 2; ++which) {
      AttentionOptions o;
      if (which == 0) o.block_mask = m.view();
      else o.mask = TensorView(bits.data(), DType::boolean, {1, H, Lq, Lk});
      out[which].assign(size_t(B) * Lq * H * d, 0);
      lse[which].assign(size_t(B) * H * Lq, 0);
      attention(TensorView(q.data(), DType::bf16, {B, Lq, H, d}), TensorView(k.data(), DType::bf16, {B, Lk, H, d}),
                TensorView(v.data(), DType::bf16, {B, Lk, H, d}),
                TensorView(out[which].data(), DType::bf16, {B, Lq, H, d}), o,
                TensorView(lse[which].data(), DType::f32, {B, H, Lq}));
    }
    const std::string where = std::string("group ") + (plan[0] ? plan[0] : "auto");
    EXPECT_EQ(out[0], out[1]) << where;
    for (size_t i = 0; i < lse[0].size(); ++i) ASSERT_EQ(lse[0][i], lse[1][i]) << where << ", lse " << i;
    for (int i = 64; i < 128; ++i) {
      EXPECT_EQ(lse[0][i], -INFINITY) << where << ", row " << i << " sees no key";
      EXPECT_EQ(out[0][size_t(i) * H * d], 0) << where << ", row " << i << " sees no key";
    }
  }
}

// The reference reads the block mask itself; it must agree with this test's own
// expansion (a check on the oracle, in float64 rounded to f32).
TEST(BlockMaskEquivalence, ReferenceAgreesWithTheDenseExpansion) {
  auto rng = make_rng(0xb111);
  const int Lq = 37, Lk = 53, H = 3, d = 8;
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(size_t(Lq) * H * d), k(size_t(Lk) * H * d), v(k.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = u(rng);
  const OwnedBlockMask m = random_block_mask(rng, 1, H, Lq, Lk, 5, 7);
  const std::vector<uint8_t> bits = expand(m, Lq, Lk);
  std::vector<float> out[2];
  for (int which = 0; which < 2; ++which) {
    AttentionOptions o;
    if (which == 0) o.block_mask = m.view();
    else o.mask = TensorView(bits.data(), DType::boolean, {1, H, Lq, Lk});
    out[which].assign(size_t(Lq) * H * d, 0);
    attention_reference(TensorView(q.data(), DType::f32, {1, Lq, H, d}), TensorView(k.data(), DType::f32, {1, Lk, H, d}),
                        TensorView(v.data(), DType::f32, {1, Lk, H, d}), TensorView(out[which].data(), DType::f32, {1, Lq, H, d}), o);
  }
  EXPECT_EQ(out[0], out[1]);
}

class BlockMaskGradTest : public PooledGradTest {};

TEST_F(BlockMaskGradTest, GradientsMatchFloat64Reference) {
  auto rng = make_rng(0xb112);
  const Shape shapes[] = {{1, 3, 17, 1, 1, 8, 2, 3}, {2, 67, 130, 4, 2, 16, 64, 64}, {1, 129, 140, 2, 1, 32, 17, 100}};
  for (const Shape& sh : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      Config s;
      s.B = sh.B, s.Lq = sh.Lq, s.Lk = sh.Lk, s.Hq = sh.Hq, s.Hkv = sh.Hkv, s.d = sh.d, s.dv = sh.d;
      const OwnedBlockMask m = random_block_mask(rng, variant == 1 ? s.B : 1, s.Hq, s.Lq, s.Lk, sh.bq, sh.bk);
      s.opt.block_mask = m.view();
      if (variant == 1) s.opt.causal = Causal::TopLeft;
      if (variant == 2) s.opt.softcap = 3.0f, s.opt.dropout_p = 0.1f, s.opt.seed = rng();
      SCOPED_TRACE(s.describe());
      EXPECT_TRUE(ledger.check(run_backward_case(s, rng)));
    }
  }
}

// Proof that the kernels skip what the block mask removes: a user tile hook (which
// the kernels call once per score tile they compute) must never see a tile that lies
// wholly inside empty blocks, while the results still match the reference.
// The tiles' sizes are the target's (64 × 64 on AVX-512, 48 queries × 32 keys on
// AVX2), so a tile may straddle two documents' query ranges: it is removed only when
// its whole rectangle misses every non-empty block.
struct TileLog {
  std::mutex mu;
  std::vector<std::array<int, 4>> tiles;  // (i0, rows, j0, cols) of each computed tile, head 0
};
void log_tile(const void* ctx, float*, int64_t, int, int h, int i0, int rows, int j0, int cols) {
  auto* log = static_cast<TileLog*>(const_cast<void*>(ctx));
  if (h != 0) return;
  std::lock_guard<std::mutex> lock(log->mu);
  log->tiles.push_back({i0, rows, j0, cols});
}

TEST(BlockMaskSkipping, EmptyBlocksAreNeverComputed) {
  auto rng = make_rng(0xb113);
  const int Lq = 256, Lk = 512, d = 32;
  // Block-diagonal: 4 documents of 64 queries × 128 keys; everything else empty.
  OwnedBlockMask m;
  m.bq = 64, m.bk = 128, m.nqb = 4, m.nkb = 4;
  m.blocks.assign(16, BlockMask::kEmpty);
  for (int t = 0; t < 4; ++t) m.at(0, 0, t, t) = BlockMask::kFull;
  std::uniform_real_distribution<float> u(-1, 1);
  std::vector<float> q(size_t(Lq) * d), k(size_t(Lk) * d), v(k.size()), out(q.size());
  for (auto* t : {&q, &k, &v})
    for (float& x : *t) x = u(rng);
  TileLog log;
  detail::UserMods mods;
  mods.ctx = &log;
  mods.tile = &log_tile;
  mods.score = [](const void*, double s, int, int, int, int) { return s; };
  mods.mask = [](const void*, int, int, int, int) { return true; };
  AttentionOptions o;
  o.block_mask = m.view();
  detail::attention_with_mods(TensorView(q.data(), DType::f32, {1, Lq, 1, d}), TensorView(k.data(), DType::f32, {1, Lk, 1, d}),
                              TensorView(v.data(), DType::f32, {1, Lk, 1, d}), TensorView(out.data(), DType::f32, {1, Lq, 1, d}),
                              o, {}, {}, &mods);
  ASSERT_FALSE(log.tiles.empty());
  std::set<std::array<int, 4>> seen(log.tiles.begin(), log.tiles.end());
  int64_t area = 0;
  for (auto [i0, rows, j0, cols] : seen) {
    // Some document's block (queries 64t.., keys 128t..) must overlap the tile.
    bool overlaps = false;
    for (int t = 0; t < 4; ++t) {
      overlaps |= i0 < 64 * (t + 1) && i0 + rows > 64 * t && j0 < 128 * (t + 1) && j0 + cols > 128 * t;
    }
    EXPECT_TRUE(overlaps) << "computed a removed tile: queries " << i0 << "+" << rows << ", keys " << j0 << "+"
                          << cols;
    area += int64_t{rows} * cols;
  }
  // The documents cover a quarter of the 256 × 512 plane; tiles that straddle two
  // documents' queries add at most as much again, so under half the plane is computed.
  EXPECT_LE(area, int64_t{Lq} * Lk / 2);
  std::vector<float> ref(out.size());
  attention_reference(TensorView(q.data(), DType::f32, {1, Lq, 1, d}), TensorView(k.data(), DType::f32, {1, Lk, 1, d}),
                      TensorView(v.data(), DType::f32, {1, Lk, 1, d}), TensorView(ref.data(), DType::f32, {1, Lq, 1, d}), o);
  for (size_t i = 0; i < out.size(); ++i) ASSERT_NEAR(out[i], ref[i], 1e-5) << i;
}

TEST(BlockMaskErrors, NameTheArgumentAndWhatWasExpected) {
  const int Lq = 10, Lk = 20, H = 2, d = 4;
  std::vector<float> q(size_t(Lq) * H * d, 0.5f), k(size_t(Lk) * H * d, 0.25f), v(k.size(), 1.0f), out(q.size());
  const TensorView qv(q.data(), DType::f32, {1, Lq, H, d}), kv(k.data(), DType::f32, {1, Lk, H, d}),
      vv(v.data(), DType::f32, {1, Lk, H, d}), ov(out.data(), DType::f32, {1, Lq, H, d});
  OwnedBlockMask good;
  good.bq = 4, good.bk = 8, good.nqb = 3, good.nkb = 3;
  good.blocks.assign(9, BlockMask::kFull);
  good.blocks[4] = 0;
  good.tiles.assign(32, 1);
  auto run = [&](const BlockMask& bm) {
    AttentionOptions o;
    o.block_mask = bm;
    attention(qv, kv, vv, ov, o);
  };
  EXPECT_NO_THROW(run(good.view()));
  {
    BlockMask bm = good.view();
    bm.block_q = 0;
    expect_attn_error([&] { run(bm); }, "block_q and block_k must be >= 1");
  }
  {
    BlockMask bm = good.view();
    bm.blocks = TensorView(good.blocks.data(), DType::i32, {1, 1, 3, 2});
    expect_attn_error([&] { run(bm); }, "dimension 3 (ceil(Lk/block_k)) must be 3");
  }
  {
    BlockMask bm = good.view();
    bm.blocks = TensorView(good.blocks.data(), DType::i32, {1, 3, 3, 1});
    expect_attn_error([&] { run(bm); }, "dimension 1 (Hq) must be 1 or 2");
  }
  {
    BlockMask bm = good.view();
    bm.blocks = TensorView(good.tiles.data(), DType::boolean, {1, 1, 3, 3});
    expect_attn_error([&] { run(bm); }, "blocks must have dtype i32");
  }
  {
    BlockMask bm = good.view();
    bm.tiles = TensorView(good.tiles.data(), DType::boolean, {1, 8, 4});
    expect_attn_error([&] { run(bm); }, "tiles must be boolean [T, block_q=4, block_k=8]");
  }
  {
    OwnedBlockMask bad = good;
    bad.blocks[7] = 1;  // only tile 0 exists
    expect_attn_error([&] { run(bad.view()); }, "blocks[0][0][2][1] must be BlockMask::kEmpty (-1), kFull (-2) or a tile index in [0, 1)");
  }
  {
    OwnedBlockMask bad = good;
    bad.blocks[0] = -3;
    bad.tiles.clear();
    bad.blocks[4] = BlockMask::kFull;
    expect_attn_error([&] { run(bad.view()); }, "tiles absent), got -3");
  }
  {  // A KV cache takes no block mask.
    std::vector<float> kc(size_t(32) * H * d, 0.0f), vc(kc.size(), 0.0f), o1(size_t(H) * d);
    std::vector<int32_t> lens{5};
    KVCache cache;
    cache.k = TensorView(kc.data(), DType::f32, {1, 32, H, d});
    cache.v = TensorView(vc.data(), DType::f32, {1, 32, H, d});
    AttentionOptions o;
    o.block_mask = good.view();
    expect_attn_error(
        [&] {
          attention_with_kvcache(TensorView(q.data(), DType::f32, {1, 1, H, d}), cache,
                                 TensorView(lens.data(), DType::i32, {1}), TensorView(o1.data(), DType::f32, {1, 1, H, d}), o);
        },
        "options.block_mask is not supported with a KV cache");
  }
}

}  // namespace
}  // namespace attn::testing
