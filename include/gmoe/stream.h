// gmoe/stream.h — the stream handle every op takes, and the events that order work across streams,
// without pulling CUDA headers into users' code.
#pragma once

#include "gmoe/tensor.h"

// The CUDA runtime declares `typedef struct CUstream_st* cudaStream_t;`. Declaring the same
// incomplete struct here makes gmoe::Stream the very same type as cudaStream_t, so callers pass
// their CUDA streams directly while the public headers stay free of CUDA includes.
struct CUstream_st;

namespace gmoe {

/// A CUDA stream (cudaStream_t). nullptr is the legacy default stream; CPU-backend ops ignore it.
using Stream = CUstream_st*;

/// An event that orders work on one stream after work enqueued on another, for a device: on CUDA a
/// cudaEvent_t made without timing (cudaEventDisableTiming), created with the object and destroyed
/// with it; on the CPU, where every op has finished when it returns, record() and wait() do nothing.
/// Both are capturable in a CUDA graph (they become the graph's dependency edges) and never
/// synchronise with the host. Move-only.
class Event {
 public:
  /// No event: defined() is false; record() and wait() throw gmoe::Error.
  Event() = default;
  /// An event for work on `device`. Throws gmoe::Error for a CUDA device in a build without CUDA.
  explicit Event(Device device);
  ~Event();
  Event(Event&& other) noexcept;
  Event& operator=(Event&& other) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  /// True for an event made by Event(device).
  bool defined() const { return defined_; }
  /// The device the event was made for (the CPU when not defined()).
  Device device() const { return device_; }
  /// Captures the work enqueued on `stream` so far (cudaEventRecord).
  void record(Stream stream);
  /// Makes work enqueued on `stream` after this call wait for the work captured by the last
  /// record() (cudaStreamWaitEvent; without a record() before, it waits for nothing).
  void wait(Stream stream) const;

 private:
  Device device_{};
  bool defined_ = false;
  void* handle_ = nullptr;  // the cudaEvent_t on CUDA
};

/// Blocks the host until every op enqueued on `stream` for `device` has finished: a deliberate sync
/// for set-up code (never on the hot path: it fails a CUDA graph capture). A no-op for the CPU;
/// throws gmoe::Error for a CUDA device in a build without CUDA.
void synchronize_stream(Stream stream, Device device);

}  // namespace gmoe
