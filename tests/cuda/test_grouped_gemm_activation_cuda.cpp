// tests/cuda/test_grouped_gemm_activation_cuda.cpp — grouped_gemm_fprop_activation on the device:
// h and z bitwise equal to grouped_gemm_fprop followed by grouped_activation_forward, its contract
// (on CUDA the op runs the GEMM, then the activation kernel), for SwiGLU and clamped SwiGLU, gate/up
// interleaved in blocks of 8, 16 and 32 or concatenated, without and with a bias (bf16 grouped or a
// list: in the GEMM's epilogue; f32: a second pass), with and without router probabilities, on the
// named cases at GPU scale. Outputs are NaN-poisoned first, so unwritten elements (rows past the
// total included) fail. Also: the op captured in global mode (no host sync) launches the same
// kernels as the composition, and replays of one capture under changing counts are bitwise the
// composition's replays. The composition itself is tested against the CPU reference in the GEMM
// and activation suites.
// And grouped_gemm_dgrad_activation_backward: dh bitwise equal to grouped_gemm_dgrad into dz then
// grouped_activation_backward(h, dz, counts, dh), with dh over h or apart from it (h's rows past
// the total hold NaN, so a dh row left unwritten fails); captured and replayed alike; and an odd F
// over a strided h, whose scratch dz the op pads to 16-byte rows.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/activation_oracle.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/activation.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

// SwiGLU and clamped SwiGLU (a limit that unit-sized h exceeds), in one gate/up layout.
std::vector<ActivationOptions> variants_for(const GluFormat& glu) {
  std::vector<ActivationOptions> v;
  for (ActivationKind kind : {ActivationKind::swiglu, ActivationKind::clamped_swiglu}) {
    ActivationOptions o;
    o.kind = kind;
    o.limit = 0.75f;
    o.glu = glu;
    v.push_back(o);
  }
  return v;
}

const std::vector<GluFormat>& layouts() {
  static const std::vector<GluFormat> kLayouts = {{GluLayout::interleaved, 8},
                                                  {GluLayout::interleaved, 16},
                                                  {GluLayout::interleaved, 32},
                                                  {GluLayout::concatenated, 1}};
  return kLayouts;
}

enum class BiasMode { kNone, kGroupedBf16, kListBf16, kGroupedF32 };
const char* bias_name(BiasMode m) {
  switch (m) {
    case BiasMode::kNone: return "no bias";
    case BiasMode::kGroupedBf16: return "grouped bf16 bias";
    case BiasMode::kListBf16: return "list bf16 bias";
    case BiasMode::kGroupedF32: return "grouped f32 bias";
  }
  return "?";
}

// One problem on the device: x, weights in a layout, counts, a bias in each form, probs. N = 2F
// with F a multiple of 32 (every layout's block divides it) near the case's N / 2.
struct Problem {
  ShapeCase c;
  int64_t F = 0;
  GemmProblem p;
  DeviceTensor x, counts, probs, bias_bf16, bias_f32;
  DeviceExperts w;
  std::vector<DeviceTensor> bias_rows;
  std::vector<TensorView> bias_list;

  static ShapeCase widened(ShapeCase c) {
    const int64_t F = std::max<int64_t>(32, (c.N / 2 + 31) / 32 * 32);
    c.N = 2 * F;
    return c;
  }
  Problem(const std::string& name, Layout layout, Rng& rng)
      : c(widened(make_case(name, rng, CaseScale::kLarge))),
        F(c.N / 2),
        p(c, DType::bf16, rng, rng.integer(0, 1) ? DType::i32 : DType::i64),
        x(p.x),
        counts(p.counts),
        w(p.w_stacked, p.w, layout) {
    HostTensor pr(DType::f32, {c.capacity});
    fill_random(pr, rng, 0.0, 1.0);
    probs = DeviceTensor(pr);
    HostTensor b16(DType::bf16, {c.E, c.N}), b32(DType::f32, {c.E, c.N});
    fill_random(b16, rng);
    fill_random(b32, rng);
    bias_bf16 = DeviceTensor(b16);
    bias_f32 = DeviceTensor(b32);
    for (int64_t e = 0; e < c.E; ++e) {
      HostTensor row(DType::bf16, {c.N});
      for (int64_t n = 0; n < c.N; ++n) row.set(n, b16.get(e * c.N + n));
      bias_rows.emplace_back(row);
    }
    for (const DeviceTensor& t : bias_rows) bias_list.push_back(t.view());
  }
  ExpertBias bias(BiasMode m) const {
    switch (m) {
      case BiasMode::kNone: return {};
      case BiasMode::kGroupedBf16: return ExpertBias::from_grouped(bias_bf16.view());
      case BiasMode::kListBf16: return ExpertBias::from_list(bias_list);
      case BiasMode::kGroupedF32: return ExpertBias::from_grouped(bias_f32.view());
    }
    return {};
  }
};

