// python/csrc/ops.cpp — gmoe's ops in PyTorch's dispatcher, namespace `gmoe` (torch.ops.gmoe.*).
//
// Each op allocates its outputs with torch (on the inputs' device), then calls the public gmoe op
// on the current torch stream with gmoe's scratch from torch's allocator. The same kernel function
// is registered for CPU (gmoe's CPU reference backend) and, where built, CUDA: gmoe dispatches on the
// tensors' device itself. gmoe checks every argument before writing anything; its errors come out as
// ValueError with gmoe's message. The fake (meta) kernels for torch.compile are registered in Python
// (gmoe/_meta.py), where symbolic shapes are natural; the autograd formulas of the differentiable
// ops in C++ (autograd.cpp), so that a call runs no Python.
//
// Conventions of the schemas:
//   w: Tensor[]     one stacked [E, N, K] tensor, or E tensors [N, K] (per-expert parameters)
//   bias: Tensor[]  empty (no bias), one grouped [E, N] tensor, or E tensors [N]
//   counts          [E] int32/int64 rows per expert, on the inputs' device (never read on the host
//                   by the CUDA backend)
//   glu_block       FC1's gate/up layout: 0 concatenated [gate | up], b > 0 interleaved in blocks of b
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "gmoe/activation.h"
#include "gmoe/fp8.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/grouped_mlp.h"
#include "torch_bridge.h"

namespace gmoe_torch {
namespace {

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK_VALUE(t.dim() == 2, what, ": expected a 2-D tensor [capacity, cols], got ", t.sizes());
}

gmoe::GluFormat glu_of(int64_t block) {
  TORCH_CHECK_VALUE(block >= 0, "glu_block: expected 0 (concatenated) or a positive block, got ", block);
  return block == 0 ? gmoe::GluFormat{gmoe::GluLayout::concatenated, 1}
                    : gmoe::GluFormat{gmoe::GluLayout::interleaved, block};
}

gmoe::ActivationOptions activation_of(const std::string& kind, double alpha, double limit, bool gelu_tanh,
                                      int64_t glu_block) {
  gmoe::ActivationOptions o;
  o.kind = gmoe::activation_from_name(kind);
  o.alpha = static_cast<float>(alpha);
  o.limit = static_cast<float>(limit);
  o.gelu_tanh = gelu_tanh;
  o.glu = glu_of(glu_block);
  return o;
}

gmoe::MaskedOffWgrad masked_off_of(const std::string& name) {
  if (name == "skip") return gmoe::MaskedOffWgrad::skip;
  if (name == "fresh") return gmoe::MaskedOffWgrad::fresh;
  TORCH_CHECK_VALUE(false, "masked_off: expected 'skip' or 'fresh', got '", name, "'");
}

/// The weight-gradient options of the in-place wgrad ops: accumulate, expert_mask, and what the
/// experts with mask 0 get (masked_off; with "fresh" their dW_e goes to fresh_dw, the other
/// experts' views of it are left untouched).
gmoe::WgradOptions wgrad_options(bool accumulate, const std::optional<at::Tensor>& expert_mask,
                                 const std::string& masked_off, std::optional<at::TensorList> fresh_dw) {
  gmoe::WgradOptions o;
  o.accumulate = accumulate;
  o.expert_mask = view_of(expert_mask, "expert_mask");
  o.masked_off = masked_off_of(masked_off);
  if (fresh_dw.has_value()) o.fresh_dw = weights_of(*fresh_dw, "fresh_dw");
  return o;
}

/// The [E, N, K] output of a functional wgrad op. With an expert mask the experts with mask 0 are
/// skipped by the kernel, so they start as zeros (the fresh gradient of a layer without main_grad).
at::Tensor new_wgrad(const at::Tensor& counts, int64_t n, int64_t k, const at::TensorOptions& o,
                     const std::optional<at::Tensor>& expert_mask) {
  TORCH_CHECK_VALUE(counts.dim() == 1, "counts: expected a 1-D tensor [E], got ", counts.sizes());
  return expert_mask.has_value() ? at::zeros({counts.size(0), n, k}, o) : at::empty({counts.size(0), n, k}, o);
}

// ---- grouped GEMM -----------------------------------------------------------------------------

at::Tensor grouped_gemm_fprop(const at::Tensor& x, at::TensorList w, const at::Tensor& counts,
                              at::TensorList bias, std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    check_rows(x, "x");
    OpScope s(x);
    const gmoe::ExpertWeights wv = weights_of(w, "w");
    at::Tensor y = at::empty({x.size(0), wv.rows()}, x.options().dtype(out_dtype.value_or(x.scalar_type())));
    gmoe::grouped_gemm_fprop(view_of(x, "x"), wv, bias_of(bias, "bias"), view_of(counts, "counts"),
                             view_of(y, "y"), s.stream(), s.alloc());
    return y;
  });
}

