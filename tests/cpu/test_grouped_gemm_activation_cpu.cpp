// tests/cpu/test_grouped_gemm_activation_cpu.cpp — grouped_gemm_fprop_activation and
// grouped_gemm_dgrad_activation_backward against the independent fp64 oracles of tests/common
// (the grouped GEMM of harness.h, the activation of activation_oracle.h) by the tolerance rule, on
// every named shape case, every activation kind (GeGLU exact and tanh), gate/up concatenated and
// interleaved in blocks of 1, 8 and 16, with and without router probabilities and a bias (bf16 or
// f32, grouped or a list), dh over h and apart from it. Outputs are NaN-poisoned; rows past the
// real total must be exactly 0.
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "common/activation_oracle.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/activation.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

// The activation suites' sweep with the interleave blocks that divide F of every named case (1, 8,
// 16), clamped SwiGLU's limit where h of about ±3 crosses it now and then.
const std::vector<ActivationOptions>& variants() {
  static const std::vector<ActivationOptions> kVariants = [] {
    std::vector<ActivationOptions> v;
    for (ActivationOptions o : activation_test_variants()) {
      if (o.glu.block > 16) continue;
      o.limit = 2.5f;
      v.push_back(o);
    }
    return v;
  }();
  return kVariants;
}

using Param = std::tuple<std::string, int>;  // named case, index into variants()

class CpuGemmActivation : public ::testing::TestWithParam<Param> {
 protected:
  const ActivationOptions& act() const { return variants()[std::get<1>(GetParam())]; }
  // FC1 of the case: [E, N = activation_input_cols(kind, F), K]; F = N/2 for gated kinds.
  ShapeCase make(Rng& rng) const { return make_case(std::get<0>(GetParam()), rng); }
  int64_t ffn(const ShapeCase& c) const { return is_gated(act().kind) ? c.N / 2 : c.N; }
};

void expect_zero_rows(const HostTensor& t, int64_t from, const std::string& what) {
  const int64_t cols = t.shape()[1];
  for (int64_t i = from * cols; i < t.numel(); ++i) {
    ASSERT_EQ(t.get(i), 0.0) << what << ": row " << i / cols << " past the total";
  }
}

// h = x·W_eᵀ (+ b_e) against the exact GEMM; z = act(h)·p against the oracle of the activation of
// the h the op wrote (the op's contract: z is the activation of the stored h).
TEST_P(CpuGemmActivation, FpropActivationAgainstTheOracles) {
  Rng rng;
  const ShapeCase c = make(rng);
  const ActivationOptions& o = act();
  const int64_t F = ffn(c);
  const GemmProblem p(c, DType::bf16, rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  const Layout layout = rng.integer(0, 1) ? Layout::kStacked : Layout::kList;
  for (int variant = 0; variant < 3; ++variant) {
    const bool with_probs = variant != 0, with_bias = variant == 2;
    const DType bias_dtype = rng.integer(0, 1) ? DType::bf16 : DType::f32;
    SCOPED_TRACE(std::string(with_probs ? "with probs" : "without probs") +
                 (with_bias ? std::string(", ") + dtype_name(bias_dtype) + " bias" : std::string()));
    HostTensor bias(bias_dtype, {c.E, c.N}), probs(DType::f32, {c.capacity});
    fill_random(bias, rng);
    fill_random(probs, rng, 0.0, 1.0);
    const ExpertBias b = with_bias ? expert_bias(bias.view(), layout) : ExpertBias();
    HostTensor h(DType::bf16, {c.capacity, c.N}), z(DType::bf16, {c.capacity, F});
    poison(h);
    poison(z);
    grouped_gemm_fprop_activation(p.x.view(), p.weights(layout), b, p.counts.view(), h.view(), z.view(), o,
                                  with_probs ? probs.view() : TensorView());

    // h: the f32 sums (+ the bias before the one rounding for a bf16 bias, after it otherwise).
    ExactResult eh = exact_fprop(p.x, p.w, c.counts);
    if (with_bias) add_bias(eh, bias, c.counts, DType::bf16, bias_dtype == DType::bf16);
    EXPECT_TRUE(within_rule(h.to_double(), eh, DType::bf16, "h"));
    const std::vector<double> pv = probs.to_double();
    const ExactActivation ez = exact_activation(h, nullptr, with_probs ? &pv : nullptr, c.total(), o, F);
    EXPECT_TRUE(within_rule(z.to_double(), ez.z, DType::bf16, "z = act(h)·p"));
    expect_zero_rows(h, c.total(), "h");
    expect_zero_rows(z, c.total(), "z");
  }
}

// dh = act'(h) · (dy·W_e) against the exact dgrad through the oracle's derivatives; the
// own-precision reference rounds dz to bf16 between the two, as the op does.
// grouped_gemm_dgrad_activation_backward takes gated activations: every variant but the last
// (squared ReLU).
class CpuGemmActivationBackward : public CpuGemmActivation {};

TEST_P(CpuGemmActivationBackward, DgradActivationBackwardAgainstTheOracles) {
  const ActivationOptions& o = act();
  ASSERT_TRUE(is_gated(o.kind)) << "activation_test_variants() ends with its one non-gated kind";
  Rng rng;
  const ShapeCase fc1 = make(rng);
  const int64_t F = ffn(fc1), H = fc1.K;
  // FC2: [E, H, F]; its dgrad dz = dy·W_e is [capacity, F].
  ShapeCase c = fc1;
  c.N = H;
  c.K = F;
  const GemmProblem p(c, DType::bf16, rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  const ExpertWeights w = p.weights(rng.integer(0, 1) ? Layout::kStacked : Layout::kList);
  const HostTensor h0 = random_activation_input(o, DType::bf16, c.capacity, c.total(), F, rng);
  const ExactResult edz = exact_dgrad(p.dy, p.w, c.counts);
  HostTensor dz_own(DType::bf16, {c.capacity, F});
  const std::vector<double> dz_rounded = rounded(edz.f32, DType::bf16);
  for (int64_t i = 0; i < dz_own.numel(); ++i) dz_own.set(i, dz_rounded[i]);
  const ExactActivation ex = exact_activation(h0, &dz_own, nullptr, c.total(), o, F, &edz.value);
  for (bool in_place : {true, false}) {
    SCOPED_TRACE(in_place ? "dh over h" : "dh apart from h");
    HostTensor h = h0, dh(DType::bf16, {c.capacity, 2 * F});
    poison(dh);
    grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h.view(), in_place ? h.view() : dh.view(),
                                           o);
    const HostTensor& got = in_place ? h : dh;
    EXPECT_TRUE(within_rule(got.to_double(), ex.dh, DType::bf16, "dh"));
    expect_zero_rows(got, c.total(), "dh");
    if (!in_place) EXPECT_TRUE(bitwise_equal(h, h0, "h (left as it was)"));
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param) + "_" + activation_case_name(variants()[std::get<1>(info.param)]);
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CpuGemmActivation,
                         ::testing::Combine(::testing::ValuesIn(named_case_names()),
                                            ::testing::Range(0, int(variants().size()))),
                         param_name);
INSTANTIATE_TEST_SUITE_P(NamedCases, CpuGemmActivationBackward,
                         ::testing::Combine(::testing::ValuesIn(named_case_names()),
                                            ::testing::Range(0, int(variants().size()) - 1)),
                         param_name);

}  // namespace
}  // namespace gmoe::test
