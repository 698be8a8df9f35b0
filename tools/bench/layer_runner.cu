// tools/bench/layer_runner.cu — layer mode on the CUDA backend (see layer_common.h).
//
// Per gemm case: one checked forward + backward (outputs poisoned, main_grad from zero, sampled
// fp64 checks of y, dx, main_grad and db); then one forward and one forward+backward captured in a
// CUDA graph (global capture mode: it fails on any host sync) to count what they launch; then the
// timing, CUDA events, with each layer call interleaved with the bare GEMMs of the same work so that
// drift during the measurement affects both alike. Inputs (x, dy, weights) rotate past L2 as in
// cuda_runner.cu; the bias and main_grad are one each, like a model's. With --layer-fp8, the FP8
// recipes of the layer are checked against the unquantized inputs (quantization bound) and timed
// interleaved with the native layer.
#include <cuda_runtime.h>

#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/graph_capture.h"
#include "bench/layer_common.h"
#include "gmoe/error.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::bench {
namespace {

// The device buffers of a layer run: `sets` copies of x, dy and the weights to rotate through, one
// bias, one main_grad, the outputs and the counts.
struct LayerBuffers {
  DType dt;
  int64_t E, rows, N, K;
  int sets;
  Device gpu;
  std::vector<std::unique_ptr<DeviceBuffer>> xs, dys, ws;
  std::unique_ptr<DeviceBuffer> bias, main_grad, y, dx, counts;

  LayerBuffers(const BenchCase& c, DType dtype, int num_sets, uint64_t seed)
      : dt(dtype), E(c.E), rows(c.rows), N(c.N), K(c.K), sets(num_sets) {
    const size_t es = dtype_size(dt);
    int device = 0;
    BENCH_CUDA(cudaGetDevice(&device));
    gpu = Device::cuda(device);
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(rows * K * es));
      dys.push_back(std::make_unique<DeviceBuffer>(rows * N * es));
      ws.push_back(std::make_unique<DeviceBuffer>(E * N * K * es));
      fill_uniform(xs[s]->ptr, dt, rows * K, seed + 10 * s);
      fill_uniform(dys[s]->ptr, dt, rows * N, seed + 10 * s + 1);
      fill_uniform(ws[s]->ptr, dt, E * N * K, seed + 10 * s + 2);
    }
    bias = std::make_unique<DeviceBuffer>(E * N * es);
    fill_uniform(bias->ptr, dt, E * N, seed + 3);
    main_grad = std::make_unique<DeviceBuffer>(E * N * K * sizeof(float));
    y = std::make_unique<DeviceBuffer>(rows * N * es);
    dx = std::make_unique<DeviceBuffer>(rows * K * es);
    counts = std::make_unique<DeviceBuffer>(E * sizeof(int32_t));
    const std::vector<int32_t> host_counts(c.counts.begin(), c.counts.end());
    BENCH_CUDA(cudaMemcpy(counts->ptr, host_counts.data(), E * sizeof(int32_t), cudaMemcpyHostToDevice));
    BENCH_CUDA(cudaDeviceSynchronize());  // the fills ran on the legacy stream; the runs use another
  }

  TensorView x(int i) const { return TensorView(xs[i % sets]->ptr, dt, gpu, {rows, K}); }
  TensorView dy(int i) const { return TensorView(dys[i % sets]->ptr, dt, gpu, {rows, N}); }
  TensorView w(int i) const { return TensorView(ws[i % sets]->ptr, dt, gpu, {E, N, K}); }
  TensorView b() const { return TensorView(bias->ptr, dt, gpu, {E, N}); }
  TensorView mg() const { return TensorView(main_grad->ptr, DType::f32, gpu, {E, N, K}); }
  TensorView yv() const { return TensorView(y->ptr, dt, gpu, {rows, N}); }
  TensorView dxv() const { return TensorView(dx->ptr, dt, gpu, {rows, K}); }
  TensorView cv() const { return TensorView(counts->ptr, DType::i32, gpu, {E}); }
};

// One forward, and one forward + backward, of `layer` on set `i` (the backward's gradients are
// released at the end, on the stream).
void layer_forward(GroupedLinear& layer, const LayerBuffers& b, int i, cudaStream_t stream) {
  GroupedLinearContext ctx;
  layer.forward(b.x(i), b.cv(), ctx, stream, b.yv());
}
void layer_forward_backward(GroupedLinear& layer, const LayerBuffers& b, int i, cudaStream_t stream) {
  GroupedLinearContext ctx;
  layer.forward(b.x(i), b.cv(), ctx, stream, b.yv());
  layer.backward(ctx, b.dy(i), stream, b.dxv());
}

}  // namespace