at::Tensor grouped_gemm_dgrad(const at::Tensor& dy, at::TensorList w, const at::Tensor& counts,
                              std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    check_rows(dy, "dy");
    OpScope s(dy);
    const gmoe::ExpertWeights wv = weights_of(w, "w");
    at::Tensor dx = at::empty({dy.size(0), wv.cols()}, dy.options().dtype(out_dtype.value_or(dy.scalar_type())));
    gmoe::grouped_gemm_dgrad(view_of(dy, "dy"), wv, view_of(counts, "counts"), view_of(dx, "dx"), s.stream(),
                             s.alloc());
    return dx;
  });
}

at::Tensor grouped_gemm_wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& counts,
                              std::optional<at::ScalarType> out_dtype, const std::optional<at::Tensor>& expert_mask) {
  return guarded([&] {
    check_rows(dy, "dy");
    check_rows(x, "x");
    OpScope s(dy);
    at::Tensor dw = new_wgrad(counts, dy.size(1), x.size(1), dy.options().dtype(out_dtype.value_or(dy.scalar_type())),
                              expert_mask);
    gmoe::grouped_gemm_wgrad(view_of(dy, "dy"), view_of(x, "x"), view_of(counts, "counts"),
                             gmoe::ExpertWeights::from_stacked(view_of(dw, "dw")),
                             wgrad_options(false, expert_mask, "skip", std::nullopt), s.stream(), s.alloc());
    return dw;
  });
}

void grouped_gemm_wgrad_(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& counts, at::TensorList dw,
                         bool accumulate, const std::optional<at::Tensor>& expert_mask,
                         const std::string& masked_off, std::optional<at::TensorList> fresh_dw) {
  guarded([&] {
    OpScope s(dy);
    gmoe::grouped_gemm_wgrad(view_of(dy, "dy"), view_of(x, "x"), view_of(counts, "counts"), weights_of(dw, "dw"),
                             wgrad_options(accumulate, expert_mask, masked_off, fresh_dw), s.stream(), s.alloc());
    return 0;
  });
}

// ---- bias -------------------------------------------------------------------------------------

at::Tensor grouped_bias_add(const at::Tensor& y, at::TensorList bias, const at::Tensor& counts) {
  return guarded([&] {
    check_rows(y, "y");
    OpScope s(y);
    const gmoe::ExpertBias b = bias_of(bias, "bias");
    // Checked before the copy is made, so that bad input costs nothing.
    TORCH_CHECK_VALUE(b.defined(), "bias: expected one grouped [E, N] tensor or E tensors [N], got none");
    at::Tensor out = y.clone(at::MemoryFormat::Contiguous);
    gmoe::grouped_bias_add(view_of(out, "y"), b, view_of(counts, "counts"), s.stream(), s.alloc());
    return out;
  });
}

at::Tensor grouped_bias_grad(const at::Tensor& dy, const at::Tensor& counts, std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    check_rows(dy, "dy");
    TORCH_CHECK_VALUE(counts.dim() == 1, "counts: expected a 1-D tensor [E], got ", counts.sizes());
    OpScope s(dy);
    at::Tensor db = at::empty({counts.size(0), dy.size(1)}, dy.options().dtype(out_dtype.value_or(dy.scalar_type())));
    gmoe::grouped_bias_grad(view_of(dy, "dy"), view_of(counts, "counts"),
                            gmoe::ExpertBias::from_grouped(view_of(db, "dbias")), s.stream(), s.alloc());
    return db;
  });
}

// ---- activations ------------------------------------------------------------------------------

at::Tensor grouped_activation_forward(const at::Tensor& h, const at::Tensor& counts, const std::string& kind,
                                      const std::optional<at::Tensor>& probs, double alpha, double limit,
                                      bool gelu_tanh, int64_t glu_block) {
  return guarded([&] {
    check_rows(h, "h");
    OpScope s(h);
    const gmoe::ActivationOptions o = activation_of(kind, alpha, limit, gelu_tanh, glu_block);
    const int64_t f = gmoe::is_gated(o.kind) ? h.size(1) / 2 : h.size(1);
    at::Tensor z = at::empty({h.size(0), f}, h.options());
    gmoe::grouped_activation_forward(view_of(h, "h"), view_of(counts, "counts"), view_of(z, "z"), o,
                                     view_of(probs, "probs"), s.stream(), s.alloc());
    return z;
  });
}

