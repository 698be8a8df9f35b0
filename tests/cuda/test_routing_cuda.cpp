// tests/cuda/test_routing_cuda.cpp — the CUDA routing ops against the CPU backend (gmoe/routing.h):
// router top-k (softmax / sigmoid, bias, DeepSeek-V3 groups, E up to 256, k = 8) with the same
// experts chosen (exactly where the selection ranks the logits themselves; elsewhere up to
// near-ties that the exp's rounding may order either way), probabilities and gradients within f32
// rounding, the losses; permute bitwise equal to the CPU (counts, maps, rows, padding, drops),
// permute's backward bitwise, combine and its backward. Run-to-run bitwise determinism; the whole
// routing pass captured once in a CUDA graph and replayed under changing logits, bitwise equal to
// eager; ids out of range set the device error word and nothing is written out of bounds; MoELayer
// on the device against the same layer on the CPU backend.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "common/routing_oracle.h"
#include "common/tolerance.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/moe_layer.h"
#include "gmoe/routing.h"

namespace gmoe::test {
namespace {

void sync_and_check() {
  test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_device_errors(nullptr);
}

std::vector<RouterCase> router_cases() {
  using S = RouterScore;
  return {{"qwen3_softmax_top8_e128", 4099, 128, router_options(8, S::softmax, true)},
          {"mixtral_softmax_top2_f32", 1000, 8, router_options(2, S::softmax, true), false, DType::f32},
          {"softmax_no_renorm_f16", 777, 64, router_options(4, S::softmax, false), false, DType::f16},
          {"dsv3_sigmoid_groups_e256_k8", 2048, 256, router_options(8, S::sigmoid, true, 8, 4, 2.5f), true},
          {"sigmoid_groups_no_bias", 513, 64, router_options(6, S::sigmoid, false, 4, 2), false, DType::f32},
          {"e1", 100, 1, router_options(1, S::softmax, false)},
          {"topk_equals_e", 300, 6, router_options(6, S::softmax, true)},
          {"e1024_k32", 64, 1024, router_options(32, S::softmax, true)},
          {"zero_tokens", 0, 16, router_options(2, S::softmax, true)}};
}

class RouterCuda : public ::testing::TestWithParam<RouterCase> {};

TEST_P(RouterCuda, MatchesCpuAndIsDeterministic) {
  GMOE_SKIP_WITHOUT_GPU();
  const RouterCase& c = GetParam();
  const int64_t k = c.o.top_k;
  Rng rng;
  HostTensor logits(c.dtype, {c.T, c.E}), bias(DType::f32, {c.E});
  fill_random(logits, rng, -3.0, 3.0);
  fill_random(bias, rng, -0.2, 0.2);
  const TensorView no_bias{};
  HostTensor ids(DType::i32, {c.T, k}), probs(DType::f32, {c.T, k}), counts(DType::i32, {c.E});
  router_topk(logits.view(), c.o, ids.view(), probs.view(), counts.view(), c.bias ? bias.view() : no_bias);

  DeviceTensor dl(logits), db(bias), dids(DType::i32, {c.T, k}), dprobs(DType::f32, {c.T, k}),
      dcounts(DType::i64, {c.E});
  router_topk(dl.view(), c.o, dids.view(), dprobs.view(), dcounts.view(), c.bias ? db.view() : no_bias);
  sync_and_check();
  const HostTensor gids = dids.download(), gprobs = dprobs.download();
  const std::vector<int32_t> got = int32_values(gids), want = int32_values(ids);
  const OracleRoute oracle =
      oracle_topk(logits.to_double(), c.T, c.E, c.o, c.bias ? bias.to_double() : std::vector<double>{});
  int64_t swapped = 0;
  ASSERT_TRUE(same_selection(got, want, oracle.choice, c.T, c.E, k, 1e-6, &swapped));
  if (!c.bias && c.o.n_group == 1) EXPECT_EQ(swapped, 0) << "ranking the logits leaves no rounding to differ";
  EXPECT_EQ(int64_values(dcounts.download()), histogram(got, c.E));
  std::vector<double> gp = gprobs.to_double(), cp = probs.to_double();
  for (int64_t i = 0; i < c.T * k; ++i) {
    if (got[i] != want[i]) gp[i] = cp[i] = 0;  // a near-tie swapped: its probabilities differ too
  }
  EXPECT_TRUE(all_close(gp, cp, 1e-7, 1e-5, "probs"));

  // Run to run: the same bits.
  router_topk(dl.view(), c.o, dids.view(), dprobs.view(), dcounts.view(), c.bias ? db.view() : no_bias);
  sync_and_check();
  EXPECT_TRUE(bitwise_equal(dids.download(), gids, "ids, second run"));
  EXPECT_TRUE(bitwise_equal(dprobs.download(), gprobs, "probs, second run"));

  // Backward with the GPU's selection on both backends; then the losses and their gradients.
  HostTensor dp(DType::f32, {c.T, k}), dlog(DType::f32, {c.T, c.E});
  fill_random(dp, rng);
  router_topk_backward(logits.view(), gids.view(), dp.view(), c.o, dlog.view());
  DeviceTensor ddp(dp), ddlog(DType::f32, {c.T, c.E});
  router_topk_backward(dl.view(), dids.view(), ddp.view(), c.o, ddlog.view());
  sync_and_check();
  EXPECT_TRUE(all_close(ddlog.download().to_double(), dlog.to_double(), 1e-7, 1e-4, "dlogits"));

  const HostTensor cpu_counts = dcounts.download();
  HostTensor loss(DType::f32, {1}), dloss(DType::f32, {1});
  dloss.set(0, 0.75);
  DeviceTensor dcpu_counts(cpu_counts), dloss_d(dloss), loss_d(DType::f32, {1});
  for (int which = 0; which < 2; ++which) {
    const char* name = which == 0 ? "aux" : "z";
    if (which == 0) {
      router_aux_loss(logits.view(), cpu_counts.view(), c.o, 0.01f, loss.view());
      router_aux_loss(dl.view(), dcpu_counts.view(), c.o, 0.01f, loss_d.view());
      router_aux_loss_backward(logits.view(), cpu_counts.view(), c.o, 0.01f, dloss.view(), dlog.view());
      router_aux_loss_backward(dl.view(), dcpu_counts.view(), c.o, 0.01f, dloss_d.view(), ddlog.view());
    } else {
      router_z_loss(logits.view(), 0.001f, loss.view());
      router_z_loss(dl.view(), 0.001f, loss_d.view());
      router_z_loss_backward(logits.view(), 0.001f, dloss.view(), dlog.view());
      router_z_loss_backward(dl.view(), 0.001f, dloss_d.view(), ddlog.view());
    }
    sync_and_check();
    EXPECT_TRUE(all_close(loss_d.download().to_double(), loss.to_double(), 1e-9, 1e-4, std::string(name) + " loss"));
    if (c.T > 0) {
      EXPECT_TRUE(
          all_close(ddlog.download().to_double(), dlog.to_double(), 1e-9, 1e-4, std::string(name) + " dlogits"));
    }
    const HostTensor first = loss_d.download();
    if (which == 0) {
      router_aux_loss(dl.view(), dcpu_counts.view(), c.o, 0.01f, loss_d.view());
    } else {
      router_z_loss(dl.view(), 0.001f, loss_d.view());
    }
    sync_and_check();
    EXPECT_TRUE(bitwise_equal(loss_d.download(), first, std::string(name) + " loss, second run"));
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, RouterCuda, ::testing::ValuesIn(router_cases()),
                         [](const auto& info) { return info.param.name; });

TEST(RouterCudaTies, LowerExpertIdWins) {
  GMOE_SKIP_WITHOUT_GPU();
  const int64_t T = 70, E = 64, k = 8;
  HostTensor logits(DType::bf16, {T, E});
  for (int64_t i = 0; i < T * E; ++i) logits.set(i, (i % 3 == 0) ? 0.5 : 0.25);  // many exact ties
  for (RouterScore s : {RouterScore::softmax, RouterScore::sigmoid}) {
    for (int64_t n_group : {1, 8}) {
      const RouterOptions o = router_options(k, s, true, n_group, n_group == 1 ? 1 : 4);
      HostTensor ids(DType::i32, {T, k}), probs(DType::f32, {T, k}), counts(DType::i32, {E});
      router_topk(logits.view(), o, ids.view(), probs.view(), counts.view());
      DeviceTensor dl(logits), dids(DType::i32, {T, k}), dprobs(DType::f32, {T, k}), dcounts(DType::i32, {E});
      router_topk(dl.view(), o, dids.view(), dprobs.view(), dcounts.view());
      sync_and_check();
      EXPECT_TRUE(bitwise_equal(dids.download(), ids, "tied ids"));
      EXPECT_TRUE(bitwise_equal(dcounts.download(), counts, "tied counts"));
    }
  }
}

// ---------------------------------------------------------------------------------------------

std::vector<PermuteCase> permute_cases() {
  return {{"qwen3_t4096_e128_k8_h2048", 4096, 128, 8, 2048, popts(1, 0)},
          {"pad128_capacity", 3000, 32, 4, 256, popts(128, 1.0)},
          {"pad16_capacity_half", 1000, 16, 2, 136, popts(16, 0.5)},
          {"odd_h_f32_scalar_path", 517, 8, 2, 67, popts(1, 0), DType::f32},
          {"f16_e256_k8", 700, 256, 8, 96, popts(16, 0), DType::f16},
          {"e1", 300, 1, 1, 64, popts(1, 0)},
          {"topk_equals_e", 257, 5, 5, 32, popts(1, 0)},
          {"all_but_few_dropped", 512, 4, 2, 16, popts(1, 0.05)},
          {"zero_tokens", 0, 8, 2, 64, popts(16, 1.0)},
          // bf16 rows of 200 bytes: the one-element path of the row kernels, with padding and drops.
          {"odd_h_bf16_scalar_path_pad16_capacity", 333, 16, 4, 101, popts(16, 1.0)},
          // 129 and 896 packs a row: steps of the row kernels that end inside a warp's packs.
          {"ragged_packs_h1032_pad16_capacity", 1000, 64, 6, 1032, popts(16, 0.8)},
          {"dsv3_e256_k8_h7168", 300, 256, 8, 7168, popts(1, 0)},
          // more than 32 slots a token: the row kernels take the slots 32 at a time.
          {"k40_e64", 200, 64, 40, 24, popts(1, 0)},
          // slot counts that leave a batch of the combine kernels (2, 4 or 8 slots) part empty: 3
          // slots in a batch of 4, 12 in one of 8 and a half-empty one, 33: one slot past 32.
          {"k3_e7_f16", 401, 7, 3, 72, popts(1, 0), DType::f16},
          {"k12_e20_pad16_capacity", 777, 20, 12, 200, popts(16, 1.0)},
          {"k33_e48_f32", 150, 48, 33, 36, popts(1, 0), DType::f32},
          // permute ranks a pair among its sub-tile's (about 256 pairs, 256 / k tokens): one token
          // a sub-tile (k = E = 256), one token in all, and E at the CUDA bound.
          {"k256_e256_one_token_sub_tiles", 40, 256, 256, 16, popts(1, 0)},
          {"one_token_pad16_capacity", 1, 16, 8, 64, popts(16, 1.0)},
          {"e1024_k8_pad16", 900, 1024, 8, 64, popts(16, 0)},
          // The scan of the tile counts gives each thread a run of one expert's tiles, loaded a
          // batch of 8 at a time: runs of several batches and a part one (167 tiles in runs of 17
          // over 96 experts, threads past the runs; 18 tiles in one run an expert at E = 1024).
          {"e96_k2_many_tiles_pad16_capacity", 170000, 96, 2, 16, popts(16, 1.0)},
          {"e1024_k8_many_tiles_capacity", 4500, 1024, 8, 16, popts(1, 1.0)}};
}

class PermuteCuda : public ::testing::TestWithParam<PermuteCase> {};

TEST_P(PermuteCuda, MatchesCpu) {
  GMOE_SKIP_WITHOUT_GPU();
  const PermuteCase& c = GetParam();
  Rng rng;
  const PermuteOptions& o = c.o;
  const int64_t rows = permuted_rows(c.T, c.k, c.E, o) + 5;
  HostTensor x(c.dtype, {c.T, c.H}), probs(DType::f32, {c.T, c.k});
  fill_random(x, rng);
  fill_random(probs, rng, 0.0, 1.0);
  const HostTensor ids = random_routing(c.T, c.E, c.k, rng);
  HostTensor perm(c.dtype, {rows, c.H}), counts(DType::i32, {c.E}), row_of(DType::i32, {c.T, c.k}),
      src(DType::i32, {rows}), pprobs(DType::f32, {rows}), dropped(DType::i32, {1});
  permute(x.view(), ids.view(), o, perm.view(), counts.view(), {row_of.view(), src.view()}, probs.view(), pprobs.view(),
          dropped.view());

  // The CPU's map, kept before its buffers are poisoned to become the device's initial outputs.
  const std::vector<int32_t> want_row_of = int32_values(row_of), want_src = int32_values(src);
  poison(perm);
  poison(pprobs);
  poison(row_of);
  poison(src);  // the device outputs start poisoned
  DeviceTensor dx(x), dids(ids), dprobs(probs), dperm(perm), dcounts(DType::i64, {c.E}), drow(row_of), dsrc(src),
      dpp(pprobs), ddrop(DType::i64, {1});
  const RoutingMap map{drow.view(), dsrc.view()};
  permute(dx.view(), dids.view(), o, dperm.view(), dcounts.view(), map, dprobs.view(), dpp.view(), ddrop.view());
  sync_and_check();
  EXPECT_EQ(int64_values(dcounts.download()), int64_values(counts));
  EXPECT_EQ(int32_values(drow.download()), want_row_of);
  EXPECT_EQ(int32_values(dsrc.download()), want_src);
  EXPECT_EQ(ddrop.download().get(0), dropped.get(0));
  HostTensor want_perm(c.dtype, {rows, c.H}), want_pp(DType::f32, {rows});
  permute(x.view(), ids.view(), o, want_perm.view(), counts.view(), {row_of.view(), src.view()}, probs.view(),
          want_pp.view(), dropped.view());
  EXPECT_TRUE(bitwise_equal(dperm.download(), want_perm, "permuted rows"));
  EXPECT_TRUE(bitwise_equal(dpp.download(), want_pp, "permuted probs"));

  // permute's backward: a sum of ones times the rows in slot order, bitwise the CPU's.
  HostTensor g(c.dtype, {rows, c.H}), gpp(DType::f32, {rows}), want_dx(c.dtype, {c.T, c.H}),
      want_dprobs(DType::f32, {c.T, c.k});
  fill_random(g, rng);
  fill_random(gpp, rng);
  permute_backward(g.view(), {row_of.view(), src.view()}, want_dx.view(), gpp.view(), want_dprobs.view());
  DeviceTensor dg(g), dgpp(gpp), ddx(c.dtype, {c.T, c.H}), ddprobs(DType::f32, {c.T, c.k});
  permute_backward(dg.view(), map, ddx.view(), dgpp.view(), ddprobs.view());
  sync_and_check();
  EXPECT_TRUE(bitwise_equal(ddx.download(), want_dx, "dx"));
  EXPECT_TRUE(bitwise_equal(ddprobs.download(), want_dprobs, "dprobs gathered"));

  // combine and its backward.
  HostTensor y(c.dtype, {rows, c.H}), out(c.dtype, {c.T, c.H}), dout(c.dtype, {c.T, c.H}), dy(c.dtype, {rows, c.H}),
      dpc(DType::f32, {c.T, c.k});
  fill_random(y, rng);
  fill_random(dout, rng);
  combine(y.view(), {row_of.view(), src.view()}, probs.view(), out.view());
  combine_backward(dout.view(), {row_of.view(), src.view()}, probs.view(), y.view(), dy.view(), dpc.view());
  DeviceTensor dyd(y), doutd(c.dtype, {c.T, c.H}), dgo(dout), ddy(c.dtype, {rows, c.H}), ddpc(DType::f32, {c.T, c.k});
  combine(dyd.view(), map, dprobs.view(), doutd.view());
  combine_backward(dgo.view(), map, dprobs.view(), dyd.view(), ddy.view(), ddpc.view());
  sync_and_check();
  // The CPU backend's outputs are the own-precision references; fp64 sums the exact ones.
  const std::vector<int32_t> rows_of = int32_values(row_of);
  EXPECT_TRUE(within_rule(doutd.download().to_double(), out.to_double(),
                          oracle_gather_sum(y.to_double(), c.H, rows_of, c.T, c.k, probs.to_double()), c.dtype,
                          "combine out"));
  EXPECT_TRUE(bitwise_equal(ddy.download(), dy, "dexpert_out"));
  EXPECT_TRUE(within_rule(ddpc.download().to_double(), dpc.to_double(),
                          oracle_combine_dprobs(dout.to_double(), y.to_double(), c.H, rows_of, c.T, c.k), DType::f32,
                          "combine dprobs"));
  // Run to run.
  const HostTensor first = doutd.download(), first_dy = ddy.download(), first_dpc = ddpc.download();
  combine(dyd.view(), map, dprobs.view(), doutd.view());
  poison(dy);
  DeviceTensor ddy2(dy);  // starts poisoned: every row, padding and past the total too, is written
  combine_backward(dgo.view(), map, dprobs.view(), dyd.view(), ddy2.view(), ddpc.view());
  sync_and_check();
  EXPECT_TRUE(bitwise_equal(doutd.download(), first, "combine, second run"));
  EXPECT_TRUE(bitwise_equal(ddy2.download(), first_dy, "dexpert_out, second run"));
  EXPECT_TRUE(bitwise_equal(ddpc.download(), first_dpc, "combine dprobs, second run"));
  // Without dprobs, expert_out is not needed and dexpert_out is the same.
  DeviceTensor ddy3(dy);
  combine_backward(dgo.view(), map, dprobs.view(), {}, ddy3.view(), {});
  sync_and_check();
  EXPECT_TRUE(bitwise_equal(ddy3.download(), first_dy, "dexpert_out without dprobs"));
}

INSTANTIATE_TEST_SUITE_P(Cases, PermuteCuda, ::testing::ValuesIn(permute_cases()),
                         [](const auto& info) { return info.param.name; });

// An expert named twice in one token's slots (k > E): each (token, slot) still gets its own row,
// in (token, slot) order, the same map and rows as the CPU.
TEST(PermuteCudaRepeats, ExpertRepeatedInATokensSlots) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t T = 1100, E = 5, k = 12, H = 48;
  PermuteOptions o = popts(16, 1.0);
  const int64_t rows = permuted_rows(T, k, E, o);
  HostTensor x(DType::bf16, {T, H}), ids(DType::i32, {T, k}), probs(DType::f32, {T, k});
  fill_random(x, rng);
  fill_random(probs, rng, 0.0, 1.0);
  for (int64_t i = 0; i < T * k; ++i) ids.set(i, double(rng.integer(0, E - 1)));
  HostTensor perm(DType::bf16, {rows, H}), counts(DType::i32, {E}), row_of(DType::i32, {T, k}),
      src(DType::i32, {rows}), pprobs(DType::f32, {rows}), dropped(DType::i32, {1});
  permute(x.view(), ids.view(), o, perm.view(), counts.view(), {row_of.view(), src.view()}, probs.view(), pprobs.view(),
          dropped.view());
  DeviceTensor dx(x), dids(ids), dprobs(probs), dperm(DType::bf16, {rows, H}), dcounts(DType::i32, {E}),
      drow(DType::i32, {T, k}), dsrc(DType::i32, {rows}), dpp(DType::f32, {rows}), ddrop(DType::i32, {1});
  permute(dx.view(), dids.view(), o, dperm.view(), dcounts.view(), {drow.view(), dsrc.view()}, dprobs.view(),
          dpp.view(), ddrop.view());
  sync_and_check();
  EXPECT_EQ(int32_values(dcounts.download()), int32_values(counts));
  EXPECT_EQ(int32_values(drow.download()), int32_values(row_of));
  EXPECT_EQ(int32_values(dsrc.download()), int32_values(src));
  EXPECT_EQ(ddrop.download().get(0), dropped.get(0));
  EXPECT_TRUE(bitwise_equal(dperm.download(), perm, "permuted rows"));
  EXPECT_TRUE(bitwise_equal(dpp.download(), pprobs, "permuted probs"));
}

// ---------------------------------------------------------------------------------------------

TEST(RoutingCudaGraph, ReplayUnderChangingLogitsEqualsEager) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t T = 1500, E = 64, k = 6, H = 264;
  RouterOptions o = router_options(k, RouterScore::sigmoid, true, 8, 3, 1.5f);
  PermuteOptions po;
  po.pad_multiple = 16;
  po.capacity_factor = 1.25;
  const int64_t rows = permuted_rows(T, k, E, po);
  HostTensor x(DType::bf16, {T, H}), bias(DType::f32, {E});
  fill_random(x, rng);
  fill_random(bias, rng, -0.1, 0.1);
  DeviceTensor dl(DType::bf16, {T, E}), dx(x), db(bias), ids(DType::i32, {T, k}), probs(DType::f32, {T, k}),
      counts(DType::i32, {E}), perm(DType::bf16, {rows, H}), pcounts(DType::i32, {E}), row_of(DType::i32, {T, k}),
      src(DType::i32, {rows}), pprobs(DType::f32, {rows}), dropped(DType::i32, {1}), out(DType::bf16, {T, H}),
      aux(DType::f32, {1}), dlogits(DType::f32, {T, E}), dperm(DType::bf16, {rows, H}), dpc(DType::f32, {T, k});
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const RoutingMap map{row_of.view(), src.view()};
  auto pass = [&] {
    router_topk(dl.view(), o, ids.view(), probs.view(), counts.view(), db.view(), stream);
    router_aux_loss(dl.view(), counts.view(), o, 0.01f, aux.view(), stream);
    permute(dx.view(), ids.view(), po, perm.view(), pcounts.view(), map, probs.view(), pprobs.view(), dropped.view(),
            stream);
    combine(perm.view(), map, probs.view(), out.view(), stream);
    combine_backward(out.view(), map, probs.view(), perm.view(), dperm.view(), dpc.view(), stream);
    router_topk_backward(dl.view(), ids.view(), dpc.view(), o, dlogits.view(), false, stream);
    router_aux_loss_backward(dl.view(), counts.view(), o, 0.01f, TensorView{}, dlogits.view(), true, stream);
    router_z_loss_backward(dl.view(), 0.001f, TensorView{}, dlogits.view(), true, stream);
  };
  auto snapshot = [&] {
    return std::vector<HostTensor>{ids.download(),     probs.download(),  counts.download(),  perm.download(),
                                   pcounts.download(), row_of.download(), src.download(),     dropped.download(),
                                   out.download(),     aux.download(),    dlogits.download(), dperm.download()};
  };
  HostTensor logits(DType::bf16, {T, E});
  fill_random(logits, rng, -3.0, 3.0);
  dl.upload(logits);
  pass();  // eager once first: what the ops set up on first use happens outside the capture
  GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
  CapturedGraph graph(stream, pass);
  for (int replay = 0; replay < 3; ++replay) {
    fill_random(logits, rng, -3.0, 3.0);
    if (replay == 2) {
      for (int64_t i = 0; i < T * E; ++i) logits.set(i, (i % E == 5) ? 4.0 : logits.get(i));  // one hot expert
    }
    dl.upload(logits);
    graph.replay(stream);
    const std::vector<HostTensor> replayed = snapshot();
    pass();
    GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
    const std::vector<HostTensor> eager = snapshot();
    for (size_t i = 0; i < eager.size(); ++i) {
      EXPECT_TRUE(
          bitwise_equal(replayed[i], eager[i], "output " + std::to_string(i) + ", replay " + std::to_string(replay)));
    }
  }
  check_device_errors(stream);
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(RoutingCudaErrors, IdsOutOfRangeSetTheErrorWordAndWriteNothingOutOfBounds) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t T = 300, E = 8, k = 2, H = 64, guard = 64;
  HostTensor ids = random_routing(T, E, k, rng);
  ids.set(7, double(E));
  ids.set(100, -3.0);
  ids.set(2 * T - 1, 1e6);
  const int64_t rows = permuted_rows(T, k, E, {});
  HostTensor x(DType::bf16, {T, H});
  fill_random(x, rng);
  // The permuted buffer and src_token are views into larger poisoned allocations: the guard rows
  // past each view must stay as they were.
  HostTensor perm_all(DType::bf16, {rows + guard, H}), src_all(DType::i32, {rows + guard});
  poison(perm_all);
  poison(src_all);
  DeviceTensor dx(x), dids(ids), dperm_all(perm_all), dsrc_all(src_all), counts(DType::i32, {E}),
      row_of(DType::i32, {T, k});
  const TensorView perm = TensorView(dperm_all.data(), DType::bf16, Device::cuda(0), {rows, H});
  const TensorView src = TensorView(dsrc_all.data(), DType::i32, Device::cuda(0), {rows});
  permute(dx.view(), dids.view(), {}, perm, counts.view(), {row_of.view(), src});
  test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  GMOE_EXPECT_ERROR(check_device_errors(nullptr), "routing-map row was out of range");
  check_device_errors(nullptr);  // read and cleared
  const std::vector<int32_t> r = int32_values(row_of.download());
  EXPECT_EQ(r[7], -1);
  EXPECT_EQ(r[100], -1);
  EXPECT_EQ(r[2 * T - 1], -1);
  int64_t total = 0;
  for (int64_t v : int64_values(counts.download())) total += v;
  EXPECT_EQ(total, T * k - 3) << "the bad slots are not counted";
  const HostTensor perm_back = dperm_all.download(), src_back = dsrc_all.download();
  EXPECT_EQ(0, std::memcmp(static_cast<const char*>(perm_back.data()) + rows * H * 2,
                           static_cast<const char*>(perm_all.data()) + rows * H * 2, guard * H * 2));
  EXPECT_EQ(0, std::memcmp(static_cast<const int32_t*>(src_back.data()) + rows,
                           static_cast<const int32_t*>(src_all.data()) + rows, guard * 4));

