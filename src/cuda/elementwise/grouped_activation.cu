// src/cuda/elementwise/grouped_activation.cu — grouped activations on the device (forward, backward), and the
// gate/up row permutation of FC1 weights and biases.
//
// Both activation passes are memory bound: a row of h (2F columns) and, backward, a row of dz are
// read once, z or dh (and optionally the recomputed z) written once. One warp owns one row at a
// time (grid-stride over rows, a full-occupancy grid of warps), and each lane moves 16 bytes per
// load and store (8 bf16/f16 or 4 f32 elements) when F, the interleave block, every row stride and
// every pointer allow it; otherwise it falls back to element loads (same kernel, VEC = 1). With 64
// warps per SM and two or three 16-byte loads per lane in flight, each SM keeps 64-96 KB of loads
// in flight, more than HBM's latency-bandwidth product needs.
//
// Interleaved gate/up: because the block is a multiple of VEC and chunks start at multiples of
// VEC, the VEC gate elements of a chunk are contiguous, and so are the matching up elements (one
// block further); concatenated halves are the case "block = F".
//
// dprobs (Σ_j dz·act over a row): each lane sums its chunks in column order, then a butterfly of
// warp shuffles combines the 32 partials in a fixed tree: deterministic, no atomics, and the
// result does not depend on the batch around the row.
//
// amax_out (optional, for a tensorwise FP8 quantization of the output that follows): each lane
// keeps the largest finite |value| of what it stored (as rounded to the output dtype) over a row,
// the warp reduces it at the row's end and one atomicMax on the f32 bits goes to the row's expert
// (found by binary search in the offsets). Non-negative floats order like their bits, so the
// result does not depend on the order: deterministic. The dh or z read back by the quantizer gives
// the same amax, so its scale and bits are those of the quantizer's own amax pass.
//
// The real total of rows comes from launch_group_offsets (one warp: counts clamped like the GEMMs',
// problems recorded in the device error word): rows at or past it get zeros, so the grid and every
// bound are host-known and the kernels are graph-capturable under any routing.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <cstdint>
#include <type_traits>

#include "common/activation_math.h"
#include "common/backend.h"
#include "common/fp8_rules.h"
#include "cuda/elementwise/activation_common.cuh"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/runtime/group_offsets.cuh"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kMaxThreadsPerSm = 2048;

using act_common::from_f;
using act_common::to_f;
using act_common::with_kind;

// VEC elements moved as one load/store (16 bytes when VEC = 16 / sizeof(T)).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
}
template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC>& v) {
  *reinterpret_cast<Pack<T, VEC>*>(p) = v;
}
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> zero_pack() {
  Pack<T, VEC> z;
#pragma unroll
  for (int i = 0; i < VEC; ++i) z.v[i] = from_f<T>(0.0f);
  return z;
}

template <typename T, int VEC>
__device__ __forceinline__ void zero_row(T* row, int chunks, int lane) {
  const Pack<T, VEC> z = zero_pack<T, VEC>();
  for (int c = lane; c < chunks; c += 32) store_pack<T, VEC>(row + c * VEC, z);
}

struct ActArgs : act_common::HArgs {
  const void* dz = nullptr;  // backward
  int64_t ld_dz = 0;
  void* dh = nullptr;        // backward
  int64_t ld_dh = 0;
  void* z = nullptr;         // forward output; backward: the optional recomputed z
  int64_t ld_z = 0;
  const float* probs = nullptr;
  float* dprobs = nullptr;   // backward, optional
  const int64_t* total = nullptr;  // device: the clamped real total of rows
  // Backward, interleave blocks that tile a round of 32 chunks: block / VEC chunks per block when
  // dh's stores are regrouped into contiguous rounds (see regroup_store_row); 0 = direct stores.
  int regroup = 0;
};

// amax_out: [E] f32 bits, zeroed before; the experts' row offsets [E+1]. A kernel parameter of its
// own: ActArgs grown by these fields makes nvcc address the parameter block through a pointer and
// compile the concatenated backward's row loop as one version instead of two (a loop unswitched
// on the run-time options), several times slower.
struct AmaxArgs {
  uint32_t* amax = nullptr;
  const int64_t* offsets = nullptr;
  int num_experts = 0;
};

