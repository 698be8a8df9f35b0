// tests/cpu/test_grouped_bias_cpu.cpp — the CPU reference of the bias gradient, grouped_bias_grad:
// within the tolerance rule of the exact sums (its f32 order is the own-precision reference's),
// exactly 0 for empty experts, rows past the total and the row stride's padding never added; every
// named case of bias_grad_cases, dy in bf16/f16/f32, the gradient grouped and as a list in dy's
// dtype and f32, poisoned first, counts i32 and i64.
#include <gtest/gtest.h>

#include <string>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/grouped_bias.h"

namespace gmoe::test {
namespace {

class CpuBiasGrad : public ::testing::TestWithParam<DType> {};

TEST_P(CpuBiasGrad, MatchesExactSums) {
  Rng rng;
  for (const BiasGradCase& c : bias_grad_cases(GetParam(), rng)) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size());
    const HostTensor counts = make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
    const ExactResult exact = exact_bias_grad(c.dy, c.counts);
    for (const BiasForm& form : bias_forms(GetParam())) {
      SCOPED_TRACE(form.name());
      HostTensor db(form.dtype, {E, c.cols});
      poison(db);
      grouped_bias_grad(c.view(), counts.view(), expert_bias(db.view(), form.layout));
      EXPECT_TRUE(within_rule(db.to_double(), exact, form.dtype, "db"));
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t n = 0; c.counts[e] == 0 && n < c.cols; ++n) {
          ASSERT_EQ(db.get(e * c.cols + n), 0.0) << "empty expert " << e;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CpuBiasGrad, ::testing::Values(DType::bf16, DType::f16, DType::f32),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

}  // namespace
}  // namespace gmoe::test
