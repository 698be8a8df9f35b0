// tests/cuda/test_grouped_linear_cuda.cpp — GroupedLinear on the CUDA backend: every bias mode and
// weight layout against the exact reference (rule: at most 2× the CPU layer's error); delayed dW on
// a second stream bitwise equal to immediate dW; and forward + backward + backward_dw captured once
// in global capture mode (any host sync fails the capture) and replayed under changing counts,
// bitwise equal to eager runs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <tuple>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::test {
namespace {

// Biases on the host and the device, as a grouped [E, N] tensor or a list of [N].
struct Biases {
  HostTensor grouped_h;
  std::vector<HostTensor> list_h;
  DeviceTensor grouped_d;
  std::vector<DeviceTensor> list_d;
  bool as_list;
  Biases(int64_t E, int64_t N, bool list, Rng& rng) : grouped_h(DType::bf16, {E, N}), as_list(list) {
    fill_random(grouped_h, rng);
    grouped_d = DeviceTensor(grouped_h);
    for (int64_t e = 0; e < E; ++e) {
      HostTensor v(DType::bf16, {N});
      for (int64_t n = 0; n < N; ++n) v.set(n, grouped_h.get(e * N + n));
      list_d.emplace_back(v);
      list_h.push_back(std::move(v));
    }
  }
  ExpertBias host() const {
    if (!as_list) return ExpertBias::from_grouped(grouped_h.view());
    std::vector<TensorView> v;
    for (const HostTensor& t : list_h) v.push_back(t.view());
    return ExpertBias::from_list(v);
  }
  ExpertBias device() const {
    if (!as_list) return ExpertBias::from_grouped(grouped_d.view());
    std::vector<TensorView> v;
    for (const DeviceTensor& t : list_d) v.push_back(t.view());
    return ExpertBias::from_list(v);
  }
};

using Param = std::tuple<Layout, bool, std::string>;  // layout, bias as list, case
class CudaGroupedLinear : public ::testing::TestWithParam<Param> {};

TEST_P(CudaGroupedLinear, MatchesReferenceAndDelayedIsBitwiseImmediate) {
  GMOE_SKIP_WITHOUT_GPU();
  const auto [layout, bias_list, case_name] = GetParam();
  Rng rng;
  const ShapeCase c = make_case(case_name, rng, CaseScale::kLarge);
  const GemmProblem p(c, DType::bf16, rng);
  const Biases bias(c.E, c.N, bias_list, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, layout);
  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main(), s2 = streams.side();

  struct Out {
    std::vector<double> y, dx, dw, db;
    int hooks = 0;
  };
  auto run_gpu = [&](bool delayed) {
    Out o;
    GroupedLinearOptions opt;
    opt.delay_wgrad = delayed;
    opt.wgrad_hook = [&o](const GroupedLinearGrads&, Stream) { ++o.hooks; };
    GroupedLinear layer(w.view(), bias.device(), opt);
    GroupedLinearContext ctx;
    Tensor y = layer.forward(x.view(), counts.view(), ctx, s1);
    GroupedLinearBackward b = layer.backward(ctx, dy.view(), s1);
    GroupedLinearGrads g = delayed ? layer.backward_dw(ctx, s2) : b.grads;  // dW on another stream
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    check_device_errors(s1);
    o.y = values(y.view());
    o.dx = values(b.dx.view());
    o.dw = values(g.weight);
    o.db = values(delayed ? b.grads.bias : g.bias);
    return o;
  };
  const Out now = run_gpu(false), later = run_gpu(true);
  EXPECT_EQ(now.hooks, 1);
  EXPECT_EQ(later.hooks, 1);
  EXPECT_EQ(now.y, later.y);
  EXPECT_EQ(now.dx, later.dx);
  EXPECT_EQ(now.dw, later.dw) << "delayed dW (second stream) differs from immediate dW";
  EXPECT_EQ(now.db, later.db);

  // CPU layer: the reference in the kernels' own precision.
  GroupedLinear cpu_layer(p.weights(layout), bias.host());
  GroupedLinearContext cctx;
  Tensor cy = cpu_layer.forward(p.x.view(), p.counts.view(), cctx);
  GroupedLinearBackward cb = cpu_layer.backward(cctx, p.dy.view());
  ExactResult exact_y = exact_fprop(p.x, p.w, c.counts);
  add_bias(exact_y, bias.grouped_h, c.counts, p.dtype, false);
  EXPECT_TRUE(within_rule(now.y, values(cy.view()), exact_y, p.dtype, "y"));
  EXPECT_TRUE(within_rule(now.dx, values(cb.dx.view()), exact_dgrad(p.dy, p.w, c.counts), p.dtype, "dx"));
  EXPECT_TRUE(within_rule(now.dw, values(cb.grads.weight), exact_wgrad(p.dy, p.x, c.counts, nullptr, nullptr),
                          p.dtype, "dW"));
  EXPECT_TRUE(within_rule(now.db, values(cb.grads.bias), exact_bias_grad(p.dy, c.counts), bias.grouped_h.dtype(), "db"));
  for (int64_t e = 0; e < c.E; ++e) {
    if (c.counts[e] != 0) continue;
    for (int64_t n = 0; n < c.N; ++n) ASSERT_EQ(now.db[e * c.N + n], 0.0) << "db of empty expert " << e;
    for (int64_t i = 0; i < c.N * c.K; ++i) ASSERT_EQ(now.dw[e * c.N * c.K + i], 0.0) << "dW of empty expert " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedLinear,
                         ::testing::Combine(::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values(false, true),
                                            ::testing::Values("uniform", "skewed", "one_expert", "all_empty",
                                                              "zero_total", "ragged", "e256")),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return std::string(layout_name(std::get<0>(info.param))) +
                                  (std::get<1>(info.param) ? "_biaslist_" : "_biasgrouped_") + std::get<2>(info.param);
                         });

// forward + backward + delayed backward_dw (on a second stream, forked and joined with events)
// captured once in global capture mode: the capture itself fails on any host sync. Replayed under
// four routings; each replay bitwise equal to an eager run of the same calls.
TEST(CudaGroupedLinearGraph, CaptureForwardBackwardDwOnceReplayUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t E = 16, N = 256, K = 384, cap = 16 * 96 + 7;
  const GemmProblem p(graph_case(E, N, K, 96, 7), DType::bf16, rng);
  const Biases bias(E, N, false, rng);
  const std::vector<std::vector<int64_t>> routings = graph_routings(E, 96, 7, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, Layout::kList);
  HostExpertTensor mg_init(Layout::kStacked, DType::f32, E, N, K);
  HostTensor init(DType::f32, {E, N, K});
  fill_random(init, rng);
  mg_init.set_all(init.to_double());
  DeviceExperts main_grad(mg_init);
  HostTensor y0(DType::bf16, {cap, N}), dx0(DType::bf16, {cap, K});
  poison(y0);
  poison(dx0);
  DeviceTensor y(y0), dx(dx0);
  HostTensor mask_h(DType::i32, {E});
  for (int64_t e = 0; e < E; ++e) mask_h.set(e, e % 5 != 3);
  DeviceTensor mask(mask_h);

  int hooks = 0;
  GroupedLinearOptions opt;
  opt.delay_wgrad = true;
  opt.main_grad = main_grad.view();
  opt.accumulate = true;
  opt.expert_mask = mask.view();
  opt.wgrad_hook = [&](const GroupedLinearGrads&, Stream) { ++hooks; };
  GroupedLinear layer(w.view(), bias.device(), opt);
  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main();
  auto step = [&] {
    GroupedLinearContext ctx;
    layer.forward(x.view(), counts.view(), ctx, s1, y.view());
    layer.backward(ctx, dy.view(), s1, dx.view());
    layer.backward_dw(ctx, streams.side());
    streams.join();
  };
  auto reset = [&] {
    y.upload(y0);
    dx.upload(dx0);
    main_grad.upload(mg_init);
  };
  step();  // eager once: module loading outside capture
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  const CapturedGraph graph(s1, step);
  EXPECT_EQ(hooks, 2) << "the hook fires at capture time too (it is host code)";

  for (const auto& routing : routings) {
    SCOPED_TRACE("routing " + ::testing::PrintToString(routing));
    counts.upload(make_counts(routing));
    reset();
    graph.replay(s1);
    check_device_errors(s1);
    const std::vector<double> gy = values(y.view()), gdx = values(dx.view()), gdw = main_grad.to_double();
    reset();
    step();
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    EXPECT_EQ(gy, values(y.view())) << "forward: replay vs eager";
    EXPECT_EQ(gdx, values(dx.view())) << "dx: replay vs eager";
    EXPECT_EQ(gdw, main_grad.to_double()) << "main_grad: replay vs eager";
    // Masked experts untouched; empty experts untouched (accumulating nothing).
    const std::vector<double> init_v = init.to_double();
    for (int64_t e = 0; e < E; ++e) {
      if (mask_h.get(e) != 0 && routing[e] != 0) continue;
      for (int64_t i = 0; i < N * K; ++i) ASSERT_EQ(gdw[e * N * K + i], init_v[e * N * K + i]) << "expert " << e;
    }
    for (double v : gy) ASSERT_FALSE(std::isnan(v)) << "unwritten output row";
  }
}

}  // namespace
}  // namespace gmoe::test
