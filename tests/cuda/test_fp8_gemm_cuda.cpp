// tests/cuda/test_fp8_gemm_cuda.cpp — the sm_90a FP8 grouped GEMM (blockwise, tensorwise, mxfp8)
// on every named shape case, all three passes (fprop also with a bias), checked twice:
//   tight   against the exact (fp64) GEMM of the dequantized operands, decoded independently
//           from the format (tests/common/fp8_fixture.h): only the output's rounding and the fp32
//           accumulation of the tensor cores may separate them;
//   recipe  against the exact GEMM of the unquantized bf16 source, within the bound that the
//           recipe's quantization error implies.
// Operands are quantized on the host by the CPU backend (no dependence on the CUDA quantizer).
// Outputs are NaN-poisoned before each run; wgrad to f32 and bf16, stacked and list dW, with
// accumulate and an expert mask (mask-0 experts skipped, or written into a fresh buffer); blockwise scale arrays at any 4-byte offset (bitwise the aligned
// run, all three passes and both wgrad outputs); CUDA-specific bad inputs; one CUDA graph of the
// three passes replayed under changing counts; inconsistent padded offsets are clamped and reported.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/fp8_fixture.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "cuda/fp8_device.h"
#include "gmoe/error.h"
#include "gmoe/fp8_gemm.h"

