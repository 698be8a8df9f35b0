// tests/dist/ep_moe_layer_multi_gpu.cpp — MoELayer with expert parallelism on the NCCL backend, in
// gmoe_tests_ep's children (one process per GPU; see ep_multi_gpu.cpp).
//
// Every rank builds the same world from the shared seed: E = 4·R experts (bf16), each rank's tokens
// and their logits and output gradients, the global batch being the ranks' tokens in rank order.
// Rank r's EP layer holds experts [4r, 4r + 4) and runs on its tokens; each rank also runs the
// single-GPU layer holding all E experts on the whole global batch, and checks its own share of
// that reference: its tokens' out, dx and dlogits, its experts' weight gradients. Both run with the
// same kernels forced (gmoe/tuning.h: the heuristics read the capacity, which differs), so
// everything is compared bit for bit: a token's rows meet the same per-row GEMMs and the same
// slot-order combine, and without padding an expert's rows reach its rank in the global batch's
// order (by source rank, then source order), so its weight-gradient sums run in the same order.
// Checks: random routing with unequal token counts; everything routed to rank 0's experts with the
// last rank holding no token (every other rank receives nothing); backward's exchanges on a second
// stream with the delayed weight gradients during the combine (the bits of the sequential order);
// forward and backward of that overlapped layer captured once in a CUDA graph in global capture
// mode (a host sync anywhere fails the capture) and replayed under three routings, each checked.
#include "dist/ep_moe_layer_multi_gpu.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/float_convert.h"
#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/moe_layer.h"
#include "gmoe/routing.h"
#include "gmoe/tuning.h"

namespace gmoe::test {
namespace {

void cuda_ok(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

constexpr int64_t kLocalExperts = 4, kHidden = 256, kFfn = 128, kTopK = 2;

// The same on every rank: the experts' weights and the global batch.
struct World {
  int R = 0;
  int64_t E = 0, T = 0;
  std::vector<int64_t> tokens, first;  // per rank
  std::vector<uint16_t> w1, w2, x, dout;
  std::vector<float> logits;

  World(int ranks, std::vector<int64_t> per_rank, std::mt19937_64& gen)
      : R(ranks), E(kLocalExperts * ranks), tokens(std::move(per_rank)) {
    for (int64_t t : tokens) {
      first.push_back(T);
      T += t;
    }
    auto fill = [&](std::vector<uint16_t>& v, int64_t n, float scale) {
      std::uniform_real_distribution<float> u(-scale, scale);
      v.resize(static_cast<size_t>(n));
      for (uint16_t& b : v) b = float_to_bf16_bits(u(gen));
    };
    fill(w1, E * 2 * kFfn * kHidden, 0.1f);
    fill(w2, E * kHidden * kFfn, 0.1f);
    fill(x, T * kHidden, 1.0f);
    fill(dout, T * kHidden, 1.0f);
    route(-1, gen);
  }
  // Fresh logits; target >= 0: the experts of rank `target` outscore every other for every token.
  void route(int target, std::mt19937_64& gen) {
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    logits.resize(static_cast<size_t>(T * E));
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t e = 0; e < E; ++e) logits[t * E + e] = u(gen) + (e / kLocalExperts == target ? 8.0f : 0.0f);
    }
  }
};

// An owning device buffer (cudaMalloc: set-up, never inside a pass).
struct DeviceBytes {
  void* p = nullptr;
  explicit DeviceBytes(size_t n) { cuda_ok(cudaMalloc(&p, std::max<size_t>(n, 1)), "cudaMalloc"); }
  ~DeviceBytes() { cudaFree(p); }
  DeviceBytes(const DeviceBytes&) = delete;
  DeviceBytes& operator=(const DeviceBytes&) = delete;
};

// Graph-safe memory: a bump arena over one cudaMalloc; free() does nothing (nothing is ever
// handed out twice, so the captured pass's buffers stay its own across replays).
class Arena final : public Allocator {
 public:
  Arena(int device, size_t bytes) : device_(device), bytes_(bytes), mem_(bytes) {}
  void* allocate(std::size_t bytes, Stream) override {
    if (bytes == 0) return nullptr;
    const size_t at = (used_ + 255) / 256 * 256;
    if (at + bytes > bytes_) throw std::runtime_error("moe_layer_ep_checks: arena exhausted");
    used_ = at + bytes;
    return static_cast<char*>(mem_.p) + at;
  }
  void free(void*, Stream) override {}
  Device device() const override { return Device::cuda(device_); }

