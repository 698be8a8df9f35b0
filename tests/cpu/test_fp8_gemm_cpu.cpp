// tests/cpu/test_fp8_gemm_cpu.cpp — the CPU reference FP8 grouped GEMM on every named shape case
// and recipe, three passes: against the exact (fp64) GEMM of the operands decoded independently
// from the format, and against the unquantized bf16 source, both by the tolerance rule with the
// f32 sums of the decoded operands as the own-precision reference (against the source it carries
// the quantization's error). Also the argument checks of the public FP8 GEMM ops.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "common/expect_error.h"
#include "common/fp8_fixture.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/fp8_gemm.h"

namespace gmoe::test {
namespace {

using Param = std::tuple<Fp8Recipe, std::string>;

class CpuFp8Gemm : public ::testing::TestWithParam<Param> {
 protected:
  Fp8Recipe recipe() const { return std::get<0>(GetParam()); }
  ShapeCase make(Rng& rng) const { return make_case(std::get<1>(GetParam()), rng); }
};

TEST_P(CpuFp8Gemm, Fprop) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  const ExactResult exact = exact_fprop(p.x_rows, p.w_data, c.counts);
  for (DType out : {DType::bf16, DType::f32}) {
    HostTensor y(out, {c.capacity, c.N});
    poison(y);
    fp8_grouped_gemm_fprop(p.x.q, p.w.q, p.base.counts.view(), y.view());
    EXPECT_TRUE(within_rule(y.to_double(), exact, out, std::string("fprop out ") + dtype_name(out)));
    EXPECT_TRUE(within_rule(y.to_double(), against_source(exact, exact_fprop(p.base.x, p.base.w, c.counts)), out,
                            "fprop vs bf16 source"));
  }
}

// With a bias: the same product plus bias_e on expert e's rows (f32 out: one rounding).
TEST_P(CpuFp8Gemm, FpropBias) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng);
  ExactResult exact = exact_fprop(p.x_rows, p.w_data, c.counts);
  HostTensor bias(DType::f32, {c.E, c.N});
  fill_random(bias, rng, -2.0, 2.0);
  add_bias(exact, bias, c.counts, DType::f32, true);
  HostTensor y(DType::f32, {c.capacity, c.N});
  poison(y);
  fp8_grouped_gemm_fprop(p.x.q, p.w.q, ExpertBias::from_grouped(bias.view()), p.base.counts.view(), y.view());
  EXPECT_TRUE(within_rule(y.to_double(), exact, DType::f32, "fprop + bias"));
}

TEST_P(CpuFp8Gemm, Dgrad) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng);
  const ExactResult exact = exact_dgrad(p.dy_rows, p.w_t, c.counts);
  for (DType out : {DType::bf16, DType::f32}) {
    HostTensor dx(out, {c.capacity, c.K});
    poison(dx);
    fp8_grouped_gemm_dgrad(p.dy.q, p.w.q, p.base.counts.view(), dx.view());
    EXPECT_TRUE(within_rule(dx.to_double(), exact, out, std::string("dgrad out ") + dtype_name(out)));
    EXPECT_TRUE(within_rule(dx.to_double(), against_source(exact, exact_dgrad(p.base.dy, p.base.w, c.counts)), out,
                            "dgrad vs bf16 source"));
  }
}

// Fast accumulation (Fp8GemmOptions) is a CUDA kernel choice: the CPU reference accumulates in
// fp32 either way, so fprop (with a bias) and dgrad are bitwise their calls without options.
TEST_P(CpuFp8Gemm, FastAccumulationIsTheReference) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng);
  HostTensor bias(DType::f32, {c.E, c.N});
  fill_random(bias, rng, -2.0, 2.0);
  const ExpertBias b = ExpertBias::from_grouped(bias.view());
  HostTensor y(DType::f32, {c.capacity, c.N}), y_fast(DType::f32, {c.capacity, c.N});
  HostTensor dx(DType::f32, {c.capacity, c.K}), dx_fast(DType::f32, {c.capacity, c.K});
  poison(y_fast);
  poison(dx_fast);
  fp8_grouped_gemm_fprop(p.x.q, p.w.q, b, p.base.counts.view(), y.view());
  fp8_grouped_gemm_fprop(p.x.q, p.w.q, b, p.base.counts.view(), y_fast.view(), Fp8GemmOptions{true});
  fp8_grouped_gemm_dgrad(p.dy.q, p.w.q, p.base.counts.view(), dx.view());
  fp8_grouped_gemm_dgrad(p.dy.q, p.w.q, p.base.counts.view(), dx_fast.view(), Fp8GemmOptions{true});
  EXPECT_EQ(y_fast.to_double(), y.to_double());
  EXPECT_EQ(dx_fast.to_double(), dx.to_double());
}

