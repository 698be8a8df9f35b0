// gmoe/grouped_mlp.h — GroupedMLP: the expert MLP of an MoE block, FC1 → activation → FC2.
//
// For E experts with FC1 weights W1_e [2F, H] (gated activations; [F, H] for squared ReLU), FC2
// weights W2_e [H, F], optional biases b1_e [2F], b2_e [H], and optional router probabilities
// p [capacity] (f32, one per row):
//   forward   h = x·W1_eᵀ + b1_e                [capacity, 2F]   (FC1, a GroupedLinear)
//             z = act(h) · p                    [capacity, F]    (gmoe/activation.h)
//             y = z·W2_eᵀ + b2_e                [capacity, H]    (FC2, a GroupedLinear)
//   backward  dz = dy·W2_e,  dW2_e = dyᵀ·z,  db2_e = Σ dy
//             dh = act'(h)·dz·p,  dp = Σ_j dz·act(h)
//             dx = dh·W1_e,  dW1_e = dhᵀ·x,  db1_e = Σ dh
// Counts stay on the device: forward, backward and backward_dw never synchronise and can be
// captured in a CUDA graph once and replayed under any routing. Rows past the real total of the
// counts give y = 0, dx = 0, dp = 0.
//
// The gate/up layout of FC1's 2F output rows (its weight rows and bias entries) is
// options.activation.glu: concatenated ([gate; up]) or interleaved in blocks (convert weights,
// biases and checkpoints with convert_fc1_glu / fc1_to_interleaved / fc1_to_concatenated, or with
// the checkpoint loader's GLU conversion).
//
// What lives between forward and backward (per layer, es = bytes per element):
//   x           capacity·H·es     a copy (none with fc1.save_original_input: a reference)
//   h           capacity·2F·es    FC1's output, the activation's input (backward writes dh over it)
//   z           capacity·F·es     FC2's input, for dW2 — not kept with recompute_activation, which
//                                  recomputes it in backward in the same pass as dh (no extra read
//                                  of h), saving capacity·F·es per layer for a little arithmetic
//   probs, counts                  references to the caller's tensors (keep them alive, unchanged)
// Backward additionally holds dz (capacity·F·es) while the activation's backward runs, and dprobs.
//
// What runs: FC1 and the activation as one op (GroupedLinear::forward_with_activation, i.e.
// grouped_gemm_fprop_activation: gmoe/grouped_gemm.h says where its activation runs), then FC2;
// backward FC2's dgrad and the activation's backward as one op where nothing else needs dz
// (GroupedLinear::backward_with_activation: no probs, no recomputed z, native recipe, gated
// activation), else FC2's dgrad then grouped_activation_backward; then FC1's backward. Both FCs
// are GroupedLinear layers driven through their public API. With an FP8 recipe (options.recipe)
// both FCs quantize inside as GroupedLinear does (x, z and the gradients in one pass each, the
// weights cached; see gmoe/grouped_linear.h), the activation in between in bf16, with z quantized
// by the activation itself (fp8_quantize_in_activation below).
#pragma once

#include <cstdint>
#include <memory>

