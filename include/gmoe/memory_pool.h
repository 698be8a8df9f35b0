// gmoe/memory_pool.h — the memory pool behind cuda_allocator(): its statistics and the release of
// its cached memory.
//
// cuda_allocator() takes its memory from a pool that gmoe creates for each CUDA device (never the
// device's default pool, which other code in the process may configure). Freed memory stays cached
// in the pool, as in PyTorch's caching allocator: a stream or event synchronisation does not give it
// back to the device, so a loop that allocates, frees and syncs every step reuses the same memory
// instead of mapping it again. trim_memory_pool() gives cached memory back on request.
//
// Allocations made while a stream is captured into a CUDA graph belong to the graph, not the pool
// (CUDA's rule for stream-ordered allocation during capture), and are not counted here.
#pragma once

#include <cstddef>

#include "gmoe/tensor.h"

namespace gmoe {

/// What gmoe's pool on one device holds, in bytes.
struct MemoryPoolStats {
  std::size_t in_use = 0;         ///< handed out by cuda_allocator() and not yet freed
  std::size_t reserved = 0;       ///< taken from the device: in use plus cached for reuse
  std::size_t peak_in_use = 0;    ///< the most in use since the pool was made or its peaks reset
  std::size_t peak_reserved = 0;  ///< the most reserved since the pool was made or its peaks reset
};

/// The statistics of gmoe's pool on `device`. A stream-ordered free counts as done once the work
/// before it has completed, so read after a synchronisation for exact figures. The CPU: all zero
/// (the host allocator caches nothing). Throws gmoe::Error for a CUDA device when gmoe was built
/// without CUDA, or for a device that does not exist.
MemoryPoolStats memory_pool_stats(Device device);

/// Resets the peaks of gmoe's pool on `device` to the current figures. The CPU: a no-op. Throws as
/// memory_pool_stats() does.
void reset_memory_pool_peaks(Device device);

/// Gives memory cached by gmoe's pool on `device` back to the device until the pool reserves at most
/// `keep_bytes` (never memory in use). Memory whose stream-ordered free the host has not yet seen
/// complete may stay reserved: synchronise the streams that freed it first. Not on the hot path (it
/// makes the next allocations map memory again). The CPU: a no-op. Throws as memory_pool_stats()
/// does.
void trim_memory_pool(Device device, std::size_t keep_bytes = 0);

}  // namespace gmoe
