// tests/layers/test_moe_layer.cpp — MoELayer on the CPU backend (f32) against an fp64 oracle of the
// whole block written from the definitions: each token's output Σ_j p_j · MLP_{e_j}(x_t) over its
// kept slots (SwiGLU experts), dx by finite differences of that oracle with the routing held fixed,
// dlogits as the router oracle's gradient for the oracle's dprobs plus the losses' gradients, the
// experts' weight and bias gradients from the chain rule of that oracle. Cases: softmax top-2,
// DeepSeek-style sigmoid groups with a bias, padding with a capacity that drops tokens (one token
// losing every slot), zero tokens, experts with recomputed activations, and experts with biases
// (an FC2 bias takes the weighted combine: the probabilities cannot go inside the experts). Then
// the bytes each path keeps for backward.
#include <gtest/gtest.h>

#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/offload_fixture.h"
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
  bool bias = false;         // the router's selection bias
  bool expert_bias = false;  // FC1 and FC2 biases (the weighted-combine path)
  bool recompute = false;    // the experts' recompute_activation
};

std::vector<LayerCase> layer_cases() {
  const RouterOptions softmax2 = router_options(2, RouterScore::softmax, true);
  const RouterOptions groups = router_options(3, RouterScore::sigmoid, true, 4, 2, 1.5f);
  PermuteOptions plain, padded_capacity;
  padded_capacity.pad_multiple = 4;
  padded_capacity.capacity_factor = 0.75;
  return {{"softmax_top2", 13, 4, 12, 6, softmax2, plain},
          {"sigmoid_groups_bias", 11, 8, 8, 4, groups, plain, true},
          {"padded_capacity_drops", 16, 4, 8, 4, softmax2, padded_capacity},
          {"zero_tokens", 0, 4, 8, 4, softmax2, padded_capacity},
          {"recompute_padded_capacity", 16, 4, 8, 4, softmax2, padded_capacity, false, false, true},
          {"expert_bias_weighted_combine", 13, 4, 12, 6, softmax2, padded_capacity, false, true}};
}

// Expert e's MLP for token row x (H): y = W2_e · z + b2_e, z = silu(g) · u, [g; u] = W1_e · x + b1_e
// (b1, b2 empty: no biases). With dy (H) given, also accumulates p-scaled weight and bias
// gradients of p·y for the upstream gradient dy into dw1, db1, dw2, db2.
struct ExpertGrads {
  std::vector<double> w1, b1, w2, b2;
};
std::vector<double> expert_mlp(const std::vector<double>& w1, const std::vector<double>& w2,
                               const std::vector<double>& b1, const std::vector<double>& b2, int64_t e, int64_t H,
                               int64_t F, const double* x, const double* dy = nullptr, double p = 0,
                               ExpertGrads* grads = nullptr) {
  std::vector<double> g(F), u(F), z(F), y(H, 0.0);
  for (int64_t f = 0; f < F; ++f) {
    g[f] = b1.empty() ? 0.0 : b1[e * 2 * F + f];
    u[f] = b1.empty() ? 0.0 : b1[e * 2 * F + F + f];
    for (int64_t h = 0; h < H; ++h) {
      g[f] += w1[(e * 2 * F + f) * H + h] * x[h];
      u[f] += w1[(e * 2 * F + F + f) * H + h] * x[h];
    }
    z[f] = g[f] / (1 + std::exp(-g[f])) * u[f];
  }
  for (int64_t h = 0; h < H; ++h) {
    y[h] = b2.empty() ? 0.0 : b2[e * H + h];
    for (int64_t f = 0; f < F; ++f) y[h] += w2[(e * H + h) * F + f] * z[f];
  }
  if (grads == nullptr) return y;
  for (int64_t f = 0; f < F; ++f) {
    double dz = 0;
    for (int64_t h = 0; h < H; ++h) {
      grads->w2[(e * H + h) * F + f] += p * dy[h] * z[f];
      dz += p * dy[h] * w2[(e * H + h) * F + f];
    }
    const double sg = 1 / (1 + std::exp(-g[f])), silu = g[f] * sg;
    const double dg = dz * u[f] * (sg + silu * (1 - sg)), du = dz * silu;
    grads->b1[e * 2 * F + f] += dg;
    grads->b1[e * 2 * F + F + f] += du;
    for (int64_t h = 0; h < H; ++h) {
      grads->w1[(e * 2 * F + f) * H + h] += dg * x[h];
      grads->w1[(e * 2 * F + F + f) * H + h] += du * x[h];
    }
  }
  for (int64_t h = 0; h < H; ++h) grads->b2[e * H + h] += p * dy[h];
  return y;
}

