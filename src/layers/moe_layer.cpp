// src/layers/moe_layer.cpp — MoELayer: router → permute → GroupedMLP → combine and back, from the
// public ops only (gmoe/routing.h, gmoe/grouped_mlp.h, and with an EP group the exchanges of
// gmoe/expert_parallel.h inserted around the experts); every buffer from the layer's allocator on
// the call's stream, so the whole pass is stream-ordered and capturable.
#include "gmoe/moe_layer.h"

#include <string>

#include "gmoe/error.h"
#include "gmoe/expert_parallel.h"
#include "layers/offload_slots.h"

namespace gmoe {

struct MoELayerContext::State {
  GroupedMLPContext experts;
  TensorView x, logits;
  Tensor ids, probs, counts;  // the router's
  // permuted: FC1's input, kept only where the experts read it by reference and it is not
  // gathered again; backward hands it (or the rows it gathers again) over to the experts, whose
  // context frees it once FC1's weight gradient has read it.
  Tensor permuted, permuted_counts, row_of, src_token;
  Tensor permuted_probs;  // probs_in_experts: each row's probability, which the experts keep by reference
  Tensor expert_out;      // weighted combine only: for dprobs, released by backward
  int64_t rows = 0;       // the permuted (source layout) rows: the map's
  bool probs_in_experts = true;
  bool regather = false;  // forward freed `permuted`; backward gathers it again from x
  bool backward_done = false;
  // Expert parallelism: the exchange's plan (backward's exchanges reuse it; the experts keep its
  // local counts by reference), and in the receive layout each row's probability (kept by the
  // experts by reference) and, only where the experts keep it by reference, their input.
  EpPlan plan;
  Tensor expert_in, expert_probs;
  Event to_comm, to_compute;  // backward with a comm stream: made once per context, reused
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
                    &s.permuted_probs, &s.expert_out, &s.plan.counts_all, &s.plan.local_counts,
                    &s.expert_in, &s.expert_probs}) {
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
  if (options_.ep != nullptr) {
    const EpGroupOptions& g = options_.ep->options();
    const int64_t El = experts.num_experts(), R = options_.ep->size();
    GMOE_CHECK(g.num_experts == El * R, "options.ep: the group's num_experts is ", g.num_experts, ", expected ", El,
               " (the experts this rank holds) x ", R, " (ranks) = ", El * R);
    GMOE_CHECK(g.hidden == experts.hidden(), "options.ep: the group's hidden is ", g.hidden, ", expected the experts' ",
               experts.hidden());
  }
  const int64_t E = num_experts();
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

int64_t MoELayer::num_experts() const {
  return experts_->num_experts() * (options_.ep != nullptr ? options_.ep->size() : 1);
}

bool MoELayer::expert_parallel() const { return options_.ep != nullptr && options_.ep->size() > 1; }

bool MoELayer::regathers_expert_input() const {
  return options_.regather_expert_input && !expert_parallel() && experts_->fc1().options().save_original_input;
}

Allocator& MoELayer::allocator(Device device) const {
  return options_.allocator != nullptr ? *options_.allocator : default_allocator(device);
}

MoEForward MoELayer::forward(const TensorView& x, const TensorView& logits, MoELayerContext& ctx, Stream stream) {
  const int64_t E = num_experts();
  GMOE_CHECK(x.defined() && x.ndim == 2 && x.size(1) == experts_->hidden(), "x: expected [tokens, ", experts_->hidden(),
             "], got ", x.str());
  if (!(logits.defined() && logits.ndim == 2 && logits.size(0) == x.size(0) && logits.size(1) == E)) {
    const std::string of_ranks = expert_parallel() ? " (E = " + std::to_string(experts_->num_experts()) +
                                                         " local experts x " + std::to_string(options_.ep->size()) +
                                                         " ranks of options.ep)"
                                                   : "";
    GMOE_FAIL("logits: expected [", x.size(0), ", ", E, "]", of_ranks, ", got ", logits.str());
  }
  const int64_t T = x.size(0), H = x.size(1), k = options_.router.top_k;
  const int64_t rows = permuted_rows(T, k, E, options_.permute);
  EpGroup* ep = expert_parallel() ? options_.ep : nullptr;
  if (ep != nullptr) {
    const EpGroupOptions& g = ep->options();
    GMOE_CHECK(g.dtype == x.dtype, "options.ep: the group's dtype is ", dtype_name(g.dtype), ", x is ",
               dtype_name(x.dtype));
    GMOE_CHECK(ep->device() == x.device, "options.ep: the group is on ", ep->device().str(), ", x on ",
               x.device.str());
    GMOE_CHECK(g.max_rows >= rows, "options.ep: the group's max_rows is ", g.max_rows, ", below the ", rows,
               " rows of the permuted layout of ", T, " tokens (permuted_rows(", T, ", ", k, ", ", E,
               ", options.permute))");
  }
  Allocator& a = allocator(x.device);
  ctx.check_resident("forward");
  {
    // The backward events are made once per context (the rest of the state is per forward).
    std::unique_ptr<MoELayerContext::State> prev = std::move(ctx.state_);
    ctx.state_ = std::make_unique<MoELayerContext::State>();
    if (prev != nullptr) {
      ctx.state_->to_comm = std::move(prev->to_comm);
      ctx.state_->to_compute = std::move(prev->to_compute);
    }
  }
  MoELayerContext::State& s = *ctx.state_;
  s.x = x;
  s.logits = logits;
  s.ids = Tensor::empty({T, k}, DType::i32, a, stream);
  s.probs = Tensor::empty({T, k}, DType::f32, a, stream);
  s.counts = Tensor::empty({E}, DType::i32, a, stream);
  router_topk(logits, options_.router, s.ids, s.probs, s.counts, options_.score_bias, stream, &a);

  // With EP the permuted rows are the exchange's source layout, which has the group's max_rows.
  s.rows = ep != nullptr ? ep->options().max_rows : rows;
  s.permuted = Tensor::empty({s.rows, H}, x.dtype, a, stream);
  s.permuted_counts = Tensor::empty({E}, DType::i32, a, stream);
  s.row_of = Tensor::empty({T, k}, DType::i32, a, stream);
  s.src_token = Tensor::empty({s.rows}, DType::i32, a, stream);
  s.probs_in_experts = probs_in_experts();
  s.regather = regathers_expert_input();
  MoEForward f;
  f.out = Tensor::empty({T, H}, x.dtype, a, stream);
  // probs_in_experts: the probabilities scale z inside the experts (0 on padding rows) and the
  // combine sums with weights 1 (see moe_layer.h). Otherwise FC2 has a bias, so FC2(p·z) = p·W2·z +
  // b2 is not the block's p·(W2·z + b2): the combine weights yp and keeps it for dprobs.
  if (s.probs_in_experts) s.permuted_probs = Tensor::empty({s.rows}, DType::f32, a, stream);
  permute(x, s.ids, options_.permute, s.permuted, s.permuted_counts, s.map(),
          s.probs_in_experts ? s.probs.view() : TensorView{}, s.permuted_probs, {}, stream, &a);
  // The experts' rows: the permuted ones, or with EP those the exchange brings to this rank's
  // experts (grouped by local expert, counted by the plan).
  TensorView expert_x = s.permuted, expert_counts = s.permuted_counts, expert_probs = s.permuted_probs;
  if (ep != nullptr) {
    s.plan = ep_plan(*ep, s.permuted_counts, &a, stream);
    EpRows sent = ep_dispatch(*ep, s.plan, s.permuted, s.permuted_probs, &a, stream);
    s.expert_in = std::move(sent.rows);
    s.expert_probs = std::move(sent.scalars);
    // Sent: nothing reads the source layout's rows and probabilities again.
    s.permuted.release_on(stream);
    s.permuted_probs.release_on(stream);
    expert_x = s.expert_in;
    expert_counts = s.plan.local_counts;
    expert_probs = s.expert_probs;
  }
  Tensor yp = experts_->forward(expert_x, expert_counts, expert_probs, s.experts, stream);
  // Nothing else reads the permuted rows: they stay only where FC1 keeps them by reference and
  // backward does not gather them again (FC1's context keeps a view of the freed rows until
  // backward hands it the regathered ones; nothing reads it in between).
  if (ep == nullptr && (s.regather || !experts_->fc1().options().save_original_input)) {
    s.permuted.release_on(stream);
  }
  if (ep != nullptr) {
    EpRows back = ep_combine(*ep, s.plan, yp, {}, &a, stream);
    yp.release_on(stream);
    yp = std::move(back.rows);
    // The experts copied their input unless they keep it by reference.
    if (!experts_->fc1().options().save_original_input) s.expert_in.release_on(stream);
  }
  if (s.probs_in_experts) {
    combine(yp, s.map(), {}, f.out, stream, &a);
    yp.release_on(stream);  // nothing in backward reads it
  } else {
    s.expert_out = std::move(yp);
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
                               const TensorView& d_aux_loss, const TensorView& d_z_loss,
                               const MoEBackwardOverlap& overlap) {
  GMOE_CHECK(ctx.state_ != nullptr && !ctx.state_->backward_done,
             "ctx: backward needs a forward with this context, and runs once per forward");
  GMOE_CHECK(!overlap.experts_wgrad_during_combine || experts_->options().fc1.delay_wgrad ||
                 experts_->options().fc2.delay_wgrad,
             "overlap.experts_wgrad_during_combine: the experts delay no weight gradient (their options' ",
             "fc1.delay_wgrad and fc2.delay_wgrad are both false)");
  ctx.check_resident("backward");
  MoELayerContext::State& s = *ctx.state_;
  const int64_t T = s.x.size(0), H = s.x.size(1), E = num_experts(), k = options_.router.top_k;
  GMOE_CHECK(dout.defined() && dout.ndim == 2 && dout.size(0) == T && dout.size(1) == H, "dout: expected [", T, ", ", H,
             "], got ", dout.str());
  Allocator& a = allocator(s.x.device);
  EpGroup* ep = expert_parallel() ? options_.ep : nullptr;
  // The exchanges' stream, and the event steps between it and the compute stream (moe_layer.h).
  const bool side = ep != nullptr && overlap.comm_stream != nullptr && overlap.comm_stream != stream;
  const Stream comm = side ? overlap.comm_stream : stream;
  if (side) {
    for (Event* e : {&s.to_comm, &s.to_compute}) {
      if (!e->defined() || e->device() != s.x.device) *e = Event(s.x.device);
    }
  }
  auto join_comm = [&] {  // comm waits for what the compute stream enqueued so far
    if (!side) return;
    s.to_comm.record(stream);
    s.to_comm.wait(comm);
  };
  auto join_compute = [&] {  // the compute stream waits for what comm enqueued so far
    if (!side) return;
    s.to_compute.record(comm);
    s.to_compute.wait(stream);
  };

  Tensor dyp = Tensor::empty({s.rows, H}, s.x.dtype, a, stream);
  Tensor dprobs = Tensor::empty({T, k}, DType::f32, a, stream);
  MoEBackward b;
  if (s.probs_in_experts) {
    // Weights 1: dyp is dout gathered into rows; dprobs comes from the experts per row and is
    // gathered back to [T, k] by permute_backward (padding and dropped slots never reach it).
    combine_backward(dout, s.map(), {}, {}, dyp, {}, stream, &a);
  } else {
    combine_backward(dout, s.map(), s.probs, s.expert_out, dyp, dprobs, stream, &a);
    s.expert_out.release_on(stream);
  }
  if (ep != nullptr) {
    join_comm();
    EpRows sent = ep_dispatch(*ep, s.plan, dyp, {}, &a, comm);
    if (overlap.during_dispatch) overlap.during_dispatch();
    join_compute();
    dyp.release_on(stream);
    dyp = std::move(sent.rows);
  } else if (overlap.during_dispatch) {
    overlap.during_dispatch();
  }
  // FC1's input, where FC1 reads it by reference, goes over to the experts' context with the
  // output gradient: each is freed as soon as its last reader is done (the input after FC1's
  // weight gradient, before FC1's dx takes memory; the gradient after FC2's), not with this
  // context.
  if (s.regather) {
    // FC1's input again, for its weight gradient: permute's rows exactly (moe_layer.h).
    Tensor xp = Tensor::empty({s.rows, H}, s.x.dtype, a, stream);
    combine_backward(s.x, s.map(), {}, {}, xp, {}, stream, &a);
    experts_->set_saved_input(s.experts, std::move(xp));
  } else if (experts_->fc1().options().save_original_input) {
    experts_->set_saved_input(s.experts, std::move(ep != nullptr ? s.expert_in : s.permuted));
  }
  GroupedMLPBackward eb = experts_->backward(s.experts, std::move(dyp), stream);
  TensorView dxp = eb.dx, dpp = eb.dprobs;
  EpRows back;
  if (ep != nullptr) {
    join_comm();
    back = ep_combine(*ep, s.plan, eb.dx, eb.dprobs, &a, comm);
  }
  b.grads = std::move(eb.grads);
  if (overlap.experts_wgrad_during_combine) {
    // On the compute stream while the combine is in flight; what backward_dw computes replaces
    // the delayed FCs' partial gradients (their bias gradients included).
    GroupedMLPGrads dw = experts_->backward_dw(s.experts, stream);
    if (experts_->options().fc1.delay_wgrad) b.grads.fc1 = std::move(dw.fc1);
    if (experts_->options().fc2.delay_wgrad) b.grads.fc2 = std::move(dw.fc2);
  }
  if (ep != nullptr) {
    join_compute();
    eb.dx.release_on(stream);
    eb.dprobs.release_on(stream);
    dxp = back.rows;
    dpp = back.scalars;
  }
  b.dx = Tensor::empty({T, H}, s.x.dtype, a, stream);  // here, not before the experts: off their peak
  permute_backward(dxp, s.map(), b.dx, dpp, s.probs_in_experts ? dprobs.view() : TensorView{}, stream, &a);
  back.rows.release_on(stream);
  back.scalars.release_on(stream);

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
