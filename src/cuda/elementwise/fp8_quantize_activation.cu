// src/cuda/elementwise/fp8_quantize_activation.cu — FP8 quantization fused with GroupedMLP's activation: the
// tile kernel of fp8_quantize.cuh fed by sources that compute the activation's output (forward:
// z = act(h)·probs) or its gradient (backward: dh from h and dz) granule by granule in registers,
// so neither z nor dh is written in bf16 and read back. Each value is computed by the expressions
// of grouped_activation.cu and rounded to h's dtype first, so the FP8 copies are bitwise those of
// grouped_activation_forward/backward followed by quantize_grouped.
//
// Forward: a CTA's column tile is 128 columns of z; each granule (8 columns) loads the gate and up
// granules of h (16 bytes each). Backward: a CTA's column tiles are columns of dh (2F wide for the
// gated kinds); a granule of dh is gate or up of 8 z columns (interleave blocks are multiples of 8)
// and loads dz and h's gate and up granules of those columns. A CTA covers the gate and the up
// columns of the same z columns — one dh tile when interleave blocks of <= 64 pair up inside it,
// else two (passes): dh tiles y and F/128 + y for concatenated halves, the matching pair of a
// block of >= 128 — so that each h and dz element comes from HBM once.
//
// dprobs (Σ over z columns of dz·act, backward with probs): each CTA sums its gate granules per row
// (thread, then the 16 lanes of the row in a fixed butterfly) into partial[blockIdx.y][row]; a
// second launch adds a row's partials in column-tile order. Deterministic, but summed in another
// order than grouped_activation_backward's (equal up to rounding).
//
// Where these sources do not apply (a dtype other than bf16, the only one the FP8 layers take;
// misaligned views; concatenated halves with F % 128 != 0; interleave blocks that are not a
// multiple of 8, or neither <= 64 dividing 128 nor a multiple of 128), the entry points return
// false and the caller composes the two ops.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
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
  const void* dz = nullptr;  // backward
  int64_t ld_dz = 0;
  const float* probs = nullptr;
  float* partial = nullptr;  // backward with dprobs: [gridDim.y, capacity]
  int passes = 1;
  int pairing = 0;  // backward: 0 one dh tile per CTA, 1 concatenated pair, 2 pair within a block >= 128
};

