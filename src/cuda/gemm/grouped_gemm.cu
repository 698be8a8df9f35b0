// src/cuda/gemm/grouped_gemm.cu — the CUDA backend's grouped GEMM entry points (fprop, dgrad, wgrad).
//
// Each call: check what is CUDA-specific (dtypes the kernels take, 16-byte alignment of pointers
// and row strides for TMA, sizes CUTLASS's 32-bit group extents hold) and throw gmoe::Error before
// anything is launched; pick a tile configuration from host-known sizes only; take one workspace
// from the caller's allocator on the stream; then enqueue, all on `stream` and without a sync:
//   1. prepare (one block): counts -> clamped offsets -> per-expert shapes, pointers, strides;
//   2. for a list of expert tensors, their pointers, passed by value in kernel parameters;
//   3. zeros where the GEMM writes nothing: rows past the real total (fprop, dgrad), or dW of
//      experts without rows (wgrad; not when accumulating or masked);
//   4. the CUTLASS grouped GEMM, reading the arrays of step 1.
// Steps 1-3 are prepare_call (grouped_gemm_prepare.h), shared with the FP8 GEMMs; the choices are
// grouped_gemm_heuristics.h's. Everything is graph-capturable: the counts may change between
// replays of one captured graph.
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "common/backend.h"
#include "cuda/gemm/grouped_gemm_heuristics.h"
#include "cuda/gemm/grouped_gemm_instances.h"
#include "cuda/gemm/grouped_gemm_kernels.h"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

// ---------------------------------------------------------------------------------------------
// The compiled instantiations (grouped_gemm_instances.def), and the one place that maps runtime
// values onto them.

struct KernelEntry {
  std::size_t (*workspace_bytes)(int sm_count) = nullptr;
  void (*run)(const GroupedGemmLaunch&, cudaStream_t) = nullptr;
  bool has_source = false;
  TileConfig tile = TileConfig::coop_128x256;  ///< of the instantiation (for LaunchRecord)
};

template <DType In, DType Out, GemmPass Pass, TileConfig Tile, GemmEpilogue Epilogue>
KernelEntry entry() {
  using K = GroupedGemmKernel<In, Out, Pass, Tile, Epilogue>;
  return {&K::workspace_bytes, &K::run, Pass == GemmPass::wgrad && Out == DType::f32, Tile};
}

// The heuristics (grouped_gemm_heuristics.h) choose only compiled configurations, so a miss is a bug.
KernelEntry find_kernel(DType in, DType out, GemmPass pass, GemmEpilogue epilogue, TileConfig tile) {
#define GMOE_GROUPED_GEMM(f, i, o, p, e, t)                                                                    \
  if (in == DType::i && out == DType::o && pass == GemmPass::p && epilogue == GemmEpilogue::e &&               \
      tile == TileConfig::t) {                                                                                 \
    return entry<DType::i, DType::o, GemmPass::p, TileConfig::t, GemmEpilogue::e>();                          \
  }
#include "cuda/gemm/grouped_gemm_instances.def"
#undef GMOE_GROUPED_GEMM
  GMOE_FAIL("no compiled grouped GEMM for ", dtype_name(in), " -> ", dtype_name(out), ", pass ",
            static_cast<int>(pass), ", epilogue ", static_cast<int>(epilogue), ", tile ", static_cast<int>(tile));
}

// ---------------------------------------------------------------------------------------------
// CUDA-specific argument checks (the public edge has checked shapes, dtypes, devices, counts).

void check_input_dtype_cuda(DType t, const char* name) {
  GMOE_CHECK(t == DType::bf16 || t == DType::f16, name,
             ": the CUDA grouped GEMM takes bf16 or f16 inputs, got ", dtype_name(t));
}

void check_aligned(const void* p, const char* name) {
  GMOE_CHECK(aligned(p, 16), name,
             ": the CUDA backend needs 16-byte aligned data (TMA), got address ", p);
}

void check_stride_bytes(int64_t stride_elems, DType t, const char* name, const char* which) {
  const int64_t bytes = stride_elems * static_cast<int64_t>(dtype_size(t));
  GMOE_CHECK(bytes % 16 == 0, name, ": the CUDA backend needs ", which,
             " that are a multiple of 16 bytes (TMA), got ", stride_elems, " elements = ", bytes,
             " bytes");
}