std::tuple<at::Tensor, at::Tensor> grouped_activation_backward(const at::Tensor& h, const at::Tensor& dz,
                                                               const at::Tensor& counts, const std::string& kind,
                                                               const std::optional<at::Tensor>& probs,
                                                               bool need_dprobs, double alpha, double limit,
                                                               bool gelu_tanh, int64_t glu_block) {
  return guarded([&] {
    check_rows(h, "h");
    OpScope s(h);
    const gmoe::ActivationOptions o = activation_of(kind, alpha, limit, gelu_tanh, glu_block);
    at::Tensor dh = at::empty(h.sizes(), h.options());
    // An op returns tensors, not "absent": without need_dprobs, dprobs is an empty [0] tensor.
    at::Tensor dprobs = at::empty({need_dprobs ? h.size(0) : 0}, h.options().dtype(at::kFloat));
    gmoe::grouped_activation_backward(view_of(h, "h"), view_of(dz, "dz"), view_of(counts, "counts"),
                                      view_of(dh, "dh"), o, view_of(probs, "probs"),
                                      need_dprobs ? view_of(dprobs, "dprobs") : gmoe::TensorView(), {},
                                      s.stream(), s.alloc());
    return std::make_tuple(dh, dprobs);
  });
}

/// FC2 of an expert MLP over its activation: y = fprop(act(h)·probs, w, bias), exactly the two ops in
/// turn. Its autograd formula (autograd.cpp) keeps h and probs, not act(h)·probs, and makes the
/// activation again in backward (GroupedMLP's recompute_activation).
at::Tensor grouped_gemm_fprop_of_activation(const at::Tensor& h, at::TensorList w, const at::Tensor& counts,
                                            at::TensorList bias, const std::string& kind,
                                            const std::optional<at::Tensor>& probs, double alpha, double limit,
                                            bool gelu_tanh, int64_t glu_block) {
  const at::Tensor z = grouped_activation_forward(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block);
  return grouped_gemm_fprop(z, w, counts, bias, std::nullopt);
}

// GroupedLinear's forward with its gradient destinations (main_grad, placeholders, delay), which
// only its autograd formula reads (python/csrc/autograd.cpp): the forward is fprop, of the
// activation where one is given.
at::Tensor grouped_linear_forward(const at::Tensor& x, at::TensorList w, const at::Tensor& counts, at::TensorList bias,
                                  at::TensorList, at::TensorList, at::TensorList, at::TensorList, bool, bool,
                                  const std::optional<std::string>& activation, const std::optional<at::Tensor>& probs,
                                  double alpha, double limit, bool gelu_tanh, int64_t glu_block,
                                  const std::optional<at::Tensor>&) {
  if (activation.has_value()) {
    return grouped_gemm_fprop_of_activation(x, w, counts, bias, *activation, probs, alpha, limit, gelu_tanh,
                                            glu_block);
  }
  return grouped_gemm_fprop(x, w, counts, bias, std::nullopt);
}

// ---- GLU layout -------------------------------------------------------------------------------

at::Tensor fc1_glu_convert(const at::Tensor& src, int64_t from_block, int64_t to_block) {
  return guarded([&] {
    TORCH_CHECK_VALUE(src.dim() == 3 || src.dim() == 2,
                      "src: expected FC1 weights [E, 2F, H] or FC1 biases [E, 2F], got ", src.sizes());
    OpScope s(src);
    at::Tensor dst = at::empty(src.sizes(), src.options());
    if (src.dim() == 3) {
      gmoe::convert_fc1_glu(gmoe::ExpertWeights::from_stacked(view_of(src, "src")), glu_of(from_block),
                            gmoe::ExpertWeights::from_stacked(view_of(dst, "dst")), glu_of(to_block), s.stream());
    } else {
      gmoe::convert_fc1_glu(gmoe::ExpertBias::from_grouped(view_of(src, "src")), glu_of(from_block),
                            gmoe::ExpertBias::from_grouped(view_of(dst, "dst")), glu_of(to_block), s.stream());
    }
    return dst;
  });
}

// ---- FP8 -----------------------------------------------------------------------------------------
//
// An FP8 operand travels as its tensors (gmoe/fp8.h's Fp8Grouped / Fp8Weights fields): data,
// scale_inv, data_t, scale_inv_t (and padded_offsets for grouped rows). A copy that was not asked
// for is a [0] tensor of the dtype it would have had. The recipe is named by a string.

