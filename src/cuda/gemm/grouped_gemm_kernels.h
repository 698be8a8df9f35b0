// src/cuda/gemm/grouped_gemm_kernels.h — what the host-side dispatcher knows about the CUTLASS grouped
// GEMM instantiations, without including CUTLASS.
//
// Every (input dtype, output dtype, pass, epilogue, tile config) that is compiled is one line of
// grouped_gemm_instances.def, from which CMake generates one explicit instantiation of
// GroupedGemmKernel per small .cu file, so the heavy CUTLASS templates are compiled once each and
// in parallel. The dispatcher (grouped_gemm.cu) maps runtime values onto exactly these lines.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "gmoe/dtype.h"

namespace gmoe::cuda_backend {

/// The three passes of an expert linear layer. Each fixes the operand layouts (CUTLASS terms, a
/// GEMM D[M,N] = A[M,K]·B[N,K]ᵀ):
///   fprop  M = rows,  N = N, K = K:     A = x (K-major), B = W_e (K-major), D = y (row-major)
///   dgrad  M = rows,  N = K, K = N:     A = dy (K-major), B = W_e (N-major), D = dx (row-major)
///   wgrad  M = N,     N = K, K = rows:  A = dy (M-major), B = x (N-major),  D = dW_e (row-major)
enum class GemmPass { fprop, dgrad, wgrad };

/// What the epilogue computes besides D = alpha·acc + beta·C.
enum class GemmEpilogue {
  none,  ///< nothing
  bias   ///< D = acc + bias_e, a row vector of N per group of the input dtype (fprop only)
};

/// Tile configurations (choose_rows_tile / choose_wgrad_tile in grouped_gemm_heuristics.h say
/// when each is used).
enum class TileConfig {
  coop_128x256,      ///< cooperative: 2 consumer warpgroups share one 128x256x64 tile; large groups
  pingpong_128x128,  ///< ping-pong: 2 consumer warpgroups alternate 128x128x64 tiles, one's
                     ///< epilogue overlapping the other's mainloop; small groups, f32 wgrad
  coop_128x256_2x1,  ///< the cooperative tile in clusters of two CTAs along M: each loads half of
                     ///< B's tile and multicasts it to both (bf16 wgrad, to bf16 or f32; bf16
                     ///< fprop and dgrad)
  coop_128x256_2x2   ///< the cooperative tile in 2x2 clusters: A's tile multicast along N and B's
                     ///< along M (bf16 fprop, dgrad, wgrad to bf16; Tuning::cluster 2x2)
};

/// One group's GEMM extent as CUTLASS's grouped problem shape stores it (cute::Shape<int,int,int>;
/// each instantiation static_asserts that the layouts agree).
struct GroupShape {
  int32_t m, n, k;
};

/// Device arrays (length num_groups, written by the argument-preparation kernels) and scalars that
/// one grouped GEMM launch reads. Strides are the one non-unit stride of each operand in elements
/// (rows of a row-major matrix): CUTLASS's per-group stride types hold exactly one int64.
struct GroupedGemmLaunch {
  int num_groups = 0;
  int device = 0;
  int sm_count = 0;
  const GroupShape* shapes = nullptr;
  const void* const* ptr_a = nullptr;
  const void* const* ptr_b = nullptr;
  const void* const* ptr_c = nullptr;  ///< only read when beta != 0 (wgrad accumulate)
  void* const* ptr_d = nullptr;
  const int64_t* stride_a = nullptr;
  const int64_t* stride_b = nullptr;
  const int64_t* stride_c = nullptr;
  const int64_t* stride_d = nullptr;
  const void* const* ptr_bias = nullptr;  ///< [E] bias vectors of N (GemmEpilogue::bias)
  /// The persistent scheduler's tile order inside a group: false, along M (consecutive tiles down
  /// the M dimension, the same N tile: B's tile reused, A re-read once per N tile); true, along N
  /// (A's tile reused, B re-read once per M tile). CUTLASS applies no heuristic to grouped
  /// problems; the host chooses from what it knows (grouped_gemm_heuristics.h).
  bool raster_along_n = false;
  float alpha = 1.0f;
  float beta = 0.0f;              ///< 1 accumulates into C (= D); needs a C-capable instantiation
  void* workspace = nullptr;      ///< CUTLASS's workspace (tensor maps per SM), 128-byte aligned
  std::size_t workspace_bytes = 0;
};

/// One compiled grouped GEMM. Defined (explicitly instantiated) only in the generated sm90_*.cu
/// files, one per line of grouped_gemm_instances.def; the dispatcher sees declarations alone.
template <DType In, DType Out, GemmPass Pass, TileConfig Tile, GemmEpilogue Epilogue = GemmEpilogue::none>
struct GroupedGemmKernel {
  /// Bytes of CUTLASS workspace for a persistent grid of sm_count CTAs.
  static std::size_t workspace_bytes(int sm_count);
  /// can_implement, initialize, run on `stream`; throws gmoe::Error on any failure.
  static void run(const GroupedGemmLaunch& launch, cudaStream_t stream);
};

}  // namespace gmoe::cuda_backend