 private:
  int device_;
  size_t bytes_, used_ = 0;
  DeviceBytes mem_;
};

// The world on this rank's device (the global tensors; a rank's share is a view of rows).
struct DeviceWorld {
  int dev;
  DeviceBytes w1, w2, x, dout, logits;
  DeviceWorld(const World& w, int device)
      : dev(device), w1(w.w1.size() * 2), w2(w.w2.size() * 2), x(w.x.size() * 2), dout(w.dout.size() * 2),
        logits(w.logits.size() * 4) {}
  void upload(const World& w, cudaStream_t s) {
    cuda_ok(cudaMemcpyAsync(w1.p, w.w1.data(), w.w1.size() * 2, cudaMemcpyHostToDevice, s), "upload w1");
    cuda_ok(cudaMemcpyAsync(w2.p, w.w2.data(), w.w2.size() * 2, cudaMemcpyHostToDevice, s), "upload w2");
    upload_batch(w, s);
  }
  // Only the batch (the routing changes, the weights do not).
  void upload_batch(const World& w, cudaStream_t s) {
    cuda_ok(cudaMemcpyAsync(x.p, w.x.data(), w.x.size() * 2, cudaMemcpyHostToDevice, s), "upload x");
    cuda_ok(cudaMemcpyAsync(dout.p, w.dout.data(), w.dout.size() * 2, cudaMemcpyHostToDevice, s), "upload dout");
    cuda_ok(cudaMemcpyAsync(logits.p, w.logits.data(), w.logits.size() * 4, cudaMemcpyHostToDevice, s),
            "upload logits");
  }
  // Rows [first, first + n) of a [rows, cols] tensor.
  TensorView rows(const DeviceBytes& b, DType dt, int64_t cols, int64_t first, int64_t n) const {
    return TensorView(static_cast<char*>(b.p) + first * cols * static_cast<int64_t>(dtype_size(dt)), dt,
                      Device::cuda(dev), {n, cols});
  }
  // Experts [first, first + n) of a stacked [E, N, K] bf16 tensor.
  TensorView experts(const DeviceBytes& b, int64_t N, int64_t K, int64_t first, int64_t n) const {
    return TensorView(static_cast<char*>(b.p) + first * N * K * 2, DType::bf16, Device::cuda(dev), {n, N, K});
  }
};

template <typename T>
std::vector<T> download(const TensorView& v, cudaStream_t s) {
  std::vector<T> h(static_cast<size_t>(v.nbytes() / static_cast<int64_t>(sizeof(T))));
  if (!h.empty()) cuda_ok(cudaMemcpyAsync(h.data(), v.data, h.size() * sizeof(T), cudaMemcpyDeviceToHost, s), "d2h");
  cuda_ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return h;
}

// A stacked gradient's experts, dense (the expert stride may be padded).
std::vector<uint16_t> download_experts(const TensorView& v, cudaStream_t s) {
  std::vector<uint16_t> out;
  for (int64_t e = 0; e < v.size(0); ++e) {
    const TensorView one(static_cast<char*>(v.data) + e * v.stride(0) * 2, v.dtype, v.device, {v.size(1), v.size(2)});
    const std::vector<uint16_t> h = download<uint16_t>(one, s);
    out.insert(out.end(), h.begin(), h.end());
  }
  return out;
}

struct Outputs {
  std::vector<uint16_t> out, dx, dw1, dw2;
  std::vector<float> dlogits;
  std::vector<int32_t> counts;
};

// Experts [first, first + n) and the layer over them, in `group` (nullptr: single-GPU).
struct Layer {
  GroupedMLP experts;
  MoELayer layer;
  MoELayerContext ctx;
  MoEForward f;
  MoEBackward b;
  bool delayed;

  static GroupedMLPOptions mlp_options(bool delay, Allocator* a) {
    GroupedMLPOptions o;
    o.fc1.delay_wgrad = delay;
    o.fc2.delay_wgrad = delay;
    o.allocator = a;
    return o;
  }
  static MoELayerOptions layer_options(EpGroup* group, Allocator* a) {
    MoELayerOptions o;
    o.router.top_k = kTopK;
    o.router.normalize = true;
    o.allocator = a;
    o.ep = group;
    return o;
  }
  Layer(const DeviceWorld& d, int64_t first, int64_t n, EpGroup* group, bool delay, Allocator* a)
      : experts(ExpertWeights::from_stacked(d.experts(d.w1, 2 * kFfn, kHidden, first, n)),
                ExpertWeights::from_stacked(d.experts(d.w2, kHidden, kFfn, first, n)), {}, {},
                mlp_options(delay, a)),
        layer(experts, layer_options(group, a)),
        delayed(delay) {}

