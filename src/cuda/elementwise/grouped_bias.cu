// src/cuda/elementwise/grouped_bias.cu — grouped bias add and bias gradient on the device, and the stream
// helpers of the layers (row copies, events).
//
// Both bias ops find each row's expert from offsets computed on the device (launch_group_offsets,
// clamped like the GEMM's preparation, problems recorded in the device error word).
//
// The bias gradient is one launch with no scratch and no atomics: block (t, e) sums the rows of
// expert e in column tile t. It finds its rows itself from the device counts (the prefix sum of the
// clamped counts before e, as launch_group_offsets would give), its warps take the rows in turn
// (warp w: rows w, w + W, ...), each lane one column, and the W warp sums are added in warp
// order, so the same inputs give the same bits. The warp count W comes from the host-known
// average rows per expert (bias_grad_warps): a skewed expert holding every row gets 32 warps per
// tile, many small experts get small blocks that do not sit mostly idle. Without the offsets
// launch, the partial-sum buffer and its final pass, the op costs one launch, like torch's
// column sum (a list of more than kListByValue experts uploads its pointers first). The final pass (launch_bias_grad_final) remains for the column sums that the FP8
// quantization of dy makes per 128-row tile (grouped_bias.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/backend.h"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_errors.h"
#include "cuda/runtime/device_info.h"
#include "cuda/runtime/group_offsets.cuh"
#include "cuda/elementwise/grouped_bias.h"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ float load_f(const void* p, DType t, int64_t i) {
  switch (t) {
    case DType::bf16: return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
    case DType::f16: return __half2float(static_cast<const __half*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
__device__ __forceinline__ void store_f(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); return;
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(v); return;
    default: static_cast<float*>(p)[i] = v;
  }
}

struct BiasRef {
  const void* const* ptrs;  // list layout, or nullptr
  const void* base;         // grouped layout
  int64_t expert_stride;    // elements
  DType dtype;
  __device__ const void* expert(int e) const {
    return ptrs ? ptrs[e]
                : static_cast<const char*>(base) + e * expert_stride * int64_t(dtype == DType::f32 ? 4 : 2);
  }
};

__global__ void bias_add_kernel(void* y, DType y_dtype, int64_t ld, int64_t N, int64_t capacity, const int64_t* offsets,
                                int E, BiasRef bias) {
  for (int64_t row = blockIdx.x; row < capacity; row += gridDim.x) {
    const int e = find_group(offsets, E, row);
    if (e == E) return;  // rows past the total stay as they are (zeros)
    const void* b = bias.expert(e);
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
      const int64_t i = row * ld + n;
      store_f(y, y_dtype, i, load_f(y, y_dtype, i) + load_f(b, bias.dtype, n));
    }
  }
}

// The same with 16-byte accesses: 8 elements of y (bf16/f16) per thread and step, the bias in y's
// type or f32; every element is computed as above (f32 sum, one rounding), so the results are the
// same. Host-checked: N a multiple of 8, y's rows and every expert's bias 16-byte aligned (the
// element kernel above, with 2-byte accesses, falls well short of the memory bandwidth).
template <typename T, typename B>
__global__ void bias_add_vec_kernel(T* y, int64_t ld, int64_t N, int64_t capacity, const int64_t* offsets, int E,
                                    BiasRef bias) {
  constexpr int kVec = 8;
  static_assert(sizeof(T) == 2, "16-bit outputs");
  const int64_t chunks = N / kVec;
  for (int64_t row = blockIdx.x; row < capacity; row += gridDim.x) {
    const int e = find_group(offsets, E, row);
    if (e == E) return;  // rows past the total stay as they are (zeros)
    const B* b = static_cast<const B*>(bias.expert(e));
    T* yr = y + row * ld;
    for (int64_t c = threadIdx.x; c < chunks; c += blockDim.x) {
      uint4 yv = reinterpret_cast<const uint4*>(yr)[c];
      T* ye = reinterpret_cast<T*>(&yv);
      float bf[kVec];
      if constexpr (sizeof(B) == 4) {
        const float4 b0 = reinterpret_cast<const float4*>(b)[2 * c], b1 = reinterpret_cast<const float4*>(b)[2 * c + 1];
        bf[0] = b0.x; bf[1] = b0.y; bf[2] = b0.z; bf[3] = b0.w;
        bf[4] = b1.x; bf[5] = b1.y; bf[6] = b1.z; bf[7] = b1.w;
      } else {
        const uint4 bv = reinterpret_cast<const uint4*>(b)[c];
        const B* be = reinterpret_cast<const B*>(&bv);
#pragma unroll
        for (int i = 0; i < kVec; ++i) bf[i] = float(be[i]);
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) ye[i] = T(float(ye[i]) + bf[i]);
      reinterpret_cast<uint4*>(yr)[c] = yv;
    }
  }
}