/// z = act(h)·probs: column tile blockIdx.y of z.
template <typename T, ActivationKind K>
struct ActForwardSource {
  ActSourceArgs a;
  __device__ int passes() const { return 1; }
  __device__ int64_t col0(int) const { return static_cast<int64_t>(blockIdx.y) * kTile; }
  static constexpr int kStashBytes = 0;
  static constexpr int kMaxPasses = 1;
  template <typename U>
  __device__ uint4 granule(const QuantParams&, const Tile& g, int i, int v, int ncols, int64_t col0, int, float&,
                           uint4*) const {
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
  template <int kIters>
  __device__ void finish(const QuantParams&, const Tile&, const float (&)[kIters]) const {}
};

/// dh from h and dz: the dh column tiles of CTA column blockIdx.y (see the file comment).
template <typename T, ActivationKind K>
struct ActBackwardSource {
  static constexpr bool kGated = K != ActivationKind::squared_relu;
  ActSourceArgs a;
  __device__ int passes() const { return a.passes; }
  __device__ int64_t col0(int pass) const {
    const int64_t y = blockIdx.y;
    if (a.pairing == 1) return y * kTile + pass * static_cast<int64_t>(a.F);
    if (a.pairing == 2) {
      const int64_t zc = y * kTile;
      return 2 * a.block * (zc / a.block) + zc % a.block + pass * a.block;
    }
    return y * kTile;
  }
  // Two passes (gate tile, then the up tile of the same z columns, granule for granule): the first
  // computes both and keeps the up granule in the thread's stash slot for the second.
  static constexpr int kStashBytes = kThreads * (kTile * kTile * 2 / 16 / kThreads) * 16;
  static constexpr int kMaxPasses = 2;
  template <typename U>
  __device__ uint4 granule(const QuantParams&, const Tile& g, int i, int v, int ncols, int64_t col0, int pass,
                           float& dp, uint4* slot) const {
    static_assert(std::is_same_v<U, T>, "the tile's element type is h's");
    if (i >= g.nrows || v * kVec >= ncols) return make_uint4(0, 0, 0, 0);
    if (pass == 1) return *slot;
    const int64_t row = g.out_row0 + i;
    const T* h = static_cast<const T*>(a.h) + row * a.ld_h;
    const int d = static_cast<int>(col0) + v * kVec;  // dh column
    const float p = a.probs != nullptr ? a.probs[row] : 1.0f;
    Pack<T> out;
    if constexpr (kGated) {
      bool is_up;
      int zc;
      if (a.block == 0) {
        is_up = d >= a.F;
        zc = is_up ? d - a.F : d;
      } else {
        const int w = d % (2 * a.block);
        is_up = w >= a.block;
        zc = (d / (2 * a.block)) * a.block + w % a.block;
      }
      const int gc = act::gate_column(zc, a.block);
      const Pack<T> gz = load_pack(static_cast<const T*>(a.dz) + row * a.ld_dz + zc);
      const Pack<T> hg = load_pack(h + gc), hu = load_pack(h + gc + act::up_offset(a.F, a.block));
      Pack<T> up;  // two passes: pass 0 is the gate tile, and keeps the up granule for pass 1
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const act::Eval ev = act::gated_eval<K>(to_f(hg.v[e]), to_f(hu.v[e]), a.prm);
        const float gi = to_f(gz.v[e]);
        const float gp = gi * p;
        up.v[e] = from_f<T>(gp * ev.d_up);
        out.v[e] = is_up ? up.v[e] : from_f<T>(gp * ev.d_gate);
        if (!is_up) dp += gi * ev.value;
      }
      if (a.passes == 2) *slot = as_granule(up);
    } else {
      const Pack<T> gz = load_pack(static_cast<const T*>(a.dz) + row * a.ld_dz + d);
      const Pack<T> x = load_pack(h + d);
#pragma unroll
      for (int e = 0; e < kVec; ++e) {
        const float xi = to_f(x.v[e]);
        const float gi = to_f(gz.v[e]);
        out.v[e] = from_f<T>(gi * p * act::squared_relu_derivative(xi));
        dp += gi * act::squared_relu_value(xi);
      }
    }
    return as_granule(out);
  }
  // The row sums of the 16 lanes that share a row in each load slot, stored per column tile.
  template <int kIters>
  __device__ void finish(const QuantParams&, const Tile& g, const float (&dp)[kIters]) const {
    if (a.partial == nullptr) return;
    constexpr int NV = kTile / kVec;
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      float s = dp[it];
#pragma unroll
      for (int m = NV / 2; m >= 1; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
      const int i = (it * kThreads + static_cast<int>(threadIdx.x)) / NV;
      if (threadIdx.x % NV == 0 && i < g.nrows) {
        a.partial[static_cast<int64_t>(blockIdx.y) * a.capacity + g.out_row0 + i] = s;
      }
    }
  }
};

/// dprobs[r] = Σ_y partial[y][r] in column-tile order for rows below the total, 0 past it.
__global__ void dprobs_reduce_kernel(const float* partial, int tiles, int64_t capacity, const int64_t* total,
                                     float* dprobs) {
  const int64_t n = *total;
  for (int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; r < capacity; r += int64_t(gridDim.x) * blockDim.x) {
    float s = 0.0f;
    if (r < n) {
      for (int y = 0; y < tiles; ++y) s += partial[int64_t(y) * capacity + r];
    }
    dprobs[r] = s;
  }
}

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

