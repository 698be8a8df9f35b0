// src/common/routing.cpp — the public routing ops (gmoe/routing.h): every host-visible property of
// the arguments checked at the edge, then dispatch to the backend of the tensors' device.
#include "gmoe/routing.h"

#include <cmath>
#include <initializer_list>
#include <limits>

#include "common/activation_internal.h"
#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe {
namespace {

constexpr int64_t kMaxI32 = std::numeric_limits<int32_t>::max();

// A contiguous tensor of exactly `shape`, one of `dtypes`, on `device`, data present unless empty.
void check_tensor(const TensorView& t, const char* name, std::initializer_list<int64_t> shape,
                  std::initializer_list<DType> dtypes, Device device) {
  std::string want = "[";
  for (int64_t s : shape) want += (want.size() > 1 ? ", " : "") + std::to_string(s);
  want += "]";
  GMOE_CHECK(t.defined(), name, ": absent, expected ", want);
  bool shape_ok = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) shape_ok = shape_ok && t.size(d++) == s;
  GMOE_CHECK(shape_ok, name, ": expected shape ", want, ", got ", t.shape_str());
  bool dtype_ok = false;
  std::string names;
  for (DType dt : dtypes) {
    dtype_ok = dtype_ok || t.dtype == dt;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(dt));
  }
  GMOE_CHECK(dtype_ok, name, ": expected dtype ", names, ", got ", dtype_name(t.dtype));
  GMOE_CHECK(t.is_contiguous(), name, ": must be contiguous, got ", t.str());
  GMOE_CHECK(t.data != nullptr || t.numel() == 0, name, ": null data for ", t.shape_str());
  check_same_device(t.device, device, name);
}

void check_logits(const TensorView& logits) {
  GMOE_CHECK(logits.defined() && logits.ndim == 2, "logits: expected [tokens, E], got ", logits.str());
  GMOE_CHECK(logits.size(1) >= 1, "logits: needs at least one expert, got ", logits.shape_str());
  check_tensor(logits, "logits", {logits.size(0), logits.size(1)}, {DType::f32, DType::bf16, DType::f16},
               logits.device);
}

void check_options(const RouterOptions& o, int64_t E) {
  GMOE_CHECK(o.top_k >= 1 && o.top_k <= E, "options.top_k: expected 1..E = 1..", E, ", got ", o.top_k);
  GMOE_CHECK(o.score == RouterScore::softmax || o.score == RouterScore::sigmoid, "options.score: unknown RouterScore ",
             static_cast<int>(o.score));
  GMOE_CHECK(o.n_group >= 1 && E % o.n_group == 0, "options.n_group: must be >= 1 and divide E = ", E, ", got ",
             o.n_group);
  if (o.n_group > 1) {
    GMOE_CHECK(o.topk_group >= 1 && o.topk_group <= o.n_group, "options.topk_group: expected 1..n_group = 1..",
               o.n_group, ", got ", o.topk_group);
    GMOE_CHECK(o.topk_group * (E / o.n_group) >= o.top_k, "options.topk_group: ", o.topk_group, " groups of ",
               E / o.n_group, " experts hold fewer than top_k = ", o.top_k);
  }
  GMOE_CHECK(std::isfinite(o.scaling_factor), "options.scaling_factor: must be finite, got ", o.scaling_factor);
}

void check_dlogits(const TensorView& dlogits, const TensorView& logits) {
  check_tensor(dlogits, "dlogits", {logits.size(0), logits.size(1)}, {logits.dtype, DType::f32}, logits.device);
  check_disjoint(dlogits, "dlogits", logits, "logits");
}

void check_loss(const TensorView& loss, const char* name, Device device) {
  check_tensor(loss, name, {1}, {DType::f32}, device);
}

void check_expert_counts(const TensorView& counts, const char* name, int64_t E, Device device) {
  check_counts(counts, name, device);
  GMOE_CHECK(counts.size(0) == E, name, ": expected ", E, " experts, got length ", counts.size(0));
}

// Rows (bf16/f16/f32, contiguous rows) of `cols` columns.
void check_hidden(const TensorView& t, const char* name, int64_t rows, int64_t cols, DType dtype, Device device) {
  check_rows(t, name);
  GMOE_CHECK(t.size(0) == rows && t.size(1) == cols, name, ": expected [", rows, ", ", cols, "], got ", t.shape_str());
  GMOE_CHECK(t.dtype == dtype, name, ": expected dtype ", dtype_name(dtype), ", got ", dtype_name(t.dtype));
  check_same_device(t.device, device, name);
}