// The values of a stacked [E, N, K] gradient view (its expert stride may be padded).
std::vector<double> stacked_values(const TensorView& v) {
  const int64_t E = v.size(0), N = v.size(1), K = v.size(2);
  std::vector<double> out(E * N * K);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < N * K; ++i) out[e * N * K + i] = static_cast<const float*>(v.data)[e * v.stride(0) + i];
  }
  return out;
}

// The values of a grouped [E, N] gradient view.
std::vector<double> grouped_values(const TensorView& v) {
  const int64_t E = v.size(0), N = v.size(1);
  std::vector<double> out(E * N);
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < N; ++i) out[e * N + i] = static_cast<const float*>(v.data)[e * v.stride(0) + i];
  }
  return out;
}

class MoELayerCpu : public ::testing::TestWithParam<LayerCase> {};

TEST_P(MoELayerCpu, ForwardAndBackwardMatchOracle) {
  const LayerCase& c = GetParam();
  const int64_t k = c.router.top_k;
  Rng rng;
  HostTensor w1(DType::f32, {c.E, 2 * c.F, c.H}), w2(DType::f32, {c.E, c.H, c.F}), x(DType::f32, {c.T, c.H}),
      logits(DType::f32, {c.T, c.E}), bias(DType::f32, {c.E}), dout(DType::f32, {c.T, c.H}),
      b1(DType::f32, {c.E, 2 * c.F}), b2(DType::f32, {c.E, c.H});
  fill_random(w1, rng, -0.5, 0.5);
  fill_random(w2, rng, -0.5, 0.5);
  fill_random(x, rng);
  fill_random(logits, rng, -2.0, 2.0);
  fill_random(bias, rng, -0.1, 0.1);
  fill_random(dout, rng);
  fill_random(b1, rng, -0.5, 0.5);
  fill_random(b2, rng, -0.5, 0.5);
  GroupedMLPOptions mo;
  mo.recompute_activation = c.recompute;
  GroupedMLP experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()),
                     c.expert_bias ? ExpertBias::from_grouped(b1.view()) : ExpertBias{},
                     c.expert_bias ? ExpertBias::from_grouped(b2.view()) : ExpertBias{}, mo);
  MoELayerOptions o;
  o.router = c.router;
  o.permute = c.permute;
  o.aux_loss_coeff = 0.01f;
  o.z_loss_coeff = 0.001f;
  if (c.bias) o.score_bias = bias.view();
  MoELayer layer(experts, o);
  EXPECT_EQ(layer.probs_in_experts(), !c.expert_bias)
      << "the probabilities go inside the experts unless FC2 has a bias";
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
  const std::vector<double> B1 = c.expert_bias ? b1.to_double() : std::vector<double>{},
                            B2 = c.expert_bias ? b2.to_double() : std::vector<double>{};
  ExpertGrads wg{std::vector<double>(W1.size()), std::vector<double>(c.E * 2 * c.F), std::vector<double>(W2.size()),
                 std::vector<double>(c.E * c.H)};
  auto block = [&](const std::vector<double>& xs, std::vector<double>* dprobs) {
    std::vector<double> out(c.T * c.H, 0.0);
    for (int64_t t = 0; t < c.T; ++t) {
      for (int64_t j = 0; j < k; ++j) {
        if (perm.row_of[t * k + j] < 0) {
          if (dprobs) (*dprobs)[t * k + j] = 0;
          continue;
        }
        const std::vector<double> y = expert_mlp(W1, W2, B1, B2, id[t * k + j], c.H, c.F, &xs[t * c.H],
                                                 &G[t * c.H], p[t * k + j], dprobs ? &wg : nullptr);
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
  // The experts' weight and bias gradients (db2 = Σ p·dout over the kept slots in either path).
  EXPECT_TRUE(all_close(stacked_values(b.grads.fc1.weight.stacked), wg.w1, 1e-5, 1e-4, "dW1"));
  EXPECT_TRUE(all_close(stacked_values(b.grads.fc2.weight.stacked), wg.w2, 1e-5, 1e-4, "dW2"));
  if (c.expert_bias) {
    EXPECT_TRUE(all_close(grouped_values(b.grads.fc1.bias.grouped), wg.b1, 1e-5, 1e-4, "db1"));
    EXPECT_TRUE(all_close(grouped_values(b.grads.fc2.bias.grouped), wg.b2, 1e-5, 1e-4, "db2"));
  }
  EXPECT_TRUE(all_close({static_cast<const float*>(f.aux_loss.view().data)[0]},
                        {oracle_aux_loss(lg, c.T, c.E, counts, c.router, 0.01)}, 1e-9, 1e-5, "aux loss"));
  if (c.permute.capacity_factor > 0 && c.T > 0) EXPECT_GT(perm.dropped, 0) << "the case is meant to drop slots";
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerCpu, ::testing::ValuesIn(layer_cases()),
                         [](const auto& info) { return info.param.name; });

// The bytes forward leaves for backward (what gmoe-bench --mode moe reports as kept per token):
// everything forward allocated that is still live, but its output. The experts keep x by reference
// (fc1.save_original_input), as the benchmark's do, unless `fc1_copy`; the layer keeps the permuted
// rows for them unless it gathers them again in backward (`regather`).
struct Kept {
  size_t bytes;
  bool probs_in_experts;
  size_t backward_peak;  // the most backward holds beyond what forward left live (its output included)
};
Kept kept_for_backward(int64_t T, int64_t E, int64_t k, int64_t H, int64_t F, bool fc2_bias, bool recompute,
                       bool regather = false, bool fc1_copy = false) {
  Rng rng;
  HostTensor w1(DType::f32, {E, 2 * F, H}), w2(DType::f32, {E, H, F}), b2(DType::f32, {E, H}),
      x(DType::f32, {T, H}), logits(DType::f32, {T, E}), dout(DType::f32, {T, H});
  for (HostTensor* t : {&w1, &w2, &b2, &x, &logits, &dout}) fill_random(*t, rng);
  CountingAllocator alloc(host_allocator());
  GroupedMLPOptions mo;
  mo.fc1.save_original_input = !fc1_copy;
  mo.recompute_activation = recompute;
  mo.allocator = &alloc;
  GroupedMLP experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()), {},
                     fc2_bias ? ExpertBias::from_grouped(b2.view()) : ExpertBias{}, mo);
  MoELayerOptions o;
  o.router.top_k = k;
  o.allocator = &alloc;
  o.regather_expert_input = regather;
  MoELayer layer(experts, o);
  MoELayerContext ctx;
  const size_t before = alloc.in_use();
  MoEForward f = layer.forward(x.view(), logits.view(), ctx);
  const size_t kept = alloc.in_use() - before - size_t(T * H) * sizeof(float);
  const size_t after_forward = alloc.in_use();
  alloc.reset_peak();
  layer.backward(ctx, dout.view());  // the context is complete: backward runs on it
  return {kept, layer.probs_in_experts(), alloc.peak() - after_forward};
}

