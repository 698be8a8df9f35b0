// src/cuda/gemm/grouped_gemm_kernels.h — what the host-side dispatcher knows about the CUTLASS grouped
// GEMM instantiations, without including CUTLASS.
//
// Every (input dtype, output dtype, pass, tile config) that is compiled is one explicit
// instantiation of GroupedGemmKernel in its own sm90_<dtype>_grouped_gemm_<pass>_<tile>.cu, so the
// heavy CUTLASS templates are compiled once each and in parallel. The dispatcher
// (grouped_gemm_dispatch.h) maps runtime values onto exactly these instantiations.
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

/// Tile configurations (choose_rows_tile / choose_wgrad_tile in grouped_gemm.cu say when each is
/// used).
enum class TileConfig {
  coop_128x256,      ///< cooperative: 2 consumer warpgroups share one 128x256x64 tile; large groups
  pingpong_128x128,  ///< ping-pong: 2 consumer warpgroups alternate 128x128x64 tiles, one's
                     ///< epilogue overlapping the other's mainloop; small groups, f32 wgrad
  coop_128x256_2x1   ///< the cooperative tile in clusters of two CTAs along M: each loads half of
                     ///< B's tile and multicasts it to both (bf16 wgrad, to bf16 or f32)
};

/// One group's GEMM extent as CUTLASS's grouped problem shape stores it (cute::Shape<int,int,int>;
/// each instantiation static_asserts that the layouts agree).
struct GroupShape {
  int32_t m, n, k;
};

/// A gated activation fused into the fprop epilogue (GroupedGemmKernel<..., Glu = true>): besides
/// D = h, the epilogue writes z[r, j] = act(gate, up) · p[r] for each gate/up column pair of the
/// tile, computed from h as stored (rounded to D's dtype), exactly as grouped_activation_forward
/// would from h. h's 2F columns are interleaved in blocks of `block` (8 or 16) columns, so that the
/// pair lies in one thread's accumulator fragment (see sm90_grouped_gemm.cuh).
struct GluEpilogue {
  void* const* ptr_z = nullptr;             ///< [E] group e's first row of z
  const int64_t* stride_z = nullptr;        ///< [E] z's row stride, elements
  const float* const* ptr_probs = nullptr;  ///< [E] group e's first router probability; nullptr: none
  int32_t kind = 0;                         ///< ActivationKind: swiglu (the one the node computes)
  int32_t block = 0;                        ///< interleave block: 8 or 16
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
  const void* const* ptr_bias = nullptr;  ///< [E] bias vectors of N (fprop with a fused bias)
  GluEpilogue glu;                        ///< fprop with a fused gated activation
  /// The persistent scheduler's tile order inside a group: false, along M (consecutive tiles down
  /// the M dimension, the same N tile: B's tile reused, A re-read once per N tile); true, along N
  /// (A's tile reused, B re-read once per M tile). CUTLASS applies no heuristic to grouped
  /// problems; the host chooses from what it knows (grouped_gemm.cu).
  bool raster_along_n = false;
  float alpha = 1.0f;
  float beta = 0.0f;              ///< 1 accumulates into C (= D); needs a C-capable instantiation
  void* workspace = nullptr;      ///< CUTLASS's workspace (tensor maps per SM), 128-byte aligned
  std::size_t workspace_bytes = 0;
};

/// One compiled grouped GEMM. Defined (explicitly instantiated) only in the sm90_*.cu files; the
/// dispatcher sees declarations alone. Bias: D = A·B + bias_e (a row vector of N per group, of the
/// input dtype) in the epilogue, before the output's rounding (fprop only). Glu: the gated
/// activation of GluEpilogue in the epilogue too (bf16 fprop only).
template <DType In, DType Out, GemmPass Pass, TileConfig Tile, bool Bias = false, bool Glu = false>
struct GroupedGemmKernel {
  /// Bytes of CUTLASS workspace for a persistent grid of sm_count CTAs.
  static std::size_t workspace_bytes(int sm_count);
  /// can_implement, initialize, run on `stream`; throws gmoe::Error on any failure.
  static void run(const GroupedGemmLaunch& launch, cudaStream_t stream);
};

}  // namespace gmoe::cuda_backend