// The largest finite |value| of a pack, into m.
template <typename T, int VEC>
__device__ __forceinline__ void pack_amax(float& m, const Pack<T, VEC>& v) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) m = fmaxf(m, fp8_rules::finite_abs(to_f(v.v[i])));
}

// Row r's amax (each lane's m) into its expert's word: every lane of the warp calls it.
__device__ __forceinline__ void flush_row_amax(AmaxArgs am, int64_t r, float m) {
#pragma unroll
  for (int d = 16; d >= 1; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  if ((threadIdx.x & 31) == 0 && m > 0.0f) {
    atomicMax(&am.amax[find_group(am.offsets, am.num_experts, r)], __float_as_uint(m));
  }
}

// kAmax: amax_out asked for (am.amax); without it the kernels compile as they do alone.
template <typename T, int VEC, ActivationKind K, bool kAmax>
__global__ void __launch_bounds__(kThreads) activation_forward_kernel(ActArgs a, AmaxArgs am) {
  constexpr bool kGated = K != ActivationKind::squared_relu;
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const int64_t total = *a.total;
  const int chunks = a.F / VEC;
  const int up = kGated ? act::up_offset(a.F, a.block) : 0;
  for (int64_t r = first_warp; r < a.capacity; r += warps) {
    T* z = static_cast<T*>(a.z) + r * a.ld_z;
    if (r >= total) {
      zero_row<T, VEC>(z, chunks, lane);
      continue;
    }
    const T* h = static_cast<const T*>(a.h) + r * a.ld_h;
    const float p = a.probs != nullptr ? a.probs[r] : 1.0f;
    [[maybe_unused]] float m = 0.0f;  // kAmax: the largest |z| this lane stored
    for (int c = lane; c < chunks; c += 32) {
      const int j = c * VEC;
      Pack<T, VEC> out;
      if constexpr (kGated) {
        const int gc = act::gate_column(j, a.block);
        const Pack<T, VEC> g = load_pack<T, VEC>(h + gc);
        const Pack<T, VEC> u = load_pack<T, VEC>(h + gc + up);
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          out.v[i] = from_f<T>(act::gated_value<K>(to_f(g.v[i]), to_f(u.v[i]), a.prm) * p);
        }
      } else {
        const Pack<T, VEC> x = load_pack<T, VEC>(h + j);
#pragma unroll
        for (int i = 0; i < VEC; ++i) out.v[i] = from_f<T>(act::squared_relu_value(to_f(x.v[i])) * p);
      }
      store_pack<T, VEC>(z + j, out);
      if constexpr (kAmax) pack_amax<T, VEC>(m, out);
    }
    if constexpr (kAmax) flush_row_amax(am, r, m);
  }
}

// The gated activation's backward on one chunk: dz pack g, h's gate and up packs → dg, du, the
// recomputed z (zo) and this chunk's share of dprobs (added to dp).
template <typename T, int VEC, ActivationKind K>
__device__ __forceinline__ void gated_backward_values(const Pack<T, VEC>& g, const Pack<T, VEC>& hg,
                                                      const Pack<T, VEC>& hu, float p, const act::Params& prm,
                                                      Pack<T, VEC>& dg, Pack<T, VEC>& du, Pack<T, VEC>& zo,
                                                      float& dp) {
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    const act::Eval ev = act::gated_eval<K>(to_f(hg.v[i]), to_f(hu.v[i]), prm);
    const float gi = to_f(g.v[i]);
    const float gp = gi * p;
    dg.v[i] = from_f<T>(gp * ev.d_gate);
    du.v[i] = from_f<T>(gp * ev.d_up);
    zo.v[i] = from_f<T>(ev.value * p);
    dp += gi * ev.value;
  }
}

// Lane `src`'s pack (16 bytes as 32-bit words) to every lane that asks: all 32 lanes call it.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> shfl_pack(const Pack<T, VEC>& v, int src) {
  static_assert(sizeof(Pack<T, VEC>) % 4 == 0, "packs move as 32-bit words");
  constexpr int kWords = int(sizeof(Pack<T, VEC>) / 4);
  uint32_t w[kWords];
  memcpy(w, &v, sizeof(w));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_sync(0xffffffffu, w[i], src);
  Pack<T, VEC> out;
  memcpy(&out, w, sizeof(w));
  return out;
}

