// src/cuda/gemm/sm90_f16_grouped_gemm_wgrad_f32_pingpong.cu — f16 wgrad grouped GEMM (f32 out), ping-pong 128x128x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::f16, DType::f32, GemmPass::wgrad, TileConfig::pingpong_128x128>;
}  // namespace gmoe::cuda_backend
