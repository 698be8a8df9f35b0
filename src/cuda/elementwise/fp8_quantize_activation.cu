// src/cuda/elementwise/fp8_quantize_activation.cu — FP8 quantization fused with GroupedMLP's
// activation: the tile kernel of fp8_quantize.cuh fed by a source that computes the activation's
// output z = act(h)·probs granule by granule in registers, so z is not written in bf16 and read
// back. Each value is computed by the expressions of grouped_activation.cu and rounded to h's dtype
// first, so the FP8 copies are bitwise those of grouped_activation_forward followed by
// quantize_grouped. A CTA's column tile is 128 columns of z; each granule (8 columns) loads the gate
// and up granules of h (16 bytes each).
//
// Where this source does not apply (tensorwise, whose amax the activation's own pass gives, so that
// the quantizer reads z once: this kernel would evaluate the activation twice; a dtype other than
// bf16, the only one the FP8 layers take; misaligned views; interleave blocks that are not a
// multiple of 8), the entry point returns false and the caller composes the two ops. (Quantizing
// dh inside the activation's backward the same way was measured slower than the two ops:
// docs/decisions.md.)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstring>
#include <type_traits>

#include "common/activation_math.h"
#include "common/backend.h"
#include "cuda/elementwise/activation_common.cuh"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/elementwise/fp8_quantize.cuh"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {
using fp8::kThreads;
using fp8::kTile;
using fp8::QuantParams;
using fp8::Tile;

constexpr int kVec = 8;  // 16-bit elements per granule

using act_common::from_f;
using act_common::to_f;

template <typename T>
struct alignas(16) Pack {
  T v[kVec];
};
template <typename T>
__device__ __forceinline__ Pack<T> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T>*>(p);
}
template <typename T>
__device__ __forceinline__ uint4 as_granule(const Pack<T>& v) {
  uint4 r;
  memcpy(&r, &v, 16);
  return r;
}

struct ActSourceArgs : act_common::HArgs {
  const float* probs = nullptr;
};

/// z = act(h)·probs: column tile blockIdx.y of z.
template <typename T, ActivationKind K>
struct ActForwardSource {
  ActSourceArgs a;
  __device__ int64_t col0() const { return static_cast<int64_t>(blockIdx.y) * kTile; }
  template <typename U>
  __device__ uint4 granule(const QuantParams&, const Tile& g, int i, int v, int ncols, int64_t col0) const {
    static_assert(std::is_same_v<U, T>, "the tile's element type is h's");
    if (i >= g.nrows || v * kVec >= ncols) return make_uint4(0, 0, 0, 0);
    const int64_t row = g.out_row0 + i;
    const T* h = static_cast<const T*>(a.h) + row * a.ld_h;
    const int j = static_cast<int>(col0) + v * kVec;
    const float p = a.probs != nullptr ? a.probs[row] : 1.0f;
    Pack<T> out;
    if constexpr (K != ActivationKind::squared_relu) {
      const int gc = act::gate_column(j, a.block);
      const Pack<T> hg = load_pack(h + gc), hu = load_pack(h + gc + act::up_offset(a.F, a.block));
#pragma unroll
      for (int e = 0; e < kVec; ++e) out.v[e] = from_f<T>(act::gated_value<K>(to_f(hg.v[e]), to_f(hu.v[e]), a.prm) * p);
    } else {
      const Pack<T> x = load_pack(h + j);
#pragma unroll
      for (int e = 0; e < kVec; ++e) out.v[e] = from_f<T>(act::squared_relu_value(to_f(x.v[e])) * p);
    }
    return as_granule(out);
  }
};

// The 16-byte granule loads need bf16 elements, 16-byte aligned rows, and (gated) interleave
// blocks that are multiples of 8 (a granule never straddles gate and up).
bool loadable(const TensorView& t) {
  return t.dtype == DType::bf16 && aligned(t.data, 16) &&
         (t.size(0) <= 1 || t.stride(0) % kVec == 0);
}

ActSourceArgs source_args(const TensorView& h, int64_t F, const ActivationOptions& o, const TensorView& probs) {
  ActSourceArgs a;
  static_cast<act_common::HArgs&>(a) = act_common::h_args(h, F, o);
  a.probs = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  return a;
}

bool shape_fusable(const TensorView& h, int64_t F, const ActivationOptions& o) {
  if (!loadable(h) || F % kVec != 0 || 2 * F > INT32_MAX) return false;
  return !is_gated(o.kind) || o.glu.layout != GluLayout::interleaved || o.glu.block % kVec == 0;
}

// Blockwise and mxfp8 only: their scales come from the tile itself (tensorwise is declined above).
void launch_fused(ActivationKind kind, const ActSourceArgs& a, Fp8Recipe recipe, const QuantParams& p, dim3 grid,
                  cudaStream_t stream) {
  act_common::with_kind(kind, [&](auto k) {
    constexpr ActivationKind K = decltype(k)::value;
    const ActForwardSource<__nv_bfloat16, K> src{a};
    if (recipe == Fp8Recipe::blockwise) {
      fp8::launch_tile<__nv_bfloat16, Fp8Recipe::blockwise, false>(p, grid, src, stream);
    } else {
      fp8::launch_tile<__nv_bfloat16, Fp8Recipe::mxfp8, false>(p, grid, src, stream);
    }
  });
}

}  // namespace

bool quantize_activation_forward(const TensorView& h, const TensorView& counts, const ActivationOptions& act,
                                 const TensorView& probs, const Fp8QuantizeOptions& o, const Fp8Grouped& q,
                                 Stream stream, Allocator& alloc) {
  const int64_t cap = h.size(0), F = q.cols;
  if (o.recipe == Fp8Recipe::tensorwise || !shape_fusable(h, F, act)) return false;
  DeviceGuard guard(h.device.index);
  Buffer scratch;
  dim3 grid;
  QuantParams p = fp8::grouped_params(counts, cap, F, o, q, scratch, alloc, stream, grid);
  p.vec = F % 16 == 0 && (p.data == nullptr || aligned(p.data, 16));
  launch_fused(act.kind, source_args(h, F, act, probs), o.recipe, p, grid, stream);
  return true;
}

}  // namespace gmoe::cuda_backend
