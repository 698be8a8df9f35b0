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
#include "gmoe/grouped_gemm.h"
#include "gmoe/offload.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Weight and bias gradients of one backward. In "fresh" mode (no main_grad) the weight and bias
/// gradients are views of ONE packed allocation made through the layer's allocator on the backward
/// stream, kept alive by `storage`; the weight views have the layout of the weights (stacked, or a
/// list), and every expert's view (weight and bias) starts on a 256-byte boundary in both layouts
/// (a stacked view's expert stride is padded to that when N·K elements are not a multiple of it).
/// In main_grad mode `weight` views the caller's main_grad.
///
/// Streams: `storage` is freed on the stream that allocated it (the backward's), after waiting for
/// every stream recorded on it with Buffer::record_stream. The layer records backward_dw's stream;
/// a caller that uses the gradients on another stream (a reduce-scatter) records that stream before
/// dropping its reference, so the memory is not reused while that stream still reads it.
struct GroupedLinearGrads {
  ExpertWeights weight;             ///< dW (absent until computed, e.g. before backward_dw)
  ExpertBias bias;                  ///< db (absent without bias)
  /// main_grad with an expert_mask and MaskedOffWgrad::fresh: f32 views (in `storage`, the weights'
  /// layout) where the experts with mask 0 get their dW_e written; the views of the experts with
  /// mask 1 are not written (undefined contents). Absent otherwise.
  ExpertWeights masked_off_weight;
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
  /// Optional [E] i32 on the layer's device: experts with 1 are written into main_grad (accumulated
  /// with `accumulate`); experts with 0 follow `masked_off`. Without main_grad (fresh gradients) and
  /// `skip`, the fresh views of experts with 0 are zeros.
  TensorView expert_mask;
  /// What experts with expert_mask 0 get (gmoe/grouped_gemm.h, MaskedOffWgrad): `skip` leaves them
  /// untouched in main_grad; `fresh` (needs main_grad and expert_mask) writes their gradient into
  /// GroupedLinearGrads::masked_off_weight, in the same weight-gradient launch as main_grad's.
  MaskedOffWgrad masked_off = MaskedOffWgrad::skip;
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
  /// see above), which also spares the columnwise quantizations that the FP8 one needs: where the
  /// FP8 weight-gradient GEMM is not faster than the bf16 one by their cost, false is faster.
  bool fp8_wgrad = true;
  /// FP8 recipes: fprop and dgrad with Fp8GemmOptions::fast_accumulation (gmoe/fp8_gemm.h: the
  /// tensor cores' own accumulation over the whole reduction, Transformer Engine's fprop default;
  /// used by fp8_tensorwise on CUDA, ignored elsewhere). The weight gradient always promotes.
  bool fp8_fast_accumulation = false;
};

/// What forward saves for backward (and backward for backward_dw). One per forward in flight.
/// Offloadable (gmoe/offload.h): x's copy, or its FP8 columnwise copy and scales, and after a
/// delayed backward dy's columnwise copy; never the caller's tensors kept by reference.
class GroupedLinearContext : public Offloadable {
 public:
  GroupedLinearContext();
  ~GroupedLinearContext();
  GroupedLinearContext(GroupedLinearContext&&) noexcept;
  GroupedLinearContext& operator=(GroupedLinearContext&&) noexcept;
  /// True between forward and the end of the weight gradient.
  bool active() const;

 private:
  friend class GroupedLinear;
  void collect(OffloadSlots& slots) override;
  struct State;
  std::unique_ptr<State> state_;
};

/// Result of GroupedLinear::backward.
struct GroupedLinearBackward {
  Tensor dx;                 ///< [capacity, K]: dgrad_out when given, else owned
  GroupedLinearGrads grads;  ///< weight (unless delayed) and bias gradients
};

/// An FP8 operand of a GroupedLinear (an input x or an output gradient dy) that the caller
/// quantizes itself, e.g. inside the kernel that produces it (GroupedMLP quantizes FC2's input in
/// the activation). Made by GroupedLinear::allocate_fp8_operand, filled by a quantization with the
/// options it was made for, handed to forward_fp8 or backward_fp8. The two copies live in separate
/// allocations: the rowwise one goes as soon as its GEMM has read it, the columnwise one stays with
/// the context until the weight gradient.
struct GroupedLinearFp8Operand {
  Fp8Grouped q;                  ///< the quantization's views, placed in `rows` and `cols`
  std::shared_ptr<Buffer> rows;  ///< the rowwise copy (and padded_offsets without a columnwise one)
  std::shared_ptr<Buffer> cols;  ///< the columnwise copy and padded_offsets (absent without one)
};

/// The expert linear layer (see the top of this file): E weights (and biases) applied to grouped
/// rows, forward and backward with the gradients of every input. Backend-agnostic: the ops of the
/// weights' device run it. One layer may serve several forwards in flight, each with its context.
class GroupedLinear {
 public:
  /// weight: E × [N, K] (stacked or list), bf16 or f16 (f32 on the CPU backend). bias: none, or
  /// E × [N] (grouped [E, N] or a list), dtype of the weight or f32. All on one device.
  GroupedLinear(ExpertWeights weight, ExpertBias bias = {}, GroupedLinearOptions options = {});

