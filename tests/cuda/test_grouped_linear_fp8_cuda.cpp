// tests/cuda/test_grouped_linear_fp8_cuda.cpp — GroupedLinear with the FP8 recipes on the CUDA
// backend. The layer quantizes inside; the quantizer is bit-exact between the backends, so the
// layer must give BITWISE the results of the CUDA ops run on the operands quantized on the host by
// tests/common/fp8_fixture.h (fprop + bias add, dgrad, wgrad; the bias gradient as the column sums
// of dy's quantization, checked against the exact sums too), with e4m3 and with
// e5m2 output gradients: immediate, delayed on
// a second stream, and with save_original_input; with fp8_wgrad off, dW is bitwise the native
// wgrad of the bf16 dy and x. dx and dW are also checked against the
// unquantized bf16 source within the recipe's documented bound. A CUDA graph of forward + backward
// + backward_dw with the weights quantized inside it, replayed under changing counts and changing
// weights, is bitwise equal to eager runs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "common/fp8_fixture.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "cuda/fp8_device.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::test {
namespace {

// (recipe, case, format of the output gradients: e4m3, or e5m2 as Transformer Engine's hybrid).
using Param = std::tuple<LinearRecipe, std::string, DType>;
class CudaGroupedLinearFp8 : public ::testing::TestWithParam<Param> {};

TEST_P(CudaGroupedLinearFp8, BitwiseTheOpCompositionAndWithinTheRecipeBound) {
  GMOE_SKIP_WITHOUT_GPU();
  const auto [recipe, case_name, grad_format] = GetParam();
  Rng rng;
  const ShapeCase c = make_case(case_name, rng, CaseScale::kLarge);
  const Fp8Problem p(c, fp8_recipe_of(recipe), rng, DType::i32, DType::e4m3, grad_format);
  const GemmProblem& base = p.base;
  HostTensor bias_h(DType::bf16, {c.E, c.N});
  fill_random(bias_h, rng);
  DeviceTensor x(base.x), dy(base.dy), counts(base.counts), bias(bias_h);
  DeviceExperts w(base.w_stacked, base.w, Layout::kStacked);
  const ExpertBias bias_v = ExpertBias::from_grouped(bias.view());

  // The CUDA ops on the host-quantized operands.
  DeviceGrouped qx(p.x.q), qdy(p.dy.q);
  DeviceWeights qw(p.w.q);
  DeviceTensor y_ref(DType::bf16, {c.capacity, c.N}), dx_ref(DType::bf16, {c.capacity, c.K});
  DeviceTensor dw_ref(DType::bf16, {c.E, c.N, c.K}), db_ref(DType::bf16, {c.E, c.N});
  fp8_grouped_gemm_fprop(qx.q, qw.q, bias_v, counts.view(), y_ref.view());
  fp8_grouped_gemm_dgrad(qdy.q, qw.q, counts.view(), dx_ref.view());
  fp8_grouped_gemm_wgrad(qdy.q, qx.q, counts.view(), ExpertWeights::from_stacked(dw_ref.view()));
  // db: made by the pass that quantizes dy (its column sums, in one order for every recipe and copy).
  Fp8QuantizeOptions dy_options;
  dy_options.recipe = fp8_recipe_of(recipe);
  dy_options.format = grad_format;
  quantize_grouped(GroupedRows{dy.view(), counts.view()}, dy_options, nullptr, nullptr, nullptr,
                   ExpertBias::from_grouped(db_ref.view()));
  // fp8_wgrad = false: the native weight gradient of the bf16 dy and x.
  DeviceTensor dw_native(DType::bf16, {c.E, c.N, c.K});
  grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), ExpertWeights::from_stacked(dw_native.view()));
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  const std::vector<double> want_y = values(y_ref.view()), want_dx = values(dx_ref.view()),
                            want_dw = values(dw_ref.view()), want_db = values(db_ref.view()),
                            want_dw_native = values(dw_native.view());

  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main(), s2 = streams.side();
  struct Variant {
    bool fp8_wgrad, save_original, delayed;
  };
  // Every saved-x form with the FP8 weight gradient; with the native one, each saved-x form once
  // (the copy immediate, the reference delayed on the second stream).
  const Variant variants[] = {{true, false, false}, {true, true, false}, {true, false, true},
                              {true, true, true},   {false, false, false}, {false, true, true}};
  for (const auto& [fp8_wgrad, save_original, delayed] : variants) {
    SCOPED_TRACE(std::string(fp8_wgrad ? "fp8 wgrad, " : "native wgrad, ") +
                 (save_original ? "save_original_input " : "saved copy ") +
                 (delayed ? "delayed (second stream)" : "immediate"));
    int hooks = 0;
    GroupedLinearOptions opt;
    opt.recipe = recipe;
    opt.grad_format = grad_format;
    opt.fp8_wgrad = fp8_wgrad;
    opt.save_original_input = save_original;
    opt.delay_wgrad = delayed;
    opt.wgrad_hook = [&hooks](const GroupedLinearGrads&, Stream) { ++hooks; };
    GroupedLinear layer(w.view(), bias_v, opt);
    GroupedLinearContext ctx;
    Tensor y = layer.forward(x.view(), counts.view(), ctx, s1);
    GroupedLinearBackward b = layer.backward(ctx, dy.view(), s1);
    const GroupedLinearGrads g = delayed ? layer.backward_dw(ctx, s2) : b.grads;
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(s1);
    EXPECT_EQ(hooks, 1);
    EXPECT_EQ(values(y.view()), want_y) << "y";
    EXPECT_EQ(values(b.dx.view()), want_dx) << "dx";
    EXPECT_EQ(values(g.weight), fp8_wgrad ? want_dw : want_dw_native) << "dW";
    EXPECT_EQ(values(b.grads.bias.grouped), want_db) << "db";
  }

  // Against the unquantized source, the f32 GEMMs of the same quantized operands the reference.
  EXPECT_TRUE(within_rule(want_db, exact_bias_grad(base.dy, c.counts), DType::bf16, "db vs exact"));
  EXPECT_TRUE(within_rule(want_dx,
                          against_source(exact_dgrad(p.dy_rows, p.w_t, c.counts), exact_dgrad(base.dy, base.w, c.counts)),
                          DType::bf16, "dx vs bf16 source", Fp8Accumulation::kPromoted));
  EXPECT_TRUE(within_rule(want_dw,
                          against_source(exact_wgrad(p.dy_cols, p.x_cols, c.counts, nullptr, nullptr),
                                         exact_wgrad(base.dy, base.x, c.counts, nullptr, nullptr)),
                          DType::bf16, "dW vs bf16 source", Fp8Accumulation::kPromoted));
  for (int64_t e = 0; e < c.E; ++e) {
    if (c.counts[e] != 0) continue;
    for (int64_t i = 0; i < c.N * c.K; ++i) ASSERT_EQ(want_dw[e * c.N * c.K + i], 0.0) << "dW of empty expert " << e;
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(linear_recipe_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param) +
         (std::get<2>(info.param) == DType::e5m2 ? "_e5m2_grads" : "");
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedLinearFp8,
                         ::testing::Combine(::testing::Values(LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise,
                                                              LinearRecipe::mxfp8),
                                            ::testing::Values("uniform", "skewed", "one_expert", "all_empty",
                                                              "zero_total", "ragged", "e256"),
                                            ::testing::Values(DType::e4m3)),
                         param_name);

