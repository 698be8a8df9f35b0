// src/common/memory_pool_backend.h — the CUDA backend's side of gmoe/memory_pool.h. Kept out of
// common/backend.h so that the pool's API does not rebuild every kernel that includes that header.
#pragma once

#include <cstddef>

#include "gmoe/memory_pool.h"

namespace gmoe::cuda_backend {

/// The statistics of gmoe's pool on CUDA device `device` (created on first use).
MemoryPoolStats memory_pool_stats(int device);
/// Resets that pool's peaks to its current figures.
void reset_memory_pool_peaks(int device);
/// cudaMemPoolTrimTo on that pool.
void trim_memory_pool(int device, std::size_t keep_bytes);

}  // namespace gmoe::cuda_backend