TEST(MoELayerCpuMemory, ProbsInExpertsKeepNoExpertOutput) {
  const int64_t T = 64, E = 8, k = 2, H = 32, F = 16, rows = T * k;
  const size_t f32 = sizeof(float), i32 = sizeof(int32_t);
  const Kept weighted = kept_for_backward(T, E, k, H, F, true, false);
  const Kept inside = kept_for_backward(T, E, k, H, F, false, false);
  const Kept recomputed = kept_for_backward(T, E, k, H, F, false, true);
  ASSERT_FALSE(weighted.probs_in_experts);
  ASSERT_TRUE(inside.probs_in_experts);
  // Both: the router's ids, probs, counts; the permuted rows, counts, row_of, src_token; FC1's
  // output h. Then z (unless recomputed), and the experts' output [rows, H] (weighted combine) or
  // each row's probability [rows] (inside the experts).
  const size_t common = size_t(T * k) * (i32 + f32 + i32) + size_t(E) * 2 * i32 + size_t(rows) * (H * f32 + i32) +
                        size_t(rows * 2 * F) * f32;
  EXPECT_EQ(weighted.bytes, common + size_t(rows * F) * f32 + size_t(rows * H) * f32);
  EXPECT_EQ(inside.bytes, common + size_t(rows * F) * f32 + size_t(rows) * f32);
  EXPECT_EQ(recomputed.bytes, common + size_t(rows) * f32);
  EXPECT_LT(recomputed.bytes, inside.bytes);
  EXPECT_LT(inside.bytes, weighted.bytes);
  // Gathered again in backward: no permuted rows kept (with the recomputed activation, what is left
  // per row is FC1's output h, the row's token, probability and nothing of [rows, H]).
  const Kept regathered = kept_for_backward(T, E, k, H, F, false, true, true);
  EXPECT_EQ(regathered.bytes, recomputed.bytes - size_t(rows * H) * f32);
  // FC1 keeping its own copy: the layer keeps no second one (either setting).
  EXPECT_EQ(kept_for_backward(T, E, k, H, F, false, false, false, true).bytes, inside.bytes);
  EXPECT_EQ(kept_for_backward(T, E, k, H, F, false, false, true, true).bytes, inside.bytes);
}

