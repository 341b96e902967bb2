// CHECK_CUDA(call) for the GPU benchmark and probe: a failing CUDA call prints itself
// and its error, and the program exits with kCheckCudaExit (each program defines it:
// its status for "the GPU failed").
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#define CHECK_CUDA(call)                                                 \
  do {                                                                   \
    const cudaError_t check_cuda_error = (call);                         \
    if (check_cuda_error != cudaSuccess) {                               \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(check_cuda_error)); \
      std::exit(kCheckCudaExit);                                         \
    }                                                                    \
  } while (0)
