// gmoe/fp8_gemm.h — FP8 grouped GEMM for the three passes of an expert linear layer.
//
// The operands are FP8 tensors in the format of gmoe/fp8.h (made by quantize_grouped /
// quantize_weights); the results are those of the dequantized operands, accumulated in fp32:
//   fprop  y_e  = dequant(x_e) · dequant(W_e)ᵀ      x rowwise,          W data    [E, N, K]
//   dgrad  dx_e = dequant(dy_e) · dequant(W_e)       dy rowwise,         W data_t  [E, K, N]
//   wgrad  dW_e = dequant(dy_e)ᵀ · dequant(x_e)      dy, x columnwise    (reduction over tokens)
// Every pass reads the copy quantized along its reduction dimension, as the format intends.
//
// Recipes (both operands of a call must use the same one):
//   blockwise   1x128 scales on grouped rows, 128x128 on weights, applied to the fp32 partial sum
//               of every 128-long k-block inside the GEMM (DeepSeek-V3's recipe).
//   tensorwise  one scale per expert and operand: alpha_e = s_a[e]·s_b[e], computed on the device
//               and applied in the epilogue.
//   mxfp8       1x32 e8m0 scales. Hopper has no hardware block scaling, and software scaling
//               of 32-wide blocks would have to leave the tensor cores after every wgmma k-step
//               (CUTLASS's Hopper blockwise mainloop needs blocks of at least 4 k-steps, 128
//               elements). So on CUDA each operand is first dequantized to bf16 by a separate
//               kernel and the bf16 grouped GEMM runs: correct, but SLOWER than the bf16 GEMM
//               alone (it adds the dequantization traffic, the expert weights included, on every
//               call). It exists for numerics parity with MXFP8 training on Blackwell, not speed.
//
// CUDA (sm_90a), blockwise/tensorwise: the activations x (fprop) and the gradient dy (dgrad, wgrad)
// in e4m3 or e5m2, the weights and x in wgrad in e4m3 (mxfp8 takes either format anywhere); every
// K and N a multiple of 16 (16-byte TMA rows of fp8); outputs y/dx in bf16, dW in f32 (a main_grad,
// optionally accumulated into, with an expert mask) or bf16. Counts stay on the device, nothing
// synchronises, and every op is CUDA-graph capturable. The CPU backend is the reference:
// dequantize to f32, then the fp32 grouped GEMM of gmoe/grouped_gemm.h.
#pragma once

#include "gmoe/allocator.h"
#include "gmoe/fp8.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_gemm.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Options of the fprop and dgrad FP8 GEMMs.
struct Fp8GemmOptions {
  /// Fast accumulation (tensorwise on CUDA; a permission, not a demand): the tensor cores'
  /// accumulators sum the whole reduction, as Transformer Engine's FP8 fprop does by default
  /// (`use_split_accumulator=False`), instead of being added into fp32 accumulators every 128 of
  /// the reduction (the default: DeepSeek-V3's promotion, which the blockwise recipe always does).
  /// Hopper's FP8 tensor cores keep about 14 significant bits while they accumulate, so the error
  /// grows with the reduction length: at most one such rounding per 32 of the reduction, of Σ|a·b|
  /// (the tests' bound), against one per 128 promoted. With it the GEMM runs 128x256 tiles and is
  /// faster than the promoted kernel (the figures are in docs/decisions.md). Blockwise and mxfp8,
  /// an e5m2 A, a fused bias (tensorwise fprop with a bf16 bias) and reductions of 16384 or more
  /// keep the promoted kernel; the CPU reference accumulates in fp32 either way.
  bool fast_accumulation = false;
};

/// fprop: y[rows of e] = dequant(x)[rows of e] · dequant(W_e)ᵀ; rows past the real total are
/// zeroed.
/// x: rowwise copy (data [capacity, K], scale_inv); w: rowwise copy (data [E, N, K], scale_inv);
/// counts: [E] i32/i64 (the counts x was quantized with); y: [capacity, N] bf16 (f32 on the CPU).
/// `alloc` provides scratch (stream-ordered); nullptr means default_allocator(device).
void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& y, Stream stream = nullptr,
                            Allocator* alloc = nullptr);
/// The same plus a per-expert bias: y[rows of e] += bias_e (grouped [E, N] or a list of E
/// vectors of N, y's dtype). CUDA: a bf16 bias with an e4m3 x is added inside the GEMM, to the f32
/// accumulators before the one rounding to bf16 (blockwise: every expert's bias 16-byte aligned;
/// tensorwise: any alignment); otherwise (mxfp8, an e5m2 x, a misaligned blockwise bias, K = 0) a
/// second pass over y adds it, as grouped_bias_add does.
void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const ExpertBias& bias,
                            const TensorView& counts, const TensorView& y, Stream stream = nullptr,
                            Allocator* alloc = nullptr);
/// The same with options (bias may be empty: ExpertBias()).
void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const ExpertBias& bias,
                            const TensorView& counts, const TensorView& y, const Fp8GemmOptions& options,
                            Stream stream = nullptr, Allocator* alloc = nullptr);

/// dgrad: dx[rows of e] = dequant(dy)[rows of e] · dequant(W_e); rows past the real total are
/// zeroed. dy: rowwise copy (data [capacity, N]); w: transposed copy (data_t [E, K, N],
/// scale_inv_t); dx: [capacity, K] bf16 (f32 on the CPU).
void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, Stream stream = nullptr,
                            Allocator* alloc = nullptr);
/// The same with options.
void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, const Fp8GemmOptions& options, Stream stream = nullptr,
                            Allocator* alloc = nullptr);

/// wgrad: dW_e = dequant(dy_e)ᵀ · dequant(x_e), the reduction over expert e's tokens read from
/// the columnwise copies (dy.data_t [N, padded], x.data_t [K, padded], their scale_inv_t and
/// padded_offsets). dw: [E, N, K] stacked or E × [N, K], f32 or bf16 (f32 required with
/// options.accumulate). An expert with no tokens gets an exactly-zero dW_e (left unchanged when
/// accumulating); experts with options.expert_mask 0 are left untouched.
void fp8_grouped_gemm_wgrad(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts,
                            const ExpertWeights& dw, const WgradOptions& options = {},
                            Stream stream = nullptr, Allocator* alloc = nullptr);

}  // namespace gmoe
