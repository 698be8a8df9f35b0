// tests/cpu/test_copy_stream_cpu.cpp — the plain data movement and stream/event API that layers use
// (gmoe/copy.h, gmoe/stream.h) on the CPU backend: copy_rows copies every row between any row
// strides and touches nothing else; fill_zero zeroes exactly the tensor; events and stream syncs are
// no-ops for the CPU; upload_counts to the CPU is an owned copy of the counts; every bad argument
// throws gmoe::Error naming it.
#include <gtest/gtest.h>

#include <cmath>
#include <utility>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "gmoe/copy.h"
#include "gmoe/stream.h"

namespace gmoe::test {
namespace {

TEST(CpuCopyRows, CopiesEveryRowBetweenStridesAndNothingElse) {
  Rng rng;
  for (const DType dt : {DType::f32, DType::bf16, DType::i64}) {
    const int64_t rows = 37, cols = 13, src_ld = 16, dst_ld = 21;
    HostTensor src(dt, {rows, src_ld}), dst(dt, {rows, dst_ld});
    fill_random(src, rng, -100.0, 100.0);
    poison(dst);
    const std::vector<double> before = dst.to_double();
    copy_rows(TensorView(dst.data(), dt, Device::cpu(), {rows, cols}, {dst_ld, 1}),
              TensorView(src.data(), dt, Device::cpu(), {rows, cols}, {src_ld, 1}));
    const std::vector<double> s = src.to_double(), d = dst.to_double();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < dst_ld; ++c) {
        const double want = c < cols ? s[r * src_ld + c] : before[r * dst_ld + c];
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(d[r * dst_ld + c])) << dtype_name(dt) << " row " << r << " col " << c;
        } else {
          ASSERT_EQ(d[r * dst_ld + c], want) << dtype_name(dt) << " row " << r << " col " << c;
        }
      }
    }
  }
}

TEST(CpuCopyRows, EmptyTensorsCopyNothing) {
  HostTensor a(DType::f32, {0, 8}), b(DType::f32, {0, 8});
  copy_rows(a.view(), b.view());
  HostTensor c(DType::f32, {4, 0}), d(DType::f32, {4, 0});
  copy_rows(c.view(), d.view());
}

TEST(CpuCopyRows, BadArgumentsNameTheArgument) {
  HostTensor a(DType::f32, {8, 4}), b(DType::f32, {8, 4}), c(DType::bf16, {8, 4}), d(DType::f32, {7, 4});
  GMOE_EXPECT_ERROR(copy_rows(TensorView(), b.view()), "dst:");
  GMOE_EXPECT_ERROR(copy_rows(a.view(), TensorView()), "src:");
  GMOE_EXPECT_ERROR(copy_rows(c.view(), b.view()), "dst:", "f32", "bf16");
  GMOE_EXPECT_ERROR(copy_rows(d.view(), b.view()), "dst:", "[8, 4]", "[7, 4]");
  GMOE_EXPECT_ERROR(copy_rows(TensorView(a.data(), DType::f32, Device::cpu(), {4, 4}, {1, 4}), b.view()), "dst:",
                    "contiguous");
  // Overlapping rows of one buffer.
  GMOE_EXPECT_ERROR(copy_rows(TensorView(a.data(), DType::f32, Device::cpu(), {4, 4}),
                              TensorView(static_cast<float*>(a.data()) + 4, DType::f32, Device::cpu(), {4, 4})),
                    "overlap");
  GMOE_EXPECT_ERROR(copy_rows(TensorView(a.data(), DType::f32, Device::cuda(0), {8, 4}), b.view()), "dst:", "cuda");
}

TEST(CpuFillZero, ZeroesExactlyTheTensor) {
  Rng rng;
  HostTensor t(DType::bf16, {5, 9});
  fill_random(t, rng);
  const std::vector<double> before = t.to_double();
  // The first three rows only (contiguous: a prefix of the buffer).
  fill_zero(TensorView(t.data(), DType::bf16, Device::cpu(), {3, 9}));
  const std::vector<double> after = t.to_double();
  for (size_t i = 0; i < after.size(); ++i) {
    ASSERT_EQ(after[i], i < 27 ? 0.0 : before[i]) << "element " << i;
  }
  fill_zero(TensorView(t.data(), DType::bf16, Device::cpu(), {0, 9}));  // nothing to do
  GMOE_EXPECT_ERROR(fill_zero(TensorView()), "t:", "absent");
  GMOE_EXPECT_ERROR(fill_zero(TensorView(t.data(), DType::bf16, Device::cpu(), {5, 4}, {9, 1})), "t:", "contiguous");
}

TEST(CpuUploadCounts, CopiesTheCountsAndChecksThem) {
  Rng rng;
  for (DType dt : {DType::i32, DType::i64}) {
    std::vector<int64_t> want(static_cast<size_t>(rng.integer(1, 40)));
    for (int64_t& c : want) c = rng.integer(0, 1 << 20);
    HostTensor host = make_counts(want, dt);
    const Tensor got = upload_counts(host.view(), Device::cpu());
    ASSERT_TRUE(got.owns_memory());
    EXPECT_NE(got.view().data, host.view().data);
    EXPECT_EQ(got.view().dtype, dt);
    for (int64_t e = 0; e < static_cast<int64_t>(want.size()); ++e) host.set(e, -1.0);  // the copy is independent
    for (int64_t e = 0; e < static_cast<int64_t>(want.size()); ++e) {
      const int64_t v = dt == DType::i32 ? got.view().ptr<int32_t>()[e] : got.view().ptr<int64_t>()[e];
      ASSERT_EQ(v, want[e]) << "count " << e;
    }
  }
  HostTensor f(DType::f32, {4});
  GMOE_EXPECT_ERROR(upload_counts(f.view(), Device::cpu()), "host_counts", "i32 or i64");
}

TEST(CpuEvent, RecordAndWaitAreNoOpsOnTheCpuAndAnUndefinedEventThrows) {
  Event none;
  EXPECT_FALSE(none.defined());
  GMOE_EXPECT_ERROR(none.record(nullptr), "Event::record", "not defined");
  GMOE_EXPECT_ERROR(none.wait(nullptr), "Event::wait", "not defined");
  Event cpu(Device::cpu());
  EXPECT_TRUE(cpu.defined());
  EXPECT_TRUE(cpu.device().is_cpu());
  cpu.record(nullptr);
  cpu.wait(nullptr);
  Event moved = std::move(cpu);
  EXPECT_TRUE(moved.defined());
  EXPECT_FALSE(cpu.defined());  // NOLINT(bugprone-use-after-move): the moved-from state is defined
  moved.record(nullptr);
  synchronize_stream(nullptr, Device::cpu());
#ifndef GMOE_WITH_CUDA
  GMOE_EXPECT_ERROR((void)Event(Device::cuda(0)), "Event", "without CUDA");
  GMOE_EXPECT_ERROR(synchronize_stream(nullptr, Device::cuda(0)), "synchronize_stream", "without CUDA");
#endif
}

}  // namespace
}  // namespace gmoe::test
