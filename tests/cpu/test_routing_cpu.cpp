// tests/cpu/test_routing_cpu.cpp — the CPU routing ops (gmoe/routing.h) against the independent
// fp64 oracle of tests/common/routing_oracle.h: router top-k over softmax / sigmoid scores, with a
// score-correction bias, group-limited (DeepSeek-V3: E = 256, k = 8), renormalised and scaled; its
// backward and the aux / z losses with their gradients against finite differences; permute with
// padding and capacity drops, its backward, the combine and its backward. Nasty cases by name: ties
// in the top-k, E = 1, top-k = E, 0 tokens, every slot of a token dropped, odd H. Bad arguments
// raise gmoe::Error naming the argument.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "common/routing_oracle.h"
#include "common/tolerance.h"
#include "gmoe/grouped.h"
#include "gmoe/routing.h"

namespace gmoe::test {
namespace {

std::vector<RouterCase> router_cases() {
  using S = RouterScore;
  return {
      {"mixtral_softmax_top2", 37, 8, router_options(2, S::softmax, true), false, DType::bf16},
      {"qwen3_softmax_top8_128", 19, 128, router_options(8, S::softmax, true), false, DType::f32},
      {"softmax_no_renorm", 23, 16, router_options(4, S::softmax, false), false, DType::f16},
      {"softmax_with_bias", 17, 32, router_options(3, S::softmax, false), true, DType::f32},
      {"dsv3_sigmoid_grouped_e256_k8", 11, 256, router_options(8, S::sigmoid, true, 8, 4, 2.5f), true, DType::bf16},
      {"sigmoid_grouped_no_bias", 13, 64, router_options(6, S::sigmoid, false, 4, 2), false, DType::f32},
      {"sigmoid_plain", 21, 40, router_options(5, S::sigmoid, true), false, DType::f32},
      {"e1", 9, 1, router_options(1, S::softmax, false), false, DType::f32},
      {"topk_equals_e", 7, 6, router_options(6, S::softmax, true), false, DType::bf16},
      {"topk_equals_e_sigmoid_groups", 5, 8, router_options(8, S::sigmoid, true, 4, 4), true, DType::f32},
      {"zero_tokens", 0, 16, router_options(2, S::softmax, true), false, DType::f32},
  };
}

// The CPU router's outputs on host tensors.
struct Routed {
  HostTensor logits, bias, ids, probs, counts;
};

Routed run_router(const RouterCase& c, Rng& rng, const HostTensor* logits_in = nullptr) {
  Routed r;
  r.logits = logits_in ? *logits_in : HostTensor(c.dtype, {c.T, c.E});
  if (!logits_in) fill_random(r.logits, rng, -3.0, 3.0);
  if (c.bias) {
    r.bias = HostTensor(DType::f32, {c.E});
    fill_random(r.bias, rng, -0.2, 0.2);
  }
  r.ids = HostTensor(DType::i32, {c.T, c.o.top_k});
  r.probs = HostTensor(DType::f32, {c.T, c.o.top_k});
  r.counts = HostTensor(DType::i64, {c.E});
  poison(r.ids);
  poison(r.probs);
  poison(r.counts);
  router_topk(r.logits.view(), c.o, r.ids.view(), r.probs.view(), r.counts.view(),
              c.bias ? r.bias.view() : TensorView{});
  return r;
}

class RouterCpu : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouterCpu, TopkMatchesOracle) {
  const RouterCase& c = GetParam();
  Rng rng;
  const Routed r = run_router(c, rng);
  const OracleRoute want =
      oracle_topk(r.logits.to_double(), c.T, c.E, c.o, c.bias ? r.bias.to_double() : std::vector<double>{});
  int64_t swapped = 0;
  const std::vector<int32_t> ids = int32_values(r.ids);
  ASSERT_TRUE(same_selection(ids, want.ids, want.choice, c.T, c.E, c.o.top_k, 1e-6, &swapped));
  EXPECT_LE(swapped, 2) << "more near-ties than random inputs make";
  EXPECT_EQ(int64_values(r.counts), histogram(ids, c.E));
  if (swapped == 0) {
    EXPECT_TRUE(all_close(r.probs.to_double(), want.probs, 1e-6, 1e-5, "probs"));
    EXPECT_EQ(int64_values(r.counts), want.counts);
  }
  // Each token's ids are distinct and, with groups, lie in at most topk_group groups.
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<int> seen(c.E, 0), groups(c.o.n_group, 0);
    for (int64_t j = 0; j < c.o.top_k; ++j) {
      ASSERT_EQ(seen[ids[t * c.o.top_k + j]]++, 0) << "token " << t << " selects an expert twice";
      groups[ids[t * c.o.top_k + j] / (c.E / c.o.n_group)] = 1;
    }
    int used = 0;
    for (int g : groups) used += g;
    EXPECT_LE(used, c.o.n_group > 1 ? c.o.topk_group : 1);
  }
}

