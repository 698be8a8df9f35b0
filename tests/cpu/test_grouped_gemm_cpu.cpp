// tests/cpu/test_grouped_gemm_cpu.cpp — the CPU reference grouped GEMM against a naive fp64
// computation, by the tolerance rule (common/tolerance.h: at most 2x the error of the f32 sums of
// tests/common rounded to the output dtype), on every named shape case: three passes, bf16/f16/f32 inputs, both weight layouts,
// outputs in the input dtype and f32, wgrad overwrite/accumulate with and without an expert mask.
#include <gtest/gtest.h>

#include <string>
#include <tuple>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

using Param = std::tuple<DType, Layout, std::string>;

class CpuGroupedGemm : public ::testing::TestWithParam<Param> {
 protected:
  DType dtype() const { return std::get<0>(GetParam()); }
  Layout layout() const { return std::get<1>(GetParam()); }
  ShapeCase make(Rng& rng) const { return make_case(std::get<2>(GetParam()), rng); }
};

TEST_P(CpuGroupedGemm, Fprop) {
  Rng rng;
  const ShapeCase c = make(rng);
  const GemmProblem p(c, dtype(), rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  const ExactResult exact = exact_fprop(p.x, p.w, c.counts);
  for (DType out_dtype : {dtype(), DType::f32}) {
    HostTensor y(out_dtype, {c.capacity, c.N});
    poison(y);
    grouped_gemm_fprop(p.x.view(), p.weights(layout()), p.counts.view(), y.view());
    EXPECT_TRUE(within_rule(y.to_double(), exact, out_dtype, std::string("fprop out ") + dtype_name(out_dtype)));
  }
}

// fprop with a bias (grouped [E, N] or a list; dtype of x or f32). bf16 with a bf16 bias: added
// to the f32 sum before the one rounding; other dtypes: the GEMM's output rounded, then the bias
// added and rounded again. The own-precision reference does the same.
TEST_P(CpuGroupedGemm, FpropWithBias) {
  Rng rng;
  const ShapeCase c = make(rng);
  const GemmProblem p(c, dtype(), rng);
  HostTensor bias(rng.integer(0, 1) ? dtype() : DType::f32, {c.E, c.N});
  fill_random(bias, rng);
  std::vector<HostTensor> rows;
  for (int64_t e = 0; e < c.E; ++e) {
    HostTensor v(bias.dtype(), {c.N});
    for (int64_t n = 0; n < c.N; ++n) v.set(n, bias.get(e * c.N + n));
    rows.push_back(std::move(v));
  }
  std::vector<TensorView> list;
  for (const HostTensor& v : rows) list.push_back(v.view());
  const bool as_list = rng.integer(0, 1) == 1;
  const ExpertBias b = as_list ? ExpertBias::from_list(list) : ExpertBias::from_grouped(bias.view());
  ExactResult exact = exact_fprop(p.x, p.w, c.counts);
  add_bias(exact, bias, c.counts, dtype(), dtype() == DType::bf16 && bias.dtype() == DType::bf16);
  HostTensor y(dtype(), {c.capacity, c.N});
  poison(y);
  grouped_gemm_fprop(p.x.view(), p.weights(layout()), b, p.counts.view(), y.view());
  EXPECT_TRUE(within_rule(y.to_double(), exact, dtype(),
                          std::string("fprop + bias (") + (as_list ? "list " : "grouped ") + dtype_name(bias.dtype()) + ")"));
}

TEST_P(CpuGroupedGemm, Dgrad) {
  Rng rng;
  const ShapeCase c = make(rng);
  const GemmProblem p(c, dtype(), rng);
  const ExactResult exact = exact_dgrad(p.dy, p.w, c.counts);
  for (DType out_dtype : {dtype(), DType::f32}) {
    HostTensor dx(out_dtype, {c.capacity, c.K});
    poison(dx);
    grouped_gemm_dgrad(p.dy.view(), p.weights(layout()), p.counts.view(), dx.view());
    EXPECT_TRUE(within_rule(dx.to_double(), exact, out_dtype, std::string("dgrad out ") + dtype_name(out_dtype)));
  }
}

TEST_P(CpuGroupedGemm, Wgrad) {
  Rng rng;
  const ShapeCase c = make(rng);
  const GemmProblem p(c, dtype(), rng);
  // Overwrite into the input dtype and into f32: every expert written, empty experts exactly 0.
  for (DType out_dtype : {dtype(), DType::f32}) {
    HostExpertTensor dw(layout(), out_dtype, c.E, c.N, c.K);
    dw.poison_all();
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), p.counts.view(), dw.view());
    const ExactResult exact = exact_wgrad(p.dy, p.x, c.counts, nullptr, nullptr);
    const std::vector<double> got = dw.to_double();
    EXPECT_TRUE(within_rule(got, exact, out_dtype, std::string("wgrad out ") + dtype_name(out_dtype)));
    for (int64_t e = 0; e < c.E; ++e) {
      if (c.counts[e] != 0) continue;
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        ASSERT_EQ(got[e * c.N * c.K + i], 0.0) << "empty expert " << e << " not exactly zero";
      }
    }
  }
}