TEST_P(CpuFp8Gemm, Wgrad) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng);
  const ExactResult exact = exact_wgrad(p.dy_cols, p.x_cols, c.counts, nullptr, nullptr);
  for (DType out : {DType::bf16, DType::f32}) {
    HostExpertTensor dw(rng.integer(0, 1) ? Layout::kStacked : Layout::kList, out, c.E, c.N, c.K);
    dw.poison_all();
    fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, p.base.counts.view(), dw.view());
    const std::vector<double> got = dw.to_double();
    EXPECT_TRUE(within_rule(got, exact, out, std::string("wgrad out ") + dtype_name(out)));
    const ExactResult source = exact_wgrad(p.base.dy, p.base.x, c.counts, nullptr, nullptr);
    EXPECT_TRUE(within_rule(got, against_source(exact, source), out, "wgrad vs bf16 source"));
    for (int64_t e = 0; e < c.E; ++e) {
      if (c.counts[e] != 0) continue;
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        ASSERT_EQ(got[e * c.N * c.K + i], 0.0) << "expert " << e;
      }
    }
  }
}

TEST_P(CpuFp8Gemm, WgradAccumulateWithMask) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng);
  std::vector<int32_t> mask(static_cast<size_t>(c.E));
  HostTensor mask_t(DType::i32, {c.E});
  for (int64_t e = 0; e < c.E; ++e) {
    mask[e] = static_cast<int32_t>(rng.integer(0, 1));
    mask_t.set(e, mask[e]);
  }
  HostTensor init(DType::f32, {c.E, c.N, c.K});
  fill_random(init, rng, -4.0, 4.0);
  const std::vector<double> init_v = init.to_double();
  HostExpertTensor dw(Layout::kStacked, DType::f32, c.E, c.N, c.K);
  dw.set_all(init_v);
  WgradOptions opt;
  opt.accumulate = true;
  opt.expert_mask = mask_t.view();
  fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, p.base.counts.view(), dw.view(), opt);
  const ExactResult exact = exact_wgrad(p.dy_cols, p.x_cols, c.counts, &init_v, &mask);
  const std::vector<double> got = dw.to_double();
  const int64_t per = c.N * c.K;
  for (int64_t e = 0; e < c.E; ++e) {
    if (mask[e] != 0 && c.counts[e] != 0) continue;
    for (int64_t i = 0; i < per; ++i) {
      ASSERT_EQ(got[e * per + i], init_v[e * per + i]) << "expert " << e << " was written";
    }
  }
  EXPECT_TRUE(within_rule(got, exact, DType::f32, "wgrad accumulate with mask"));
}

// The FP8 weight gradient with MaskedOffWgrad::fresh: mask-1 experts accumulated into main_grad,
// mask-0 experts written into the fresh buffer (a list), from the dequantized columnwise copies.
TEST_P(CpuFp8Gemm, WgradMaskedOffFresh) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Fp8Problem p(c, recipe(), rng);
  const MaskedOffDestinations d(c.E, c.N, c.K, rng);
  MaskedOffBuffers out(d, Layout::kStacked, c.E, c.N, c.K);  // fresh: a list
  HostExpertTensor& main = out.main;
  HostExpertTensor& fresh = out.fresh;
  const WgradOptions opt = masked_off_wgrad_options(true, d.mask_t.view(), fresh.view());
  fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, p.base.counts.view(), main.view(), opt);
  expect_masked_off_destinations(d, p.dy_cols, p.x_cols, c.counts, true, main.to_double(), fresh.to_double(), nullptr,
                                 nullptr, "fp8 wgrad accumulate, masked off fresh");
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(fp8_recipe_name(std::get<0>(info.param))) + "_" + std::get<1>(info.param);
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CpuFp8Gemm,
                         ::testing::Combine(::testing::Values(Fp8Recipe::blockwise,
                                                              Fp8Recipe::tensorwise,
                                                              Fp8Recipe::mxfp8),
                                            ::testing::ValuesIn(named_case_names())),
                         param_name);

// e5m2 gradients (the hybrid recipe): the reference takes them on every recipe.
TEST(CpuFp8GemmFormats, E5m2Operands) {
  Rng rng;
  const ShapeCase c = make_case("skewed", rng);
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise, Fp8Recipe::mxfp8}) {
    SCOPED_TRACE(fp8_recipe_name(r));
    const Fp8Problem p(c, r, rng, DType::i32, DType::e5m2);
    HostTensor y(DType::f32, {c.capacity, c.N});
    fp8_grouped_gemm_fprop(p.x.q, p.w.q, p.base.counts.view(), y.view());
    const ExactResult exact = exact_fprop(p.x_rows, p.w_data, c.counts);
    EXPECT_TRUE(within_rule(y.to_double(), exact, DType::f32, "fprop e5m2"));
    EXPECT_TRUE(within_rule(y.to_double(), against_source(exact, exact_fprop(p.base.x, p.base.w, c.counts)),
                            DType::f32, "fprop e5m2 vs bf16 source"));
  }
}

// ---------------------------------------------------------------------------------------------
// Argument checks at the API edge (the same for every backend).

