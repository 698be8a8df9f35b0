// gmoe/fp8.h — FP8 operands of the grouped GEMMs: the format, and grouped quantization /
// dequantization of grouped rows (activations x, gradients dy) and of expert weights.
//
// The format (fixed; see docs/architecture.md, "FP8 operands"):
//   * e4m3 (max 448) or e5m2 (max 57344) data, one byte per element;
//   * scale_inv = the dequantization multiplier: x ≈ float(data) * scale_inv;
//   * recipes: tensorwise (one f32 scale per expert), blockwise (f32 scales, 1x128 blocks for
//     grouped rows, 128x128 for weights), mxfp8 (1x32 blocks, e8m0 scales);
//   * blocks never span two experts: the columnwise (transposed) copy of grouped rows pads every
//     expert's tokens to a multiple of 128 (kFp8TokenPad), from the device counts.
//
// Quantization rule (all recipes, bit-exact between the CPU and CUDA backends):
//   amax  = max |x| over the block (or the expert slice for tensorwise), over FINITE values only
//           (NaN and ±inf are skipped);
//   f32 recipes: scale = fp8_max / amax (IEEE f32 division), scale = FLT_MAX if that overflows,
//           scale = 1 if amax == 0; with pow2_scales, scale is rounded down to a power of two;
//           scale_inv = 1 / scale (IEEE f32 division);
//   mxfp8:  scale_inv = 2^(floor(log2 amax) - emax) (emax 8 for e4m3, 15 for e5m2), exponent
//           clamped to e8m0's range [-127, 127]; amax == 0 -> 1.0 (e8m0 byte 127);
//           scale = 1 / scale_inv (exact: a power of two);
//   data  = fp8(x * scale) with x * scale rounded once in f32, then converted round-to-nearest-even
//           with saturation to ±fp8_max (cuda_fp8.h __NV_SATFINITE semantics).
//   Non-finite inputs: NaN -> the canonical NaN byte 0x7F (both formats, sign dropped, as the
//   hardware conversion does); ±inf -> ±fp8_max (saturated, like every out-of-range value).
//   Neither changes the scale (amax skips them).
//   Partial blocks (cols not a multiple of the block, or N/K of weights): the last block of a
//   row/column is partial; its amax is over the elements that exist.
//   Padding (columnwise token padding, rows past the real total): data 0, and their blocks (if
//   entirely padding) have amax 0 -> scale_inv 1.
#pragma once

#include <cstdint>
#include <memory>

#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// How an FP8 tensor is scaled (see the top of this file).
enum class Fp8Recipe : uint8_t {
  tensorwise,  ///< one f32 scale per expert (current scaling)
  blockwise,   ///< f32 scales per 1x128 block of grouped rows, per 128x128 block of weights
  mxfp8,       ///< e8m0 scales per 1x32 block
};

/// Block sizes, fixed:
constexpr int64_t kFp8Block = 128;     ///< blockwise: 1x128 (activations/grads), 128x128 (weights)
constexpr int64_t kMxBlock = 32;       ///< mxfp8: 1x32, e8m0 scales
constexpr int64_t kFp8TokenPad = 128;  ///< columnwise token padding per expert (all recipes)

/// Quantized grouped rows ("activations" x or gradients dy).
struct Fp8Grouped {
  Fp8Recipe recipe = Fp8Recipe::blockwise;  ///< the scaling of both copies
  DType format = DType::e4m3;  ///< e4m3 or e5m2
  int64_t capacity = 0, cols = 0;  ///< source shape [capacity, cols]
  /// rowwise (optional): data [capacity, cols] fp8, same row positions as the source; rows past
  /// the real total are zero.
  TensorView data;
  /// dequant multipliers: x ≈ float(data) * scale_inv.
  ///   tensorwise [E] f32; blockwise [ceil(cols/128), capacity] f32, token-major: row b holds
  ///   every token's scale of columns [128b, 128b + 128), so that one k-tile of the GEMM reads one
  ///   contiguous run (rows past the total: 1.0; see fp8_rows_scale_index);
  ///   mxfp8 [capacity, ceil(cols/32)] e8m0 (rows past the total: 127, i.e. 1.0).
  TensorView scale_inv;
  /// columnwise (optional; transposed, for the weight gradient): [cols, padded_capacity] fp8;
  /// expert e's tokens are columns [padded_offsets[e], padded_offsets[e] + counts[e]), the rest
  /// of its padded range (up to padded_offsets[e+1]) and everything past padded_offsets[E] is 0.
  TensorView data_t;
  /// tensorwise [E] f32 (the same values as scale_inv; may view the same memory);
  /// blockwise [padded_capacity/128, cols] f32, token-block-major: row b holds every column's
  /// scale over tokens [128b, 128b + 128), expert e's blocks start at row padded_offsets[e]/128
  /// (blocks past padded_offsets[E]: 1.0). One k-tile of the weight-gradient GEMM reads one
  /// contiguous run of them (see fp8_cols_scale_index);
  /// mxfp8 [cols, padded_capacity/32] e8m0 (blocks past padded_offsets[E]: 127).
  TensorView scale_inv_t;
  /// [E+1] i64 on the device: padded_offsets[e] = Σ_{j<e} roundup(counts[j], 128) (counts clamped
  /// like every grouped op: negative -> 0, total clamped to capacity).
  TensorView padded_offsets;
  int64_t padded_capacity = 0;  ///< host-known bound: roundup(capacity, 128) + 128 * E
};