namespace gmoe::test {
namespace {

// ---------------------------------------------------------------------------------------------
// Tolerances: the rule of common/tolerance.h, the f32 sums of the same quantized operands the
// reference. Hopper's FP8 tensor cores add each 128-long k-block's products in fewer bits than f32
// before promoting them (Fp8Accumulation::kPromoted); with fast accumulation (Fp8GemmOptions,
// tensorwise only: blockwise always promotes, mxfp8 runs bf16 GEMMs) nothing is promoted (kFast).

Fp8Accumulation accumulation(Fp8Recipe recipe, const Fp8GemmOptions& options = {}) {
  return options.fast_accumulation && recipe == Fp8Recipe::tensorwise ? Fp8Accumulation::kFast
                                                                      : Fp8Accumulation::kPromoted;
}

std::vector<double> values_of(const HostTensor& t) { return t.to_double(); }

const char* recipe_str(Fp8Recipe r) { return fp8_recipe_name(r); }

// ---------------------------------------------------------------------------------------------
// The passes.

// with_bias: a per-expert bf16 bias, grouped [E, N] or a list, fused by every recipe (blockwise
// from the accumulators' start, tensorwise in the epilogue, mxfp8 in the bf16 fprop it runs on):
// one rounding of the f32 result, the bound of the exact sum. `bias_list`, if given: whether the
// bias was a list (a list leaves the experts whole: no row chunks). bias_offset: every expert's
// vector starts that many elements past a 256-byte boundary (an odd offset is not the 16-byte
// alignment the blockwise kernel copies the bias with: the second pass then adds it).
void check_fprop(const ShapeCase& c, Fp8Recipe recipe, Rng& rng, bool with_bias = false,
                 const Fp8GemmOptions& options = {}, bool* bias_list = nullptr, int64_t bias_offset = 0) {
  const Fp8Problem p(c, recipe, rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  HostTensor bias(DType::bf16, {c.E, c.N});
  fill_random(bias, rng, -2.0, 2.0);
  const bool as_list = rng.integer(0, 1) == 1;
  if (bias_list != nullptr) *bias_list = with_bias && as_list;
  // The grouped bias, [E, N] at bias_offset elements into its buffer.
  HostTensor grouped_h(DType::bf16, {c.E * c.N + bias_offset});
  for (int64_t i = 0; i < c.E * c.N; ++i) grouped_h.set(bias_offset + i, bias.get(i));
  DeviceTensor bias_d(grouped_h);
  auto at_offset = [bias_offset](const TensorView& buffer, std::initializer_list<int64_t> shape) {
    return TensorView(static_cast<char*>(buffer.data) + bias_offset * 2, DType::bf16, buffer.device, shape);
  };
  std::vector<DeviceTensor> rows_d;
  std::vector<TensorView> list_d;
  for (int64_t e = 0; e < c.E; ++e) {
    HostTensor v(DType::bf16, {c.N + bias_offset});
    for (int64_t n = 0; n < c.N; ++n) v.set(bias_offset + n, bias.get(e * c.N + n));
    rows_d.emplace_back(v);
  }
  for (DeviceTensor& r : rows_d) list_d.push_back(at_offset(r.view(), {c.N}));
  const ExpertBias bias_v = !with_bias ? ExpertBias()
                            : as_list  ? ExpertBias::from_list(list_d)
                                       : ExpertBias::from_grouped(at_offset(bias_d.view(), {c.E, c.N}));
  DeviceGrouped x(p.x.q);
  DeviceWeights w(p.w.q);
  DeviceTensor counts(p.base.counts);
  HostTensor y_h(DType::bf16, {c.capacity, c.N});
  poison(y_h);
  DeviceTensor y(y_h);
  if (options.fast_accumulation) {
    fp8_grouped_gemm_fprop(x.q, w.q, bias_v, counts.view(), y.view(), options);
  } else if (with_bias) {
    fp8_grouped_gemm_fprop(x.q, w.q, bias_v, counts.view(), y.view());
  } else {
    fp8_grouped_gemm_fprop(x.q, w.q, counts.view(), y.view());
  }
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  check_device_errors(nullptr);
  const std::vector<double> got = y.download().to_double();
  ExactResult exact = exact_fprop(p.x_rows, p.w_data, c.counts);
  const Fp8Accumulation acc = accumulation(recipe, options);
  if (!with_bias) {
    EXPECT_TRUE(within_rule(got, exact, DType::bf16, "fprop tight", acc));
    EXPECT_TRUE(within_rule(got, against_source(exact, exact_fprop(p.base.x, p.base.w, c.counts)), DType::bf16,
                            "fprop vs bf16 source", acc));
    return;
  }
  // A bias off 16-byte alignment: blockwise adds it in a second pass, after y's rounding to bf16;
  // tensorwise's epilogue and the bf16 GEMM behind mxfp8 read it at any alignment (fused).
  add_bias(exact, bias, c.counts, DType::bf16, !(bias_offset % 8 != 0 && recipe == Fp8Recipe::blockwise));
  EXPECT_TRUE(within_rule(got, exact, DType::bf16, std::string("fprop + bias (") + (as_list ? "list)" : "grouped)"),
                          acc));
}

// grad_format: dy's format (e5m2 runs the kernels whose A operand is e5m2).
// x in e5m2 (the weights in e4m3): the kernels whose A operand is e5m2, and for a bias its second
// pass (the fused-bias kernels are compiled for e4m3 x only).
void check_fprop_e5m2_x(const ShapeCase& c, Fp8Recipe recipe, Rng& rng) {
  const Fp8Problem p(c, recipe, rng);
  Fp8QuantizeOptions o;
  o.recipe = recipe;
  o.format = DType::e5m2;
  const Fp8GroupedTensor x5 = quantize_grouped(GroupedRows{p.base.x.view(), p.base.counts.view()}, o);
  const HostTensor x5_rows = decode_grouped(x5.q, c.counts, Fp8Copy::rowwise);
  HostTensor bias(DType::bf16, {c.E, c.N});
  fill_random(bias, rng, -2.0, 2.0);
  DeviceTensor bias_d(bias);
  DeviceGrouped x(x5.q);
  DeviceWeights w(p.w.q);
  DeviceTensor counts(p.base.counts);
  for (bool with_bias : {false, true}) {
    SCOPED_TRACE(with_bias ? "with a bias" : "no bias");
    HostTensor y_h(DType::bf16, {c.capacity, c.N});
    poison(y_h);
    DeviceTensor y(y_h);
    if (with_bias) {
      fp8_grouped_gemm_fprop(x.q, w.q, ExpertBias::from_grouped(bias_d.view()), counts.view(), y.view());
    } else {
      fp8_grouped_gemm_fprop(x.q, w.q, counts.view(), y.view());
    }
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);
    ExactResult exact = exact_fprop(x5_rows, p.w_data, c.counts);
    // y rounded to bf16 once before the bias is added (second pass).
    if (with_bias) add_bias(exact, bias, c.counts, DType::bf16, false);
    EXPECT_TRUE(within_rule(y.download().to_double(), exact, DType::bf16, "fprop (e5m2 x) tight",
                            Fp8Accumulation::kPromoted));
  }
}

void check_dgrad(const ShapeCase& c, Fp8Recipe recipe, Rng& rng, DType grad_format = DType::e4m3,
                 const Fp8GemmOptions& options = {}) {
  const Fp8Problem p(c, recipe, rng, rng.integer(0, 1) ? DType::i32 : DType::i64, DType::e4m3, grad_format);
  DeviceGrouped dy(p.dy.q);
  DeviceWeights w(p.w.q);
  DeviceTensor counts(p.base.counts);
  HostTensor dx_h(DType::bf16, {c.capacity, c.K});
  poison(dx_h);
  DeviceTensor dx(dx_h);
  if (options.fast_accumulation) {
    fp8_grouped_gemm_dgrad(dy.q, w.q, counts.view(), dx.view(), options);
  } else {
    fp8_grouped_gemm_dgrad(dy.q, w.q, counts.view(), dx.view());
  }
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  check_device_errors(nullptr);
  const std::vector<double> got = dx.download().to_double();
  const ExactResult exact = exact_dgrad(p.dy_rows, p.w_t, c.counts);
  const Fp8Accumulation acc = accumulation(recipe, options);
  EXPECT_TRUE(within_rule(got, exact, DType::bf16, "dgrad tight", acc));
  EXPECT_TRUE(within_rule(got, against_source(exact, exact_dgrad(p.base.dy, p.base.w, c.counts)), DType::bf16,
                          "dgrad vs bf16 source", acc));
}

void check_wgrad(const ShapeCase& c, Fp8Recipe recipe, Layout layout, Rng& rng,
                 DType grad_format = DType::e4m3) {
  const Fp8Problem p(c, recipe, rng, rng.integer(0, 1) ? DType::i32 : DType::i64, DType::e4m3, grad_format);
  DeviceGrouped dy(p.dy.q), x(p.x.q);
  DeviceTensor counts(p.base.counts);
  const ExactResult exact = exact_wgrad(p.dy_cols, p.x_cols, c.counts, nullptr, nullptr);
  const ExactResult source = against_source(exact, exact_wgrad(p.base.dy, p.base.x, c.counts, nullptr, nullptr));
  for (DType out : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string("dW ") + dtype_name(out) + ", " + layout_name(layout));
    HostExpertTensor dw_h(layout, out, c.E, c.N, c.K);
    dw_h.poison_all();
    DeviceExperts dw(dw_h);
    fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), dw.view());
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);
    const std::vector<double> got = dw.to_double();
    EXPECT_TRUE(within_rule(got, exact, out, "wgrad tight", Fp8Accumulation::kPromoted));
    EXPECT_TRUE(within_rule(got, source, out, "wgrad vs bf16 source", Fp8Accumulation::kPromoted));
    for (int64_t e = 0; e < c.E; ++e) {
      if (c.counts[e] != 0) continue;
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        ASSERT_EQ(got[e * c.N * c.K + i], 0.0) << "empty expert " << e << " not exactly zero";
      }
    }
  }
}