// The map of T tokens with k slots over `rows` permuted rows.
void check_map(const RoutingMap& map, int64_t T, int64_t k, int64_t rows, Device device) {
  check_tensor(map.row_of, "map.row_of", {T, k}, {DType::i32}, device);
  check_tensor(map.src_token, "map.src_token", {rows}, {DType::i32}, device);
  GMOE_CHECK(rows <= kMaxI32, "map.src_token: at most 2^31 - 1 permuted rows, got ", rows);
}

// Runs the op on the tensors' backend (CUDA only when compiled), then the debug mode's check.
template <typename Cpu, typename Cuda>
void run_on(Device device, const char* op, Stream stream, Cpu&& cpu, Cuda&& cuda) {
  if (device.is_cpu()) {
    cpu();
  } else {
    check_cuda_compiled(op);
    cuda();
  }
  if (device.is_cuda() && debug_sync_enabled()) check_device_errors(stream);
}

}  // namespace

void router_topk(const TensorView& logits, const RouterOptions& options, const TensorView& ids, const TensorView& probs,
                 const TensorView& counts, const TensorView& score_bias, Stream stream, Allocator* alloc) {
  check_logits(logits);
  const int64_t T = logits.size(0), E = logits.size(1);
  check_options(options, E);
  const Device dev = logits.device;
  check_tensor(ids, "ids", {T, options.top_k}, {DType::i32}, dev);
  check_tensor(probs, "probs", {T, options.top_k}, {DType::f32}, dev);
  check_expert_counts(counts, "counts", E, dev);
  if (score_bias.defined()) check_tensor(score_bias, "score_bias", {E}, {DType::f32}, dev);
  check_disjoint(ids, "ids", probs, "probs");
  check_disjoint(ids, "ids", counts, "counts");
  check_disjoint(probs, "probs", counts, "counts");
  run_on(
      dev, "router_topk", stream, [&] { cpu_backend::router_topk(logits, options, ids, probs, counts, score_bias); },
      [&] {
        cuda_backend::router_topk(logits, options, ids, probs, counts, score_bias, stream, pick_allocator(alloc, dev));
      });
}

void router_topk_backward(const TensorView& logits, const TensorView& ids, const TensorView& dprobs,
                          const RouterOptions& options, const TensorView& dlogits, bool accumulate, Stream stream,
                          Allocator* alloc) {
  check_logits(logits);
  const int64_t T = logits.size(0), E = logits.size(1);
  check_options(options, E);
  const Device dev = logits.device;
  check_tensor(ids, "ids", {T, options.top_k}, {DType::i32}, dev);
  check_tensor(dprobs, "dprobs", {T, options.top_k}, {DType::f32}, dev);
  check_dlogits(dlogits, logits);
  check_disjoint(dlogits, "dlogits", dprobs, "dprobs");
  check_disjoint(dlogits, "dlogits", ids, "ids");
  run_on(
      dev, "router_topk_backward", stream,
      [&] { cpu_backend::router_topk_backward(logits, ids, dprobs, options, dlogits, accumulate); },
      [&] {
        cuda_backend::router_topk_backward(logits, ids, dprobs, options, dlogits, accumulate, stream,
                                           pick_allocator(alloc, dev));
      });
}

void router_aux_loss(const TensorView& logits, const TensorView& counts, const RouterOptions& options, float coeff,
                     const TensorView& loss, Stream stream, Allocator* alloc) {
  check_logits(logits);
  check_options(options, logits.size(1));
  const Device dev = logits.device;
  check_expert_counts(counts, "counts", logits.size(1), dev);
  check_loss(loss, "loss", dev);
  run_on(
      dev, "router_aux_loss", stream, [&] { cpu_backend::router_aux_loss(logits, counts, options, coeff, loss); },
      [&] { cuda_backend::router_aux_loss(logits, counts, options, coeff, loss, stream, pick_allocator(alloc, dev)); });
}

void router_aux_loss_backward(const TensorView& logits, const TensorView& counts, const RouterOptions& options,
                              float coeff, const TensorView& dloss, const TensorView& dlogits, bool accumulate,
                              Stream stream, Allocator* alloc) {
  check_logits(logits);
  check_options(options, logits.size(1));
  const Device dev = logits.device;
  check_expert_counts(counts, "counts", logits.size(1), dev);
  if (dloss.defined()) check_loss(dloss, "dloss", dev);
  check_dlogits(dlogits, logits);
  run_on(
      dev, "router_aux_loss_backward", stream,
      [&] { cpu_backend::router_aux_loss_backward(logits, counts, options, coeff, dloss, dlogits, accumulate); },
      [&] {
        cuda_backend::router_aux_loss_backward(logits, counts, options, coeff, dloss, dlogits, accumulate, stream,
                                               pick_allocator(alloc, dev));
      });
}