#include "gmoe/activation.h"
#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_linear.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Options of a GroupedMLP.
struct GroupedMLPOptions {
  /// The activation (kind, alpha, limit, GELU form) and FC1's gate/up layout.
  ActivationOptions activation;
  /// Per-FC settings, as for a GroupedLinear: delay_wgrad (each FC separately; backward_dw computes
  /// the delayed ones), main_grad + accumulate + expert_mask + masked_off (the experts with mask 0
  /// skipped, or their gradient in GroupedLinearGrads::masked_off_weight), and one wgrad_hook per FC, called as
  /// soon as that FC's weight gradients are complete — FC2's before FC1's, so a data-parallel
  /// reduce-scatter of FC2's gradients overlaps FC1's backward (with only fc2.delay_wgrad, FC1's
  /// gradients complete first, in backward, and its hook fires there; FC2's in backward_dw).
  /// fc1.save_original_input keeps a reference to x instead of a copy (same aliasing contract as
  /// GroupedLinear).
  /// fc2.save_original_input is ignored: FC2's input is the layer's own z, always kept by
  /// reference (fc2().options() shows what FC2 runs with: save_original_input, and delay_wgrad
  /// also under recompute_activation, since dW2 needs the z that backward rebuilds; backward then
  /// computes it itself unless fc2.delay_wgrad). fc1/fc2.allocator default to `allocator` below.
  GroupedLinearOptions fc1;  ///< FC1's settings (see above)
  GroupedLinearOptions fc2;  ///< FC2's settings (see above)
  /// Do not keep z = act(h)·p from forward to backward; backward recomputes it (see above).
  bool recompute_activation = false;
  /// The precision of both FCs' GEMMs (LinearRecipe of gmoe/grouped_linear.h: native, or an FP8
  /// recipe with its constraints: bf16 weights, and on CUDA hidden and ffn multiples of 16). It
  /// sets fc1.recipe and fc2.recipe, which must be left native (or equal to it).
  LinearRecipe recipe = LinearRecipe::native;
  /// FP8 recipes: quantize FC2's input inside the activation (z is never written in bf16, nor
  /// read back, nor quantized again for dW2), on CUDA in one pass where the kernel allows it
  /// (docs/architecture.md); used when FC2's weight gradient is FP8 or z is recomputed. Bitwise
  /// the values of the activation followed by the quantization (false: those two ops). Tensorwise
  /// takes the two ops either way, the activation giving z's per-expert amax from its own pass
  /// (the one-pass kernel would evaluate the activation twice, for the amax and for the values):
  /// z is written in bf16 for the quantizer's one read ([capacity, ffn] of scratch meanwhile).
  bool fp8_quantize_in_activation = true;
  /// Scratch, saved tensors and fresh gradients; nullptr: the device's default allocator.
  Allocator* allocator = nullptr;
};

/// Weight and bias gradients of both FCs (see GroupedLinearGrads: fresh gradients are views of one
/// packed allocation per FC, or the caller's main_grad).
struct GroupedMLPGrads {
  GroupedLinearGrads fc1;  ///< FC1's weight and bias gradients
  GroupedLinearGrads fc2;  ///< FC2's weight and bias gradients
};

/// Result of GroupedMLP::backward.
struct GroupedMLPBackward {
  Tensor dx;              ///< [capacity, H]: dgrad_out when given, else owned
  Tensor dprobs;          ///< f32 [capacity] when forward had probs (dprobs_out when given), else absent
  GroupedMLPGrads grads;  ///< weight gradients unless delayed (bias gradients always)
};

/// What forward saves for backward (and backward for backward_dw). One per forward in flight.
/// Offloadable (gmoe/offload.h): h (dh after backward), z, and both FCs' saved tensors (x's copy,
/// FP8 columnwise copies and scales); never counts, probs or x kept by reference.
class GroupedMLPContext : public Offloadable {
 public:
  GroupedMLPContext();
  ~GroupedMLPContext();
  GroupedMLPContext(GroupedMLPContext&&) noexcept;
  GroupedMLPContext& operator=(GroupedMLPContext&&) noexcept;
  /// True between forward and the end of the last weight gradient.
  bool active() const;

 private:
  friend class GroupedMLP;
  void collect(OffloadSlots& slots) override;
  struct State;
  std::unique_ptr<State> state_;
};

/// The expert MLP (see the top of this file): FC1 → activation → FC2 over grouped rows, forward and
/// backward with the gradients of every input. One layer may serve several forwards in flight, each
/// with its context.
class GroupedMLP {
 public:
  /// fc1_weight: E × [2F, H] (gated; E × [F, H] for squared_relu), fc2_weight: E × [H, F], each
  /// stacked or a list; bf16 or f16 (f32 on the CPU backend), one dtype and device. Biases: none,
  /// or E × [2F] (in FC1's gate/up layout) and E × [H], grouped or lists, dtype of the weights or
  /// f32. Throws gmoe::Error naming the argument on any mismatch.
  GroupedMLP(ExpertWeights fc1_weight, ExpertWeights fc2_weight, ExpertBias fc1_bias = {},
             ExpertBias fc2_bias = {}, GroupedMLPOptions options = {});

  /// E.
  int64_t num_experts() const { return fc1_.num_experts(); }
  /// H, the columns of x and y.
  int64_t hidden() const { return fc1_.in_features(); }
  /// F, the columns of z (FC2's input).
  int64_t ffn() const { return fc2_.in_features(); }
  /// FC1, with the options it runs with.
  const GroupedLinear& fc1() const { return fc1_; }
  /// FC2, with the options it runs with (see GroupedMLPOptions::fc2).
  const GroupedLinear& fc2() const { return fc2_; }
  /// The options the layer was built with (fc1/fc2 allocators and recipes filled in).
  const GroupedMLPOptions& options() const { return options_; }

