// tests/layers/test_moe_layer.cpp — MoELayer on the CPU backend (f32) against an fp64 oracle of the
// whole block written from the definitions: each token's output Σ_j p_j · MLP_{e_j}(x_t) over its
// kept slots (SwiGLU experts), dx by finite differences of that oracle with the routing held fixed,
// dlogits as the router oracle's gradient for the oracle's dprobs plus the losses' gradients. Cases:
// softmax top-2, DeepSeek-style sigmoid groups with a bias, padding with a capacity that drops
// tokens (one token losing every slot), and zero tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "common/routing_oracle.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/moe_layer.h"

namespace gmoe::test {
namespace {

struct LayerCase {
  std::string name;
  int64_t T, E, H, F;
  RouterOptions router;
  PermuteOptions permute;
  bool bias = false;
};

std::vector<LayerCase> layer_cases() {
  RouterOptions softmax2;
  softmax2.top_k = 2;
  softmax2.normalize = true;
  RouterOptions groups;
  groups.top_k = 3;
  groups.score = RouterScore::sigmoid;
  groups.normalize = true;
  groups.n_group = 4;
  groups.topk_group = 2;
  groups.scaling_factor = 1.5f;
  PermuteOptions plain, padded_capacity;
  padded_capacity.pad_multiple = 4;
  padded_capacity.capacity_factor = 0.75;
  return {{"softmax_top2", 13, 4, 12, 6, softmax2, plain},
          {"sigmoid_groups_bias", 11, 8, 8, 4, groups, plain, true},
          {"padded_capacity_drops", 16, 4, 8, 4, softmax2, padded_capacity},
          {"zero_tokens", 0, 4, 8, 4, softmax2, padded_capacity}};
}

// The experts' output for token row x (H) through expert e: W2_e · (silu(g) · u), [g; u] = W1_e · x.
std::vector<double> expert_mlp(const std::vector<double>& w1, const std::vector<double>& w2, int64_t e, int64_t H,
                               int64_t F, const double* x) {
  std::vector<double> z(F), y(H, 0.0);
  for (int64_t f = 0; f < F; ++f) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < H; ++h) {
      g += w1[(e * 2 * F + f) * H + h] * x[h];
      u += w1[(e * 2 * F + F + f) * H + h] * x[h];
    }
    z[f] = g / (1 + std::exp(-g)) * u;
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t f = 0; f < F; ++f) y[h] += w2[(e * H + h) * F + f] * z[f];
  }
  return y;
}

