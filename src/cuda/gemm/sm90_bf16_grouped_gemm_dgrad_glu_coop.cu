// src/cuda/gemm/sm90_bf16_grouped_gemm_dgrad_glu_coop.cu — bf16 dgrad grouped GEMM with the gated activation's backward in the epilogue (dh from dz's accumulators and h; dz is not stored), cooperative 128x256x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_glu_epilogue.cuh"
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::bf16, GemmPass::dgrad, TileConfig::coop_128x256, false, true>;
}  // namespace gmoe::cuda_backend
