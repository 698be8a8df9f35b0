// src/common/activation.cpp — the public grouped activation ops: check every host-visible property
// of the arguments, then dispatch to the backend of the tensors' device.
#include "gmoe/activation.h"

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

#include "common/activation_internal.h"
#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"

namespace gmoe {

const char* activation_name(ActivationKind kind) {
  switch (kind) {
    case ActivationKind::swiglu: return "swiglu";
    case ActivationKind::geglu: return "geglu";
    case ActivationKind::clamped_swiglu: return "clamped_swiglu";
    case ActivationKind::squared_relu: return "squared_relu";
  }
  return "unknown";
}

ActivationKind activation_from_name(const std::string& name) {
  for (ActivationKind k : {ActivationKind::swiglu, ActivationKind::geglu, ActivationKind::clamped_swiglu,
                           ActivationKind::squared_relu}) {
    if (name == activation_name(k)) return k;
  }
  GMOE_FAIL("unknown activation '", name, "': expected swiglu, geglu, clamped_swiglu or squared_relu");
}

void check_activation_options(const ActivationOptions& o, int64_t F, const char* name) {
  const int k = static_cast<int>(o.kind);
  GMOE_CHECK(k >= 0 && k <= static_cast<int>(ActivationKind::squared_relu), name, ".kind: unknown activation ", k);
  if (o.kind == ActivationKind::clamped_swiglu) {
    GMOE_CHECK(std::isfinite(o.alpha), name, ".alpha: expected a finite value, got ", o.alpha);
    GMOE_CHECK(std::isfinite(o.limit) && o.limit > 0, name, ".limit: expected a finite value > 0, got ", o.limit);
  }
  if (is_gated(o.kind) && o.glu.layout == GluLayout::interleaved) {
    GMOE_CHECK(o.glu.block >= 1 && o.glu.block <= (int64_t{1} << 30), name, ".glu.block: expected a block of ",
               "at least 1 column, got ", o.glu.block);
    GMOE_CHECK(F % o.glu.block == 0, name, ".glu.block: the interleave block ", o.glu.block,
               " must divide the ", F, " columns of each half (gate, up)");
  }
}

namespace {

void check_row_vector(const TensorView& v, const char* name, int64_t capacity, Device device) {
  check_f32_vector(v, name, capacity, "one value per row", device);
}

// h [capacity, in_cols] against F output columns, and the options.
void check_h(const TensorView& h, const ActivationOptions& o, int64_t F) {
  check_rows(h, "h");
  check_input_dtype(h.dtype, "h");
  check_activation_options(o, F, "options");
  const int64_t in_cols = activation_input_cols(o.kind, F);
  GMOE_CHECK(h.size(1) == in_cols, "h: ", activation_name(o.kind), " with ", F, " output columns takes ",
             in_cols, " input columns, got ", h.shape_str());
}

void check_like(const TensorView& t, const char* name, const TensorView& h, int64_t cols) {
  check_rows(t, name);
  check_same_device(t.device, h.device, name);
  GMOE_CHECK(t.size(0) == h.size(0) && t.size(1) == cols, name, ": expected [", h.size(0), ", ", cols, "], got ",
             t.shape_str());
  GMOE_CHECK(t.dtype == h.dtype, name, ": expected dtype ", dtype_name(h.dtype), " (h's), got ", dtype_name(t.dtype));
}

// amax_out: f32 [E] (E = counts' length) on h's device, apart from every other tensor of the op.
void check_amax_out(const TensorView& amax_out, const TensorView& h, const TensorView& counts,
                    std::initializer_list<std::pair<const TensorView*, const char*>> others) {
  if (!amax_out.defined()) return;
  check_f32_vector(amax_out, "amax_out", counts.size(0), "one amax per expert", h.device);
  for (const auto& [t, n] : others) check_disjoint(amax_out, "amax_out", *t, n);
}

void after_op(Device device, Stream stream) {
  if (device.is_cuda() && debug_sync_enabled()) check_device_errors(stream);
}

}  // namespace

void check_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                              const ActivationOptions& options, const TensorView& probs) {
  GMOE_CHECK(z.defined() && z.ndim == 2, "z: expected a 2-D tensor [capacity, F], got ", z.str());
  const int64_t F = z.size(1);
  check_h(h, options, F);
  check_counts(counts, "counts", h.device);
  check_like(z, "z", h, F);
  check_disjoint(z, "z", h, "h");
  if (probs.defined()) {
    check_row_vector(probs, "probs", h.size(0), h.device);
    check_disjoint(z, "z", probs, "probs");
  }
}

