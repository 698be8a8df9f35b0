// src/cuda/gemm/grouped_gemm_prepare.h — device-side argument preparation for the grouped GEMMs, and
// the small kernels around them (zeroing rows past the real total, zeroing empty experts' dW).
//
// Nothing here reads the counts on the host: one single-block kernel reads them on the device,
// clamps them (recording problems in the device error word), takes the prefix sum and writes the
// per-expert problem shapes, pointers and strides that the CUTLASS grouped kernel reads.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "cuda/gemm/grouped_gemm_kernels.h"
#include "cuda/gemm/grouped_gemm_heuristics.h"  // the choices prepare_call and the FP8 dispatcher share
#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::cuda_backend {

/// Most experts one call takes (the zeroing kernel puts experts on gridDim.y).
constexpr int64_t kMaxExperts = 65535;

/// The device arrays one grouped GEMM call fills, all carved from one workspace allocation: one
/// entry per group (an expert, or with row chunks a run of an expert's rows; "[E]" below), except
/// total, zero_expert (per expert) and alpha (per expert; each group's alpha_ptr points at its
/// expert's).
struct GroupedGemmArrays {
  GroupShape* shapes = nullptr;       ///< [E]
  const void** ptr_a = nullptr;       ///< [E]
  const void** ptr_b = nullptr;       ///< [E]
  const void** ptr_c = nullptr;       ///< [E] (wgrad: = ptr_d, read only when accumulating)
  void** ptr_d = nullptr;             ///< [E]
  int64_t* stride_a = nullptr;        ///< [E], elements
  int64_t* stride_b = nullptr;
  int64_t* stride_c = nullptr;
  int64_t* stride_d = nullptr;
  int64_t* total = nullptr;           ///< [1] the clamped real total of rows
  int32_t* zero_expert = nullptr;     ///< [E] wgrad: 1 where dW_e must be written as zeros
  const void** ptr_bias = nullptr;    ///< [E] fprop with a fused bias: expert e's bias vector
  /// [E] wgrad with a list fresh_dw (WgradOptions::masked_off == fresh): expert e's fresh dW_e and
  /// its row stride, written by value before the preparation kernel, which picks them for the
  /// experts whose mask is 0.
  const void** fresh_ptr = nullptr;
  int64_t* fresh_ld = nullptr;
  // FP8 only (fp8_grouped_gemm.cu); absent (nullptr) for the 16-bit GEMMs.
  const float** ptr_sfa = nullptr;    ///< [E] blockwise: group e's first scale of A
  const float** ptr_sfb = nullptr;    ///< [E] blockwise: group e's first scale of B
  float* alpha = nullptr;             ///< [E] tensorwise: alpha_e = alpha_a[e] * alpha_b[e]
  const float** alpha_ptr = nullptr;  ///< [E] tensorwise: &alpha[e], for CUTLASS's epilogue
};

/// A grouped-rows operand: group e starts at base + offset_e * ld * elem_bytes.
struct RowsOperand {
  const void* base = nullptr;
  int64_t ld = 0;          ///< row stride, elements
  int32_t elem_bytes = 0;
  /// FP8 wgrad's columnwise (transposed) operands [cols, padded_capacity]: group e starts at
  /// column padded_offsets[e] (device, i64 [E + 1], multiples of 128) instead of at row offset_e.
  /// nullptr for row operands.
  const int64_t* padded_offsets = nullptr;
  int64_t padded_capacity = 0;  ///< columns of the columnwise operand
};

/// Where group e's FP8 block scales start (f32 scale matrices).
enum class ScaleStart : int32_t {
  none,     ///< no block scales
  rows,     ///< scales of grouped rows: base + offset_e * ld (token-major [kb, capacity]: ld 1)
  columns,  ///< token-block scales of a columnwise operand [padded/128, cols] (token-block-major):
            ///< base + padded_offsets[e] / 128 * ld (the operand's padded_offsets, ld = cols)
  expert    ///< expert weights' scales [E, nb, kb]: base + e * expert_stride
};
struct ScaleOperand {
  const float* base = nullptr;
  ScaleStart start = ScaleStart::none;
  int64_t ld = 0;             ///< rows, columns: elements between consecutive scale rows
  int64_t expert_stride = 0;  ///< expert: elements between experts
};

