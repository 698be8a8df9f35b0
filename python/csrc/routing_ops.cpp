// python/csrc/routing_ops.cpp — gmoe's token-routing ops (gmoe/routing.h) in PyTorch's dispatcher,
// beside the expert ops of ops.cpp and with the same conventions: outputs allocated with torch on
// the inputs' device, the public gmoe op called on the current torch stream with scratch from
// torch's allocator, gmoe's errors as ValueError. Every output shape is known on the host (the
// permuted rows are permuted_rows(...), the largest padded total any routing can reach), so
// nothing here reads the device's counts and every op can be captured in a CUDA graph.
//
// Conventions of the schemas:
//   score            "softmax" or "sigmoid" (gmoe::RouterScore)
//   router_topk      returns (probs, ids, counts): the differentiable output first, as autograd
//                    tools (opcheck's AOT test) sum the outputs starting from the first
//   counts           int32 [E], tokens per expert (router_topk) or padded rows per expert (permute)
//   row_of, src_token  the RoutingMap: int32 [T, k] permuted row of each (token, slot), -1 where
//                    dropped; int32 [rows] token of each permuted row, -1 for padding
//   an optional output that was not asked for is a [0] tensor of its dtype
#include <torch/library.h>

#include <string>
#include <tuple>
#include <vector>

#include "gmoe/routing.h"
#include "torch_bridge.h"

namespace gmoe_torch {
namespace {

gmoe::RouterScore score_of(const std::string& name) {
  if (name == "softmax") return gmoe::RouterScore::softmax;
  if (name == "sigmoid") return gmoe::RouterScore::sigmoid;
  TORCH_CHECK_VALUE(false, "score: expected 'softmax' or 'sigmoid', got '", name, "'");
}

gmoe::RouterOptions router_options(int64_t top_k, const std::string& score, bool normalize, int64_t n_group,
                                   int64_t topk_group, double scaling_factor) {
  gmoe::RouterOptions o;
  o.top_k = top_k;
  o.score = score_of(score);
  o.normalize = normalize;
  o.n_group = n_group;
  o.topk_group = topk_group;
  o.scaling_factor = static_cast<float>(scaling_factor);
  return o;
}

void check_2d(const at::Tensor& t, const char* what, const char* expected) {
  TORCH_CHECK_VALUE(t.dim() == 2, what, ": expected a 2-D tensor ", expected, ", got ", t.sizes());
}

gmoe::RoutingMap map_of(const at::Tensor& row_of, const at::Tensor& src_token) {
  return gmoe::RoutingMap{view_of(row_of, "row_of"), view_of(src_token, "src_token")};
}

/// The gradient of the logits: logits' dtype unless asked otherwise (float32 always works).
at::Tensor empty_dlogits(const at::Tensor& logits, std::optional<at::ScalarType> out_dtype) {
  return at::empty(logits.sizes(), logits.options().dtype(out_dtype.value_or(logits.scalar_type())));
}

// ---- router -------------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_topk(const at::Tensor& logits, int64_t top_k,
                                                           const std::string& score, bool normalize, int64_t n_group,
                                                           int64_t topk_group, double scaling_factor,
                                                           const std::optional<at::Tensor>& score_bias) {
  return guarded([&] {
    check_2d(logits, "logits", "[tokens, E]");
    TORCH_CHECK_VALUE(top_k >= 1 && top_k <= logits.size(1), "top_k: expected 1..E = 1..", logits.size(1), ", got ",
                      top_k);
    OpScope s(logits);
    const gmoe::RouterOptions o = router_options(top_k, score, normalize, n_group, topk_group, scaling_factor);
    const int64_t T = logits.size(0), E = logits.size(1);
    at::Tensor ids = at::empty({T, top_k}, logits.options().dtype(at::kInt));
    at::Tensor probs = at::empty({T, top_k}, logits.options().dtype(at::kFloat));
    at::Tensor counts = at::empty({E}, logits.options().dtype(at::kInt));
    gmoe::router_topk(view_of(logits, "logits"), o, view_of(ids, "ids"), view_of(probs, "probs"),
                      view_of(counts, "counts"), view_of(score_bias, "score_bias"), s.stream(), s.alloc());
    return std::make_tuple(probs, ids, counts);
  });
}

at::Tensor router_topk_backward(const at::Tensor& logits, const at::Tensor& ids, const at::Tensor& dprobs,
                                const std::string& score, bool normalize, double scaling_factor,
                                std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    check_2d(logits, "logits", "[tokens, E]");
    check_2d(ids, "ids", "[tokens, k]");
    OpScope s(logits);
    const gmoe::RouterOptions o = router_options(ids.size(1), score, normalize, 1, 1, scaling_factor);
    at::Tensor dlogits = empty_dlogits(logits, out_dtype);
    gmoe::router_topk_backward(view_of(logits, "logits"), view_of(ids, "ids"), view_of(dprobs, "dprobs"), o,
                               view_of(dlogits, "dlogits"), false, s.stream(), s.alloc());
    return dlogits;
  });
}

