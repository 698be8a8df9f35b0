// tests/common/activation_oracle.h — the activations of gmoe/activation.h computed exactly (fp64)
// for the test suites: values and partial derivatives written out from the formulas (independently
// of src/common/activation_math.h), the gate/up column layout, grouped forward and backward on host
// tensors, each with the same formulas evaluated in f32: the own-precision reference of the
// tolerance rule (common/tolerance.h). Where the exact value is NaN the output must be NaN.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/harness.h"
#include "gmoe/activation.h"

namespace gmoe::test {

/// A gated activation's exact value and partial derivatives at (gate, up).
struct ExactGated {
  double value = 0, d_gate = 0, d_up = 0;
};
/// Gated kinds (swiglu, geglu, clamped_swiglu) with the options' alpha, limit and GELU form.
ExactGated exact_gated(const ActivationOptions& o, double g, double u);
/// squared_relu: relu(h)²; `derivative` (optional) gets 2·relu(h) (0 at h = 0 and for NaN).
double exact_squared_relu(double h, double* derivative = nullptr);

/// The same formulas evaluated in f32 (the own-precision reference of the tolerance rule).
ExactGated f32_gated(const ActivationOptions& o, double g, double u);
double f32_squared_relu(double h, double* derivative = nullptr);

/// Column of gate element j (of F) among h's 2F columns, and of the matching up element.
int64_t gate_column(const GluFormat& glu, int64_t F, int64_t j);
int64_t up_column(const GluFormat& glu, int64_t F, int64_t j);

/// Exact grouped activation of host tensors, each output an ExactResult (value: fp64; f32: the
/// same formulas in f32, before the output's rounding; dprobs is a sum over F columns, its
/// abs_sum Σ|dz·act|). Rows >= total are exactly 0.
struct ExactActivation {
  ExactResult z;       ///< [capacity, F]: act(h)·p
  ExactResult dh;      ///< [capacity, cols of h] (backward only)
  ExactResult dprobs;  ///< [capacity]: Σ_j dz·act(h) (backward only)
};
/// h: [capacity, activation_input_cols(kind, F)]; dz: [capacity, F] or nullptr (forward only);
/// probs: capacity values or nullptr. dz_exact: where dz is the rounded result of an upstream op
/// (the dgrad of grouped_gemm_dgrad_activation_backward), its exact values for the fp64 side; the
/// f32 side takes dz as rounded.
ExactActivation exact_activation(const HostTensor& h, const HostTensor* dz, const std::vector<double>* probs,
                                 int64_t total, const ActivationOptions& o, int64_t F,
                                 const std::vector<double>* dz_exact = nullptr);

/// The activation suites' sweep: each gated kind (GeGLU exact and tanh) concatenated and
/// interleaved in blocks of 1, 32 and 64, then squared ReLU (17 variants; F must be a multiple of 64).
const std::vector<ActivationOptions>& activation_test_variants();

/// h [cap, activation_input_cols(kind, F)] for a sweep: uniform in [-4, 4) (both saturating ends
/// of sigmoid and gelu); clamped SwiGLU sees [-10, 10) with about one value in sixteen exactly at
/// ±limit; rows at or past `total` hold NaN, which must not leak into any output.
HostTensor random_activation_input(const ActivationOptions& o, DType dt, int64_t cap, int64_t total, int64_t F,
                                   Rng& rng);

/// "swiglu", "geglu_tanh", "clamped_swiglu" ... with the GLU layout: for test names.
std::string activation_case_name(const ActivationOptions& o);

/// Each expert's largest finite |value| of t ([capacity, cols], contiguous) over its rows, as f32
/// (0 for an expert without rows): what grouped_activation_*'s amax_out must hold for the output t.
/// `counts` as given to the op (every test total fits the capacity).
std::vector<float> expert_amax(const HostTensor& t, const std::vector<int64_t>& counts);
/// The same as an f32 [E] tensor (an Fp8QuantizeOptions::amax).
HostTensor expert_amax_tensor(const HostTensor& t, const std::vector<int64_t>& counts);
/// `amax` (an amax_out, f32 [E]) is bitwise expert_amax(t, counts); else a failure naming `what`.
::testing::AssertionResult amax_matches(const HostTensor& amax, const HostTensor& t, const std::vector<int64_t>& counts,
                                        const std::string& what);

}  // namespace gmoe::test
