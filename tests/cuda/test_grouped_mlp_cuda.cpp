// tests/cuda/test_grouped_mlp_cuda.cpp — GroupedMLP on the CUDA backend: bitwise equal to the
// unfused composition of public ops on the device (GroupedLinear → grouped_activation_forward →
// GroupedLinear, and their backward) for every activation and gate/up layout, both weight layouts
// and bias forms, with and without probs, on the named cases; against the exact (fp64) MLP by the
// tolerance rule with the CPU layer as the reference in the kernels' own precision; delayed weight
// gradients on a second stream, recompute_activation and save_original_input bitwise equal to the
// immediate run, hooks in order; and forward + backward + backward_dw captured once in global
// capture mode (any host sync fails the capture) and replayed under four routings (uniform; skewed
// with empty experts; all in one expert; all empty), each replay bitwise equal to an eager run.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "common/activation_oracle.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "common/mlp_fixture.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe::test {
namespace {

// An MlpProblem's tensors on the device, weights in one layout.
struct DeviceMlp {
  DeviceTensor x, dy, probs, counts, b1g, b2g;
  std::vector<DeviceTensor> b1l, b2l;
  DeviceExperts w1, w2;
  DeviceMlp(const MlpProblem& p, Layout layout)
      : x(p.x), dy(p.dy), probs(p.probs), counts(p.counts), b1g(p.b1g), b2g(p.b2g),
        w1(p.w1s, p.w1l, layout), w2(p.w2s, p.w2l, layout) {
    for (const HostTensor& t : p.b1l) b1l.emplace_back(t);
    for (const HostTensor& t : p.b2l) b2l.emplace_back(t);
  }
  static ExpertBias bias(const DeviceTensor& g, const std::vector<DeviceTensor>& l, MlpBias m) {
    if (m == MlpBias::kNone) return {};
    if (m == MlpBias::kGrouped) return ExpertBias::from_grouped(g.view());
    std::vector<TensorView> v;
    for (const DeviceTensor& t : l) v.push_back(t.view());
    return ExpertBias::from_list(std::move(v));
  }
  ExpertBias b1(MlpBias m) const { return bias(b1g, b1l, m); }
  ExpertBias b2(MlpBias m) const { return bias(b2g, b2l, m); }
  TensorView probs_view(bool with) const { return with ? probs.view() : TensorView(); }
};

struct RunSpec {
  MlpBias bias = MlpBias::kNone;
  bool probs = false;
  bool caller_outputs = false;  // out, dgrad_out, dprobs_out given (poisoned)
  GroupedMLPOptions options;
};

// GroupedMLP on the device: forward and backward on s1, backward_dw (when delayed) on s2.
MlpOutputs run_cuda(const MlpProblem& p, const DeviceMlp& d, RunSpec spec, cudaStream_t s1, cudaStream_t s2,
                    std::vector<std::string>* hooks = nullptr) {
  spec.options.activation = p.act;
  if (hooks != nullptr) {
    spec.options.fc1.wgrad_hook = [hooks](const GroupedLinearGrads&, Stream) { hooks->push_back("fc1"); };
    spec.options.fc2.wgrad_hook = [hooks](const GroupedLinearGrads&, Stream) { hooks->push_back("fc2"); };
  }
  GroupedMLP mlp(d.w1.view(), d.w2.view(), d.b1(spec.bias), d.b2(spec.bias), spec.options);
  HostTensor y0(DType::bf16, {p.cap, p.H}), dp0(DType::f32, {p.cap});
  poison(y0);
  poison(dp0);
  DeviceTensor y_out(y0), dx_out(y0), dp_out(dp0);
  GroupedMLPContext ctx;
  Tensor y = mlp.forward(d.x.view(), d.counts.view(), d.probs_view(spec.probs), ctx, s1,
                         spec.caller_outputs ? y_out.view() : TensorView());
  GroupedMLPBackward b = mlp.backward(ctx, d.dy.view(), s1, spec.caller_outputs ? dx_out.view() : TensorView(),
                                      spec.caller_outputs && spec.probs ? dp_out.view() : TensorView());
  const bool d1 = spec.options.fc1.delay_wgrad, d2 = spec.options.fc2.delay_wgrad;
  GroupedMLPGrads later;
  if (d1 || d2) later = mlp.backward_dw(ctx, s2);
  EXPECT_FALSE(ctx.active());
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  check_device_errors(s1);
  MlpOutputs o;
  o.y = host_of(y);
  o.dx = host_of(b.dx);
  if (spec.probs) o.dprobs = host_of(b.dprobs);
  o.dw1 = values(d1 ? later.fc1.weight : b.grads.fc1.weight);
  o.dw2 = values(d2 ? later.fc2.weight : b.grads.fc2.weight);
  o.db1 = values(b.grads.fc1.bias);
  o.db2 = values(b.grads.fc2.bias);
  return o;
}

// The unfused composition of public ops on the device (fresh gradients, immediate). With an FP8
// recipe in spec.options, FP8 GroupedLinear layers (FC2 keeping its input by reference, as the MLP's).
MlpOutputs run_unfused_cuda(const MlpProblem& p, const DeviceMlp& d, const RunSpec& spec, cudaStream_t s) {
  GroupedLinearOptions o1, o2;
  o1.recipe = o2.recipe = spec.options.recipe;
  o1.fp8_fast_accumulation = spec.options.fc1.fp8_fast_accumulation;
  o2.fp8_fast_accumulation = spec.options.fc2.fp8_fast_accumulation;
  o2.save_original_input = spec.options.recipe != LinearRecipe::native;
  GroupedLinear fc1(d.w1.view(), d.b1(spec.bias), o1), fc2(d.w2.view(), d.b2(spec.bias), o2);
  GroupedLinearContext c1, c2;
  const TensorView pv = d.probs_view(spec.probs);
  HostTensor z0(DType::bf16, {p.cap, p.F}), dh0(DType::bf16, {p.cap, p.rows1}), dp0(DType::f32, {p.cap});
  poison(z0);
  poison(dh0);
  poison(dp0);
  DeviceTensor z(z0), dh(dh0), dprobs(dp0);
  Tensor h = fc1.forward(d.x.view(), d.counts.view(), c1, s);
  grouped_activation_forward(h, d.counts.view(), z.view(), p.act, pv, s);
  Tensor y = fc2.forward(z.view(), d.counts.view(), c2, s);
  GroupedLinearBackward b2 = fc2.backward(c2, d.dy.view(), s);
  grouped_activation_backward(h, b2.dx, d.counts.view(), dh.view(), p.act, pv,
                              spec.probs ? dprobs.view() : TensorView(), {}, s);
  GroupedLinearBackward b1 = fc1.backward(c1, dh.view(), s);
  EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  check_device_errors(s);
  MlpOutputs o;
  o.y = host_of(y);
  o.dx = host_of(b1.dx);
  o.h = host_of(h);
  o.dz = host_of(b2.dx);
  if (spec.probs) o.dprobs = dprobs.download();
  o.dw1 = values(b1.grads.weight);
  o.dw2 = values(b2.grads.weight);
  o.db1 = values(b1.grads.bias);
  o.db2 = values(b2.grads.bias);
  return o;
}

// The CPU layer (the reference in the kernels' own precision).
MlpOutputs run_cpu(const MlpProblem& p, Layout layout, const RunSpec& spec) {
  GroupedMLPOptions o;
  o.activation = p.act;
  GroupedMLP mlp(p.w1(layout), p.w2(layout), p.b1(spec.bias), p.b2(spec.bias), o);
  GroupedMLPContext ctx;
  Tensor y = mlp.forward(p.x.view(), p.counts.view(), p.probs_view(spec.probs), ctx);
  GroupedMLPBackward b = mlp.backward(ctx, p.dy.view());
  MlpOutputs out;
  out.y = host_of(y);
  out.dx = host_of(b.dx);
  if (spec.probs) out.dprobs = host_of(b.dprobs);
  out.dw1 = values(b.grads.fc1.weight);
  out.dw2 = values(b.grads.fc2.weight);
  out.db1 = values(b.grads.fc1.bias);
  out.db2 = values(b.grads.fc2.bias);
  return out;
}

// The CPU layer is the reference in the kernels' own precision.
void expect_within_rule(const MlpProblem& p, const MlpOutputs& gpu, const MlpOutputs& cpu, const ExactMlp& ex,
                        const RunSpec& spec) {
  expect_mlp_within_rule(p, gpu, values_of(cpu), ex, spec.bias == MlpBias::kList ? DType::f32 : DType::bf16);
}

const std::vector<std::string>& cuda_cases() {
  static const std::vector<std::string> kCases = {"uniform", "skewed",  "one_expert", "all_empty",
                                                   "zero_total", "ragged", "dim192",  "e256"};
  return kCases;
}

using Param = std::tuple<int, std::string>;  // index into mlp_activation_variants(), named case
std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return activation_case_name(mlp_activation_variants()[std::get<0>(info.param)]) + "_" + std::get<1>(info.param);
}

