// tools/bench/cpu_runner.cpp — gemm cases on the CPU reference backend.
#include <algorithm>
#include <functional>

#include "bench/check.h"
#include "bench/runner.h"
#include "bench/wall_clock.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::bench {

std::vector<ResultRow> run_gemm_case_cpu(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  std::vector<uint8_t> x(c.rows * c.K * es), w(c.E * c.N * c.K * es), dy(c.rows * c.N * es);
  fill_uniform_host(x.data(), dt, c.rows * c.K, o.seed);
  fill_uniform_host(w.data(), dt, c.E * c.N * c.K, o.seed + 1);
  fill_uniform_host(dy.data(), dt, c.rows * c.N, o.seed + 2);
  std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  std::vector<uint8_t> y(c.rows * c.N * es), dx(c.rows * c.K * es), dw(c.E * c.N * c.K * es);

  const Device cpu = Device::cpu();
  const TensorView xv(x.data(), dt, cpu, {c.rows, c.K}), dyv(dy.data(), dt, cpu, {c.rows, c.N});
  const TensorView cv(counts.data(), DType::i32, cpu, {c.E});
  const ExpertWeights wv = ExpertWeights::from_stacked(TensorView(w.data(), dt, cpu, {c.E, c.N, c.K}));
  const ExpertWeights dwv = ExpertWeights::from_stacked(TensorView(dw.data(), dt, cpu, {c.E, c.N, c.K}));
  const TensorView yv(y.data(), dt, cpu, {c.rows, c.N}), dxv(dx.data(), dt, cpu, {c.rows, c.K});

  GemmHostData d{dt, c.E, c.rows, c.N, c.K, prefix_offsets(c.counts), x.data(), w.data(), dy.data()};
  struct Pass {
    const char* name;
    std::vector<uint8_t>* out;
    std::function<void()> run;
  };
  const Pass passes[] = {
      {"fprop", &y, [&] { grouped_gemm_fprop(xv, wv, cv, yv); }},
      {"dgrad", &dx, [&] { grouped_gemm_dgrad(dyv, wv, cv, dxv); }},
      {"wgrad", &dw, [&] { grouped_gemm_wgrad(dyv, xv, cv, dwv); }},
  };
  std::vector<ResultRow> rows;
  for (const Pass& p : passes) {
    if (!o.runs_pass(p.name)) continue;
    // Correctness first, on a poisoned output (0xff bytes are NaN in bf16 and f16); on the CPU
    // the checked run is also the first timed one (a run here is long, and there is no warm-up
    // effect worth a second).
    std::fill(p.out->begin(), p.out->end(), uint8_t{0xff});
    std::vector<double> times;
    for (int i = 0; i < std::max(1, o.iters); ++i) times.push_back(wall_ms(p.run));
    const CheckResult chk = check_pass(d, p.name, p.out->data(), dt, o.samples, o.seed + 7);
    rows.push_back(timed_row(c.name, p.name, "gmoe", dtype_name(dt), median(times), gemm_flops(c), chk.ok,
                             chk.detail));
  }
  return rows;
}

}  // namespace gmoe::bench
