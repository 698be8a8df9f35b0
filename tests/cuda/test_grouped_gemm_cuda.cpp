// tests/cuda/test_grouped_gemm_cuda.cpp — the sm_90a grouped GEMM against the fp64 exact result
// and the CPU reference (the tolerance rule of DESIGN.md), on every named shape case: three passes,
// bf16/f16, both weight layouts, i32/i64 counts, wgrad to the input dtype and to f32 with
// accumulate and an expert mask. Outputs are NaN-poisoned before each run so unwritten elements
// fail. Also: CUDA-specific bad inputs rejected before any launch, counts past the capacity, and
// one CUDA graph of fprop + dgrad + wgrad replayed under changing counts.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/error.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

using Param = std::tuple<DType, Layout, std::string, CaseScale>;

class CudaGroupedGemm : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
  DType dtype() const { return std::get<0>(GetParam()); }
  Layout layout() const { return std::get<1>(GetParam()); }
  ShapeCase make(Rng& rng) const {
    return make_case(std::get<2>(GetParam()), rng, std::get<3>(GetParam()));
  }
};

// The CPU backend is the reference "in the kernel's own precision" (f32 accumulation, output
// rounded to its dtype).
void check_fprop(const ShapeCase& c, DType dtype, Layout layout, Rng& rng) {
  const GemmProblem p(c, dtype, rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  HostTensor own(dtype, {c.capacity, c.N});
  grouped_gemm_fprop(p.x.view(), p.weights(layout), p.counts.view(), own.view());

  DeviceTensor x(p.x), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, layout);
  HostTensor y_host(dtype, {c.capacity, c.N});
  poison(y_host);
  DeviceTensor y(y_host);
  grouped_gemm_fprop(x.view(), w.view(), counts.view(), y.view());
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  check_device_errors(nullptr);
  EXPECT_TRUE(within_rule(y.download().to_double(), own.to_double(), exact_fprop(p.x, p.w, c.counts), dtype, "fprop"));
}

// fprop with a bias (grouped or list, dtype of x or f32) against the CPU reference, which adds it
// the same way (bf16 with a bf16 bias: before the one rounding, fused into the CUDA epilogue; other
// combinations: after the GEMM's rounding, in a second pass on CUDA): the rule as for plain fprop.
void check_fprop_bias(const ShapeCase& c, DType dtype, Layout layout, Rng& rng, bool bias_of_x_dtype = false) {
  const GemmProblem p(c, dtype, rng);
  const DType bias_dtype = !bias_of_x_dtype && rng.integer(0, 2) == 0 ? DType::f32 : dtype;
  HostTensor bias(bias_dtype, {c.E, c.N});
  fill_random(bias, rng);
  const bool as_list = rng.integer(0, 1) == 1;
  std::vector<HostTensor> rows_h;
  std::vector<DeviceTensor> rows_d;
  std::vector<TensorView> list_h, list_d;
  for (int64_t e = 0; e < c.E; ++e) {
    HostTensor v(bias_dtype, {c.N});
    for (int64_t n = 0; n < c.N; ++n) v.set(n, bias.get(e * c.N + n));
    rows_d.emplace_back(v);
    rows_h.push_back(std::move(v));
  }
  for (size_t e = 0; e < rows_h.size(); ++e) {
    list_h.push_back(rows_h[e].view());
    list_d.push_back(rows_d[e].view());
  }
  DeviceTensor bias_d(bias);
  HostTensor own(dtype, {c.capacity, c.N});
  grouped_gemm_fprop(p.x.view(), p.weights(layout),
                     as_list ? ExpertBias::from_list(list_h) : ExpertBias::from_grouped(bias.view()),
                     p.counts.view(), own.view());
  DeviceTensor x(p.x), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, layout);
  HostTensor y_host(dtype, {c.capacity, c.N});
  poison(y_host);
  DeviceTensor y(y_host);
  grouped_gemm_fprop(x.view(), w.view(),
                     as_list ? ExpertBias::from_list(list_d) : ExpertBias::from_grouped(bias_d.view()),
                     counts.view(), y.view());
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  check_device_errors(nullptr);
  const bool fused = dtype == DType::bf16 && bias_dtype == DType::bf16;
  ExactResult exact = exact_fprop(p.x, p.w, c.counts);
  add_bias(exact, bias, c.counts, dtype, fused);
  EXPECT_TRUE(within_rule(y.download().to_double(), own.to_double(), exact, dtype,
                          std::string("fprop + bias (") + (as_list ? "list " : "grouped ") +
                              dtype_name(bias_dtype) + (fused ? ", fused)" : ", second pass)")));
}

