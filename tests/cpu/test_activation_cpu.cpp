// tests/cpu/test_activation_cpu.cpp — the CPU grouped activations against the exact (fp64) oracle of
// tests/common/activation_oracle.h by the tolerance rule (its f32 evaluation the own-precision
// reference): every activation (GeGLU in both forms), both gate/up layouts
// (concatenated; interleaved in blocks of 1, 8, 16, 32, 64), bf16/f16/f32, with and without router
// probabilities, forward, backward with dprobs and the recomputed z (bitwise the forward's), in
// place (dh over h) and with padded row strides; rows past the real total zero even over NaN
// inputs, empty experts, zero total, zero capacity. The oracle's derivatives are checked against
// finite differences of its forward; clamped SwiGLU at, beyond and around its limit and with NaN;
// bad arguments raise gmoe::Error naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/activation_oracle.h"
#include "common/expect_error.h"
#include "common/harness.h"
#include "gmoe/activation.h"

namespace gmoe::test {
namespace {

constexpr int64_t kF = 192;  // divisible by every test interleave block (1, 8, 16, 32, 64) and by 3
const double kNaN = std::numeric_limits<double>::quiet_NaN();

const std::vector<ActivationOptions>& variants() { return activation_test_variants(); }

// Row splits: counts over experts and the capacity (rows past the total are slack).
struct Split {
  std::string name;
  std::vector<int64_t> counts;
  int64_t capacity = 0;
  int64_t total() const {
    int64_t t = 0;
    for (int64_t c : counts) t += c;
    return t;
  }
};
std::vector<Split> splits(Rng& rng) {
  return {{"uniform", {12, 12, 12, 12}, 48},
          {"skewed_with_empty_experts", zipf_counts(8, 50, 1.1, 4, rng), 50 + rng.integer(1, 9)},
          {"one_expert", {0, 37, 0}, 40},
          {"zero_total", {0, 0, 0}, 9},
          {"zero_capacity", {0, 0}, 0},
          {"e256", zipf_counts(256, 400, 1.1, 4, rng), 403}};  // amax_out's per-expert slots
}

HostTensor copy_of(const HostTensor& t) { return t; }

// A [rows, cols] view into a buffer with `pad` extra columns per row.
struct Padded {
  HostTensor storage;
  TensorView view;
  Padded(DType dt, int64_t rows, int64_t cols, int64_t pad) : storage(dt, {rows, cols + pad}) {
    poison(storage);
    view = TensorView(storage.data(), dt, Device::cpu(), {rows, cols}, {cols + pad, 1});
    if (rows == 0) view.data = nullptr;
  }
  HostTensor packed() const {
    HostTensor out(storage.dtype(), {view.size(0), view.size(1)});
    for (int64_t r = 0; r < view.size(0); ++r)
      for (int64_t c = 0; c < view.size(1); ++c) out.set(r * view.size(1) + c, storage.get(r * view.stride(0) + c));
    return out;
  }
};

using Param = std::tuple<int, DType>;  // index into variants(), storage dtype
class CpuActivation : public ::testing::TestWithParam<Param> {
 protected:
  const ActivationOptions& options() const { return variants()[std::get<0>(GetParam())]; }
  DType dtype() const { return std::get<1>(GetParam()); }
};

TEST_P(CpuActivation, ForwardBackwardAgainstExact) {
  Rng rng;
  const ActivationOptions& o = options();
  const DType dt = dtype();
  const int64_t cols = activation_input_cols(o.kind, kF);
  for (const Split& s : splits(rng)) {
    for (bool with_probs : {false, true}) {
      SCOPED_TRACE(s.name + (with_probs ? " with probs" : " without probs"));
      const int64_t cap = s.capacity, total = s.total();
      const HostTensor counts = make_counts(s.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
      const HostTensor h = random_activation_input(o, dt, cap, total, kF, rng);
      HostTensor dz(dt, {cap, kF});
      fill_random(dz, rng);
      HostTensor probs(DType::f32, {cap});
      fill_random(probs, rng, 0.0, 1.0);
      const std::vector<double> p = probs.to_double();
      const TensorView pv = with_probs ? probs.view() : TensorView();
      const ExactActivation ex = exact_activation(h, &dz, with_probs ? &p : nullptr, total, o, kF);

      HostTensor z(dt, {cap, kF});
      poison(z);
      grouped_activation_forward(h.view(), counts.view(), z.view(), o, pv);
      EXPECT_TRUE(within_rule(z.to_double(), ex.z, dt, "z"));

      HostTensor dh(dt, {cap, cols}), dprobs(DType::f32, {cap}), z_out(dt, {cap, kF});
      poison(dh);
      poison(dprobs);
      poison(z_out);
      grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, pv, dprobs.view(), z_out.view());
      EXPECT_TRUE(within_rule(dh.to_double(), ex.dh, dt, "dh"));
      EXPECT_TRUE(within_rule(dprobs.to_double(), ex.dprobs, DType::f32, "dprobs"));
      EXPECT_TRUE(bitwise_equal(z_out, z, "z recomputed in backward vs forward's z"));
      for (int64_t r = total; r < cap; ++r) {
        ASSERT_EQ(dprobs.get(r), 0.0) << "dprobs of row " << r << " past the total";
        for (int64_t c = 0; c < kF; ++c) ASSERT_EQ(z.get(r * kF + c), 0.0) << "z row " << r << " past the total";
        for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(dh.get(r * cols + c), 0.0) << "dh row " << r;
      }

      // Without the optional outputs: the same dh.
      HostTensor dh2(dt, {cap, cols});
      poison(dh2);
      grouped_activation_backward(h.view(), dz.view(), counts.view(), dh2.view(), o, pv);
      EXPECT_TRUE(bitwise_equal(dh2, dh, "dh without dprobs/z_out"));

      // amax_out: each expert's largest finite |output| over its rows; the outputs unchanged.
      const int64_t E = static_cast<int64_t>(s.counts.size());
      HostTensor z3(dt, {cap, kF}), dh3(dt, {cap, cols}), za(DType::f32, {E}), dha(DType::f32, {E});
      for (HostTensor* t : {&z3, &dh3, &za, &dha}) poison(*t);
      grouped_activation_forward(h.view(), counts.view(), z3.view(), o, pv, nullptr, nullptr, za.view());
      grouped_activation_backward(h.view(), dz.view(), counts.view(), dh3.view(), o, pv, {}, {}, nullptr, nullptr,
                                  dha.view());
      EXPECT_TRUE(bitwise_equal(z3, z, "z with amax_out"));
      EXPECT_TRUE(bitwise_equal(dh3, dh, "dh with amax_out"));
      EXPECT_TRUE(amax_matches(za, z, s.counts, "z's amax_out"));
      EXPECT_TRUE(amax_matches(dha, dh, s.counts, "dh's amax_out"));

      // In place: dh written over h.
      HostTensor hd = copy_of(h);
      HostTensor dprobs2(DType::f32, {cap});
      poison(dprobs2);
      grouped_activation_backward(hd.view(), dz.view(), counts.view(), hd.view(), o, pv, dprobs2.view());
      EXPECT_TRUE(bitwise_equal(hd, dh, "dh written over h"));
      EXPECT_TRUE(bitwise_equal(dprobs2, dprobs, "dprobs (in place)"));

      // Padded row strides on every 2-D tensor: the same values.
      Padded hp(dt, cap, cols, 5), dzp(dt, cap, kF, 3), zp(dt, cap, kF, 7), dhp(dt, cap, cols, 1);
      for (int64_t r = 0; r < cap; ++r) {
        for (int64_t c = 0; c < cols; ++c) hp.storage.set(r * hp.view.stride(0) + c, h.get(r * cols + c));
        for (int64_t c = 0; c < kF; ++c) dzp.storage.set(r * dzp.view.stride(0) + c, dz.get(r * kF + c));
      }
      grouped_activation_forward(hp.view, counts.view(), zp.view, o, pv);
      EXPECT_TRUE(bitwise_equal(zp.packed(), z, "z (padded rows)"));
      grouped_activation_backward(hp.view, dzp.view, counts.view(), dhp.view, o, pv);
      EXPECT_TRUE(bitwise_equal(dhp.packed(), dh, "dh (padded rows)"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, CpuActivation,
                         ::testing::Combine(::testing::Range(0, int(variants().size())),
                                            ::testing::Values(DType::bf16, DType::f16, DType::f32)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return activation_case_name(variants()[std::get<0>(info.param)]) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

// ---------------------------------------------------------------------------------------------

// The oracle's derivatives against central differences of its exact forward at points away from
// the kinks (a check of the oracle: central differences are within 1e-6 here, a property of the
// step, not a tolerance of an op), and the CPU backward at those points by the tolerance rule.
TEST(CpuActivationGradients, MatchFiniteDifferencesOfTheExactForward) {
  std::vector<ActivationOptions> kinds(6);
  kinds[0].kind = ActivationKind::swiglu;
  kinds[1].kind = ActivationKind::geglu;
  kinds[2].kind = ActivationKind::geglu;
  kinds[2].gelu_tanh = true;
  kinds[3].kind = ActivationKind::clamped_swiglu;  // alpha 1.702, limit 7
  kinds[4].kind = ActivationKind::clamped_swiglu;
  kinds[4].alpha = 1.0f;
  kinds[4].limit = 1.5f;  // the points below straddle this limit on both inputs
  kinds[5].kind = ActivationKind::squared_relu;
  const double points[] = {-3.125, -0.6875, 0.3125, 1.875, 4.25};
  const double eps = 1e-4;
  for (const ActivationOptions& o : kinds) {
    SCOPED_TRACE(activation_case_name(o) + " limit " + std::to_string(o.limit));
    const bool gated = is_gated(o.kind);
    const int64_t n = gated ? 25 : 5, cols = gated ? 2 : 1;
    HostTensor h(DType::f32, {n, cols}), dz(DType::f32, {n, 1}), probs(DType::f32, {n});
    for (int64_t i = 0; i < n; ++i) {
      h.set(i * cols, points[i % 5]);
      if (gated) h.set(i * cols + 1, points[i / 5]);
      dz.set(i, 1.0);
      probs.set(i, 0.5 + 0.0625 * double(i % 7));
    }
    const HostTensor counts = make_counts({n});
    HostTensor dh(DType::f32, {n, cols}), dprobs(DType::f32, {n});
    poison(dh);
    grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, probs.view(), dprobs.view());
    auto value = [&](double g, double u) { return gated ? exact_gated(o, g, u).value : exact_squared_relu(g); };
    for (int64_t i = 0; i < n; ++i) {
      const double g = h.get(i * cols), u = gated ? h.get(i * cols + 1) : 0.0;
      const double fd_g = (value(g + eps, u) - value(g - eps, u)) / (2 * eps);
      const double fd_u = gated ? (value(g, u + eps) - value(g, u - eps)) / (2 * eps) : 0.0;
      double exact_dg = 0, exact_du = 0;
      if (gated) {
        const ExactGated e = exact_gated(o, g, u);
        exact_dg = e.d_gate;
        exact_du = e.d_up;
      } else {
        exact_squared_relu(g, &exact_dg);
      }
      const double fd_step_error = 1e-6 * (1 + std::abs(fd_g) + std::abs(fd_u));
      EXPECT_NEAR(exact_dg, fd_g, fd_step_error) << "oracle d/dgate at (" << g << ", " << u << ")";
      EXPECT_NEAR(exact_du, fd_u, fd_step_error) << "oracle d/dup at (" << g << ", " << u << ")";
    }
    const std::vector<double> pv = probs.to_double();
    const ExactActivation ex = exact_activation(h, &dz, &pv, n, o, 1);
    EXPECT_TRUE(within_rule(dh.to_double(), ex.dh, DType::f32, "dh"));
    EXPECT_TRUE(within_rule(dprobs.to_double(), ex.dprobs, DType::f32, "dprobs"));
  }
}

// gpt-oss's clamped SwiGLU at the limit, beyond it, and with NaN, against torch's clamp semantics:
// a gradient flows where the value was not clamped and at the limit itself; none beyond it or for
// NaN; NaN values stay NaN.
TEST(CpuActivationClamp, ValuesAtAndBeyondTheLimitAndNaN) {
  for (const auto& [alpha, limit] : {std::pair{1.702f, 7.0f}, std::pair{1.0f, 1.5f}}) {
    for (DType dt : {DType::f32, DType::bf16}) {
      SCOPED_TRACE("limit " + std::to_string(limit) + ", " + dtype_name(dt));
      ActivationOptions o;
      o.kind = ActivationKind::clamped_swiglu;
      o.alpha = alpha;
      o.limit = limit;
      const double L = limit;
      struct Point {
        double g, u;
        int gate_grad;  // 1: non-zero, 0: exactly 0, -1: NaN
        int up_grad;
        bool nan_value;
      };
      const Point pts[] = {
          {L, 0.5, 1, 1, false},         {L + 0.5, 0.5, 0, 1, false},   {-3 * L, 0.5, 1, 1, false},
          {0.75, L, 1, 1, false},        {0.75, -L, 1, 1, false},       {0.75, L + 0.25, 1, 0, false},
          {0.75, -L - 2, 1, 0, false},   {L + 1, -L - 1, 0, 0, false},  {kNaN, 0.5, 0, -1, true},
          {0.75, kNaN, -1, 0, true},     {L + 0.5, kNaN, 0, 0, true},
      };
      const int64_t n = int64_t(std::size(pts));
      HostTensor h(dt, {n, 2}), dz(dt, {n, 1}), probs(DType::f32, {n});
      for (int64_t i = 0; i < n; ++i) {
        h.set(2 * i, pts[i].g);
        h.set(2 * i + 1, pts[i].u);
        dz.set(i, 0.75);
        probs.set(i, 1.0);
      }
      const HostTensor counts = make_counts({n});
      HostTensor z(dt, {n, 1}), dh(dt, {n, 2}), dprobs(DType::f32, {n});
      poison(z);
      poison(dh);
      grouped_activation_forward(h.view(), counts.view(), z.view(), o);
      grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, {}, dprobs.view());
      for (int64_t i = 0; i < n; ++i) {
        SCOPED_TRACE("gate " + std::to_string(pts[i].g) + ", up " + std::to_string(pts[i].u));
        EXPECT_EQ(std::isnan(z.get(i)), pts[i].nan_value);
        EXPECT_EQ(std::isnan(dprobs.get(i)), pts[i].nan_value);
        const double dg = dh.get(2 * i), du = dh.get(2 * i + 1);
        auto expect = [](double got, int want, const char* what) {
          if (want < 0) {
            EXPECT_TRUE(std::isnan(got)) << what << " = " << got << ", expected NaN";
          } else if (want == 0) {
            EXPECT_EQ(got, 0.0) << what << " must be exactly 0";
          } else {
            EXPECT_TRUE(std::isfinite(got) && got != 0.0) << what << " = " << got << ", expected a gradient";
          }
        };
        expect(dg, pts[i].gate_grad, "d/dgate");
        expect(du, pts[i].up_grad, "d/dup");
      }
      // And the values, against the oracle.
      const ExactActivation ex = exact_activation(h, &dz, nullptr, n, o, 1);
      EXPECT_TRUE(within_rule(z.to_double(), ex.z, dt, "z"));
      EXPECT_TRUE(within_rule(dh.to_double(), ex.dh, dt, "dh"));
    }
  }
}

TEST(CpuActivationSquaredRelu, ZeroNegativeAndNaN) {
  ActivationOptions o;
  o.kind = ActivationKind::squared_relu;
  const double in[] = {0.0, -0.0, 0.5, -2.0, 3.0, kNaN};
  const int64_t n = int64_t(std::size(in));
  HostTensor h(DType::f32, {1, n}), dz(DType::f32, {1, n}), z(DType::f32, {1, n}), dh(DType::f32, {1, n});
  for (int64_t i = 0; i < n; ++i) {
    h.set(i, in[i]);
    dz.set(i, 1.5);
  }
  const HostTensor counts = make_counts({1});
  grouped_activation_forward(h.view(), counts.view(), z.view(), o);
  grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o);
  const double want_z[] = {0, 0, 0.25, 0, 9, kNaN}, want_dh[] = {0, 0, 1.5, 0, 9, 0};
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(want_z[i])) {
      EXPECT_TRUE(std::isnan(z.get(i)));
    } else {
      EXPECT_EQ(z.get(i), want_z[i]) << "h = " << in[i];
    }
    EXPECT_EQ(dh.get(i), want_dh[i]) << "h = " << in[i];
  }
}

// ---------------------------------------------------------------------------------------------

TEST(CpuActivationApi, NamesRoundTrip) {
  for (ActivationKind k : {ActivationKind::swiglu, ActivationKind::geglu, ActivationKind::clamped_swiglu,
                           ActivationKind::squared_relu}) {
    EXPECT_EQ(activation_from_name(activation_name(k)), k);
  }
  GMOE_EXPECT_ERROR(activation_from_name("gelu"), "unknown activation 'gelu'", "swiglu");
}

TEST(CpuActivationApi, BadArgumentsNameTheArgument) {
  const int64_t cap = 16, F = 64;
  HostTensor h(DType::bf16, {cap, 2 * F}), dz(DType::bf16, {cap, F}), z(DType::bf16, {cap, F});
  HostTensor dh(DType::bf16, {cap, 2 * F}), probs(DType::f32, {cap}), dprobs(DType::f32, {cap});
  Rng rng;
  fill_random(h, rng);
  fill_random(dz, rng);
  fill_random(probs, rng);
  const HostTensor counts = make_counts({8, 8});
  const ActivationOptions o;

  // Forward.
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), TensorView(), o), "z:", "2-D");
  HostTensor z_wide(DType::bf16, {cap, F + 1});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z_wide.view(), o), "h:", "input columns");
  HostTensor z_f16(DType::f16, {cap, F});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z_f16.view(), o), "z:", "dtype");
  HostTensor z_short(DType::bf16, {cap - 1, F});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z_short.view(), o), "z:", "expected [");
  HostTensor h_i32(DType::i32, {cap, 2 * F});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h_i32.view(), counts.view(), z.view(), o), "h:", "dtype");
  HostTensor counts_f32(DType::f32, {2});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts_f32.view(), z.view(), o), "counts:", "i32 or i64");
  const HostTensor too_many = make_counts({9, 8});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), too_many.view(), z.view(), o), "counts");
  HostTensor probs_f16(DType::f16, {cap}), probs_short(DType::f32, {cap - 2});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), o, probs_f16.view()), "probs:",
                    "f32[");
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), o, probs_short.view()), "probs:");
  HostTensor probs_wide(DType::f32, {2 * cap});
  const TensorView strided(probs_wide.data(), DType::f32, Device::cpu(), {cap}, {2});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), o, strided), "probs:",
                    "contiguous");
  ActivationOptions bad = o;
  bad.kind = ActivationKind::clamped_swiglu;
  bad.limit = 0.0f;
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), bad), "options.limit", "> 0");
  bad.limit = 7.0f;
  bad.alpha = std::numeric_limits<float>::quiet_NaN();
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), bad), "options.alpha", "finite");
  bad = o;
  bad.glu = {GluLayout::interleaved, 48};
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), bad), "options.glu.block",
                    "must divide");
  bad.glu = {GluLayout::interleaved, 0};
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), bad), "options.glu.block");
  // z aliasing h: the first F columns of h's rows.
  const TensorView z_in_h(h.data(), DType::bf16, Device::cpu(), {cap, F}, {2 * F, 1});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z_in_h, o), "z and h overlap");
  const TensorView z_in_probs(probs.data(), DType::bf16, Device::cpu(), {1, F});
  HostTensor h1(DType::bf16, {1, 2 * F});
  fill_random(h1, rng);
  const TensorView probs1(probs.data(), DType::f32, Device::cpu(), {1});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h1.view(), make_counts({1}).view(), z_in_probs, o, probs1),
                    "z and probs overlap");

  // Backward.
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), z_wide.view(), counts.view(), dh.view(), o), "h:",
                    "input columns");
  HostTensor dh_narrow(DType::bf16, {cap, F});
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz.view(), counts.view(), dh_narrow.view(), o), "dh:",
                    "expected [");
  HostTensor dz_short(DType::bf16, {cap - 1, F});
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz_short.view(), counts.view(), dh.view(), o), "dz:",
                    "expected [");
  // dz and dh interleaved row by row in one buffer: their byte ranges overlap.
  HostTensor shared(DType::bf16, {cap, 3 * F});
  const TensorView dz_in(shared.data(), DType::bf16, Device::cpu(), {cap, F}, {3 * F, 1});
  const TensorView dh_in(static_cast<uint16_t*>(shared.data()) + F, DType::bf16, Device::cpu(), {cap, 2 * F},
                         {3 * F, 1});
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz_in, counts.view(), dh_in, o), "dh and dz overlap");
  HostTensor dprobs_bf16(DType::bf16, {cap});
  GMOE_EXPECT_ERROR(
      grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, {}, dprobs_bf16.view()),
      "dprobs:", "f32[");
  const TensorView dprobs_in_dh(dh.data(), DType::f32, Device::cpu(), {cap});
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, {}, dprobs_in_dh),
                    "dprobs and dh overlap");
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, probs.view(),
                                                dprobs.view(), z_wide.view()),
                    "z_out:", "expected [");
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, probs.view(),
                                                dprobs.view(), dz.view()),
                    "z_out and dz overlap");

  // amax_out: f32, one per expert, contiguous, apart from the other tensors.
  HostTensor amax3(DType::f32, {3}), amax_bf16(DType::bf16, {2}), amax4(DType::f32, {4});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), o, {}, nullptr, nullptr, amax3.view()),
                    "amax_out:", "f32[2]");
  GMOE_EXPECT_ERROR(
      grouped_activation_forward(h.view(), counts.view(), z.view(), o, {}, nullptr, nullptr, amax_bf16.view()),
      "amax_out:", "f32[2]");
  const TensorView amax_strided(amax4.data(), DType::f32, Device::cpu(), {2}, {2});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), o, {}, nullptr, nullptr, amax_strided),
                    "amax_out:", "contiguous");
  const TensorView amax_in_z(z.data(), DType::f32, Device::cpu(), {2});
  GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), counts.view(), z.view(), o, {}, nullptr, nullptr, amax_in_z),
                    "amax_out and z overlap");
  const TensorView amax_in_dh(dh.data(), DType::f32, Device::cpu(), {2});
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, {}, {}, {}, nullptr,
                                                nullptr, amax_in_dh),
                    "amax_out and dh overlap");
  GMOE_EXPECT_ERROR(grouped_activation_backward(h.view(), dz.view(), counts.view(), dh.view(), o, {}, {}, {}, nullptr,
                                                nullptr, amax3.view()),
                    "amax_out:", "f32[2]");
}

}  // namespace
}  // namespace gmoe::test