at::Tensor router_aux_loss(const at::Tensor& logits, const at::Tensor& counts, int64_t top_k,
                           const std::string& score, double coeff) {
  return guarded([&] {
    OpScope s(logits);
    at::Tensor loss = at::empty({1}, logits.options().dtype(at::kFloat));
    gmoe::router_aux_loss(view_of(logits, "logits"), view_of(counts, "counts"),
                          router_options(top_k, score, false, 1, 1, 1.0), static_cast<float>(coeff),
                          view_of(loss, "loss"), s.stream(), s.alloc());
    return loss;
  });
}

at::Tensor router_aux_loss_backward(const at::Tensor& logits, const at::Tensor& counts, const at::Tensor& dloss,
                                    int64_t top_k, const std::string& score, double coeff,
                                    std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    OpScope s(logits);
    at::Tensor dlogits = empty_dlogits(logits, out_dtype);
    gmoe::router_aux_loss_backward(view_of(logits, "logits"), view_of(counts, "counts"),
                                   router_options(top_k, score, false, 1, 1, 1.0), static_cast<float>(coeff),
                                   view_of(dloss, "dloss"), view_of(dlogits, "dlogits"), false, s.stream(),
                                   s.alloc());
    return dlogits;
  });
}

at::Tensor router_z_loss(const at::Tensor& logits, double coeff) {
  return guarded([&] {
    OpScope s(logits);
    at::Tensor loss = at::empty({1}, logits.options().dtype(at::kFloat));
    gmoe::router_z_loss(view_of(logits, "logits"), static_cast<float>(coeff), view_of(loss, "loss"), s.stream(),
                        s.alloc());
    return loss;
  });
}

at::Tensor router_z_loss_backward(const at::Tensor& logits, const at::Tensor& dloss, double coeff,
                                  std::optional<at::ScalarType> out_dtype) {
  return guarded([&] {
    OpScope s(logits);
    at::Tensor dlogits = empty_dlogits(logits, out_dtype);
    gmoe::router_z_loss_backward(view_of(logits, "logits"), static_cast<float>(coeff), view_of(dloss, "dloss"),
                                 view_of(dlogits, "dlogits"), false, s.stream(), s.alloc());
    return dlogits;
  });
}

