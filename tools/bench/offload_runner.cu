// tools/bench/offload_runner.cu — offload mode on CUDA (offload_common.h). A compute and a copy
// stream, both non-blocking. Per case:
//   step        the stack's step without offloading and with each of kOffloadSchedules, timed
//               interleaved (CUDA events, median), each with gmoe's memory pool's peak in use
//               above what it held before
//   copy        the offloader's copies of the saved tensors of every layer but the last alone (no
//               compute beside them), device to host and back, against one plain cudaMemcpyAsync of
//               the same bytes between device memory and pinned host memory: the bandwidth ratio
// The step with offloading should take at most 1.1 × max(step without, copies) and hold at least
// 70% less activation memory after forward (issue 42's targets; docs/benchmarks.md).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "bench/cuda_util.h"
#include "bench/mlp_common.h"
#include "bench/offload_common.h"
#include "gmoe/memory_pool.h"

namespace gmoe::bench {
namespace {

// The current CUDA device: gmoe's pool there is the one cuda_allocator() draws from.
Device current_cuda_device() {
  int dev = 0;
  BENCH_CUDA(cudaGetDevice(&dev));
  return Device::cuda(dev);
}

// The pool's peak of bytes in use during `work` above what was in use before it.
std::size_t pool_peak_during(const std::function<void()>& work, cudaStream_t stream) {
  const Device dev = current_cuda_device();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const std::size_t before = memory_pool_stats(dev).in_use;
  reset_memory_pool_peaks(dev);
  work();
  BENCH_CUDA(cudaDeviceSynchronize());
  const std::size_t high = memory_pool_stats(dev).peak_in_use;
  return high > before ? high - before : 0;
}

// Milliseconds between two events recorded on `stream` around `work`, after a device sync.
float stream_ms(cudaStream_t stream, const std::function<void()>& work) {
  cudaEvent_t a, b;
  BENCH_CUDA(cudaEventCreate(&a));
  BENCH_CUDA(cudaEventCreate(&b));
  BENCH_CUDA(cudaDeviceSynchronize());
  BENCH_CUDA(cudaEventRecord(a, stream));
  work();
  BENCH_CUDA(cudaEventRecord(b, stream));
  BENCH_CUDA(cudaEventSynchronize(b));
  float ms = 0;
  BENCH_CUDA(cudaEventElapsedTime(&ms, a, b));
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

std::vector<ResultRow> run_offload_case_cuda(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const char* dname = dt == DType::bf16 ? "bf16" : "f16";
  const std::size_t es = dtype_size(dt);
  const int64_t E = c.E, rows = c.rows, H = c.hidden, F = c.ffn, R1 = mlp_fc1_rows(c);
  int dev = 0;
  BENCH_CUDA(cudaGetDevice(&dev));
  const Device cuda = Device::cuda(dev);
  std::vector<std::unique_ptr<DeviceBuffer>> w1(kOffloadLayers), w2(kOffloadLayers);
  std::vector<TensorView> w1v, w2v;
  for (int l = 0; l < kOffloadLayers; ++l) {
    w1[l] = std::make_unique<DeviceBuffer>(E * R1 * H * es);
    w2[l] = std::make_unique<DeviceBuffer>(E * H * F * es);
    fill_uniform(w1[l]->ptr, dt, E * R1 * H, o.seed + 10 * l);
    fill_uniform(w2[l]->ptr, dt, E * H * F, o.seed + 10 * l + 1);
    w1v.emplace_back(w1[l]->ptr, dt, cuda, std::initializer_list<int64_t>{E, R1, H});
    w2v.emplace_back(w2[l]->ptr, dt, cuda, std::initializer_list<int64_t>{E, H, F});
  }
  DeviceBuffer x(rows * H * es), dy(rows * H * es), cnt(E * 4);
  fill_uniform(x.ptr, dt, rows * H, o.seed + 100);
  fill_uniform(dy.ptr, dt, rows * H, o.seed + 101);
  std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  BENCH_CUDA(cudaMemcpy(cnt.ptr, counts.data(), E * 4, cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaDeviceSynchronize());
  const TensorView xv(x.ptr, dt, cuda, {rows, H}), dyv(dy.ptr, dt, cuda, {rows, H});
  const TensorView cv(cnt.ptr, DType::i32, cuda, {E});

  cudaStream_t compute = nullptr, copy = nullptr;
  BENCH_CUDA(cudaStreamCreateWithFlags(&compute, cudaStreamNonBlocking));
  BENCH_CUDA(cudaStreamCreateWithFlags(&copy, cudaStreamNonBlocking));
  std::vector<ResultRow> r;
  {
    OffloadStack stack(c, w1v, w2v, nullptr);
    Offloader off(cuda, copy);
    std::vector<OffloadScheduler> scheds;
    for (const OffloadSchedule& s : kOffloadSchedules) {
      scheds.emplace_back(off, offload_bench_schedule(s.keep_last_layer));
    }
    // Run 0 without offloading, run 1 + i with kOffloadSchedules[i]; each writes its own dx.
    std::vector<std::unique_ptr<DeviceBuffer>> dx;
    std::vector<TensorView> dxv;
    for (int i = 0; i < kOffloadRuns; ++i) {
      dx.push_back(std::make_unique<DeviceBuffer>(rows * H * es));
      dxv.emplace_back(dx.back()->ptr, dt, cuda, std::initializer_list<int64_t>{rows, H});
    }
    const auto step = [&](int i, const std::function<void()>& after_forward = {}) {
      return offload_stack_step(stack, xv, cv, dyv, i ? &scheds[i - 1] : nullptr, compute, dxv[i], after_forward);
    };
    // Correctness (and the pinned pool's growth, before anything is timed).
    std::vector<OffloadStepRun> runs(kOffloadRuns);
    for (int i = 0; i < kOffloadRuns; ++i) runs[i].offloaded = step(i);
    BENCH_CUDA(cudaDeviceSynchronize());
    std::vector<uint8_t> h0(rows * H * es), hi(rows * H * es);
    BENCH_CUDA(cudaMemcpy(h0.data(), dx[0]->ptr, h0.size(), cudaMemcpyDeviceToHost));
    for (int i = 1; i < kOffloadRuns; ++i) {
      BENCH_CUDA(cudaMemcpy(hi.data(), dx[i]->ptr, hi.size(), cudaMemcpyDeviceToHost));
      runs[i].equal = hi == h0;
    }

    const auto held = [&](std::size_t* out) {
      return [out] {
        BENCH_CUDA(cudaDeviceSynchronize());
        *out = memory_pool_stats(current_cuda_device()).in_use;
      };
    };
    std::size_t before = 0;
    held(&before)();
    std::vector<std::function<void(int)>> timed;
    for (int i = 0; i < kOffloadRuns; ++i) {
      runs[i].peak = pool_peak_during([&] { step(i, held(&runs[i].held)); }, compute);
      runs[i].held -= std::min(runs[i].held, before);
      timed.push_back([&step, i](int) { step(i); });
    }
    const std::vector<double> ms = time_interleaved_ms(timed, o.warmup, o.iters, compute, o.warm_ms);
    for (int i = 0; i < kOffloadRuns; ++i) runs[i].ms = ms[i];
    // The copies below are those of the first schedule: every layer's but the last.
    static_assert(kOffloadSchedules[0].keep_last_layer, "the copies below leave the last layer out");
    const std::size_t offloaded = runs[1].offloaded;

    // The offloader's copies alone: the saved tensors of the offloaded layers out, then back.
    std::vector<double> d2h, h2d;
    for (int rep = 0; rep < 5; ++rep) {
      std::vector<GroupedMLPContext> ctx(kOffloadLayers);
      std::vector<Tensor> ys;
      TensorView cur = xv;
      for (int l = 0; l < kOffloadLayers; ++l) {
        ys.push_back(stack.layers[l]->forward(cur, cv, {}, ctx[l], compute));
        cur = ys.back().view();
      }
      d2h.push_back(stream_ms(copy, [&] {
        for (int l = 0; l + 1 < kOffloadLayers; ++l) ctx[l].offload(off, compute);
      }));
      for (int l = 0; l + 1 < kOffloadLayers; ++l) ctx[l].release(compute);
      h2d.push_back(stream_ms(copy, [&] {
        for (int l = kOffloadLayers - 2; l >= 0; --l) ctx[l].prefetch(compute);
      }));
      for (int l = 0; l + 1 < kOffloadLayers; ++l) ctx[l].reload(compute);
      TensorView g = dyv;
      std::vector<GroupedMLPBackward> back(kOffloadLayers);
      for (int l = kOffloadLayers - 1; l >= 0; --l) {
        back[l] = stack.layers[l]->backward(ctx[l], g, compute);
        g = back[l].dx.view();
      }
      BENCH_CUDA(cudaStreamSynchronize(compute));
    }
    // One plain copy of the same bytes each way, pinned host memory.
    void* pinned = nullptr;
    BENCH_CUDA(cudaMallocHost(&pinned, offloaded));
    DeviceBuffer dev_buf(offloaded);
    const double plain_d2h = time_ms(
        [&](int) { BENCH_CUDA(cudaMemcpyAsync(pinned, dev_buf.ptr, offloaded, cudaMemcpyDeviceToHost, copy)); }, 2,
        10, copy);
    const double plain_h2d = time_ms(
        [&](int) { BENCH_CUDA(cudaMemcpyAsync(dev_buf.ptr, pinned, offloaded, cudaMemcpyHostToDevice, copy)); }, 2,
        10, copy);
    BENCH_CUDA(cudaFreeHost(pinned));
    const double gb = offloaded / 1e9;
    const auto gbps = [gb](double ms) { return gb / (ms * 1e-3); };
    const double off_d2h = median(d2h), off_h2d = median(h2d);
    const double copy_ms = off_d2h + off_h2d;

    // The step against max(step without, copies); a schedule that offloads more bytes than the
    // copies measured above, its copies at the same bandwidth.
    char note[320];
    for (int i = 1; i < kOffloadRuns; ++i) {
      const double copies = copy_ms * double(runs[i].offloaded) / double(std::max<std::size_t>(offloaded, 1));
      std::snprintf(note, sizeof note, "; %.2fx max(step without %.3f ms, copies %.3f ms%s)",
                    ms[i] / std::max(ms[0], copies), ms[0], copies,
                    runs[i].offloaded == offloaded ? "" : ", at the measured copies' bandwidth");
      runs[i].extra = note;
    }
    r = offload_step_rows(c.name, dname, runs);
    // Each direction: the offloader's copies beside one plain pinned copy of the same bytes.
    const auto copy_rows = [&](const char* pass, double off_ms, double plain_ms) {
      std::snprintf(note, sizeof note, "%.1f GB/s, %.0f%% of the plain pinned copy", gbps(off_ms),
                    100.0 * plain_ms / off_ms);
      r.push_back(timed_row(c.name, pass, "offloader", dname, off_ms, 0, std::nullopt, note));
      r.back().gbps = gbps(off_ms);
      r.back().copy_gbps = gbps(plain_ms);
      std::snprintf(note, sizeof note, "%.1f GB/s", gbps(plain_ms));
      r.push_back(timed_row(c.name, pass, "pinned_memcpy", dname, plain_ms, 0, std::nullopt, note));
      r.back().gbps = gbps(plain_ms);
    };
    copy_rows("copy_d2h", off_d2h, plain_d2h);
    copy_rows("copy_h2d", off_h2d, plain_h2d);
  }
  BENCH_CUDA(cudaDeviceSynchronize());
  cudaStreamDestroy(compute);
  cudaStreamDestroy(copy);
  for (const ResultRow& row : r) {
    std::printf("  %-24s %-9s %-24s %9.3f ms  %s\n", row.case_name.c_str(), row.pass.c_str(), row.impl.c_str(), row.ms,
                row.note.c_str());
  }
  return r;
}

}  // namespace gmoe::bench