void router_z_loss(const TensorView& logits, float coeff, const TensorView& loss, Stream stream, Allocator* alloc) {
  check_logits(logits);
  const Device dev = logits.device;
  check_loss(loss, "loss", dev);
  run_on(
      dev, "router_z_loss", stream, [&] { cpu_backend::router_z_loss(logits, coeff, loss); },
      [&] { cuda_backend::router_z_loss(logits, coeff, loss, stream, pick_allocator(alloc, dev)); });
}

void router_z_loss_backward(const TensorView& logits, float coeff, const TensorView& dloss, const TensorView& dlogits,
                            bool accumulate, Stream stream, Allocator* alloc) {
  check_logits(logits);
  const Device dev = logits.device;
  if (dloss.defined()) check_loss(dloss, "dloss", dev);
  check_dlogits(dlogits, logits);
  run_on(
      dev, "router_z_loss_backward", stream,
      [&] { cpu_backend::router_z_loss_backward(logits, coeff, dloss, dlogits, accumulate); },
      [&] {
        cuda_backend::router_z_loss_backward(logits, coeff, dloss, dlogits, accumulate, stream,
                                             pick_allocator(alloc, dev));
      });
}

int64_t expert_capacity(int64_t tokens, int64_t top_k, int64_t num_experts, const PermuteOptions& options) {
  GMOE_CHECK(tokens >= 0 && top_k >= 1 && num_experts >= 1, "expert_capacity: tokens ", tokens, ", top_k ", top_k,
             ", experts ", num_experts, " (expected >= 0, >= 1, >= 1)");
  GMOE_CHECK(std::isfinite(options.capacity_factor) && options.capacity_factor >= 0,
             "options.capacity_factor: expected a finite value >= 0, got ", options.capacity_factor);
  if (options.capacity_factor == 0) return -1;
  const double c = std::ceil(options.capacity_factor * static_cast<double>(tokens) * static_cast<double>(top_k) /
                             static_cast<double>(num_experts));
  return static_cast<int64_t>(std::min(c, static_cast<double>(tokens * top_k)));
}

int64_t permuted_rows(int64_t tokens, int64_t top_k, int64_t num_experts, const PermuteOptions& options) {
  GMOE_CHECK(options.pad_multiple >= 1, "options.pad_multiple: expected >= 1, got ", options.pad_multiple);
  const int64_t cap = expert_capacity(tokens, top_k, num_experts, options);
  const int64_t kept = cap < 0 ? tokens * top_k : std::min(tokens * top_k, num_experts * cap);
  return kept + num_experts * (options.pad_multiple - 1);
}

void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs, const TensorView& permuted_probs,
             const TensorView& dropped, Stream stream, Allocator* alloc) {
  check_rows(x, "x");
  check_input_dtype(x.dtype, "x");
  const Device dev = x.device;
  const int64_t T = x.size(0), H = x.size(1);
  GMOE_CHECK(ids.defined() && ids.ndim == 2 && ids.size(1) >= 1, "ids: expected [tokens, k], got ", ids.str());
  const int64_t k = ids.size(1);
  check_tensor(ids, "ids", {T, k}, {DType::i32}, dev);
  check_counts(counts, "counts", dev);
  const int64_t E = counts.size(0);
  const int64_t rows = permuted_rows(T, k, E, options);
  GMOE_CHECK(permuted.defined() && permuted.ndim == 2, "permuted: expected [rows, H], got ", permuted.str());
  GMOE_CHECK(permuted.size(0) >= rows, "permuted: needs at least permuted_rows(", T, ", ", k, ", ", E,
             ", options) = ", rows, " rows, got ", permuted.shape_str());
  GMOE_CHECK(T * k <= kMaxI32, "ids: at most 2^31 - 1 (token, slot) pairs, got ", T, " x ", k);
  check_hidden(permuted, "permuted", permuted.size(0), H, x.dtype, dev);
  check_map(map, T, k, permuted.size(0), dev);
  GMOE_CHECK(probs.defined() == permuted_probs.defined(), "probs and permuted_probs: give both or neither (probs ",
             probs.defined() ? "given" : "absent", ", permuted_probs ", permuted_probs.defined() ? "given" : "absent",
             ")");
  if (probs.defined()) {
    check_tensor(probs, "probs", {T, k}, {DType::f32}, dev);
    check_tensor(permuted_probs, "permuted_probs", {permuted.size(0)}, {DType::f32}, dev);
  }
  if (dropped.defined()) check_tensor(dropped, "dropped", {1}, {DType::i32, DType::i64}, dev);
  check_disjoint(permuted, "permuted", x, "x");
  check_disjoint(map.row_of, "map.row_of", map.src_token, "map.src_token");
  check_disjoint(map.row_of, "map.row_of", ids, "ids");
  run_on(
      dev, "permute", stream,
      [&] { cpu_backend::permute(x, ids, options, permuted, counts, map, probs, permuted_probs, dropped); },
      [&] {
        cuda_backend::permute(x, ids, options, permuted, counts, map, probs, permuted_probs, dropped, stream,
                              pick_allocator(alloc, dev));
      });
}