// ---- permute / combine ----------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute(
    const at::Tensor& x, const at::Tensor& ids, int64_t num_experts, int64_t pad_multiple, double capacity_factor,
    const std::optional<at::Tensor>& probs) {
  return guarded([&] {
    check_2d(x, "x", "[tokens, H]");
    check_2d(ids, "ids", "[tokens, k]");
    TORCH_CHECK_VALUE(num_experts >= 1, "num_experts: expected >= 1, got ", num_experts);
    TORCH_CHECK_VALUE(ids.size(0) == x.size(0), "ids: expected ", x.size(0), " rows (x's tokens), got ", ids.sizes());
    OpScope s(x);
    gmoe::PermuteOptions o;
    o.pad_multiple = pad_multiple;
    o.capacity_factor = capacity_factor;
    const int64_t T = x.size(0), k = ids.size(1);
    const int64_t rows = gmoe::permuted_rows(T, k, num_experts, o);
    const auto i32 = x.options().dtype(at::kInt);
    at::Tensor permuted = at::empty({rows, x.size(1)}, x.options());
    at::Tensor counts = at::empty({num_experts}, i32);
    at::Tensor row_of = at::empty({T, k}, i32);
    at::Tensor src_token = at::empty({rows}, i32);
    at::Tensor permuted_probs = at::empty({probs.has_value() ? rows : 0}, x.options().dtype(at::kFloat));
    at::Tensor dropped = at::empty({1}, i32);
    gmoe::permute(view_of(x, "x"), view_of(ids, "ids"), o, view_of(permuted, "permuted"), view_of(counts, "counts"),
                  map_of(row_of, src_token), view_of(probs, "probs"),
                  probs.has_value() ? view_of(permuted_probs, "permuted_probs") : gmoe::TensorView(),
                  view_of(dropped, "dropped"), s.stream(), s.alloc());
    return std::make_tuple(permuted, counts, row_of, src_token, permuted_probs, dropped);
  });
}

std::tuple<at::Tensor, at::Tensor> permute_backward(const at::Tensor& dpermuted, const at::Tensor& row_of,
                                                    const at::Tensor& src_token,
                                                    const std::optional<at::Tensor>& dpermuted_probs) {
  return guarded([&] {
    check_2d(dpermuted, "dpermuted", "[rows, H]");
    check_2d(row_of, "row_of", "[tokens, k]");
    OpScope s(dpermuted);
    at::Tensor dx = at::empty({row_of.size(0), dpermuted.size(1)}, dpermuted.options());
    const bool with_probs = dpermuted_probs.has_value();
    at::Tensor dprobs = at::empty(with_probs ? row_of.sizes().vec() : std::vector<int64_t>{0},
                                  dpermuted.options().dtype(at::kFloat));
    gmoe::permute_backward(view_of(dpermuted, "dpermuted"), map_of(row_of, src_token), view_of(dx, "dx"),
                           view_of(dpermuted_probs, "dpermuted_probs"),
                           with_probs ? view_of(dprobs, "dprobs") : gmoe::TensorView(), s.stream(), s.alloc());
    return std::make_tuple(dx, dprobs);
  });
}

at::Tensor combine(const at::Tensor& expert_out, const at::Tensor& row_of, const at::Tensor& src_token,
                   const std::optional<at::Tensor>& probs) {
  return guarded([&] {
    check_2d(expert_out, "expert_out", "[rows, H]");
    check_2d(row_of, "row_of", "[tokens, k]");
    OpScope s(expert_out);
    at::Tensor out = at::empty({row_of.size(0), expert_out.size(1)}, expert_out.options());
    gmoe::combine(view_of(expert_out, "expert_out"), map_of(row_of, src_token), view_of(probs, "probs"),
                  view_of(out, "out"), s.stream(), s.alloc());
    return out;
  });
}

std::tuple<at::Tensor, at::Tensor> combine_backward(const at::Tensor& dout, const at::Tensor& row_of,
                                                    const at::Tensor& src_token,
                                                    const std::optional<at::Tensor>& probs,
                                                    const std::optional<at::Tensor>& expert_out, bool need_dprobs) {
  return guarded([&] {
    check_2d(dout, "dout", "[tokens, H]");
    check_2d(row_of, "row_of", "[tokens, k]");
    TORCH_CHECK_VALUE(src_token.dim() == 1, "src_token: expected a 1-D tensor [rows], got ", src_token.sizes());
    TORCH_CHECK_VALUE(!need_dprobs || expert_out.has_value(), "expert_out: needed for dprobs (need_dprobs), absent");
    OpScope s(dout);
    at::Tensor dexpert_out = at::empty({src_token.size(0), dout.size(1)}, dout.options());
    at::Tensor dprobs = at::empty(need_dprobs ? row_of.sizes().vec() : std::vector<int64_t>{0},
                                  dout.options().dtype(at::kFloat));
    gmoe::combine_backward(view_of(dout, "dout"), map_of(row_of, src_token), view_of(probs, "probs"),
                           view_of(expert_out, "expert_out"), view_of(dexpert_out, "dexpert_out"),
                           need_dprobs ? view_of(dprobs, "dprobs") : gmoe::TensorView(), s.stream(), s.alloc());
    return std::make_tuple(dexpert_out, dprobs);
  });
}

