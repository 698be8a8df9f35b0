// src/common/fp8_gemm.cpp — the public FP8 grouped GEMM ops: check every host-visible property of
// the FP8 operands (against the layouts of gmoe/fp8.h) and of the outputs, then dispatch to the
// backend of the tensors' device.
#include "gmoe/fp8_gemm.h"

#include <string>

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"

namespace gmoe {
namespace {

bool is_fp8_format(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

// A view of an FP8 operand must be exactly its layout's: shape, dtype, device, contiguous.
void check_view(const TensorView& given, const TensorView& expected, const std::string& name) {
  GMOE_CHECK(given.defined(), name, ": absent (expected ", expected.str(), ")");
  GMOE_CHECK(given.ndim == expected.ndim && given.dtype == expected.dtype &&
                 given.device == expected.device,
             name, ": expected ", expected.str(), ", got ", given.str());
  for (int d = 0; d < expected.ndim; ++d) {
    GMOE_CHECK(given.shape[d] == expected.shape[d], name, ": expected shape ",
               expected.shape_str(), ", got ", given.shape_str());
  }
  GMOE_CHECK(given.is_contiguous(), name, ": must be contiguous, got ", given.str());
  GMOE_CHECK(given.data != nullptr || given.numel() == 0, name, ": null data for ",
             given.shape_str());
}

void check_recipe(Fp8Recipe r, DType format, const char* name) {
  GMOE_CHECK(r == Fp8Recipe::tensorwise || r == Fp8Recipe::blockwise || r == Fp8Recipe::mxfp8,
             name, ".recipe: unknown value ", static_cast<int>(r));
  GMOE_CHECK(is_fp8_format(format), name, ".format: expected e4m3 or e5m2, got ",
             dtype_name(format));
}

// The copy of grouped rows that a pass reads (rowwise: fprop x, dgrad dy; columnwise: wgrad).
void check_grouped_operand(const Fp8Grouped& q, int64_t E, Fp8Copy which, Device device,
                           const char* name) {
  check_recipe(q.recipe, q.format, name);
  GMOE_CHECK(q.capacity >= 0 && q.cols >= 0, name, ": negative shape [", q.capacity, ", ",
             q.cols, "]");
  Fp8QuantizeOptions o;
  o.recipe = q.recipe;
  o.format = q.format;
  o.rowwise = which == Fp8Copy::rowwise;
  o.columnwise = which == Fp8Copy::columnwise;
  const Fp8Grouped l = fp8_grouped_layout(q.capacity, q.cols, E, o, device);
  const std::string n(name);
  if (which == Fp8Copy::rowwise) {
    GMOE_CHECK(q.data.defined(), name, ": the rowwise copy (data) is absent; this pass reads it");
    check_view(q.data, l.data, n + ".data");
    check_view(q.scale_inv, l.scale_inv, n + ".scale_inv");
  } else {
    GMOE_CHECK(q.data_t.defined(), name,
               ": the columnwise copy (data_t) is absent; the weight gradient reads it");
    GMOE_CHECK(q.padded_capacity == l.padded_capacity, name, ".padded_capacity: expected ",
               l.padded_capacity, " (fp8_padded_capacity(", q.capacity, ", ", E, ")), got ",
               q.padded_capacity);
    check_view(q.data_t, l.data_t, n + ".data_t");
    check_view(q.scale_inv_t, l.scale_inv_t, n + ".scale_inv_t");
    check_view(q.padded_offsets, l.padded_offsets, n + ".padded_offsets");
  }
}

// The copy of the weights that a pass reads (rowwise: fprop; columnwise = data_t: dgrad).
void check_weights_operand(const Fp8Weights& q, int64_t E, Fp8Copy which, Device device,
                           const char* name) {
  check_recipe(q.recipe, q.format, name);
  GMOE_CHECK(q.experts == E, name, ".experts: ", q.experts, ", but counts has length ", E);
  GMOE_CHECK(q.rows >= 0 && q.cols >= 0, name, ": negative shape [", q.rows, ", ", q.cols, "]");
  Fp8QuantizeOptions o;
  o.recipe = q.recipe;
  o.format = q.format;
  o.rowwise = which == Fp8Copy::rowwise;
  o.columnwise = which == Fp8Copy::columnwise;
  const Fp8Weights l = fp8_weights_layout(q.experts, q.rows, q.cols, o, device);
  const std::string n(name);
  if (which == Fp8Copy::rowwise) {
    GMOE_CHECK(q.data.defined(), name, ": the rowwise copy (data) is absent; fprop reads it");
    check_view(q.data, l.data, n + ".data");
    check_view(q.scale_inv, l.scale_inv, n + ".scale_inv");
  } else {
    GMOE_CHECK(q.data_t.defined(), name,
               ": the transposed copy (data_t) is absent; dgrad reads it");
    check_view(q.data_t, l.data_t, n + ".data_t");
    check_view(q.scale_inv_t, l.scale_inv_t, n + ".scale_inv_t");
  }
}

void check_same_recipe(Fp8Recipe a, Fp8Recipe b, const char* a_name, const char* b_name) {
  GMOE_CHECK(a == b, b_name, ".recipe: ", fp8_recipe_name(b), ", but ", a_name, " is ",
             fp8_recipe_name(a), "; both operands of an FP8 GEMM must use one recipe");
}

// y / dx: [capacity, cols], bf16 or f32 (the CUDA backend narrows to bf16).
void check_rows_output(const TensorView& out, int64_t capacity, int64_t cols, Device device,
                       const char* name) {
  check_rows(out, name);
  check_same_device(out.device, device, name);
  GMOE_CHECK(out.size(0) == capacity && out.size(1) == cols, name, ": expected [", capacity, ", ",
             cols, "], got ", out.shape_str());
  GMOE_CHECK(out.dtype == DType::bf16 || out.dtype == DType::f32, name,
             ": FP8 GEMMs write bf16 (or f32 on the CPU), got ", dtype_name(out.dtype));
}

void after_op(Device device, Stream stream) {
  if (device.is_cuda() && debug_sync_enabled()) check_device_errors(stream);
}

}  // namespace

void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& y, Stream stream, Allocator* alloc) {
  GMOE_CHECK(x.data.defined(), "x: the rowwise copy (data) is absent; fprop reads it");
  const Device device = x.data.device;
  check_counts(counts, "counts", device);
  const int64_t E = counts.size(0);
  check_grouped_operand(x, E, Fp8Copy::rowwise, device, "x");
  check_weights_operand(w, E, Fp8Copy::rowwise, device, "w");
  check_same_recipe(x.recipe, w.recipe, "x", "w");
  GMOE_CHECK(w.cols == x.cols, "w: experts of [N, K] = [", w.rows, ", ", w.cols,
             "], but x has K = ", x.cols, " columns");
  check_rows_output(y, x.capacity, w.rows, device, "y");
  if (device.is_cpu()) {
    cpu_backend::fp8_grouped_gemm_fprop(x, w, counts, y);
  } else {
    check_cuda_compiled("fp8_grouped_gemm_fprop");
    cuda_backend::fp8_grouped_gemm_fprop(x, w, counts, y, stream, pick_allocator(alloc, device));
  }
  after_op(device, stream);
}

void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, Stream stream, Allocator* alloc) {
  GMOE_CHECK(dy.data.defined(), "dy: the rowwise copy (data) is absent; dgrad reads it");
  const Device device = dy.data.device;
  check_counts(counts, "counts", device);
  const int64_t E = counts.size(0);
  check_grouped_operand(dy, E, Fp8Copy::rowwise, device, "dy");
  check_weights_operand(w, E, Fp8Copy::columnwise, device, "w");
  check_same_recipe(dy.recipe, w.recipe, "dy", "w");
  GMOE_CHECK(w.rows == dy.cols, "w: experts of [N, K] = [", w.rows, ", ", w.cols,
             "], but dy has N = ", dy.cols, " columns");
  check_rows_output(dx, dy.capacity, w.cols, device, "dx");
  if (device.is_cpu()) {
    cpu_backend::fp8_grouped_gemm_dgrad(dy, w, counts, dx);
  } else {
    check_cuda_compiled("fp8_grouped_gemm_dgrad");
    cuda_backend::fp8_grouped_gemm_dgrad(dy, w, counts, dx, stream, pick_allocator(alloc, device));
  }
  after_op(device, stream);
}

