// tests/layers/test_moe_layer_ep.cpp — MoELayer with expert parallelism on the CPU backend's
// in-process group (make_ep_group_local: R ranks, one thread each), against the single-GPU layer.
//
// The reference is the EP = 1 layer holding all E experts run on the global batch, the
// concatenation of the ranks' tokens in rank order; rank r holds experts [r·El, (r+1)·El). On the
// CPU everything is bitwise: a token's rows go through the same per-row GEMMs and the combine sums
// its slots in slot order on either side, and an expert's rows reach its rank in the global
// batch's row order (by source rank, then source order), so the weight and bias gradients, sums
// over those rows in order, are bitwise too (padding rows sit elsewhere but add exact zeros). No
// tolerance is needed, and none is used. What is per rank is tested against the EP = 1 layer on the
// rank's tokens alone: the load-balancing and z losses, and the capacity drops. Then the overlap of
// backward's exchanges with the experts' delayed weight gradients against the sequential order, the
// EP context offloaded and reloaded, checkpoints saved under one EP size and loaded under another,
// and the argument errors. Every rank's allocator poisons what is freed, so a buffer the layer
// releases too early shows.
#include <gtest/gtest.h>

#include <cstring>
#include <exception>
#include <functional>
#include <ostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "checkpoint/ckpt_test_util.h"  // TempDir
#include "common/offload_fixture.h"
#include "common/routing_oracle.h"
#include "gmoe/checkpoint.h"
#include "gmoe/expert_parallel.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/moe_layer.h"
#include "gmoe/offload.h"

namespace gmoe::test {
namespace {

// Where the routing is steered: nowhere (random logits), or every token to the experts of the
// first or the last rank (that rank receives every row, the others none).
enum class Skew { none, to_first_rank, to_last_rank };

struct EpCase {
  std::string name;
  int R;                        // ranks
  std::vector<int64_t> tokens;  // per rank
  int64_t El, H, F;
  RouterOptions router;
  PermuteOptions permute;
  Skew skew = Skew::none;
  bool gpt_oss = false;     // FC1 and FC2 biases, clamped SwiGLU: the weighted combine
  bool recompute = false;   // the experts' recompute_activation
  bool keep_input = false;  // fc1.save_original_input: the experts keep the received rows by reference
};

// gtest prints the case by its name.
void PrintTo(const EpCase& c, std::ostream* os) { *os << c.name; }

RouterOptions softmax_topk(int64_t k) {
  RouterOptions r;
  r.top_k = k;
  r.normalize = true;
  return r;
}

PermuteOptions padded(int64_t multiple) {
  PermuteOptions p;
  p.pad_multiple = multiple;
  return p;
}

std::vector<EpCase> ep_cases() {
  const RouterOptions groups = router_options(3, RouterScore::sigmoid, true, 4, 2, 1.5f);
  const PermuteOptions plain;
  std::vector<EpCase> c = {
      {"softmax_top2_ep2", 2, {7, 9}, 2, 12, 6, softmax_topk(2), plain},
      {"sigmoid_groups_ep4", 4, {5, 3, 6, 4}, 2, 8, 4, groups, plain},
      {"padded_ep2", 2, {9, 6}, 3, 8, 4, softmax_topk(2), padded(4)},
      {"padded_ep4", 4, {4, 7, 5, 6}, 2, 8, 4, softmax_topk(2), padded(3)},
      {"zero_tokens_on_rank0_ep2", 2, {0, 11}, 2, 8, 4, softmax_topk(2), plain},
      {"zero_tokens_on_two_ranks_padded_ep4", 4, {6, 0, 5, 0}, 2, 8, 4, softmax_topk(2), padded(4)},
      {"all_to_first_rank_ep2", 2, {8, 10}, 2, 8, 4, softmax_topk(2), plain, Skew::to_first_rank},
      {"all_to_last_rank_padded_ep4", 4, {5, 6, 3, 7}, 2, 8, 4, softmax_topk(2), padded(4), Skew::to_last_rank},
      {"gpt_oss_bias_padded_ep2", 2, {7, 8}, 2, 12, 6, softmax_topk(2), padded(4), Skew::none, true},
      {"gpt_oss_bias_all_to_first_rank_ep4", 4, {4, 5, 6, 3}, 2, 8, 4, softmax_topk(2), plain, Skew::to_first_rank,
       true},
  };
  EpCase recompute{"recompute_padded_ep2", 2, {8, 7}, 2, 8, 4, softmax_topk(2), padded(4)};
  recompute.recompute = true;
  EpCase keep{"keep_received_input_ep4", 4, {5, 4, 6, 5}, 2, 8, 4, softmax_topk(2), plain};
  keep.keep_input = true;
  c.push_back(recompute);
  c.push_back(keep);
  return c;
}

// The global experts (E = El·R of them) and the global batch, and the views of a rank's share.
struct Problem {
  int64_t E, H, F, T = 0;
  std::vector<int64_t> tokens, first_token;  // per rank
  bool gpt_oss;
  HostTensor w1, w2, b1, b2, x, logits, dout;

