// src/layers/moe_layer.cpp — MoELayer: router → permute → GroupedMLP → combine and back, from the
// public ops only (gmoe/routing.h, gmoe/grouped_mlp.h); every buffer from the layer's allocator on
// the call's stream, so the whole pass is stream-ordered and capturable.
#include "gmoe/moe_layer.h"

#include "gmoe/error.h"
#include "layers/offload_slots.h"

namespace gmoe {

struct MoELayerContext::State {
  GroupedMLPContext experts;
  TensorView x, logits;
  Tensor ids, probs, counts;  // the router's
  Tensor permuted, permuted_counts, row_of, src_token;
  Tensor permuted_probs;  // probs_in_experts: each row's probability, which the experts keep by reference
  Tensor expert_out;      // weighted combine only: for dprobs, released by backward
  Tensor dexpert_out;  // kept: a delayed FC2 weight gradient reads it in backward_dw
  bool backward_done = false;
  RoutingMap map() const { return {row_of.view(), src_token.view()}; }
};

MoELayerContext::MoELayerContext() = default;
MoELayerContext::~MoELayerContext() = default;
MoELayerContext::MoELayerContext(MoELayerContext&&) noexcept = default;
MoELayerContext& MoELayerContext::operator=(MoELayerContext&&) noexcept = default;
bool MoELayerContext::active() const { return state_ != nullptr; }
void MoELayerContext::collect(OffloadSlots& slots) {
  if (state_ == nullptr) return;
  State& s = *state_;
  slots.child(s.experts);
  for (Tensor* t : {&s.ids, &s.probs, &s.counts, &s.permuted, &s.permuted_counts, &s.row_of, &s.src_token,
                    &s.permuted_probs, &s.expert_out, &s.dexpert_out}) {
    slots.tensor(*t);
  }
  slots.view(s.x);
  slots.view(s.logits);
}

GroupedMLPContext& MoELayerContext::experts() {
  GMOE_CHECK(state_ != nullptr, "MoELayerContext: no forward has run with this context");
  // The experts' tensors are offloaded with this context: reach them only once it is back.
  check_resident("experts()");
  return state_->experts;
}

MoELayer::MoELayer(GroupedMLP& experts, MoELayerOptions options) : experts_(&experts), options_(options) {
  const int64_t E = experts.num_experts();
  const RouterOptions& r = options_.router;
  GMOE_CHECK(r.top_k >= 1 && r.top_k <= E, "options.router.top_k: expected 1..", E, " (the experts), got ", r.top_k);
  GMOE_CHECK(r.n_group >= 1 && E % r.n_group == 0, "options.router.n_group: must divide the ", E, " experts, got ",
             r.n_group);
  GMOE_CHECK(options_.permute.pad_multiple >= 1, "options.permute.pad_multiple: expected >= 1, got ",
             options_.permute.pad_multiple);
  if (options_.score_bias.defined()) {
    GMOE_CHECK(options_.score_bias.ndim == 1 && options_.score_bias.size(0) == E, "options.score_bias: expected [", E,
               "], got ", options_.score_bias.str());
  }
}

Allocator& MoELayer::allocator(Device device) const {
  return options_.allocator != nullptr ? *options_.allocator : default_allocator(device);
}

MoEForward MoELayer::forward(const TensorView& x, const TensorView& logits, MoELayerContext& ctx, Stream stream) {
  GMOE_CHECK(x.defined() && x.ndim == 2 && x.size(1) == experts_->hidden(), "x: expected [tokens, ", experts_->hidden(),
             "], got ", x.str());
  GMOE_CHECK(
      logits.defined() && logits.ndim == 2 && logits.size(0) == x.size(0) && logits.size(1) == experts_->num_experts(),
      "logits: expected [", x.size(0), ", ", experts_->num_experts(), "], got ", logits.str());
  const int64_t T = x.size(0), H = x.size(1), E = experts_->num_experts(), k = options_.router.top_k;
  Allocator& a = allocator(x.device);
  ctx.check_resident("forward");
  ctx.state_ = std::make_unique<MoELayerContext::State>();
  MoELayerContext::State& s = *ctx.state_;
  s.x = x;
  s.logits = logits;
  s.ids = Tensor::empty({T, k}, DType::i32, a, stream);
  s.probs = Tensor::empty({T, k}, DType::f32, a, stream);
  s.counts = Tensor::empty({E}, DType::i32, a, stream);
  router_topk(logits, options_.router, s.ids, s.probs, s.counts, options_.score_bias, stream, &a);

  const int64_t rows = permuted_rows(T, k, E, options_.permute);
  s.permuted = Tensor::empty({rows, H}, x.dtype, a, stream);
  s.permuted_counts = Tensor::empty({E}, DType::i32, a, stream);
  s.row_of = Tensor::empty({T, k}, DType::i32, a, stream);
  s.src_token = Tensor::empty({rows}, DType::i32, a, stream);
  MoEForward f;
  f.out = Tensor::empty({T, H}, x.dtype, a, stream);
  if (probs_in_experts()) {
    // The probabilities scale z inside the experts (0 on padding rows), the combine sums with
    // weights 1, and yp is dropped here: nothing in backward reads it (see moe_layer.h).
    s.permuted_probs = Tensor::empty({rows}, DType::f32, a, stream);
    permute(x, s.ids, options_.permute, s.permuted, s.permuted_counts, s.map(), s.probs, s.permuted_probs, {},
            stream, &a);
    Tensor yp = experts_->forward(s.permuted, s.permuted_counts, s.permuted_probs, s.experts, stream);
    combine(yp, s.map(), {}, f.out, stream, &a);
    yp.release_on(stream);
  } else {
    // FC2 has a bias, so FC2(p·z) = p·W2·z + b2 is not the block's p·(W2·z + b2): the combine
    // weights yp and keeps it for dprobs.
    permute(x, s.ids, options_.permute, s.permuted, s.permuted_counts, s.map(), {}, {}, {}, stream, &a);
    s.expert_out = experts_->forward(s.permuted, s.permuted_counts, {}, s.experts, stream);
    combine(s.expert_out, s.map(), s.probs, f.out, stream, &a);
  }
  if (options_.aux_loss_coeff != 0.0f) {
    f.aux_loss = Tensor::empty({1}, DType::f32, a, stream);
    router_aux_loss(logits, s.counts, options_.router, options_.aux_loss_coeff, f.aux_loss, stream, &a);
  }
  if (options_.z_loss_coeff != 0.0f) {
    f.z_loss = Tensor::empty({1}, DType::f32, a, stream);
    router_z_loss(logits, options_.z_loss_coeff, f.z_loss, stream, &a);
  }
  f.ids = Tensor::wrap(s.ids);
  f.probs = Tensor::wrap(s.probs);
  f.counts = Tensor::wrap(s.counts);
  return f;
}

MoEBackward MoELayer::backward(MoELayerContext& ctx, const TensorView& dout, Stream stream,
                               const TensorView& d_aux_loss, const TensorView& d_z_loss) {
  GMOE_CHECK(ctx.state_ != nullptr && !ctx.state_->backward_done,
             "ctx: backward needs a forward with this context, and runs once per forward");
  ctx.check_resident("backward");
  MoELayerContext::State& s = *ctx.state_;
  const int64_t T = s.x.size(0), H = s.x.size(1), E = experts_->num_experts(), k = options_.router.top_k;
  GMOE_CHECK(dout.defined() && dout.ndim == 2 && dout.size(0) == T && dout.size(1) == H, "dout: expected [", T, ", ", H,
             "], got ", dout.str());
  Allocator& a = allocator(s.x.device);

  const int64_t rows = s.permuted.view().size(0);
  s.dexpert_out = Tensor::empty({rows, H}, s.x.dtype, a, stream);
  Tensor dprobs = Tensor::empty({T, k}, DType::f32, a, stream);
  MoEBackward b;
  b.dx = Tensor::empty({T, H}, s.x.dtype, a, stream);
  const bool probs_in_experts = s.permuted_probs.view().defined();
  if (probs_in_experts) {
    // Weights 1: dyp is dout gathered into rows; dprobs comes from the experts per row and is
    // gathered back to [T, k] by permute_backward (padding and dropped slots never reach it).
    combine_backward(dout, s.map(), {}, {}, s.dexpert_out, {}, stream, &a);
  } else {
    combine_backward(dout, s.map(), s.probs, s.expert_out, s.dexpert_out, dprobs, stream, &a);
    s.expert_out.release_on(stream);
  }
  GroupedMLPBackward eb = experts_->backward(s.experts, s.dexpert_out, stream);
  permute_backward(eb.dx, s.map(), b.dx, eb.dprobs, probs_in_experts ? dprobs.view() : TensorView{}, stream, &a);
  b.grads = std::move(eb.grads);

  b.dlogits = Tensor::empty({T, E}, DType::f32, a, stream);
  router_topk_backward(s.logits, s.ids, dprobs, options_.router, b.dlogits, false, stream, &a);
  if (options_.aux_loss_coeff != 0.0f) {
    router_aux_loss_backward(s.logits, s.counts, options_.router, options_.aux_loss_coeff, d_aux_loss, b.dlogits, true,
                             stream, &a);
  }
  if (options_.z_loss_coeff != 0.0f) {
    router_z_loss_backward(s.logits, options_.z_loss_coeff, d_z_loss, b.dlogits, true, stream, &a);
  }
  s.backward_done = true;
  return b;
}

}  // namespace gmoe