// Backward's peak is in FC1's backward, where it holds both weight gradients and one [rows, H]
// buffer: FC1's input until its weight gradient has read it, then dx of the permuted rows. The
// output gradient of the experts is gone by then (freed after FC2's weight gradient), and so is
// FC1's input before FC1's dx takes memory, whichever way FC1 got it: gathered again, kept by the
// layer, or copied by FC1. The rest is the router's gradient of the probabilities and the
// experts' per-row one.
TEST(MoELayerCpuMemory, BackwardPeakHoldsOneRowsBuffer) {
  const int64_t T = 16, E = 8, k = 2, H = 32, F = 16, rows = T * k;
  const size_t f32 = sizeof(float);
  // Both weight gradients (each expert's block is a multiple of 256 bytes here, so unpadded).
  const size_t grads = size_t(E * 2 * F * H) * f32 + size_t(E * H * F) * f32;
  const size_t rows_buffer = size_t(rows * H) * f32, dprobs = size_t(T * k) * f32 + size_t(rows) * f32;
  EXPECT_EQ(kept_for_backward(T, E, k, H, F, false, true, true).backward_peak, grads + rows_buffer + dprobs)
      << "gathered again";
  // Kept from forward, the rows buffer is in what forward left live, not in backward's peak above it.
  EXPECT_EQ(kept_for_backward(T, E, k, H, F, false, true, false).backward_peak, grads + dprobs) << "kept by the layer";
  EXPECT_EQ(kept_for_backward(T, E, k, H, F, false, true, false, true).backward_peak, grads + dprobs) << "FC1's copy";
}

// regather_expert_input: forward frees the permuted rows and backward gathers them again from x
// for FC1's weight gradient. Every output and gradient must be bitwise those of the layer that
// keeps the rows, and forward must keep exactly the rows' bytes less.
struct RegatherCase {
  std::string name;
  int64_t T, E, H, F, k;
  ActivationKind act = ActivationKind::swiglu;
  PermuteOptions permute = {};
  bool delay = false;       // fc1 and fc2 delay_wgrad: backward_dw after backward
  bool overlap = false;     // with delay: the experts' weight gradients inside backward
  bool recompute = false;   // the experts' recompute_activation
  bool one_expert = false;  // logits steer every token to expert 0: one expert holds all tokens
  bool shared = false;      // a shared expert (a one-expert MLP on every token) beside the layer
  bool fc2_bias = false;    // FC1 and FC2 biases: the weighted combine
  LinearRecipe recipe = LinearRecipe::native;
};

