// tools/gmoe_ep_bench.cpp — gmoe-ep-bench: times MoELayer's backward with expert parallelism on
// NCCL, in order and with its exchanges overlapped with the experts' delayed weight gradients
// (MoEBackwardOverlap: comm_stream + experts_wgrad_during_combine), one process per GPU.
//
//   gmoe-ep-bench [--ranks R] [--case SUBSTRING] [--warmup N] [--iters N] [--json PATH]
//
// Per case (uniform routing from random logits, bf16, both FCs' weight gradients delayed) each
// rank times with CUDA events, after the warm-up, the median of --iters steps of:
//   forward_eager         the eager forward
//   backward_sequential   backward, then backward_dw, on one stream
//   backward_overlap      backward with its exchanges on a second stream and backward_dw on the
//                         compute stream while the combine of dxr is in flight
//   exchanges             ep_dispatch + ep_combine of the same rows alone (backward's two exchanges:
//                         dyp out, dxr and dpr back)
//   exchanges_combine     the ep_combine alone (the one exchange that backward_dw can overlap: the
//                         dispatch of dyp precedes the experts' backward, which needs its rows)
//   wgrad                 the experts' backward_dw alone
// The table shows the largest of the ranks' medians, the time the overlap saved (sequential -
// overlap) and its share of the shorter of the overlapped parts: of min(exchanges, wgrad), and of
// min(combine, wgrad), the most this overlap can hide (only the combine runs beside backward_dw).
//
// Every timed step starts after a device-side barrier (an ep_plan, an all-gather of the counts),
// so that the ranks' start events line up and a rank that enqueues late is not charged to its
// peers. All ranks run the same steps in the same order (the collectives pair up).
//
// The parent makes the NCCL unique ids before any CUDA call (a forked child cannot use a CUDA
// driver its parent initialised; the GPU count comes from a probe child), forks one child per GPU,
// and reads each child's medians back through a pipe. Fewer than 2 GPUs: prints
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

enum Pass { kForward, kSequential, kOverlap, kExchanges, kCombine, kWgrad, kNumPasses };
// JSON passes: bench/torch_ep_baseline.py's gmoe_ep rows of the same cases already have a
// "forward" and a "combine" (which bench/report.py reads), so these are named apart.
constexpr const char* kPassNames[kNumPasses] = {"forward_eager", "backward_sequential", "backward_overlap", "exchanges",
                                                "exchanges_combine", "wgrad"};

