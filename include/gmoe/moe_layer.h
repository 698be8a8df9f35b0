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
//             xp  = combine_backward(x)     regather_expert_input: FC1's input gathered again
//             dxp, dpp = experts.backward(dyp);  dx, dprobs = permute_backward(dxp, dpp)
//             dlogits = router_topk_backward(dprobs) (+ the losses')
//
// Memory that does not grow with top-k (options.regather_expert_input, on by default): the
// permuted rows xp ([rows, H], k copies of each token) are FC1's input, which its weight gradient
// dW1_e = dh_eᵀ·xp_e reads. Forward frees them once the experts have run, and backward gathers
// them again from x (kept by reference anyway) through the map the layer keeps: combine_backward
// of x with weights 1 writes x[t] to the row each (t, j) owns and zeros to every other row, which
// is exactly what permute wrote, so the gradients are bitwise those of a layer that kept xp. Cost:
// one more gather pass (permute's bytes) in backward, for rows·H·es bytes less between forward
// and backward. It applies where FC1 reads its input by reference (the experts'
// fc1.save_original_input; with an FP8 recipe FC1 then quantizes the regathered rows columnwise
// in backward, and keeps no FP8 copy either). Where FC1 keeps its own copy of its input (without
// save_original_input: a copy, or with fp8_wgrad the FP8 columnwise copy) that copy is what
// backward reads, so the layer frees xp after forward either way and has nothing to gather. With
// an EP group the experts' input is the rows other ranks sent, which this rank cannot gather from
// its own x: the layer then keeps what the experts need, as without the option (another exchange
// in backward would cost more than the memory it saves). regathers_expert_input() says whether a
// layer gathers.
//
// Backward's peak is FC1's backward, holding both weight gradients; it holds one [rows, H] buffer
// there, not three: the layer hands the experts their output gradient dyp and FC1's input xp
// (gathered again, or kept) with ownership (GroupedMLP::backward and set_saved_input taking a
// Tensor), so dyp is freed once FC2's weight gradient has read it, and xp once FC1's has, before
// FC1's dx takes memory (GroupedLinear::backward computes dW before dx). dx of the tokens is
// allocated after the experts' backward.
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
//
// Expert parallelism (options.ep, a group of R > 1 ranks; gmoe/expert_parallel.h): every rank runs
// its own layer on its own tokens, and its GroupedMLP holds only its El = E / R experts, global
// experts [rank·El, (rank+1)·El). The router, the permutation and the combine work on the rank's
// tokens over all E experts; the experts' rows travel between them:
//   forward   xp, counts_p, map, pp = permute(x, ids, probs)    the source layout, over E experts
//             plan   = ep_plan(counts_p)                        (all ranks' counts, on the device)
//             xr, pr = ep_dispatch(plan, xp, pp)                 the receive layout, by local expert
//             yr     = experts.forward(xr, plan.local_counts, pr)
//             yp     = ep_combine(plan, yr)                      back to the source layout
//             out    = combine(yp, map)                         as above
//   backward  dyp = combine_backward(dout);  dyr = ep_dispatch(plan, dyp)
//             dxr, dpr = experts.backward(dyr);  dxp, dpp = ep_combine(plan, dxr, dpr)
//             dx, dprobs = permute_backward(dxp, dpp);  dlogits as above
// (the weighted combine likewise, without the probabilities in the exchanges). Every step is
// collective: all ranks of the group call forward, and backward, in the same order. A rank's
// outputs are those of the single-GPU layer holding all E experts run on the rank's tokens alone,
// and the experts' weight gradients are those of its slice of that layer run on all ranks' tokens.
// Hence what is per rank: a per-expert capacity (PermuteOptions::capacity_factor) is computed from
// and applied to the rank's tokens, and the load-balancing and z losses are those of the rank's
// tokens (counts, T and the mean over tokens all local, as Megatron computes them per micro-batch:
// the data-parallel reduction of the gradients averages them). They are not the losses of the
// concatenated global batch (whose aux loss is a product of global sums, not a mean of ranks').
//
// Streams in backward (MoEBackwardOverlap): by default every step runs on the call's stream. With
// an EP group and overlap.comm_stream, the two exchanges of backward run on comm_stream instead,
// ordered against the call's (compute) stream with events: comm_stream waits for dyp, the compute
// stream waits for dyr before the experts; comm_stream waits for the experts' dxr, the compute
// stream for dxp before permute_backward. Work the caller enqueues on the compute stream in
// overlap.during_dispatch (the previous layer's delayed weight gradients, say) runs while the
// dispatch of dyp is in flight; with overlap.experts_wgrad_during_combine the experts' delayed
// weight gradients (GroupedMLP::backward_dw) run on the compute stream while ep_combine of dxr is
// in flight (Megatron's overlap_dispatch_backward_with_experts_wgrad). backward returns with all
// of comm_stream's work joined into the compute stream (a capture of the compute stream captures
// both), and every buffer either stream touched released in stream order. comm_stream needs no
// ordering from the caller (its first wait orders it after everything enqueued on the compute
// stream before the call, this layer's forward exchanges included), but the caller must not
// enqueue other ops of the same group on it, or on the compute stream in during_dispatch, while
// backward runs: the group's ops keep one order.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>

