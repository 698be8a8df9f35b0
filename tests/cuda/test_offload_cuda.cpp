// tests/cuda/test_offload_cuda.cpp — activation offloading (gmoe/offload.h) on the GPU, with a compute
// and a copy stream: stacks of GroupedMLP layers over every recipe bitwise equal with and without
// offloading (scheduler; everything offloaded, delayed weight gradients included); device memory
// released (the allocator's bytes and gmoe's memory pool's bytes in use after forward); freed memory
// scribbled over between forward and backward (a copy not ordered before its free would bring the
// scribble back); the pool stops growing after the first step; a step with offloading captured in
// a CUDA graph (global mode: any host sync fails the capture) and replayed bitwise. Run under
// compute-sanitizer (racecheck, memcheck) with --gtest_filter='*OffloadCuda*'.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "common/offload_fixture.h"
#include "cuda_test_util.h"
#include "gmoe/copy.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/memory_pool.h"
#include "gmoe/offload.h"

namespace gmoe::test {
namespace {

// Device copies of host tensors, freed with the object; read-back by cudaMemcpy after a device sync.
struct CudaIO {
  std::vector<void*> owned;
  DeviceIO io;
  CudaIO() {
    io.device = Device::cuda(0);
    io.upload = [this](const HostTensor& t) {
      void* p = nullptr;
      const std::size_t bytes = t.bytes().size();
      test_cuda_check(cudaMalloc(&p, bytes == 0 ? 1 : bytes), "cudaMalloc");
      if (bytes != 0) test_cuda_check(cudaMemcpy(p, t.data(), bytes, cudaMemcpyHostToDevice), "cudaMemcpy");
      owned.push_back(p);
      TensorView v = t.view();
      v.data = p;
      v.device = Device::cuda(0);
      return v;
    };
    io.download = [](const TensorView& v) {
      std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
      HostTensor t(v.dtype, shape);
      if (!t.bytes().empty()) {
        test_cuda_check(cudaMemcpy(t.data(), v.data, t.bytes().size(), cudaMemcpyDeviceToHost), "cudaMemcpy");
      }
      return t;
    };
    io.sync = [] { test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize"); };
  }
  ~CudaIO() {
    cudaDeviceSynchronize();
    for (void* p : owned) cudaFree(p);
  }
};

// Bytes in use in gmoe's pool on device 0 (what cuda_allocator() hands out).
std::size_t pool_used_bytes() { return memory_pool_stats(Device::cuda(0)).in_use; }

class OffloadCudaStack : public ::testing::TestWithParam<StackSpec> {};

TEST_P(OffloadCudaStack, BitwiseEqualAndMemoryReleased) {
  GMOE_SKIP_WITHOUT_GPU();
  const StackSpec& spec = GetParam();
  Rng rng;
  StackInputs in(spec, rng);
  CudaIO cio;
  ForkedStreams streams;
  std::size_t used_base = 0;
  auto measure = [](std::size_t* out) {
    return [out](Allocator&, Stream s) {
      test_cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
      *out = pool_used_bytes();
    };
  };
  const StackRun base = run_mlp_stack(spec, in, OffloadMode::none, cio.io, streams.main(), streams.side(), 1,
                                      measure(&used_base));
  for (OffloadMode mode : {OffloadMode::scheduler, OffloadMode::everything}) {
    SCOPED_TRACE(mode == OffloadMode::scheduler ? "scheduler" : "everything");
    std::size_t used = 0;
    const StackRun run =
        run_mlp_stack(spec, in, mode, cio.io, streams.main(), streams.side(), 1, measure(&used));
    EXPECT_TRUE(runs_bitwise_equal(base, run)) << "seed " << rng.seed();
    EXPECT_GT(run.offloaded_bytes, std::size_t(0));
    EXPECT_EQ(base.in_use_after_forward - run.in_use_after_forward, run.offloaded_bytes);
    // Written without a subtraction: size_t wraps, and a pool that grew would pass a difference test.
    EXPECT_GE(used_base, used + run.offloaded_bytes) << "the memory pool's used bytes after forward";
  }
}

// Between forward and backward, every byte the allocator hands out is overwritten: with the copies
// out not ordered before the frees (or the copies back not waited for), the scribble is what backward
// would read.
TEST_P(OffloadCudaStack, ScribbleOverFreedMemoryBetweenForwardAndBackward) {
  GMOE_SKIP_WITHOUT_GPU();
  const StackSpec& spec = GetParam();
  Rng rng;
  StackInputs in(spec, rng);
  CudaIO cio;
  ForkedStreams streams;
  auto scribble = [](Allocator& alloc, Stream s) {
    const std::size_t bytes = std::size_t(64) << 20;
    void* p = alloc.allocate(bytes, s);
    test_cuda_check(cudaMemsetAsync(p, 0xff, bytes, s), "cudaMemsetAsync");
    alloc.free(p, s);
  };
  const StackRun base = run_mlp_stack(spec, in, OffloadMode::none, cio.io, streams.main(), streams.side());
  const StackRun run =
      run_mlp_stack(spec, in, OffloadMode::everything, cio.io, streams.main(), streams.side(), 2, scribble);
  EXPECT_TRUE(runs_bitwise_equal(base, run)) << "seed " << rng.seed();
  const StackRun one = run_mlp_stack(spec, in, OffloadMode::everything, cio.io, streams.main(), streams.side(), 1);
  EXPECT_EQ(one.pool_chunks, run.pool_chunks) << "the pinned pool grows on the first step only";
}

INSTANTIATE_TEST_SUITE_P(Stacks, OffloadCudaStack, ::testing::ValuesIn(offload_stack_specs()),
                         [](const auto& info) { return info.param.name; });

// One step of a 3-layer stack with offloading (scheduler, the last layer offloaded too), captured in a
// CUDA graph and replayed: dx bitwise equal to the eager step without offloading.
TEST(OffloadCudaGraph, CapturedStepReplaysBitwise) {
  GMOE_SKIP_WITHOUT_GPU();
  StackSpec spec;
  spec.layers = 3;
  spec.probs = true;
  Rng rng;
  StackInputs in(spec, rng);
  CudaIO cio;
  ForkedStreams streams;
  const StackRun base = run_mlp_stack(spec, in, OffloadMode::none, cio.io, streams.main(), streams.side());

  std::vector<std::unique_ptr<GroupedMLP>> mlp;
  for (int l = 0; l < spec.layers; ++l) {
    mlp.push_back(std::make_unique<GroupedMLP>(ExpertWeights::from_stacked(cio.io.upload(in.w1[l])),
                                               ExpertWeights::from_stacked(cio.io.upload(in.w2[l]))));
  }
  const TensorView x = cio.io.upload(in.x), dy = cio.io.upload(in.dy), counts = cio.io.upload(in.counts),
                   probs = cio.io.upload(in.probs);
  HostTensor dx_host(DType::bf16, {spec.cap, spec.H});
  const TensorView dx_out = cio.io.upload(dx_host);
  Offloader off(Device::cuda(0), streams.side());
  OffloadSchedulerOptions so;
  so.num_layers = spec.layers;
  so.keep_last_layer = false;
  OffloadScheduler sched(off, so);
  auto step = [&] {
    std::vector<GroupedMLPContext> ctx(spec.layers);
    std::vector<Tensor> ys;
    TensorView cur = x;
    for (int l = 0; l < spec.layers; ++l) {
      ys.push_back(mlp[l]->forward(cur, counts, probs, ctx[l], streams.main()));
      cur = ys.back().view();
      sched.forward_done(l, ctx[l], streams.main());
    }
    sched.forward_end(streams.main());
    std::vector<GroupedMLPBackward> back(spec.layers);
    TensorView g = dy;
    for (int l = spec.layers - 1; l >= 0; --l) {
      sched.backward_begin(l, streams.main());
      back[l] = mlp[l]->backward(ctx[l], g, streams.main());
      g = back[l].dx.view();
    }
    copy_rows(dx_out, g, streams.main());
  };
  step();  // eager: the pinned pool grows here, never inside the capture
  cio.io.sync();
  const int64_t chunks = off.pool().chunk_allocations();
  CapturedGraph graph(streams.main(), step);
  EXPECT_GT(graph.nodes().memcpys, 0) << "the offload copies are in the graph";
  cio.io.sync();
  test_cuda_check(cudaMemsetAsync(dx_out.data, 0xff, dx_out.nbytes(), streams.main()), "cudaMemsetAsync");
  graph.replay(streams.main());
  graph.replay(streams.main());
  EXPECT_EQ(off.pool().chunk_allocations(), chunks);
  const HostTensor dx = cio.io.download(dx_out);
  const auto it = std::find(base.names.begin(), base.names.end(), "dx");
  ASSERT_NE(it, base.names.end());
  EXPECT_TRUE(bitwise_equal(base.outputs[it - base.names.begin()], dx, "dx"));
}

}  // namespace
}  // namespace gmoe::test
