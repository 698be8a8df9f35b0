// src/cuda/routing/permute.cu — permute, combine and their backwards on the device (gmoe/routing.h).
//
// Permute is a counting sort, not a comparison sort: a fixed number of launches whatever the
// routing, nothing read on the host.
//   1. tile_histogram: each tile of kTileTokens tokens counts its (token, slot) pairs per expert
//      (shared-memory integer atomics: exact in any order) -> tile_counts[tile, e]; an id outside
//      [0, E) is left out and recorded in the device error word.
//   2. expert_offsets (one block, a warp per expert at a time): per expert, the exclusive scan of
//      its tile counts over the tiles (the tile's first position inside the expert), the expert's
//      total, the kept part under the capacity, its group padded to pad_multiple; then the
//      exclusive scan of the padded groups over the experts -> offsets, counts, dropped.
//   3. place: each tile again; its warps take contiguous runs of the tile's pairs, count them per
//      expert, scan over the warps, then walk their run in 32-pair steps in (token, slot) order:
//      __match_any_sync groups the lanes holding one expert, a lane's rank among them plus the
//      warp's running count gives the pair's position in the expert. Stable, so deterministic.
//      Writes row_of, src_token (memset to -1 before) and the permuted probabilities.
//   4. gather_rows: one warp per permuted row copies x[src_token[row]] in 16-byte packs, or zeros
//      for padding and rows past the total: every row of the output written once, in one pass.
// Combine (and permute's backward, a combine with weights 1) is one warp per token summing its k
// rows in slot order in f32; its backward writes every expert row once (the (token, slot) of a row
// found through src_token) and forms dprobs as warp-reduced dot products.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/backend.h"
#include "cuda/routing/routing_common.cuh"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_errors.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::cuda_backend {
namespace {

using routing::from_f;
using routing::Pack;
using routing::to_f;
using routing::warp_sum;

constexpr int kTileTokens = 256;    // tokens per tile of the counting sort
constexpr int kPlaceWarps = 8;      // warps per tile in the placement
constexpr int kScanThreads = 1024;  // the one-block scan of expert_offsets
constexpr int kRowWarps = 8;        // warps per block of the row kernels (one row or token per warp)

__global__ void tile_histogram_kernel(const int32_t* ids, int64_t T, int k, int E, int* tile_counts,
                                      uint32_t* error_word) {
  extern __shared__ int hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t i0 = int64_t(blockIdx.x) * kTileTokens * k;
  const int64_t i1 = min(i0 + int64_t(kTileTokens) * k, T * k);
  bool bad = false;
  for (int64_t i = i0 + threadIdx.x; i < i1; i += blockDim.x) {
    const int32_t e = ids[i];
    if (e >= 0 && e < E) {
      atomicAdd(&hist[e], 1);
    } else {
      bad = true;
    }
  }
  if (bad) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) tile_counts[int64_t(blockIdx.x) * E + e] = hist[e];
}