// gtest prints the case by its name.
void PrintTo(const RegatherCase& c, std::ostream* os) { *os << c.name; }

std::vector<RegatherCase> regather_cases() {
  PermuteOptions padded_capacity;
  padded_capacity.pad_multiple = 4;
  padded_capacity.capacity_factor = 0.75;
  RegatherCase geglu{"geglu_padded_capacity_drops", 16, 4, 8, 4, 2, ActivationKind::geglu, padded_capacity};
  RegatherCase clamped{"clamped_swiglu_biases", 13, 4, 12, 6, 2, ActivationKind::clamped_swiglu};
  clamped.fc2_bias = true;
  RegatherCase relu2{"squared_relu_top3", 11, 8, 8, 4, 3, ActivationKind::squared_relu};
  RegatherCase delayed{"swiglu_delayed_wgrad", 13, 4, 12, 6, 2};
  delayed.delay = true;
  RegatherCase overlap = delayed;
  overlap.name = "swiglu_wgrad_inside_backward";
  overlap.overlap = true;
  RegatherCase recompute{"swiglu_recompute_delayed", 16, 4, 8, 4, 2, ActivationKind::swiglu, padded_capacity};
  recompute.recompute = true;
  recompute.delay = true;
  RegatherCase zero{"zero_tokens_padded", 0, 4, 8, 4, 2, ActivationKind::swiglu, padded_capacity};
  RegatherCase all{"one_expert_all_tokens", 24, 4, 8, 4, 2};
  all.one_expert = true;
  RegatherCase shared{"shared_expert", 13, 8, 8, 4, 2};
  shared.shared = true;
  RegatherCase fp8{"fp8_blockwise", 16, 4, 16, 16, 2};
  fp8.recipe = LinearRecipe::fp8_blockwise;
  return {{"swiglu_top2", 13, 4, 12, 6, 2}, geglu, clamped, relu2, delayed, overlap, recompute, zero, all, shared,
          fp8};
}

struct RegatherRun {
  std::vector<float> out, dx, dlogits, dw1, dw2, db1, db2;
  size_t kept = 0;
  bool regathers = false;
};

std::vector<float> floats(const TensorView& v) {
  if (!v.defined()) return {};
  const float* p = static_cast<const float*>(v.data);
  return std::vector<float>(p, p + v.numel());
}

std::vector<float> as_floats(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }

class MoELayerRegatherCpu : public ::testing::TestWithParam<RegatherCase> {};

