// tests/layers/test_grouped_linear_parts.cpp — the parts of GroupedLinear's public API that layers
// built on it (GroupedMLP) use, on the CPU backend: forward_with_activation and
// backward_with_activation are BITWISE forward / backward followed by the activation's op;
// forward_fp8 and backward_fp8 on operands the caller quantized (allocate_fp8_operand, then
// quantize_grouped with input_quantization() / grad_quantization()) are BITWISE forward / backward
// of the same layer; a tensorwise dy_amax gives backward's bits; and each of them checks its
// arguments, naming the one at fault.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "common/expect_error.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/activation.h"
#include "gmoe/fp8.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::test {
namespace {

std::vector<double> values_of(const TensorView& v) {
  HostTensor h(v.dtype, {v.numel()});
  if (!h.bytes().empty()) {
    if (v.ndim == 2 && v.stride(0) != v.size(1)) {
      const size_t row = size_t(v.size(1)) * dtype_size(v.dtype);
      for (int64_t r = 0; r < v.size(0); ++r) {
        std::memcpy(static_cast<char*>(h.data()) + r * row,
                    static_cast<const char*>(v.data) + r * v.stride(0) * dtype_size(v.dtype), row);
      }
    } else {
      std::memcpy(h.data(), v.data, h.bytes().size());
    }
  }
  return h.to_double();
}
std::vector<double> values_of(const ExpertWeights& w) {
  std::vector<double> out;
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    const std::vector<double> v = values_of(w.expert(e));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}
std::vector<double> values_of(const ExpertBias& b) {
  std::vector<double> out;
  for (int64_t e = 0; b.defined() && e < b.num_experts(); ++e) {
    const std::vector<double> v = values_of(b.expert(e));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// A gated FC1-like problem: N = 2F output columns over K inputs, skewed counts with empty experts
// and rows past the total.
struct Fc1Problem {
  GemmProblem p;
  HostTensor bias, probs;
  int64_t F;
  explicit Fc1Problem(Rng& rng, const std::string& case_name = "skewed")
      : p(make_case(case_name, rng), DType::bf16, rng), bias(DType::bf16, {p.shape.E, p.shape.N}),
        probs(DType::f32, {p.shape.capacity}), F(p.shape.N / 2) {
    fill_random(bias, rng);
    fill_random(probs, rng, 0.0, 1.0);
  }
};

ActivationOptions interleaved_swiglu(int64_t F) {
  ActivationOptions a;
  a.kind = ActivationKind::swiglu;
  a.glu = F % 2 == 0 ? GluFormat{GluLayout::interleaved, 2} : GluFormat{GluLayout::concatenated, 1};
  return a;
}

TEST(CpuGroupedLinearParts, ForwardWithActivationIsForwardThenTheActivation) {
  Rng rng;
  for (const char* name : {"skewed", "ragged", "zero_total"}) {
    SCOPED_TRACE(name);
    const Fc1Problem f(rng, name);
    const int64_t cap = f.p.shape.capacity;
    const ActivationOptions act = interleaved_swiglu(f.F);
    GroupedLinear layer(f.p.weights(Layout::kList), expert_bias(f.bias.view(), Layout::kStacked));
    GroupedLinearContext a, b;
    Tensor y = layer.forward(f.p.x.view(), f.p.counts.view(), a);
    HostTensor z_ref(DType::bf16, {cap, f.F}), z(DType::bf16, {cap, f.F});
    poison(z_ref);
    poison(z);
    grouped_activation_forward(y.view(), f.p.counts.view(), z_ref.view(), act, f.probs.view());
    Tensor y2 = layer.forward_with_activation(f.p.x.view(), f.p.counts.view(), b, z.view(), act, f.probs.view());
    EXPECT_EQ(values_of(y.view()), values_of(y2.view())) << "y";
    EXPECT_EQ(z_ref.to_double(), z.to_double()) << "z";
    // Both contexts hold the same saved state: their backward passes agree too.
    HostTensor dy(DType::bf16, {cap, f.p.shape.N});
    fill_random(dy, rng);
    const GroupedLinearBackward ba = layer.backward(a, dy.view()), bb = layer.backward(b, dy.view());
    EXPECT_EQ(values_of(ba.grads.weight), values_of(bb.grads.weight)) << "dW";
  }
}

TEST(CpuGroupedLinearParts, BackwardWithActivationIsBackwardThenTheActivationsBackward) {
  Rng rng;
  const Fc1Problem f(rng);  // h: FC1's output, [capacity, 2F]; this layer (FC2) maps F -> H
  const int64_t cap = f.p.shape.capacity, F = f.F, H = f.p.shape.K;
  const ActivationOptions act = interleaved_swiglu(F);
  HostTensor h(DType::bf16, {cap, 2 * F}), z(DType::bf16, {cap, F}), dy(DType::bf16, {cap, H});
  fill_random(h, rng);
  fill_random(dy, rng);
  grouped_activation_forward(h.view(), f.p.counts.view(), z.view(), act);
  HostTensor w2(DType::bf16, {f.p.shape.E, H, F}), b2(DType::bf16, {f.p.shape.E, H});
  fill_random(w2, rng, -0.2, 0.2);
  fill_random(b2, rng);
  GroupedLinearOptions opt;
  opt.save_original_input = true;
  GroupedLinear fc2(ExpertWeights::from_stacked(w2.view()), ExpertBias::from_grouped(b2.view()), opt);

  GroupedLinearContext a, b;
  fc2.forward(z.view(), f.p.counts.view(), a);
  fc2.forward(z.view(), f.p.counts.view(), b);
  const GroupedLinearBackward ref = fc2.backward(a, dy.view());
  HostTensor dh_ref(DType::bf16, {cap, 2 * F});
  poison(dh_ref);
  grouped_activation_backward(h.view(), ref.dx.view(), f.p.counts.view(), dh_ref.view(), act);
  HostTensor dh = h;  // written over a copy of h, as GroupedMLP writes it over h
  const GroupedLinearBackward got = fc2.backward_with_activation(b, dy.view(), dh.view(), dh.view(), act);
  EXPECT_FALSE(got.dx.view().defined()) << "dx is not made";
  EXPECT_EQ(dh_ref.to_double(), dh.to_double()) << "dh";
  EXPECT_EQ(values_of(ref.grads.weight), values_of(got.grads.weight)) << "dW";
  EXPECT_EQ(values_of(ref.grads.bias), values_of(got.grads.bias)) << "db";
}

// The layer's own forward + backward against the same layer fed the operands quantized by hand.
TEST(CpuGroupedLinearParts, Fp8OperandsGiveForwardAndBackwardBitwise) {
  Rng rng;
  for (const LinearRecipe recipe : {LinearRecipe::fp8_blockwise, LinearRecipe::fp8_tensorwise, LinearRecipe::mxfp8}) {
    SCOPED_TRACE(linear_recipe_name(recipe));
    const GemmProblem p(make_case("skewed", rng), DType::bf16, rng);
    const int64_t cap = p.shape.capacity;
    GroupedLinearOptions opt;
    opt.recipe = recipe;
    GroupedLinear layer(p.weights(Layout::kStacked), {}, opt);
    GroupedLinearContext a, b;
    Tensor y_ref = layer.forward(p.x.view(), p.counts.view(), a);
    const GroupedLinearBackward ref = layer.backward(a, p.dy.view());

    const Fp8QuantizeOptions xo = layer.input_quantization();
    EXPECT_TRUE(xo.rowwise && xo.columnwise) << "fp8_wgrad keeps x's columnwise copy";
    GroupedLinearFp8Operand xq = layer.allocate_fp8_operand(cap, p.shape.K, xo);
    quantize_grouped(GroupedRows{p.x.view(), p.counts.view()}, xo, nullptr, nullptr, &xq.q);
    Tensor y = layer.forward_fp8(std::move(xq), p.counts.view(), b);
    EXPECT_EQ(values_of(y_ref.view()), values_of(y.view())) << "y";

    const Fp8QuantizeOptions go = layer.grad_quantization();
    GroupedLinearFp8Operand dyq = layer.allocate_fp8_operand(cap, p.shape.N, go);
    quantize_grouped(GroupedRows{p.dy.view(), p.counts.view()}, go, nullptr, nullptr, &dyq.q);
    const GroupedLinearBackward got = layer.backward_fp8(b, std::move(dyq));
    EXPECT_EQ(values_of(ref.dx.view()), values_of(got.dx.view())) << "dx";
    EXPECT_EQ(values_of(ref.grads.weight), values_of(got.grads.weight)) << "dW";
  }
}

// Tensorwise: backward with dy's amax given (as the activation's backward computes it) gives the
// bits of backward without it.
TEST(CpuGroupedLinearParts, TensorwiseDyAmaxGivesTheSameBits) {
  Rng rng;
  const GemmProblem p(make_case("skewed", rng), DType::bf16, rng);
  GroupedLinearOptions opt;
  opt.recipe = LinearRecipe::fp8_tensorwise;
  GroupedLinear layer(p.weights(Layout::kList), {}, opt);
  HostTensor amax(DType::f32, {p.shape.E});
  const std::vector<double> dy = p.dy.to_double();
  int64_t row = 0;
  for (int64_t e = 0; e < p.shape.E; ++e) {
    double m = 0;
    for (int64_t r = 0; r < p.shape.counts[e]; ++r, ++row)
      for (int64_t n = 0; n < p.shape.N; ++n) m = std::max(m, std::abs(dy[row * p.shape.N + n]));
    amax.set(e, m);
  }
  GroupedLinearContext a, b;
  layer.forward(p.x.view(), p.counts.view(), a);
  layer.forward(p.x.view(), p.counts.view(), b);
  const GroupedLinearBackward ref = layer.backward(a, p.dy.view());
  const GroupedLinearBackward got = layer.backward(b, p.dy.view(), nullptr, {}, amax.view());
  EXPECT_EQ(values_of(ref.dx.view()), values_of(got.dx.view())) << "dx";
  EXPECT_EQ(values_of(ref.grads.weight), values_of(got.grads.weight)) << "dW";
}

TEST(CpuGroupedLinearParts, BadArgumentsNameTheArgument) {
  Rng rng;
  const Fc1Problem f(rng, "uniform");
  const GemmProblem& p = f.p;
  const int64_t cap = p.shape.capacity;
  GroupedLinear native(p.weights(Layout::kStacked));
  GroupedLinearOptions fo;
  fo.recipe = LinearRecipe::fp8_blockwise;
  GroupedLinear fp8(p.weights(Layout::kStacked), {}, fo);
  GroupedLinearContext ctx;

  // The FP8 parts on a native layer.
  GMOE_EXPECT_ERROR(native.input_quantization(), "input_quantization", "native");
  GMOE_EXPECT_ERROR(native.grad_quantization(), "grad_quantization", "native");
  GMOE_EXPECT_ERROR(native.allocate_fp8_operand(cap, p.shape.K, fp8.input_quantization()), "allocate_fp8_operand");
  GMOE_EXPECT_ERROR(native.forward_fp8(fp8.allocate_fp8_operand(cap, p.shape.K, fp8.input_quantization()),
                                       p.counts.view(), ctx),
                    "forward_fp8", "native");
  EXPECT_FALSE(ctx.active()) << "a rejected call leaves the context as it was";

  // An operand of another recipe, of the wrong width, without its rowwise copy.
  Fp8QuantizeOptions other = fp8.input_quantization();
  other.recipe = Fp8Recipe::mxfp8;
  GMOE_EXPECT_ERROR(fp8.forward_fp8(fp8.allocate_fp8_operand(cap, p.shape.K, other), p.counts.view(), ctx), "x:",
                    "blockwise", "mxfp8");
  GMOE_EXPECT_ERROR(fp8.forward_fp8(fp8.allocate_fp8_operand(cap, p.shape.K + 16, fp8.input_quantization()),
                                    p.counts.view(), ctx),
                    "x:", "columns");
  Fp8QuantizeOptions cols_only = fp8.input_quantization();
  cols_only.rowwise = false;
  GMOE_EXPECT_ERROR(fp8.forward_fp8(fp8.allocate_fp8_operand(cap, p.shape.K, cols_only), p.counts.view(), ctx),
                    "x:", "rowwise");
  // Without the columnwise copy the layer must keep its input (save_original_input).
  Fp8QuantizeOptions rows_only = fp8.input_quantization();
  rows_only.columnwise = false;
  GMOE_EXPECT_ERROR(fp8.forward_fp8(fp8.allocate_fp8_operand(cap, p.shape.K, rows_only), p.counts.view(), ctx),
                    "x:", "save_original_input");
  EXPECT_FALSE(ctx.active());

  // backward_fp8 needs a forward, and dy's columnwise copy for the FP8 weight gradient.
  GMOE_EXPECT_ERROR(fp8.backward_fp8(ctx, fp8.allocate_fp8_operand(cap, p.shape.N, fp8.grad_quantization())), "ctx:");
  fp8.forward(p.x.view(), p.counts.view(), ctx);
  Fp8QuantizeOptions dy_rows = fp8.grad_quantization();
  dy_rows.columnwise = false;
  GMOE_EXPECT_ERROR(fp8.backward_fp8(ctx, fp8.allocate_fp8_operand(cap, p.shape.N, dy_rows)), "dy:", "columnwise");
  GMOE_EXPECT_ERROR(fp8.backward_fp8(ctx, fp8.allocate_fp8_operand(cap - 1, p.shape.N, fp8.grad_quantization())),
                    "dy:", "rows");
  GMOE_EXPECT_ERROR(fp8.backward(ctx, p.dy.view(), nullptr, {}, f.probs.view()), "dy_amax");
  GMOE_EXPECT_ERROR(fp8.backward_with_activation(ctx, p.dy.view(), p.dy.view(), p.dy.view(), ActivationOptions{}),
                    "backward_with_activation", "fp8_blockwise");

  // forward_with_activation: z's width must be the activation's output of N columns; probs f32 [capacity].
  GroupedLinearContext c2;
  const ActivationOptions act;
  HostTensor z_wide(DType::bf16, {cap, p.shape.N}), z(DType::bf16, {cap, p.shape.N / 2});
  GMOE_EXPECT_ERROR(native.forward_with_activation(p.x.view(), p.counts.view(), c2, z_wide.view(), act), "z:",
                    "swiglu");
  GMOE_EXPECT_ERROR(native.forward_with_activation(p.x.view(), p.counts.view(), c2, z.view(), act, p.counts.view()),
                    "probs");
  EXPECT_FALSE(c2.active());
}

}  // namespace
}  // namespace gmoe::test
