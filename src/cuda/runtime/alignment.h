// src/cuda/runtime/alignment.h — the address test the CUDA backend's vector paths and checks share.
#pragma once

#include <cstddef>
#include <cstdint>

namespace gmoe::cuda_backend {

/// True when `p` is a multiple of `a` bytes (16 for the 16-byte load/store paths).
inline bool aligned(const void* p, std::size_t a) { return reinterpret_cast<std::uintptr_t>(p) % a == 0; }

}  // namespace gmoe::cuda_backend
