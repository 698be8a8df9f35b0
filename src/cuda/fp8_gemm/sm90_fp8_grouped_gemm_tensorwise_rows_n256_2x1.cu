// src/cuda/fp8_gemm/sm90_fp8_grouped_gemm_tensorwise_rows_n256_2x1.cu — FP8 tensorwise (e4m3) fprop/dgrad grouped GEMM, bf16 out, cooperative 128x256x128 in 2x1 clusters.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct Fp8GroupedGemmKernel<Fp8Scaling::tensorwise, Fp8Operands::rows, DType::bf16, false, DType::e4m3, Fp8Tile::t128x256_2x1>;
}  // namespace gmoe::cuda_backend