void check_wgrad_accumulate_mask(const ShapeCase& c, Fp8Recipe recipe, Layout layout, Rng& rng,
                                 DType grad_format = DType::e4m3) {
  const Fp8Problem p(c, recipe, rng, DType::i32, DType::e4m3, grad_format);
  std::vector<int32_t> mask(static_cast<size_t>(c.E));
  for (auto& m : mask) m = static_cast<int32_t>(rng.integer(0, 1));
  HostTensor mask_t(DType::i32, {c.E});
  for (int64_t e = 0; e < c.E; ++e) mask_t.set(e, mask[e]);
  DeviceGrouped dy(p.dy.q), x(p.x.q);
  DeviceTensor counts(p.base.counts), mask_d(mask_t);
  for (bool accumulate : {false, true}) {
    SCOPED_TRACE(accumulate ? "accumulate" : "overwrite");
    HostTensor init(DType::f32, {c.E, c.N, c.K});
    fill_random(init, rng, -4.0, 4.0);
    const std::vector<double> init_v = init.to_double();
    HostExpertTensor dw_h(layout, DType::f32, c.E, c.N, c.K);
    dw_h.set_all(init_v);
    DeviceExperts dw(dw_h);
    WgradOptions opt;
    opt.accumulate = accumulate;
    opt.expert_mask = mask_d.view();
    fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), dw.view(), opt);
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);

    ExactResult exact = exact_wgrad(p.dy_cols, p.x_cols, c.counts, accumulate ? &init_v : nullptr,
                                    &mask);
    const std::vector<double> got = dw.to_double();
    const int64_t per = c.N * c.K;
    for (int64_t e = 0; e < c.E; ++e) {
      // Masked experts, and empty experts when accumulating, are left untouched: bitwise init.
      const bool untouched = mask[e] == 0 || (accumulate && c.counts[e] == 0);
      for (int64_t i = 0; i < per; ++i) {
        if (mask[e] == 0) exact.value[e * per + i] = exact.f32[e * per + i] = init_v[e * per + i];
        if (untouched) {
          ASSERT_EQ(got[e * per + i], init_v[e * per + i]) << "expert " << e << " was written";
        } else if (!accumulate && c.counts[e] == 0) {
          ASSERT_EQ(got[e * per + i], 0.0) << "empty expert " << e << " not exactly zero";
        }
      }
    }
    // The reference adds its f32 sum onto init with one f32 rounding, as the kernel does.
    EXPECT_TRUE(within_rule(got, exact, DType::f32, "wgrad f32 accumulate/mask", Fp8Accumulation::kPromoted));
  }
  expect_overwrite_then_accumulate(layout, c.E, c.N, c.K, rng, [&](const ExpertWeights& out, bool accumulate) {
    WgradOptions opt;
    opt.accumulate = accumulate;
    fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), out, opt);
  });
}

// ---------------------------------------------------------------------------------------------

using Param = std::tuple<Fp8Recipe, std::string>;

class CudaFp8Gemm : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
  Fp8Recipe recipe() const { return std::get<0>(GetParam()); }
  ShapeCase make(Rng& rng) const {
    return make_case(std::get<1>(GetParam()), rng, CaseScale::kSmall);
  }
};

TEST_P(CudaFp8Gemm, Fprop) {
  Rng rng;
  check_fprop(make(rng), recipe(), rng);
}

TEST_P(CudaFp8Gemm, FpropBias) {
  Rng rng;
  check_fprop(make(rng), recipe(), rng, /*with_bias=*/true);
}

// An expert's bias not 16-byte aligned (2 bytes past a boundary): blockwise takes the second
// pass (fp8_grouped_gemm_fprop); tensorwise's epilogue and mxfp8's bf16 GEMM read it in place.
TEST_P(CudaFp8Gemm, FpropBiasMisaligned) {
  Rng rng;
  check_fprop(make(rng), recipe(), rng, /*with_bias=*/true, {}, nullptr, /*bias_offset=*/1);
}

TEST_P(CudaFp8Gemm, Dgrad) {
  Rng rng;
  check_dgrad(make(rng), recipe(), rng);
}

TEST_P(CudaFp8Gemm, Wgrad) {
  Rng rng;
  check_wgrad(make(rng), recipe(), rng.integer(0, 1) ? Layout::kStacked : Layout::kList, rng);
}

// The FP8 weight gradient with MaskedOffWgrad::fresh (mxfp8 through the bf16 wgrad, the others
// through the FP8 kernels): mask-1 experts accumulated into main_grad, mask-0 experts written into
// the fresh buffer, in the other layout than main_grad's, in one launch; every expert's
// destination checked against the exact result of the dequantized copies, untouched ones bitwise.
TEST_P(CudaFp8Gemm, WgradMaskedOffFresh) {
  Rng rng;
  const ShapeCase c = make(rng);
  const Layout layout = rng.integer(0, 1) ? Layout::kStacked : Layout::kList;
  const Fp8Problem p(c, recipe(), rng);
  const MaskedOffDestinations d(c.E, c.N, c.K, rng);
  DeviceGrouped dy(p.dy.q), x(p.x.q);
  DeviceTensor counts(p.base.counts), mask_d(d.mask_t);
  for (bool accumulate : {false, true}) {
    const MaskedOffBuffers host(d, layout, c.E, c.N, c.K);
    DeviceExperts main_d(host.main), fresh_d(host.fresh);
    fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), main_d.view(),
                           masked_off_wgrad_options(accumulate, mask_d.view(), fresh_d.view()));
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);
    expect_masked_off_destinations(d, p.dy_cols, p.x_cols, c.counts, accumulate, main_d.to_double(),
                                   fresh_d.to_double(), nullptr, nullptr,
                                   accumulate ? "fp8 wgrad accumulate, masked off fresh" : "fp8 wgrad, masked off fresh",
                                   Fp8Accumulation::kPromoted);
  }
}

TEST_P(CudaFp8Gemm, WgradAccumulateWithMask) {
  Rng rng;
  const Layout layout = rng.integer(0, 1) ? Layout::kStacked : Layout::kList;
  check_wgrad_accumulate_mask(make(rng), recipe(), layout, rng);
}

// e5m2 gradients (Transformer Engine's hybrid format): dy in e5m2, x and the weights in e4m3.
TEST_P(CudaFp8Gemm, DgradE5m2) {
  Rng rng;
  check_dgrad(make(rng), recipe(), rng, DType::e5m2);
}