template <template <typename, ActivationKind> class Source>
void launch_fused(const TensorView& h, ActivationKind kind, const ActSourceArgs& a, const Fp8QuantizeOptions& o,
                  const QuantParams& p, dim3 grid, cudaStream_t stream) {
  uint32_t* amax = const_cast<uint32_t*>(p.amax_bits);
  act_common::with_kind(kind, [&](auto k) {
    constexpr ActivationKind K = decltype(k)::value;
    fp8::launch_typed<__nv_bfloat16, false>(o.recipe, p, grid, amax, stream, Source<__nv_bfloat16, K>{a});
  });
}

}  // namespace

bool quantize_activation_forward(const TensorView& h, const TensorView& counts, const ActivationOptions& act,
                                 const TensorView& probs, const Fp8QuantizeOptions& o, const Fp8Grouped& q,
                                 Stream stream, Allocator& alloc) {
  const int64_t cap = h.size(0), F = q.cols;
  if (!shape_fusable(h, F, act)) return false;
  DeviceGuard guard(h.device.index);
  Buffer scratch;
  dim3 grid;
  QuantParams p = fp8::grouped_params(counts, cap, F, o, q, scratch, alloc, stream, grid);
  p.vec = F % 16 == 0 && (p.data == nullptr || aligned(p.data, 16));
  launch_fused<ActForwardSource>(h, act.kind, source_args(h, F, act, probs), o, p, grid, stream);
  return true;
}

bool quantize_activation_backward(const TensorView& h, const TensorView& dz, const TensorView& counts,
                                  const ActivationOptions& act, const TensorView& probs, const TensorView& dprobs,
                                  const Fp8QuantizeOptions& o, const Fp8Grouped& q, Stream stream, Allocator& alloc) {
  const int64_t cap = h.size(0), F = dz.size(1), cols = q.cols;
  if (!shape_fusable(h, F, act) || !loadable(dz) || dz.dtype != h.dtype) return false;
  ActSourceArgs a = source_args(h, F, act, probs);
  a.dz = dz.data;
  a.ld_dz = dz.stride(0);
  int64_t col_tiles = (cols + kTile - 1) / kTile;
  if (is_gated(act.kind)) {
    if (a.block != 0 && a.block <= 64 && kTile % (2 * a.block) == 0) {
      a.pairing = 0;  // whole gate/up pairs in every dh tile
    } else if (a.block == 0 && F % kTile == 0) {
      a.pairing = 1;
      a.passes = 2;
      col_tiles = F / kTile;
    } else if (a.block != 0 && a.block % kTile == 0) {
      a.pairing = 2;
      a.passes = 2;
      col_tiles = F / kTile;
    } else {
      return false;
    }
  }
  DeviceGuard guard(h.device.index);
  Buffer scratch, partial;
  dim3 grid;
  QuantParams p = fp8::grouped_params(counts, cap, cols, o, q, scratch, alloc, stream, grid);
  p.vec = cols % 16 == 0 && (p.data == nullptr || aligned(p.data, 16));
  grid.y = static_cast<unsigned>(std::max<int64_t>(1, col_tiles));
  if (dprobs.defined() && cap > 0) {
    partial = Buffer(alloc, sizeof(float) * static_cast<size_t>(grid.y) * cap, stream);
    a.partial = static_cast<float*>(partial.data());
  }
  launch_fused<ActBackwardSource>(h, act.kind, a, o, p, grid, stream);
  if (dprobs.defined() && cap > 0) {
    const int64_t* total = static_cast<const int64_t*>(scratch.data()) + counts.size(0);  // offsets[E]
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>((cap + 255) / 256, 4096));
    // (No column tiles: nothing was summed, every row's dprobs is an empty sum.)
    dprobs_reduce_kernel<<<blocks, 256, 0, stream>>>(a.partial, cols > 0 ? static_cast<int>(grid.y) : 0, cap, total,
                                                     static_cast<float*>(dprobs.data));
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  return true;
}

}  // namespace gmoe::cuda_backend