__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// One block of kScanThreads. Warp w scans the experts w, w + warps, ...: its lanes take contiguous
// runs of the tiles (independent loads, so a long tile column costs a few round trips, not one per
// tile), a warp scan gives each run its start, and each tile count becomes the tile's first
// position inside the expert. The expert's total, cut at the capacity and padded, goes to shared
// memory; warp 0 then scans the padded groups over the experts (32 contiguous experts per lane).
__global__ void __launch_bounds__(kScanThreads)
    expert_offsets_kernel(int* tile_counts /* in: counts; out: first positions */, int64_t tiles, int E,
                          int64_t capacity, int64_t pad, int64_t* offsets, void* counts, bool counts_i64, void* dropped,
                          bool dropped_i64) {
  __shared__ int64_t group[routing::kMaxRoutingExperts];
  __shared__ unsigned long long n_dropped;
  const int warps = kScanThreads / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) n_dropped = 0;
  __syncthreads();
  const int64_t per = (tiles + 31) / 32;
  const int64_t t0 = min(per * lane, tiles), t1 = min(t0 + per, tiles);
  for (int e = warp; e < E; e += warps) {
    int64_t local = 0;
    for (int64_t t = t0; t < t1; ++t) local += tile_counts[t * E + e];
    const int64_t inclusive = warp_inclusive_sum(local);
    int64_t run = inclusive - local;
    for (int64_t t = t0; t < t1; ++t) {
      const int c = tile_counts[t * E + e];
      tile_counts[t * E + e] = static_cast<int>(run);
      run += c;
    }
    const int64_t total = __shfl_sync(0xffffffffu, inclusive, 31);
    if (lane == 0) {
      const int64_t kept = min(total, capacity);
      if (total != kept) atomicAdd(&n_dropped, static_cast<unsigned long long>(total - kept));
      group[e] = (kept + pad - 1) / pad * pad;
    }
  }
  __syncthreads();
  if (warp != 0) return;
  const int per_lane = (E + 31) / 32;
  const int first = min(lane * per_lane, E), last = min(first + per_lane, E);
  int64_t local = 0;
  for (int e = first; e < last; ++e) local += group[e];
  int64_t at = warp_inclusive_sum(local) - local;
  if (lane == 0) offsets[0] = 0;
  for (int e = first; e < last; ++e) {
    at += group[e];
    offsets[e + 1] = at;
    if (counts_i64) {
      static_cast<int64_t*>(counts)[e] = group[e];
    } else {
      static_cast<int32_t*>(counts)[e] = static_cast<int32_t>(group[e]);
    }
  }
  if (lane == 0 && dropped != nullptr) {
    if (dropped_i64) {
      *static_cast<int64_t*>(dropped) = static_cast<int64_t>(n_dropped);
    } else {
      *static_cast<int32_t*>(dropped) = static_cast<int32_t>(n_dropped);
    }
  }
}

struct PlaceArgs {
  const int32_t* ids;
  int64_t T;
  int k, E;
  const int* first_pos;  // [tiles, E]: the tile's first position inside each expert
  const int64_t* offsets;
  int64_t capacity;
  int32_t* row_of;
  int32_t* src_token;
  const float* probs;  // or nullptr
  float* permuted_probs;
};

__global__ void __launch_bounds__(kPlaceWarps * 32) place_kernel(PlaceArgs a) {
  extern __shared__ int run[];  // [kPlaceWarps][E]: counts, then each warp's running position
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < kPlaceWarps * a.E; i += blockDim.x) run[i] = 0;
  __syncthreads();
  const int64_t i0 = int64_t(blockIdx.x) * kTileTokens * a.k;
  const int64_t n = min(int64_t(kTileTokens) * a.k, a.T * a.k - i0);
  const int64_t per = (n + kPlaceWarps - 1) / kPlaceWarps;
  const int64_t w0 = i0 + min(per * warp, n), w1 = i0 + min(per * (warp + 1), n);
  int* mine = run + warp * a.E;
  for (int64_t i = w0 + lane; i < w1; i += 32) {
    const int32_t e = a.ids[i];
    if (e >= 0 && e < a.E) atomicAdd(&mine[e], 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) {  // exclusive scan over the warps, per expert
    int pos = a.first_pos[int64_t(blockIdx.x) * a.E + e];
    for (int w = 0; w < kPlaceWarps; ++w) {
      const int c = run[w * a.E + e];
      run[w * a.E + e] = pos;
      pos += c;
    }
  }
  __syncthreads();
  const unsigned below = (1u << lane) - 1u;
  for (int64_t b = w0; b < w1; b += 32) {
    const int64_t i = b + lane;
    const bool valid = i < w1;
    const int32_t raw = valid ? a.ids[i] : -1;
    const int32_t e = (raw >= 0 && raw < a.E) ? raw : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, e);
    int pos = 0;
    if (e >= 0) pos = mine[e] + __popc(peers & below);
    __syncwarp();
    if (e >= 0 && (peers >> lane) == 1u) mine[e] += __popc(peers);  // the group's highest lane
    __syncwarp();
    if (!valid) continue;
    int32_t row = -1;
    if (e >= 0 && pos < a.capacity) {
      row = static_cast<int32_t>(a.offsets[e] + pos);
      a.src_token[row] = static_cast<int32_t>(i / a.k);
      if (a.probs != nullptr) a.permuted_probs[row] = a.probs[i];
    }
    a.row_of[i] = row;
  }
}