constexpr int kGradCols = 32;   // columns per block: a warp's lanes, one column each
constexpr int kGradMaxWarps = 32;
constexpr int kListByValue = 256;  // list-layout pointers passed as kernel parameters (2 KB) up to this E

__device__ __forceinline__ int64_t clamped_count(const void* counts, bool is_i64, int e, int64_t capacity) {
  return min(max(read_count(counts, is_i64, e), int64_t{0}), capacity);
}

// Where the bias gradient goes: grouped [E, N] (base + e * stride), or the list layout's pointers,
// as parameters (E <= kListByValue) or uploaded to the device (device_list).
struct DbiasOut {
  void* base;
  int64_t expert_stride;  // elements
  DType dtype;
  void* const* device_list;
  void* list[kListByValue];
  __device__ void* expert(int e) const {
    if (base) return static_cast<char*>(base) + e * expert_stride * int64_t(dtype == DType::f32 ? 4 : 2);
    return device_list ? device_list[e] : list[e];
  }
};

// dbias_e[n] for n in column tile blockIdx.x, e = blockIdx.y; blockDim.x = 32 * W.
template <typename T>
__global__ void __launch_bounds__(kGradCols * kGradMaxWarps)
    bias_grad_kernel(const T* __restrict__ dy, int64_t ld, int64_t N, int64_t capacity, const void* counts,
                     bool is_i64, DbiasOut out, uint32_t* error_word) {
  __shared__ int64_t warp_prefix[kGradMaxWarps];
  __shared__ float warp_sums[kGradMaxWarps][kGradCols + 1];
  const int e = int(blockIdx.y);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;

  // Rows of e: [min(p, capacity), min(p + c_e, capacity)) with p the sum of the clamped counts
  // before e (each clamped to capacity first, so the sum of at most 65535 of them cannot overflow).
  int64_t p = 0;
  for (int j = threadIdx.x; j < e; j += blockDim.x) p += clamped_count(counts, is_i64, j, capacity);
#pragma unroll
  for (int d = 16; d >= 1; d /= 2) p += __shfl_xor_sync(0xffffffffu, p, d);
  if (lane == 0) warp_prefix[warp] = p;
  __syncthreads();
  p = 0;
  for (int w = 0; w < warps; ++w) p += warp_prefix[w];
  const int64_t c = clamped_count(counts, is_i64, e, capacity);
  const int64_t row0 = min(p, capacity), row1 = min(p + c, capacity);
  if (blockIdx.x == 0 && threadIdx.x == 0) {  // one report per expert, like launch_group_offsets
    const int64_t raw = read_count(counts, is_i64, e);
    uint32_t errors = 0;
    if (raw < 0) errors |= kDeviceErrorNegativeCount;
    if (raw > capacity || p + c > capacity) errors |= kDeviceErrorCountsPastCapacity;
    if (errors != 0) atomicOr(error_word, errors);
  }

  const int64_t n = int64_t(blockIdx.x) * kGradCols + lane;
  float acc = 0.f;
  if (n < N) {
    const T* col = dy + n;
#pragma unroll 8
    for (int64_t r = row0 + warp; r < row1; r += warps) acc += float(col[r * ld]);
  }
  warp_sums[warp][lane] = acc;
  __syncthreads();
  if (warp != 0 || n >= N) return;
  float total = 0.f;
  for (int w = 0; w < warps; ++w) total += warp_sums[w][lane];
  store_f(out.expert(e), out.dtype, n, total);
}

