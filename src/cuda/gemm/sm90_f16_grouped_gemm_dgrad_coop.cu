// src/cuda/gemm/sm90_f16_grouped_gemm_dgrad_coop.cu — f16 dgrad grouped GEMM (f16 out), cooperative 128x256x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::f16, DType::f16, GemmPass::dgrad, TileConfig::coop_128x256>;
}  // namespace gmoe::cuda_backend
