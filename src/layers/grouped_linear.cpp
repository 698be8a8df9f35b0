// src/layers/grouped_linear.cpp — GroupedLinear: backend-agnostic orchestration over the grouped
// ops (GEMM passes, bias add and gradient), with the context that forward saves for backward.
#include "gmoe/grouped_linear.h"

#include <cstdint>

#include "common/activation_internal.h"
#include "common/checks.h"
#include "gmoe/copy.h"
#include "gmoe/error.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped_gemm.h"
#include "layers/offload_slots.h"

namespace gmoe {

struct GroupedLinearContext::State {
  bool active = false;          // forward ran; the weight gradient is not done yet
  bool wgrad_pending = false;   // backward ran with delay_wgrad; backward_dw not yet
  Device device{};
  TensorView x;                 // the saved input (the copy, or the caller's with save_original_input)
  Tensor x_copy;
  TensorView counts;             // the caller's, or counts_upload's when given on the host
  Tensor counts_upload;          // counts given on the host, uploaded by forward
  TensorView dy;                // delayed: the caller's dy, by reference
  GroupedLinearGrads grads;     // delayed: where backward_dw writes, and the bias gradients
  Event event;                  // recorded at the end of a delayed backward, waited for by backward_dw
  // FP8 recipes: the columnwise copies the weight gradient reads (x's from forward unless
  // save_original_input; dy's from backward when delayed).
  Fp8GroupedTensor x_cols, dy_cols;

  static void release_fp8(Fp8GroupedTensor& t, Stream stream) {
    if (t.storage) t.storage->reset_on(stream);
    t = Fp8GroupedTensor();
  }

