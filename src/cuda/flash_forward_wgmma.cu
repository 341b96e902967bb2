// The attention forward on Hopper's warpgroup products (wgmma, sm_90a), for the calls
// that need nothing but the band: bf16 or f16 inputs, d = 64 or 128, no softcap, ALiBi,
// masks, block mask or dropout (causal, windows, varlen, key lengths and lse are kept).
// Other calls, and GPUs other than sm_90, take flash_forward.cu's mma.sync kernel.
//
// One thread block is one warpgroup (4 warps, 128 threads) that owns 64 query rows of
// one (sequence, head). Q, K and V tiles sit in shared memory in the 128-byte-swizzled
// layout the tensor cores read directly (wgmma.cuh; bench/cuda/wgmma_probe checked its
// descriptors on an H200): S = Q·Kᵀ is D/16 products of m64n64k16 with both operands in
// shared memory, and O += P·V is (D/64)·4 products with P from registers (its f32
// accumulators rounded in place: the accumulator layout is the A-fragment layout) and V
// as stored. The softmax, the band and the semantics of removed keys are those of the
// mma.sync kernel, register for register: a warp's 16 rows of the warpgroup's m64
// accumulator have mma.sync's C layout.
//
// Against the mma.sync kernel this removes the fragment loads (ldmatrix) and most of the
// instructions the tensor cores waited on. Within a block, tile j's S is issued together
// with tile j − 1's P·V, and the softmax of j runs while that P·V finishes
// (FlashAttention-3's overlap inside a warpgroup); across blocks, 3 (d = 128) or 4
// (d = 64) per multiprocessor, by registers and shared memory, overlap one block's
// softmax with another's products. The copies are cp.async: V of a tile is in flight
// during S, the next K during the softmax. Tried on an H200 and not kept
// (docs/PERFORMANCE.md): Q's operands in registers and 128-key tiles (both cost a block
// per multiprocessor), two K buffers without the overlap.
#include "cuda/flash_forward_wgmma.hpp"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/mma_fragments.cuh"
#include "cuda/nonfinite_tiles.cuh"
#include "cuda/score_mods.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/wgmma_rows.cuh"

