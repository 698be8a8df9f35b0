// tests/cuda/test_layer_launches_cuda.cpp — what one call of a layer launches does not grow with the
// number of experts. GroupedLinear and GroupedMLP forward, and forward + backward, are captured in a
// CUDA graph (bench::capture_node_counts: the count gmoe-bench reports per layer call; global capture
// mode, so a host sync fails the capture) for E = 8 and E = 256, with stacked and list weights and
// biases, in bf16 and with the FP8 blockwise recipe (the weights quantized inside the captured
// forward). Every node count (kernels, memsets, memcpys, stream-ordered allocations and frees) must
// be the same for both E: per-expert work belongs inside the kernels, never in a loop of launches.
// The counts are fresh Zipf counts with empty experts: nothing reads them on the host. The gradient
// paths (main_grad with a mask and fresh gradients for mask-0 experts, backward_dw, counts given on
// the host) are counted too.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <tuple>
#include <vector>

#include "bench/graph_capture.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/grouped_linear.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe::test {
namespace {

constexpr int64_t kRows = 2048;    // capacity of every layer's grouped rows
constexpr int64_t kHidden = 256;   // GroupedLinear: K and N; GroupedMLP: H
constexpr int64_t kFfn = 128;      // GroupedMLP: F (FC1 makes 2F for SwiGLU)

/// What one forward, and one forward + backward, launch.
struct Launches {
  bench::GraphNodeCounts forward, forward_backward;
};

/// Fresh random bf16 tensors on the device.
DeviceTensor random_rows(int64_t rows, int64_t cols, Rng& rng) {
  HostTensor h(DType::bf16, {rows, cols});
  fill_random(h, rng);
  return DeviceTensor(h);
}
DeviceExperts random_weights(int64_t E, int64_t N, int64_t K, Layout layout, Rng& rng) {
  HostTensor values(DType::bf16, {E, N, K});
  fill_random(values, rng, -0.1, 0.1);
  HostExpertTensor h(layout, DType::bf16, E, N, K);
  h.set_all(values.to_double());
  return DeviceExperts(h);
}
/// Zipf counts over E experts (some empty), leaving rows past the total.
DeviceTensor random_counts(int64_t E, Rng& rng) {
  return DeviceTensor(make_counts(zipf_counts(E, kRows - 16, 1.1, 4, rng)));
}

/// The grouped rows one layer call runs on: x and dy ([kRows, kHidden] bf16), counts of E experts.
struct Rows {
  DeviceTensor x, dy, counts;
  Rows(int64_t E, Rng& rng)
      : x(random_rows(kRows, kHidden, rng)), dy(random_rows(kRows, kHidden, rng)), counts(random_counts(E, rng)) {}
};

std::string trace(const char* what, int64_t E, const bench::GraphNodeCounts& n) {
  return std::string(what) + " with E = " + std::to_string(E) + ": " + n.str();
}

/// `launches(E)` (which builds a layer of E experts and captures its calls) for E = 8 and E = 256,
/// and the counts compared.
template <class Capture>
void expect_same_for_both_e(Capture&& launches) {
  const Launches few = launches(int64_t{8});
  const Launches many = launches(int64_t{256});
  EXPECT_GT(few.forward.kernels, 0) << "nothing was captured";
  EXPECT_GT(few.forward_backward.kernels, few.forward.kernels) << "backward captured no kernel";
  EXPECT_TRUE(few.forward == many.forward) << "forward launches grow with E: " << trace("forward", 8, few.forward)
                                           << "; " << trace("forward", 256, many.forward);
  EXPECT_TRUE(few.forward_backward == many.forward_backward)
      << "forward + backward launches grow with E: " << trace("forward + backward", 8, few.forward_backward) << "; "
      << trace("forward + backward", 256, many.forward_backward);
  ::testing::Test::RecordProperty("forward", few.forward.str());
  ::testing::Test::RecordProperty("forward_backward", few.forward_backward.str());
}

/// Captures `call(backward)` on `stream` once without and once with the backward, after one eager
/// run of the whole (module loading happens outside the captures).
template <class Call>
Launches capture_calls(cudaStream_t stream, Call&& call) {
  call(true);
  EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  check_device_errors(stream);
  Launches l;
  l.forward = bench::capture_node_counts([&] { call(false); }, stream);
  l.forward_backward = bench::capture_node_counts([&] { call(true); }, stream);
  return l;
}

using LinearParam = std::tuple<Layout, LinearRecipe>;
class CudaLayerLaunchesLinear : public ::testing::TestWithParam<LinearParam> {};

TEST_P(CudaLayerLaunchesLinear, SameForEightAndTwoHundredFiftySixExperts) {
  GMOE_SKIP_WITHOUT_GPU();
  const auto [layout, recipe] = GetParam();
  Rng rng;
  const ForkedStreams streams;
  const cudaStream_t s = streams.main();
  expect_same_for_both_e([&](int64_t E) {
    const Rows in(E, rng);
    const DeviceExperts w = random_weights(E, kHidden, kHidden, layout, rng);
    const DeviceTensor bias = random_rows(E, kHidden, rng);
    GroupedLinearOptions opt;
    opt.recipe = recipe;
    GroupedLinear layer(w.view(), expert_bias(bias.view(), layout), opt);
    return capture_calls(s, [&](bool backward) {
      layer.invalidate_fp8_weight();  // FP8: the weights' quantization is part of the forward
      GroupedLinearContext ctx;
      layer.forward(in.x.view(), in.counts.view(), ctx, s);
      if (backward) layer.backward(ctx, in.dy.view(), s);
    });
  });
}

INSTANTIATE_TEST_SUITE_P(Layers, CudaLayerLaunchesLinear,
                         ::testing::Combine(::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values(LinearRecipe::native, LinearRecipe::fp8_blockwise)),
                         [](const ::testing::TestParamInfo<LinearParam>& info) {
                           return std::string(layout_name(std::get<0>(info.param))) + "_" +
                                  linear_recipe_name(std::get<1>(info.param));
                         });

// The gradient paths that training frameworks drive: main_grad with an expert mask whose mask-0
// experts get a fresh gradient (MaskedOffWgrad::fresh: one launch whatever the mask), the weight
// gradient delayed to backward_dw, and counts given on the host (one pinned upload). Their
// launches must not grow with E either.
class CudaLayerLaunchesLinearGradients : public ::testing::TestWithParam<Layout> {};

TEST_P(CudaLayerLaunchesLinearGradients, SameForEightAndTwoHundredFiftySixExperts) {
  GMOE_SKIP_WITHOUT_GPU();
  const Layout layout = GetParam();
  Rng rng;
  const ForkedStreams streams;
  const cudaStream_t s = streams.main();
  expect_same_for_both_e([&](int64_t E) {
    const Rows in(E, rng);
    const HostTensor host_counts = in.counts.download();
    const DeviceExperts w = random_weights(E, kHidden, kHidden, layout, rng);
    HostExpertTensor zeros(layout, DType::f32, E, kHidden, kHidden);
    zeros.set_all(std::vector<double>(static_cast<size_t>(E * kHidden * kHidden), 0.0));
    const DeviceExperts main_grad(zeros);
    HostTensor mask_h(DType::i32, {E});
    for (int64_t e = 0; e < E; ++e) mask_h.set(e, static_cast<double>(rng.integer(0, 1)));
    const DeviceTensor mask(mask_h);
    GroupedLinearOptions opt;
    opt.main_grad = main_grad.view();
    opt.expert_mask = mask.view();
    opt.masked_off = MaskedOffWgrad::fresh;
    opt.delay_wgrad = true;
    GroupedLinear layer(w.view(), {}, opt);
    return capture_calls(s, [&](bool backward) {
      GroupedLinearContext ctx;
      layer.forward(in.x.view(), host_counts.view(), ctx, s);
      if (backward) {
        layer.backward(ctx, in.dy.view(), s);
        layer.backward_dw(ctx, s);
      }
    });
  });
}

INSTANTIATE_TEST_SUITE_P(Layers, CudaLayerLaunchesLinearGradients,
                         ::testing::Values(Layout::kStacked, Layout::kList),
                         [](const ::testing::TestParamInfo<Layout>& info) { return std::string(layout_name(info.param)); });

using MlpParam = std::tuple<Layout, LinearRecipe, bool>;  // layout, recipe, with router probabilities
class CudaLayerLaunchesMlp : public ::testing::TestWithParam<MlpParam> {};

TEST_P(CudaLayerLaunchesMlp, SameForEightAndTwoHundredFiftySixExperts) {
  GMOE_SKIP_WITHOUT_GPU();
  const auto [layout, recipe, with_probs] = GetParam();
  Rng rng;
  const ForkedStreams streams;
  const cudaStream_t s = streams.main();
  expect_same_for_both_e([&](int64_t E) {
    const Rows in(E, rng);
    HostTensor probs_h(DType::f32, {kRows});
    fill_random(probs_h, rng, 0.0, 1.0);
    const DeviceTensor probs(probs_h);
    const DeviceExperts w1 = random_weights(E, 2 * kFfn, kHidden, layout, rng);
    const DeviceExperts w2 = random_weights(E, kHidden, kFfn, layout, rng);
    const DeviceTensor b2 = random_rows(E, kHidden, rng);
    GroupedMLPOptions opt;
    opt.recipe = recipe;
    // FC1 without a bias, FC2 with one: both FCs' bias paths, and FC1's dh quantized as FP8 can take it.
    GroupedMLP mlp(w1.view(), w2.view(), {}, expert_bias(b2.view(), layout), opt);
    return capture_calls(s, [&](bool backward) {
      mlp.invalidate_fp8_weight();
      GroupedMLPContext ctx;
      mlp.forward(in.x.view(), in.counts.view(), with_probs ? probs.view() : TensorView(), ctx, s);
      if (backward) mlp.backward(ctx, in.dy.view(), s);
    });
  });
}

INSTANTIATE_TEST_SUITE_P(Layers, CudaLayerLaunchesMlp,
                         ::testing::Combine(::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values(LinearRecipe::native, LinearRecipe::fp8_blockwise),
                                            ::testing::Bool()),
                         [](const ::testing::TestParamInfo<MlpParam>& info) {
                           return std::string(layout_name(std::get<0>(info.param))) + "_" +
                                  linear_recipe_name(std::get<1>(info.param)) +
                                  (std::get<2>(info.param) ? "_probs" : "_noprobs");
                         });

}  // namespace
}  // namespace gmoe::test
