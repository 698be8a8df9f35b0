// python/csrc/autograd.cpp — the autograd formulas of gmoe's differentiable ops (the expert ops
// grouped_gemm_fprop, grouped_bias_add, grouped_activation_forward, grouped_gemm_fprop_of_activation,
// grouped_linear_forward; the routing ops router_topk, router_aux_loss, router_z_loss, permute,
// combine; the expert-parallel exchanges ep_dispatch and ep_combine), registered at the Autograd
// dispatch key in C++.
//
// Why C++: an autograd formula registered from Python (torch.library.register_autograd) runs Python
// on every call of the op, with or without gradients (the dispatcher boxes the arguments into
// Python objects, a Python kernel decides whether to record, then redispatches through Python
// again); under autograd it also builds a Python autograd.Function. Here the op costs the
// dispatcher's own work and no Python at all, so it is also cheap when called from C++/libtorch.
//
// Each forward (call_*) redispatches below autograd (AutoDispatchBelowADInplaceOrView) to the backend
// kernel, or under torch.compile to the fake kernel of gmoe/_meta.py; each backward calls the gmoe
// ops through the dispatcher, so that it runs gmoe's kernels and traces under torch.compile. No
// size is read on the host here: shapes may be symbolic (torch.compile's dynamic shapes).
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace gmoe_torch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

/// The typed dispatcher handle of gmoe::<name>, looked up once.
template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

at::Tensor call_fprop(const at::Tensor& x, at::TensorList w, const at::Tensor& counts, at::TensorList bias,
                      std::optional<at::ScalarType> out_dtype) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, at::TensorList, const at::Tensor&, at::TensorList,
                                              std::optional<at::ScalarType>)>("gmoe::grouped_gemm_fprop");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, w, counts, bias, out_dtype);
}

at::Tensor call_dgrad(const at::Tensor& dy, at::TensorList w, const at::Tensor& counts) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, at::TensorList, const at::Tensor&,
                                              std::optional<at::ScalarType>)>("gmoe::grouped_gemm_dgrad");
  return op.call(dy, w, counts, std::nullopt);
}

at::Tensor call_wgrad(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& counts, at::ScalarType out_dtype,
                      const std::optional<at::Tensor>& expert_mask = std::nullopt) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              std::optional<at::ScalarType>, const std::optional<at::Tensor>&)>(
      "gmoe::grouped_gemm_wgrad");
  return op.call(dy, x, counts, out_dtype, expert_mask);
}

at::Tensor call_bias_grad(const at::Tensor& dy, const at::Tensor& counts, at::ScalarType out_dtype) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, std::optional<at::ScalarType>)>(
      "gmoe::grouped_bias_grad");
  return op.call(dy, counts, out_dtype);
}

at::Tensor call_bias_add(const at::Tensor& y, at::TensorList bias, const at::Tensor& counts) {
  static const auto op =
      op_handle<at::Tensor(const at::Tensor&, at::TensorList, const at::Tensor&)>("gmoe::grouped_bias_add");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(y, bias, counts);
}

using ActivationForward = at::Tensor(const at::Tensor&, const at::Tensor&, const std::string&,
                                     const std::optional<at::Tensor>&, double, double, bool, int64_t);
using ActivationBackward = std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                              const at::Tensor&, const std::string&,
                                                              const std::optional<at::Tensor>&, bool, double, double,
                                                              bool, int64_t);

/// An optional argument from a saved tensor (undefined: absent).
std::optional<at::Tensor> optional_of(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

/// The activation's parameters as the ops take them, kept in a context's saved_data.
struct ActivationParams {
  std::string kind;
  double alpha = 0, limit = 0;
  bool gelu_tanh = false;
  int64_t glu_block = 0;

  void save(AutogradContext* ctx) const {
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["alpha"] = alpha;
    ctx->saved_data["limit"] = limit;
    ctx->saved_data["gelu_tanh"] = gelu_tanh;
    ctx->saved_data["glu_block"] = glu_block;
  }
  static bool saved(AutogradContext* ctx) { return ctx->saved_data.count("kind") != 0; }
  static ActivationParams load(AutogradContext* ctx) {
    return {ctx->saved_data["kind"].toStringRef(), ctx->saved_data["alpha"].toDouble(),
            ctx->saved_data["limit"].toDouble(), ctx->saved_data["gelu_tanh"].toBool(),
            ctx->saved_data["glu_block"].toInt()};
  }
};

/// What the expert-layer Functions with probabilities save for backward: their input (undefined
/// where it is not kept), the counts, the probabilities (undefined: absent), then the weights.
void save_operands(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& counts,
                   const std::optional<at::Tensor>& probs, at::TensorList w) {
  std::vector<at::Tensor> saved{input, counts, probs.value_or(at::Tensor())};
  saved.insert(saved.end(), w.begin(), w.end());
  ctx->save_for_backward(saved);
}
struct SavedOperands {
  at::Tensor input, counts;
  std::optional<at::Tensor> probs;
  std::vector<at::Tensor> w;
  static SavedOperands load(AutogradContext* ctx) {
    const variable_list saved = ctx->get_saved_variables();
    return {saved[0], saved[1], optional_of(saved[2]), std::vector<at::Tensor>(saved.begin() + 3, saved.end())};
  }
};

bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && requires_grad(*t); }
bool requires_grad(at::TensorList ts) {
  for (const at::Tensor& t : ts)
    if (requires_grad(t)) return true;
  return false;
}

