// src/cuda/runtime/offload_copy.cu — the CUDA side of activation offloading (gmoe/offload.h): the
// pinned host chunks of the pool and the stream-ordered copies between them and the device.
#include <cuda_runtime.h>

#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"

namespace gmoe::cuda_backend {

void* host_alloc_pinned(std::size_t bytes) {
  void* p = nullptr;
  // Portable: the pool may serve copies issued while another device is current.
  GMOE_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable));
  return p;
}

void host_free_pinned(void* ptr) {
  // Called from destructors: a failure is not thrown (the process is tearing the pool down).
  if (ptr != nullptr) cudaFreeHost(ptr);
}

void copy_bytes_async(void* dst, const void* src, std::size_t bytes, Stream stream) {
  // cudaMemcpyDefault: unified addressing tells host from device, so one call serves both
  // directions; with pinned host memory the copy is asynchronous and a graph memcpy node.
  if (bytes != 0) GMOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

}  // namespace gmoe::cuda_backend