// Stores one round of dh (the gate and up packs of 32 consecutive output chunks, one per lane,
// chunk c of the round at lane c) as two warp-wide stores of 32 consecutive 16-byte chunks each.
// Stored straight from each lane, gate/up blocks of `bc` = block / VEC chunks (bc < 32) make each
// store instruction write every other run of bc chunks over twice the span, several times slower
// than contiguous stores. Position p of the round (0..63, 16-byte chunks of dh) holds gate
// or up ((p / bc) odd) of output chunk (p / (2 bc)) bc + p mod bc. `valid`: positions below it
// exist (a row's last round may be short; it holds whole gate/up block pairs).
template <typename T, int VEC>
__device__ __forceinline__ void regroup_store_row(T* dh_round, const Pack<T, VEC>& dg, const Pack<T, VEC>& du,
                                                  int bc, int lane, int valid) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int p = 32 * half + lane;
    const int q = p / (2 * bc), o = p % (2 * bc);
    const int owner = q * bc + o % bc;
    const Pack<T, VEC> g = shfl_pack<T, VEC>(dg, owner);
    const Pack<T, VEC> u = shfl_pack<T, VEC>(du, owner);
    if (p < valid) store_pack<T, VEC>(dh_round + p * VEC, o < bc ? g : u);
  }
}

