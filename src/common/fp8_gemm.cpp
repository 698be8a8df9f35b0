// src/common/fp8_gemm.cpp — the public FP8 grouped GEMM ops: check every host-visible property of
// the FP8 operands (against the layouts of gmoe/fp8.h) and of the outputs, then dispatch to the
// backend of the tensors' device.
#include "gmoe/fp8_gemm.h"

#include <string>

#include "common/backend.h"
#include "common/checks.h"
#include "common/fp8_checks.h"
#include "gmoe/error.h"

namespace gmoe {
namespace {

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
  fp8_grouped_gemm_fprop(x, w, ExpertBias(), counts, y, stream, alloc);
}

void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const ExpertBias& bias,
                            const TensorView& counts, const TensorView& y, Stream stream,
                            Allocator* alloc) {
  fp8_grouped_gemm_fprop(x, w, bias, counts, y, Fp8GemmOptions{}, stream, alloc);
}

void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const ExpertBias& bias,
                            const TensorView& counts, const TensorView& y, const Fp8GemmOptions& options,
                            Stream stream, Allocator* alloc) {
  GMOE_CHECK(x.data.defined(), "x: the rowwise copy (data) is absent; fprop reads it");
  const Device device = x.data.device;
  check_counts(counts, "counts", device);
  const int64_t E = counts.size(0);
  check_fp8_grouped(x, E, Fp8Copy::rowwise, device, "x", "; fprop reads it");
  check_fp8_weights(w, E, Fp8Copy::rowwise, device, "w", "; fprop reads it");
  check_same_recipe(x.recipe, w.recipe, "x", "w");
  GMOE_CHECK(w.cols == x.cols, "w: experts of [N, K] = [", w.rows, ", ", w.cols,
             "], but x has K = ", x.cols, " columns");
  check_rows_output(y, x.capacity, w.rows, device, "y");
  if (bias.defined()) check_expert_bias(bias, "bias", E, w.rows, y.dtype, device);
  if (device.is_cpu()) {
    cpu_backend::fp8_grouped_gemm_fprop(x, w, counts, y, bias);
  } else {
    check_cuda_compiled("fp8_grouped_gemm_fprop");
    cuda_backend::fp8_grouped_gemm_fprop(x, w, counts, y, stream, pick_allocator(alloc, device), bias,
                                         options.fast_accumulation);
  }
  after_op(device, stream);
}

void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, Stream stream, Allocator* alloc) {
  fp8_grouped_gemm_dgrad(dy, w, counts, dx, Fp8GemmOptions{}, stream, alloc);
}

void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, const Fp8GemmOptions& options, Stream stream,
                            Allocator* alloc) {
  GMOE_CHECK(dy.data.defined(), "dy: the rowwise copy (data) is absent; dgrad reads it");
  const Device device = dy.data.device;
  check_counts(counts, "counts", device);
  const int64_t E = counts.size(0);
  check_fp8_grouped(dy, E, Fp8Copy::rowwise, device, "dy", "; dgrad reads it");
  check_fp8_weights(w, E, Fp8Copy::columnwise, device, "w", "; dgrad reads it");
  check_same_recipe(dy.recipe, w.recipe, "dy", "w");
  GMOE_CHECK(w.rows == dy.cols, "w: experts of [N, K] = [", w.rows, ", ", w.cols,
             "], but dy has N = ", dy.cols, " columns");
  check_rows_output(dx, dy.capacity, w.cols, device, "dx");
  if (device.is_cpu()) {
    cpu_backend::fp8_grouped_gemm_dgrad(dy, w, counts, dx);
  } else {
    check_cuda_compiled("fp8_grouped_gemm_dgrad");
    cuda_backend::fp8_grouped_gemm_dgrad(dy, w, counts, dx, stream, pick_allocator(alloc, device),
                                         options.fast_accumulation);
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
  check_fp8_grouped(dy, E, Fp8Copy::columnwise, device, "dy", "; the weight gradient reads it");
  check_fp8_grouped(x, E, Fp8Copy::columnwise, device, "x", "; the weight gradient reads it");
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
  check_wgrad_mask(options, dw, device);
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