std::vector<ResultRow> run_layer_case_cuda(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  const BenchStream stream;
  const int64_t nx = c.rows * c.K, ndy = c.rows * c.N, nw = c.E * c.N * c.K, nb = c.E * c.N;
  const LayerBuffers b(c, dt, rotation_sets((nx + ndy + nw) * es), o.seed);
  std::vector<GroupedLinear> layers;
  for (int s = 0; s < b.sets; ++s) layers.push_back(make_bench_layer(b.w(s), b.b(), b.mg(), o));

  std::vector<uint8_t> hx(nx * es), hdy(ndy * es), hw(nw * es), hbias(nb * es);
  BENCH_CUDA(cudaMemcpy(hx.data(), b.xs[0]->ptr, nx * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hdy.data(), b.dys[0]->ptr, ndy * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hw.data(), b.ws[0]->ptr, nw * es, cudaMemcpyDeviceToHost));
  BENCH_CUDA(cudaMemcpy(hbias.data(), b.bias->ptr, nb * es, cudaMemcpyDeviceToHost));
  GemmHostData hd{dt, c.E, c.rows, c.N, c.K, prefix_offsets(c.counts), hx.data(), hw.data(), hdy.data()};
  hd.bias = hbias.data();
  hd.bias_dtype = dt;

  // Correctness first: poisoned outputs (0xff bytes are NaN), main_grad from zero, one run.
  auto check_run = [&](GroupedLinear& layer, double quant_u, bool fp8_wgrad = true) {
    std::vector<uint8_t> hy(ndy * es), hdx(nx * es), hdb(nb * es);
    std::vector<float> hmg(nw);
    BENCH_CUDA(cudaMemsetAsync(b.y->ptr, 0xff, ndy * es, stream));
    BENCH_CUDA(cudaMemsetAsync(b.dx->ptr, 0xff, nx * es, stream));
    BENCH_CUDA(cudaMemsetAsync(b.main_grad->ptr, 0, nw * sizeof(float), stream));
    GroupedLinearContext ctx;
    layer.forward(b.x(0), b.cv(), ctx, stream, b.yv());
    const GroupedLinearBackward back = layer.backward(ctx, b.dy(0), stream, b.dxv());
    BENCH_CUDA(cudaStreamSynchronize(stream));
    check_device_errors(stream);
    BENCH_CUDA(cudaMemcpy(hy.data(), b.y->ptr, ndy * es, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hdx.data(), b.dx->ptr, nx * es, cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hmg.data(), b.main_grad->ptr, nw * sizeof(float), cudaMemcpyDeviceToHost));
    BENCH_CUDA(cudaMemcpy(hdb.data(), back.grads.bias.grouped.data, nb * es, cudaMemcpyDeviceToHost));
    return check_layer(hd, {hy.data(), hdx.data(), hmg.data(), hdb.data()}, o, quant_u, fp8_wgrad);
  };
  const LayerCheck chk = check_run(layers[0], 0);

  LayerTimes t;
  t.forward_nodes = capture_node_counts([&] { layer_forward(layers[0], b, 0, stream); }, stream);
  t.forward_backward_nodes = capture_node_counts([&] { layer_forward_backward(layers[0], b, 0, stream); }, stream);

  const ExpertWeights mg = ExpertWeights::from_stacked(b.mg());
  auto bare_fprop = [&](int i) {
    grouped_gemm_fprop(b.x(i), ExpertWeights::from_stacked(b.w(i)), b.cv(), b.yv(), stream);
  };
  auto bare_backward = [&](int i) {
    const ExpertWeights w = ExpertWeights::from_stacked(b.w(i));
    grouped_gemm_dgrad(b.dy(i), w, b.cv(), b.dxv(), stream);
    grouped_gemm_wgrad(b.dy(i), b.x(i), b.cv(), mg, WgradOptions{true, {}}, stream);
  };
  auto native_forward = [&](int i) { layer_forward(layers[i % b.sets], b, i, stream); };
  auto native_forward_backward = [&](int i) { layer_forward_backward(layers[i % b.sets], b, i, stream); };
  const std::vector<double> fwd = time_interleaved_ms({native_forward, bare_fprop}, o.warmup, o.iters, stream, o.warm_ms);
  const std::vector<double> fb = time_interleaved_ms({native_forward_backward,
                                                      [&](int i) {
                                                        bare_fprop(i);
                                                        bare_backward(i);
                                                      }},
                                                     o.warmup, o.iters, stream, o.warm_ms);
  t.forward_ms = fwd[0];
  t.forward_bare_ms = fwd[1];
  t.forward_backward_ms = fb[0];
  t.forward_backward_bare_ms = fb[1];
  std::vector<ResultRow> rows = layer_rows(c, dt, t, chk);

  // FP8 recipes: the same layer with quantization inside, timed interleaved with the native layer.
  // The weights are quantized in every forward (invalidated before it), as with one microbatch per
  // optimizer step: the conservative case. With "+cached_weights" they are quantized once (by the
  // checked run), as in every later microbatch of a step.
  for (const std::string& name : o.layer_recipes) {
    const BenchRecipe br = bench_recipe_from_name(name);
    std::vector<GroupedLinear> fp8_layers;
    for (int s = 0; s < b.sets; ++s) {
      fp8_layers.push_back(make_bench_layer(b.w(s), b.b(), b.mg(), o, br.recipe, br.fp8_wgrad, br.requant_input, br.pow2,
                                              br.fast_accum));
    }
    const LayerCheck fchk = check_run(fp8_layers[0], recipe_quant_u(br.recipe), br.fp8_wgrad);
    if (br.cached_weights) {
      for (GroupedLinear& layer : fp8_layers) layer.quantize_weight(stream);
    }
    auto fp8_forward = [&](int i) {
      GroupedLinear& layer = fp8_layers[i % b.sets];
      if (!br.cached_weights) layer.invalidate_fp8_weight();
      layer_forward(layer, b, i, stream);
    };
    auto fp8_forward_backward = [&](int i) {
      GroupedLinear& layer = fp8_layers[i % b.sets];
      if (!br.cached_weights) layer.invalidate_fp8_weight();
      layer_forward_backward(layer, b, i, stream);
    };
    LayerTimes ft;
    ft.forward_nodes = capture_node_counts([&] { fp8_forward(0); }, stream);
    ft.forward_backward_nodes = capture_node_counts([&] { fp8_forward_backward(0); }, stream);
    const std::vector<double> ffwd = time_interleaved_ms({fp8_forward, native_forward}, o.warmup, o.iters, stream, o.warm_ms);
    const std::vector<double> ffb =
        time_interleaved_ms({fp8_forward_backward, native_forward_backward}, o.warmup, o.iters, stream, o.warm_ms);
    ft.forward_ms = ffwd[0];
    ft.forward_bare_ms = ffwd[1];
    ft.forward_backward_ms = ffb[0];
    ft.forward_backward_bare_ms = ffb[1];
    std::vector<ResultRow> r = layer_rows(c, dt, ft, fchk, br.name);  // forward, forward_backward
    r[0].native_alone_ms = t.forward_ms;
    r[1].native_alone_ms = t.forward_backward_ms;
    rows.insert(rows.end(), r.begin(), r.end());
  }
  check_device_errors(stream);
  return rows;
}

