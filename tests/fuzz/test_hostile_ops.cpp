// tests/fuzz/test_hostile_ops.cpp — the defects probing found at the public ops' edge (issue 39),
// one named test each: counts that overflow past the capacity check, size products that overflow,
// a mask with no data, and the output-dtype message. Each refused call must leave its outputs
// untouched (they are poisoned before).
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "gmoe/activation.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// Counts written exactly (make_counts goes through double, which cannot hold INT64_MAX).
HostTensor counts_tensor(const std::vector<int64_t>& counts, DType dtype = DType::i64) {
  HostTensor t(dtype, {static_cast<int64_t>(counts.size())});
  for (size_t e = 0; e < counts.size(); ++e) {
    if (dtype == DType::i64) {
      static_cast<int64_t*>(t.data())[e] = counts[e];
    } else {
      static_cast<int32_t*>(t.data())[e] = static_cast<int32_t>(counts[e]);
    }
  }
  return t;
}

// The device's offsets (src/cuda/runtime/group_offsets.cu) computed without any overflow: each
// count clamped to [0, capacity], the exact prefix clamped to capacity.
std::vector<int64_t> device_offsets(const std::vector<int64_t>& counts, int64_t capacity,
                                    uint32_t* errors) {
  std::vector<int64_t> off{0};
  __int128 prefix = 0;
  *errors = 0;
  for (int64_t c : counts) {
    if (c < 0) *errors |= kDeviceErrorNegativeCount;
    const int64_t cc = std::min(std::max<int64_t>(c, 0), capacity);
    if (c > capacity || prefix + cc > capacity) *errors |= kDeviceErrorCountsPastCapacity;
    prefix += cc;
    off.push_back(static_cast<int64_t>(std::min<__int128>(prefix, capacity)));
  }
  return off;
}

TEST(HostileOps, GroupOffsetsClampLikeTheDevice) {
  struct Case {
    std::vector<int64_t> counts;
    int64_t capacity;
  };
  std::vector<Case> cases = {
      {{1, kI64Max, 2}, 6},
      {{2, kI64Max - 1, int64_t{1} << 62}, 5},
      {{kI64Max, kI64Max, kI64Max}, kI64Max},
      {{-3, 4, 1}, 4},
      {{std::numeric_limits<int64_t>::min(), 3, -1}, 3},
      {{0, 0, 0}, 0},
      {{0, 0, 781}, 8},  // one count past the capacity, clamped to it: still an error
      {{9}, 8},
      {{1, 2, 3}, 6},
  };
  Rng rng;
  for (int i = 0; i < 200; ++i) {  // random counts, some extreme
    Case c;
    c.capacity = rng.integer(0, 3) == 0 ? rng.integer(0, kI64Max) : rng.integer(0, 40);
    const int64_t E = rng.integer(1, 9);
    for (int64_t e = 0; e < E; ++e) {
      const int64_t pick = rng.integer(0, 5);
      c.counts.push_back(pick == 0   ? rng.integer(std::numeric_limits<int64_t>::min(), -1)
                         : pick == 1 ? rng.integer(kI64Max - 8, kI64Max)
                         : pick == 2 ? rng.integer(0, kI64Max)
                                     : rng.integer(0, 12));
    }
    cases.push_back(c);
  }
  for (const Case& c : cases) {
    for (DType dt : {DType::i64, DType::i32}) {
      std::vector<int64_t> counts = c.counts;
      if (dt == DType::i32) {
        for (int64_t& v : counts) v = static_cast<int32_t>(v);  // what an i32 tensor can hold
      }
      const HostTensor t = counts_tensor(counts, dt);
      uint32_t want_errors = 0;
      const std::vector<int64_t> want = device_offsets(counts, c.capacity, &want_errors);
      SCOPED_TRACE(::testing::PrintToString(counts) + " capacity " + std::to_string(c.capacity));
      const ClampedGroupOffsets got = clamped_group_offsets(t.view(), c.capacity);
      EXPECT_EQ(got.offsets, want);
      EXPECT_EQ(got.errors, want_errors);
      if (want_errors == 0) {
        EXPECT_EQ(host_group_offsets(t.view(), c.capacity), want);
      } else {
        // The CPU backend reports what the device would record, in check_device_errors' words.
        const std::string device_words = device_error_text(want_errors);
        GMOE_EXPECT_ERROR(host_group_offsets(t.view(), c.capacity, "counts"), "counts",
                          (want_errors & kDeviceErrorNegativeCount) ? "negative" : "past the capacity",
                          device_words.c_str());
      }
    }
  }
}

