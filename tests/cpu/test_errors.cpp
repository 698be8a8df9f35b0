// tests/cpu/test_errors.cpp — bad input gets gmoe::Error naming the argument, what was expected
// and what was given; and nothing is written when a call is refused.
#include <gtest/gtest.h>

#include "common/expect_error.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/activation.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

struct Small {
  Rng rng;
  ShapeCase c;
  GemmProblem p;
  HostTensor y;
  Small() : c(make_case("uniform", rng)), p(c, DType::bf16, rng), y(DType::bf16, {c.capacity, c.N}) {
    poison(y);
  }
  ExpertWeights w() const { return p.weights(Layout::kStacked); }
};

TEST(Errors, ShapeMismatch) {
  Small s;
  HostTensor y_bad(DType::bf16, {s.c.capacity, s.c.N + 1});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), s.p.counts.view(), y_bad.view()),
                    "y:", "expected [", "got [");
  HostTensor x_bad(DType::bf16, {s.c.capacity, s.c.K + 8});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(x_bad.view(), s.w(), s.p.counts.view(), s.y.view()), "w:",
                    "expected experts of");
  HostTensor dx_bad(DType::bf16, {s.c.capacity + 1, s.c.K});
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad(s.p.dy.view(), s.w(), s.p.counts.view(), dx_bad.view()), "dx:");
  HostTensor x_rows(DType::bf16, {s.c.capacity + 3, s.c.K});
  HostExpertTensor dw(Layout::kStacked, DType::f32, s.c.E, s.c.N, s.c.K);
  GMOE_EXPECT_ERROR(grouped_gemm_wgrad(s.p.dy.view(), x_rows.view(), s.p.counts.view(), dw.view()),
                    "x:", "rows");
  // A list whose experts disagree in shape.
  std::vector<TensorView> list;
  for (const HostTensor& t : s.p.w) list.push_back(t.view());
  HostTensor odd(DType::bf16, {s.c.N, s.c.K - 1});
  list[3] = odd.view();
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), ExpertWeights::from_list(list), s.p.counts.view(),
                                       s.y.view()),
                    "w[3]", "shape of expert 0");
  // A bias of the wrong length, or for the wrong number of experts.
  HostTensor bias_bad(DType::bf16, {s.c.E, s.c.N + 1});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), ExpertBias::from_grouped(bias_bad.view()),
                                       s.p.counts.view(), s.y.view()),
                    "bias", "expected");
  HostTensor bias_few(DType::bf16, {s.c.E - 1, s.c.N});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), ExpertBias::from_grouped(bias_few.view()),
                                       s.p.counts.view(), s.y.view()),
                    "bias", "experts");
  // Nothing was written by any refused call.
  for (int64_t i = 0; i < s.y.numel(); ++i) ASSERT_TRUE(std::isnan(s.y.get(i)));
}

TEST(Errors, DtypeNotSupported) {
  Small s;
  HostTensor x8(DType::e4m3, {s.c.capacity, s.c.K});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(x8.view(), s.w(), s.p.counts.view(), s.y.view()), "x:",
                    "dtype not supported", "e4m3");
  HostTensor y16(DType::f16, {s.c.capacity, s.c.N});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), s.p.counts.view(), y16.view()), "y:",
                    "bf16", "f16");
  HostTensor wf(DType::f16, {s.c.E, s.c.N, s.c.K});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), ExpertWeights::from_stacked(wf.view()),
                                       s.p.counts.view(), s.y.view()),
                    "w:", "must match x");
  HostExpertTensor dw(Layout::kStacked, DType::bf16, s.c.E, s.c.N, s.c.K);
  WgradOptions acc;
  acc.accumulate = true;
  GMOE_EXPECT_ERROR(grouped_gemm_wgrad(s.p.dy.view(), s.p.x.view(), s.p.counts.view(), dw.view(), acc),
                    "dw:", "accumulate", "f32");
}

TEST(Errors, DeviceMismatch) {
  Small s;
  TensorView y_gpu = s.y.view();
  y_gpu.device = Device::cuda(0);
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), s.p.counts.view(), y_gpu), "y:", "cpu",
                    "cuda:0");
  TensorView counts_gpu = s.p.counts.view();
  counts_gpu.device = Device::cuda(0);
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), counts_gpu, s.y.view()), "counts:",
                    "cuda:0");
}

TEST(Errors, CountsTensor) {
  Small s;
  HostTensor short_counts = make_counts(std::vector<int64_t>(static_cast<size_t>(s.c.E - 1), 1));
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), short_counts.view(), s.y.view()), "w:",
                    "experts", "counts has length");
  HostTensor float_counts(DType::f32, {s.c.E});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), float_counts.view(), s.y.view()),
                    "counts:", "i32 or i64", "f32");
  HostTensor counts_2d(DType::i32, {1, s.c.E});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), counts_2d.view(), s.y.view()), "counts:",
                    "1-D");
}