void check_dgrad(const ShapeCase& c, DType dtype, Layout layout, Rng& rng) {
  const GemmProblem p(c, dtype, rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  HostTensor own(dtype, {c.capacity, c.K});
  grouped_gemm_dgrad(p.dy.view(), p.weights(layout), p.counts.view(), own.view());

  DeviceTensor dy(p.dy), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, layout);
  HostTensor dx_host(dtype, {c.capacity, c.K});
  poison(dx_host);
  DeviceTensor dx(dx_host);
  grouped_gemm_dgrad(dy.view(), w.view(), counts.view(), dx.view());
  GMOE_TEST_CUDA(cudaDeviceSynchronize());
  check_device_errors(nullptr);
  EXPECT_TRUE(within_rule(dx.download().to_double(), own.to_double(), exact_dgrad(p.dy, p.w, c.counts), dtype, "dgrad"));
}

void check_wgrad(const ShapeCase& c, DType dtype, Layout layout, Rng& rng) {
  const GemmProblem p(c, dtype, rng, rng.integer(0, 1) ? DType::i32 : DType::i64);
  const ExactResult exact = exact_wgrad(p.dy, p.x, c.counts, nullptr, nullptr);
  DeviceTensor dy(p.dy), x(p.x), counts(p.counts);
  for (DType out_dtype : {dtype, DType::f32}) {
    HostExpertTensor own(layout, out_dtype, c.E, c.N, c.K);
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), p.counts.view(), own.view());
    HostExpertTensor dw_host(layout, out_dtype, c.E, c.N, c.K);
    dw_host.poison_all();
    DeviceExperts dw(dw_host);
    grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), dw.view());
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);
    const std::vector<double> got = dw.to_double();
    EXPECT_TRUE(within_rule(got, own.to_double(), exact, out_dtype, std::string("wgrad out ") + dtype_name(out_dtype)));
    for (int64_t e = 0; e < c.E; ++e) {
      if (c.counts[e] != 0) continue;
      for (int64_t i = 0; i < c.N * c.K; ++i) {
        ASSERT_EQ(got[e * c.N * c.K + i], 0.0) << "empty expert " << e << " not exactly zero";
      }
    }
  }
}

