// tests/common/tolerance.cpp — the one tolerance rule (see the header for the rule and its table).
#include "common/tolerance.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/float_convert.h"
#include "common/harness.h"

namespace gmoe::test {
namespace {

constexpr double kAtol16 = 1e-5;                   // bf16, f16: exact zeros, ties of tiny tensors
constexpr double kAtol32 = 1e-6;                   // f32: the same, at f32's precision
constexpr double kF32OrderSteps = 4.0;             // f32 roundings per step of a reordered sum
constexpr double kFp8BlockFraction = 1.0 / 2048.0; // 2^-11 of Σ|a·b|: a 128-long k-block in fewer bits
constexpr double kFp8FastStep = 1.0 / 8192.0;      // 2^-13 of Σ|a·b| per 32-long k-step, unpromoted
constexpr double kU32 = 5.9604644775390625e-08;    // 2^-24

double max_finite_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) {
    if (std::isfinite(x)) m = std::max(m, std::abs(x));
  }
  return m;
}

}  // namespace

Precision precision_of(const ExactResult& exact, DType out, Fp8Accumulation fp8) {
  Precision p;
  p.out = out;
  p.reduction = std::max<int64_t>(exact.reduction, 1);
  p.fp8 = fp8;
  p.max_abs_sum = max_finite_abs(exact.abs_sum);
  return p;
}

double rule_atol(const Precision& p, const std::vector<double>& exact) {
  double atol = p.out == DType::f32 ? kAtol32 : kAtol16;
  if (p.out == DType::f32) {
    atol += kF32OrderSteps * std::sqrt(static_cast<double>(std::max<int64_t>(p.reduction, 1))) * kU32 *
            max_finite_abs(exact);
  }
  if (p.fp8 != Fp8Accumulation::kNone) atol += kFp8BlockFraction * p.max_abs_sum;
  if (p.fp8 == Fp8Accumulation::kFast) {
    atol += static_cast<double>((std::max<int64_t>(p.reduction, 1) + 31) / 32) * kFp8FastStep * p.max_abs_sum;
  }
  return atol;
}

Comparison compare(const std::vector<double>& got, const std::vector<double>& exact) {
  Comparison c;
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const bool want_nan = std::isnan(exact[i]);
    if (want_nan != std::isnan(got[i]) || (!std::isfinite(got[i]) && std::isfinite(exact[i]))) {
      if (c.nan_count++ == 0) c.worst_index = static_cast<int64_t>(i);
      continue;
    }
    if (want_nan || std::isinf(exact[i])) continue;
    const double d = std::abs(got[i] - exact[i]);
    if (d > c.max_abs_err) {
      c.max_abs_err = d;
      if (c.nan_count == 0) c.worst_index = static_cast<int64_t>(i);
    }
    err2 += d * d;
    ref2 += exact[i] * exact[i];
  }
  c.rel_frobenius = ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2);
  return c;
}

::testing::AssertionResult within_rule(const std::vector<double>& got, const std::vector<double>& own,
                                       const std::vector<double>& exact, const Precision& p,
                                       const std::string& what) {
  if (got.size() != exact.size() || own.size() != exact.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values and a reference of "
                                         << own.size() << ", expected " << exact.size();
  }
  const Comparison k = compare(got, exact);
  const Comparison r = compare(own, exact);
  const double atol = rule_atol(p, exact);
  const double limit = 2.0 * r.max_abs_err + atol;
  std::ostringstream msg;
  msg << what << ": max err " << k.max_abs_err << " (limit " << limit << " = 2 x own-precision reference's "
      << r.max_abs_err << " + atol " << atol << " of " << dtype_name(p.out) << "), rel Frobenius "
      << k.rel_frobenius << " (reference's " << r.rel_frobenius << ")";
  if (r.nan_count > 0) msg << "; the reference itself has " << r.nan_count << " NaN mismatches";
  if (k.nan_count > 0 || r.nan_count > 0 || k.max_abs_err > limit) {
    const int64_t i = k.worst_index;
    msg << "; " << k.nan_count << " NaN mismatches; worst at flat index " << i;
    if (i >= 0) msg << ": got " << got[i] << ", exact " << exact[i] << ", reference " << own[i];
    return ::testing::AssertionFailure() << msg.str();
  }
  return ::testing::AssertionSuccess() << msg.str();
}

::testing::AssertionResult within_rule(const std::vector<double>& got, const ExactResult& exact, DType out,
                                       const std::string& what, Fp8Accumulation fp8) {
  return within_rule(got, rounded(exact.f32, out), exact.value, precision_of(exact, out, fp8), what);
}

::testing::AssertionResult within_rule(const std::vector<double>& got, const std::vector<double>& own,
                                       const ExactResult& exact, DType out, const std::string& what,
                                       Fp8Accumulation fp8) {
  return within_rule(got, own, exact.value, precision_of(exact, out, fp8), what);
}

std::vector<double> rounded(const std::vector<double>& values, DType dtype) {
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    float f = static_cast<float>(values[i]);
    if (dtype != DType::f32) {
      uint8_t bytes[4];
      store_float(bytes, dtype, 0, f);
      f = load_float(bytes, dtype, 0);
    }
    out[i] = f;
  }
  return out;
}

}  // namespace gmoe::test
