// src/cuda/routing/routing_common.cuh — what the routing kernels share: warp reductions in a fixed
// order (so sums are bitwise the same run to run), the row packs of the memory-bound kernels, and
// the switch from a tensor's dtype and alignment onto a (type, pack width) pair.
//
// A row kernel moves `V` elements per access: 16 bytes (8 bf16/f16, 4 f32) when the row length and
// every row start are 16-byte multiples, else one element. The choice is made once per op on the
// host from the pointers, the row strides and H.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "cuda/elementwise/activation_common.cuh"
#include "cuda/runtime/alignment.h"
#include "gmoe/error.h"
#include "gmoe/tensor.h"

namespace gmoe::cuda_backend::routing {

using act_common::from_f;
using act_common::to_f;

/// The largest E the CUDA routing kernels take (their per-expert tables live in shared memory).
constexpr int64_t kMaxRoutingExperts = 1024;

/// Σ over the warp by a butterfly: every lane gets the same bits, the same every run.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}

/// V elements of T moved as one access.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

/// A pack loaded to be read as f32: held as the 32-bit words it arrives in and widened one element
/// at a time where it is used. Loaded as Pack, a 16-bit element takes a register of its own, split
/// out right after the load: the split waits for the load, so a batch of loads is no longer in
/// flight together, and the pack takes twice the registers.
template <typename T, int V, bool = (sizeof(T) * V) % 4 == 0>
struct LoadedPack {
  Pack<T, V> p;
  __device__ __forceinline__ float at(int v) const { return to_f(p.v[v]); }
};
template <typename T, int V>
struct alignas(sizeof(T) * V) LoadedPack<T, V, true> {
  uint32_t w[sizeof(T) * V / 4];
  __device__ __forceinline__ float at(int v) const {
    if constexpr (sizeof(T) == 4) {
      return __uint_as_float(w[v]);
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {  // bf16 -> f32: the bits, shifted up
      return __uint_as_float(v % 2 == 0 ? w[v / 2] << 16 : w[v / 2] & 0xffff0000u);
    } else {
      return __half2float(__ushort_as_half(static_cast<unsigned short>(v % 2 == 0 ? w[v / 2] : w[v / 2] >> 16)));
    }
  }
};

/// Calls f(T{}, std::integral_constant<int, V>{}) for the dtype (bf16/f16/f32) and the widest
/// pack every row of every view allows (16 bytes, else 1 element).
template <typename F>
void with_row_type(DType dtype, int64_t H, std::initializer_list<TensorView> rows, F&& f) {
  const int64_t es = static_cast<int64_t>(dtype_size(dtype));
  bool vec = (H * es) % 16 == 0;
  for (const TensorView& t : rows) {
    if (!t.defined() || t.data == nullptr) continue;
    vec = vec && aligned(t.data, 16) && (t.ndim < 2 || (t.stride(0) * es) % 16 == 0);
  }
  auto go = [&](auto type) {
    using T = decltype(type);
    if (vec) {
      f(T{}, std::integral_constant<int, static_cast<int>(16 / sizeof(T))>{});
    } else {
      f(T{}, std::integral_constant<int, 1>{});
    }
  };
  switch (dtype) {
    case DType::bf16:
      go(__nv_bfloat16{});
      break;
    case DType::f16:
      go(__half{});
      break;
    case DType::f32:
      go(float{});
      break;
    default:
      GMOE_FAIL("routing: unsupported row dtype ", dtype_name(dtype));
  }
}

/// Calls f(T{}) for a logits dtype.
template <typename F>
void with_logit_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::bf16:
      f(__nv_bfloat16{});
      break;
    case DType::f16:
      f(__half{});
      break;
    case DType::f32:
      f(float{});
      break;
    default:
      GMOE_FAIL("routing: unsupported logits dtype ", dtype_name(dtype));
  }
}

/// Blocks for a grid-stride loop over `work` items of `per_block` each: enough to fill the device a
/// few times over, never more than the work.
int grid_for(int64_t work, int per_block);

}  // namespace gmoe::cuda_backend::routing