void check_wgrad_f32_accumulate_mask(const ShapeCase& c, DType dtype, Layout layout, Rng& rng) {
  const GemmProblem p(c, dtype, rng);
  std::vector<int32_t> mask(static_cast<size_t>(c.E));
  for (auto& m : mask) m = static_cast<int32_t>(rng.integer(0, 1));
  HostTensor mask_t(DType::i32, {c.E});
  for (int64_t e = 0; e < c.E; ++e) mask_t.set(e, mask[e]);
  DeviceTensor dy(p.dy), x(p.x), counts(p.counts), mask_d(mask_t);
  for (bool accumulate : {false, true}) {
    HostTensor init(DType::f32, {c.E, c.N, c.K});
    fill_random(init, rng, -4.0, 4.0);
    const std::vector<double> init_v = init.to_double();
    WgradOptions opt;
    opt.accumulate = accumulate;

    HostExpertTensor own(layout, DType::f32, c.E, c.N, c.K);
    own.set_all(init_v);
    opt.expert_mask = mask_t.view();
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), p.counts.view(), own.view(), opt);

    HostExpertTensor dw_host(layout, DType::f32, c.E, c.N, c.K);
    dw_host.set_all(init_v);
    DeviceExperts dw(dw_host);
    opt.expert_mask = mask_d.view();
    grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), dw.view(), opt);
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);

    ExactResult exact = exact_wgrad(p.dy, p.x, c.counts, accumulate ? &init_v : nullptr, &mask);
    const std::vector<double> got = dw.to_double();
    const int64_t per = c.N * c.K;
    for (int64_t e = 0; e < c.E; ++e) {
      // Masked experts, and empty experts when accumulating, are left untouched: bitwise init.
      const bool untouched = mask[e] == 0 || (accumulate && c.counts[e] == 0);
      for (int64_t i = 0; i < per; ++i) {
        if (mask[e] == 0) exact.value[e * per + i] = init_v[e * per + i];
        if (untouched) {
          ASSERT_EQ(got[e * per + i], init_v[e * per + i]) << "expert " << e << " was written";
        } else if (!accumulate && c.counts[e] == 0) {
          ASSERT_EQ(got[e * per + i], 0.0) << "empty expert " << e << " not exactly zero";
        }
      }
    }
    EXPECT_TRUE(within_rule(got, own.to_double(), exact, DType::f32,
                            accumulate ? "wgrad f32 accumulate+mask" : "wgrad f32 overwrite+mask"));
  }
  expect_overwrite_then_accumulate(layout, c.E, c.N, c.K, rng, [&](const ExpertWeights& out, bool accumulate) {
    WgradOptions opt;
    opt.accumulate = accumulate;
    grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), out, opt);
  });
}

// WgradOptions::masked_off = fresh on the device: the mask read by the preparation kernel sends
// mask-1 experts to main_grad (overwritten or accumulated) and mask-0 experts to the fresh buffer
// (in the other layout than main_grad's: a stacked fresh buffer is located by the kernel, a list's
// pointers are written before it), both in one launch; against the CPU backend and the exact
// result, every untouched element bitwise.
void check_wgrad_masked_off_fresh(const ShapeCase& c, DType dtype, Layout layout, Rng& rng) {
  const GemmProblem p(c, dtype, rng);
  const MaskedOffDestinations d(c.E, c.N, c.K, rng);
  DeviceTensor dy(p.dy), x(p.x), counts(p.counts), mask_d(d.mask_t);
  for (bool accumulate : {false, true}) {
    MaskedOffBuffers own(d, layout, c.E, c.N, c.K);  // the CPU backend's run
    DeviceExperts main_d(own.main), fresh_d(own.fresh);
    HostExpertTensor& main_h = own.main;
    HostExpertTensor& fresh_h = own.fresh;
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), p.counts.view(), main_h.view(),
                       masked_off_wgrad_options(accumulate, d.mask_t.view(), fresh_h.view()));  // the CPU backend
    grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), main_d.view(),
                       masked_off_wgrad_options(accumulate, mask_d.view(), fresh_d.view()));
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    check_device_errors(nullptr);
    const std::vector<double> own_main = main_h.to_double(), own_fresh = fresh_h.to_double();
    expect_masked_off_destinations(d, p.dy, p.x, c.counts, accumulate, main_d.to_double(), fresh_d.to_double(),
                                   &own_main, &own_fresh,
                                   accumulate ? "wgrad accumulate, masked off fresh" : "wgrad, masked off fresh");
  }
}

TEST_P(CudaGroupedGemm, Fprop) {
  Rng rng;
  check_fprop(make(rng), dtype(), layout(), rng);
}

TEST_P(CudaGroupedGemm, FpropWithBias) {
  Rng rng;
  check_fprop_bias(make(rng), dtype(), layout(), rng);
}

TEST_P(CudaGroupedGemm, Dgrad) {
  Rng rng;
  check_dgrad(make(rng), dtype(), layout(), rng);
}

TEST_P(CudaGroupedGemm, Wgrad) {
  Rng rng;
  check_wgrad(make(rng), dtype(), layout(), rng);
}