struct Outputs {
  HostTensor h, z;
};

// Poisoned outputs, then `run` on `stream`, then the outputs.
Outputs run_poisoned(const Problem& q, cudaStream_t stream,
                     const std::function<void(const TensorView&, const TensorView&)>& run) {
  HostTensor h0(DType::bf16, {q.c.capacity, q.c.N}), z0(DType::bf16, {q.c.capacity, q.F});
  poison(h0);
  poison(z0);
  DeviceTensor h(h0), z(z0);
  run(h.view(), z.view());
  test_cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  check_device_errors(stream);
  return {h.download(), z.download()};
}

using Param = std::tuple<int, std::string>;  // index into layouts(), named case

// A test over (gate/up layout, named case).
class ActivationOpTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
  const GluFormat& glu() const { return layouts()[std::get<0>(GetParam())]; }
  const std::string& case_name() const { return std::get<1>(GetParam()); }
};

using CudaGroupedGemmActivation = ActivationOpTest;

TEST_P(CudaGroupedGemmActivation, BitwiseTheGemmThenTheActivation) {
  Rng rng;
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const ActivationOptions& act : variants_for(glu())) {
    for (BiasMode bias : {BiasMode::kNone, BiasMode::kGroupedBf16, BiasMode::kListBf16, BiasMode::kGroupedF32}) {
      const bool with_probs = rng.integer(0, 1) == 1;
      const Layout layout = rng.integer(0, 1) ? Layout::kStacked : Layout::kList;
      SCOPED_TRACE(activation_case_name(act) + ", " + bias_name(bias) + (with_probs ? ", probs, " : ", no probs, ") +
                   layout_name(layout));
      const Problem q(case_name(), layout, rng);
      const TensorView probs = with_probs ? q.probs.view() : TensorView();
      const Outputs op = run_poisoned(q, stream, [&](const TensorView& h, const TensorView& z) {
        grouped_gemm_fprop_activation(q.x.view(), q.w.view(), q.bias(bias), q.counts.view(), h, z, act, probs, stream);
      });
      const Outputs composed = run_poisoned(q, stream, [&](const TensorView& h, const TensorView& z) {
        grouped_gemm_fprop(q.x.view(), q.w.view(), q.bias(bias), q.counts.view(), h, stream);
        grouped_activation_forward(h, q.counts.view(), z, act, probs, stream);
      });
      EXPECT_TRUE(bitwise_equal(op.h, composed.h, "h"));
      EXPECT_TRUE(bitwise_equal(op.z, composed.z, "z"));
      // Rows past the real total are zeros, written over the poison.
      for (int64_t r = q.c.total(); r < q.c.capacity; ++r) {
        ASSERT_EQ(op.z.get(r * q.F), 0.0) << "z row " << r << " past the total";
        ASSERT_EQ(op.h.get(r * q.c.N), 0.0) << "h row " << r << " past the total";
      }
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

const std::vector<std::string>& cases() {
  static const std::vector<std::string> kCases = {"uniform", "skewed", "one_expert", "all_empty", "zero_total",
                                                   "ragged", "dim192",  "dim1408",    "e256"};
  return kCases;
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  const GluFormat& g = layouts()[std::get<0>(info.param)];
  const std::string layout =
      g.layout == GluLayout::concatenated ? std::string("concat") : "inter" + std::to_string(g.block);
  return layout + "_" + std::get<1>(info.param);
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedGemmActivation,
                         ::testing::Combine(::testing::Range(0, int(layouts().size())), ::testing::ValuesIn(cases())),
                         param_name);

// Captured in global mode (any host sync fails the capture), the op launches the composition's
// kernels, for SwiGLU in every layout and clamped SwiGLU; replays of the one capture under
// changing counts (uniform, skewed with empty experts, all in one expert, all empty) are bitwise
// the composition's replays.
TEST(CudaGroupedGemmActivationGraph, CapturedLikeTheCompositionAndReplaysUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t E = 16, F = 96, K = 256, per = 80, slack = 24;
  ShapeCase c = graph_case(E, 2 * F, K, per, slack);
  const GemmProblem p(c, DType::bf16, rng);
  DeviceTensor x(p.x), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, Layout::kStacked);
  HostTensor pr(DType::f32, {c.capacity}), b16(DType::bf16, {E, 2 * F});
  fill_random(pr, rng, 0.0, 1.0);
  fill_random(b16, rng);
  DeviceTensor probs(pr), bias(b16);
  HostTensor h0(DType::bf16, {c.capacity, 2 * F}), z0(DType::bf16, {c.capacity, F});
  poison(h0);
  poison(z0);
  DeviceTensor h(h0), z(z0), h_ref(h0), z_ref(z0);
  std::vector<ActivationOptions> acts;
  for (const GluFormat& glu : layouts()) acts.push_back(variants_for(glu)[0]);  // SwiGLU in every layout
  acts.push_back(variants_for({GluLayout::interleaved, 16})[1]);             // clamped SwiGLU
  for (const ActivationOptions& act : acts) {
    const GluFormat& glu = act.glu;
    const ExpertBias b = ExpertBias::from_grouped(bias.view());
    const CapturedGraph op(stream, [&] {
      grouped_gemm_fprop_activation(x.view(), w.view(), b, counts.view(), h.view(), z.view(), act, probs.view(),
                                    stream);
    });
    const CapturedGraph composed(stream, [&] {
      grouped_gemm_fprop(x.view(), w.view(), b, counts.view(), h_ref.view(), stream);
      grouped_activation_forward(h_ref.view(), counts.view(), z_ref.view(), act, probs.view(), stream);
    });
    SCOPED_TRACE(glu.layout == GluLayout::concatenated ? "concatenated" : "interleaved " + std::to_string(glu.block));
    SCOPED_TRACE(activation_name(act.kind));
    EXPECT_EQ(op.kernel_nodes(), composed.kernel_nodes());
    for (const std::vector<int64_t>& routing : graph_routings(E, per, slack, rng)) {
      counts.upload(make_counts(routing));
      h.upload(h0);
      z.upload(z0);
      h_ref.upload(h0);
      z_ref.upload(z0);
      op.replay(stream);
      composed.replay(stream);
      check_device_errors(stream);
      EXPECT_TRUE(bitwise_equal(h.download(), h_ref.download(), "h replay"));
      EXPECT_TRUE(bitwise_equal(z.download(), z_ref.download(), "z replay"));
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

// ---------------------------------------------------------------------------------------------
// grouped_gemm_dgrad_activation_backward: FC2's dgrad with the activation's backward.

// One problem on the device: dy [capacity, H], FC2's weights [E, H, F] in a layout, counts, and h
// [capacity, 2F] with NaN in the rows past the total. F: a multiple of 32 (every layout's block
// divides it) near the case's K.
struct BackwardProblem {
  ShapeCase c;
  int64_t F = 0;
  GemmProblem p;
  DeviceTensor dy, counts;
  DeviceExperts w;
  HostTensor h;

  static ShapeCase widened(ShapeCase c) {
    c.K = std::max<int64_t>(32, (c.K + 31) / 32 * 32);
    return c;
  }
  BackwardProblem(const std::string& name, Layout layout, Rng& rng)
      : c(widened(make_case(name, rng, CaseScale::kLarge))),
        F(c.K),
        p(c, DType::bf16, rng, rng.integer(0, 1) ? DType::i32 : DType::i64),
        dy(p.dy),
        counts(p.counts),
        w(p.w_stacked, p.w, layout),
        h(DType::bf16, {c.capacity, 2 * c.K}) {
    fill_random(h, rng, -3.0, 3.0);
    for (int64_t i = c.total() * 2 * F; i < c.capacity * 2 * F; ++i) h.set(i, std::numeric_limits<double>::quiet_NaN());
  }
};

using CudaGroupedGemmActivationBackward = ActivationOpTest;

TEST_P(CudaGroupedGemmActivationBackward, BitwiseTheDgradThenTheActivationBackward) {
  Rng rng;
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const ActivationOptions& act : variants_for(glu())) {
    for (bool in_place : {true, false}) {
      const Layout layout = rng.integer(0, 1) ? Layout::kStacked : Layout::kList;
      SCOPED_TRACE(activation_case_name(act) + (in_place ? ", dh over h, " : ", dh apart, ") + layout_name(layout));
      const BackwardProblem q(case_name(), layout, rng);
      // The op: dh over h, or into a NaN-poisoned dh apart from it.
      DeviceTensor h(q.h);
      HostTensor dh0(DType::bf16, {q.c.capacity, 2 * q.F});
      poison(dh0);
      DeviceTensor dh_apart(dh0);
      const TensorView dh = in_place ? h.view() : dh_apart.view();
      grouped_gemm_dgrad_activation_backward(q.dy.view(), q.w.view(), q.counts.view(), h.view(), dh, act, stream);
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      check_device_errors(stream);
      const HostTensor got = in_place ? h.download() : dh_apart.download();
      // The composition: dgrad into dz, then the activation's backward.
      DeviceTensor h_ref(q.h), dh_ref(dh0);
      HostTensor dz0(DType::bf16, {q.c.capacity, q.F});
      poison(dz0);
      DeviceTensor dz(dz0);
      grouped_gemm_dgrad(q.dy.view(), q.w.view(), q.counts.view(), dz.view(), stream);
      grouped_activation_backward(h_ref.view(), dz.view(), q.counts.view(), dh_ref.view(), act, {}, {}, {}, stream);
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(bitwise_equal(got, dh_ref.download(), "dh"));
      if (!in_place) EXPECT_TRUE(bitwise_equal(h.download(), q.h, "h (left as it was)"));
      for (int64_t r = q.c.total(); r < q.c.capacity; ++r) {
        ASSERT_EQ(got.get(r * 2 * q.F), 0.0) << "dh row " << r << " past the total";
      }
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Cases, CudaGroupedGemmActivationBackward,
                         ::testing::Combine(::testing::Range(0, int(layouts().size())), ::testing::ValuesIn(cases())),
                         param_name);

// Captured in global mode (any host sync fails the capture; the op takes its dz scratch from the
// allocator on the stream), dh over h launches the composition's kernels, for SwiGLU in every
// layout and clamped SwiGLU; replays of the one capture under changing counts (uniform, skewed
// with empty experts, all in one expert, all empty) are bitwise the composition's replays.
TEST(CudaGroupedGemmActivationBackwardGraph, CapturedLikeTheCompositionAndReplaysUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t E = 16, F = 96, H = 256, per = 80, slack = 24;
  ShapeCase c = graph_case(E, H, F, per, slack);
  const GemmProblem p(c, DType::bf16, rng);
  DeviceTensor dy(p.dy), counts(p.counts);
  DeviceExperts w(p.w_stacked, p.w, Layout::kStacked);
  HostTensor h0(DType::bf16, {c.capacity, 2 * F});
  fill_random(h0, rng, -3.0, 3.0);
  HostTensor dz0(DType::bf16, {c.capacity, F});
  poison(dz0);
  DeviceTensor h(h0), h_ref(h0), dz(dz0);
  std::vector<ActivationOptions> acts;
  for (const GluFormat& glu : layouts()) acts.push_back(variants_for(glu)[0]);  // SwiGLU in every layout
  acts.push_back(variants_for({GluLayout::interleaved, 16})[1]);             // clamped SwiGLU
  for (const ActivationOptions& act : acts) {
    const CapturedGraph op(stream, [&] {
      grouped_gemm_dgrad_activation_backward(dy.view(), w.view(), counts.view(), h.view(), h.view(), act, stream);
    });
    const CapturedGraph composed(stream, [&] {
      grouped_gemm_dgrad(dy.view(), w.view(), counts.view(), dz.view(), stream);
      grouped_activation_backward(h_ref.view(), dz.view(), counts.view(), h_ref.view(), act, {}, {}, {}, stream);
    });
    SCOPED_TRACE(activation_case_name(act));
    EXPECT_EQ(op.kernel_nodes(), composed.kernel_nodes());
    for (const std::vector<int64_t>& routing : graph_routings(E, per, slack, rng)) {
      counts.upload(make_counts(routing));
      h.upload(h0);
      h_ref.upload(h0);
      op.replay(stream);
      composed.replay(stream);
      check_device_errors(stream);
      EXPECT_TRUE(bitwise_equal(h.download(), h_ref.download(), "dh replay"));
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

// An odd F with concatenated halves over a strided h (FC2's weights strided too, as the GEMM's TMA
// needs 16-byte rows): the op's scratch dz has F = 45 columns in rows padded to 16 bytes, and the
// result is bitwise the two ops in turn over a dz the test pads alike, h's padding columns untouched.
TEST(CudaGroupedGemmActivationBackwardGraph, OddFOverAStridedH) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  cudaStream_t stream;
  GMOE_TEST_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t E = 4, F = 45, H = 128, per = 70, slack = 10;
  const int64_t ld_w = 48, ld_h = 96;  // w's rows of F in 48 columns, h's 2F = 90 in 96
  ShapeCase c = graph_case(E, H, ld_w, per, slack);
  const GemmProblem p(c, DType::bf16, rng);  // dy [capacity, H], w [E, H, 48] (F of them used)
  DeviceTensor dy(p.dy), counts(p.counts), w_store(p.w_stacked);
  const TensorView wv(w_store.view().data, DType::bf16, Device::cuda(0), {E, H, F}, {H * ld_w, ld_w, 1});
  const ExpertWeights w = ExpertWeights::from_stacked(wv);
  HostTensor h0(DType::bf16, {c.capacity, ld_h});
  fill_random(h0, rng, -3.0, 3.0);
  HostTensor dz0(DType::bf16, {c.capacity, ld_w});
  poison(dz0);
  DeviceTensor h(h0), h_ref(h0), dz_store(dz0);
  const TensorView dz(dz_store.view().data, DType::bf16, Device::cuda(0), {c.capacity, F}, {ld_w, 1});
  const auto strided = [&](const DeviceTensor& t) {
    return TensorView(t.view().data, DType::bf16, Device::cuda(0), {c.capacity, 2 * F}, {ld_h, 1});
  };
  const ActivationOptions act = variants_for({GluLayout::concatenated, 1})[0];  // SwiGLU
  const CapturedGraph op(stream, [&] {
    grouped_gemm_dgrad_activation_backward(dy.view(), w, counts.view(), strided(h), strided(h), act, stream);
  });
  const CapturedGraph composed(stream, [&] {
    grouped_gemm_dgrad(dy.view(), w, counts.view(), dz, stream);
    grouped_activation_backward(strided(h_ref), dz, counts.view(), strided(h_ref), act, {}, {}, {}, stream);
  });
  EXPECT_EQ(op.kernel_nodes(), composed.kernel_nodes());
  op.replay(stream);
  composed.replay(stream);
  check_device_errors(stream);
  EXPECT_TRUE(bitwise_equal(h.download(), h_ref.download(), "dh (and h's padding columns, untouched)"));
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace gmoe::test
