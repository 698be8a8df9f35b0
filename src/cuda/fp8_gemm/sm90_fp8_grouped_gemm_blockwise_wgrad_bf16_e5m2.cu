// src/cuda/fp8_gemm/sm90_fp8_grouped_gemm_blockwise_wgrad_bf16_e5m2.cu — FP8 wgrad grouped GEMM with an e5m2 A (dyᵀ) and e4m3 B (xᵀ), blockwise scales, bf16 out, cooperative 128x128x128.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct Fp8GroupedGemmKernel<Fp8Scaling::blockwise, Fp8Operands::wgrad, DType::bf16, false, DType::e5m2>;
}  // namespace gmoe::cuda_backend
