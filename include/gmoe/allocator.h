// gmoe/allocator.h — stream-ordered memory allocation, and owning buffers built on it.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Stream-ordered allocator. allocate() returns memory usable by work enqueued on `stream` after
/// the call; free() releases it after all work enqueued on `stream` before the call. Every scratch
/// buffer of every op comes from here, so a framework (PyTorch) can plug in its own caching
/// allocator and keep track of all memory. Implementations must be usable during CUDA graph
/// capture if ops are to be captured (cudaMallocAsync and cudaMallocFromPoolAsync are).
class Allocator {
 public:
  virtual ~Allocator() = default;
  /// Allocates `bytes` (may be 0: returns nullptr) on `stream`, aligned to at least 256 bytes
  /// (cudaMallocAsync's and PyTorch's caching allocator's alignment; views carved at 256-byte
  /// offsets of one allocation, as the packed gradients are, rely on it). Throws gmoe::Error on
  /// failure.
  virtual void* allocate(std::size_t bytes, Stream stream) = 0;
  /// Frees a pointer returned by allocate() on `stream` (nullptr is a no-op).
  virtual void free(void* ptr, Stream stream) = 0;
  /// The device the memory lives on.
  virtual Device device() const = 0;
};

/// Process-wide host allocator (aligned malloc; stream ignored).
Allocator& host_allocator();

/// Process-wide allocator for the current CUDA device: cudaMallocFromPoolAsync/cudaFreeAsync on a
/// pool gmoe owns per device, which keeps freed memory cached across synchronisations
/// (graph-capturable; its statistics and trim: gmoe/memory_pool.h). Throws gmoe::Error if gmoe was
/// built without CUDA.
Allocator& cuda_allocator();

/// The default allocator for a device: host_allocator() for the CPU, cuda_allocator() for CUDA.
Allocator& default_allocator(Device device);

/// An owning buffer from an Allocator, released on the stream it was made on (or on the stream
/// given to reset_on()). Memory used on other streams too is marked with record_stream(): the free
/// then waits (stream-ordered, through events; no host sync) for the work enqueued on each of them
/// up to the free, so a stream-ordered allocator cannot hand the memory out again while one of them
/// may still read or write it. Move-only.
class Buffer {
 public:
  /// No memory.
  Buffer() = default;
  /// `bytes` from `alloc` on `stream`.
  Buffer(Allocator& alloc, std::size_t bytes, Stream stream);
  Buffer(Buffer&& other) noexcept;
  Buffer& operator=(Buffer&& other) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer();

  void* data() const { return ptr_; }            ///< the memory (nullptr when none)
  std::size_t bytes() const { return bytes_; }  ///< its size
  /// Frees now (stream-ordered on the stream it was made on).
  void reset();
  /// Frees now, ordered on `stream` instead: for memory last used on another stream than the one
  /// it was made on (the caller has ordered that stream after every use, except on the streams
  /// recorded with record_stream(), which the free waits for).
  void reset_on(Stream stream);
  /// Marks the memory as used by work on `stream` (PyTorch's record_stream): when it is freed, an
  /// event is recorded on `stream` at that moment and the free is ordered after it. Recording the
  /// stream that frees, or a stream twice, does nothing more. Capturable in a CUDA graph when
  /// `stream` is part of the same capture.
  void record_stream(Stream stream);
  /// The streams recorded with record_stream() (besides the one the buffer was made on).
  const std::vector<Stream>& recorded_streams() const { return used_on_; }

 private:
  Allocator* alloc_ = nullptr;
  void* ptr_ = nullptr;
  std::size_t bytes_ = 0;
  Stream stream_ = nullptr;
  std::vector<Stream> used_on_;  // record_stream()'s streams
};

/// A tensor that may own its memory: either an allocation from an Allocator (Tensor::empty) or a
/// non-owning wrapper of a caller's view (Tensor::wrap). Ops that can write into caller-provided
/// outputs return one of these either way. Move-only.
class Tensor {
 public:
  /// An absent tensor.
  Tensor() = default;
  /// A contiguous tensor of `shape` from `alloc` on `stream` (contents undefined).
  static Tensor empty(std::initializer_list<int64_t> shape, DType dtype, Allocator& alloc, Stream stream);
  /// The same with the shape as an array of `ndim` sizes.
  static Tensor empty(const int64_t* shape, int ndim, DType dtype, Allocator& alloc, Stream stream);
  /// A non-owning wrapper of `view`.
  static Tensor wrap(const TensorView& view);

  /// The view (absent for an absent tensor).
  const TensorView& view() const { return view_; }
  /// The view, so that a Tensor passes wherever a TensorView is taken.
  operator const TensorView&() const { return view_; }
  /// True when made by empty() with memory (not a wrap()).
  bool owns_memory() const { return buffer_.data() != nullptr; }
  /// Frees owned memory ordered on `stream` (see Buffer::reset_on); the view becomes absent.
  void release_on(Stream stream);

 private:
  Buffer buffer_;
  TensorView view_;
};

}  // namespace gmoe