INSTANTIATE_TEST_SUITE_P(E5m2Grads, CudaGroupedLinearFp8,
                         ::testing::Combine(::testing::Values(LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise,
                                                              LinearRecipe::mxfp8),
                                            ::testing::Values("skewed", "all_empty", "ragged"),
                                            ::testing::Values(DType::e5m2)),
                         param_name);

// GroupedLinearOptions::fp8_fast_accumulation: y and dx bitwise the FP8 ops with
// Fp8GemmOptions::fast_accumulation on the layer's own quantization of x, dy and W (tensorwise:
// the 128x256 kernels), dW the promoted weight gradient, and every recipe within its bound of the
// bf16 source (the recipes that ignore the option bitwise their layer without it).
TEST(CudaGroupedLinearFp8Fast, BitwiseTheOpsWithFastAccumulation) {
  GMOE_SKIP_WITHOUT_GPU();
  for (const LinearRecipe recipe : {LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise}) {
    for (const char* case_name : {"uniform", "skewed", "ragged", "zero_total"}) {
      SCOPED_TRACE(std::string(linear_recipe_name(recipe)) + ", " + case_name);
      Rng rng;
      const ShapeCase c = make_case(case_name, rng, CaseScale::kLarge);
      const Fp8Problem p(c, fp8_recipe_of(recipe), rng, DType::i32);
      const GemmProblem& base = p.base;
      DeviceTensor x(base.x), dy(base.dy), counts(base.counts);
      DeviceExperts w(base.w_stacked, base.w, Layout::kStacked);
      DeviceGrouped qx(p.x.q), qdy(p.dy.q);
      DeviceWeights qw(p.w.q);
      DeviceTensor y_ref(DType::bf16, {c.capacity, c.N}), dx_ref(DType::bf16, {c.capacity, c.K});
      DeviceTensor dw_ref(DType::bf16, {c.E, c.N, c.K});
      const Fp8GemmOptions fast{true};
      fp8_grouped_gemm_fprop(qx.q, qw.q, ExpertBias(), counts.view(), y_ref.view(), fast);
      fp8_grouped_gemm_dgrad(qdy.q, qw.q, counts.view(), dx_ref.view(), fast);
      fp8_grouped_gemm_wgrad(qdy.q, qx.q, counts.view(), ExpertWeights::from_stacked(dw_ref.view()));
      GroupedLinearOptions opt;
      opt.recipe = recipe;
      opt.fp8_fast_accumulation = true;
      GroupedLinear layer(w.view(), ExpertBias(), opt);
      GroupedLinearContext ctx;
      Tensor y = layer.forward(x.view(), counts.view(), ctx, nullptr);
      GroupedLinearBackward b = layer.backward(ctx, dy.view(), nullptr);
      GMOE_TEST_CUDA(cudaDeviceSynchronize());
      check_device_errors(nullptr);
      EXPECT_EQ(values(y.view()), values(y_ref.view())) << "y";
      EXPECT_EQ(values(b.dx.view()), values(dx_ref.view())) << "dx";
      EXPECT_EQ(values(b.grads.weight), values(dw_ref.view())) << "dW";
      const Fp8Accumulation acc =
          recipe == LinearRecipe::fp8_tensorwise ? Fp8Accumulation::kFast : Fp8Accumulation::kPromoted;
      EXPECT_TRUE(within_rule(values(b.dx.view()),
                              against_source(exact_dgrad(p.dy_rows, p.w_t, c.counts),
                                             exact_dgrad(base.dy, base.w, c.counts)),
                              DType::bf16, "dx vs bf16 source", acc));
    }
  }
}

