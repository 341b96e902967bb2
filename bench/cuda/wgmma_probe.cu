// A probe of Hopper's warpgroup products (wgmma, sm_90a) before a kernel is built on
// them: which shared-memory layouts and descriptor fields give the right product, and
// where each accumulator register lands. The PTX manual's words for the descriptor's
// two byte offsets (LBO, SBO) are easy to read two ways, and a wrong reading gives
// wrong numbers, not an error; a GPU session is too short to find that out inside an
// attention kernel. So each reading is tried here on a small product against a float64
// reference on the host, and the probe prints which ones are right.
//
// Products (one warpgroup of 128 threads, bf16 operands, f32 accumulators):
//   SS: D[64×64] = A[64×K]·B[64×K]ᵀ, both from shared memory, "K-major" (rows of K
//       contiguous elements): S = Q·Kᵀ of an attention tile.
//   RS: D[64×64] = A[64×16]·V[16×64], A from registers (mma.sync's A-fragment layout),
//       V from shared memory as stored (rows of N contiguous elements, "MN-major",
//       transposed by the instruction): O += P·V.
// Layouts: no swizzle (8×16-byte core matrices) and the 128-byte swizzle.
//
//   wgmma_probe   → one line per case: "ok" or the largest error, and for a wrong case
//                   where thread 0's first registers' values are found in the reference.
// Exit status: 0 when the cases the attention kernel needs (one SS and one RS reading
// per layout) have a right reading, 1 otherwise, 2 without a usable sm_90 GPU.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "check_cuda.hpp"
#include "cuda/wgmma.cuh"

