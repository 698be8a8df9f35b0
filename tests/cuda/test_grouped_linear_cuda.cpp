// tests/cuda/test_grouped_linear_cuda.cpp — GroupedLinear on the CUDA backend: every bias mode and
// weight layout against the exact reference (rule: at most 2× the CPU layer's error); delayed dW on
// a second stream bitwise equal to immediate dW; and forward + backward + backward_dw captured once
// in global capture mode (any host sync fails the capture) and replayed under changing counts,
// bitwise equal to eager runs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>
#include <tuple>
#include <vector>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/allocator.h"
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

// The device's allocator with statistics: every allocation filled with 0x7F bytes (the finite f32
// fill_value(): memory nobody wrote reads as that), and every free's position in its stream kept
// as an event, so that a test can ask whether the memory has really been released yet.
class RecordingCudaAllocator final : public Allocator {
 public:
  static double fill_value() {
    float f;
    const unsigned char b[4] = {0x7F, 0x7F, 0x7F, 0x7F};
    std::memcpy(&f, b, 4);
    return f;
  }
  ~RecordingCudaAllocator() override {
    for (const Free& f : frees) cudaEventDestroy(f.done);
  }
  void* allocate(std::size_t bytes, Stream stream) override {
    void* p = cuda_allocator().allocate(bytes, stream);
    if (p != nullptr) test_cuda_check(cudaMemsetAsync(p, 0x7F, bytes, stream), "cudaMemsetAsync");
    ++allocations;
    return p;
  }
  void free(void* ptr, Stream stream) override {
    if (ptr == nullptr) return;
    Free f{ptr, stream, nullptr};
    test_cuda_check(cudaEventCreateWithFlags(&f.done, cudaEventDisableTiming), "cudaEventCreate");
    test_cuda_check(cudaEventRecord(f.done, stream), "cudaEventRecord");
    frees.push_back(f);
    cuda_allocator().free(ptr, stream);
  }
  Device device() const override { return cuda_allocator().device(); }

  struct Free {
    void* ptr;
    Stream stream;
    cudaEvent_t done;  // reached when the free's stream passes the free
  };
  int allocations = 0;
  std::vector<Free> frees;
  /// The free of `ptr` (the last one), or nullptr.
  const Free* free_of(const void* ptr) const {
    for (auto it = frees.rbegin(); it != frees.rend(); ++it) {
      if (it->ptr == ptr) return &*it;
    }
    return nullptr;
  }
};

// main_grad with an expert mask and MaskedOffWgrad::fresh on the CUDA backend (native and an FP8
// recipe, both layouts, the weight gradient immediate or delayed on a second stream): every
// expert's destination against the same layer's gradient into a zeroed main_grad without a mask
// (expect_layer_masked_off: untouched memory bitwise; computed values within an f32 rounding of
// the accumulation); the fresh views 256-byte aligned in the weights' layout.
using MaskedOffParam = std::tuple<Layout, LinearRecipe>;
class CudaGroupedLinearMaskedOff : public ::testing::TestWithParam<MaskedOffParam> {};

