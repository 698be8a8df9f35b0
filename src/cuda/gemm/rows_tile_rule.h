// src/cuda/gemm/rows_tile_rule.h — the 16-bit grouped GEMM's fprop/dgrad tile rule as arithmetic on
// host-known sizes, free of CUDA and CUTLASS so that the CPU tests check it
// (tests/cpu/test_rows_tile_rule.cpp). choose_rows_tile (grouped_gemm_heuristics.cu) applies it
// under the Tuning overrides and to what is compiled, and says why the rule is what it is.
#pragma once

#include <algorithm>
#include <cstdint>

namespace gmoe::cuda_backend {

/// What the rule picks for fprop/dgrad, before overrides.
enum class RowsTileRule {
  pingpong,  ///< the 128x128 ping-pong tile, 1x1
  coop,      ///< the 128x256 cooperative tile, 1x1
  coop_2x1   ///< the 128x256 cooperative tile in 2x1 clusters
};

/// Average rows per expert from which operands whose rows are off the 128-byte lines take 2x1
/// clusters (four 128-row tiles: a group with an odd tile count then wastes at most a fifth).
inline constexpr int64_t kRowsCluster2x1MinRows = 512;

/// The cooperative tile when the average group (capacity / num_experts rows) fills a 128-row tile
/// and its tiles (gemm_n wide, 256 columns each) cover every one of `sms` SMs, else the ping-pong
/// tile; the cooperative tile in 2x1 clusters when some operand row does not start on a 128-byte
/// line (`rows_on_lines` false) and the average group has at least kRowsCluster2x1MinRows rows.
constexpr RowsTileRule rows_tile_rule(int64_t capacity, int64_t num_experts, int64_t gemm_n, int sms,
                                      bool rows_on_lines) {
  const int64_t avg_rows = capacity / std::max<int64_t>(num_experts, 1);
  const int64_t coop_tiles = num_experts * ((avg_rows + 127) / 128) * ((gemm_n + 255) / 256);
  if (avg_rows < 128 || coop_tiles < sms) return RowsTileRule::pingpong;
  return !rows_on_lines && avg_rows >= kRowsCluster2x1MinRows ? RowsTileRule::coop_2x1 : RowsTileRule::coop;
}

}  // namespace gmoe::cuda_backend
