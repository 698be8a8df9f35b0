// src/cuda/gemm/sm90_bf16_grouped_gemm_fprop_glu_pingpong.cu — bf16 fprop grouped GEMM (bf16 out) and the gated activation in the epilogue (h and z), ping-pong 128x128x64 tile.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/gemm/sm90_glu_epilogue.cuh"
#include "cuda/gemm/sm90_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct GroupedGemmKernel<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::pingpong_128x128, false, true>;
}  // namespace gmoe::cuda_backend