/// A stacked expert operand: expert e starts at base + e * expert_stride * elem_bytes.
struct StackedOperand {
  const void* base = nullptr;
  int64_t expert_stride = 0;  ///< elements between experts
  int64_t ld = 0;             ///< row stride inside an expert, elements
  int32_t elem_bytes = 0;
};

/// What the preparation kernel needs. fprop/dgrad: A and D are grouped rows, B the expert weights
/// (stacked here, or written by write_expert_pointers for a list). wgrad: A (dy) and B (x) are
/// grouped rows, D (and C) the expert gradients.
struct PrepareParams {
  GemmPass pass = GemmPass::fprop;
  const void* counts = nullptr;
  bool counts_i64 = false;
  int32_t num_experts = 0;
  int64_t capacity = 0;
  /// GEMM extents fixed on the host: fprop/dgrad use n, k (m is each group's count); wgrad uses
  /// m, n (k is each group's count).
  int32_t gemm_m = 0, gemm_n = 0, gemm_k = 0;
  RowsOperand rows_a, rows_b, rows_d;
  bool expert_stacked = true;
  StackedOperand expert;  ///< fprop/dgrad: B; wgrad: D and C
  const int32_t* mask = nullptr;  ///< wgrad: [E], 0 = masked off (see masked_off_fresh); nullptr = all written
  /// wgrad: experts with mask 0 are written into the fresh destination (WgradOptions::fresh_dw)
  /// instead of being skipped. The choice is made per expert in the preparation kernel.
  bool masked_off_fresh = false;
  bool fresh_stacked = true;      ///< wgrad: the fresh destination is stacked (`fresh`), else a list
  StackedOperand fresh;           ///< wgrad, masked_off_fresh and stacked: the fresh dW
  bool accumulate = false;        ///< wgrad: D += A·B into dw (never into fresh), empty experts left untouched
  /// fprop with a fused grouped [E, N] bias: expert e's vector at base + e * expert_stride
  /// (elements; ld unused). base == nullptr: no bias, or a list (written by write_expert_pointers).
  StackedOperand bias;
  // FP8 only (fp8_grouped_gemm.cu):
  ScaleOperand scale_a, scale_b;   ///< blockwise: where group e's scales of A and B start
  const float* alpha_a = nullptr;  ///< tensorwise: [E] per-expert scale_inv of A (device)
  const float* alpha_b = nullptr;  ///< tensorwise: [E] per-expert scale_inv of B (device)
  // Set by prepare_call:
  /// fprop/dgrad: each expert's rows split into groups of at most this many (row_chunk_rows); 0:
  /// one group per expert.
  int32_t row_chunk = 0;
  int32_t num_groups = 0;  ///< the groups of the launch (E, or E + ceil(capacity / row_chunk))
};

/// The parameters every call sets alike: the pass, the device counts ([E] i32/i64) and the capacity.
inline PrepareParams prepare_params(GemmPass pass, const TensorView& counts, int64_t capacity) {
  PrepareParams p;
  p.pass = pass;
  p.counts = counts.data;
  p.counts_i64 = counts.dtype == DType::i64;
  p.num_experts = static_cast<int32_t>(counts.size(0));
  p.capacity = capacity;
  return p;
}

/// Launches the preparation kernel (one block) on `stream`.
void launch_prepare(const PrepareParams& p, const GroupedGemmArrays& arrays, cudaStream_t stream);

/// For the list layout: writes ptr[e] and ld[e] (and, if ptr2 is given, ptr2[e] and ld2[e]) from
/// host values passed by value in kernel parameters (graph-safe: no host-to-device copy), in
/// chunks of a few hundred experts per launch.
void launch_write_expert_pointers(const void* const* host_ptrs, const int64_t* host_lds, int count,
                                  const void** ptr, int64_t* ld, const void** ptr2, int64_t* ld2,
                                  cudaStream_t stream);
/// The same for pointers alone (a list of bias vectors): ptr[e] = host_ptrs[e].
void launch_write_pointers(const void* const* host_ptrs, int count, const void** ptr, cudaStream_t stream);