TEST(HostileOps, OverflowingCountsAreRefusedByEveryGroupedOp) {
  Rng rng;
  const int64_t E = 3, N = 16, K = 8, F = 8, capacity = 6;
  for (const std::vector<int64_t>& counts :
       {std::vector<int64_t>{1, kI64Max, 2}, std::vector<int64_t>{2, kI64Max - 1, int64_t{1} << 62}}) {
    SCOPED_TRACE(::testing::PrintToString(counts));
    const HostTensor c = counts_tensor(counts);
    HostTensor x(DType::bf16, {capacity, K}), w(DType::bf16, {E, N, K}), y(DType::bf16, {capacity, N});
    fill_random(x, rng);
    fill_random(w, rng);
    poison(y);
    GMOE_EXPECT_ERROR(grouped_gemm_fprop(x.view(), ExpertWeights::from_stacked(w.view()), c.view(), y.view()),
                      "counts", "past the capacity");
    HostTensor bias(DType::bf16, {E, N});
    fill_random(bias, rng);
    GMOE_EXPECT_ERROR(grouped_bias_add(y.view(), ExpertBias::from_grouped(bias.view()), c.view()),
                      "counts", "past the capacity");
    for (int64_t i = 0; i < y.numel(); ++i) ASSERT_TRUE(std::isnan(y.get(i))) << "y[" << i << "] written";

    HostTensor h(DType::bf16, {capacity, 2 * F}), z(DType::bf16, {capacity, F});
    fill_random(h, rng);
    poison(z);
    GMOE_EXPECT_ERROR(grouped_activation_forward(h.view(), c.view(), z.view(), ActivationOptions{}),
                      "counts", "past the capacity");
    for (int64_t i = 0; i < z.numel(); ++i) ASSERT_TRUE(std::isnan(z.get(i))) << "z[" << i << "] written";
  }
}

TEST(HostileOps, SizeProductsThatOverflowAreErrors) {
  // {2^32, 2^33}: 2^65 elements wrap to 0 unchecked, pass the "data present unless empty" check.
  // The constructor refuses it; a view filled in by hand is checked where it is counted.
  GMOE_EXPECT_ERROR(TensorView(nullptr, DType::bf16, Device::cpu(), {int64_t{1} << 32, int64_t{1} << 33}),
                    "overflow");
  TensorView huge;
  huge.dtype = DType::bf16;
  huge.ndim = 2;
  huge.shape = {int64_t{1} << 32, int64_t{1} << 33};
  huge.strides = {int64_t{1} << 33, 1};
  GMOE_EXPECT_ERROR((void)huge.numel(), "overflow");
  GMOE_EXPECT_ERROR((void)huge.nbytes(), "overflow");
  TensorView bytes_only(nullptr, DType::f32, Device::cpu(), {int64_t{1} << 62});
  EXPECT_EQ(bytes_only.numel(), int64_t{1} << 62);
  GMOE_EXPECT_ERROR((void)bytes_only.nbytes(), "overflow");
  // The contiguous strides of [0, 2^62, 4] do not fit, however empty the tensor is.
  GMOE_EXPECT_ERROR(TensorView(nullptr, DType::f32, Device::cpu(), {0, int64_t{1} << 62, 4}), "overflow");
  GMOE_EXPECT_ERROR(TensorView(nullptr, DType::f32, Device::cpu(), {int64_t{1} << 62, 4, 0}).numel(), "overflow");
  EXPECT_EQ(TensorView(nullptr, DType::f32, Device::cpu(), {int64_t{1} << 62, 0}).numel(), 0);

  const HostTensor counts = make_counts({0, 0}, DType::i32);
  HostTensor z(DType::bf16, {4, 4});
  TensorView h = huge;  // [2^32, 2^33]: gated, so F = 2^32
  TensorView z_huge = huge;  // [2^32, 2^32]: F = 2^32
  z_huge.shape[1] = int64_t{1} << 32;
  z_huge.strides[0] = int64_t{1} << 32;
  GMOE_EXPECT_ERROR(grouped_activation_forward(h, counts.view(), z_huge, ActivationOptions{}), "overflow");
  GMOE_EXPECT_ERROR(grouped_activation_forward(h, counts.view(), z.view(), ActivationOptions{}), "h");
}

TEST(HostileOps, ExpertMaskWithoutDataIsAnError) {
  Rng rng;
  const int64_t E = 3, N = 8, K = 8, capacity = 9;
  const HostTensor c = make_counts({3, 3, 3});
  HostTensor x(DType::f32, {capacity, K}), dy(DType::f32, {capacity, N}), dw(DType::f32, {E, N, K});
  fill_random(x, rng);
  fill_random(dy, rng);
  poison(dw);
  WgradOptions opt;
  opt.accumulate = true;
  opt.expert_mask = TensorView(nullptr, DType::i32, Device::cpu(), {E});
  GMOE_EXPECT_ERROR(grouped_gemm_wgrad(dy.view(), x.view(), c.view(), ExpertWeights::from_stacked(dw.view()), opt),
                    "expert_mask", "no data");
  for (int64_t i = 0; i < dw.numel(); ++i) ASSERT_TRUE(std::isnan(dw.get(i))) << "dw[" << i << "] written";
}

TEST(HostileOps, OutputDtypeMessageNamesEachChoiceOnce) {
  Rng rng;
  const HostTensor c = make_counts({2, 2});
  HostTensor x(DType::f32, {4, 8}), w(DType::f32, {2, 8, 8}), y(DType::bf16, {4, 8});
  fill_random(x, rng);
  fill_random(w, rng);
  try {
    grouped_gemm_fprop(x.view(), ExpertWeights::from_stacked(w.view()), c.view(), y.view());
    ADD_FAILURE() << "a bf16 y for f32 x was accepted";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("expected dtype f32 (the input's), got bf16"), std::string::npos) << what;
    EXPECT_EQ(what.find("or f32"), std::string::npos) << what;
  }
  HostTensor xb(DType::bf16, {4, 8}), wb(DType::bf16, {2, 8, 8}), y16(DType::f16, {4, 8});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(xb.view(), ExpertWeights::from_stacked(wb.view()), c.view(), y16.view()),
                    "expected dtype bf16 (the input's) or f32, got f16");
}

}  // namespace
}  // namespace gmoe::test