namespace {

namespace wg = attn::cuda::wgmma;

// A failing CUDA call ends the probe with status 2 ("no usable GPU").
constexpr int kCheckCudaExit = 2;

/// How a case stores its shared-memory operand and fills its descriptor.
enum Layout : int {
  kCoreLboK = 0,     // no swizzle, K-adjacent core matrices 128 B apart, M/N-adjacent 256·(K/16) B
  kCoreLboMN = 1,    // the same bytes, the descriptor's two offsets swapped
  kSwizzle128 = 2,   // rows of 64 elements (128 B), 16-byte chunks XOR row % 8, 8-row atoms of 1 KiB
  kSwizzle128Swapped = 3,
};

constexpr int kM = 64, kN = 64;

/// Byte offset of element (row, col) of a [rows][cols] operand whose contiguous
/// dimension is `cols`, in layout `layout` (cols = 16 for the core layouts in SS,
/// 64 for the swizzled ones and for RS's V).
__host__ __device__ inline uint32_t element_offset(int layout, int row, int col, int cols) {
  if (layout == kCoreLboK || layout == kCoreLboMN) {
    // Core matrix (row / 8, col / 8): 8 rows × 16 bytes, contiguous; the core matrices of
    // one group of 8 rows are adjacent (128 B apart), groups are cols/8·128 B apart.
    return uint32_t((row / 8) * (cols / 8) * 128 + (col / 8) * 128 + (row % 8) * 16 + (col % 8) * 2);
  }
  return wg::sw128_offset(row, col);  // the kernel's own layout
}

#ifdef ATTN_HAVE_WGMMA
/// The dynamic shared memory from its first 1 KiB boundary (the 128-byte swizzle is a
/// function of the address bits, so its atoms must start there; 1 KiB extra is launched).
__device__ inline unsigned char* aligned_shared() {
  extern __shared__ unsigned char smem_raw[];
  const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  return smem_raw + ((1024 - at % 1024) % 1024);
}
#endif

/// SS case: A [64][K], B [64][K] (row-major bf16 in global memory) → raw[128 threads][32]
/// (each thread's accumulator registers as they come out).
__global__ void ss_kernel(const __nv_bfloat16* a, const __nv_bfloat16* b, int K, int layout, float* raw) {
#ifdef ATTN_HAVE_WGMMA
  unsigned char* sa = aligned_shared();
  unsigned char* sb = sa + 64 * K * 2;  // a multiple of 1 KiB for K = 16 and 64 (swizzle atoms)
  const bool swz = layout == kSwizzle128 || layout == kSwizzle128Swapped;
  for (int x = threadIdx.x; x < kM * K; x += blockDim.x) {
    const int r = x / K, c = x % K;
    *reinterpret_cast<__nv_bfloat16*>(sa + element_offset(layout, r, c, K)) = a[x];
    *reinterpret_cast<__nv_bfloat16*>(sb + element_offset(layout, r, c, K)) = b[x];
  }
  wg::fence_shared_for_async();  // ordinary stores → the async proxy
  __syncthreads();
  const uint32_t base_a = static_cast<uint32_t>(__cvta_generic_to_shared(sa));
  const uint32_t base_b = static_cast<uint32_t>(__cvta_generic_to_shared(sb));
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  wg::fence();
  for (int ks = 0; ks < K / 16; ++ks) {
    uint64_t da, db;
    if (!swz) {
      // K-adjacent core matrices 128 B apart; 8-row groups (K/8)·128 B apart; a k-step
      // of 16 starts two core matrices (256 B) further.
      const uint32_t along_k = 128, along_mn = (K / 8) * 128;
      const uint32_t lbo = layout == kCoreLboK ? along_k : along_mn, sbo = layout == kCoreLboK ? along_mn : along_k;
      da = wg::descriptor(base_a + ks * 256, lbo, sbo, wg::kNoSwizzle);
      db = wg::descriptor(base_b + ks * 256, lbo, sbo, wg::kNoSwizzle);
    } else {
      // The kernel's reading (wgmma.cuh), or the two offsets swapped; a k-step of 16
      // elements starts 32 B further in the row.
      const bool own = layout == kSwizzle128;
      const uint32_t lbo = own ? wg::kSw128Lbo : wg::kSw128Sbo, sbo = own ? wg::kSw128Sbo : wg::kSw128Lbo;
      da = wg::descriptor(base_a + ks * 32, lbo, sbo, wg::kSwizzle128);
      db = wg::descriptor(base_b + ks * 32, lbo, sbo, wg::kSwizzle128);
    }
    wg::ss_m64n64k16<false>(d, da, db, ks > 0 ? 1 : 0);
  }
  wg::commit();
  wg::wait<0>();
  for (int i = 0; i < 32; ++i) raw[threadIdx.x * 32 + i] = d[i];
#endif
}

/// RS case: A [64][16] (global, row-major) as register fragments, V [16][64] (global,
/// row-major) stored in shared memory as it is, MN-major → raw[128][32].
__global__ void rs_kernel(const __nv_bfloat16* a, const __nv_bfloat16* v, int layout, float* raw) {
#ifdef ATTN_HAVE_WGMMA
  unsigned char* smem = aligned_shared();
  const bool swz = layout == kSwizzle128 || layout == kSwizzle128Swapped;
  for (int x = threadIdx.x; x < 16 * kN; x += blockDim.x) {
    const int k = x / kN, n = x % kN;
    // MN-major: the 8 contiguous elements of a core matrix run along N; its 8 rows along K.
    *reinterpret_cast<__nv_bfloat16*>(smem + element_offset(layout, k, n, kN)) = v[x];
  }
  wg::fence_shared_for_async();
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  auto pack = [&](int r, int c) {
    const __nv_bfloat16 lo = a[r * 16 + c], hi = a[r * 16 + c + 1];
    return uint32_t(*reinterpret_cast<const uint16_t*>(&lo)) | (uint32_t(*reinterpret_cast<const uint16_t*>(&hi)) << 16);
  };
  const int r0 = warp * 16 + g;
  const uint32_t af[4] = {pack(r0, 2 * t), pack(r0 + 8, 2 * t), pack(r0, 2 * t + 8), pack(r0 + 8, 2 * t + 8)};
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint32_t lbo, sbo;
  if (!swz) {
    // N-adjacent core matrices 128 B apart, K-adjacent (8 rows of K) 8·128 B apart.
    const uint32_t along_mn = 128, along_k = (kN / 8) * 128;
    lbo = layout == kCoreLboK ? along_k : along_mn;
    sbo = layout == kCoreLboK ? along_mn : along_k;
  } else {
    const bool own = layout == kSwizzle128;  // the kernel's reading (wgmma.cuh), or swapped
    lbo = own ? wg::kSw128Lbo : wg::kSw128Sbo;
    sbo = own ? wg::kSw128Sbo : wg::kSw128Lbo;
  }
  float d[32];
  for (int i = 0; i < 32; ++i) d[i] = 0.0f;
  wg::fence();
  wg::rs_m64n64k16_tb<false>(d, af, wg::descriptor(base, lbo, sbo, swz ? wg::kSwizzle128 : wg::kNoSwizzle), 0);
  wg::commit();
  wg::wait<0>();
  for (int i = 0; i < 32; ++i) raw[threadIdx.x * 32 + i] = d[i];
#endif
}

/// Where the layout the kernels assume puts register i of thread `thread`: mma.sync's C
/// layout per warp and 8-column block (d[4j + 2h + c] = D[16·warp + g + 8h][8j + 2t + c]).
void assumed_position(int thread, int i, int& row, int& col) {
  const int warp = thread / 32, lane = thread % 32, g = lane / 4, t = lane % 4;
  const int j = i / 4, h = (i % 4) / 2, c = i % 2;
  row = 16 * warp + g + 8 * h;
  col = 8 * j + 2 * t + c;
}

struct Case {
  const char* name;
  bool ss;
  int layout, K;
};

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::fprintf(stderr, "wgmma_probe: no usable GPU\n");
    return 2;
  }
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  if (prop.major < 9) {
    std::fprintf(stderr, "wgmma_probe: %s is sm_%d%d; wgmma needs sm_90\n", prop.name, prop.major, prop.minor);
    return 2;
  }
  std::printf("wgmma_probe on %s\n", prop.name);
  std::mt19937 rng(2027);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  auto random_bf16 = [&](size_t n, std::vector<__nv_bfloat16>& h, std::vector<double>& f) {
    h.resize(n), f.resize(n);
    for (size_t i = 0; i < n; ++i) h[i] = __float2bfloat16(u(rng)), f[i] = double(__bfloat162float(h[i]));
  };
  const Case cases[] = {
      {"SS K=16 no swizzle, LBO along K", true, kCoreLboK, 16},
      {"SS K=16 no swizzle, LBO along M/N", true, kCoreLboMN, 16},
      {"SS K=64 no swizzle, LBO along K", true, kCoreLboK, 64},
      {"SS K=64 no swizzle, LBO along M/N", true, kCoreLboMN, 64},
      {"SS K=64 128B swizzle, the kernel's reading", true, kSwizzle128, 64},
      {"SS K=64 128B swizzle, offsets swapped", true, kSwizzle128Swapped, 64},
      {"RS V MN-major no swizzle, LBO along K", false, kCoreLboK, 16},
      {"RS V MN-major no swizzle, LBO along N", false, kCoreLboMN, 16},
      {"RS V MN-major 128B swizzle, the kernel's reading", false, kSwizzle128, 16},
      {"RS V MN-major 128B swizzle, offsets swapped", false, kSwizzle128Swapped, 16},
  };
  bool ss_core = false, ss_swz = false, rs_core = false, rs_swz = false;
  for (const Case& cs : cases) {
    std::vector<__nv_bfloat16> ha, hb;
    std::vector<double> fa, fb;
    random_bf16(size_t(kM) * cs.K, ha, fa);
    random_bf16(cs.ss ? size_t(kN) * cs.K : size_t(16) * kN, hb, fb);
    std::vector<double> ref(size_t(kM) * kN, 0.0);
    for (int m = 0; m < kM; ++m)
      for (int n = 0; n < kN; ++n)
        for (int k = 0; k < cs.K; ++k) ref[m * kN + n] += fa[m * cs.K + k] * (cs.ss ? fb[n * cs.K + k] : fb[k * kN + n]);
    __nv_bfloat16 *da, *db;
    float* draw;
    CHECK_CUDA(cudaMalloc(&da, ha.size() * 2));
    CHECK_CUDA(cudaMalloc(&db, hb.size() * 2));
    CHECK_CUDA(cudaMalloc(&draw, 128 * 32 * sizeof(float)));
    CHECK_CUDA(cudaMemcpy(da, ha.data(), ha.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemcpy(db, hb.data(), hb.size() * 2, cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(draw, 0xFF, 128 * 32 * sizeof(float)));  // NaN: a register never written shows
    const size_t smem = 16384 + 1024;
    if (cs.ss) {
      CHECK_CUDA(cudaFuncSetAttribute(ss_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      ss_kernel<<<1, 128, smem>>>(da, db, cs.K, cs.layout, draw);
    } else {
      CHECK_CUDA(cudaFuncSetAttribute(rs_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      rs_kernel<<<1, 128, smem>>>(da, db, cs.layout, draw);
    }
    const cudaError_t launched = cudaGetLastError(), ran = cudaDeviceSynchronize();
    if (launched != cudaSuccess || ran != cudaSuccess) {
      std::printf("%-42s CUDA error: %s\n", cs.name, cudaGetErrorString(launched != cudaSuccess ? launched : ran));
      return 1;  // the context is gone
    }
    std::vector<float> raw(128 * 32);
    CHECK_CUDA(cudaMemcpy(raw.data(), draw, raw.size() * sizeof(float), cudaMemcpyDeviceToHost));
    double worst = 0;
    for (int th = 0; th < 128; ++th)
      for (int i = 0; i < 32; ++i) {
        int r, c;
        assumed_position(th, i, r, c);
        const double e = std::fabs(double(raw[th * 32 + i]) - ref[r * kN + c]);
        worst = std::isnan(e) ? INFINITY : std::max(worst, e);
      }
    const bool ok = worst < 1e-3 * cs.K;
    std::printf("%-42s %s (largest |error| %.3g)\n", cs.name, ok ? "ok" : "WRONG", worst);
    if (!ok) {
      // Where thread 0's first four registers and thread 37's first value are in the reference.
      for (int th : {0, 37})
        for (int i = 0; i < (th == 0 ? 4 : 1); ++i) {
          std::string where;
          for (int x = 0; x < kM * kN; ++x)
            if (std::fabs(ref[x] - raw[th * 32 + i]) < 1e-4 * cs.K) where += " (" + std::to_string(x / kN) + "," + std::to_string(x % kN) + ")";
          int r, c;
          assumed_position(th, i, r, c);
          std::printf("    thread %d d[%d] = %.4f, assumed (%d,%d), found at%s\n", th, i, raw[th * 32 + i], r, c,
                      where.empty() ? " nowhere" : where.c_str());
        }
    }
    if (ok && cs.ss && cs.layout <= kCoreLboMN && cs.K == 64) ss_core = true;
    if (ok && cs.ss && cs.layout >= kSwizzle128) ss_swz = true;
    if (ok && !cs.ss && cs.layout <= kCoreLboMN) rs_core = true;
    if (ok && !cs.ss && cs.layout >= kSwizzle128) rs_swz = true;
    CHECK_CUDA(cudaFree(da));
    CHECK_CUDA(cudaFree(db));
    CHECK_CUDA(cudaFree(draw));
  }
  std::printf("a right reading: SS no swizzle %s, SS 128B swizzle %s, RS no swizzle %s, RS 128B swizzle %s\n",
              ss_core ? "yes" : "no", ss_swz ? "yes" : "no", rs_core ? "yes" : "no", rs_swz ? "yes" : "no");
  return ss_core && ss_swz && rs_core && rs_swz ? 0 : 1;
}
