// tools/bench/moe_runner.cu — moe mode on the CUDA backend (see moe_common.h).
//
// Per moe case: one checked forward + backward (eager, which also loads every kernel module before
// any capture), during which the counting allocator gives the bytes kept for backward and the peak;
// the sampled fp64 check; the same for the layer keeping its permuted rows (gmoe_keep_input), whose
// results must be gmoe's bits; then one forward and one forward + backward captured in CUDA graphs
// (global capture mode: it fails on any host sync), whose nodes are what one call launches, and
// (where the memory allows) instantiated per input set; then the timing, CUDA events: the eager
// forward, the eager forward + backward, gmoe_keep_input's, the block's phases alone (MoePhases)
// and both graphs replayed, interleaved so that drift affects them alike; the backward alone (each
// after an untimed forward); last, the routing ops alone on the case's routing, interleaved with a
// device copy of the permuted rows' bytes. x, the logits and dout rotate past L2 (the weights, one
// copy, are far larger than L2 in every moe case).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/graph_capture.h"
#include "bench/mlp_common.h"
#include "bench/moe_common.h"
#include "common/float_convert.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::bench {
namespace {

// The device inputs of a moe run: `sets` copies of x, the logits and dout; one copy of the weights.
struct MoeBuffers {
  DType dt;
  int64_t T, E, H, F, R1;
  int sets;
  Device gpu;
  std::vector<std::unique_ptr<DeviceBuffer>> xs, logits, douts;
  std::unique_ptr<DeviceBuffer> w1, w2;

  MoeBuffers(const BenchCase& c, DType dtype, int num_sets, uint64_t seed)
      : dt(dtype), T(c.tokens), E(c.E), H(c.hidden), F(c.ffn), R1(mlp_fc1_rows(c)), sets(num_sets) {
    const size_t es = dtype_size(dt);
    int device = 0;
    BENCH_CUDA(cudaGetDevice(&device));
    gpu = Device::cuda(device);
    std::vector<uint8_t> host_logits(T * E * es);
    for (int s = 0; s < sets; ++s) {
      xs.push_back(std::make_unique<DeviceBuffer>(T * H * es));
      douts.push_back(std::make_unique<DeviceBuffer>(T * H * es));
      logits.push_back(std::make_unique<DeviceBuffer>(T * E * es));
      fill_uniform(xs[s]->ptr, dt, T * H, seed + 10 * s);
      fill_uniform(douts[s]->ptr, dt, T * H, seed + 10 * s + 1);
      const std::vector<float> l = moe_logits(c, seed + 10 * s + 4);
      for (int64_t i = 0; i < T * E; ++i) store_float(host_logits.data(), dt, i, l[i]);
      BENCH_CUDA(cudaMemcpy(logits[s]->ptr, host_logits.data(), T * E * es, cudaMemcpyHostToDevice));
    }
    // Weights scaled so that h and y are about unit size (x, dout uniform in [-1, 1)).
    w1 = std::make_unique<DeviceBuffer>(E * R1 * H * es);
    w2 = std::make_unique<DeviceBuffer>(E * H * F * es);
    fill_uniform_scaled(w1->ptr, dt, E * R1 * H, 3.0 / std::sqrt(double(H)), seed + 2);
    fill_uniform_scaled(w2->ptr, dt, E * H * F, 3.0 / std::sqrt(double(F)), seed + 3);
    BENCH_CUDA(cudaDeviceSynchronize());  // the fills ran on the legacy stream; the runs use another
  }