namespace attn::cuda {
namespace {

namespace wg = wgmma;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kRows = 64;      // query rows per block: the m of the products
constexpr int kKeys = 64;      // keys per tile: the n of S's products, the k of P·V's

/// Bytes of a tile of `rows` rows × D operands: D / 64 panels of 64 columns, each
/// `rows` swizzled rows of 128 bytes (wg::sw128_offset).
template <int D>
constexpr int tile_bytes(int rows) {
  return rows * D * 2;
}

// v_bad: the pre-pass's flag per kKeys-key tile of V (nonfinite_tiles.cuh), v_tiles per
// head.
template <class T, int D>
__global__ void __launch_bounds__(kThreads)
    flash_forward_wgmma_kernel(ForwardParams p, const SeqDesc* seqs, const uint8_t* v_bad, int v_tiles) {
#ifdef ATTN_HAVE_WGMMA
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr int kNt = kKeys / 8;  // n-tiles of a warp's score rows
  constexpr int kDt = D / 8;      // n-tiles of a warp's output rows
  // The swizzle is a function of address bits: its regions start on a 1 KiB boundary
  // (1 KiB more is launched).
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_at = shared_address(smem_raw);
  unsigned char* q_s = smem_raw + ((1024 - raw_at % 1024) % 1024);
  unsigned char* k_s = q_s + tile_bytes<D>(kRows);
  unsigned char* v_s = k_s + tile_bytes<D>(kKeys);  // two V buffers: tile parity
  T* p_s = reinterpret_cast<T*>(v_s + 2 * tile_bytes<D>(kKeys));  // [4 warps][16][kKeys], the gated path's P

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int q0 = blockIdx.x * kRows;
  if (q0 >= s.Lq) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int hk = h / (p.Hq / p.Hkv);
  const T* q = static_cast<const T*>(p.q) + s.q_offset + int64_t{h} * p.q_head;
  const T* k = static_cast<const T*>(p.k) + s.k_offset + int64_t{hk} * p.k_head;
  const T* v = static_cast<const T*>(p.v) + s.v_offset + int64_t{hk} * p.v_head;
  const uint8_t* v_bad_head = v_bad + (int64_t{b} * p.Hkv + hk) * v_tiles;

  start_swizzled_tile<T, D, kRows>(q_s, q, p.q_row, q0, s.Lq, rows_vectorizable<T>(q, p.q_row));
  cp_async_commit();
  // This thread's two rows of the warp's 16: A = row g, B = row g + 8.
  const int row_a = q0 + warp * 16 + g, row_b = row_a + 8;
  const Band band_a = band_of_row(p, s, row_a), band_b = band_of_row(p, s, row_b);
  const int last_row = min(q0 + kRows, s.Lq) - 1;
  const Band band_first = band_of_row(p, s, q0), band_last = band_of_row(p, s, last_row);
  const int64_t key_lo = max(int64_t{0}, band_first.lo);
  const int64_t key_hi = min(int64_t{s.Lk} - 1, band_last.hi);

  float o[kDt][4];
#pragma unroll
  for (int n = 0; n < kDt; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
  SoftmaxRows rows{band_a, band_b, band_first, band_last, p.scale * kLog2e};

  const bool k_vec = rows_vectorizable<T>(k, p.k_row), v_vec = rows_vectorizable<T>(v, p.v_row);
  int64_t j0 = key_lo <= key_hi ? (key_lo / kKeys) * kKeys : -1;
  if (j0 >= 0) start_swizzled_tile<T, D, kKeys>(k_s, k, p.k_row, static_cast<int>(j0), s.Lk, k_vec);
  cp_async_commit();

  const uint64_t q_desc = wg::descriptor(shared_address(q_s), wg::kSw128Lbo, wg::kSw128Sbo, wg::kSwizzle128);
  const uint64_t k_desc = wg::descriptor(shared_address(k_s), wg::kSw128Lbo, wg::kSw128Sbo, wg::kSwizzle128);
  const uint64_t v_desc = wg::descriptor(shared_address(v_s), wg::kSw128Lbo, wg::kSw128Sbo, wg::kSwizzle128);
  // A descriptor's start address is in 16-byte units (its low 14 bits): an offset of
  // `bytes` into a region adds bytes / 16.
  auto at = [](uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); };

  // S = Q·Kᵀ: k-step ks reads columns 16·ks … of Q's and K's rows, 32 bytes further
  // along a swizzled row, a panel (rows · 128 bytes) further every 4 steps. The first
  // k-step overwrites the accumulators (scale-d = 0). Issued, not waited for.
  auto issue_scores = [&](float (*sc)[4]) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      wg::ss_m64n64k16<kHalf>(&sc[0][0], at(q_desc, (ks / 4) * kRows * 128 + (ks % 4) * 32),
                              at(k_desc, (ks / 4) * kKeys * 128 + (ks % 4) * 32), ks > 0 ? 1 : 0);
    }
  };
  // FlashAttention-3's overlap inside a warpgroup: tile j's S and tile j − 1's P·V
  // are in flight together, and the softmax of j runs while P·V of j − 1 finishes.
  // V has two buffers (tile parity); K one.
  uint32_t pa_prev[kKeys / 16][4];
  bool have_prev = false, slow_prev = false;
  int vb = 0;
  while (j0 >= 0) {
    unsigned char* v_tile = v_s + vb * tile_bytes<D>(kKeys);
    start_swizzled_tile<T, D, kKeys>(v_tile, v, p.v_row, static_cast<int>(j0), s.Lk, v_vec);
    cp_async_commit();
    const int64_t next = j0 + kKeys <= key_hi ? j0 + kKeys : -1;
    cp_async_wait<1>();  // Q, K of this tile and V of the last (this tile's V in flight)
    const bool slow = v_bad_head[j0 / kKeys] != 0;
    wg::fence_shared_for_async();
    __syncthreads();
    float sc[kNt][4];
    pin_all<kDt>(o);
    wg::fence();
    issue_scores(sc);
    wg::commit();
    const uint64_t v_prev = at(v_desc, (vb ^ 1) * tile_bytes<D>(kKeys));
    if (have_prev && !slow_prev) issue_values<kHalf, D, kKeys>(o, pa_prev, v_prev);
    wg::commit();
    wg::wait<1>();  // S (P·V of the last tile may run on)
    pin_all<kNt>(sc);
    __syncthreads();  // every warp's S has read K: the next tile's K may come
    if (next >= 0) start_swizzled_tile<T, D, kKeys>(k_s, k, p.k_row, static_cast<int>(next), s.Lk, k_vec);
    cp_async_commit();
    float alpha_a, alpha_b;
    rows.step<kNt>(sc, j0, t, alpha_a, alpha_b);
    wg::wait<0>();
    pin_all<kDt>(o);
    if (have_prev && slow_prev) {
      gated_values<T, D, kKeys>(o, pa_prev, p_s + warp * 16 * kKeys, v_s + (vb ^ 1) * tile_bytes<D>(kKeys));
    }
    rescale_rows<kDt>(o, alpha_a, alpha_b);
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) a_from_accumulator<T>(sc, kk, pa_prev[kk]);
    have_prev = true, slow_prev = slow;
    __syncthreads();  // the last tile's V buffer is free for the next tile's
    j0 = next;
    vb ^= 1;
  }
  if (have_prev) {
    cp_async_wait<0>();
    wg::fence_shared_for_async();
    __syncthreads();
    if (!slow_prev) {
      accumulate_values<kHalf, D, kKeys>(o, pa_prev, at(v_desc, (vb ^ 1) * tile_bytes<D>(kKeys)));
    } else {
      gated_values<T, D, kKeys>(o, pa_prev, p_s + warp * 16 * kKeys, v_s + (vb ^ 1) * tile_bytes<D>(kKeys));
    }
  }
  cp_async_wait<0>();

  rows.finish<T, kDt>(o, p, s, h, row_a, row_b, t);
