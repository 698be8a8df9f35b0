// tools/bench/layer_common.cpp — layer mode: configuration, checks and rows (see layer_common.h).
#include "bench/layer_common.h"

namespace gmoe::bench {

GroupedLinear make_bench_layer(const TensorView& w, const TensorView& bias, const TensorView& main_grad,
                               const BenchOptions& o) {
  GroupedLinearOptions opt;
  opt.main_grad = ExpertWeights::from_stacked(main_grad);
  opt.accumulate = true;
  opt.save_original_input = !o.layer_copy_input;
  return GroupedLinear(ExpertWeights::from_stacked(w), ExpertBias::from_grouped(bias), opt);
}

LayerCheck check_layer(const GemmHostData& d, const LayerOutputs& out, const BenchOptions& o) {
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
    const CheckResult r = check_pass(d, p.pass, p.data, p.dtype, o.samples, o.seed + 7);
    if (&p == &parts[0]) chk.forward = r;
    chk.backward.ok = chk.backward.ok && r.ok;
    chk.backward.detail += std::string(chk.backward.detail.empty() ? "" : "; ") + p.name + ": " + r.detail;
  }
  return chk;
}

std::vector<ResultRow> layer_rows(const BenchCase& c, DType dt, const LayerTimes& t, const LayerCheck& chk) {
  const double flops = gemm_flops(c);
  auto row = [&](const char* pass, double pass_flops, double ms, double bare_ms, const CheckResult& check,
                 const std::optional<GraphNodeCounts>& nodes) {
    ResultRow r;
    r.case_name = c.name;
    r.pass = pass;
    r.impl = "gmoe_linear";
    r.dtype = dtype_name(dt);
    r.ms = ms;
    r.tflops = ms > 0 ? pass_flops / (ms * 1e-3) / 1e12 : 0;
    r.correct = check.ok;
    r.note = check.detail;
    r.bare_ms = bare_ms;
    r.launches = nodes;
    return r;
  };
  return {row("forward", flops, t.forward_ms, t.forward_bare_ms, chk.forward, t.forward_nodes),
          row("forward_backward", 3 * flops, t.forward_backward_ms, t.forward_backward_bare_ms, chk.backward,
              t.forward_backward_nodes)};
}

}  // namespace gmoe::bench
