// src/common/backend.h — the contract between the public ops (src/common) and the backends.
//
// The public functions in gmoe/*.h check every host-visible property of their arguments, then call
// the backend of the tensors' device with arguments that are already valid: backends re-check
// nothing the edge checked, and check only what is specific to them (alignment for CUDA, say).
#pragma once

#include "gmoe/activation.h"
#include "gmoe/allocator.h"
#include "gmoe/fp8.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/routing.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Whether fprop adds a bias to the f32 accumulator before the output's one rounding (bf16 x, bias
/// and y: what the CUDA epilogue does), or to the output already rounded, rounding again (every
/// other combination). The same on every backend, so that the CPU backend stays the reference in the
/// kernels' own precision.
inline bool bias_in_epilogue(DType x, DType bias, DType y) {
  return x == DType::bf16 && bias == DType::bf16 && y == DType::bf16;
}

/// Plain loops, fp32 accumulation: the oracle for every kernel. Counts are on the host.
namespace cpu_backend {
/// `bias` may be absent; when present it is added as bias_in_epilogue says.
void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, const ExpertBias& bias = {});
void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx);
void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options);
void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts);
void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias);
/// dst[r, :] = src[r, :] for 2-D views of one shape and dtype (rows contiguous).
void copy_rows(const TensorView& dst, const TensorView& src);
/// Grouped activations (gmoe/activation.h).
void grouped_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                                const ActivationOptions& options, const TensorView& probs,
                                const TensorView& amax_out = {});
void grouped_activation_backward(const TensorView& h, const TensorView& dz, const TensorView& counts,
                                 const TensorView& dh, const ActivationOptions& options, const TensorView& probs,
                                 const TensorView& dprobs, const TensorView& z_out, const TensorView& amax_out = {});
/// FP8 quantization: `q` holds every output view to write (checked, allocated by the caller).
void quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& options, const Fp8Grouped& q);
void quantize_weights(const ExpertWeights& w, const Fp8QuantizeOptions& options, const Fp8Weights& q);
void dequantize_grouped(const Fp8Grouped& q, const TensorView& counts, const TensorView& out,
                        Fp8Copy which);
void dequantize_weights(const Fp8Weights& q, const ExpertWeights& out, Fp8Copy which);
/// FP8 grouped GEMM reference: dequantize to f32, then the grouped GEMM above.
void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& y, const ExpertBias& bias);
void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx);
void fp8_grouped_gemm_wgrad(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts,
                            const ExpertWeights& dw, const WgradOptions& options);
/// Routing (gmoe/routing.h). The CPU backend sees ids on the host and throws on one out of range.
void router_topk(const TensorView& logits, const RouterOptions& options, const TensorView& ids,
                 const TensorView& probs, const TensorView& counts, const TensorView& score_bias);
void router_topk_backward(const TensorView& logits, const TensorView& ids, const TensorView& dprobs,
                          const RouterOptions& options, const TensorView& dlogits, bool accumulate);
void router_aux_loss(const TensorView& logits, const TensorView& counts, const RouterOptions& options, float coeff,
                     const TensorView& loss);
void router_aux_loss_backward(const TensorView& logits, const TensorView& counts, const RouterOptions& options,
                              float coeff, const TensorView& dloss, const TensorView& dlogits, bool accumulate);
void router_z_loss(const TensorView& logits, float coeff, const TensorView& loss);
void router_z_loss_backward(const TensorView& logits, float coeff, const TensorView& dloss, const TensorView& dlogits,
                            bool accumulate);
void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs,
             const TensorView& permuted_probs, const TensorView& dropped);
void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs, const TensorView& dprobs);
void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out);
void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs);
}  // namespace cpu_backend

/// sm_90a kernels. Counts stay on the device. Defined only when GMOE_WITH_CUDA; otherwise the
/// public ops throw "built without CUDA" before reaching here.
namespace cuda_backend {
/// True when gmoe was compiled with the CUDA backend.
bool compiled();
Allocator& allocator();
void check_device_errors(Stream stream);
/// `bias` may be absent; bias_in_epilogue: in the GEMM's epilogue, else in a second pass.
void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, Stream stream, Allocator& alloc, const ExpertBias& bias = {});
/// grouped_gemm_fprop then grouped_activation_forward.
void grouped_gemm_fprop_activation(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                                   const TensorView& h, const TensorView& z, const ActivationOptions& options,
                                   const TensorView& probs, Stream stream, Allocator& alloc,
                                   const ExpertBias& bias = {});
void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx, Stream stream, Allocator& alloc);
/// grouped_gemm_dgrad into a dz scratch then grouped_activation_backward(h, dz, counts, dh).
void grouped_gemm_dgrad_activation_backward(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                                            const TensorView& h, const TensorView& dh,
                                            const ActivationOptions& options, Stream stream, Allocator& alloc);
void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                        Allocator& alloc);
void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts,
                      Stream stream, Allocator& alloc);
void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias,
                       Stream stream, Allocator& alloc);