/// Whether autograd records a call with these differentiable inputs. Where it does not (no grad
/// mode, or no input that requires grad) the kernels redispatch at once: an autograd Function
/// costs a node, its saved state and its output wrapping even when it records nothing.
template <class... Inputs>
bool recording(const Inputs&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

/// The argument positions of a Tensor[] among an op's differentiable inputs.
struct Span {
  int64_t begin = 0, size = 0;
  int64_t end() const { return begin + size; }
};

bool any_needs_grad(AutogradContext* ctx, Span s) {
  for (int64_t i = s.begin; i < s.end(); ++i)
    if (ctx->needs_input_grad(static_cast<size_t>(i))) return true;
  return false;
}

/// A stacked gradient [E, ...] in the layout of the list it is for: itself for one tensor of its
/// rank (stacked weights [E, N, K], a grouped bias [E, N]), else E per-expert views.
void append_in_layout(variable_list& out, const at::Tensor& g, bool stacked, int64_t count) {
  if (stacked) {
    out.push_back(g);
    return;
  }
  std::vector<at::Tensor> parts = g.unbind(0);
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == count, "gmoe autograd: ", parts.size(),
              " expert gradients for ", count, " tensors");
  for (at::Tensor& p : parts) out.push_back(std::move(p));
}

/// What the biases' gradients need to know of the biases (an empty list: no bias).
void save_bias_layout(AutogradContext* ctx, at::TensorList bias) {
  ctx->saved_data["num_biases"] = static_cast<int64_t>(bias.size());
  ctx->saved_data["bias_grouped"] = bias.size() == 1 && bias[0].dim() == 2;
  if (!bias.empty()) ctx->saved_data["bias_dtype"] = bias[0].scalar_type();
}

/// The biases' gradients (at positions `s` of the inputs) appended in their layout; undefined
/// (nothing computed) where no bias needs one.
void append_bias_grads(AutogradContext* ctx, variable_list& out, const at::Tensor& dy, const at::Tensor& counts,
                       Span s) {
  if (s.size == 0) return;
  if (!any_needs_grad(ctx, s)) {
    out.resize(out.size() + s.size);
    return;
  }
  const at::Tensor db = call_bias_grad(dy, counts, ctx->saved_data["bias_dtype"].toScalarType());
  append_in_layout(out, db, ctx->saved_data["bias_grouped"].toBool(), s.size);
}

/// The weights' gradients (at positions `s` of the inputs) appended in their layout:
/// wgrad(dy, input()), the GEMM's input made only where a weight needs its gradient.
template <class GemmInput>
void append_weight_grads(AutogradContext* ctx, variable_list& out, const at::Tensor& dy, GemmInput&& input,
                         const at::Tensor& counts, const std::vector<at::Tensor>& w, Span s,
                         const std::optional<at::Tensor>& expert_mask = std::nullopt) {
  if (!any_needs_grad(ctx, s)) {
    out.resize(out.size() + s.size);
    return;
  }
  append_in_layout(out, call_wgrad(dy, input(), counts, w[0].scalar_type(), expert_mask),
                   ctx->saved_data["weights_stacked"].toBool(), s.size);
}

// ---- grouped_gemm_fprop(x, w, counts, bias, out_dtype) -------------------------------------------

struct FpropFunction : torch::autograd::Function<FpropFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList w, const at::Tensor& counts,
                            at::TensorList bias, std::optional<at::ScalarType> out_dtype) {
    const at::Tensor y = call_fprop(x, w, counts, bias, out_dtype);
    std::vector<at::Tensor> saved{x, counts};
    saved.insert(saved.end(), w.begin(), w.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["weights_stacked"] = w.size() == 1 && w[0].dim() == 3;
    save_bias_layout(ctx, bias);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list saved = ctx->get_saved_variables();
    at::Tensor x = std::move(saved[0]);
    const at::Tensor& counts = saved[1];
    const std::vector<at::Tensor> w(saved.begin() + 2, saved.end());
    const int64_t nw = static_cast<int64_t>(w.size());
    const int64_t nb = ctx->saved_data["num_biases"].toInt();
    // Positions among the inputs: x, w..., counts, bias..., out_dtype.
    const Span weights{1, nw}, biases{nw + 2, nb};
    const at::Tensor dy = grads[0].to(x.scalar_type()).contiguous();
    // The weight gradient before dgrad: an x that only this backward holds (gathered again by the
    // saved-tensor hooks of MoELayer's regather_expert_input, or brought back by an offload) is
    // freed before dx's memory is taken (GroupedLinear::backward does the same).
    variable_list dw;
    append_weight_grads(ctx, dw, dy, [&] { return x; }, counts, w, weights);
    x.reset();
    variable_list out;
    out.reserve(nw + nb + 3);
    out.push_back(ctx->needs_input_grad(0) ? call_dgrad(dy, w, counts) : at::Tensor());
    out.insert(out.end(), dw.begin(), dw.end());
    out.emplace_back();  // counts
    append_bias_grads(ctx, out, dy, counts, biases);
    out.emplace_back();  // out_dtype
    return out;
  }
};

at::Tensor grouped_gemm_fprop_autograd(const at::Tensor& x, at::TensorList w, const at::Tensor& counts,
                                       at::TensorList bias, std::optional<at::ScalarType> out_dtype) {
  if (!recording(x, w, bias)) return call_fprop(x, w, counts, bias, out_dtype);
  return FpropFunction::apply(x, w, counts, bias, out_dtype);
}

// ---- grouped_bias_add(y, bias, counts) ----------------------------------------------------------

