// src/cuda/fp8_gemm/fp8_gemm_heuristics.h — which compiled FP8 grouped GEMM runs a call (its tile
// and cluster) and in which order a weight gradient walks its tiles. The rules, and why each
// holds, are in fp8_gemm_heuristics.cu; the measurements behind them in docs/decisions.md.
#pragma once

#include <cstdint>

#include "cuda/fp8_gemm/fp8_grouped_gemm_kernels.h"
#include "gmoe/dtype.h"

namespace gmoe::cuda_backend {

/// An fprop or dgrad call as the heuristics see it. M, each expert's row count, lives on the
/// device only: the host knows the capacity and the number of experts.
struct Fp8RowsProblem {
  Fp8Scaling scaling = Fp8Scaling::blockwise;
  DType format_a = DType::e4m3;    ///< A's format (x in fprop, dy in dgrad)
  bool bias = false;               ///< fprop with a fused bias
  bool fast_accumulation = false;  ///< Fp8GemmOptions::fast_accumulation
  int64_t capacity = 0;            ///< rows of A
  int64_t num_experts = 0;
  int64_t gemm_n = 0;  ///< D's columns
  int64_t gemm_k = 0;  ///< the reduction's length
};

/// The compiled kernel of an fprop/dgrad call: the heuristic's tile and cluster, or the cluster
/// that gmoe::Tuning::fp8_rows_cluster (else Tuning::cluster) forces where that kernel is compiled.
Fp8KernelKey choose_fp8_rows_kernel(const Fp8RowsProblem& p);

/// The compiled kernel of a weight gradient D[m, n] (m = the layer's N, n = its K) written as
/// `out` (f32 or bf16) from an A (dy) in `format_a`.
Fp8KernelKey choose_fp8_wgrad_kernel(Fp8Scaling scaling, DType out, DType format_a, int64_t m);

/// Whether the weight gradient D[m, n] run by `kernel` (choose_fp8_wgrad_kernel) walks its tiles
/// along N rather than M; `padded_capacity` is the token columns of the columnwise copies.
bool choose_fp8_wgrad_raster_along_n(const Fp8KernelKey& kernel, int64_t m, int64_t n,
                                     int64_t padded_capacity, int64_t num_experts);

}  // namespace gmoe::cuda_backend