TEST_P(CudaFp8Gemm, WgradE5m2) {
  Rng rng;
  check_wgrad(make(rng), recipe(), rng.integer(0, 1) ? Layout::kStacked : Layout::kList, rng, DType::e5m2);
}

TEST_P(CudaFp8Gemm, WgradAccumulateWithMaskE5m2) {
  Rng rng;
  const Layout layout = rng.integer(0, 1) ? Layout::kStacked : Layout::kList;
  check_wgrad_accumulate_mask(make(rng), recipe(), layout, rng, DType::e5m2);
}

// Fast accumulation (tensorwise's 128x256 kernels; the other recipes ignore it and must keep the
// promoted bound); with a bias (tensorwise: the promoted fused-bias kernel) and an e5m2 dy (the
// promoted e5m2 kernel).
TEST_P(CudaFp8Gemm, FpropFastAccumulation) {
  Rng rng;
  const ShapeCase c = make(rng);
  check_fprop(c, recipe(), rng, /*with_bias=*/false, Fp8GemmOptions{true});
  check_fprop(c, recipe(), rng, /*with_bias=*/true, Fp8GemmOptions{true});
}

TEST_P(CudaFp8Gemm, DgradFastAccumulation) {
  Rng rng;
  const ShapeCase c = make(rng);
  check_dgrad(c, recipe(), rng, DType::e4m3, Fp8GemmOptions{true});
  check_dgrad(c, recipe(), rng, DType::e5m2, Fp8GemmOptions{true});
}

TEST_P(CudaFp8Gemm, FpropE5m2Activations) {
  Rng rng;
  check_fprop_e5m2_x(make(rng), recipe(), rng);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(recipe_str(std::get<0>(info.param))) + "_" + std::get<1>(info.param);
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CudaFp8Gemm,
                         ::testing::Combine(::testing::Values(Fp8Recipe::blockwise,
                                                              Fp8Recipe::tensorwise,
                                                              Fp8Recipe::mxfp8),
                                            ::testing::ValuesIn(named_case_names())),
                         param_name);

// An empty reduction (K = 0) with a bias: y = bias on every counted row, for every recipe (the
// fused paths run no GEMM, so the bias takes the second pass).
TEST(CudaFp8GemmEdge, FpropBiasEmptyReduction) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise, Fp8Recipe::mxfp8}) {
    SCOPED_TRACE(recipe_str(r));
    check_fprop(fixed_case("k0", 32, 0, {5, 0, 7}, 3), r, rng, /*with_bias=*/true);
  }
}

// Several tiles along every dimension, long reductions (several 128-blocks of K, of N and of
// tokens, partial last blocks), every expert more than one M tile.
TEST(CudaFp8GemmLarge, AllPassesAllRecipes) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  // N: 3 full 128-blocks + a partial one; K: 8 full 128-blocks + a partial one.
  const ShapeCase c = fixed_case("large", 400, 1040, {300, 0, 517, 129, 1000}, 7);
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise, Fp8Recipe::mxfp8}) {
    SCOPED_TRACE(recipe_str(r));
    check_fprop(c, r, rng);
    check_dgrad(c, r, rng);
    check_wgrad(c, r, Layout::kStacked, rng);
  }
}

// A copy of a device float array placed `shift` floats into a fresh allocation whose other floats
// are NaN (a scale read from outside the array poisons the output), and its view.
struct ShiftedScales {
  DeviceTensor storage;
  TensorView view;
  ShiftedScales(const TensorView& src, int shift) : storage(DType::f32, {src.numel() + 4}) {
    view = src;
    view.data = static_cast<float*>(storage.view().data) + shift;
    if (cudaMemset(storage.view().data, 0xFF, static_cast<size_t>(storage.view().nbytes())) != cudaSuccess ||
        cudaMemcpy(view.data, src.data, static_cast<size_t>(src.nbytes()), cudaMemcpyDeviceToDevice) != cudaSuccess) {
      throw std::runtime_error("ShiftedScales: cudaMemset/cudaMemcpy failed");
    }
  }
};