// Warps per block of bias_grad_kernel: about 16 rows per warp for an expert of average size
// (capacity / E), a power of two in [1, 32]. Fewer rows per warp leave each block too little to do
// beside finding its rows; a block of 32 warps keeps enough loads in flight for one skewed expert.
int bias_grad_warps(int64_t capacity, int64_t E) {
  const int64_t rows_per_expert = capacity / std::max<int64_t>(E, 1);
  int warps = 1;
  while (warps < kGradMaxWarps && int64_t(warps) * 16 < rows_per_expert) warps *= 2;
  return warps;
}

// Stage 2: db_e[n] = Σ over e's chunks, in chunk order (0 for an expert without rows).
__global__ void bias_grad_final_kernel(const float* partial, int64_t N, const int64_t* chunk_offsets,
                                       int64_t chunk_unit, void* const* db_ptrs, void* db_base, int64_t db_stride,
                                       DType db_dtype) {
  const int e = blockIdx.y;
  const int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (n >= N) return;
  float acc = 0.f;
  const int64_t c1 = chunk_offsets[e + 1] / chunk_unit;
  for (int64_t c = chunk_offsets[e] / chunk_unit; c < c1; ++c) acc += partial[c * N + n];
  void* db = db_ptrs ? db_ptrs[e]
                     : static_cast<char*>(db_base) + e * db_stride * int64_t(db_dtype == DType::f32 ? 4 : 2);
  store_f(db, db_dtype, n, acc);
}

// The bias add's group offsets [E + 1] (clamped to capacity), in scratch from the allocator.
int64_t* launch_offsets(const TensorView& counts, int64_t capacity, Buffer& buffer, Allocator& alloc, Stream stream) {
  buffer = Buffer(alloc, (size_t(counts.size(0)) + 1) * sizeof(int64_t), stream);
  int64_t* offsets = static_cast<int64_t*>(buffer.data());
  launch_group_offsets(counts, capacity, offsets, nullptr, 1, 1, stream);
  return offsets;
}

// The list layout's per-expert pointers on the device, in `buffer` (the grouped layout: nullptr).
void** list_pointers(const ExpertBias& b, Buffer& buffer, Allocator& alloc, Stream stream) {
  if (b.is_grouped()) return nullptr;
  std::vector<const void*> ptrs(b.list.size());
  for (size_t e = 0; e < b.list.size(); ++e) ptrs[e] = b.list[e].data;
  buffer = Buffer(alloc, ptrs.size() * sizeof(void*), stream);
  launch_write_pointers(ptrs.data(), int(ptrs.size()), static_cast<const void**>(buffer.data()), stream);
  return static_cast<void**>(buffer.data());
}

void check_cuda_args(const ExpertBias& b, const char* name) {
  GMOE_CHECK(b.num_experts() <= kMaxExperts, name, ": at most ", kMaxExperts, " experts on CUDA, got ",
             b.num_experts());
}

// Every expert's bias starts 16-byte aligned (the vector kernel reads it in 16-byte units).
bool bias_aligned16(const ExpertBias& b) {
  if (b.is_grouped()) {
    return aligned(b.grouped.data, 16) && (b.grouped.stride(0) * int64_t(dtype_size(b.dtype()))) % 16 == 0;
  }
  for (int64_t e = 0; e < b.num_experts(); ++e) {
    if (!aligned(b.expert(e).data, 16)) return false;
  }
  return true;
}

}  // namespace

