// tests/common/mlp_fixture.h — the inputs of one GroupedMLP problem on the host, built from a named
// shape case (weights in both layouts, biases grouped and as lists, probs, counts), the activation
// variants the MLP suites sweep, the host outputs of one forward + backward and their bitwise
// comparison, and the exact (fp64) MLP: FC1 → activation → FC2 and its backward with no
// intermediate rounding. CPU and CUDA suites build the same problems from it.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/activation.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe::test {

/// The interleave block of the interleaved variants (divides every F of mlp_dims).
constexpr int64_t kMlpGluBlock = 16;

/// Each kind (GeGLU exact and tanh; clamped SwiGLU with limit 0.75, which about a quarter of the
/// unit-sized h exceed) concatenated and interleaved in blocks of kMlpGluBlock, then squared ReLU:
/// 9 variants, indices 0..8 (1: swiglu interleaved, 6: clamped concatenated, 8: squared ReLU).
const std::vector<ActivationOptions>& mlp_activation_variants();

/// The variant with clamped SwiGLU's limit at its default (7), which the unit-sized h never reach.
/// For comparisons with the exact MLP: near the limit the derivative jumps, so where h lies within
/// a rounding of it dh depends on which side the rounding fell, and dx, dW1, db1 with it (the
/// clamping itself is checked where inputs are exact: the activation suites, and bitwise against the
/// composition of public ops).
ActivationOptions with_unreached_limit(ActivationOptions o);

/// Hidden and FFN sizes for a named case: the odd sizes of the dim cases (H = 192/1408/2880), small
/// ones elsewhere (kSmall: 40 × 48; kLarge: 128 × 64), 32 × 32 for the many-expert cases.
std::pair<int64_t, int64_t> mlp_dims(const std::string& case_name, CaseScale scale);

enum class MlpBias { kNone, kGrouped, kList };

/// One MLP problem. Weights are scaled so that h and y are about unit size whatever H and F; the
/// list biases (f32) hold the values of the grouped ones (bf16).
struct MlpProblem {
  ShapeCase c;
  ActivationOptions act;
  int64_t E = 0, H = 0, F = 0, rows1 = 0, cap = 0;  ///< rows1: FC1's output rows (2F gated, else F)
  HostTensor x, dy, probs, counts;                  ///< [cap, H] bf16, [cap, H] bf16, f32 [cap], [E]
  HostTensor w1s, w2s;                              ///< [E, rows1, H], [E, H, F] bf16
  std::vector<HostTensor> w1l, w2l;                 ///< the same per expert
  HostTensor b1g, b2g;                              ///< [E, rows1], [E, H] bf16
  std::vector<HostTensor> b1l, b2l;                 ///< E × [rows1], E × [H] f32

  MlpProblem(const std::string& case_name, const ActivationOptions& act, Rng& rng,
             CaseScale scale = CaseScale::kSmall);
  /// The same for explicit counts and capacity (c.E, c.counts, c.capacity) and sizes.
  MlpProblem(const ShapeCase& c, int64_t H, int64_t F, const ActivationOptions& act, Rng& rng);
  ExpertWeights w1(Layout l) const;
  ExpertWeights w2(Layout l) const;
  ExpertBias b1(MlpBias m) const;
  ExpertBias b2(MlpBias m) const;
  TensorView probs_view(bool with) const { return with ? probs.view() : TensorView(); }

  /// Random bf16 experts [E, N, K] uniform in [-a, a), and the same as a list.
  static HostTensor random_experts(int64_t E, int64_t N, int64_t K, double a, Rng& rng,
                                   std::vector<HostTensor>& list);
};

/// Host copies of the outputs of one forward + backward (+ backward_dw). dprobs is empty without
/// probs; dW/db are expert-major values (db empty without bias).
struct MlpOutputs {
  HostTensor y, dx, dprobs;
  std::vector<double> dw1, dw2, db1, db2;
  HostTensor h, z, dz, dh;  ///< intermediates, where the run exposes them (the unfused composition)
};

/// Bitwise equality of two value vectors (the first difference named).
::testing::AssertionResult same_values(const std::vector<double>& a, const std::vector<double>& b,
                                       const std::string& what);
/// Bitwise equality of y, dx, dprobs, dW1, dW2, db1, db2.
::testing::AssertionResult same_outputs(const MlpOutputs& a, const MlpOutputs& b, const std::string& what);

/// The exact MLP on the problem's (rounded) inputs, in fp64 without intermediate rounding.
struct ExactMlp {
  std::vector<double> y, dx, dprobs, dw1, dw2, db1, db2;
};
ExactMlp exact_mlp(const MlpProblem& p, bool with_bias, bool with_probs);
/// The same MLP in the layer's own precision (f32 sums; h, z, dz and dh rounded to bf16 where the
/// layer stores them; the grouped bf16 biases added before the one rounding): the reference of the
/// tolerance rule against exact_mlp. Outputs are f32 sums, rounded by the rule.
ExactMlp own_precision_mlp(const MlpProblem& p, bool with_bias, bool with_probs);

/// The outputs of a run as value vectors (dprobs, db empty where the run has none).
ExactMlp values_of(const MlpOutputs& o);

/// Every output of `got` against `exact` by the tolerance rule, `own` the reference in the
/// layer's own precision (rounded to each output's dtype here: own_precision_mlp's f32 sums, or a
/// backend's outputs, which rounding leaves as they are). Each output keyed by its dtype (y, dx,
/// dW bf16; dprobs f32; db `bias_grad_dtype`) and reduction length. dprobs and db where `got` has them.
void expect_mlp_within_rule(const MlpProblem& p, const MlpOutputs& got, const ExactMlp& own, const ExactMlp& exact,
                            DType bias_grad_dtype);

/// The FP8 option combinations that the delayed/recompute suites run against the immediate run,
/// as bits: 1 fc1.delay_wgrad, 2 fc2.delay_wgrad, 4 recompute_activation, 8 fc1.save_original_input,
/// 16 z quantized after the activation (fp8_quantize_in_activation off).
const std::vector<int>& fp8_option_flags();
void apply_fp8_option_flags(GroupedMLPOptions& o, int flags);
std::string fp8_option_flags_name(int flags);

}  // namespace gmoe::test
