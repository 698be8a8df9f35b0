// src/common/activation_internal.h — checks shared by the activation ops and the layers built on
// them.
#pragma once

#include <cstdint>

#include "gmoe/activation.h"

namespace gmoe {

/// Options valid for F output columns: a known kind; clamped_swiglu's alpha finite and limit finite
/// and > 0; an interleaved gate/up block >= 1 dividing F. Throws gmoe::Error naming `name`.
void check_activation_options(const ActivationOptions& options, int64_t F, const char* name);

/// Every argument check of grouped_activation_forward (h, counts, z, options, probs).
void check_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                              const ActivationOptions& options, const TensorView& probs);

/// Throws gmoe::Error naming both when the bytes that views `a` and `b` touch overlap (absent or
/// empty views overlap nothing).
void check_disjoint(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name);

}  // namespace gmoe
