// src/common/allocator.cpp — host allocator, default-allocator dispatch and Buffer.
#include "gmoe/allocator.h"

#include <cstdlib>
#include <utility>

#include "common/backend.h"
#include "gmoe/error.h"

namespace gmoe {
namespace {

class HostAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Stream) override {
    if (bytes == 0) return nullptr;
    // 64-byte alignment: cache lines, and more than any vector load needs.
    std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded);
    GMOE_CHECK(p != nullptr, "host allocation of ", bytes, " bytes failed");
    return p;
  }
  void free(void* ptr, Stream) override { std::free(ptr); }
  Device device() const override { return Device::cpu(); }
};

}  // namespace

Allocator& host_allocator() {
  static HostAllocator instance;
  return instance;
}

Allocator& cuda_allocator() {
  GMOE_CHECK(cuda_backend::compiled(), "cuda_allocator(): gmoe was built without CUDA");
  return cuda_backend::allocator();
}

Allocator& default_allocator(Device device) {
  return device.is_cpu() ? host_allocator() : cuda_allocator();
}

Buffer::Buffer(Allocator& alloc, std::size_t bytes, Stream stream)
    : alloc_(&alloc), ptr_(alloc.allocate(bytes, stream)), bytes_(bytes), stream_(stream) {}

Buffer::Buffer(Buffer&& other) noexcept
    : alloc_(std::exchange(other.alloc_, nullptr)),
      ptr_(std::exchange(other.ptr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      stream_(other.stream_) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    alloc_ = std::exchange(other.alloc_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = other.stream_;
  }
  return *this;
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() {
  if (alloc_ != nullptr && ptr_ != nullptr) alloc_->free(ptr_, stream_);
  ptr_ = nullptr;
  bytes_ = 0;
}

}  // namespace gmoe