TEST(Errors, CountsPastCapacityAndNegative) {
  Small s;
  std::vector<int64_t> over = s.c.counts;
  over.back() += 1;
  HostTensor over_t = make_counts(over);
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), over_t.view(), s.y.view()), "counts",
                    "past the capacity");
  std::vector<int64_t> neg = s.c.counts;
  neg[2] = -1;
  HostTensor neg_t = make_counts(neg, DType::i64);
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad(s.p.dy.view(), s.w(), neg_t.view(), s.p.x.view()), "counts[2]",
                    "negative");
  for (int64_t i = 0; i < s.y.numel(); ++i) ASSERT_TRUE(std::isnan(s.y.get(i)));
}

TEST(Errors, StridesAndMask) {
  Small s;
  TensorView x = s.p.x.view();
  x.strides[1] = 2;
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(x, s.w(), s.p.counts.view(), s.y.view()), "x:", "contiguous");
  TensorView y = s.y.view();
  y.strides[0] = s.c.N - 1;
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(s.p.x.view(), s.w(), s.p.counts.view(), y), "y:", "row stride");
  HostExpertTensor dw(Layout::kList, DType::f32, s.c.E, s.c.N, s.c.K);
  HostTensor mask(DType::i64, {s.c.E});
  WgradOptions opt;
  opt.expert_mask = mask.view();
  GMOE_EXPECT_ERROR(grouped_gemm_wgrad(s.p.dy.view(), s.p.x.view(), s.p.counts.view(), dw.view(), opt),
                    "options.expert_mask", "i32[");
}

// MaskedOffWgrad: fresh needs a mask and a fresh_dw of dw's shape and dtype, disjoint from dw;
// skip takes no fresh_dw.
TEST(Errors, MaskedOffFresh) {
  Small s;
  HostExpertTensor dw(Layout::kStacked, DType::f32, s.c.E, s.c.N, s.c.K);
  HostExpertTensor fresh(Layout::kList, DType::f32, s.c.E, s.c.N, s.c.K);
  HostTensor mask(DType::i32, {s.c.E});
  const auto wgrad = [&](const WgradOptions& opt) {
    grouped_gemm_wgrad(s.p.dy.view(), s.p.x.view(), s.p.counts.view(), dw.view(), opt);
  };
  WgradOptions opt;
  opt.fresh_dw = fresh.view();
  GMOE_EXPECT_ERROR(wgrad(opt), "options.fresh_dw", "skip");
  opt.masked_off = MaskedOffWgrad::fresh;
  GMOE_EXPECT_ERROR(wgrad(opt), "options.masked_off", "expert_mask");
  opt.expert_mask = mask.view();
  opt.fresh_dw = ExpertWeights();
  GMOE_EXPECT_ERROR(wgrad(opt), "options.fresh_dw", "got none");
  HostExpertTensor fresh16(Layout::kList, DType::bf16, s.c.E, s.c.N, s.c.K);
  opt.fresh_dw = fresh16.view();
  GMOE_EXPECT_ERROR(wgrad(opt), "options.fresh_dw", "f32");
  HostExpertTensor wide(Layout::kList, DType::f32, s.c.E, s.c.N, s.c.K + 1);
  opt.fresh_dw = wide.view();
  GMOE_EXPECT_ERROR(wgrad(opt), "options.fresh_dw", "experts of");
  opt.fresh_dw = dw.view();
  GMOE_EXPECT_ERROR(wgrad(opt), "options.fresh_dw", "dw");
}

TEST(Errors, CudaTensorsWithoutCuda) {
#ifdef GMOE_WITH_CUDA
  GTEST_SKIP() << "built with CUDA: the CUDA suites cover CUDA tensors";
#else
  Small s;
  auto on_gpu = [](TensorView v) { v.device = Device::cuda(0); return v; };
  TensorView wg = s.p.w_stacked.view();
  wg.device = Device::cuda(0);
  GMOE_EXPECT_ERROR(grouped_gemm_fprop(on_gpu(s.p.x.view()), ExpertWeights::from_stacked(wg),
                                       on_gpu(s.p.counts.view()), on_gpu(s.y.view())),
                    "grouped_gemm_fprop", "built without CUDA");
#endif
}

