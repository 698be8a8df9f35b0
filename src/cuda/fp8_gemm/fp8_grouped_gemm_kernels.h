// src/cuda/fp8_gemm/fp8_grouped_gemm_kernels.h — what the FP8 grouped GEMM dispatcher knows about its
// CUTLASS instantiations, without including CUTLASS.
//
// Every FP8 GEMM is "TN" on sm_90a: wgmma takes FP8 operands only K-major, which is why the FP8
// format carries transposed copies (Fp8Weights::data_t for dgrad, Fp8Grouped::data_t for wgrad).
// So all three passes are one GEMM shape D[M,N] = A[M,K]·B[N,K]ᵀ with both operands K-major:
//   fprop  A = x.data      [rows, K]        B = w.data   [E][N, K]   D = y  [rows, N]
//   dgrad  A = dy.data     [rows, N]        B = w.data_t [E][K, N]   D = dx [rows, K]
//   wgrad  A = dy.data_t   [N, tokens]      B = x.data_t [K, tokens] D = dW_e [N, K]
// fprop and dgrad are the same kernel ("rows": M is each expert's row count); wgrad differs in its
// scale granularity (1x128 token blocks on both operands) and its output (f32 main_grad with an
// optional source operand, or bf16).
//
// The instantiations are the lines of fp8_grouped_gemm_instances.def (one generated .cu each): B
// always e4m3 (weights; x in wgrad), A e4m3 and, for the 1x1 kernels, e5m2 too (the gradient dy of
// dgrad and wgrad, or an e5m2 x in fprop: wgmma multiplies e5m2 by e4m3 at the same rate).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/grouped_gemm_kernels.h"
#include "gmoe/dtype.h"

namespace gmoe::cuda_backend {

/// How the FP8 operands are scaled inside the GEMM.
enum class Fp8Scaling {
  blockwise,  ///< scales per 1x128 / 128x128 block, applied to the fp32 partial sums of every
              ///< 128-long k-tile (CUTLASS's FP8 blockwise mainloop)
  tensorwise  ///< one scale per expert and operand: alpha_e = sa[e]·sb[e] in the epilogue
};

/// Which operand shapes (see the file comment).
enum class Fp8Operands {
  rows,  ///< fprop/dgrad: A = grouped rows (M = count_e), B = expert weights
  wgrad  ///< A, B = columnwise (transposed) grouped rows (K = count_e), D = dW_e
};

/// The CTA tile and cluster of an instantiation. The tile is 128x128x128, the wgmma accumulators
/// promoted to fp32 every 128 of the reduction; or, for tensorwise rows with fast accumulation,
/// 128x256x128 without promotion (sm90_fp8_grouped_gemm.cuh). Which pass compiles which is the
/// table (fp8_grouped_gemm_instances.def); which one runs, the heuristics (fp8_gemm_heuristics.h).
enum class Fp8Tile {
  t128x128,      ///< cluster 1x1
  t128x128_2x1,  ///< clusters of two CTAs along M, each loading half of B's tile and
                 ///< multicasting it to both
  t128x128_2x2,  ///< clusters of 2x2 CTAs: A's tile multicast along N as well
  t128x256,      ///< 128x256x128 tiles with fast accumulation (Fp8GemmOptions), cluster 1x1
  t128x256_2x1   ///< the same in clusters of two along M
};

/// What an instantiation's epilogue adds to A·Bᵀ.
enum class Fp8Epilogue {
  none,  ///< D = alpha·acc (+ beta·C for the f32 weight gradient)
  bias   ///< fprop: D = A·Bᵀ + bias_e (blockwise: the accumulators start from it; tensorwise:
         ///< alpha_e·acc + bias_e in the epilogue)
};

/// The CTA tile's N extent of an instantiation.
constexpr int fp8_tile_n(Fp8Tile t) {
  return t == Fp8Tile::t128x256 || t == Fp8Tile::t128x256_2x1 ? 256 : 128;
}
/// The cluster's extents along M and N.
constexpr int fp8_cluster_m(Fp8Tile t) { return t == Fp8Tile::t128x128 || t == Fp8Tile::t128x256 ? 1 : 2; }
constexpr int fp8_cluster_n(Fp8Tile t) { return t == Fp8Tile::t128x128_2x2 ? 2 : 1; }

/// Everything one launch reads: the plain grouped GEMM arrays plus the FP8 scale arrays.
struct Fp8GemmLaunch {
  GroupedGemmLaunch gemm;  ///< shapes, pointers, strides, beta, workspace (alpha unused)
  /// blockwise: per-group pointers to the first scale of A and B, and the scale matrices' row
  /// strides (elements; the same for every group of one launch).
  const float* const* ptr_sfa = nullptr;
  const float* const* ptr_sfb = nullptr;
  int32_t sfa_ld = 0, sfb_ld = 0;
  /// tensorwise: per-group pointers to alpha_e (device), read by the epilogue.
  const float* const* alpha_ptrs = nullptr;
};

/// One compiled FP8 grouped GEMM (explicit instantiations: fp8_grouped_gemm_instances.def only).
/// Bias: D = A·Bᵀ + bias_e (rows to bf16 with an e4m3 A only; gemm.ptr_bias[e] is expert e's bf16
/// vector of N). FormatA: A's fp8 format (e4m3 or e5m2); B is e4m3.
template <Fp8Scaling S, Fp8Operands Ops, DType Out, bool Bias = false, DType FormatA = DType::e4m3,
          Fp8Tile Tile = Fp8Tile::t128x128>
struct Fp8GroupedGemmKernel {
  /// Bytes of CUTLASS workspace for a persistent grid of sm_count CTAs.
  static std::size_t workspace_bytes(int sm_count);
  /// can_implement, initialize, run on `stream`; throws gmoe::Error on any failure.
  static void run(const Fp8GemmLaunch& launch, cudaStream_t stream);
};

/// What tells the compiled FP8 GEMMs apart: the columns of fp8_grouped_gemm_instances.def.
struct Fp8KernelKey {
  Fp8Scaling scaling = Fp8Scaling::blockwise;
  Fp8Operands operands = Fp8Operands::rows;
  DType out = DType::bf16;
  Fp8Epilogue epilogue = Fp8Epilogue::none;
  DType format_a = DType::e4m3;
  Fp8Tile tile = Fp8Tile::t128x128;

  bool operator==(const Fp8KernelKey& o) const {
    return scaling == o.scaling && operands == o.operands && out == o.out && epilogue == o.epilogue &&
           format_a == o.format_a && tile == o.tile;
  }
};

/// One compiled FP8 grouped GEMM: its key and Fp8GroupedGemmKernel's entry points.
struct Fp8Kernel {
  Fp8KernelKey key;
  std::size_t (*workspace_bytes)(int sm_count) = nullptr;
  void (*run)(const Fp8GemmLaunch&, cudaStream_t) = nullptr;
};

/// The compiled kernel of `key`, or nullptr where that configuration is not compiled
/// (fp8_grouped_gemm.cu).
const Fp8Kernel* find_fp8_kernel(const Fp8KernelKey& key);

}  // namespace gmoe::cuda_backend