void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts, Stream stream_,
                      Allocator& alloc) {
  cudaStream_t stream = stream_;
  check_cuda_args(bias, "bias");
  const int E = int(counts.size(0));
  if (y.size(0) == 0 || y.size(1) == 0) return;
  Buffer offsets_buffer;
  const int64_t* offsets = launch_offsets(counts, y.size(0), offsets_buffer, alloc, stream_);
  Buffer ptrs;
  const BiasRef ref{list_pointers(bias, ptrs, alloc, stream_), bias.is_grouped() ? bias.grouped.data : nullptr,
                    bias.is_grouped() ? bias.grouped.stride(0) : 0, bias.dtype()};
  const int blocks = int(std::min<int64_t>(y.size(0), int64_t(sm_count(current_device())) * 16));
  const int64_t N = y.size(1);
  const bool vec_y = (y.dtype == DType::bf16 || y.dtype == DType::f16) && N % 8 == 0 && aligned(y.data, 16) &&
                     (y.stride(0) * 2) % 16 == 0;
  const bool vec_b = bias.dtype() == y.dtype || bias.dtype() == DType::f32;
  if (vec_y && vec_b && bias_aligned16(bias)) {
    const bool f32 = bias.dtype() == DType::f32;
    auto go = [&](auto t) {
      using T = decltype(t);
      if (f32) {
        bias_add_vec_kernel<T, float><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(y.data), y.stride(0), N,
                                                                        y.size(0), offsets, E, ref);
      } else {
        bias_add_vec_kernel<T, T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(y.data), y.stride(0), N, y.size(0),
                                                                    offsets, E, ref);
      }
    };
    if (y.dtype == DType::bf16) {
      go(__nv_bfloat16{});
    } else {
      go(__half{});
    }
  } else {
    bias_add_kernel<<<blocks, kThreads, 0, stream>>>(y.data, y.dtype, y.stride(0), N, y.size(0), offsets, E, ref);
  }
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias, Stream stream_,
                       Allocator& alloc) {
  cudaStream_t stream = stream_;
  check_cuda_args(dbias, "dbias");
  const int E = int(counts.size(0));
  const int64_t N = dy.size(1);
  if (N == 0 || E == 0) return;
  DbiasOut out{};
  out.base = dbias.is_grouped() ? dbias.grouped.data : nullptr;
  out.expert_stride = dbias.is_grouped() ? dbias.grouped.stride(0) : 0;
  out.dtype = dbias.dtype();
  Buffer ptrs;  // only for a list of more than kListByValue experts
  if (!dbias.is_grouped() && E > kListByValue) {
    out.device_list = list_pointers(dbias, ptrs, alloc, stream_);
  } else {
    for (int e = 0; !dbias.is_grouped() && e < E; ++e) out.list[e] = dbias.list[size_t(e)].data;
  }
  const dim3 grid(unsigned((N + kGradCols - 1) / kGradCols), unsigned(E));
  const unsigned threads = unsigned(32 * bias_grad_warps(dy.size(0), E));
  auto go = [&](auto t) {
    using T = decltype(t);
    bias_grad_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(dy.data), dy.stride(0), N, dy.size(0),
                                                      counts.data, counts.dtype == DType::i64, out,
                                                      device_error_word());
  };
  switch (dy.dtype) {
    case DType::bf16: go(__nv_bfloat16{}); break;
    case DType::f16: go(__half{}); break;
    default: go(float{});
  }
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_bias_grad_final(const float* partial, int64_t N, const int64_t* chunk_offsets, int64_t chunk_unit,
                            const ExpertBias& dbias, Stream stream, Allocator& alloc) {
  check_cuda_args(dbias, "dbias");
  if (N == 0) return;
  Buffer ptrs;
  void* const* db_ptrs = list_pointers(dbias, ptrs, alloc, stream);
  const dim3 grid(unsigned((N + kThreads - 1) / kThreads), unsigned(dbias.num_experts()));
  bias_grad_final_kernel<<<grid, kThreads, 0, stream>>>(
      partial, N, chunk_offsets, chunk_unit, db_ptrs, dbias.is_grouped() ? dbias.grouped.data : nullptr,
      dbias.is_grouped() ? dbias.grouped.stride(0) : 0, dbias.dtype());
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void copy_rows(const TensorView& dst, const TensorView& src, Stream stream) {
  const size_t es = dtype_size(src.dtype);
  if (src.size(0) == 0 || src.size(1) == 0) return;
  GMOE_CUDA_CHECK(cudaMemcpy2DAsync(dst.data, dst.stride(0) * es, src.data, src.stride(0) * es, src.size(1) * es,
                                    src.size(0), cudaMemcpyDeviceToDevice, stream));
}

void zero_bytes(void* ptr, std::size_t bytes, Stream stream) {
  if (bytes != 0) GMOE_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream));
}

void* event_create() {
  cudaEvent_t ev;
  GMOE_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  return ev;
}
void event_destroy(void* event) {
  if (event) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}
void event_record(void* event, Stream stream) {
  GMOE_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(event), stream));
}
void stream_wait_event(Stream stream, void* event) {
  GMOE_CUDA_CHECK(cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0));
}
void stream_synchronize(Stream stream) { GMOE_CUDA_CHECK(cudaStreamSynchronize(stream)); }

}  // namespace gmoe::cuda_backend