TEST_P(MoELayerRegatherCpu, BitwiseTheLayerThatKeepsItsRows) {
  const RegatherCase& c = GetParam();
  const int64_t R1 = activation_input_cols(c.act, c.F);
  Rng rng;
  HostTensor w1(DType::f32, {c.E, R1, c.H}), w2(DType::f32, {c.E, c.H, c.F}), b1(DType::f32, {c.E, R1}),
      b2(DType::f32, {c.E, c.H}), x(DType::f32, {c.T, c.H}), logits(DType::f32, {c.T, c.E}),
      dout(DType::f32, {c.T, c.H}), sw1(DType::f32, {1, R1, c.H}), sw2(DType::f32, {1, c.H, c.F});
  for (HostTensor* t : {&w1, &w2, &b1, &b2, &sw1, &sw2}) fill_random(*t, rng, -0.5, 0.5);
  fill_random(x, rng);
  fill_random(logits, rng, -2.0, 2.0);
  fill_random(dout, rng);
  if (c.one_expert) {
    for (int64_t t = 0; t < c.T; ++t) logits.set(t * c.E, 10.0);
  }
  auto run = [&](bool regather) {
    CountingAllocator alloc(host_allocator());  // freed blocks are poisoned: a use after release shows
    GroupedMLPOptions mo;
    mo.activation.kind = c.act;
    mo.fc1.save_original_input = true;
    mo.fc1.delay_wgrad = c.delay;
    mo.fc2.delay_wgrad = c.delay;
    mo.recompute_activation = c.recompute;
    mo.recipe = c.recipe;
    mo.allocator = &alloc;
    GroupedMLP experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()),
                       c.fc2_bias ? ExpertBias::from_grouped(b1.view()) : ExpertBias{},
                       c.fc2_bias ? ExpertBias::from_grouped(b2.view()) : ExpertBias{}, mo);
    GroupedMLPOptions so;
    so.activation.kind = c.act;
    so.fc1.save_original_input = true;  // x by reference, like the routed experts' regathered rows
    so.allocator = &alloc;
    GroupedMLP shared(ExpertWeights::from_stacked(sw1.view()), ExpertWeights::from_stacked(sw2.view()), {}, {}, so);
    const HostTensor every_token = make_counts({c.T});
    MoELayerOptions o;
    o.router = router_options(c.k, RouterScore::softmax, true);
    o.permute = c.permute;
    o.aux_loss_coeff = 0.01f;
    o.allocator = &alloc;
    o.regather_expert_input = regather;
    MoELayer layer(experts, o);
    RegatherRun r;
    r.regathers = layer.regathers_expert_input();
    MoELayerContext ctx;
    GroupedMLPContext shared_ctx;
    const size_t before = alloc.in_use();
    MoEForward f = layer.forward(x.view(), logits.view(), ctx);
    r.kept = alloc.in_use() - before - size_t(c.T * c.H) * sizeof(float);
    Tensor shared_out;
    if (c.shared) {
      shared_out = shared.forward(x.view(), every_token.view(), {}, shared_ctx);
      for (int64_t i = 0; i < c.T * c.H; ++i) {
        static_cast<float*>(f.out.view().data)[i] += static_cast<const float*>(shared_out.view().data)[i];
      }
    }
    MoEBackwardOverlap overlap;
    overlap.experts_wgrad_during_combine = c.overlap;
    MoEBackward b = layer.backward(ctx, dout.view(), nullptr, {}, {}, overlap);
    if (c.delay && !c.overlap) {
      GroupedMLPGrads dw = experts.backward_dw(ctx.experts());
      b.grads.fc1 = std::move(dw.fc1);
      b.grads.fc2 = std::move(dw.fc2);
    }
    if (c.shared) {
      GroupedMLPBackward sb = shared.backward(shared_ctx, dout.view());
      for (int64_t i = 0; i < c.T * c.H; ++i) {
        static_cast<float*>(b.dx.view().data)[i] += static_cast<const float*>(sb.dx.view().data)[i];
      }
    }
    r.out = floats(f.out);
    r.dx = floats(b.dx);
    r.dlogits = floats(b.dlogits);
    r.dw1 = as_floats(stacked_values(b.grads.fc1.weight.stacked));
    r.dw2 = as_floats(stacked_values(b.grads.fc2.weight.stacked));
    if (c.fc2_bias) {
      r.db1 = floats(b.grads.fc1.bias.grouped);
      r.db2 = floats(b.grads.fc2.bias.grouped);
    }
    return r;
  };
  const RegatherRun kept = run(false), re = run(true);
  EXPECT_FALSE(kept.regathers);
  EXPECT_TRUE(re.regathers);
  EXPECT_EQ(re.out, kept.out) << "out";
  EXPECT_EQ(re.dx, kept.dx) << "dx";
  EXPECT_EQ(re.dlogits, kept.dlogits) << "dlogits";
  EXPECT_EQ(re.dw1, kept.dw1) << "dW1";
  EXPECT_EQ(re.dw2, kept.dw2) << "dW2";
  EXPECT_EQ(re.db1, kept.db1) << "db1";
  EXPECT_EQ(re.db2, kept.db2) << "db2";
  EXPECT_FALSE(kept.dw1.empty());
  // Forward keeps the permuted rows' bytes less (zero-token cases too: the padding rows).
  const int64_t rows = permuted_rows(c.T, c.k, c.E, c.permute);
  EXPECT_EQ(kept.kept - re.kept, size_t(rows * c.H) * sizeof(float));
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerRegatherCpu, ::testing::ValuesIn(regather_cases()),
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