struct BiasAddFunction : torch::autograd::Function<BiasAddFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, at::TensorList bias, const at::Tensor& counts) {
    const at::Tensor out = call_bias_add(y, bias, counts);
    ctx->save_for_backward({counts});
    save_bias_layout(ctx, bias);
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor counts = ctx->get_saved_variables()[0];
    const int64_t nb = ctx->saved_data["num_biases"].toInt();
    const at::Tensor dy = grads[0].contiguous();
    variable_list out;
    out.reserve(nb + 2);
    out.push_back(ctx->needs_input_grad(0) ? dy : at::Tensor());
    append_bias_grads(ctx, out, dy, counts, Span{1, nb});  // positions: y, bias..., counts
    out.emplace_back();                                    // counts
    return out;
  }
};

at::Tensor grouped_bias_add_autograd(const at::Tensor& y, at::TensorList bias, const at::Tensor& counts) {
  if (!recording(y, bias)) return call_bias_add(y, bias, counts);
  return BiasAddFunction::apply(y, bias, counts);
}

// ---- grouped_activation_forward(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block) -----

at::Tensor call_activation(const at::Tensor& h, const at::Tensor& counts, const std::string& kind,
                           const std::optional<at::Tensor>& probs, double alpha, double limit, bool gelu_tanh,
                           int64_t glu_block) {
  static const auto op = op_handle<ActivationForward>("gmoe::grouped_activation_forward");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block);
}

at::Tensor call_activation(const at::Tensor& h, const at::Tensor& counts, const ActivationParams& a,
                           const std::optional<at::Tensor>& probs) {
  return call_activation(h, counts, a.kind, probs, a.alpha, a.limit, a.gelu_tanh, a.glu_block);
}

struct ActivationFunction : torch::autograd::Function<ActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& counts,
                            const std::string& kind, const std::optional<at::Tensor>& probs, double alpha,
                            double limit, bool gelu_tanh, int64_t glu_block) {
    const at::Tensor z = call_activation(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block);
    ctx->save_for_backward({h, counts, probs.value_or(at::Tensor())});
    ActivationParams{kind, alpha, limit, gelu_tanh, glu_block}.save(ctx);
    ctx->saved_data["need_dprobs"] = probs.has_value() && probs->defined() && probs->requires_grad();
    return z;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<ActivationBackward>("gmoe::grouped_activation_backward");
    const variable_list saved = ctx->get_saved_variables();
    const bool need_dprobs = ctx->saved_data["need_dprobs"].toBool();
    const ActivationParams act = ActivationParams::load(ctx);
    auto [dh, dprobs] = op.call(saved[0], grads[0].contiguous(), saved[1], act.kind, optional_of(saved[2]),
                                need_dprobs, act.alpha, act.limit, act.gelu_tanh, act.glu_block);
    // Positions: h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block.
    return {dh, at::Tensor(), at::Tensor(), need_dprobs ? dprobs : at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor()};
  }
};

at::Tensor grouped_activation_forward_autograd(const at::Tensor& h, const at::Tensor& counts, const std::string& kind,
                                               const std::optional<at::Tensor>& probs, double alpha, double limit,
                                               bool gelu_tanh, int64_t glu_block) {
  if (!recording(h, probs)) return call_activation(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block);
  return ActivationFunction::apply(h, counts, kind, probs, alpha, limit, gelu_tanh, glu_block);
}

// ---- grouped_gemm_fprop_of_activation(h, w, counts, bias, kind, probs, alpha, limit, gelu_tanh,
//                                       glu_block) ----------------------------------------------------
// y = fprop(z, w, bias) with z = act(h)·probs made inside the op: only h and probs are kept, and
// backward makes z again for the weight gradient (the same op on the same operands, so bitwise the
// forward's) and runs the activation's backward on dz for dh and d(probs).

using FpropOfActivation = at::Tensor(const at::Tensor&, at::TensorList, const at::Tensor&, at::TensorList,
                                     const std::string&, const std::optional<at::Tensor>&, double, double, bool,
                                     int64_t);

at::Tensor call_fprop_of_activation(const at::Tensor& h, at::TensorList w, const at::Tensor& counts,
                                    at::TensorList bias, const std::string& kind,
                                    const std::optional<at::Tensor>& probs, double alpha, double limit,
                                    bool gelu_tanh, int64_t glu_block) {
  static const auto op = op_handle<FpropOfActivation>("gmoe::grouped_gemm_fprop_of_activation");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(h, w, counts, bias, kind, probs, alpha, limit, gelu_tanh, glu_block);
}

struct FpropOfActivationFunction : torch::autograd::Function<FpropOfActivationFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, at::TensorList w, const at::Tensor& counts,
                            at::TensorList bias, const std::string& kind, const std::optional<at::Tensor>& probs,
                            double alpha, double limit, bool gelu_tanh, int64_t glu_block) {
    const at::Tensor y = call_fprop_of_activation(h, w, counts, bias, kind, probs, alpha, limit, gelu_tanh, glu_block);
    save_operands(ctx, h, counts, probs, w);
    ctx->saved_data["weights_stacked"] = w.size() == 1 && w[0].dim() == 3;
    save_bias_layout(ctx, bias);
    ActivationParams{kind, alpha, limit, gelu_tanh, glu_block}.save(ctx);
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto act_backward = op_handle<ActivationBackward>("gmoe::grouped_activation_backward");
    const SavedOperands saved = SavedOperands::load(ctx);
    const at::Tensor& h = saved.input;
    const at::Tensor& counts = saved.counts;
    const std::optional<at::Tensor>& probs = saved.probs;
    const std::vector<at::Tensor>& w = saved.w;
    const int64_t nw = static_cast<int64_t>(w.size());
    const int64_t nb = ctx->saved_data["num_biases"].toInt();
    const ActivationParams act = ActivationParams::load(ctx);
    // Positions among the inputs: h, w..., counts, bias..., kind, probs (when given), alpha, limit,
    // gelu_tanh, glu_block; needs_input_grad counts the tensors only: h, w..., counts, bias..., probs.
    const Span weights{1, nw}, biases{nw + 2, nb};
    const bool need_dprobs = probs.has_value() && ctx->needs_input_grad(static_cast<size_t>(nw + nb + 2));
    const at::Tensor dy = grads[0].to(h.scalar_type()).contiguous();
    variable_list out;
    out.reserve(nw + nb + 8);
    at::Tensor dh, dprobs;
    if (ctx->needs_input_grad(0) || need_dprobs) {
      std::tie(dh, dprobs) = act_backward.call(h, call_dgrad(dy, w, counts).contiguous(), counts, act.kind, probs,
                                               need_dprobs, act.alpha, act.limit, act.gelu_tanh, act.glu_block);
    }
    out.push_back(ctx->needs_input_grad(0) ? dh : at::Tensor());
    append_weight_grads(ctx, out, dy, [&] { return call_activation(h, counts, act, probs); }, counts, w, weights);
    out.emplace_back();  // counts
    append_bias_grads(ctx, out, dy, counts, biases);
    out.emplace_back();  // kind
    out.push_back(need_dprobs ? dprobs : at::Tensor());
    out.resize(out.size() + 4);  // alpha, limit, gelu_tanh, glu_block
    return out;
  }
};

