// tools/bench/offload_common.cpp — the stack and step of offload mode (offload_common.h), and its CPU
// runner: wall-clock times and a counting allocator's peak, a smoke run of the same code path.
#include "bench/offload_common.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>

#include "bench/check.h"
#include "bench/mlp_common.h"
#include "gmoe/copy.h"
#include "gmoe/error.h"

namespace gmoe::bench {

OffloadStack::OffloadStack(const BenchCase& c, const std::vector<TensorView>& w1, const std::vector<TensorView>& w2,
                           Allocator* allocator) {
  for (int l = 0; l < kOffloadLayers; ++l) {
    GroupedMLPOptions o;
    o.activation = mlp_activation(c);
    o.allocator = allocator;
    layers.push_back(std::make_unique<GroupedMLP>(ExpertWeights::from_stacked(w1[l]),
                                                  ExpertWeights::from_stacked(w2[l]), ExpertBias(), ExpertBias(), o));
  }
}

OffloadSchedulerOptions offload_bench_schedule(bool keep_last_layer) {
  OffloadSchedulerOptions so;
  so.num_layers = kOffloadLayers;
  so.reload_ahead = 1;
  so.keep_last_layer = keep_last_layer;
  return so;
}

std::vector<ResultRow> offload_step_rows(const std::string& case_name, const std::string& dtype,
                                         const std::vector<OffloadStepRun>& runs) {
  constexpr double MiB = 1048576.0;
  const OffloadStepRun& plain = runs[0];
  bool all_equal = true;
  for (const OffloadStepRun& run : runs) all_equal = all_equal && run.equal;
  std::vector<ResultRow> r;
  char note[320];
  std::snprintf(note, sizeof note, "activations after forward %.2f MiB, step peak %.2f MiB", plain.held / MiB,
                plain.peak / MiB);
  r.push_back(timed_row(case_name, "step", "gmoe_stack", dtype, plain.ms, 0, all_equal, note));
  r.back().activations_mib = plain.held / MiB;
  r.back().peak_mib = plain.peak / MiB;
  for (std::size_t i = 1; i < runs.size(); ++i) {
    const OffloadStepRun& run = runs[i];
    const OffloadSchedule& sched = kOffloadSchedules[i - 1];
    std::snprintf(note, sizeof note,
                  "%s: activations after forward %.2f MiB (%.0f%% less), step peak %.2f MiB, %.2f MiB offloaded",
                  sched.keep_last_layer ? "last layer kept" : "every layer offloaded", run.held / MiB,
                  plain.held ? 100.0 * (1.0 - double(run.held) / plain.held) : 0.0, run.peak / MiB,
                  run.offloaded / MiB);
    r.push_back(timed_row(case_name, "step", sched.impl, dtype, run.ms, 0, run.equal, note + run.extra));
    r.back().activations_mib = run.held / MiB;
    r.back().peak_mib = run.peak / MiB;
    r.back().offloaded_mib = run.offloaded / MiB;
    if (!run.equal) r.back().note += "; dx differs from the step without offloading";
  }
  return r;
}

std::size_t offload_stack_step(OffloadStack& s, const TensorView& x, const TensorView& counts, const TensorView& dy,
                               OffloadScheduler* sched, Stream stream, const TensorView& dx_out,
                               const std::function<void()>& after_forward) {
  const int L = static_cast<int>(s.layers.size());
  std::vector<GroupedMLPContext> ctx(L);
  std::vector<Tensor> ys;
  std::size_t offloaded = 0;
  TensorView cur = x;
  for (int l = 0; l < L; ++l) {
    ys.push_back(s.layers[l]->forward(cur, counts, {}, ctx[l], stream));
    cur = ys.back().view();
    if (l > 0) ys[l - 1].release_on(stream);  // FC1 keeps its own copy of its input
    if (sched == nullptr) continue;
    if (sched->offloads(l)) offloaded += ctx[l].offloadable_bytes();
    sched->forward_done(l, ctx[l], stream);
  }
  if (sched != nullptr) sched->forward_end(stream);
  if (after_forward) after_forward();
  std::vector<GroupedMLPBackward> back(L);
  TensorView g = dy;
  for (int l = L - 1; l >= 0; --l) {
    if (sched != nullptr) sched->backward_begin(l, stream);
    back[l] = s.layers[l]->backward(ctx[l], g, stream);
    g = back[l].dx.view();
  }
  copy_rows(dx_out, g, stream);
  return offloaded;
}

namespace {

// Counts the bytes in use and their peak (the CPU backend's stand-in for the memory pool's).
class PeakAllocator final : public Allocator {
 public:
  void* allocate(std::size_t bytes, Stream stream) override {
    void* p = host_allocator().allocate(bytes, stream);
    if (p != nullptr) {
      live_[p] = bytes;
      in_use_ += bytes;
      peak_ = std::max(peak_, in_use_);
    }
    return p;
  }
  void free(void* ptr, Stream stream) override {
    auto it = live_.find(ptr);
    if (it != live_.end()) {
      in_use_ -= it->second;
      live_.erase(it);
    }
    host_allocator().free(ptr, stream);
  }
  Device device() const override { return Device::cpu(); }
  std::size_t in_use() const { return in_use_; }
  std::size_t peak() const { return peak_; }
  void reset_peak() { peak_ = in_use_; }

