// tests/dist/ep_multi_gpu.cpp — gmoe_tests_ep: expert parallelism on the NCCL backend, one process
// per GPU.
//
//   gmoe_tests_ep [--ranks R] [--seed S]
//
// The parent makes the NCCL unique ids before any CUDA call (a forked child cannot use a CUDA
// driver that its parent initialised; the GPU count comes from a probe child), then forks R
// children (R = the visible GPUs, or --ranks); child r runs on device r. Every child rebuilds the
// whole world (every rank's counts and rows) from the shared seed, so it checks its own results
// against tests/dist/ep_oracle.h computed from all ranks' inputs. Checks: random routings over
// dtypes and row widths (every vector width of the kernels), skewed routings (one rank receives
// nothing, one everything, no rows at all, a capacity exactly at the largest receiver), two
// exchanges in flight, receive overflow recorded in the device error word with the kept rows
// intact, and plan + dispatch + combine captured once in a CUDA graph (global capture mode: any
// host sync fails the capture) and replayed under three routings. A child prints each failure and
// exits non-zero; the parent exits non-zero when any child failed or hung. Where
// tests/dist/ep_moe_layer_multi_gpu.cpp exists, its MoE layer checks run last in every child.
// Fewer than 2 GPUs: the binary prints "gmoe_tests_ep: skipped" and exits 0 (CTest: skipped).
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/process_ranks.h"
#include "dist/ep_oracle.h"
#include "gmoe/allocator.h"
#include "gmoe/error.h"
#include "gmoe/expert_parallel.h"
#include "gmoe/grouped.h"
#ifdef GMOE_EP_LAYER_CHECKS
#include "dist/ep_moe_layer_multi_gpu.h"  // the MoE layer's multi-GPU checks (ep-layer's file)
#endif

