// tests/layers/test_offload.cpp — activation offloading (gmoe/offload.h) on the CPU backend, where
// an offload is a host copy done on return: the logic (what is saved, what comes back, the views
// re-pointed, the states) is the same as on CUDA. Stacks of GroupedMLP layers over every recipe,
// with probs, biases, recompute and delayed weight gradients, bitwise equal with and without
// offloading; the allocator's bytes in use drop by exactly what was offloaded; the pool stops
// growing after the first step; a GroupedLinear and a MoELayer alone; misuse is an error.
#include <gtest/gtest.h>

#include <deque>
#include <string>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "common/offload_fixture.h"
#include "gmoe/grouped_linear.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/moe_layer.h"
#include "gmoe/offload.h"

namespace gmoe::test {
namespace {

class OffloadStackCpu : public ::testing::TestWithParam<StackSpec> {};

TEST_P(OffloadStackCpu, BitwiseEqualAndMemoryReleased) {
  const StackSpec& spec = GetParam();
  Rng rng;
  StackInputs in(spec, rng);
  std::deque<HostTensor> storage;
  DeviceIO io = cpu_io(storage);
  const StackRun base = run_mlp_stack(spec, in, OffloadMode::none, io, nullptr, nullptr);
  for (OffloadMode mode : {OffloadMode::scheduler, OffloadMode::everything}) {
    SCOPED_TRACE(mode == OffloadMode::scheduler ? "scheduler" : "everything");
    const StackRun run = run_mlp_stack(spec, in, mode, io, nullptr, nullptr);
    EXPECT_TRUE(runs_bitwise_equal(base, run)) << "seed " << rng.seed();
    // Layers 0..2 (and 3 without keep_last_layer) hold at least x's copy or its FP8 copy, and h.
    EXPECT_GT(run.offloaded_bytes, std::size_t(0));
    EXPECT_EQ(base.in_use_after_forward - run.in_use_after_forward, run.offloaded_bytes)
        << "the device bytes after forward drop by exactly what was offloaded";
  }
}

TEST_P(OffloadStackCpu, PoolStopsGrowingAfterTheFirstStep) {
  const StackSpec& spec = GetParam();
  Rng rng;
  StackInputs in(spec, rng);
  std::deque<HostTensor> storage;
  DeviceIO io = cpu_io(storage);
  const StackRun one = run_mlp_stack(spec, in, OffloadMode::everything, io, nullptr, nullptr, 1);
  const StackRun three = run_mlp_stack(spec, in, OffloadMode::everything, io, nullptr, nullptr, 3);
  EXPECT_EQ(one.pool_chunks, three.pool_chunks);
  EXPECT_TRUE(runs_bitwise_equal(one, three));
}

INSTANTIATE_TEST_SUITE_P(Stacks, OffloadStackCpu, ::testing::ValuesIn(offload_stack_specs()),
                         [](const auto& info) { return info.param.name; });

TEST(PinnedHostPoolCpu, ReusesCoalescesAndRejectsForeignPointers) {
  PinnedHostPool pool(Device::cpu(), 4096);
  void* a = pool.allocate(1000);
  void* b = pool.allocate(1000);
  void* c = pool.allocate(1000);
  EXPECT_EQ(pool.chunk_allocations(), 1);
  EXPECT_EQ(pool.used_bytes(), std::size_t(3 * 1024));
  pool.free(b);
  pool.free(a);  // coalesces with b's run
  void* ab = pool.allocate(2000);
  EXPECT_EQ(ab, a) << "the freed neighbours make one run";
  EXPECT_EQ(pool.chunk_allocations(), 1);
  void* big = pool.allocate(10000);  // bigger than the chunk: a chunk of its own
  EXPECT_EQ(pool.chunk_allocations(), 2);
  int foreign = 0;
  GMOE_EXPECT_ERROR(pool.free(&foreign), "not a block of this pool");
  GMOE_EXPECT_ERROR(pool.free(static_cast<char*>(c) + 256), "not a block of this pool");
  pool.free(ab);
  pool.free(c);
  pool.free(big);
  EXPECT_EQ(pool.used_bytes(), std::size_t(0));
  EXPECT_EQ(pool.peak_used_bytes(), std::size_t(3 * 1024 + 10240));
  pool.reserve(4096);  // the first chunk is whole again: no growth
  EXPECT_EQ(pool.chunk_allocations(), 2);
  pool.reserve(20000);
  EXPECT_EQ(pool.chunk_allocations(), 3);
  EXPECT_EQ(pool.allocate(0), nullptr);
}

// One GroupedLinear of each recipe: forward, offload, release, reload, backward; the saved copy's
// memory leaves and comes back.
TEST(OffloadLinearCpu, EveryRecipeBitwiseAndStates) {
  Rng rng;
  const int64_t E = 3, N = 32, K = 48, cap = 40;
  HostTensor x(DType::bf16, {cap, K}), dy(DType::bf16, {cap, N}), w(DType::bf16, {E, N, K});
  fill_random(x, rng);
  fill_random(dy, rng);
  fill_random(w, rng, -0.2, 0.2);
  HostTensor counts = make_counts({17, 0, 20});
  for (LinearRecipe r : {LinearRecipe::native, LinearRecipe::fp8_tensorwise, LinearRecipe::fp8_blockwise,
                         LinearRecipe::mxfp8}) {
    SCOPED_TRACE(linear_recipe_name(r));
    CountingAllocator counting(host_allocator());
    GroupedLinearOptions o;
    o.recipe = r;
    o.allocator = &counting;
    GroupedLinear layer(ExpertWeights::from_stacked(w.view()), {}, o);
    Offloader off(Device::cpu(), nullptr, &counting, 1 << 16);
    std::vector<HostTensor> results[2];
    for (int offload = 0; offload < 2; ++offload) {
      GroupedLinearContext ctx;
      Tensor y = layer.forward(x.view(), counts.view(), ctx);
      if (offload) {
        const std::size_t saved = ctx.offloadable_bytes(), before = counting.in_use();
        ASSERT_GT(saved, std::size_t(0));
        ctx.offload(off, nullptr);
        EXPECT_EQ(ctx.offload_state(), OffloadState::offloading);
        EXPECT_EQ(counting.in_use(), before) << "offload keeps the device memory until release";
        GMOE_EXPECT_ERROR(ctx.offload(off, nullptr), "are offloading");
        ctx.release(nullptr);
        EXPECT_EQ(ctx.offload_state(), OffloadState::offloaded);
        EXPECT_EQ(before - counting.in_use(), saved);
        EXPECT_EQ(off.pool().used_bytes() >= saved, true);
        GMOE_EXPECT_ERROR(layer.backward(ctx, dy.view()), "call reload(stream) first");
        GMOE_EXPECT_ERROR(ctx.release(nullptr), "needs an offloading context");
        ctx.prefetch(nullptr);
        EXPECT_EQ(ctx.offload_state(), OffloadState::reloading);
        EXPECT_EQ(counting.in_use(), before);
        EXPECT_EQ(off.pool().used_bytes(), std::size_t(0)) << "host blocks go back once the copies back are issued";
        ctx.reload(nullptr);
        EXPECT_EQ(ctx.offload_state(), OffloadState::resident);
      }
      GroupedLinearBackward b = layer.backward(ctx, dy.view());
      std::deque<HostTensor> st;
      DeviceIO io = cpu_io(st);
      results[offload] = {io.download(y.view()), io.download(b.dx.view()), io.download(b.grads.weight.stacked)};
    }
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(bitwise_equal(results[0][i], results[1][i], "output " + std::to_string(i)));
  }
}

// Offloading a context and reloading it before release keeps the device memory and copies nothing back.
TEST(OffloadLinearCpu, ReloadWithoutReleaseCopiesNothingBack) {
  Rng rng;
  HostTensor x(DType::bf16, {16, 16}), w(DType::bf16, {2, 16, 16});
  fill_random(x, rng);
  fill_random(w, rng);
  HostTensor counts = make_counts({8, 8});
  GroupedLinear layer(ExpertWeights::from_stacked(w.view()));
  Offloader off(Device::cpu(), nullptr);
  GroupedLinearContext ctx;
  Tensor y = layer.forward(x.view(), counts.view(), ctx);
  ctx.offload(off, nullptr);
  ctx.reload(nullptr);
  EXPECT_EQ(ctx.offload_state(), OffloadState::resident);
  EXPECT_EQ(off.bytes_reloaded(), 0);
  EXPECT_GT(off.bytes_offloaded(), 0);
  EXPECT_EQ(off.pool().used_bytes(), std::size_t(0));
}

TEST(OffloadSchedulerCpu, OptionsAndOptOut) {
  Offloader off(Device::cpu(), nullptr);
  OffloadSchedulerOptions o;
  GMOE_EXPECT_ERROR(OffloadScheduler(off, o), "num_layers");
  o.num_layers = 3;
  o.reload_ahead = 0;
  GMOE_EXPECT_ERROR(OffloadScheduler(off, o), "reload_ahead");
  o.reload_ahead = 1;
  o.offload_layer = {true, false};
  GMOE_EXPECT_ERROR(OffloadScheduler(off, o), "offload_layer");
  o.offload_layer = {true, false, true};
  OffloadScheduler s(off, o);
  EXPECT_TRUE(s.offloads(0));
  EXPECT_FALSE(s.offloads(1)) << "opted out";
  EXPECT_FALSE(s.offloads(2)) << "the last layer stays";
  GMOE_EXPECT_ERROR(s.offloads(3), "layer");
  GMOE_EXPECT_ERROR(s.backward_begin(0, nullptr), "had no forward_done");
}

// The MoE block: router outputs, permutation map, permuted input and the experts' tensors go and come
// back; forward's and backward's results bitwise equal; experts() refuses while offloaded.
TEST(OffloadMoECpu, BitwiseEqualAndReleased) {
  Rng rng;
  const int64_t T = 24, E = 4, H = 32, F = 16;
  HostTensor x(DType::bf16, {T, H}), logits(DType::f32, {T, E}), dout(DType::bf16, {T, H});
  HostTensor w1(DType::bf16, {E, 2 * F, H}), w2(DType::bf16, {E, H, F});
  fill_random(x, rng);
  fill_random(logits, rng, -2, 2);
  fill_random(dout, rng);
  fill_random(w1, rng, -0.3, 0.3);
  fill_random(w2, rng, -0.3, 0.3);
  for (bool delayed : {false, true}) {
    SCOPED_TRACE(delayed ? "delayed wgrad" : "wgrad in backward");
    CountingAllocator counting(host_allocator());
    GroupedMLPOptions mo;
    mo.allocator = &counting;
    mo.fc1.delay_wgrad = mo.fc2.delay_wgrad = delayed;
    GroupedMLP experts(ExpertWeights::from_stacked(w1.view()), ExpertWeights::from_stacked(w2.view()), {}, {}, mo);
    MoELayerOptions lo;
    lo.router.top_k = 2;
    lo.allocator = &counting;
    MoELayer layer(experts, lo);
    Offloader off(Device::cpu(), nullptr, &counting);
    std::deque<HostTensor> st;
    DeviceIO io = cpu_io(st);
    std::vector<HostTensor> results[2];
    for (int offload = 0; offload < 2; ++offload) {
      MoELayerContext ctx;
      MoEForward f = layer.forward(x.view(), logits.view(), ctx);
      results[offload].push_back(io.download(f.out.view()));
      results[offload].push_back(io.download(f.probs.view()));
      if (offload) {
        const std::size_t saved = ctx.offloadable_bytes(), before = counting.in_use();
        ctx.offload(off, nullptr);
        ctx.release(nullptr);
        EXPECT_EQ(before - counting.in_use(), saved);
        GMOE_EXPECT_ERROR(ctx.experts(), "call reload(stream) first");
        GMOE_EXPECT_ERROR(layer.backward(ctx, dout.view()), "call reload(stream) first");
        ctx.reload(nullptr);
      }
      MoEBackward b = layer.backward(ctx, dout.view());
      if (delayed) {
        if (offload) {
          // After backward the experts' output gradient and what the delayed FCs read are saved.
          ctx.offload(off, nullptr);
          ctx.release(nullptr);
          ctx.reload(nullptr);
        }
        b.grads = experts.backward_dw(ctx.experts());
      }
      for (const TensorView& v : {b.dx.view(), b.dlogits.view(), b.grads.fc1.weight.stacked,
                                  b.grads.fc2.weight.stacked}) {
        results[offload].push_back(io.download(v));
      }
    }
    for (std::size_t i = 0; i < results[0].size(); ++i) {
      EXPECT_TRUE(bitwise_equal(results[0][i], results[1][i], "output " + std::to_string(i)));
    }
  }
}

}  // namespace
}  // namespace gmoe::test