TEST_P(CudaGroupedGemm, WgradMaskedOffFresh) {
  Rng rng;
  check_wgrad_masked_off_fresh(make(rng), dtype(), layout(), rng);
}

TEST_P(CudaGroupedGemm, WgradF32AccumulateWithMask) {
  Rng rng;
  check_wgrad_f32_accumulate_mask(make(rng), dtype(), layout(), rng);
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(dtype_name(std::get<0>(info.param))) + "_" +
         layout_name(std::get<1>(info.param)) + "_" + std::get<2>(info.param) +
         (std::get<3>(info.param) == CaseScale::kLarge ? "_large" : "");
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CudaGroupedGemm,
                         ::testing::Combine(::testing::Values(DType::bf16, DType::f16),
                                            ::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::ValuesIn(named_case_names()),
                                            ::testing::Values(CaseScale::kSmall)),
                         param_name);

// Sizes with several tiles along every dimension, where the cooperative tile is chosen.
INSTANTIATE_TEST_SUITE_P(LargeCases, CudaGroupedGemm,
                         ::testing::Combine(::testing::Values(DType::bf16),
                                            ::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values("uniform", "skewed", "ragged",
                                                              "one_expert", "e128"),
                                            ::testing::Values(CaseScale::kLarge)),
                         param_name);

// An empty reduction (K = 0): y = bias on every counted row, also where the bias would be fused
// (bf16 with a bf16 bias), whose GEMM does not run.
TEST(CudaGroupedGemmEdge, FpropWithBiasEmptyReduction) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  for (DType dtype : {DType::bf16, DType::f16}) {
    for (Layout layout : {Layout::kStacked, Layout::kList}) {
      SCOPED_TRACE(std::string(dtype_name(dtype)) + (layout == Layout::kList ? ", list" : ", stacked"));
      check_fprop_bias(fixed_case("k0", 32, 0, {5, 0, 7}, 3), dtype, layout, rng, /*bias_of_x_dtype=*/true);
    }
  }
}

// The second-pass bias add (grouped_bias_add) bitwise against the CPU's: 16-bit y with a bias of
// its dtype or f32, grouped or a list, N a multiple of 8 (16-byte path) or not (element path), a
// padded row stride, empty experts and rows past the total (left as they were).
TEST(CudaGroupedBiasAdd, BitwiseTheCpuOnEveryPath) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const std::vector<int64_t> counts_v = {5, 0, 130, 1, 0, 64};
  const int64_t total = 200, cap = 203;
  HostTensor counts(DType::i32, {int64_t(counts_v.size())});
  for (size_t e = 0; e < counts_v.size(); ++e) counts.set(int64_t(e), double(counts_v[e]));
  const int64_t E = int64_t(counts_v.size());
  ASSERT_EQ(std::accumulate(counts_v.begin(), counts_v.end(), int64_t{0}), total);
  for (DType dt : {DType::bf16, DType::f16}) {
    for (DType bdt : {dt, DType::f32}) {
      for (int64_t N : {int64_t{256}, int64_t{40}, int64_t{37}}) {
        for (int64_t ld : {N, N + 8}) {
          for (bool as_list : {false, true}) {
            SCOPED_TRACE(std::string(dtype_name(dt)) + " y, " + dtype_name(bdt) + " bias, N " + std::to_string(N) +
                         ", ld " + std::to_string(ld) + (as_list ? ", list" : ", grouped"));
            HostTensor y(dt, {cap, ld}), bias(bdt, {E, N});
            fill_random(y, rng);
            fill_random(bias, rng);
            HostTensor want = y;
            const TensorView yv_h(want.data(), dt, Device::cpu(), {cap, N}, {ld, 1});
            std::vector<DeviceTensor> rows_d;
            std::vector<TensorView> list_h, list_d;
            for (int64_t e = 0; e < E; ++e) {
              list_h.emplace_back(static_cast<char*>(bias.data()) + e * N * int64_t(dtype_size(bdt)), bdt,
                                  Device::cpu(), std::initializer_list<int64_t>{N});
              HostTensor row(bdt, {N});
              std::memcpy(row.data(), list_h.back().data, size_t(N) * dtype_size(bdt));
              rows_d.emplace_back(row);
            }
            for (const DeviceTensor& r : rows_d) list_d.push_back(r.view());
            grouped_bias_add(yv_h, as_list ? ExpertBias::from_list(list_h) : ExpertBias::from_grouped(bias.view()),
                             counts.view());
            DeviceTensor yd(y), bd(bias), cd(counts);
            const TensorView yv_d(yd.data(), dt, Device::cuda(0), {cap, N}, {ld, 1});
            grouped_bias_add(yv_d, as_list ? ExpertBias::from_list(list_d) : ExpertBias::from_grouped(bd.view()),
                             cd.view());
            GMOE_TEST_CUDA(cudaDeviceSynchronize());
            EXPECT_TRUE(bitwise_equal(yd.download(), want, "y + bias"));
          }
        }
      }
    }
  }
}