#endif
}

template <class T, int D>
cudaError_t launch(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  auto* kernel = &flash_forward_wgmma_kernel<T, D>;
  // Q, K and two V tiles, the gated path's P, and 1 KiB to align the swizzled regions:
  // 73 KiB at d = 128 (3 blocks per multiprocessor), 37 KiB at d = 64.
  const size_t smem = 1024 + size_t(tile_bytes<D>(kRows)) + 3 * size_t(tile_bytes<D>(kKeys)) +
                      size_t{kRows} * kKeys * sizeof(T);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  NonfiniteTiles v_bad;
  e = v_bad.make<T, T, D, kKeys>(p, seqs, nullptr, TileSource::values, p.v, p.v_row, p.v_head, p.Hkv, stream);
  if (e == cudaSuccess) {
    const dim3 grid((p.max_lq + kRows - 1) / kRows, p.Hq, p.B);
    kernel<<<grid, kThreads, smem, stream>>>(p, seqs, v_bad.flags, v_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f = v_bad.free(stream);
  return e != cudaSuccess ? e : f;
}

}  // namespace

bool wgmma_forward_applies(const ForwardParams& p) {
#ifndef ATTN_CUDA_SM90A
  (void)p;
  return false;
#else
  if (p.in == Elem::f32 || (p.d != 64 && p.d != 128)) return false;
  if (p.softcap > 0.0f || p.alibi != nullptr || p.add_mask != nullptr || p.bool_mask != nullptr ||
      p.bm_blocks != nullptr || p.dropout_p > 0.0f) {
    return false;
  }
  if (const char* env = std::getenv("ATTN_CUDA_WGMMA"); env != nullptr && std::strcmp(env, "0") == 0) return false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, p.device) != cudaSuccess) return false;
  return major == 9;  // wgmma is sm_90a's alone (not in later architectures)
#endif
}

cudaError_t wgmma_forward(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  const bool half = p.in == Elem::f16;
  if (p.d == 64) return half ? launch<__half, 64>(p, seqs, stream) : launch<__nv_bfloat16, 64>(p, seqs, stream);
  return half ? launch<__half, 128>(p, seqs, stream) : launch<__nv_bfloat16, 128>(p, seqs, stream);
}

}  // namespace attn::cuda
