// src/common/fp8_checks.h — the edge checks of FP8 operands, shared by the quantization ops
// (fp8.cpp) and the FP8 GEMMs (fp8_gemm.cpp): a copy of an Fp8Grouped / Fp8Weights must be exactly
// what fp8_grouped_layout / fp8_weights_layout lay out. Each throws gmoe::Error naming the view.
#pragma once

#include <cstdint>
#include <string>

#include "gmoe/fp8.h"

namespace gmoe {

inline bool is_fp8_format(DType t) { return t == DType::e4m3 || t == DType::e5m2; }

/// `given` must be exactly the layout's `expected` view: defined, shape, dtype, device,
/// contiguous, data present unless empty.
void check_layout_view(const TensorView& given, const TensorView& expected, const std::string& name);

/// Copy `which` of q (rowwise: data, scale_inv; columnwise: data_t, scale_inv_t, padded_offsets,
/// padded_capacity) laid out for E experts on `device`, with a known recipe and an fp8 format.
/// `reader` ends the message of an absent copy ("; the weight gradient reads it", or "").
void check_fp8_grouped(const Fp8Grouped& q, int64_t E, Fp8Copy which, Device device, const char* name,
                       const char* reader);
/// Copy `which` of q (rowwise: data, scale_inv; columnwise: the transposed data_t, scale_inv_t);
/// E: the experts q must hold, or -1 for any number >= 1.
void check_fp8_weights(const Fp8Weights& q, int64_t E, Fp8Copy which, Device device, const char* name,
                       const char* reader);

}  // namespace gmoe