gmoe::Fp8Recipe recipe_of(const std::string& name) {
  if (name == "tensorwise") return gmoe::Fp8Recipe::tensorwise;
  if (name == "blockwise") return gmoe::Fp8Recipe::blockwise;
  if (name == "mxfp8") return gmoe::Fp8Recipe::mxfp8;
  TORCH_CHECK_VALUE(false, "recipe: expected 'tensorwise', 'blockwise' or 'mxfp8', got '", name, "'");
}

gmoe::DType format_of(const std::string& name) {
  if (name == "e4m3") return gmoe::DType::e4m3;
  if (name == "e5m2") return gmoe::DType::e5m2;
  TORCH_CHECK_VALUE(false, "format: expected 'e4m3' or 'e5m2', got '", name, "'");
}

/// A torch tensor for a layout view: allocated when the view is wanted, else a [0] tensor.
at::Tensor alloc_like_view(const gmoe::TensorView& v, gmoe::DType absent_dtype, const at::TensorOptions& o) {
  if (!v.defined()) return at::empty({0}, o.dtype(scalar_type_of(absent_dtype)));
  return at::empty(at::IntArrayRef(v.shape.data(), v.ndim), o.dtype(scalar_type_of(v.dtype)));
}

gmoe::TensorView view_if(const at::Tensor& t, bool wanted, const char* what) {
  return wanted ? view_of(t, what) : gmoe::TensorView();
}