// forward + backward + backward_dw of an FP8 layer with its weights quantized inside the graph
// (the cache was invalidated before capture, so every replay quantizes the current weights):
// replayed under changing counts and after the weights changed, bitwise equal to eager runs.
TEST(CudaGroupedLinearFp8Graph, CaptureWithWeightQuantizationReplayUnderChangingCountsAndWeights) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t E = 16, N = 256, K = 384, cap = 16 * 96 + 7;
  const GemmProblem p(graph_case(E, N, K, 96, 7), DType::bf16, rng);
  const std::vector<std::vector<int64_t>> routings = graph_routings(E, 96, 7, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts), w(p.w_stacked), main_grad(DType::f32, {E, N, K});
  DeviceTensor y(DType::bf16, {cap, N}), dx(DType::bf16, {cap, K});
  for (LinearRecipe recipe : {LinearRecipe::fp8_blockwise, LinearRecipe::fp8_tensorwise, LinearRecipe::mxfp8}) {
    SCOPED_TRACE(linear_recipe_name(recipe));
    GroupedLinearOptions opt;
    opt.recipe = recipe;
    opt.delay_wgrad = true;
    opt.main_grad = ExpertWeights::from_stacked(main_grad.view());
    opt.accumulate = false;
    GroupedLinear layer(ExpertWeights::from_stacked(w.view()), {}, opt);
    const ForkedStreams streams;
    const cudaStream_t s1 = streams.main();
    auto step = [&] {
      layer.invalidate_fp8_weight();  // a training step: the optimizer changed the weights
      GroupedLinearContext ctx;
      layer.forward(x.view(), counts.view(), ctx, s1, y.view());
      layer.backward(ctx, dy.view(), s1, dx.view());
      layer.backward_dw(ctx, streams.side());
      streams.join();
    };
    step();  // eager once: module loading outside capture
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    const CapturedGraph graph(s1, step);
    for (size_t i = 0; i < routings.size(); ++i) {
      SCOPED_TRACE("routing " + ::testing::PrintToString(routings[i]));
      counts.upload(make_counts(routings[i]));
      if (i == 3) {  // new weights: the replay must quantize them
        HostTensor w2 = p.w_stacked;
        fill_random(w2, rng);
        w.upload(w2);
      }
      graph.replay(s1);
      check_device_errors(s1);
      const std::vector<double> gy = values(y.view()), gdx = values(dx.view()), gdw = values(main_grad.view());
      step();
      GMOE_TEST_CUDA(cudaDeviceSynchronize());
      EXPECT_EQ(gy, values(y.view())) << "y: replay vs eager";
      EXPECT_EQ(gdx, values(dx.view())) << "dx: replay vs eager";
      EXPECT_EQ(gdw, values(main_grad.view())) << "main_grad: replay vs eager";
      for (double v : gy) ASSERT_FALSE(std::isnan(v)) << "unwritten output row";
    }
  }
}

}  // namespace
}  // namespace gmoe::test
