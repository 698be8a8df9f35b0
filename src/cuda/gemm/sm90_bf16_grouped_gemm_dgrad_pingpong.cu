// src/cuda/gemm/sm90_bf16_grouped_gemm_dgrad_pingpong.cu — bf16 dgrad grouped GEMM (bf16 out), ping-pong 128x128x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::bf16, GemmPass::dgrad, TileConfig::pingpong_128x128>;
}  // namespace gmoe::cuda_backend
