// src/common/cuda_unavailable.cpp — the CUDA backend's entry points in a CPU-only build.
// Compiled only when GMOE_WITH_CUDA is off; the public ops check compiled() first, so reaching
// any of the other functions is a bug, reported as such.
#include "common/backend.h"
#include "common/memory_pool_backend.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {

bool compiled() { return false; }

[[noreturn]] static void unavailable() { GMOE_FAIL("gmoe was built without CUDA"); }

Allocator& allocator() { unavailable(); }
MemoryPoolStats memory_pool_stats(int) { unavailable(); }
void reset_memory_pool_peaks(int) { unavailable(); }
void trim_memory_pool(int, std::size_t) { unavailable(); }
void check_device_errors(Stream) {}
void grouped_gemm_fprop(const TensorView&, const ExpertWeights&, const TensorView&,
                        const TensorView&, Stream, Allocator&, const ExpertBias&) { unavailable(); }
void grouped_gemm_fprop_activation(const TensorView&, const ExpertWeights&, const TensorView&, const TensorView&,
                                   const TensorView&, const ActivationOptions&, const TensorView&, Stream, Allocator&,
                                   const ExpertBias&) {
  unavailable();
}
void grouped_gemm_dgrad(const TensorView&, const ExpertWeights&, const TensorView&,
                        const TensorView&, Stream, Allocator&) { unavailable(); }
void grouped_gemm_dgrad_activation_backward(const TensorView&, const ExpertWeights&, const TensorView&,
                                            const TensorView&, const TensorView&, const ActivationOptions&, Stream,
                                            Allocator&) {
  unavailable();
}
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
bool quantize_activation_forward(const TensorView&, const TensorView&, const ActivationOptions&, const TensorView&,
                                 const Fp8QuantizeOptions&, const Fp8Grouped&, Stream, Allocator&) {
  unavailable();
}
void copy_rows(const TensorView&, const TensorView&, Stream) { unavailable(); }
void zero_bytes(void*, std::size_t, Stream) { unavailable(); }
void upload_host_bytes(void*, const void*, std::size_t, Stream) { unavailable(); }
const void* last_upload_staging() { return nullptr; }
void* event_create() { unavailable(); }
void event_destroy(void*) {}
void event_record(void*, Stream) { unavailable(); }
void stream_wait_event(Stream, void*) { unavailable(); }
void stream_synchronize(Stream) { unavailable(); }
void* host_alloc_pinned(std::size_t) { unavailable(); }
void host_free_pinned(void*) {}
void copy_bytes_async(void*, const void*, std::size_t, Stream) { unavailable(); }
void grouped_activation_forward(const TensorView&, const TensorView&, const TensorView&, const ActivationOptions&,
                                const TensorView&, const TensorView&, Stream, Allocator&) {
  unavailable();
}
void grouped_activation_backward(const TensorView&, const TensorView&, const TensorView&, const TensorView&,
                                 const ActivationOptions&, const TensorView&, const TensorView&, const TensorView&,
                                 const TensorView&, Stream, Allocator&) {
  unavailable();
}
void permute_glu_rows(const TensorView&, const TensorView&, const GluFormat&, const GluFormat&, Stream) {
  unavailable();
}
void quantize_grouped(const GroupedRows&, const Fp8QuantizeOptions&, const Fp8Grouped&, Stream,
                      Allocator&, const ExpertBias&) {
  unavailable();
}
void quantize_weights(const ExpertWeights&, const Fp8QuantizeOptions&, const Fp8Weights&, Stream,
                      Allocator&) {
  unavailable();
}
void dequantize_grouped(const Fp8Grouped&, const TensorView&, const TensorView&, Fp8Copy, Stream,
                        Allocator&) {
  unavailable();
}
void dequantize_weights(const Fp8Weights&, const ExpertWeights&, Fp8Copy, Stream, Allocator&) {
  unavailable();
}
void fp8_grouped_gemm_fprop(const Fp8Grouped&, const Fp8Weights&, const TensorView&,
                            const TensorView&, Stream, Allocator&, const ExpertBias&, bool) {
  unavailable();
}
void fp8_grouped_gemm_dgrad(const Fp8Grouped&, const Fp8Weights&, const TensorView&,
                            const TensorView&, Stream, Allocator&, bool) {
  unavailable();
}
void fp8_grouped_gemm_wgrad(const Fp8Grouped&, const Fp8Grouped&, const TensorView&,
                            const ExpertWeights&, const WgradOptions&, Stream, Allocator&) {
  unavailable();
}

void router_topk(const TensorView&, const RouterOptions&, const TensorView&, const TensorView&, const TensorView&,
                 const TensorView&, Stream, Allocator&) {
  unavailable();
}
void router_topk_backward(const TensorView&, const TensorView&, const TensorView&, const RouterOptions&,
                          const TensorView&, bool, Stream, Allocator&) {
  unavailable();
}
void router_aux_loss(const TensorView&, const TensorView&, const RouterOptions&, float, const TensorView&, Stream,
                     Allocator&) {
  unavailable();
}
void router_aux_loss_backward(const TensorView&, const TensorView&, const RouterOptions&, float, const TensorView&,
                              const TensorView&, bool, Stream, Allocator&) {
  unavailable();
}
void router_z_loss(const TensorView&, float, const TensorView&, Stream, Allocator&) { unavailable(); }
void router_z_loss_backward(const TensorView&, float, const TensorView&, const TensorView&, bool, Stream,
                            Allocator&) {
  unavailable();
}
void permute(const TensorView&, const TensorView&, const PermuteOptions&, const TensorView&, const TensorView&,
             const RoutingMap&, const TensorView&, const TensorView&, const TensorView&, Stream, Allocator&) {
  unavailable();
}
void permute_backward(const TensorView&, const RoutingMap&, const TensorView&, const TensorView&, const TensorView&,
                      Stream, Allocator&) {
  unavailable();
}
void combine(const TensorView&, const RoutingMap&, const TensorView&, const TensorView&, Stream, Allocator&) {
  unavailable();
}
void combine_backward(const TensorView&, const RoutingMap&, const TensorView&, const TensorView&, const TensorView&,
                      const TensorView&, Stream, Allocator&) {
  unavailable();
}

}  // namespace gmoe::cuda_backend
