// tests/common/fp8_fixture.cpp — host-side FP8 grouped-GEMM problems for the test suites.
#include "common/fp8_fixture.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "common/fp8_rules.h"
#include "gmoe/error.h"

namespace gmoe::test {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

const uint8_t* bytes(const TensorView& t) { return static_cast<const uint8_t*>(t.data); }

// Scale `i` of a scale tensor: f32, or e8m0 for mxfp8.
double scale_at(const TensorView& s, int64_t i) {
  if (s.dtype == DType::e8m0) return fp8_rules::e8m0_to_float(bytes(s)[i]);
  return static_cast<const float*>(s.data)[i];
}

double fp8_at(const TensorView& d, int64_t i, DType format) {
  return fp8_rules::fp8_to_float(bytes(d)[i], format == DType::e5m2);
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

int64_t block_of(Fp8Recipe r) { return r == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block; }

// Σ|v| over each row of a [rows, cols] tensor.
std::vector<double> row_abs_sums(const HostTensor& t) {
  const int64_t rows = t.shape()[0], cols = t.shape()[1];
  std::vector<double> s(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) s[r] += std::abs(t.get(r * cols + c));
  }
  return s;
}

double max_abs(const HostTensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.get(i)));
  return m;
}

// The bound of recipe_bound_* from the per-element sums (see fp8_fixture.h).
double product_bound(double u, double s_ab, double s_a, double s_b, double t_a, double t_b,
                     double length) {
  return (2 * u + u * u) * s_ab + (1 + u) * (t_a * s_b + t_b * s_a) + length * t_a * t_b;
}

constexpr double kSubnormalFraction = 1.0 / 262144.0;  // 2^-18 (see fp8_fixture.h)

// Output rounding on top of the product bound, and slack for the fp32 accumulation.
double finish_bound(double product, double exact_abs, DType out, double s_ab) {
  return product + unit_roundoff(out) * (exact_abs + product) + std::ldexp(1.0, -10) * s_ab + 1e-6;
}

}  // namespace

HostTensor decode_grouped(const Fp8Grouped& q, const std::vector<int64_t>& counts, Fp8Copy which) {
  const int64_t cap = q.capacity, cols = q.cols;
  const std::vector<int64_t> off = offsets_of(counts);
  const int64_t block = block_of(q.recipe);
  HostTensor out(DType::f32, {cap, cols});
  for (int64_t i = 0; i < out.numel(); ++i) out.set(i, 0.0);
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        double v;
        if (which == Fp8Copy::rowwise) {
          const double s = q.recipe == Fp8Recipe::tensorwise
                               ? scale_at(q.scale_inv, static_cast<int64_t>(e))
                               : scale_at(q.scale_inv, q.recipe == Fp8Recipe::blockwise
                                                           ? c / block * cap + r  // token-major
                                                           : r * ceil_div(cols, block) + c / block);
          v = fp8_at(q.data, r * cols + c, q.format) * s;
        } else {
          const int64_t P = q.padded_capacity;
          const int64_t p = static_cast<const int64_t*>(q.padded_offsets.data)[e] + (r - off[e]);
          const double s = q.recipe == Fp8Recipe::tensorwise
                               ? scale_at(q.scale_inv_t, static_cast<int64_t>(e))
                           : q.recipe == Fp8Recipe::blockwise  // [P/128, cols]
                               ? scale_at(q.scale_inv_t, p / block * cols + c)
                               : scale_at(q.scale_inv_t, c * (P / block) + p / block);
          v = fp8_at(q.data_t, c * P + p, q.format) * s;
        }
        out.set(r * cols + c, v);
      }
    }
  }
  return out;
}