void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs, const TensorView& dprobs, Stream stream, Allocator* alloc) {
  check_rows(dpermuted, "dpermuted");
  check_input_dtype(dpermuted.dtype, "dpermuted");
  const Device dev = dpermuted.device;
  GMOE_CHECK(map.row_of.defined() && map.row_of.ndim == 2, "map.row_of: expected [tokens, k], got ", map.row_of.str());
  const int64_t T = map.row_of.size(0), k = map.row_of.size(1), rows = dpermuted.size(0);
  check_map(map, T, k, rows, dev);
  check_hidden(dx, "dx", T, dpermuted.size(1), dpermuted.dtype, dev);
  check_disjoint(dx, "dx", dpermuted, "dpermuted");
  GMOE_CHECK(dpermuted_probs.defined() == dprobs.defined(), "dpermuted_probs and dprobs: give both or neither");
  if (dprobs.defined()) {
    check_tensor(dpermuted_probs, "dpermuted_probs", {rows}, {DType::f32}, dev);
    check_tensor(dprobs, "dprobs", {T, k}, {DType::f32}, dev);
  }
  run_on(
      dev, "permute_backward", stream,
      [&] { cpu_backend::permute_backward(dpermuted, map, dx, dpermuted_probs, dprobs); },
      [&] {
        cuda_backend::permute_backward(dpermuted, map, dx, dpermuted_probs, dprobs, stream, pick_allocator(alloc, dev));
      });
}

void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out,
             Stream stream, Allocator* alloc) {
  check_rows(expert_out, "expert_out");
  check_input_dtype(expert_out.dtype, "expert_out");
  const Device dev = expert_out.device;
  GMOE_CHECK(map.row_of.defined() && map.row_of.ndim == 2, "map.row_of: expected [tokens, k], got ", map.row_of.str());
  const int64_t T = map.row_of.size(0), k = map.row_of.size(1);
  check_map(map, T, k, expert_out.size(0), dev);
  if (probs.defined()) check_tensor(probs, "probs", {T, k}, {DType::f32}, dev);
  check_hidden(out, "out", T, expert_out.size(1), expert_out.dtype, dev);
  check_disjoint(out, "out", expert_out, "expert_out");
  run_on(
      dev, "combine", stream, [&] { cpu_backend::combine(expert_out, map, probs, out); },
      [&] { cuda_backend::combine(expert_out, map, probs, out, stream, pick_allocator(alloc, dev)); });
}

void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs,
                      Stream stream, Allocator* alloc) {
  check_rows(dout, "dout");
  check_input_dtype(dout.dtype, "dout");
  const Device dev = dout.device;
  GMOE_CHECK(map.row_of.defined() && map.row_of.ndim == 2, "map.row_of: expected [tokens, k], got ", map.row_of.str());
  const int64_t T = map.row_of.size(0), k = map.row_of.size(1), H = dout.size(1);
  GMOE_CHECK(dout.size(0) == T, "dout: expected ", T, " rows (map.row_of's tokens), got ", dout.shape_str());
  GMOE_CHECK(dexpert_out.defined() && dexpert_out.ndim == 2, "dexpert_out: expected [rows, H], got ",
             dexpert_out.str());
  const int64_t rows = dexpert_out.size(0);
  check_map(map, T, k, rows, dev);
  check_hidden(dexpert_out, "dexpert_out", rows, H, dout.dtype, dev);
  if (probs.defined()) check_tensor(probs, "probs", {T, k}, {DType::f32}, dev);
  if (dprobs.defined()) {
    check_tensor(dprobs, "dprobs", {T, k}, {DType::f32}, dev);
    GMOE_CHECK(expert_out.defined(), "expert_out: needed for dprobs, absent");
  }
  if (expert_out.defined()) check_hidden(expert_out, "expert_out", rows, H, dout.dtype, dev);
  check_disjoint(dexpert_out, "dexpert_out", dout, "dout");
  check_disjoint(dexpert_out, "dexpert_out", expert_out, "expert_out");
  run_on(
      dev, "combine_backward", stream,
      [&] { cpu_backend::combine_backward(dout, map, probs, expert_out, dexpert_out, dprobs); },
      [&] {
        cuda_backend::combine_backward(dout, map, probs, expert_out, dexpert_out, dprobs, stream,
                                       pick_allocator(alloc, dev));
      });
}

}  // namespace gmoe
