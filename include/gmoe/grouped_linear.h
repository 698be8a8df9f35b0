// gmoe/grouped_linear.h — GroupedLinear: the expert linear layer of an MoE block.
//
// For E experts with weights W_e [N, K] (out_features × in_features) and optional biases b_e [N]:
//   forward   y[rows of e]  = x[rows of e] · W_eᵀ + b_e        (rows past the real total: 0)
//   backward  dx[rows of e] = dy[rows of e] · W_e
//             dW_e = dy_eᵀ · x_e,  db_e = Σ_rows dy_e           (now, or later in backward_dw)
// Counts stay on the device: forward, backward and backward_dw never synchronise and can be
// captured in a CUDA graph once and replayed under any routing. Explicit forward/backward (no
// autograd engine): what forward saves for backward lives in a GroupedLinearContext.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gmoe/activation.h"
#include "gmoe/allocator.h"
#include "gmoe/fp8.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Weight and bias gradients of one backward. In "fresh" mode (no main_grad) the weight and bias
/// gradients are views of ONE packed allocation made through the layer's allocator on the backward
/// stream, kept alive by `storage`; the weight views have the layout of the weights (stacked, or a
/// list). In main_grad mode `weight` views the caller's main_grad.
struct GroupedLinearGrads {
  ExpertWeights weight;             ///< dW (absent until computed, e.g. before backward_dw)
  ExpertBias bias;                  ///< db (absent without bias)
  std::shared_ptr<Buffer> storage;  ///< the packed allocation behind fresh gradients
};

/// Precision of a GroupedLinear's three GEMMs (see "FP8 recipes" below).
enum class LinearRecipe : uint8_t {
  native,          ///< the inputs' dtype (bf16/f16; f32 on the CPU), f32 accumulation
  fp8_tensorwise,  ///< e4m3, one scale per expert and operand (current scaling, amax on the device)
  fp8_blockwise,   ///< e4m3, 1x128 scales on x and dy, 128x128 on the weights (DeepSeek-V3)
  mxfp8,           ///< 1x32 blocks with e8m0 scales (on Hopper: dequantized to bf16, then bf16 GEMMs)
};

/// "native", "fp8_tensorwise", "fp8_blockwise", "mxfp8".
const char* linear_recipe_name(LinearRecipe recipe);
/// Parses linear_recipe_name's names; throws gmoe::Error naming the text otherwise.
LinearRecipe linear_recipe_from_name(const std::string& name);
/// The quantization recipe (gmoe/fp8.h) of an FP8 LinearRecipe; throws gmoe::Error for native.
Fp8Recipe fp8_recipe_of(LinearRecipe recipe);

/// Options of a GroupedLinear.
//
// FP8 recipes. With a recipe other than `native`, the layer quantizes inside (gmoe/fp8.h, one
// launch per tensor for all experts, blocks restarting at each expert boundary from the device
// counts) and runs the FP8 grouped GEMMs of gmoe/fp8_gemm.h:
//   forward   x  -> rowwise copy (fprop) and, unless save_original_input, the columnwise copy that
//                   backward's weight gradient reads (saved instead of a bf16 copy of x), in one pass;
//             W  -> rowwise and transposed copies, cached in the layer (see quantize_weight);
//   backward  dy -> rowwise (dgrad) and columnwise (wgrad) copies in one pass, in `grad_format`;
//                   with save_original_input, x is quantized again (columnwise) for the weight gradient.
// With fp8_wgrad = false the weight gradient is the native GEMM of the bf16 dy and x (as Transformer
// Engine's override_linear_precision for wgrad): no columnwise copies are made, x is kept in bf16
// (copied, or by reference with save_original_input), and dW is exactly the native layer's.
// The bias and its gradient stay in the weights' precision (db is reduced from the bf16 dy, in the
// quantization's pass over dy: quantize_grouped's column_sums, so dy is read once).
// y and dx are bf16 (f32 on the CPU with f32 weights), so FP8 recipes need bf16 weights on CUDA,
// and in_features and out_features multiples of 16 (FP8 rows are read by TMA in 16-byte units).
struct GroupedLinearOptions {
  /// backward computes dx and db only; dW is computed by backward_dw (possibly on another stream).
  bool delay_wgrad = false;
  /// Keep a reference to the caller's x instead of a copy. Aliasing contract: the caller must keep
  /// x alive and unmodified until the weight gradient has been computed (backward, or backward_dw
  /// when delayed). Without it forward copies x (stream-ordered) into memory from the allocator.
  bool save_original_input = false;
  /// Weight gradients into caller-provided f32 buffers (one stacked [E, N, K] or E × [N, K]),
  /// instead of fresh gradient buffers.
  ExpertWeights main_grad;
  /// With main_grad: D = dW + D (true) or D = dW (false).
  bool accumulate = true;
  /// Optional [E] i32 on the layer's device: experts with 0 are left untouched in main_grad (and
  /// get no fresh gradient written either: their views are left as zeros).
  TensorView expert_mask;
  /// Called once the weight gradients of a backward are complete (after backward, or after
  /// backward_dw when delayed), with the gradients and the stream they were computed on: where a
  /// data-parallel reduce-scatter is launched. Work enqueued on that stream is ordered after them.
  std::function<void(const GroupedLinearGrads&, Stream)> wgrad_hook;
  /// Scratch, saved inputs and fresh gradients; nullptr: the device's default allocator.
  Allocator* allocator = nullptr;
  /// Precision of the GEMMs (see above).
  LinearRecipe recipe = LinearRecipe::native;
  /// FP8 recipes: the format of the quantized output gradients dy: e4m3 (DeepSeek-V3), or e5m2
  /// (the wider range, Transformer Engine's "hybrid" format), with every recipe and backend.
  DType grad_format = DType::e4m3;
  /// fp8_tensorwise / fp8_blockwise: round every scale down to a power of two.
  bool fp8_pow2_scales = false;
  /// FP8 recipes: the weight gradient in FP8 (true) or as the native GEMM of bf16 dy and x (false;
  /// see above): the blockwise FP8 wgrad measured 0.94-1.14x our bf16 one on an H100, before the
  /// columnwise quantizations it needs.
  bool fp8_wgrad = true;
  /// FP8 recipes: fprop and dgrad with Fp8GemmOptions::fast_accumulation (gmoe/fp8_gemm.h: the
  /// tensor cores' own accumulation over the whole reduction, Transformer Engine's fprop default;
  /// used by fp8_tensorwise on CUDA, ignored elsewhere). The weight gradient always promotes.
  bool fp8_fast_accumulation = false;
};