at::Tensor grouped_gemm_fprop_of_activation_autograd(const at::Tensor& h, at::TensorList w, const at::Tensor& counts,
                                                     at::TensorList bias, const std::string& kind,
                                                     const std::optional<at::Tensor>& probs, double alpha,
                                                     double limit, bool gelu_tanh, int64_t glu_block) {
  if (!recording(h, w, bias, probs)) {
    return call_fprop_of_activation(h, w, counts, bias, kind, probs, alpha, limit, gelu_tanh, glu_block);
  }
  return FpropOfActivationFunction::apply(h, w, counts, bias, kind, probs, alpha, limit, gelu_tanh, glu_block);
}

// ---- grouped_linear_forward(x, w, counts, bias, w_main_grad, bias_main_grad, w_placeholder,
//                             bias_placeholder, accumulate, delay_wgrad, activation, probs, alpha,
//                             limit, gelu_tanh, glu_block) ----------------------------------------
// GroupedLinear's forward where its gradients go elsewhere than autograd's .grad (Megatron):
// y = fprop(x, w, bias), or with `activation` fprop(act(x)·probs, w, bias) with z made again in
// backward (grouped_gemm_fprop_of_activation's formula). Backward: dx (and dprobs) as those ops';
// the biases' gradient added into (accumulate) or written over bias_main_grad where given; the
// weights' gradient into w_main_grad with grouped_gemm_wgrad_ where given, not at all with
// delay_wgrad (the module takes dy from a hook on y for backward_dw). Where a main_grad took a
// gradient, autograd gets the placeholder given for the parameter (Megatron's DDP hooks run on
// it), or nothing. main_grad is written even where autograd asks for no parameter gradient
// (torch.autograd.grad of the inputs only), as Megatron's modules do. The main_grads and
// placeholders are kept outside save_for_backward: other backwards add into main_grad between
// this forward and its backward (gradient accumulation), which is no error here. expert_mask:
// the weight gradient's, experts with mask 0 skipped (main_grad untouched; zeros in a new
// gradient), as grouped_gemm_wgrad(_)'s "skip".

at::Tensor call_linear(const at::Tensor& x, at::TensorList w, const at::Tensor& counts, at::TensorList bias,
                       const std::optional<std::string>& activation, const std::optional<at::Tensor>& probs,
                       double alpha, double limit, bool gelu_tanh, int64_t glu_block) {
  if (activation.has_value()) {
    return call_fprop_of_activation(x, w, counts, bias, *activation, probs, alpha, limit, gelu_tanh, glu_block);
  }
  return call_fprop(x, w, counts, bias, std::nullopt);
}

c10::List<at::Tensor> list_of(at::TensorList ts) { return c10::List<at::Tensor>(ts.vec()); }