  Problem(const EpCase& c, Rng& rng)
      : E(c.El * c.R), H(c.H), F(c.F), tokens(c.tokens), gpt_oss(c.gpt_oss) {
    for (int64_t t : tokens) {
      first_token.push_back(T);
      T += t;
    }
    w1 = HostTensor(DType::f32, {E, 2 * F, H});
    w2 = HostTensor(DType::f32, {E, H, F});
    b1 = HostTensor(DType::f32, {E, 2 * F});
    b2 = HostTensor(DType::f32, {E, H});
    x = HostTensor(DType::f32, {T, H});
    logits = HostTensor(DType::f32, {T, E});
    dout = HostTensor(DType::f32, {T, H});
    fill_random(w1, rng, -0.5, 0.5);
    fill_random(w2, rng, -0.5, 0.5);
    fill_random(b1, rng, -0.5, 0.5);
    fill_random(b2, rng, -0.5, 0.5);
    fill_random(x, rng);
    fill_random(logits, rng, -2.0, 2.0);
    fill_random(dout, rng);
    if (c.skew != Skew::none) {
      // The target rank's experts outscore every other by far for every token.
      const int target = c.skew == Skew::to_first_rank ? 0 : c.R - 1;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t e = target * c.El; e < (target + 1) * c.El; ++e) logits.set(t * E + e, logits.get(t * E + e) + 8);
      }
    }
  }

  // Rows [first, first + n) of a [rows, cols] f32 tensor.
  static TensorView rows_of(const HostTensor& t, int64_t first, int64_t n) {
    const int64_t cols = t.shape()[1];
    return TensorView(const_cast<float*>(static_cast<const float*>(t.data())) + first * cols, DType::f32,
                      Device::cpu(), {n, cols});
  }
  // Experts [first, first + n) of a stacked [E, ...] f32 tensor.
  static TensorView experts_of(const HostTensor& t, int64_t first, int64_t n) {
    int64_t per = 1;
    for (size_t d = 1; d < t.shape().size(); ++d) per *= t.shape()[d];
    float* base = const_cast<float*>(static_cast<const float*>(t.data())) + first * per;
    return t.shape().size() == 3 ? TensorView(base, DType::f32, Device::cpu(), {n, t.shape()[1], t.shape()[2]})
                                 : TensorView(base, DType::f32, Device::cpu(), {n, t.shape()[1]});
  }
};

// Experts [first, first + n) of `p` (or of the given weights) as a GroupedMLP.
GroupedMLP make_experts(const Problem& p, const HostTensor& w1, const HostTensor& w2, int64_t first, int64_t n,
                        GroupedMLPOptions mo) {
  if (p.gpt_oss) mo.activation.kind = ActivationKind::clamped_swiglu;
  return GroupedMLP(ExpertWeights::from_stacked(Problem::experts_of(w1, first, n)),
                    ExpertWeights::from_stacked(Problem::experts_of(w2, first, n)),
                    p.gpt_oss ? ExpertBias::from_grouped(Problem::experts_of(p.b1, first, n)) : ExpertBias{},
                    p.gpt_oss ? ExpertBias::from_grouped(Problem::experts_of(p.b2, first, n)) : ExpertBias{}, mo);
}

std::vector<float> values(const TensorView& v) {
  if (!v.defined()) return {};
  const float* d = static_cast<const float*>(v.data);
  return std::vector<float>(d, d + v.numel());
}