/// Quantized expert weights W_e [N, K], stacked.
struct Fp8Weights {
  Fp8Recipe recipe = Fp8Recipe::blockwise;  ///< the scaling of both copies
  DType format = DType::e4m3;               ///< e4m3 or e5m2
  int64_t experts = 0, rows = 0 /*N*/, cols = 0 /*K*/;  ///< the source shape E × [N, K]
  /// [E, N, K] fp8 (for fprop: y = x·Wᵀ, reduction over K).
  TensorView data;
  /// tensorwise [E] f32; blockwise 128x128 [E, ceil(N/128), ceil(K/128)] f32;
  /// mxfp8 1x32 along K [E, N, ceil(K/32)] e8m0.
  TensorView scale_inv;
  /// [E, K, N] fp8 (transposed, for dgrad: dx = dy·W, reduction over N).
  TensorView data_t;
  /// tensorwise [E] f32 (same values as scale_inv); blockwise [E, ceil(K/128), ceil(N/128)] f32
  /// (the transpose of scale_inv: data_t is exactly the transpose of data);
  /// mxfp8 1x32 along N [E, K, ceil(N/32)] e8m0 (a separate quantization of Wᵀ).
  TensorView scale_inv_t;
};

/// What to produce.
struct Fp8QuantizeOptions {
  Fp8Recipe recipe = Fp8Recipe::blockwise;  ///< the scaling
  DType format = DType::e4m3;  ///< e4m3 (activations, weights) or e5m2 (gradients)
  bool rowwise = true;         ///< data + scale_inv
  bool columnwise = false;     ///< data_t + scale_inv_t (grouped rows: + padded_offsets)
  /// f32 recipes: round each scale down to a power of two (DeepSeek-V3 style). Ignored by mxfp8.
  bool pow2_scales = false;
  /// quantize_grouped, tensorwise only (optional): each expert's amax of x.data already computed,
  /// f32 [E] on x's device — the largest finite |value| over the expert's rows (0 without rows),
  /// as grouped_activation_forward/backward's `amax_out` gives it for their output. The
  /// quantization then skips its own pass over x for it (CUDA: one read of x instead of two) and
  /// gives the bits it would give without it. A value that is not that amax is not detected: an
  /// amax below the true one saturates the values above it to the format's largest.
  TensorView amax;
};

/// Which copy a dequantization reads.
enum class Fp8Copy : uint8_t { rowwise, columnwise };

/// "tensorwise", "blockwise", "mxfp8".
const char* fp8_recipe_name(Fp8Recipe recipe);
/// Largest finite value of an fp8 format: 448 (e4m3), 57344 (e5m2). Throws on other dtypes.
float fp8_max(DType format);

/// Element index in Fp8Grouped::scale_inv (blockwise or mxfp8) of row `row`'s scale over column
/// block `block` (columns [block·B, block·B + B), B = 128 or 32) of a rowwise copy with `capacity`
/// rows and `cols` columns: blockwise block·capacity + row (token-major), mxfp8
/// row·ceil(cols/32) + block.
constexpr int64_t fp8_rows_scale_index(Fp8Recipe recipe, int64_t row, int64_t block, int64_t capacity,
                                       int64_t cols) {
  return recipe == Fp8Recipe::mxfp8 ? row * ((cols + kMxBlock - 1) / kMxBlock) + block
                                    : block * capacity + row;
}

/// Element index in Fp8Grouped::scale_inv_t (blockwise or mxfp8) of column `col`'s scale over
/// token block `block` (tokens [block·B, block·B + B), B = 128 or 32) of a columnwise copy with
/// `cols` columns and `padded_capacity` tokens: blockwise block·cols + col, mxfp8
/// col·(padded_capacity/32) + block.
constexpr int64_t fp8_cols_scale_index(Fp8Recipe recipe, int64_t col, int64_t block, int64_t cols,
                                       int64_t padded_capacity) {
  return recipe == Fp8Recipe::mxfp8 ? col * (padded_capacity / kMxBlock) + block
                                    : block * cols + col;
}