struct LinearFunction : torch::autograd::Function<LinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList w, const at::Tensor& counts,
                            at::TensorList bias, at::TensorList w_main_grad, at::TensorList bias_main_grad,
                            at::TensorList w_placeholder, at::TensorList bias_placeholder, bool accumulate,
                            bool delay_wgrad, const std::optional<std::string>& activation,
                            const std::optional<at::Tensor>& probs, double alpha, double limit, bool gelu_tanh,
                            int64_t glu_block, const std::optional<at::Tensor>& expert_mask) {
    const at::Tensor y = call_linear(x, w, counts, bias, activation, probs, alpha, limit, gelu_tanh, glu_block);
    // With delay_wgrad the module keeps x for backward_dw itself (through the saved-tensor hooks,
    // so that an offload moves it once); only the activation's backward reads it here.
    const bool keep_x = !delay_wgrad || activation.has_value();
    save_operands(ctx, keep_x ? x : at::Tensor(), counts, probs, w);
    ctx->saved_data["weights_stacked"] = w.size() == 1 && w[0].dim() == 3;
    save_bias_layout(ctx, bias);
    ctx->saved_data["w_main_grad"] = list_of(w_main_grad);
    ctx->saved_data["bias_main_grad"] = list_of(bias_main_grad);
    ctx->saved_data["w_placeholder"] = list_of(w_placeholder);
    ctx->saved_data["bias_placeholder"] = list_of(bias_placeholder);
    ctx->saved_data["accumulate"] = accumulate;
    ctx->saved_data["delay_wgrad"] = delay_wgrad;
    ctx->saved_data["x_dtype"] = x.scalar_type();
    // Read when the weight gradient runs (a captured graph's mask is updated in place between
    // replays), so kept outside save_for_backward like the main_grads.
    if (expert_mask.has_value()) ctx->saved_data["expert_mask"] = *expert_mask;
    ctx->saved_data["counts_main_grads"] = static_cast<int64_t>(w_main_grad.size() + bias_main_grad.size() +
                                                               w_placeholder.size() + bias_placeholder.size());
    if (activation.has_value()) ActivationParams{*activation, alpha, limit, gelu_tanh, glu_block}.save(ctx);
    return y;
  }

  /// Where a main_grad took the gradients of `n` parameters: their placeholders, or nothing.
  static void append_placeholders(variable_list& out, const c10::List<at::Tensor>& placeholders, int64_t n) {
    if (placeholders.empty()) {
      out.resize(out.size() + n);
      return;
    }
    for (const at::Tensor& p : placeholders) out.push_back(p);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto act_backward = op_handle<ActivationBackward>("gmoe::grouped_activation_backward");
    static const auto wgrad_into = op_handle<void(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  at::TensorList, bool, const std::optional<at::Tensor>&,
                                                  const std::string&, std::optional<at::TensorList>)>(
        "gmoe::grouped_gemm_wgrad_");
    SavedOperands saved = SavedOperands::load(ctx);
    const at::Tensor& x = saved.input;
    const at::Tensor& counts = saved.counts;
    const std::optional<at::Tensor>& probs = saved.probs;
    const std::vector<at::Tensor>& w = saved.w;
    const int64_t nw = static_cast<int64_t>(w.size());
    const int64_t nb = ctx->saved_data["num_biases"].toInt();
    static const std::string kSkip = "skip";
    const auto w_main_grad = ctx->saved_data["w_main_grad"].toTensorList();
    const auto bias_main_grad = ctx->saved_data["bias_main_grad"].toTensorList();
    const bool accumulate = ctx->saved_data["accumulate"].toBool();
    const bool delay_wgrad = ctx->saved_data["delay_wgrad"].toBool();
    const bool with_activation = ActivationParams::saved(ctx);
    const std::optional<at::Tensor> expert_mask =
        ctx->saved_data.count("expert_mask") != 0 ? std::optional<at::Tensor>(ctx->saved_data["expert_mask"].toTensor())
                                                   : std::nullopt;
    // Tensor positions (needs_input_grad): x, w..., counts, bias..., the main_grad and placeholder
    // lists, probs.
    const Span weights{1, nw}, biases{nw + 2, nb};
    const size_t probs_at = static_cast<size_t>(nw + nb + 2 + ctx->saved_data["counts_main_grads"].toInt());
    const bool need_dprobs = probs.has_value() && ctx->needs_input_grad(probs_at);
    const at::Tensor dy = grads[0].to(ctx->saved_data["x_dtype"].toScalarType()).contiguous();

    const ActivationParams act = with_activation ? ActivationParams::load(ctx) : ActivationParams{};
    auto gemm_input = [&] {
      return with_activation ? call_activation(x, counts, act, probs) : x;
    };

    variable_list dw;  // the weights' gradients (or their placeholders, or nothing when delayed)
    auto weight_grads = [&] {
      if (delay_wgrad) {
        dw.resize(static_cast<size_t>(nw));  // backward_dw computes them
      } else if (!w_main_grad.empty()) {
        wgrad_into.call(dy, gemm_input(), counts, w_main_grad.vec(), accumulate, expert_mask, kSkip, std::nullopt);
        append_placeholders(dw, ctx->saved_data["w_placeholder"].toTensorList(), nw);
      } else {
        append_weight_grads(ctx, dw, dy, gemm_input, counts, w, weights, expert_mask);
      }
    };
    // Without an activation (x is the GEMM's input and dgrad does not read it) the weight gradient
    // comes first and x is dropped before dgrad, as in grouped_gemm_fprop's backward.
    if (!with_activation) {
      weight_grads();
      saved.input.reset();
    }
    variable_list out;
    out.reserve(static_cast<size_t>(probs_at) + 8);
    at::Tensor dx, dprobs;
    if (ctx->needs_input_grad(0) || need_dprobs) {
      dx = call_dgrad(dy, w, counts);
      if (with_activation) {
        std::tie(dx, dprobs) = act_backward.call(x, dx.contiguous(), counts, act.kind, probs, need_dprobs, act.alpha,
                                                 act.limit, act.gelu_tanh, act.glu_block);
      }
    }
    out.push_back(ctx->needs_input_grad(0) ? dx : at::Tensor());
    if (with_activation) weight_grads();
    out.insert(out.end(), dw.begin(), dw.end());
    out.emplace_back();  // counts

    if (!bias_main_grad.empty()) {
      const at::Tensor db = call_bias_grad(dy, counts, ctx->saved_data["bias_dtype"].toScalarType());
      const bool grouped = ctx->saved_data["bias_grouped"].toBool();
      for (int64_t i = 0; i < nb; ++i) {
        at::Tensor main_grad = bias_main_grad[static_cast<size_t>(i)];
        const at::Tensor g = grouped ? db : db.select(0, i);
        if (accumulate) {
          main_grad.add_(g);
        } else {
          main_grad.copy_(g);
        }
      }
      append_placeholders(out, ctx->saved_data["bias_placeholder"].toTensorList(), nb);
    } else {
      append_bias_grads(ctx, out, dy, counts, biases);
    }
    // The main_grad and placeholder lists, accumulate, delay_wgrad, activation, then probs, alpha,
    // limit, gelu_tanh, glu_block.
    out.resize(out.size() + static_cast<size_t>(ctx->saved_data["counts_main_grads"].toInt()) + 3);
    out.push_back(need_dprobs ? dprobs : at::Tensor());
    out.resize(out.size() + 5);  // alpha, limit, gelu_tanh, glu_block, expert_mask
    return out;
  }
};

