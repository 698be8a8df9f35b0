// tests/common/fp8_fixture.h — FP8 grouped-GEMM problems on the host: a GemmProblem (bf16 x, dy,
// weights, counts) quantized with the CPU backend's quantizer (rowwise and columnwise copies of
// everything), the dequantized operands decoded independently from the format of gmoe/fp8.h
// (fp8 bytes times the scale of their block, indexed here, not by the quantizer's code), and the
// error bound of a recipe. CPU and CUDA suites build the same problem from it.
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

/// Largest relative error of one element's quantization under a recipe and format, for values in
/// the normal range of the format: round to nearest (2^-4 e4m3, 2^-3 e5m2), and for mxfp8 the
/// saturation of the block maximum (a power-of-two scale maps amax into [256, 512) for e4m3,
/// clamped at 448: at most 1/8).
double fp8_relative_error(Fp8Recipe recipe, DType format);

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
  /// The error bound's u for dgrad and wgrad (dy with the weights or x): the wider format's.
  double u_grads() const;
};

/// |got - exact| <= bound[i] for every element (NaN fails); reports the worst ratio.
::testing::AssertionResult within_bound(const std::vector<double>& got,
                                        const std::vector<double>& exact,
                                        const std::vector<double>& bound, const std::string& what);

/// Per output element, the bound of the recipe against the unquantized source. With
/// |dequant(a) - a| <= u·|a| + t_a per element (u = fp8_relative_error; t_a = 2^-18 · max|a|
/// covers the format's subnormals, whatever the block's scale), a product's error is at most
/// (u|a| + t_a)|b| + |a|(u|b| + t_b) + (u|a| + t_a)(u|b| + t_b); summed over the reduction, plus
/// the output's rounding (u_out · (|exact| + that)) and 2^-10 · Σ|a·b| for fp32 accumulation.
std::vector<double> recipe_bound_fprop(const Fp8Problem& p, double u, DType out);
std::vector<double> recipe_bound_dgrad(const Fp8Problem& p, double u, DType out);
std::vector<double> recipe_bound_wgrad(const Fp8Problem& p, double u, DType out);

}  // namespace gmoe::test