gmoe::DType scale_dtype(gmoe::Fp8Recipe r) { return r == gmoe::Fp8Recipe::mxfp8 ? gmoe::DType::e8m0 : gmoe::DType::f32; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_grouped(
    const at::Tensor& x, const at::Tensor& counts, const std::string& recipe, const std::string& format,
    bool rowwise, bool columnwise, bool pow2_scales) {
  return guarded([&] {
    check_rows(x, "x");
    TORCH_CHECK_VALUE(counts.dim() == 1, "counts: expected a 1-D tensor [E], got ", counts.sizes());
    OpScope s(x);
    gmoe::Fp8QuantizeOptions o;
    o.recipe = recipe_of(recipe);
    o.format = format_of(format);
    o.rowwise = rowwise;
    o.columnwise = columnwise;
    o.pow2_scales = pow2_scales;
    const gmoe::Device dev = view_of(x, "x").device;
    gmoe::Fp8Grouped q = gmoe::fp8_grouped_layout(x.size(0), x.size(1), counts.size(0), o, dev);
    const auto opts = x.options();
    at::Tensor data = alloc_like_view(q.data, o.format, opts);
    at::Tensor scale = alloc_like_view(q.scale_inv, scale_dtype(o.recipe), opts);
    at::Tensor data_t = alloc_like_view(q.data_t, o.format, opts);
    at::Tensor scale_t = alloc_like_view(q.scale_inv_t, scale_dtype(o.recipe), opts);
    at::Tensor offsets = alloc_like_view(q.padded_offsets, gmoe::DType::i64, opts);
    q.data = view_if(data, rowwise, "data");
    q.scale_inv = view_if(scale, rowwise, "scale_inv");
    q.data_t = view_if(data_t, columnwise, "data_t");
    q.scale_inv_t = view_if(scale_t, columnwise, "scale_inv_t");
    q.padded_offsets = view_of(offsets, "padded_offsets");
    gmoe::quantize_grouped(gmoe::GroupedRows{view_of(x, "x"), view_of(counts, "counts")}, o, s.stream(), s.alloc(),
                           &q);
    return std::make_tuple(data, scale, data_t, scale_t, offsets);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_weights(at::TensorList w, const std::string& recipe,
                                                                            bool rowwise, bool columnwise,
                                                                            bool pow2_scales) {
  return guarded([&] {
    const gmoe::ExpertWeights wv = weights_of(w, "w");
    OpScope s(w[0]);
    gmoe::Fp8QuantizeOptions o;
    o.recipe = recipe_of(recipe);
    o.format = gmoe::DType::e4m3;
    o.rowwise = rowwise;
    o.columnwise = columnwise;
    o.pow2_scales = pow2_scales;
    gmoe::Fp8Weights q = gmoe::fp8_weights_layout(wv.num_experts(), wv.rows(), wv.cols(), o, wv.device());
    const auto opts = w[0].options();
    at::Tensor data = alloc_like_view(q.data, o.format, opts);
    at::Tensor scale = alloc_like_view(q.scale_inv, scale_dtype(o.recipe), opts);
    at::Tensor data_t = alloc_like_view(q.data_t, o.format, opts);
    at::Tensor scale_t = alloc_like_view(q.scale_inv_t, scale_dtype(o.recipe), opts);
    q.data = view_if(data, rowwise, "data");
    q.scale_inv = view_if(scale, rowwise, "scale_inv");
    q.data_t = view_if(data_t, columnwise, "data_t");
    q.scale_inv_t = view_if(scale_t, columnwise, "scale_inv_t");
    gmoe::quantize_weights(wv, o, s.stream(), s.alloc(), &q);
    return std::make_tuple(data, scale, data_t, scale_t);
  });
}

/// The rowwise copy of grouped rows from its tensors (data [capacity, cols]).
gmoe::Fp8Grouped fp8_rows(const at::Tensor& data, const at::Tensor& scale_inv, const std::string& recipe,
                          const char* what) {
  check_rows(data, what);
  gmoe::Fp8Grouped q;
  q.recipe = recipe_of(recipe);
  q.format = dtype_of(data.scalar_type(), what);
  q.capacity = data.size(0);
  q.cols = data.size(1);
  q.data = view_of(data, what);
  q.scale_inv = view_of(scale_inv, "scale_inv");
  return q;
}

/// The columnwise copy of grouped rows (data_t [cols, padded_capacity]) of `capacity` rows.
gmoe::Fp8Grouped fp8_cols(const at::Tensor& data_t, const at::Tensor& scale_inv_t, const at::Tensor& padded_offsets,
                          int64_t capacity, const std::string& recipe, const char* what) {
  check_rows(data_t, what);
  gmoe::Fp8Grouped q;
  q.recipe = recipe_of(recipe);
  q.format = dtype_of(data_t.scalar_type(), what);
  q.capacity = capacity;
  q.cols = data_t.size(0);
  q.padded_capacity = data_t.size(1);
  q.data_t = view_of(data_t, what);
  q.scale_inv_t = view_of(scale_inv_t, "scale_inv_t");
  q.padded_offsets = view_of(padded_offsets, "padded_offsets");
  return q;
}

/// Expert weights' copy: rowwise data [E, N, K], or (transposed) data_t [E, K, N].
gmoe::Fp8Weights fp8_weights(const at::Tensor& data, const at::Tensor& scale_inv, bool transposed,
                             const std::string& recipe, const char* what) {
  TORCH_CHECK_VALUE(data.dim() == 3, what, ": expected a 3-D tensor, got ", data.sizes());
  gmoe::Fp8Weights q;
  q.recipe = recipe_of(recipe);
  q.format = dtype_of(data.scalar_type(), what);
  q.experts = data.size(0);
  q.rows = transposed ? data.size(2) : data.size(1);
  q.cols = transposed ? data.size(1) : data.size(2);
  (transposed ? q.data_t : q.data) = view_of(data, what);
  (transposed ? q.scale_inv_t : q.scale_inv) = view_of(scale_inv, "scale_inv");
  return q;
}

/// FP8 GEMMs write bf16 on CUDA and f32 on the CPU unless told otherwise.
at::ScalarType fp8_out_dtype(const at::Tensor& t, std::optional<at::ScalarType> out_dtype) {
  return out_dtype.value_or(t.is_cuda() ? at::kBFloat16 : at::kFloat);
}

at::Tensor fp8_grouped_gemm_fprop(const at::Tensor& x_data, const at::Tensor& x_scale_inv, const at::Tensor& w_data,
                                  const at::Tensor& w_scale_inv, const at::Tensor& counts, const std::string& recipe,
                                  at::TensorList bias, bool fast_accumulation, std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    OpScope s(x_data);
    const gmoe::Fp8Grouped x = fp8_rows(x_data, x_scale_inv, recipe, "x_data");
    const gmoe::Fp8Weights w = fp8_weights(w_data, w_scale_inv, false, recipe, "w_data");
    at::Tensor y = at::empty({x.capacity, w.rows}, x_data.options().dtype(fp8_out_dtype(x_data, out_dtype)));
    gmoe::fp8_grouped_gemm_fprop(x, w, bias_of(bias, "bias"), view_of(counts, "counts"), view_of(y, "y"),
                                 gmoe::Fp8GemmOptions{fast_accumulation}, s.stream(), s.alloc());
    return y;
  });
}

at::Tensor fp8_grouped_gemm_dgrad(const at::Tensor& dy_data, const at::Tensor& dy_scale_inv,
                                  const at::Tensor& w_data_t, const at::Tensor& w_scale_inv_t,
                                  const at::Tensor& counts, const std::string& recipe, bool fast_accumulation,
                                  std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    OpScope s(dy_data);
    const gmoe::Fp8Grouped dy = fp8_rows(dy_data, dy_scale_inv, recipe, "dy_data");
    const gmoe::Fp8Weights w = fp8_weights(w_data_t, w_scale_inv_t, true, recipe, "w_data_t");
    at::Tensor dx = at::empty({dy.capacity, w.cols}, dy_data.options().dtype(fp8_out_dtype(dy_data, out_dtype)));
    gmoe::fp8_grouped_gemm_dgrad(dy, w, view_of(counts, "counts"), view_of(dx, "dx"),
                                 gmoe::Fp8GemmOptions{fast_accumulation}, s.stream(), s.alloc());
    return dx;
  });
}