/// dst[r, :] = src[r, :] (cudaMemcpy2DAsync, device to device, stream-ordered).
void copy_rows(const TensorView& dst, const TensorView& src, Stream stream);
/// bytes zeros at ptr (cudaMemsetAsync).
void zero_bytes(void* ptr, std::size_t bytes, Stream stream);
/// upload_counts' device side: `bytes` of host memory at `src` copied on the host into a pinned
/// staging block (an event-guarded pool: gmoe/copy.h), then cudaMemcpyAsync'd to `dst` on `stream`.
void upload_host_bytes(void* dst, const void* src, std::size_t bytes, Stream stream);
/// The staging block the last upload_host_bytes of this host thread copied from (tests: pinned, and
/// never one that another thread's upload still holds).
const void* last_upload_staging();
/// Events for ordering work across streams (capturable): an opaque cudaEvent_t.
void* event_create();
void event_destroy(void* event);
void event_record(void* event, Stream stream);
void stream_wait_event(Stream stream, void* event);
/// A deliberate sync, for set-up code only (never on the hot path).
void stream_synchronize(Stream stream);
/// Pinned host memory (cudaHostAlloc, portable): the offload pool's chunks. Not capturable.
void* host_alloc_pinned(std::size_t bytes);
void host_free_pinned(void* ptr);
/// `bytes` from src to dst, either on the host (pinned) or the device (cudaMemcpyAsync with the
/// kind inferred from the pointers), stream-ordered: the offload copies.
void copy_bytes_async(void* dst, const void* src, std::size_t bytes, Stream stream);
/// Grouped activations (gmoe/activation.h); counts stay on the device.
void grouped_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                                const ActivationOptions& options, const TensorView& probs,
                                const TensorView& amax_out, Stream stream, Allocator& alloc);
void grouped_activation_backward(const TensorView& h, const TensorView& dz, const TensorView& counts,
                                 const TensorView& dh, const ActivationOptions& options, const TensorView& probs,
                                 const TensorView& dprobs, const TensorView& z_out, const TensorView& amax_out,
                                 Stream stream, Allocator& alloc);
/// dst = src with the 2F rows of dimension 1 re-ordered from gate/up layout `from` to `to`; src and
/// dst are [outer, 2F, inner] views with unit inner stride, not overlapping (FC1 weights, biases).
void permute_glu_rows(const TensorView& src, const TensorView& dst, const GluFormat& from, const GluFormat& to,
                      Stream stream);
/// FP8 quantization (see the cpu_backend twins); counts stay on the device. column_sums (may be
/// absent): each expert's column sums of x.data, from the same pass over x (gmoe/fp8.h).
void quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& options, const Fp8Grouped& q,
                      Stream stream, Allocator& alloc, const ExpertBias& column_sums);
/// The activation's output (z = act(h)·probs, [capacity, F] with F = q.cols) quantized into q
/// straight from h, in one pass: bitwise grouped_activation_forward then quantize_grouped. False,
/// having launched nothing, where the fused kernel does not apply (tensorwise, dtype, alignment,
/// gate/up layout: fp8_quantize_activation.cu); the caller then composes the two ops.
bool quantize_activation_forward(const TensorView& h, const TensorView& counts, const ActivationOptions& act,
                                 const TensorView& probs, const Fp8QuantizeOptions& options, const Fp8Grouped& q,
                                 Stream stream, Allocator& alloc);
void quantize_weights(const ExpertWeights& w, const Fp8QuantizeOptions& options, const Fp8Weights& q,
                      Stream stream, Allocator& alloc);
void dequantize_grouped(const Fp8Grouped& q, const TensorView& counts, const TensorView& out,
                        Fp8Copy which, Stream stream, Allocator& alloc);
void dequantize_weights(const Fp8Weights& q, const ExpertWeights& out, Fp8Copy which,
                        Stream stream, Allocator& alloc);
/// FP8 grouped GEMM (see the cpu_backend twins); counts stay on the device. fast_accumulation:
/// Fp8GemmOptions (gmoe/fp8_gemm.h).
void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& y, Stream stream, Allocator& alloc, const ExpertBias& bias,
                            bool fast_accumulation);
void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, Stream stream, Allocator& alloc, bool fast_accumulation);
void fp8_grouped_gemm_wgrad(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts,
                            const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                            Allocator& alloc);
/// Routing (gmoe/routing.h); counts stay on the device, ids out of range set the device error word.
void router_topk(const TensorView& logits, const RouterOptions& options, const TensorView& ids,
                 const TensorView& probs, const TensorView& counts, const TensorView& score_bias, Stream stream,
                 Allocator& alloc);
void router_topk_backward(const TensorView& logits, const TensorView& ids, const TensorView& dprobs,
                          const RouterOptions& options, const TensorView& dlogits, bool accumulate, Stream stream,
                          Allocator& alloc);
void router_aux_loss(const TensorView& logits, const TensorView& counts, const RouterOptions& options, float coeff,
                     const TensorView& loss, Stream stream, Allocator& alloc);
void router_aux_loss_backward(const TensorView& logits, const TensorView& counts, const RouterOptions& options,
                              float coeff, const TensorView& dloss, const TensorView& dlogits, bool accumulate,
                              Stream stream, Allocator& alloc);
void router_z_loss(const TensorView& logits, float coeff, const TensorView& loss, Stream stream, Allocator& alloc);
void router_z_loss_backward(const TensorView& logits, float coeff, const TensorView& dloss, const TensorView& dlogits,
                            bool accumulate, Stream stream, Allocator& alloc);
void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs,
             const TensorView& permuted_probs, const TensorView& dropped, Stream stream, Allocator& alloc);
void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs, const TensorView& dprobs, Stream stream, Allocator& alloc);
void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out,
             Stream stream, Allocator& alloc);
void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs,
                      Stream stream, Allocator& alloc);
}  // namespace cuda_backend

}  // namespace gmoe
