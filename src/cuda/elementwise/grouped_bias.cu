// src/cuda/elementwise/grouped_bias.cu — grouped bias add and bias gradient on the device, and the stream
// helpers of the layers (row copies, events).
//
// Both bias ops find each row's expert from offsets computed on the device (launch_group_offsets,
// clamped like the GEMM's preparation, problems recorded in the device error word).
//
// The bias gradient is a deterministic two-stage column reduction, with no atomics: each expert's
// rows are cut into chunks of kChunkRows counted from the expert's first row (so the cut depends
// only on that expert's count, never on the batch around it); stage 1 sums each chunk's rows in
// order into an f32 partial, stage 2 sums an expert's partials in chunk order. A skewed expert with
// 16k rows is spread over 128 blocks instead of one. Stage 2 also reduces the column sums that the
// FP8 quantization of dy makes per 128-row tile (grouped_bias.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/backend.h"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/runtime/group_offsets.cuh"
#include "cuda/elementwise/grouped_bias.h"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kChunkRows = 128;
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

// Stage 1: partial[chunk, n] = Σ rows of the chunk of dy[row, n], in row order.
__global__ void bias_grad_partial_kernel(const void* dy, DType dt, int64_t ld, int64_t N, const int64_t* offsets,
                                         const int64_t* chunk_offsets, int E, int64_t max_chunks, float* partial) {
  const int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  for (int64_t chunk = blockIdx.y; chunk < max_chunks; chunk += gridDim.y) {
    if (chunk >= chunk_offsets[E]) return;
    const int e = find_group(chunk_offsets, E, chunk);
    const int64_t row0 = offsets[e] + (chunk - chunk_offsets[e]) * kChunkRows;
    const int64_t row1 = min(row0 + kChunkRows, offsets[e + 1]);
    if (n >= N) continue;
    float acc = 0.f;
#pragma unroll 8
    for (int64_t r = row0; r < row1; ++r) acc += load_f(dy, dt, r * ld + n);
    partial[chunk * N + n] = acc;
  }
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

// Scratch for one op: offsets and chunk offsets.
struct Scratch {
  Buffer buffer;
  int64_t* offsets = nullptr;
  int64_t* chunk_offsets = nullptr;
};

Scratch make_scratch(int E, Allocator& alloc, Stream stream) {
  Scratch s;
  const size_t n_off = size_t(E) + 1;
  s.buffer = Buffer(alloc, 2 * n_off * sizeof(int64_t), stream);
  s.offsets = static_cast<int64_t*>(s.buffer.data());
  s.chunk_offsets = s.offsets + n_off;
  return s;
}

// offsets[E + 1] (clamped to capacity) and chunk_offsets[E + 1] (prefix sums of each expert's
// number of kChunkRows chunks).
void launch_offsets(const TensorView& counts, int64_t capacity, const Scratch& s, cudaStream_t stream) {
  launch_group_offsets(counts, capacity, s.offsets, s.chunk_offsets, kChunkRows, 1, stream);
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
  Scratch s = make_scratch(E, alloc, stream_);
  launch_offsets(counts, y.size(0), s, stream);
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
                                                                        y.size(0), s.offsets, E, ref);
      } else {
        bias_add_vec_kernel<T, T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(y.data), y.stride(0), N, y.size(0),
                                                                    s.offsets, E, ref);
      }
    };
    if (y.dtype == DType::bf16) {
      go(__nv_bfloat16{});
    } else {
      go(__half{});
    }
  } else {
    bias_add_kernel<<<blocks, kThreads, 0, stream>>>(y.data, y.dtype, y.stride(0), N, y.size(0), s.offsets, E, ref);
  }
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias, Stream stream_,
                       Allocator& alloc) {
  cudaStream_t stream = stream_;
  check_cuda_args(dbias, "dbias");
  const int E = int(counts.size(0));
  const int64_t N = dy.size(1);
  if (N == 0) return;
  Scratch s = make_scratch(E, alloc, stream_);
  launch_offsets(counts, dy.size(0), s, stream);
  // Host-known bound on the number of chunks: every expert may end in a partial chunk.
  const int64_t max_chunks = (dy.size(0) + kChunkRows - 1) / kChunkRows + E;
  Buffer partial(alloc, size_t(max_chunks) * N * sizeof(float), stream_);
  const dim3 grid1(unsigned((N + kThreads - 1) / kThreads), unsigned(std::min<int64_t>(max_chunks, 65535)));
  bias_grad_partial_kernel<<<grid1, kThreads, 0, stream>>>(dy.data, dy.dtype, dy.stride(0), N, s.offsets,
                                                           s.chunk_offsets, E, max_chunks,
                                                           static_cast<float*>(partial.data()));
  GMOE_CUDA_CHECK(cudaGetLastError());
  launch_bias_grad_final(static_cast<const float*>(partial.data()), N, s.chunk_offsets, 1, dbias, stream_, alloc);
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
