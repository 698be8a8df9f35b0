// tests/cpu/test_memory_pool_cpu.cpp — gmoe/memory_pool.h on the CPU: the host allocator caches
// nothing, so its figures are zero and its peaks reset and trim do nothing, even with host memory
// allocated; in a build without CUDA, a CUDA device is refused by name.
#include <gtest/gtest.h>

#include "common/expect_error.h"
#include "gmoe/allocator.h"
#include "gmoe/memory_pool.h"

namespace gmoe::test {
namespace {

TEST(MemoryPoolCpu, HostFiguresAreZeroAndTheCallsDoNothing) {
  Buffer held(host_allocator(), std::size_t(1) << 20, nullptr);
  ASSERT_NE(held.data(), nullptr);
  const MemoryPoolStats s = memory_pool_stats(Device::cpu());
  EXPECT_EQ(s.in_use, 0u);
  EXPECT_EQ(s.reserved, 0u);
  EXPECT_EQ(s.peak_in_use, 0u);
  EXPECT_EQ(s.peak_reserved, 0u);
  reset_memory_pool_peaks(Device::cpu());
  trim_memory_pool(Device::cpu());
  trim_memory_pool(Device::cpu(), 123);
  EXPECT_EQ(memory_pool_stats(Device::cpu()).reserved, 0u);
}

TEST(MemoryPoolCpu, CudaDeviceWithoutCuda) {
#ifdef GMOE_WITH_CUDA
  GTEST_SKIP() << "built with CUDA: tests/cuda/test_memory_pool_cuda.cpp covers CUDA devices";
#else
  GMOE_EXPECT_ERROR(memory_pool_stats(Device::cuda(0)), "memory_pool_stats", "cuda:0", "built without CUDA");
  GMOE_EXPECT_ERROR(reset_memory_pool_peaks(Device::cuda(1)), "reset_memory_pool_peaks", "built without CUDA");
  GMOE_EXPECT_ERROR(trim_memory_pool(Device::cuda(0)), "trim_memory_pool", "built without CUDA");
#endif
}

}  // namespace
}  // namespace gmoe::test
