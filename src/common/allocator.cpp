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
    // 256-byte alignment, as the Allocator contract asks (what cudaMallocAsync gives): views
    // carved at 256-byte offsets, such as the packed gradients', stay aligned in absolute terms.
    std::size_t rounded = (bytes + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, rounded);
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
      stream_(other.stream_),
      used_on_(std::exchange(other.used_on_, {})) {}

Buffer& Buffer::operator=(Buffer&& other) noexcept {
  if (this != &other) {
    reset();
    alloc_ = std::exchange(other.alloc_, nullptr);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    stream_ = other.stream_;
    used_on_ = std::exchange(other.used_on_, {});
  }
  return *this;
}

Buffer::~Buffer() { reset(); }

void Buffer::reset() { reset_on(stream_); }

void Buffer::reset_on(Stream stream) {
  if (alloc_ != nullptr && ptr_ != nullptr) {
    // The free is stream-ordered on `stream`; the memory may be handed out again to work ordered
    // after it, so every other stream that used it must be joined into `stream` first.
    for (Stream used : used_on_) {
      if (used == stream) continue;
      Event done(alloc_->device());
      done.record(used);
      done.wait(stream);
    }
    alloc_->free(ptr_, stream);
  }
  ptr_ = nullptr;
  bytes_ = 0;
  used_on_.clear();
}

void Buffer::record_stream(Stream stream) {
  if (ptr_ == nullptr || stream == stream_) return;
  for (Stream used : used_on_) {
    if (used == stream) return;
  }
  used_on_.push_back(stream);
}

Tensor Tensor::empty(std::initializer_list<int64_t> shape, DType dtype, Allocator& alloc, Stream stream) {
  return empty(shape.begin(), static_cast<int>(shape.size()), dtype, alloc, stream);
}

Tensor Tensor::empty(const int64_t* shape, int ndim, DType dtype, Allocator& alloc, Stream stream) {
  GMOE_CHECK(ndim >= 0 && ndim <= TensorView::kMaxDims, "Tensor::empty: ", ndim, " dimensions");
  Tensor t;
  t.view_.dtype = dtype;
  t.view_.device = alloc.device();
  t.view_.ndim = ndim;
  int64_t n = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    GMOE_CHECK(shape[d] >= 0, "Tensor::empty: negative size ", shape[d]);
    t.view_.shape[d] = shape[d];
    t.view_.strides[d] = n;
    n *= shape[d];
  }
  t.buffer_ = Buffer(alloc, static_cast<std::size_t>(n) * dtype_size(dtype), stream);
  t.view_.data = t.buffer_.data();
  return t;
}

Tensor Tensor::wrap(const TensorView& view) {
  Tensor t;
  t.view_ = view;
  return t;
}

void Tensor::release_on(Stream stream) {
  buffer_.reset_on(stream);
  view_ = TensorView();
}

}  // namespace gmoe