// Shapes for which the host heuristics pick the other tiles (named cases are too small for them):
// with >= 128 rows per expert and >= one tile per SM (132 on H100), fprop/dgrad take the
// cooperative 128x256 tile; with >= 1024 rows per expert, f32 wgrad takes the cooperative tile.
TEST(CudaGroupedGemmTiles, CooperativeRowsTile) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  ShapeCase c;
  c.name = "coop_rows";
  c.E = 32;
  c.N = 1024;
  c.K = 128;
  c.counts = zipf_counts(c.E, c.E * 160, 0.6, 8, rng);
  c.capacity = c.total() + 3;
  check_fprop(c, DType::bf16, Layout::kStacked, rng);
  check_fprop_bias(c, DType::bf16, Layout::kStacked, rng, true);  // the fused cooperative kernel
  c.N = 128;  // dgrad's GEMM N is K: swap so that it also has 4 tiles along N
  c.K = 1024;
  check_dgrad(c, DType::f16, Layout::kList, rng);
}

TEST(CudaGroupedGemmTiles, CooperativeWgradLongReduction) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ShapeCase c = fixed_case("coop_wgrad", 384, 192, {1100, 0, 2000}, 5);
  check_wgrad(c, DType::bf16, Layout::kList, rng);
  check_wgrad_f32_accumulate_mask(c, DType::f16, Layout::kStacked, rng);
}

// With the defaults: experts past 4096 rows split into groups of 4096 rows in fprop/dgrad (row
// chunks; 4100 rows leave a last group of 4), and weight gradients in 2x1 clusters, by the even
// tile rule (N = 256: two M tiles) and past 16 tiles (N = 2176: 17, the last cluster pairing a
// real tile with an all-out-of-range one).
TEST(CudaGroupedGemmTiles, BigExpertsChunkedAndClusteredWgrad) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ShapeCase big = fixed_case("big_experts", 256, 384, {9000, 0, 4100}, 200);
  check_fprop(big, DType::bf16, Layout::kStacked, rng);
  expect_launch("fprop", false, big.E, true, 1, 1);
  check_dgrad(big, DType::bf16, Layout::kStacked, rng);
  expect_launch("dgrad", false, big.E, true, 1, 1);
  check_wgrad(big, DType::bf16, Layout::kStacked, rng);
  expect_launch("wgrad", false, big.E, false, 2, 1);
  const ShapeCase odd = fixed_case("wgrad_17_tiles", 2176, 64, {1100, 0, 2000}, 5);
  check_wgrad(odd, DType::bf16, Layout::kStacked, rng);
  expect_launch("wgrad, 17 tiles", false, odd.E, false, 2, 1);
  check_wgrad_f32_accumulate_mask(odd, DType::bf16, Layout::kStacked, rng);
  expect_launch("wgrad accumulating, 17 tiles", false, odd.E, false, 2, 1);
}

