// A warp-specialised attention forward for Hopper (sm_90a), FlashAttention-3's layout:
// one producer warpgroup whose first thread copies tiles with the bulk tensor copy engine
// (TMA), and two consumer warpgroups of 64 query rows each that share every K and V
// tile. The same calls as flash_forward_wgmma.cu (bf16/f16, d = 64 or 128, nothing but
// the band), opt-in with ATTN_CUDA_WGMMA=ws.
//
// UNVERIFIED: written and compiled for sm_90a on a machine without a GPU (2026-11-29),
// after the wgmma kernel's session had spent its GPU time. The next GPU session should
// A/B it in one call: `bash scripts/gpu-ab-env.sh NAME ATTN_CUDA_WGMMA 1 ws` (the forward
// GPU tests and timings with each); a deadlock shows as tests that time out.
//
// Why: ncu put the wgmma kernel's time on shared memory (70% of the L1/shared pipe: the
// cp.async copies and the products' operand reads share it) and on latency (3 blocks of
// one warpgroup per SM). Here the copy engine moves the tiles outside the warps' pipes,
// each tile feeds 128 query rows instead of 64, S is one m64n128k16 product per k-step
// (A read once per 128 keys), and setmaxnreg moves the producer's registers to the
// consumers (24 and 240 a thread).
//
// Pipeline: two stages of K and V. The producer waits until the consumers released a
// stage (an mbarrier both consumer warpgroups arrive on), then asks for the next tile's K
// and V panels on that stage's "full" barriers. A consumer, per tile j: waits for K,
// issues S = Q·Kᵀ and the previous tile's O += P·V together, runs the softmax of j
// while that P·V finishes, then releases the previous tile's stage.
//
// The copy engine fills rows past the tensor's end with zeros, but inside a packed or
// padded tensor the rows past a sequence's last key are other keys: their scores are
// removed by the band, and their values would meet p = 0 on the tensor cores (0·∞ =
// NaN), so a partial last tile takes the element-by-element P·V, as a tile with a NaN
// or ±∞ does.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/flash_forward_wgmma.hpp"
#include "cuda/mma_fragments.cuh"
#include "cuda/nonfinite_tiles.cuh"
#include "cuda/score_mods.cuh"
#include "cuda/wgmma.cuh"
#include "cuda/wgmma_rows.cuh"

namespace attn::cuda {
namespace {

namespace wg = wgmma;

constexpr int kConsumers = 2;                  // consumer warpgroups, 64 query rows each
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr int kRows = 64 * kConsumers;         // query rows per block
constexpr int kKeys = 128;                     // keys per tile
constexpr int kStages = 2;

/// The block's shared memory from its 1 KiB-aligned start: Q [kRows][D], K and V
/// [kStages][kKeys][D] (swizzled panels of 64 columns), the gated path's P per consumer
/// warp, then the mbarriers.
template <class T, int D>
struct Smem {
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kRows * D * 2;
  static constexpr int kV = kK + kStages * kKeys * D * 2;
  static constexpr int kP = kV + kStages * kKeys * D * 2;
  static constexpr int kBars = kP + kConsumers * 4 * 16 * kKeys * int(sizeof(T));
  static constexpr int kBytes = kBars + 8 * (1 + 3 * kStages);  // full_q, full_k[], full_v[], empty[]
};

#ifdef ATTN_HAVE_WGMMA
__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(bar)), "r"(count) : "memory");
}
/// One arrival that also announces `bytes` the copy engine will complete on this barrier.
__device__ __forceinline__ void bar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(bar)) : "memory");
}
/// Waits until the barrier's phase of this parity has completed. After ~2·10⁹ cycles
/// (about a second; a tile takes microseconds) it traps: while the kernel is unverified,
/// a pipeline that never completes a phase fails the call instead of hanging it. (The
/// clock is read inside the asm: C++ around it cost the consumers 244 bytes of spills.)
__device__ __forceinline__ void bar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .u64 t0, t1;\nmov.u64 t0, %%clock64;\n"
      "wait_again:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@p bra wait_done;\n"
      "mov.u64 t1, %%clock64;\n"
      "sub.u64 t1, t1, t0;\n"
      "setp.gt.u64 p, t1, 2000000000;\n"
      "@p trap;\n"
      "bra wait_again;\n"
      "wait_done:\n}\n" ::"r"(shared_address(bar)),
      "r"(parity)
      : "memory");
}

