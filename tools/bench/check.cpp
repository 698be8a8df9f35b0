// tools/bench/check.cpp — sampled correctness checks and host input generation.
#include "bench/check.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <sstream>

#include "common/float_convert.h"

namespace gmoe::bench {
namespace {

struct Sample {
  double exact = 0;
  double abs_sum = 0;  // Σ|a·b|
  float own = 0;  // f32 sequential accumulation, as the reference backend's precision
};

template <typename Term>
Sample reduce(int64_t len, Term term) {
  Sample s;
  for (int64_t l = 0; l < len; ++l) {
    const auto [a, b] = term(l);
    s.exact += static_cast<double>(a) * static_cast<double>(b);
    s.abs_sum += std::abs(static_cast<double>(a) * static_cast<double>(b));
    s.own += a * b;
  }
  return s;
}

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

int64_t count_nonfinite(const void* p, DType dt, int64_t n) {
  int64_t bad = 0;
  if (dt == DType::f32) {
    const uint32_t* u = static_cast<const uint32_t*>(p);
#pragma omp parallel for reduction(+ : bad)
    for (int64_t i = 0; i < n; ++i) bad += (u[i] & 0x7f800000u) == 0x7f800000u;
    return bad;
  }
  const uint16_t mask = dt == DType::bf16 ? 0x7f80 : 0x7c00;
  const uint16_t* u = static_cast<const uint16_t*>(p);
#pragma omp parallel for reduction(+ : bad)
  for (int64_t i = 0; i < n; ++i) bad += (u[i] & mask) == mask;
  return bad;
}

std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

void fill_uniform_host(void* data, DType dtype, int64_t n, uint64_t seed) {
  auto value = [seed](int64_t i) {
    const uint64_t h = splitmix(seed * 0x100000001b3ull + static_cast<uint64_t>(i));
    return static_cast<float>(static_cast<double>(h >> 11) * (2.0 / 9007199254740992.0) - 1.0);
  };
  if (dtype == DType::bf16) {
    uint16_t* p = static_cast<uint16_t*>(data);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) p[i] = float_to_bf16_bits(value(i));
    return;
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) store_float(data, dtype, i, value(i));
}

CheckResult check_pass(const GemmHostData& d, const std::string& pass, const void* out, DType out_dtype,
                       int samples, uint64_t seed, double quant_u) {
  std::mt19937_64 rng(seed);
  const int64_t out_rows = pass == "wgrad" ? d.E * d.N : pass == "bias_grad" ? d.E : d.rows;
  const int64_t out_cols = pass == "fprop" || pass == "bias_grad" ? d.N : d.K;
  CheckResult result;
  // Every output element: finite (the output was poisoned with NaN before the run).
  const int64_t nonfinite = count_nonfinite(out, out_dtype, out_rows * out_cols);
  auto in = [&](const void* p, int64_t i) { return load_float(p, d.dtype, i); };
  auto expert_of = [&](int64_t row) {
    return static_cast<int64_t>(std::upper_bound(d.offsets.begin(), d.offsets.end(), row) - d.offsets.begin()) - 1;
  };
  double max_err = 0, max_ref_err = 0, sum_sq = 0, max_exact = 0, max_quant_ratio = 0;
  int64_t max_len = 0;  // longest reduction sampled
  std::string worst;
  for (int s = 0; s < samples && out_rows > 0 && out_cols > 0; ++s) {
    const int64_t r = std::uniform_int_distribution<int64_t>(0, out_rows - 1)(rng);
    const int64_t c = std::uniform_int_distribution<int64_t>(0, out_cols - 1)(rng);
    Sample smp;
    double own = 0;
    int64_t len = 0;
    if (pass == "fprop") {
      const int64_t e = expert_of(r);
      len = d.K;
      smp = reduce(len, [&](int64_t k) { return std::pair{in(d.x, r * d.K + k), in(d.w, (e * d.N + c) * d.K + k)}; });
      own = round_to(out_dtype, smp.own);
      if (d.bias != nullptr) {  // added to the f32 accumulator before the one rounding
        const float b = load_float(d.bias, d.bias_dtype, e * d.N + c);
        smp.exact += b;
        smp.abs_sum += std::abs(b);
        own = round_to(out_dtype, smp.own + b);
      }
    } else if (pass == "bias_grad") {
      const int64_t r0 = d.offsets[r];
      len = d.offsets[r + 1] - r0;
      smp = reduce(len, [&](int64_t l) { return std::pair{in(d.dy, (r0 + l) * d.N + c), 1.0f}; });
    } else if (pass == "dgrad") {
      const int64_t e = expert_of(r);
      len = d.N;
      smp = reduce(len, [&](int64_t n) { return std::pair{in(d.dy, r * d.N + n), in(d.w, (e * d.N + n) * d.K + c)}; });
    } else {
      const int64_t e = r / d.N, n = r % d.N, r0 = d.offsets[e];
      len = d.offsets[e + 1] - r0;
      smp = reduce(len,
                   [&](int64_t l) { return std::pair{in(d.dy, (r0 + l) * d.N + n), in(d.x, (r0 + l) * d.K + c)}; });
    }
    const double got = load_float(out, out_dtype, r * out_cols + c);
    if (pass != "fprop") own = round_to(out_dtype, smp.own);
    const double err = std::abs(got - smp.exact);
    if (quant_u > 0) {
      // Quantized operands (each element within u·|a| of its source): (2u + u²)·Σ|a·b|, the
      // tensor cores' reduced-precision accumulation inside a k-block (2^-10 of Σ|a·b|), and
      // two roundings of the output (the bias may be added after the GEMM's).
      const double u_out = out_dtype == DType::f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8);
      const double bound = (2 * quant_u + quant_u * quant_u + std::ldexp(1.0, -10)) * smp.abs_sum +
                           2 * u_out * std::abs(smp.exact) + 1e-6;
      max_quant_ratio = std::max(max_quant_ratio, std::isfinite(got) ? err / bound : INFINITY);
    }
    max_ref_err = std::max(max_ref_err, std::abs(own - smp.exact));
    sum_sq += smp.exact * smp.exact;
    max_exact = std::max(max_exact, std::abs(smp.exact));
    max_len = std::max(max_len, len);
    if (err > max_err || !std::isfinite(got)) {
      max_err = std::isfinite(got) ? err : INFINITY;
      std::ostringstream os;
      os << "[" << r << ", " << c << "] got " << got << " exact " << smp.exact;
      worst = os.str();
    }
  }
  const double rms = samples > 0 ? std::sqrt(sum_sq / samples) : 0;
  // Rounding unit of the output at the RMS magnitude.
  const double u = out_dtype == DType::bf16 ? std::ldexp(1.0, -8) : out_dtype == DType::f16 ? std::ldexp(1.0, -11)
                                                                                          : std::ldexp(1.0, -24);
  double limit = 2 * max_ref_err + u * rms + 1e-30;
  // f32 outputs are not dominated by their own rounding: the tensor cores add in f32 but neither in
  // the reference's sequential order nor rounding after every addition, so on long reductions the
  // kernel lands a few ulps past twice the sequential error. As the CUDA tests (atol_for): allow a
  // random walk of 4 f32 roundings per step over the longest reduction, 4·√L·2⁻²⁴·max|exact|.
  if (out_dtype == DType::f32) {
    limit += 4 * std::sqrt(static_cast<double>(std::max<int64_t>(max_len, 1))) * std::ldexp(1.0, -24) * max_exact;
  }
  std::ostringstream os;
  if (quant_u > 0) {
    result.ok = nonfinite == 0 && max_quant_ratio <= 1;
    os << "max err " << max_err << ", at most " << max_quant_ratio << " of the quantization bound (u = " << quant_u
       << ")";
  } else {
    result.ok = nonfinite == 0 && max_err <= limit;
    os << "max err " << max_err << " (limit " << limit << ")";
  }
  if (nonfinite) os << ", " << nonfinite << " non-finite outputs";
  if (!result.ok && !worst.empty()) os << ", worst " << worst;
  result.detail = os.str();
  return result;
}

void fill_uniform_scaled_host(void* data, DType dtype, int64_t n, double a, uint64_t seed) {
  fill_uniform_host(data, dtype, n, seed);
  for (int64_t i = 0; i < n; ++i) store_float(data, dtype, i, float(a) * load_float(data, dtype, i));
}

}  // namespace gmoe::bench
