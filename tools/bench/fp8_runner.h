// tools/bench/fp8_runner.h — gmoe-bench's FP8 grouped GEMM rows (--fp8): the three passes of a
// gemm case with FP8 operands, one recipe at a time.
#pragma once

#include <string>
#include <vector>

#include "bench/results.h"
#include "bench/runner.h"
#include "bench/suite.h"
#include "gmoe/fp8.h"

namespace gmoe::bench {

/// A recipe of the gemm mode's FP8 rows: blockwise, tensorwise, mxfp8, blockwise_pow2 /
/// tensorwise_pow2 (every scale rounded down to a power of two, Fp8QuantizeOptions::pow2_scales),
/// or tensorwise_fast (fprop and dgrad with Fp8GemmOptions::fast_accumulation).
struct Fp8BenchRecipe {
  Fp8Recipe recipe = Fp8Recipe::blockwise;
  bool pow2 = false;
  bool fast = false;
  std::string name;  ///< as given: the rows' impl is gmoe_fp8_<name> (gmoe_mxfp8 for mxfp8)
};

/// Parses a recipe name (throws gmoe::Error for an unknown one).
Fp8BenchRecipe fp8_recipe_from_name(const std::string& name);

/// FP8 grouped GEMM on the CUDA backend: the bf16 inputs of the case are quantized once by the
/// CUDA quantizer (e4m3, rowwise and columnwise copies), outside the timing; each pass is checked
/// first (sampled elements against the fp64 GEMM of the operands decoded on the host, and a scan
/// for non-finite outputs), then timed alone (impl gmoe_fp8_<name>, gmoe_mxfp8 for mxfp8) and
/// with the quantization of its activation operands in front (impl ..._with_quant: fprop
/// quantizes x, dgrad dy, wgrad dy and x columnwise; the weights stay quantized, as a training
/// step caches them). dtype "fp8". Both rows are timed interleaved with the bf16 grouped GEMM of
/// the same pass on the same (unquantized) inputs and output dtype, whose time is their bare_ms,
/// after o.gemm_warm_ms of untimed work.
std::vector<ResultRow> run_fp8_gemm_case_cuda(const BenchCase& c, const BenchOptions& o,
                                              const Fp8BenchRecipe& recipe);

}  // namespace gmoe::bench
