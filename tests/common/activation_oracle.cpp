// tests/common/activation_oracle.cpp — exact (fp64) activations for the tests (see the header).
#include "common/activation_oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

namespace gmoe::test {
namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

constexpr double kPi = 3.14159265358979323846;
constexpr double kF32Ulp = 5.9604644775390625e-08;  // 2^-24
constexpr double kEvalUlps = 64;                     // f32 ulps of `scale` an evaluation may be off

// gelu(g) and its derivative: exact erf form, or the tanh approximation (torch's 'tanh').
double gelu(double g, bool tanh_form, double* derivative) {
  if (tanh_form) {
    const double c = std::sqrt(2.0 / kPi), k = 0.044715;
    const double t = std::tanh(c * (g + k * g * g * g));
    *derivative = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * c * (1 + 3 * k * g * g);
    return 0.5 * g * (1 + t);
  }
  const double cdf = 0.5 * (1 + std::erf(g / std::sqrt(2.0)));
  *derivative = cdf + g * std::exp(-0.5 * g * g) / std::sqrt(2 * kPi);
  return g * cdf;
}

// Magnitudes the f32 formulas combine (see the header): of the value, of ∂/∂gate and of ∂/∂up,
// before the factors dz and p.
struct Scales {
  double value = 0, d_gate = 0, d_up = 0;
};
Scales gated_scales(const ActivationOptions& o, double g, double u) {
  if (o.kind == ActivationKind::clamped_swiglu) {
    const double L = o.limit;
    g = std::min(g, L);
    u = std::clamp(u, -L, L);
  }
  const double a = o.kind == ActivationKind::clamped_swiglu ? std::max(1.0, std::abs(double(o.alpha))) : 1.0;
  const double ag = std::abs(g), au = std::abs(u) + 1;
  return {ag * au, au * (1 + a * ag), ag};
}

}  // namespace

ExactGated exact_gated(const ActivationOptions& o, double g, double u) {
  ExactGated r;
  switch (o.kind) {
    case ActivationKind::swiglu: {
      const double s = sigmoid(g);
      r.value = g * s * u;
      r.d_gate = u * s * (1 + g * (1 - s));
      r.d_up = g * s;
      return r;
    }
    case ActivationKind::geglu: {
      double d = 0;
      const double ge = gelu(g, o.gelu_tanh, &d);
      r.value = ge * u;
      r.d_gate = u * d;
      r.d_up = ge;
      return r;
    }
    case ActivationKind::clamped_swiglu: {
      // torch.clamp semantics: NaN passes through the clamp; the gradient flows where
      // lo <= x <= hi (the limits included), and is 0 elsewhere and for NaN.
      const double L = o.limit, alpha = o.alpha;
      const double gc = std::isnan(g) ? g : std::min(g, L);
      const double uc = std::isnan(u) ? u : std::clamp(u, -L, L);
      const double s = sigmoid(alpha * gc);
      r.value = gc * s * (uc + 1);
      r.d_gate = g <= L ? (uc + 1) * s * (1 + alpha * gc * (1 - s)) : 0.0;
      r.d_up = (u >= -L && u <= L) ? gc * s : 0.0;
      return r;
    }
    case ActivationKind::squared_relu: break;
  }
  ADD_FAILURE() << "exact_gated: not a gated activation";
  return r;
}

double exact_squared_relu(double h, double* derivative) {
  if (derivative != nullptr) *derivative = h > 0 ? 2 * h : 0.0;
  if (std::isnan(h)) return h;
  return h > 0 ? h * h : 0.0;
}

int64_t gate_column(const GluFormat& glu, int64_t F, int64_t j) {
  (void)F;
  if (glu.layout == GluLayout::concatenated) return j;
  return (j / glu.block) * 2 * glu.block + j % glu.block;
}
int64_t up_column(const GluFormat& glu, int64_t F, int64_t j) {
  return glu.layout == GluLayout::concatenated ? F + j : gate_column(glu, F, j) + glu.block;
}

