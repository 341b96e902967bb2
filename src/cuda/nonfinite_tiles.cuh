// Which tiles of a key-side tensor (K or V) hold a NaN or ±∞, found once per call by a
// pre-pass, so that the attention kernels need not scan every tile they load.
//
// The kernels multiply P (or dS) by a tile on the tensor cores, where a removed key's
// 0 meeting a NaN or ±∞ gives NaN; such a tile must take the element-by-element path.
// Scanning each tile in the kernel costs every query block ~100 instructions per thread
// and tile (an eighth of the forward's loop), for a check that depends on the tile only:
// here each tile is read once, and a kernel reads one byte per tile instead.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/cuda_backend.hpp"
#include "cuda/mma_fragments.cuh"

namespace attn::cuda {
// Internal to each kernel file that includes this (no kernel shared across translation units).
namespace {

/// Which key-side tensor of a call a flag table describes.
enum class KeySide : uint8_t { keys, values };

/// flags[(b·heads + h)·tiles + t] = 1 when rows [t·R, min(t·R + R, L)) of head h of
/// sequence b (L its key count) hold a NaN or ±∞ as operands of type T (f32 inputs
/// are checked after rounding, which can overflow to ±∞), else 0. Grid (tiles, heads, B),
/// 128 threads.
template <class T, class In, int D, int R>
__global__ void __launch_bounds__(128)
    nonfinite_tiles_kernel(const In* x, int64_t row, int64_t head, const SeqDesc* seqs, KeySide side, int tiles,
                           uint8_t* flags) {
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const SeqDesc s = seqs[b];
  const In* base = x + (side == KeySide::keys ? s.k_offset : s.v_offset) + int64_t{h} * head;
  const int r0 = t * R, rows = max(0, min(R, s.Lk - r0));
  const bool vec = rows_vectorizable<T>(base, row);
  constexpr int kChunks = D / 8;
  bool bad = false;
  for (int c = threadIdx.x; c < rows * kChunks; c += 128) {
    const int r = c / kChunks, col = (c - r * kChunks) * 8;
    bad = bad || !chunk_finite<T>(load_chunk<T>(base + int64_t{r0 + r} * row + col, vec));
  }
  bad = __syncthreads_or(bad);
  if (threadIdx.x == 0) flags[(int64_t{b} * gridDim.y + h) * tiles + t] = bad ? 1 : 0;
}

/// The number of R-row tiles of the longest sequence's keys (the flag table's `tiles`).
inline int key_tiles(const ForwardParams& p, int R) {
  int max_lk = 0;
  for (int b = 0; b < p.B; ++b) max_lk = p.seqs_host[b].Lk > max_lk ? p.seqs_host[b].Lk : max_lk;
  return (max_lk + R - 1) / R;
}

/// Fills `flags` (B·Hkv·tiles bytes of device memory) for K or V of the call, on `stream`.
template <class T, class In, int D, int R>
cudaError_t find_nonfinite_tiles(const ForwardParams& p, const SeqDesc* seqs, KeySide side, int tiles,
                                 uint8_t* flags, cudaStream_t stream) {
  if (tiles == 0) return cudaSuccess;
  const bool keys = side == KeySide::keys;
  const dim3 grid(tiles, p.Hkv, p.B);
  nonfinite_tiles_kernel<T, In, D, R><<<grid, 128, 0, stream>>>(
      static_cast<const In*>(keys ? p.k : p.v), keys ? p.k_row : p.v_row, keys ? p.k_head : p.v_head, seqs, side,
      tiles, flags);
  return cudaGetLastError();
}

}  // namespace
}  // namespace attn::cuda
