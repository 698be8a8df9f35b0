// src/layers/grouped_linear.cpp — GroupedLinear: backend-agnostic orchestration over the grouped
// ops (GEMM passes, bias add and gradient), with the context that forward saves for backward.
#include "gmoe/grouped_linear.h"

#include <cstring>

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe {

struct GroupedLinearContext::State {
  bool active = false;          // forward ran; the weight gradient is not done yet
  bool wgrad_pending = false;   // backward ran with delay_wgrad; backward_dw not yet
  Device device{};
  TensorView x;                 // the saved input (the copy, or the caller's with save_original_input)
  Tensor x_copy;
  TensorView counts;
  TensorView dy;                // delayed: the caller's dy, by reference
  GroupedLinearGrads grads;     // delayed: where backward_dw writes, and the bias gradients
  void* event = nullptr;        // CUDA: recorded at the end of a delayed backward

  ~State() {
    if (event != nullptr) cuda_backend::event_destroy(event);
  }

  // Releases what forward saved, ordered on the stream of the last work that read it.
  void release_saved(Stream stream) {
    x_copy.release_on(stream);
    x = TensorView();
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

namespace {

constexpr std::size_t kPackAlign = 256;  // every view in the packed gradient buffer is 256-byte aligned
std::size_t align_up(std::size_t v) { return (v + kPackAlign - 1) / kPackAlign * kPackAlign; }

}  // namespace

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
}

Allocator& GroupedLinear::allocator() const {
  return options_.allocator ? *options_.allocator : default_allocator(weight_.device());
}

Tensor GroupedLinear::forward(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx,
                              Stream stream, const TensorView& out) {
  GroupedLinearContext::State& st = *ctx.state_;
  GMOE_CHECK(!st.active, "ctx: still holds a forward whose weight gradient was not computed (call backward",
             st.wgrad_pending ? "_dw" : "", " first, or use one context per forward in flight)");
  check_rows(x, "x");
  GMOE_CHECK(x.dtype == weight_.dtype(), "x: expected dtype ", dtype_name(weight_.dtype()), " (the weight's), got ",
             dtype_name(x.dtype));
  const int64_t cap = x.size(0), N = out_features();
  Allocator& alloc = allocator();
  Tensor y = out.defined() ? Tensor::wrap(out) : Tensor::empty({cap, N}, x.dtype, alloc, stream);
  grouped_gemm_fprop(x, weight_, counts, y, stream, &alloc);
  if (bias_.defined()) grouped_bias_add(y, bias_, counts, stream, &alloc);

  st.device = x.device;
  st.counts = counts;
  if (options_.save_original_input) {
    st.x = x;
  } else {
    st.x_copy = Tensor::empty({cap, x.size(1)}, x.dtype, alloc, stream);
    if (x.device.is_cpu()) {
      cpu_backend::copy_rows(st.x_copy, x);
    } else {
      cuda_backend::copy_rows(st.x_copy, x, stream);
    }
    st.x = st.x_copy.view();
  }
  st.active = true;
  return y;
}

GroupedLinearGrads GroupedLinear::allocate_grads(Stream stream) const {
  const bool fresh_weight = !options_.main_grad.is_stacked() && options_.main_grad.list.empty();
  const int64_t E = num_experts(), N = out_features(), K = in_features();
  const Device dev = weight_.device();
  const DType wdt = weight_.dtype();
  const std::size_t w_bytes = fresh_weight ? align_up(std::size_t(E * N * K) * dtype_size(wdt)) : 0;
  const std::size_t b_bytes = bias_.defined() ? align_up(std::size_t(E * N) * dtype_size(bias_.dtype())) : 0;
  GroupedLinearGrads g;
  if (fresh_weight) {
    g.storage = std::make_shared<Buffer>(allocator(), w_bytes + b_bytes, stream);
  } else if (b_bytes != 0) {
    g.storage = std::make_shared<Buffer>(allocator(), b_bytes, stream);
  }
  char* base = g.storage ? static_cast<char*>(g.storage->data()) : nullptr;
  if (fresh_weight) {
    if (weight_.is_stacked()) {
      g.weight = ExpertWeights::from_stacked(TensorView(base, wdt, dev, {E, N, K}));
    } else {
      std::vector<TensorView> list;
      for (int64_t e = 0; e < E; ++e) {
        list.emplace_back(base + std::size_t(e * N * K) * dtype_size(wdt), wdt, dev, std::initializer_list<int64_t>{N, K});
      }
      g.weight = ExpertWeights::from_list(std::move(list));
    }
    if (options_.expert_mask.defined()) {
      // Masked-out experts are skipped by the kernel: give their fresh views a defined value.
      if (dev.is_cpu()) {
        std::memset(base, 0, w_bytes);
      } else {
        cuda_backend::zero_bytes(base, w_bytes, stream);
      }
    }
  } else {
    g.weight = options_.main_grad;
  }
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
  WgradOptions opt;
  const bool main_grad = options_.main_grad.is_stacked() || !options_.main_grad.list.empty();
  opt.accumulate = main_grad && options_.accumulate;
  opt.expert_mask = options_.expert_mask;
  grouped_gemm_wgrad(st.dy, st.x, st.counts, grads.weight, opt, stream, &allocator());
}

GroupedLinearBackward GroupedLinear::backward(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                              const TensorView& dgrad_out) {
  GroupedLinearContext::State& st = *ctx.state_;
  GMOE_CHECK(st.active && !st.wgrad_pending, "ctx: backward needs a context filled by forward (and not yet ",
             "consumed by backward)");
  check_rows(dy, "dy");
  GMOE_CHECK(dy.size(0) == st.x.size(0) && dy.size(1) == out_features(), "dy: expected [", st.x.size(0), ", ",
             out_features(), "], got ", dy.shape_str());
  Allocator& alloc = allocator();
  GroupedLinearBackward result;
  result.dx = dgrad_out.defined() ? Tensor::wrap(dgrad_out)
                                  : Tensor::empty({st.x.size(0), in_features()}, dy.dtype, alloc, stream);
  grouped_gemm_dgrad(dy, weight_, st.counts, result.dx, stream, &alloc);
  GroupedLinearGrads grads = allocate_grads(stream);
  if (bias_.defined()) grouped_bias_grad(dy, st.counts, grads.bias, stream, &alloc);
  st.dy = dy;
  if (options_.delay_wgrad) {
    st.grads = grads;
    st.wgrad_pending = true;
    if (st.device.is_cuda()) {
      if (st.event == nullptr) st.event = cuda_backend::event_create();
      cuda_backend::event_record(st.event, stream);
    }
    result.grads.bias = grads.bias;
    result.grads.storage = grads.storage;
    return result;
  }
  compute_wgrad(ctx, grads, stream);
  st.release_saved(stream);
  if (options_.wgrad_hook) options_.wgrad_hook(grads, stream);
  result.grads = std::move(grads);
  return result;
}

void GroupedLinear::set_saved_input(GroupedLinearContext& ctx, const TensorView& x) const {
  GroupedLinearContext::State& st = *ctx.state_;
  GMOE_CHECK(st.active, "ctx: set_saved_input needs a context filled by forward whose weight gradient is pending");
  GMOE_CHECK(options_.save_original_input, "set_saved_input: only with options.save_original_input (the layer ",
             "keeps a reference to its input, not a copy)");
  check_rows(x, "x");
  GMOE_CHECK(x.dtype == st.x.dtype && x.size(0) == st.x.size(0) && x.size(1) == st.x.size(1) &&
                 x.device == st.x.device,
             "x: expected ", dtype_name(st.x.dtype), "[", st.x.size(0), ", ", st.x.size(1), "] on ",
             st.x.device.str(), " (the input saved by forward), got ", x.str());
  st.x = x;
}

GroupedLinearGrads GroupedLinear::backward_dw(GroupedLinearContext& ctx, Stream stream) {
  GroupedLinearContext::State& st = *ctx.state_;
  GMOE_CHECK(st.wgrad_pending, "ctx: backward_dw needs a context after a backward with delay_wgrad");
  if (st.device.is_cuda()) cuda_backend::stream_wait_event(stream, st.event);
  GroupedLinearGrads grads = std::move(st.grads);
  st.grads = GroupedLinearGrads();
  compute_wgrad(ctx, grads, stream);
  st.release_saved(stream);
  if (options_.wgrad_hook) options_.wgrad_hook(grads, stream);
  return grads;
}

}  // namespace gmoe
