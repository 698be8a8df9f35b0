// tests/layers/test_grouped_linear_fp8.cpp — GroupedLinear with the FP8 recipes on the CPU backend.
//
// The layer quantizes x, dy and the weights itself. The quantizer is deterministic (and bit-exact
// between the backends), so the layer must give BITWISE the results of the public ops composed by
// hand on the operands that tests/common/fp8_fixture.h quantizes: fprop + bias add, dgrad, wgrad,
// bias gradient. On top, dx and dW against the unquantized bf16 source by the tolerance rule (the
// f32 GEMM of the same quantized operands the reference: it carries the quantization's error); delayed dW bitwise equal to immediate; save_original_input (x quantized again in backward)
// bitwise equal to the saved columnwise copy; with fp8_wgrad off, dW bitwise the native wgrad;
// main_grad accumulate with a mask; the weight cache and its invalidation; e5m2 gradients; the
// argument checks.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>

#include "common/expect_error.h"
#include "common/fp8_fixture.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::test {
namespace {

std::vector<double> expert_values(const ExpertWeights& w) {
  std::vector<double> out;
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    const TensorView v = w.expert(e);
    HostTensor h(v.dtype, {v.size(0), v.size(1)});
    if (!h.bytes().empty()) std::memcpy(h.data(), v.data, h.bytes().size());
    const std::vector<double> d = h.to_double();
    out.insert(out.end(), d.begin(), d.end());
  }
  return out;
}
std::vector<double> view_values(const TensorView& v) {
  HostTensor h(v.dtype, {v.numel()});
  if (!h.bytes().empty()) std::memcpy(h.data(), v.data, h.bytes().size());
  return h.to_double();
}

// The layer's results for one configuration.
struct LayerRun {
  std::vector<double> y, dx, dw, db;
  int hooks = 0;
};

LayerRun run_layer(const GemmProblem& base, Layout layout, const HostTensor& bias, GroupedLinearOptions opt) {
  LayerRun r;
  opt.wgrad_hook = [&r](const GroupedLinearGrads&, Stream) { ++r.hooks; };
  // The bias in the weights' layout: the FP8 backward's bias gradient (the column sums of dy's
  // quantization) is copied into the gradients, grouped or a list.
  GroupedLinear layer(base.weights(layout), expert_bias(bias.view(), layout), opt);
  GroupedLinearContext ctx;
  Tensor y = layer.forward(base.x.view(), base.counts.view(), ctx);
  GroupedLinearBackward b = layer.backward(ctx, base.dy.view());
  const GroupedLinearGrads g = opt.delay_wgrad ? layer.backward_dw(ctx) : b.grads;
  r.y = view_values(y.view());
  r.dx = view_values(b.dx.view());
  r.dw = expert_values(g.weight);
  for (int64_t e = 0; e < b.grads.bias.num_experts(); ++e) {
    const std::vector<double> db_e = view_values(b.grads.bias.expert(e));
    r.db.insert(r.db.end(), db_e.begin(), db_e.end());
  }
  return r;
}

using Param = std::tuple<LinearRecipe, Layout, std::string>;
class CpuGroupedLinearFp8 : public ::testing::TestWithParam<Param> {
 protected:
  LinearRecipe recipe() const { return std::get<0>(GetParam()); }
  Layout layout() const { return std::get<1>(GetParam()); }
  ShapeCase make(Rng& rng) const { return make_case(std::get<2>(GetParam()), rng); }
};

