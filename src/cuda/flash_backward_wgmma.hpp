// The Hopper (sm_90a) backward on warpgroup products, for the calls it covers
// (flash_backward_wgmma.cu); flash_backward.cu asks it after the prep kernel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/backward_rows.cuh"
#include "cuda/cuda_backend.hpp"

namespace attn::cuda {

/// Whether the wgmma dQ and dK/dV kernels compute this call: the environment asks for
/// them (ATTN_CUDA_WGMMA_BWD=1: they have not run on a GPU yet), the build has sm_90a
/// code, the device is an sm_90 GPU, the inputs are bf16 or f16 with d = 64 or 128,
/// nothing modifies the scores but the band, and there is neither dropout nor dbias.
bool wgmma_backward_applies(const BackwardParams& bp);

/// dQ, dK and dV of such a call, on `stream`, from the prep kernel's statistics `st`
/// (seqs, bseqs: the sequence tables in device memory; the gradients' padding is
/// already zeroed).
cudaError_t wgmma_backward(const BackwardParams& bp, const SeqDesc* seqs, const BackwardSeq* bseqs,
                           const RowStats& st, cudaStream_t stream);

}  // namespace attn::cuda
