// tests/common/tolerance.h — the one tolerance rule of every gmoe test suite (DESIGN.md, "Numerics").
//
// An output `got` is compared with `exact`, an fp64 computation on the same inputs the op saw (for
// FP8, the same quantized operands). A reference computed in the op's own precision (`own`: f32
// arithmetic in the same formulas, rounded to the output dtype; the CPU backend where a CUDA kernel
// is tested) has some largest error against exact. The rule:
//
//     max |got - exact|  <=  2 · max |own - exact|  +  atol
//
// and got is NaN exactly where exact is NaN. The relative Frobenius error ||got - exact|| / ||exact||
// is reported beside it. atol comes from one table, keyed by the output dtype and, for FP8 operands
// on Hopper's tensor cores, how their products are accumulated. It covers only what the
// own-precision reference cannot (L: the longest sum behind one output element, 1 for elementwise
// ops; Σ|a·b|: the magnitudes of the products behind it):
//
//   key                              atol                               covers
//   bf16, f16 output                 1e-5                               exact zeros; ties in tiny tensors
//   f32 output                       1e-6 + 4·√L·2⁻²⁴·max|exact|        f32 sums in another order (a
//                                                                       random walk of 4 roundings a step)
//   + e4m3/e5m2, promoted            + 2⁻¹¹·max Σ|a·b|                  each 128-long k-block's products
//                                                                       added in fewer bits than f32
//   + e4m3/e5m2, fast accumulation   + 2⁻¹¹·max Σ|a·b|                  no promotion: a ~14-bit accumulator,
//                                      + ⌈L/32⌉·2⁻¹³·max Σ|a·b|         one rounding per 32-long k-step
//
// The CPU backend accumulates FP8 products in f32 (no FP8 row). FP8 quantization error is never in
// atol: the reference is computed from the same quantized operands (fp8_fixture.h's against_source
// holds a result against the unquantized source with that reference).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "gmoe/dtype.h"

namespace gmoe::test {

struct ExactResult;

/// How FP8 products are accumulated by the op under test (the FP8 rows of the table).
enum class Fp8Accumulation { kNone, kPromoted, kFast };

/// The key of the atol table, and what the atol scales with.
struct Precision {
  DType out = DType::f32;     ///< the output's dtype
  int64_t reduction = 1;      ///< L: the longest sum behind one element (1: elementwise)
  Fp8Accumulation fp8 = Fp8Accumulation::kNone;
  double max_abs_sum = 0;     ///< max Σ|a·b| over the elements (FP8 rows only)
};
/// The key of an exact result rounded to `out`: its reduction length and Σ|a·b|.
Precision precision_of(const ExactResult& exact, DType out, Fp8Accumulation fp8 = Fp8Accumulation::kNone);

/// The table's atol for a result whose exact values are `exact`.
double rule_atol(const Precision& p, const std::vector<double>& exact);

/// Largest error, relative Frobenius error and non-finite count of values against exact values.
struct Comparison {
  double max_abs_err = 0;   ///< max |got - exact| over elements where exact is not NaN
  double rel_frobenius = 0; ///< ||got - exact|| / ||exact||
  int64_t nan_count = 0;    ///< elements non-finite where exact is finite, or finite where it is NaN
  int64_t worst_index = -1;
};
Comparison compare(const std::vector<double>& got, const std::vector<double>& exact);

/// The rule: max |got - exact| <= 2·max |own - exact| + rule_atol(p, exact); NaN where exact is.
::testing::AssertionResult within_rule(const std::vector<double>& got, const std::vector<double>& own,
                                       const std::vector<double>& exact, const Precision& p,
                                       const std::string& what);
/// The rule against an exact result that carries its own-precision twin (exact.f32 rounded to
/// `out`), keyed by `out`, exact.reduction and, for FP8 operands, their accumulation.
::testing::AssertionResult within_rule(const std::vector<double>& got, const ExactResult& exact, DType out,
                                       const std::string& what, Fp8Accumulation fp8 = Fp8Accumulation::kNone);

/// The same with `own` given (a CUDA kernel against the CPU backend's output) and exact an exact
/// result, which keys the table with `out`.
::testing::AssertionResult within_rule(const std::vector<double>& got, const std::vector<double>& own,
                                       const ExactResult& exact, DType out, const std::string& what,
                                       Fp8Accumulation fp8 = Fp8Accumulation::kNone);

/// Each value rounded to `dtype` (through f32, as the ops round).
std::vector<double> rounded(const std::vector<double>& values, DType dtype);

}  // namespace gmoe::test