at::Tensor grouped_linear_forward_autograd(const at::Tensor& x, at::TensorList w, const at::Tensor& counts,
                                           at::TensorList bias, at::TensorList w_main_grad,
                                           at::TensorList bias_main_grad, at::TensorList w_placeholder,
                                           at::TensorList bias_placeholder, bool accumulate, bool delay_wgrad,
                                           const std::optional<std::string>& activation,
                                           const std::optional<at::Tensor>& probs, double alpha, double limit,
                                           bool gelu_tanh, int64_t glu_block,
                                           const std::optional<at::Tensor>& expert_mask) {
  if (!recording(x, w, bias, probs)) {
    return call_linear(x, w, counts, bias, activation, probs, alpha, limit, gelu_tanh, glu_block);
  }
  return LinearFunction::apply(x, w, counts, bias, w_main_grad, bias_main_grad, w_placeholder, bias_placeholder,
                               accumulate, delay_wgrad, activation, probs, alpha, limit, gelu_tanh, glu_block,
                               expert_mask);
}

// ---- routing ---------------------------------------------------------------------------------------
// The integer outputs (ids, counts, the map, dropped) have no gradient (autograd leaves integer
// outputs out by their dtype); the selection is a constant. The gradients of the outputs that the
// loss does not reach stay undefined (no zeros are made for them), as these formulas read only the
// probabilities' and rows' gradients.


using RouterTopk = std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, int64_t, const std::string&, bool,
                                                                  int64_t, int64_t, double,
                                                                  const std::optional<at::Tensor>&);

// router_topk(logits, top_k, score, normalize, n_group, topk_group, scaling_factor, score_bias)
//   -> (probs, ids, counts)
std::tuple<at::Tensor, at::Tensor, at::Tensor> call_router_topk(const at::Tensor& logits, int64_t top_k,
                                                                const std::string& score, bool normalize,
                                                                int64_t n_group, int64_t topk_group,
                                                                double scaling_factor,
                                                                const std::optional<at::Tensor>& score_bias) {
  static const auto op = op_handle<RouterTopk>("gmoe::router_topk");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(logits, top_k, score, normalize, n_group, topk_group, scaling_factor, score_bias);
}

struct RouterTopkFunction : torch::autograd::Function<RouterTopkFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& logits, int64_t top_k, const std::string& score,
                               bool normalize, int64_t n_group, int64_t topk_group, double scaling_factor,
                               const std::optional<at::Tensor>& score_bias) {
    auto [probs, ids, counts] =
        call_router_topk(logits, top_k, score, normalize, n_group, topk_group, scaling_factor, score_bias);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({logits, ids});
    ctx->saved_data["score"] = score;
    ctx->saved_data["normalize"] = normalize;
    ctx->saved_data["scaling_factor"] = scaling_factor;
    return {probs, ids, counts};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                const std::string&, bool, double, std::optional<at::ScalarType>)>(
        "gmoe::router_topk_backward");
    variable_list out(8);  // logits, top_k, score, normalize, n_group, topk_group, scaling_factor, score_bias
    if (!grads[0].defined() || !ctx->needs_input_grad(0)) return out;
    const variable_list saved = ctx->get_saved_variables();
    out[0] = op.call(saved[0], saved[1], grads[0].to(at::kFloat).contiguous(), ctx->saved_data["score"].toStringRef(),
                     ctx->saved_data["normalize"].toBool(), ctx->saved_data["scaling_factor"].toDouble(),
                     std::nullopt);
    return out;
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> router_topk_autograd(const at::Tensor& logits, int64_t top_k,
                                                                    const std::string& score, bool normalize,
                                                                    int64_t n_group, int64_t topk_group,
                                                                    double scaling_factor,
                                                                    const std::optional<at::Tensor>& score_bias) {
  if (!recording(logits)) {
    return call_router_topk(logits, top_k, score, normalize, n_group, topk_group, scaling_factor, score_bias);
  }
  const variable_list r = RouterTopkFunction::apply(logits, top_k, score, normalize, n_group, topk_group,
                                                    scaling_factor, score_bias);
  return {r[0], r[1], r[2]};
}

// router_aux_loss(logits, counts, top_k, score, coeff)
at::Tensor call_aux_loss(const at::Tensor& logits, const at::Tensor& counts, int64_t top_k, const std::string& score,
                         double coeff) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const std::string&,
                                              double)>("gmoe::router_aux_loss");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(logits, counts, top_k, score, coeff);
}

struct AuxLossFunction : torch::autograd::Function<AuxLossFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, const at::Tensor& counts, int64_t top_k,
                            const std::string& score, double coeff) {
    const at::Tensor loss = call_aux_loss(logits, counts, top_k, score, coeff);
    ctx->save_for_backward({logits, counts});
    ctx->saved_data["top_k"] = top_k;
    ctx->saved_data["score"] = score;
    ctx->saved_data["coeff"] = coeff;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
                                                const std::string&, double, std::optional<at::ScalarType>)>(
        "gmoe::router_aux_loss_backward");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor dlogits = op.call(saved[0], saved[1], grads[0].to(at::kFloat).contiguous(),
                                       ctx->saved_data["top_k"].toInt(), ctx->saved_data["score"].toStringRef(),
                                       ctx->saved_data["coeff"].toDouble(), std::nullopt);
    return {dlogits, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor router_aux_loss_autograd(const at::Tensor& logits, const at::Tensor& counts, int64_t top_k,
                                    const std::string& score, double coeff) {
  if (!recording(logits)) return call_aux_loss(logits, counts, top_k, score, coeff);
  return AuxLossFunction::apply(logits, counts, top_k, score, coeff);
}

// router_z_loss(logits, coeff)
at::Tensor call_z_loss(const at::Tensor& logits, double coeff) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, double)>("gmoe::router_z_loss");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(logits, coeff);
}

