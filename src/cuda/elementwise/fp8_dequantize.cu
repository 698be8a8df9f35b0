// src/cuda/elementwise/fp8_dequantize.cu — FP8 dequantization on the device, for tests and debugging: plain
// element loops (the columnwise reads are strided), not tuned. Same arithmetic as the CPU
// reference: float(data) * scale_inv in f32, rounded once to the output dtype.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <vector>

#include "common/backend.h"
#include "common/fp8_rules.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/runtime/group_offsets.cuh"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void store_out(void* p, DType t, int64_t i, float v) {
  switch (t) {
    case DType::bf16: static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v); return;
    case DType::f16: static_cast<__half*>(p)[i] = __float2half_rn(v); return;
    default: static_cast<float*>(p)[i] = v;
  }
}

__device__ __forceinline__ float load_inv(const void* scales, Fp8Recipe r, int64_t i) {
  return r == Fp8Recipe::mxfp8 ? fp8_rules::e8m0_to_float(static_cast<const uint8_t*>(scales)[i])
                               : static_cast<const float*>(scales)[i];
}

struct GroupedDequant {
  const uint8_t* data;     // rowwise [cap, cols] or columnwise [cols, P]
  const void* scales;
  Fp8Recipe recipe;
  bool e5m2;
  bool columnwise;
  int64_t cap, cols, P;
  int E;
  const int64_t* offsets;  // [E+1] real
  const int64_t* padded;   // [E+1]
  void* out;
  DType out_dtype;
  int64_t out_ld;
};

__global__ void dequant_grouped_kernel(const GroupedDequant d) {
  const int64_t block = d.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block;
  for (int64_t r = blockIdx.x; r < d.cap; r += gridDim.x) {
    const int e = find_group(d.offsets, d.E, r);
    for (int64_t c = threadIdx.x; c < d.cols; c += blockDim.x) {
      float v = 0.0f;
      if (e < d.E) {
        if (!d.columnwise) {
          const int64_t si =
              d.recipe == Fp8Recipe::tensorwise ? e : fp8_rows_scale_index(d.recipe, r, c / block, d.cap, d.cols);
          v = __fmul_rn(fp8_rules::fp8_to_float(d.data[r * d.cols + c], d.e5m2), load_inv(d.scales, d.recipe, si));
        } else {
          const int64_t t = d.padded[e] + (r - d.offsets[e]);
          const int64_t si =
              d.recipe == Fp8Recipe::tensorwise ? e : fp8_cols_scale_index(d.recipe, c, t / block, d.cols, d.P);
          v = __fmul_rn(fp8_rules::fp8_to_float(d.data[c * d.P + t], d.e5m2), load_inv(d.scales, d.recipe, si));
        }
      }
      store_out(d.out, d.out_dtype, r * d.out_ld + c, v);
    }
  }
}

struct WeightsDequant {
  const uint8_t* data;  // [E, N, K] or [E, K, N]
  const void* scales;
  Fp8Recipe recipe;
  bool e5m2;
  bool transposed;
  int64_t E, N, K;
  void* const* out_ptrs;  // list layout, or nullptr
  const int64_t* out_lds;
  void* out_base;         // stacked
  int64_t out_expert_stride, out_ld;
  DType out_dtype;
};

__global__ void dequant_weights_kernel(const WeightsDequant d) {
  const int64_t nbn = (d.N + kFp8Block - 1) / kFp8Block, nbk = (d.K + kFp8Block - 1) / kFp8Block;
  const int64_t mbn = (d.N + kMxBlock - 1) / kMxBlock, mbk = (d.K + kMxBlock - 1) / kMxBlock;
  const int64_t es = d.out_dtype == DType::f32 ? 4 : 2;
  for (int64_t row = blockIdx.x; row < d.E * d.N; row += gridDim.x) {
    const int64_t e = row / d.N, n = row % d.N;
    char* out;
    int64_t ld;
    if (d.out_ptrs != nullptr) {
      out = static_cast<char*>(d.out_ptrs[e]);
      ld = d.out_lds[e];
    } else {
      out = static_cast<char*>(d.out_base) + e * d.out_expert_stride * es;
      ld = d.out_ld;
    }
    for (int64_t k = threadIdx.x; k < d.K; k += blockDim.x) {
      uint8_t b;
      int64_t si = e;
      if (!d.transposed) {
        b = d.data[(e * d.N + n) * d.K + k];
        if (d.recipe == Fp8Recipe::blockwise) si = (e * nbn + n / kFp8Block) * nbk + k / kFp8Block;
        if (d.recipe == Fp8Recipe::mxfp8) si = (e * d.N + n) * mbk + k / kMxBlock;
      } else {
        b = d.data[(e * d.K + k) * d.N + n];
        if (d.recipe == Fp8Recipe::blockwise) si = (e * nbk + k / kFp8Block) * nbn + n / kFp8Block;
        if (d.recipe == Fp8Recipe::mxfp8) si = (e * d.K + k) * mbn + n / kMxBlock;
      }
      const float v = __fmul_rn(fp8_rules::fp8_to_float(b, d.e5m2), load_inv(d.scales, d.recipe, si));
      store_out(out, d.out_dtype, n * ld + k, v);
    }
  }
}

