// src/cuda/gemm/grouped_gemm_heuristics.h — what the grouped GEMMs choose from host-known sizes,
// in one place: the 16-bit GEMM's tile configuration, the weight gradient's cluster and tile order
// (shared with the FP8 GEMM), and the row chunks of fprop and dgrad (both GEMMs, through
// prepare_call).
//
// The counts are on the device only: every rule works from what the host knows (capacity, the
// expert count, the layer's N and K, the device's SM count and L2 size). Each choice yields to the
// override of gmoe::current_tuning() for the calling thread, read at every call (never cached).
// grouped_gemm_heuristics.cu says why each rule is what it is; docs/decisions.md holds the
// measurements.
#pragma once

#include <cstdint>

#include "cuda/gemm/grouped_gemm_kernels.h"
#include "cuda/gemm/rows_tile_rule.h"
#include "gmoe/dtype.h"

namespace gmoe::cuda_backend {

/// fprop/dgrad of the 16-bit GEMM: rows_tile_rule (rows_tile_rule.h) on what is compiled for
/// (in, pass, epilogue). `lines`: whether the rows of A and of the experts' weights start on
/// 128-byte lines. Tuning::gemm_tile overrides the tile where compiled; Tuning::cluster the
/// cooperative tile's cluster (1x1; 2x1 or 2x2 where that instantiation is compiled, 2x2 else 2x1).
TileConfig choose_rows_tile(DType in, GemmPass pass, GemmEpilogue epilogue, int64_t capacity,
                            int64_t num_experts, int64_t gemm_n, int sms, OperandLines lines);

/// wgrad of the 16-bit GEMM: to f32, ping-pong below 1024 rows per expert on average, else
/// cooperative; to 16 bits, cooperative. The cooperative tile runs in 2x1 clusters
/// where wgrad_cluster_2x1 says so and that instantiation is compiled. Tuning::gemm_tile overrides
/// the tile where compiled for (in, out), Tuning::cluster the cluster (1x1 or 2x1; 2x2 runs 2x1).
TileConfig choose_wgrad_tile(DType in, DType out, int64_t capacity, int64_t num_experts, int64_t gemm_m);

/// Whether the weight gradient D[M, N] (M = the layer's N) runs in clusters of two CTAs along M,
/// each loading half of B's tile and multicasting it to both (bf16, and FP8 tensorwise): when M
/// spans an even number of 128-row tiles, or at least 16. Tuning::cluster 1x1 forces it off, 2x1
/// or 2x2 on.
bool wgrad_cluster_2x1(int64_t m);

/// Whether the weight gradient D[M, N] (M = the layer's N, N = its K; reductions over each
/// expert's tokens) walks its tiles along N rather than M: along N when, at the average tokens per
/// expert, the A operand does not fit in half the L2 and B does. `along_n`: the caller's kernel
/// walks best along N whatever the sizes (the FP8 tensorwise weight gradient without a source,
/// fp8_grouped_gemm.cu). Tuning::wgrad_raster forces an order over both.
bool choose_wgrad_raster_along_n(int64_t m, int64_t n, int64_t capacity, int64_t num_experts, DType in,
                                 bool along_n = false);

/// The most rows of one expert that one group of an fprop/dgrad launch covers (a multiple of the
/// 128-row tile; 0: a group per expert). Bigger experts are split into several groups so that the
/// tiles running at once cover a block of the output rather than a tall strip of it.
/// Tuning::row_chunk overrides it (0: no splitting; rows rounded up to a multiple of 128).
int32_t row_chunk_rows();

/// Tuning::cluster as an index: 0 for 1x1, 1 for 2x1, 2 for 2x2, -1 when automatic.
int forced_cluster();

}  // namespace gmoe::cuda_backend
