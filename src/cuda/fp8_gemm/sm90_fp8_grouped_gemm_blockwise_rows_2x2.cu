// src/cuda/fp8_gemm/sm90_fp8_grouped_gemm_blockwise_rows_2x2.cu — FP8 blockwise (e4m3) fprop/dgrad grouped GEMM, bf16 out, cooperative 128x128x128 in 2x2 clusters.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct Fp8GroupedGemmKernel<Fp8Scaling::blockwise, Fp8Operands::rows, DType::bf16, false, DType::e4m3, Fp8Tile::t128x128_2x2>;
}  // namespace gmoe::cuda_backend