// The experts' values of a stacked or grouped gradient, dense (the expert stride may be padded).
std::vector<float> expert_values(const TensorView& v) {
  if (!v.defined()) return {};
  const int64_t per = v.numel() / v.size(0);
  std::vector<float> out;
  for (int64_t e = 0; e < v.size(0); ++e) {
    const float* d = static_cast<const float*>(v.data) + e * v.stride(0);
    out.insert(out.end(), d, d + per);
  }
  return out;
}

// What one layer (a rank's, or the single-GPU one) produced, copied out of its buffers.
struct Result {
  std::vector<float> out, dx, dlogits, aux, z, dw1, dw2, db1, db2;
  std::vector<int32_t> counts;  // the router's, over all E experts
  int during_dispatch = 0;      // how often MoEBackwardOverlap::during_dispatch was called
  size_t offloaded = 0;         // bytes the context's offloads released
};

struct RunOptions {
  RouterOptions router;
  PermuteOptions permute;
  float aux = 0, z = 0;
  bool recompute = false, keep_input = false;
  bool delay_fc1 = false, delay_fc2 = false;  // the experts' delayed weight gradients
  bool overlap = false;                       // MoEBackwardOverlap with a comm stream and the wgrad inside
  bool offload = false;  // the context offloaded, released and reloaded before backward (and backward_dw)
};

// The case's options, with the losses' coefficients.
RunOptions run_options(const EpCase& c, float aux = 0, float z = 0) {
  RunOptions ro;
  ro.router = c.router;
  ro.permute = c.permute;
  ro.recompute = c.recompute;
  ro.keep_input = c.keep_input;
  ro.aux = aux;
  ro.z = z;
  return ro;
}

// A stream handle the CPU backend ignores (it runs every op at once), distinct from the compute
// stream so that the layer takes its two-stream path with its events.
Stream cpu_comm_stream() {
  static char tag;
  return reinterpret_cast<Stream>(&tag);
}

// Forward and backward of the layer holding experts [first, first + n) of `w1`/`w2` on tokens
// [t0, t0 + T) of `p`, in group `ep` (nullptr: single-GPU).
Result run_layer(const Problem& p, const HostTensor& w1, const HostTensor& w2, int64_t first, int64_t n, int64_t t0,
                 int64_t T, const RunOptions& ro, EpGroup* ep) {
  CountingAllocator alloc(host_allocator());  // freed blocks are poisoned: a use after release shows
  GroupedMLPOptions mo;
  mo.recompute_activation = ro.recompute;
  mo.fc1.save_original_input = ro.keep_input;
  mo.fc1.delay_wgrad = ro.delay_fc1;
  mo.fc2.delay_wgrad = ro.delay_fc2;
  mo.allocator = &alloc;
  GroupedMLP experts = make_experts(p, w1, w2, first, n, mo);
  MoELayerOptions o;
  o.router = ro.router;
  o.permute = ro.permute;
  o.aux_loss_coeff = ro.aux;
  o.z_loss_coeff = ro.z;
  o.allocator = &alloc;
  o.ep = ep;
  MoELayer layer(experts, o);
  MoELayerContext ctx;
  MoEForward f = layer.forward(Problem::rows_of(p.x, t0, T), Problem::rows_of(p.logits, t0, T), ctx);
  Result r;
  r.out = values(f.out);
  r.counts.assign(static_cast<const int32_t*>(f.counts.view().data),
                  static_cast<const int32_t*>(f.counts.view().data) + f.counts.view().numel());
  Offloader off(Device::cpu(), nullptr, &alloc);
  auto round_trip = [&] {  // what the context saved goes to the host and back
    if (!ro.offload) return;
    const size_t saved = ctx.offloadable_bytes(), before = alloc.in_use();
    ctx.offload(off, nullptr);
    ctx.release(nullptr);
    r.offloaded += before - alloc.in_use();
    EXPECT_EQ(before - alloc.in_use(), saved);
    ctx.reload(nullptr);
  };
  round_trip();
  MoEBackwardOverlap overlap;
  if (ro.overlap) {
    overlap.comm_stream = cpu_comm_stream();
    overlap.experts_wgrad_during_combine = true;
  }
  overlap.during_dispatch = [&] { ++r.during_dispatch; };
  MoEBackward b = layer.backward(ctx, Problem::rows_of(p.dout, t0, T), nullptr, {}, {}, overlap);
  if ((ro.delay_fc1 || ro.delay_fc2) && !ro.overlap) {
    round_trip();
    GroupedMLPGrads dw = experts.backward_dw(ctx.experts());
    if (ro.delay_fc1) b.grads.fc1 = std::move(dw.fc1);
    if (ro.delay_fc2) b.grads.fc2 = std::move(dw.fc2);
  }
  r.dx = values(b.dx);
  r.dlogits = values(b.dlogits);
  r.aux = values(f.aux_loss);
  r.z = values(f.z_loss);
  r.dw1 = expert_values(b.grads.fc1.weight.stacked);
  r.dw2 = expert_values(b.grads.fc2.weight.stacked);
  r.db1 = expert_values(b.grads.fc1.bias.grouped);
  r.db2 = expert_values(b.grads.fc2.bias.grouped);
  return r;
}