/// What forward saves for backward (and backward for backward_dw). One per forward in flight.
class GroupedLinearContext {
 public:
  GroupedLinearContext();
  ~GroupedLinearContext();
  GroupedLinearContext(GroupedLinearContext&&) noexcept;
  GroupedLinearContext& operator=(GroupedLinearContext&&) noexcept;
  /// True between forward and the end of the weight gradient.
  bool active() const;

 private:
  friend class GroupedLinear;
  struct State;
  std::unique_ptr<State> state_;
};

/// Result of GroupedLinear::backward.
struct GroupedLinearBackward {
  Tensor dx;                 ///< [capacity, K]: dgrad_out when given, else owned
  GroupedLinearGrads grads;  ///< weight (unless delayed) and bias gradients
};

class GroupedLinear {
 public:
  /// weight: E × [N, K] (stacked or list), bf16 or f16 (f32 on the CPU backend). bias: none, or
  /// E × [N] (grouped [E, N] or a list), dtype of the weight or f32. All on one device.
  GroupedLinear(ExpertWeights weight, ExpertBias bias = {}, GroupedLinearOptions options = {});

  int64_t num_experts() const { return weight_.num_experts(); }
  int64_t in_features() const { return weight_.cols(); }
  int64_t out_features() const { return weight_.rows(); }
  const ExpertWeights& weight() const { return weight_; }
  const ExpertBias& bias() const { return bias_; }
  const GroupedLinearOptions& options() const { return options_; }

  /// y = x·W_eᵀ + b_e per expert. x: [capacity, K]; counts: [E] i32/i64 on the layer's device
  /// (kept by reference in ctx: keep it alive and unchanged until backward). `out`, if given, is
  /// [capacity, N] of x's dtype and receives y.
  Tensor forward(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx,
                 Stream stream = nullptr, const TensorView& out = {});

  /// dx = dy·W_e per expert, db, and dW unless delay_wgrad. dy: [capacity, N]. When delayed, dy
  /// is kept by reference until backward_dw (keep it alive and unchanged). `dgrad_out`, if given,
  /// is [capacity, K] and receives dx.
  GroupedLinearBackward backward(GroupedLinearContext& ctx, const TensorView& dy,
                                 Stream stream = nullptr, const TensorView& dgrad_out = {});

  /// The delayed weight gradient, on `stream` (ordered after backward through an event). Returns
  /// the gradients (bias ones included) and calls the hook. Capturable in a CUDA graph.
  GroupedLinearGrads backward_dw(GroupedLinearContext& ctx, Stream stream = nullptr);

  /// For layers built on GroupedLinear that rebuild a saved input instead of keeping it
  /// (GroupedMLP with recompute_activation): with save_original_input, replaces the input that
  /// forward kept by reference with `x` (same shape and dtype, the same values), before the weight
  /// gradient is computed (backward, or backward_dw when delayed). The same aliasing contract holds
  /// for the new `x`.
  void set_saved_input(GroupedLinearContext& ctx, const TensorView& x) const;