class MoELayerCpu : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoELayerCpu, ForwardAndBackwardMatchOracle) {
  const LayerCase& c = GetParam();
  const int64_t k = c.router.top_k;
  Rng rng;
  HostTensor w1(DType::f32, {c.E, 2 * c.F, c.H}), w2(DType::f32, {c.E, c.H, c.F}), x(DType::f32, {c.T, c.H}),
      logits(DType::f32, {c.T, c.E}), bias(DType::f32, {c.E}), dout(DType::f32, {c.T, c.H});
  fill_random(w1, rng, -0.5, 0.5);
  fill_random(w2, rng, -0.5, 0.5);
  fill_random(x, rng);
  fill_random(logits, rng, -2.0, 2.0);
  fill_random(bias, rng, -0.1, 0.1);
  fill_random(dout, rng);
  GroupedMLP experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()));
  MoELayerOptions o;
  o.router = c.router;
  o.permute = c.permute;
  o.aux_loss_coeff = 0.01f;
  o.z_loss_coeff = 0.001f;
  if (c.bias) o.score_bias = bias.view();
  MoELayer layer(experts, o);
  MoELayerContext ctx;
  MoEForward f = layer.forward(x.view(), logits.view(), ctx);
  MoEBackward b = layer.backward(ctx, dout.view());

  // The routing the layer took is the router's own (checked by the routing suites); the rest of
  // the block is checked from it.
  const HostTensor ids = [&] {
    HostTensor t(DType::i32, {c.T, k});
    for (int64_t i = 0; i < c.T * k; ++i) t.set(i, static_cast<const int32_t*>(f.ids.view().data)[i]);
    return t;
  }();
  std::vector<int32_t> id(c.T * k);
  std::vector<double> p(c.T * k);
  for (int64_t i = 0; i < c.T * k; ++i) {
    id[i] = static_cast<int32_t>(ids.get(i));
    p[i] = static_cast<const float*>(f.probs.view().data)[i];
  }
  const std::vector<double> lg = logits.to_double();
  const OracleRoute route = oracle_topk(lg, c.T, c.E, c.router, c.bias ? bias.to_double() : std::vector<double>{});
  int64_t swapped = 0;
  ASSERT_TRUE(same_selection(id, route.ids, route.choice, c.T, c.E, k, 1e-6, &swapped));
  const OraclePermutation perm = oracle_permutation(id, c.T, k, c.E, permuted_rows(c.T, k, c.E, c.permute), c.permute);

  const std::vector<double> W1 = w1.to_double(), W2 = w2.to_double(), X = x.to_double(), G = dout.to_double();
  auto block = [&](const std::vector<double>& xs, std::vector<double>* dprobs) {
    std::vector<double> out(c.T * c.H, 0.0);
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        if (perm.row_of[t * k + j] < 0) {
          if (dprobs) (*dprobs)[t * k + j] = 0;
          continue;
        }
        const std::vector<double> y = expert_mlp(W1, W2, id[t * k + j], c.H, c.F, &xs[t * c.H]);
        double dot = 0;
        for (int64_t h = 0; h < c.H; ++h) {
          out[t * c.H + h] += p[t * k + j] * y[h];
          dot += G[t * c.H + h] * y[h];
        }
        if (dprobs) (*dprobs)[t * k + j] = dot;
      }
    }
    return out;
  };
  std::vector<double> dprobs(c.T * k);
  const std::vector<double> want = block(X, &dprobs);
  std::vector<double> got(c.T * c.H);
  for (int64_t i = 0; i < c.T * c.H; ++i) got[i] = static_cast<const float*>(f.out.view().data)[i];
  EXPECT_TRUE(all_close(got, want, 1e-5, 1e-4, "out"));

  // dx: finite differences of Σ dout·out over x, the routing fixed.
  std::vector<double> want_dx(c.T * c.H);
  std::vector<double> xs = X;
  for (int64_t i = 0; i < c.T * c.H; ++i) {
    const double x0 = xs[i], step = 1e-6;
    double l[2];
    for (int s = 0; s < 2; ++s) {
      xs[i] = x0 + (s == 0 ? step : -step);
      const std::vector<double> o2 = block(xs, nullptr);
      l[s] = 0;
      for (int64_t m = 0; m < c.T * c.H; ++m) l[s] += G[m] * o2[m];
    }
    xs[i] = x0;
    want_dx[i] = (l[0] - l[1]) / (2 * step);
  }
  std::vector<double> got_dx(c.T * c.H);
  for (int64_t i = 0; i < c.T * c.H; ++i) got_dx[i] = static_cast<const float*>(b.dx.view().data)[i];
  EXPECT_TRUE(all_close(got_dx, want_dx, 1e-5, 1e-3, "dx"));

  // dlogits: the router's gradient for the block's dprobs, plus the losses' (dloss = 1).
  std::vector<double> want_dl = oracle_topk_backward(lg, c.T, c.E, id, dprobs, c.router);
  const std::vector<int64_t> counts = histogram(id, c.E);
  const std::vector<double> aux = oracle_aux_loss_grad(lg, c.T, c.E, counts, c.router, 0.01, 1.0);
  const std::vector<double> z = oracle_z_loss_grad(lg, c.T, c.E, 0.001, 1.0);
  for (int64_t i = 0; i < c.T * c.E; ++i) want_dl[i] += aux[i] + z[i];
  std::vector<double> got_dl(c.T * c.E);
  for (int64_t i = 0; i < c.T * c.E; ++i) got_dl[i] = static_cast<const float*>(b.dlogits.view().data)[i];
  EXPECT_TRUE(all_close(got_dl, want_dl, 1e-6, 1e-3, "dlogits"));
  EXPECT_TRUE(all_close({static_cast<const float*>(f.aux_loss.view().data)[0]},
                        {oracle_aux_loss(lg, c.T, c.E, counts, c.router, 0.01)}, 1e-9, 1e-5, "aux loss"));
  if (c.permute.capacity_factor > 0 && c.T > 0) EXPECT_GT(perm.dropped, 0) << "the case is meant to drop slots";
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerCpu, ::testing::ValuesIn(layer_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(MoELayerCpuErrors, Arguments) {
  HostTensor w1(DType::f32, {4, 8, 6}), w2(DType::f32, {4, 6, 4});
  Rng rng;
  fill_random(w1, rng);
  fill_random(w2, rng);
  GroupedMLP experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()));
  MoELayerOptions o;
  o.router.top_k = 5;
  GMOE_EXPECT_ERROR(MoELayer(experts, o), "options.router.top_k", "5");
  o.router.top_k = 2;
  MoELayer layer(experts, o);
  MoELayerContext ctx;
  HostTensor x(DType::f32, {3, 6}), logits(DType::f32, {3, 5});
  GMOE_EXPECT_ERROR(layer.forward(x.view(), logits.view(), ctx), "logits", "[3, 4]");
  HostTensor dout(DType::f32, {3, 6});
  GMOE_EXPECT_ERROR(layer.backward(ctx, dout.view()), "ctx", "forward");
}

}  // namespace
}  // namespace gmoe::test