// The blockwise kernels copy their scales 4 bytes at a time (CUTLASS's scale-loading warp): scale
// arrays at every 4-byte offset from a 16-byte boundary give the same outputs (fprop, dgrad, and
// wgrad into f32 and into bf16: each its own kernel), bit for bit, as the aligned run, itself
// checked against the exact GEMM of the dequantized operands (outputs NaN-poisoned before every
// run). fprop/dgrad run in 1x1 clusters in the first case and in 2x1 in the second (2121 rows per
// expert on average, past the 2048 of choose_fp8_rows_kernel), checked by the launch record. (Through
// TMA, whose boxes start only at 16-byte aligned elements, fprop/dgrad's token-major scales could
// not come: docs/decisions.md, "Blockwise fprop/dgrad: the scales".)
TEST(CudaFp8GemmLarge, BlockwiseScalesAtAnyFourByteOffset) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const std::pair<ShapeCase, int> cases[] = {
      {fixed_case("offsets", 400, 1040, {300, 0, 517, 129, 1000}, 7), 1},
      {fixed_case("offsets_2x1", 256, 384, {2500, 3075, 0, 2900}, 11), 2}};
  for (const auto& one : cases) {
    const ShapeCase& c = one.first;
    const int rows_cluster_m = one.second;
    SCOPED_TRACE(c.name);
    const Fp8Problem p(c, Fp8Recipe::blockwise, rng);
    DeviceGrouped x(p.x.q), dy(p.dy.q);
    DeviceWeights w(p.w.q);
    DeviceTensor counts(p.base.counts);
    HostTensor y_h(DType::bf16, {c.capacity, c.N}), dx_h(DType::bf16, {c.capacity, c.K});
    HostTensor dw_h(DType::f32, {c.E, c.N, c.K}), dw16_h(DType::bf16, {c.E, c.N, c.K});
    poison(y_h);
    poison(dx_h);
    poison(dw_h);
    poison(dw16_h);
    DeviceTensor y(y_h), dx(dx_h), dw(dw_h), dw16(dw16_h);
    auto run = [&](const Fp8Grouped& xq, const Fp8Grouped& dyq, const Fp8Weights& wq) {
      y.upload(y_h);
      dx.upload(dx_h);
      dw.upload(dw_h);
      dw16.upload(dw16_h);
      fp8_grouped_gemm_fprop(xq, wq, counts.view(), y.view());
      expect_launch("fprop", true, c.E, false, rows_cluster_m, 1);
      fp8_grouped_gemm_dgrad(dyq, wq, counts.view(), dx.view());
      expect_launch("dgrad", true, c.E, false, rows_cluster_m, 1);
      fp8_grouped_gemm_wgrad(dyq, xq, counts.view(), ExpertWeights::from_stacked(dw.view()));
      fp8_grouped_gemm_wgrad(dyq, xq, counts.view(), ExpertWeights::from_stacked(dw16.view()));
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      check_device_errors(nullptr);
      return std::vector<HostTensor>{y.download(), dx.download(), dw.download(), dw16.download()};
    };
    const std::vector<HostTensor> aligned = run(x.q, dy.q, w.q);
    const ExactResult fprop = exact_fprop(p.x_rows, p.w_data, c.counts);
    const ExactResult dgrad = exact_dgrad(p.dy_rows, p.w_t, c.counts);
    const ExactResult wgrad = exact_wgrad(p.dy_cols, p.x_cols, c.counts, nullptr, nullptr);
    const Fp8Accumulation acc = Fp8Accumulation::kPromoted;
    EXPECT_TRUE(within_rule(aligned[0].to_double(), fprop, DType::bf16, "fprop tight", acc));
    EXPECT_TRUE(within_rule(aligned[1].to_double(), dgrad, DType::bf16, "dgrad tight", acc));
    EXPECT_TRUE(within_rule(aligned[2].to_double(), wgrad, DType::f32, "wgrad tight", acc));
    EXPECT_TRUE(within_rule(aligned[3].to_double(), wgrad, DType::bf16, "wgrad bf16 tight", acc));
    for (int shift : {1, 2, 3, 4}) {
      SCOPED_TRACE("scales " + std::to_string(4 * shift) + " bytes past a 16-byte boundary");
      ShiftedScales xs(x.q.scale_inv, shift), xt(x.q.scale_inv_t, shift), ys(dy.q.scale_inv, shift),
          yt(dy.q.scale_inv_t, shift), ws(w.q.scale_inv, shift), wt(w.q.scale_inv_t, shift);
      Fp8Grouped xq = x.q, dyq = dy.q;
      Fp8Weights wq = w.q;
      xq.scale_inv = xs.view;
      xq.scale_inv_t = xt.view;
      dyq.scale_inv = ys.view;
      dyq.scale_inv_t = yt.view;
      wq.scale_inv = ws.view;
      wq.scale_inv_t = wt.view;
      const std::vector<HostTensor> shifted = run(xq, dyq, wq);
      EXPECT_TRUE(bitwise_equal(shifted[0], aligned[0], "fprop"));
      EXPECT_TRUE(bitwise_equal(shifted[1], aligned[1], "dgrad"));
      EXPECT_TRUE(bitwise_equal(shifted[2], aligned[2], "wgrad"));
      EXPECT_TRUE(bitwise_equal(shifted[3], aligned[3], "wgrad bf16"));
    }
  }
}

// Experts past 4096 rows: with the defaults, fprop/dgrad split them into groups of 4096 rows (row
// chunks) and, at >= 4096 average rows per expert, run in 2x1 clusters, where a group of an odd
// number of M tiles (here 4100 = 4096 + 4 rows: a last group of one tile) pairs a real tile with
// an all-out-of-range one. The weight gradient (N = 256: two M tiles) runs in 2x1 clusters too.
TEST(CudaFp8GemmLarge, BigExpertsChunkedInClusters) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  // 13300 / 3 >= 4096 rows per expert on average.
  const ShapeCase c = fixed_case("big_experts", 256, 384, {9000, 0, 4100}, 200);
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise}) {
    SCOPED_TRACE(recipe_str(r));
    check_fprop(c, r, rng);
    expect_launch("fprop", true, c.E, true, 2, 1);
    check_dgrad(c, r, rng);
    expect_launch("dgrad", true, c.E, true, 2, 1);
    check_wgrad(c, r, Layout::kStacked, rng);
    // The last launch wrote bf16 dW: tensorwise in 2x1 (the rows kernel), blockwise 1x1 only.
    expect_launch("wgrad", true, c.E, false, r == Fp8Recipe::tensorwise ? 2 : 1, 1);
  }
}

// The cluster rule of fprop/dgrad (fp8_gemm_heuristics.cu, choose_fp8_rows_kernel): the promoted kernels
// (blockwise, tensorwise) take 2x1 clusters from 2048 rows per expert on average, whatever the
// output's width; fast accumulation's 128x256 tiles from 4096 rows, and 1x1 where the output is
// wider than 2048 columns. Checked by the launch record, each result against the exact one.
void check_rows_clusters(const ShapeCase& fprop_case, const ShapeCase& dgrad_case, int promoted_m, int fast_m) {
  Rng rng;
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise}) {
    SCOPED_TRACE(recipe_str(r));
    check_fprop(fprop_case, r, rng);
    expect_launch("fprop", true, fprop_case.E, true, promoted_m, 1);
    bool bias_list = false;
    check_fprop(fprop_case, r, rng, true, {}, &bias_list);
    expect_launch("fprop with a bias", true, fprop_case.E, !bias_list, promoted_m, 1);
    check_dgrad(dgrad_case, r, rng);
    expect_launch("dgrad", true, dgrad_case.E, true, promoted_m, 1);
  }
  SCOPED_TRACE("tensorwise, fast accumulation");
  const Fp8GemmOptions fast{true};
  const bool forced = current_tuning().fp8_rows_cluster_forced() != ClusterShape::automatic;
  check_fprop(fprop_case, Fp8Recipe::tensorwise, rng, false, fast);
  expect_launch("fprop", true, fprop_case.E, true, fast_m, 1);
  if (!forced) EXPECT_EQ(cuda_backend::last_launch_record().tile_n, 256) << "fprop";
  check_dgrad(dgrad_case, Fp8Recipe::tensorwise, rng, DType::e4m3, fast);
  expect_launch("dgrad", true, dgrad_case.E, true, fast_m, 1);
  if (!forced) EXPECT_EQ(cuda_backend::last_launch_record().tile_n, 256) << "dgrad";
}

