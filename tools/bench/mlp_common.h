// tools/bench/mlp_common.h — what the mlp mode's CPU and CUDA runners share: the configuration of
// the expert MLP, the unfused composition it is compared with, the sampled fp64 checks of y and
// dx, and the result rows.
//
// An mlp run times the expert MLP of an mlp case: stacked bf16 weights FC1 [E, 2·ffn, hidden] (gate
// and up concatenated, as bench/torch_baseline.py splits them with chunk(2); or with
// --mlp-glu-block B interleaved in blocks of B rows) and FC2 [E, hidden, ffn], no bias, no router probabilities, x kept by reference
// (save_original_input; with an FP8 recipe and FP8 weight gradients FC1 keeps x's columnwise FP8
// copy from forward instead, its default, unless '+requant_input'). Weight gradients: fresh bf16 tensors, as torch's autograd returns them
// (the default, so that the comparison with torch is like for like), or with --mlp-main-grad
// accumulated in f32 into one stacked main_grad per FC (Megatron's training configuration: the
// f32 read and write of dW cost 2·4 bytes per weight on top).
// Two implementations, each timed `forward` and `forward_backward` (forward, then backward: dx
// and both weight gradients):
//   gmoe          GroupedMLP
//   gmoe_unfused  the same work composed of separate public ops: GroupedLinear FC1,
//                 grouped_activation_forward, GroupedLinear FC2; backward FC2, grouped_activation_
//                 backward (dh written over h), FC1
// FLOPs as docs/benchmarks.md counts them (mlp_flops; forward_backward 3×). Correctness first: one
// forward + backward of each on outputs poisoned with NaN, then y and dx at sampled rows against
// the exact values (fp64, no intermediate rounding) by the rule of check.h: the largest error at
// most twice that of a reference in the layer's own precision (f32 sums, h, z, dz, dh and the
// outputs rounded to the input dtype) plus one rounding unit at the outputs' RMS; and no
// non-finite element anywhere in y or dx.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/check.h"
#include "bench/results.h"
#include "bench/runner.h"
#include "bench/suite.h"
#include "gmoe/activation.h"
#include "gmoe/grouped_linear.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe::bench {

/// The activation of an mlp case (its "activation" name; clamped_swiglu with gpt-oss's alpha 1.702
/// and limit 7), FC1's gate/up rows concatenated (glu_block 0) or interleaved in blocks of
/// glu_block (when it divides ffn). Throws gmoe::Error on an unknown name.
ActivationOptions mlp_activation(const BenchCase& c, int64_t glu_block = 0);
/// FC1's output rows: 2·ffn for gated activations, ffn for squared_relu.
int64_t mlp_fc1_rows(const BenchCase& c);

/// The parameters of an mlp run: w1 [E, fc1 rows, hidden], w2 [E, hidden, ffn] (input dtype),
/// mg1, mg2 their f32 main_grads (accumulated into), or absent: fresh gradients of w's dtype.
struct MlpParams {
  TensorView w1, w2, mg1, mg2;
  int64_t glu_block = 0;  ///< FC1's gate/up layout (mlp_activation)
};

/// GroupedMLP in the configuration of the header comment, with `recipe` for both FCs (FP8: the
/// weight gradients FP8 or not, and GroupedMLPOptions::fp8_quantize_in_activation). FC1
/// keeps x as make_bench_layer keeps a layer's input (requant_input likewise).
GroupedMLP make_bench_mlp(const BenchCase& c, const MlpParams& p, LinearRecipe recipe = LinearRecipe::native,
                          bool fp8_wgrad = true, bool quant_in_act = true,
                          bool requant_input = false, bool pow2 = false, bool fast_accum = false);

/// The unfused composition of separate public ops, in the same configuration.
class UnfusedMlp {
 public:
  /// What forward keeps for backward.
  struct Context {
    GroupedLinearContext fc1, fc2;
    Tensor h, z;
    TensorView counts;
  };
  UnfusedMlp(const BenchCase& c, const MlpParams& p);
  /// y = FC2(act(FC1(x))) into `y` [rows, hidden].
  void forward(const TensorView& x, const TensorView& counts, Context& ctx, Stream stream, const TensorView& y);
  /// dx into `dx` [rows, hidden]; both weight gradients (into the main_grads, if any).
  void backward(Context& ctx, const TensorView& dy, Stream stream, const TensorView& dx);