TEST_P(CpuGroupedLinearFp8, BitwiseTheOpCompositionAndWithinTheRuleOfTheSource) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, fp8_recipe_of(recipe()), rng);
  const GemmProblem& base = p.base;
  HostTensor bias(DType::bf16, {c.E, c.N});
  fill_random(bias, rng);

  // The composition of the public ops on the fixture's quantized operands.
  HostTensor y_ref(DType::bf16, {c.capacity, c.N}), dx_ref(DType::bf16, {c.capacity, c.K});
  poison(y_ref);
  poison(dx_ref);
  fp8_grouped_gemm_fprop(p.x.q, p.w.q, ExpertBias::from_grouped(bias.view()), base.counts.view(), y_ref.view());
  fp8_grouped_gemm_dgrad(p.dy.q, p.w.q, base.counts.view(), dx_ref.view());
  HostExpertTensor dw_ref(layout(), DType::bf16, c.E, c.N, c.K);
  dw_ref.poison_all();
  fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, base.counts.view(), dw_ref.view());
  HostTensor db_ref(DType::bf16, {c.E, c.N});
  grouped_bias_grad(base.dy.view(), base.counts.view(), ExpertBias::from_grouped(db_ref.view()));
  // fp8_wgrad = false: the native weight gradient of the bf16 dy and x.
  HostExpertTensor dw_native(layout(), DType::bf16, c.E, c.N, c.K);
  dw_native.poison_all();
  grouped_gemm_wgrad(base.dy.view(), base.x.view(), base.counts.view(), dw_native.view());

  GroupedLinearOptions opt;
  opt.recipe = recipe();
  for (bool fp8_wgrad : {true, false}) {
    for (bool save_original : {false, true}) {
      for (bool delayed : {false, true}) {
        SCOPED_TRACE(std::string(fp8_wgrad ? "fp8 wgrad, " : "native wgrad, ") +
                     (save_original ? "save_original_input " : "saved copy ") + (delayed ? "delayed" : "immediate"));
        opt.fp8_wgrad = fp8_wgrad;
        opt.save_original_input = save_original;
        opt.delay_wgrad = delayed;
        const LayerRun r = run_layer(base, layout(), bias, opt);
        EXPECT_EQ(r.hooks, 1);
        EXPECT_EQ(r.y, y_ref.to_double()) << "y differs from fprop + bias add on the same FP8 operands";
        EXPECT_EQ(r.dx, dx_ref.to_double()) << "dx differs from dgrad on the same FP8 operands";
        EXPECT_EQ(r.dw, (fp8_wgrad ? dw_ref : dw_native).to_double())
            << (fp8_wgrad ? "dW differs from wgrad on the same FP8 operands" : "dW differs from the native wgrad");
        EXPECT_EQ(r.db, db_ref.to_double()) << "db differs from the bias gradient of dy";
      }
    }
  }

  // Against the unquantized source, the quantized operands' f32 GEMMs the reference.
  EXPECT_TRUE(within_rule(dx_ref.to_double(),
                          against_source(exact_dgrad(p.dy_rows, p.w_t, c.counts), exact_dgrad(base.dy, base.w, c.counts)),
                          DType::bf16, "dx vs bf16 source"));
  EXPECT_TRUE(within_rule(dw_ref.to_double(),
                          against_source(exact_wgrad(p.dy_cols, p.x_cols, c.counts, nullptr, nullptr),
                                         exact_wgrad(base.dy, base.x, c.counts, nullptr, nullptr)),
                          DType::bf16, "dW vs bf16 source"));
  const std::vector<double> dw = dw_ref.to_double();
  for (int64_t e = 0; e < c.E; ++e) {
    if (c.counts[e] != 0) continue;
    for (int64_t i = 0; i < c.N * c.K; ++i) ASSERT_EQ(dw[e * c.N * c.K + i], 0.0) << "dW of empty expert " << e;
  }
}

TEST_P(CpuGroupedLinearFp8, MainGradAccumulateWithMask) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, fp8_recipe_of(recipe()), rng);
  HostTensor mask(DType::i32, {c.E});
  for (int64_t e = 0; e < c.E; ++e) mask.set(e, rng.integer(0, 1));
  HostTensor init(DType::f32, {c.E, c.N, c.K});
  fill_random(init, rng, -2.0, 2.0);
  HostExpertTensor want(layout(), DType::f32, c.E, c.N, c.K), got(layout(), DType::f32, c.E, c.N, c.K);
  want.set_all(init.to_double());
  got.set_all(init.to_double());
  WgradOptions wo;
  wo.accumulate = true;
  wo.expert_mask = mask.view();
  fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, p.base.counts.view(), want.view(), wo);

  GroupedLinearOptions opt;
  opt.recipe = recipe();
  opt.main_grad = got.view();
  opt.accumulate = true;
  opt.expert_mask = mask.view();
  opt.delay_wgrad = true;
  GroupedLinear layer(p.base.weights(layout()), {}, opt);
  GroupedLinearContext ctx;
  layer.forward(p.base.x.view(), p.base.counts.view(), ctx);
  layer.backward(ctx, p.base.dy.view());
  layer.backward_dw(ctx);
  EXPECT_EQ(got.to_double(), want.to_double());
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(linear_recipe_name(std::get<0>(info.param))) + "_" + layout_name(std::get<1>(info.param)) +
         "_" + std::get<2>(info.param);
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CpuGroupedLinearFp8,
                         ::testing::Combine(::testing::Values(LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise,
                                                              LinearRecipe::mxfp8),
                                            ::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values("uniform", "skewed", "one_expert", "all_empty",
                                                              "zero_total", "ragged", "dim1408", "e128")),
                         param_name);