ExactActivation exact_activation(const HostTensor& h, const HostTensor* dz, const std::vector<double>* probs,
                                 int64_t total, const ActivationOptions& o, int64_t F) {
  const int64_t cap = h.shape()[0], cols = h.shape()[1];
  const bool gated = is_gated(o.kind);
  ExactActivation r;
  r.z.assign(size_t(cap * F), 0.0);
  r.z_slack = r.z;
  if (dz != nullptr) {
    r.dh.assign(size_t(cap * cols), 0.0);
    r.dh_slack = r.dh;
    r.dprobs.assign(size_t(cap), 0.0);
    r.dprobs_slack = r.dprobs;
  }
  for (int64_t row = 0; row < std::min(total, cap); ++row) {
    const double p = probs != nullptr ? (*probs)[row] : 1.0;
    double dp = 0, dp_terms = 0, dp_eval = 0;
    for (int64_t j = 0; j < F; ++j) {
      double a, da_g = 0, da_u = 0;
      Scales sc;
      int64_t gc = j, uc = -1;
      if (gated) {
        gc = gate_column(o.glu, F, j);
        uc = up_column(o.glu, F, j);
        const double g = h.get(row * cols + gc), u = h.get(row * cols + uc);
        const ExactGated e = exact_gated(o, g, u);
        a = e.value;
        da_g = e.d_gate;
        da_u = e.d_up;
        sc = gated_scales(o, g, u);
      } else {
        const double x = h.get(row * cols + j);
        a = exact_squared_relu(x, &da_g);
        sc = {x * x, 2 * std::abs(x), 0};
      }
      r.z[row * F + j] = a * p;
      r.z_slack[row * F + j] = kEvalUlps * kF32Ulp * sc.value * std::abs(p);
      if (dz == nullptr) continue;
      const double g_out = dz->get(row * F + j);
      r.dh[row * cols + gc] = g_out * p * da_g;
      r.dh_slack[row * cols + gc] = kEvalUlps * kF32Ulp * std::abs(g_out * p) * sc.d_gate;
      if (gated) {
        r.dh[row * cols + uc] = g_out * p * da_u;
        r.dh_slack[row * cols + uc] = kEvalUlps * kF32Ulp * std::abs(g_out * p) * sc.d_up;
      }
      dp += g_out * a;
      dp_terms += std::abs(g_out * a);
      dp_eval += std::abs(g_out) * sc.value;
    }
    if (dz != nullptr) {
      r.dprobs[row] = dp;
      r.dprobs_slack[row] = kEvalUlps * kF32Ulp * dp_eval + double(F + 2) * kF32Ulp * dp_terms;
    }
  }
  return r;
}

::testing::AssertionResult within_activation_bound(const std::vector<double>& got, const std::vector<double>& exact,
                                                   const std::vector<double>& slack, DType out_dtype,
                                                   const std::string& what) {
  if (got.size() != exact.size() || slack.size() != exact.size()) {
    return ::testing::AssertionFailure() << what << ": size " << got.size() << ", expected " << exact.size();
  }
  const double u = unit_roundoff(out_dtype);
  const double subnormal_half_step = out_dtype == DType::f16    ? std::ldexp(1.0, -25)
                                     : out_dtype == DType::bf16 ? std::ldexp(1.0, -134)
                                                                : std::ldexp(1.0, -150);
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(exact[i])) {
      if (!std::isnan(got[i])) {
        return ::testing::AssertionFailure() << what << ": element " << i << " = " << got[i] << ", expected NaN";
      }
      continue;
    }
    // A NaN slack comes from NaN inputs whose derivative is exactly 0 (a clamped side): no slack.
    const double bound = u * std::abs(exact[i]) + (std::isnan(slack[i]) ? 0.0 : slack[i]) + subnormal_half_step;
    if (!(std::abs(got[i] - exact[i]) <= bound)) {  // also catches NaN
      return ::testing::AssertionFailure() << what << ": element " << i << " = " << got[i] << ", exact " << exact[i]
                                           << ", error " << std::abs(got[i] - exact[i]) << " > bound " << bound;
    }
  }
  return ::testing::AssertionSuccess();
}