TEST_P(CpuGroupedGemm, WgradAccumulateWithMask) {
  Rng rng;
  const ShapeCase c = make(rng);
  const GemmProblem p(c, dtype(), rng);
  std::vector<int32_t> mask(static_cast<size_t>(c.E));
  for (auto& m : mask) m = static_cast<int32_t>(rng.integer(0, 1));
  HostTensor mask_t(DType::i32, {c.E});
  for (int64_t e = 0; e < c.E; ++e) mask_t.set(e, mask[e]);
  for (bool accumulate : {false, true}) {
    HostExpertTensor dw(layout(), DType::f32, c.E, c.N, c.K);
    HostTensor init(DType::f32, {c.E, c.N, c.K});
    fill_random(init, rng, -4.0, 4.0);
    const std::vector<double> init_v = init.to_double();
    dw.set_all(init_v);
    WgradOptions opt;
    opt.accumulate = accumulate;
    opt.expert_mask = mask_t.view();
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), p.counts.view(), dw.view(), opt);
    // Masked experts keep init; others: init + product (accumulate) or the product (overwrite).
    ExactResult exact = exact_wgrad(p.dy, p.x, c.counts, accumulate ? &init_v : nullptr, &mask);
    const std::vector<double> got = dw.to_double();
    for (int64_t e = 0; e < c.E; ++e) {
      if (mask[e] != 0) continue;
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        exact.value[e * c.N * c.K + i] = exact.f32[e * c.N * c.K + i] = init_v[e * c.N * c.K + i];
        ASSERT_EQ(got[e * c.N * c.K + i], init_v[e * c.N * c.K + i]) << "masked expert " << e << " was written";
      }
    }
    EXPECT_TRUE(within_rule(got, exact, DType::f32, accumulate ? "wgrad accumulate+mask" : "wgrad overwrite+mask"));
  }
}

// WgradOptions::masked_off = fresh: mask-1 experts into main_grad (overwritten or accumulated),
// mask-0 experts written into the fresh buffer, in the other layout than main_grad's (each
// destination's layout is its own); every element each must not touch is checked bitwise.
TEST_P(CpuGroupedGemm, WgradMaskedOffFresh) {
  Rng rng;
  const ShapeCase c = make(rng);
  const GemmProblem p(c, dtype(), rng);
  const MaskedOffDestinations d(c.E, c.N, c.K, rng);
  for (bool accumulate : {false, true}) {
    MaskedOffBuffers out(d, layout(), c.E, c.N, c.K);
    HostExpertTensor& main = out.main;
    HostExpertTensor& fresh = out.fresh;
    const WgradOptions opt = masked_off_wgrad_options(accumulate, d.mask_t.view(), fresh.view());
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), p.counts.view(), main.view(), opt);
    expect_masked_off_destinations(d, p.dy, p.x, c.counts, accumulate, main.to_double(), fresh.to_double(), nullptr,
                                   nullptr, accumulate ? "wgrad accumulate, masked off fresh" : "wgrad, masked off fresh");
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" + layout_name(std::get<1>(info.param)) +
         "_" + std::get<2>(info.param);
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CpuGroupedGemm,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f16, DType::f32),
                                            ::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::ValuesIn(named_case_names())),
                         param_name);

}  // namespace
}  // namespace gmoe::test
