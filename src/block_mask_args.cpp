// options.block_mask: shapes, dtypes, block sizes and every entry checked once per
// call, so the kernels can index tiles without bounds checks.
#include "block_mask_args.hpp"

#include <string>
#include <vector>

#include "device.hpp"

namespace attn::detail {
namespace {

int64_t blocks_for(int64_t length, int block) { return (length + block - 1) / block; }

}  // namespace

void bind_block_mask(const Checker& c, const BlockMask& bm, int B, int Hq, int64_t max_lq,
                     int64_t max_lk, bool varlen, Problem* p) {
  if (bm.empty()) return;
  c.require(bm.block_q >= 1 && bm.block_k >= 1, [&] {
    return "options.block_mask.block_q and block_k must be >= 1, got " + std::to_string(bm.block_q) + " and " +
           std::to_string(bm.block_k);
  });
  const TensorView& t = bm.blocks;
  c.require(t.dtype() == DType::i32,
            [&] { return std::string("options.block_mask.blocks must have dtype i32, got ") + dtype_name(t.dtype()); });
  c.require(t.rank() == 4, [&] {
    return "options.block_mask.blocks must have rank 4 [B or 1, Hq or 1, "
           "ceil(Lq/block_q), ceil(Lk/block_k)], got " +
           t.describe();
  });
  c.nonnegative_strides(t, "options.block_mask.blocks");
  const int64_t want[4] = {B, Hq, blocks_for(max_lq, bm.block_q), blocks_for(max_lk, bm.block_k)};
  const char* names[4] = {"B", "Hq", "ceil(Lq/block_q)", "ceil(Lk/block_k)"};
  int64_t strides[4] = {0, 0, 0, 0};
  for (int i = 0; i < 4; ++i) {
    const int64_t sz = t.size(i);
    const bool ok = i < 2 ? (sz == 1 || sz == want[i]) : (varlen ? sz >= want[i] : sz == want[i]);
    if (!ok) {
      c.fail("options.block_mask.blocks " + t.describe() + ": dimension " + std::to_string(i) + " (" +
             names[i] + ") must be " + (i < 2 ? "1 or " : "") + std::to_string(want[i]) +
             (varlen && i >= 2 ? " or more" : "") + " for block_q=" + std::to_string(bm.block_q) +
             ", block_k=" + std::to_string(bm.block_k) + ", got " + std::to_string(sz));
    }
    strides[i] = sz == 1 ? 0 : t.stride(i);
  }
  c.require(t.data() != nullptr || t.numel() == 0, "options.block_mask.blocks has a null data pointer");

  int64_t ntiles = 0;
  const TensorView& tl = bm.tiles;
  if (!tl.empty()) {
    c.require(tl.dtype() == DType::boolean,
              [&] { return std::string("options.block_mask.tiles must be boolean, got ") + dtype_name(tl.dtype()); });
    c.require(tl.rank() == 3 && tl.size(1) == bm.block_q && tl.size(2) == bm.block_k, [&] {
      return "options.block_mask.tiles must be boolean [T, block_q=" + std::to_string(bm.block_q) +
             ", block_k=" + std::to_string(bm.block_k) + "], got " + tl.describe();
    });
    c.nonnegative_strides(tl, "options.block_mask.tiles");
    c.last_contiguous(tl, "options.block_mask.tiles");
    c.require(tl.data() != nullptr || tl.numel() == 0, "options.block_mask.tiles has a null data pointer");
    ntiles = tl.size(0);
    p->bm_tiles = tl.data_as<const uint8_t>();
    p->bm_t = tl.stride(0);
    p->bm_r = tl.stride(1);
  }

  // Every entry: kEmpty, kFull or a tile index < T (read through a host copy when the
  // table is in a device's memory).
  const int32_t* base = t.data_as<const int32_t>();
  std::vector<int32_t> host_copy;
  if (!t.device().is_cpu() && t.numel() > 0) {
    int64_t span = 1;
    for (int i = 0; i < 4; ++i) span += (t.size(i) - 1) * t.stride(i);
    host_copy.resize(static_cast<size_t>(span));
    copy_to_host(c, host_copy.data(), t, host_copy.size() * sizeof(int32_t), "options.block_mask.blocks");
    base = host_copy.data();
  }
  for (int64_t i0 = 0; i0 < t.size(0); ++i0) {
    for (int64_t i1 = 0; i1 < t.size(1); ++i1) {
      for (int64_t i2 = 0; i2 < t.size(2); ++i2) {
        const int32_t* row = base + i0 * t.stride(0) + i1 * t.stride(1) + i2 * t.stride(2);
        for (int64_t i3 = 0; i3 < t.size(3); ++i3) {
          const int32_t e = row[i3 * t.stride(3)];
          if (e == BlockMask::kEmpty || e == BlockMask::kFull || (e >= 0 && e < ntiles)) continue;
          c.fail("options.block_mask.blocks[" + std::to_string(i0) + "][" + std::to_string(i1) + "][" +
                 std::to_string(i2) + "][" + std::to_string(i3) + "] must be BlockMask::kEmpty (-1), "
                 "kFull (-2) or a tile index in [0, " + std::to_string(ntiles) + ") (tiles " +
                 (tl.empty() ? std::string("absent") : tl.describe()) + "), got " + std::to_string(e));
        }
      }
    }
  }
  p->bm_blocks = t.data_as<const int32_t>();
  p->bm_b = strides[0], p->bm_h = strides[1], p->bm_qb = strides[2], p->bm_kb = strides[3];
  p->bm_bq = bm.block_q;
  p->bm_bk = bm.block_k;
}

}  // namespace attn::detail