TEST_P(CudaGroupedLinearMaskedOff, EveryExpertsDestination) {
  GMOE_SKIP_WITHOUT_GPU();
  const auto [layout, recipe] = GetParam();
  Rng rng;
  const ShapeCase c = make_case("skewed", rng, CaseScale::kLarge);
  const GemmProblem p(c, DType::bf16, rng);
  const MaskedOffDestinations d(c.E, c.N, c.K, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts), mask(d.mask_t);
  DeviceExperts w(p.w_stacked, p.w, layout);
  const ForkedStreams streams;
  const cudaStream_t s1 = streams.main(), s2 = streams.side();
  RecordingCudaAllocator alloc;
  const auto run = [&](DeviceExperts& main_grad, bool masked, bool accumulate, bool delayed) {
    const GroupedLinearOptions opt =
        main_grad_options(recipe, main_grad.view(), accumulate, delayed, &alloc, masked ? mask.view() : TensorView());
    GroupedLinear layer(w.view(), {}, opt);
    GroupedLinearContext ctx;
    layer.forward(x.view(), counts.view(), ctx, s1);
    GroupedLinearBackward b = layer.backward(ctx, dy.view(), s1);
    GroupedLinearGrads g = delayed ? layer.backward_dw(ctx, s2) : b.grads;
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    check_device_errors(s1);
    return g;
  };
  HostExpertTensor zeros(layout, DType::f32, c.E, c.N, c.K);
  zeros.set_all(std::vector<double>(d.main_init.size(), 0.0));
  DeviceExperts plain(zeros);
  run(plain, false, false, false);
  const std::vector<double> product = plain.to_double();
  HostExpertTensor init(layout, DType::f32, c.E, c.N, c.K);
  init.set_all(d.main_init);
  for (bool accumulate : {false, true}) {
    for (bool delayed : {false, true}) {
      DeviceExperts main_grad(init);
      const GroupedLinearGrads g = run(main_grad, true, accumulate, delayed);
      const ExpertWeights& fresh = g.masked_off_weight;
      ASSERT_EQ(fresh.is_stacked(), layout == Layout::kStacked);
      ASSERT_EQ(fresh.num_experts(), c.E);
      for (int64_t e = 0; e < c.E; ++e) {
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(fresh.expert(e).data) % 256, 0u) << "fresh view " << e;
      }
      expect_layer_masked_off(d.mask, accumulate, d.main_init, RecordingCudaAllocator::fill_value(), product,
                              main_grad.to_double(), values(fresh), 1e-6,
                              std::string(accumulate ? "accumulate" : "overwrite") + (delayed ? ", delayed" : ""));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, CudaGroupedLinearMaskedOff,
                         ::testing::Combine(::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values(LinearRecipe::native, LinearRecipe::fp8_tensorwise,
                                                              LinearRecipe::fp8_blockwise, LinearRecipe::mxfp8)),
                         [](const ::testing::TestParamInfo<MaskedOffParam>& info) {
                           return std::string(layout_name(std::get<0>(info.param))) + "_" +
                                  linear_recipe_name(std::get<1>(info.param));
                         });

// The packed gradients' allocation is not released while another stream may still use it. The
// layer's backward allocates them on s1; backward_dw writes them on s2, held behind a gate; the
// caller's reduce-scatter stream s3 records itself. With every reference dropped while s2 and s3 are
// held, the free (on s1) must not have been reached: the allocator's event for that free stays
// not ready until the gates open, and an allocation made meanwhile on a fourth stream that gets the
// same memory is ordered after them too. The control (a buffer used on s2 without record_stream)
// shows that the check can fail: its free is reached at once.
TEST(CudaPackedGradients, FreedWhileAnotherStreamUsesThemIsNotReused) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ShapeCase c = fixed_case("odd_expert_bytes", 24, 40, {50, 0, 170, 30, 90}, 3);
  const GemmProblem p(c, DType::bf16, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts);
  HostTensor bias_h(DType::bf16, {c.E, c.N});
  fill_random(bias_h, rng);
  DeviceTensor bias(bias_h);
  const ForkedStreams streams, more;
  const cudaStream_t s1 = streams.main(), s2 = streams.side(), s3 = more.main(), s4 = more.side();
  for (Layout layout : {Layout::kStacked, Layout::kList}) {
    SCOPED_TRACE(layout_name(layout));
    DeviceExperts w(p.w_stacked, p.w, layout);
    RecordingCudaAllocator alloc;
    GroupedLinearOptions opt;
    opt.delay_wgrad = true;
    opt.save_original_input = true;
    opt.allocator = &alloc;
    GroupedLinear layer(w.view(), expert_bias(bias.view(), layout), opt);
    DeviceTensor dx(HostTensor(DType::bf16, {c.capacity, c.K}));
    {
      // One whole step before the gates: the first launch of a kernel loads its module (lazy
      // loading), which waits for the device, so a first launch behind a closed gate never returns.
      GroupedLinearContext warm;
      layer.forward(x.view(), counts.view(), warm, s1);
      layer.backward(warm, dy.view(), s1, dx.view());
      layer.backward_dw(warm, s1);
      GMOE_TEST_CUDA(cudaStreamSynchronize(s1));
    }
    GroupedLinearContext ctx;
    layer.forward(x.view(), counts.view(), ctx, s1);
    GroupedLinearBackward b = layer.backward(ctx, dy.view(), s1, dx.view());
    const void* packed = b.grads.storage->data();
    const std::size_t packed_bytes = b.grads.storage->bytes();
    // One allocation: every bias gradient (and below, every weight gradient) lies inside it.
    const auto inside = [&](const TensorView& v) {
      const char* at = static_cast<const char*>(v.data);
      return at >= static_cast<const char*>(packed) && at + v.nbytes() <= static_cast<const char*>(packed) + packed_bytes;
    };
    for (int64_t e = 0; e < c.E; ++e) ASSERT_TRUE(inside(b.grads.bias.expert(e))) << "db_" << e;
    DeviceTensor sink(HostTensor(DType::bf16, {c.N, c.K}));  // (before the gates: its cudaFree syncs)
    GMOE_TEST_CUDA(cudaStreamSynchronize(s1));
    {
      StreamGate gate2(s2), gate3(s3);
      GroupedLinearGrads g = layer.backward_dw(ctx, s2);  // enqueued behind gate2
      ASSERT_EQ(g.storage->data(), packed);
      for (int64_t e = 0; e < c.E; ++e) {
        ASSERT_EQ(reinterpret_cast<std::uintptr_t>(g.weight.expert(e).data) % 256, 0u) << "dW_" << e;
        ASSERT_TRUE(inside(g.weight.expert(e))) << "dW_" << e;
      }
      // The caller's reduce-scatter: reads the gradients on s3 (behind gate3), recorded.
      GMOE_TEST_CUDA(cudaMemcpyAsync(sink.view().data, g.weight.expert(0).data, c.N * c.K * 2,
                                     cudaMemcpyDeviceToDevice, s3));
      g.storage->record_stream(s3);
      b = GroupedLinearBackward();
      g = GroupedLinearGrads();  // the last reference: the packed allocation is freed (on s1)
      const RecordingCudaAllocator::Free* f = alloc.free_of(packed);
      ASSERT_NE(f, nullptr) << "the packed gradients were not freed with their last reference";
      EXPECT_EQ(f->stream, s1) << "freed on another stream than the one that allocated them";
      // Give s1 every chance to pass the free if nothing held it.
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      EXPECT_EQ(cudaEventQuery(f->done), cudaErrorNotReady) << "the free did not wait for s2 and s3";
      // Memory handed out meanwhile on s4: if it is the packed allocation, its use is ordered after s2, s3.
      Buffer again(cuda_allocator(), packed_bytes, s4);
      GMOE_TEST_CUDA(cudaMemsetAsync(again.data(), 0, 256, s4));
      if (again.data() == packed) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        EXPECT_EQ(cudaStreamQuery(s4), cudaErrorNotReady) << "the packed memory was reused while s2/s3 held it";
      }
      gate2.open();
      gate3.open();
      GMOE_TEST_CUDA(cudaDeviceSynchronize());
      EXPECT_EQ(cudaEventQuery(f->done), cudaSuccess);
    }
  }
  // Control: without record_stream the free is reached while s2 is still held.
  RecordingCudaAllocator alloc;
  {
    StreamGate gate(s2);
    Buffer used(alloc, 4096, s1);
    GMOE_TEST_CUDA(cudaMemsetAsync(used.data(), 0, 4096, s2));
    const void* ptr = used.data();
    used.reset();
    GMOE_TEST_CUDA(cudaStreamSynchronize(s1));
    EXPECT_EQ(cudaEventQuery(alloc.free_of(ptr)->done), cudaSuccess) << "control: an unrecorded free waits for s2";
    gate.open();
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
  }
}

}  // namespace
}  // namespace gmoe::test