  /// FP8 recipes: the weights are quantized once (rowwise for fprop, transposed for dgrad) into a
  /// cache that the layer allocates when it is built, and reused by every forward and backward
  /// until invalidate_fp8_weight() is called (after the optimizer changed the weights): the next
  /// forward then quantizes again on its stream, in place. quantize_weight() does it now, on
  /// `stream`. In a CUDA graph: capture it (or a forward after invalidate_fp8_weight()) inside
  /// the graph so that every replay quantizes the current weights; the cache's address never
  /// changes. No-op for the native recipe.
  void quantize_weight(Stream stream = nullptr);
  /// Marks the FP8 weight cache stale: the next forward quantizes the weights again.
  void invalidate_fp8_weight() { fp8_weight_valid_ = false; }

 private:
  friend class GroupedMLP;
  /// FC1 of GroupedMLP: forward, and z = act(y)·probs of the activation written into `z` (by
  /// grouped_gemm_fprop_activation, the activation in the GEMM's epilogue where it can be, with
  /// the native recipe; after the FP8 GEMM otherwise). Bitwise forward + grouped_activation_forward.
  struct ActivationOut {
    TensorView z;
    ActivationOptions options;
    TensorView probs;
  };
  Tensor forward_impl(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx, Stream stream,
                      const TensorView& out, const ActivationOut* act);
  /// An FP8 quantization of [rows, cols] laid out for `o`, its copies placed in two allocations:
  /// the rowwise one (with padded_offsets when there is no columnwise copy), which can go as soon
  /// as its GEMM has read it, and the columnwise one, which the weight gradient keeps.
  struct Fp8Placed {
    Fp8Grouped q;
    std::shared_ptr<Buffer> rows, cols;
  };
  Fp8Placed place_fp8(int64_t rows, int64_t cols, const Fp8QuantizeOptions& o, Device device, Stream stream) const;
  /// What forward and backward quantize x and dy with.
  Fp8QuantizeOptions fp8_input_options() const { return fp8_options(DType::e4m3, true, fp8_keeps_x_cols()); }
  Fp8QuantizeOptions fp8_grad_options() const { return fp8_options(options_.grad_format, true, options_.fp8_wgrad); }
  Fp8GemmOptions fp8_gemm_options() const { return Fp8GemmOptions{options_.fp8_fast_accumulation}; }
  /// forward once the input ([capacity, in_features] of dtype `dt`) is quantized into `xq`: the FP8
  /// fprop (+ bias, + `act`), its columnwise copy (if any) kept for the weight gradient. ctx keeps
  /// the input's shape only: without a columnwise copy, the caller hands the input over with
  /// set_saved_input (save_original_input) before the weight gradient.
  Tensor forward_fp8(Fp8Placed xq, DType dt, const TensorView& counts, GroupedLinearContext& ctx, Stream stream,
                     const TensorView& out, const ActivationOut* act);
  /// backward once dy ([capacity, out_features] of dtype `dt`) is quantized into `dyq` (with
  /// fp8_grad_options()): needs the FP8 weight gradient and no bias (whose gradient reads dy).
  GroupedLinearBackward backward_fp8(GroupedLinearContext& ctx, Fp8Placed dyq, DType dt, Stream stream,
                                     const TensorView& dgrad_out);
  /// FC2 of GroupedMLP: the data gradient fused with the activation's backward, dh written over
  /// `h` (grouped_gemm_dgrad_activation_backward; native recipe only); the result's dx is absent.
  struct ActivationBackwardIn {
    TensorView h;
    ActivationOptions options;
  };
  /// backward, with dy's per-expert amax (f32 [E]) already computed where the recipe is tensorwise
  /// (Fp8QuantizeOptions::amax: the quantization of dy then reads it once); ignored otherwise.
  GroupedLinearBackward backward_impl(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                      const TensorView& dgrad_out, const TensorView& dy_amax,
                                      const ActivationBackwardIn* act = nullptr);
  // The shared tails: x kept (by reference or as a copy), the FP8 dgrad, and everything after dx.
  void save_input(GroupedLinearContext& ctx, const TensorView& x, Stream stream) const;
  void fp8_dgrad(GroupedLinearContext& ctx, Fp8Placed dyq, const TensorView& dx, Stream stream) const;
  GroupedLinearBackward finish_backward(GroupedLinearContext& ctx, const TensorView& dy, Tensor dx, Stream stream,
                                        const TensorView& db);
  GroupedLinearGrads allocate_grads(Stream stream) const;
  void compute_wgrad(GroupedLinearContext& ctx, GroupedLinearGrads& grads, Stream stream) const;
  Allocator& allocator() const;

  bool fp8() const { return options_.recipe != LinearRecipe::native; }
  /// Forward keeps x's columnwise FP8 copy for the weight gradient instead of x.
  bool fp8_keeps_x_cols() const { return fp8() && options_.fp8_wgrad && !options_.save_original_input; }
  Fp8QuantizeOptions fp8_options(DType format, bool rowwise, bool columnwise) const;

  ExpertWeights weight_;
  ExpertBias bias_;
  GroupedLinearOptions options_;
  // FP8 recipes: the quantized weights (rowwise + transposed), allocated at construction.
  Fp8WeightsTensor fp8_weight_;
  bool fp8_weight_valid_ = false;
};

}  // namespace gmoe
