// gmoe/offload.h — offloading the expert layers' saved activations to pinned host memory between
// forward and backward, overlapped with compute.
//
// A layer context (GroupedLinearContext, GroupedMLPContext, MoELayerContext) holds what forward
// saved for backward (and backward for a delayed backward_dw): copies of inputs, FP8 columnwise
// copies and their scales, the MLP's h and z, the router's ids/probs/counts and the permutation
// map. Weights, main_grad and the tensors a context keeps by reference (the caller's) are never
// moved. Each context goes through four steps, all stream-ordered, none synchronising the host,
// all capturable in a CUDA graph:
//
//   offload(off, s)   the copy stream waits for the work on s so far, then copies every saved
//                     allocation to host memory from off's pool (the device memory is still held)
//   release(s)        s waits for those copies (an event); the device memory is freed on s
//   prefetch(s)       device memory again from off's allocator on s; the copy stream waits for s,
//                     copies the data back, and every view into the saved memory is re-pointed
//   reload(s)         prefetch if not done; s waits for the copies: the context is as it was
//
// The device memory is freed on the compute stream, after that stream waited for the copies, so
// that any allocator (PyTorch's caching one frees to the stream a block was made on) sees the
// block idle. release() is a separate step so that the copies of layer i overlap the compute of
// layer i+1: release layer i after layer i+1's forward is enqueued (OffloadScheduler does).
// On the CPU backend the copies are host copies done when the call returns, so that the logic
// (what is saved, what comes back, in which state) is tested everywhere.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "gmoe/allocator.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// A reusable pool of host memory for offloaded activations: pinned (cudaHostAlloc) for a CUDA
/// device, so that copies run at full PCIe bandwidth and asynchronously; plain host memory for the
/// CPU. Grows by whole chunks when no free run fits (a cudaHostAlloc, which is slow and not
/// capturable: reserve() before capturing a graph) and never shrinks while it lives: after the
/// first step every later one reuses the same chunks. Blocks are handed out first-fit, 256-byte
/// aligned, and coalesce when freed. Reuse of a freed block is ordered by the one copy stream of
/// the Offloader that owns the pool (every copy into or out of it runs there). Not thread-safe.
class PinnedHostPool {
 public:
  /// A pool for copies to and from `device`; new chunks hold at least `min_chunk_bytes`.
  explicit PinnedHostPool(Device device, std::size_t min_chunk_bytes = std::size_t(64) << 20);
  ~PinnedHostPool();
  PinnedHostPool(const PinnedHostPool&) = delete;
  PinnedHostPool& operator=(const PinnedHostPool&) = delete;

  /// A block of `bytes` (0: nullptr). Grows the pool when no free run fits.
  void* allocate(std::size_t bytes);
  /// Returns a block from allocate() (nullptr: no-op). Throws gmoe::Error for a foreign pointer.
  void free(void* ptr);
  /// Makes sure one free run of `bytes` exists (grows now if not): call before a graph capture.
  void reserve(std::size_t bytes);
  /// Host bytes held in chunks.
  std::size_t capacity_bytes() const;
  /// Bytes in blocks handed out now (rounded to the alignment).
  std::size_t used_bytes() const { return used_; }
  /// The most used_bytes() has been.
  std::size_t peak_used_bytes() const { return peak_used_; }
  /// Chunks allocated so far (each one a cudaHostAlloc on CUDA): flat after the first step.
  int64_t chunk_allocations() const { return chunk_allocations_; }
  /// The device the pool serves.
  Device device() const { return device_; }

 private:
  struct Chunk;
  Chunk& grow(std::size_t bytes);
  Device device_;
  std::size_t min_chunk_;
  std::vector<std::unique_ptr<Chunk>> chunks_;
  std::size_t used_ = 0, peak_used_ = 0;
  int64_t chunk_allocations_ = 0;
};

/// What offloads run on: one copy stream (distinct from the compute streams; nullptr on the CPU),
/// a PinnedHostPool it owns, and the allocator that reloaded tensors come from. It must outlive
/// every context offloaded with it (a context not yet reloaded holds blocks of its pool).
class Offloader {
 public:
  /// For `device`; `copy_stream`: the stream of every copy (a CUDA stream the caller made and keeps
  /// alive; must not be the compute stream). allocator: nullptr: the device's default allocator.
  /// min_chunk_bytes: the pool's (see PinnedHostPool).
  Offloader(Device device, Stream copy_stream, Allocator* allocator = nullptr,
            std::size_t min_chunk_bytes = std::size_t(64) << 20);
  /// The device.
  Device device() const { return device_; }
  /// The copy stream.
  Stream copy_stream() const { return copy_stream_; }
  /// The host pool.
  PinnedHostPool& pool() { return pool_; }
  /// Where reloaded tensors come from.
  Allocator& allocator() const;
  /// Bytes copied to the host so far.
  int64_t bytes_offloaded() const { return bytes_offloaded_; }
  /// Bytes copied back to the device so far.
  int64_t bytes_reloaded() const { return bytes_reloaded_; }

