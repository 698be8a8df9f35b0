// tools/bench/cuda_util.h — what the CUDA runners of gmoe-bench share: checked CUDA calls, device
// buffers, reproducible device-side input fills, the L2 rotation count, and CUDA-event timing
// (warm-up, then the median of runs each bracketed by its own events). Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "gmoe/dtype.h"
#include "gmoe/error.h"

#define BENCH_CUDA(call)                                                                       \
  do {                                                                                         \
    cudaError_t err_ = (call);                                                                 \
    GMOE_CHECK(err_ == cudaSuccess, #call " failed: ", cudaGetErrorString(err_));              \
  } while (0)

namespace gmoe::bench {

/// cudaMalloc'd memory, freed on destruction.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { BENCH_CUDA(cudaMalloc(&ptr, n > 0 ? n : 1)); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

/// A non-blocking stream, synchronised and destroyed on destruction. Declared before everything
/// that frees memory on it (gmoe's tensors free on their stream when destroyed), so that it is
/// destroyed after them: a free enqueued on a destroyed stream is undefined.
class BenchStream {
 public:
  BenchStream() { BENCH_CUDA(cudaStreamCreateWithFlags(&s_, cudaStreamNonBlocking)); }
  ~BenchStream() {
    cudaStreamSynchronize(s_);
    cudaStreamDestroy(s_);
  }
  BenchStream(const BenchStream&) = delete;
  BenchStream& operator=(const BenchStream&) = delete;
  operator cudaStream_t() const { return s_; }  // NOLINT: used wherever a stream is

 private:
  cudaStream_t s_ = nullptr;
};

/// Fills `n` bf16/f16 elements with uniform values in [-1, 1), reproducibly from (seed, index), on
/// the legacy default stream.
void fill_uniform(void* p, DType dt, int64_t n, uint64_t seed);

/// The same, uniform in [-a, a) (fill_uniform's values scaled by a).
void fill_uniform_scaled(void* p, DType dt, int64_t n, double a, uint64_t seed);

/// How many copies of a set of inputs of `set_bytes` to rotate through so that no timed run finds
/// its inputs in L2 (1 to 8, from the device's L2 size).
int rotation_sets(size_t set_bytes);

/// Median over `iters` timed runs (after `warmup`), each bracketed by its own events. run(i) gets
/// the run's index (to rotate inputs).
double time_ms(const std::function<void(int)>& run, int warmup, int iters, cudaStream_t stream, double warm_ms = 0);

/// The same for several functions timed in turn within each iteration (run 0, run 1, ..., run 0,
/// ...), so that clock and thermal drift during the measurement affect them alike: for ratios of
/// things measured in the same run. Returns each one's median.
/// warm_ms > 0: after the `warmup` rounds, more untimed rounds until that much wall-clock time of
/// back-to-back work has passed, so that the timed runs see the clocks of sustained load (an H100
/// running GEMMs back to back measured a lone GEMM 18% slower after a few hundred milliseconds
/// than in its first 60: power management lowers the clocks), whatever ran before.
std::vector<double> time_interleaved_ms(const std::vector<std::function<void(int)>>& runs, int warmup, int iters,
                                        cudaStream_t stream, double warm_ms = 0);

}  // namespace gmoe::bench