std::vector<HostTensor> decode_weights(const Fp8Weights& q, Fp8Copy which) {
  const int64_t E = q.experts, N = q.rows, K = q.cols;
  std::vector<HostTensor> out;
  for (int64_t e = 0; e < E; ++e) {
    HostTensor m(DType::f32, {N, K});
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        double v;
        if (which == Fp8Copy::rowwise) {
          int64_t si = e;  // tensorwise
          if (q.recipe == Fp8Recipe::blockwise) {
            si = (e * ceil_div(N, kFp8Block) + n / kFp8Block) * ceil_div(K, kFp8Block) +
                 k / kFp8Block;
          } else if (q.recipe == Fp8Recipe::mxfp8) {
            si = (e * N + n) * ceil_div(K, kMxBlock) + k / kMxBlock;
          }
          v = fp8_at(q.data, (e * N + n) * K + k, q.format) * scale_at(q.scale_inv, si);
        } else {
          int64_t si = e;
          if (q.recipe == Fp8Recipe::blockwise) {
            si = (e * ceil_div(K, kFp8Block) + k / kFp8Block) * ceil_div(N, kFp8Block) +
                 n / kFp8Block;
          } else if (q.recipe == Fp8Recipe::mxfp8) {
            si = (e * K + k) * ceil_div(N, kMxBlock) + n / kMxBlock;
          }
          v = fp8_at(q.data_t, (e * K + k) * N + n, q.format) * scale_at(q.scale_inv_t, si);
        }
        m.set(n * K + k, v);
      }
    }
    out.push_back(std::move(m));
  }
  return out;
}

double fp8_relative_error(Fp8Recipe recipe, DType format) {
  const double rounding = format == DType::e5m2 ? 0.125 : 0.0625;
  return recipe == Fp8Recipe::mxfp8 ? std::max(rounding, 0.125) : rounding;
}

Fp8Problem::Fp8Problem(const ShapeCase& c, Fp8Recipe r, Rng& rng, DType counts_dtype, DType fmt,
                       std::optional<DType> grad_fmt)
    : base(c, DType::bf16, rng, counts_dtype), recipe(r), format(fmt), grad_format(grad_fmt.value_or(fmt)) {
  Fp8QuantizeOptions o;
  o.recipe = r;
  o.format = fmt;
  o.rowwise = true;
  o.columnwise = true;
  Fp8QuantizeOptions og = o;
  og.format = grad_format;
  x = quantize_grouped(GroupedRows{base.x.view(), base.counts.view()}, o);
  dy = quantize_grouped(GroupedRows{base.dy.view(), base.counts.view()}, og);
  w = quantize_weights(base.weights(Layout::kStacked), o);
  x_rows = decode_grouped(x.q, c.counts, Fp8Copy::rowwise);
  dy_rows = decode_grouped(dy.q, c.counts, Fp8Copy::rowwise);
  x_cols = decode_grouped(x.q, c.counts, Fp8Copy::columnwise);
  dy_cols = decode_grouped(dy.q, c.counts, Fp8Copy::columnwise);
  w_data = decode_weights(w.q, Fp8Copy::rowwise);
  w_t = decode_weights(w.q, Fp8Copy::columnwise);
}

double Fp8Problem::u_grads() const {
  return std::max(fp8_relative_error(recipe, format), fp8_relative_error(recipe, grad_format));
}

::testing::AssertionResult within_bound(const std::vector<double>& got,
                                        const std::vector<double>& exact,
                                        const std::vector<double>& bound, const std::string& what) {
  if (got.size() != exact.size() || bound.size() != exact.size()) {
    return ::testing::AssertionFailure() << what << ": size mismatch";
  }
  double worst = 0;
  int64_t worst_i = -1;
  double err2 = 0, ref2 = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(got[i] - exact[i]);
    if (!(err <= bound[i])) {  // NaN fails
      return ::testing::AssertionFailure()
             << what << ": element " << i << " = " << got[i] << ", exact " << exact[i]
             << ", error " << err << " > bound " << bound[i];
    }
    const double ratio = bound[i] > 0 ? err / bound[i] : 0;
    if (ratio > worst) {
      worst = ratio;
      worst_i = static_cast<int64_t>(i);
    }
    err2 += err * err;
    ref2 += exact[i] * exact[i];
  }
  std::ostringstream msg;
  msg << what << ": worst error/bound " << worst << " at " << worst_i << ", rel Frobenius "
      << (ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2));
  return ::testing::AssertionSuccess() << msg.str();
}

