// src/common/activation_internal.h — checks shared by the activation ops and the layers built on
// them.
#pragma once

#include <cstdint>

#include "gmoe/activation.h"
#include "gmoe/fp8.h"

namespace gmoe {

/// Options valid for F output columns: a known kind; clamped_swiglu's alpha finite and limit finite
/// and > 0; an interleaved gate/up block >= 1 dividing F. Throws gmoe::Error naming `name`.
void check_activation_options(const ActivationOptions& options, int64_t F, const char* name);

/// Every argument check of grouped_activation_forward (h, counts, z, options, probs).
void check_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                              const ActivationOptions& options, const TensorView& probs);

/// The checks of h and dh that grouped_activation_backward makes (F output columns): h's shape for
/// the activation and the options; dh of h's shape, dtype and device, h itself or disjoint from it.
void check_activation_dh(const TensorView& h, const TensorView& dh, const ActivationOptions& options, int64_t F);

/// Whether a quantization of `recipe` takes its amax from the activation's own pass (the
/// activation's amax_out handed over as Fp8QuantizeOptions::amax): tensorwise, whose current
/// scaling otherwise reads its source once more for the amax.
constexpr bool activation_amax_for(Fp8Recipe recipe) { return recipe == Fp8Recipe::tensorwise; }
/// f32 [experts] for an activation's amax_out when activation_amax_for(recipe), else absent.
Tensor activation_amax_scratch(Fp8Recipe recipe, int64_t experts, Allocator& alloc, Stream stream);
/// GroupedMLP's FP8 path, arguments checked by the layer. z = act(h)·probs ([capacity, q.cols])
/// quantized into q (every view placed, per fp8_grouped_layout(capacity, F, E, options)): on CUDA in
/// one pass from h where the fused kernel applies (cuda_backend::quantize_activation_forward),
/// else grouped_activation_forward into scratch then quantize_grouped; bitwise the same. `fused`
/// false: always the composition (for comparisons in tests). Tensorwise always composes: the
/// one-pass kernel would evaluate the activation twice (once for the amax, once to quantize),
/// while the activation's own amax_out lets the quantizer read z once.
void quantize_activation_forward(const TensorView& h, const TensorView& counts, const ActivationOptions& act,
                                 const TensorView& probs, const Fp8QuantizeOptions& options, const Fp8Grouped& q,
                                 bool fused, Stream stream, Allocator& alloc);

}  // namespace gmoe