  // Forward and backward of tokens [t0, t0 + T); `comm`: backward's exchanges there, with the
  // delayed weight gradients during the combine (nullptr: in order, backward_dw after backward).
  void run(const DeviceWorld& d, int64_t t0, int64_t T, int64_t E, cudaStream_t s, cudaStream_t comm) {
    f = layer.forward(d.rows(d.x, DType::bf16, kHidden, t0, T), d.rows(d.logits, DType::f32, E, t0, T), ctx, s);
    MoEBackwardOverlap overlap;
    overlap.comm_stream = comm;
    overlap.experts_wgrad_during_combine = comm != nullptr && delayed;
    b = layer.backward(ctx, d.rows(d.dout, DType::bf16, kHidden, t0, T), s, {}, {}, overlap);
    if (delayed && comm == nullptr) {
      GroupedMLPGrads dw = experts.backward_dw(ctx.experts(), s);
      b.grads = std::move(dw);
    }
  }
  Outputs outputs(cudaStream_t s) const {
    Outputs o;
    o.out = download<uint16_t>(f.out, s);
    o.dx = download<uint16_t>(b.dx, s);
    o.dlogits = download<float>(b.dlogits, s);
    o.dw1 = download_experts(b.grads.fc1.weight.stacked, s);
    o.dw2 = download_experts(b.grads.fc2.weight.stacked, s);
    o.counts = download<int32_t>(f.counts, s);
    return o;
  }
};

// The checks of one child.
struct Checker {
  int rank, ranks;
  uint64_t seed;
  cudaStream_t stream;
  int failures = 0;

  void fail(const std::string& what) {
    std::fprintf(stderr, "gmoe_tests_ep rank %d: FAIL moe_layer %s (seed %llu)\n", rank, what.c_str(),
                 static_cast<unsigned long long>(seed));
    ++failures;
  }
  // got == want[offset, offset + got.size()) bit for bit.
  template <typename T>
  void same(const std::vector<T>& got, const std::vector<T>& want, size_t offset, const std::string& what) {
    if (offset + got.size() > want.size()) {
      fail(what + ": " + std::to_string(got.size()) + " values at " + std::to_string(offset) + " past the reference's " +
           std::to_string(want.size()));
      return;
    }
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::memcmp(&got[i], &want[offset + i], sizeof(T)) != 0) {
        fail(what + ": element " + std::to_string(i) + " of " + std::to_string(got.size()) +
             " differs from the single-GPU layer's");
        return;
      }
    }
  }
  // This rank's share of the single-GPU layer's outputs on the global batch.
  void same_share(const World& w, const Outputs& got, const Outputs& ref, const std::string& what) {
    const size_t t0 = static_cast<size_t>(w.first[rank]), e0 = static_cast<size_t>(rank * kLocalExperts);
    same(got.out, ref.out, t0 * kHidden, what + " out");
    same(got.dx, ref.dx, t0 * kHidden, what + " dx");
    same(got.dlogits, ref.dlogits, t0 * static_cast<size_t>(w.E), what + " dlogits");
    same(got.dw1, ref.dw1, e0 * 2 * kFfn * kHidden, what + " dW1");
    same(got.dw2, ref.dw2, e0 * kHidden * kFfn, what + " dW2");
  }
  Outputs reference(const DeviceWorld& d, const World& w) {
    Layer ref(d, 0, w.E, nullptr, false, nullptr);
    ref.run(d, 0, w.T, w.E, stream, nullptr);
    return ref.outputs(stream);
  }
};

// Tokens per rank: unequal, the last rank's `last` (0: no tokens).
std::vector<int64_t> tokens_per_rank(int R, int64_t last) {
  std::vector<int64_t> t;
  for (int r = 0; r < R; ++r) t.push_back(r == R - 1 ? last : 48 + 16 * r);
  return t;
}