// Experts of 2500 and 3075 rows (20 and 25 M tiles, the last partial; 25 odd, so one pair holds an
// all-out-of-range tile), no expert past the 4096-row chunk: promoted 2x1, fast 1x1.
TEST(CudaFp8GemmLarge, MidSizeExpertsClusters) {
  GMOE_SKIP_WITHOUT_GPU();
  const ShapeCase c = fixed_case("mid_experts", 256, 384, {2500, 3075}, 11);
  check_rows_clusters(c, c, 2, 1);
}

// One expert of 4100 rows (33 M tiles, the last of 4 rows; row chunks), an output 2176 wide (17 N
// tiles, the last partial), a reduction of 144 (one partial k-tile): promoted 2x1, fast 1x1 (wide).
TEST(CudaFp8GemmLarge, WideOutputsClusters) {
  GMOE_SKIP_WITHOUT_GPU();
  check_rows_clusters(fixed_case("wide_n", 2176, 144, {4100}, 60), fixed_case("wide_k", 144, 2176, {4100}, 60), 2, 1);
}

// Fast accumulation runs tensorwise fprop/dgrad in 128x256 tiles (fp8_grouped_gemm.cu,
// choose_rows_tile): N = 400 for fprop (one full 256-column tile and a partial one) and 1040 for
// dgrad (four and 16 columns), experts of 0, 129, 517 and 1000 rows; then experts of 4100 and more
// rows (row chunks with a last group of one M tile, 2x1 clusters), N = 384, K = 1168. An e5m2 dy has
// no 128x256 kernel and blockwise never takes one: both stay 128x128 (and promoted).
TEST(CudaFp8GemmLarge, FastAccumulationTiles) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ShapeCase small = fixed_case("fast_small", 400, 1040, {0, 129, 517, 1000}, 5);
  const ShapeCase big = fixed_case("fast_big", 384, 1168, {9000, 0, 4100}, 200);
  // Forced 2x2 clusters (gpu_check's forced runs) keep 128x128 tiles.
  const bool clusters_forced = current_tuning().fp8_rows_cluster_forced() != ClusterShape::automatic;
  const int wide = current_tuning().fp8_rows_cluster_forced() == ClusterShape::c2x2 ? 128 : 256;
  const Fp8GemmOptions fast{true};
  auto tile_n = [] { return cuda_backend::last_launch_record().tile_n; };
  check_fprop(small, Fp8Recipe::tensorwise, rng, false, fast);
  EXPECT_EQ(tile_n(), wide) << "fprop";
  check_dgrad(small, Fp8Recipe::tensorwise, rng, DType::e4m3, fast);
  EXPECT_EQ(tile_n(), wide) << "dgrad";
  check_dgrad(small, Fp8Recipe::tensorwise, rng, DType::e5m2, fast);
  EXPECT_EQ(tile_n(), 128) << "dgrad, e5m2 dy";
  check_fprop(big, Fp8Recipe::tensorwise, rng, false, fast);
  EXPECT_EQ(tile_n(), wide) << "fprop, big experts";
  if (!clusters_forced) EXPECT_EQ(cuda_backend::last_launch_record().cluster_m, 2) << "fprop, big experts";
  check_dgrad(big, Fp8Recipe::tensorwise, rng, DType::e4m3, fast);
  EXPECT_EQ(tile_n(), wide) << "dgrad, big experts";
  check_fprop(small, Fp8Recipe::blockwise, rng, false, fast);
  EXPECT_EQ(tile_n(), 128) << "blockwise fprop";
  check_fprop(small, Fp8Recipe::tensorwise, rng);
  EXPECT_EQ(tile_n(), 128) << "tensorwise fprop without fast accumulation";
  // A fused bias runs the promoted 128x128 kernels, in 2x1 clusters for big experts.
  bool bias_list = false;
  check_fprop(big, Fp8Recipe::tensorwise, rng, true, fast, &bias_list);
  EXPECT_EQ(tile_n(), 128) << "fprop with a bias, fast accumulation asked";
  expect_launch("fprop with a bias, fast accumulation asked", true, big.E, !bias_list, 2, 1);
}

// Reductions of 16384 or more run fprop/dgrad in 2x2 clusters by default (fp8_grouped_gemm.cu,
// choose_rows_tile): fprop with K = 16384, dgrad with N = 16384, odd tile counts along M and N.
TEST(CudaFp8GemmLarge, LongReductionsIn2x2Clusters) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise}) {
    SCOPED_TRACE(recipe_str(r));
    const ShapeCase long_k = fixed_case("long_k", 384, 16384, {300, 0, 517}, 9);
    check_fprop(long_k, r, rng);
    expect_launch("fprop", true, 3, false, 2, 2);
    // The fused-bias kernels have no 2x2 instantiation: the 2x1 rule, 1x1 for these small experts
    // and 2x1 for an expert of 4100 rows (row chunks unless the bias is a list).
    check_fprop(long_k, r, rng, true);
    expect_launch("fprop with a bias", true, 3, false, 1, 1);
    bool bias_list = false;
    check_fprop(fixed_case("long_k_big", 16, 16384, {4100}, 9), r, rng, true, {}, &bias_list);
    expect_launch("fprop with a bias, big expert", true, 1, !bias_list, 2, 1);
    check_dgrad(fixed_case("long_n", 16384, 384, {300, 0, 517}, 9), r, rng);
    expect_launch("dgrad", true, 3, false, 2, 2);
  }
}