// The group options that fit `tokens` per rank.
EpGroupOptions group_options(const Problem& p, const RunOptions& ro) {
  EpGroupOptions go;
  go.num_experts = p.E;
  go.hidden = p.H;
  go.dtype = DType::f32;
  for (int64_t t : p.tokens) {
    go.max_rows = std::max(go.max_rows, permuted_rows(t, ro.router.top_k, p.E, ro.permute));
  }
  return go;
}

// Runs fn(rank) on one thread per rank; rethrows the first rank's exception.
void on_ranks(int R, const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> err(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        err[r] = std::current_exception();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : err) {
    if (e) std::rethrow_exception(e);
  }
}

// The EP run: rank r holds experts [r·El, (r+1)·El) and runs on its tokens.
std::vector<Result> run_ep(const Problem& p, const HostTensor& w1, const HostTensor& w2, const RunOptions& ro) {
  const int R = static_cast<int>(p.tokens.size());
  std::vector<std::unique_ptr<EpGroup>> groups = make_ep_group_local(R, group_options(p, ro));
  std::vector<Result> out(R);
  const int64_t El = p.E / R;
  on_ranks(R, [&](int r) {
    out[r] = run_layer(p, w1, w2, r * El, El, p.first_token[r], p.tokens[r], ro, groups[r].get());
  });
  return out;
}

Result run_single(const Problem& p, const HostTensor& w1, const HostTensor& w2, const RunOptions& ro,
                  int64_t t0 = 0, int64_t T = -1) {
  return run_layer(p, w1, w2, 0, p.E, t0, T < 0 ? p.T : T, ro, nullptr);
}

// got == want[offset, offset + got.size()) bit for bit.
template <typename V>
::testing::AssertionResult bitwise(const V& got, const V& want, size_t offset, const std::string& what) {
  if (got.empty() && want.empty()) return ::testing::AssertionSuccess();  // absent on both sides
  if (offset + got.size() > want.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values at " << offset << " past the "
                                         << want.size() << " of the reference";
  }
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[offset + i], sizeof(got[i])) != 0) {
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << got[i] << ", the reference "
                                           << want[offset + i] << " (" << got.size() << " compared)";
    }
  }
  return ::testing::AssertionSuccess();
}

// Every rank's outputs against the rows of its tokens in `ref`, and its experts' gradients against
// its slice of `ref`'s.
void expect_ranks_match(const Problem& p, const std::vector<Result>& ranks, const Result& ref) {
  const int R = static_cast<int>(ranks.size());
  const int64_t El = p.E / R, H = p.H, F = p.F;
  for (int r = 0; r < R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Result& g = ranks[r];
    const size_t t0 = static_cast<size_t>(p.first_token[r]);
    ASSERT_EQ(g.out.size(), static_cast<size_t>(p.tokens[r] * H));
    EXPECT_TRUE(bitwise(g.out, ref.out, t0 * H, "out"));
    EXPECT_TRUE(bitwise(g.dx, ref.dx, t0 * H, "dx"));
    EXPECT_TRUE(bitwise(g.dlogits, ref.dlogits, t0 * p.E, "dlogits"));
    const size_t e0 = static_cast<size_t>(r * El);
    ASSERT_EQ(g.dw1.size(), static_cast<size_t>(El * 2 * F * H));
    EXPECT_TRUE(bitwise(g.dw1, ref.dw1, e0 * 2 * F * H, "dW1"));
    EXPECT_TRUE(bitwise(g.dw2, ref.dw2, e0 * H * F, "dW2"));
    ASSERT_EQ(g.db1.size(), p.gpt_oss ? static_cast<size_t>(El * 2 * F) : 0u);
    EXPECT_TRUE(bitwise(g.db1, ref.db1, e0 * 2 * F, "db1"));
    EXPECT_TRUE(bitwise(g.db2, ref.db2, e0 * H, "db2"));
  }
}