class CudaGroupedMlp : public ::testing::TestWithParam<Param> {
 protected:
  const ActivationOptions& act() const { return mlp_activation_variants()[std::get<0>(GetParam())]; }
  const std::string& case_name() const { return std::get<1>(GetParam()); }
};

TEST_P(CudaGroupedMlp, MatchesTheDeviceCompositionBitwiseAndTheExactMlpByTheRule) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main(), s2 = streams.side();
  struct Combo {
    Layout layout;
    RunSpec spec;
  };
  const Combo combos[] = {{Layout::kStacked, {MlpBias::kGrouped, true, true, {}}},
                          {Layout::kList, {MlpBias::kList, false, false, {}}}};
  const bool clamped = act().kind == ActivationKind::clamped_swiglu;
  for (const Combo& cb : combos) {
    SCOPED_TRACE(std::string(layout_name(cb.layout)) + (cb.spec.probs ? " probs" : " noprobs"));
    const MlpProblem p(case_name(), act(), rng, CaseScale::kLarge);
    const DeviceMlp d(p, cb.layout);
    const MlpOutputs got = run_cuda(p, d, cb.spec, s1, s2);
    EXPECT_TRUE(same_outputs(got, run_unfused_cuda(p, d, cb.spec, s1), "GroupedMLP vs the device composition"));
    for (int64_t r = p.c.total(); r < p.cap; ++r) {
      for (int64_t n = 0; n < p.H; ++n) {
        ASSERT_EQ(got.y.get(r * p.H + n), 0.0) << "y row " << r << " past the total";
        ASSERT_EQ(got.dx.get(r * p.H + n), 0.0) << "dx row " << r << " past the total";
      }
      if (cb.spec.probs) ASSERT_EQ(got.dprobs.get(r), 0.0) << "dprobs row " << r;
    }
    for (int64_t e = 0; e < p.E; ++e) {
      if (p.c.counts[e] != 0) continue;
      for (int64_t i = 0; i < p.rows1 * p.H; ++i) ASSERT_EQ(got.dw1[e * p.rows1 * p.H + i], 0.0) << "dW1 of " << e;
      for (int64_t i = 0; i < p.H * p.F; ++i) ASSERT_EQ(got.dw2[e * p.H * p.F + i], 0.0) << "dW2 of " << e;
    }
    // Against the exact MLP: clamped SwiGLU with a limit h does not reach (see with_unreached_limit).
    if (clamped) {
      const MlpProblem q(case_name(), with_unreached_limit(act()), rng, CaseScale::kLarge);
      const DeviceMlp dq(q, cb.layout);
      expect_within_rule(q, run_cuda(q, dq, cb.spec, s1, s2), run_cpu(q, cb.layout, cb.spec),
                         exact_mlp(q, cb.spec.bias != MlpBias::kNone, cb.spec.probs), cb.spec);
    } else {
      expect_within_rule(p, got, run_cpu(p, cb.layout, cb.spec),
                         exact_mlp(p, cb.spec.bias != MlpBias::kNone, cb.spec.probs), cb.spec);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedMlp,
                         ::testing::Combine(::testing::Range(0, int(mlp_activation_variants().size())),
                                            ::testing::ValuesIn(cuda_cases())),
                         param_name);

// Delayed weight gradients (computed on a second stream), recompute_activation and
// save_original_input: bitwise the immediate run; hooks once each, in the order their gradients
// complete (FC2's before FC1's within a call).
class CudaGroupedMlpOptions : public CudaGroupedMlp {};

TEST_P(CudaGroupedMlpOptions, DelayedOnASecondStreamAndRecomputeAreBitwiseImmediate) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main(), s2 = streams.side();
  const MlpProblem p(case_name(), act(), rng, CaseScale::kLarge);
  const DeviceMlp d(p, Layout::kStacked);
  RunSpec spec{MlpBias::kGrouped, true, false, {}};
  const MlpOutputs base = run_cuda(p, d, spec, s1, s2);
  for (int flags = 1; flags < 16; ++flags) {
    RunSpec s = spec;
    s.options.fc1.delay_wgrad = flags & 1;
    s.options.fc2.delay_wgrad = flags & 2;
    s.options.recompute_activation = flags & 4;
    s.options.fc1.save_original_input = flags & 8;
    SCOPED_TRACE("delay fc1 " + std::to_string(flags & 1) + ", delay fc2 " + std::to_string((flags >> 1) & 1) +
                 ", recompute " + std::to_string((flags >> 2) & 1) + ", save_original_input " +
                 std::to_string((flags >> 3) & 1));
    std::vector<std::string> hooks;
    EXPECT_TRUE(same_outputs(run_cuda(p, d, s, s1, s2, &hooks), base, "vs immediate"));
    std::vector<std::string> order;
    for (bool in_dw : {false, true}) {
      if (bool(flags & 2) == in_dw) order.push_back("fc2");
      if (bool(flags & 1) == in_dw) order.push_back("fc1");
    }
    EXPECT_EQ(hooks, order);
  }
}

