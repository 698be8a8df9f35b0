// src/common/grouped_gemm.cpp — the public grouped GEMM ops: check every host-visible property of
// the arguments, then dispatch to the backend of the tensors' device.
#include "gmoe/grouped_gemm.h"

#include <string>

#include "common/activation_internal.h"
#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"

namespace gmoe {
namespace {

// What every pass checks about the weights (or the weight gradient) against the grouped rows.
void check_weights_against(const ExpertWeights& w, const char* name, const TensorView& counts,
                           int64_t n_expected, int64_t k_expected, Device device) {
  check_expert_weights(w, name);
  GMOE_CHECK(w.num_experts() == counts.size(0), name, ": ", w.num_experts(),
             " experts, but counts has length ", counts.size(0));
  GMOE_CHECK(w.rows() == n_expected && w.cols() == k_expected, name, ": expected experts of [",
             n_expected, ", ", k_expected, "], got [", w.rows(), ", ", w.cols(), "]");
  check_same_device(w.device(), device, name);
}

void after_op(Device device, Stream stream) {
  if (device.is_cuda() && debug_sync_enabled()) check_device_errors(stream);
}

}  // namespace

void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, Stream stream, Allocator* alloc) {
  grouped_gemm_fprop(x, w, ExpertBias::none(), counts, y, stream, alloc);
}

namespace {

// fprop's arguments; `y_name` is the output's name in the messages ("y", or "h").
void check_fprop(const TensorView& x, const ExpertWeights& w, const ExpertBias& bias, const TensorView& counts,
                 const TensorView& y, const char* y_name) {
  check_rows(x, "x");
  check_counts(counts, "counts", x.device);
  check_input_dtype(x.dtype, "x");
  check_weights_against(w, "w", counts, w.rows(), x.size(1), x.device);
  GMOE_CHECK(w.dtype() == x.dtype, "w: dtype must match x (", dtype_name(x.dtype), "), got ",
             dtype_name(w.dtype()));
  check_rows(y, y_name);
  check_same_device(y.device, x.device, y_name);
  GMOE_CHECK(y.size(0) == x.size(0) && y.size(1) == w.rows(), y_name, ": expected [", x.size(0), ", ",
             w.rows(), "], got ", y.shape_str());
  check_output_dtype(y.dtype, x.dtype, y_name);
  if (bias.defined()) check_expert_bias(bias, "bias", w.num_experts(), w.rows(), x.dtype, x.device);
}

}  // namespace

void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const ExpertBias& bias,
                        const TensorView& counts, const TensorView& y, Stream stream, Allocator* alloc) {
  check_fprop(x, w, bias, counts, y, "y");
  if (x.device.is_cpu()) {
    cpu_backend::grouped_gemm_fprop(x, w, counts, y, bias);
  } else {
    check_cuda_compiled("grouped_gemm_fprop");
    cuda_backend::grouped_gemm_fprop(x, w, counts, y, stream, pick_allocator(alloc, x.device), bias);
  }
  after_op(x.device, stream);
}

void grouped_gemm_fprop_activation(const TensorView& x, const ExpertWeights& w, const ExpertBias& bias,
                                   const TensorView& counts, const TensorView& h, const TensorView& z,
                                   const ActivationOptions& options, const TensorView& probs, Stream stream,
                                   Allocator* alloc) {
  // Everything both ops check, before either runs.
  check_fprop(x, w, bias, counts, h, "h");
  GMOE_CHECK(h.dtype == x.dtype, "h: expected x's dtype ", dtype_name(x.dtype), ", got ", dtype_name(h.dtype));
  check_activation_forward(h, counts, z, options, probs);
  // The outputs are written while the inputs are read (on CUDA by one kernel): no overlap.
  for (const TensorView* out : {&h, &z}) {
    const char* out_name = out == &h ? "h" : "z";
    check_disjoint(*out, out_name, x, "x");
    if (w.is_stacked()) {
      check_disjoint(*out, out_name, w.stacked, "w");
    } else {
      for (const TensorView& we : w.list) check_disjoint(*out, out_name, we, "w");
    }
    if (bias.is_grouped()) {
      check_disjoint(*out, out_name, bias.grouped, "bias");
    } else if (bias.defined()) {
      for (const TensorView& b : bias.list) check_disjoint(*out, out_name, b, "bias");
    }
  }
  check_disjoint(h, "h", probs, "probs");
  if (x.device.is_cpu()) {
    cpu_backend::grouped_gemm_fprop(x, w, counts, h, bias);
    cpu_backend::grouped_activation_forward(h, counts, z, options, probs);
  } else {
    check_cuda_compiled("grouped_gemm_fprop_activation");
    cuda_backend::grouped_gemm_fprop_activation(x, w, counts, h, z, options, probs, stream,
                                                pick_allocator(alloc, x.device), bias);
  }
  after_op(x.device, stream);
}