// ---------------------------------------------------------------------------------------------
// Inputs the CUDA backend must refuse before launching anything.

class CudaFp8GemmErrors : public ::testing::Test {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
};

// Runs `op`, expects gmoe::Error whose message contains `needle`, and checks that `out` still
// holds its poison (nothing was launched that wrote it).
template <class Op>
void expect_refused(Op op, const std::string& needle, const DeviceTensor& out) {
  try {
    op();
    ADD_FAILURE() << "expected gmoe::Error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (double d : out.download().to_double()) {
    ASSERT_TRUE(std::isnan(d)) << "output written although the call was refused";
  }
}

TEST_F(CudaFp8GemmErrors, RefusedBeforeLaunch) {
  Rng rng;
  ShapeCase c;
  c.name = "errors";
  c.E = 3;
  c.N = 64;
  c.K = 96;
  c.counts = {10, 20, 5};
  c.capacity = 40;
  const Fp8Problem p(c, Fp8Recipe::blockwise, rng);
  DeviceGrouped x(p.x.q), dy(p.dy.q);
  DeviceWeights w(p.w.q);
  DeviceTensor counts(p.base.counts);
  HostTensor y_h(DType::bf16, {c.capacity, c.N});
  poison(y_h);
  DeviceTensor y(y_h);

  // f32 output: the CUDA kernels write bf16.
  HostTensor y32_h(DType::f32, {c.capacity, c.N});
  poison(y32_h);
  DeviceTensor y32(y32_h);
  expect_refused([&] { fp8_grouped_gemm_fprop(x.q, w.q, counts.view(), y32.view()); }, "y", y32);

  // e5m2 where the kernels take e4m3 only: the weights (fprop, dgrad) and x in wgrad.
  {
    const Fp8Problem p5(c, Fp8Recipe::blockwise, rng, DType::i32, DType::e5m2);
    DeviceGrouped x5(p5.x.q), dy5(p5.dy.q);
    DeviceWeights w5(p5.w.q);
    expect_refused([&] { fp8_grouped_gemm_fprop(x.q, w5.q, counts.view(), y.view()); }, "w.format", y);
    HostTensor dx_h(DType::bf16, {c.capacity, c.K});
    poison(dx_h);
    DeviceTensor dx(dx_h);
    expect_refused([&] { fp8_grouped_gemm_dgrad(dy.q, w5.q, counts.view(), dx.view()); }, "w.format", dx);
    HostTensor dw_h(DType::bf16, {c.E, c.N, c.K});
    poison(dw_h);
    DeviceTensor dw(dw_h);
    expect_refused([&] {
      fp8_grouped_gemm_wgrad(dy5.q, x5.q, counts.view(), ExpertWeights::from_stacked(dw.view()));
    }, "x.format", dw);
  }

  // Mixed recipes.
  {
    const Fp8Problem pt(c, Fp8Recipe::tensorwise, rng);
    DeviceWeights wt(pt.w.q);
    expect_refused([&] { fp8_grouped_gemm_fprop(x.q, wt.q, counts.view(), y.view()); }, "recipe",
                   y);
  }

  // A misaligned output row stride (N + 4 bf16 = 136 bytes).
  HostTensor wide_h(DType::bf16, {c.capacity, c.N + 4});
  poison(wide_h);
  DeviceTensor wide(wide_h);
  TensorView y_odd(wide.data(), DType::bf16, Device::cuda(0), {c.capacity, c.N}, {c.N + 4, 1});
  expect_refused([&] { fp8_grouped_gemm_fprop(x.q, w.q, counts.view(), y_odd); }, "y", wide);
}

// K or N not a multiple of 16: FP8 rows are not 16-byte multiples, which TMA cannot read.
TEST_F(CudaFp8GemmErrors, DimensionsNotMultipleOf16) {
  Rng rng;
  ShapeCase c;
  c.name = "odd";
  c.E = 2;
  c.N = 64;
  c.K = 72;  // 72 % 16 = 8
  c.counts = {5, 6};
  c.capacity = 12;
  const Fp8Problem p(c, Fp8Recipe::tensorwise, rng);
  DeviceGrouped x(p.x.q), dy(p.dy.q);
  DeviceWeights w(p.w.q);
  DeviceTensor counts(p.base.counts);
  HostTensor y_h(DType::bf16, {c.capacity, c.N}), dx_h(DType::bf16, {c.capacity, c.K});
  poison(y_h);
  poison(dx_h);
  DeviceTensor y(y_h), dx(dx_h);
  expect_refused([&] { fp8_grouped_gemm_fprop(x.q, w.q, counts.view(), y.view()); },
                 "multiple of 16", y);
  expect_refused([&] { fp8_grouped_gemm_dgrad(dy.q, w.q, counts.view(), dx.view()); },
                 "multiple of 16", dx);
  HostTensor dw_h(DType::f32, {c.E, c.N, c.K});
  poison(dw_h);
  DeviceTensor dw(dw_h);
  expect_refused([&] {
    fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), ExpertWeights::from_stacked(dw.view()));
  }, "multiple of 16", dw);
}

// ---------------------------------------------------------------------------------------------
// padded_offsets that do not match the counts (a corrupted columnwise copy): wgrad must clamp
// every expert's token range inside the operand (compute-sanitizer checks nothing is read out of
// bounds) and report it in the device error word.

