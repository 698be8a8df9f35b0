// tests/cuda/test_memory_pool_cuda.cpp — gmoe's memory pool (gmoe/memory_pool.h) behind
// cuda_allocator(): its statistics follow an allocation and its free; memory freed and then
// synchronised on stays cached (a loop that syncs every step reuses it, the pool does not grow);
// a trim gives it back; scratch taken and released inside a captured CUDA graph replays, and the
// graph's memory is not the pool's; a device that does not exist is refused by name.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "common/expect_error.h"
#include "cuda_test_util.h"
#include "gmoe/allocator.h"
#include "gmoe/memory_pool.h"

namespace gmoe::test {
namespace {

constexpr std::size_t kMiB = std::size_t(1) << 20;

const Device kDev = Device::cuda(0);

// Each test on device 0 with a non-blocking stream of its own (no other suite's work is ordered with
// its checks), after every earlier test's stream-ordered frees completed, so that the pool's figures
// move only with the test's own work.
class MemoryPoolCuda : public ::testing::Test {
 protected:
  void SetUp() override {
    GMOE_SKIP_WITHOUT_GPU();
    test_cuda_check(cudaSetDevice(0), "cudaSetDevice");
    test_cuda_check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    test_cuda_check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  }
  void TearDown() override {
    if (s != nullptr) cudaStreamDestroy(s);
  }
  void sync() const { test_cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize"); }

  cudaStream_t s = nullptr;
  Allocator& alloc = cuda_allocator();
};

TEST_F(MemoryPoolCuda, StatsFollowAnAllocationAndStayReservedAfterASync) {
  const std::size_t bytes = 96 * kMiB;
  const MemoryPoolStats before = memory_pool_stats(kDev);
  EXPECT_LE(before.in_use, before.reserved);

  void* p = alloc.allocate(bytes, s);
  ASSERT_NE(p, nullptr);
  test_cuda_check(cudaMemsetAsync(p, 0x5a, bytes, s), "cudaMemsetAsync");
  sync();
  const MemoryPoolStats held = memory_pool_stats(kDev);
  EXPECT_GE(held.in_use, before.in_use + bytes);
  EXPECT_GE(held.reserved, held.in_use);
  EXPECT_GE(held.peak_in_use, held.in_use);
  EXPECT_GE(held.peak_reserved, held.reserved);

  alloc.free(p, s);
  sync();
  // The default pool's release threshold of 0 gives freed memory back at a sync; gmoe's keeps it.
  const MemoryPoolStats freed = memory_pool_stats(kDev);
  EXPECT_EQ(freed.in_use, before.in_use);
  EXPECT_EQ(freed.reserved, held.reserved) << "freed memory left the pool at a stream synchronisation";
  EXPECT_GE(freed.peak_in_use, held.in_use) << "the peak forgot the allocation";

  reset_memory_pool_peaks(kDev);
  const MemoryPoolStats reset = memory_pool_stats(kDev);
  EXPECT_EQ(reset.peak_in_use, reset.in_use);
  EXPECT_EQ(reset.peak_reserved, reset.reserved);
}

TEST_F(MemoryPoolCuda, TrimGivesCachedMemoryBack) {
  const std::size_t bytes = 128 * kMiB;
  void* kept = alloc.allocate(4 * kMiB, s);  // in use across the trim: must stay
  sync();
  void* p = alloc.allocate(bytes, s);
  alloc.free(p, s);
  sync();
  const MemoryPoolStats cached = memory_pool_stats(kDev);
  ASSERT_GE(cached.reserved, cached.in_use + bytes) << "the freed block is not cached";

  trim_memory_pool(kDev);
  const MemoryPoolStats trimmed = memory_pool_stats(kDev);
  EXPECT_EQ(trimmed.in_use, cached.in_use) << "a trim touched memory in use";
  EXPECT_LE(trimmed.reserved + bytes, cached.reserved) << "the trim kept the freed block";
  EXPECT_GE(trimmed.reserved, trimmed.in_use);

  // keep_bytes: a trim to a size above what is reserved gives nothing back.
  void* q = alloc.allocate(bytes, s);
  alloc.free(q, s);
  sync();
  const MemoryPoolStats again = memory_pool_stats(kDev);
  trim_memory_pool(kDev, again.reserved);
  EXPECT_EQ(memory_pool_stats(kDev).reserved, again.reserved);

  alloc.free(kept, s);
  sync();
}

// What the EP bench's steps do: a large scratch taken, used, freed, then a sync, over and over.
// After the first step the pool reserves nothing more.
TEST_F(MemoryPoolCuda, MemoryFreedBeforeASyncIsReusedNotRemapped) {
  const std::size_t bytes = 512 * kMiB + 3 * 4096;  // not a multiple of the pool's granularity
  trim_memory_pool(kDev);
  auto step = [&](unsigned char value) {
    void* p = alloc.allocate(bytes, s);
    test_cuda_check(cudaMemsetAsync(p, value, bytes, s), "cudaMemsetAsync");
    unsigned char last = 0;
    test_cuda_check(cudaMemcpyAsync(&last, static_cast<char*>(p) + bytes - 1, 1, cudaMemcpyDeviceToHost, s),
                    "cudaMemcpyAsync");
    alloc.free(p, s);
    sync();
    EXPECT_EQ(last, value);
  };
  step(1);
  const MemoryPoolStats after_first = memory_pool_stats(kDev);
  ASSERT_GE(after_first.reserved, bytes);
  reset_memory_pool_peaks(kDev);
  for (int i = 0; i < 6; ++i) {
    step(static_cast<unsigned char>(2 + i));
    EXPECT_EQ(memory_pool_stats(kDev).reserved, after_first.reserved) << "step " << i;
  }
  EXPECT_EQ(memory_pool_stats(kDev).peak_reserved, after_first.reserved) << "the pool grew within a step";
}

// Scratch from cuda_allocator() inside a global-mode capture (which fails on any host sync): the
// graph owns it, the pool's figures do not move, and every replay writes what the capture says.
TEST_F(MemoryPoolCuda, CapturedGraphWithScratchReplays) {
  const std::size_t bytes = 8 * kMiB;
  void* out = nullptr;
  test_cuda_check(cudaMalloc(&out, bytes), "cudaMalloc");
  std::vector<unsigned char> host(bytes);
  const MemoryPoolStats before = memory_pool_stats(kDev);

  cudaGraph_t graph = bench::capture_graph(s, [&] {
    void* scratch = alloc.allocate(bytes, s);
    test_cuda_check(cudaMemsetAsync(scratch, 0x3c, bytes, s), "cudaMemsetAsync");
    test_cuda_check(cudaMemcpyAsync(out, scratch, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
    alloc.free(scratch, s);
  });
  const bench::GraphNodeCounts nodes = bench::count_graph_nodes(graph);
  EXPECT_EQ(nodes.allocs, 1);
  EXPECT_EQ(nodes.frees, 1);
  cudaGraphExec_t exec = nullptr;
  test_cuda_check(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
  for (int replay = 0; replay < 3; ++replay) {
    test_cuda_check(cudaMemsetAsync(out, 0, bytes, s), "cudaMemsetAsync");
    test_cuda_check(cudaGraphLaunch(exec, s), "cudaGraphLaunch");
    test_cuda_check(cudaMemcpyAsync(host.data(), out, bytes, cudaMemcpyDeviceToHost, s), "cudaMemcpyAsync");
    sync();
    std::size_t wrong = 0;
    for (unsigned char v : host) wrong += v != 0x3c;
    EXPECT_EQ(wrong, 0u) << "replay " << replay;
  }
  const MemoryPoolStats after = memory_pool_stats(kDev);
  EXPECT_EQ(after.in_use, before.in_use) << "the graph's scratch counted as the pool's";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaFree(out);
}

TEST_F(MemoryPoolCuda, ADeviceThatDoesNotExistIsRefused) {
  int n = 0;
  test_cuda_check(cudaGetDeviceCount(&n), "cudaGetDeviceCount");
  GMOE_EXPECT_ERROR(memory_pool_stats(Device::cuda(n)), "CUDA device", "does not exist");
  GMOE_EXPECT_ERROR(trim_memory_pool(Device::cuda(-1)), "trim_memory_pool", "negative");
}

}  // namespace
}  // namespace gmoe::test
