// Hopper's warpgroup products (wgmma, sm_90a only): shared-memory descriptors, the
// 128-byte-swizzled tile layout, and the m64n64k16 and m64n128k16 bf16/f16 products with
// f32 accumulators that the wgmma forward kernels and bench/cuda/wgmma_probe.cu use.
//
// The descriptor's two byte offsets (LBO, SBO) are read here as the probe's first
// reading; the probe tries both on the GPU, against a float64 reference, before a kernel
// relies on them (the PTX manual's wording admits either, and a wrong one gives wrong
// numbers, not an error).
//
// Accumulators: a warpgroup's m64nN f32 result is, per warp w and per 8 columns j, the
// mma.sync C layout: d[4j + 2h + c] = D[16w + g + 8h][8j + 2t + c] (g = lane / 4,
// t = lane % 4). A from registers: per warp, mma.sync's m16n8k16 A-fragment layout.
#pragma once

#include <cstdint>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ATTN_HAVE_WGMMA 1
#endif

namespace attn::cuda::wgmma {

/// Byte offset of element (row, col) in a 128-byte-swizzled region of 64-element rows
/// (2-byte elements): row r is 128 bytes at r·128 of its 8-row atom (1 KiB), and its
/// 16-byte chunk c sits at chunk c ^ (r % 8). Regions must start on a 1 KiB boundary.
__host__ __device__ inline uint32_t sw128_offset(int row, int col) {
  return uint32_t((row / 8) * 1024 + (row % 8) * 128 + (((col / 8) ^ (row % 8)) * 16) + (col % 8) * 2);
}

/// The 128-byte swizzle's descriptor offsets as this file reads them: SBO = 1 KiB between
/// 8-row atoms, LBO unused (16 bytes) while a product's K (SS) or N (RS, ≤ 64) stays
/// within one 128-byte row. The probe's "SBO 1 KiB" cases test this reading.
constexpr uint32_t kSw128Lbo = 16, kSw128Sbo = 1024;

/// Swizzle modes of the descriptor's bits 62–63.
enum Swizzle : int { kNoSwizzle = 0, kSwizzle128 = 1 };

/// A shared-memory matrix descriptor: start address, LBO and SBO (bytes, multiples of
/// 16), swizzle mode; base offset 0 (regions start on a 1 KiB boundary).
__device__ inline uint64_t descriptor(uint32_t smem_addr, uint32_t lbo, uint32_t sbo, int swizzle) {
  return uint64_t((smem_addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32) | (uint64_t(swizzle) << 62);
}

#ifdef ATTN_HAVE_WGMMA
/// Orders this thread's register writes (accumulators, A fragments) before the next wgmma.
__device__ inline void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
/// Closes the group of wgmma issued since the last commit.
__device__ inline void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
/// Waits until at most N committed groups are in flight.
template <int N>
__device__ inline void wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
/// Makes this thread's ordinary (and cp.async) shared-memory writes visible to wgmma.
__device__ inline void fence_shared_for_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

#define ATTN_WGMMA_D32(d)                                                                                     \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), \
      "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),  \
      "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), \
      "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define ATTN_WGMMA_REGS32                                                                                    \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                  \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"

#define ATTN_WGMMA_D64(d) ATTN_WGMMA_D32(d), ATTN_WGMMA_D32((d + 32))
#define ATTN_WGMMA_REGS64                                                                                      \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "                                    \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "                           \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "                           \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"

/// d (m64n64, f32) = A·Bᵀ + (accumulate ? d : 0): A [64][16] and B [64][16] from shared
/// memory, K-major; Half: true for f16 operands, false for bf16.
template <bool Half>
__device__ inline void ss_m64n64k16(float d[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (Half) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " ATTN_WGMMA_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : ATTN_WGMMA_D32(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATTN_WGMMA_REGS32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : ATTN_WGMMA_D32(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}

/// d (m64n64, f32) = A·B + (accumulate ? d : 0): A [64][16] from registers (a[4] per
/// thread, mma.sync's A-fragment layout per warp), B [16][64] from shared memory as
/// stored, rows of N contiguous elements (MN-major, transposed by the instruction).
template <bool Half>
__device__ inline void rs_m64n64k16_tb(float d[32], const uint32_t a[4], uint64_t desc_b, int accumulate) {
  if constexpr (Half) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " ATTN_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : ATTN_WGMMA_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " ATTN_WGMMA_REGS32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : ATTN_WGMMA_D32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));
  }
}

/// d (m64n128, f32) = A·Bᵀ + (accumulate ? d : 0): ss_m64n64k16 with B [128][16]
/// (128 rows of K: 16 swizzle atoms, SBO apart). Ran correct on an H200 in a kernel
/// (2026-11-29, 128-key tiles, not kept for speed).
template <bool Half>
__device__ inline void ss_m64n128k16(float d[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
  if constexpr (Half) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 " ATTN_WGMMA_REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : ATTN_WGMMA_D64(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " ATTN_WGMMA_REGS64 ", %64, %65, p, 1, 1, 0, 0;\n}\n"
                 : ATTN_WGMMA_D64(d)
                 : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
}
#endif

}  // namespace attn::cuda::wgmma