void fp8_grouped_gemm_wgrad_(const at::Tensor& dy_data_t, const at::Tensor& dy_scale_inv_t,
                             const at::Tensor& x_data_t, const at::Tensor& x_scale_inv_t,
                             const at::Tensor& padded_offsets, const at::Tensor& counts, int64_t capacity,
                             const std::string& recipe, at::TensorList dw, bool accumulate,
                             const std::optional<at::Tensor>& expert_mask, const std::string& masked_off,
                             std::optional<at::TensorList> fresh_dw) {
  guarded([&] {
    OpScope s(dy_data_t);
    gmoe::fp8_grouped_gemm_wgrad(fp8_cols(dy_data_t, dy_scale_inv_t, padded_offsets, capacity, recipe, "dy_data_t"),
                                 fp8_cols(x_data_t, x_scale_inv_t, padded_offsets, capacity, recipe, "x_data_t"),
                                 view_of(counts, "counts"), weights_of(dw, "dw"),
                                 wgrad_options(accumulate, expert_mask, masked_off, fresh_dw), s.stream(), s.alloc());
    return 0;
  });
}

at::Tensor fp8_grouped_gemm_wgrad(const at::Tensor& dy_data_t, const at::Tensor& dy_scale_inv_t,
                                  const at::Tensor& x_data_t, const at::Tensor& x_scale_inv_t,
                                  const at::Tensor& padded_offsets, const at::Tensor& counts, int64_t capacity,
                                  const std::string& recipe, std::optional<at::ScalarType> out_dtype,
                                  const std::optional<at::Tensor>& expert_mask) {
  TORCH_CHECK_VALUE(counts.dim() == 1 && dy_data_t.dim() == 2 && x_data_t.dim() == 2,
                    "fp8_grouped_gemm_wgrad: expected counts [E], dy_data_t [N, padded], x_data_t [K, padded], got ",
                    counts.sizes(), ", ", dy_data_t.sizes(), ", ", x_data_t.sizes());
  at::Tensor dw = new_wgrad(counts, dy_data_t.size(0), x_data_t.size(0),
                            dy_data_t.options().dtype(out_dtype.value_or(at::kFloat)), expert_mask);
  fp8_grouped_gemm_wgrad_(dy_data_t, dy_scale_inv_t, x_data_t, x_scale_inv_t, padded_offsets, counts, capacity,
                          recipe, {dw}, false, expert_mask, "skip", std::nullopt);
  return dw;
}

at::Tensor dequantize_grouped(const at::Tensor& data, const at::Tensor& scale_inv, const at::Tensor& data_t,
                              const at::Tensor& scale_inv_t, const at::Tensor& padded_offsets,
                              const at::Tensor& counts, int64_t capacity, int64_t cols, const std::string& recipe,
                              bool columnwise, at::ScalarType out_dtype) {
  return guarded([&] {
    OpScope s(columnwise ? data_t : data);
    gmoe::Fp8Grouped q = columnwise ? fp8_cols(data_t, scale_inv_t, padded_offsets, capacity, recipe, "data_t")
                                    : fp8_rows(data, scale_inv, recipe, "data");
    TORCH_CHECK_VALUE(q.capacity == capacity && q.cols == cols, "dequantize_grouped: the copy is of [", q.capacity,
                      ", ", q.cols, "], expected [", capacity, ", ", cols, "]");
    at::Tensor out = at::empty({capacity, cols}, (columnwise ? data_t : data).options().dtype(out_dtype));
    gmoe::dequantize_grouped(q, view_of(counts, "counts"), view_of(out, "out"),
                             columnwise ? gmoe::Fp8Copy::columnwise : gmoe::Fp8Copy::rowwise, s.stream(), s.alloc());
    return out;
  });
}

