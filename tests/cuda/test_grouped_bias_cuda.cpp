// tests/cuda/test_grouped_bias_cuda.cpp — the bias gradient on the device, grouped_bias_grad: within
// the tolerance rule of the exact sums beside the CPU reference (the device adds in another order),
// the same bits on a second run, exactly 0 for empty experts, on every named case of
// bias_grad_cases (strided dy, slack rows, 0 rows, odd widths, 300 and 1000 experts); one kernel
// launch and no scratch per call (a list of more than 256 experts also uploads its pointers),
// whatever the routing under one capture; negative counts and counts past the capacity clamped as
// on the CPU and reported in the device error word.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"

namespace gmoe::test {
namespace {

class CudaBiasGrad : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
};

// dy's strided view over a device copy of the case's storage.
TensorView device_rows(const BiasGradCase& c, const DeviceTensor& storage) {
  return TensorView(storage.data(), c.storage.dtype(), Device::cuda(0), {c.capacity, c.cols}, {c.cols + c.pad, 1});
}

TEST_P(CudaBiasGrad, MatchesExactSumsAndRepeatsItsBits) {
  Rng rng;
  for (const BiasGradCase& c : bias_grad_cases(GetParam(), rng)) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size());
    const HostTensor counts_h = make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
    const DeviceTensor storage(c.storage), counts(counts_h);
    const ExactResult exact = exact_bias_grad(c.dy, c.counts);
    for (const BiasForm& form : bias_forms(GetParam())) {
      SCOPED_TRACE(form.name());
      HostTensor poisoned(form.dtype, {E, c.cols});
      poison(poisoned);
      HostTensor own(form.dtype, {E, c.cols});
      grouped_bias_grad(c.view(), counts_h.view(), expert_bias(own.view(), form.layout));
      DeviceTensor first(poisoned), second(poisoned);
      grouped_bias_grad(device_rows(c, storage), counts.view(), expert_bias(first.view(), form.layout));
      grouped_bias_grad(device_rows(c, storage), counts.view(), expert_bias(second.view(), form.layout));
      GMOE_TEST_CUDA(cudaDeviceSynchronize());
      check_device_errors(nullptr);
      const HostTensor got = first.download();
      EXPECT_TRUE(within_rule(got.to_double(), own.to_double(), exact, form.dtype, "db"));
      EXPECT_TRUE(bitwise_equal(second.download(), got, "db, second run"));
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t n = 0; c.counts[e] == 0 && n < c.cols; ++n) {
          ASSERT_EQ(got.get(e * c.cols + n), 0.0) << "empty expert " << e;
        }
      }
    }
  }
}

TEST_P(CudaBiasGrad, OneLaunchUnderEveryRouting) {
  // Captured once, replayed under uniform, skewed, one-expert and all-empty routings: one kernel,
  // no allocation, no copy; each replay within the rule of that routing's exact sums.
  Rng rng;
  for (auto [E, layout] : {std::pair<int64_t, Layout>{8, Layout::kStacked}, {8, Layout::kList},
                           {256, Layout::kStacked}, {256, Layout::kList}, {1000, Layout::kStacked}}) {
    SCOPED_TRACE("E " + std::to_string(E) + " " + layout_name(layout));
    const int64_t per = 24, slack = 5, cols = 72;
    const std::vector<std::vector<int64_t>> routings = graph_routings(E, per, slack, rng);
    HostTensor dy_h(GetParam(), {E * per + slack, cols});
    fill_random(dy_h, rng);
    const DeviceTensor dy(dy_h);
    DeviceTensor counts(make_counts(routings[0]));
    DeviceTensor db(DType::f32, {E, cols});
    const ExpertBias dbias = expert_bias(db.view(), layout);
    cudaStream_t stream;
    GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto call = [&] { grouped_bias_grad(dy.view(), counts.view(), dbias, stream); };
    call();  // eager once first: module loading happens outside capture
    GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
    {
      const CapturedGraph graph(stream, call);
      const bench::GraphNodeCounts nodes = graph.nodes();
      EXPECT_EQ(nodes.kernels, 1) << nodes.str();
      EXPECT_EQ(nodes.allocs + nodes.frees + nodes.memcpys + nodes.memsets, 0) << nodes.str();
      for (const std::vector<int64_t>& routing : routings) {
        SCOPED_TRACE("routing " + ::testing::PrintToString(routing));
        counts.upload(make_counts(routing));
        HostTensor poisoned(DType::f32, {E, cols});
        poison(poisoned);
        db.upload(poisoned);
        graph.replay(stream);
        check_device_errors(stream);
        EXPECT_TRUE(within_rule(db.download().to_double(), exact_bias_grad(dy_h, routing), DType::f32, "db"));
      }
    }
    GMOE_TEST_CUDA(cudaStreamDestroy(stream));
  }
}

TEST_P(CudaBiasGrad, BadCountsAreClampedAndReported) {
  // A negative count is 0 and counts past the capacity stop at it, as on the CPU; the device error
  // word says both.
  Rng rng;
  const int64_t cap = 100, cols = 40;
  const std::vector<int64_t> bad = {30, -7, 50, 45, 9};
  const std::vector<int64_t> clamped = {30, 0, 50, 20, 0};
  HostTensor dy_h(GetParam(), {cap, cols});
  fill_random(dy_h, rng);
  const DeviceTensor dy(dy_h);
  const DeviceTensor counts(make_counts(bad));
  HostTensor poisoned(DType::f32, {5, cols});
  poison(poisoned);
  DeviceTensor db(poisoned);
  check_device_errors(nullptr);  // nothing left over from earlier tests
  grouped_bias_grad(dy.view(), counts.view(), expert_bias(db.view(), Layout::kStacked));
  expect_device_error({"negative", "capacity"});
  HostTensor own(DType::f32, {5, cols});
  grouped_bias_grad(dy_h.view(), make_counts(clamped).view(), expert_bias(own.view(), Layout::kStacked));
  EXPECT_TRUE(within_rule(db.download().to_double(), own.to_double(), exact_bias_grad(dy_h, clamped), DType::f32,
                          "db clamped"));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaBiasGrad, ::testing::Values(DType::bf16, DType::f16, DType::f32),
                         [](const ::testing::TestParamInfo<DType>& i) { return std::string(dtype_name(i.param)); });

}  // namespace
}  // namespace gmoe::test
