// src/cuda/runtime/cuda_runtime.cu — the CUDA backend's runtime pieces: compiled(), the stream-ordered
// allocator (cudaMallocAsync / cudaFreeAsync: graph-capturable), and cached device properties.
#include <cuda_runtime.h>

#include <array>
#include <atomic>

#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

// cudaMallocAsync from the device's default memory pool. Inside stream capture both calls become
// graph memory nodes, so scratch taken and released within one op is replayable.
class CudaAsyncAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Stream stream) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    GMOE_CUDA_CHECK(cudaMallocAsync(&p, bytes, stream));
    return p;
  }
  void free(void* ptr, Stream stream) override {
    if (ptr != nullptr) GMOE_CUDA_CHECK(cudaFreeAsync(ptr, stream));
  }
  Device device() const override { return Device::cuda(current_device()); }
};

constexpr int kMaxCachedDevices = 64;

}  // namespace

bool compiled() { return true; }

Allocator& allocator() {
  static CudaAsyncAllocator instance;
  return instance;
}

int current_device() {
  int device = 0;
  GMOE_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

namespace {

// A positive integer attribute of CUDA device `device`, read on first use and cached per device
// and attribute slot (0 = not read yet; racing first readers store the same value).
template <int kSlot>
int cached_attribute(int device, cudaDeviceAttr attr, const char* what) {
  GMOE_CHECK(device >= 0 && device < kMaxCachedDevices, "CUDA device ", device,
             " out of the supported range [0, ", kMaxCachedDevices, ")");
  static std::array<std::atomic<int>, kMaxCachedDevices> cache{};
  int n = cache[device].load(std::memory_order_relaxed);
  if (n == 0) {
    GMOE_CUDA_CHECK(cudaDeviceGetAttribute(&n, attr, device));
    GMOE_CHECK(n > 0, "CUDA device ", device, " reports ", n, " ", what);
    cache[device].store(n, std::memory_order_relaxed);
  }
  return n;
}

}  // namespace

int sm_count(int device) { return cached_attribute<0>(device, cudaDevAttrMultiProcessorCount, "multiprocessors"); }

int64_t l2_bytes(int device) { return cached_attribute<1>(device, cudaDevAttrL2CacheSize, "bytes of L2 cache"); }

DeviceGuard::DeviceGuard(int device) {
  const int now = current_device();
  if (now != device) {
    GMOE_CUDA_CHECK(cudaSetDevice(device));
    previous_ = now;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);  // a destructor must not throw
}

}  // namespace gmoe::cuda_backend
