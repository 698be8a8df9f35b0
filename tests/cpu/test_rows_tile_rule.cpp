// tests/cpu/test_rows_tile_rule.cpp — the 16-bit GEMM's fprop/dgrad tile rule (rows_tile_rule,
// src/cuda/gemm/rows_tile_rule.h), which the CUDA backend applies from host-known sizes: on the
// public suite's odd_kn shapes (K = 1400, N = 2888: rows off the 128-byte lines) the cooperative
// tile goes to 2x1 clusters, on the same sizes with rows on the lines it stays 1x1, and small
// groups keep the ping-pong tile whatever the lines.
#include <gtest/gtest.h>

#include "cuda/gemm/rows_tile_rule.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kH100Sms = 132;

TEST(RowsTileRule, OddKnTakesTwoByOneClusters) {
  // odd_kn/uniform and /skewed: 24576 rows over 24 experts; fprop's N is the layer's N, dgrad's
  // is its K.
  EXPECT_EQ(rows_tile_rule(24576, 24, 2888, kH100Sms, false), RowsTileRule::coop_2x1);
  EXPECT_EQ(rows_tile_rule(24576, 24, 1400, kH100Sms, false), RowsTileRule::coop_2x1);
  // The same sizes with every row on a line: 1x1.
  EXPECT_EQ(rows_tile_rule(24576, 24, 2888, kH100Sms, true), RowsTileRule::coop);
  EXPECT_EQ(rows_tile_rule(24576, 24, 1400, kH100Sms, true), RowsTileRule::coop);
}

TEST(RowsTileRule, TwoByOneFromTheMinimumAverageRows) {
  const int64_t E = 64, n = 4096;
  EXPECT_EQ(rows_tile_rule(E * kRowsCluster2x1MinRows, E, n, kH100Sms, false), RowsTileRule::coop_2x1);
  EXPECT_EQ(rows_tile_rule(E * kRowsCluster2x1MinRows - 1, E, n, kH100Sms, false), RowsTileRule::coop)
      << "one row short of the minimum average: groups of an odd tile count would waste too much";
  EXPECT_EQ(rows_tile_rule(E * 128, E, n, kH100Sms, false), RowsTileRule::coop);
}

TEST(RowsTileRule, SmallGroupsKeepThePingPongTile) {
  // odd_kn_small/skewed: 512 rows over 64 experts.
  EXPECT_EQ(rows_tile_rule(512, 64, 2888, kH100Sms, false), RowsTileRule::pingpong);
  EXPECT_EQ(rows_tile_rule(512, 64, 2888, kH100Sms, true), RowsTileRule::pingpong);
  // Groups of 127 rows on average: ping-pong.
  EXPECT_EQ(rows_tile_rule(24 * 127, 24, 2888, kH100Sms, false), RowsTileRule::pingpong);
  // Long groups but fewer cooperative tiles than SMs (2 experts x 8 x 2 = 32): ping-pong.
  EXPECT_EQ(rows_tile_rule(2 * 1024, 2, 400, kH100Sms, false), RowsTileRule::pingpong);
  // The same with as many tiles as SMs (2 x 8 x 9 = 144 >= 132): cooperative in 2x1.
  EXPECT_EQ(rows_tile_rule(2 * 1024, 2, 2200, kH100Sms, false), RowsTileRule::coop_2x1);
}

TEST(RowsTileRule, NoExpertsIsNotADivisionByZero) {
  EXPECT_EQ(rows_tile_rule(0, 0, 2888, kH100Sms, false), RowsTileRule::pingpong);
}

}  // namespace
}  // namespace gmoe::cuda_backend
