// Which tiles of an input (Q, K, V or dO) hold a NaN or ±∞, found once per call by a
// pre-pass, so that the attention kernels need not scan every tile they load.
//
// The kernels multiply P (or dS) by a tile on the tensor cores, where a removed key's
// 0 meeting a NaN or ±∞ gives NaN; such a tile must take the element-by-element path.
// (Forward: V; dQ kernel: K; dK/dV kernel: Q and dO.)
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

/// Which tensor of a call a flag table describes: its rows are a sequence's queries
/// (q, dout) or keys (k, v).
enum class TileSource : uint8_t { queries, keys, values, dout };

/// flags[(b·heads + h)·tiles + t] = 1 when rows [t·R, min(t·R + R, L)) of head h of
/// sequence b (L: its query or key count) hold a NaN or ±∞ as operands of type T (f32
/// inputs are checked after rounding, which can overflow to ±∞), else 0. `x` is the
/// tensor's element 0, row and head its strides; bseqs is needed for dout only. Grid
/// (tiles, heads, B), 128 threads.
template <class T, class In, int D, int R>
__global__ void __launch_bounds__(128)
    nonfinite_tiles_kernel(const In* x, int64_t row, int64_t head, const SeqDesc* seqs, const BackwardSeq* bseqs,
                           TileSource source, int tiles, uint8_t* flags) {
  const int t = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const SeqDesc s = seqs[b];
  int64_t offset = 0;
  switch (source) {
    case TileSource::queries: offset = s.q_offset; break;
    case TileSource::keys: offset = s.k_offset; break;
    case TileSource::values: offset = s.v_offset; break;
    case TileSource::dout: offset = bseqs[b].dout_offset; break;
  }
  const bool query_rows = source == TileSource::queries || source == TileSource::dout;
  const In* base = x + offset + int64_t{h} * head;
  const int r0 = t * R, rows = max(0, min(R, (query_rows ? s.Lq : s.Lk) - r0));
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

/// The number of R-row tiles of the call's longest sequence, in queries or in keys (a
/// flag table's `tiles`).
inline int tile_count(const ForwardParams& p, int R, bool query_rows) {
  int longest = 0;
  for (int b = 0; b < p.B; ++b) {
    const int n = query_rows ? p.seqs_host[b].Lq : p.seqs_host[b].Lk;
    longest = n > longest ? n : longest;
  }
  return (longest + R - 1) / R;
}

/// One flag table in stream-ordered device memory: make() allocates and fills it for a
/// tensor of the call, free() releases it (after the kernels that read it, on the same
/// stream).
struct NonfiniteTiles {
  uint8_t* flags = nullptr;
  int tiles = 0;

  /// x: the tensor's element 0 with row and head strides and `heads` heads.
  template <class T, class In, int D, int R>
  cudaError_t make(const ForwardParams& p, const SeqDesc* seqs, const BackwardSeq* bseqs, TileSource source,
                   const void* x, int64_t row, int64_t head, int heads, cudaStream_t stream) {
    tiles = tile_count(p, R, source == TileSource::queries || source == TileSource::dout);
    const size_t bytes = size_t(p.B) * heads * size_t(tiles > 0 ? tiles : 1);
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&flags), bytes, stream);
    if (e != cudaSuccess || tiles == 0) return e;
    nonfinite_tiles_kernel<T, In, D, R><<<dim3(tiles, heads, p.B), 128, 0, stream>>>(
        static_cast<const In*>(x), row, head, seqs, bseqs, source, tiles, flags);
    return cudaGetLastError();
  }
  cudaError_t free(cudaStream_t stream) {
    const cudaError_t e = flags != nullptr ? cudaFreeAsync(flags, stream) : cudaSuccess;
    flags = nullptr;
    return e;
  }
};

}  // namespace
}  // namespace attn::cuda