  // A corrupt map: rows outside the buffer are skipped by combine and recorded.
  HostTensor bad_map(DType::i32, {T, k});
  for (int64_t i = 0; i < T * k; ++i) bad_map.set(i, double(i % 3 == 0 ? rows + 5 : i % rows));
  DeviceTensor dbad(bad_map), out(DType::bf16, {T, H});
  combine(perm, {dbad.view(), src}, {}, out.view());
  test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  GMOE_EXPECT_ERROR(check_device_errors(nullptr), "routing-map row was out of range");
}

TEST(RoutingCudaErrors, HostVisibleArguments) {
  GMOE_SKIP_WITHOUT_GPU();
  DeviceTensor logits(DType::bf16, {16, 2048}), ids(DType::i32, {16, 2}), probs(DType::f32, {16, 2}),
      counts(DType::i32, {2048});
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::softmax, true), ids.view(), probs.view(),
                                counts.view()),
                    "logits", "1024");
  HostTensor host_ids(DType::i32, {16, 2});
  GMOE_EXPECT_ERROR(router_topk(logits.view(), router_options(2, RouterScore::softmax, true), host_ids.view(),
                                probs.view(), counts.view()),
                    "ids", "cuda:0", "cpu");
}

// ---------------------------------------------------------------------------------------------
// MoELayer on the device against the same layer on the CPU backend (bf16 experts on both).