// FP8 recipes: GroupedMLP with options.recipe is, bitwise, the device composition of FP8
// GroupedLinear layers of that recipe around the bf16 activation (the CPU suite checks the recipes'
// error against the exact MLP, and the FP8 layer suites the layers themselves). Tensorwise also with
// fp8_fast_accumulation on both FCs (the layers of the composition take it too).
TEST(CudaGroupedMlpFp8, EachRecipeIsTheCompositionOfFp8Layers) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ForkedStreams streams;
  const std::pair<LinearRecipe, bool> configs[] = {{LinearRecipe::fp8_tensorwise, false},
                                                   {LinearRecipe::fp8_tensorwise, true},
                                                   {LinearRecipe::fp8_blockwise, false},
                                                   {LinearRecipe::mxfp8, false}};
  for (const auto& [recipe, fast] : configs) {
    for (int v : {0, 6, 8}) {  // swiglu, clamped swiglu, squared relu
      for (const char* case_name : {"uniform", "skewed", "all_empty"}) {
        SCOPED_TRACE(std::string(linear_recipe_name(recipe)) + (fast ? " fast accumulation " : " ") +
                     activation_case_name(mlp_activation_variants()[v]) + " " + case_name);
        const MlpProblem p(case_name, mlp_activation_variants()[v], rng, CaseScale::kLarge);
        const DeviceMlp d(p, Layout::kStacked);
        RunSpec spec{MlpBias::kGrouped, true, false, {}};
        spec.options.recipe = recipe;
        spec.options.fc1.fp8_fast_accumulation = spec.options.fc2.fp8_fast_accumulation = fast;
        spec.options.activation = p.act;
        const MlpOutputs want = run_unfused_cuda(p, d, spec, streams.main());
        EXPECT_TRUE(same_outputs(run_cuda(p, d, spec, streams.main(), streams.side()), want,
                                 "FP8 GroupedMLP vs the composition of FP8 layers"));
        // Without a bias on FC1: bitwise the composition by default and with z quantized after the
        // activation.
        spec.bias = MlpBias::kNone;
        const MlpOutputs want_nb = run_unfused_cuda(p, d, spec, streams.main());
        EXPECT_TRUE(same_outputs(run_cuda(p, d, spec, streams.main(), streams.side()), want_nb,
                                 "FP8 GroupedMLP without bias vs the composition"));
        RunSpec unfused = spec;
        unfused.options.fp8_quantize_in_activation = false;
        EXPECT_TRUE(same_outputs(run_cuda(p, d, unfused, streams.main(), streams.side()), want_nb,
                                 "FP8 GroupedMLP, quantization after the activation, vs the composition"));
      }
    }
  }
}