 private:
  std::map<void*, std::size_t> live_;
  std::size_t in_use_ = 0, peak_ = 0;
};

}  // namespace

std::vector<ResultRow> run_offload_case_cpu(const BenchCase& c, const BenchOptions& o) {
  const DType dt = o.dtype;
  const std::size_t es = dtype_size(dt);
  const int64_t E = c.E, rows = c.rows, H = c.hidden, F = c.ffn, R1 = mlp_fc1_rows(c);
  const Device cpu = Device::cpu();
  std::vector<std::vector<uint8_t>> w1(kOffloadLayers), w2(kOffloadLayers);
  std::vector<TensorView> w1v, w2v;
  for (int l = 0; l < kOffloadLayers; ++l) {
    w1[l].resize(E * R1 * H * es);
    w2[l].resize(E * H * F * es);
    fill_uniform_host(w1[l].data(), dt, E * R1 * H, o.seed + 10 * l);
    fill_uniform_host(w2[l].data(), dt, E * H * F, o.seed + 10 * l + 1);
    w1v.emplace_back(w1[l].data(), dt, cpu, std::initializer_list<int64_t>{E, R1, H});
    w2v.emplace_back(w2[l].data(), dt, cpu, std::initializer_list<int64_t>{E, H, F});
  }
  std::vector<uint8_t> x(rows * H * es), dy(rows * H * es);
  fill_uniform_host(x.data(), dt, rows * H, o.seed + 100);
  fill_uniform_host(dy.data(), dt, rows * H, o.seed + 101);
  std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  const TensorView xv(x.data(), dt, cpu, {rows, H}), dyv(dy.data(), dt, cpu, {rows, H});
  const TensorView cv(counts.data(), DType::i32, cpu, {E});

  PeakAllocator alloc;
  OffloadStack stack(c, w1v, w2v, &alloc);
  Offloader off(cpu, nullptr, &alloc);
  std::vector<OffloadScheduler> scheds;
  for (const OffloadSchedule& s : kOffloadSchedules) scheds.emplace_back(off, offload_bench_schedule(s.keep_last_layer));
  // Run 0 without offloading, run 1 + i with kOffloadSchedules[i].
  std::vector<OffloadStepRun> runs(kOffloadRuns);
  std::vector<std::vector<uint8_t>> dx(kOffloadRuns);
  for (int i = 0; i < kOffloadRuns; ++i) {
    dx[i].assign(rows * H * es, 0);
    const TensorView dxv(dx[i].data(), dt, cpu, {rows, H});
    alloc.reset_peak();
    const std::size_t base = alloc.in_use();
    const auto t0 = std::chrono::steady_clock::now();
    runs[i].offloaded = offload_stack_step(stack, xv, cv, dyv, i ? &scheds[i - 1] : nullptr, nullptr, dxv,
                                           [&] { runs[i].held = alloc.in_use() - base; });
    runs[i].ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    runs[i].peak = alloc.peak() - base;
    runs[i].equal = dx[i] == dx[0];
  }
  const std::vector<ResultRow> r = offload_step_rows(c.name, dt == DType::bf16 ? "bf16" : "f16", runs);
  for (const ResultRow& row : r) {
    std::printf("  %-24s %-24s %9.3f ms  %s\n", row.case_name.c_str(), row.impl.c_str(), row.ms, row.note.c_str());
  }
  return r;
}

#ifndef GMOE_WITH_CUDA
std::vector<ResultRow> run_offload_case_cuda(const BenchCase&, const BenchOptions&) {
  GMOE_FAIL("gmoe-bench was built without CUDA");
}
#endif

std::vector<ResultRow> run_offload_mode(const BenchCase& full, const BenchOptions& o, bool use_cuda, double cpu_gflop,
                                        const std::string& dtype) {
  std::vector<ResultRow> rows;
  try {
    rows = use_cuda ? run_offload_case_cuda(full, o)
                    : run_offload_case_cpu(scale_rows(full, std::min(1.0, cpu_gflop * 1e9 / mlp_flops(full))), o);
  } catch (const std::exception& e) {
    std::printf("  SKIPPED %s offload: %s\n", full.name.c_str(), e.what());
    rows = {skipped_row(full.name, "step", "gmoe_stack_offload", dtype, e.what())};
  }
  for (ResultRow& r : rows) r.kind = "offload";  // their tables are their own (ms, memory), not TFLOP/s
  return rows;
}

}  // namespace gmoe::bench