// With the defaults: bf16 fprop/dgrad whose operand rows are off the 128-byte lines (x or dy rows
// of 360 elements, 720 bytes; dgrad's weights 2800-byte rows) run the cooperative tile in clusters
// when the average expert has at least 256 rows (rows_tile_rule: 700 here; the experts are 5, 0,
// 12 and 6 tiles tall, so one pairs a real tile with an all-out-of-range one) and the tiles cover
// every SM (4 x 6 x 6 = 144): 2x1, and 2x2 in dgrad when dy and the weights are both off the
// lines. With every operand row on the lines (384 and 1408 elements) they stay 1x1.
TEST(CudaGroupedGemmTiles, RowsOffTheLinesTakeClusters) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const std::vector<int64_t> counts = {600, 0, 1500, 700};
  enum class Pass { fprop, fprop_bias, dgrad };
  struct Case {
    const char* what;
    Pass pass;
    int64_t n, k;  // fixed_case's N and K
    Layout layout;
    int cluster_m, cluster_n;
  };
  const Case cases[] = {
      {"fprop, 720-byte rows", Pass::fprop, 1400, 360, Layout::kStacked, 2, 1},
      {"fprop with the fused bias, 720-byte rows", Pass::fprop_bias, 1400, 360, Layout::kList, 2, 1},
      {"dgrad, 720-byte dy rows and 2800-byte weight rows", Pass::dgrad, 360, 1400, Layout::kList, 2, 2},
      {"dgrad, 768-byte dy rows and 2800-byte weight rows", Pass::dgrad, 384, 1400, Layout::kStacked, 2, 1},
      {"fprop, 768-byte rows", Pass::fprop, 1400, 384, Layout::kList, 1, 1},
      {"dgrad, 768-byte rows", Pass::dgrad, 384, 1408, Layout::kStacked, 1, 1}};
  for (const Case& t : cases) {
    SCOPED_TRACE(t.what);
    const ShapeCase c = fixed_case(t.what, t.n, t.k, counts, 20);
    switch (t.pass) {
      case Pass::fprop: check_fprop(c, DType::bf16, t.layout, rng); break;
      case Pass::fprop_bias: check_fprop_bias(c, DType::bf16, t.layout, rng, true); break;
      case Pass::dgrad: check_dgrad(c, DType::bf16, t.layout, rng); break;
    }
    expect_launch(t.what, false, c.E, false, t.cluster_m, t.cluster_n);
  }
}

// ---------------------------------------------------------------------------------------------
// Inputs the CUDA backend must refuse before launching anything.

class CudaGroupedGemmErrors : public ::testing::Test {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
};