// FP8 (blockwise, no bias, no probs): delayed weight gradients on a second stream,
// recompute_activation (z rebuilt for dW2 in backward), save_original_input, and z quantized after
// the activation instead of in it: bitwise the immediate run.
TEST_P(CudaGroupedMlpOptions, Fp8DelayedRecomputeAndUnfusedQuantizationBitwise) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ForkedStreams streams;
  const MlpProblem p(case_name(), act(), rng, CaseScale::kLarge);
  const DeviceMlp d(p, Layout::kStacked);
  RunSpec spec{MlpBias::kNone, false, false, {}};
  spec.options.recipe = LinearRecipe::fp8_blockwise;
  const MlpOutputs base = run_cuda(p, d, spec, streams.main(), streams.side());
  for (int flags : fp8_option_flags()) {
    RunSpec s = spec;
    apply_fp8_option_flags(s.options, flags);
    SCOPED_TRACE(fp8_option_flags_name(flags));
    EXPECT_TRUE(same_outputs(run_cuda(p, d, s, streams.main(), streams.side()), base, "vs immediate"));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedMlpOptions,
                         ::testing::Combine(::testing::Values(1, 6, 8),  // swiglu interleaved, clamped, relu²
                                            ::testing::Values("uniform", "skewed", "all_empty", "zero_total")),
                         param_name);