class CpuFp8GemmErrors : public ::testing::Test {
 protected:
  CpuFp8GemmErrors() {
    c.name = "errors";
    c.E = 3;
    c.N = 64;
    c.K = 96;
    c.counts = {10, 20, 5};
    c.capacity = 40;
  }
  ShapeCase c;
  Rng rng;
};

TEST_F(CpuFp8GemmErrors, Fprop) {
  const Fp8Problem p(c, Fp8Recipe::blockwise, rng);
  const Fp8Problem pt(c, Fp8Recipe::tensorwise, rng);
  const TensorView counts = p.base.counts.view();
  HostTensor y(DType::bf16, {c.capacity, c.N});
  fp8_grouped_gemm_fprop(p.x.q, p.w.q, counts, y.view());  // valid

  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, pt.w.q, counts, y.view()), "recipe",
                    "blockwise", "tensorwise");
  Fp8Grouped no_rows = p.x.q;
  no_rows.data = TensorView();
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(no_rows, p.w.q, counts, y.view()), "x",
                    "rowwise copy");
  Fp8Grouped bad_scale = p.x.q;
  bad_scale.scale_inv.shape[1] += 1;
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(bad_scale, p.w.q, counts, y.view()), "x.scale_inv");
  HostTensor y_wrong(DType::bf16, {c.capacity, c.N + 16});
  // The expected fragment outlives the macro's list of C strings (a temporary's c_str() would not).
  const std::string n_text = std::to_string(c.N);
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, p.w.q, counts, y_wrong.view()), "y", n_text.c_str());
  HostTensor y_f16(DType::f16, {c.capacity, c.N});
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, p.w.q, counts, y_f16.view()), "y", "f16");
  HostTensor bias_short(DType::bf16, {c.E, c.N - 1});
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, p.w.q, ExpertBias::from_grouped(bias_short.view()), counts,
                                           y.view()),
                    "bias");
  HostTensor bias_f16(DType::f16, {c.E, c.N});
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, p.w.q, ExpertBias::from_grouped(bias_f16.view()), counts,
                                           y.view()),
                    "bias", "f16");
  const HostTensor counts4 = make_counts({10, 20, 5, 0});
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, p.w.q, counts4.view(), y.view()), "experts");
  // Weights of another K.
  ShapeCase c2 = c;
  c2.K = 128;
  const Fp8Problem p2(c2, Fp8Recipe::blockwise, rng);
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_fprop(p.x.q, p2.w.q, counts, y.view()), "w", "K");
}

TEST_F(CpuFp8GemmErrors, Dgrad) {
  const Fp8Problem p(c, Fp8Recipe::tensorwise, rng);
  const TensorView counts = p.base.counts.view();
  HostTensor dx(DType::bf16, {c.capacity, c.K});
  fp8_grouped_gemm_dgrad(p.dy.q, p.w.q, counts, dx.view());  // valid
  Fp8Weights no_t = p.w.q;
  no_t.data_t = TensorView();
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_dgrad(p.dy.q, no_t, counts, dx.view()), "w", "data_t");
  HostTensor dx_wrong(DType::bf16, {c.capacity + 1, c.K});
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_dgrad(p.dy.q, p.w.q, counts, dx_wrong.view()), "dx");
}

TEST_F(CpuFp8GemmErrors, Wgrad) {
  const Fp8Problem p(c, Fp8Recipe::mxfp8, rng);
  const TensorView counts = p.base.counts.view();
  HostTensor dw(DType::f32, {c.E, c.N, c.K});
  const ExpertWeights dwv = ExpertWeights::from_stacked(dw.view());
  fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, counts, dwv);  // valid

  Fp8Grouped no_cols = p.dy.q;
  no_cols.data_t = TensorView();
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_wgrad(no_cols, p.x.q, counts, dwv), "dy", "columnwise");
  Fp8Grouped bad_pc = p.x.q;
  bad_pc.padded_capacity += 128;
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_wgrad(p.dy.q, bad_pc, counts, dwv), "x.padded_capacity");
  HostTensor dw16(DType::bf16, {c.E, c.N, c.K});
  WgradOptions acc;
  acc.accumulate = true;
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, counts,
                                           ExpertWeights::from_stacked(dw16.view()), acc),
                    "accumulate", "f32");
  HostTensor mask(DType::i32, {c.E + 1});
  WgradOptions masked;
  masked.expert_mask = mask.view();
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, counts, dwv, masked), "expert_mask");
  HostTensor dw_t(DType::f32, {c.E, c.K, c.N});  // transposed shape
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_wgrad(p.dy.q, p.x.q, counts,
                                           ExpertWeights::from_stacked(dw_t.view())),
                    "dw");
  // x and dy of different capacities.
  ShapeCase c2 = c;
  c2.capacity = c.capacity + 8;
  const Fp8Problem p2(c2, Fp8Recipe::mxfp8, rng);
  GMOE_EXPECT_ERROR(fp8_grouped_gemm_wgrad(p.dy.q, p2.x.q, counts, dwv), "capacity");
}

}  // namespace
}  // namespace gmoe::test