// What a child sends back: its medians per case and pass (-1: not run), its device, its error.
struct Report {
  double ms[kNumCases][kNumPasses];
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

// One case on one rank: fills `ms` with the medians of every pass.
void run_case(const Case& c, int rank, int ranks, const gmoe::EpUniqueId& id, int warmup, int iters,
              cudaStream_t s, cudaStream_t comm, double* ms) {
  using namespace gmoe;
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

  cudaEvent_t start = nullptr, stop = nullptr;
  cuda_ok(cudaEventCreate(&start), "cudaEventCreate");
  cuda_ok(cudaEventCreate(&stop), "cudaEventCreate");
  struct EventGuard {
    cudaEvent_t a, b;
    ~EventGuard() {
      cudaEventDestroy(a);
      cudaEventDestroy(b);
    }
  } events{start, stop};
  // `prepare` untimed, then the barrier, then `body` between the events; the median over `iters`
  // after `warmup` steps.
  auto timed = [&](const std::function<void()>& prepare, const std::function<void()>& body) {
    std::vector<double> t;
    for (int i = 0; i < warmup + iters; ++i) {
      prepare();
      barrier();
      cuda_ok(cudaEventRecord(start, s), "cudaEventRecord");
      body();
      cuda_ok(cudaEventRecord(stop, s), "cudaEventRecord");
      cuda_ok(cudaEventSynchronize(stop), "cudaEventSynchronize");
      float e = 0;
      cuda_ok(cudaEventElapsedTime(&e, start, stop), "cudaEventElapsedTime");
      if (i >= warmup) t.push_back(e);
    }
    return median(t);
  };
  auto forward = [&] { layer.forward(xv, logitsv, ctx, s); };
  auto backward_in_order = [&] {
    MoEBackward b = layer.backward(ctx, doutv, s);
    GroupedMLPGrads dw = experts.backward_dw(ctx.experts(), s);
  };
  MoEBackwardOverlap overlap;
  overlap.comm_stream = comm;
  overlap.experts_wgrad_during_combine = true;

  ms[kForward] = timed([] {}, forward);
  ms[kSequential] = timed(forward, backward_in_order);
  ms[kOverlap] = timed(forward, [&] { MoEBackward b = layer.backward(ctx, doutv, s, {}, {}, overlap); });
  ms[kWgrad] = timed([&] { forward(); MoEBackward b = layer.backward(ctx, doutv, s); },
                    [&] { GroupedMLPGrads dw = experts.backward_dw(ctx.experts(), s); });

  // Backward's exchanges alone, on this routing's plan: dyp [max_rows, H] out, dxr [recv, H] with
  // dpr f32 [recv] back.
  const EpPlan plan = ep_plan(*group, layer.forward(xv, logitsv, ctx, s).counts, nullptr, s);
  DeviceBytes rows(size_t(go.max_rows * H) * 2), recv_scalars(size_t(group->recv_capacity()) * 4);
  cuda_ok(cudaMemsetAsync(rows.p, 0, rows.n, s), "cudaMemset");
  cuda_ok(cudaMemsetAsync(recv_scalars.p, 0, recv_scalars.n, s), "cudaMemset");
  const TensorView rows_view(rows.p, DType::bf16, dev, {go.max_rows, H});
  const TensorView scalars_view(recv_scalars.p, DType::f32, dev, {group->recv_capacity()});
  ms[kExchanges] = timed([] {}, [&] {
    EpRows there = ep_dispatch(*group, plan, rows_view, {}, nullptr, s);
    EpRows back = ep_combine(*group, plan, there.rows.view(), scalars_view, nullptr, s);
  });
  EpRows there;
  ms[kCombine] = timed([&] { there = ep_dispatch(*group, plan, rows_view, {}, nullptr, s); },
                       [&] { EpRows back = ep_combine(*group, plan, there.rows.view(), scalars_view, nullptr, s); });
  there = {};
  cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  check_device_errors(s);
}

int child_main(int rank, int ranks, const std::vector<gmoe::EpUniqueId>& ids, int warmup, int iters,
               const std::string& filter, Report& rep) {
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
      run_case(kCases[i], rank, ranks, ids[static_cast<size_t>(i)], warmup, iters, s, comm, rep.ms[i]);
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gmoe-ep-bench: MoELayer backward with expert parallelism on NCCL, its exchanges in order and "
               "overlapped with the experts' delayed weight gradients (one process per GPU)"};
  int ranks = -1, warmup = 3, iters = 20;
  std::string filter, json;
  app.add_option("--ranks", ranks, "ranks, one per GPU (default: every visible GPU)");
  app.add_option("--case", filter, "run only the cases whose name contains this");
  app.add_option("--warmup", warmup, "untimed steps per pass")->check(CLI::NonNegativeNumber);
  app.add_option("--iters", iters, "timed steps per pass (the median is reported)")->check(CLI::PositiveNumber);
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
  std::printf("gmoe-ep-bench: %d ranks, warm-up %d, median of %d\n", ranks, warmup, iters);
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
    for (auto& row : rep->ms) std::fill(std::begin(row), std::end(row), -1.0);
    const int rc = child_main(r, ranks, ids, warmup, iters, filter, *rep);
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

  // The largest of the ranks' medians.
  std::vector<gmoe::bench::ResultRow> rows;
  std::printf("\n%-26s %8s %8s %8s %8s %8s %8s %8s %7s %7s\n", "case", "fwd ms", "seq ms", "ovl ms", "exch ms",
              "comb ms", "wgrad ms", "saved ms", "hid/ex", "hid/cb");
  for (int i = 0; i < kNumCases; ++i) {
    double m[kNumPasses];
    for (int p = 0; p < kNumPasses; ++p) {
      m[p] = -1;
      for (int r = 0; r < ranks; ++r) m[p] = std::max(m[p], reports[r].ms[i][p]);
    }
    if (m[kForward] < 0) continue;
    const double saved = m[kSequential] - m[kOverlap];
    const double hidden = saved / std::min(m[kExchanges], m[kWgrad]);
    const double hidden_combine = saved / std::min(m[kCombine], m[kWgrad]);
    std::printf("%-26s %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %6.0f%% %6.0f%%\n", kCases[i].name, m[kForward],
                m[kSequential], m[kOverlap], m[kExchanges], m[kCombine], m[kWgrad], saved, 100 * hidden,
                100 * hidden_combine);
    for (int p = 0; p < kNumPasses; ++p) {
      gmoe::bench::ResultRow row = gmoe::bench::timed_row(kCases[i].name, kPassNames[p], "gmoe_ep", "bf16", m[p], 0);
      row.kind = "ep";
      if (p == kOverlap) {
        row.note = "saved " + fmt(saved, 3) + " ms: " + fmt(100 * hidden, 0) + "% of min(exchanges, wgrad), " +
                   fmt(100 * hidden_combine, 0) + "% of min(combine, wgrad)";
      }
      rows.push_back(row);
    }
  }
  std::printf("\nlargest of %d ranks' medians. seq: backward + backward_dw on one stream; ovl: backward with "
              "MoEBackwardOverlap{comm_stream, experts_wgrad_during_combine}; exch: backward's ep_dispatch + "
              "ep_combine alone; comb: the ep_combine alone; wgrad: backward_dw alone; saved = seq - ovl; hid/ex = saved / "
              "min(exch, wgrad); hid/cb = saved / min(comb, wgrad)\n",
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
  return 0;
}