/// Host-known padded token bound of the columnwise copy: roundup(capacity, 128) + 128 * experts.
int64_t fp8_padded_capacity(int64_t capacity, int64_t experts);

/// The shapes and dtypes of quantize_grouped's outputs for `options` (contiguous views with
/// data == nullptr, on `device`; views not asked for are absent; padded_offsets is always set).
/// For callers that preallocate: point each view's data at nbytes() of memory.
Fp8Grouped fp8_grouped_layout(int64_t capacity, int64_t cols, int64_t experts,
                              const Fp8QuantizeOptions& options, Device device);
/// Likewise for quantize_weights.
Fp8Weights fp8_weights_layout(int64_t experts, int64_t rows, int64_t cols,
                              const Fp8QuantizeOptions& options, Device device);

/// quantize_grouped's result: the views, and the one packed allocation behind the outputs that
/// were not given by the caller (null when all were given). Copies share the storage.
struct Fp8GroupedTensor {
  Fp8Grouped q;                     ///< the views
  std::shared_ptr<Buffer> storage;  ///< the allocation behind them (null when the caller gave all)
};
/// quantize_weights' result, as Fp8GroupedTensor.
struct Fp8WeightsTensor {
  Fp8Weights q;                     ///< the views
  std::shared_ptr<Buffer> storage;  ///< the allocation behind them (null when the caller gave all)
};

/// Quantizes grouped rows x.data [capacity, cols] (bf16/f16/f32, rows contiguous) split by
/// x.counts [E] (i32/i64, on the device for CUDA; never read on the host there). Rowwise and/or
/// columnwise per `options`, in one pass. `out` (optional): views that are defined there are
/// written (they must match fp8_grouped_layout: shape, dtype, contiguous, device); the needed views
/// that are absent come from `alloc` (nullptr: default_allocator(device)) on `stream`, in one
/// packed allocation. padded_offsets is always written (allocated if absent). CUDA: no host sync,
/// graph capturable, counts read on the device (problems recorded in the device error word).
///
/// `column_sums` (optional; E × [cols], grouped [E, cols] or a list, dtype of x.data or f32): also
/// writes each expert's column sums of x.data, Σ over the rows r of expert e of x.data[r, :] — the
/// bias gradient when x is a layer's output gradient dy — from the same pass over x (CUDA: the
/// pass that reads every element, partial sums per 128-row tile, then one small reduction; no
/// second read of x). Accumulated in f32 in a fixed order (deterministic, no atomics) and rounded
/// once: equal to grouped_bias_grad(x.data, x.counts, column_sums) up to the order of that f32
/// sum (bitwise on the CPU backend); exactly 0 for an expert without rows.
Fp8GroupedTensor quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& options,
                                  Stream stream = nullptr, Allocator* alloc = nullptr,
                                  const Fp8Grouped* out = nullptr, const ExpertBias& column_sums = {});

/// Quantizes expert weights (stacked [E, N, K] or a list of E × [N, K]; bf16/f16/f32):
/// options.rowwise -> data/scale_inv, options.columnwise -> data_t/scale_inv_t (transposed).
/// `out` and `alloc` as for quantize_grouped.
Fp8WeightsTensor quantize_weights(const ExpertWeights& w, const Fp8QuantizeOptions& options,
                                  Stream stream = nullptr, Allocator* alloc = nullptr,
                                  const Fp8Weights* out = nullptr);

/// Dequantizes one copy of `q` back into the source layout: out [capacity, cols] (bf16/f16/f32,
/// rows contiguous) = float(data) * scale_inv, in f32 then rounded once to out's dtype; rows past
/// the real total are zeroed. `counts` [E] are the counts `q` was made with (tensorwise rowwise
/// and every columnwise dequantization need them to map rows to experts). For tests/debugging.
void dequantize_grouped(const Fp8Grouped& q, const TensorView& counts, const TensorView& out,
                        Fp8Copy which = Fp8Copy::rowwise, Stream stream = nullptr,
                        Allocator* alloc = nullptr);

/// Dequantizes one copy of `q` into out: E × [N, K] (stacked or list; bf16/f16/f32), whichever
/// copy is read (the columnwise one is transposed back). For tests/debugging.
void dequantize_weights(const Fp8Weights& q, const ExpertWeights& out,
                        Fp8Copy which = Fp8Copy::rowwise, Stream stream = nullptr,
                        Allocator* alloc = nullptr);

}  // namespace gmoe
