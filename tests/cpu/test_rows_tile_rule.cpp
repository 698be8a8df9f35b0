// tests/cpu/test_rows_tile_rule.cpp — the 16-bit GEMM's fprop/dgrad tile rule (rows_tile_rule,
// src/cuda/gemm/rows_tile_rule.h), which the CUDA backend applies from host-known sizes: on the
// public suite's odd_kn shapes (K = 1400, N = 2888: rows off the 128-byte lines) the cooperative
// tile goes to 2x1 clusters in fprop and 2x2 in dgrad, on the same sizes with rows on the lines it
// stays 1x1, and small groups keep the ping-pong tile whatever the lines.
#include <gtest/gtest.h>

#include "cuda/gemm/rows_tile_rule.h"

namespace gmoe::cuda_backend {
namespace {

constexpr int kH100Sms = 132;
constexpr OperandLines kOn{true, true};
constexpr OperandLines kBothOff{false, false};
constexpr OperandLines kRowsOff{false, true};
constexpr OperandLines kWeightsOff{true, false};

TEST(RowsTileRule, OddKnTakesClusters) {
  // odd_kn/uniform and /skewed: 24576 rows over 24 experts; fprop's N is the layer's N, dgrad's
  // is its K. x, dy and the weights are all off the lines there.
  EXPECT_EQ(rows_tile_rule(24576, 24, 2888, kH100Sms, kBothOff, false), RowsTileRule::coop_2x1);
  EXPECT_EQ(rows_tile_rule(24576, 24, 1400, kH100Sms, kBothOff, true), RowsTileRule::coop_2x2);
  // The same sizes with every row on a line: 1x1.
  EXPECT_EQ(rows_tile_rule(24576, 24, 2888, kH100Sms, kOn, false), RowsTileRule::coop);
  EXPECT_EQ(rows_tile_rule(24576, 24, 1400, kH100Sms, kOn, true), RowsTileRule::coop);
}

TEST(RowsTileRule, DgradTakesTwoByTwoOnlyWithBothOperandsOffTheLines) {
  // K odd only (dy on the lines, the weights off) and N odd only (dy off, the weights on): 2x1.
  EXPECT_EQ(rows_tile_rule(24576, 24, 1400, kH100Sms, kWeightsOff, true), RowsTileRule::coop_2x1);
  EXPECT_EQ(rows_tile_rule(24576, 24, 1408, kH100Sms, kRowsOff, true), RowsTileRule::coop_2x1);
  // fprop never takes 2x2.
  EXPECT_EQ(rows_tile_rule(24576, 24, 2888, kH100Sms, kRowsOff, false), RowsTileRule::coop_2x1);
  EXPECT_EQ(rows_tile_rule(24576, 24, 2888, kH100Sms, kWeightsOff, false), RowsTileRule::coop_2x1);
}

TEST(RowsTileRule, ClustersFromTheMinimumAverageRows) {
  const int64_t E = 64, n = 4096;
  EXPECT_EQ(rows_tile_rule(E * kRowsClusterMinRows, E, n, kH100Sms, kBothOff, false), RowsTileRule::coop_2x1);
  EXPECT_EQ(rows_tile_rule(E * kRowsClusterMinRows, E, n, kH100Sms, kBothOff, true), RowsTileRule::coop_2x2);
  EXPECT_EQ(rows_tile_rule(E * kRowsClusterMinRows - 1, E, n, kH100Sms, kBothOff, false), RowsTileRule::coop)
      << "one row short of the minimum average: groups of an odd tile count would waste too much";
  EXPECT_EQ(rows_tile_rule(E * kRowsClusterMinRows - 1, E, n, kH100Sms, kBothOff, true), RowsTileRule::coop);
  EXPECT_EQ(rows_tile_rule(E * 128, E, n, kH100Sms, kBothOff, false), RowsTileRule::coop);
}

TEST(RowsTileRule, SmallGroupsKeepThePingPongTile) {
  // odd_kn_small/skewed: 512 rows over 64 experts.
  EXPECT_EQ(rows_tile_rule(512, 64, 2888, kH100Sms, kBothOff, false), RowsTileRule::pingpong);
  EXPECT_EQ(rows_tile_rule(512, 64, 2888, kH100Sms, kOn, true), RowsTileRule::pingpong);
  // Groups of 127 rows on average: ping-pong.
  EXPECT_EQ(rows_tile_rule(24 * 127, 24, 2888, kH100Sms, kBothOff, true), RowsTileRule::pingpong);
  // Long groups but fewer cooperative tiles than SMs (2 experts x 8 x 2 = 32): ping-pong.
  EXPECT_EQ(rows_tile_rule(2 * 1024, 2, 400, kH100Sms, kBothOff, false), RowsTileRule::pingpong);
  // The same with as many tiles as SMs (2 x 8 x 9 = 144 >= 132): cooperative in 2x1.
  EXPECT_EQ(rows_tile_rule(2 * 1024, 2, 2200, kH100Sms, kBothOff, false), RowsTileRule::coop_2x1);
}

TEST(RowsTileRule, NoExpertsIsNotADivisionByZero) {
  EXPECT_EQ(rows_tile_rule(0, 0, 2888, kH100Sms, kBothOff, true), RowsTileRule::pingpong);
}

}  // namespace
}  // namespace gmoe::cuda_backend