  // Releases the saved input (what the weight gradient alone reads), ordered on the stream of the
  // last work that read it.
  void release_input(Stream stream) {
    x_copy.release_on(stream);
    release_fp8(x_cols, stream);
    x = TensorView();
  }
  // Releases what forward saved, ordered on the stream of the last work that read it.
  void release_saved(Stream stream) {
    release_input(stream);
    counts_upload.release_on(stream);
    release_fp8(dy_cols, stream);
    dy = TensorView();
    active = false;
    wgrad_pending = false;
  }
};

GroupedLinearContext::GroupedLinearContext() : state_(std::make_unique<State>()) {}
GroupedLinearContext::~GroupedLinearContext() = default;
GroupedLinearContext::GroupedLinearContext(GroupedLinearContext&&) noexcept = default;
GroupedLinearContext& GroupedLinearContext::operator=(GroupedLinearContext&&) noexcept = default;
bool GroupedLinearContext::active() const { return state_ && state_->active; }

void GroupedLinearContext::collect(OffloadSlots& slots) {
  State& st = *state_;
  slots.tensor(st.x_copy);
  slots.fp8(st.x_cols);
  slots.fp8(st.dy_cols);
  for (TensorView* v : {&st.x, &st.counts, &st.dy}) slots.view(*v);
}

namespace {

constexpr std::size_t kPackAlign = 256;  // every view in the packed gradient buffer is 256-byte aligned
std::size_t align_up(std::size_t v) { return (v + kPackAlign - 1) / kPackAlign * kPackAlign; }

// E experts of `elems` elements each, back to back with each expert's start 256-byte aligned: the
// stride between experts (elements) and the bytes of all.
struct ExpertPack {
  int64_t stride = 0;
  std::size_t bytes = 0;
};
ExpertPack pack_experts(int64_t E, int64_t elems, DType dt) {
  const std::size_t size = dtype_size(dt);
  const std::size_t expert_bytes = align_up(std::size_t(elems) * size);
  return ExpertPack{static_cast<int64_t>(expert_bytes / size), std::size_t(E) * expert_bytes};
}

// Points the views `slots` (planned by an fp8 layout, data == nullptr) into one allocation, each
// 256-byte aligned. The rowwise and columnwise copies of one quantization get separate allocations
// so that the rowwise one can go as soon as its GEMM has read it.
std::shared_ptr<Buffer> place(std::initializer_list<TensorView*> slots, Allocator& alloc, Stream stream) {
  std::size_t total = 0;
  for (TensorView* v : slots) total += align_up(static_cast<std::size_t>(v->nbytes()));
  auto buffer = std::make_shared<Buffer>(alloc, total, stream);
  char* p = static_cast<char*>(buffer->data());
  for (TensorView* v : slots) {
    v->data = total == 0 ? nullptr : p;
    p += align_up(static_cast<std::size_t>(v->nbytes()));
  }
  return buffer;
}

// An operand made by allocate_fp8_operand and quantized by the caller, checked against what the
// layer reads: the recipe and format, `cols` columns, on the layer's device, with its rowwise copy
// (and the columnwise one when `need_cols`).
void check_fp8_operand(const Fp8Grouped& q, const char* name, Fp8Recipe recipe, DType format, int64_t cols,
                       Device device, bool need_cols) {
  GMOE_CHECK(q.recipe == recipe && q.format == format, name, ": expected a ", fp8_recipe_name(recipe), " ",
             dtype_name(format), " quantization, got ", fp8_recipe_name(q.recipe), " ", dtype_name(q.format));
  GMOE_CHECK(q.cols == cols && q.capacity >= 0, name, ": expected ", cols, " columns, got [", q.capacity, ", ",
             q.cols, "]");
  GMOE_CHECK(q.data.defined() && q.scale_inv.defined(), name, ": the rowwise copy (data, scale_inv) is absent");
  check_same_device(q.data.device, device, name);
  if (need_cols || q.data_t.defined()) {
    GMOE_CHECK(q.data_t.defined() && q.scale_inv_t.defined() && q.padded_offsets.defined(), name,
               ": the columnwise copy (data_t, scale_inv_t, padded_offsets) is ", need_cols ? "needed" : "incomplete");
  }
}

}  // namespace

const char* linear_recipe_name(LinearRecipe recipe) {
  switch (recipe) {
    case LinearRecipe::native: return "native";
    case LinearRecipe::fp8_tensorwise: return "fp8_tensorwise";
    case LinearRecipe::fp8_blockwise: return "fp8_blockwise";
    case LinearRecipe::mxfp8: return "mxfp8";
  }
  return "unknown";
}

Fp8Recipe fp8_recipe_of(LinearRecipe recipe) {
  switch (recipe) {
    case LinearRecipe::fp8_tensorwise: return Fp8Recipe::tensorwise;
    case LinearRecipe::fp8_blockwise: return Fp8Recipe::blockwise;
    case LinearRecipe::mxfp8: return Fp8Recipe::mxfp8;
    case LinearRecipe::native: break;
  }
  GMOE_FAIL("recipe: ", linear_recipe_name(recipe), " is not an FP8 recipe");
}

LinearRecipe linear_recipe_from_name(const std::string& name) {
  for (LinearRecipe r : {LinearRecipe::native, LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise,
                         LinearRecipe::mxfp8}) {
    if (name == linear_recipe_name(r)) return r;
  }
  GMOE_FAIL("unknown recipe '", name, "': expected native, fp8_tensorwise, fp8_blockwise or mxfp8");
}

GroupedLinear::GroupedLinear(ExpertWeights weight, ExpertBias bias, GroupedLinearOptions options)
    : weight_(std::move(weight)), bias_(std::move(bias)), options_(std::move(options)) {
  check_expert_weights(weight_, "weight");
  const Device dev = weight_.device();
  const DType dt = weight_.dtype();
  GMOE_CHECK(dt == DType::bf16 || dt == DType::f16 || (dt == DType::f32 && dev.is_cpu()),
             "weight: dtype not supported: expected bf16 or f16 (f32 on the CPU), got ", dtype_name(dt));
  if (bias_.defined()) {
    check_expert_bias(bias_, "bias", weight_.num_experts(), weight_.rows(), dt, dev);
  }
  if (options_.main_grad.is_stacked() || !options_.main_grad.list.empty()) {
    const ExpertWeights& mg = options_.main_grad;
    check_expert_weights(mg, "options.main_grad");
    GMOE_CHECK(mg.num_experts() == weight_.num_experts() && mg.rows() == weight_.rows() &&
                   mg.cols() == weight_.cols(),
               "options.main_grad: expected ", weight_.num_experts(), " experts of [", weight_.rows(), ", ",
               weight_.cols(), "], got ", mg.num_experts(), " of [", mg.rows(), ", ", mg.cols(), "]");
    GMOE_CHECK(mg.dtype() == DType::f32, "options.main_grad: expected f32, got ", dtype_name(mg.dtype()));
    check_same_device(mg.device(), dev, "options.main_grad");
  }
  if (options_.expert_mask.defined()) {
    const TensorView& m = options_.expert_mask;
    GMOE_CHECK(m.ndim == 1 && m.size(0) == weight_.num_experts() && m.dtype == DType::i32,
               "options.expert_mask: expected i32[", weight_.num_experts(), "], got ", m.str());
    check_same_device(m.device, dev, "options.expert_mask");
  }
  const int mo = static_cast<int>(options_.masked_off);
  GMOE_CHECK(mo >= 0 && mo <= static_cast<int>(MaskedOffWgrad::fresh), "options.masked_off: unknown value ", mo);
  GMOE_CHECK(options_.masked_off == MaskedOffWgrad::skip ||
                 (options_.expert_mask.defined() && (options_.main_grad.is_stacked() || !options_.main_grad.list.empty())),
             "options.masked_off: fresh needs main_grad and expert_mask (the experts with mask 0 get a fresh ",
             "gradient instead of main_grad's)");
  if (fp8()) {
    const int r = static_cast<int>(options_.recipe);
    GMOE_CHECK(r >= 0 && r <= static_cast<int>(LinearRecipe::mxfp8), "options.recipe: unknown value ", r);
    GMOE_CHECK(dt == DType::bf16 || (dt == DType::f32 && dev.is_cpu()), "weight: the ",
               linear_recipe_name(options_.recipe), " recipe needs bf16 weights (f32 on the CPU): its FP8 ",
               "GEMMs write bf16; got ", dtype_name(dt));
    GMOE_CHECK(options_.grad_format == DType::e4m3 || options_.grad_format == DType::e5m2,
               "options.grad_format: expected e4m3 or e5m2, got ", dtype_name(options_.grad_format));
    if (dev.is_cuda()) {
      GMOE_CHECK(weight_.rows() % 16 == 0 && weight_.cols() % 16 == 0, "weight: the CUDA FP8 GEMMs need ",
                 "in_features and out_features that are multiples of 16, got [", weight_.rows(), ", ",
                 weight_.cols(), "]");
    }
    // The cache lives as long as the layer, at one address (graph replays quantize into it).
    Fp8Weights layout = fp8_weights_layout(num_experts(), out_features(), in_features(),
                                           fp8_options(DType::e4m3, true, true), dev);
    fp8_weight_.storage = place({&layout.data, &layout.scale_inv, &layout.data_t, &layout.scale_inv_t},
                                allocator(), nullptr);
    fp8_weight_.q = layout;
    // Set-up, not the hot path: make the allocation (stream-ordered on the default stream) usable
    // from every stream the layer will run on.
    synchronize_stream(nullptr, dev);
  }
}

Fp8QuantizeOptions GroupedLinear::fp8_options(DType format, bool rowwise, bool columnwise) const {
  Fp8QuantizeOptions o;
  o.recipe = fp8_recipe_of(options_.recipe);
  o.format = format;
  o.rowwise = rowwise;
  o.columnwise = columnwise;
  o.pow2_scales = options_.fp8_pow2_scales;
  return o;
}

Fp8QuantizeOptions GroupedLinear::input_quantization() const {
  GMOE_CHECK(fp8(), "input_quantization: the native recipe quantizes nothing");
  return fp8_options(DType::e4m3, true, fp8_keeps_x_cols());
}

Fp8QuantizeOptions GroupedLinear::grad_quantization() const {
  GMOE_CHECK(fp8(), "grad_quantization: the native recipe quantizes nothing");
  return fp8_options(options_.grad_format, true, options_.fp8_wgrad);
}

void GroupedLinear::quantize_weight(Stream stream) {
  if (!fp8()) return;
  quantize_weights(weight_, fp8_options(DType::e4m3, true, true), stream, &allocator(), &fp8_weight_.q);
  fp8_weight_valid_ = true;
}

Allocator& GroupedLinear::allocator() const {
  return options_.allocator ? *options_.allocator : default_allocator(weight_.device());
}

Tensor GroupedLinear::forward(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx,
                              Stream stream, const TensorView& out) {
  return forward_impl(x, counts, ctx, stream, out, nullptr);
}

Tensor GroupedLinear::forward_with_activation(const TensorView& x, const TensorView& counts,
                                              GroupedLinearContext& ctx, const TensorView& z,
                                              const ActivationOptions& activation, const TensorView& probs,
                                              Stream stream, const TensorView& out) {
  // What the activation needs of z and probs, before anything runs (the ops check the rest).
  check_rows(x, "x");
  check_rows(z, "z");
  const int64_t F = z.size(1);
  check_activation_options(activation, F, "activation");
  GMOE_CHECK(activation_input_cols(activation.kind, F) == out_features(), "z: ", activation_name(activation.kind),
             " of the layer's ", out_features(), " output columns gives ",
             is_gated(activation.kind) ? out_features() / 2 : out_features(), " columns, got ", z.shape_str());
  GMOE_CHECK(z.size(0) == x.size(0) && z.dtype == x.dtype, "z: expected ", dtype_name(x.dtype), "[", x.size(0),
             ", ", F, "] (x's rows and dtype), got ", z.str());
  check_same_device(z.device, weight_.device(), "z");
  if (probs.defined()) check_f32_vector(probs, "probs", x.size(0), "one value per row", weight_.device());
  const ActivationOut act{z, activation, probs};
  return forward_impl(x, counts, ctx, stream, out, &act);
}

Tensor GroupedLinear::forward_impl(const TensorView& x, const TensorView& given_counts, GroupedLinearContext& ctx,
                                   Stream stream, const TensorView& out, const ActivationOut* act) {
  GroupedLinearContext::State& st = *ctx.state_;
  ctx.check_resident("forward");
  GMOE_CHECK(!st.active, "ctx: still holds a forward whose weight gradient was not computed (call backward",
             st.wgrad_pending ? "_dw" : "", " first, or use one context per forward in flight)");
  check_rows(x, "x");
  GMOE_CHECK(x.dtype == weight_.dtype(), "x: expected dtype ", dtype_name(weight_.dtype()), " (the weight's), got ",
             dtype_name(x.dtype));
  const int64_t cap = x.size(0), N = out_features();
  Allocator& alloc = allocator();
  TensorView counts = given_counts;
  if (counts.defined() && counts.device.is_cpu() && weight_.device().is_cuda()) {
    // Counts given on the host: uploaded once (pinned, stream-ordered), kept until the weight gradient.
    check_counts(counts, "counts", Device::cpu());
    st.counts_upload = upload_counts(counts, weight_.device(), stream, &alloc);
    counts = st.counts_upload.view();
  }
  if (fp8()) {
    // One pass: the rowwise copy for fprop, and the columnwise one that the weight gradient reads
    // (unless x itself is kept, or the weight gradient is native).
    const Fp8QuantizeOptions qo = input_quantization();
    GroupedLinearFp8Operand xq = allocate_fp8_operand(cap, x.size(1), qo, stream);
    quantize_grouped(GroupedRows{x, counts}, qo, stream, &alloc, &xq.q);
    Tensor y = forward_quantized(std::move(xq), counts, ctx, stream, out, act);
    if (!fp8_keeps_x_cols()) save_input(ctx, x, stream);
    return y;
  }
  Tensor y = out.defined() ? Tensor::wrap(out) : Tensor::empty({cap, N}, x.dtype, alloc, stream);
  if (act != nullptr) {
    grouped_gemm_fprop_activation(x, weight_, bias_, counts, y, act->z, act->options, act->probs, stream, &alloc);
  } else {
    grouped_gemm_fprop(x, weight_, bias_, counts, y, stream, &alloc);  // the bias in the epilogue
  }
  st.device = x.device;
  st.counts = counts;
  save_input(ctx, x, stream);
  st.active = true;
  return y;
}

GroupedLinearFp8Operand GroupedLinear::allocate_fp8_operand(int64_t rows, int64_t cols, const Fp8QuantizeOptions& o,
                                                            Stream stream) const {
  GMOE_CHECK(fp8(), "allocate_fp8_operand: the native recipe takes no FP8 operands");
  GroupedLinearFp8Operand r;
  r.q = fp8_grouped_layout(rows, cols, num_experts(), o, weight_.device());
  Allocator& alloc = allocator();
  if (o.columnwise) {
    if (o.rowwise) r.rows = place({&r.q.data, &r.q.scale_inv}, alloc, stream);
    r.cols = place({&r.q.data_t, &r.q.scale_inv_t, &r.q.padded_offsets}, alloc, stream);
  } else {
    r.rows = place({&r.q.data, &r.q.scale_inv, &r.q.padded_offsets}, alloc, stream);
  }
  return r;
}

Tensor GroupedLinear::forward_fp8(GroupedLinearFp8Operand x, const TensorView& counts, GroupedLinearContext& ctx,
                                  Stream stream, const TensorView& out) {
  GMOE_CHECK(fp8(), "forward_fp8: the layer's recipe is native");
  check_fp8_operand(x.q, "x", fp8_recipe_of(options_.recipe), DType::e4m3, in_features(), weight_.device(), false);
  GMOE_CHECK((x.q.data_t.defined() && options_.fp8_wgrad) || options_.save_original_input, "x: without a ",
             "columnwise copy for the FP8 weight gradient the layer needs options.save_original_input (the input in ",
             "its own precision comes later, by set_saved_input)");
  check_counts(counts, "counts", weight_.device());
  GMOE_CHECK(counts.size(0) == num_experts(), "counts: expected one count per expert (", num_experts(), "), got ",
             counts.size(0));
  return forward_quantized(std::move(x), counts, ctx, stream, out, nullptr);
}

Tensor GroupedLinear::forward_quantized(GroupedLinearFp8Operand xq, const TensorView& counts,
                                        GroupedLinearContext& ctx, Stream stream, const TensorView& out,
                                        const ActivationOut* act) {
  GroupedLinearContext::State& st = *ctx.state_;
  ctx.check_resident("forward");
  GMOE_CHECK(!st.active, "ctx: still holds a forward whose weight gradient was not computed");
  const Device dev = weight_.device();
  const DType dt = weight_.dtype();
  const int64_t cap = xq.q.capacity;
  Allocator& alloc = allocator();
  Tensor y = out.defined() ? Tensor::wrap(out) : Tensor::empty({cap, out_features()}, dt, alloc, stream);
  if (!fp8_weight_valid_) quantize_weight(stream);
  fp8_grouped_gemm_fprop(xq.q, fp8_weight_.q, bias_, counts, y, fp8_gemm_options(), stream, &alloc);  // bias: see there
  if (xq.q.data_t.defined()) {
    st.x_cols.q = xq.q;
    st.x_cols.q.data = TensorView();
    st.x_cols.q.scale_inv = TensorView();
    st.x_cols.storage = std::move(xq.cols);
  }
  if (act != nullptr) grouped_activation_forward(y, counts, act->z, act->options, act->probs, stream, &alloc);
  st.device = dev;
  st.counts = counts;
  st.x = TensorView(nullptr, dt, dev, {cap, in_features()});  // shape only (see the header)
  st.active = true;
  return y;
}

void GroupedLinear::save_input(GroupedLinearContext& ctx, const TensorView& x, Stream stream) const {
  GroupedLinearContext::State& st = *ctx.state_;
  if (options_.save_original_input) {
    st.x = x;
    return;
  }
  st.x_copy = Tensor::empty({x.size(0), x.size(1)}, x.dtype, allocator(), stream);
  copy_rows(st.x_copy, x, stream);
  st.x = st.x_copy.view();
}

GroupedLinearGrads GroupedLinear::allocate_grads(Stream stream) const {
  const bool main_grad = options_.main_grad.is_stacked() || !options_.main_grad.list.empty();
  const bool masked_off_fresh = main_grad && options_.masked_off == MaskedOffWgrad::fresh;
  const bool fresh_weight = !main_grad || masked_off_fresh;
  const int64_t E = num_experts(), N = out_features(), K = in_features();
  const Device dev = weight_.device();
  // Fresh gradients are in the weights' dtype; the masked-off experts' ones share the main_grad's
  // launch, and so its f32.
  const DType wdt = masked_off_fresh ? DType::f32 : weight_.dtype();
  const ExpertPack wpack = pack_experts(E, N * K, wdt);
  // The biases stay one [E, N] block in either layout (the FP8 path copies db into it at once).
  const std::size_t b_bytes = bias_.defined() ? align_up(std::size_t(E * N) * dtype_size(bias_.dtype())) : 0;
  const std::size_t w_bytes = fresh_weight ? wpack.bytes : 0;
  GroupedLinearGrads g;
  if (w_bytes + b_bytes != 0) g.storage = std::make_shared<Buffer>(allocator(), w_bytes + b_bytes, stream);
  char* base = g.storage ? static_cast<char*>(g.storage->data()) : nullptr;
  GMOE_CHECK(reinterpret_cast<std::uintptr_t>(base) % kPackAlign == 0, "options.allocator: returned ", g.storage->bytes(),
             " bytes at ", static_cast<void*>(base), ", not ", kPackAlign, "-byte aligned (the Allocator contract)");
  if (fresh_weight) {
    ExpertWeights fresh;
    if (weight_.is_stacked()) {
      fresh = ExpertWeights::from_stacked(TensorView(base, wdt, dev, {E, N, K}, {wpack.stride, K, 1}));
    } else {
      std::vector<TensorView> list;
      for (int64_t e = 0; e < E; ++e) {
        list.emplace_back(base + std::size_t(e * wpack.stride) * dtype_size(wdt), wdt, dev,
                          std::initializer_list<int64_t>{N, K});
      }
      fresh = ExpertWeights::from_list(std::move(list));
    }
    if (options_.expert_mask.defined() && !main_grad) {
      // Masked-out experts are skipped by the kernel: give their fresh views a defined value (the
      // padding between experts included: one pass over the packed weights).
      fill_zero(TensorView(base, wdt, dev, {static_cast<int64_t>(w_bytes / dtype_size(wdt))}), stream);
    }
    (masked_off_fresh ? g.masked_off_weight : g.weight) = std::move(fresh);
  }
  if (main_grad) g.weight = options_.main_grad;
  if (bias_.defined()) {
    char* bbase = base + w_bytes;
    const DType bdt = bias_.dtype();
    if (bias_.is_grouped()) {
      g.bias = ExpertBias::from_grouped(TensorView(bbase, bdt, dev, {E, N}));
    } else {
      std::vector<TensorView> list;
      for (int64_t e = 0; e < E; ++e) {
        list.emplace_back(bbase + std::size_t(e * N) * dtype_size(bdt), bdt, dev, std::initializer_list<int64_t>{N});
      }
      g.bias = ExpertBias::from_list(std::move(list));
    }
  }
  return g;
}

void GroupedLinear::compute_wgrad(GroupedLinearContext& ctx, GroupedLinearGrads& grads, Stream stream) const {
  GroupedLinearContext::State& st = *ctx.state_;
  const bool native_wgrad = !fp8() || !options_.fp8_wgrad;
  GMOE_CHECK((!native_wgrad && st.x_cols.q.data_t.defined()) || st.x.data != nullptr || st.x.numel() == 0,
             "ctx: forward_fp8 kept no input for the weight gradient: hand it over with set_saved_input first");
  WgradOptions opt;
  const bool main_grad = options_.main_grad.is_stacked() || !options_.main_grad.list.empty();
  opt.accumulate = main_grad && options_.accumulate;
  opt.expert_mask = options_.expert_mask;
  if (grads.masked_off_weight.is_stacked() || !grads.masked_off_weight.list.empty()) {
    opt.masked_off = MaskedOffWgrad::fresh;
    opt.fresh_dw = grads.masked_off_weight;
  }
  if (native_wgrad) {
    grouped_gemm_wgrad(st.dy, st.x, st.counts, grads.weight, opt, stream, &allocator());
    return;
  }
  if (!st.x_cols.q.data_t.defined()) {
    // save_original_input: x was kept in its own precision; quantize it along the tokens now.
    st.x_cols = quantize_grouped(GroupedRows{st.x, st.counts}, fp8_options(DType::e4m3, false, true), stream,
                                 &allocator());
  }
  fp8_grouped_gemm_wgrad(st.dy_cols.q, st.x_cols.q, st.counts, grads.weight, opt, stream, &allocator());
}

void GroupedLinear::check_active_for_backward(const GroupedLinearContext& ctx) const {
  const GroupedLinearContext::State& st = *ctx.state_;
  ctx.check_resident("backward");
  GMOE_CHECK(st.active && !st.wgrad_pending, "ctx: backward needs a context filled by forward (and not yet ",
             "consumed by backward)");
}

GroupedLinearBackward GroupedLinear::backward(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                              const TensorView& dgrad_out, const TensorView& dy_amax) {
  if (dy_amax.defined()) {
    check_f32_vector(dy_amax, "dy_amax", num_experts(), "one amax per expert", weight_.device());
  }
  return backward_impl(ctx, dy, stream, dgrad_out, dy_amax, nullptr);
}

GroupedLinearBackward GroupedLinear::backward_with_activation(GroupedLinearContext& ctx, const TensorView& dy,
                                                              const TensorView& h, const TensorView& dh,
                                                              const ActivationOptions& activation, Stream stream) {
  GMOE_CHECK(!fp8(), "backward_with_activation: the activation's backward fuses into the native recipe's dgrad, ",
             "not into the ", linear_recipe_name(options_.recipe), " one");
  const ActivationBackwardIn act{h, dh, activation};
  return backward_impl(ctx, dy, stream, {}, {}, &act);
}

GroupedLinearBackward GroupedLinear::backward_impl(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                                   const TensorView& dgrad_out, const TensorView& dy_amax,
                                                   const ActivationBackwardIn* act) {
  GroupedLinearContext::State& st = *ctx.state_;
  check_active_for_backward(ctx);
  check_rows(dy, "dy");
  GMOE_CHECK(dy.size(0) == st.x.size(0) && dy.size(1) == out_features(), "dy: expected [", st.x.size(0), ", ",
             out_features(), "], got ", dy.shape_str());
  Allocator& alloc = allocator();
  if (act != nullptr) {
    grouped_gemm_dgrad_activation_backward(dy, weight_, st.counts, act->h, act->dh, act->options, stream, &alloc);
    return finish_backward(ctx, dy, Tensor(), stream, {});
  }
  auto make_dx = [&] {
    return dgrad_out.defined() ? Tensor::wrap(dgrad_out)
                               : Tensor::empty({dy.size(0), in_features()}, dy.dtype, alloc, stream);
  };
  if (!fp8() && !options_.delay_wgrad) {
    // The weight gradient before dgrad: an input that the context owns (its copy of x, or one
    // handed over by set_saved_input) is freed before dx's memory is taken, so that backward never
    // holds both. The counts stay until dgrad has read them.
    GroupedLinearGrads grads = begin_grads(ctx, dy, stream, {});
    compute_wgrad(ctx, grads, stream);
    st.release_input(stream);
    Tensor dx = make_dx();
    grouped_gemm_dgrad(dy, weight_, st.counts, dx, stream, &alloc);
    return end_backward(ctx, std::move(dx), std::move(grads), stream);
  }
  Tensor dx = make_dx();
  Tensor db;  // FP8 with a bias: the bias gradient, from the quantization's pass over dy
  if (fp8()) {
    GMOE_CHECK(dy.dtype == weight_.dtype(), "dy: expected dtype ", dtype_name(weight_.dtype()), " (the weight's), got ",
               dtype_name(dy.dtype));
    // One pass over dy: the rowwise copy for dgrad, the columnwise one for an FP8 weight gradient,
    // and the bias gradient (dy's column sums). That goes to a small buffer of its own, copied into
    // the gradients later: allocating them here would hold the weight gradient and dy's rowwise
    // copy (freed after dgrad) at once, raising the peak by that copy.
    Fp8QuantizeOptions qo = grad_quantization();
    if (qo.recipe == Fp8Recipe::tensorwise) qo.amax = dy_amax;
    GroupedLinearFp8Operand dyq = allocate_fp8_operand(dy.size(0), dy.size(1), qo, stream);
    ExpertBias column_sums;
    if (bias_.defined()) {
      db = Tensor::empty({num_experts(), out_features()}, bias_.dtype(), alloc, stream);
      column_sums = ExpertBias::from_grouped(db.view());
    }
    quantize_grouped(GroupedRows{dy, st.counts}, qo, stream, &alloc, &dyq.q, column_sums);
    fp8_dgrad(ctx, std::move(dyq), dx, stream);
  } else {
    grouped_gemm_dgrad(dy, weight_, st.counts, dx, stream, &alloc);
  }
  return finish_backward(ctx, dy, std::move(dx), stream, db.view());
}

GroupedLinearBackward GroupedLinear::backward_fp8(GroupedLinearContext& ctx, GroupedLinearFp8Operand dy,
                                                  Stream stream, const TensorView& dgrad_out) {
  GroupedLinearContext::State& st = *ctx.state_;
  check_active_for_backward(ctx);
  GMOE_CHECK(fp8() && options_.fp8_wgrad && !bias_.defined(),
             "backward_fp8: needs an FP8 recipe with the FP8 weight gradient and no bias");
  check_fp8_operand(dy.q, "dy", fp8_recipe_of(options_.recipe), options_.grad_format, out_features(),
                    weight_.device(), true);
  const int64_t cap = st.x.size(0);
  GMOE_CHECK(dy.q.capacity == cap, "dy: expected ", cap, " rows (forward's), got ", dy.q.capacity);
  const DType dt = weight_.dtype();
  Tensor dx = dgrad_out.defined() ? Tensor::wrap(dgrad_out)
                                  : Tensor::empty({cap, in_features()}, dt, allocator(), stream);
  fp8_dgrad(ctx, std::move(dy), dx, stream);
  return finish_backward(ctx, TensorView(nullptr, dt, st.device, {cap, out_features()}), std::move(dx), stream, {});
}

void GroupedLinear::fp8_dgrad(GroupedLinearContext& ctx, GroupedLinearFp8Operand dyq, const TensorView& dx,
                              Stream stream) const {
  GroupedLinearContext::State& st = *ctx.state_;
  Allocator& alloc = allocator();
  fp8_grouped_gemm_dgrad(dyq.q, fp8_weight_.q, st.counts, dx, fp8_gemm_options(), stream, &alloc);
  if (dyq.q.data_t.defined()) {
    st.dy_cols.q = dyq.q;
    st.dy_cols.q.data = TensorView();
    st.dy_cols.q.scale_inv = TensorView();
    st.dy_cols.storage = std::move(dyq.cols);
  }
}

// The gradients' memory, the bias gradient (`db` when already made, [E, N], else from dy), and dy
// kept for the weight gradient.
GroupedLinearGrads GroupedLinear::begin_grads(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                              const TensorView& db) const {
  GroupedLinearContext::State& st = *ctx.state_;
  GroupedLinearGrads grads = allocate_grads(stream);
  if (bias_.defined() && db.defined()) {
    // allocate_grads lays out either bias layout as one [E, N] block.
    copy_rows(TensorView(grads.bias.expert(0).data, db.dtype, db.device, {db.size(0), db.size(1)}), db, stream);
  } else if (bias_.defined()) {
    grouped_bias_grad(dy, st.counts, grads.bias, stream, &allocator());
  }
  st.dy = dy;
  return grads;
}

// After dx: the bias gradient, then the weight gradient now or, delayed, dy kept for backward_dw.
GroupedLinearBackward GroupedLinear::finish_backward(GroupedLinearContext& ctx, const TensorView& dy, Tensor dx,
                                                     Stream stream, const TensorView& db) {
  GroupedLinearContext::State& st = *ctx.state_;
  GroupedLinearBackward result;
  result.dx = std::move(dx);
  GroupedLinearGrads grads = begin_grads(ctx, dy, stream, db);
  if (options_.delay_wgrad) {
    st.grads = grads;
    st.wgrad_pending = true;
    if (!st.event.defined() || st.event.device() != st.device) st.event = Event(st.device);
    st.event.record(stream);
    result.grads.bias = grads.bias;
    result.grads.storage = grads.storage;
    return result;
  }
  compute_wgrad(ctx, grads, stream);
  return end_backward(ctx, std::move(result.dx), std::move(grads), stream);
}

// The weight gradient done: what forward saved released, the hook, the result.
GroupedLinearBackward GroupedLinear::end_backward(GroupedLinearContext& ctx, Tensor dx, GroupedLinearGrads grads,
                                                  Stream stream) const {
  ctx.state_->release_saved(stream);
  if (options_.wgrad_hook) options_.wgrad_hook(grads, stream);
  GroupedLinearBackward result;
  result.dx = std::move(dx);
  result.grads = std::move(grads);
  return result;
}

void GroupedLinear::set_saved_input(GroupedLinearContext& ctx, const TensorView& x) const {
  GroupedLinearContext::State& st = *ctx.state_;
  GMOE_CHECK(st.active, "ctx: set_saved_input needs a context filled by forward whose weight gradient is pending");
  ctx.check_resident("set_saved_input");
  GMOE_CHECK(options_.save_original_input, "set_saved_input: only with options.save_original_input (the layer ",
             "keeps a reference to its input, not a copy)");
  check_rows(x, "x");
  GMOE_CHECK(x.dtype == st.x.dtype && x.size(0) == st.x.size(0) && x.size(1) == st.x.size(1) &&
                 x.device == st.x.device,
             "x: expected ", dtype_name(st.x.dtype), "[", st.x.size(0), ", ", st.x.size(1), "] on ",
             st.x.device.str(), " (the input saved by forward), got ", x.str());
  st.x = x;
}

void GroupedLinear::set_saved_input(GroupedLinearContext& ctx, Tensor&& x) const {
  set_saved_input(ctx, x.view());
  ctx.state_->x_copy = std::move(x);
}

GroupedLinearGrads GroupedLinear::backward_dw(GroupedLinearContext& ctx, Stream stream) {
  GroupedLinearContext::State& st = *ctx.state_;
  GMOE_CHECK(st.wgrad_pending, "ctx: backward_dw needs a context after a backward with delay_wgrad");
  ctx.check_resident("backward_dw");
  st.event.wait(stream);
  GroupedLinearGrads grads = std::move(st.grads);
  st.grads = GroupedLinearGrads();
  // The packed gradients were allocated on backward's stream and are written on this one: their
  // free (when the last reference goes) waits for this stream's work.
  if (grads.storage) grads.storage->record_stream(stream);
  compute_wgrad(ctx, grads, stream);
  st.release_saved(stream);
  if (options_.wgrad_hook) options_.wgrad_hook(grads, stream);
  return grads;
}

}  // namespace gmoe
