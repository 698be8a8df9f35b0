// tests/layers/test_grouped_linear.cpp — GroupedLinear on the CPU backend against a reference made
// of E independent dense linear layers sharing the weights (computed exactly, in fp64): forward,
// dx, dW, db on every named case, both weight layouts, every bias mode; fresh gradients (views of
// one allocation), main_grad accumulate/overwrite with an expert mask; delayed and immediate weight
// gradients bitwise equal; hooks fire once per backward; zero-token experts get exact zeros.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>

#include "common/expect_error.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "common/offload_fixture.h"
#include "gmoe/copy.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::test {
namespace {

enum class BiasMode { kNone, kList, kGrouped };
const char* bias_name(BiasMode b) { return b == BiasMode::kNone ? "nobias" : b == BiasMode::kList ? "biaslist" : "biasgrouped"; }

struct HostBias {
  HostTensor grouped;             // [E, N] values (also the source of the list)
  std::vector<HostTensor> list;
  BiasMode mode = BiasMode::kNone;
  HostBias(BiasMode m, DType dt, int64_t E, int64_t N, Rng& rng) : grouped(dt, {E, N}), mode(m) {
    fill_random(grouped, rng);
    for (int64_t e = 0; e < E; ++e) {
      HostTensor v(dt, {N});
      for (int64_t n = 0; n < N; ++n) v.set(n, grouped.get(e * N + n));
      list.push_back(std::move(v));
    }
  }
  ExpertBias view() const {
    if (mode == BiasMode::kNone) return ExpertBias::none();
    if (mode == BiasMode::kGrouped) return ExpertBias::from_grouped(grouped.view());
    std::vector<TensorView> v;
    for (const HostTensor& t : list) v.push_back(t.view());
    return ExpertBias::from_list(std::move(v));
  }
};

std::vector<double> expert_values(const ExpertWeights& w) {
  std::vector<double> out;
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    const TensorView v = w.expert(e);
    HostTensor h(v.dtype, {v.size(0), v.size(1)});
    std::memcpy(h.data(), v.data, h.bytes().size());
    const std::vector<double> d = h.to_double();
    out.insert(out.end(), d.begin(), d.end());
  }
  return out;
}
std::vector<double> bias_values(const ExpertBias& b) {
  std::vector<double> out;
  for (int64_t e = 0; e < b.num_experts(); ++e) {
    const TensorView v = b.expert(e);
    HostTensor h(v.dtype, {v.size(0)});
    std::memcpy(h.data(), v.data, h.bytes().size());
    const std::vector<double> d = h.to_double();
    out.insert(out.end(), d.begin(), d.end());
  }
  return out;
}
HostTensor to_host(const TensorView& v) {
  HostTensor h(v.dtype, {v.size(0), v.size(1)});
  if (!h.bytes().empty()) std::memcpy(h.data(), v.data, h.bytes().size());
  return h;
}

using Param = std::tuple<Layout, BiasMode, std::string>;
class CpuGroupedLinear : public ::testing::TestWithParam<Param> {
 protected:
  Layout layout() const { return std::get<0>(GetParam()); }
  BiasMode bias_mode() const { return std::get<1>(GetParam()); }
  const std::string& case_name() const { return std::get<2>(GetParam()); }
};