void check_extent(int64_t v, const char* name, const char* what) {
  GMOE_CHECK(v <= INT32_MAX, name, ": ", what, " of ", v,
             " exceeds the 32-bit extents of the CUDA grouped GEMM");
}

void check_rows_cuda(const TensorView& t, const char* name) {
  check_aligned(t.data, name);
  check_stride_bytes(t.stride(0), t.dtype, name, "row strides");
  check_extent(t.size(0), name, "capacity");
  check_extent(t.size(1), name, "column count");
}

void check_experts_cuda(const ExpertWeights& w, const char* name) {
  check_extent(w.rows(), name, "rows");
  check_extent(w.cols(), name, "columns");
  GMOE_CHECK(w.num_experts() <= kMaxExperts, name, ": ", w.num_experts(),
             " experts, the CUDA backend takes at most ", kMaxExperts);
  if (w.is_stacked()) {
    check_aligned(w.stacked.data, name);
    check_stride_bytes(w.stacked.stride(0), w.dtype(), name, "expert strides");
    check_stride_bytes(w.stacked.stride(1), w.dtype(), name, "row strides");
  } else {
    for (const TensorView& t : w.list) {
      check_aligned(t.data, name);
      check_stride_bytes(t.stride(0), t.dtype, name, "row strides");
    }
  }
}

// Whether every row of the rows operand `a`, and every row of the experts' weights, starts on a
// 128-byte line (choose_rows_tile: a TMA box row of 128 bytes is then one L2 line).
OperandLines operand_lines(const TensorView& a, const ExpertWeights& w) {
  const auto on_lines = [](const void* p, int64_t stride_elems, DType t) {
    return aligned(p, 128) && stride_elems * static_cast<int64_t>(dtype_size(t)) % 128 == 0;
  };
  OperandLines lines;
  lines.rows = on_lines(a.data, a.stride(0), a.dtype);
  if (w.is_stacked()) {
    lines.weights = on_lines(w.stacked.data, w.stacked.stride(0), w.dtype()) &&
                    on_lines(w.stacked.data, w.stacked.stride(1), w.dtype());
  } else {
    for (const TensorView& t : w.list) lines.weights = lines.weights && on_lines(t.data, t.stride(0), t.dtype);
  }
  return lines;
}

// ---------------------------------------------------------------------------------------------
// One call, planned on the host and enqueued on the stream.

struct Plan : CallPlan {
  DType in = DType::bf16, out = DType::bf16;
  float beta = 0.0f;
  TileConfig tile = TileConfig::coop_128x256;
  bool raster_along_n = false;
};

KernelEntry kernel_of(const Plan& plan) {
  const GemmEpilogue epilogue = plan.bias != nullptr ? GemmEpilogue::bias : GemmEpilogue::none;
  return find_kernel(plan.in, plan.out, plan.prep.pass, epilogue, plan.tile);
}

void execute(const Plan& plan, Stream stream, Allocator& alloc) {
  const KernelEntry kernel = kernel_of(plan);
  GMOE_CHECK(plan.beta == 0.0f || kernel.has_source,
             "grouped GEMM: accumulate needs the f32 weight-gradient kernels");
  PreparedCall call =
      prepare_call(plan, plan.run_gemm ? kernel.workspace_bytes(sm_count(current_device())) : 0, stream, alloc);
  const bool pairs_m = kernel.tile == TileConfig::coop_128x256_2x1 || kernel.tile == TileConfig::coop_128x256_2x2;
  last_launch_record().cluster_m = pairs_m ? 2 : 1;
  last_launch_record().cluster_n = kernel.tile == TileConfig::coop_128x256_2x2 ? 2 : 1;
  if (plan.run_gemm) {
    call.launch.beta = plan.beta;
    call.launch.raster_along_n = plan.raster_along_n;
    kernel.run(call.launch, stream);
  }
  // `call.workspace` is released on `stream` here, after everything above.
}

RowsOperand rows_operand(const TensorView& t) {
  return {t.data, t.stride(0), static_cast<int32_t>(dtype_size(t.dtype))};
}