std::vector<double> recipe_bound_fprop(const Fp8Problem& p, double u, DType out) {
  const ShapeCase& c = p.base.shape;
  const ExactResult ex = exact_fprop(p.base.x, p.base.w, c.counts);
  const std::vector<double> sx = row_abs_sums(p.base.x);
  const double tx = kSubnormalFraction * max_abs(p.base.x);
  const double tw = kSubnormalFraction * max_abs(p.base.w_stacked);
  const std::vector<int64_t> off = offsets_of(c.counts);
  std::vector<double> bound(ex.value.size(), 0.0);
  for (int64_t e = 0; e < c.E; ++e) {
    const std::vector<double> sw = row_abs_sums(p.base.w[e]);
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t n = 0; n < c.N; ++n) {
        const int64_t i = r * c.N + n;
        const double b = product_bound(u, ex.abs_sum[i], sx[r], sw[n], tx, tw, c.K);
        bound[i] = finish_bound(b, std::abs(ex.value[i]), out, ex.abs_sum[i]);
      }
    }
  }
  return bound;
}

std::vector<double> recipe_bound_dgrad(const Fp8Problem& p, double u, DType out) {
  const ShapeCase& c = p.base.shape;
  const ExactResult ex = exact_dgrad(p.base.dy, p.base.w, c.counts);
  const std::vector<double> sdy = row_abs_sums(p.base.dy);
  const double tdy = kSubnormalFraction * max_abs(p.base.dy);
  const double tw = kSubnormalFraction * max_abs(p.base.w_stacked);
  const std::vector<int64_t> off = offsets_of(c.counts);
  std::vector<double> bound(ex.value.size(), 0.0);
  for (int64_t e = 0; e < c.E; ++e) {
    std::vector<double> sw(static_cast<size_t>(c.K), 0.0);  // Σ_n |w[n, k]|
    for (int64_t n = 0; n < c.N; ++n) {
      for (int64_t k = 0; k < c.K; ++k) sw[k] += std::abs(p.base.w[e].get(n * c.K + k));
    }
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t k = 0; k < c.K; ++k) {
        const int64_t i = r * c.K + k;
        const double b = product_bound(u, ex.abs_sum[i], sdy[r], sw[k], tdy, tw, c.N);
        bound[i] = finish_bound(b, std::abs(ex.value[i]), out, ex.abs_sum[i]);
      }
    }
  }
  return bound;
}

std::vector<double> recipe_bound_wgrad(const Fp8Problem& p, double u, DType out) {
  const ShapeCase& c = p.base.shape;
  const ExactResult ex = exact_wgrad(p.base.dy, p.base.x, c.counts, nullptr, nullptr);
  const double tdy = kSubnormalFraction * max_abs(p.base.dy);
  const double tx = kSubnormalFraction * max_abs(p.base.x);
  const std::vector<int64_t> off = offsets_of(c.counts);
  std::vector<double> bound(ex.value.size(), 0.0);
  for (int64_t e = 0; e < c.E; ++e) {
    // Σ over the expert's tokens of |dy[:, n]| and |x[:, k]|.
    std::vector<double> sdy(static_cast<size_t>(c.N), 0.0), sx(static_cast<size_t>(c.K), 0.0);
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t n = 0; n < c.N; ++n) sdy[n] += std::abs(p.base.dy.get(r * c.N + n));
      for (int64_t k = 0; k < c.K; ++k) sx[k] += std::abs(p.base.x.get(r * c.K + k));
    }
    for (int64_t n = 0; n < c.N; ++n) {
      for (int64_t k = 0; k < c.K; ++k) {
        const int64_t i = (e * c.N + n) * c.K + k;
        const double b = product_bound(u, ex.abs_sum[i], sdy[n], sx[k], tdy, tx, c.counts[e]);
        bound[i] = finish_bound(b, std::abs(ex.value[i]), out, ex.abs_sum[i]);
      }
    }
  }
  return bound;
}

}  // namespace gmoe::test
