// tests/cuda/test_host_counts_cuda.cpp — counts given on the host (upload_counts, gmoe/copy.h, and
// the layers' forward with host counts): the copy reads pinned staging memory, is stream-ordered
// (the host counts may change as soon as the call returns, even while the stream is held), two host
// threads uploading on two streams at once never share a staging block, a layer given host counts
// is bitwise the layer given the same counts on the device, and a captured forward with host counts
// replays the counts given at capture.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <set>
#include <thread>
#include <vector>

#include "common/backend.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/copy.h"
#include "gmoe/grouped_linear.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe::test {
namespace {

std::vector<int64_t> values_i64(const TensorView& v) {
  const std::vector<double> d = values(v);
  return std::vector<int64_t>(d.begin(), d.end());
}

bool pinned(const void* p) {
  cudaPointerAttributes a{};
  return cudaPointerGetAttributes(&a, p) == cudaSuccess && a.type == cudaMemoryTypeHost;
}

// The stream is held while the upload is enqueued and the host counts are then overwritten: the
// device must still receive the values given to the call (the staging copy is taken at the call),
// and the staging block is pinned memory (no pageable copy).
TEST(CudaHostCounts, UploadIsStreamOrderedFromPinnedStaging) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ForkedStreams streams;
  const cudaStream_t s = streams.main();
  for (DType dt : {DType::i32, DType::i64}) {
    std::vector<int64_t> want(37);
    for (int64_t& c : want) c = rng.integer(0, 1000);
    HostTensor host = make_counts(want, dt);
    Tensor dev;
    {
      StreamGate gate(s);
      dev = upload_counts(host.view(), Device::cuda(), s);
      EXPECT_TRUE(pinned(cuda_backend::last_upload_staging())) << "the upload's staging block is not pinned";
      for (int64_t e = 0; e < 37; ++e) host.set(e, -1.0);  // the caller's memory changes at once
      EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
      gate.open();
      GMOE_TEST_CUDA(cudaStreamSynchronize(s));
    }
    EXPECT_EQ(dev.view().dtype, dt);
    EXPECT_TRUE(dev.view().device.is_cuda());
    EXPECT_EQ(values_i64(dev.view()), want);
  }
}

