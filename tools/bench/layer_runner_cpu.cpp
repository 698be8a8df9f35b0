// tools/bench/layer_runner_cpu.cpp — layer mode on the CPU reference backend: GroupedLinear
// forward and backward, and the bare GEMMs of the same work, wall-clock. A run here is long, so the
// forward of a forward+backward is the timed forward itself (forward_backward = forward + backward
// of the same iteration), and the first iteration is the checked one.
#include <algorithm>

#include "bench/layer_common.h"
#include "bench/wall_clock.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::bench {

std::vector<ResultRow> run_layer_case_cpu(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  std::vector<uint8_t> x(c.rows * c.K * es), w(c.E * c.N * c.K * es), dy(c.rows * c.N * es), bias(c.E * c.N * es);
  fill_uniform_host(x.data(), dt, c.rows * c.K, o.seed);
  fill_uniform_host(w.data(), dt, c.E * c.N * c.K, o.seed + 1);
  fill_uniform_host(dy.data(), dt, c.rows * c.N, o.seed + 2);
  fill_uniform_host(bias.data(), dt, c.E * c.N, o.seed + 3);
  std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  std::vector<uint8_t> y(c.rows * c.N * es, 0xff), dx(c.rows * c.K * es, 0xff);  // poisoned: NaN
  std::vector<float> main_grad(c.E * c.N * c.K, 0.f);

  const Device cpu = Device::cpu();
  const TensorView xv(x.data(), dt, cpu, {c.rows, c.K}), dyv(dy.data(), dt, cpu, {c.rows, c.N});
  const TensorView wv(w.data(), dt, cpu, {c.E, c.N, c.K}), bv(bias.data(), dt, cpu, {c.E, c.N});
  const TensorView mgv(main_grad.data(), DType::f32, cpu, {c.E, c.N, c.K});
  const TensorView cv(counts.data(), DType::i32, cpu, {c.E});
  const TensorView yv(y.data(), dt, cpu, {c.rows, c.N}), dxv(dx.data(), dt, cpu, {c.rows, c.K});
  GroupedLinear layer = make_bench_layer(wv, bv, mgv, o);

  GemmHostData d{dt, c.E, c.rows, c.N, c.K, prefix_offsets(c.counts), x.data(), w.data(), dy.data()};
  d.bias = bias.data();
  d.bias_dtype = dt;
  LayerCheck chk;
  std::vector<double> fwd, bwd;
  for (int i = 0; i < std::max(1, o.iters); ++i) {
    GroupedLinearContext ctx;
    fwd.push_back(wall_ms([&] { layer.forward(xv, cv, ctx, nullptr, yv); }));
    GroupedLinearBackward b;
    bwd.push_back(wall_ms([&] { b = layer.backward(ctx, dyv, nullptr, dxv); }));
    if (i == 0) chk = check_layer(d, {y.data(), dx.data(), main_grad.data(), b.grads.bias.grouped.data}, o);
  }
  std::vector<double> bare_fwd, bare_bwd;
  const ExpertWeights we = ExpertWeights::from_stacked(wv), mg = ExpertWeights::from_stacked(mgv);
  for (int i = 0; i < std::max(1, o.iters); ++i) {
    bare_fwd.push_back(wall_ms([&] { grouped_gemm_fprop(xv, we, cv, yv); }));
    bare_bwd.push_back(wall_ms([&] {
      grouped_gemm_dgrad(dyv, we, cv, dxv);
      grouped_gemm_wgrad(dyv, xv, cv, mg, WgradOptions{true, {}});
    }));
  }
  LayerTimes t;
  t.forward_ms = median(fwd);
  t.forward_bare_ms = median(bare_fwd);
  std::vector<double> fb(fwd.size()), bare_fb(bare_fwd.size());
  for (size_t i = 0; i < fb.size(); ++i) fb[i] = fwd[i] + bwd[i];
  for (size_t i = 0; i < bare_fb.size(); ++i) bare_fb[i] = bare_fwd[i] + bare_bwd[i];
  t.forward_backward_ms = median(fb);
  t.forward_backward_bare_ms = median(bare_fb);
  return layer_rows(c, dt, t, chk);
}

}  // namespace gmoe::bench
