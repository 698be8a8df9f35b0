// src/cuda/gemm/sm90_bf16_grouped_gemm_wgrad_f32_coop.cu — bf16 wgrad grouped GEMM (f32 out), cooperative 128x256x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::f32, GemmPass::wgrad, TileConfig::coop_128x256>;
}  // namespace gmoe::cuda_backend
