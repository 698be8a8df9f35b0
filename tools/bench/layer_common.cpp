// tools/bench/layer_common.cpp — layer mode: configuration, checks and rows (see layer_common.h).
#include "bench/layer_common.h"

#include <string>

#include "gmoe/error.h"

namespace gmoe::bench {

bool bench_keeps_input_reference(LinearRecipe recipe, bool fp8_wgrad, bool requant_input, bool copy_input) {
  if (recipe != LinearRecipe::native && fp8_wgrad && !requant_input) return false;  // x's FP8 columns
  return !copy_input;
}

GroupedLinear make_bench_layer(const TensorView& w, const TensorView& bias, const TensorView& main_grad,
                               const BenchOptions& o, LinearRecipe recipe, bool fp8_wgrad, bool requant_input,
                               bool pow2, bool fast_accum) {
  GroupedLinearOptions opt;
  opt.recipe = recipe;
  opt.fp8_wgrad = fp8_wgrad;
  opt.fp8_pow2_scales = pow2;
  opt.fp8_fast_accumulation = fast_accum;
  opt.main_grad = ExpertWeights::from_stacked(main_grad);
  opt.accumulate = true;
  opt.save_original_input = bench_keeps_input_reference(recipe, fp8_wgrad, requant_input, o.layer_copy_input);
  return GroupedLinear(ExpertWeights::from_stacked(w), ExpertBias::from_grouped(bias), opt);
}

BenchRecipe bench_recipe_from_name(const std::string& name) {
  BenchRecipe r;
  r.name = name;
  const std::size_t plus = name.find('+');
  const std::string base = name.substr(0, plus);
  for (std::size_t at = plus; at != std::string::npos;) {
    const std::size_t next = name.find('+', at + 1);
    const std::string option = name.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
    if (option == "native_wgrad") {
      r.fp8_wgrad = false;
    } else if (option == "cached_weights") {
      r.cached_weights = true;
    } else if (option == "quant_after_act") {
      r.quant_in_act = false;
    } else if (option == "requant_input") {
      r.requant_input = true;
    } else if (option == "pow2") {
      r.pow2 = true;
    } else if (option == "fast_accum") {
      r.fast_accum = true;
    } else {
      GMOE_CHECK(false, "--layer-fp8: '", name, "': unknown option '+", option,
                 "' (native_wgrad, cached_weights, quant_after_act, requant_input, pow2, fast_accum)");
    }
    at = next;
  }
  r.recipe = linear_recipe_from_name(base);
  GMOE_CHECK(r.recipe != LinearRecipe::native, "--layer-fp8: '", name, "' is not an FP8 recipe");
  return r;
}

double recipe_quant_u(LinearRecipe recipe) {
  switch (recipe) {
    case LinearRecipe::native: return 0;
    case LinearRecipe::mxfp8: return 0.125;
    default: return 0.0625;
  }
}

LayerCheck check_layer(const GemmHostData& d, const LayerOutputs& out, const BenchOptions& o, double quant_u,
                       bool fp8_wgrad) {
  struct Part {
    const char* name;
    const char* pass;
    const void* data;
    DType dtype;
  };
  const Part parts[] = {{"y", "fprop", out.y, d.dtype},
                        {"dx", "dgrad", out.dx, d.dtype},
                        {"main_grad", "wgrad", out.main_grad, DType::f32},
                        {"db", "bias_grad", out.db, d.bias_dtype}};
  LayerCheck chk;
  chk.backward.ok = true;
  for (const Part& p : parts) {
    const std::string pass = p.pass;
    const double u = pass == "bias_grad" || (pass == "wgrad" && !fp8_wgrad) ? 0 : quant_u;
    const CheckResult r = check_pass(d, p.pass, p.data, p.dtype, o.samples, o.seed + 7, u);
    if (&p == &parts[0]) chk.forward = r;
    chk.backward.ok = chk.backward.ok && r.ok;
    chk.backward.detail += std::string(chk.backward.detail.empty() ? "" : "; ") + p.name + ": " + r.detail;
  }
  return chk;
}

std::vector<ResultRow> layer_rows(const BenchCase& c, DType dt, const LayerTimes& t, const LayerCheck& chk,
                                  const std::string& recipe_name) {
  const double flops = gemm_flops(c);
  auto row = [&](const char* pass, double pass_flops, double ms, double bare_ms, const CheckResult& check,
                 const std::optional<GraphNodeCounts>& nodes) {
    const bool native = recipe_name.empty();
    ResultRow r = timed_row(c.name, pass, native ? std::string("gmoe_linear") : "gmoe_linear_" + recipe_name,
                            native ? dtype_name(dt) : "fp8", ms, pass_flops, check.ok, check.detail);
    r.bare_ms = bare_ms;
    r.launches = nodes;
    return r;
  };
  return {row("forward", flops, t.forward_ms, t.forward_bare_ms, chk.forward, t.forward_nodes),
          row("forward_backward", 3 * flops, t.forward_backward_ms, t.forward_backward_bare_ms, chk.backward,
              t.forward_backward_nodes)};
}

}  // namespace gmoe::bench
