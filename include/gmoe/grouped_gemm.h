// gmoe/grouped_gemm.h — grouped GEMM for the three passes of an expert linear layer.
//
// With X the grouped input rows [capacity, K], W_e the weight of expert e [N, K] and counts on the
// device:
//   fprop  Y_e  = X_e · W_eᵀ        Y  [capacity, N]
//   dgrad  dX_e = dY_e · W_e        dX [capacity, K]
//   wgrad  dW_e = dY_eᵀ · X_e       dW [E, N, K]   (reduction length counts[e], possibly 0)
// Inputs bf16/f16 (f32 on the CPU backend), fp32 accumulation. All tensors of one call live on one
// device; the op runs on that device's backend. CUDA ops never read counts on the host, never
// synchronise, and are CUDA-graph capturable: capture once, replay under any routing.
#pragma once

#include "gmoe/activation.h"
#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// What the weight gradient does for an expert whose WgradOptions::expert_mask entry is 0.
///
/// The mask splits the experts between two destinations in ONE grouped call (one launch, the
/// choice made on the device from the mask; no host sync): experts with mask 1 go to `dw` (the
/// main_grad, accumulated into with WgradOptions::accumulate), experts with mask 0 either get no
/// gradient (`skip`) or get their gradient written into a second buffer (`fresh`), which is what
/// Megatron-LM and Transformer Engine mean by a partial accumulation: "spare" experts whose
/// gradient must not land in main_grad but is still needed.
enum class MaskedOffWgrad : uint8_t {
  skip,   ///< mask 0: no gradient is computed; dW_e in `dw` (and everything else) is left untouched
  fresh,  ///< mask 0: dW_e is written (overwritten, never accumulated) into WgradOptions::fresh_dw
};

/// Options of the weight-gradient pass.
struct WgradOptions {
  /// D = A·B + D: accumulate into the existing contents of dW (fp32 dW only: a main_grad). Applies
  /// to the experts written into `dw`; `fresh_dw` is always overwritten.
  bool accumulate = false;
  /// Optional [E] int32 tensor on dW's device. Experts with a non-zero mask are written into `dw`
  /// (overwritten, or accumulated into when `accumulate`); experts with mask 0 follow `masked_off`.
  /// Absent: every expert is written into `dw`.
  TensorView expert_mask;
  /// What experts with mask 0 get (see MaskedOffWgrad). `fresh` needs an expert_mask and fresh_dw.
  MaskedOffWgrad masked_off = MaskedOffWgrad::skip;
  /// With masked_off == fresh: E × [N, K] of dw's dtype and device (stacked or a list, either
  /// layout independently of dw's), disjoint from dw. Expert e of it is written where mask[e] == 0
  /// (zeros when the expert has no rows) and left untouched where mask[e] != 0. With `skip` it must
  /// be absent.
  ExpertWeights fresh_dw;
};

/// fprop: y[rows of e] = x[rows of e] · W_eᵀ for each expert; rows past the real total are zeroed.
/// x: [capacity, K] bf16/f16; y: [capacity, N], dtype of x (or f32); counts: [E] i32/i64.
/// `alloc` provides scratch (stream-ordered); nullptr means default_allocator(x.device).
void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, Stream stream = nullptr, Allocator* alloc = nullptr);

/// fprop with a bias: y[rows of e] = x[rows of e] · W_eᵀ + b_e. bias: E × [N] (grouped [E, N] or a
/// list), dtype of x or f32. With bf16 x, bias and y the bias is added to the f32 accumulator before
/// the output's one rounding (on CUDA in the GEMM's epilogue: no extra pass over y); every other
/// combination adds it to the rounded GEMM output and rounds again (on CUDA a second pass over y).
/// Both backends compute the same. An absent bias is plain fprop.
void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const ExpertBias& bias,
                        const TensorView& counts, const TensorView& y, Stream stream = nullptr,
                        Allocator* alloc = nullptr);

/// FC1 of an expert MLP with its activation: h = fprop(x, w, bias) exactly as grouped_gemm_fprop
/// writes it, and z = act(h) [· probs] exactly as grouped_activation_forward(h, counts, z, options,
/// probs) writes it (h is still written: backward needs it). On every backend, CUDA included, it
/// runs those two ops in turn. x: [capacity, K]; h: [capacity, N] with N =
/// activation_input_cols(kind, F); z: [capacity, F], both of x's dtype, disjoint from each other
/// and from every input; probs: absent or f32 [capacity]. Rows past the real total: h = 0, z = 0.
void grouped_gemm_fprop_activation(const TensorView& x, const ExpertWeights& w, const ExpertBias& bias,
                                   const TensorView& counts, const TensorView& h, const TensorView& z,
                                   const ActivationOptions& options, const TensorView& probs = {},
                                   Stream stream = nullptr, Allocator* alloc = nullptr);

/// dgrad: dx[rows of e] = dy[rows of e] · W_e; rows past the real total are zeroed.
/// dy: [capacity, N]; dx: [capacity, K], dtype of dy (or f32).
void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx, Stream stream = nullptr, Allocator* alloc = nullptr);

/// FC2's data gradient of an expert MLP with the gated activation's backward: dz = dgrad(dy, w)
/// exactly as grouped_gemm_dgrad writes it, then dh = grouped_activation_backward(h, dz, counts, dh,
/// options) (no probabilities, no recomputed z), bitwise that composition on every backend. dy:
/// [capacity, H]; w: [E, H, F] (FC2's weights); h: [capacity, 2F] (a gated activation), dh: h's
/// shape and dtype, h itself or disjoint from it. On every backend, CUDA included, it runs those
/// two ops in turn, dz in a scratch buffer from `alloc` (on CUDA its rows padded to 16 bytes).
/// Rows past the real total: dh = 0.
void grouped_gemm_dgrad_activation_backward(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                                            const TensorView& h, const TensorView& dh,
                                            const ActivationOptions& options, Stream stream = nullptr,
                                            Allocator* alloc = nullptr);

/// wgrad: dW_e = dy_eᵀ · x_e for each expert. dy: [capacity, N], x: [capacity, K], same dtype.
/// dw: [E, N, K] stacked or E × [N, K], dtype of x or f32 (f32 required with accumulate). An expert
/// with no rows gets an exactly-zero dW_e (left unchanged when accumulating). With an expert_mask,
/// WgradOptions says where each expert's dW_e goes (dw, options.fresh_dw, or nowhere).
void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options = {},
                        Stream stream = nullptr, Allocator* alloc = nullptr);

}  // namespace gmoe