// ---------------------------------------------------------------------------------------------

// forward + backward + backward_dw of both FCs (delayed, on a second stream forked and joined with
// events), probs, biases, f32 main_grad accumulated with expert masks, caller-owned y, dx and
// dprobs: captured once in global capture mode, replayed under four routings, each replay bitwise
// equal to an eager run of the same calls; in bf16 keeping z and recomputing it, and with FP8
// recipes (weights quantized inside the graph: their caches are invalidated before the capture),
// blockwise with z quantized inside the activation, tensorwise recomputing z with e5m2 gradients,
// and tensorwise with fast accumulation (the 128x256 kernels) keeping z.
TEST(CudaGroupedMlpGraph, CaptureForwardBackwardDwOnceReplayUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  struct Config {
    LinearRecipe recipe;
    bool recompute;
    DType grad_format;
    bool fast = false;
  };
  for (const auto& [recipe, recompute, grad_format, fast] :
       {Config{LinearRecipe::native, false, DType::e4m3}, Config{LinearRecipe::native, true, DType::e4m3},
        Config{LinearRecipe::fp8_blockwise, false, DType::e4m3},
        Config{LinearRecipe::fp8_tensorwise, true, DType::e5m2},
        Config{LinearRecipe::fp8_tensorwise, false, DType::e4m3, true}}) {
    SCOPED_TRACE(std::string(linear_recipe_name(recipe)) + (recompute ? ", recompute_activation" : ", z kept") +
                 (grad_format == DType::e5m2 ? ", e5m2 gradients" : "") + (fast ? ", fast accumulation" : ""));
    Rng rng;
    const int64_t E = 16, H = 256, F = 128, cap = 16 * 96 + 7;
    ActivationOptions act;
    act.glu = {GluLayout::interleaved, kMlpGluBlock};
    const MlpProblem p(graph_case(E, 0, 0, 96, 7), H, F, act, rng);
    DeviceMlp d(p, Layout::kList);
    const std::vector<std::vector<int64_t>> routings = graph_routings(E, 96, 7, rng);

    HostExpertTensor mg1_init(Layout::kStacked, DType::f32, E, p.rows1, H);
    HostExpertTensor mg2_init(Layout::kList, DType::f32, E, H, F);
    HostTensor init1(DType::f32, {E, p.rows1, H}), init2(DType::f32, {E, H, F});
    fill_random(init1, rng);
    fill_random(init2, rng);
    mg1_init.set_all(init1.to_double());
    mg2_init.set_all(init2.to_double());
    DeviceExperts mg1(mg1_init), mg2(mg2_init);
    HostTensor mask1_h(DType::i32, {E}), mask2_h(DType::i32, {E});
    for (int64_t e = 0; e < E; ++e) {
      mask1_h.set(e, e % 5 != 3);
      mask2_h.set(e, e % 3 != 1);
    }
    DeviceTensor mask1(mask1_h), mask2(mask2_h);
    HostTensor y0(DType::bf16, {cap, H}), dp0(DType::f32, {cap});
    poison(y0);
    poison(dp0);
    DeviceTensor y(y0), dx(y0), dprobs(dp0);

    std::vector<std::string> hooks;
    GroupedMLPOptions opt;
    opt.activation = act;
    opt.recompute_activation = recompute;
    opt.recipe = recipe;
    opt.fc1.grad_format = opt.fc2.grad_format = grad_format;
    opt.fc1.fp8_fast_accumulation = opt.fc2.fp8_fast_accumulation = fast;
    opt.fc1.delay_wgrad = opt.fc2.delay_wgrad = true;
    opt.fc1.save_original_input = true;
    opt.fc1.main_grad = mg1.view();
    opt.fc2.main_grad = mg2.view();
    opt.fc1.expert_mask = mask1.view();
    opt.fc2.expert_mask = mask2.view();
    opt.fc1.wgrad_hook = [&](const GroupedLinearGrads&, Stream) { hooks.push_back("fc1"); };
    opt.fc2.wgrad_hook = [&](const GroupedLinearGrads&, Stream) { hooks.push_back("fc2"); };
    GroupedMLP mlp(d.w1.view(), d.w2.view(), d.b1(MlpBias::kGrouped), d.b2(MlpBias::kGrouped), opt);
    const ForkedStreams streams;
    const cudaStream_t s1 = streams.main();
    auto step = [&] {
      GroupedMLPContext ctx;
      mlp.forward(d.x.view(), d.counts.view(), d.probs.view(), ctx, s1, y.view());
      mlp.backward(ctx, d.dy.view(), s1, dx.view(), dprobs.view());
      mlp.backward_dw(ctx, streams.side());
      streams.join();
    };
    auto reset = [&] {
      y.upload(y0);
      dx.upload(y0);
      dprobs.upload(dp0);
      mg1.upload(mg1_init);
      mg2.upload(mg2_init);
    };
    step();  // eager once: module loading outside the capture
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(s1);
    mlp.invalidate_fp8_weight();  // FP8: the weights are quantized by every replay
    const CapturedGraph graph(s1, step);
    EXPECT_EQ(hooks, (std::vector<std::string>{"fc2", "fc1", "fc2", "fc1"}))
        << "the hooks fire at capture time too (they are host code)";

    const std::vector<double> i1 = init1.to_double(), i2 = init2.to_double();
    for (const auto& routing : routings) {
      SCOPED_TRACE("routing " + ::testing::PrintToString(routing));
      d.counts.upload(make_counts(routing, p.counts.dtype()));
      reset();
      graph.replay(s1);
      check_device_errors(s1);
      const HostTensor gy = y.download(), gdx = dx.download(), gdp = dprobs.download();
      const std::vector<double> g1 = mg1.to_double(), g2 = mg2.to_double();
      reset();
      step();
      GMOE_TEST_CUDA(cudaDeviceSynchronize());
      EXPECT_TRUE(bitwise_equal(gy, y.download(), "y: replay vs eager"));
      EXPECT_TRUE(bitwise_equal(gdx, dx.download(), "dx: replay vs eager"));
      EXPECT_TRUE(bitwise_equal(gdp, dprobs.download(), "dprobs: replay vs eager"));
      EXPECT_TRUE(same_values(g1, mg1.to_double(), "FC1 main_grad: replay vs eager"));
      EXPECT_TRUE(same_values(g2, mg2.to_double(), "FC2 main_grad: replay vs eager"));
      // Masked experts untouched, and experts without tokens (accumulating nothing).
      for (const auto& [g, init, mask, per] :
           {std::tuple{&g1, &i1, &mask1_h, p.rows1 * H}, std::tuple{&g2, &i2, &mask2_h, H * F}}) {
        for (int64_t e = 0; e < E; ++e) {
          if (mask->get(e) != 0 && routing[e] != 0) continue;
          for (int64_t i = 0; i < per; ++i) ASSERT_EQ((*g)[e * per + i], (*init)[e * per + i]) << "expert " << e;
        }
      }
      for (const HostTensor* t : {&gy, &gdx, &gdp}) {
        for (int64_t i = 0; i < t->numel(); ++i) ASSERT_FALSE(std::isnan(t->get(i))) << "unwritten output element";
      }
    }
  }
}

}  // namespace
}  // namespace gmoe::test