std::vector<double> host_values(const Tensor& t) { return host_of(t.view()).to_double(); }

// The inputs of a MoELayer test: bf16 weights (SwiGLU experts), x and dout; f32 logits.
struct MoeInputs {
  HostTensor w1, w2, x, logits, dout;
  MoeInputs(Rng& rng, int64_t T, int64_t E, int64_t H, int64_t F)
      : w1(DType::bf16, {E, 2 * F, H}), w2(DType::bf16, {E, H, F}), x(DType::bf16, {T, H}),
        logits(DType::f32, {T, E}), dout(DType::bf16, {T, H}) {
    fill_random(w1, rng, -0.1, 0.1);
    fill_random(w2, rng, -0.1, 0.1);
    fill_random(x, rng);
    fill_random(logits, rng, -2.0, 2.0);
    fill_random(dout, rng);
  }
};

TEST(MoELayerCuda, MatchesCpuLayer) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t T = 777, E = 16, k = 4, H = 256, F = 128;
  MoeInputs in(rng, T, E, H, F);
  HostTensor &w1 = in.w1, &w2 = in.w2, &x = in.x, &logits = in.logits, &dout = in.dout;
  MoELayerOptions o;
  o.router = router_options(k, RouterScore::softmax, true);
  o.permute.pad_multiple = 16;
  o.permute.capacity_factor = 1.25;
  o.aux_loss_coeff = 0.01f;
  o.z_loss_coeff = 0.001f;

  GroupedMLP cpu_experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()));
  MoELayer cpu_layer(cpu_experts, o);
  MoELayerContext cpu_ctx;
  const MoEForward cf = cpu_layer.forward(x.view(), logits.view(), cpu_ctx);
  const MoEBackward cb = cpu_layer.backward(cpu_ctx, dout.view());

  DeviceTensor dw1(w1), dw2(w2), dx(x), dl(logits), ddout(dout);
  GroupedMLP gpu_experts(ExpertWeights::from_stacked(dw1.view()), ExpertWeights::from_stacked(dw2.view()));
  MoELayer gpu_layer(gpu_experts, o);
  MoELayerContext gpu_ctx;
  const MoEForward gf = gpu_layer.forward(dx.view(), dl.view(), gpu_ctx);
  const MoEBackward gb = gpu_layer.backward(gpu_ctx, ddout.view());
  sync_and_check();

  EXPECT_EQ(host_values(gf.ids), host_values(cf.ids)) << "softmax without bias ranks the logits: the same experts";
  // bf16 GEMMs summing in another order than the CPU's: compared by relative Frobenius error.
  for (const auto& [got, want, what] : {std::make_tuple(&gf.out, &cf.out, "out"), std::make_tuple(&gb.dx, &cb.dx, "dx"),
                                        std::make_tuple(&gb.dlogits, &cb.dlogits, "dlogits")}) {
    const Comparison cmp = compare(host_values(*got), host_values(*want));
    EXPECT_LT(cmp.rel_frobenius, 1e-2) << what;
    EXPECT_EQ(cmp.nan_count, 0) << what;
  }
  EXPECT_TRUE(all_close(host_values(gf.aux_loss), host_values(cf.aux_loss), 1e-9, 1e-4, "aux loss"));
  EXPECT_TRUE(all_close(host_values(gf.z_loss), host_values(cf.z_loss), 1e-9, 1e-4, "z loss"));
}

