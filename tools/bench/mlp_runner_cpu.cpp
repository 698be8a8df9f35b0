// tools/bench/mlp_runner_cpu.cpp — mlp mode on the CPU reference backend (see mlp_common.h):
// GroupedMLP and the unfused composition, forward and backward, wall-clock. A run here is long, so
// the forward of a forward+backward is the timed forward itself (forward_backward = forward +
// backward of the same iteration), and the first iteration of each is the checked one.
#include <algorithm>
#include <cmath>
#include <functional>

#include "bench/mlp_common.h"
#include "bench/wall_clock.h"

namespace gmoe::bench {

std::vector<ResultRow> run_mlp_case_cpu(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  const int64_t E = c.E, rows = c.rows, H = c.hidden, F = c.ffn, R1 = mlp_fc1_rows(c);
  std::vector<uint8_t> x(rows * H * es), dy(rows * H * es), w1(E * R1 * H * es), w2(E * H * F * es);
  fill_uniform_host(x.data(), dt, rows * H, o.seed);
  fill_uniform_host(dy.data(), dt, rows * H, o.seed + 1);
  // Weights scaled so that h and y are about unit size (x, dy uniform in [-1, 1)).
  fill_uniform_scaled_host(w1.data(), dt, E * R1 * H, 3.0 / std::sqrt(double(H)), o.seed + 2);
  fill_uniform_scaled_host(w2.data(), dt, E * H * F, 3.0 / std::sqrt(double(F)), o.seed + 3);
  std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  std::vector<uint8_t> y(rows * H * es), dx(rows * H * es);
  std::vector<float> mg1(E * R1 * H, 0.f), mg2(E * H * F, 0.f);

  const Device cpu = Device::cpu();
  const TensorView xv(x.data(), dt, cpu, {rows, H}), dyv(dy.data(), dt, cpu, {rows, H});
  const TensorView yv(y.data(), dt, cpu, {rows, H}), dxv(dx.data(), dt, cpu, {rows, H});
  const TensorView cv(counts.data(), DType::i32, cpu, {E});
  const MlpParams params{TensorView(w1.data(), dt, cpu, {E, R1, H}), TensorView(w2.data(), dt, cpu, {E, H, F}),
                         o.mlp_main_grad ? TensorView(mg1.data(), DType::f32, cpu, {E, R1, H}) : TensorView(),
                         o.mlp_main_grad ? TensorView(mg2.data(), DType::f32, cpu, {E, H, F}) : TensorView(),
                         o.mlp_glu_block};

  MlpHostData d;
  d.dtype = dt;
  d.E = E;
  d.rows = rows;
  d.H = H;
  d.F = F;
  d.R1 = R1;
  d.act = mlp_activation(c, o.mlp_glu_block);
  d.offsets = prefix_offsets(c.counts);
  d.x = x.data();
  d.w1 = w1.data();
  d.w2 = w2.data();
  d.dy = dy.data();
  const MlpReference ref = mlp_reference(d, o.samples, o.seed + 7);

  GroupedMLP mlp = make_bench_mlp(c, params);
  UnfusedMlp unfused(c, params);
  struct Impl {
    const char* name;
    std::function<double()> forward;   // returns its wall time; leaves what backward needs
    std::function<double()> backward;
  };
  GroupedMLPContext mctx;
  UnfusedMlp::Context uctx;
  const Impl impls[] = {
      {"gmoe", [&] { return wall_ms([&] { mlp.forward(xv, cv, {}, mctx, nullptr, yv); }); },
       [&] { return wall_ms([&] { mlp.backward(mctx, dyv, nullptr, dxv); }); }},
      {"gmoe_unfused", [&] { return wall_ms([&] { unfused.forward(xv, cv, uctx, nullptr, yv); }); },
       [&] { return wall_ms([&] { unfused.backward(uctx, dyv, nullptr, dxv); }); }},
  };
  std::vector<ResultRow> out;
  for (const Impl& impl : impls) {
    // Correctness first, on outputs poisoned with NaN (0xff bytes).
    std::fill(y.begin(), y.end(), uint8_t{0xff});
    std::fill(dx.begin(), dx.end(), uint8_t{0xff});
    MlpCheck chk;
    std::vector<double> fwd, fb;
    for (int i = 0; i < std::max(1, o.iters); ++i) {
      const double f = impl.forward();
      const double b = impl.backward();
      if (i == 0) chk = check_mlp(d, ref, y.data(), dx.data());
      fwd.push_back(f);
      fb.push_back(f + b);
    }
    MlpTimes t;
    t.forward_ms = median(fwd);
    t.forward_backward_ms = median(fb);
    const std::vector<ResultRow> r = mlp_rows(c, dt, impl.name, t, chk, o.mlp_main_grad);
    out.insert(out.end(), r.begin(), r.end());
  }
  return out;
}

}  // namespace gmoe::bench