TEST_P(CpuGroupedLinear, ForwardBackwardDelayedBitwiseAndHooks) {
  Rng rng;
  const ShapeCase c = make_case(case_name(), rng);
  const DType dt = DType::bf16;
  const GemmProblem p(c, dt, rng);
  const HostBias hb(bias_mode(), dt, c.E, c.N, rng);
  struct Run {
    HostTensor y, dx;
    std::vector<double> dw, db;
    int hooks = 0;
  };
  auto run = [&](bool delayed) {
    Run r;
    GroupedLinearOptions opt;
    opt.delay_wgrad = delayed;
    opt.wgrad_hook = [&r](const GroupedLinearGrads& g, Stream) {
      ++r.hooks;
      EXPECT_EQ(g.weight.num_experts(), g.weight.is_stacked() ? g.weight.stacked.size(0) : int64_t(g.weight.list.size()));
    };
    GroupedLinear layer(p.weights(layout()), hb.view(), opt);
    GroupedLinearContext ctx;
    Tensor y = layer.forward(p.x.view(), p.counts.view(), ctx);
    EXPECT_TRUE(ctx.active());
    GroupedLinearBackward b = layer.backward(ctx, p.dy.view());
    GroupedLinearGrads g = delayed ? layer.backward_dw(ctx) : b.grads;
    if (delayed) {
      EXPECT_FALSE(b.grads.weight.is_stacked() || !b.grads.weight.list.empty()) << "delayed backward returned dW";
    }
    EXPECT_FALSE(ctx.active());
    EXPECT_EQ(g.weight.is_stacked(), layout() == Layout::kStacked) << "fresh dW must have the weight's layout";
    r.y = to_host(y.view());
    r.dx = to_host(b.dx.view());
    r.dw = expert_values(g.weight);
    if (bias_mode() != BiasMode::kNone) r.db = bias_values(delayed ? b.grads.bias : g.bias);
    return r;
  };
  const Run now = run(false), later = run(true);
  EXPECT_EQ(now.hooks, 1);
  EXPECT_EQ(later.hooks, 1);
  EXPECT_TRUE(bitwise_equal(now.y, later.y, "y"));
  EXPECT_TRUE(bitwise_equal(now.dx, later.dx, "dx"));
  EXPECT_EQ(now.dw, later.dw) << "delayed dW differs from immediate dW";
  EXPECT_EQ(now.db, later.db) << "db differs between delayed and immediate";

  // Against the exact E dense layers; the own-precision reference adds the bias onto the GEMM's
  // rounded output (a second rounding, at least as far from exact as one).
  ExactResult y = exact_fprop(p.x, p.w, c.counts);
  if (bias_mode() != BiasMode::kNone) add_bias(y, hb.grouped, c.counts, dt, false);
  EXPECT_TRUE(within_rule(now.y.to_double(), y, dt, "y"));
  EXPECT_TRUE(within_rule(now.dx.to_double(), exact_dgrad(p.dy, p.w, c.counts), dt, "dx"));
  EXPECT_TRUE(within_rule(now.dw, exact_wgrad(p.dy, p.x, c.counts, nullptr, nullptr), dt, "dW"));
  for (int64_t e = 0; e < c.E; ++e) {
    if (c.counts[e] != 0) continue;
    for (int64_t i = 0; i < c.N * c.K; ++i) ASSERT_EQ(now.dw[e * c.N * c.K + i], 0.0) << "dW of empty expert " << e;
    for (int64_t n = 0; n < c.N && !now.db.empty(); ++n) ASSERT_EQ(now.db[e * c.N + n], 0.0) << "db of empty expert " << e;
  }
  if (bias_mode() != BiasMode::kNone) EXPECT_TRUE(within_rule(now.db, exact_bias_grad(p.dy, c.counts), dt, "db"));
}

