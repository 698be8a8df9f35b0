// tools/bench/runner.h — running one suite case on a backend: correctness first, then timing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/results.h"
#include "bench/suite.h"
#include "gmoe/dtype.h"

namespace gmoe::bench {

struct BenchOptions {
  DType dtype = DType::bf16;
  int warmup = 3;        ///< untimed runs before timing
  int iters = 30;        ///< timed runs; the median is reported (>= 20 on the GPU)
  int samples = 256;     ///< sampled elements per correctness check
  uint64_t seed = 1;
  bool baselines = true; ///< also time cuBLAS dense and the per-expert cuBLAS loop (GPU)
};

/// CPU reference backend on the case as given (the caller scales rows down first). Wall-clock
/// timing, no baselines.
std::vector<ResultRow> run_gemm_case_cpu(const BenchCase& c, const BenchOptions& o);

/// True when a CUDA device is usable; `name` gets its name.
bool cuda_available(std::string* name);
/// CUDA backend with CUDA-event timing, and in the same run the cuBLAS baselines.
std::vector<ResultRow> run_gemm_case_cuda(const BenchCase& c, const BenchOptions& o);

}  // namespace gmoe::bench
