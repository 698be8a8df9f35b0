// src/common/backend.h — the contract between the public ops (src/common) and the backends.
//
// The public functions in gmoe/*.h check every host-visible property of their arguments, then call
// the backend of the tensors' device with arguments that are already valid: backends re-check
// nothing the edge checked, and check only what is specific to them (alignment for CUDA, say).
#pragma once

#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
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
}  // namespace cuda_backend

}  // namespace gmoe