  /// E.
  int64_t num_experts() const { return weight_.num_experts(); }
  /// K, the columns of x.
  int64_t in_features() const { return weight_.cols(); }
  /// N, the columns of y.
  int64_t out_features() const { return weight_.rows(); }
  /// The weights the layer was built with (views of the caller's memory).
  const ExpertWeights& weight() const { return weight_; }
  /// The biases the layer was built with (absent: none).
  const ExpertBias& bias() const { return bias_; }
  /// The options the layer was built with.
  const GroupedLinearOptions& options() const { return options_; }
  /// True for the FP8 recipes (options().recipe other than native).
  bool fp8() const { return options_.recipe != LinearRecipe::native; }

  /// y = x·W_eᵀ + b_e per expert. x: [capacity, K]; counts: [E] i32/i64 on the layer's device
  /// (kept by reference in ctx: keep it alive and unchanged until backward), or in host memory for a
  /// CUDA layer: then uploaded once by upload_counts (gmoe/copy.h: pinned staging, stream-ordered, no
  /// sync; the host counts may change as soon as forward returns) into memory that ctx keeps until
  /// the weight gradient, which backward reuses. `out`, if given, is [capacity, N] of x's dtype and
  /// receives y. (forward_with_activation takes host counts alike; forward_fp8 needs device counts.)
  Tensor forward(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx,
                 Stream stream = nullptr, const TensorView& out = {});

  /// forward, and the activation of y written into `z` (the FC1 of an expert MLP, as GroupedMLP
  /// runs it): z = act(y)·probs, [capacity, F] of x's dtype with N = 2F for gated activations
  /// (N = F for squared_relu); probs absent or f32 [capacity]. Bitwise forward followed by
  /// grouped_activation_forward(y, counts, z, activation, probs). Native recipe: one op,
  /// grouped_gemm_fprop_activation (gmoe/grouped_gemm.h says where its activation runs); FP8
  /// recipes: the FP8 GEMM, then grouped_activation_forward.
  Tensor forward_with_activation(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx,
                                 const TensorView& z, const ActivationOptions& activation,
                                 const TensorView& probs = {}, Stream stream = nullptr, const TensorView& out = {});

  /// dx = dy·W_e per expert, db, and dW unless delay_wgrad. dy: [capacity, N]. When delayed, dy
  /// is kept by reference until backward_dw (keep it alive and unchanged). `dgrad_out`, if given,
  /// is [capacity, K] and receives dx. `dy_amax` (optional, f32 [E] on the layer's device; used by
  /// fp8_tensorwise, ignored by the other recipes): each expert's largest finite |dy| over its rows,
  /// as grouped_activation_backward's amax_out gives it, so that the quantization of dy reads dy
  /// once (Fp8QuantizeOptions::amax, with its contract: a wrong amax is not detected). Native
  /// recipe, not delayed: dW before dx, and an input that ctx owns (forward's copy of x, or one
  /// handed over by set_saved_input) freed between them, so backward never holds both.
  GroupedLinearBackward backward(GroupedLinearContext& ctx, const TensorView& dy, Stream stream = nullptr,
                                 const TensorView& dgrad_out = {}, const TensorView& dy_amax = {});

  /// backward fused with the backward of the activation that made this layer's input from h (the
  /// FC2 of an expert MLP): dh = act'(h)·(dy·W_e) written into `dh` (h's shape and dtype; h itself
  /// or disjoint from it), db, and dW unless delayed; the result's dx is absent. Native recipe
  /// only. One op, grouped_gemm_dgrad_activation_backward: bitwise backward followed by
  /// grouped_activation_backward(h, dx, counts, dh, activation).
  GroupedLinearBackward backward_with_activation(GroupedLinearContext& ctx, const TensorView& dy,
                                                 const TensorView& h, const TensorView& dh,
                                                 const ActivationOptions& activation, Stream stream = nullptr);

  /// The delayed weight gradient, on `stream` (ordered after backward through an event). Returns
  /// the gradients (bias ones included) and calls the hook. Capturable in a CUDA graph.
  GroupedLinearGrads backward_dw(GroupedLinearContext& ctx, Stream stream = nullptr);

