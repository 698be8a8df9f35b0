// tests/common/mlp_fixture.cpp — host-side GroupedMLP problems and the exact MLP (see the header).
#include "common/mlp_fixture.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "common/activation_oracle.h"

namespace gmoe::test {

const std::vector<ActivationOptions>& mlp_activation_variants() {
  static const std::vector<ActivationOptions> kVariants = [] {
    std::vector<ActivationOptions> v;
    for (int k = 0; k < 4; ++k) {
      for (bool inter : {false, true}) {
        ActivationOptions o;
        o.kind = k == 0 ? ActivationKind::swiglu : k == 3 ? ActivationKind::clamped_swiglu : ActivationKind::geglu;
        o.gelu_tanh = k == 2;
        o.limit = 0.75f;
        if (inter) o.glu = {GluLayout::interleaved, kMlpGluBlock};
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

ActivationOptions with_unreached_limit(ActivationOptions o) {
  o.limit = ActivationOptions{}.limit;
  return o;
}

std::pair<int64_t, int64_t> mlp_dims(const std::string& name, CaseScale scale) {
  if (name == "dim192") return {192, 96};
  if (name == "dim1408") return {1408, 48};
  if (name == "dim2880") return {2880, 48};
  if (name == "e128" || name == "e256") return {32, 32};
  return scale == CaseScale::kLarge ? std::pair<int64_t, int64_t>{128, 64} : std::pair<int64_t, int64_t>{40, 48};
}

HostTensor MlpProblem::random_experts(int64_t E, int64_t N, int64_t K, double a, Rng& rng,
                                      std::vector<HostTensor>& list) {
  HostTensor s(DType::bf16, {E, N, K});
  fill_random(s, rng, -a, a);
  const size_t bytes = size_t(N * K) * dtype_size(DType::bf16);
  for (int64_t e = 0; e < E; ++e) {
    HostTensor m(DType::bf16, {N, K});
    if (bytes > 0) std::memcpy(m.data(), static_cast<const char*>(s.data()) + e * bytes, bytes);
    list.push_back(std::move(m));
  }
  return s;
}

namespace {

HostTensor random_biases(int64_t E, int64_t N, Rng& rng, std::vector<HostTensor>& list) {
  HostTensor g(DType::bf16, {E, N});
  fill_random(g, rng, -0.5, 0.5);
  for (int64_t e = 0; e < E; ++e) {
    HostTensor v(DType::f32, {N});
    for (int64_t n = 0; n < N; ++n) v.set(n, g.get(e * N + n));
    list.push_back(std::move(v));
  }
  return g;
}

ExpertWeights weights_of(const HostTensor& s, const std::vector<HostTensor>& l, Layout layout) {
  if (layout == Layout::kStacked) return ExpertWeights::from_stacked(s.view());
  std::vector<TensorView> v;
  for (const HostTensor& t : l) v.push_back(t.view());
  return ExpertWeights::from_list(std::move(v));
}

ExpertBias bias_of(const HostTensor& g, const std::vector<HostTensor>& l, MlpBias m) {
  if (m == MlpBias::kNone) return {};
  if (m == MlpBias::kGrouped) return ExpertBias::from_grouped(g.view());
  std::vector<TensorView> v;
  for (const HostTensor& t : l) v.push_back(t.view());
  return ExpertBias::from_list(std::move(v));
}

}  // namespace

MlpProblem::MlpProblem(const std::string& case_name, const ActivationOptions& a, Rng& rng, CaseScale scale)
    : MlpProblem(make_case(case_name, rng, scale), mlp_dims(case_name, scale).first,
                 mlp_dims(case_name, scale).second, a, rng) {}

MlpProblem::MlpProblem(const ShapeCase& shape, int64_t hidden, int64_t ffn, const ActivationOptions& a, Rng& rng)
    : c(shape), act(a), H(hidden), F(ffn) {
  E = c.E;
  cap = c.capacity;
  rows1 = activation_input_cols(act.kind, F);
  x = HostTensor(DType::bf16, {cap, H});
  dy = HostTensor(DType::bf16, {cap, H});
  fill_random(x, rng);
  fill_random(dy, rng);
  probs = HostTensor(DType::f32, {cap});
  fill_random(probs, rng, 0.0, 1.0);
  counts = make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
  w1s = random_experts(E, rows1, H, std::sqrt(3.0 / double(H)), rng, w1l);
  w2s = random_experts(E, H, F, std::sqrt(3.0 / double(F)), rng, w2l);
  b1g = random_biases(E, rows1, rng, b1l);
  b2g = random_biases(E, H, rng, b2l);
}

ExpertWeights MlpProblem::w1(Layout l) const { return weights_of(w1s, w1l, l); }
ExpertWeights MlpProblem::w2(Layout l) const { return weights_of(w2s, w2l, l); }
ExpertBias MlpProblem::b1(MlpBias m) const { return bias_of(b1g, b1l, m); }
ExpertBias MlpProblem::b2(MlpBias m) const { return bias_of(b2g, b2l, m); }

::testing::AssertionResult same_values(const std::vector<double>& a, const std::vector<double>& b,
                                       const std::string& what) {
  if (a.size() != b.size()) return ::testing::AssertionFailure() << what << ": " << a.size() << " vs " << b.size();
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(&a[i], &b[i], sizeof(double)) != 0) {
      return ::testing::AssertionFailure() << what << ": first difference at " << i << " (" << a[i] << " vs " << b[i]
                                           << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult same_outputs(const MlpOutputs& a, const MlpOutputs& b, const std::string& what) {
  for (const auto& [x, y, n] : {std::tuple{&a.y, &b.y, "y"}, {&a.dx, &b.dx, "dx"}, {&a.dprobs, &b.dprobs, "dprobs"}}) {
    const ::testing::AssertionResult r = bitwise_equal(*x, *y, what + ": " + n);
    if (!r) return r;
  }
  for (const auto& [x, y, n] : {std::tuple{&a.dw1, &b.dw1, "dW1"}, {&a.dw2, &b.dw2, "dW2"}, {&a.db1, &b.db1, "db1"},
                                {&a.db2, &b.db2, "db2"}}) {
    const ::testing::AssertionResult r = same_values(*x, *y, what + ": " + n);
    if (!r) return r;
  }
  return ::testing::AssertionSuccess();
}

namespace {

// The MLP in T: fp64 with no intermediate rounding (the exact MLP), or f32 sums with h, z, dz and
// dh rounded to bf16 where the layer stores them and the (bf16, grouped) biases added to the f32
// sums before the one rounding, as grouped_gemm_fprop adds them (the own-precision reference;
// outputs left as f32 sums for the rule to round).
template <typename T>
ExactMlp mlp_in(const MlpProblem& p, bool with_bias, bool with_probs) {
  constexpr bool kOwn = std::is_same_v<T, float>;
  auto store = [](T v) -> T {  // what the layer keeps between ops
    if constexpr (kOwn) return static_cast<T>(rounded({double(v)}, DType::bf16)[0]);
    return v;
  };
  const int64_t E = p.E, H = p.H, F = p.F, R1 = p.rows1, cap = p.cap;
  const bool gated = is_gated(p.act.kind);
  auto as_t = [](const HostTensor& t) {
    const std::vector<double> d = t.to_double();
    return std::vector<T>(d.begin(), d.end());
  };
  const std::vector<T> x = as_t(p.x), dy = as_t(p.dy), w1 = as_t(p.w1s), w2 = as_t(p.w2s), b1 = as_t(p.b1g),
                       b2 = as_t(p.b2g), probs = as_t(p.probs);
  std::vector<T> y(size_t(cap * H), 0), dx(size_t(cap * H), 0), dprobs(with_probs ? size_t(cap) : 0, 0),
      dw1(size_t(E * R1 * H), 0), dw2(size_t(E * H * F), 0), db1(with_bias ? size_t(E * R1) : 0, 0),
      db2(with_bias ? size_t(E * H) : 0, 0);
  std::vector<T> h(static_cast<size_t>(R1)), z(static_cast<size_t>(F)), a(static_cast<size_t>(F)),
      dz(static_cast<size_t>(F)), dh(static_cast<size_t>(R1));
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    const T* W1 = &w1[size_t(e * R1 * H)];
    const T* W2 = &w2[size_t(e * H * F)];
    for (int64_t k = 0; k < p.c.counts[e]; ++k, ++row) {
      const T* xr = &x[size_t(row * H)];
      const T* gr = &dy[size_t(row * H)];
      const T pr = with_probs ? probs[row] : T(1);
      for (int64_t c = 0; c < R1; ++c) {
        T s = 0;
        for (int64_t i = 0; i < H; ++i) s += xr[i] * W1[c * H + i];
        h[c] = store(with_bias ? s + b1[e * R1 + c] : s);
      }
      for (int64_t j = 0; j < F; ++j) {
        T s = 0;
        for (int64_t n = 0; n < H; ++n) s += gr[n] * W2[n * F + j];
        dz[j] = store(s);
      }
      T dp = 0;
      for (int64_t j = 0; j < F; ++j) {
        T d_gate = 0, d_up = 0;
        const int64_t gc = gated ? gate_column(p.act.glu, F, j) : j;
        const int64_t uc = gated ? up_column(p.act.glu, F, j) : -1;
        if (gated) {
          const ExactGated ev = kOwn ? f32_gated(p.act, h[gc], h[uc]) : exact_gated(p.act, h[gc], h[uc]);
          a[j] = T(ev.value);
          d_gate = T(ev.d_gate);
          d_up = T(ev.d_up);
        } else {
          double d = 0;
          a[j] = T(kOwn ? f32_squared_relu(h[j], &d) : exact_squared_relu(h[j], &d));
          d_gate = T(d);
        }
        z[j] = store(a[j] * pr);
        dh[gc] = store(dz[j] * pr * d_gate);
        if (gated) dh[uc] = store(dz[j] * pr * d_up);
        dp += dz[j] * a[j];
      }
      if (with_probs) dprobs[row] = dp;
      for (int64_t n = 0; n < H; ++n) {
        T s = 0;
        for (int64_t j = 0; j < F; ++j) s += z[j] * W2[n * F + j];
        y[row * H + n] = with_bias ? s + b2[e * H + n] : s;
      }
      for (int64_t i = 0; i < H; ++i) {
        T s = 0;
        for (int64_t c = 0; c < R1; ++c) s += dh[c] * W1[c * H + i];
        dx[row * H + i] = s;
      }
      T* dW1 = &dw1[size_t(e * R1 * H)];
      T* dW2 = &dw2[size_t(e * H * F)];
      for (int64_t c = 0; c < R1; ++c)
        for (int64_t i = 0; i < H; ++i) dW1[c * H + i] += dh[c] * xr[i];
      for (int64_t n = 0; n < H; ++n)
        for (int64_t j = 0; j < F; ++j) dW2[n * F + j] += gr[n] * z[j];
      if (with_bias) {
        for (int64_t c = 0; c < R1; ++c) db1[e * R1 + c] += dh[c];
        for (int64_t n = 0; n < H; ++n) db2[e * H + n] += gr[n];
      }
    }
  }
  auto d = [](const std::vector<T>& v) { return std::vector<double>(v.begin(), v.end()); };
  return {d(y), d(dx), d(dprobs), d(dw1), d(dw2), d(db1), d(db2)};
}

}  // namespace

ExactMlp exact_mlp(const MlpProblem& p, bool with_bias, bool with_probs) {
  return mlp_in<double>(p, with_bias, with_probs);
}

ExactMlp own_precision_mlp(const MlpProblem& p, bool with_bias, bool with_probs) {
  return mlp_in<float>(p, with_bias, with_probs);
}

ExactMlp values_of(const MlpOutputs& o) {
  const bool probs = !o.dprobs.shape().empty();  // a default HostTensor: no dprobs
  return {o.y.to_double(), o.dx.to_double(), probs ? o.dprobs.to_double() : std::vector<double>{}, o.dw1, o.dw2,
          o.db1, o.db2};
}

void expect_mlp_within_rule(const MlpProblem& p, const MlpOutputs& got, const ExactMlp& own, const ExactMlp& exact,
                            DType bias_grad_dtype) {
  const ExactMlp g = values_of(got);
  const int64_t longest = p.c.counts.empty() ? 1 : *std::max_element(p.c.counts.begin(), p.c.counts.end());
  const struct {
    const std::vector<double>& got;
    const std::vector<double>& own;
    const std::vector<double>& exact;
    DType out;
    int64_t reduction;
    const char* what;
  } outputs[] = {{g.y, own.y, exact.y, DType::bf16, p.F, "y"},
                 {g.dx, own.dx, exact.dx, DType::bf16, p.rows1, "dx"},
                 {g.dprobs, own.dprobs, exact.dprobs, DType::f32, p.F, "dprobs"},
                 {g.dw1, own.dw1, exact.dw1, DType::bf16, longest, "dW1"},
                 {g.dw2, own.dw2, exact.dw2, DType::bf16, longest, "dW2"},
                 {g.db1, own.db1, exact.db1, bias_grad_dtype, longest, "db1"},
                 {g.db2, own.db2, exact.db2, bias_grad_dtype, longest, "db2"}};
  for (const auto& o : outputs) {
    if (o.got.empty() && o.exact.empty()) continue;  // no probs or no bias
    EXPECT_TRUE(within_rule(o.got, rounded(o.own, o.out), o.exact, Precision{o.out, o.reduction}, o.what));
  }
}

const std::vector<int>& fp8_option_flags() {
  static const std::vector<int> kFlags = {1, 2, 4, 6, 8, 16, 19, 20, 24, 31};
  return kFlags;
}

void apply_fp8_option_flags(GroupedMLPOptions& o, int flags) {
  o.fc1.delay_wgrad = flags & 1;
  o.fc2.delay_wgrad = flags & 2;
  o.recompute_activation = flags & 4;
  o.fc1.save_original_input = flags & 8;
  o.fp8_quantize_in_activation = !(flags & 16);
}

std::string fp8_option_flags_name(int flags) {
  std::string s = "flags " + std::to_string(flags) + ":";
  const char* names[] = {" delay fc1", " delay fc2", " recompute", " save_original_input", " z quantized after"};
  for (int b = 0; b < 5; ++b) {
    if (flags & (1 << b)) s += names[b];
  }
  return s;
}

}  // namespace gmoe::test
