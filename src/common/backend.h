// src/common/backend.h — the contract between the public ops (src/common) and the backends.
//
// The public functions in gmoe/*.h check every host-visible property of their arguments, then call
// the backend of the tensors' device with arguments that are already valid: backends re-check
// nothing the edge checked, and check only what is specific to them (alignment for CUDA, say).
#pragma once

#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Plain loops, fp32 accumulation: the oracle for every kernel. Counts are on the host.
namespace cpu_backend {
void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y);
void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx);
void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options);
void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts);
void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias);
/// dst[r, :] = src[r, :] for 2-D views of one shape and dtype (rows contiguous).
void copy_rows(const TensorView& dst, const TensorView& src);
}  // namespace cpu_backend

/// sm_90a kernels. Counts stay on the device. Defined only when GMOE_WITH_CUDA; otherwise the
/// public ops throw "built without CUDA" before reaching here.
namespace cuda_backend {
/// True when gmoe was compiled with the CUDA backend.
bool compiled();
Allocator& allocator();
void check_device_errors(Stream stream);
void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, Stream stream, Allocator& alloc);
void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx, Stream stream, Allocator& alloc);
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
/// Events for ordering work across streams (capturable): an opaque cudaEvent_t.
void* event_create();
void event_destroy(void* event);
void event_record(void* event, Stream stream);
void stream_wait_event(Stream stream, void* event);
}  // namespace cuda_backend

}  // namespace gmoe