TEST_P(RouterCpu, BackwardMatchesFiniteDifferences) {
  const RouterCase& c = GetParam();
  Rng rng;
  const Routed r = run_router(c, rng);
  HostTensor dprobs(DType::f32, {c.T, c.o.top_k});
  fill_random(dprobs, rng);
  HostTensor dlogits(DType::f32, {c.T, c.E});
  poison(dlogits);
  router_topk_backward(r.logits.view(), r.ids.view(), dprobs.view(), c.o, dlogits.view());
  const std::vector<double> want =
      oracle_topk_backward(r.logits.to_double(), c.T, c.E, int32_values(r.ids), dprobs.to_double(), c.o);
  EXPECT_TRUE(all_close(dlogits.to_double(), want, 2e-6, 1e-4, "dlogits"));
  // accumulate: adding the same gradient again doubles it exactly (f32 x + x).
  const HostTensor once = dlogits;
  router_topk_backward(r.logits.view(), r.ids.view(), dprobs.view(), c.o, dlogits.view(), true);
  EXPECT_TRUE(doubled_exactly(once.to_double(), dlogits.to_double(), "dlogits accumulated"));
}

TEST_P(RouterCpu, AuxAndZLossMatchFiniteDifferences) {
  const RouterCase& c = GetParam();
  Rng rng;
  const Routed r = run_router(c, rng);
  const std::vector<double> x = r.logits.to_double();
  const std::vector<int64_t> counts = int64_values(r.counts);
  const float coeff = 0.01f;
  HostTensor loss(DType::f32, {1}), dloss(DType::f32, {1}), d(DType::f32, {c.T, c.E});
  dloss.set(0, rng.uniform(0.5, 2.0));
  poison(loss);
  router_aux_loss(r.logits.view(), r.counts.view(), c.o, coeff, loss.view());
  EXPECT_TRUE(all_close(loss.to_double(), {oracle_aux_loss(x, c.T, c.E, counts, c.o, coeff)}, 1e-9, 1e-5, "aux loss"));
  poison(d);
  router_aux_loss_backward(r.logits.view(), r.counts.view(), c.o, coeff, dloss.view(), d.view());
  if (c.T > 0) {
    EXPECT_TRUE(all_close(d.to_double(), oracle_aux_loss_grad(x, c.T, c.E, counts, c.o, coeff, dloss.get(0)), 1e-8,
                          1e-4, "aux dlogits"));
  }
  poison(loss);
  router_z_loss(r.logits.view(), coeff, loss.view());
  EXPECT_TRUE(all_close(loss.to_double(), {oracle_z_loss(x, c.T, c.E, coeff)}, 1e-9, 1e-5, "z loss"));
  poison(d);
  router_z_loss_backward(r.logits.view(), coeff, TensorView{}, d.view());
  if (c.T > 0) {
    EXPECT_TRUE(all_close(d.to_double(), oracle_z_loss_grad(x, c.T, c.E, coeff, 1.0), 1e-8, 1e-4, "z dlogits"));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, RouterCpu, ::testing::ValuesIn(router_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(RouterCpuTies, LowerExpertIdWins) {
  // Every logit equal: softmax and sigmoid scores tie everywhere, so the lowest ids win, in order.
  const int64_t T = 3, E = 12;
  HostTensor logits(DType::f32, {T, E});
  for (int64_t i = 0; i < T * E; ++i) logits.set(i, 0.25);
  for (RouterScore s : {RouterScore::softmax, RouterScore::sigmoid}) {
    for (int64_t n_group : {1, 4}) {
      const RouterOptions o = router_options(5, s, true, n_group, n_group == 1 ? 1 : 2);
      HostTensor ids(DType::i32, {T, 5}), probs(DType::f32, {T, 5}), counts(DType::i32, {E});
      router_topk(logits.view(), o, ids.view(), probs.view(), counts.view());
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < 5; ++j) EXPECT_EQ(ids.get(t * 5 + j), j) << "token " << t;
        for (int64_t j = 0; j < 5; ++j) EXPECT_NEAR(probs.get(t * 5 + j), 0.2, 1e-6);
      }
    }
  }
  // A partial tie: experts 9 and 2 share the best logit, 4 and 7 the next: 2, 9, 4, 7.
  HostTensor one(DType::bf16, {1, E});
  for (int64_t e = 0; e < E; ++e) one.set(e, -1.0);
  one.set(9, 2.0);
  one.set(2, 2.0);
  one.set(7, 1.0);
  one.set(4, 1.0);
  HostTensor ids(DType::i32, {1, 4}), probs(DType::f32, {1, 4}), counts(DType::i32, {E});
  router_topk(one.view(), router_options(4, RouterScore::softmax, false), ids.view(), probs.view(), counts.view());
  EXPECT_EQ(int32_values(ids), (std::vector<int32_t>{2, 9, 4, 7}));
}

TEST(RouterCpuTies, BiasSteersSelectionNotProbabilities) {
  const int64_t E = 8;
  HostTensor logits(DType::f32, {1, E}), bias(DType::f32, {E});
  for (int64_t e = 0; e < E; ++e) logits.set(e, 0.1 * double(e));  // expert 7 best by score
  for (int64_t e = 0; e < E; ++e) bias.set(e, 0.0);
  bias.set(0, 1.0);  // expert 0 best by choice
  HostTensor ids(DType::i32, {1, 1}), probs(DType::f32, {1, 1}), counts(DType::i32, {E});
  router_topk(logits.view(), router_options(1, RouterScore::sigmoid, false), ids.view(), probs.view(), counts.view(),
              bias.view());
  EXPECT_EQ(ids.get(0), 0);
  EXPECT_NEAR(probs.get(0), 0.5, 1e-7) << "the probability is the score sigmoid(0), without the bias";
}

// ---------------------------------------------------------------------------------------------
// Permute and combine.

std::vector<PermuteCase> permute_cases() {
  return {{"plain", 29, 8, 2, 64, popts(1, 0)},
          {"odd_h_f32", 31, 6, 3, 67, popts(1, 0), DType::f32},
          {"pad16", 40, 8, 2, 32, popts(16, 0)},
          {"pad128_f16", 50, 4, 2, 24, popts(128, 0), DType::f16},
          {"capacity_1", 64, 8, 2, 16, popts(1, 1.0)},
          {"capacity_half_pad16", 64, 8, 4, 40, popts(16, 0.5)},
          {"capacity_tiny_all_dropped_tokens", 30, 4, 2, 8, popts(1, 0.1)},
          {"e1", 13, 1, 1, 48, popts(1, 0)},
          {"topk_equals_e", 11, 5, 5, 16, popts(1, 0)},
          {"e256_k8", 40, 256, 8, 16, popts(16, 0)},
          {"zero_tokens", 0, 8, 2, 32, popts(16, 1.0)}};
}

struct Permuted {
  HostTensor x, ids, probs, permuted, counts, row_of, src_token, pprobs, dropped;
  RoutingMap map() const { return {row_of.view(), src_token.view()}; }
};

Permuted run_permute(const PermuteCase& c, Rng& rng) {
  Permuted p;
  p.x = HostTensor(c.dtype, {c.T, c.H});
  fill_random(p.x, rng);
  p.ids = random_routing(c.T, c.E, c.k, rng);
  p.probs = HostTensor(DType::f32, {c.T, c.k});
  fill_random(p.probs, rng, 0.0, 1.0);
  const int64_t rows = permuted_rows(c.T, c.k, c.E, c.o) + 3;  // slack rows past the largest total
  p.permuted = HostTensor(c.dtype, {rows, c.H});
  p.counts = HostTensor(DType::i32, {c.E});
  p.row_of = HostTensor(DType::i32, {c.T, c.k});
  p.src_token = HostTensor(DType::i32, {rows});
  p.pprobs = HostTensor(DType::f32, {rows});
  p.dropped = HostTensor(DType::i64, {1});
  for (HostTensor* t : {&p.permuted, &p.counts, &p.row_of, &p.src_token, &p.pprobs, &p.dropped}) poison(*t);
  permute(p.x.view(), p.ids.view(), c.o, p.permuted.view(), p.counts.view(), p.map(), p.probs.view(), p.pprobs.view(),
          p.dropped.view());
  return p;
}

class PermuteCpu : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(PermuteCpu, ForwardMatchesOracle) {
  const PermuteCase& c = GetParam();
  Rng rng;
  const Permuted p = run_permute(c, rng);
  const int64_t rows = p.permuted.shape()[0];
  const OraclePermutation want = oracle_permutation(int32_values(p.ids), c.T, c.k, c.E, rows, c.o);
  EXPECT_EQ(int64_values(p.counts), want.counts);
  EXPECT_EQ(int32_values(p.row_of), want.row_of);
  EXPECT_EQ(int32_values(p.src_token), want.src_token);
  EXPECT_EQ(p.dropped.get(0), want.dropped);
  const std::vector<double> x = p.x.to_double(), got = p.permuted.to_double(), pp = p.pprobs.to_double();
  for (int64_t r = 0; r < rows; ++r) {
    const int32_t t = want.src_token[r];
    for (int64_t h = 0; h < c.H; ++h) {
      ASSERT_EQ(got[r * c.H + h], t < 0 ? 0.0 : x[t * c.H + h]) << "row " << r << " col " << h;
    }
  }
  for (int64_t i = 0; i < c.T * c.k; ++i) {
    if (want.row_of[i] >= 0) EXPECT_EQ(pp[want.row_of[i]], p.probs.get(i));
  }
  int64_t padded_total = 0;
  for (int64_t v : want.counts) {
    EXPECT_EQ(v % c.o.pad_multiple, 0);
    padded_total += v;
  }
  for (int64_t r = padded_total; r < rows; ++r) EXPECT_EQ(pp[r], 0.0);
  if (c.o.capacity_factor > 0) {
    const int64_t cap = expert_capacity(c.T, c.k, c.E, c.o);
    for (int64_t v : want.counts) EXPECT_LE(v, (cap + c.o.pad_multiple - 1) / c.o.pad_multiple * c.o.pad_multiple);
  }
}

TEST_P(PermuteCpu, BackwardAndCombineMatchOracle) {
  const PermuteCase& c = GetParam();
  Rng rng;
  const Permuted p = run_permute(c, rng);
  const int64_t rows = p.permuted.shape()[0];
  const std::vector<int32_t> row_of = int32_values(p.row_of);

  // permute_backward: dx = Σ_j dpermuted[row(t, j)]; dprobs gathered.
  HostTensor dperm(c.dtype, {rows, c.H}), dpp(DType::f32, {rows}), dx(c.dtype, {c.T, c.H}),
      dprobs(DType::f32, {c.T, c.k});
  fill_random(dperm, rng);
  fill_random(dpp, rng);
  poison(dx);
  poison(dprobs);
  permute_backward(dperm.view(), p.map(), dx.view(), dpp.view(), dprobs.view());
  EXPECT_TRUE(within_rule(dx.to_double(), oracle_gather_sum(dperm.to_double(), c.H, row_of, c.T, c.k, {}), c.dtype,
                          "dx"));
  for (int64_t i = 0; i < c.T * c.k; ++i) EXPECT_EQ(dprobs.get(i), row_of[i] < 0 ? 0.0 : dpp.get(row_of[i]));

  // combine: out = Σ_j p·y[row(t, j)].
  HostTensor y(c.dtype, {rows, c.H}), out(c.dtype, {c.T, c.H});
  fill_random(y, rng);
  poison(out);
  combine(y.view(), p.map(), p.probs.view(), out.view());
  const std::vector<double> probs = p.probs.to_double();
  EXPECT_TRUE(within_rule(out.to_double(), oracle_gather_sum(y.to_double(), c.H, row_of, c.T, c.k, probs), c.dtype,
                          "out"));

  // combine_backward: dy[row(t, j)] = p·dout[t], 0 on every other row; dprobs = dout·y[row].
  HostTensor dout(c.dtype, {c.T, c.H}), dy(c.dtype, {rows, c.H}), dp2(DType::f32, {c.T, c.k});
  fill_random(dout, rng);
  poison(dy);
  poison(dp2);
  combine_backward(dout.view(), p.map(), p.probs.view(), y.view(), dy.view(), dp2.view());
  // dexpert_out is one product per element: its exact value and the f32 product rounded to the dtype.
  std::vector<double> want_dy(rows * c.H, 0.0), own_dy(rows * c.H, 0.0);
  const std::vector<double> g = dout.to_double();
  for (int64_t t = 0; t < c.T; ++t) {
    for (int64_t j = 0; j < c.k; ++j) {
      const int32_t r = row_of[t * c.k + j];
      for (int64_t h = 0; h < c.H && r >= 0; ++h) {
        want_dy[r * c.H + h] = probs[t * c.k + j] * g[t * c.H + h];
        own_dy[r * c.H + h] = static_cast<float>(probs[t * c.k + j]) * static_cast<float>(g[t * c.H + h]);
      }
    }
  }
  EXPECT_TRUE(within_rule(dy.to_double(), rounded(own_dy, c.dtype), want_dy, Precision{c.dtype, 1}, "dexpert_out"));
  EXPECT_TRUE(within_rule(dp2.to_double(), oracle_combine_dprobs(g, y.to_double(), c.H, row_of, c.T, c.k),
                          DType::f32, "combine dprobs"));
}

INSTANTIATE_TEST_SUITE_P(Cases, PermuteCpu, ::testing::ValuesIn(permute_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(PermuteCpuNasty, TokenWithEverySlotDroppedCombinesToZero) {
  // Capacity 1 per expert: token 0 takes expert 0 and 1, token 1 (same experts) is dropped whole.
  const int64_t T = 2, E = 4, k = 2, H = 8;
  Rng rng;
  HostTensor x(DType::f32, {T, H}), ids(DType::i32, {T, k});
  fill_random(x, rng);
  for (int64_t i = 0; i < T * k; ++i) ids.set(i, double(i % 2));
  PermuteOptions o = popts(1, 0.5);  // ceil(0.5·2·2/4) = 1
  ASSERT_EQ(expert_capacity(T, k, E, o), 1);
  const int64_t rows = permuted_rows(T, k, E, o);
  HostTensor perm(DType::f32, {rows, H}), counts(DType::i32, {E}), row_of(DType::i32, {T, k}), src(DType::i32, {rows}),
      dropped(DType::i32, {1});
  permute(x.view(), ids.view(), o, perm.view(), counts.view(), {row_of.view(), src.view()}, {}, {}, dropped.view());
  EXPECT_EQ(int32_values(row_of), (std::vector<int32_t>{0, 1, -1, -1}));
  EXPECT_EQ(dropped.get(0), 2);
  HostTensor out(DType::f32, {T, H});
  poison(out);
  combine(perm.view(), {row_of.view(), src.view()}, {}, out.view());
  for (int64_t h = 0; h < H; ++h) {
    EXPECT_EQ(out.get(H + h), 0.0);
    EXPECT_EQ(out.get(h), 2 * x.get(h)) << "token 0: its two rows, weight 1";
  }
}

TEST(PermuteCpuNasty, RoundTripWithTopOne) {
  Rng rng;
  const int64_t T = 33, E = 7, H = 19;
  HostTensor x(DType::bf16, {T, H});
  fill_random(x, rng);
  const HostTensor ids = random_routing(T, E, 1, rng);
  const PermuteOptions o = popts(16, 0);
  const int64_t rows = permuted_rows(T, 1, E, o);
  HostTensor perm(DType::bf16, {rows, H}), counts(DType::i32, {E}), row_of(DType::i32, {T, 1}), src(DType::i32, {rows}),
      out(DType::bf16, {T, H});
  permute(x.view(), ids.view(), o, perm.view(), counts.view(), {row_of.view(), src.view()});
  combine(perm.view(), {row_of.view(), src.view()}, {}, out.view());
  EXPECT_TRUE(bitwise_equal(out, x, "combine(permute(x)) with k = 1"));
}

// ---------------------------------------------------------------------------------------------
// Bad arguments.

TEST(RoutingCpuErrors, RouterArguments) {
  HostTensor logits(DType::f32, {4, 8}), ids(DType::i32, {4, 2}), probs(DType::f32, {4, 2}), counts(DType::i32, {8});
  Rng rng;
  fill_random(logits, rng);
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(9, RouterScore::softmax, false), ids.view(), probs.view(),
                                counts.view()),
                    "options.top_k", "9");
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::sigmoid, false, 3, 1), ids.view(),
                                probs.view(), counts.view()),
                    "options.n_group", "divide");
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::sigmoid, false, 4, 5), ids.view(),
                                probs.view(), counts.view()),
                    "options.topk_group");
  GMOE_EXPECT_ERROR(
      router_topk(logits.view(), router_options(6, RouterScore::sigmoid, false, 4, 2),
                  HostTensor(DType::i32, {4, 6}).view(), HostTensor(DType::f32, {4, 6}).view(), counts.view()),
      "options.topk_group", "fewer than top_k");
  HostTensor bad_ids(DType::i64, {4, 2});
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::softmax, false), bad_ids.view(),
                                probs.view(), counts.view()),
                    "ids", "i32", "i64");
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::softmax, false), ids.view(),
                                HostTensor(DType::f32, {4, 3}).view(), counts.view()),
                    "probs", "[4, 2]");
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::softmax, false), ids.view(), probs.view(),
                                HostTensor(DType::i32, {7}).view()),
                    "counts", "8");
  GMOE_EXPECT_ERROR(router_topk(HostTensor(DType::i32, {4, 8}).view(), router_options(2, RouterScore::softmax, false),
                                ids.view(), probs.view(), counts.view()),
                    "logits", "dtype");
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::softmax, false), ids.view(), probs.view(),
                                counts.view(), HostTensor(DType::f32, {7}).view()),
                    "score_bias", "[8]");
  HostTensor loss(DType::f32, {2});
  GMOE_EXPECT_ERROR(router_z_loss(logits.view(), 1.0f, loss.view()), "loss", "[1]");
}