  /// FP8 recipes: the quantization that forward makes of x (recipe, e4m3, the scale options):
  /// rowwise for fprop, and columnwise too when the weight gradient reads x's FP8 columnwise copy
  /// (fp8_wgrad without save_original_input). Throws gmoe::Error for the native recipe.
  Fp8QuantizeOptions input_quantization() const;
  /// FP8 recipes: the quantization that backward makes of dy (in grad_format): rowwise for dgrad,
  /// and columnwise too with fp8_wgrad. Throws gmoe::Error for the native recipe.
  Fp8QuantizeOptions grad_quantization() const;
  /// FP8 recipes: memory for a quantization of `rows` × `cols` with `options` (the views of
  /// fp8_grouped_layout(rows, cols, num_experts(), options), on the layer's device), from the
  /// layer's allocator on `stream`, for forward_fp8 or backward_fp8.
  GroupedLinearFp8Operand allocate_fp8_operand(int64_t rows, int64_t cols, const Fp8QuantizeOptions& options,
                                               Stream stream = nullptr) const;
  /// forward from an input that the caller has quantized with `counts` (allocate_fp8_operand,
  /// then a quantization with input_quantization()'s recipe, format and scales; rowwise, with or
  /// without the columnwise copy): y = x·W_eᵀ + b_e in the weights' dtype (bf16; f32 on the CPU).
  /// With fp8_wgrad, ctx keeps x's columnwise copy for the weight gradient. Otherwise (no
  /// columnwise copy, or a native weight gradient) the layer needs save_original_input, and the
  /// caller hands the input in its own precision over with set_saved_input before the weight
  /// gradient. FP8 recipes only.
  Tensor forward_fp8(GroupedLinearFp8Operand x, const TensorView& counts, GroupedLinearContext& ctx,
                     Stream stream = nullptr, const TensorView& out = {});
  /// backward from an output gradient that the caller has quantized with grad_quantization()
  /// (allocate_fp8_operand, then the quantization, with the counts of forward): dx, and dW unless
  /// delayed, from the FP8 copies. Needs fp8_wgrad and no bias (the bias gradient reads dy in its
  /// own precision). FP8 recipes only.
  GroupedLinearBackward backward_fp8(GroupedLinearContext& ctx, GroupedLinearFp8Operand dy, Stream stream = nullptr,
                                     const TensorView& dgrad_out = {});

  /// For layers built on GroupedLinear that rebuild a saved input instead of keeping it
  /// (GroupedMLP with recompute_activation): with save_original_input, replaces the input that
  /// forward kept by reference with `x` (same shape and dtype, the same values), before the weight
  /// gradient is computed (backward, or backward_dw when delayed). The same aliasing contract holds
  /// for the new `x`.
  void set_saved_input(GroupedLinearContext& ctx, const TensorView& x) const;
  /// The same, and ctx takes `x` over: it is freed once the weight gradient has read it (in
  /// backward before dx's memory is taken, or after backward_dw when delayed).
  void set_saved_input(GroupedLinearContext& ctx, Tensor&& x) const;

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
  /// The activation of forward_with_activation.
  struct ActivationOut {
    TensorView z;
    ActivationOptions options;
    TensorView probs;
  };
  /// The activation's backward of backward_with_activation.
  struct ActivationBackwardIn {
    TensorView h, dh;
    ActivationOptions options;
  };
  Tensor forward_impl(const TensorView& x, const TensorView& counts, GroupedLinearContext& ctx, Stream stream,
                      const TensorView& out, const ActivationOut* act);
  /// forward once x is quantized (arguments checked): the FP8 fprop (+ bias, + `act`), x's
  /// columnwise copy (if any) kept for the weight gradient, else x's shape only.
  Tensor forward_quantized(GroupedLinearFp8Operand xq, const TensorView& counts, GroupedLinearContext& ctx,
                           Stream stream, const TensorView& out, const ActivationOut* act);
  GroupedLinearBackward backward_impl(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                      const TensorView& dgrad_out, const TensorView& dy_amax,
                                      const ActivationBackwardIn* act);
  // The shared tails: x kept (by reference or as a copy), the FP8 dgrad, and everything after dx.
  void save_input(GroupedLinearContext& ctx, const TensorView& x, Stream stream) const;
  void fp8_dgrad(GroupedLinearContext& ctx, GroupedLinearFp8Operand dyq, const TensorView& dx, Stream stream) const;
  GroupedLinearGrads begin_grads(GroupedLinearContext& ctx, const TensorView& dy, Stream stream,
                                 const TensorView& db) const;
  GroupedLinearBackward finish_backward(GroupedLinearContext& ctx, const TensorView& dy, Tensor dx, Stream stream,
                                        const TensorView& db);
  GroupedLinearBackward end_backward(GroupedLinearContext& ctx, Tensor dx, GroupedLinearGrads grads,
                                     Stream stream) const;
  GroupedLinearGrads allocate_grads(Stream stream) const;
  void compute_wgrad(GroupedLinearContext& ctx, GroupedLinearGrads& grads, Stream stream) const;
  Allocator& allocator() const;
  void check_active_for_backward(const GroupedLinearContext& ctx) const;

  /// Forward keeps x's columnwise FP8 copy for the weight gradient instead of x.
  bool fp8_keeps_x_cols() const { return fp8() && options_.fp8_wgrad && !options_.save_original_input; }
  Fp8QuantizeOptions fp8_options(DType format, bool rowwise, bool columnwise) const;
  Fp8GemmOptions fp8_gemm_options() const { return Fp8GemmOptions{options_.fp8_fast_accumulation}; }

  ExpertWeights weight_;
  ExpertBias bias_;
  GroupedLinearOptions options_;
  // FP8 recipes: the quantized weights (rowwise + transposed), allocated at construction.
  Fp8WeightsTensor fp8_weight_;
  bool fp8_weight_valid_ = false;
};

}  // namespace gmoe