 private:
  ActivationOptions act_;
  GroupedLinear fc1_, fc2_;
};

/// Host copies of an mlp case's inputs (row-major, input dtype).
struct MlpHostData {
  DType dtype = DType::bf16;
  int64_t E = 0, rows = 0, H = 0, F = 0, R1 = 0;  ///< R1: FC1's output rows
  ActivationOptions act;
  std::vector<int64_t> offsets;  ///< E + 1 prefix sums of the counts
  const void* x = nullptr;       ///< [rows, H]
  const void* w1 = nullptr;      ///< [E, R1, H]
  const void* w2 = nullptr;      ///< [E, H, F]
  const void* dy = nullptr;      ///< [rows, H]
};

/// y and dx of whole sampled rows, exact and in the layer's own precision. Computed once per case
/// (the costly part) and checked against every implementation.
struct MlpReference {
  std::vector<int64_t> rows;                      ///< the sampled rows
  std::vector<double> y_exact, y_own;             ///< [rows.size(), H]
  std::vector<double> dx_exact, dx_own;           ///< [rows.size(), H]
};
/// About samples / 32 rows (at least 4, at most 64), chosen at random from `seed`.
MlpReference mlp_reference(const MlpHostData& d, int samples, uint64_t seed);

/// One row x (H values of d.dtype, as floats) through expert e's MLP of `d` (d.x, d.dy and
/// d.offsets unused), exactly (fp64) and in the layer's own precision (f32 sums; h, z, dz, dh and
/// the outputs rounded to d.dtype): y [H], and dx [H] for the output gradient dy [H] (dy_exact for
/// the exact one, dy_own, values of d.dtype, for the own-precision one).
struct MlpRowReference {
  std::vector<double> y_exact, y_own, dx_exact, dx_own;
};
MlpRowReference mlp_row_reference(const MlpHostData& d, int64_t e, const float* x, const double* dy_exact,
                                  const float* dy_own);

/// The check rule of check.h on gathered values: the largest |got - exact| at most twice the
/// largest |own - exact| plus u times the RMS of `exact` (u: one rounding unit of the outputs), and
/// no non-finite value in `got` nor `nonfinite_elsewhere` (non-finite elements counted outside the
/// sample). `name` and the worst element's `label(i)` go into the detail.
CheckResult check_gathered(const std::vector<double>& exact, const std::vector<double>& own,
                           const std::vector<double>& got, double u, const char* name, int64_t nonfinite_elsewhere,
                           const std::function<std::string(size_t)>& label);

struct MlpCheck {
  CheckResult forward;   ///< y
  CheckResult backward;  ///< y and dx
};
/// y [rows, H] and dx [rows, H] (input dtype) of one run against the reference.
MlpCheck check_mlp(const MlpHostData& d, const MlpReference& ref, const void* y, const void* dx);
/// The same for an FP8 recipe, whose quantization error the rule above does not allow: no
/// non-finite element, and the relative Frobenius error of y and dx over the sampled rows against
/// the exact values at most `max_rel` (a sanity bound; the FP8 test suites hold the layers to each
/// recipe's error bound). The measured errors are in the details.
MlpCheck check_mlp_quantized(const MlpHostData& d, const MlpReference& ref, const void* y, const void* dx,
                             double max_rel);

/// The times of one implementation on one case.
struct MlpTimes {
  double forward_ms = 0, forward_backward_ms = 0;
};

/// The rows of a case for one implementation ("gmoe" or "gmoe_unfused"): `forward` (mlp_flops)
/// and `forward_backward` (3× that).
std::vector<ResultRow> mlp_rows(const BenchCase& c, DType dt, const std::string& impl, const MlpTimes& t,
                                const MlpCheck& chk, bool main_grad);

}  // namespace gmoe::bench
