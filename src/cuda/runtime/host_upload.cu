// src/cuda/runtime/host_upload.cu — counts given on the host, uploaded stream-ordered from pinned
// memory (upload_counts in gmoe/copy.h): a process-wide pool of pinned staging blocks, each guarded
// by an event recorded behind the copy that reads it.
//
// Why a pool and not one static buffer: a copy from pinned memory runs later, on the stream; the
// block must stay unchanged until then. One shared buffer would be overwritten by the next call
// (another thread, another stream, or the same stream before the copy ran), and a pageable source
// would make cudaMemcpyAsync stage and synchronise behind the caller's back. A block goes back to the
// pool only once its event has completed; under graph capture the copy is a node replayed later, so
// the block is kept unchanged for the process's lifetime.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

constexpr std::size_t kMinBlockBytes = 4096;  // counts of up to 512 experts in i64 per block

struct StagingBlock {
  enum class State { free, held, pending, retired };
  void* host = nullptr;  // pinned (cudaHostAllocPortable: usable with every device)
  std::size_t bytes = 0;
  cudaEvent_t done = nullptr;  // recorded behind the copy that reads the block (state pending)
  State state = State::free;
};

class PinnedStagingPool {
 public:
  // A block of at least `bytes` held by the caller alone until release(). While the caller's
  // stream is capturing, pending blocks are not queried: cudaEventQuery is illegal during a
  // global-mode capture (it invalidates the capture), so only blocks already known free are taken.
  StagingBlock* acquire(std::size_t bytes, bool capturing) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const std::unique_ptr<StagingBlock>& b : blocks_) {
        if (b->bytes < bytes) continue;
        if (b->state == StagingBlock::State::pending && !capturing) {
          const cudaError_t q = cudaEventQuery(b->done);
          if (q == cudaErrorNotReady) continue;
          GMOE_CUDA_CHECK(q);
          b->state = StagingBlock::State::free;
        }
        if (b->state == StagingBlock::State::free) {
          b->state = StagingBlock::State::held;
          return b.get();
        }
      }
    }
    // Every fitting block is busy: a new one. cudaHostAlloc is not stream-ordered; inside a capture
    // it is made legal for this thread (relaxed mode) since it enqueues nothing.
    auto b = std::make_unique<StagingBlock>();
    b->bytes = std::max(bytes, kMinBlockBytes);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    GMOE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    const cudaError_t alloc = cudaHostAlloc(&b->host, b->bytes, cudaHostAllocPortable);
    const cudaError_t event = alloc == cudaSuccess ? cudaEventCreateWithFlags(&b->done, cudaEventDisableTiming) : alloc;
    GMOE_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode));
    GMOE_CUDA_CHECK(alloc);
    GMOE_CUDA_CHECK(event);
    b->state = StagingBlock::State::held;
    std::lock_guard<std::mutex> lock(mutex_);
    blocks_.push_back(std::move(b));
    return blocks_.back().get();
  }

  // After the copy from `b` was enqueued on `stream`: pending until the event behind it completes,
  // or retired when `stream` is capturing (the graph's replays read the block).
  void release(StagingBlock* b, cudaStream_t stream, bool capturing) {
    if (!capturing) GMOE_CUDA_CHECK(cudaEventRecord(b->done, stream));
    std::lock_guard<std::mutex> lock(mutex_);
    b->state = capturing ? StagingBlock::State::retired : StagingBlock::State::pending;
  }

 private:
  std::mutex mutex_;
  std::vector<std::unique_ptr<StagingBlock>> blocks_;  // never freed: pinned memory outlives graphs
};

PinnedStagingPool& staging_pool() {
  static PinnedStagingPool* pool = new PinnedStagingPool();  // leaked: no teardown after the CUDA runtime's
  return *pool;
}

thread_local const void* t_last_staging = nullptr;

}  // namespace

void upload_host_bytes(void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (bytes == 0) return;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  GMOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  const bool capturing = status != cudaStreamCaptureStatusNone;
  StagingBlock* b = staging_pool().acquire(bytes, capturing);
  std::memcpy(b->host, src, bytes);
  const cudaError_t copy = cudaMemcpyAsync(dst, b->host, bytes, cudaMemcpyHostToDevice, stream);
  staging_pool().release(b, stream, capturing);
  GMOE_CUDA_CHECK(copy);
  t_last_staging = b->host;
}

const void* last_upload_staging() { return t_last_staging; }

}  // namespace gmoe::cuda_backend