unsigned blocks_for(int64_t rows) {
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(rows, int64_t{8} * sm_count(current_device()))));
}

}  // namespace

void dequantize_grouped(const Fp8Grouped& q, const TensorView& counts, const TensorView& out,
                        Fp8Copy which, Stream stream_, Allocator& alloc) {
  cudaStream_t stream = stream_;
  const int E = static_cast<int>(counts.size(0));
  if (q.capacity == 0 || q.cols == 0) return;
  Buffer scratch(alloc, sizeof(int64_t) * (E + 1), stream_);
  int64_t* offsets = static_cast<int64_t*>(scratch.data());
  launch_group_offsets(counts, q.capacity, offsets, nullptr, 1, 1, stream);
  GroupedDequant d{};
  d.columnwise = which == Fp8Copy::columnwise;
  d.data = static_cast<const uint8_t*>(d.columnwise ? q.data_t.data : q.data.data);
  d.scales = d.columnwise ? q.scale_inv_t.data : q.scale_inv.data;
  d.recipe = q.recipe;
  d.e5m2 = q.format == DType::e5m2;
  d.cap = q.capacity;
  d.cols = q.cols;
  d.P = q.padded_capacity;
  d.E = E;
  d.offsets = offsets;
  d.padded = static_cast<const int64_t*>(q.padded_offsets.data);
  d.out = out.data;
  d.out_dtype = out.dtype;
  d.out_ld = out.stride(0);
  dequant_grouped_kernel<<<blocks_for(q.capacity), kThreads, 0, stream>>>(d);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void dequantize_weights(const Fp8Weights& q, const ExpertWeights& out, Fp8Copy which, Stream stream_,
                        Allocator& alloc) {
  cudaStream_t stream = stream_;
  const int E = static_cast<int>(q.experts);
  if (q.rows == 0 || q.cols == 0) return;
  WeightsDequant d{};
  d.transposed = which == Fp8Copy::columnwise;
  d.data = static_cast<const uint8_t*>(d.transposed ? q.data_t.data : q.data.data);
  d.scales = d.transposed ? q.scale_inv_t.data : q.scale_inv.data;
  d.recipe = q.recipe;
  d.e5m2 = q.format == DType::e5m2;
  d.E = E;
  d.N = q.rows;
  d.K = q.cols;
  d.out_dtype = out.dtype();
  Buffer scratch;
  if (!out.is_stacked()) {
    scratch = Buffer(alloc, (sizeof(void*) + sizeof(int64_t)) * E, stream_);
    const void** ptrs = static_cast<const void**>(scratch.data());
    int64_t* lds = reinterpret_cast<int64_t*>(ptrs + E);
    std::vector<const void*> hp(E);
    std::vector<int64_t> hl(E);
    for (int e = 0; e < E; ++e) {
      hp[e] = out.list[e].data;
      hl[e] = out.list[e].stride(0);
    }
    launch_write_expert_pointers(hp.data(), hl.data(), E, ptrs, lds, nullptr, nullptr, stream);
    d.out_ptrs = static_cast<void* const*>(scratch.data());  // the same array, as written
    d.out_lds = lds;
  } else {
    d.out_base = out.stacked.data;
    d.out_expert_stride = out.stacked.stride(0);
    d.out_ld = out.stacked.stride(1);
  }
  dequant_weights_kernel<<<blocks_for(q.experts * q.rows), kThreads, 0, stream>>>(d);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gmoe::cuda_backend