at::Tensor dequantize_weights(const at::Tensor& data, const at::Tensor& scale_inv, bool transposed,
                              const std::string& recipe, at::ScalarType out_dtype) {
  return guarded([&] {
    OpScope s(data);
    const gmoe::Fp8Weights q = fp8_weights(data, scale_inv, transposed, recipe, transposed ? "data_t" : "data");
    at::Tensor out = at::empty({q.experts, q.rows, q.cols}, data.options().dtype(out_dtype));
    gmoe::dequantize_weights(q, gmoe::ExpertWeights::from_stacked(view_of(out, "out")),
                             transposed ? gmoe::Fp8Copy::columnwise : gmoe::Fp8Copy::rowwise, s.stream(), s.alloc());
    return out;
  });
}

// ---- device errors -------------------------------------------------------------------------------

/// gmoe::check_device_errors on the current stream of `anchor`'s device (a deliberate sync; a
/// no-op for CPU tensors, whose backend throws at once instead).
void check_device_errors(const at::Tensor& anchor) {
  guarded([&] {
    if (!anchor.is_cuda()) return 0;
    OpScope s(anchor);
    gmoe::check_device_errors(s.stream());
    return 0;
  });
}

void set_debug_sync(bool enabled) { gmoe::set_debug_sync(enabled); }

void register_impls(torch::Library& m) {
  m.impl("grouped_gemm_fprop", &grouped_gemm_fprop);
  m.impl("grouped_gemm_dgrad", &grouped_gemm_dgrad);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad);
  m.impl("grouped_gemm_wgrad_", &grouped_gemm_wgrad_);
  m.impl("grouped_bias_add", &grouped_bias_add);
  m.impl("grouped_bias_grad", &grouped_bias_grad);
  m.impl("grouped_activation_forward", &grouped_activation_forward);
  m.impl("grouped_activation_backward", &grouped_activation_backward);
  m.impl("grouped_gemm_fprop_of_activation", &grouped_gemm_fprop_of_activation);
  m.impl("grouped_linear_forward", &grouped_linear_forward);
  m.impl("fc1_glu_convert", &fc1_glu_convert);
  m.impl("quantize_grouped", &quantize_grouped);
  m.impl("quantize_weights", &quantize_weights);
  m.impl("fp8_grouped_gemm_fprop", &fp8_grouped_gemm_fprop);
  m.impl("fp8_grouped_gemm_dgrad", &fp8_grouped_gemm_dgrad);
  m.impl("fp8_grouped_gemm_wgrad", &fp8_grouped_gemm_wgrad);
  m.impl("fp8_grouped_gemm_wgrad_", &fp8_grouped_gemm_wgrad_);
  m.impl("dequantize_grouped", &dequantize_grouped);
  m.impl("dequantize_weights", &dequantize_weights);
  m.impl("check_device_errors", &check_device_errors);
}

}  // namespace
}  // namespace gmoe_torch

