// src/layers/grouped_mlp.cpp — GroupedMLP: FC1 (a GroupedLinear) → grouped activation → FC2 (a
// GroupedLinear), with the context forward saves for backward, and the gate/up conversion of FC1
// weights and biases (convert_fc1_glu).
//
// FC2 always keeps its input by reference: that input is z, which this layer owns. With
// recompute_activation z is freed right after FC2's forward and FC2's weight gradient has to wait
// for the activation's backward, which rebuilds z (in the same pass as dh); so FC2 then runs with a
// delayed weight gradient internally, and unless the caller delayed it too, backward computes it
// right after the activation step — still before FC1's backward, so the hooks keep their order.
#include "gmoe/grouped_mlp.h"

#include <string>
#include <utility>
#include <vector>

#include "common/activation_internal.h"
#include "common/checks.h"
#include "gmoe/copy.h"
#include "gmoe/error.h"
#include "layers/offload_slots.h"

namespace gmoe {

struct GroupedMLPContext::State {
  GroupedLinearContext fc1, fc2;
  Tensor h;                    // FC1's output; after backward's activation step, dh (written over it)
  Tensor z;                    // FC2's input (absent between forward and backward with recompute)
  TensorView counts, probs;    // the caller's, by reference (counts: the uploaded ones when given on the host)
  Tensor counts_upload;        // counts given on the host, uploaded once for both FCs and the activation
  Device device{};
  bool active = false;         // forward ran; some weight gradient is still to come
  bool backward_done = false;  // backward ran; backward_dw still has delayed weight gradients to compute
  bool fc1_pending = false, fc2_pending = false;
  Event event;                 // recorded at the end of a backward that left work to backward_dw
  Tensor dy;                   // handed over to backward: freed once FC2's weight gradient has read it
  Stream dy_stream = nullptr;  // backward's: dy may come from another stream, and is freed on this one

  ~State() { dy.release_on(dy_stream); }