bool check_layer_launches_cuda(const BenchOptions& o) {
  const int64_t rows = 4096, N = 256, K = 256;
  const BenchStream stream;
  std::printf("launches per GroupedLinear call (stacked weights, grouped bias, f32 main_grad accumulated; "
              "rows %lld, N %lld, K %lld; CUDA graph capture, global mode):\n",
              (long long)rows, (long long)N, (long long)K);
  GraphNodeCounts first_fwd, first_fb;
  bool same = true;
  for (const int64_t E : {int64_t{8}, int64_t{256}}) {
    BenchCase c;
    c.kind = "gemm";
    c.name = "launch_check";
    c.E = E;
    c.rows = rows;
    c.N = N;
    c.K = K;
    c.counts.assign(E, rows / E);
    const LayerBuffers b(c, o.dtype, 1, o.seed);
    GroupedLinear layer = make_bench_layer(b.w(0), b.b(), b.mg(), o);
    BENCH_CUDA(cudaMemsetAsync(b.main_grad->ptr, 0, E * N * K * sizeof(float), stream));
    layer_forward_backward(layer, b, 0, stream);  // eagerly once: module loading outside the capture
    BENCH_CUDA(cudaStreamSynchronize(stream));
    check_device_errors(stream);
    const GraphNodeCounts fwd = capture_node_counts([&] { layer_forward(layer, b, 0, stream); }, stream);
    const GraphNodeCounts fb = capture_node_counts([&] { layer_forward_backward(layer, b, 0, stream); }, stream);
    std::printf("  E = %3lld: forward: %s; forward+backward: %s\n", (long long)E, fwd.str().c_str(),
                fb.str().c_str());
    if (E == 8) {
      first_fwd = fwd;
      first_fb = fb;
    } else {
      same = same && fwd == first_fwd && fb == first_fb;
    }
  }
  std::printf("  the same for E = 8 and E = 256: %s\n", same ? "yes" : "NO (FAILED: launches grow with E)");
  std::fflush(stdout);
  return same;
}

}  // namespace gmoe::bench