TORCH_LIBRARY(gmoe, m) {
  // The fake kernels live in this Python module: torch.compile imports it when it needs them.
  m.set_python_module("gmoe._meta");
  m.def("grouped_gemm_fprop(Tensor x, Tensor[] w, Tensor counts, Tensor[] bias, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_dgrad(Tensor dy, Tensor[] w, Tensor counts, ScalarType? out_dtype=None) -> Tensor");
  // The wgrad ops' expert_mask (int32 [E] on the inputs' device): experts with mask 0 are skipped
  // (zeros in a new output; left untouched in `dw`), or with masked_off="fresh" written into fresh_dw
  // (E x [N, K] of dw's dtype, disjoint from dw) instead of dw.
  m.def("grouped_gemm_wgrad(Tensor dy, Tensor x, Tensor counts, ScalarType? out_dtype=None, "
        "Tensor? expert_mask=None) -> Tensor");
  m.def("grouped_gemm_wgrad_(Tensor dy, Tensor x, Tensor counts, Tensor(a!)[] dw, bool accumulate=False, "
        "Tensor? expert_mask=None, str masked_off=\"skip\", Tensor(b!)[]? fresh_dw=None) -> ()");
  m.def("grouped_bias_add(Tensor y, Tensor[] bias, Tensor counts) -> Tensor");
  m.def("grouped_bias_grad(Tensor dy, Tensor counts, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_activation_forward(Tensor h, Tensor counts, str kind, Tensor? probs=None, float alpha=1.702, "
        "float limit=7.0, bool gelu_tanh=False, int glu_block=0) -> Tensor");
  m.def("grouped_activation_backward(Tensor h, Tensor dz, Tensor counts, str kind, Tensor? probs=None, "
        "bool need_dprobs=False, float alpha=1.702, float limit=7.0, bool gelu_tanh=False, int glu_block=0) "
        "-> (Tensor, Tensor)");
  m.def("grouped_gemm_fprop_of_activation(Tensor h, Tensor[] w, Tensor counts, Tensor[] bias, str kind, "
        "Tensor? probs=None, float alpha=1.702, float limit=7.0, bool gelu_tanh=False, int glu_block=0) -> Tensor");
  // GroupedLinear's forward whose backward sends the parameters' gradients to Megatron's main_grad
  // (added, or written over without accumulate) and gives autograd the placeholders instead (or
  // nothing), and with delay_wgrad leaves the weights' to the module's backward_dw. Lists empty:
  // autograd's gradients as grouped_gemm_fprop's. activation: x is h, the GEMM's input
  // act(h)·probs (grouped_gemm_fprop_of_activation). expert_mask: the weight gradient's (experts
  // with mask 0 skipped: main_grad untouched, zeros in a new gradient), read when it runs.
  m.def("grouped_linear_forward(Tensor x, Tensor[] w, Tensor counts, Tensor[] bias, Tensor[] w_main_grad, "
        "Tensor[] bias_main_grad, Tensor[] w_placeholder, Tensor[] bias_placeholder, bool accumulate=True, "
        "bool delay_wgrad=False, str? activation=None, Tensor? probs=None, float alpha=1.702, float limit=7.0, "
        "bool gelu_tanh=False, int glu_block=0, Tensor? expert_mask=None) -> Tensor");
  m.def("fc1_glu_convert(Tensor src, int from_block, int to_block) -> Tensor");
  m.def("quantize_grouped(Tensor x, Tensor counts, str recipe, str format=\"e4m3\", bool rowwise=True, "
        "bool columnwise=False, bool pow2_scales=False) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("quantize_weights(Tensor[] w, str recipe, bool rowwise=True, bool columnwise=True, bool pow2_scales=False) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("fp8_grouped_gemm_fprop(Tensor x_data, Tensor x_scale_inv, Tensor w_data, Tensor w_scale_inv, "
        "Tensor counts, str recipe, Tensor[] bias, bool fast_accumulation=False, ScalarType? out_dtype=None) "
        "-> Tensor");
  m.def("fp8_grouped_gemm_dgrad(Tensor dy_data, Tensor dy_scale_inv, Tensor w_data_t, Tensor w_scale_inv_t, "
        "Tensor counts, str recipe, bool fast_accumulation=False, ScalarType? out_dtype=None) -> Tensor");
  m.def("fp8_grouped_gemm_wgrad(Tensor dy_data_t, Tensor dy_scale_inv_t, Tensor x_data_t, Tensor x_scale_inv_t, "
        "Tensor padded_offsets, Tensor counts, int capacity, str recipe, ScalarType? out_dtype=None, "
        "Tensor? expert_mask=None) -> Tensor");
  m.def("fp8_grouped_gemm_wgrad_(Tensor dy_data_t, Tensor dy_scale_inv_t, Tensor x_data_t, Tensor x_scale_inv_t, "
        "Tensor padded_offsets, Tensor counts, int capacity, str recipe, Tensor(a!)[] dw, bool accumulate=False, "
        "Tensor? expert_mask=None, str masked_off=\"skip\", Tensor(b!)[]? fresh_dw=None) -> ()");
  m.def("dequantize_grouped(Tensor data, Tensor scale_inv, Tensor data_t, Tensor scale_inv_t, Tensor padded_offsets, "
        "Tensor counts, int capacity, int cols, str recipe, bool columnwise, ScalarType out_dtype) -> Tensor");
  m.def("dequantize_weights(Tensor data, Tensor scale_inv, bool transposed, str recipe, ScalarType out_dtype) "
        "-> Tensor");
  m.def("check_device_errors(Tensor anchor) -> ()");
  // No tensor argument to dispatch on: one kernel for every backend.
  m.def("set_debug_sync(bool enabled) -> ()", &gmoe_torch::set_debug_sync);
}

TORCH_LIBRARY_IMPL(gmoe, CPU, m) { gmoe_torch::register_impls(m); }
#ifdef GMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(gmoe, CUDA, m) { gmoe_torch::register_impls(m); }
#endif
