// src/common/memory_pool.cpp — gmoe/memory_pool.h: the device's backend, or nothing for the CPU.
#include "gmoe/memory_pool.h"

#include "common/backend.h"
#include "common/memory_pool_backend.h"
#include "gmoe/error.h"

namespace gmoe {
namespace {

// The CUDA device's ordinal, after checking that the CUDA backend exists (the CPU returns false).
bool cuda_pool_device(Device device, const char* what) {
  if (device.is_cpu()) return false;
  GMOE_CHECK(cuda_backend::compiled(), what, "(", device.str(), "): gmoe was built without CUDA");
  GMOE_CHECK(device.index >= 0, what, ": negative CUDA device index ", device.index);
  return true;
}

}  // namespace

MemoryPoolStats memory_pool_stats(Device device) {
  if (!cuda_pool_device(device, "memory_pool_stats")) return {};
  return cuda_backend::memory_pool_stats(device.index);
}

void reset_memory_pool_peaks(Device device) {
  if (cuda_pool_device(device, "reset_memory_pool_peaks")) cuda_backend::reset_memory_pool_peaks(device.index);
}

void trim_memory_pool(Device device, std::size_t keep_bytes) {
  if (cuda_pool_device(device, "trim_memory_pool")) cuda_backend::trim_memory_pool(device.index, keep_bytes);
}

}  // namespace gmoe