// Runs `op`, expects gmoe::Error whose message names `name`, and checks that `y` still holds its
// poison (nothing was launched that wrote it).
template <class Op>
void expect_refused(Op op, const std::string& name, const DeviceTensor& y) {
  try {
    op();
    ADD_FAILURE() << "expected gmoe::Error naming " << name;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<double> v = y.download().to_double();
  for (double d : v) ASSERT_TRUE(std::isnan(d)) << "output written although the call was refused";
}

TEST_F(CudaGroupedGemmErrors, RefusedBeforeLaunch) {
  Rng rng;
  const int64_t E = 4, N = 64, K = 96, cap = 64;
  HostTensor x_h(DType::bf16, {cap + 1, K + 8}), w_h(DType::bf16, {E, N, K});
  fill_random(x_h, rng);
  fill_random(w_h, rng);
  HostTensor counts_h = make_counts({16, 16, 16, 16});
  HostTensor y_h(DType::bf16, {cap, N});
  poison(y_h);
  DeviceTensor x(x_h), w(w_h), counts(counts_h), y(y_h);
  const ExpertWeights ws = ExpertWeights::from_stacked(w.view());

  // A valid x view for reference: [cap, K] with row stride K + 8 (= 208 bytes, fine).
  TensorView xv(x.data(), DType::bf16, Device::cuda(0), {cap, K}, {K + 8, 1});
  // Misaligned data pointer (2 bytes off).
  TensorView x_mis = xv;
  x_mis.data = static_cast<char*>(x.data()) + 2;
  expect_refused([&] { grouped_gemm_fprop(x_mis, ws, counts.view(), y.view()); }, "x", y);
  // Row stride of K + 1 elements = 194 bytes: not a multiple of 16.
  TensorView x_stride(x.data(), DType::bf16, Device::cuda(0), {cap, K}, {K + 1, 1});
  expect_refused([&] { grouped_gemm_fprop(x_stride, ws, counts.view(), y.view()); }, "x", y);
  // f32 output of fprop: not implemented on CUDA.
  HostTensor y32_h(DType::f32, {cap, N});
  poison(y32_h);
  DeviceTensor y32(y32_h);
  expect_refused([&] { grouped_gemm_fprop(xv, ws, counts.view(), y32.view()); }, "y", y32);
  // f32 inputs: the kernels take bf16/f16 only.
  HostTensor x32_h(DType::f32, {cap, K}), w32_h(DType::f32, {E, N, K});
  fill_random(x32_h, rng);
  fill_random(w32_h, rng);
  DeviceTensor x32(x32_h), w32(w32_h);
  expect_refused([&] {
    grouped_gemm_fprop(x32.view(), ExpertWeights::from_stacked(w32.view()), counts.view(),
                       y32.view());
  }, "x", y32);
  // Misaligned weights in a list.
  std::vector<TensorView> list;
  for (int64_t e = 0; e < E; ++e) list.push_back(w.view().select0(e));
  list[2].data = static_cast<char*>(list[2].data) + 4;
  expect_refused([&] {
    grouped_gemm_fprop(xv, ExpertWeights::from_list(list), counts.view(), y.view());
  }, "w", y);
  // Expert stride of the stacked weights not a multiple of 16 bytes.
  TensorView w_odd(w.data(), DType::bf16, Device::cuda(0), {E - 1, N, K}, {N * K + 1, K, 1});
  HostTensor counts3_h = make_counts({16, 16, 16});
  DeviceTensor counts3(counts3_h);
  expect_refused([&] {
    grouped_gemm_fprop(xv, ExpertWeights::from_stacked(w_odd), counts3.view(), y.view());
  }, "w", y);
}

// ---------------------------------------------------------------------------------------------
// Counts the device must clamp: negative counts and counts summing past the capacity. Nothing may
// be written out of bounds (compute-sanitizer runs this suite), the error bits must be reported,
// and the result must be that of the clamped counts.

TEST_F(CudaGroupedGemmErrors, CountsPastCapacityAreClamped) {
  Rng rng;
  for (DType counts_dtype : {DType::i32, DType::i64}) {
    const int64_t E = 6, N = 128, K = 192, cap = 300;
    const std::vector<int64_t> raw = {100, -5, 150, 90, 40, 7};  // sums to 382 > 300
    const std::vector<int64_t> clamped = {100, 0, 150, 50, 0, 0};
    ShapeCase c;
    c.name = "past_capacity";
    c.E = E;
    c.N = N;
    c.K = K;
    c.capacity = cap;
    c.counts = raw;
    GemmProblem p(c, DType::bf16, rng, counts_dtype);
    DeviceTensor x(p.x), dy(p.dy), counts(p.counts);
    DeviceExperts w(p.w_stacked, p.w, Layout::kStacked);

    HostTensor y_h(DType::bf16, {cap, N});
    poison(y_h);
    DeviceTensor y(y_h);
    grouped_gemm_fprop(x.view(), w.view(), counts.view(), y.view());
    expect_device_error({"negative", "capacity"});
    check_device_errors(nullptr);  // cleared by the read above

    const HostTensor clamped_counts = make_counts(clamped);
    HostTensor own(DType::bf16, {cap, N});
    grouped_gemm_fprop(p.x.view(), p.weights(Layout::kStacked), clamped_counts.view(), own.view());
    EXPECT_TRUE(within_rule(y.download().to_double(), own.to_double(), exact_fprop(p.x, p.w, clamped), DType::bf16,
                            "fprop clamped"));

    HostExpertTensor dw_h(Layout::kStacked, DType::f32, E, N, K);
    dw_h.poison_all();
    DeviceExperts dw(dw_h);
    grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), dw.view());
    EXPECT_THROW(check_device_errors(nullptr), Error);
    HostExpertTensor own_dw(Layout::kStacked, DType::f32, E, N, K);
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), clamped_counts.view(), own_dw.view());
    const ExactResult exact_dw = exact_wgrad(p.dy, p.x, clamped, nullptr, nullptr);
    EXPECT_TRUE(within_rule(dw.to_double(), own_dw.to_double(), exact_dw, DType::f32, "wgrad clamped"));
  }
}

