// The Hopper (sm_90a) forward on warpgroup products, for the calls it covers
// (flash_forward_wgmma.cu); flash_forward.cu asks it first.
#pragma once

#include <cuda_runtime.h>

#include "cuda/cuda_backend.hpp"

namespace attn::cuda {

/// Whether the wgmma kernel computes this call: the build has sm_90a code, the device is
/// an sm_90 GPU, the inputs are bf16 or f16 with d = 64 or 128, nothing modifies the
/// scores but the band (causal, windows, key lengths), there is no dropout, and the
/// environment does not say ATTN_CUDA_WGMMA=0 (which keeps the mma.sync kernel, for
/// comparisons).
bool wgmma_forward_applies(const ForwardParams& p);

/// The forward of a call wgmma_forward_applies() accepts, on `stream`; seqs: the
/// sequence table in device memory.
cudaError_t wgmma_forward(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream);

/// Whether the environment asks for the warp-specialised kernel (flash_forward_ws.cu,
/// ATTN_CUDA_WGMMA=ws) for the calls wgmma_forward_applies() accepts. Unverified on a GPU.
bool ws_forward_wanted();

/// That kernel's forward, or cudaErrorNotSupported (before anything runs) where the
/// copy engine cannot address the call's tensors; the caller then runs wgmma_forward.
cudaError_t ws_forward(const ForwardParams& p, const SeqDesc* seqs, cudaStream_t stream);

}  // namespace attn::cuda
