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

void grouped_bias_add(const TensorView&, const ExpertBias&, const TensorView&, Stream, Allocator&) {
  unavailable();
}
void grouped_bias_grad(const TensorView&, const TensorView&, const ExpertBias&, Stream, Allocator&) {
  unavailable();
}
void copy_rows(const TensorView&, const TensorView&, Stream) { unavailable(); }
void zero_bytes(void*, std::size_t, Stream) { unavailable(); }
void* event_create() { unavailable(); }
void event_destroy(void*) {}
void event_record(void*, Stream) { unavailable(); }
void stream_wait_event(Stream, void*) { unavailable(); }

}  // namespace gmoe::cuda_backend
