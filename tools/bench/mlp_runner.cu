// tools/bench/mlp_runner.cu — mlp mode on the CUDA backend (see mlp_common.h).
//
// Per mlp case: the fp64 reference of sampled rows (once); then for GroupedMLP and for the unfused
// composition one checked forward + backward (outputs poisoned, main_grads from zero); then the
// timing, CUDA events, each GroupedMLP call interleaved with the composition's so that drift during
// the measurement affects both alike. Inputs (x, dy, weights) rotate past L2 as in cuda_runner.cu;
// the main_grads are one each, like a model's. Last, the activation kernels alone (forward; forward
// and backward) on the case's shapes: rows impl gmoe_activation, the share of the MLP's time that
// fusing the activation into the GEMMs' epilogues could at most save (docs/architecture.md).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <functional>
#include <memory>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/layer_common.h"
#include "bench/mlp_common.h"
#include "gmoe/activation.h"
#include "gmoe/error.h"

namespace gmoe::bench {
namespace {

// The device buffers of an mlp run: `sets` copies of x, dy and both weights to rotate through, one
// main_grad per FC, the outputs and the counts.
struct MlpBuffers {
  DType dt;
  int64_t E, rows, H, F, R1;
  int sets;
  Device gpu;
  std::vector<std::unique_ptr<DeviceBuffer>> xs, dys, w1s, w2s;
  std::unique_ptr<DeviceBuffer> mg1, mg2, y, dx, counts;

  MlpBuffers(const BenchCase& c, DType dtype, int num_sets, uint64_t seed)
      : dt(dtype), E(c.E), rows(c.rows), H(c.hidden), F(c.ffn), R1(mlp_fc1_rows(c)), sets(num_sets) {
    const size_t es = dtype_size(dt);
    int device = 0;
    BENCH_CUDA(cudaGetDevice(&device));
    gpu = Device::cuda(device);
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(rows * H * es));
      dys.push_back(std::make_unique<DeviceBuffer>(rows * H * es));
      w1s.push_back(std::make_unique<DeviceBuffer>(E * R1 * H * es));
      w2s.push_back(std::make_unique<DeviceBuffer>(E * H * F * es));
      fill_uniform(xs[s]->ptr, dt, rows * H, seed + 10 * s);
      fill_uniform(dys[s]->ptr, dt, rows * H, seed + 10 * s + 1);
      // Weights scaled so that h and y are about unit size.
      fill_uniform_scaled(w1s[s]->ptr, dt, E * R1 * H, 3.0 / std::sqrt(double(H)), seed + 10 * s + 2);
      fill_uniform_scaled(w2s[s]->ptr, dt, E * H * F, 3.0 / std::sqrt(double(F)), seed + 10 * s + 3);
    }
    mg1 = std::make_unique<DeviceBuffer>(E * R1 * H * sizeof(float));
    mg2 = std::make_unique<DeviceBuffer>(E * H * F * sizeof(float));
    y = std::make_unique<DeviceBuffer>(rows * H * es);
    dx = std::make_unique<DeviceBuffer>(rows * H * es);
    counts = std::make_unique<DeviceBuffer>(E * sizeof(int32_t));
    const std::vector<int32_t> host_counts(c.counts.begin(), c.counts.end());
    BENCH_CUDA(cudaMemcpy(counts->ptr, host_counts.data(), E * sizeof(int32_t), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaDeviceSynchronize());  // the fills ran on the legacy stream; the runs use another
  }

  TensorView x(int i) const { return TensorView(xs[i % sets]->ptr, dt, gpu, {rows, H}); }
  TensorView dy(int i) const { return TensorView(dys[i % sets]->ptr, dt, gpu, {rows, H}); }
  MlpParams params(int i, const BenchOptions& o) const {
    MlpParams p{TensorView(w1s[i % sets]->ptr, dt, gpu, {E, R1, H}), TensorView(w2s[i % sets]->ptr, dt, gpu, {E, H, F}),
                {}, {}, o.mlp_glu_block};
    if (o.mlp_main_grad) {
      p.mg1 = TensorView(mg1->ptr, DType::f32, gpu, {E, R1, H});
      p.mg2 = TensorView(mg2->ptr, DType::f32, gpu, {E, H, F});
    }
    return p;
  }
  TensorView yv() const { return TensorView(y->ptr, dt, gpu, {rows, H}); }
  TensorView dxv() const { return TensorView(dx->ptr, dt, gpu, {rows, H}); }
  TensorView cv() const { return TensorView(counts->ptr, DType::i32, gpu, {E}); }
};

// One forward, and one forward + backward, on set `i` (what forward saved is released at the end,
// on the stream).
void mlp_forward(GroupedMLP& m, const MlpBuffers& b, int i, cudaStream_t s) {
  GroupedMLPContext ctx;
  m.forward(b.x(i), b.cv(), {}, ctx, s, b.yv());
}
void mlp_forward_backward(GroupedMLP& m, const MlpBuffers& b, int i, cudaStream_t s) {
  GroupedMLPContext ctx;
  m.forward(b.x(i), b.cv(), {}, ctx, s, b.yv());
  m.backward(ctx, b.dy(i), s, b.dxv());
}
void unfused_forward(UnfusedMlp& m, const MlpBuffers& b, int i, cudaStream_t s) {
  UnfusedMlp::Context ctx;
  m.forward(b.x(i), b.cv(), ctx, s, b.yv());
}
void unfused_forward_backward(UnfusedMlp& m, const MlpBuffers& b, int i, cudaStream_t s) {
  UnfusedMlp::Context ctx;
  m.forward(b.x(i), b.cv(), ctx, s, b.yv());
  m.backward(ctx, b.dy(i), s, b.dxv());
}

}  // namespace