  // Forgets the caller's tensors once every gradient is done, on `stream`, the stream of the last
  // work (what else this layer owns is released by then, each on the stream of its last use).
  void finish(Stream stream) {
    counts_upload.release_on(stream);
    counts = TensorView();
    probs = TensorView();
    active = false;
    backward_done = false;
    fc1_pending = false;
    fc2_pending = false;
  }
};

GroupedMLPContext::GroupedMLPContext() : state_(std::make_unique<State>()) {}
GroupedMLPContext::~GroupedMLPContext() = default;
GroupedMLPContext::GroupedMLPContext(GroupedMLPContext&&) noexcept = default;
GroupedMLPContext& GroupedMLPContext::operator=(GroupedMLPContext&&) noexcept = default;
bool GroupedMLPContext::active() const { return state_ && state_->active; }

void GroupedMLPContext::collect(OffloadSlots& slots) {
  State& st = *state_;
  slots.child(st.fc1);
  slots.child(st.fc2);
  slots.tensor(st.h);
  slots.tensor(st.z);
  slots.view(st.counts);
  slots.view(st.probs);
}

namespace {

bool has_main_grad(const GroupedLinearOptions& o) { return o.main_grad.is_stacked() || !o.main_grad.list.empty(); }

// main_grad and expert_mask of one FC, named as the caller wrote them ("options.fc1.main_grad"),
// before GroupedLinear's own checks (which name them without the FC) can see them.
void check_fc_options(const GroupedLinearOptions& o, const std::string& name, int64_t E, int64_t N, int64_t K,
                      Device dev) {
  if (has_main_grad(o)) {
    const std::string mg_name = name + ".main_grad";
    const ExpertWeights& mg = o.main_grad;
    check_expert_weights(mg, mg_name.c_str());
    GMOE_CHECK(mg.num_experts() == E && mg.rows() == N && mg.cols() == K, mg_name, ": expected ", E, " experts of [",
               N, ", ", K, "], got ", mg.num_experts(), " of [", mg.rows(), ", ", mg.cols(), "]");
    GMOE_CHECK(mg.dtype() == DType::f32, mg_name, ": expected f32, got ", dtype_name(mg.dtype()));
    check_same_device(mg.device(), dev, mg_name.c_str());
  }
  if (o.expert_mask.defined()) {
    const std::string m_name = name + ".expert_mask";
    const TensorView& m = o.expert_mask;
    GMOE_CHECK(m.ndim == 1 && m.size(0) == E && m.dtype == DType::i32, m_name, ": expected i32[", E, "], got ",
               m.str());
    check_same_device(m.device, dev, m_name.c_str());
  }
}

// Every host-visible property of the constructor's arguments; returns the options with the FCs'
// allocators defaulted to the layer's.
GroupedMLPOptions checked_options(const ExpertWeights& w1, const ExpertWeights& w2, const ExpertBias& b1,
                                  const ExpertBias& b2, GroupedMLPOptions o) {
  check_expert_weights(w1, "fc1_weight");
  check_expert_weights(w2, "fc2_weight");
  const Device dev = w1.device();
  const DType dt = w1.dtype();
  GMOE_CHECK(dt == DType::bf16 || dt == DType::f16 || (dt == DType::f32 && dev.is_cpu()),
             "fc1_weight: dtype not supported: expected bf16 or f16 (f32 on the CPU), got ", dtype_name(dt));
  GMOE_CHECK(w2.dtype() == dt, "fc2_weight: expected dtype ", dtype_name(dt), " (fc1_weight's), got ",
             dtype_name(w2.dtype()));
  check_same_device(w2.device(), dev, "fc2_weight");
  const int64_t E = w1.num_experts(), H = w2.rows(), F = w2.cols();
  GMOE_CHECK(w2.num_experts() == E, "fc2_weight: expected ", E, " experts (fc1_weight's), got ", w2.num_experts());
  check_activation_options(o.activation, F, "options.activation");
  const int64_t fc1_rows = activation_input_cols(o.activation.kind, F);
  GMOE_CHECK(w1.rows() == fc1_rows && w1.cols() == H, "fc1_weight: ", activation_name(o.activation.kind),
             " with fc2_weight [", H, ", ", F, "] (hidden ", H, ", ffn ", F, ") needs experts of [", fc1_rows, ", ",
             H, "], got [", w1.rows(), ", ", w1.cols(), "]");
  if (b1.defined()) check_expert_bias(b1, "fc1_bias", E, fc1_rows, dt, dev);
  if (b2.defined()) check_expert_bias(b2, "fc2_bias", E, H, dt, dev);
  check_fc_options(o.fc1, "options.fc1", E, fc1_rows, H, dev);
  check_fc_options(o.fc2, "options.fc2", E, H, F, dev);
  if (o.allocator != nullptr) {
    GMOE_CHECK(o.allocator->device().type == dev.type, "options.allocator: allocator for ",
               o.allocator->device().str(), " used with weights on ", dev.str());
  }
  for (GroupedLinearOptions* fc : {&o.fc1, &o.fc2}) {
    if (fc->allocator == nullptr) fc->allocator = o.allocator;
  }
  if (o.recipe != LinearRecipe::native) {
    GMOE_CHECK(dt == DType::bf16 || (dt == DType::f32 && dev.is_cpu()), "options.recipe: ",
               linear_recipe_name(o.recipe), " needs bf16 weights (f32 on the CPU), got ", dtype_name(dt));
    GMOE_CHECK(dev.is_cpu() || (H % 16 == 0 && F % 16 == 0), "options.recipe: ", linear_recipe_name(o.recipe),
               " on CUDA needs hidden and ffn sizes that are multiples of 16 (FP8 rows are read in 16-byte "
               "units), got hidden ", H, ", ffn ", F);
    for (GroupedLinearOptions* fc : {&o.fc1, &o.fc2}) {
      GMOE_CHECK(fc->recipe == LinearRecipe::native || fc->recipe == o.recipe, "options.",
                 fc == &o.fc1 ? "fc1" : "fc2", ".recipe: ", linear_recipe_name(fc->recipe),
                 " disagrees with options.recipe ", linear_recipe_name(o.recipe));
      fc->recipe = o.recipe;
    }
  }
  return o;
}

// What FC2 runs: its input (z) by reference always; a delayed weight gradient also when z is
// recomputed in backward (see the file comment).
GroupedLinearOptions fc2_layer_options(const GroupedMLPOptions& o) {
  GroupedLinearOptions fc2 = o.fc2;
  fc2.save_original_input = true;
  fc2.delay_wgrad = o.fc2.delay_wgrad || o.recompute_activation;
  return fc2;
}

void check_like_rows(const TensorView& t, const char* name, int64_t rows, int64_t cols, DType dt, Device dev) {
  check_rows(t, name);
  GMOE_CHECK(t.size(0) == rows && t.size(1) == cols && t.dtype == dt, name, ": expected ", dtype_name(dt), "[",
             rows, ", ", cols, "], got ", t.str());
  check_same_device(t.device, dev, name);
}

}  // namespace

GroupedMLP::GroupedMLP(ExpertWeights fc1_weight, ExpertWeights fc2_weight, ExpertBias fc1_bias,
                       ExpertBias fc2_bias, GroupedMLPOptions options)
    : options_(checked_options(fc1_weight, fc2_weight, fc1_bias, fc2_bias, std::move(options))),
      fc1_(std::move(fc1_weight), std::move(fc1_bias), options_.fc1),
      fc2_(std::move(fc2_weight), std::move(fc2_bias), fc2_layer_options(options_)) {}

Allocator& GroupedMLP::allocator() const {
  return options_.allocator ? *options_.allocator : default_allocator(fc1_.weight().device());
}

Tensor GroupedMLP::forward(const TensorView& x, const TensorView& counts, const TensorView& probs,
                           GroupedMLPContext& ctx, Stream stream, const TensorView& out) {
  GroupedMLPContext::State& st = *ctx.state_;
  ctx.check_resident("forward");
  GMOE_CHECK(!st.active, "ctx: still holds a forward whose gradients were not computed (call backward",
             st.backward_done ? "_dw" : "", " first, or use one context per forward in flight)");
  const Device dev = fc1_.weight().device();
  const DType dt = fc1_.weight().dtype();
  const int64_t E = num_experts(), H = hidden();
  // Everything checked before anything runs, so that a bad argument leaves ctx as it was.
  check_rows(x, "x");
  const int64_t cap = x.size(0);
  check_like_rows(x, "x", cap, H, dt, dev);
  check_counts(counts, "counts", counts.device.is_cpu() ? Device::cpu() : dev);  // host counts are uploaded
  GMOE_CHECK(counts.size(0) == E, "counts: expected one count per expert (", E, "), got ", counts.size(0));
  if (probs.defined()) {
    GMOE_CHECK(probs.ndim == 1 && probs.size(0) == cap && probs.dtype == DType::f32, "probs: expected f32[", cap,
               "] (one router probability per row of x), got ", probs.str());
    GMOE_CHECK(probs.stride(0) == 1 || cap <= 1, "probs: must be contiguous, got stride ", probs.stride(0));
    GMOE_CHECK(probs.data != nullptr || cap == 0, "probs: null data");
    check_same_device(probs.device, dev, "probs");
  }
  if (out.defined()) check_like_rows(out, "out", cap, H, dt, dev);

  Allocator& alloc = allocator();
  if (counts.device != dev) {
    // Counts given on the host: uploaded once (pinned, stream-ordered), for both FCs and the activation.
    st.counts_upload = upload_counts(counts, dev, stream, &alloc);
    return forward_device_counts(x, st.counts_upload.view(), probs, ctx, stream, out);
  }
  return forward_device_counts(x, counts, probs, ctx, stream, out);
}

Tensor GroupedMLP::forward_device_counts(const TensorView& x, const TensorView& counts, const TensorView& probs,
                                         GroupedMLPContext& ctx, Stream stream, const TensorView& out) {
  GroupedMLPContext::State& st = *ctx.state_;
  const Device dev = fc1_.weight().device();
  const DType dt = fc1_.weight().dtype();
  const int64_t cap = x.size(0), F = ffn();
  Allocator& alloc = allocator();
  Tensor h, y, z;
  if (fp8_quantize_z()) {
    // FP8: z quantized by the activation itself (rowwise for FC2's fprop, columnwise for its
    // weight gradient unless z is rebuilt in backward, which then hands it over).
    h = fc1_.forward(x, counts, st.fc1, stream);
    Fp8QuantizeOptions qo = fc2_.input_quantization();
    qo.columnwise = !options_.recompute_activation;
    GroupedLinearFp8Operand zq = fc2_.allocate_fp8_operand(cap, F, qo, stream);
    quantize_activation_forward(h, counts, options_.activation, probs, qo, zq.q, true, stream, alloc);
    y = fc2_.forward_fp8(std::move(zq), counts, st.fc2, stream, out);
  } else {
    // FC1 and the activation as one op (GroupedLinear::forward_with_activation), bitwise the two in
    // turn.
    z = Tensor::empty({cap, F}, dt, alloc, stream);
    h = fc1_.forward_with_activation(x, counts, st.fc1, z, options_.activation, probs, stream);
    y = fc2_.forward(z, counts, st.fc2, stream, out);
    // Recompute: FC2's context keeps a view of the freed z until backward hands it the rebuilt one
    // (set_saved_input); nothing reads it in between (FC2's dgrad needs only dy and W2).
    if (options_.recompute_activation) z.release_on(stream);
  }
  st.h = std::move(h);
  st.z = std::move(z);
  st.counts = counts;
  st.probs = probs;
  st.device = dev;
  st.active = true;
  st.backward_done = false;
  return y;
}

GroupedMLPBackward GroupedMLP::backward(GroupedMLPContext& ctx, const TensorView& dy, Stream stream,
                                        const TensorView& dgrad_out, const TensorView& dprobs_out) {
  GroupedMLPContext::State& st = *ctx.state_;
  ctx.check_resident("backward");
  GMOE_CHECK(st.active && !st.backward_done, "ctx: backward needs a context filled by forward (and not yet ",
             "consumed by backward)");
  const Device dev = st.device;
  const DType dt = fc1_.weight().dtype();
  const int64_t cap = st.h.view().size(0), H = hidden(), F = ffn();
  check_like_rows(dy, "dy", cap, H, dt, dev);
  if (dgrad_out.defined()) check_like_rows(dgrad_out, "dgrad_out", cap, H, dt, dev);
  if (dprobs_out.defined()) {
    GMOE_CHECK(st.probs.defined(), "dprobs_out: given, but forward had no probs (there is no dprobs)");
    GMOE_CHECK(dprobs_out.ndim == 1 && dprobs_out.size(0) == cap && dprobs_out.dtype == DType::f32,
               "dprobs_out: expected f32[", cap, "], got ", dprobs_out.str());
    GMOE_CHECK(dprobs_out.stride(0) == 1 || cap <= 1, "dprobs_out: must be contiguous, got stride ",
               dprobs_out.stride(0));
    check_same_device(dprobs_out.device, dev, "dprobs_out");
  }

  Allocator& alloc = allocator();
  GroupedMLPBackward result;
  const TensorView h = st.h.view();
  Tensor dh_amax;
  // Without probabilities, a rebuilt z or FP8, FC2's dgrad and the activation's backward are one
  // op (GroupedLinear::backward_with_activation: dh over h, bitwise the two in turn).
  const bool dgrad_activation = !fc2_.fp8() && !st.probs.defined() && !options_.recompute_activation &&
                                is_gated(options_.activation.kind);
  GroupedLinearBackward b2;
  Tensor z_rebuilt;
  if (dgrad_activation) {
    // FC2: dh = act'(h)·(dy·W2_e) over h, db2; dW2 now unless delayed.
    b2 = fc2_.backward_with_activation(st.fc2, dy, h, h, options_.activation, stream);
  } else {
    // FC2: dz = dy·W2_e, db2; dW2 now unless delayed (by the caller, or because z is rebuilt below).
    b2 = fc2_.backward(st.fc2, dy, stream);
    // Activation: dh over h (h is read for the last time here), dprobs, and z when not kept.
    if (options_.recompute_activation) z_rebuilt = Tensor::empty({cap, F}, dt, alloc, stream);
    if (st.probs.defined()) {
      result.dprobs =
          dprobs_out.defined() ? Tensor::wrap(dprobs_out) : Tensor::empty({cap}, DType::f32, alloc, stream);
    }
    // Tensorwise FP8: dh's amax from this pass, so that FC1's quantization of dh reads it once.
    if (fc1_.fp8()) dh_amax = activation_amax_scratch(fc1_.grad_quantization().recipe, num_experts(), alloc, stream);
    grouped_activation_backward(h, b2.dx, st.counts, h, options_.activation, st.probs, result.dprobs.view(),
                                z_rebuilt.view(), stream, &alloc, dh_amax.view());
  }
  b2.dx.release_on(stream);
  const bool fc2_delayed = options_.fc2.delay_wgrad;
  if (options_.recompute_activation) {
    st.z = std::move(z_rebuilt);
    fc2_.set_saved_input(st.fc2, st.z);
    // FC2 ran delayed only to wait for z: its weight gradient (and hook) now, before FC1's.
    if (!fc2_delayed) b2.grads = fc2_.backward_dw(st.fc2, stream);
  }
  result.grads.fc2 = std::move(b2.grads);
  if (!fc2_delayed) {
    st.z.release_on(stream);
    st.dy.release_on(stream);
  }
  // FC1: dx = dh·W1_e, db1; dW1 now unless delayed (dh stays in st.h until then).
  GroupedLinearBackward b1 = fc1_.backward(st.fc1, h, stream, dgrad_out, dh_amax.view());
  dh_amax.release_on(stream);
  result.dx = std::move(b1.dx);
  result.grads.fc1 = std::move(b1.grads);
  st.fc1_pending = options_.fc1.delay_wgrad;
  st.fc2_pending = fc2_delayed;
  if (!st.fc1_pending) st.h.release_on(stream);
  if (st.fc1_pending || st.fc2_pending) {
    st.backward_done = true;
    // backward_dw may run on another stream: order it after all of this backward (FC2's own event
    // is recorded before the activation step, which may still be writing the rebuilt z).
    if (!st.event.defined() || st.event.device() != dev) st.event = Event(dev);
    st.event.record(stream);
  } else {
    st.finish(stream);
  }
  return result;
}

GroupedMLPBackward GroupedMLP::backward(GroupedMLPContext& ctx, Tensor&& dy, Stream stream,
                                        const TensorView& dgrad_out, const TensorView& dprobs_out) {
  GroupedMLPContext::State& st = *ctx.state_;
  const TensorView v = dy.view();
  if (st.active && !st.backward_done) {  // else the backward below throws, and dy stays the caller's
    st.dy = std::move(dy);
    st.dy_stream = stream;
  }
  return backward(ctx, v, stream, dgrad_out, dprobs_out);
}

void GroupedMLP::check_set_saved_input(const GroupedMLPContext& ctx) const {
  const GroupedMLPContext::State& st = *ctx.state_;
  GMOE_CHECK(st.active && (!st.backward_done || st.fc1_pending),
             "ctx: set_saved_input needs a context filled by forward whose FC1 weight gradient is pending");
  GMOE_CHECK(options_.fc1.save_original_input, "set_saved_input: only with options.fc1.save_original_input (FC1 ",
             "keeps a reference to its input, not a copy)");
}

void GroupedMLP::set_saved_input(GroupedMLPContext& ctx, const TensorView& x) const {
  check_set_saved_input(ctx);
  fc1_.set_saved_input(ctx.state_->fc1, x);
}

void GroupedMLP::set_saved_input(GroupedMLPContext& ctx, Tensor&& x) const {
  check_set_saved_input(ctx);
  fc1_.set_saved_input(ctx.state_->fc1, std::move(x));
}

GroupedMLPGrads GroupedMLP::backward_dw(GroupedMLPContext& ctx, Stream stream) {
  GroupedMLPContext::State& st = *ctx.state_;
  GMOE_CHECK(st.backward_done, "ctx: backward_dw needs a context after a backward with a delayed weight gradient ",
             "(options.fc1.delay_wgrad or options.fc2.delay_wgrad)");
  ctx.check_resident("backward_dw");
  st.event.wait(stream);
  GroupedMLPGrads grads;
  if (st.fc2_pending) {
    grads.fc2 = fc2_.backward_dw(st.fc2, stream);
    st.z.release_on(stream);
    st.dy.release_on(stream);
  }
  if (st.fc1_pending) {
    grads.fc1 = fc1_.backward_dw(st.fc1, stream);
    st.h.release_on(stream);
  }
  st.finish(stream);
  return grads;
}

}  // namespace gmoe