namespace {

// dgrad's inputs: dy [capacity, N], w [E, N, K] of dy's dtype, counts.
void check_dgrad_inputs(const TensorView& dy, const ExpertWeights& w, const TensorView& counts) {
  check_rows(dy, "dy");
  check_counts(counts, "counts", dy.device);
  check_input_dtype(dy.dtype, "dy");
  check_weights_against(w, "w", counts, dy.size(1), w.cols(), dy.device);
  GMOE_CHECK(w.dtype() == dy.dtype, "w: dtype must match dy (", dtype_name(dy.dtype), "), got ",
             dtype_name(w.dtype()));
}

}  // namespace

void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx, Stream stream, Allocator* alloc) {
  check_dgrad_inputs(dy, w, counts);
  check_rows(dx, "dx");
  check_same_device(dx.device, dy.device, "dx");
  GMOE_CHECK(dx.size(0) == dy.size(0) && dx.size(1) == w.cols(), "dx: expected [", dy.size(0),
             ", ", w.cols(), "], got ", dx.shape_str());
  check_output_dtype(dx.dtype, dy.dtype, "dx");
  if (dy.device.is_cpu()) {
    cpu_backend::grouped_gemm_dgrad(dy, w, counts, dx);
  } else {
    check_cuda_compiled("grouped_gemm_dgrad");
    cuda_backend::grouped_gemm_dgrad(dy, w, counts, dx, stream, pick_allocator(alloc, dy.device));
  }
  after_op(dy.device, stream);
}

void grouped_gemm_dgrad_activation_backward(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                                            const TensorView& h, const TensorView& dh,
                                            const ActivationOptions& options, Stream stream, Allocator* alloc) {
  check_dgrad_inputs(dy, w, counts);
  const int64_t cap = dy.size(0), F = w.cols();
  GMOE_CHECK(is_gated(options.kind), "options.kind: grouped_gemm_dgrad_activation_backward needs a gated ",
             "activation, got ", activation_name(options.kind));
  check_activation_dh(h, dh, options, F);  // dh then matches h in shape, dtype and device
  check_same_device(h.device, dy.device, "h");
  GMOE_CHECK(h.size(0) == cap, "h: expected dy's ", cap, " rows, got ", h.shape_str());
  GMOE_CHECK(h.dtype == dy.dtype, "h: expected dy's dtype ", dtype_name(dy.dtype), ", got ", dtype_name(h.dtype));
  check_disjoint(dh, "dh", dy, "dy");
  if (w.is_stacked()) {
    check_disjoint(dh, "dh", w.stacked, "w");
  } else {
    for (const TensorView& we : w.list) check_disjoint(dh, "dh", we, "w");
  }
  if (dy.device.is_cpu()) {
    Tensor dz = Tensor::empty({cap, F}, dy.dtype, pick_allocator(alloc, dy.device), stream);
    cpu_backend::grouped_gemm_dgrad(dy, w, counts, dz.view());
    cpu_backend::grouped_activation_backward(h, dz.view(), counts, dh, options, {}, {}, {}, {});
  } else {
    check_cuda_compiled("grouped_gemm_dgrad_activation_backward");
    cuda_backend::grouped_gemm_dgrad_activation_backward(dy, w, counts, h, dh, options, stream,
                                                         pick_allocator(alloc, dy.device));
  }
  after_op(dy.device, stream);
}

void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                        Allocator* alloc) {
  check_rows(dy, "dy");
  check_rows(x, "x");
  check_same_device(x.device, dy.device, "x");
  check_counts(counts, "counts", dy.device);
  check_input_dtype(dy.dtype, "dy");
  GMOE_CHECK(x.dtype == dy.dtype, "x: dtype must match dy (", dtype_name(dy.dtype), "), got ",
             dtype_name(x.dtype));
  GMOE_CHECK(x.size(0) == dy.size(0), "x: expected ", dy.size(0), " rows (the capacity of dy), got ",
             x.size(0));
  check_weights_against(dw, "dw", counts, dy.size(1), x.size(1), dy.device);
  check_output_dtype(dw.dtype(), dy.dtype, "dw");
  GMOE_CHECK(!options.accumulate || dw.dtype() == DType::f32,
             "dw: accumulate needs an f32 main_grad, got ", dtype_name(dw.dtype()));
  check_wgrad_mask(options, dw, dy.device);
  if (dy.device.is_cpu()) {
    cpu_backend::grouped_gemm_wgrad(dy, x, counts, dw, options);
  } else {
    check_cuda_compiled("grouped_gemm_wgrad");
    cuda_backend::grouped_gemm_wgrad(dy, x, counts, dw, options, stream,
                                     pick_allocator(alloc, dy.device));
  }
  after_op(dy.device, stream);
}

}  // namespace gmoe