TEST(RoutingCpuErrors, PermuteArguments) {
  const int64_t T = 4, E = 3, k = 2, H = 8;
  HostTensor x(DType::bf16, {T, H}), ids(DType::i32, {T, k}), counts(DType::i32, {E}), row_of(DType::i32, {T, k});
  for (int64_t i = 0; i < T * k; ++i) ids.set(i, double(i % E));
  const int64_t rows = permuted_rows(T, k, E, {});
  HostTensor perm(DType::bf16, {rows, H}), src(DType::i32, {rows});
  GMOE_EXPECT_ERROR(permute(x.view(), ids.view(), {}, HostTensor(DType::bf16, {rows - 1, H}).view(), counts.view(),
                            {row_of.view(), HostTensor(DType::i32, {rows - 1}).view()}),
                    "permuted", "permuted_rows");
  GMOE_EXPECT_ERROR(permute(x.view(), ids.view(), {}, HostTensor(DType::f32, {rows, H}).view(), counts.view(),
                            {row_of.view(), src.view()}),
                    "permuted", "bf16", "f32");
  GMOE_EXPECT_ERROR(permute(x.view(), ids.view(), popts(0, 0), perm.view(), counts.view(), {row_of.view(), src.view()}),
                    "options.pad_multiple");
  GMOE_EXPECT_ERROR(
      permute(x.view(), ids.view(), popts(1, -1), perm.view(), counts.view(), {row_of.view(), src.view()}),
      "options.capacity_factor");
  GMOE_EXPECT_ERROR(permute(x.view(), HostTensor(DType::i32, {T + 1, k}).view(), {}, perm.view(), counts.view(),
                            {row_of.view(), src.view()}),
                    "ids");
  ids.set(3, 3.0);  // == E
  GMOE_EXPECT_ERROR(permute(x.view(), ids.view(), {}, perm.view(), counts.view(), {row_of.view(), src.view()}),
                    "ids[1, 1]", "outside [0, 3)");
  ids.set(3, -1.0);
  GMOE_EXPECT_ERROR(permute(x.view(), ids.view(), {}, perm.view(), counts.view(), {row_of.view(), src.view()}),
                    "ids[1, 1]", "-1");
  HostTensor out(DType::bf16, {T, H});
  for (int64_t i = 0; i < T * k; ++i) row_of.set(i, double(rows));
  GMOE_EXPECT_ERROR(combine(perm.view(), {row_of.view(), src.view()}, {}, out.view()), "map.row_of");
  GMOE_EXPECT_ERROR(combine(perm.view(), {row_of.view(), src.view()}, {}, HostTensor(DType::f32, {T, H}).view()), "out",
                    "dtype");
}

}  // namespace
}  // namespace gmoe::test
