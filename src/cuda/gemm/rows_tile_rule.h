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
  coop_2x1,  ///< the 128x256 cooperative tile in 2x1 clusters
  coop_2x2   ///< the 128x256 cooperative tile in 2x2 clusters
};

/// Whether the rows of each operand start on 128-byte lines (pitch and base address).
struct OperandLines {
  bool rows = true;     ///< A: x in fprop, dy in dgrad
  bool weights = true;  ///< the experts' weights
};

/// Average rows per expert from which operands whose rows are off the 128-byte lines take
/// clusters (two 128-row tiles: a group with an odd tile count then wastes at most a third).
inline constexpr int64_t kRowsClusterMinRows = 256;

/// The cooperative tile when the average group (capacity / num_experts rows) fills a 128-row tile
/// and its tiles (gemm_n wide, 256 columns each) cover every one of `sms` SMs, else the ping-pong
/// tile. Off the lines (some operand's rows do not start on 128-byte lines) and from
/// kRowsClusterMinRows average rows, the cooperative tile runs in clusters: 2x2 in dgrad when both
/// operands are off the lines, else 2x1.
constexpr RowsTileRule rows_tile_rule(int64_t capacity, int64_t num_experts, int64_t gemm_n, int sms,
                                      OperandLines lines, bool dgrad) {
  const int64_t avg_rows = capacity / std::max<int64_t>(num_experts, 1);
  const int64_t coop_tiles = num_experts * ((avg_rows + 127) / 128) * ((gemm_n + 255) / 256);
  if (avg_rows < 128 || coop_tiles < sms) return RowsTileRule::pingpong;
  if ((lines.rows && lines.weights) || avg_rows < kRowsClusterMinRows) return RowsTileRule::coop;
  return dgrad && !lines.rows && !lines.weights ? RowsTileRule::coop_2x2 : RowsTileRule::coop_2x1;
}

}  // namespace gmoe::cuda_backend