/// gmoe::permuted_rows for the fake kernels' tests and for callers sizing buffers (host math only).
int64_t permuted_rows(int64_t tokens, int64_t top_k, int64_t num_experts, int64_t pad_multiple,
                      double capacity_factor) {
  return guarded([&] {
    gmoe::PermuteOptions o;
    o.pad_multiple = pad_multiple;
    o.capacity_factor = capacity_factor;
    return gmoe::permuted_rows(tokens, top_k, num_experts, o);
  });
}

void register_routing_impls(torch::Library& m) {
  m.impl("router_topk", &router_topk);
  m.impl("router_topk_backward", &router_topk_backward);
  m.impl("router_aux_loss", &router_aux_loss);
  m.impl("router_aux_loss_backward", &router_aux_loss_backward);
  m.impl("router_z_loss", &router_z_loss);
  m.impl("router_z_loss_backward", &router_z_loss_backward);
  m.impl("permute", &permute);
  m.impl("permute_backward", &permute_backward);
  m.impl("combine", &combine);
  m.impl("combine_backward", &combine_backward);
}

}  // namespace
}  // namespace gmoe_torch

TORCH_LIBRARY_FRAGMENT(gmoe, m) {
  m.def("router_topk(Tensor logits, int top_k, str score=\"softmax\", bool normalize=False, int n_group=1, "
        "int topk_group=1, float scaling_factor=1.0, Tensor? score_bias=None) -> (Tensor probs, Tensor ids, Tensor counts)");
  m.def("router_topk_backward(Tensor logits, Tensor ids, Tensor dprobs, str score=\"softmax\", bool normalize=False, "
        "float scaling_factor=1.0, ScalarType? out_dtype=None) -> Tensor");
  m.def("router_aux_loss(Tensor logits, Tensor counts, int top_k, str score=\"softmax\", float coeff=1.0) -> Tensor");
  m.def("router_aux_loss_backward(Tensor logits, Tensor counts, Tensor dloss, int top_k, str score=\"softmax\", "
        "float coeff=1.0, ScalarType? out_dtype=None) -> Tensor");
  m.def("router_z_loss(Tensor logits, float coeff=1.0) -> Tensor");
  m.def("router_z_loss_backward(Tensor logits, Tensor dloss, float coeff=1.0, ScalarType? out_dtype=None) -> Tensor");
  m.def("permute(Tensor x, Tensor ids, int num_experts, int pad_multiple=1, float capacity_factor=0.0, "
        "Tensor? probs=None) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("permute_backward(Tensor dpermuted, Tensor row_of, Tensor src_token, Tensor? dpermuted_probs=None) "
        "-> (Tensor, Tensor)");
  m.def("combine(Tensor expert_out, Tensor row_of, Tensor src_token, Tensor? probs=None) -> Tensor");
  m.def("combine_backward(Tensor dout, Tensor row_of, Tensor src_token, Tensor? probs=None, Tensor? expert_out=None, "
        "bool need_dprobs=False) -> (Tensor, Tensor)");
  // Host arithmetic only: one kernel for every backend.
  m.def("permuted_rows(int tokens, int top_k, int num_experts, int pad_multiple=1, float capacity_factor=0.0) -> int",
        &gmoe_torch::permuted_rows);
}

TORCH_LIBRARY_IMPL(gmoe, CPU, m) { gmoe_torch::register_routing_impls(m); }
#ifdef GMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(gmoe, CUDA, m) { gmoe_torch::register_routing_impls(m); }
#endif
