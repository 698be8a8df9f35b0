// tests/cuda/test_activation_cuda.cpp — the CUDA grouped activations against the CPU backend by the
// tolerance rule (error against the exact fp64 oracle at most 2× the CPU's, plus the atol of
// common/tolerance.h's table): every activation and gate/up layout (16-byte and
// element paths), bf16/f16/f32, with and without probs, dprobs, z recomputed in backward bitwise
// equal to the forward's, dh over h bitwise equal to a separate dh, padded row strides; rows past
// the real total zero over NaN inputs, more rows than resident warps, zero total, zero capacity;
// clamped SwiGLU at and beyond its limit and with NaN (the CPU's pattern of zeros and NaNs); and
// convert_fc1_glu on the device bitwise equal to the CPU's.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/activation_oracle.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/activation.h"
#include "gmoe/grouped_mlp.h"

namespace gmoe::test {
namespace {

// 320 columns: every test block divides it; 16-byte chunks take one full round of 32 lanes and a
// short one (bf16: 40 chunks; f32: 80, two full rounds and a short one).
constexpr int64_t kF = 320;

HostTensor download(const DeviceTensor& d) { return d.download(); }

struct Split {
  std::string name;
  std::vector<int64_t> counts;
  int64_t capacity = 0;
  int64_t total() const {
    int64_t t = 0;
    for (int64_t c : counts) t += c;
    return t;
  }
};
std::vector<Split> splits(Rng& rng) {
  // 9000 rows: more than a full-occupancy grid of warps holds on an H100 (132 SMs × 64 warps), so
  // the grid-stride loop runs more than once per warp.
  return {{"skewed_with_empty_experts", zipf_counts(16, 9000, 1.1, 4, rng), 9000 + rng.integer(1, 40)},
          {"ragged", {1, 7, 9, 15, 17, 31, 127, 129}, 343},
          {"zero_total", {0, 0, 0, 0}, 17},
          {"zero_capacity", {0, 0}, 0},
          {"e256", zipf_counts(256, 1500, 1.1, 4, rng), 1505}};  // amax_out's search over 256 offsets
}

using Param = std::tuple<int, DType>;
class CudaActivation : public ::testing::TestWithParam<Param> {
 protected:
  const ActivationOptions& options() const { return activation_test_variants()[std::get<0>(GetParam())]; }
  DType dtype() const { return std::get<1>(GetParam()); }
};

TEST_P(CudaActivation, MatchesTheCpuByTheRule) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const ActivationOptions& o = options();
  const DType dt = dtype();
  const int64_t cols = activation_input_cols(o.kind, kF);
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Split& s : splits(rng)) {
    for (bool with_probs : {false, true}) {
      SCOPED_TRACE(s.name + (with_probs ? " with probs" : " without probs"));
      const int64_t cap = s.capacity, total = s.total();
      const HostTensor counts = make_counts(s.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
      const HostTensor h = random_activation_input(o, dt, cap, total, kF, rng);
      HostTensor dz(dt, {cap, kF}), probs(DType::f32, {cap}), z0(dt, {cap, kF}), dh0(dt, {cap, cols}),
          dp0(DType::f32, {cap});
      fill_random(dz, rng);
      fill_random(probs, rng, 0.0, 1.0);
      poison(z0);
      poison(dh0);
      poison(dp0);
      const std::vector<double> p = probs.to_double();
      const ExactActivation ex = exact_activation(h, &dz, with_probs ? &p : nullptr, total, o, kF);

      // CPU: the reference in the kernels' own precision.
      HostTensor cz = z0, cdh = dh0, cdp = dp0;
      const TensorView cpv = with_probs ? probs.view() : TensorView();
      grouped_activation_forward(h.view(), counts.view(), cz.view(), o, cpv);
      grouped_activation_backward(h.view(), dz.view(), counts.view(), cdh.view(), o, cpv, cdp.view());

      DeviceTensor dh_in(h), ddz(dz), dprobs_in(probs), dcounts(counts), z(z0), dh(dh0), dp(dp0), z_out(z0);
      const TensorView pv = with_probs ? dprobs_in.view() : TensorView();
      grouped_activation_forward(dh_in.view(), dcounts.view(), z.view(), o, pv, stream);
      grouped_activation_backward(dh_in.view(), ddz.view(), dcounts.view(), dh.view(), o, pv, dp.view(),
                                  z_out.view(), stream);
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      check_device_errors(stream);
      const HostTensor gz = download(z), gdh = download(dh), gdp = download(dp), gzo = download(z_out);
      EXPECT_TRUE(within_rule(gz.to_double(), cz.to_double(), ex.z, dt, "z"));
      EXPECT_TRUE(within_rule(gdh.to_double(), cdh.to_double(), ex.dh, dt, "dh"));
      EXPECT_TRUE(within_rule(gdp.to_double(), cdp.to_double(), ex.dprobs, DType::f32, "dprobs"));
      EXPECT_TRUE(bitwise_equal(gzo, gz, "z recomputed in backward vs forward's z"));

      // amax_out (poisoned first: the op zeroes it): each expert's largest finite |output|, from the
      // kernels' own pass; the outputs unchanged.
      const int64_t E = static_cast<int64_t>(s.counts.size());
      HostTensor amax0(DType::f32, {E});
      poison(amax0);
      DeviceTensor za(amax0), dha(amax0), z3(z0), dh3(dh0);
      grouped_activation_forward(dh_in.view(), dcounts.view(), z3.view(), o, pv, stream, nullptr, za.view());
      grouped_activation_backward(dh_in.view(), ddz.view(), dcounts.view(), dh3.view(), o, pv, {}, {}, stream, nullptr,
                                  dha.view());
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(bitwise_equal(download(z3), gz, "z with amax_out"));
      EXPECT_TRUE(bitwise_equal(download(dh3), gdh, "dh with amax_out"));
      EXPECT_TRUE(amax_matches(download(za), gz, s.counts, "z's amax_out"));
      EXPECT_TRUE(amax_matches(download(dha), gdh, s.counts, "dh's amax_out"));
      for (int64_t r = total; r < cap; ++r) {
        ASSERT_EQ(gdp.get(r), 0.0) << "dprobs row " << r << " past the total";
        for (int64_t c = 0; c < kF; ++c) ASSERT_EQ(gz.get(r * kF + c), 0.0) << "z row " << r;
        for (int64_t c = 0; c < cols; ++c) ASSERT_EQ(gdh.get(r * cols + c), 0.0) << "dh row " << r;
      }

      // dh over h: the same dh and dprobs.
      DeviceTensor hd(h), dp2(dp0);
      grouped_activation_backward(hd.view(), ddz.view(), dcounts.view(), hd.view(), o, pv, dp2.view(), {}, stream);
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(bitwise_equal(download(hd), gdh, "dh written over h"));
      EXPECT_TRUE(bitwise_equal(download(dp2), gdp, "dprobs (in place)"));

      // Row strides padded by one element: the element path, the same z and dh (dprobs sums its
      // columns in another grouping there, so it is held to the rule).
      if (cap > 0) {
        HostTensor hp(dt, {cap, cols + 1}), dzp(dt, {cap, kF + 1}), pz(dt, {cap, kF + 1}), pdh(dt, {cap, cols + 1});
        poison(pz);
        poison(pdh);
        for (int64_t r = 0; r < cap; ++r) {
          for (int64_t c = 0; c < cols; ++c) hp.set(r * (cols + 1) + c, h.get(r * cols + c));
          for (int64_t c = 0; c < kF; ++c) dzp.set(r * (kF + 1) + c, dz.get(r * kF + c));
        }
        DeviceTensor dhp(hp), ddzp(dzp), dpz(pz), dpdh(pdh), dp3(dp0), za2(amax0), dha2(amax0);
        auto strided = [](const DeviceTensor& t, DType d, int64_t rows, int64_t c) {
          return TensorView(t.data(), d, Device::cuda(0), {rows, c}, {c + 1, 1});
        };
        grouped_activation_forward(strided(dhp, dt, cap, cols), dcounts.view(), strided(dpz, dt, cap, kF), o, pv,
                                   stream, nullptr, za2.view());
        grouped_activation_backward(strided(dhp, dt, cap, cols), strided(ddzp, dt, cap, kF), dcounts.view(),
                                    strided(dpdh, dt, cap, cols), o, pv, dp3.view(), {}, stream, nullptr, dha2.view());
        GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
        EXPECT_TRUE(amax_matches(download(za2), gz, s.counts, "z's amax_out (element path)"));
        EXPECT_TRUE(amax_matches(download(dha2), gdh, s.counts, "dh's amax_out (element path)"));
        GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
        const HostTensor spz = download(dpz), spdh = download(dpdh);
        HostTensor pz_packed(dt, {cap, kF}), pdh_packed(dt, {cap, cols});
        for (int64_t r = 0; r < cap; ++r) {
          for (int64_t c = 0; c < kF; ++c) pz_packed.set(r * kF + c, spz.get(r * (kF + 1) + c));
          for (int64_t c = 0; c < cols; ++c) pdh_packed.set(r * cols + c, spdh.get(r * (cols + 1) + c));
        }
        EXPECT_TRUE(bitwise_equal(pz_packed, gz, "z (padded rows, element path)"));
        EXPECT_TRUE(bitwise_equal(pdh_packed, gdh, "dh (padded rows, element path)"));
        EXPECT_TRUE(within_rule(download(dp3).to_double(), cdp.to_double(), ex.dprobs, DType::f32, "dprobs"));
      }
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Variants, CudaActivation,
                         ::testing::Combine(::testing::Range(0, int(activation_test_variants().size())),
                                            ::testing::Values(DType::bf16, DType::f16, DType::f32)),
                         [](const ::testing::TestParamInfo<Param>& info) {
                           return activation_case_name(activation_test_variants()[std::get<0>(info.param)]) + "_" +
                                  dtype_name(std::get<1>(info.param));
                         });

// Clamped SwiGLU at, beyond and around the limit and with NaN: the CPU's zeros and NaNs exactly,
// the values by the rule.
TEST(CudaActivationClamp, ValuesAtAndBeyondTheLimitAndNaN) {
  GMOE_SKIP_WITHOUT_GPU();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  ActivationOptions o;
  o.kind = ActivationKind::clamped_swiglu;
  const double L = o.limit;
  const double pts[][2] = {{L, 0.5},     {L + 0.5, 0.5}, {-3 * L, 0.5},    {0.75, L},    {0.75, -L},
                           {0.75, L + 1}, {0.75, -L - 2}, {L + 1, -L - 1}, {nan, 0.5},   {0.75, nan},
                           {L + 0.5, nan}, {-L, -L},      {1e30, 2.0},      {-0.0, 0.0}, {2.0, -1.0}};
  const int64_t n = int64_t(std::size(pts));
  for (DType dt : {DType::bf16, DType::f32}) {
    SCOPED_TRACE(dtype_name(dt));
    HostTensor h(dt, {n, 2}), dz(dt, {n, 1}), z0(dt, {n, 1}), dh0(dt, {n, 2}), dp0(DType::f32, {n});
    for (int64_t i = 0; i < n; ++i) {
      h.set(2 * i, pts[i][0]);
      h.set(2 * i + 1, pts[i][1]);
      dz.set(i, 0.75);
    }
    poison(z0);
    poison(dh0);
    poison(dp0);
    const HostTensor counts = make_counts({n});
    HostTensor cz = z0, cdh = dh0, cdp = dp0;
    grouped_activation_forward(h.view(), counts.view(), cz.view(), o);
    grouped_activation_backward(h.view(), dz.view(), counts.view(), cdh.view(), o, {}, cdp.view());
    DeviceTensor dh_in(h), ddz(dz), dcounts(counts), z(z0), dh(dh0), dp(dp0);
    grouped_activation_forward(dh_in.view(), dcounts.view(), z.view(), o);
    grouped_activation_backward(dh_in.view(), ddz.view(), dcounts.view(), dh.view(), o, {}, dp.view());
    GMOE_TEST_CUDA(cudaDeviceSynchronize());
    const std::vector<std::pair<std::vector<double>, std::vector<double>>> outs = {
        {download(z).to_double(), cz.to_double()},
        {download(dh).to_double(), cdh.to_double()},
        {download(dp).to_double(), cdp.to_double()}};
    const ExactActivation ex = exact_activation(h, &dz, nullptr, n, o, 1);
    const ExactResult* exact[] = {&ex.z, &ex.dh, &ex.dprobs};
    const DType out[] = {dt, dt, DType::f32};
    const char* names[] = {"z", "dh", "dprobs"};
    for (size_t k = 0; k < outs.size(); ++k) {
      const auto& [got, cpu] = outs[k];
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(std::isnan(got[i]), std::isnan(cpu[i])) << names[k] << "[" << i << "]: NaN pattern";
        EXPECT_EQ(got[i] == 0.0, cpu[i] == 0.0) << names[k] << "[" << i << "]: zero pattern (" << got[i] << " vs "
                                                << cpu[i] << ")";
      }
      std::vector<double> g = got, c = cpu;
      ExactResult e = *exact[k];
      for (size_t i = 0; i < g.size(); ++i) {
        if (std::isnan(e.value[i])) g[i] = c[i] = e.value[i] = 0;  // NaN positions checked above
      }
      EXPECT_TRUE(within_rule(g, c, e, out[k], names[k]));
    }
  }
}

// ---------------------------------------------------------------------------------------------

// FC1 weights and biases re-ordered on the device: bitwise what the CPU's convert_glu gives, for
// both weight layouts, bias forms, 16-byte rows (H = 64) and odd rows (H = 23), blocks 1, 16, F.
TEST(CudaConvertFc1Glu, MatchesTheCpuBitwise) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t E = 5, F = 48;
  for (int64_t H : {int64_t{64}, int64_t{23}}) {
    for (int64_t block : {int64_t{1}, int64_t{16}, F}) {
      for (Layout layout : {Layout::kStacked, Layout::kList}) {
        SCOPED_TRACE("H " + std::to_string(H) + ", block " + std::to_string(block) + ", " + layout_name(layout));
        HostTensor src(DType::bf16, {E, 2 * F, H}), cpu(DType::bf16, {E, 2 * F, H}), back(DType::bf16, {E, 2 * F, H});
        fill_random(src, rng);
        poison(cpu);
        poison(back);
        std::vector<HostTensor> src_l, out_l;
        for (int64_t e = 0; e < E; ++e) {
          HostTensor m(DType::bf16, {2 * F, H});
          for (int64_t i = 0; i < 2 * F * H; ++i) m.set(i, src.get(e * 2 * F * H + i));
          src_l.push_back(std::move(m));
          out_l.emplace_back(DType::bf16, std::vector<int64_t>{2 * F, H});
          poison(out_l.back());
        }
        // Device outputs start poisoned (uploaded before the CPU conversion fills `cpu`).
        DeviceExperts d_src(src, src_l, layout), d_dst(cpu, out_l, layout), d_back(back, out_l, layout);
        fc1_to_interleaved(ExpertWeights::from_stacked(src.view()), ExpertWeights::from_stacked(cpu.view()), block);
        fc1_to_interleaved(d_src.view(), d_dst.view(), block);
        fc1_to_concatenated(d_dst.view(), d_back.view(), block);
        GMOE_TEST_CUDA(cudaDeviceSynchronize());
        EXPECT_EQ(d_dst.to_double(), cpu.to_double()) << "device conversion differs from the CPU's";
        EXPECT_EQ(d_back.to_double(), src.to_double()) << "round trip on the device";

        HostTensor b(DType::f32, {E, 2 * F}), bcpu(DType::f32, {E, 2 * F});
        fill_random(b, rng);
        poison(bcpu);
        DeviceTensor db(b), ddst(bcpu);
        fc1_to_interleaved(ExpertBias::from_grouped(b.view()), ExpertBias::from_grouped(bcpu.view()), block);
        std::vector<DeviceTensor> lsrc, ldst;
        for (int64_t e = 0; e < E; ++e) {
          HostTensor v(DType::f32, {2 * F});
          for (int64_t i = 0; i < 2 * F; ++i) v.set(i, b.get(e * 2 * F + i));
          lsrc.emplace_back(v);
          poison(v);
          ldst.emplace_back(v);
        }
        auto list = [](const std::vector<DeviceTensor>& l) {
          std::vector<TensorView> v;
          for (const DeviceTensor& t : l) v.push_back(t.view());
          return ExpertBias::from_list(std::move(v));
        };
        if (layout == Layout::kStacked) {
          fc1_to_interleaved(ExpertBias::from_grouped(db.view()), ExpertBias::from_grouped(ddst.view()), block);
          GMOE_TEST_CUDA(cudaDeviceSynchronize());
          EXPECT_TRUE(bitwise_equal(ddst.download(), bcpu, "grouped bias"));
        } else {
          fc1_to_interleaved(list(lsrc), list(ldst), block);
          GMOE_TEST_CUDA(cudaDeviceSynchronize());
          for (int64_t e = 0; e < E; ++e) {
            const HostTensor got = ldst[e].download();
            for (int64_t i = 0; i < 2 * F; ++i) ASSERT_EQ(got.get(i), bcpu.get(e * 2 * F + i)) << "bias list " << e;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace gmoe::test
