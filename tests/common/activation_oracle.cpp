// tests/common/activation_oracle.cpp — exact (fp64) activations for the tests (see the header).
#include "common/activation_oracle.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>

#include "common/tolerance.h"

namespace gmoe::test {
namespace {

template <typename T>
T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

constexpr double kPi = 3.14159265358979323846;

// gelu(g) and its derivative: exact erf form, or the tanh approximation (torch's 'tanh').
template <typename T>
T gelu(T g, bool tanh_form, T* derivative) {
  if (tanh_form) {
    const T c = T(std::sqrt(2.0 / kPi)), k = T(0.044715);
    const T t = std::tanh(c * (g + k * g * g * g));
    *derivative = T(0.5) * (1 + t) + T(0.5) * g * (1 - t * t) * c * (1 + 3 * k * g * g);
    return T(0.5) * g * (1 + t);
  }
  const T cdf = T(0.5) * (1 + std::erf(g / T(std::sqrt(2.0))));
  *derivative = cdf + g * std::exp(T(-0.5) * g * g) / T(std::sqrt(2 * kPi));
  return g * cdf;
}

template <typename T>
struct Gated {
  T value = 0, d_gate = 0, d_up = 0;
};

// The formulas, in T: fp64 for the exact values, f32 for the own-precision reference.
template <typename T>
Gated<T> gated(const ActivationOptions& o, T g, T u) {
  Gated<T> r;
  switch (o.kind) {
    case ActivationKind::swiglu: {
      const T s = sigmoid(g);
      r.value = g * s * u;
      r.d_gate = u * s * (1 + g * (1 - s));
      r.d_up = g * s;
      return r;
    }
    case ActivationKind::geglu: {
      T d = 0;
      const T ge = gelu(g, o.gelu_tanh, &d);
      r.value = ge * u;
      r.d_gate = u * d;
      r.d_up = ge;
      return r;
    }
    case ActivationKind::clamped_swiglu: {
      // torch.clamp semantics: NaN passes through the clamp; the gradient flows where
      // lo <= x <= hi (the limits included), and is 0 elsewhere and for NaN.
      const T L = T(o.limit), alpha = T(o.alpha);
      const T gc = std::isnan(g) ? g : std::min(g, L);
      const T uc = std::isnan(u) ? u : std::clamp(u, -L, L);
      const T s = sigmoid(alpha * gc);
      r.value = gc * s * (uc + 1);
      r.d_gate = g <= L ? (uc + 1) * s * (1 + alpha * gc * (1 - s)) : T(0);
      r.d_up = (u >= -L && u <= L) ? gc * s : T(0);
      return r;
    }
    case ActivationKind::squared_relu: break;
  }
  ADD_FAILURE() << "exact_gated: not a gated activation";
  return r;
}

template <typename T>
T squared_relu(T h, T* derivative) {
  if (derivative != nullptr) *derivative = h > 0 ? 2 * h : T(0);
  if (std::isnan(h)) return h;
  return h > 0 ? h * h : T(0);
}

}  // namespace

ExactGated exact_gated(const ActivationOptions& o, double g, double u) {
  const Gated<double> r = gated<double>(o, g, u);
  return {r.value, r.d_gate, r.d_up};
}

double exact_squared_relu(double h, double* derivative) { return squared_relu<double>(h, derivative); }

ExactGated f32_gated(const ActivationOptions& o, double g, double u) {
  const Gated<float> r = gated<float>(o, static_cast<float>(g), static_cast<float>(u));
  return {r.value, r.d_gate, r.d_up};
}

double f32_squared_relu(double h, double* derivative) {
  float d = 0;
  const float v = squared_relu<float>(static_cast<float>(h), &d);
  if (derivative != nullptr) *derivative = d;
  return v;
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
                                 int64_t total, const ActivationOptions& o, int64_t F,
                                 const std::vector<double>* dz_exact) {
  const int64_t cap = h.shape()[0], cols = h.shape()[1];
  const bool gated_kind = is_gated(o.kind);
  ExactActivation r;
  auto init = [](ExactResult& e, int64_t n, int64_t reduction) {
    e.value.assign(static_cast<size_t>(n), 0.0);
    e.abs_sum = e.f32 = e.value;
    e.reduction = reduction;
  };
  init(r.z, cap * F, 1);
  if (dz != nullptr) {
    init(r.dh, cap * cols, 1);
    init(r.dprobs, cap, F);
  }
  for (int64_t row = 0; row < std::min(total, cap); ++row) {
    const double p = probs != nullptr ? (*probs)[row] : 1.0;
    const float p32 = static_cast<float>(p);
    double dp = 0, dp_abs = 0;
    float dp32 = 0;
    for (int64_t j = 0; j < F; ++j) {
      Gated<double> a;
      Gated<float> a32;
      int64_t gc = j, uc = -1;
      if (gated_kind) {
        gc = gate_column(o.glu, F, j);
        uc = up_column(o.glu, F, j);
        const double g = h.get(row * cols + gc), u = h.get(row * cols + uc);
        a = gated<double>(o, g, u);
        a32 = gated<float>(o, static_cast<float>(g), static_cast<float>(u));
      } else {
        const double x = h.get(row * cols + j);
        a.value = squared_relu<double>(x, &a.d_gate);
        a32.value = squared_relu<float>(static_cast<float>(x), &a32.d_gate);
      }
      r.z.value[row * F + j] = a.value * p;
      r.z.f32[row * F + j] = a32.value * p32;
      if (dz == nullptr) continue;
      const float g32 = static_cast<float>(dz->get(row * F + j));
      const double g_out = dz_exact != nullptr ? (*dz_exact)[row * F + j] : dz->get(row * F + j);
      r.dh.value[row * cols + gc] = g_out * p * a.d_gate;
      r.dh.f32[row * cols + gc] = g32 * p32 * a32.d_gate;
      if (gated_kind) {
        r.dh.value[row * cols + uc] = g_out * p * a.d_up;
        r.dh.f32[row * cols + uc] = g32 * p32 * a32.d_up;
      }
      dp += g_out * a.value;
      dp_abs += std::abs(g_out * a.value);
      dp32 += g32 * a32.value;
    }
    if (dz != nullptr) {
      r.dprobs.value[row] = dp;
      r.dprobs.abs_sum[row] = dp_abs;
      r.dprobs.f32[row] = dp32;
    }
  }
  return r;
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