TEST_F(CudaFp8GemmErrors, InconsistentPaddedOffsetsAreClampedAndReported) {
  Rng rng;
  ShapeCase c;
  c.name = "bad_offsets";
  c.E = 3;
  c.N = 128;
  c.K = 64;
  c.counts = {100, 40, 60};
  c.capacity = 200;
  for (Fp8Recipe r : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise}) {
    SCOPED_TRACE(recipe_str(r));
    const Fp8Problem p(c, r, rng);
    Fp8Grouped bad = p.dy.q;
    HostTensor offsets = copy_of(p.dy.q.padded_offsets);
    auto* po = static_cast<int64_t*>(offsets.data());
    po[1] = p.dy.q.padded_capacity - 64;  // expert 1 would run past the end and is misaligned
    po[2] = -128;                         // negative
    bad.padded_offsets = offsets.view();
    DeviceGrouped dy(bad), x(p.x.q);
    DeviceTensor counts(p.base.counts);
    HostTensor dw_h(DType::f32, {c.E, c.N, c.K});
    poison(dw_h);
    DeviceTensor dw(dw_h);
    fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), ExpertWeights::from_stacked(dw.view()));
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    expect_device_error({"padded_offsets"});
    // Expert 0's offsets are intact: its result is right.
    const ExactResult exact = exact_wgrad(p.dy_cols, p.x_cols, c.counts, nullptr, nullptr);
    const std::vector<double> got = dw.download().to_double();
    const int64_t per = c.N * c.K;
    const std::vector<double> got0(got.begin(), got.begin() + per);
    ExactResult e0;
    e0.value.assign(exact.value.begin(), exact.value.begin() + per);
    e0.abs_sum.assign(exact.abs_sum.begin(), exact.abs_sum.begin() + per);
    e0.f32.assign(exact.f32.begin(), exact.f32.begin() + per);
    e0.reduction = c.counts[0];
    EXPECT_TRUE(within_rule(got0, e0, DType::f32, "expert 0", Fp8Accumulation::kPromoted));
    for (double v : got) ASSERT_FALSE(std::isnan(v)) << "a dW element was not written";
  }
}

// ---------------------------------------------------------------------------------------------
// fprop + dgrad + wgrad captured once (global capture mode: any sync fails it), then replayed
// under several routings: new counts and new FP8 operands (quantized for those counts) written
// into the same device buffers. Each replay must equal an eager run bitwise and the exact result
// within the tight bound. Tensorwise runs twice: promoted, and with fast accumulation (fprop and
// dgrad in the 128x256 kernels, with the fast bound; wgrad promoted either way).

TEST(CudaFp8GemmGraph, CaptureOnceReplayUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t E = 8, N = 256, K = 384, cap = 8 * 200 + 5;
  const std::vector<std::vector<int64_t>> routings = graph_routings(E, 200, cap - E * 200, rng);

  const std::pair<Fp8Recipe, bool> configs[] = {{Fp8Recipe::blockwise, false},
                                                 {Fp8Recipe::tensorwise, false},
                                                 {Fp8Recipe::tensorwise, true},
                                                 {Fp8Recipe::mxfp8, false}};
  for (const auto& [recipe, fast] : configs) {
    SCOPED_TRACE(std::string(recipe_str(recipe)) + (fast ? ", fast accumulation" : ""));
    const Fp8GemmOptions options{fast};
    ShapeCase c = graph_case(E, N, K, 200, cap - E * 200);
    const Fp8Problem p0(c, recipe, rng);
    DeviceGrouped x(p0.x.q), dy(p0.dy.q);
    DeviceWeights w(p0.w.q);
    DeviceTensor counts(p0.base.counts);
    HostTensor y_h(DType::bf16, {cap, N}), dx_h(DType::bf16, {cap, K}), dw_h(DType::f32, {E, N, K});
    poison(y_h);
    poison(dx_h);
    poison(dw_h);
    DeviceTensor y(y_h), dx(dx_h), dw(dw_h);
    const ExpertWeights dw_view = ExpertWeights::from_stacked(dw.view());

    cudaStream_t stream = nullptr;
    GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto layer = [&] {
      fp8_grouped_gemm_fprop(x.q, w.q, ExpertBias(), counts.view(), y.view(), options, stream);
      fp8_grouped_gemm_dgrad(dy.q, w.q, counts.view(), dx.view(), options, stream);
      fp8_grouped_gemm_wgrad(dy.q, x.q, counts.view(), dw_view, {}, stream);
    };
    auto poison_outputs = [&] {
      y.upload(y_h);
      dx.upload(dx_h);
      dw.upload(dw_h);
    };
    layer();  // eager once first: module loading and attribute setting happen outside capture
    GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
    const CapturedGraph graph(stream, layer);
    const Fp8Accumulation acc = accumulation(recipe, options);

    for (const std::vector<int64_t>& routing : routings) {
      SCOPED_TRACE("routing " + ::testing::PrintToString(routing));
      c.counts = routing;
      const Fp8Problem p(c, recipe, rng);
      x.upload(p.x.q);
      dy.upload(p.dy.q);
      w.upload(p.w.q);
      counts.upload(p.base.counts);
      poison_outputs();
      graph.replay(stream);
      check_device_errors(stream);
      const HostTensor y_g = y.download(), dx_g = dx.download(), dw_g = dw.download();

      poison_outputs();
      layer();
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(bitwise_equal(y_g, y.download(), "fprop graph vs eager"));
      EXPECT_TRUE(bitwise_equal(dx_g, dx.download(), "dgrad graph vs eager"));
      EXPECT_TRUE(bitwise_equal(dw_g, dw.download(), "wgrad graph vs eager"));

      const ExactResult ey = exact_fprop(p.x_rows, p.w_data, routing);
      const ExactResult edx = exact_dgrad(p.dy_rows, p.w_t, routing);
      const ExactResult edw = exact_wgrad(p.dy_cols, p.x_cols, routing, nullptr, nullptr);
      EXPECT_TRUE(within_rule(values_of(y_g), ey, DType::bf16, "fprop replay", acc));
      EXPECT_TRUE(within_rule(values_of(dx_g), edx, DType::bf16, "dgrad replay", acc));
      EXPECT_TRUE(within_rule(values_of(dw_g), edw, DType::f32, "wgrad replay", Fp8Accumulation::kPromoted));
    }
    GMOE_TEST_CUDA(cudaStreamDestroy(stream));
  }
}

}  // namespace
}  // namespace gmoe::test