void fp8_grouped_gemm_wgrad(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts,
                            const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                            Allocator* alloc) {
  GMOE_CHECK(dy.data_t.defined(),
             "dy: the columnwise copy (data_t) is absent; the weight gradient reads it");
  const Device device = dy.data_t.device;
  check_counts(counts, "counts", device);
  const int64_t E = counts.size(0);
  check_grouped_operand(dy, E, Fp8Copy::columnwise, device, "dy");
  check_grouped_operand(x, E, Fp8Copy::columnwise, device, "x");
  check_same_recipe(dy.recipe, x.recipe, "dy", "x");
  GMOE_CHECK(x.capacity == dy.capacity, "x.capacity: ", x.capacity, ", but dy's is ", dy.capacity,
             " (both are the same grouped rows)");
  check_expert_weights(dw, "dw");
  GMOE_CHECK(dw.num_experts() == E, "dw: ", dw.num_experts(), " experts, but counts has length ",
             E);
  GMOE_CHECK(dw.rows() == dy.cols && dw.cols() == x.cols, "dw: expected experts of [", dy.cols,
             ", ", x.cols, "], got [", dw.rows(), ", ", dw.cols(), "]");
  check_same_device(dw.device(), device, "dw");
  GMOE_CHECK(dw.dtype() == DType::f32 || dw.dtype() == DType::bf16,
             "dw: FP8 weight gradients are f32 or bf16, got ", dtype_name(dw.dtype()));
  GMOE_CHECK(!options.accumulate || dw.dtype() == DType::f32,
             "dw: accumulate needs an f32 main_grad, got ", dtype_name(dw.dtype()));
  if (options.expert_mask.defined()) {
    const TensorView& m = options.expert_mask;
    GMOE_CHECK(m.ndim == 1 && m.size(0) == E && m.dtype == DType::i32,
               "options.expert_mask: expected i32[", E, "], got ", m.str());
    GMOE_CHECK(m.stride(0) == 1 || m.size(0) <= 1, "options.expert_mask: must be contiguous");
    check_same_device(m.device, device, "options.expert_mask");
  }
  if (device.is_cpu()) {
    cpu_backend::fp8_grouped_gemm_wgrad(dy, x, counts, dw, options);
  } else {
    check_cuda_compiled("fp8_grouped_gemm_wgrad");
    cuda_backend::fp8_grouped_gemm_wgrad(dy, x, counts, dw, options, stream,
                                         pick_allocator(alloc, device));
  }
  after_op(device, stream);
}

}  // namespace gmoe
