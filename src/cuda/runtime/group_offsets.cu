// src/cuda/runtime/group_offsets.cu — group offsets from device counts (see group_offsets.cuh).
#include "cuda/runtime/group_offsets.cuh"

#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_errors.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::cuda_backend {
namespace {


__device__ __forceinline__ int64_t warp_exclusive_sum(int64_t v) {
  const int lane = threadIdx.x & 31;
  int64_t inclusive = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t up = __shfl_up_sync(0xffffffffu, inclusive, d);
    if (lane >= d) inclusive += up;
  }
  return inclusive - v;
}

// One warp; lane l owns experts [l*per, (l+1)*per). Counts are clamped to [0, capacity] before
// the scan (so E * capacity < 2^63 cannot overflow), offsets clamped in closed form as
// min(prefix, capacity), exactly like the grouped GEMM's preparation.
__global__ void __launch_bounds__(32)
    group_offsets_kernel(const void* counts, bool is_i64, int E, int64_t capacity,
                         int64_t* offsets, int64_t* chunk_offsets, int64_t chunk_rows,
                         int64_t chunk_unit, uint32_t* error_word) {
  const int lane = threadIdx.x;
  const int per = (E + 31) / 32;
  const int first = min(lane * per, E);
  const int last = min(first + per, E);

  uint32_t errors = 0;
  int64_t local = 0;
  for (int e = first; e < last; ++e) {
    const int64_t c = read_count(counts, is_i64, e);
    if (c < 0) errors |= kDeviceErrorNegativeCount;
    // A count past the capacity is clamped to it below, which the running total alone cannot
    // see when every earlier count is 0.
    if (c > capacity) errors |= kDeviceErrorCountsPastCapacity;
    local += min(max(c, int64_t{0}), capacity);
  }
  const int64_t prefix = warp_exclusive_sum(local);

  int64_t local_chunks = 0;
  int64_t p = prefix;
  for (int e = first; e < last; ++e) {
    const int64_t c = min(max(read_count(counts, is_i64, e), int64_t{0}), capacity);
    const int64_t rows = min(p + c, capacity) - min(p, capacity);
    if (p + c > capacity) errors |= kDeviceErrorCountsPastCapacity;
    p += c;
    local_chunks += (rows + chunk_rows - 1) / chunk_rows;
  }
  const int64_t chunk_prefix = chunk_offsets != nullptr ? warp_exclusive_sum(local_chunks) : 0;

  if (lane == 0) {
    offsets[0] = 0;
    if (chunk_offsets != nullptr) chunk_offsets[0] = 0;
  }
  p = prefix;
  int64_t chunks = chunk_prefix;
  for (int e = first; e < last; ++e) {
    const int64_t c = min(max(read_count(counts, is_i64, e), int64_t{0}), capacity);
    const int64_t begin = min(p, capacity);
    const int64_t end = min(p + c, capacity);
    p += c;
    offsets[e + 1] = end;
    if (chunk_offsets != nullptr) {
      chunks += (end - begin + chunk_rows - 1) / chunk_rows;
      chunk_offsets[e + 1] = chunks * chunk_unit;
    }
  }
  if (errors != 0) atomicOr(error_word, errors);
}

}  // namespace

void launch_group_offsets(const TensorView& counts, int64_t capacity, int64_t* offsets,
                          int64_t* chunk_offsets, int64_t chunk_rows, int64_t chunk_unit,
                          cudaStream_t stream) {
  GMOE_CHECK(chunk_rows >= 1 && chunk_unit >= 1, "group offsets: chunk_rows ", chunk_rows,
             " and chunk_unit ", chunk_unit, " must be >= 1");
  group_offsets_kernel<<<1, 32, 0, stream>>>(counts.data, counts.dtype == DType::i64,
                                             static_cast<int>(counts.size(0)), capacity, offsets,
                                             chunk_offsets, chunk_rows, chunk_unit,
                                             device_error_word());
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gmoe::cuda_backend