std::vector<ResultRow> run_mlp_case_cuda(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  const BenchStream stream;
  const int64_t R1 = mlp_fc1_rows(c);
  const int64_t nx = c.rows * c.hidden, nw1 = c.E * R1 * c.hidden, nw2 = c.E * c.hidden * c.ffn;
  const MlpBuffers b(c, dt, rotation_sets((2 * nx + nw1 + nw2) * es), o.seed);
  std::vector<GroupedMLP> mlps;
  std::vector<UnfusedMlp> unfused;
  for (int s = 0; s < b.sets; ++s) {
    mlps.push_back(make_bench_mlp(c, b.params(s, o)));
    unfused.emplace_back(c, b.params(s, o));
  }

  // The reference of sampled rows, from host copies of set 0.
  std::vector<uint8_t> hx(nx * es), hdy(nx * es), hw1(nw1 * es), hw2(nw2 * es), hy(nx * es), hdx(nx * es);
  BENCH_CUDA(cudaMemcpy(hx.data(), b.xs[0]->ptr, nx * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hdy.data(), b.dys[0]->ptr, nx * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hw1.data(), b.w1s[0]->ptr, nw1 * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hw2.data(), b.w2s[0]->ptr, nw2 * es, cudaMemcpyDeviceToHost));
  MlpHostData d;
  d.dtype = dt;
  d.E = c.E;
  d.rows = c.rows;
  d.H = c.hidden;
  d.F = c.ffn;
  d.R1 = R1;
  d.act = mlp_activation(c, o.mlp_glu_block);
  d.offsets = prefix_offsets(c.counts);
  d.x = hx.data();
  d.w1 = hw1.data();
  d.w2 = hw2.data();
  d.dy = hdy.data();
  const MlpReference ref = mlp_reference(d, o.samples, o.seed + 7);

  // Correctness first: poisoned outputs (0xff bytes are NaN), main_grads from zero, one run each.
  auto checked_run = [&](const std::function<void()>& run) {
    BENCH_CUDA(cudaMemsetAsync(b.y->ptr, 0xff, nx * es, stream));
    BENCH_CUDA(cudaMemsetAsync(b.dx->ptr, 0xff, nx * es, stream));
    BENCH_CUDA(cudaMemsetAsync(b.mg1->ptr, 0, nw1 * sizeof(float), stream));
    BENCH_CUDA(cudaMemsetAsync(b.mg2->ptr, 0, nw2 * sizeof(float), stream));
    run();
    BENCH_CUDA(cudaStreamSynchronize(stream));
    check_device_errors(stream);
    BENCH_CUDA(cudaMemcpy(hy.data(), b.y->ptr, nx * es, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hdx.data(), b.dx->ptr, nx * es, cudaMemcpyDeviceToHost));
    return check_mlp(d, ref, hy.data(), hdx.data());
  };
  const MlpCheck chk_mlp = checked_run([&] { mlp_forward_backward(mlps[0], b, 0, stream); });
  const MlpCheck chk_unfused = checked_run([&] { unfused_forward_backward(unfused[0], b, 0, stream); });

  const std::vector<double> fwd = time_interleaved_ms(
      {[&](int i) { mlp_forward(mlps[i % b.sets], b, i, stream); },
       [&](int i) { unfused_forward(unfused[i % b.sets], b, i, stream); }},
      o.warmup, o.iters, stream, o.warm_ms);
  const std::vector<double> fb = time_interleaved_ms(
      {[&](int i) { mlp_forward_backward(mlps[i % b.sets], b, i, stream); },
       [&](int i) { unfused_forward_backward(unfused[i % b.sets], b, i, stream); }},
      o.warmup, o.iters, stream, o.warm_ms);
  // The activation alone: h [rows, R1] (FC1's output of set 0, rebuilt by one GroupedMLP forward
  // is not needed: any values time alike), z and dz [rows, F], dh [rows, R1].
  DeviceBuffer h(c.rows * R1 * es), z(c.rows * c.ffn * es), dz(c.rows * c.ffn * es), dh(c.rows * R1 * es);
  fill_uniform(h.ptr, dt, c.rows * R1, o.seed + 5);
  fill_uniform(dz.ptr, dt, c.rows * c.ffn, o.seed + 6);
  BENCH_CUDA(cudaDeviceSynchronize());
  const TensorView hv(h.ptr, dt, b.gpu, {c.rows, R1}), zv(z.ptr, dt, b.gpu, {c.rows, c.ffn}),
      dzv(dz.ptr, dt, b.gpu, {c.rows, c.ffn}), dhv(dh.ptr, dt, b.gpu, {c.rows, R1});
  const ActivationOptions act = mlp_activation(c, o.mlp_glu_block);
  auto act_forward = [&](int) { grouped_activation_forward(hv, b.cv(), zv, act, {}, stream); };
  auto act_backward = [&](int) { grouped_activation_backward(hv, dzv, b.cv(), dhv, act, {}, {}, {}, stream); };
  // After the same sustained warm-up as the MLP rows, so that the share compares like with like.
  const double act_fwd = time_ms(act_forward, o.warmup, o.iters, stream, o.warm_ms);
  const double act_fb = time_ms(
      [&](int i) {
        act_forward(i);
        act_backward(i);
      },
      o.warmup, o.iters, stream, o.warm_ms);
  check_device_errors(stream);
  std::vector<ResultRow> rows = mlp_rows(c, dt, "gmoe", {fwd[0], fb[0]}, chk_mlp, o.mlp_main_grad);
  const std::vector<ResultRow> u = mlp_rows(c, dt, "gmoe_unfused", {fwd[1], fb[1]}, chk_unfused, o.mlp_main_grad);
  rows.insert(rows.end(), u.begin(), u.end());

  // FP8 recipes (--layer-fp8): GroupedMLP with the recipe on both FCs (weights quantized in every
  // forward, as after each optimizer step), checked by check_mlp_quantized, timed interleaved with
  // the bf16 GroupedMLP (whose time goes to bare_ms: the speedup is bare_ms / ms).
  for (const std::string& name : o.layer_recipes) {
    const BenchRecipe br = bench_recipe_from_name(name);
    const LinearRecipe recipe = br.recipe;
    std::vector<GroupedMLP> fp8;
    for (int s = 0; s < b.sets; ++s) fp8.push_back(make_bench_mlp(c, b.params(s, o), recipe, br.fp8_wgrad, br.quant_in_act,
                                                                br.requant_input, br.pow2, br.fast_accum));
    auto invalidate = [&](int i) {
      if (!br.cached_weights) fp8[i % b.sets].invalidate_fp8_weight();
    };
    // checked_run leaves y and dx in hy, hdx; the bf16 rule it applies does not hold for FP8.
    checked_run([&] {
      fp8[0].invalidate_fp8_weight();
      mlp_forward_backward(fp8[0], b, 0, stream);
    });
    const MlpCheck quantized =
        check_mlp_quantized(d, ref, hy.data(), hdx.data(), recipe == LinearRecipe::mxfp8 ? 0.25 : 0.15);
    // One pass (mlp_forward or mlp_forward_backward): the FP8 layer interleaved with the bf16 one.
    auto against_bf16 = [&](void (*pass)(GroupedMLP&, const MlpBuffers&, int, cudaStream_t)) {
      return time_interleaved_ms({[&](int i) {
                                    invalidate(i);
                                    pass(fp8[i % b.sets], b, i, stream);
                                  },
                                  [&](int i) { pass(mlps[i % b.sets], b, i, stream); }},
                                 o.warmup, o.iters, stream, o.warm_ms);
    };
    const std::vector<double> f = against_bf16(mlp_forward);
    const std::vector<double> g = against_bf16(mlp_forward_backward);
    std::vector<ResultRow> r = mlp_rows(c, dt, std::string("gmoe_") + name, {f[0], g[0]}, quantized, o.mlp_main_grad);
    r[0].bare_ms = f[1];
    r[1].bare_ms = g[1];
    r[0].native_alone_ms = fwd[0];
    r[1].native_alone_ms = fb[0];
    for (ResultRow& row : r) row.dtype = "fp8";
    rows.insert(rows.end(), r.begin(), r.end());
    fp8.clear();
    check_device_errors(stream);
  }
  for (const auto& [pass, ms] : {std::pair{"forward", act_fwd}, std::pair{"forward_backward", act_fb}}) {
    rows.push_back(timed_row(c.name, pass, "gmoe_activation", dtype_name(dt), ms, 0, std::nullopt,
                             "the activation kernels alone (no FLOPs counted)"));
  }
  return rows;
}

}  // namespace gmoe::bench
