// tools/bench/layer_common.h — what the layer mode's CPU and CUDA runners share: the layer's
// configuration, the correctness checks of one forward + backward, and the result rows.
//
// A layer run times GroupedLinear as Megatron-style training uses it: stacked weights, a grouped
// [E, N] bias of the weights' dtype, and the weight gradients accumulated in f32 into one stacked
// main_grad [E, N, K]. Two passes: `forward`, and `forward_backward` (forward, then backward with
// dx, db and dW). Beside each, the bare GEMMs of the same work are timed in the same run (fprop;
// fprop + dgrad + wgrad accumulated into main_grad): the difference is the layer's overhead (the
// bias kernels, the input copy when asked for, allocations, host work).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "bench/check.h"
#include "bench/results.h"
#include "bench/runner.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::bench {

/// The layer of a layer run. w: [E, N, K]; bias: [E, N] of w's dtype; main_grad: f32 [E, N, K]
/// (accumulated into). The input is kept by reference (save_original_input), as an autograd
/// framework keeps a saved tensor, unless o.layer_copy_input; an FP8 layer with an FP8 weight
/// gradient keeps x's columnwise FP8 copy from forward instead (the layer's default, as
/// Transformer Engine's), unless requant_input (x by reference, quantized again in backward).
GroupedLinear make_bench_layer(const TensorView& w, const TensorView& bias, const TensorView& main_grad,
                               const BenchOptions& o, LinearRecipe recipe = LinearRecipe::native,
                               bool fp8_wgrad = true, bool requant_input = false, bool pow2 = false,
                               bool fast_accum = false);

/// Whether a bench layer keeps its input by reference (see make_bench_layer).
bool bench_keeps_input_reference(LinearRecipe recipe, bool fp8_wgrad, bool requant_input, bool copy_input);

/// A --layer-fp8 entry: a recipe name (linear_recipe_name), optionally followed by "+native_wgrad"
/// (GroupedLinearOptions::fp8_wgrad = false: the weight gradient in bf16) and/or "+cached_weights"
/// (the FP8 weights quantized once, as in every microbatch after a step's first, instead of
/// invalidated before each timed forward as after every optimizer step).
struct BenchRecipe {
  LinearRecipe recipe = LinearRecipe::native;
  bool fp8_wgrad = true;
  bool cached_weights = false;
  bool quant_in_act = true;       ///< mlp mode: fp8_quantize_in_activation ("+quant_after_act": off)
  bool requant_input = false;     ///< "+requant_input": x (FC1's) by reference, quantized again in backward
  bool pow2 = false;              ///< "+pow2": scales rounded down to powers of two (fp8_pow2_scales)
  bool fast_accum = false;        ///< "+fast_accum": fprop/dgrad with fast accumulation (fp8_fast_accumulation)
  std::string name;  ///< as given: the rows' impl suffix
};
BenchRecipe bench_recipe_from_name(const std::string& name);

/// Host copies of the outputs of one forward + backward, main_grad accumulated from zero.
struct LayerOutputs {
  const void* y = nullptr;          ///< [rows, N], input dtype
  const void* dx = nullptr;         ///< [rows, K], input dtype
  const void* main_grad = nullptr;  ///< [E, N, K] f32
  const void* db = nullptr;         ///< [E, N], bias dtype
};

struct LayerCheck {
  CheckResult forward;   ///< y = x·W_eᵀ + b_e
  CheckResult backward;  ///< y, dx, dW (main_grad) and db all correct
};

/// Sampled checks of a layer's outputs against the fp64 reference (d.bias set: y includes it).
/// quant_u > 0 (FP8 recipes): y, dx and dW against the unquantized inputs within the quantization
/// bound of check_pass; db (reduced from the unquantized dy) by the usual rule, and so is dW when
/// !fp8_wgrad (the native weight gradient of the unquantized dy and x).
LayerCheck check_layer(const GemmHostData& d, const LayerOutputs& out, const BenchOptions& o, double quant_u = 0,
                       bool fp8_wgrad = true);

/// Per-element relative quantization error of a recipe's operands (e4m3 round to nearest; mxfp8's
/// power-of-two scale may also saturate the block maximum): the quant_u of check_layer.
double recipe_quant_u(LinearRecipe recipe);

/// Times and launches of one case's layer run.
struct LayerTimes {
  double forward_ms = 0, forward_bare_ms = 0;
  double forward_backward_ms = 0, forward_backward_bare_ms = 0;
  std::optional<GraphNodeCounts> forward_nodes, forward_backward_nodes;
};

/// The rows of a case: `forward` (FLOPs 2·rows·N·K) and `forward_backward` (3× that), impl
/// gmoe_linear (native), or gmoe_linear_<recipe> with dtype fp8, whose bare_ms is then the native
/// layer timed interleaved with it.
/// recipe_name: empty for native, else the --layer-fp8 entry.
std::vector<ResultRow> layer_rows(const BenchCase& c, DType dt, const LayerTimes& t, const LayerCheck& chk,
                                  const std::string& recipe_name = "");

}  // namespace gmoe::bench