// The weights are quantized once and cached: a change of the weights is seen only after
// invalidate_fp8_weight() (or quantize_weight()).
TEST(CpuGroupedLinearFp8Api, WeightCacheAndInvalidation) {
  Rng rng;
  const ShapeCase c = make_case("skewed", rng);
  GemmProblem base(c, DType::bf16, rng);
  GroupedLinearOptions opt;
  opt.recipe = LinearRecipe::fp8_blockwise;
  opt.save_original_input = true;
  GroupedLinear layer(base.weights(Layout::kStacked), {}, opt);
  auto forward = [&] {
    GroupedLinearContext ctx;
    Tensor y = layer.forward(base.x.view(), base.counts.view(), ctx);
    std::vector<double> v = view_values(y.view());
    layer.backward(ctx, base.dy.view());
    return v;
  };
  const std::vector<double> before = forward();
  HostTensor w_new = base.w_stacked;
  fill_random(w_new, rng);
  std::memcpy(base.w_stacked.data(), w_new.data(), w_new.bytes().size());  // the optimizer step, in place
  EXPECT_EQ(forward(), before) << "the cached FP8 weights were refreshed without invalidation";
  layer.invalidate_fp8_weight();
  const std::vector<double> after = forward();
  EXPECT_NE(after, before);
  Fp8QuantizeOptions qo;
  qo.recipe = Fp8Recipe::blockwise;
  const Fp8GroupedTensor qx = quantize_grouped(GroupedRows{base.x.view(), base.counts.view()}, qo);
  const Fp8WeightsTensor qw = quantize_weights(ExpertWeights::from_stacked(w_new.view()), qo);
  HostTensor y_ref(DType::bf16, {c.capacity, c.N});
  fp8_grouped_gemm_fprop(qx.q, qw.q, base.counts.view(), y_ref.view());
  EXPECT_EQ(after, y_ref.to_double()) << "after invalidation, y must use the new weights";
}

// e5m2 gradients: dy quantized in e5m2 (rowwise for dgrad, columnwise for wgrad).
TEST(CpuGroupedLinearFp8Api, E5m2Gradients) {
  Rng rng;
  const ShapeCase c = make_case("ragged", rng);
  for (LinearRecipe recipe : {LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise, LinearRecipe::mxfp8}) {
    SCOPED_TRACE(linear_recipe_name(recipe));
    const Fp8Problem p(c, fp8_recipe_of(recipe), rng);
    Fp8QuantizeOptions qo;
    qo.recipe = fp8_recipe_of(recipe);
    qo.format = DType::e5m2;
    qo.columnwise = true;
    const Fp8GroupedTensor qdy = quantize_grouped(GroupedRows{p.base.dy.view(), p.base.counts.view()}, qo);
    HostTensor dx_ref(DType::bf16, {c.capacity, c.K});
    fp8_grouped_gemm_dgrad(qdy.q, p.w.q, p.base.counts.view(), dx_ref.view());
    HostExpertTensor dw_ref(Layout::kStacked, DType::bf16, c.E, c.N, c.K);
    fp8_grouped_gemm_wgrad(qdy.q, p.x.q, p.base.counts.view(), dw_ref.view());
    GroupedLinearOptions opt;
    opt.recipe = recipe;
    opt.grad_format = DType::e5m2;
    HostTensor no_bias(DType::bf16, {c.E, c.N});
    fill_random(no_bias, rng);
    const LayerRun r = run_layer(p.base, Layout::kStacked, no_bias, opt);
    EXPECT_EQ(r.dx, dx_ref.to_double());
    EXPECT_EQ(r.dw, dw_ref.to_double());
    const HostTensor dy_e5m2 = decode_grouped(qdy.q, c.counts, Fp8Copy::rowwise);
    EXPECT_TRUE(within_rule(r.dx,
                            against_source(exact_dgrad(dy_e5m2, p.w_t, c.counts),
                                           exact_dgrad(p.base.dy, p.base.w, c.counts)),
                            DType::bf16, "dx (e5m2 dy) vs bf16 source"));
  }
}

TEST(CpuGroupedLinearFp8Api, Errors) {
  Rng rng;
  const ShapeCase c = make_case("uniform", rng);
  const GemmProblem p16(c, DType::f16, rng);
  GroupedLinearOptions opt;
  opt.recipe = LinearRecipe::fp8_blockwise;
  GMOE_EXPECT_ERROR(GroupedLinear(p16.weights(Layout::kStacked), {}, opt), "weight:", "bf16");
  const GemmProblem p(c, DType::bf16, rng);
  opt.grad_format = DType::bf16;
  GMOE_EXPECT_ERROR(GroupedLinear(p.weights(Layout::kStacked), {}, opt), "options.grad_format", "e5m2");
  opt.grad_format = DType::e4m3;
  opt.recipe = static_cast<LinearRecipe>(9);
  GMOE_EXPECT_ERROR(GroupedLinear(p.weights(Layout::kStacked), {}, opt), "options.recipe", "unknown");
  EXPECT_EQ(linear_recipe_from_name("fp8_blockwise"), LinearRecipe::fp8_blockwise);
  GMOE_EXPECT_ERROR(linear_recipe_from_name("fp4"), "fp4", "expected native");
}

}  // namespace
}  // namespace gmoe::test