#include "gmoe/allocator.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/routing.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

class EpGroup;  // gmoe/expert_parallel.h: one rank of an expert-parallel group

/// Options of a MoELayer.
struct MoELayerOptions {
  RouterOptions router;            ///< the top-k rule
  PermuteOptions permute;          ///< per-expert padding and capacity
  TensorView score_bias;           ///< absent, or f32 [E]: the selection-only bias (kept by reference)
  float aux_loss_coeff = 0.0f;     ///< the load-balancing loss's coefficient; 0: not computed
  float z_loss_coeff = 0.0f;       ///< the z-loss's coefficient; 0: not computed
  Allocator* allocator = nullptr;  ///< outputs, saved tensors and scratch; nullptr: the device's default
  /// The expert-parallel group (kept by reference; see the top of this file), or nullptr. nullptr
  /// or a group of size 1: the single-GPU layer, bitwise. Its options must match the layer: E =
  /// the experts' count × size, hidden = H, dtype = x's, max_rows >= permuted_rows(T, k, E,
  /// permute) for every forward's T (xp, the source layout, has max_rows rows), device = x's.
  /// Rows past a rank's receive capacity (EpGroupOptions::max_recv_rows, when set below size ·
  /// max_rows) are dropped by the dispatch and recorded in the device error word: their tokens
  /// get no expert output there.
  EpGroup* ep = nullptr;
  /// Do not keep the permuted rows (FC1's input) for backward: backward gathers them again from x
  /// for FC1's weight gradient, bitwise the same (see the top of this file: where it applies, and
  /// why not with an EP group). rows·H·es bytes less kept per forward, one more gather in backward.
  bool regather_expert_input = true;
};

/// How MoELayer::backward overlaps its exchanges with compute (see the top of this file for the
/// stream contract). The defaults run everything in order on the call's stream.
struct MoEBackwardOverlap {
  /// With an EP group of size > 1: the stream of backward's two exchanges (ep_dispatch of dyp,
  /// ep_combine of dxr); nullptr: the call's stream. Ignored without EP.
  Stream comm_stream = nullptr;
  /// Runs the experts' delayed weight gradients (GroupedMLP::backward_dw: the experts' options
  /// must delay fc1's or fc2's) on the call's stream while ep_combine of dxr is in flight, and
  /// returns them in MoEBackward::grads; the caller does not call backward_dw for this forward.
  /// Without EP they run right after the experts' backward.
  bool experts_wgrad_during_combine = false;
  /// Called on the host once the dispatch of dyp is enqueued on comm_stream and before the call's
  /// stream waits for it: work the caller enqueues on the call's stream here overlaps the dispatch.
  /// It must enqueue no op of this EP group. Called without EP too (at the same point).
  std::function<void()> during_dispatch;
};