void set_expert_operand(PrepareParams& p, const ExpertWeights& w) {
  p.expert_stacked = w.is_stacked();
  if (w.is_stacked()) {
    p.expert = {w.stacked.data, w.stacked.stride(0), w.stacked.stride(1),
                static_cast<int32_t>(dtype_size(w.dtype()))};
  }
}

void check_rows_pass_cuda(const TensorView& a, const ExpertWeights& w, const TensorView& counts,
                          const TensorView& d, const char* a_name, const char* d_name) {
  check_input_dtype_cuda(a.dtype, a_name);
  GMOE_CHECK(d.dtype == a.dtype, d_name, ": the CUDA grouped GEMM writes ", d_name,
             " in the input dtype (", dtype_name(a.dtype), "); ", dtype_name(d.dtype),
             " output is not implemented");
  check_rows_cuda(a, a_name);
  check_rows_cuda(d, d_name);
  check_experts_cuda(w, "w");
  GMOE_CHECK(counts.size(0) <= kMaxExperts, "counts: ", counts.size(0),
             " experts, the CUDA backend takes at most ", kMaxExperts);
}

// fprop and dgrad differ only in which weight extent is the GEMM's N and which is its reduction.
// `fused_bias`: fprop with the bias in the epilogue (bias_in_epilogue).
void rows_pass(GemmPass pass, const TensorView& a, const ExpertWeights& w, const TensorView& counts,
               const TensorView& d, Stream stream, Allocator& alloc, const char* a_name,
               const char* d_name, const ExpertBias* fused_bias = nullptr) {
  check_rows_pass_cuda(a, w, counts, d, a_name, d_name);
  DeviceGuard guard(a.device.index);
  const int64_t capacity = a.size(0);
  const int64_t gemm_n = d.size(1);  // fprop: N; dgrad: K
  const int64_t gemm_k = a.size(1);  // fprop: K; dgrad: N
  Plan plan;
  plan.in = a.dtype;
  plan.out = d.dtype;
  plan.prep = prepare_params(pass, counts, capacity);
  plan.prep.gemm_n = static_cast<int32_t>(gemm_n);
  plan.prep.gemm_k = static_cast<int32_t>(gemm_k);
  plan.prep.rows_a = rows_operand(a);
  plan.prep.rows_d = rows_operand(d);
  set_expert_operand(plan.prep, w);
  plan.experts = &w;
  if (fused_bias != nullptr) {
    plan.bias = fused_bias;
    if (fused_bias->is_grouped()) {
      const TensorView& b = fused_bias->grouped;
      plan.prep.bias = {b.data, b.stride(0), 0, static_cast<int32_t>(dtype_size(b.dtype))};
    }
  }
  plan.run_gemm = capacity > 0 && gemm_n > 0 && gemm_k > 0;
  plan.tile = choose_rows_tile(a.dtype, pass, fused_bias != nullptr ? GemmEpilogue::bias : GemmEpilogue::none,
                               capacity, counts.size(0), gemm_n, sm_count(a.device.index), operand_lines(a, w));
  plan.out_base = d.data;
  plan.out_ld_bytes = d.stride(0) * static_cast<int64_t>(dtype_size(d.dtype));
  plan.out_row_bytes = gemm_n * static_cast<int64_t>(dtype_size(d.dtype));
  plan.zero_all_rows = gemm_k == 0;  // an empty reduction: every row is zero
  execute(plan, stream, alloc);
}

}  // namespace

void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, Stream stream, Allocator& alloc, const ExpertBias& bias) {
  if (!bias.defined()) {
    rows_pass(GemmPass::fprop, x, w, counts, y, stream, alloc, "x", "y");
    return;
  }
  // bf16 with a bf16 bias: in the epilogue (the bias is read element-wise into shared memory, so
  // it needs no alignment). Other dtypes, and an empty reduction (K = 0 runs no GEMM, so y = 0 +
  // bias needs the bias added to the zeroed rows): a second pass over y.
  if (bias_in_epilogue(x.dtype, bias.dtype(), y.dtype) && x.size(1) > 0) {
    rows_pass(GemmPass::fprop, x, w, counts, y, stream, alloc, "x", "y", &bias);
    return;
  }
  rows_pass(GemmPass::fprop, x, w, counts, y, stream, alloc, "x", "y");
  cuda_backend::grouped_bias_add(y, bias, counts, stream, alloc);
}