// grouped_gemm_fprop_activation: every refusal names the argument before anything is written (its
// values are held to the fp64 oracles in test_grouped_gemm_activation_cpu.cpp).
TEST(FpropActivation, RefusalsNameTheArgument) {
  Rng rng;
  ShapeCase c = make_case("skewed", rng);
  c.N = 2 * 48;
  const GemmProblem p(c, DType::bf16, rng);
  HostTensor bias(DType::bf16, {c.E, c.N});
  fill_random(bias, rng);
  ActivationOptions act;
  act.kind = ActivationKind::clamped_swiglu;
  act.limit = 0.75f;
  act.glu = {GluLayout::interleaved, 16};
  const ExpertBias b = ExpertBias::from_grouped(bias.view());
  const ExpertWeights w = p.weights(Layout::kStacked);
  HostTensor h2(DType::bf16, {c.capacity, c.N}), z2(DType::bf16, {c.capacity, 48});
  poison(h2);
  poison(z2);
  HostTensor z_bad(DType::bf16, {c.capacity, 32}), h_f32(DType::f32, {c.capacity, c.N});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop_activation(p.x.view(), w, b, p.counts.view(), h2.view(), z_bad.view(), act),
                    "h:", "input columns");
  GMOE_EXPECT_ERROR(grouped_gemm_fprop_activation(p.x.view(), w, b, p.counts.view(), h_f32.view(), z2.view(), act),
                    "h:", "x's dtype");
  ActivationOptions odd = act;
  odd.glu = {GluLayout::interleaved, 32};  // does not divide F = 48
  GMOE_EXPECT_ERROR(grouped_gemm_fprop_activation(p.x.view(), w, b, p.counts.view(), h2.view(), z2.view(), odd),
                    "options.glu.block", "must divide");
  // z over x: the epilogue would write what the GEMM still reads.
  const TensorView x_as_z = contiguous_view(const_cast<void*>(p.x.data()), DType::bf16, Device::cpu(), {c.capacity, 48});
  GMOE_EXPECT_ERROR(grouped_gemm_fprop_activation(p.x.view(), w, b, p.counts.view(), h2.view(), x_as_z, act),
                    "z and x overlap");
  for (int64_t i = 0; i < h2.numel(); ++i) ASSERT_TRUE(std::isnan(h2.get(i)));
  for (int64_t i = 0; i < z2.numel(); ++i) ASSERT_TRUE(std::isnan(z2.get(i)));
}

// grouped_gemm_dgrad_activation_backward: every refusal names the argument before anything is
// written (its values are held to the fp64 oracles in test_grouped_gemm_activation_cpu.cpp).
TEST(DgradActivationBackward, RefusalsNameTheArgument) {
  Rng rng;
  ShapeCase c = make_case("skewed", rng);
  c.K = 48;   // F: FC2's weights are [E, H = c.N, F]
  c.N = 112;  // H: dy [capacity, H] holds as many elements as h (the overlap refusal below)
  const int64_t F = c.K;
  const GemmProblem p(c, DType::bf16, rng);
  const ExpertWeights w = p.weights(rng.integer(0, 1) ? Layout::kStacked : Layout::kList);
  HostTensor h0(DType::bf16, {c.capacity, 2 * F});
  fill_random(h0, rng, -3.0, 3.0);
  ActivationOptions act;
  act.glu = {GluLayout::interleaved, 16};
  HostTensor h = h0;
  HostTensor h_odd(DType::bf16, {c.capacity, 2 * F + 2}), h_f32(DType::f32, {c.capacity, 2 * F});
  ActivationOptions relu2 = act;
  relu2.kind = ActivationKind::squared_relu;
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h.view(), h.view(), relu2),
                    "options.kind", "gated");
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h_odd.view(),
                                                           h_odd.view(), act),
                    "h:", "input columns");
  HostTensor h_short(DType::bf16, {c.capacity - 1, 2 * F}), dh_f32(DType::f32, {c.capacity, 2 * F});
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h_short.view(),
                                                           h_short.view(), act),
                    "h:", "dy's", "rows");
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h.view(), dh_f32.view(),
                                                           act),
                    "dh:", "expected dtype");
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h_f32.view(),
                                                           h_f32.view(), act),
                    "h:", "dy's dtype");
  ActivationOptions odd = act;
  odd.glu = {GluLayout::interleaved, 32};  // does not divide F = 48
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h.view(), h.view(), odd),
                    "options.glu.block", "must divide");
  // dh over dy: the epilogue would write what the GEMM still reads.
  const TensorView dy_as_dh =
      contiguous_view(const_cast<void*>(p.dy.data()), DType::bf16, Device::cpu(), {c.capacity, 2 * F});
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), h.view(), dy_as_dh, act),
                    "dh and dy overlap");
  // dh one row into h: neither h itself nor apart from it.
  HostTensor h_big(DType::bf16, {c.capacity + 1, 2 * F});
  const TensorView big_head = contiguous_view(h_big.data(), DType::bf16, Device::cpu(), {c.capacity, 2 * F});
  const TensorView big_shifted =
      contiguous_view(static_cast<char*>(h_big.data()) + 2 * F * 2, DType::bf16, Device::cpu(), {c.capacity, 2 * F});
  GMOE_EXPECT_ERROR(grouped_gemm_dgrad_activation_backward(p.dy.view(), w, p.counts.view(), big_head, big_shifted, act),
                    "dh and h overlap");
  EXPECT_TRUE(bitwise_equal(h, h0, "h (nothing written by a refused call)"));
}

// Every bit a kernel can record has words of its own: none reaches the user as "unknown".
TEST(Errors, EveryDeviceErrorBitIsDescribed) {
  for (uint32_t bit : {kDeviceErrorNegativeCount, kDeviceErrorCountsPastCapacity, kDeviceErrorPaddedOffsets,
                       kDeviceErrorRoutingIndexOutOfRange}) {
    const std::string text = device_error_text(bit);
    EXPECT_FALSE(text.empty()) << "bit 0x" << std::hex << bit;
    EXPECT_EQ(text.find("unknown"), std::string::npos) << text;
  }
  EXPECT_NE(device_error_text(1u << 31).find("unknown bits 0x80000000"), std::string::npos);
}

}  // namespace
}  // namespace gmoe::test