// kRegroup: dh's stores regrouped into whole rounds (a.regroup = chunks per block); a kernel of
// its own, so that the direct path compiles as it does alone (one kernel for both makes the
// concatenated layout's loop slower). The row loop stays in the kernel's body: split into
// helpers, nvcc compiles many of its instantiations to longer code.
template <typename T, int VEC, ActivationKind K, bool kRegroup, bool kAmax>
__global__ void __launch_bounds__(kThreads) activation_backward_kernel(ActArgs a, AmaxArgs am) {
  constexpr bool kGated = K != ActivationKind::squared_relu;
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (int64_t(blockIdx.x) * kThreads + threadIdx.x) >> 5;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const int64_t total = *a.total;
  const int chunks = a.F / VEC;
  const int up = kGated ? act::up_offset(a.F, a.block) : 0;
  for (int64_t r = first_warp; r < a.capacity; r += warps) {
    T* dh = static_cast<T*>(a.dh) + r * a.ld_dh;
    T* z = a.z != nullptr ? static_cast<T*>(a.z) + r * a.ld_z : nullptr;
    if (r >= total) {
      zero_row<T, VEC>(dh, kGated ? 2 * chunks : chunks, lane);
      if (z != nullptr) zero_row<T, VEC>(z, chunks, lane);
      if (a.dprobs != nullptr && lane == 0) a.dprobs[r] = 0.0f;
      continue;
    }
    const T* h = static_cast<const T*>(a.h) + r * a.ld_h;
    const T* dz = static_cast<const T*>(a.dz) + r * a.ld_dz;
    const float p = a.probs != nullptr ? a.probs[r] : 1.0f;
    float dp = 0.0f;
    [[maybe_unused]] float m = 0.0f;  // kAmax: the largest |dh| this lane stored
    if constexpr (kGated && kRegroup) {
      // Whole rounds of 32 chunks, every lane in each (the stores shuffle across the warp).
      for (int base = 0; base < chunks; base += 32) {
        const int c = base + lane;
        const bool active = c < chunks;
        const int j = c * VEC;
        const int gc = act::gate_column(j, a.block);
        Pack<T, VEC> dg = zero_pack<T, VEC>(), du = zero_pack<T, VEC>(), zo;
        if (active) {
          gated_backward_values<T, VEC, K>(load_pack<T, VEC>(dz + j), load_pack<T, VEC>(h + gc),
                                           load_pack<T, VEC>(h + gc + up), p, a.prm, dg, du, zo, dp);
          if (z != nullptr) store_pack<T, VEC>(z + j, zo);
          if constexpr (kAmax) {
            pack_amax<T, VEC>(m, dg);
            pack_amax<T, VEC>(m, du);
          }
        }
        // Every lane has read its h above; the shuffles order those reads before any store
        // over them (dh may alias h).
        const int valid = 2 * min(32, chunks - base);
        regroup_store_row<T, VEC>(dh + 2 * base * VEC, dg, du, a.regroup, lane, valid);
      }
    }
    for (int c = kRegroup ? chunks : lane; c < chunks; c += 32) {
      const int j = c * VEC;
      const Pack<T, VEC> g = load_pack<T, VEC>(dz + j);
      Pack<T, VEC> zo;
      if constexpr (kGated) {
        const int gc = act::gate_column(j, a.block);
        Pack<T, VEC> dg, du;
        gated_backward_values<T, VEC, K>(g, load_pack<T, VEC>(h + gc), load_pack<T, VEC>(h + gc + up), p, a.prm, dg, du,
                                         zo, dp);
        // h is read completely above before dh (which may alias h) is written.
        store_pack<T, VEC>(dh + gc, dg);
        store_pack<T, VEC>(dh + gc + up, du);
        if constexpr (kAmax) {
          pack_amax<T, VEC>(m, dg);
          pack_amax<T, VEC>(m, du);
        }
      } else {
        const Pack<T, VEC> x = load_pack<T, VEC>(h + j);
        Pack<T, VEC> dx;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xi = to_f(x.v[i]);
          const float gi = to_f(g.v[i]);
          const float av = act::squared_relu_value(xi);
          dx.v[i] = from_f<T>(gi * p * act::squared_relu_derivative(xi));
          zo.v[i] = from_f<T>(av * p);
          dp += gi * av;
        }
        store_pack<T, VEC>(dh + j, dx);
        if constexpr (kAmax) pack_amax<T, VEC>(m, dx);
      }
      if (z != nullptr) store_pack<T, VEC>(z + j, zo);
    }
    if constexpr (kAmax) flush_row_amax(am, r, m);
    if (a.dprobs != nullptr) {
#pragma unroll
      for (int d = 16; d >= 1; d >>= 1) dp += __shfl_xor_sync(0xffffffffu, dp, d);
      if (lane == 0) a.dprobs[r] = dp;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side: one switch from run-time values onto the compiled kernels.

template <typename F>
void with_storage(DType dt, F&& f) {
  switch (dt) {
    case DType::bf16: f(__nv_bfloat16{}); return;
    case DType::f16: f(__half{}); return;
    case DType::f32: f(float{}); return;
    default: GMOE_FAIL("grouped activation on CUDA: dtype ", dtype_name(dt), " not supported");
  }
}

// The 16-byte path needs every row start of every tensor 16-byte aligned, and VEC-element chunks
// that never straddle a gate/up block.
bool can_vectorize(const ActArgs& a, int vec, const TensorView* const* views, int n_views) {
  if (a.F % vec != 0 || a.block % vec != 0) return false;
  for (int i = 0; i < n_views; ++i) {
    const TensorView& t = *views[i];
    if (!t.defined()) continue;
    if (!aligned(t.data, 16) || t.stride(0) % vec != 0) return false;
  }
  return true;
}

ActArgs common_args(const TensorView& h, int64_t F, const ActivationOptions& o) {
  GMOE_CHECK(2 * F <= INT32_MAX, "h: ", 2 * F, " columns exceed the 32-bit column indices of the CUDA kernels");
  ActArgs a;
  static_cast<act_common::HArgs&>(a) = act_common::h_args(h, F, o);
  return a;
}

// Launches kernel<T, VEC, K> over a full-occupancy grid of warps (one warp per row at a time).
template <template <typename, int, ActivationKind> class Kernel>
void launch(DType dt, ActivationKind kind, bool vectorize, const ActArgs& a, const AmaxArgs& am,
            cudaStream_t stream) {
  const int64_t blocks_needed = (a.capacity + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t resident = int64_t(sm_count(current_device())) * (kMaxThreadsPerSm / kThreads);
  const unsigned blocks = static_cast<unsigned>(std::min(blocks_needed, resident));
  with_storage(dt, [&](auto t) {
    using T = decltype(t);
    constexpr int kVec = 16 / int(sizeof(T));
    with_kind(kind, [&](auto k) {
      constexpr ActivationKind K = decltype(k)::value;
      if (vectorize) {
        Kernel<T, kVec, K>::launch(blocks, stream, a, am);
      } else {
        Kernel<T, 1, K>::launch(blocks, stream, a, am);
      }
    });
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename T, int VEC, ActivationKind K>
struct ForwardKernel {
  static void launch(unsigned blocks, cudaStream_t s, const ActArgs& a, const AmaxArgs& am) {
    if (am.amax != nullptr) {
      activation_forward_kernel<T, VEC, K, true><<<blocks, kThreads, 0, s>>>(a, am);
    } else {
      activation_forward_kernel<T, VEC, K, false><<<blocks, kThreads, 0, s>>>(a, am);
    }
  }
};
template <typename T, int VEC, ActivationKind K>
struct BackwardKernel {
  template <bool kAmax>
  static void launch_amax(unsigned blocks, cudaStream_t s, const ActArgs& a, const AmaxArgs& am) {
    if constexpr (VEC > 1 && K != ActivationKind::squared_relu) {
      if (a.regroup != 0) {
        activation_backward_kernel<T, VEC, K, true, kAmax><<<blocks, kThreads, 0, s>>>(a, am);
        return;
      }
    }
    activation_backward_kernel<T, VEC, K, false, kAmax><<<blocks, kThreads, 0, s>>>(a, am);
  }
  static void launch(unsigned blocks, cudaStream_t s, const ActArgs& a, const AmaxArgs& am) {
    if (am.amax != nullptr) {
      launch_amax<true>(blocks, s, a, am);
    } else {
      launch_amax<false>(blocks, s, a, am);
    }
  }
};

// The clamped real total (offsets[E] of launch_group_offsets) into a and the experts' row offsets
// into the result, in scratch that lives on `stream` until the caller's Buffer goes out of scope
// after its launches; amax_out (optional, f32 [E]) zeroed for the kernel's atomicMax.
AmaxArgs launch_offsets(const TensorView& counts, const TensorView& amax_out, ActArgs& a, Buffer& scratch,
                        Allocator& alloc, Stream stream) {
  const int64_t E = counts.size(0);
  scratch = Buffer(alloc, static_cast<size_t>(E + 1) * sizeof(int64_t), stream);
  int64_t* offsets = static_cast<int64_t*>(scratch.data());
  launch_group_offsets(counts, a.capacity, offsets, nullptr, 1, 1, stream);
  a.total = offsets + E;
  AmaxArgs am;
  am.offsets = offsets;
  am.num_experts = static_cast<int>(E);
  if (amax_out.defined() && E > 0) {
    am.amax = static_cast<uint32_t*>(amax_out.data);
    GMOE_CUDA_CHECK(cudaMemsetAsync(am.amax, 0, sizeof(uint32_t) * E, stream));
  }
  return am;
}

// ---------------------------------------------------------------------------------------------
// Gate/up row permutation: one block per destination row (grid-stride), 16-byte copies when
// every row start is 16-byte aligned and the row length a multiple of 16 bytes.

struct PermuteArgs {
  const char* src = nullptr;
  char* dst = nullptr;
  int64_t src_outer = 0, src_row = 0;  // strides in bytes
  int64_t dst_outer = 0, dst_row = 0;
  int64_t outer = 0, rows = 0, row_bytes = 0;
  int64_t from_block = 0, to_block = 0;  // 0: concatenated
};

template <bool kVec16>
__global__ void permute_glu_rows_kernel(PermuteArgs a) {
  const int64_t F = a.rows / 2;
  for (int64_t i = blockIdx.x; i < a.outer * a.rows; i += gridDim.x) {
    const int64_t o = i / a.rows, rd = i % a.rows;
    // (half, j) of destination row rd in the `to` layout, then its row in the `from` layout.
    int64_t half, j;
    if (a.to_block == 0) {
      half = rd / F;
      j = rd % F;
    } else {
      const int64_t w = rd % (2 * a.to_block);
      half = w / a.to_block;
      j = (rd / (2 * a.to_block)) * a.to_block + w % a.to_block;
    }
    const int64_t rs = act::gate_column(j, a.from_block) + half * act::up_offset(F, a.from_block);
    const char* s = a.src + o * a.src_outer + rs * a.src_row;
    char* d = a.dst + o * a.dst_outer + rd * a.dst_row;
    if constexpr (kVec16) {
      for (int64_t b = threadIdx.x; b < a.row_bytes / 16; b += blockDim.x) {
        reinterpret_cast<uint4*>(d)[b] = reinterpret_cast<const uint4*>(s)[b];
      }
    } else {
      for (int64_t b = threadIdx.x; b < a.row_bytes; b += blockDim.x) d[b] = s[b];
    }
  }
}

}  // namespace

void grouped_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                                const ActivationOptions& options, const TensorView& probs,
                                const TensorView& amax_out, Stream stream_, Allocator& alloc) {
  const cudaStream_t stream = stream_;
  DeviceGuard guard(h.device.index);
  ActArgs a = common_args(h, z.size(1), options);
  if (a.capacity == 0 || a.F == 0) {  // no values: every expert's amax is 0
    if (amax_out.defined()) zero_bytes(amax_out.data, sizeof(float) * amax_out.size(0), stream_);
    return;
  }
  a.z = z.data;
  a.ld_z = z.stride(0);
  a.probs = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  const TensorView* views[] = {&h, &z};
  const bool vec = can_vectorize(a, 16 / int(dtype_size(h.dtype)), views, 2);
  Buffer scratch;
  const AmaxArgs am = launch_offsets(counts, amax_out, a, scratch, alloc, stream_);
  launch<ForwardKernel>(h.dtype, options.kind, vec, a, am, stream);
}

void grouped_activation_backward(const TensorView& h, const TensorView& dz, const TensorView& counts,
                                 const TensorView& dh, const ActivationOptions& options, const TensorView& probs,
                                 const TensorView& dprobs, const TensorView& z_out, const TensorView& amax_out,
                                 Stream stream_, Allocator& alloc) {
  const cudaStream_t stream = stream_;
  DeviceGuard guard(h.device.index);
  ActArgs a = common_args(h, dz.size(1), options);
  if (a.capacity == 0 || a.F == 0) {  // nothing per column: each row's dprobs is an empty sum, amax 0
    if (dprobs.defined() && a.capacity > 0) zero_bytes(dprobs.data, a.capacity * sizeof(float), stream_);
    if (amax_out.defined()) zero_bytes(amax_out.data, sizeof(float) * amax_out.size(0), stream_);
    return;
  }
  a.dz = dz.data;
  a.ld_dz = dz.stride(0);
  a.dh = dh.data;
  a.ld_dh = dh.stride(0);
  a.z = z_out.defined() ? z_out.data : nullptr;
  a.ld_z = z_out.defined() ? z_out.stride(0) : 0;
  a.probs = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  a.dprobs = dprobs.defined() ? static_cast<float*>(dprobs.data) : nullptr;
  const TensorView* views[] = {&h, &dz, &dh, &z_out};
  const int vec_elems = 16 / int(dtype_size(h.dtype));
  const bool vec = can_vectorize(a, vec_elems, views, 4);
  // Interleave blocks whose gate/up pairs tile a round of 32 chunks: regrouped stores.
  if (vec && a.block != 0 && (32 * vec_elems) % a.block == 0) a.regroup = a.block / vec_elems;
  Buffer scratch;
  const AmaxArgs am = launch_offsets(counts, amax_out, a, scratch, alloc, stream_);
  launch<BackwardKernel>(h.dtype, options.kind, vec, a, am, stream);
}

void permute_glu_rows(const TensorView& src, const TensorView& dst, const GluFormat& from, const GluFormat& to,
                      Stream stream) {
  DeviceGuard guard(src.device.index);
  const int64_t es = static_cast<int64_t>(dtype_size(src.dtype));
  PermuteArgs a;
  a.src = static_cast<const char*>(src.data);
  a.dst = static_cast<char*>(dst.data);
  a.src_outer = src.stride(0) * es;
  a.src_row = src.stride(1) * es;
  a.dst_outer = dst.stride(0) * es;
  a.dst_row = dst.stride(1) * es;
  a.outer = src.size(0);
  a.rows = src.size(1);
  a.row_bytes = src.size(2) * es;
  a.from_block = from.layout == GluLayout::interleaved ? from.block : 0;
  a.to_block = to.layout == GluLayout::interleaved ? to.block : 0;
  if (a.outer == 0 || a.rows == 0 || a.row_bytes == 0) return;
  const bool vec = aligned(a.src, 16) && aligned(a.dst, 16) && a.row_bytes % 16 == 0 && a.src_outer % 16 == 0 &&
                   a.src_row % 16 == 0 && a.dst_outer % 16 == 0 && a.dst_row % 16 == 0;
  const int64_t rows = a.outer * a.rows;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(rows, int64_t(sm_count(current_device())) * 16));
  if (vec) {
    permute_glu_rows_kernel<true><<<blocks, 128, 0, stream>>>(a);
  } else {
    permute_glu_rows_kernel<false><<<blocks, 128, 0, stream>>>(a);
  }
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gmoe::cuda_backend