  /// FP8 recipes: marks both FCs' quantized weight caches stale (after the optimizer changed the
  /// weights); the next forward quantizes them again (GroupedLinear::invalidate_fp8_weight).
  void invalidate_fp8_weight() {
    fc1_.invalidate_fp8_weight();
    fc2_.invalidate_fp8_weight();
  }

  /// y for x: [capacity, H] of the weights' dtype; counts: [E] i32/i64; probs: absent or f32
  /// [capacity]. counts, probs (and x with fc1.save_original_input) are kept by reference until
  /// backward (backward_dw for a delayed FC1): keep them alive and unchanged. Counts in host memory
  /// for a CUDA layer are uploaded once (upload_counts, gmoe/copy.h: pinned, stream-ordered, no
  /// sync; they may change once forward returns) into memory that ctx keeps for both FCs, the
  /// activation and their backward. `out`, if given, is [capacity, H] of x's dtype and receives y.
  Tensor forward(const TensorView& x, const TensorView& counts, const TensorView& probs,
                 GroupedMLPContext& ctx, Stream stream = nullptr, const TensorView& out = {});

  /// dx, dprobs (when forward had probs), bias gradients, and the weight gradients of the FCs that
  /// are not delayed (their hooks fire here). dy: [capacity, H]; with a delayed FC2 it is kept by
  /// reference until backward_dw. `dgrad_out`, if given, is [capacity, H] and receives dx;
  /// `dprobs_out`, if given (only when forward had probs), is f32 [capacity] and receives dprobs,
  /// so that every output can live in caller-owned buffers (a replayed CUDA graph's, a framework's).
  GroupedMLPBackward backward(GroupedMLPContext& ctx, const TensorView& dy, Stream stream = nullptr,
                              const TensorView& dgrad_out = {}, const TensorView& dprobs_out = {});
  /// The same, and ctx takes `dy` over: it is freed once FC2's weight gradient has read it (before
  /// FC1's backward takes memory, or in backward_dw when FC2's is delayed), so that the pass does
  /// not hold dy and FC1's gradients at once.
  GroupedMLPBackward backward(GroupedMLPContext& ctx, Tensor&& dy, Stream stream = nullptr,
                              const TensorView& dgrad_out = {}, const TensorView& dprobs_out = {});

  /// The delayed weight gradients (FC2's, then FC1's), on `stream`, ordered after backward through
  /// an event; calls their hooks and releases what was saved. Capturable in a CUDA graph.
  GroupedMLPGrads backward_dw(GroupedMLPContext& ctx, Stream stream = nullptr);

  /// For layers built on GroupedMLP that rebuild its input instead of keeping it (MoELayer with
  /// regather_expert_input gathers its permuted rows again): with fc1.save_original_input,
  /// replaces the x that forward kept by reference with `x` (same shape and dtype, the same
  /// values) before FC1's weight gradient reads it (backward, or backward_dw when FC1's is
  /// delayed). The aliasing contract of save_original_input holds for the new `x`.
  void set_saved_input(GroupedMLPContext& ctx, const TensorView& x) const;
  /// The same, and ctx takes `x` over: it is freed once FC1's weight gradient has read it (before
  /// FC1's dx takes memory unless delayed; GroupedLinear::set_saved_input).
  void set_saved_input(GroupedMLPContext& ctx, Tensor&& x) const;

 private:
  Allocator& allocator() const;
  void check_set_saved_input(const GroupedMLPContext& ctx) const;
  /// forward once the arguments are checked and the counts are on the layer's device.
  Tensor forward_device_counts(const TensorView& x, const TensorView& counts, const TensorView& probs,
                               GroupedMLPContext& ctx, Stream stream, const TensorView& out);
  /// FP8 under the conditions of fp8_quantize_in_activation: forward quantizes z inside the
  /// activation.
  bool fp8_quantize_z() const {
    return options_.recipe != LinearRecipe::native && options_.fp8_quantize_in_activation &&
           (fc2_.options().fp8_wgrad || options_.recompute_activation);
  }

  GroupedMLPOptions options_;
  GroupedLinear fc1_;
  GroupedLinear fc2_;
};

}  // namespace gmoe
