// src/common/cuda_unavailable.cpp — the CUDA backend's entry points in a CPU-only build.
// Compiled only when GMOE_WITH_CUDA is off; the public ops check compiled() first, so reaching
// any of the other functions is a bug, reported as such.
#include "common/backend.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {

bool compiled() { return false; }

[[noreturn]] static void unavailable() { GMOE_FAIL("gmoe was built without CUDA"); }

Allocator& allocator() { unavailable(); }
void check_device_errors(Stream) {}
void grouped_gemm_fprop(const TensorView&, const ExpertWeights&, const TensorView&,
                        const TensorView&, Stream, Allocator&) { unavailable(); }
void grouped_gemm_dgrad(const TensorView&, const ExpertWeights&, const TensorView&,
                        const TensorView&, Stream, Allocator&) { unavailable(); }
void grouped_gemm_wgrad(const TensorView&, const TensorView&, const TensorView&,
                        const ExpertWeights&, const WgradOptions&, Stream, Allocator&) {
  unavailable();
}

}  // namespace gmoe::cuda_backend