// permuted[r] = x[src_token[r]], or zeros (padding, past the total, a token out of range).
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    gather_rows_kernel(const T* x, int64_t ld_x, int64_t T_, T* out, int64_t ld_out, int64_t rows, int64_t H,
                       const int32_t* src_token, uint32_t* error_word) {
  using P = Pack<T, V>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  for (int64_t r = blockIdx.x * int64_t(kRowWarps) + warp; r < rows; r += int64_t(gridDim.x) * kRowWarps) {
    const int32_t t = src_token[r];
    P* dst = reinterpret_cast<P*>(out + r * ld_out);
    if (t < 0 || t >= T_) {
      if (t >= T_ && lane == 0) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
      P zero;
#pragma unroll
      for (int v = 0; v < V; ++v) zero.v[v] = from_f<T>(0.f);
      for (int64_t c = lane; c < packs; c += 32) dst[c] = zero;
      continue;
    }
    const P* src = reinterpret_cast<const P*>(x + t * ld_x);
    for (int64_t c = lane; c < packs; c += 32) dst[c] = src[c];
  }
}

// out[t] = Σ_j w[t, j] · y[row_of[t, j]] over the kept slots, in slot order, f32, rounded once
// (w: probs, or 1 when nullptr). A row outside [-1, rows) counts as dropped and is recorded.
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    combine_kernel(const T* y, int64_t ld_y, int64_t rows, const int32_t* row_of, const float* w, int k, T* out,
                   int64_t ld_out, int64_t T_, int64_t H, uint32_t* error_word) {
  using P = Pack<T, V>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  for (int64_t t = blockIdx.x * int64_t(kRowWarps) + warp; t < T_; t += int64_t(gridDim.x) * kRowWarps) {
    bool bad = false;
    for (int64_t c = lane; c < packs; c += 32) {
      float acc[V];
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = 0.f;
      for (int j = 0; j < k; ++j) {
        const int32_t r = row_of[t * k + j];
        if (r < 0 || r >= rows) {
          bad = bad || r >= rows || r < -1;
          continue;
        }
        const float p = w != nullptr ? w[t * k + j] : 1.f;
        const P in = reinterpret_cast<const P*>(y + r * ld_y)[c];
#pragma unroll
        for (int v = 0; v < V; ++v) acc[v] += p * to_f(in.v[v]);
      }
      P o;
#pragma unroll
      for (int v = 0; v < V; ++v) o.v[v] = from_f<T>(acc[v]);
      reinterpret_cast<P*>(out + t * ld_out)[c] = o;
    }
    if (bad) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
  }
}

// dprobs[t, j] = dpermuted_probs[row_of[t, j]], 0 where dropped.
__global__ void gather_probs_kernel(const float* dpp, int64_t rows, const int32_t* row_of, int64_t n, float* dprobs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = row_of[i];
    dprobs[i] = (r >= 0 && r < rows) ? dpp[r] : 0.f;
  }
}

// dy[r] = w[t, j] · dout[t] for the (t, j) whose row is r, zeros on every other row.
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    combine_backward_rows_kernel(const T* dout, int64_t ld_dout, int64_t T_, const int32_t* row_of,
                                 const int32_t* src_token, const float* w, int k, T* dy, int64_t ld_dy, int64_t rows,
                                 int64_t H, uint32_t* error_word) {
  using P = Pack<T, V>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  for (int64_t r = blockIdx.x * int64_t(kRowWarps) + warp; r < rows; r += int64_t(gridDim.x) * kRowWarps) {
    const int32_t t = src_token[r];
    int slot = -1;
    if (t >= 0 && t < T_) {
      for (int j = 0; j < k; ++j) slot = (slot < 0 && row_of[int64_t(t) * k + j] == r) ? j : slot;
    }
    if (t >= T_ && lane == 0) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
    P* dst = reinterpret_cast<P*>(dy + r * ld_dy);
    if (slot < 0) {
      P zero;
#pragma unroll
      for (int v = 0; v < V; ++v) zero.v[v] = from_f<T>(0.f);
      for (int64_t c = lane; c < packs; c += 32) dst[c] = zero;
      continue;
    }
    const float p = w != nullptr ? w[int64_t(t) * k + slot] : 1.f;
    const P* src = reinterpret_cast<const P*>(dout + int64_t(t) * ld_dout);
    for (int64_t c = lane; c < packs; c += 32) {
      const P in = src[c];
      P o;
#pragma unroll
      for (int v = 0; v < V; ++v) o.v[v] = from_f<T>(p * to_f(in.v[v]));
      dst[c] = o;
    }
  }
}