// ---------------------------------------------------------------------------------------------
// One layer's fprop + dgrad + wgrad captured once (global capture mode: any sync fails it), then
// replayed under several routings written into the same device counts buffer. Each replay must be
// bitwise equal to an eager run and within the rule of the CPU reference.

TEST(CudaGroupedGemmGraph, CaptureOnceReplayUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t E = 8, N = 512, K = 384, cap = 8 * 256 + 5;
  const DType dt = DType::bf16;
  const std::vector<std::vector<int64_t>> routings = graph_routings(E, 256, cap - E * 256, rng);
  const GemmProblem p(graph_case(E, N, K, 256, cap - E * 256), dt, rng);
  DeviceTensor x(p.x), dy(p.dy), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, Layout::kStacked);
  HostTensor y_h(dt, {cap, N}), dx_h(dt, {cap, K}), dw_h(DType::f32, {E, N, K});
  poison(y_h);
  poison(dx_h);
  poison(dw_h);
  DeviceTensor y(y_h), dx(dx_h), dw(dw_h);
  const ExpertWeights dw_view = ExpertWeights::from_stacked(dw.view());

  cudaStream_t stream = nullptr;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto layer = [&] {
    grouped_gemm_fprop(x.view(), w.view(), counts.view(), y.view(), stream);
    grouped_gemm_dgrad(dy.view(), w.view(), counts.view(), dx.view(), stream);
    grouped_gemm_wgrad(dy.view(), x.view(), counts.view(), dw_view, {}, stream);
  };
  auto poison_outputs = [&] {
    y.upload(y_h);
    dx.upload(dx_h);
    dw.upload(dw_h);
  };

  layer();  // eager once first: module loading and attribute setting happen outside capture
  GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
  const CapturedGraph graph(stream, layer);

  for (const std::vector<int64_t>& routing : routings) {
    SCOPED_TRACE("routing " + ::testing::PrintToString(routing));
    const HostTensor counts_h = make_counts(routing);
    counts.upload(counts_h);
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

    HostTensor y_ref(dt, {cap, N}), dx_ref(dt, {cap, K});
    HostExpertTensor dw_ref(Layout::kStacked, DType::f32, E, N, K);
    grouped_gemm_fprop(p.x.view(), p.weights(Layout::kStacked), counts_h.view(), y_ref.view());
    grouped_gemm_dgrad(p.dy.view(), p.weights(Layout::kStacked), counts_h.view(), dx_ref.view());
    grouped_gemm_wgrad(p.dy.view(), p.x.view(), counts_h.view(), dw_ref.view());
    EXPECT_TRUE(within_rule(y_g.to_double(), y_ref.to_double(), exact_fprop(p.x, p.w, routing), dt, "fprop replay"));
    EXPECT_TRUE(within_rule(dx_g.to_double(), dx_ref.to_double(), exact_dgrad(p.dy, p.w, routing), dt, "dgrad replay"));
    EXPECT_TRUE(within_rule(dw_g.to_double(), dw_ref.to_double(), exact_wgrad(p.dy, p.x, routing, nullptr, nullptr),
                            DType::f32, "wgrad replay"));
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gmoe::test
