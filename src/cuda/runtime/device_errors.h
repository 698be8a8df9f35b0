// src/cuda/runtime/device_errors.h — the device error word, for kernels in any translation unit.
//
// The word itself is a __device__ variable in grouped_gemm_prepare.cu (without relocatable device
// code it is visible only there); kernels elsewhere receive its address as a parameter.
#pragma once

#include <cstdint>

namespace gmoe::cuda_backend {

/// Device address of the error word on the current device (cudaGetSymbolAddress; not a stream
/// operation, so it is allowed during graph capture).
uint32_t* device_error_word();

}  // namespace gmoe::cuda_backend