struct ZLossFunction : torch::autograd::Function<ZLossFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, double coeff) {
    const at::Tensor loss = call_z_loss(logits, coeff);
    ctx->save_for_backward({logits});
    ctx->saved_data["coeff"] = coeff;
    return loss;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, double,
                                                std::optional<at::ScalarType>)>("gmoe::router_z_loss_backward");
    const at::Tensor dlogits = op.call(ctx->get_saved_variables()[0], grads[0].to(at::kFloat).contiguous(),
                                       ctx->saved_data["coeff"].toDouble(), std::nullopt);
    return {dlogits, at::Tensor()};
  }
};

at::Tensor router_z_loss_autograd(const at::Tensor& logits, double coeff) {
  if (!recording(logits)) return call_z_loss(logits, coeff);
  return ZLossFunction::apply(logits, coeff);
}

using Permute = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, const std::optional<at::Tensor>&);

// permute(x, ids, num_experts, pad_multiple, capacity_factor, probs)
//   -> (permuted, counts, row_of, src_token, permuted_probs, dropped)
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> call_permute(
    const at::Tensor& x, const at::Tensor& ids, int64_t num_experts, int64_t pad_multiple, double capacity_factor,
    const std::optional<at::Tensor>& probs) {
  static const auto op = op_handle<Permute>("gmoe::permute");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(x, ids, num_experts, pad_multiple, capacity_factor, probs);
}

struct PermuteFunction : torch::autograd::Function<PermuteFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& ids, int64_t num_experts,
                               int64_t pad_multiple, double capacity_factor, const std::optional<at::Tensor>& probs) {
    auto [permuted, counts, row_of, src_token, permuted_probs, dropped] =
        call_permute(x, ids, num_experts, pad_multiple, capacity_factor, probs);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({row_of, src_token});
    ctx->saved_data["cols"] = x.sym_size(1);
    ctx->saved_data["x_dtype"] = x.scalar_type();
    ctx->saved_data["need_dprobs"] = requires_grad(probs);
    return {permuted, counts, row_of, src_token, permuted_probs, dropped};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&)>(
        "gmoe::permute_backward");
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor& row_of = saved[0];
    const at::Tensor& src_token = saved[1];
    const at::ScalarType x_dtype = ctx->saved_data["x_dtype"].toScalarType();
    at::Tensor dpermuted = grads[0];
    if (!dpermuted.defined()) {
      dpermuted = at::zeros_symint({src_token.sym_size(0), ctx->saved_data["cols"].toSymInt()},
                                   row_of.options().dtype(x_dtype));
    }
    const bool want_dprobs = ctx->saved_data["need_dprobs"].toBool() && grads[4].defined();
    auto [dx, dprobs] = op.call(dpermuted.to(x_dtype).contiguous(), row_of, src_token,
                                want_dprobs ? optional_of(grads[4].to(at::kFloat).contiguous()) : std::nullopt);
    // Positions: x, ids, num_experts, pad_multiple, capacity_factor, probs.
    return {dx, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), want_dprobs ? dprobs : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> permute_autograd(
    const at::Tensor& x, const at::Tensor& ids, int64_t num_experts, int64_t pad_multiple, double capacity_factor,
    const std::optional<at::Tensor>& probs) {
  if (!recording(x, probs)) return call_permute(x, ids, num_experts, pad_multiple, capacity_factor, probs);
  const variable_list r = PermuteFunction::apply(x, ids, num_experts, pad_multiple, capacity_factor, probs);
  return {r[0], r[1], r[2], r[3], r[4], r[5]};
}

// combine(expert_out, row_of, src_token, probs)
at::Tensor call_combine(const at::Tensor& expert_out, const at::Tensor& row_of, const at::Tensor& src_token,
                        const std::optional<at::Tensor>& probs) {
  static const auto op = op_handle<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                              const std::optional<at::Tensor>&)>("gmoe::combine");
  at::AutoDispatchBelowADInplaceOrView below;
  return op.call(expert_out, row_of, src_token, probs);
}

struct CombineFunction : torch::autograd::Function<CombineFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& expert_out, const at::Tensor& row_of,
                            const at::Tensor& src_token, const std::optional<at::Tensor>& probs) {
    const at::Tensor out = call_combine(expert_out, row_of, src_token, probs);
    const bool need_dprobs = requires_grad(probs);
    // expert_out lives on to backward only for the probabilities' gradient.
    ctx->save_for_backward({row_of, src_token, probs.value_or(at::Tensor()), need_dprobs ? expert_out : at::Tensor()});
    ctx->saved_data["need_dprobs"] = need_dprobs;
    ctx->saved_data["out_dtype"] = expert_out.scalar_type();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto op = op_handle<std::tuple<at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
        const std::optional<at::Tensor>&, bool)>("gmoe::combine_backward");
    const variable_list saved = ctx->get_saved_variables();
    const bool need_dprobs = ctx->saved_data["need_dprobs"].toBool();
    auto [dexpert_out, dprobs] =
        op.call(grads[0].to(ctx->saved_data["out_dtype"].toScalarType()).contiguous(), saved[0], saved[1],
                optional_of(saved[2]), optional_of(saved[3]), need_dprobs);
    // Positions: expert_out, row_of, src_token, probs.
    return {dexpert_out, at::Tensor(), at::Tensor(), need_dprobs ? dprobs : at::Tensor()};
  }
};