TEST_P(CpuGroupedLinear, MainGradAccumulateOverwriteMask) {
  Rng rng;
  const ShapeCase c = make_case(case_name(), rng);
  const GemmProblem p(c, DType::bf16, rng);
  const HostBias hb(bias_mode(), DType::bf16, c.E, c.N, rng);
  HostTensor mask(DType::i32, {c.E});
  std::vector<int32_t> mask_v(size_t(c.E));
  for (int64_t e = 0; e < c.E; ++e) mask.set(e, mask_v[e] = int32_t(rng.integer(0, 1)));
  for (bool accumulate : {true, false}) {
    for (bool delayed : {false, true}) {
      HostExpertTensor main_grad(layout(), DType::f32, c.E, c.N, c.K);
      HostTensor init(DType::f32, {c.E, c.N, c.K});
      fill_random(init, rng, -2.0, 2.0);
      const std::vector<double> init_v = init.to_double();
      main_grad.set_all(init_v);
      GroupedLinearOptions opt;
      opt.main_grad = main_grad.view();
      opt.accumulate = accumulate;
      opt.expert_mask = mask.view();
      opt.delay_wgrad = delayed;
      opt.save_original_input = true;
      int hooks = 0;
      opt.wgrad_hook = [&](const GroupedLinearGrads&, Stream) { ++hooks; };
      GroupedLinear layer(p.weights(layout()), hb.view(), opt);
      GroupedLinearContext ctx;
      layer.forward(p.x.view(), p.counts.view(), ctx);
      layer.backward(ctx, p.dy.view());
      if (delayed) {
        EXPECT_EQ(hooks, 0) << "hook fired before the delayed weight gradient";
        layer.backward_dw(ctx);
      }
      EXPECT_EQ(hooks, 1);
      ExactResult exact = exact_wgrad(p.dy, p.x, c.counts, accumulate ? &init_v : nullptr, &mask_v);
      const std::vector<double> got = main_grad.to_double();
      for (int64_t e = 0; e < c.E; ++e) {
        const bool untouched = mask_v[e] == 0 || (accumulate && c.counts[e] == 0);
        for (int64_t i = 0; untouched && i < c.N * c.K; ++i) {
          ASSERT_EQ(got[e * c.N * c.K + i], init_v[e * c.N * c.K + i]) << "expert " << e << " was written";
          exact.value[e * c.N * c.K + i] = exact.f32[e * c.N * c.K + i] = init_v[e * c.N * c.K + i];
        }
      }
      EXPECT_TRUE(within_rule(got, exact, DType::f32, accumulate ? "main_grad +=" : "main_grad ="));
    }
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::string(layout_name(std::get<0>(info.param))) + "_" + bias_name(std::get<1>(info.param)) + "_" +
         std::get<2>(info.param);
}

INSTANTIATE_TEST_SUITE_P(NamedCases, CpuGroupedLinear,
                         ::testing::Combine(::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values(BiasMode::kNone, BiasMode::kList, BiasMode::kGrouped),
                                            ::testing::ValuesIn(named_case_names())),
                         param_name);

// A host allocator that fills every allocation with 0x7F bytes (the finite f32 kFill): memory no
// one wrote reads as kFill, which no computed gradient equals. Counts its allocations and keeps the
// last one's range.
class FillingAllocator final : public Allocator {
 public:
  static constexpr unsigned char kByte = 0x7F;
  static double fill_value() {
    float f;
    const unsigned char b[4] = {kByte, kByte, kByte, kByte};
    std::memcpy(&f, b, 4);
    return f;
  }
  void* allocate(std::size_t bytes, Stream stream) override {
    void* p = host_allocator().allocate(bytes, stream);
    if (p != nullptr) std::memset(p, kByte, bytes);
    ++allocations;
    return p;
  }
  void free(void* ptr, Stream stream) override { host_allocator().free(ptr, stream); }
  Device device() const override { return Device::cpu(); }
  int allocations = 0;
};

// One layer's weight gradient with main_grad, an expert mask and MaskedOffWgrad::fresh (`recipe`:
// the native and FP8 weight gradients), immediate and delayed, overwriting and accumulating,
// against the same layer's gradient into a zeroed main_grad without a mask (expect_layer_masked_off:
// every expert's destination, bitwise on the CPU backend).
using MaskedOffParam = std::tuple<Layout, LinearRecipe, std::string>;
class CpuGroupedLinearMaskedOff : public ::testing::TestWithParam<MaskedOffParam> {};

TEST_P(CpuGroupedLinearMaskedOff, EveryExpertsDestination) {
  const auto [layout, recipe, case_name] = GetParam();
  Rng rng;
  const ShapeCase c = make_case(case_name, rng);
  const GemmProblem p(c, DType::bf16, rng);
  const MaskedOffDestinations d(c.E, c.N, c.K, rng);
  FillingAllocator alloc;
  const auto run = [&](HostExpertTensor& main_grad, bool masked, bool accumulate, bool delayed) {
    const GroupedLinearOptions opt =
        main_grad_options(recipe, main_grad.view(), accumulate, delayed, &alloc, masked ? d.mask_t.view() : TensorView());
    GroupedLinear layer(p.weights(layout), {}, opt);
    GroupedLinearContext ctx;
    layer.forward(p.x.view(), p.counts.view(), ctx);
    GroupedLinearBackward b = layer.backward(ctx, p.dy.view());
    return delayed ? layer.backward_dw(ctx) : b.grads;
  };
  HostExpertTensor plain(layout, DType::f32, c.E, c.N, c.K);
  plain.set_all(std::vector<double>(d.main_init.size(), 0.0));
  const GroupedLinearGrads pg = run(plain, false, false, false);
  EXPECT_FALSE(pg.masked_off_weight.is_stacked() || !pg.masked_off_weight.list.empty())
      << "a fresh buffer without MaskedOffWgrad::fresh";
  const std::vector<double> product = plain.to_double();
  for (bool accumulate : {false, true}) {
    for (bool delayed : {false, true}) {
      HostExpertTensor main_grad(layout, DType::f32, c.E, c.N, c.K);
      main_grad.set_all(d.main_init);
      const GroupedLinearGrads g = run(main_grad, true, accumulate, delayed);
      const ExpertWeights& fresh = g.masked_off_weight;
      ASSERT_EQ(fresh.is_stacked(), layout == Layout::kStacked) << "the fresh views take the weights' layout";
      ASSERT_EQ(fresh.num_experts(), c.E);
      EXPECT_EQ(fresh.dtype(), DType::f32) << "the fresh views share main_grad's launch, and its dtype";
      ASSERT_TRUE(g.storage != nullptr);
      EXPECT_EQ(g.weight.expert(0).data, main_grad.view().expert(0).data) << "weight views main_grad";
      expect_layer_masked_off(d.mask, accumulate, d.main_init, FillingAllocator::fill_value(), product,
                              main_grad.to_double(), expert_values(fresh), 0.0,
                              std::string(accumulate ? "accumulate" : "overwrite") + (delayed ? ", delayed" : ""));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, CpuGroupedLinearMaskedOff,
                         ::testing::Combine(::testing::Values(Layout::kStacked, Layout::kList),
                                            ::testing::Values(LinearRecipe::native, LinearRecipe::fp8_tensorwise,
                                                              LinearRecipe::fp8_blockwise, LinearRecipe::mxfp8),
                                            ::testing::Values("skewed", "e1")),
                         [](const ::testing::TestParamInfo<MaskedOffParam>& info) {
                           return std::string(layout_name(std::get<0>(info.param))) + "_" +
                                  linear_recipe_name(std::get<1>(info.param)) + "_" + std::get<2>(info.param);
                         });

TEST(CpuGroupedLinearApi, MaskedOffFreshNeedsMainGradAndMask) {
  Rng rng;
  const ShapeCase c = make_case("skewed", rng);
  const GemmProblem p(c, DType::bf16, rng);
  HostTensor mask(DType::i32, {c.E});
  GroupedLinearOptions opt;
  opt.masked_off = MaskedOffWgrad::fresh;
  opt.expert_mask = mask.view();
  GMOE_EXPECT_ERROR(GroupedLinear(p.weights(Layout::kStacked), {}, opt), "options.masked_off", "main_grad");
  HostExpertTensor main_grad(Layout::kStacked, DType::f32, c.E, c.N, c.K);
  opt.main_grad = main_grad.view();
  opt.expert_mask = TensorView();
  GMOE_EXPECT_ERROR(GroupedLinear(p.weights(Layout::kStacked), {}, opt), "options.masked_off", "expert_mask");
}

// Fresh weight and bias gradients are views of ONE allocation (the only one backward's gradients
// make), and every expert's weight view starts on a 256-byte boundary in both layouts, on a shape
// whose N·K·2 bytes per expert are not a multiple of 256 (so back-to-back experts would not be).
TEST(CpuGroupedLinearApi, PackedGradientsOneAllocationAligned) {
  Rng rng;
  const ShapeCase c = fixed_case("odd_expert_bytes", 24, 40, {5, 0, 17, 3, 9}, 3);  // 1920 B per expert
  const GemmProblem p(c, DType::bf16, rng);
  HostTensor bias(DType::bf16, {c.E, c.N});
  fill_random(bias, rng);
  for (Layout layout : {Layout::kStacked, Layout::kList}) {
    FillingAllocator alloc;
    GroupedLinearOptions opt;
    opt.allocator = &alloc;
    opt.save_original_input = true;  // forward allocates nothing: every allocation below is backward's
    opt.delay_wgrad = true;
    GroupedLinear layer(p.weights(layout), expert_bias(bias.view(), layout), opt);
    GroupedLinearContext ctx;
    Tensor y = layer.forward(p.x.view(), p.counts.view(), ctx);
    HostTensor dx(DType::bf16, {c.capacity, c.K});
    const int before = alloc.allocations;
    GroupedLinearBackward b = layer.backward(ctx, p.dy.view(), nullptr, dx.view());
    EXPECT_EQ(alloc.allocations - before, 1) << layout_name(layout) << ": backward's gradients take one allocation";
    const GroupedLinearGrads g = layer.backward_dw(ctx);
    EXPECT_EQ(alloc.allocations - before, 1) << layout_name(layout) << ": backward_dw allocated";
    ASSERT_TRUE(g.storage != nullptr);
    const char* lo = static_cast<const char*>(g.storage->data());
    const char* hi = lo + g.storage->bytes();
    const auto inside = [&](const TensorView& v) {
      const char* at = static_cast<const char*>(v.data);
      return at >= lo && at + v.nbytes() <= hi;
    };
    EXPECT_EQ(g.weight.is_stacked(), layout == Layout::kStacked);
    for (int64_t e = 0; e < c.E; ++e) {
      const TensorView w = g.weight.expert(e);
      EXPECT_TRUE(inside(w)) << layout_name(layout) << ": dW_" << e << " outside the packed allocation";
      EXPECT_EQ(reinterpret_cast<std::uintptr_t>(w.data) % 256, 0u)
          << layout_name(layout) << ": dW_" << e << " not 256-byte aligned";
      EXPECT_TRUE(w.is_contiguous()) << layout_name(layout) << ": dW_" << e;
      EXPECT_TRUE(inside(g.bias.expert(e))) << layout_name(layout) << ": db_" << e << " outside the packed allocation";
    }
    // The padding changes where experts lie, not their values.
    EXPECT_TRUE(within_rule(expert_values(g.weight), exact_wgrad(p.dy, p.x, c.counts, nullptr, nullptr), DType::bf16,
                            std::string("padded dW, ") + layout_name(layout)));
  }
}

TEST(CpuGroupedLinearApi, CopiedInputIsIndependentOfTheCaller) {
  Rng rng;
  const ShapeCase c = make_case("skewed", rng);
  GemmProblem p(c, DType::bf16, rng);
  auto dw_for = [&](bool save_original, bool clobber) {
    GroupedLinearOptions opt;
    opt.save_original_input = save_original;
    GroupedLinear layer(p.weights(Layout::kStacked), {}, opt);
    GroupedLinearContext ctx;
    HostTensor x = p.x;
    layer.forward(x.view(), p.counts.view(), ctx);
    if (clobber) fill_random(x, rng);  // the caller reuses its buffer after forward
    return expert_values(layer.backward(ctx, p.dy.view()).grads.weight);
  };
  EXPECT_EQ(dw_for(false, false), dw_for(false, true)) << "the saved copy must not alias the caller's x";
  EXPECT_NE(dw_for(true, false), dw_for(true, true)) << "save_original_input must keep a reference";
}

// An input that the context owns (forward's copy of x, or one handed over by set_saved_input) is
// freed once the weight gradient has read it: backward then holds the gradients and dx, not the
// input too, unless the weight gradient is delayed. The results are those of the input by reference.
TEST(CpuGroupedLinearApi, OwnedInputFreedBeforeDx) {
  Rng rng;
  const ShapeCase c = fixed_case("owned_input", 32, 64, {7, 0, 19, 6}, 3);  // 4 KiB of dW per expert
  const GemmProblem p(c, DType::f32, rng);
  const size_t grads = size_t(c.E * c.N * c.K) * sizeof(float), dx = size_t(c.capacity * c.K) * sizeof(float);
  enum class Input { reference, copy, handed_over };
  struct Run {
    size_t peak;  // backward's most beyond what forward left live
    std::vector<double> dw, dx;
  };
  auto run = [&](Input input, bool delay) {
    CountingAllocator alloc(host_allocator());  // freed blocks are poisoned: a use after release shows
    GroupedLinearOptions opt;
    opt.allocator = &alloc;
    opt.save_original_input = input != Input::copy;
    opt.delay_wgrad = delay;
    GroupedLinear layer(p.weights(Layout::kStacked), {}, opt);
    GroupedLinearContext ctx;
    layer.forward(p.x.view(), p.counts.view(), ctx);
    if (input == Input::handed_over) {
      Tensor x = Tensor::empty({c.capacity, c.K}, DType::f32, alloc, nullptr);
      copy_rows(x, p.x.view());
      layer.set_saved_input(ctx, std::move(x));
    }
    const size_t live = alloc.in_use();
    alloc.reset_peak();
    GroupedLinearBackward b = layer.backward(ctx, p.dy.view());
    GroupedLinearGrads g = delay ? layer.backward_dw(ctx) : std::move(b.grads);
    return Run{alloc.peak() - live, expert_values(g.weight), to_host(b.dx.view()).to_double()};
  };
  const Run ref = run(Input::reference, false);
  EXPECT_EQ(ref.peak, grads + dx);
  for (Input input : {Input::copy, Input::handed_over}) {
    const char* name = input == Input::copy ? "copy" : "handed over";
    const Run now = run(input, false), delayed = run(input, true);
    EXPECT_EQ(now.peak, grads) << name << ": dx takes the input's memory";
    EXPECT_EQ(delayed.peak, grads + dx) << name << ": delayed, the input stays until backward_dw";
    EXPECT_EQ(now.dw, ref.dw) << name;
    EXPECT_EQ(now.dx, ref.dx) << name;
    EXPECT_EQ(delayed.dw, ref.dw) << name;
  }
}

TEST(CpuGroupedLinearApi, Errors) {
  Rng rng;
  const ShapeCase c = make_case("uniform", rng);
  const GemmProblem p(c, DType::bf16, rng);
  HostTensor bad_bias(DType::bf16, {c.E, c.N + 1});
  GMOE_EXPECT_ERROR(GroupedLinear(p.weights(Layout::kStacked), ExpertBias::from_grouped(bad_bias.view())), "bias:",
                    "expected vectors of");
  HostExpertTensor mg(Layout::kStacked, DType::bf16, c.E, c.N, c.K);
  GroupedLinearOptions opt;
  opt.main_grad = mg.view();
  GMOE_EXPECT_ERROR(GroupedLinear(p.weights(Layout::kStacked), {}, opt), "options.main_grad", "f32");
  GroupedLinear layer(p.weights(Layout::kList));
  GroupedLinearContext ctx;
  GMOE_EXPECT_ERROR(layer.backward(ctx, p.dy.view()), "ctx:", "forward");
  layer.forward(p.x.view(), p.counts.view(), ctx);
  GMOE_EXPECT_ERROR(layer.forward(p.x.view(), p.counts.view(), ctx), "ctx:", "backward");
  HostTensor dy_bad(DType::bf16, {c.capacity, c.N + 2});
  GMOE_EXPECT_ERROR(layer.backward(ctx, dy_bad.view()), "dy:", "expected [");
  GMOE_EXPECT_ERROR(layer.backward_dw(ctx), "ctx:", "delay_wgrad");
}

}  // namespace
}  // namespace gmoe::test
