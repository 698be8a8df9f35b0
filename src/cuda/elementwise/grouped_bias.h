// src/cuda/elementwise/grouped_bias.h — the bias gradient's final reduction (grouped_bias.cu), shared with the
// FP8 quantization of grouped rows, whose tiles make the column sums of dy as they read it
// (fp8_quantize_grouped.cu): one reduction, one order, for both.
#pragma once

#include <cstdint>

#include "gmoe/allocator.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/stream.h"

namespace gmoe::cuda_backend {

/// dbias_e[n] = Σ over the chunks c in [chunk_offsets[e] / chunk_unit, chunk_offsets[e+1] / chunk_unit)
/// of partial[c · N + n], in chunk order, in f32 rounded once to dbias's dtype (0 for an expert
/// without chunks). partial: [chunks, N] f32 and chunk_offsets: [E + 1] i64, both on the device,
/// E = dbias.num_experts() <= kMaxExperts; dbias checked by the caller (check_expert_bias).
void launch_bias_grad_final(const float* partial, int64_t N, const int64_t* chunk_offsets, int64_t chunk_unit,
                            const ExpertBias& dbias, Stream stream, Allocator& alloc);

}  // namespace gmoe::cuda_backend
