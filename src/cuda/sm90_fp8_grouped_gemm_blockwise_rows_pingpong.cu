// src/cuda/sm90_fp8_grouped_gemm_blockwise_rows_pingpong.cu — FP8 (e4m3) fprop/dgrad grouped GEMM, blockwise scales, bf16 out, ping-pong 64x128x128.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/sm90_fp8_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct Fp8GroupedGemmKernel<Fp8Scaling::blockwise, Fp8Operands::rows, DType::bf16, Fp8Tile::pingpong_64x128>;
}  // namespace gmoe::cuda_backend
