// src/cuda/runtime/group_offsets.cuh — group offsets from device counts, shared by every op that maps
// grouped rows to experts on the device (grouped bias, FP8 quantization).
//
// One single-warp launch reads the counts on the device, clamps them like the grouped GEMM's
// preparation (a negative count is 0, the total is clamped to capacity; both recorded in the
// device error word) and writes the exclusive prefix sums. Optionally it also writes "chunk"
// offsets: each expert's rows cut into chunks of `chunk_rows` counted from its first row (the
// last chunk partial), prefix-summed and multiplied by `chunk_unit` — chunk indices for the bias
// gradient (unit 1), padded row offsets for the FP8 columnwise copy (chunk_rows = unit = 128).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "gmoe/tensor.h"

namespace gmoe::cuda_backend {

/// offsets[E+1] = prefix sums of the clamped counts (offsets[E] = the clamped real total);
/// chunk_offsets[E+1] (if not nullptr) = chunk_unit * Σ_{j<e} ceil(c_j / chunk_rows).
/// counts: [E] i32/i64 on the device. Any E >= 1.
void launch_group_offsets(const TensorView& counts, int64_t capacity, int64_t* offsets,
                          int64_t* chunk_offsets, int64_t chunk_rows, int64_t chunk_unit,
                          cudaStream_t stream);

/// counts[e] of an i32 or i64 counts array on the device, as int64.
__device__ __forceinline__ int64_t read_count(const void* counts, bool is_i64, int64_t e) {
  return is_i64 ? static_cast<const int64_t*>(counts)[e]
                : static_cast<int64_t>(static_cast<const int32_t*>(counts)[e]);
}

/// The group owning `row` (offsets[g] <= row < offsets[g + 1]) for offsets[G+1] non-decreasing;
/// G if row >= offsets[G]. Empty groups are never returned for rows they do not own.
__device__ __forceinline__ int find_group(const int64_t* offsets, int G, int64_t row) {
  int lo = 0, hi = G;  // invariant: offsets[lo] <= row, answer in [lo, hi)
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (offsets[mid] <= row) lo = mid; else hi = mid;
  }
  return row < offsets[G] ? lo : G;
}

}  // namespace gmoe::cuda_backend