void grouped_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                                const ActivationOptions& options, const TensorView& probs, Stream stream,
                                Allocator* alloc, const TensorView& amax_out) {
  check_activation_forward(h, counts, z, options, probs);
  check_amax_out(amax_out, h, counts, {{&h, "h"}, {&z, "z"}, {&probs, "probs"}, {&counts, "counts"}});
  if (h.device.is_cpu()) {
    cpu_backend::grouped_activation_forward(h, counts, z, options, probs, amax_out);
  } else {
    check_cuda_compiled("grouped_activation_forward");
    cuda_backend::grouped_activation_forward(h, counts, z, options, probs, amax_out, stream,
                                             pick_allocator(alloc, h.device));
  }
  after_op(h.device, stream);
}

void check_activation_dh(const TensorView& h, const TensorView& dh, const ActivationOptions& options, int64_t F) {
  check_h(h, options, F);
  check_like(dh, "dh", h, h.size(1));
  // dh may be h itself (each element is read, then written, by the same thread), nothing else.
  if (dh.data != h.data || dh.stride(0) != h.stride(0)) check_disjoint(dh, "dh", h, "h");
}

void grouped_activation_backward(const TensorView& h, const TensorView& dz, const TensorView& counts,
                                 const TensorView& dh, const ActivationOptions& options, const TensorView& probs,
                                 const TensorView& dprobs, const TensorView& z_out, Stream stream, Allocator* alloc,
                                 const TensorView& amax_out) {
  GMOE_CHECK(dz.defined() && dz.ndim == 2, "dz: expected a 2-D tensor [capacity, F], got ", dz.str());
  const int64_t F = dz.size(1);
  check_activation_dh(h, dh, options, F);
  check_counts(counts, "counts", h.device);
  check_like(dz, "dz", h, F);
  check_disjoint(dh, "dh", dz, "dz");
  if (probs.defined()) {
    check_row_vector(probs, "probs", h.size(0), h.device);
    check_disjoint(dh, "dh", probs, "probs");
  }
  if (dprobs.defined()) {
    check_row_vector(dprobs, "dprobs", h.size(0), h.device);
    for (const auto& [t, n] : {std::pair<const TensorView*, const char*>{&h, "h"}, {&dz, "dz"}, {&dh, "dh"},
                               {&probs, "probs"}}) {
      check_disjoint(dprobs, "dprobs", *t, n);
    }
  }
  if (z_out.defined()) {
    check_like(z_out, "z_out", h, F);
    for (const auto& [t, n] : {std::pair<const TensorView*, const char*>{&h, "h"}, {&dz, "dz"}, {&dh, "dh"},
                               {&probs, "probs"}, {&dprobs, "dprobs"}}) {
      check_disjoint(z_out, "z_out", *t, n);
    }
  }
  check_amax_out(amax_out, h, counts,
                 {{&h, "h"}, {&dz, "dz"}, {&dh, "dh"}, {&probs, "probs"}, {&dprobs, "dprobs"}, {&z_out, "z_out"},
                  {&counts, "counts"}});
  if (h.device.is_cpu()) {
    cpu_backend::grouped_activation_backward(h, dz, counts, dh, options, probs, dprobs, z_out, amax_out);
  } else {
    check_cuda_compiled("grouped_activation_backward");
    cuda_backend::grouped_activation_backward(h, dz, counts, dh, options, probs, dprobs, z_out, amax_out, stream,
                                              pick_allocator(alloc, h.device));
  }
  after_op(h.device, stream);
}

Tensor activation_amax_scratch(Fp8Recipe recipe, int64_t experts, Allocator& alloc, Stream stream) {
  return activation_amax_for(recipe) ? Tensor::empty({experts}, DType::f32, alloc, stream) : Tensor();
}

void quantize_activation_forward(const TensorView& h, const TensorView& counts, const ActivationOptions& act,
                                 const TensorView& probs, const Fp8QuantizeOptions& options, const Fp8Grouped& q,
                                 bool fused, Stream stream, Allocator& alloc) {
  if (fused && !activation_amax_for(options.recipe) && h.device.is_cuda() &&
      cuda_backend::quantize_activation_forward(h, counts, act, probs, options, q, stream, alloc)) {
    after_op(h.device, stream);
    return;
  }
  // Tensorwise: z's amax from the activation's own pass (the quantizer then reads z once).
  Tensor z = Tensor::empty({h.size(0), q.cols}, h.dtype, alloc, stream);
  Tensor amax = activation_amax_scratch(options.recipe, counts.size(0), alloc, stream);
  grouped_activation_forward(h, counts, z, act, probs, stream, &alloc, amax.view());
  Fp8QuantizeOptions o = options;
  o.amax = amax.view();
  quantize_grouped(GroupedRows{z, counts}, o, stream, &alloc, &q);
  z.release_on(stream);
  amax.release_on(stream);
}

}  // namespace gmoe
