// tools/bench/cuda_util.cu — the CUDA runners' shared helpers (see cuda_util.h).
#include "bench/cuda_util.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <chrono>

namespace gmoe::bench {
namespace {

__device__ uint64_t splitmix_d(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

template <typename T>
__global__ void fill_uniform_kernel(T* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const double u = double(splitmix_d(seed * 0x100000001b3ull + uint64_t(i)) >> 11) * (1.0 / 9007199254740992.0);
    p[i] = T(float(2.0 * u - 1.0));
  }
}

template <typename T>
__global__ void scale_kernel(T* p, int64_t n, float a) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    p[i] = T(a * float(p[i]));
  }
}

}  // namespace

void fill_uniform(void* p, DType dt, int64_t n, uint64_t seed) {
  if (n == 0) return;
  if (dt == DType::bf16) {
    fill_uniform_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  } else {
    fill_uniform_kernel<<<1024, 256>>>(static_cast<__half*>(p), n, seed);
  }
  BENCH_CUDA(cudaGetLastError());
}

void fill_uniform_scaled(void* p, DType dt, int64_t n, double a, uint64_t seed) {
  fill_uniform(p, dt, n, seed);
  if (n == 0) return;
  if (dt == DType::bf16) {
    scale_kernel<<<1024, 256>>>(static_cast<__nv_bfloat16*>(p), n, float(a));
  } else {
    scale_kernel<<<1024, 256>>>(static_cast<__half*>(p), n, float(a));
  }
  BENCH_CUDA(cudaGetLastError());
}

int rotation_sets(size_t set_bytes) {
  int device = 0, l2 = 0;
  BENCH_CUDA(cudaGetDevice(&device));
  BENCH_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  return static_cast<int>(std::clamp<size_t>((3 * size_t(l2)) / std::max<size_t>(set_bytes, 1) + 1, 1, 8));
}

std::vector<double> time_interleaved_ms(const std::vector<std::function<void(int)>>& runs, int warmup, int iters,
                                        cudaStream_t stream, double warm_ms) {
  GMOE_CHECK(iters >= 1, "timing needs at least one timed run, got ", iters);
  const size_t n = runs.size();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < warmup; ++i) {
    for (const auto& run : runs) run(i);
  }
  if (warm_ms > 0) {
    for (int i = warmup;; ++i) {
      BENCH_CUDA(cudaStreamSynchronize(stream));
      if (std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() >= warm_ms) break;
      for (const auto& run : runs) run(i);
    }
  }
  std::vector<cudaEvent_t> ev(2 * n * iters);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < iters; ++i) {
    for (size_t r = 0; r < n; ++r) {
      BENCH_CUDA(cudaEventRecord(ev[2 * (i * n + r)], stream));
      runs[r](i);
      BENCH_CUDA(cudaEventRecord(ev[2 * (i * n + r) + 1], stream));
    }
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<double> medians(n);
  for (size_t r = 0; r < n; ++r) {
    std::vector<float> ms(iters);
    for (int i = 0; i < iters; ++i) {
      BENCH_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * (i * n + r)], ev[2 * (i * n + r) + 1]));
    }
    std::sort(ms.begin(), ms.end());
    medians[r] = ms[iters / 2];
  }
  for (auto& e : ev) cudaEventDestroy(e);
  return medians;
}

double time_ms(const std::function<void(int)>& run, int warmup, int iters, cudaStream_t stream, double warm_ms) {
  return time_interleaved_ms({run}, warmup, iters, stream, warm_ms)[0];
}

}  // namespace gmoe::bench