/// The box at (column c0, head c1, row c2) of a 3-d tensor map into shared memory, its
/// bytes completed on `bar`.
__device__ __forceinline__ void tma_load(void* dst, const CUtensorMap* map, uint64_t* bar, int c0, int c1, int c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5}], [%2];\n" ::
          "r"(shared_address(dst)),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}
#endif

// tq, tk, tv: 3-d tensor maps (column, head, row) of q, k and v with boxes of 64 columns
// × 1 head × kRows (q) or kKeys (k, v) rows, 128-byte swizzle; a sequence's first row is
// its offset over the row stride (a whole number, checked on the host). v_bad: the
// pre-pass's flag per kKeys-key tile of V, v_tiles per head.
template <class T, int D>
__global__ void __launch_bounds__(kThreads, 1)
    flash_forward_ws_kernel(const __grid_constant__ CUtensorMap tq, const __grid_constant__ CUtensorMap tk,
                            const __grid_constant__ CUtensorMap tv, ForwardParams p, const SeqDesc* seqs,
                            const uint8_t* v_bad, int v_tiles) {
#ifdef ATTN_HAVE_WGMMA
  using L = Smem<T, D>;
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr bool kHalf = std::is_same_v<T, __half>;
  constexpr int kNt = kKeys / 8, kDt = D / 8;
  constexpr uint32_t kTileBytes = kKeys * D * 2;
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw_at = shared_address(smem_raw);
  unsigned char* smem = smem_raw + ((1024 - raw_at % 1024) % 1024);
  unsigned char* q_s = smem + L::kQ;
  auto k_s = [&](int stage) { return smem + L::kK + stage * kTileBytes; };
  auto v_s = [&](int stage) { return smem + L::kV + stage * kTileBytes; };
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* full_q = bars;
  uint64_t* full_k = bars + 1;
  uint64_t* full_v = full_k + kStages;
  uint64_t* empty = full_v + kStages;

  const int b = blockIdx.z, h = blockIdx.y;
  const SeqDesc s = seqs[b];
  const int q0 = blockIdx.x * kRows;
  if (q0 >= s.Lq) return;  // the whole block
  const int hk = h / (p.Hq / p.Hkv);
  // The block's keys (every row of both consumers), the same on every thread.
  const int last_row = min(q0 + kRows, s.Lq) - 1;
  const int64_t key_lo = max(int64_t{0}, band_of_row(p, s, q0).lo);
  const int64_t key_hi = min(int64_t{s.Lk} - 1, band_of_row(p, s, last_row).hi);
  const int first_tile = key_lo <= key_hi ? static_cast<int>(key_lo / kKeys) : 0;
  const int tiles = key_lo <= key_hi ? static_cast<int>(key_hi / kKeys) - first_tile + 1 : 0;

  if (threadIdx.x == 0) {
    bar_init(full_q, 1);
    for (int st = 0; st < kStages; ++st) {
      bar_init(full_k + st, 1);
      bar_init(full_v + st, 1);
      bar_init(empty + st, kConsumers * 128);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  // The roles, one branch each (setmaxnreg takes effect where each warpgroup's role is
  // one branch of an if/else).
  const int group = threadIdx.x / 128;
  if (group == 0) {
    // The producer: one thread asks for every tile; the warpgroup's registers go to the
    // consumers.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n" ::: "memory");
    if (threadIdx.x == 0) {
      const int q_row0 = static_cast<int>(s.q_offset / p.q_row), k_row0 = static_cast<int>(s.k_offset / p.k_row),
                v_row0 = static_cast<int>(s.v_offset / p.v_row);
      bar_expect(full_q, kRows * D * 2);
      for (int pn = 0; pn < D / 64; ++pn) tma_load(q_s + pn * kRows * 128, &tq, full_q, pn * 64, h, q_row0 + q0);
      for (int it = 0; it < tiles; ++it) {
        const int st = it % kStages, use = it / kStages;
        if (use > 0) bar_wait(empty + st, (use - 1) & 1);
        const int j0 = (first_tile + it) * kKeys;
        bar_expect(full_k + st, kTileBytes);
        for (int pn = 0; pn < D / 64; ++pn) tma_load(k_s(st) + pn * kKeys * 128, &tk, full_k + st, pn * 64, hk, k_row0 + j0);
        bar_expect(full_v + st, kTileBytes);
        for (int pn = 0; pn < D / 64; ++pn) tma_load(v_s(st) + pn * kKeys * 128, &tv, full_v + st, pn * 64, hk, v_row0 + j0);
      }
    }
  } else {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n" ::: "memory");
    const int consumer = group - 1, ct = threadIdx.x - 128 * group;
    const int warp = ct / 32, lane = ct % 32, g = lane / 4, t = lane % 4;
    const int row_a = q0 + consumer * 64 + warp * 16 + g, row_b = row_a + 8;
    // This warpgroup's rows (all past the sequence's end in a last block: it still takes
    // part in every barrier, and writes nothing).
    const int wg_first = q0 + consumer * 64, wg_last = max(wg_first, min(wg_first + 64, s.Lq) - 1);
    SoftmaxRows rows{band_of_row(p, s, row_a), band_of_row(p, s, row_b), band_of_row(p, s, wg_first),
                     band_of_row(p, s, wg_last), p.scale * kLog2e};
    const uint8_t* v_bad_head = v_bad + (int64_t{b} * p.Hkv + hk) * v_tiles;
    T* pw = reinterpret_cast<T*>(smem + L::kP) + (consumer * 4 + warp) * 16 * kKeys;

    float o[kDt][4];
#pragma unroll
    for (int n = 0; n < kDt; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    auto desc = [](const unsigned char* at) {
      return wg::descriptor(shared_address(at), wg::kSw128Lbo, wg::kSw128Sbo, wg::kSwizzle128);
    };
    const uint64_t q_desc = desc(q_s + consumer * 64 * 128);  // this warpgroup's 64 rows of each panel
    auto at = [](uint64_t d, uint32_t bytes) { return d + (bytes >> 4); };

    bar_wait(full_q, 0);
    uint32_t pa_prev[kKeys / 16][4];
    bool slow_prev = false;
    int st_prev = 0;
    uint32_t parity_prev = 0;
    for (int it = 0; it < tiles; ++it) {
      const int st = it % kStages;
      const uint32_t parity = (it / kStages) & 1;
      const int64_t j0 = int64_t{first_tile + it} * kKeys;
      // A tile with a NaN or ±∞ value, or past the sequence's last key, takes the
      // element-by-element P·V.
      const bool slow = v_bad_head[j0 / kKeys] != 0 || j0 + kKeys > s.Lk;
      bar_wait(full_k + st, parity);
      float sc[kNt][4];
      pin_all<kDt>(o);
      wg::fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        wg::ss_m64n128k16<kHalf>(&sc[0][0], at(q_desc, (ks / 4) * kRows * 128 + (ks % 4) * 32),
                                 at(desc(k_s(st)), (ks / 4) * kKeys * 128 + (ks % 4) * 32), ks > 0 ? 1 : 0);
      }
      wg::commit();
      if (it > 0) bar_wait(full_v + st_prev, parity_prev);
      if (it > 0 && !slow_prev) issue_values<kHalf, D, kKeys>(o, pa_prev, desc(v_s(st_prev)));
      wg::commit();
      wg::wait<1>();  // S (the previous tile's P·V may run on)
      pin_all<kNt>(sc);
      float alpha_a, alpha_b;
      rows.step<kNt>(sc, j0, t, alpha_a, alpha_b);
      wg::wait<0>();
      pin_all<kDt>(o);
      if (it > 0) {
        if (slow_prev) gated_values<T, D, kKeys>(o, pa_prev, pw, v_s(st_prev));
        bar_arrive(empty + st_prev);  // the previous tile's K and V are read
      }
      rescale_rows<kDt>(o, alpha_a, alpha_b);
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) a_from_accumulator<T>(sc, kk, pa_prev[kk]);
      slow_prev = slow, st_prev = st, parity_prev = parity;
    }
    if (tiles > 0) {
      bar_wait(full_v + st_prev, parity_prev);
      if (!slow_prev) {
        accumulate_values<kHalf, D, kKeys>(o, pa_prev, desc(v_s(st_prev)));
      } else {
        gated_values<T, D, kKeys>(o, pa_prev, pw, v_s(st_prev));
      }
    }
    rows.finish<T, kDt>(o, p, s, h, row_a, row_b, t);
  }
#endif
}

/// cuTensorMapEncodeTiled from the driver (the runtime is linked statically; the driver
/// entry point needs no -lcuda), or nullptr.
PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found) !=
            cudaSuccess ||
        found != cudaDriverEntryPointSuccess) {
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

/// A 3-d map (column, head, row) of one of q, k, v with boxes of 64 columns × 1 head ×
/// box_rows rows, 128-byte swizzle. False where the copy engine cannot address it: a
/// start or a stride that is not a multiple of 16 bytes, or a sequence that does not
/// start on a row.
bool tensor_map(CUtensorMap& map, const ForwardParams& p, const void* base, int64_t row, int64_t head, int heads,
                int box_rows, int64_t SeqDesc::*offset, bool query_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = encode_tiled();
  if (encode == nullptr || reinterpret_cast<uintptr_t>(base) % 16 != 0 || row <= 0 || (row * 2) % 16 != 0) return false;
  if (heads > 1 && (head <= 0 || (head * 2) % 16 != 0)) return false;
  int64_t rows = 1;
  for (int b = 0; b < p.B; ++b) {
    const SeqDesc& s = p.seqs_host[b];
    if (s.*offset % row != 0) return false;
    rows = std::max(rows, s.*offset / row + (query_rows ? s.Lq : s.Lk));
  }
  if (rows >= (int64_t{1} << 31)) return false;
  const cuuint64_t dims[3] = {cuuint64_t(p.d), cuuint64_t(heads), cuuint64_t(rows)};
  const cuuint64_t strides[2] = {cuuint64_t(heads > 1 ? head * 2 : row * 2), cuuint64_t(row * 2)};
  const cuuint32_t box[3] = {64, 1, cuuint32_t(box_rows)};
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(&map, p.in == Elem::f16 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3,
                const_cast<void*>(base), dims, strides, box, element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <class T, int D>
cudaError_t launch(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  CUtensorMap tq, tk, tv;
  if (!tensor_map(tq, p, p.q, p.q_row, p.q_head, p.Hq, kRows, &SeqDesc::q_offset, true) ||
      !tensor_map(tk, p, p.k, p.k_row, p.k_head, p.Hkv, kKeys, &SeqDesc::k_offset, false) ||
      !tensor_map(tv, p, p.v, p.v_row, p.v_head, p.Hkv, kKeys, &SeqDesc::v_offset, false)) {
    return cudaErrorNotSupported;
  }
  auto* kernel = &flash_forward_ws_kernel<T, D>;
  const size_t smem = 1024 + size_t(Smem<T, D>::kBytes);
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
  if (e != cudaSuccess) return e;
  NonfiniteTiles v_bad;
  e = v_bad.make<T, T, D, kKeys>(p, seqs, nullptr, TileSource::values, p.v, p.v_row, p.v_head, p.Hkv, stream);
  if (e == cudaSuccess) {
    const dim3 grid((p.max_lq + kRows - 1) / kRows, p.Hq, p.B);
    kernel<<<grid, kThreads, smem, stream>>>(tq, tk, tv, p, seqs, v_bad.flags, v_bad.tiles);
    e = cudaGetLastError();
  }
  const cudaError_t f = v_bad.free(stream);
  return e != cudaSuccess ? e : f;
}

}  // namespace

bool ws_forward_wanted() {
  const char* env = std::getenv("ATTN_CUDA_WGMMA");
  return env != nullptr && std::strcmp(env, "ws") == 0;
}

cudaError_t ws_forward(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream) {
  const bool half = p.in == Elem::f16;
  if (p.d == 64) return half ? launch<__half, 64>(p, seqs, stream) : launch<__nv_bfloat16, 64>(p, seqs, stream);
  return half ? launch<__half, 128>(p, seqs, stream) : launch<__nv_bfloat16, 128>(p, seqs, stream);
}

}  // namespace attn::cuda
