// tools/gmoe_ep_bench.cpp — gmoe-ep-bench: times MoELayer's backward with expert parallelism on
// NCCL, in order and with its exchanges overlapped with the experts' delayed weight gradients
// (MoEBackwardOverlap: comm_stream + experts_wgrad_during_combine), one process per GPU.
//
//   gmoe-ep-bench [--ranks R] [--case SUBSTRING] [--warmup N] [--iters N] [--trim-pool-each-step]
//                 [--json PATH]
//
// Per case (uniform routing from random logits, bf16, both FCs' weight gradients delayed) each
// rank times with CUDA events, after the warm-up, the median of --iters steps of:
//   forward_eager         the eager forward
//   backward_sequential   backward, then backward_dw, on one stream
//   backward_overlap      backward with its exchanges on a second stream and backward_dw on the
//                         compute stream while the combine of dxr is in flight
//   exchanges             ep_dispatch + ep_combine of the same rows alone (backward's two exchanges:
//                         dyp out, dxr and dpr back)
//   exchanges_dispatch    the ep_dispatch alone
//   exchanges_combine     the ep_combine alone (the one exchange that backward_dw can overlap: the
//                         dispatch of dyp precedes the experts' backward, which needs its rows)
//   wgrad                 the experts' backward_dw alone
// Before timing, the overlapped backward is checked against the sequential one: dx, dlogits and
// every weight gradient bitwise equal (the overlap moves work between streams, not arithmetic).
//
// Every timed step starts after a device-side barrier (an ep_plan, an all-gather of the counts),
// so that the ranks' start events line up and a rank that enqueues late is not charged to its
// peers. All ranks run the same steps in the same order (the collectives pair up). Besides each
// rank's median device time, every pass reports per rank: the barrier's device time (a rank that
// waits there waits for a slower peer), the host time to enqueue the step's body, the steps in
// which the device had already passed the barrier when the host finished enqueueing the body
// ("host-late": the GPU may then have waited on the host, so the device time includes host time),
// and the steps in which gmoe's memory pool reserved more device memory than before the step.
// The table shows the largest of the ranks' medians and the smallest beside it.
//
// --trim-pool-each-step times every pass a second time (impl gmoe_ep_trimmed) with gmoe's pool
// trimmed after each step: what a pool that gives freed memory back at every synchronisation costs
// (CUDA's default pool does, with its release threshold of 0), A/B in the same run.
//
// The parent makes the NCCL unique ids before any CUDA call (a forked child cannot use a CUDA
// driver its parent initialised; the GPU count comes from a probe child), forks one child per GPU,
// and reads each child's figures back through a pipe. Fewer than 2 GPUs: prints
// "gmoe-ep-bench: skipped" and exits 0.
#include <cuda_runtime.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "bench/process_ranks.h"
#include "bench/results.h"
#include "gmoe/expert_parallel.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/memory_pool.h"
#include "gmoe/moe_layer.h"
#include "gmoe/routing.h"