/// Result of MoELayer::forward.
struct MoEForward {
  Tensor out;       ///< [T, H], x's dtype
  Tensor ids;       ///< i32 [T, k]: the experts of each token (a view of what the context keeps)
  Tensor probs;     ///< f32 [T, k]: their probabilities (a view of what the context keeps)
  Tensor counts;    ///< i32 [E]: tokens routed to each expert before any capacity drop (a view, likewise;
                    ///< with EP this rank's tokens over all E experts)
  Tensor aux_loss;  ///< f32 [1] when aux_loss_coeff != 0, else absent (with EP: this rank's tokens')
  Tensor z_loss;    ///< f32 [1] when z_loss_coeff != 0, else absent (with EP: this rank's tokens')
};

/// Result of MoELayer::backward.
struct MoEBackward {
  Tensor dx;              ///< [T, H], x's dtype: through the experts only (the gate's path is the caller's)
  Tensor dlogits;         ///< f32 [T, E]: through the probabilities and the losses
  GroupedMLPGrads grads;  ///< the experts' weight and bias gradients (see GroupedMLP::backward; with EP
                          ///< this rank's experts', from every rank's tokens routed to them)
};

/// What forward keeps for backward. One per forward in flight. Offloadable (gmoe/offload.h): the
/// router's ids, probs and counts, the permuted counts, the permutation map, the permuted input
/// only where the experts read it by reference and the layer does not gather it again
/// (regathers_expert_input()), the experts' context, and either the per-row probabilities (probs_in_experts: the experts keep
/// them by reference) or the experts' output (the weighted combine's dprobs reads it). Backward
/// hands the experts' context their output gradient and their input (kept or gathered again): it
/// frees each after the weight gradient that reads it, in backward, or in backward_dw when that
/// gradient is delayed. With EP also
/// the exchange's plan (backward's exchanges reuse it; the experts keep its local counts by
/// reference), and in the receive layout the per-row probabilities and, where the experts keep
/// their input by reference (fc1.save_original_input), their input; not the source-layout rows,
/// which the exchange has sent. Never x or logits (the caller's).
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
  /// count does not allow, and on an EP group whose options do not match (options.ep).
  MoELayer(GroupedMLP& experts, MoELayerOptions options = {});

  /// The options the layer was built with.
  const MoELayerOptions& options() const { return options_; }
  /// The experts this layer (this rank, with EP) holds.
  GroupedMLP& experts() const { return *experts_; }
  /// E, the experts the router chooses among: the experts' count, times the EP group's size.
  int64_t num_experts() const;
  /// True with an EP group of size > 1 (the exchanges run); false for the single-GPU path.
  bool expert_parallel() const;
  /// True when the router probabilities are applied inside the experts' activation and the
  /// combine has weights 1 (the experts' FC2 has no bias; see the top of this file), false when
  /// the combine weights the experts' output.
  bool probs_in_experts() const { return !experts_->fc2().bias().defined(); }
  /// True when forward frees the permuted rows and backward gathers them again for FC1's weight
  /// gradient: options().regather_expert_input, the experts' fc1.save_original_input, and no EP
  /// group of size > 1 (see the top of this file).
  bool regathers_expert_input() const;

  /// x: [T, H] of the experts' dtype; logits: [T, E] f32/bf16/f16 on x's device (E =
  /// num_experts(), all experts of the EP group). x, logits (and the options' score_bias) are kept
  /// by reference until backward: keep them alive and unchanged. With EP: collective.
  MoEForward forward(const TensorView& x, const TensorView& logits, MoELayerContext& ctx, Stream stream = nullptr);

  /// dout: [T, H] of x's dtype. d_aux_loss, d_z_loss: absent (1) or f32 [1] on the device, the
  /// upstream gradients of the losses forward returned. overlap: see MoEBackwardOverlap. With EP:
  /// collective.
  MoEBackward backward(MoELayerContext& ctx, const TensorView& dout, Stream stream = nullptr,
                       const TensorView& d_aux_loss = {}, const TensorView& d_z_loss = {},
                       const MoEBackwardOverlap& overlap = {});

 private:
  Allocator& allocator(Device device) const;
  GroupedMLP* experts_;
  MoELayerOptions options_;
};

}  // namespace gmoe
