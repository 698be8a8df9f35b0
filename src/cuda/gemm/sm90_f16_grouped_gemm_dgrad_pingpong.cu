// src/cuda/gemm/sm90_f16_grouped_gemm_dgrad_pingpong.cu — f16 dgrad grouped GEMM (f16 out), ping-pong 128x128x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::f16, DType::f16, GemmPass::dgrad, TileConfig::pingpong_128x128>;
}  // namespace gmoe::cuda_backend
