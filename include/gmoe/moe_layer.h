// gmoe/moe_layer.h — MoELayer: the routed part of a Mixture-of-Experts block, from the router's
// logits to the combined output, built from the public ops of gmoe/routing.h and a GroupedMLP.
//
//   forward   ids, probs, counts = router_topk(logits)                 (gmoe/routing.h)
//             xp, counts_p, map, pp = permute(x, ids, probs)            rows grouped by expert, pp: each
//                                                                      row's probability (0 for padding)
//             yp                 = experts.forward(xp, counts_p, pp)   (gmoe/grouped_mlp.h): z = act(h)·pp
//             out[t]             = Σ_j yp[row(t, j)]                    combine with weights 1
//             aux_loss, z_loss   (when their coefficients are not 0)
//   backward  dyp = combine_backward(dout)  (a gather of dout: needs no yp)
//             dxp, dpp = experts.backward(dyp);  dx, dprobs = permute_backward(dxp, dpp)
//             dlogits = router_topk_backward(dprobs) (+ the losses')
//
// The probabilities are applied inside the experts' activation (as Megatron and Transformer Engine
// do) rather than in the combine, so that yp need not be kept for the combine's d(probs) =
// <dout[t], yp[row]>: GroupedMLP forms d(pp) from the values its backward has anyway. Exact
// because FC2 is linear: FC2(p·z) = p·FC2(z). With an FC2 bias it is not (FC2(p·z) = p·W2·z + b2,
// but the block is p·(W2·z + b2)), so experts whose FC2 has a bias (gpt-oss) take the weighted
// combine: yp = experts.forward(xp, counts_p), out[t] = Σ_j probs[t, j]·yp[row(t, j)], and yp is
// kept for dprobs (probs_in_experts() says which path a layer takes).
//
// The logits are the caller's (the gate projection x·W_rᵀ is a dense GEMM of the framework's), and
// so is the gradient of that projection: backward returns dlogits beside dx. Nothing reads the
// counts on the host; forward and backward never synchronise and can be captured in a CUDA graph
// and replayed under any routing. Shared experts (a dense MLP beside the routed ones) are the
// caller's too: their output is added to `out`.
#pragma once

#include <cstdint>
#include <memory>

#include "gmoe/allocator.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/routing.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Options of a MoELayer.
struct MoELayerOptions {
  RouterOptions router;            ///< the top-k rule
  PermuteOptions permute;          ///< per-expert padding and capacity
  TensorView score_bias;           ///< absent, or f32 [E]: the selection-only bias (kept by reference)
  float aux_loss_coeff = 0.0f;     ///< the load-balancing loss's coefficient; 0: not computed
  float z_loss_coeff = 0.0f;       ///< the z-loss's coefficient; 0: not computed
  Allocator* allocator = nullptr;  ///< outputs, saved tensors and scratch; nullptr: the device's default
};

/// Result of MoELayer::forward.
struct MoEForward {
  Tensor out;       ///< [T, H], x's dtype
  Tensor ids;       ///< i32 [T, k]: the experts of each token (a view of what the context keeps)
  Tensor probs;     ///< f32 [T, k]: their probabilities (a view of what the context keeps)
  Tensor counts;    ///< i32 [E]: tokens routed to each expert before any capacity drop (a view, likewise)
  Tensor aux_loss;  ///< f32 [1] when aux_loss_coeff != 0, else absent
  Tensor z_loss;    ///< f32 [1] when z_loss_coeff != 0, else absent
};

/// Result of MoELayer::backward.
struct MoEBackward {
  Tensor dx;              ///< [T, H], x's dtype: through the experts only (the gate's path is the caller's)
  Tensor dlogits;         ///< f32 [T, E]: through the probabilities and the losses
  GroupedMLPGrads grads;  ///< the experts' weight and bias gradients (see GroupedMLP::backward)
};

/// What forward keeps for backward. One per forward in flight. Offloadable (gmoe/offload.h): the
/// router's ids, probs and counts, the permuted input and counts, the permutation map, the
/// experts' context, and either the per-row probabilities (probs_in_experts: the experts keep
/// them by reference) or the experts' output (the weighted combine's dprobs reads it); after
/// backward the experts' output gradient, which a delayed FC2 weight gradient reads. Never x or
/// logits (the caller's).
class MoELayerContext : public Offloadable {
 public:
  MoELayerContext();
  ~MoELayerContext();
  MoELayerContext(MoELayerContext&&) noexcept;
  MoELayerContext& operator=(MoELayerContext&&) noexcept;
  /// The experts' context (for GroupedMLP::backward_dw after a delayed weight gradient).
  GroupedMLPContext& experts();
  /// True from forward on; what it keeps is released when the context is destroyed or reused by
  /// the next forward (the experts' delayed weight gradients may still need it after backward).
  bool active() const;

 private:
  friend class MoELayer;
  void collect(OffloadSlots& slots) override;
  struct State;
  std::unique_ptr<State> state_;
};

/// Router → permute → experts → combine. The GroupedMLP is the caller's, used through its public
/// API and kept by reference (it must outlive the layer).
class MoELayer {
 public:
  /// Throws gmoe::Error naming the option on a top_k, group or padding setting that the experts'
  /// count does not allow.
  MoELayer(GroupedMLP& experts, MoELayerOptions options = {});

  const MoELayerOptions& options() const { return options_; }
  GroupedMLP& experts() const { return *experts_; }
  /// True when the router probabilities are applied inside the experts' activation and the
  /// combine has weights 1 (the experts' FC2 has no bias; see the top of this file), false when
  /// the combine weights the experts' output.
  bool probs_in_experts() const { return !experts_->fc2().bias().defined(); }

  /// x: [T, H] of the experts' dtype; logits: [T, E] f32/bf16/f16 on x's device. x, logits (and
  /// the options' score_bias) are kept by reference until backward: keep them alive and unchanged.
  MoEForward forward(const TensorView& x, const TensorView& logits, MoELayerContext& ctx, Stream stream = nullptr);

  /// dout: [T, H] of x's dtype. d_aux_loss, d_z_loss: absent (1) or f32 [1] on the device, the
  /// upstream gradients of the losses forward returned.
  MoEBackward backward(MoELayerContext& ctx, const TensorView& dout, Stream stream = nullptr,
                       const TensorView& d_aux_loss = {}, const TensorView& d_z_loss = {});

 private:
  Allocator& allocator(Device device) const;
  GroupedMLP* experts_;
  MoELayerOptions options_;
};

}  // namespace gmoe