// regather_expert_input on the device: the layer that gathers its permuted rows again in backward
// gives bitwise the results of the layer that keeps them (the gather is a copy), eager and from a
// CUDA graph of the whole forward + backward replayed under changing logits (global capture mode:
// the regather syncs nothing).
TEST(MoELayerCuda, RegatherIsBitwiseEagerAndCaptured) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t T = 777, E = 16, k = 4, H = 256, F = 128;
  MoeInputs in(rng, T, E, H, F);
  HostTensor &w1 = in.w1, &w2 = in.w2, &x = in.x, &logits = in.logits, &dout = in.dout;
  DeviceTensor dw1(w1), dw2(w2), dx(x), dl(logits), ddout(dout);
  GroupedMLPOptions mo;
  mo.fc1.save_original_input = true;  // FC1 reads its input by reference: what the layer may regather
  mo.recompute_activation = true;
  GroupedMLP experts(ExpertWeights::from_stacked(dw1.view()), ExpertWeights::from_stacked(dw2.view()), {}, {}, mo);
  MoELayerOptions o;
  o.router = router_options(k, RouterScore::softmax, true);
  o.permute.pad_multiple = 16;
  o.permute.capacity_factor = 1.25;
  o.aux_loss_coeff = 0.01f;
  MoELayer regather(experts, o);
  o.regather_expert_input = false;
  MoELayer keep(experts, o);
  ASSERT_TRUE(regather.regathers_expert_input());
  ASSERT_FALSE(keep.regathers_expert_input());

  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceTensor out(DType::bf16, {T, H}), grad_x(DType::bf16, {T, H}), grad_logits(DType::f32, {T, E}),
      grad_w1(DType::bf16, {E, 2 * F, H}), grad_w2(DType::bf16, {E, H, F});
  // One forward + backward, its results copied into fixed buffers (the layer's own are freed at the
  // end of the pass: in a capture, by the graph).
  auto pass = [&](MoELayer& layer) {
    MoELayerContext ctx;
    const MoEForward f = layer.forward(dx.view(), dl.view(), ctx, stream);
    const MoEBackward b = layer.backward(ctx, ddout.view(), stream);
    for (const auto& [from, to] : {std::make_pair(f.out.view(), out.view()), std::make_pair(b.dx.view(), grad_x.view()),
                                   std::make_pair(b.dlogits.view(), grad_logits.view()),
                                   std::make_pair(b.grads.fc1.weight.stacked, grad_w1.view()),
                                   std::make_pair(b.grads.fc2.weight.stacked, grad_w2.view())}) {
      // A stacked gradient's expert stride may be padded: expert by expert, as rows of a 2-D copy.
      const size_t es = dtype_size(from.dtype), per = size_t(from.numel() / std::max<int64_t>(from.size(0), 1)) * es;
      test_cuda_check(cudaMemcpy2DAsync(to.data, per, from.data, size_t(from.stride(0)) * es, per,
                                        size_t(from.size(0)), cudaMemcpyDeviceToDevice, stream),
                      "cudaMemcpy2DAsync");
    }
  };
  auto snapshot = [&] {
    test_cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return std::vector<HostTensor>{out.download(), grad_x.download(), grad_logits.download(), grad_w1.download(),
                                   grad_w2.download()};
  };
  auto expect_bitwise = [](const std::vector<HostTensor>& got, const std::vector<HostTensor>& want,
                           const std::string& what) {
    const char* names[] = {"out", "dx", "dlogits", "dW1", "dW2"};
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(bitwise_equal(got[i], want[i], what + ": " + names[i]));
  };
  pass(keep);
  const std::vector<HostTensor> kept = snapshot();
  pass(regather);
  expect_bitwise(snapshot(), kept, "eager");
  CapturedGraph graph(stream, [&] { pass(regather); });
  for (int replay = 0; replay < 2; ++replay) {
    fill_random(logits, rng, -2.0, 2.0);
    dl.upload(logits);
    graph.replay(stream);
    const std::vector<HostTensor> replayed = snapshot();
    pass(keep);
    expect_bitwise(replayed, snapshot(), "replay " + std::to_string(replay));
  }
  check_device_errors(stream);
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gmoe::test
