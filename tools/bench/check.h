// tools/bench/check.h — correctness before timing: sampled fp64 checks of a pass's output.
//
// A few hundred output elements, chosen at random across every expert, are recomputed exactly
// (fp64) and in the kernel's own precision (f32 sequential accumulation, rounded to the output
// dtype). The pass is correct when its largest sampled error is at most twice the own-precision
// reference's plus one rounding unit at the outputs' RMS (DESIGN.md's rule, on a sample; f32
// outputs also get the CUDA tests' allowance for the accumulation order, 4·√L·2⁻²⁴·max|exact| over
// the longest reduction L), and when no output element anywhere is non-finite (outputs are
// poisoned with NaN before the run).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/suite.h"
#include "gmoe/dtype.h"

namespace gmoe::bench {

/// Host copies of a gemm case's inputs (row-major, dtype bf16/f16).
struct GemmHostData {
  DType dtype = DType::bf16;
  int64_t E = 0, rows = 0, N = 0, K = 0;
  std::vector<int64_t> offsets;  ///< E + 1 prefix sums of the counts
  const void* x = nullptr;       ///< [rows, K]
  const void* w = nullptr;       ///< [E, N, K]
  const void* dy = nullptr;      ///< [rows, N]
  /// Optional [E, N] bias of a layer (dtype bias_dtype): fprop then checks y = x·W_eᵀ + b_e, the
  /// bias added to the f32 accumulator before the output's one rounding.
  const void* bias = nullptr;
  DType bias_dtype = DType::bf16;
};

struct CheckResult {
  bool ok = false;
  std::string detail;
};

/// pass: "fprop" (out [rows, N]), "dgrad" (out [rows, K]), "wgrad" (out [E, N, K]) or
/// "bias_grad" (out [E, N]: db_e = Σ over the rows of e of dy).
/// quant_u > 0: the pass ran on quantized operands (FP8), each element within quant_u·|a| of its
/// source; every sample must then lie within (2u + u² + 2^-10)·Σ|a·b| + 2 roundings of the output
/// of the exact result of the unquantized inputs, instead of the rule above.
CheckResult check_pass(const GemmHostData& d, const std::string& pass, const void* out, DType out_dtype,
                       int samples, uint64_t seed, double quant_u = 0);

/// Fills `n` elements of a bf16/f16 buffer with uniform values in [-1, 1), reproducibly from
/// (seed, index), in parallel.
void fill_uniform_host(void* data, DType dtype, int64_t n, uint64_t seed);

/// The same, uniform in [-a, a) (those values scaled by a, rounded to the dtype).
void fill_uniform_scaled_host(void* data, DType dtype, int64_t n, double a, uint64_t seed);

/// Non-finite elements of `n` bf16/f16/f32 values, on the bits (all-ones exponent), so it runs at
/// memory speed.
int64_t count_nonfinite(const void* p, DType dt, int64_t n);

/// Offsets (E + 1) of counts.
std::vector<int64_t> prefix_offsets(const std::vector<int64_t>& counts);

}  // namespace gmoe::bench
