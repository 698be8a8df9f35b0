// tests/common/fp8_fixture.h — FP8 grouped-GEMM problems on the host: a GemmProblem (bf16 x, dy,
// weights, counts) quantized with the CPU backend's quantizer (rowwise and columnwise copies of
// everything), the dequantized operands decoded independently from the format of gmoe/fp8.h
// (fp8 bytes times the scale of their block, indexed here, not by the quantizer's code). CPU and
// CUDA suites build the same problem from it.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/fp8.h"

namespace gmoe::test {

/// Decodes one copy of quantized grouped rows into token rows [capacity, cols] (f32; rows past
/// the total 0): rowwise data[r, c] * scale(r, c), or the columnwise copy mapped back through the
/// counts and padded_offsets. Host tensors only.
HostTensor decode_grouped(const Fp8Grouped& q, const std::vector<int64_t>& counts, Fp8Copy which);
/// Decodes one copy of quantized weights into E × [N, K] (f32; data_t transposed back).
std::vector<HostTensor> decode_weights(const Fp8Weights& q, Fp8Copy which);

struct Fp8Problem {
  GemmProblem base;  ///< the bf16 source operands and counts
  Fp8Recipe recipe;
  DType format;       ///< of x and the weights
  DType grad_format;  ///< of dy (the same as format unless given)
  Fp8GroupedTensor x, dy;  ///< rowwise + columnwise copies
  Fp8WeightsTensor w;      ///< data + data_t
  // Independently decoded operands, f32 (see decode_*).
  HostTensor x_rows, dy_rows;      ///< rowwise copies
  HostTensor x_cols, dy_cols;      ///< columnwise copies, as token rows
  std::vector<HostTensor> w_data;  ///< from data
  std::vector<HostTensor> w_t;     ///< from data_t, transposed back to [N, K]

  Fp8Problem(const ShapeCase& c, Fp8Recipe recipe, Rng& rng, DType counts_dtype = DType::i32,
             DType format = DType::e4m3, std::optional<DType> grad_format = std::nullopt);
};

/// The exact GEMM of the unquantized source with the own-precision reference of the quantized
/// operands: the tolerance rule then holds a result against the source, the quantization's error
/// carried by the reference (the f32 sums of the same quantized inputs) instead of a bound of
/// the recipe. `quantized` and `source` are exact_* of the decoded and of the bf16 operands.
ExactResult against_source(const ExactResult& quantized, const ExactResult& source);

}  // namespace gmoe::test