// dprobs[t, j] = Σ_h dout[t, h] · y[row_of[t, j], h] in f32: lanes over packs in order, then the
// warp butterfly. 0 where dropped.
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32)
    combine_dprobs_kernel(const T* dout, int64_t ld_dout, const T* y, int64_t ld_y, int64_t rows, const int32_t* row_of,
                          int k, int64_t T_, int64_t H, float* dprobs) {
  using P = Pack<T, V>;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  for (int64_t t = blockIdx.x * int64_t(kRowWarps) + warp; t < T_; t += int64_t(gridDim.x) * kRowWarps) {
    const P* g = reinterpret_cast<const P*>(dout + t * ld_dout);
    for (int j = 0; j < k; ++j) {
      const int32_t r = row_of[t * k + j];
      float dot = 0.f;
      if (r >= 0 && r < rows) {
        const P* yr = reinterpret_cast<const P*>(y + r * ld_y);
        for (int64_t c = lane; c < packs; c += 32) {
          const P a = g[c], b = yr[c];
#pragma unroll
          for (int v = 0; v < V; ++v) dot += to_f(a.v[v]) * to_f(b.v[v]);
        }
      }
      dot = warp_sum(dot);
      if (lane == 0) dprobs[t * k + j] = dot;
    }
  }
}

void check_cuda_experts(int64_t E) {
  GMOE_CHECK(E <= routing::kMaxRoutingExperts, "counts: at most ", routing::kMaxRoutingExperts,
             " experts on CUDA, got ", E);
}

