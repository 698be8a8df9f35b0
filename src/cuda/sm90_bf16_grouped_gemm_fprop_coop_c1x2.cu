// src/cuda/sm90_bf16_grouped_gemm_fprop_coop_c1x2.cu — bf16 fprop grouped GEMM, cooperative 128x256x64 tile in 1x2 clusters.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::coop_128x256_c1x2>;
}  // namespace gmoe::cuda_backend