const std::vector<ActivationOptions>& activation_test_variants() {
  static const std::vector<ActivationOptions> kVariants = [] {
    std::vector<ActivationOptions> v;
    const GluFormat layouts[] = {{GluLayout::concatenated, 1},
                                 {GluLayout::interleaved, 1},
                                 {GluLayout::interleaved, 8},
                                 {GluLayout::interleaved, 16},
                                 {GluLayout::interleaved, 32},
                                 {GluLayout::interleaved, 64}};
    for (int k = 0; k < 4; ++k) {
      for (const GluFormat& glu : layouts) {
        ActivationOptions o;
        o.kind = k == 0 ? ActivationKind::swiglu : k == 3 ? ActivationKind::clamped_swiglu : ActivationKind::geglu;
        o.gelu_tanh = k == 2;
        o.glu = glu;
        v.push_back(o);
      }
    }
    ActivationOptions relu2;
    relu2.kind = ActivationKind::squared_relu;
    v.push_back(relu2);
    return v;
  }();
  return kVariants;
}

HostTensor random_activation_input(const ActivationOptions& o, DType dt, int64_t cap, int64_t total, int64_t F,
                                   Rng& rng) {
  const int64_t cols = activation_input_cols(o.kind, F);
  HostTensor h(dt, {cap, cols});
  const bool clamped = o.kind == ActivationKind::clamped_swiglu;
  fill_random(h, rng, clamped ? -10.0 : -4.0, clamped ? 10.0 : 4.0);
  for (int64_t i = 0; clamped && i < total * cols; ++i) {
    if (rng.integer(0, 15) == 0) h.set(i, rng.integer(0, 1) ? o.limit : -o.limit);
  }
  for (int64_t i = std::max<int64_t>(total, 0) * cols; i < cap * cols; ++i) {
    h.set(i, std::numeric_limits<double>::quiet_NaN());
  }
  return h;
}

std::string activation_case_name(const ActivationOptions& o) {
  std::ostringstream os;
  os << activation_name(o.kind);
  if (o.kind == ActivationKind::geglu) os << (o.gelu_tanh ? "_tanh" : "_erf");
  if (is_gated(o.kind)) {
    if (o.glu.layout == GluLayout::concatenated) {
      os << "_concat";
    } else {
      os << "_inter" << o.glu.block;
    }
  }
  return os.str();
}

}  // namespace gmoe::test

namespace gmoe::test {

std::vector<float> expert_amax(const HostTensor& t, const std::vector<int64_t>& counts) {
  const int64_t cols = t.shape().size() == 2 ? t.shape()[1] : 0;
  std::vector<float> amax(counts.size(), 0.0f);
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t r = row; r < row + std::max<int64_t>(counts[e], 0); ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const float v = std::abs(static_cast<float>(t.get(r * cols + c)));
        if (std::isfinite(v)) amax[e] = std::max(amax[e], v);
      }
    }
    row += std::max<int64_t>(counts[e], 0);
  }
  return amax;
}

HostTensor expert_amax_tensor(const HostTensor& t, const std::vector<int64_t>& counts) {
  const std::vector<float> v = expert_amax(t, counts);
  HostTensor a(DType::f32, {static_cast<int64_t>(v.size())});
  for (size_t e = 0; e < v.size(); ++e) a.set(static_cast<int64_t>(e), v[e]);
  return a;
}

::testing::AssertionResult amax_matches(const HostTensor& amax, const HostTensor& t, const std::vector<int64_t>& counts,
                                        const std::string& what) {
  const std::vector<float> want = expert_amax(t, counts);
  if (amax.numel() != static_cast<int64_t>(want.size())) {
    return ::testing::AssertionFailure() << what << ": " << amax.numel() << " values, expected " << want.size();
  }
  for (size_t e = 0; e < want.size(); ++e) {
    const float got = static_cast<float>(amax.get(static_cast<int64_t>(e)));
    if (!(got == want[e]) || std::signbit(got)) {
      return ::testing::AssertionFailure() << what << ": expert " << e << " amax " << got << ", expected " << want[e];
    }
  }
  return ::testing::AssertionSuccess();
}

}  // namespace gmoe::test