void launch_combine(const TensorView& y, const TensorView& row_of, const float* w, const TensorView& out,
                    cudaStream_t stream) {
  const int64_t T = out.size(0), H = out.size(1);
  if (T == 0 || H == 0) return;
  routing::with_row_type(y.dtype, H, {y, out}, [&](auto t, auto v) {
    using T_ = decltype(t);
    constexpr int V = decltype(v)::value;
    combine_kernel<T_, V><<<routing::grid_for(T, kRowWarps), kRowWarps * 32, 0, stream>>>(
        static_cast<const T_*>(y.data), y.stride(0), y.size(0), static_cast<const int32_t*>(row_of.data), w,
        int(row_of.size(1)), static_cast<T_*>(out.data), out.stride(0), T, H, device_error_word());
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs, const TensorView& permuted_probs,
             const TensorView& dropped, Stream stream_, Allocator& alloc) {
  cudaStream_t stream = stream_;
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = counts.size(0), rows = permuted.size(0);
  check_cuda_experts(E);
  const int64_t cap_opt = expert_capacity(T, k, E, options);
  const int64_t capacity = cap_opt < 0 ? std::numeric_limits<int64_t>::max() : cap_opt;
  const int64_t tiles = (T + kTileTokens - 1) / kTileTokens;
  // Scratch: tile counts (then first positions) [max(tiles, 1), E] and offsets [E + 1].
  Buffer scratch(alloc, size_t(std::max<int64_t>(tiles, 1)) * E * sizeof(int) + size_t(E + 1) * sizeof(int64_t) + 16,
                 stream_);
  int64_t* offsets = static_cast<int64_t*>(scratch.data());
  int* tile_counts = reinterpret_cast<int*>(offsets + E + 1);
  if (tiles == 0) GMOE_CUDA_CHECK(cudaMemsetAsync(tile_counts, 0, size_t(E) * sizeof(int), stream));
  if (rows > 0) GMOE_CUDA_CHECK(cudaMemsetAsync(map.src_token.data, 0xff, size_t(rows) * sizeof(int32_t), stream));
  if (permuted_probs.defined() && rows > 0) {
    GMOE_CUDA_CHECK(cudaMemsetAsync(permuted_probs.data, 0, size_t(rows) * sizeof(float), stream));
  }
  const int32_t* id = static_cast<const int32_t*>(ids.data);
  if (tiles > 0) {
    tile_histogram_kernel<<<unsigned(tiles), 256, size_t(E) * sizeof(int), stream>>>(id, T, int(k), int(E), tile_counts,
                                                                                     device_error_word());
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  expert_offsets_kernel<<<1, kScanThreads, 0, stream>>>(
      tile_counts, std::max<int64_t>(tiles, 1), int(E), capacity, options.pad_multiple, offsets, counts.data,
      counts.dtype == DType::i64, dropped.defined() ? dropped.data : nullptr,
      dropped.defined() && dropped.dtype == DType::i64);
  GMOE_CUDA_CHECK(cudaGetLastError());
  if (tiles > 0) {
    PlaceArgs a{id,
                T,
                int(k),
                int(E),
                tile_counts,
                offsets,
                capacity,
                static_cast<int32_t*>(map.row_of.data),
                static_cast<int32_t*>(map.src_token.data),
                probs.defined() ? static_cast<const float*>(probs.data) : nullptr,
                permuted_probs.defined() ? static_cast<float*>(permuted_probs.data) : nullptr};
    place_kernel<<<unsigned(tiles), kPlaceWarps * 32, size_t(kPlaceWarps) * E * sizeof(int), stream>>>(a);
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  if (rows == 0 || H == 0) return;
  routing::with_row_type(x.dtype, H, {x, permuted}, [&](auto t, auto v) {
    using T_ = decltype(t);
    constexpr int V = decltype(v)::value;
    gather_rows_kernel<T_, V><<<routing::grid_for(rows, kRowWarps), kRowWarps * 32, 0, stream>>>(
        static_cast<const T_*>(x.data), x.stride(0), T, static_cast<T_*>(permuted.data), permuted.stride(0), rows, H,
        static_cast<const int32_t*>(map.src_token.data), device_error_word());
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs, const TensorView& dprobs, Stream stream, Allocator&) {
  launch_combine(dpermuted, map.row_of, nullptr, dx, stream);
  const int64_t n = map.row_of.numel();
  if (dprobs.defined() && n > 0) {
    gather_probs_kernel<<<routing::grid_for(n, 256), 256, 0, stream>>>(
        static_cast<const float*>(dpermuted_probs.data), dpermuted.size(0),
        static_cast<const int32_t*>(map.row_of.data), n, static_cast<float*>(dprobs.data));
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
}

void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out,
             Stream stream, Allocator&) {
  launch_combine(expert_out, map.row_of, probs.defined() ? static_cast<const float*>(probs.data) : nullptr, out,
                 stream);
}

void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs,
                      Stream stream_, Allocator&) {
  cudaStream_t stream = stream_;
  const int64_t T = dout.size(0), H = dout.size(1), rows = dexpert_out.size(0), k = map.row_of.size(1);
  const float* w = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  const int32_t* row_of = static_cast<const int32_t*>(map.row_of.data);
  if (rows > 0 && H > 0) {
    routing::with_row_type(dout.dtype, H, {dout, dexpert_out}, [&](auto t, auto v) {
      using T_ = decltype(t);
      constexpr int V = decltype(v)::value;
      combine_backward_rows_kernel<T_, V><<<routing::grid_for(rows, kRowWarps), kRowWarps * 32, 0, stream>>>(
          static_cast<const T_*>(dout.data), dout.stride(0), T, row_of, static_cast<const int32_t*>(map.src_token.data),
          w, int(k), static_cast<T_*>(dexpert_out.data), dexpert_out.stride(0), rows, H, device_error_word());
    });
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  if (!dprobs.defined() || T == 0) return;
  routing::with_row_type(dout.dtype, H, {dout, expert_out}, [&](auto t, auto v) {
    using T_ = decltype(t);
    constexpr int V = decltype(v)::value;
    combine_dprobs_kernel<T_, V><<<routing::grid_for(T, kRowWarps), kRowWarps * 32, 0, stream>>>(
        static_cast<const T_*>(dout.data), dout.stride(0), static_cast<const T_*>(expert_out.data),
        expert_out.stride(0), rows, row_of, int(k), T, H, static_cast<float*>(dprobs.data));
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gmoe::cuda_backend
