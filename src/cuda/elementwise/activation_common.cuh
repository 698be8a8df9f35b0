// src/cuda/elementwise/activation_common.cuh — what the device activation kernels share: element conversions
// to and from f32, the switch from a run-time activation kind onto a compile-time one
// (common/activation_kinds.h, the CPU backend's too), and the run-time arguments every activation
// kernel takes from h and the options (HArgs).
// Used by grouped_activation.cu and fp8_quantize_activation.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/activation_kinds.h"
#include "common/activation_math.h"
#include "gmoe/activation.h"
#include "gmoe/tensor.h"

namespace gmoe::cuda_backend::act_common {

template <typename T> __device__ __forceinline__ float to_f(T v);
template <> __device__ __forceinline__ float to_f<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f<__half>(__half v) { return __half2float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }

using act::with_kind;

/// The interleave block of h's gate/up columns (0: concatenated halves, or not gated).
inline int interleave_block(const ActivationOptions& o) {
  return is_gated(o.kind) && o.glu.layout == GluLayout::interleaved ? static_cast<int>(o.glu.block) : 0;
}
/// The activation's run-time parameters.
inline act::Params params_of(const ActivationOptions& o) { return act::Params{o.alpha, o.limit, o.gelu_tanh}; }

/// What every activation kernel reads of h and the options (the kernels' argument structs derive
/// from it).
struct HArgs {
  const void* h = nullptr;
  int64_t ld_h = 0;
  int64_t capacity = 0;  // rows of h
  int F = 0;             // output columns (the callers keep 2F < 2^31)
  int block = 0;         // interleave block; 0: concatenated halves
  act::Params prm;
};
inline HArgs h_args(const TensorView& h, int64_t F, const ActivationOptions& o) {
  HArgs a;
  a.h = h.data;
  a.ld_h = h.stride(0);
  a.capacity = h.size(0);
  a.F = static_cast<int>(F);
  a.block = interleave_block(o);
  a.prm = params_of(o);
  return a;
}

}  // namespace gmoe::cuda_backend::act_common
