// src/cuda/gemm/sm90_bf16_grouped_gemm_fprop_bias_glu_coop.cu — bf16 fprop grouped GEMM (bf16 out) with the bf16 bias and the gated activation in the epilogue (h and z), cooperative 128x256x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_glu_epilogue.cuh"
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::coop_128x256, true, true>;
}  // namespace gmoe::cuda_backend