namespace {

struct Case {
  const char* name;
  int64_t tokens, hidden, ffn, experts, top_k;  // tokens per rank
};

// The shapes of bench/suites/ep.json's uniform cases.
constexpr Case kCases[] = {
    {"ep_dsv3_e256/uniform", 4096, 7168, 2048, 256, 8},
    {"ep_qwen3_30b_a3b/uniform", 8192, 2048, 768, 128, 8},
};
constexpr int kNumCases = sizeof(kCases) / sizeof(kCases[0]);

enum Pass { kForward, kSequential, kOverlap, kExchanges, kDispatch, kCombine, kWgrad, kNumPasses };
// JSON passes: bench/torch_ep_baseline.py's gmoe_ep rows of the same cases already have a
// "forward", a "dispatch" and a "combine" (which bench/report.py reads), so these are named apart.
constexpr const char* kPassNames[kNumPasses] = {"forward_eager", "backward_sequential", "backward_overlap", "exchanges",
                                                "exchanges_dispatch", "exchanges_combine", "wgrad"};
// How the pool is treated between steps: kept (gmoe's pool caches freed memory), or trimmed after
// each step (--trim-pool-each-step: what a pool with a release threshold of 0 does at each sync).
enum Mode { kCached, kTrimmed, kNumModes };
constexpr const char* kModeImpl[kNumModes] = {"gmoe_ep", "gmoe_ep_trimmed"};

// One rank's figures for one pass; device_ms < 0: not run.
struct PassStats {
  double device_ms = -1;   // median of the body's device time (events after the barrier and after the body)
  double barrier_ms = 0;   // median of the barrier's device time
  double enqueue_ms = 0;   // median of the host time to enqueue the body
  int host_late = 0;       // steps whose barrier the device had passed before the body was enqueued
  int pool_grew = 0;       // steps after which gmoe's pool reserved more than before the step
  int steps = 0;           // timed steps
  double peak_reserved_gib = 0;  // gmoe's pool's peak reserved bytes during the pass
};

// What a child sends back: its figures per case, mode and pass, the overlap's check, its device,
// its error.
struct Report {
  PassStats pass[kNumCases][kNumModes][kNumPasses];
  int overlap_equal[kNumCases];  // 1: overlapped backward bitwise equal to the sequential one; -1: not run
  char overlap_detail[kNumCases][160];
  char gpu[256];
  char error[512];
};

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

// An owning device buffer (set-up only).
struct DeviceBytes {
  void* p = nullptr;
  size_t n = 0;
  explicit DeviceBytes(size_t bytes) : n(bytes) { cuda_ok(cudaMalloc(&p, std::max<size_t>(bytes, 1)), "cudaMalloc"); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// bf16 values uniform in [-scale, scale]: a random block of 1 Mi values tiled over the buffer (the
// values only set the GEMMs' data; drawing billions of them on the host would take minutes).
void fill_bf16(DeviceBytes& b, float scale, std::mt19937_64& gen, cudaStream_t s) {
  std::uniform_real_distribution<float> u(-scale, scale);
  std::vector<uint16_t> block(size_t(1) << 20);
  for (uint16_t& v : block) v = gmoe::float_to_bf16_bits(u(gen));
  const size_t block_bytes = block.size() * 2;
  for (size_t at = 0; at < b.n; at += block_bytes) {
    cuda_ok(cudaMemcpyAsync(static_cast<char*>(b.p) + at, block.data(), std::min(block_bytes, b.n - at),
                            cudaMemcpyHostToDevice, s),
            "upload");
  }
  cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Whether `bytes` at device pointers a and b are equal, read back in chunks (the weight gradients
// are gigabytes; a host copy of both would be too).
bool device_bytes_equal(const void* a, const void* b, size_t bytes, cudaStream_t s) {
  const size_t chunk = size_t(64) << 20;
  std::vector<unsigned char> ha(std::min(chunk, bytes)), hb(ha.size());
  for (size_t at = 0; at < bytes; at += chunk) {
    const size_t n = std::min(chunk, bytes - at);
    cuda_ok(cudaMemcpyAsync(ha.data(), static_cast<const char*>(a) + at, n, cudaMemcpyDeviceToHost, s), "download");
    cuda_ok(cudaMemcpyAsync(hb.data(), static_cast<const char*>(b) + at, n, cudaMemcpyDeviceToHost, s), "download");
    cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (std::memcmp(ha.data(), hb.data(), n) != 0) return false;
  }
  return true;
}

// The parts of two backward results (dx, dlogits, both FCs' packed weight gradients) that differ,
// comma-separated; empty when all are bitwise equal.
std::string backward_differences(const gmoe::MoEBackward& a, const gmoe::GroupedMLPGrads& ga,
                                 const gmoe::MoEBackward& b, const gmoe::GroupedMLPGrads& gb, cudaStream_t s) {
  std::string differ;
  auto check = [&](const char* what, const void* pa, const void* pb, size_t bytes) {
    if (!device_bytes_equal(pa, pb, bytes, s)) differ += std::string(differ.empty() ? "" : ", ") + what;
  };
  check("dx", a.dx.view().data, b.dx.view().data, a.dx.view().numel() * gmoe::dtype_size(a.dx.view().dtype));
  check("dlogits", a.dlogits.view().data, b.dlogits.view().data, a.dlogits.view().numel() * 4);
  const gmoe::GroupedLinearGrads* fa[] = {&ga.fc1, &ga.fc2};
  const gmoe::GroupedLinearGrads* fb[] = {&gb.fc1, &gb.fc2};
  const char* names[] = {"fc1 dW", "fc2 dW"};
  for (int k = 0; k < 2; ++k) {
    if (fa[k]->storage == nullptr || fb[k]->storage == nullptr || fa[k]->storage->bytes() != fb[k]->storage->bytes()) {
      throw std::runtime_error(std::string(names[k]) + ": a delayed weight gradient without packed storage");
    }
    check(names[k], fa[k]->storage->data(), fb[k]->storage->data(), fa[k]->storage->bytes());
  }
  return differ;
}

// One case on one rank: fills `rep`'s rows of case `ci`.
void run_case(int ci, int rank, int ranks, const gmoe::EpUniqueId& id, int warmup, int iters, bool trim_ab,
              cudaStream_t s, cudaStream_t comm, Report& rep) {
  using namespace gmoe;
  const Case& c = kCases[ci];
  const Device dev = Device::cuda(rank);
  const int64_t T = c.tokens, H = c.hidden, F = c.ffn, E = c.experts, El = E / ranks;
  std::mt19937_64 gen(1000003ull * static_cast<uint64_t>(rank + 1) + static_cast<uint64_t>(E));

  DeviceBytes w1(size_t(El * 2 * F * H) * 2), w2(size_t(El * H * F) * 2), x(size_t(T * H) * 2),
      dout(size_t(T * H) * 2), logits(size_t(T * E) * 4);
  fill_bf16(w1, 0.02f, gen, s);
  fill_bf16(w2, 0.02f, gen, s);
  fill_bf16(x, 1.0f, gen, s);
  fill_bf16(dout, 1.0f, gen, s);
  {
    std::normal_distribution<float> n(0.0f, 1.0f);
    std::vector<float> h(static_cast<size_t>(T * E));
    for (float& v : h) v = n(gen);
    cuda_ok(cudaMemcpy(logits.p, h.data(), h.size() * 4, cudaMemcpyHostToDevice), "upload logits");
  }
  const TensorView xv(x.p, DType::bf16, dev, {T, H}), doutv(dout.p, DType::bf16, dev, {T, H}),
      logitsv(logits.p, DType::f32, dev, {T, E});

  EpGroupOptions go;
  go.num_experts = E;
  go.hidden = H;
  go.dtype = DType::bf16;
  go.max_rows = permuted_rows(T, c.top_k, E, {});
  std::unique_ptr<EpGroup> group = make_ep_group_nccl(id, rank, ranks, dev, go);

  GroupedMLPOptions mo;
  mo.fc1.delay_wgrad = true;
  mo.fc2.delay_wgrad = true;
  GroupedMLP experts(ExpertWeights::from_stacked(TensorView(w1.p, DType::bf16, dev, {El, 2 * F, H})),
                     ExpertWeights::from_stacked(TensorView(w2.p, DType::bf16, dev, {El, H, F})), {}, {}, mo);
  MoELayerOptions lo;
  lo.router.top_k = c.top_k;
  lo.router.normalize = true;
  lo.ep = group.get();
  MoELayer layer(experts, lo);
  MoELayerContext ctx;

  // The barrier before every timed step: an all-gather of this rank's counts.
  DeviceBytes barrier_counts(size_t(E) * 4);
  cuda_ok(cudaMemset(barrier_counts.p, 0, size_t(E) * 4), "cudaMemset");
  const TensorView barrier_view(barrier_counts.p, DType::i32, dev, {E});
  auto barrier = [&] { ep_plan(*group, barrier_view, nullptr, s); };

  cudaEvent_t ev[3] = {};
  for (cudaEvent_t& e : ev) cuda_ok(cudaEventCreate(&e), "cudaEventCreate");
  struct EventGuard {
    cudaEvent_t* e;
    ~EventGuard() {
      for (int i = 0; i < 3; ++i) cudaEventDestroy(e[i]);
    }
  } events{ev};
  const cudaEvent_t before_barrier = ev[0], start = ev[1], stop = ev[2];
  Mode mode = kCached;
  // `prepare` untimed, then the barrier, then `body` between the events; the medians over `iters`
  // after `warmup` steps, and the counts of host-late steps and of steps that grew the pool.
  auto timed = [&](const std::function<void()>& prepare, const std::function<void()>& body) {
    std::vector<double> device, barrier_ms, enqueue;
    PassStats st;
    cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    if (mode == kTrimmed) trim_memory_pool(dev);
    reset_memory_pool_peaks(dev);
    std::size_t reserved = memory_pool_stats(dev).reserved;
    for (int i = 0; i < warmup + iters; ++i) {
      prepare();
      cuda_ok(cudaEventRecord(before_barrier, s), "cudaEventRecord");
      barrier();
      cuda_ok(cudaEventRecord(start, s), "cudaEventRecord");
      const auto t0 = std::chrono::steady_clock::now();
      body();
      const auto t1 = std::chrono::steady_clock::now();
      // Done already: the device passed the barrier before the body was all enqueued, so it may
      // have waited on the host inside the body.
      const cudaError_t passed = cudaEventQuery(start);
      if (passed != cudaSuccess && passed != cudaErrorNotReady) cuda_ok(passed, "cudaEventQuery");
      if (passed == cudaErrorNotReady && cudaPeekAtLastError() == cudaErrorNotReady) cudaGetLastError();
      cuda_ok(cudaEventRecord(stop, s), "cudaEventRecord");
      cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float body_ms = 0, wait_ms = 0;
      cuda_ok(cudaEventElapsedTime(&body_ms, start, stop), "cudaEventElapsedTime");
      cuda_ok(cudaEventElapsedTime(&wait_ms, before_barrier, start), "cudaEventElapsedTime");
      if (mode == kTrimmed) cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");  // comm's frees too
      const std::size_t now = memory_pool_stats(dev).reserved;
      if (i >= warmup) {
        device.push_back(body_ms);
        barrier_ms.push_back(wait_ms);
        enqueue.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
        st.host_late += passed == cudaSuccess;
        st.pool_grew += now > reserved;
        ++st.steps;
      }
      if (mode == kTrimmed) {
        trim_memory_pool(dev);
        reserved = memory_pool_stats(dev).reserved;
      } else {
        reserved = now;
      }
    }
    st.device_ms = median(device);
    st.barrier_ms = median(barrier_ms);
    st.enqueue_ms = median(enqueue);
    st.peak_reserved_gib = double(memory_pool_stats(dev).peak_reserved) / double(1ull << 30);
    return st;
  };
  auto forward = [&] { layer.forward(xv, logitsv, ctx, s); };
  auto backward_in_order = [&] {
    MoEBackward b = layer.backward(ctx, doutv, s);
    GroupedMLPGrads dw = experts.backward_dw(ctx.experts(), s);
  };
  MoEBackwardOverlap overlap;
  overlap.comm_stream = comm;
  overlap.experts_wgrad_during_combine = true;

  // The overlap moves work between streams, not arithmetic: its gradients equal the sequential ones.
  {
    forward();
    MoEBackward b = layer.backward(ctx, doutv, s);
    GroupedMLPGrads dw = experts.backward_dw(ctx.experts(), s);
    forward();
    MoEBackward o = layer.backward(ctx, doutv, s, {}, {}, overlap);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    const std::string differ = backward_differences(b, dw, o, o.grads, s);
    rep.overlap_equal[ci] = differ.empty() ? 1 : 0;
    std::snprintf(rep.overlap_detail[ci], sizeof rep.overlap_detail[ci], "%s",
                  differ.empty() ? "dx, dlogits, fc1 and fc2 dW bitwise equal to the sequential backward's"
                                 : ("differ from the sequential backward's: " + differ).c_str());
  }

  // Backward's exchanges alone, on this routing's plan: dyp [max_rows, H] out, dxr [recv, H] with
  // dpr f32 [recv] back.
  const EpPlan plan = ep_plan(*group, layer.forward(xv, logitsv, ctx, s).counts, nullptr, s);
  DeviceBytes rows(size_t(go.max_rows * H) * 2), recv_scalars(size_t(group->recv_capacity()) * 4);
  cuda_ok(cudaMemsetAsync(rows.p, 0, rows.n, s), "cudaMemset");
  cuda_ok(cudaMemsetAsync(recv_scalars.p, 0, recv_scalars.n, s), "cudaMemset");
  const TensorView rows_view(rows.p, DType::bf16, dev, {go.max_rows, H});
  const TensorView scalars_view(recv_scalars.p, DType::f32, dev, {group->recv_capacity()});

  for (int m = 0; m < (trim_ab ? kNumModes : 1); ++m) {
    mode = static_cast<Mode>(m);
    PassStats* ms = rep.pass[ci][m];
    ms[kForward] = timed([] {}, forward);
    ms[kSequential] = timed(forward, backward_in_order);
    ms[kOverlap] = timed(forward, [&] { MoEBackward b = layer.backward(ctx, doutv, s, {}, {}, overlap); });
    ms[kWgrad] = timed([&] { forward(); MoEBackward b = layer.backward(ctx, doutv, s); },
                       [&] { GroupedMLPGrads dw = experts.backward_dw(ctx.experts(), s); });
    ms[kExchanges] = timed([] {}, [&] {
      EpRows there = ep_dispatch(*group, plan, rows_view, {}, nullptr, s);
      EpRows back = ep_combine(*group, plan, there.rows.view(), scalars_view, nullptr, s);
    });
    ms[kDispatch] = timed([] {}, [&] { EpRows there = ep_dispatch(*group, plan, rows_view, {}, nullptr, s); });
    EpRows there;
    ms[kCombine] = timed([&] { there = ep_dispatch(*group, plan, rows_view, {}, nullptr, s); },
                         [&] { EpRows back = ep_combine(*group, plan, there.rows.view(), scalars_view, nullptr, s); });
    there = {};
  }
  cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  check_device_errors(s);
}

int child_main(int rank, int ranks, const std::vector<gmoe::EpUniqueId>& ids, int warmup, int iters,
               bool trim_ab, const std::string& filter, Report& rep) {
  cudaStream_t s = nullptr, comm = nullptr;
  try {
    cuda_ok(cudaSetDevice(rank), "cudaSetDevice");
    cudaDeviceProp prop{};
    cuda_ok(cudaGetDeviceProperties(&prop, rank), "cudaGetDeviceProperties");
    std::snprintf(rep.gpu, sizeof rep.gpu, "%s", prop.name);
    cuda_ok(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda_ok(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), "cudaStreamCreate");
    for (int i = 0; i < kNumCases; ++i) {
      if (!filter.empty() && std::string(kCases[i].name).find(filter) == std::string::npos) continue;
      if (kCases[i].experts % ranks != 0) continue;  // every rank skips it alike
      run_case(i, rank, ranks, ids[static_cast<size_t>(i)], warmup, iters, trim_ab, s, comm, rep);
      // The next case's cudaMalloc'd inputs and NCCL window must not find this case's scratch cached.
      cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
      gmoe::trim_memory_pool(gmoe::Device::cuda(rank));
    }
  } catch (const std::exception& e) {
    std::snprintf(rep.error, sizeof rep.error, "%s", e.what());
    std::fprintf(stderr, "gmoe-ep-bench rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}

bool read_all(int fd, void* dst, size_t n) {
  char* p = static_cast<char*>(dst);
  while (n > 0) {
    const ssize_t got = read(fd, p, n);
    if (got <= 0) return false;
    p += got;
    n -= static_cast<size_t>(got);
  }
  return true;
}

std::string fmt(double v, int prec) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.*f", prec, v);
  return buf;
}

// One pass over the ranks: the largest and smallest of their medians, the largest median barrier
// and enqueue times, and the host-late and pool-grew steps summed over the ranks.
struct OverRanks {
  double max_ms = -1, min_ms = -1, barrier_ms = 0, enqueue_ms = 0, peak_reserved_gib = 0;
  int host_late = 0, pool_grew = 0, steps = 0;
  bool run() const { return max_ms >= 0; }
};

OverRanks over_ranks(const std::vector<Report>& reports, int ci, int mode, int pass) {
  OverRanks o;
  for (const Report& rep : reports) {
    const PassStats& st = rep.pass[ci][mode][pass];
    if (st.device_ms < 0) return OverRanks{};  // not run (on one rank: on none)
    o.max_ms = std::max(o.max_ms, st.device_ms);
    o.min_ms = o.min_ms < 0 ? st.device_ms : std::min(o.min_ms, st.device_ms);
    o.barrier_ms = std::max(o.barrier_ms, st.barrier_ms);
    o.enqueue_ms = std::max(o.enqueue_ms, st.enqueue_ms);
    o.peak_reserved_gib = std::max(o.peak_reserved_gib, st.peak_reserved_gib);
    o.host_late += st.host_late;
    o.pool_grew += st.pool_grew;
    o.steps += st.steps;
  }
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gmoe-ep-bench: MoELayer backward with expert parallelism on NCCL, its exchanges in order and "
               "overlapped with the experts' delayed weight gradients (one process per GPU)"};
  int ranks = -1, warmup = 3, iters = 20;
  bool trim_ab = false;
  std::string filter, json;
  app.add_option("--ranks", ranks, "ranks, one per GPU (default: every visible GPU)");
  app.add_option("--case", filter, "run only the cases whose name contains this");
  app.add_option("--warmup", warmup, "untimed steps per pass")->check(CLI::NonNegativeNumber);
  app.add_option("--iters", iters, "timed steps per pass (the median is reported)")->check(CLI::PositiveNumber);
  app.add_flag("--trim-pool-each-step", trim_ab,
               "time every pass a second time (impl gmoe_ep_trimmed) with gmoe's memory pool trimmed after each "
               "step: the cost of a pool that gives freed memory back at every sync, A/B in the same run");
  app.add_option("--json", json, "write the rows here (docs/benchmarks.md's results format, kind \"ep\")");
  CLI11_PARSE(app, argc, argv);

  const int gpus = gmoe::bench::count_gpus_in_child([] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  if (ranks < 0) ranks = gpus;
  if (gpus < 2 || ranks < 2 || ranks > gpus) {
    std::printf("gmoe-ep-bench: skipped: %d GPU(s) visible, %d rank(s) asked; needs at least 2 ranks, one per GPU\n",
                gpus, ranks);
    return 0;
  }
  // NVLink multicast stays off (the machines' rule); the children inherit it.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<gmoe::EpUniqueId> ids;
  try {
    for (int i = 0; i < kNumCases; ++i) ids.push_back(gmoe::ep_unique_id());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gmoe-ep-bench: ep_unique_id failed: %s\n", e.what());
    return 1;
  }
  std::printf("gmoe-ep-bench: %d ranks, warm-up %d, median of %d%s\n", ranks, warmup, iters,
              trim_ab ? ", every pass also with the pool trimmed after each step" : "");
  std::fflush(stdout);

  // Each child sends its Report through a pipe of its own; a report fits a pipe's buffer, so the
  // child's write never blocks and the parent reads them once every child has exited.
  std::vector<int> fds;
  for (int r = 0; r < ranks; ++r) {
    int p[2];
    if (pipe(p) != 0) {
      std::perror("gmoe-ep-bench: pipe");
      return 1;
    }
    fds.push_back(p[0]);
    fds.push_back(p[1]);
  }
  auto child = [&](int r) {
    auto rep = std::make_unique<Report>();
    std::memset(rep.get(), 0, sizeof(Report));
    for (auto& c : rep->pass) {
      for (auto& m : c) std::fill(std::begin(m), std::end(m), PassStats{});
    }
    std::fill(std::begin(rep->overlap_equal), std::end(rep->overlap_equal), -1);
    const int rc = child_main(r, ranks, ids, warmup, iters, trim_ab, filter, *rep);
    std::fflush(stdout);
    std::fflush(stderr);
    const int fd = fds[2 * static_cast<size_t>(r) + 1];
    const bool sent = write(fd, rep.get(), sizeof(Report)) == static_cast<ssize_t>(sizeof(Report));
    return rc == 0 && sent ? 0 : 1;
  };
  const std::vector<int> result = gmoe::bench::run_ranks(ranks, child, std::chrono::seconds(540), "gmoe-ep-bench");
  for (int r = 0; r < ranks; ++r) close(fds[2 * static_cast<size_t>(r) + 1]);
  std::vector<Report> reports(static_cast<size_t>(ranks));
  int failed = 0;
  for (int r = 0; r < ranks; ++r) {
    const bool have = read_all(fds[2 * static_cast<size_t>(r)], &reports[r], sizeof(Report));
    close(fds[2 * static_cast<size_t>(r)]);
    failed += result[r] != 0 || !have;
  }
  if (failed > 0) {
    std::fprintf(stderr, "gmoe-ep-bench: %d of %d ranks failed\n", failed, ranks);
    return 1;
  }

  // Per case and mode: one line per pass, then what the passes say together.
  std::vector<gmoe::bench::ResultRow> rows;
  int overlap_wrong = 0;
  for (int i = 0; i < kNumCases; ++i) {
    for (int mode = 0; mode < kNumModes; ++mode) {
      OverRanks o[kNumPasses];
      for (int p = 0; p < kNumPasses; ++p) o[p] = over_ranks(reports, i, mode, p);
      if (!o[kForward].run()) continue;
      std::printf("\n%s, %s (%s)\n", kCases[i].name, kModeImpl[mode],
                  mode == kCached ? "gmoe's pool keeps freed memory" : "gmoe's pool trimmed after every step");
      std::printf("  %-20s %9s %9s %10s %10s %10s %10s %9s\n", "pass", "max ms", "min ms", "barrier ms",
                  "enqueue ms", "host-late", "pool grew", "peak GiB");
      for (int p = 0; p < kNumPasses; ++p) {
        if (!o[p].run()) continue;
        std::printf("  %-20s %9.3f %9.3f %10.3f %10.3f %5d/%-4d %5d/%-4d %9.2f\n", kPassNames[p], o[p].max_ms,
                    o[p].min_ms, o[p].barrier_ms, o[p].enqueue_ms, o[p].host_late, o[p].steps, o[p].pool_grew,
                    o[p].steps, o[p].peak_reserved_gib);
      }
      const double saved = o[kSequential].max_ms - o[kOverlap].max_ms;
      const double hidden = saved / std::min(o[kExchanges].max_ms, o[kWgrad].max_ms);
      const double hidden_combine = saved / std::min(o[kCombine].max_ms, o[kWgrad].max_ms);
      const double parts = o[kDispatch].max_ms + o[kCombine].max_ms;
      std::printf("  saved (sequential - overlap) %.3f ms: %.0f%% of min(exchanges, wgrad), %.0f%% of min(combine, "
                  "wgrad); exchanges %.3f ms vs dispatch + combine alone %.3f ms (%+.0f%%)\n",
                  saved, 100 * hidden, 100 * hidden_combine, o[kExchanges].max_ms, parts,
                  100 * (o[kExchanges].max_ms / parts - 1));
      const bool equal = std::all_of(reports.begin(), reports.end(), [&](const Report& r) { return r.overlap_equal[i] == 1; });
      if (mode == kCached) {
        overlap_wrong += !equal;
        for (int r = 0; r < ranks; ++r) {
          if (reports[r].overlap_equal[i] != 1) std::printf("  rank %d: overlapped backward: %s\n", r, reports[r].overlap_detail[i]);
        }
        if (equal) std::printf("  overlapped backward: %s on every rank\n", reports[0].overlap_detail[i]);
      }
      for (int p = 0; p < kNumPasses; ++p) {
        if (!o[p].run()) continue;
        std::optional<bool> correct;
        if (p == kOverlap) correct = equal;
        gmoe::bench::ResultRow row =
            gmoe::bench::timed_row(kCases[i].name, kPassNames[p], kModeImpl[mode], "bf16", o[p].max_ms, 0, correct);
        row.kind = "ep";
        row.note = "largest of " + std::to_string(ranks) + " ranks' medians (smallest " + fmt(o[p].min_ms, 3) +
                   " ms); barrier " + fmt(o[p].barrier_ms, 3) + " ms, host enqueue " + fmt(o[p].enqueue_ms, 3) +
                   " ms (largest rank's medians); host-late steps " + std::to_string(o[p].host_late) + "/" +
                   std::to_string(o[p].steps) + ", pool grew in " + std::to_string(o[p].pool_grew) + "/" +
                   std::to_string(o[p].steps) + ", pool peak reserved " + fmt(o[p].peak_reserved_gib, 2) + " GiB";
        if (p == kOverlap) {
          row.note += "; saved " + fmt(saved, 3) + " ms: " + fmt(100 * hidden, 0) + "% of min(exchanges, wgrad), " +
                      fmt(100 * hidden_combine, 0) + "% of min(combine, wgrad)";
        }
        if (p == kExchanges) row.note += "; dispatch + combine alone " + fmt(parts, 3) + " ms";
        rows.push_back(row);
      }
    }
  }
  std::printf("\nmax ms / min ms: the largest / smallest of the %d ranks' median device times of the step's body "
              "(CUDA events after the barrier and after the body). barrier ms: the barrier's device time (waiting for "
              "a slower peer), enqueue ms: the host time to enqueue the body (largest rank's medians). host-late: "
              "steps (summed over ranks) in which the device had passed the barrier before the host finished "
              "enqueueing the body: there the device time may include host time. pool grew: steps after which gmoe's "
              "pool reserved more device memory than before the step.\n",
              ranks);
  if (!json.empty()) {
    gmoe::bench::RunInfo info;
    info.gpu = std::string(reports[0].gpu) + " x" + std::to_string(ranks);
    const char* commit = std::getenv("GMOE_COMMIT");
    info.commit = commit != nullptr ? commit : "unknown";
    char date[16];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d", std::gmtime(&now));
    info.date = date;
    info.suite = "ep_overlap";
    gmoe::bench::write_json(json, info, rows);
    std::printf("wrote %s\n", json.c_str());
  }
  if (overlap_wrong > 0) {
    std::fprintf(stderr, "gmoe-ep-bench: the overlapped backward differs from the sequential one in %d case(s)\n",
                 overlap_wrong);
    return 1;
  }
  return 0;
}
