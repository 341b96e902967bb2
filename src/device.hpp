// Calls on device memory: whether this build and this machine can run them, and the
// host reads argument checking needs. Backed by the CUDA backend (src/cuda/) when the
// build has it (ATTN_WITH_CUDA), else every device call is a clear attn::Error.
#pragma once

#include <cstddef>

#include "arg_checker.hpp"
#include "attn/attention.hpp"

namespace attn::detail {

/// Throws (through c, naming `name`) unless this build has the CUDA backend and the
/// device of `t` can run it.
void require_cuda_device(const Checker& c, const TensorView& t, const char* name);

/// Copies the first `bytes` of t's memory (on a CUDA device) to dst, in t's stream,
/// and waits for the copy. Throws through c on a CUDA error.
void copy_to_host(const Checker& c, void* dst, const TensorView& t, size_t bytes, const char* name);

/// attention() for tensors on a CUDA device: checks what the GPU path supports, then
/// runs src/cuda/'s kernel on the tensors' stream (asynchronously).
void attention_forward_cuda(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                            const TensorView& out, const AttentionOptions& options, const TensorView& lse,
                            const TensorView& probs, const UserMods* mods);

/// attention_backward() for tensors on a CUDA device: checks what the GPU path
/// supports, then runs src/cuda/'s kernels on the tensors' stream (asynchronously).
void attention_backward_cuda(const char* fn, const TensorView& q, const TensorView& k, const TensorView& v,
                             const TensorView& out, const TensorView& lse, const TensorView& dout,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             const AttentionOptions& options, const TensorView& dbias, const UserMods* mods);

}  // namespace attn::detail
