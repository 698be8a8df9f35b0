// python/csrc/cuda_bridge.cpp — the CUDA side of Exec: torch's current stream, and gmoe's Allocator
// on torch's CUDA caching allocator. Compiled only when both gmoe and torch have CUDA.
//
// Allocations are made on the op's stream (raw_alloc_with_stream), so the caching allocator orders
// their reuse on that stream, and during CUDA graph capture they come from the graph's private pool:
// a captured gmoe op replays on the memory it was captured with, as torch's own ops do. gmoe's ops
// free their scratch on the stream they allocated it on, which is the case raw_delete is safe for.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include <memory>
#include <mutex>
#include <vector>

#include "torch_bridge.h"

namespace gmoe_torch {
namespace {

class TorchCudaAllocator final : public gmoe::Allocator {
 public:
  explicit TorchCudaAllocator(int index) : index_(index) {}
  void* allocate(std::size_t bytes, gmoe::Stream stream) override {
    if (bytes == 0) return nullptr;
    // gmoe::Stream and cudaStream_t are the same type (gmoe/stream.h).
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, stream);
  }
  void free(void* ptr, gmoe::Stream) override {
    if (ptr != nullptr) c10::cuda::CUDACachingAllocator::raw_delete(ptr);
  }
  gmoe::Device device() const override { return gmoe::Device::cuda(index_); }

 private:
  int index_;
};

gmoe::Allocator& allocator_for(c10::DeviceIndex index) {
  static std::mutex mutex;
  static std::vector<std::unique_ptr<TorchCudaAllocator>> per_device;
  std::lock_guard<std::mutex> lock(mutex);
  if (per_device.size() <= static_cast<std::size_t>(index)) per_device.resize(index + 1);
  if (!per_device[index]) per_device[index] = std::make_unique<TorchCudaAllocator>(index);
  return *per_device[index];
}

}  // namespace

Exec cuda_exec(c10::DeviceIndex index) {
  return Exec{c10::cuda::getCurrentCUDAStream(index).stream(), &allocator_for(index)};
}

}  // namespace gmoe_torch
