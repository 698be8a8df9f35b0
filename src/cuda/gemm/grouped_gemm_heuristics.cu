// src/cuda/gemm/grouped_gemm_heuristics.cu — the grouped GEMMs' choices from host-known sizes,
// and why (grouped_gemm_heuristics.h lists them). The measurements behind each rule are in
// docs/decisions.md under the name of the function that applies it.
#include "cuda/gemm/grouped_gemm_heuristics.h"

#include <algorithm>

#include "cuda/gemm/grouped_gemm_instances.h"
#include "cuda/gemm/rows_tile_rule.h"
#include "cuda/runtime/device_info.h"
#include "gmoe/tuning.h"

namespace gmoe::cuda_backend {
namespace {

// Average rows per expert from which the f32 weight gradient takes the cooperative tile
// (choose_wgrad_tile says why).
constexpr int64_t kWgradCoopMinRows = 1024;

// row_chunk_rows()'s choice (it says why).
constexpr int32_t kDefaultRowChunk = 4096;

// Tuning::gemm_tile as the tile it names, where that tile is compiled for the call.
bool forced_tile(DType in, DType out, GemmPass pass, GemmEpilogue epilogue, TileConfig* tile) {
  TileConfig t;
  switch (current_tuning().gemm_tile) {
    case GemmTile::automatic: return false;
    case GemmTile::cooperative: t = TileConfig::coop_128x256; break;
    case GemmTile::pingpong: t = TileConfig::pingpong_128x128; break;
    default: return false;
  }
  if (!compiled(in, out, pass, epilogue, t)) return false;
  *tile = t;
  return true;
}

int cluster_index(ClusterShape c) {
  switch (c) {
    case ClusterShape::c1x1: return 0;
    case ClusterShape::c2x1: return 1;
    case ClusterShape::c2x2: return 2;
    default: return -1;
  }
}

}  // namespace

// A group's M is its row count, which only the device knows; the host knows the average,
// capacity / E. The cooperative 128x256 tile is the fast one when groups fill it (>= 128 rows) and
// there are enough tiles to occupy every SM. Below that, a 128x256 tile computes mostly
// out-of-range rows or leaves SMs idle; the 128x128 ping-pong tile makes twice as many tiles and
// overlaps one warpgroup's epilogue with the other's mainloop. With a few rows per expert both
// tiles take the time of reading every expert's weights once, so the choice there matters little.
//
// The cooperative tile's cluster. Each k-step loads A's 128 x 64 and B's 256 x 64 tile as TMA box
// rows of 64 elements, 128 bytes. Where an operand's rows start on 128-byte lines (K and N
// multiples of 64, at aligned addresses), a box row is one L2 line; where they do not (e.g. K =
// 1400: 2800-byte rows), every box row spans two lines and a sector more, and the 1x1 kernel's
// mainloop waits on the L2. A 2x1 cluster loads B's tile once for both CTAs (TMA multicast), a
// third fewer L2 requests per CTA (torch._grouped_mm runs this tile in 2x1 clusters everywhere); a
// 2x2 cluster multicasts A's tile too, which pays in dgrad when dy and the weights are both off
// the lines and not in fprop (docs/decisions.md has the figures). On rows that are on the lines
// the 1x1 kernel is no slower on the whole, and pairing tiles costs a group with an odd tile count
// one empty tile, hence clusters only off the lines and from kRowsClusterMinRows average rows
// (rows_tile_rule, rows_tile_rule.h). Only bf16 has the clustered instantiations; f16 stays 1x1.
TileConfig choose_rows_tile(DType in, GemmPass pass, GemmEpilogue epilogue, int64_t capacity,
                            int64_t num_experts, int64_t gemm_n, int sms, OperandLines lines) {
  const RowsTileRule rule = rows_tile_rule(capacity, num_experts, gemm_n, sms, lines, pass == GemmPass::dgrad);
  TileConfig tile;
  if (!forced_tile(in, in, pass, epilogue, &tile)) {
    tile = rule == RowsTileRule::pingpong ? TileConfig::pingpong_128x128 : TileConfig::coop_128x256;
  }
  if (tile != TileConfig::coop_128x256) return tile;
  const int forced = forced_cluster();
  const int cluster = forced >= 0 ? forced : rule == RowsTileRule::coop_2x2 ? 2 : rule == RowsTileRule::coop_2x1 ? 1 : 0;
  if (cluster == 2 && compiled(in, in, pass, epilogue, TileConfig::coop_128x256_2x2)) {
    return TileConfig::coop_128x256_2x2;
  }
  return cluster >= 1 && compiled(in, in, pass, epilogue, TileConfig::coop_128x256_2x1) ? TileConfig::coop_128x256_2x1
                                                                                        : tile;
}

// To f32, each output tile costs 2·BM·BN·rows flops in the mainloop and BM·BN·4 bytes in the
// epilogue: with short reductions (few rows per expert) the dW write is a large share of a tile's
// time, and the ping-pong schedule hides it behind the other warpgroup's mainloop; the cooperative
// tile (no overlap, fewer and larger tiles) wins when the reduction is long. The crossover,
// kWgradCoopMinRows, and its figures are in docs/decisions.md. A 16-bit dW is written at half
// the bytes: cooperative only (a ping-pong 16-bit weight gradient is no faster, and not compiled).
// The cooperative tile runs in 2x1 clusters where wgrad_cluster_2x1 says so.
TileConfig choose_wgrad_tile(DType in, DType out, int64_t capacity, int64_t num_experts, int64_t gemm_m) {
  TileConfig tile;
  if (!forced_tile(in, out, GemmPass::wgrad, GemmEpilogue::none, &tile)) {
    tile = out == DType::f32 && capacity / num_experts < kWgradCoopMinRows ? TileConfig::pingpong_128x128
                                                                           : TileConfig::coop_128x256;
  }
  const bool clustered = tile == TileConfig::coop_128x256 && wgrad_cluster_2x1(gemm_m) &&
                         compiled(in, out, GemmPass::wgrad, GemmEpilogue::none, TileConfig::coop_128x256_2x1);
  return clustered ? TileConfig::coop_128x256_2x1 : tile;
}

// A 2x1 cluster halves the L2-to-SM traffic of B's tiles (TMA multicast) but schedules tiles in
// pairs along M: a group whose M tiles are odd in number computes one all-out-of-range tile per N
// tile. The weight gradient's M is the layer's N, host-known, so the rule is exact: 2x1 where the
// pairing wastes nothing (an even tile count) or little (16 tiles or more). fprop/dgrad, whose M is
// each expert's row count, stay 1x1 in the 16-bit GEMM (a group of one M tile, common in MoE,
// would leave half of each cluster idle); the FP8 GEMM has its own rule there
// (fp8_grouped_gemm.cu). The FP8 blockwise weight gradient gains nothing from 2x1 and is not
// compiled in it.
bool wgrad_cluster_2x1(int64_t m) {
  const int forced = forced_cluster();
  if (forced >= 0) return forced >= 1;
  const int64_t tiles_m = (m + 127) / 128;
  return tiles_m >= 2 && (tiles_m % 2 == 0 || tiles_m >= 16);
}

// The tile order of the weight gradient (M = the layer's N, N = its K, host-known; K = an expert's
// tokens, on the device only). Tiles along M share B's tile and re-read A (dy_e, M x tokens) once
// per N tile unless all of A stays in L2; along N they share A's tile and need all of B (x_e,
// N x tokens) to stay in L2 instead. So along N when, at the average tokens per expert, A does not
// fit in half the L2 and B does; along M otherwise, CUTLASS's default for grouped problems (where
// both operands fit, the order makes no difference). The FP8 weight gradient takes the same rule
// with its 1-byte operands, except the tensorwise one without a source, which walks along N
// (`along_n`; the call site says why).
bool choose_wgrad_raster_along_n(int64_t m, int64_t n, int64_t capacity, int64_t num_experts, DType in,
                                 bool along_n) {
  switch (current_tuning().wgrad_raster) {
    case WgradRaster::along_m: return false;
    case WgradRaster::along_n: return true;
    default: break;
  }
  if (along_n) return true;
  const int64_t tokens = capacity / std::max<int64_t>(num_experts, 1);
  const int64_t elem = static_cast<int64_t>(dtype_size(in));
  const int64_t half_l2 = l2_bytes(current_device()) / 2;
  return m * tokens * elem > half_l2 && n * tokens * elem <= half_l2;
}

// The group scheduler hands out an expert's tiles in order along M (its rows) and then N, so the
// tiles that run at once (one per SM) are up to ceil(rows_e / 128) tiles tall: an expert with many rows
// has its CTAs read as many different row strips of A (each 128 x K) for only one or two column
// strips of B, and A's strips are read again for every further column strip. Splitting the expert
// into groups of row_chunk rows bounds the strip count, as the uniform cases have it. Splitting
// changes no result (each output row is the same dot products in the same order). 4096 rows splits
// only the outsized experts of skewed routings; smaller chunks help those as much but also split
// the experts of uniform routings, where the extra group switches cost more than they save.
int32_t row_chunk_rows() {
  const int64_t forced = current_tuning().row_chunk;
  if (forced < 0) return kDefaultRowChunk;
  // Bounded so that rounding up stays in 32 bits (capacities are below 2^31 rows, host-checked).
  const int64_t rows = std::min<int64_t>(forced, int64_t{1} << 30);
  return static_cast<int32_t>((rows + 127) / 128 * 128);
}

int forced_cluster() { return cluster_index(current_tuning().cluster); }

}  // namespace gmoe::cuda_backend
