// python/csrc/ops.cpp — gmoe's ops in PyTorch's dispatcher, namespace `gmoe` (torch.ops.gmoe.*).
//
// Each op allocates its outputs with torch (on the inputs' device), then calls the public gmoe op
// on the current torch stream with gmoe's scratch from torch's allocator. The same kernel function
// is registered for CPU (gmoe's CPU reference backend) and, where built, CUDA: gmoe dispatches on the
// tensors' device itself. gmoe checks every argument before writing anything; its errors come out as
// ValueError with gmoe's message. The fake (meta) kernels for torch.compile and the autograd formulas
// are registered in Python (gmoe/_meta.py, gmoe/_autograd.py), where symbolic shapes are natural.
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
                              std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    check_rows(dy, "dy");
    check_rows(x, "x");
    TORCH_CHECK_VALUE(counts.dim() == 1, "counts: expected a 1-D tensor [E], got ", counts.sizes());
    OpScope s(dy);
    at::Tensor dw = at::empty({counts.size(0), dy.size(1), x.size(1)},
                              dy.options().dtype(out_dtype.value_or(dy.scalar_type())));
    gmoe::grouped_gemm_wgrad(view_of(dy, "dy"), view_of(x, "x"), view_of(counts, "counts"),
                             gmoe::ExpertWeights::from_stacked(view_of(dw, "dw")), {}, s.stream(), s.alloc());
    return dw;
  });
}

void grouped_gemm_wgrad_(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& counts, at::TensorList dw,
                         bool accumulate, const std::optional<at::Tensor>& expert_mask) {
  guarded([&] {
    OpScope s(dy);
    gmoe::WgradOptions o;
    o.accumulate = accumulate;
    o.expert_mask = view_of(expert_mask, "expert_mask");
    gmoe::grouped_gemm_wgrad(view_of(dy, "dy"), view_of(x, "x"), view_of(counts, "counts"), weights_of(dw, "dw"),
                             o, s.stream(), s.alloc());
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

void register_impls(torch::Library& m) {
  m.impl("grouped_gemm_fprop", &grouped_gemm_fprop);
  m.impl("grouped_gemm_dgrad", &grouped_gemm_dgrad);
  m.impl("grouped_gemm_wgrad", &grouped_gemm_wgrad);
  m.impl("grouped_gemm_wgrad_", &grouped_gemm_wgrad_);
  m.impl("grouped_bias_add", &grouped_bias_add);
  m.impl("grouped_bias_grad", &grouped_bias_grad);
  m.impl("grouped_activation_forward", &grouped_activation_forward);
  m.impl("grouped_activation_backward", &grouped_activation_backward);
  m.impl("fc1_glu_convert", &fc1_glu_convert);
}

}  // namespace
}  // namespace gmoe_torch

TORCH_LIBRARY(gmoe, m) {
  // The fake kernels live in this Python module: torch.compile imports it when it needs them.
  m.set_python_module("gmoe._meta");
  m.def("grouped_gemm_fprop(Tensor x, Tensor[] w, Tensor counts, Tensor[] bias, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_dgrad(Tensor dy, Tensor[] w, Tensor counts, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_wgrad(Tensor dy, Tensor x, Tensor counts, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_gemm_wgrad_(Tensor dy, Tensor x, Tensor counts, Tensor(a!)[] dw, bool accumulate=False, "
        "Tensor? expert_mask=None) -> ()");
  m.def("grouped_bias_add(Tensor y, Tensor[] bias, Tensor counts) -> Tensor");
  m.def("grouped_bias_grad(Tensor dy, Tensor counts, ScalarType? out_dtype=None) -> Tensor");
  m.def("grouped_activation_forward(Tensor h, Tensor counts, str kind, Tensor? probs=None, float alpha=1.702, "
        "float limit=7.0, bool gelu_tanh=False, int glu_block=0) -> Tensor");
  m.def("grouped_activation_backward(Tensor h, Tensor dz, Tensor counts, str kind, Tensor? probs=None, "
        "bool need_dprobs=False, float alpha=1.702, float limit=7.0, bool gelu_tanh=False, int glu_block=0) "
        "-> (Tensor, Tensor)");
  m.def("fc1_glu_convert(Tensor src, int from_block, int to_block) -> Tensor");
}

TORCH_LIBRARY_IMPL(gmoe, CPU, m) { gmoe_torch::register_impls(m); }
#ifdef GMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(gmoe, CUDA, m) { gmoe_torch::register_impls(m); }
#endif