  TensorView x(int i) const { return TensorView(xs[i % sets]->ptr, dt, gpu, {T, H}); }
  TensorView dout(int i) const { return TensorView(douts[i % sets]->ptr, dt, gpu, {T, H}); }
  TensorView l(int i) const { return TensorView(logits[i % sets]->ptr, dt, gpu, {T, E}); }
  TensorView w1v() const { return TensorView(w1->ptr, dt, gpu, {E, R1, H}); }
  TensorView w2v() const { return TensorView(w2->ptr, dt, gpu, {E, H, F}); }
};

template <typename T>
std::vector<T> to_host(const void* p, int64_t n) {
  std::vector<T> v(static_cast<size_t>(n));
  if (n > 0) BENCH_CUDA(cudaMemcpy(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

// A graph of one call of `work`, instantiated.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Graph(cudaStream_t stream, const std::function<void()>& work) {
    graph = capture_graph(stream, work);
    BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  }
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
};

// Median of `iters` timings of backward, each after an untimed forward of the same input set.
double time_backward_ms(MoELayer& layer, const MoeBuffers& b, int warmup, int iters, cudaStream_t stream) {
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) BENCH_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < warmup + iters; ++i) {
    MoELayerContext ctx;
    layer.forward(b.x(i), b.l(i), ctx, stream);
    const int t = i - warmup;
    if (t >= 0) BENCH_CUDA(cudaEventRecord(ev[2 * t], stream));
    layer.backward(ctx, b.dout(i), stream);
    if (t >= 0) BENCH_CUDA(cudaEventRecord(ev[2 * t + 1], stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  std::vector<float> ms(iters);
  for (int i = 0; i < iters; ++i) BENCH_CUDA(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  std::sort(ms.begin(), ms.end());
  return ms[iters / 2];
}

}  // namespace

std::vector<ResultRow> run_moe_case_cuda(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const size_t es = dtype_size(dt);
  const int64_t T = c.tokens, E = c.E, k = c.top_k, H = c.hidden, F = c.ffn;
  const BenchStream stream;
  const MoeBuffers b(c, dt, rotation_sets(T * (2 * H + E) * es), o.seed);
  CountingAllocator alloc(cuda_allocator());
  GroupedMLP experts = make_bench_moe_experts(c, b.w1v(), b.w2v(), alloc);
  MoELayer layer = make_bench_moe(c, experts, alloc);
  MoELayer keep_layer = make_bench_moe(c, experts, alloc, false);
  MoeTimes t;

  // One eager forward + backward of `l` on set 0, and its memory: the peak, and the bytes kept for
  // backward (what forward leaves live but its output, plus x and the logits, kept by reference).
  struct Measured {
    MoELayerContext ctx;  // kept: f's ids, probs and counts are views of what it holds
    MoEForward f;
    MoEBackward b;
  };
  auto measured = [&](MoELayer& l, double* peak, double* kept_bytes, std::string* detail) {
    BENCH_CUDA(cudaStreamSynchronize(stream));
    const size_t before = alloc.live();
    alloc.reset_peak();
    Measured m;
    m.f = l.forward(b.x(0), b.l(0), m.ctx, stream);
    const size_t kept = alloc.live() - before - (m.f.out.owns_memory() ? size_t(T * H) * es : 0);
    m.b = l.backward(m.ctx, b.dout(0), stream);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    check_device_errors(stream);
    *peak = double(alloc.peak() - before);
    *kept_bytes = double(kept + size_t(T * (H + E)) * es);
    *detail = std::to_string(kept / std::max<int64_t>(T, 1)) + " B/token owned + x and logits by reference";
    return m;
  };

  // Correctness first, and the memory.
  MoeCheck chk;
  {
    const Measured run = measured(layer, &t.peak_bytes, &t.kept_bytes, &t.kept_detail);
    const MoEForward& f = run.f;
    const MoEBackward& back = run.b;

    const std::vector<int32_t> ids = to_host<int32_t>(f.ids.view().data, T * k);
    const std::vector<uint16_t> hx = to_host<uint16_t>(b.xs[0]->ptr, T * H), hd = to_host<uint16_t>(b.douts[0]->ptr, T * H);
    const std::vector<uint16_t> hl = to_host<uint16_t>(b.logits[0]->ptr, T * E);
    const std::vector<uint16_t> hout = to_host<uint16_t>(f.out.view().data, T * H);
    const std::vector<uint16_t> hdx = to_host<uint16_t>(back.dx.view().data, T * H);
    const std::vector<float> hdl = to_host<float>(back.dlogits.view().data, T * E);
    MoeSample s;
    MoeGot got;
    moe_gather(c, dt, o.samples, o.seed + 7, hx.data(), hd.data(), hl.data(), ids.data(), hout.data(), hdx.data(),
               hdl.data(), &s, &got);
    // Only the chosen experts' weights come to the host (all of them are tens of GB in some cases).
    const std::vector<int64_t> chosen = moe_chosen_experts(s.ids, E, &s.slot);
    const size_t w1e = size_t(s.R1 * H) * es, w2e = size_t(H * F) * es;
    s.w1.resize(chosen.size() * w1e);
    s.w2.resize(chosen.size() * w2e);
    for (size_t i = 0; i < chosen.size(); ++i) {
      BENCH_CUDA(cudaMemcpy(s.w1.data() + i * w1e, static_cast<uint8_t*>(b.w1->ptr) + chosen[i] * w1e, w1e,
                            cudaMemcpyDeviceToHost));
      BENCH_CUDA(cudaMemcpy(s.w2.data() + i * w2e, static_cast<uint8_t*>(b.w2->ptr) + chosen[i] * w2e, w2e,
                            cudaMemcpyDeviceToHost));
    }
    chk = check_moe(s, got);

    // The layer that keeps its permuted rows: its memory, and its results against gmoe's bits.
    const Measured kept = measured(keep_layer, &t.keep_peak_bytes, &t.keep_kept_bytes, &t.keep_kept_detail);
    t.keep_mismatch = moe_bitwise_mismatch(back, kept.b, [](const void* p, size_t n) { return to_host<uint8_t>(p, n); });
  }

  auto eager_forward = [&](int i) {
    MoELayerContext ctx;
    layer.forward(b.x(i), b.l(i), ctx, stream);
  };
  auto eager_forward_backward = [&](int i) {
    MoELayerContext ctx;
    layer.forward(b.x(i), b.l(i), ctx, stream);
    layer.backward(ctx, b.dout(i), stream);
  };
  auto keep_forward_backward = [&](int i) {
    MoELayerContext ctx;
    keep_layer.forward(b.x(i), b.l(i), ctx, stream);
    keep_layer.backward(ctx, b.dout(i), stream);
  };
  // The phases run on set 0's routing; x, the logits and dout still rotate.
  MoePhases phases(c, experts, b.x(0), b.l(0), b.dout(0), alloc, stream);
  t.forward_nodes = capture_node_counts([&] { eager_forward(0); }, stream);
  t.forward_backward_nodes = capture_node_counts([&] { eager_forward_backward(0); }, stream);
  // An instantiated graph keeps the physical memory of its allocations (the graph memory pool)
  // beside what the eager calls hold in the stream-ordered pool: the replays are timed only where
  // 2 graphs per input set and the eager calls fit in the free memory (not with E = 256 experts'
  // fresh weight gradients of a DeepSeek-V3 layer on one GPU).
  // The graphs' memory comes from the device, not from gmoe's pool, which keeps what the eager calls
  // freed: that goes back to the device first (the eager calls take it again when they run).
  size_t free_bytes = 0, total_bytes = 0;
  release_cached_memory_cuda();
  BENCH_CUDA(cudaMemGetInfo(&free_bytes, &total_bytes));
  const double graph_need = 1.1 * (2.0 * b.sets + 1) * t.peak_bytes;
  std::vector<std::unique_ptr<Graph>> fwd_graphs, fb_graphs;
  std::vector<std::function<void(int)>> runs = {
      eager_forward,
      eager_forward_backward,
      keep_forward_backward,
      [&](int i) { phases.router(b.l(i), stream); },
      [&](int i) { phases.permute(b.x(i), stream); },
      [&](int) { phases.experts(stream); },
      [&](int i) { phases.combine(b.dout(i), stream); }};
  const size_t graph_runs = runs.size();
  if (graph_need < double(free_bytes)) {
    for (int s = 0; s < b.sets; ++s) {
      fwd_graphs.push_back(std::make_unique<Graph>(stream, [&] { eager_forward(s); }));
      fb_graphs.push_back(std::make_unique<Graph>(stream, [&] { eager_forward_backward(s); }));
    }
    runs.push_back([&](int i) { BENCH_CUDA(cudaGraphLaunch(fwd_graphs[i % b.sets]->exec, stream)); });
    runs.push_back([&](int i) { BENCH_CUDA(cudaGraphLaunch(fb_graphs[i % b.sets]->exec, stream)); });
  } else {
    t.graph_note = "graph replays not timed: " + std::to_string(2 * b.sets) + " graphs of up to " +
                   std::to_string(int64_t(t.peak_bytes / (1 << 20))) + " MiB each and the eager calls need more than the " +
                   std::to_string(int64_t(free_bytes >> 20)) + " MiB free";
    std::printf("  %s: %s\n", c.name.c_str(), t.graph_note.c_str());
  }
  const std::vector<double> ms = time_interleaved_ms(runs, o.warmup, o.iters, stream, o.warm_ms);
  t.forward_ms = ms[0];
  t.forward_backward_ms = ms[1];
  t.keep_forward_backward_ms = ms[2];
  t.router_fb_ms = ms[3];
  t.permute_fb_ms = ms[4];
  t.experts_fb_ms = ms[5];
  t.combine_fb_ms = ms[6];
  if (ms.size() == graph_runs + 2) {
    t.graph_forward_ms = ms[graph_runs];
    t.graph_forward_backward_ms = ms[graph_runs + 1];
  }
  t.backward_ms = time_backward_ms(layer, b, o.warmup, o.iters, stream);
  fwd_graphs.clear();
  fb_graphs.clear();
  check_device_errors(stream);

  // The routing ops alone, on set 0's routing (x and dout rotated: one set of x may fit in L2),
  // against a device copy of the permuted rows.
  const int64_t rows = permuted_rows(T, k, E, {});
  DeviceBuffer ids(T * k * 4), probs(T * k * 4), counts(E * 4), pcounts(E * 4), row_of(T * k * 4), src(rows * 4),
      dprobs(T * k * 4), permuted(rows * H * es), copy(rows * H * es), out(T * H * es), dpermuted(rows * H * es);
  const TensorView idv(ids.ptr, DType::i32, b.gpu, {T, k}), pv(probs.ptr, DType::f32, b.gpu, {T, k});
  const TensorView perm(permuted.ptr, dt, b.gpu, {rows, H}), outv(out.ptr, dt, b.gpu, {T, H});
  const TensorView dperm(dpermuted.ptr, dt, b.gpu, {rows, H}), dpv(dprobs.ptr, DType::f32, b.gpu, {T, k});
  const TensorView pcv(pcounts.ptr, DType::i32, b.gpu, {E});
  const RoutingMap map{TensorView(row_of.ptr, DType::i32, b.gpu, {T, k}), TensorView(src.ptr, DType::i32, b.gpu, {rows})};
  router_topk(b.l(0), moe_router(c), idv, pv, TensorView(counts.ptr, DType::i32, b.gpu, {E}), {}, stream);
  permute(b.x(0), idv, {}, perm, pcv, map, {}, {}, {}, stream);
  const std::vector<double> op = time_interleaved_ms(
      {[&](int i) { permute(b.x(i), idv, {}, perm, pcv, map, {}, {}, {}, stream); },
       [&](int) { combine(perm, map, pv, outv, stream); },
       [&](int) { permute_backward(perm, map, outv, {}, {}, stream); },
       [&](int i) { combine_backward(b.dout(i), map, pv, perm, dperm, dpv, stream); },
       [&](int) { BENCH_CUDA(cudaMemcpyAsync(copy.ptr, permuted.ptr, rows * H * es, cudaMemcpyDeviceToDevice, stream)); }},
      o.warmup, o.iters, stream, 0);
  t.permute_ms = op[0];
  t.combine_ms = op[1];
  t.permute_backward_ms = op[2];
  t.combine_backward_ms = op[3];
  t.copy_ms = op[4];
  check_device_errors(stream);
  return moe_rows(c, dt, t, chk);
}

}  // namespace gmoe::bench
