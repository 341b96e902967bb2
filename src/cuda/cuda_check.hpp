// Error handling and device selection shared by the CUDA backend's files.
#pragma once

#include <cuda_runtime.h>

#include <string>

namespace attn::cuda {

/// "what: cudaErrorX (the runtime's description)".
inline std::string cuda_error_text(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) + ")";
}

/// Makes `device` current for its lifetime and then restores the caller's device, so
/// that a call on cuda:1 leaves the application's current device as it found it.
class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    cudaError_t e = cudaGetDevice(&previous_);
    if (e == cudaSuccess && previous_ != device) e = cudaSetDevice(device), changed_ = e == cudaSuccess;
    if (e != cudaSuccess) error_ = cuda_error_text(("selecting cuda:" + std::to_string(device)).c_str(), e);
  }
  ~DeviceScope() {
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  bool ok() const { return error_.empty(); }
  const std::string& error() const { return error_; }

 private:
  int previous_ = 0;
  bool changed_ = false;
  std::string error_;
};

}  // namespace attn::cuda

/// Returns the error text from the enclosing function (which returns std::string)
/// when a CUDA runtime call fails.
#define ATTN_CUDA_TRY(call)                                                  \
  do {                                                                       \
    const cudaError_t attn_cuda_e = (call);                                  \
    if (attn_cuda_e != cudaSuccess) return ::attn::cuda::cuda_error_text(#call, attn_cuda_e); \
  } while (0)
