// The CUDA backend's runtime services: whether a device can run the kernels, and the
// small device-to-host copies argument checking needs (cu_seqlens, key_lengths).
#include <cuda_runtime.h>

#include <string>

#include "cuda/cuda_backend.hpp"
#include "cuda/cuda_check.hpp"

namespace attn::cuda {

std::string device_usable(int device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) return cuda_error_text("no usable CUDA device (cudaGetDeviceCount)", e);
  if (device < 0 || device >= count) {
    return "cuda:" + std::to_string(device) + " does not exist (this machine has " + std::to_string(count) +
           " CUDA device" + (count == 1 ? "" : "s") + ")";
  }
  cudaDeviceProp prop{};
  ATTN_CUDA_TRY(cudaGetDeviceProperties(&prop, device));
  if (prop.major < 8) {
    return "cuda:" + std::to_string(device) + " (" + prop.name + ", sm_" + std::to_string(prop.major) +
           std::to_string(prop.minor) + ") is older than sm_80, which the kernels need (bf16 tensor cores)";
  }
  return "";
}

std::string copy_to_host(void* dst, const void* src, size_t bytes, int device, void* stream) {
  if (bytes == 0) return "";
  const DeviceScope scope(device);
  if (!scope.ok()) return scope.error();
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  ATTN_CUDA_TRY(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, s));
  ATTN_CUDA_TRY(cudaStreamSynchronize(s));
  return "";
}

}  // namespace attn::cuda