class MoELayerEpCpu : public ::testing::TestWithParam<EpCase> {};

TEST_P(MoELayerEpCpu, MatchesSingleGpuLayerOnGlobalBatch) {
  const EpCase& c = GetParam();
  Rng rng;
  const Problem p(c, rng);
  const RunOptions ro = run_options(c);
  const Result ref = run_single(p, p.w1, p.w2, ro);
  const std::vector<Result> ranks = run_ep(p, p.w1, p.w2, ro);
  expect_ranks_match(p, ranks, ref);
  for (const Result& r : ranks) EXPECT_EQ(r.during_dispatch, 1);
  if (c.skew != Skew::none) {
    // The case is what it says: no rank routed a token outside the target rank's experts.
    const int target = c.skew == Skew::to_first_rank ? 0 : c.R - 1;
    for (int r = 0; r < c.R; ++r) {
      for (int64_t e = 0; e < p.E; ++e) {
        if (e / c.El != target) {
          EXPECT_EQ(ranks[r].counts[e], 0) << "rank " << r << ", expert " << e;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, MoELayerEpCpu, ::testing::ValuesIn(ep_cases()),
                         [](const auto& info) { return info.param.name; });

// A group of size 1 is the single-GPU layer: the same bits, and no exchange.
TEST(MoELayerEpCpuSemantics, GroupOfOneIsTheSingleGpuLayer) {
  Rng rng;
  const EpCase c{"one", 1, {13}, 4, 8, 4, softmax_topk(2), padded(4)};
  const Problem p(c, rng);
  const RunOptions ro = run_options(c, 0.01f, 0.001f);
  const Result ref = run_single(p, p.w1, p.w2, ro);
  const std::vector<Result> one = run_ep(p, p.w1, p.w2, ro);
  expect_ranks_match(p, one, ref);
  EXPECT_TRUE(bitwise(one[0].aux, ref.aux, 0, "aux loss"));
  EXPECT_TRUE(bitwise(one[0].z, ref.z, 0, "z loss"));
}

// The losses and the capacity are the rank's: rank r's outputs, losses and dlogits are those of the
// single-GPU layer (all E experts) run on rank r's tokens alone — not those of the global batch.
TEST(MoELayerEpCpuSemantics, LossesAndCapacityAreTheRanksTokens) {
  Rng rng;
  PermuteOptions capacity = padded(2);
  capacity.capacity_factor = 0.75;
  const EpCase c{"per_rank", 2, {12, 16}, 2, 8, 4, softmax_topk(2), capacity};
  const Problem p(c, rng);
  const RunOptions ro = run_options(c, 0.01f, 0.001f);
  const std::vector<Result> ranks = run_ep(p, p.w1, p.w2, ro);
  for (int r = 0; r < c.R; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const Result alone = run_single(p, p.w1, p.w2, ro, p.first_token[r], p.tokens[r]);
    EXPECT_TRUE(bitwise(ranks[r].out, alone.out, 0, "out"));
    EXPECT_TRUE(bitwise(ranks[r].dx, alone.dx, 0, "dx"));
    EXPECT_TRUE(bitwise(ranks[r].dlogits, alone.dlogits, 0, "dlogits (the losses' gradients included)"));
    EXPECT_TRUE(bitwise(ranks[r].aux, alone.aux, 0, "aux loss"));
    EXPECT_TRUE(bitwise(ranks[r].z, alone.z, 0, "z loss"));
    EXPECT_TRUE(bitwise(ranks[r].counts, alone.counts, 0, "counts"));
  }
  // The global batch's aux loss is a product of global sums, not the mean of the ranks' losses:
  // the per-rank loss is a different quantity (and the test can tell them apart).
  const Result global = run_single(p, p.w1, p.w2, ro);
  EXPECT_NE(global.aux[0], 0.5f * (ranks[0].aux[0] + ranks[1].aux[0]));
}

// Backward's exchanges on a comm stream with the experts' delayed weight gradients run while the
// combine of dxr is in flight: the same bits as the sequential order (backward, then backward_dw).
TEST(MoELayerEpCpuOverlap, WgradDuringCombineEqualsSequential) {
  Rng rng;
  for (const EpCase& c : {EpCase{"ep2", 2, {9, 7}, 2, 8, 4, softmax_topk(2), padded(4)},
                          EpCase{"ep4_gpt_oss_skewed", 4, {5, 6, 3, 4}, 2, 8, 4, softmax_topk(2), PermuteOptions{},
                                 Skew::to_last_rank, true},
                          EpCase{"ep1", 1, {11}, 4, 8, 4, softmax_topk(2), padded(2)}}) {
    SCOPED_TRACE(c.name);
    const Problem p(c, rng);
    for (int delayed = 1; delayed <= 3; ++delayed) {  // fc1, fc2, both
      SCOPED_TRACE("delayed " + std::string(delayed == 1 ? "fc1" : delayed == 2 ? "fc2" : "fc1+fc2"));
      RunOptions ro = run_options(c);
      ro.delay_fc1 = delayed & 1;
      ro.delay_fc2 = delayed & 2;
      const std::vector<Result> sequential = run_ep(p, p.w1, p.w2, ro);
      ro.overlap = true;
      const std::vector<Result> overlapped = run_ep(p, p.w1, p.w2, ro);
      for (int r = 0; r < c.R; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const Result &a = overlapped[r], &b = sequential[r];
        EXPECT_TRUE(bitwise(a.dx, b.dx, 0, "dx"));
        EXPECT_TRUE(bitwise(a.dlogits, b.dlogits, 0, "dlogits"));
        ASSERT_FALSE(a.dw1.empty());
        ASSERT_FALSE(a.dw2.empty());
        EXPECT_TRUE(bitwise(a.dw1, b.dw1, 0, "dW1"));
        EXPECT_TRUE(bitwise(a.dw2, b.dw2, 0, "dW2"));
        EXPECT_TRUE(bitwise(a.db1, b.db1, 0, "db1"));
        EXPECT_TRUE(bitwise(a.db2, b.db2, 0, "db2"));
        EXPECT_EQ(a.during_dispatch, 1);
      }
      // And the global batch's gradients, as without the overlap.
      if (c.R > 1) {
        const Result ref = run_single(p, p.w1, p.w2, ro);
        expect_ranks_match(p, overlapped, ref);
      }
    }
  }
}

// The EP context offloads what it keeps (the plan, the received probabilities, the experts' saved
// tensors) and reloads it: the same bits, the experts' references re-pointed.
TEST(MoELayerEpCpuOffload, ContextRoundTripIsBitwise) {
  Rng rng;
  for (const EpCase& c : {EpCase{"ep2_padded_delayed", 2, {9, 7}, 2, 8, 4, softmax_topk(2), padded(4)},
                          EpCase{"ep4_gpt_oss_keep_input", 4, {5, 0, 6, 4}, 2, 8, 4, softmax_topk(2), PermuteOptions{},
                                 Skew::none, true, false, true}}) {
    SCOPED_TRACE(c.name);
    const Problem p(c, rng);
    RunOptions ro = run_options(c);
    ro.delay_fc1 = ro.delay_fc2 = c.name == "ep2_padded_delayed";
    const std::vector<Result> resident = run_ep(p, p.w1, p.w2, ro);
    ro.offload = true;
    const std::vector<Result> offloaded = run_ep(p, p.w1, p.w2, ro);
    for (int r = 0; r < c.R; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_GT(offloaded[r].offloaded, 0u);
      const Result &a = offloaded[r], &b = resident[r];
      EXPECT_TRUE(bitwise(a.dx, b.dx, 0, "dx"));
      EXPECT_TRUE(bitwise(a.dlogits, b.dlogits, 0, "dlogits"));
      EXPECT_TRUE(bitwise(a.dw1, b.dw1, 0, "dW1"));
      EXPECT_TRUE(bitwise(a.dw2, b.dw2, 0, "dW2"));
      EXPECT_TRUE(bitwise(a.db1, b.db1, 0, "db1"));
      EXPECT_TRUE(bitwise(a.db2, b.db2, 0, "db2"));
    }
  }
}

TEST(MoELayerEpCpuOverlap, WgradDuringCombineNeedsDelayedExperts) {
  Rng rng;
  const EpCase c{"ep1", 1, {5}, 4, 8, 4, softmax_topk(2), {}};
  const Problem p(c, rng);
  GroupedMLP experts = make_experts(p, p.w1, p.w2, 0, p.E, {});
  MoELayerOptions o;
  o.router = c.router;
  MoELayer layer(experts, o);
  MoELayerContext ctx;
  layer.forward(p.x.view(), p.logits.view(), ctx);
  MoEBackwardOverlap overlap;
  overlap.experts_wgrad_during_combine = true;
  GMOE_EXPECT_ERROR(layer.backward(ctx, p.dout.view(), nullptr, {}, {}, overlap),
                    "overlap.experts_wgrad_during_combine", "delay_wgrad");
}

// Checkpoints across EP sizes (the EP-slice code of gmoe/checkpoint.h): each rank of EP = 2 saves
// its experts' shards, EP = 1 loads them all, and the reverse; the layer's output after loading is
// the original's, bit for bit.
const ExpertParamKey kFc1{"layer.experts.fc1.weight", ""};
const ExpertParamKey kFc2{"layer.experts.fc2.weight", ""};

// Saves experts [first, first + n) of w1/w2 as a shard set of E experts (the index from rank 0).
void save_slice(const std::string& dir, const HostTensor& w1, const HostTensor& w2, int64_t first, int64_t n,
                int64_t E) {
  ExpertShardOptions so;
  so.experts_per_file = 1;
  so.write_index = first == 0;
  std::vector<ExpertParamToSave> params(2);
  params[0].key = kFc1;
  params[0].src = ExpertWeights::from_stacked(Problem::experts_of(w1, first, n));
  params[1].key = kFc2;
  params[1].src = ExpertWeights::from_stacked(Problem::experts_of(w2, first, n));
  save_expert_shards(dir, "experts", params, first, E, so);
}

// Loads experts [first, first + n) of the shard set into [first, first + n) of w1/w2.
void load_slice(const std::string& dir, HostTensor& w1, HostTensor& w2, int64_t first, int64_t n, int64_t E) {
  const Checkpoint ckpt = Checkpoint::open(expert_shard_index_path(dir, "experts"));
  std::vector<ExpertParamToLoad> params(2);
  params[0].key = kFc1;
  params[0].dst = ExpertWeights::from_stacked(Problem::experts_of(w1, first, n));
  params[1].key = kFc2;
  params[1].dst = ExpertWeights::from_stacked(Problem::experts_of(w2, first, n));
  load_expert_params(ckpt, params, E, first);
}

TEST(MoELayerEpCpuCheckpoint, SaveUnderOneEpSizeLoadUnderAnother) {
  Rng rng;
  const EpCase c{"ckpt", 2, {9, 8}, 3, 8, 4, softmax_topk(2), padded(2)};
  const Problem p(c, rng);
  const int64_t El = c.El;
  const RunOptions ro = run_options(c);
  {
    SCOPED_TRACE("saved with EP = 2, loaded with EP = 1");
    gmoe_test::TempDir dir;
    const std::vector<Result> original = run_ep(p, p.w1, p.w2, ro);
    for (int r = 0; r < c.R; ++r) save_slice(dir.path, p.w1, p.w2, r * El, El, p.E);
    HostTensor w1(DType::f32, p.w1.shape()), w2(DType::f32, p.w2.shape());
    poison(w1);
    poison(w2);
    load_slice(dir.path, w1, w2, 0, p.E, p.E);
    EXPECT_TRUE(bitwise_equal(w1, p.w1, "fc1 weights loaded"));
    EXPECT_TRUE(bitwise_equal(w2, p.w2, "fc2 weights loaded"));
    const Result loaded = run_single(p, w1, w2, ro);
    for (int r = 0; r < c.R; ++r) {
      EXPECT_TRUE(bitwise(original[r].out, loaded.out, p.first_token[r] * p.H, "out, rank " + std::to_string(r)));
    }
  }
  {
    SCOPED_TRACE("saved with EP = 1, loaded with EP = 2");
    gmoe_test::TempDir dir;
    const Result original = run_single(p, p.w1, p.w2, ro);
    save_slice(dir.path, p.w1, p.w2, 0, p.E, p.E);
    HostTensor w1(DType::f32, p.w1.shape()), w2(DType::f32, p.w2.shape());
    poison(w1);
    poison(w2);
    // Each rank loads its own slice only (the other rows stay poisoned: a rank reading past its
    // slice would show).
    for (int r = 0; r < c.R; ++r) load_slice(dir.path, w1, w2, r * El, El, p.E);
    const std::vector<Result> loaded = run_ep(p, w1, w2, ro);
    for (int r = 0; r < c.R; ++r) {
      EXPECT_TRUE(bitwise(loaded[r].out, original.out, p.first_token[r] * p.H, "out, rank " + std::to_string(r)));
    }
  }
}

// What the host sees is checked before any exchange, naming the argument.
TEST(MoELayerEpCpuErrors, Arguments) {
  Rng rng;
  const EpCase c{"errors", 2, {3, 3}, 2, 8, 4, softmax_topk(2), {}};
  const Problem p(c, rng);
  const RunOptions ro = run_options(c);
  GroupedMLP experts = make_experts(p, p.w1, p.w2, 0, c.El, {});
  const EpGroupOptions good = group_options(p, ro);
  auto layer_options = [&](EpGroup* g) {
    MoELayerOptions o;
    o.router = c.router;
    o.ep = g;
    return o;
  };
  {
    // E != El·R: the group counts 6 experts, the layer's 2 ranks hold 2 each.
    EpGroupOptions go = good;
    go.num_experts = 6;
    auto groups = make_ep_group_local(2, go);
    GMOE_EXPECT_ERROR(MoELayer(experts, layer_options(groups[0].get())), "options.ep", "num_experts", "6", "4");
  }
  {
    EpGroupOptions go = good;
    go.hidden = p.H + 1;
    auto groups = make_ep_group_local(2, go);
    GMOE_EXPECT_ERROR(MoELayer(experts, layer_options(groups[0].get())), "options.ep", "hidden");
  }
  auto groups = make_ep_group_local(2, good);
  MoELayer layer(experts, layer_options(groups[0].get()));
  EXPECT_EQ(layer.num_experts(), 4);
  EXPECT_TRUE(layer.expert_parallel());
  {
    // regather_expert_input (on by default) falls back under EP: the experts' rows are other
    // ranks', so they are kept; the same experts without a group gather theirs again.
    GroupedMLPOptions by_reference;
    by_reference.fc1.save_original_input = true;
    GroupedMLP referencing = make_experts(p, p.w1, p.w2, 0, c.El, by_reference);
    EXPECT_FALSE(MoELayer(referencing, layer_options(groups[0].get())).regathers_expert_input());
    EXPECT_TRUE(MoELayer(referencing, layer_options(nullptr)).regathers_expert_input());
  }
  MoELayerContext ctx;
  {
    // logits over the local experts only: E is every rank's.
    HostTensor logits(DType::f32, {3, c.El});
    fill_random(logits, rng);
    GMOE_EXPECT_ERROR(layer.forward(Problem::rows_of(p.x, 0, 3), logits.view(), ctx), "logits", "[3, 4]",
                      "2 local experts x 2 ranks");
  }
  {
    // More tokens than the group's max_rows holds.
    HostTensor x(DType::f32, {4, p.H}), logits(DType::f32, {4, p.E});
    fill_random(x, rng);
    fill_random(logits, rng);
    GMOE_EXPECT_ERROR(layer.forward(x.view(), logits.view(), ctx), "options.ep", "max_rows");
  }
  {
    // The group moves bf16 rows, x is f32.
    EpGroupOptions go = good;
    go.dtype = DType::bf16;
    auto bf16_groups = make_ep_group_local(2, go);
    MoELayer bf16_layer(experts, layer_options(bf16_groups[0].get()));
    GMOE_EXPECT_ERROR(bf16_layer.forward(Problem::rows_of(p.x, 0, 3), Problem::rows_of(p.logits, 0, 3), ctx),
                      "options.ep", "dtype", "bf16", "f32");
  }
  {
    // The router's top_k and groups count every rank's experts.
    MoELayerOptions o = layer_options(groups[0].get());
    o.router.top_k = 4;
    EXPECT_NO_THROW(MoELayer(experts, o));
    o.router.top_k = 5;
    GMOE_EXPECT_ERROR(MoELayer(experts, o), "options.router.top_k", "4");
  }
}

}  // namespace
}  // namespace gmoe::test
