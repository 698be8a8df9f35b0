// src/cuda/gemm/sm90_bf16_grouped_gemm_wgrad_f32_coop2x1.cu — bf16 wgrad grouped GEMM to f32 (main_grad accumulate), cooperative 128x256x64 tile in 2x1 clusters.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::f32, GemmPass::wgrad, TileConfig::coop_128x256_2x1>;
}  // namespace gmoe::cuda_backend