// Two host threads, each on its own stream held by a gate, upload many different count lists at
// once: no staging block serves both threads (each is held until its copy has run), and every
// upload delivers its own values once the gates open.
TEST(CudaHostCounts, TwoThreadsOnTwoStreamsNeverShareStaging) {
  GMOE_SKIP_WITHOUT_GPU();
  constexpr int kUploads = 64;
  const ForkedStreams streams;
  struct Worker {
    cudaStream_t stream;
    std::vector<std::vector<int64_t>> want;
    std::vector<Tensor> got;
    std::set<const void*> staging;
  };
  Worker w[2] = {{streams.main(), {}, {}, {}}, {streams.side(), {}, {}, {}}};
  Rng rng;
  for (int t = 0; t < 2; ++t) {
    for (int i = 0; i < kUploads; ++i) {
      std::vector<int64_t> c(static_cast<size_t>(rng.integer(1, 300)));
      for (int64_t& v : c) v = rng.integer(0, 1 << 20);
      w[t].want.push_back(std::move(c));
    }
  }
  {
    StreamGate gate0(w[0].stream), gate1(w[1].stream);
    std::vector<std::thread> threads;
    for (Worker& wk : w) {
      threads.emplace_back([&wk] {
        GMOE_TEST_CUDA(cudaSetDevice(0));
        for (const std::vector<int64_t>& c : wk.want) {
          HostTensor h = make_counts(c, DType::i64);  // pageable, freed at once
          wk.got.push_back(upload_counts(h.view(), Device::cuda(), wk.stream));
          wk.staging.insert(cuda_backend::last_upload_staging());
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (const void* p : w[0].staging) EXPECT_EQ(w[1].staging.count(p), 0u) << "staging block " << p << " shared";
    EXPECT_EQ(w[0].staging.size(), static_cast<size_t>(kUploads)) << "a block was reused before its copy ran";
    gate0.open();
    gate1.open();
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
  }
  for (const Worker& wk : w) {
    for (int i = 0; i < kUploads; ++i) ASSERT_EQ(values_i64(wk.got[i].view()), wk.want[i]) << "upload " << i;
  }
}

// GroupedLinear and GroupedMLP given host counts: bitwise the same outputs and gradients as with
// the same counts on the device (forward, backward, delayed backward_dw on a second stream).
TEST(CudaHostCounts, LayersTakeHostCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ShapeCase c = make_case("skewed", rng, CaseScale::kLarge);
  const GemmProblem p(c, DType::bf16, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts);
  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main(), s2 = streams.side();
  for (Layout layout : {Layout::kStacked, Layout::kList}) {
    SCOPED_TRACE(layout_name(layout));
    DeviceExperts w(p.w_stacked, p.w, layout);
    using Results = std::vector<std::vector<double>>;
    const auto run = [&](const TensorView& cnt) -> Results {
      GroupedLinearOptions opt;
      opt.delay_wgrad = true;
      GroupedLinear layer(w.view(), {}, opt);
      GroupedLinearContext ctx;
      Tensor y = layer.forward(x.view(), cnt, ctx, s1);
      GroupedLinearBackward b = layer.backward(ctx, dy.view(), s1);
      GroupedLinearGrads g = layer.backward_dw(ctx, s2);
      test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      check_device_errors(s1);
      return std::vector<std::vector<double>>{values(y.view()), values(b.dx.view()), values(g.weight)};
    };
    EXPECT_EQ(run(p.counts.view()), run(counts.view())) << "GroupedLinear with host counts";
  }
  // The MLP (SwiGLU): FC1 [2F, H], FC2 [H, F], with H the case's K.
  const int64_t H = c.K, F = 64;
  HostTensor w1h(DType::bf16, {c.E, 2 * F, H}), w2h(DType::bf16, {c.E, H, F});
  fill_random(w1h, rng, -0.1, 0.1);
  fill_random(w2h, rng, -0.1, 0.1);
  DeviceTensor w1(w1h), w2(w2h);
  HostTensor dyh(DType::bf16, {c.capacity, H});
  fill_random(dyh, rng);
  DeviceTensor dy_mlp(dyh);
  const auto run_mlp = [&](const TensorView& cnt) -> std::vector<std::vector<double>> {
    GroupedMLP mlp(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()), {}, {}, {});
    GroupedMLPContext ctx;
    Tensor y = mlp.forward(x.view(), cnt, {}, ctx, s1);
    GroupedMLPBackward b = mlp.backward(ctx, dy_mlp.view(), s1);
    test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    check_device_errors(s1);
    return std::vector<std::vector<double>>{values(y.view()), values(b.dx.view()), values(b.grads.fc1.weight),
                                            values(b.grads.fc2.weight)};
  };
  EXPECT_EQ(run_mlp(p.counts.view()), run_mlp(counts.view())) << "GroupedMLP with host counts";
}

// A forward + backward given host counts, captured in global mode (a sync or a pageable copy would
// fail the capture), then replayed after the host counts changed: each replay uploads the counts
// given at capture, bitwise the eager run with them.
TEST(CudaHostCounts, CapturedForwardReplaysTheCountsOfTheCapture) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ShapeCase c = make_case("skewed", rng, CaseScale::kLarge);
  const GemmProblem p(c, DType::bf16, rng);
  DeviceTensor x(p.x), dy(p.dy);
  DeviceExperts w(p.w_stacked, p.w, Layout::kStacked);
  const ForkedStreams streams;
  const cudaStream_t s = streams.main();
  GroupedLinear layer(w.view());
  HostTensor host = make_counts(c.counts);
  Tensor y_eager;
  {
    GroupedLinearContext ctx;
    y_eager = layer.forward(x.view(), host.view(), ctx, s);
    layer.backward(ctx, dy.view(), s);
    GMOE_TEST_CUDA(cudaStreamSynchronize(s));
  }
  DeviceTensor y_out(HostTensor(DType::bf16, {c.capacity, c.N}));
  const CapturedGraph graph(s, [&] {
    GroupedLinearContext ctx;
    layer.forward(x.view(), host.view(), ctx, s, y_out.view());
    layer.backward(ctx, dy.view(), s);
  });
  for (int64_t e = 0; e < c.E; ++e) host.set(e, 0.0);  // changed after the capture
  for (int replay = 0; replay < 2; ++replay) {
    graph.replay(s);
    EXPECT_EQ(values(y_out.view()), values(y_eager.view())) << "replay " << replay;
  }
}

}  // namespace
}  // namespace gmoe::test
