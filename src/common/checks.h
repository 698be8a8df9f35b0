// src/common/checks.h — argument checks shared by the public ops. Each throws gmoe::Error naming
// the argument, what was expected and what was given.
#pragma once

#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// A 2-D grouped-rows tensor: [capacity, cols], rows contiguous (stride(1) == 1), row stride
/// >= cols, data present unless empty.
void check_rows(const TensorView& t, const char* name);
/// Counts: 1-D i32/i64, contiguous, length >= 1, on `device`.
void check_counts(const TensorView& counts, const char* name, Device device);
/// Expert weights: every expert [N, K] with unit column stride and row stride >= K; one dtype and
/// device across the list; stacked row/expert strides consistent.
void check_expert_weights(const ExpertWeights& w, const char* name);
void check_same_device(Device given, Device expected, const char* name);
/// A contiguous f32 vector of n values on `device` (probs and dprobs: one per row; an amax: one per
/// expert), data present unless empty; `what` says what the values are in the message.
void check_f32_vector(const TensorView& v, const char* name, int64_t n, const char* what, Device device);
/// bf16/f16/f32 (f32 is the CPU reference's; the CUDA backend narrows further).
void check_input_dtype(DType t, const char* name);
/// The input dtype or f32.
void check_output_dtype(DType out, DType in, const char* name);
/// WgradOptions::expert_mask when given: i32[E], contiguous, with data, on `device`.
void check_expert_mask(const TensorView& mask, int64_t E, Device device);
/// WgradOptions' mask and its destinations: the expert_mask (check_expert_mask), and with
/// MaskedOffWgrad::fresh a mask and a fresh_dw of dw's experts, shape, dtype and device, each of its
/// experts disjoint from every expert of dw; with skip, no fresh_dw.
void check_wgrad_mask(const WgradOptions& options, const ExpertWeights& dw, Device device);
/// Expert biases: E vectors of N, dtype of the rows or f32, contiguous, on `device`.
void check_expert_bias(const ExpertBias& b, const char* name, int64_t E, int64_t N, DType rows_dtype,
                       Device device);
/// `alloc`, checked to serve `device`'s type, or the device's default allocator when nullptr.
Allocator& pick_allocator(Allocator* alloc, Device device);
/// Throws gmoe::Error naming both when the bytes that views `a` and `b` touch overlap (absent or
/// empty views overlap nothing).
void check_disjoint(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name);
/// Throws "<op>: tensors are on CUDA but gmoe was built without CUDA".
void check_cuda_compiled(const char* op);

}  // namespace gmoe