void run_checks(Checker& c, const EpUniqueId* ids) {
  const int R = c.ranks, dev = c.rank;
  std::mt19937_64 gen(c.seed + 4343);
  // The kernels of both sides forced alike (the heuristics read the capacity, which differs).
  Tuning forced;
  forced.gemm_tile = GemmTile::pingpong;
  forced.cluster = ClusterShape::c1x1;
  forced.wgrad_raster = WgradRaster::along_m;
  forced.row_chunk = 0;
  ScopedTuning scope(forced);
  cudaStream_t comm = nullptr;
  cuda_ok(cudaStreamCreateWithFlags(&comm, cudaStreamNonBlocking), "cudaStreamCreate");
  struct StreamGuard {
    cudaStream_t s;
    ~StreamGuard() { cudaStreamDestroy(s); }
  } comm_guard{comm};

  int64_t most_tokens = 0;
  for (int64_t t : tokens_per_rank(R, 96)) most_tokens = std::max(most_tokens, t);
  EpGroupOptions go;
  go.num_experts = kLocalExperts * R;
  go.hidden = kHidden;
  go.dtype = DType::bf16;
  go.max_rows = permuted_rows(most_tokens, kTopK, go.num_experts, {});
  std::unique_ptr<EpGroup> group = make_ep_group_nccl(ids[0], c.rank, R, Device::cuda(dev), go);

  // This rank's EP layer (experts delayed or not) on its tokens of `w`, backward's exchanges on
  // `on` (nullptr: in order).
  auto ep_outputs = [&](const World& w, const DeviceWorld& d, bool delayed, cudaStream_t on) {
    Layer ep(d, c.rank * kLocalExperts, kLocalExperts, group.get(), delayed, nullptr);
    ep.run(d, w.first[c.rank], w.tokens[c.rank], w.E, c.stream, on);
    return ep.outputs(c.stream);
  };
  // Random routing, unequal token counts; then the same backward with its exchanges on `comm` and
  // the delayed weight gradients during the combine.
  {
    World w(R, tokens_per_rank(R, 96), gen);
    DeviceWorld d(w, dev);
    d.upload(w, c.stream);
    const Outputs got = ep_outputs(w, d, false, nullptr);
    c.same_share(w, got, c.reference(d, w), "random routing:");
    const Outputs o = ep_outputs(w, d, true, comm);
    for (const auto& [a, b, what] : {std::make_tuple(&o.out, &got.out, "out"), std::make_tuple(&o.dx, &got.dx, "dx"),
                                     std::make_tuple(&o.dw1, &got.dw1, "dW1"), std::make_tuple(&o.dw2, &got.dw2, "dW2")}) {
      c.same(*a, *b, 0, std::string("overlapped backward vs in order: ") + what);
    }
    c.same(o.dlogits, got.dlogits, 0, "overlapped backward vs in order: dlogits");
  }
  // Everything to rank 0's experts, the last rank without tokens: rank 0 receives every row, every
  // other rank none.
  {
    World w(R, tokens_per_rank(R, 0), gen);
    w.route(0, gen);
    DeviceWorld d(w, dev);
    d.upload(w, c.stream);
    const Outputs got = ep_outputs(w, d, false, nullptr);
    c.same_share(w, got, c.reference(d, w), "all to rank 0:");
    for (int64_t e = kLocalExperts; e < w.E; ++e) {
      if (got.counts[static_cast<size_t>(e)] != 0) c.fail("all to rank 0: a token routed to expert " + std::to_string(e));
    }
  }
  // The overlapped forward and backward captured once (global mode) and replayed under three
  // routings: random, everything to the last rank, everything to rank 0.
  {
    World w(R, tokens_per_rank(R, 96), gen);
    DeviceWorld d(w, dev);
    d.upload(w, c.stream);
    Arena arena(dev, size_t(256) << 20);
    Layer ep(d, c.rank * kLocalExperts, kLocalExperts, group.get(), true, &arena);
    // One eager step first: what the layer makes once per context (its events) exists before the capture.
    ep.run(d, w.first[c.rank], w.tokens[c.rank], w.E, c.stream, comm);
    cuda_ok(cudaStreamSynchronize(c.stream), "cudaStreamSynchronize");
    cudaGraph_t graph = nullptr;
    cuda_ok(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeGlobal), "cudaStreamBeginCapture");
    try {
      ep.run(d, w.first[c.rank], w.tokens[c.rank], w.E, c.stream, comm);
    } catch (...) {
      cudaStreamEndCapture(c.stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      throw;
    }
    cuda_ok(cudaStreamEndCapture(c.stream, &graph), "capturing the EP layer (a host sync inside fails it)");
    cudaGraphExec_t exec = nullptr;
    cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "cudaGraphInstantiate");
    for (int routing = 0; routing < 3; ++routing) {
      w.route(routing == 0 ? -1 : routing == 1 ? R - 1 : 0, gen);
      d.upload_batch(w, c.stream);
      cuda_ok(cudaGraphLaunch(exec, c.stream), "cudaGraphLaunch");
      const Outputs got = ep.outputs(c.stream);
      const Outputs ref = c.reference(d, w);
      c.same_share(w, got, ref, "graph replay " + std::to_string(routing) + ":");
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
  check_device_errors(c.stream);
}

}  // namespace

int moe_layer_ep_checks(int rank, int ranks, uint64_t seed, const EpUniqueId* ids, Stream stream) {
  Checker c{rank, ranks, seed, stream};
  try {
    run_checks(c, ids);
  } catch (const std::exception& e) {
    c.fail(std::string("exception: ") + e.what());
  }
  return c.failures;
}

}  // namespace gmoe::test
