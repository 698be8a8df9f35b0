// src/cuda/fp8_gemm/sm90_fp8_grouped_gemm_tensorwise_wgrad_f32.cu — FP8 (e4m3 A and B) wgrad grouped GEMM, per-expert alpha, f32 out, cooperative 128x128x128.
// One explicit instantiation per file: the CUTLASS templates compile in parallel and only once.
#include "cuda/fp8_gemm/sm90_fp8_grouped_gemm.cuh"

namespace gmoe::cuda_backend {
template struct Fp8GroupedGemmKernel<Fp8Scaling::tensorwise, Fp8Operands::wgrad, DType::f32>;
}  // namespace gmoe::cuda_backend
