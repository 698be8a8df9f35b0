// src/cuda/runtime/cuda_check.h — GMOE_CUDA_CHECK: turn a failed CUDA runtime call into a gmoe::Error.
//
// Every CUDA runtime call in src/cuda goes through it, and every kernel launch is followed by
// GMOE_CUDA_CHECK(cudaGetLastError()) so a bad launch configuration is reported where it happened
// rather than at the next unrelated call.
#pragma once

#include <cuda_runtime.h>

#include "gmoe/error.h"

/// GMOE_CUDA_CHECK(cudaMemsetAsync(...)) throws gmoe::Error with file, line, the call and the
/// CUDA error string when the call does not return cudaSuccess.
#define GMOE_CUDA_CHECK(call)                                                            \
  do {                                                                                   \
    const cudaError_t gmoe_cuda_status_ = (call);                                        \
    if (gmoe_cuda_status_ != cudaSuccess) {                                              \
      ::gmoe::detail::throw_error(__FILE__, __LINE__, #call, "CUDA error ",              \
                                  static_cast<int>(gmoe_cuda_status_), " (",             \
                                  cudaGetErrorName(gmoe_cuda_status_), "): ",            \
                                  cudaGetErrorString(gmoe_cuda_status_));                \
    }                                                                                    \
  } while (0)