 private:
  friend class Offloadable;
  Device device_;
  Stream copy_stream_;
  Allocator* allocator_;
  PinnedHostPool pool_;
  int64_t bytes_offloaded_ = 0, bytes_reloaded_ = 0;
};

/// Where a context's saved tensors are.
enum class OffloadState : uint8_t {
  resident,   ///< on the device, usable (the only state backward and backward_dw accept)
  offloading, ///< copies to the host issued; the device memory still held
  offloaded,  ///< on the host only; the device memory released
  reloading,  ///< copies back issued; reload() makes the compute stream wait for them
};

/// "resident", "offloading", "offloaded", "reloading".
const char* offload_state_name(OffloadState state);

/// The collection of what one context saves (internal: filled by each context).
struct OffloadSlots;

/// The offload steps shared by every layer context (see the top of this file). A context that has
/// been offloaded must be reload()ed before backward or backward_dw (they throw gmoe::Error
/// otherwise), and before its next forward. The views a forward returned of the context's own
/// tensors (MoEForward's ids, probs, counts) are not valid from release() to reload().
class Offloadable {
 public:
  Offloadable();
  virtual ~Offloadable();
  Offloadable(Offloadable&&) noexcept;
  Offloadable& operator=(Offloadable&&) noexcept;

  /// Starts copying the saved allocations to `off`'s pool on its copy stream, after the work enqueued
  /// on `stream` so far. Needs state resident; a context with nothing saved stays resident.
  void offload(Offloader& off, Stream stream);
  /// `stream` waits for the copies of offload(); the device memory is freed on `stream`. Needs
  /// state offloading.
  void release(Stream stream);
  /// Starts bringing the saved allocations back: memory from the offloader's allocator on `stream`,
  /// the copies on the copy stream after the work enqueued on `stream` so far. From offloading (not
  /// released) nothing is copied back. No-op when resident or already reloading.
  void prefetch(Stream stream);
  /// prefetch(stream) if needed, then `stream` waits for the copies back: state resident.
  void reload(Stream stream);
  /// The current state.
  OffloadState offload_state() const;
  /// Bytes offload() would copy now (what the context owns of what it saved).
  std::size_t offloadable_bytes();

 protected:
  /// Adds every allocation the context owns for backward/backward_dw, and every view that may
  /// point into one of them, to `slots`.
  virtual void collect(OffloadSlots& slots) = 0;
  /// Throws gmoe::Error unless resident (for backward, backward_dw and forward).
  void check_resident(const char* what) const;

 private:
  friend struct OffloadSlots;
  struct Record;
  std::unique_ptr<Record> record_;
};

/// Options of an OffloadScheduler.
struct OffloadSchedulerOptions {
  int num_layers = 0;            ///< layers in the stack, numbered 0 .. num_layers-1 in forward order
  /// Layers whose reload is started ahead of the backward that needs them (>= 1): when layer i's
  /// backward begins, layers i-1 .. i-reload_ahead are being brought back. Each one holds its
  /// device memory from then on, so more is faster where copies are slower, and uses more memory.
  int reload_ahead = 1;
  /// The last layer's activations stay on the device (its backward comes first, right after its
  /// forward: there is nothing to overlap the copies with).
  bool keep_last_layer = true;
  /// Per-layer opt-out: empty (every layer offloads), or num_layers flags, false = stays on the device.
  std::vector<bool> offload_layer;
};

/// Offloads a stack of layers: layer i's copies overlap layer i+1's forward; in backward, layers
/// come back in reverse order, reload_ahead of them in flight. Reusable for every step (the pool
/// grows on the first step only). Calls, for each step:
///   forward:   forward of layer i, then forward_done(i, ctx_i, s), for i = 0 .. N-1; forward_end(s)
///   backward:  backward_begin(i, s), then backward of layer i, for i = N-1 .. 0
/// Delayed weight gradients: backward_dw after backward finds the context resident (reload brought
/// back everything backward_dw reads); offloading again between the two is the context's own
/// offload/release/reload.
class OffloadScheduler {
 public:
  /// Throws gmoe::Error on options that do not fit num_layers.
  OffloadScheduler(Offloader& offloader, OffloadSchedulerOptions options);
  /// Whether layer `layer` is offloaded (not opted out, not the kept last layer).
  bool offloads(int layer) const;
  /// After layer `layer`'s forward is enqueued on `stream`: starts its offload and releases the
  /// previous offloaded layer (whose copies overlapped this forward).
  void forward_done(int layer, Offloadable& ctx, Stream stream);
  /// After the last forward: releases what is still held.
  void forward_end(Stream stream);
  /// Before layer `layer`'s backward: `stream` waits for its reload; the reloads of the next
  /// reload_ahead layers are started.
  void backward_begin(int layer, Stream stream);
  /// The options.
  const OffloadSchedulerOptions& options() const { return options_; }

 private:
  Offloader* offloader_;
  OffloadSchedulerOptions options_;
  std::vector<Offloadable*> ctx_;
  int pending_release_ = -1;
};

}  // namespace gmoe