// The GEMM, then the activation kernel. (An activation in the GEMM's epilogue is not faster: the
// epilogue's extra work costs what the activation kernel's read of h saves.)
void grouped_gemm_fprop_activation(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                                   const TensorView& h, const TensorView& z, const ActivationOptions& options,
                                   const TensorView& probs, Stream stream, Allocator& alloc,
                                   const ExpertBias& bias) {
  cuda_backend::grouped_gemm_fprop(x, w, counts, h, stream, alloc, bias);
  cuda_backend::grouped_activation_forward(h, counts, z, options, probs, {}, stream, alloc);
}

void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx, Stream stream, Allocator& alloc) {
  rows_pass(GemmPass::dgrad, dy, w, counts, dx, stream, alloc, "dy", "dx");
}

// The GEMM into a scratch dz, then the activation's backward kernel (in the GEMM's epilogue it is
// slower: see grouped_gemm_fprop_activation).
void grouped_gemm_dgrad_activation_backward(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                                            const TensorView& h, const TensorView& dh,
                                            const ActivationOptions& options, Stream stream, Allocator& alloc) {
  const int64_t cap = h.size(0), F = h.size(1) / 2;
  // dz's rows padded to 16 bytes, as the GEMM's TMA stores need, whatever F is.
  const int64_t ld = (F + 7) / 8 * 8;
  Tensor dz = Tensor::empty({cap, ld}, dy.dtype, alloc, stream);
  const TensorView dzv(dz.view().data, dy.dtype, dy.device, {cap, F}, {ld, 1});
  rows_pass(GemmPass::dgrad, dy, w, counts, dzv, stream, alloc, "dy", "dz");
  cuda_backend::grouped_activation_backward(h, dzv, counts, dh, options, {}, {}, {}, {}, stream, alloc);
  dz.release_on(stream);
}

void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                        Allocator& alloc) {
  check_input_dtype_cuda(dy.dtype, "dy");
  GMOE_CHECK(dw.dtype() == dy.dtype || dw.dtype() == DType::f32, "dw: the CUDA grouped GEMM "
             "writes dW in the input dtype (", dtype_name(dy.dtype), ") or f32, got ",
             dtype_name(dw.dtype()));
  check_rows_cuda(dy, "dy");
  check_rows_cuda(x, "x");
  check_experts_cuda(dw, "dw");
  if (options.expert_mask.defined()) check_aligned(options.expert_mask.data, "options.expert_mask");
  if (options.masked_off == MaskedOffWgrad::fresh) check_experts_cuda(options.fresh_dw, "options.fresh_dw");

  DeviceGuard guard(dy.device.index);
  const int64_t capacity = dy.size(0);
  const int64_t n = dy.size(1), k = x.size(1);
  Plan plan;
  plan.in = dy.dtype;
  plan.out = dw.dtype();
  plan.prep = prepare_params(GemmPass::wgrad, counts, capacity);
  plan.prep.gemm_m = static_cast<int32_t>(n);
  plan.prep.gemm_n = static_cast<int32_t>(k);
  plan.prep.rows_a = rows_operand(dy);
  plan.prep.rows_b = rows_operand(x);
  set_expert_operand(plan.prep, dw);
  set_wgrad_mask(plan, options);
  plan.experts = &dw;
  plan.run_gemm = capacity > 0 && n > 0 && k > 0;
  plan.beta = options.accumulate ? 1.0f : 0.0f;
  plan.tile = choose_wgrad_tile(dy.dtype, dw.dtype(), capacity, counts.size(0), n);
  plan.raster_along_n = choose_wgrad_raster_along_n(n, k, capacity, counts.size(0), dy.dtype);
  plan.dw_elem_bytes = static_cast<int32_t>(dtype_size(dw.dtype()));
  plan.dw_rows = n;
  plan.dw_row_bytes = k * static_cast<int64_t>(dtype_size(dw.dtype()));
  execute(plan, stream, alloc);
}

}  // namespace gmoe::cuda_backend