/// Zeroes rows [*start_row, capacity) of a row-major matrix (start_row == nullptr: from row 0).
void launch_zero_rows(void* base, int64_t ld_bytes, int64_t row_bytes, int64_t capacity,
                      const int64_t* start_row, int sm_count, cudaStream_t stream);

/// Zeroes dW_e ([rows, row_bytes] at ptr_d[e] with row stride stride_d[e] * elem_bytes) for every
/// expert with zero_expert[e] != 0.
void launch_zero_experts(void* const* ptr_d, const int64_t* stride_d, int32_t elem_bytes,
                         int64_t rows, int64_t row_bytes, const int32_t* zero_expert,
                         int num_experts, int sm_count, cudaStream_t stream);

/// One grouped GEMM call up to its kernel, the same for the 16-bit and the FP8 GEMMs (prep.pass
/// says which operands are grouped rows).
struct CallPlan {
  PrepareParams prep;
  /// The expert tensors when given as a list (fprop/dgrad: B; wgrad: D and C), whose pointers are
  /// written by value; nullptr or stacked: the preparation kernel computes them.
  const ExpertWeights* experts = nullptr;
  const ExpertBias* bias = nullptr;  ///< fprop with a bias fused into the epilogue
  /// wgrad with MaskedOffWgrad::fresh and a list fresh_dw: its pointers, written by value.
  const ExpertWeights* fresh = nullptr;
  bool block_scales = false;         ///< FP8 blockwise: per-group scale pointers
  bool alpha = false;                ///< FP8 tensorwise: per-group alpha
  bool run_gemm = false;             ///< false: every extent empty, only the zeros are written
  // Zeros where the GEMM writes nothing. fprop/dgrad: the output rows past the real total (all
  // rows when the reduction is empty); wgrad: dW_e ([dw_rows, dw_row_bytes]) of experts without rows.
  void* out_base = nullptr;
  int64_t out_ld_bytes = 0, out_row_bytes = 0;
  bool zero_all_rows = false;
  int32_t dw_elem_bytes = 0;
  int64_t dw_rows = 0, dw_row_bytes = 0;
};

/// wgrad: the expert mask and where masked-off experts go (WgradOptions), into plan.prep (a
/// stacked fresh_dw) or plan.fresh (a list).
void set_wgrad_mask(CallPlan& plan, const WgradOptions& options);

/// What prepare_call leaves: the workspace (released on the call's stream when this goes), the
/// arrays in it, and the launch arguments of the grouped kernel (shapes, pointers, strides, bias,
/// CUTLASS's workspace; alpha 1, beta 0: the caller sets what differs).
struct PreparedCall {
  Buffer workspace;
  GroupedGemmArrays arrays;
  GroupedGemmLaunch launch;
};

/// Takes one workspace from `alloc` for the arrays and `cutlass_bytes` of CUTLASS workspace, then
/// enqueues on `stream`: the preparation kernel, a list's pointers (experts and bias), the zeros.
PreparedCall prepare_call(const CallPlan& plan, std::size_t cutlass_bytes, cudaStream_t stream, Allocator& alloc);

/// What the last grouped GEMM call (bf16 or FP8) on this host thread launched: the choices that no
/// result shows (row chunks, the cluster of the instantiation that ran), written on the host as the
/// call is enqueued (prepare_call, then the dispatcher), so that tests can check that a rule took
/// effect rather than a silent fallback to another kernel.
struct LaunchRecord {
  bool fp8 = false;
  bool ran = false;        ///< false: every extent was empty (only zeros were written, no GEMM)
  int32_t num_groups = 0;  ///< groups of the launch (the experts, plus the row chunks' extra groups)
  int32_t row_chunk = 0;   ///< fprop/dgrad: most rows of an expert per group (0: one group each)
  int32_t cluster_m = 1, cluster_n = 1;  ///< the cluster of the instantiation that ran
  int32_t tile_n = 128;                  ///< FP8 launches: the CTA tile's N extent (tensorwise rows: 128 or 256)
};
/// This thread's record (see LaunchRecord).
LaunchRecord& last_launch_record();

}  // namespace gmoe::cuda_backend