at::Tensor combine_autograd(const at::Tensor& expert_out, const at::Tensor& row_of, const at::Tensor& src_token,
                            const std::optional<at::Tensor>& probs) {
  if (!recording(expert_out, probs)) return call_combine(expert_out, row_of, src_token, probs);
  return CombineFunction::apply(expert_out, row_of, src_token, probs);
}

// ep_dispatch / ep_combine(group, counts_all, local_counts, rows, scalars) -> (rows, scalars): each
// one's backward is the other with the same plan (the same ranks exchange the same rows back).
using EpExchange = std::tuple<at::Tensor, at::Tensor>(int64_t, const at::Tensor&, const at::Tensor&,
                                                      const at::Tensor&, const std::optional<at::Tensor>&);

c10::TypedOperatorHandle<EpExchange> ep_exchange_op(bool dispatch) {
  static const auto dispatch_op = op_handle<EpExchange>("gmoe::ep_dispatch");
  static const auto combine_op = op_handle<EpExchange>("gmoe::ep_combine");
  return dispatch ? dispatch_op : combine_op;
}

template <bool kDispatch>
struct EpExchangeFunction : torch::autograd::Function<EpExchangeFunction<kDispatch>> {
  static variable_list forward(AutogradContext* ctx, int64_t group, const at::Tensor& counts_all,
                               const at::Tensor& local_counts, const at::Tensor& rows,
                               const std::optional<at::Tensor>& scalars) {
    at::Tensor out, out_scalars;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      std::tie(out, out_scalars) = ep_exchange_op(kDispatch).call(group, counts_all, local_counts, rows, scalars);
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({counts_all, local_counts});
    ctx->saved_data["group"] = group;
    ctx->saved_data["rows_dtype"] = rows.scalar_type();
    ctx->saved_data["out_rows"] = out.sym_size(0);  // for a missing gradient's zeros
    ctx->saved_data["cols"] = out.sym_size(1);
    ctx->saved_data["has_scalars"] = scalars.has_value();
    ctx->saved_data["need_dscalars"] = requires_grad(scalars);
    if (!scalars.has_value()) ctx->mark_non_differentiable({out_scalars});  // the empty [0] placeholder
    return {out, out_scalars};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::ScalarType rows_dtype = ctx->saved_data["rows_dtype"].toScalarType();
    // The reverse exchange is collective: every rank runs it with the same arguments, so a missing
    // gradient (an output this rank did not use) is zeros, never a skipped exchange.
    at::Tensor drows = grads[0].defined()
                           ? grads[0].to(rows_dtype).contiguous()
                           : at::zeros_symint({ctx->saved_data["out_rows"].toSymInt(), ctx->saved_data["cols"].toSymInt()},
                                              saved[0].options().dtype(rows_dtype));
    std::optional<at::Tensor> dscalars;
    if (ctx->saved_data["has_scalars"].toBool()) {
      dscalars = grads[1].defined() ? grads[1].to(at::kFloat).contiguous()
                                    : at::zeros_symint({drows.sym_size(0)}, saved[0].options().dtype(at::kFloat));
    }
    auto [drows_in, dscalars_in] =
        ep_exchange_op(!kDispatch).call(ctx->saved_data["group"].toInt(), saved[0], saved[1], drows, dscalars);
    // Positions: group, counts_all, local_counts, rows, scalars.
    return {at::Tensor(), at::Tensor(), at::Tensor(), drows_in,
            ctx->saved_data["need_dscalars"].toBool() ? dscalars_in : at::Tensor()};
  }
};

template <bool kDispatch>
std::tuple<at::Tensor, at::Tensor> ep_exchange_autograd(int64_t group, const at::Tensor& counts_all,
                                                        const at::Tensor& local_counts, const at::Tensor& rows,
                                                        const std::optional<at::Tensor>& scalars) {
  if (!recording(rows, scalars)) {
    at::AutoDispatchBelowADInplaceOrView below;
    return ep_exchange_op(kDispatch).call(group, counts_all, local_counts, rows, scalars);
  }
  const variable_list r = EpExchangeFunction<kDispatch>::apply(group, counts_all, local_counts, rows, scalars);
  return {r[0], r[1]};
}

}  // namespace
}  // namespace gmoe_torch

TORCH_LIBRARY_IMPL(gmoe, Autograd, m) {
  m.impl("grouped_gemm_fprop", &gmoe_torch::grouped_gemm_fprop_autograd);
  m.impl("grouped_bias_add", &gmoe_torch::grouped_bias_add_autograd);
  m.impl("grouped_activation_forward", &gmoe_torch::grouped_activation_forward_autograd);
  m.impl("grouped_gemm_fprop_of_activation", &gmoe_torch::grouped_gemm_fprop_of_activation_autograd);
  m.impl("grouped_linear_forward", &gmoe_torch::grouped_linear_forward_autograd);
  m.impl("router_topk", &gmoe_torch::router_topk_autograd);
  m.impl("router_aux_loss", &gmoe_torch::router_aux_loss_autograd);
  m.impl("router_z_loss", &gmoe_torch::router_z_loss_autograd);
  m.impl("permute", &gmoe_torch::permute_autograd);
  m.impl("combine", &gmoe_torch::combine_autograd);
  m.impl("ep_dispatch", &gmoe_torch::ep_exchange_autograd<true>);
  m.impl("ep_combine", &gmoe_torch::ep_exchange_autograd<false>);
}