namespace {

using gmoe::test::ep_oracle::Layout;
using gmoe::test::ep_oracle::World;
namespace oracle = gmoe::test::ep_oracle;
using oracle::fill_rows;
using oracle::make_world;
using oracle::options_of;

constexpr int kMaxGroups = 16;  // unique ids made by the parent: one per group a child creates
constexpr int kLayerGroups = 4;  // more ids after those, for the MoE layer's checks
#ifdef GMOE_EP_LAYER_CHECKS
static_assert(gmoe::test::kMoELayerEpGroups <= kLayerGroups, "the layer checks' groups have their ids");
#endif

#define CUDA_OK(call)                                                                                   \
  do {                                                                                                  \
    const cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) throw std::runtime_error(std::string(#call) + ": " + cudaGetErrorString(e_)); \
  } while (0)

// One child's state: its rank, the ids, the stream, and the failures so far.
struct Child {
  int rank = 0;
  int ranks = 1;
  uint64_t seed = 0;
  std::vector<gmoe::EpUniqueId> ids;
  int next_id = 0;
  cudaStream_t stream = nullptr;
  int failures = 0;

  void fail(const std::string& what) {
    std::fprintf(stderr, "gmoe_tests_ep rank %d: FAIL %s (seed %llu)\n", rank, what.c_str(),
                 static_cast<unsigned long long>(seed));
    ++failures;
  }
  std::unique_ptr<gmoe::EpGroup> group(const gmoe::EpGroupOptions& o) {
    if (next_id >= kMaxGroups) throw std::runtime_error("more groups than unique ids");
    return gmoe::make_ep_group_nccl(ids[next_id++], rank, ranks, gmoe::Device::cuda(rank), o);
  }
};

// Graph-safe outputs: a bump allocator over one cudaMalloc'd arena; free() is a no-op and reset()
// starts over (the test owns the lifetimes).
class Arena final : public gmoe::Allocator {
 public:
  Arena(int device, size_t bytes) : device_(device), bytes_(bytes) { CUDA_OK(cudaMalloc(&base_, bytes)); }
  ~Arena() override { cudaFree(base_); }
  void* allocate(std::size_t bytes, gmoe::Stream) override {
    if (bytes == 0) return nullptr;
    const size_t at = (used_ + 255) / 256 * 256;
    if (at + bytes > bytes_) throw std::runtime_error("arena exhausted");
    used_ = at + bytes;
    return static_cast<char*>(base_) + at;
  }
  void free(void*, gmoe::Stream) override {}
  gmoe::Device device() const override { return gmoe::Device::cuda(device_); }
  void reset() { used_ = 0; }

 private:
  int device_;
  size_t bytes_;
  void* base_ = nullptr;
  size_t used_ = 0;
};

// Device copies of one rank's inputs.
struct DeviceBuf {
  void* p = nullptr;
  size_t bytes = 0;
  explicit DeviceBuf(size_t n) : bytes(n) { CUDA_OK(cudaMalloc(&p, n == 0 ? 1 : n)); }
  ~DeviceBuf() { cudaFree(p); }
  DeviceBuf(const DeviceBuf&) = delete;
  DeviceBuf& operator=(const DeviceBuf&) = delete;
  void upload(const void* src, cudaStream_t s) { CUDA_OK(cudaMemcpyAsync(p, src, bytes, cudaMemcpyHostToDevice, s)); }
};

template <typename T>
std::vector<T> download(const gmoe::TensorView& v, cudaStream_t s) {
  std::vector<T> h(static_cast<size_t>(v.nbytes()) / sizeof(T));
  CUDA_OK(cudaStreamSynchronize(s));
  CUDA_OK(cudaMemcpy(h.data(), v.data, static_cast<size_t>(v.nbytes()), cudaMemcpyDeviceToHost));
  return h;
}

Layout download_layout(const gmoe::EpRows& r, cudaStream_t s) {
  Layout l{download<uint8_t>(r.rows.view(), s), {}};
  if (r.scalars.view().defined()) l.scalars = download<float>(r.scalars.view(), s);
  return l;
}

bool same_layout(Child& c, const Layout& got, const Layout& want, size_t row_bytes, const std::string& what) {
  if (got.rows.size() != want.rows.size()) {
    c.fail(what + ": " + std::to_string(got.rows.size()) + " row bytes, want " + std::to_string(want.rows.size()));
    return false;
  }
  for (size_t i = 0; i * row_bytes < want.rows.size(); ++i) {
    if (std::memcmp(got.rows.data() + i * row_bytes, want.rows.data() + i * row_bytes, row_bytes) != 0) {
      c.fail(what + ": row " + std::to_string(i) + " differs");
      return false;
    }
  }
  if (got.scalars != want.scalars) {
    c.fail(what + ": scalars differ");
    return false;
  }
  return true;
}

// This rank's device inputs of a world.
struct Inputs {
  DeviceBuf counts, rows, scalars, fresh_rows, fresh_scalars;
  Inputs(const World& w, int r, const Layout& fresh, cudaStream_t s)
      : counts(w.counts[r].size() * 4),
        rows(w.rows[r].size()),
        scalars(w.scalars[r].size() * 4),
        fresh_rows(fresh.rows.size()),
        fresh_scalars(fresh.scalars.size() * 4) {
    counts.upload(w.counts[r].data(), s);
    rows.upload(w.rows[r].data(), s);
    scalars.upload(w.scalars[r].data(), s);
    fresh_rows.upload(fresh.rows.data(), s);
    fresh_scalars.upload(fresh.scalars.data(), s);
    CUDA_OK(cudaStreamSynchronize(s));
  }
};

gmoe::TensorView dview(const DeviceBuf& b, gmoe::DType dt, std::initializer_list<int64_t> shape, int dev) {
  return gmoe::TensorView(b.p, dt, gmoe::Device::cuda(dev), shape);
}

// Checks one exchange's downloaded results against the oracle.
void check_results(Child& c, const World& w, const std::vector<int32_t>& counts_all,
                   const std::vector<int32_t>& local_counts, const Layout& dispatched, const Layout& back,
                   const Layout* combined, const std::vector<Layout>& fresh, const std::string& name) {
  std::vector<int32_t> all;
  for (const auto& v : w.counts) all.insert(all.end(), v.begin(), v.end());
  if (counts_all != all) c.fail(name + ": counts_all");
  if (local_counts != oracle::local_counts(w, c.rank)) c.fail(name + ": local_counts");
  same_layout(c, dispatched, oracle::dispatch(w, c.rank, oracle::sources(w)), w.row_bytes(), name + ": dispatch");
  // combine(dispatch(x)): x where its rows were received, zeros elsewhere (the oracle's combine of
  // the oracle's dispatch, which drops what passes recv_cap).
  std::vector<Layout> recv;
  for (int r = 0; r < w.ranks; ++r) recv.push_back(oracle::dispatch(w, r, oracle::sources(w)));
  same_layout(c, back, oracle::combine(w, c.rank, recv), w.row_bytes(), name + ": combine(dispatch(x))");
  if (combined != nullptr) {
    same_layout(c, *combined, oracle::combine(w, c.rank, fresh), w.row_bytes(), name + ": combine");
  }
}

// One exchange on a fresh group: plan, dispatch, combine of the dispatched rows, combine of fresh
// rows; with `overflow`, the device error word must report the drop.
void run_exchange(Child& c, World w, gmoe::DType dt, int64_t max_recv_rows, std::mt19937_64& gen,
                  const std::string& name, bool overflow = false) {
  fill_rows(w, gen);
  std::vector<Layout> fresh;
  for (int r = 0; r < w.ranks; ++r) fresh.push_back(oracle::random_layout(w.recv_cap, w, gen));
  auto g = c.group(options_of(w, dt, max_recv_rows));
  const int dev = c.rank;
  Inputs in(w, c.rank, fresh[c.rank], c.stream);
  gmoe::EpPlan plan = gmoe::ep_plan(*g, dview(in.counts, gmoe::DType::i32, {w.experts}, dev), nullptr, c.stream);
  gmoe::EpRows d = gmoe::ep_dispatch(*g, plan, dview(in.rows, dt, {w.max_rows, w.hidden}, dev),
                                     dview(in.scalars, gmoe::DType::f32, {w.max_rows}, dev), nullptr, c.stream);
  gmoe::EpRows b = gmoe::ep_combine(*g, plan, d.rows, d.scalars, nullptr, c.stream);
  gmoe::EpRows x = gmoe::ep_combine(*g, plan, dview(in.fresh_rows, dt, {w.recv_cap, w.hidden}, dev),
                                    dview(in.fresh_scalars, gmoe::DType::f32, {w.recv_cap}, dev), nullptr, c.stream);
  const Layout combined = download_layout(x, c.stream);
  check_results(c, w, download<int32_t>(plan.counts_all.view(), c.stream),
                download<int32_t>(plan.local_counts.view(), c.stream), download_layout(d, c.stream),
                download_layout(b, c.stream), &combined, fresh, name);
  bool reported = false;
  try {
    gmoe::check_device_errors(c.stream);
  } catch (const gmoe::Error& e) {
    reported = std::string(e.what()).find("past the capacity") != std::string::npos;
    if (!overflow) c.fail(name + ": unexpected device error: " + e.what());
  }
  // With an overflow every rank that pushed a dropped row records it; a rank may have pushed none.
  if (overflow && !reported) {
    bool pushed_past = false;
    for (int r = 0; r < w.ranks; ++r) {
      oracle::for_each_received(w, r, [&](int s, int64_t, int64_t, int64_t pos) {
        if (s == c.rank && pos >= w.recv_cap) pushed_past = true;
      });
    }
    if (pushed_past) c.fail(name + ": the dropped rows were not recorded in the device error word");
  }
}

void random_cases(Child& c) {
  const int R = c.ranks;
  struct Case {
    gmoe::DType dt;
    int64_t H, El, max_rows;
  };
  // Row bytes 20 (4-byte vectors), 48 (16), 6 (2), 7 (1), and a DeepSeek-V3-like row (16).
  const Case cases[] = {{gmoe::DType::f32, 5, 3, 37},
                        {gmoe::DType::bf16, 24, 2, 64},
                        {gmoe::DType::f16, 3, 1, 19},
                        {gmoe::DType::e4m3, 7, 4, 50},
                        {gmoe::DType::bf16, 7168, 16, 512}};
  int id = 0;
  for (const Case& k : cases) {
    std::mt19937_64 gen(c.seed + 1000 * ++id);
    World w = make_world(R, k.El, k.H, k.dt, k.max_rows, R * k.max_rows);
    std::vector<double> weight(static_cast<size_t>(w.experts));
    for (double& x : weight) x = std::uniform_real_distribution<double>(0.1, 1.0)(gen);
    weight[1] = 0.0;  // an expert that no rank routes to
    for (int s = 0; s < R; ++s) {
      w.counts[s] = oracle::spread_counts(std::uniform_int_distribution<int64_t>(0, k.max_rows)(gen), weight, gen);
    }
    run_exchange(c, w, k.dt, 0, gen, std::string("random ") + gmoe::dtype_name(k.dt) + " H=" + std::to_string(k.H));
  }
}

void skewed_cases(Child& c) {
  const int R = c.ranks;
  const int64_t El = 2, max_rows = 41;
  std::mt19937_64 gen(c.seed + 77);
  {
    World w = make_world(R, El, 16, gmoe::DType::bf16, max_rows, R * max_rows);
    std::vector<double> weight(static_cast<size_t>(R * El), 0.0);
    weight[0] = weight[1] = 1.0;  // every row to rank 0: the others receive nothing
    for (int s = 0; s < R; ++s) w.counts[s] = oracle::spread_counts(max_rows, weight, gen);
    run_exchange(c, w, gmoe::DType::bf16, 0, gen, "all rows to rank 0");
  }
  run_exchange(c, make_world(R, El, 16, gmoe::DType::bf16, max_rows, R * max_rows), gmoe::DType::bf16, 0, gen,
               "all counts zero");
  {
    World w = make_world(R, El, 16, gmoe::DType::bf16, max_rows, 0);
    std::vector<double> weight(static_cast<size_t>(R * El), 1.0);
    for (int s = 0; s < R; ++s) w.counts[s] = oracle::spread_counts(s == 0 ? 0 : max_rows, weight, gen);
    int64_t most = 1;
    for (int r = 0; r < R; ++r) {
      int64_t got = 0;
      for (int32_t x : oracle::local_counts(w, r)) got += x;
      most = std::max(most, got);
    }
    w.recv_cap = most;
    run_exchange(c, w, gmoe::DType::bf16, most, gen, "receive capacity at the largest receiver");
  }
  {
    // Every rank sends all its rows to the last rank, past its receive capacity.
    World w = make_world(R, El, 16, gmoe::DType::bf16, max_rows, max_rows + 3);
    std::vector<double> weight(static_cast<size_t>(R * El), 0.0);
    weight[R * El - 1] = weight[R * El - 2] = 1.0;
    for (int s = 0; s < R; ++s) w.counts[s] = oracle::spread_counts(max_rows, weight, gen);
    run_exchange(c, w, gmoe::DType::bf16, w.recv_cap, gen, "receive overflow", /*overflow=*/true);
  }
}

void two_in_flight(Child& c) {
  const int R = c.ranks;
  std::mt19937_64 gen(c.seed + 99);
  World a = make_world(R, 2, 32, gmoe::DType::bf16, 30, 30 * R), b = a;
  std::vector<double> weight(static_cast<size_t>(2 * R), 1.0);
  for (int s = 0; s < R; ++s) {
    a.counts[s] = oracle::spread_counts(30, weight, gen);
    b.counts[s] = oracle::spread_counts(11, weight, gen);
  }
  fill_rows(a, gen);
  fill_rows(b, gen);
  Layout none{std::vector<uint8_t>(a.recv_cap * a.row_bytes()), std::vector<float>(a.recv_cap)};
  auto g = c.group(options_of(a, gmoe::DType::bf16, 0));
  Inputs ia(a, c.rank, none, c.stream), ib(b, c.rank, none, c.stream);
  const int dev = c.rank;
  gmoe::EpPlan pa = gmoe::ep_plan(*g, dview(ia.counts, gmoe::DType::i32, {a.experts}, dev), nullptr, c.stream);
  gmoe::EpPlan pb = gmoe::ep_plan(*g, dview(ib.counts, gmoe::DType::i32, {b.experts}, dev), nullptr, c.stream);
  gmoe::EpRows ra = gmoe::ep_dispatch(*g, pa, dview(ia.rows, gmoe::DType::bf16, {30, 32}, dev),
                                      dview(ia.scalars, gmoe::DType::f32, {30}, dev), nullptr, c.stream);
  gmoe::EpRows rb = gmoe::ep_dispatch(*g, pb, dview(ib.rows, gmoe::DType::bf16, {30, 32}, dev),
                                      dview(ib.scalars, gmoe::DType::f32, {30}, dev), nullptr, c.stream);
  gmoe::EpRows xb = gmoe::ep_combine(*g, pb, rb.rows, rb.scalars, nullptr, c.stream);
  gmoe::EpRows xa = gmoe::ep_combine(*g, pa, ra.rows, ra.scalars, nullptr, c.stream);
  check_results(c, a, download<int32_t>(pa.counts_all.view(), c.stream),
                download<int32_t>(pa.local_counts.view(), c.stream), download_layout(ra, c.stream),
                download_layout(xa, c.stream), nullptr, {}, "in flight a");
  check_results(c, b, download<int32_t>(pb.counts_all.view(), c.stream),
                download<int32_t>(pb.local_counts.view(), c.stream), download_layout(rb, c.stream),
                download_layout(xb, c.stream), nullptr, {}, "in flight b");
  gmoe::check_device_errors(c.stream);
}

// plan + dispatch + combine captured once (global mode: a host sync anywhere fails the capture),
// replayed under three routings written into the captured input buffers.
void graph_replay(Child& c) {
  const int R = c.ranks;
  const int64_t El = 4, H = 256, max_rows = 96;
  const gmoe::DType dt = gmoe::DType::bf16;
  std::mt19937_64 gen(c.seed + 555);
  World w = make_world(R, El, H, dt, max_rows, R * max_rows);
  auto g = c.group(options_of(w, dt, 0));
  const int dev = c.rank;
  DeviceBuf counts(w.experts * 4), rows(max_rows * w.row_bytes()), scalars(max_rows * 4);
  Arena arena(dev, 64 << 20);
  gmoe::EpPlan plan;
  gmoe::EpRows d, b;
  cudaGraph_t graph = nullptr;
  CUDA_OK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeGlobal));
  try {
    plan = gmoe::ep_plan(*g, dview(counts, gmoe::DType::i32, {w.experts}, dev), &arena, c.stream);
    d = gmoe::ep_dispatch(*g, plan, dview(rows, dt, {max_rows, H}, dev),
                          dview(scalars, gmoe::DType::f32, {max_rows}, dev), &arena, c.stream);
    b = gmoe::ep_combine(*g, plan, d.rows, d.scalars, &arena, c.stream);
  } catch (...) {
    cudaStreamEndCapture(c.stream, &graph);
    throw;
  }
  CUDA_OK(cudaStreamEndCapture(c.stream, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  for (int routing = 0; routing < 3; ++routing) {
    std::vector<double> weight(static_cast<size_t>(w.experts), 1.0);
    if (routing == 1) {  // everything to the last rank
      std::fill(weight.begin(), weight.end(), 0.0);
      weight.back() = 1.0;
    }
    for (int s = 0; s < R; ++s) {
      const int64_t total = routing == 2 ? (s % 2 == 0 ? 0 : max_rows) : max_rows / (routing + 1);
      w.counts[s] = oracle::spread_counts(total, weight, gen);
    }
    fill_rows(w, gen);
    counts.upload(w.counts[c.rank].data(), c.stream);
    rows.upload(w.rows[c.rank].data(), c.stream);
    scalars.upload(w.scalars[c.rank].data(), c.stream);
    CUDA_OK(cudaGraphLaunch(exec, c.stream));
    check_results(c, w, download<int32_t>(plan.counts_all.view(), c.stream),
                  download<int32_t>(plan.local_counts.view(), c.stream), download_layout(d, c.stream),
                  download_layout(b, c.stream), nullptr, {}, "graph replay " + std::to_string(routing));
  }
  gmoe::check_device_errors(c.stream);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
}

int child_main(Child c) {
  try {
    CUDA_OK(cudaSetDevice(c.rank));
    CUDA_OK(cudaStreamCreateWithFlags(&c.stream, cudaStreamNonBlocking));
    random_cases(c);
    skewed_cases(c);
    two_in_flight(c);
    graph_replay(c);
#ifdef GMOE_EP_LAYER_CHECKS
    c.failures += gmoe::test::moe_layer_ep_checks(c.rank, c.ranks, c.seed, c.ids.data() + kMaxGroups, c.stream);
#endif
  } catch (const std::exception& e) {
    c.fail(std::string("exception: ") + e.what());
  }
  std::printf("gmoe_tests_ep rank %d: %s\n", c.rank, c.failures == 0 ? "passed" : "FAILED");
  std::fflush(stdout);
  std::fflush(stderr);
  return c.failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = -1;
  uint64_t seed = std::random_device{}();
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--ranks" && i + 1 < argc) {
      ranks = std::atoi(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      seed = std::strtoull(argv[++i], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: %s [--ranks R] [--seed S]\n", argv[0]);
      return 2;
    }
  }
  const int gpus = gmoe::bench::count_gpus_in_child([] {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  });
  if (ranks < 0) ranks = gpus;
  if (gpus < 2 || ranks < 2 || ranks > gpus) {
    std::printf("gmoe_tests_ep: skipped: %d GPU(s) visible, %d rank(s) asked; needs at least 2 ranks, one per GPU\n",
                gpus, ranks);
    return 0;
  }
  // NVLink multicast stays off (the machines' rule); the children inherit it.
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  std::vector<gmoe::EpUniqueId> ids;
  try {
    for (int i = 0; i < kMaxGroups + kLayerGroups; ++i) ids.push_back(gmoe::ep_unique_id());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gmoe_tests_ep: ep_unique_id failed: %s\n", e.what());
    return 1;
  }
  std::printf("gmoe_tests_ep: %d ranks, seed %llu (replay with --seed)\n", ranks, static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  auto child = [&](int r) {
    Child c;
    c.rank = r;
    c.ranks = ranks;
    c.seed = seed;
    c.ids = ids;
    return child_main(c);
  };
  const std::vector<int> result = gmoe::bench::run_ranks(ranks, child, std::chrono::seconds(480), "gmoe_tests_ep");
  int failed = 0;
  for (int r = 0; r < ranks; ++r) failed += result[r] != 0;
  std::printf("gmoe_tests_ep: %d of %d ranks passed\n", ranks - failed, ranks);
  return failed == 0 ? 0 : 1;
}
