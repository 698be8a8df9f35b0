// src/cuda/runtime/cuda_runtime.cu — the CUDA backend's runtime pieces: compiled(), the stream-ordered
// allocator (cudaMallocFromPoolAsync / cudaFreeAsync on gmoe's own pool per device: graph-capturable),
// the pool's statistics and trim (gmoe/memory_pool.h), and cached device properties.
#include <cuda_runtime.h>

#include <array>
#include <atomic>
#include <cstdint>
#include <mutex>

#include "common/backend.h"
#include "common/memory_pool_backend.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kMaxCachedDevices = 64;

// Lets the calling thread make calls that global-mode stream capture forbids while another stream
// is captured (creating a pool enqueues nothing), for its lifetime.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { GMOE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }  // a destructor must not throw
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// gmoe's pool on CUDA device `device`, made on first use and kept for the life of the process
// (destroying it at exit would race CUDA's own teardown). Its own pool, not the device's default
// one: the default pool is process-global state that other code configures, and its release
// threshold of 0 hands every freed byte back to the device at each synchronisation, so a loop that
// syncs once per step maps its scratch again every step. This pool's threshold is the largest
// possible: freed memory stays cached for reuse (what PyTorch's caching allocator does) until
// trim_memory_pool() gives it back.
cudaMemPool_t device_pool(int device) {
  GMOE_CHECK(device >= 0 && device < kMaxCachedDevices, "CUDA device ", device,
             " out of the supported range [0, ", kMaxCachedDevices, ")");
  static std::array<std::atomic<cudaMemPool_t>, kMaxCachedDevices> pools{};
  static std::mutex making;
  cudaMemPool_t pool = pools[device].load(std::memory_order_acquire);
  if (pool != nullptr) return pool;
  std::lock_guard<std::mutex> lock(making);
  pool = pools[device].load(std::memory_order_acquire);
  if (pool == nullptr) {
    int count = 0;
    GMOE_CUDA_CHECK(cudaGetDeviceCount(&count));
    GMOE_CHECK(device < count, "CUDA device ", device, " does not exist (", count, " visible)");
    RelaxedCaptureMode relaxed;
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    GMOE_CUDA_CHECK(cudaMemPoolCreate(&pool, &props));
    std::uint64_t keep_all = UINT64_MAX;
    GMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
    pools[device].store(pool, std::memory_order_release);
  }
  return pool;
}

std::size_t pool_attribute(cudaMemPool_t pool, cudaMemPoolAttr attr) {
  std::uint64_t v = 0;
  GMOE_CUDA_CHECK(cudaMemPoolGetAttribute(pool, attr, &v));
  return static_cast<std::size_t>(v);
}

// Stream-ordered allocation from gmoe's pool of the current device. Inside stream capture both
// calls become graph memory nodes (the graph, not the pool, then owns the memory), so scratch taken
// and released within one op is replayable.
class CudaPoolAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Stream stream) override {
    if (bytes == 0) return nullptr;
    void* p = nullptr;
    GMOE_CUDA_CHECK(cudaMallocFromPoolAsync(&p, bytes, device_pool(current_device()), stream));
    return p;
  }
  void free(void* ptr, Stream stream) override {
    if (ptr != nullptr) GMOE_CUDA_CHECK(cudaFreeAsync(ptr, stream));
  }
  Device device() const override { return Device::cuda(current_device()); }
};

}  // namespace

bool compiled() { return true; }

Allocator& allocator() {
  static CudaPoolAllocator instance;
  return instance;
}

MemoryPoolStats memory_pool_stats(int device) {
  const cudaMemPool_t pool = device_pool(device);
  MemoryPoolStats s;
  s.in_use = pool_attribute(pool, cudaMemPoolAttrUsedMemCurrent);
  s.reserved = pool_attribute(pool, cudaMemPoolAttrReservedMemCurrent);
  s.peak_in_use = pool_attribute(pool, cudaMemPoolAttrUsedMemHigh);
  s.peak_reserved = pool_attribute(pool, cudaMemPoolAttrReservedMemHigh);
  return s;
}

void reset_memory_pool_peaks(int device) {
  const cudaMemPool_t pool = device_pool(device);
  std::uint64_t zero = 0;  // the only value these attributes take: resets them to the current figure
  GMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
  GMOE_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
}

void trim_memory_pool(int device, std::size_t keep_bytes) {
  GMOE_CUDA_CHECK(cudaMemPoolTrimTo(device_pool(device), keep_bytes));
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
