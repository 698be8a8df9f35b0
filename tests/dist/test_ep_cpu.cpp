// tests/dist/test_ep_cpu.cpp — expert parallelism on the CPU backend (gmoe/expert_parallel.h): R
// ranks as threads of one process. Dispatch equals the layout computed directly from every rank's
// inputs (tests/dist/ep_oracle.h), combine equals its own oracle and undoes dispatch on the valid
// rows; skewed routings (one rank receives nothing, one everything, no rows at all, an expert that
// no rank routes to), receive overflow and bad counts throw on every rank once the collective is
// over, and every bad argument throws gmoe::Error naming it.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "common/expect_error.h"
#include "common/harness.h"
#include "dist/ep_oracle.h"
#include "gmoe/expert_parallel.h"

namespace gmoe::test {
namespace {

using ep_oracle::Layout;
using ep_oracle::World;
using ep_oracle::fill_rows;
using ep_oracle::make_world;
using ep_oracle::options_of;

// Runs fn(rank) on one thread per rank; returns each rank's exception message ("" when none).
std::vector<std::string> run_ranks(int R, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(R));
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  return errors;
}

void expect_no_errors(const std::vector<std::string>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TensorView counts_view(std::vector<int32_t>& c) {
  return TensorView(c.data(), DType::i32, Device::cpu(), {static_cast<int64_t>(c.size())});
}
TensorView rows_view(Layout& l, const World& w, int64_t n, DType dt) {
  return TensorView(l.rows.data(), dt, Device::cpu(), {n, w.hidden});
}
TensorView scalars_view(Layout& l, int64_t n) { return TensorView(l.scalars.data(), DType::f32, Device::cpu(), {n}); }

Layout to_layout(const EpRows& r) {
  const TensorView& v = r.rows.view();
  const auto* p = static_cast<const uint8_t*>(v.data);
  Layout l{std::vector<uint8_t>(p, p + v.nbytes()), {}};
  if (r.scalars.view().defined()) {
    const float* s = r.scalars.view().ptr<const float>();
    l.scalars.assign(s, s + r.scalars.view().numel());
  }
  return l;
}

std::vector<int32_t> to_i32(const Tensor& t) {
  const int32_t* p = t.view().ptr<const int32_t>();
  return std::vector<int32_t>(p, p + t.view().numel());
}

// Byte-exact comparison, reporting the first differing row.
void expect_layout_eq(const Layout& got, const Layout& want, size_t row_bytes, const std::string& what) {
  ASSERT_EQ(got.rows.size(), want.rows.size()) << what;
  for (size_t i = 0; i * row_bytes < want.rows.size(); ++i) {
    if (std::memcmp(got.rows.data() + i * row_bytes, want.rows.data() + i * row_bytes, row_bytes) != 0) {
      ADD_FAILURE() << what << ": row " << i << " differs";
      return;
    }
  }
  ASSERT_EQ(got.scalars.size(), want.scalars.size()) << what;
  for (size_t i = 0; i < want.scalars.size(); ++i) {
    ASSERT_EQ(got.scalars[i], want.scalars[i]) << what << ": scalar " << i;
  }
}

// One full exchange on a fresh group: plan, dispatch (checked against the oracle), combine of the
// dispatched rows (the identity on the valid rows), combine of fresh rows (against the oracle).
void check_exchange(World w, DType dt, int64_t max_recv_rows, std::mt19937_64& rng, const std::string& name) {
  SCOPED_TRACE(name);
  fill_rows(w, rng);
  auto groups = make_ep_group_local(w.ranks, options_of(w, dt, max_recv_rows));
  ASSERT_EQ(groups[0]->recv_capacity(), w.recv_cap);
  const std::vector<Layout> src = ep_oracle::sources(w);
  std::vector<Layout> fresh;
  for (int r = 0; r < w.ranks; ++r) fresh.push_back(ep_oracle::random_layout(w.recv_cap, w, rng));

  std::vector<Layout> dispatched(w.ranks), back(w.ranks), combined(w.ranks);
  std::vector<std::vector<int32_t>> counts_all(w.ranks), local(w.ranks);
  const auto errors = run_ranks(w.ranks, [&](int r) {
    EpGroup& g = *groups[r];
    std::vector<int32_t> counts = w.counts[r];
    Layout in = src[r];
    EpPlan plan = ep_plan(g, counts_view(counts));
    counts_all[r] = to_i32(plan.counts_all);
    local[r] = to_i32(plan.local_counts);
    EpRows d = ep_dispatch(g, plan, rows_view(in, w, w.max_rows, dt), scalars_view(in, w.max_rows));
    dispatched[r] = to_layout(d);
    EpRows b = ep_combine(g, plan, d.rows, d.scalars);
    back[r] = to_layout(b);
    Layout y = fresh[r];
    EpRows c = ep_combine(g, plan, rows_view(y, w, w.recv_cap, dt), scalars_view(y, w.recv_cap));
    combined[r] = to_layout(c);
  });
  expect_no_errors(errors);
  std::vector<int32_t> all;
  for (const auto& c : w.counts) all.insert(all.end(), c.begin(), c.end());
  for (int r = 0; r < w.ranks; ++r) {
    const std::string rank = " on rank " + std::to_string(r);
    EXPECT_EQ(counts_all[r], all) << "counts_all" << rank;
    EXPECT_EQ(local[r], ep_oracle::local_counts(w, r)) << "local_counts" << rank;
    expect_layout_eq(dispatched[r], ep_oracle::dispatch(w, r, src), w.row_bytes(), "dispatch" + rank);
    // combine(dispatch(x)) = x on the valid rows, zeros past them.
    Layout want = src[r];
    int64_t total = 0;
    for (int32_t c : w.counts[r]) total += c;
    std::memset(want.rows.data() + total * w.row_bytes(), 0, (w.max_rows - total) * w.row_bytes());
    std::fill(want.scalars.begin() + total, want.scalars.end(), 0.0f);
    expect_layout_eq(back[r], want, w.row_bytes(), "combine(dispatch(x))" + rank);
    expect_layout_eq(combined[r], ep_oracle::combine(w, r, fresh), w.row_bytes(), "combine" + rank);
  }
}

TEST(CpuEp, RandomRoutingMatchesTheOracle) {
  Rng rng;
  std::mt19937_64 gen(rng.seed());
  for (int R : {1, 2, 3, 4}) {
    for (int64_t El : {1, 3}) {
      for (DType dt : {DType::f32, DType::bf16}) {
        const int64_t H = dt == DType::f32 ? 5 : 24;  // odd row bytes, and whole 16-byte vectors
        const int64_t max_rows = 13 + 7 * R;
        World w = make_world(R, El, H, dt, max_rows, R * max_rows);
        std::vector<double> weight(static_cast<size_t>(w.experts));
        for (double& x : weight) x = std::uniform_real_distribution<double>(0.1, 1.0)(gen);
        weight[0] = 0.0;  // an expert that no rank routes to
        for (int s = 0; s < R; ++s) {
          const int64_t total = std::uniform_int_distribution<int64_t>(0, max_rows)(gen);
          w.counts[s] = ep_oracle::spread_counts(total, weight, gen);
        }
        check_exchange(w, dt, 0, gen,
                       "R=" + std::to_string(R) + " El=" + std::to_string(El) + " " + dtype_name(dt));
      }
    }
  }
}

TEST(CpuEp, SkewedRoutings) {
  Rng rng;
  std::mt19937_64 gen(rng.seed());
  const int R = 3;
  const int64_t El = 2, max_rows = 11;
  // Every row of every rank goes to rank 0's experts: ranks 1 and 2 receive nothing.
  {
    World w = make_world(R, El, 4, DType::f32, max_rows, R * max_rows);
    std::vector<double> weight(R * El, 0.0);
    weight[0] = weight[1] = 1.0;
    for (int s = 0; s < R; ++s) w.counts[s] = ep_oracle::spread_counts(max_rows, weight, gen);
    check_exchange(w, DType::f32, 0, gen, "all rows to rank 0");
  }
  // No rows anywhere.
  check_exchange(make_world(R, El, 4, DType::f32, max_rows, R * max_rows), DType::f32, 0, gen, "all counts zero");
  // One rank holds no rows, the others full; a receive capacity exactly at the largest receiver.
  {
    World w = make_world(R, El, 4, DType::f32, max_rows, 0);
    std::vector<double> weight(R * El, 1.0);
    w.counts[0] = ep_oracle::spread_counts(0, weight, gen);
    w.counts[1] = ep_oracle::spread_counts(max_rows, weight, gen);
    w.counts[2] = ep_oracle::spread_counts(max_rows, weight, gen);
    int64_t most = 0;
    for (int r = 0; r < R; ++r) {
      int64_t got = 0;
      for (int32_t c : ep_oracle::local_counts(w, r)) got += c;
      most = std::max(most, got);
    }
    w.recv_cap = std::max<int64_t>(most, 1);
    check_exchange(w, DType::f32, w.recv_cap, gen, "receive capacity at the largest receiver");
  }
}

TEST(CpuEp, TwoExchangesInFlight) {
  // Two micro-batches: both plans made first, their dispatches and combines interleaved; each
  // result matches its own oracle (the windows are reused between ops, the plans are not).
  Rng rng;
  std::mt19937_64 gen(rng.seed());
  const int R = 2;
  World a = make_world(R, 2, 6, DType::f32, 9, 18), b = make_world(R, 2, 6, DType::f32, 9, 18);
  std::vector<double> weight(4, 1.0);
  for (int s = 0; s < R; ++s) {
    a.counts[s] = ep_oracle::spread_counts(9, weight, gen);
    b.counts[s] = ep_oracle::spread_counts(5, weight, gen);
  }
  fill_rows(a, gen);
  fill_rows(b, gen);
  auto groups = make_ep_group_local(R, options_of(a, DType::f32, 0));
  std::vector<Layout> da(R), db(R), ca(R), cb(R);
  const auto errors = run_ranks(R, [&](int r) {
    EpGroup& g = *groups[r];
    Layout ia{a.rows[r], a.scalars[r]}, ib{b.rows[r], b.scalars[r]};
    EpPlan pa = ep_plan(g, counts_view(a.counts[r]));
    EpPlan pb = ep_plan(g, counts_view(b.counts[r]));
    EpRows ra = ep_dispatch(g, pa, rows_view(ia, a, 9, DType::f32), scalars_view(ia, 9));
    EpRows rb = ep_dispatch(g, pb, rows_view(ib, b, 9, DType::f32));
    EpRows xb = ep_combine(g, pb, rb.rows);
    EpRows xa = ep_combine(g, pa, ra.rows, ra.scalars);
    da[r] = to_layout(ra);
    db[r] = to_layout(rb);
    ca[r] = to_layout(xa);
    cb[r] = to_layout(xb);
  });
  expect_no_errors(errors);
  for (int r = 0; r < R; ++r) {
    expect_layout_eq(da[r], ep_oracle::dispatch(a, r, ep_oracle::sources(a)), a.row_bytes(), "dispatch a");
    Layout want_b = ep_oracle::dispatch(b, r, ep_oracle::sources(b));
    want_b.scalars.clear();  // dispatched without scalars: none returned
    expect_layout_eq(db[r], want_b, b.row_bytes(), "dispatch b");
    expect_layout_eq(ca[r], ep_oracle::combine(a, r, da), a.row_bytes(), "combine a");
    std::vector<Layout> db_scalars = db;  // the oracle moves scalars too: give it zeros
    for (Layout& l : db_scalars) l.scalars.assign(static_cast<size_t>(b.recv_cap), 0.0f);
    Layout want_cb = ep_oracle::combine(b, r, db_scalars);
    want_cb.scalars.clear();
    expect_layout_eq(cb[r], want_cb, b.row_bytes(), "combine b");
  }
}

TEST(CpuEp, ReceiveOverflowThrowsOnEveryRankAndTheGroupStaysUsable) {
  Rng rng;
  std::mt19937_64 gen(rng.seed());
  const int R = 2;
  World w = make_world(R, 2, 4, DType::f32, 8, 5);
  std::vector<double> to_rank1 = {0.0, 0.0, 1.0, 1.0};
  for (int s = 0; s < R; ++s) w.counts[s] = ep_oracle::spread_counts(4, to_rank1, gen);  // rank 1 gets 8 > 5
  fill_rows(w, gen);
  auto groups = make_ep_group_local(R, options_of(w, DType::f32, 5));
  auto errors = run_ranks(R, [&](int r) {
    Layout in{w.rows[r], w.scalars[r]};
    EpPlan plan = ep_plan(*groups[r], counts_view(w.counts[r]));
    ep_dispatch(*groups[r], plan, rows_view(in, w, 8, DType::f32), scalars_view(in, 8));
  });
  for (int r = 0; r < R; ++r) {
    EXPECT_NE(errors[r].find("ep_dispatch"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("max_recv_rows"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1 receives 8 rows"), std::string::npos) << errors[r];
  }
  // The collective finished before the throw: the same group runs a fitting exchange.
  for (int s = 0; s < R; ++s) w.counts[s] = ep_oracle::spread_counts(2, to_rank1, gen);
  std::vector<Layout> out(R);
  errors = run_ranks(R, [&](int r) {
    Layout in{w.rows[r], w.scalars[r]};
    EpPlan plan = ep_plan(*groups[r], counts_view(w.counts[r]));
    out[r] = to_layout(ep_dispatch(*groups[r], plan, rows_view(in, w, 8, DType::f32), scalars_view(in, 8)));
  });
  expect_no_errors(errors);
  for (int r = 0; r < R; ++r) {
    expect_layout_eq(out[r], ep_oracle::dispatch(w, r, ep_oracle::sources(w)), w.row_bytes(), "after overflow");
  }
}

TEST(CpuEp, BadCountsThrowOnEveryRank) {
  const int R = 2;
  World w = make_world(R, 2, 4, DType::f32, 8, 16);
  auto groups = make_ep_group_local(R, options_of(w, DType::f32, 0));
  w.counts[0] = {1, -2, 0, 0};  // a negative count on rank 0
  w.counts[1] = {5, 5, 0, 0};   // rank 1 sums past max_rows
  const auto errors = run_ranks(R, [&](int r) { ep_plan(*groups[r], counts_view(w.counts[r])); });
  for (int r = 0; r < R; ++r) {
    EXPECT_NE(errors[r].find("ep_plan"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 0's counts hold a negative count"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 1's counts sum past max_rows 8"), std::string::npos) << errors[r];
  }
}

TEST(CpuEp, BadOptionsNameTheField) {
  EpGroupOptions o;
  o.num_experts = 6;
  o.hidden = 8;
  o.dtype = DType::bf16;
  o.max_rows = 4;
  EXPECT_EQ(make_ep_group_local(3, o).size(), 3u);
  GMOE_EXPECT_ERROR(make_ep_group_local(0, o), "size:", "at least 1");
  GMOE_EXPECT_ERROR(make_ep_group_local(4, o), "options.num_experts:", "multiple", "4");
  EpGroupOptions bad = o;
  bad.num_experts = 0;
  GMOE_EXPECT_ERROR(make_ep_group_local(1, bad), "options.num_experts:");
  bad = o;
  bad.hidden = 0;
  GMOE_EXPECT_ERROR(make_ep_group_local(2, bad), "options.hidden:");
  bad = o;
  bad.max_rows = 0;
  GMOE_EXPECT_ERROR(make_ep_group_local(2, bad), "options.max_rows:");
  bad = o;
  bad.max_recv_rows = -1;
  GMOE_EXPECT_ERROR(make_ep_group_local(2, bad), "options.max_recv_rows:");
  bad = o;
  bad.max_rows = int64_t{1} << 31;
  GMOE_EXPECT_ERROR(make_ep_group_local(2, bad), "options.max_rows:", "i32");
  auto g = make_ep_group_local(3, o);
  EXPECT_EQ(g[1]->rank(), 1);
  EXPECT_EQ(g[1]->size(), 3);
  EXPECT_EQ(g[1]->local_experts(), 2);
  EXPECT_EQ(g[1]->recv_capacity(), 12);
  EXPECT_TRUE(g[1]->device().is_cpu());
#ifndef GMOE_WITH_NCCL
  GMOE_EXPECT_ERROR(ep_unique_id(), "ep_unique_id", "NCCL");
  GMOE_EXPECT_ERROR(make_ep_group_nccl(EpUniqueId{}, 0, 1, Device::cuda(0), o), "make_ep_group_nccl", "NCCL");
#endif
}

TEST(CpuEp, BadArgumentsNameTheArgument) {
  // Argument checks run before the collective starts: one rank's bad call throws alone.
  const int R = 2;
  World w = make_world(R, 2, 4, DType::f32, 8, 16);
  auto groups = make_ep_group_local(R, options_of(w, DType::f32, 0));
  EpGroup& g = *groups[0];
  std::vector<int32_t> c4(4, 1), c5(5, 1);
  std::vector<int64_t> c64(4, 1);
  GMOE_EXPECT_ERROR(ep_plan(g, TensorView()), "counts:", "absent");
  GMOE_EXPECT_ERROR(ep_plan(g, counts_view(c5)), "counts:", "[4]", "[5]");
  GMOE_EXPECT_ERROR(ep_plan(g, TensorView(c64.data(), DType::i64, Device::cpu(), {4})), "counts:", "i32", "i64");
  GMOE_EXPECT_ERROR(ep_plan(g, TensorView(c4.data(), DType::i32, Device::cuda(0), {4})), "counts");
  GMOE_EXPECT_ERROR(ep_plan(g, TensorView(c4.data(), DType::i32, Device::cpu(), {2}, {2})), "counts:");

  std::vector<float> rows(8 * 4), wide(9 * 4), scal(8), scal7(7);
  const TensorView x(rows.data(), DType::f32, Device::cpu(), {8, 4});
  EpPlan none;
  GMOE_EXPECT_ERROR(ep_dispatch(g, none, x), "plan.counts_all:");
  EpPlan plan;
  std::vector<int32_t> all(2 * 4, 0), local(2, 0);
  plan.counts_all = Tensor::wrap(TensorView(all.data(), DType::i32, Device::cpu(), {2, 4}));
  plan.local_counts = Tensor::wrap(TensorView(local.data(), DType::i32, Device::cpu(), {3}));
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, x), "plan.local_counts:", "[2]", "[3]");
  plan.local_counts = Tensor::wrap(TensorView(local.data(), DType::i32, Device::cpu(), {2}));
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, TensorView(rows.data(), DType::bf16, Device::cpu(), {8, 4})), "rows:",
                    "f32", "bf16");
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, TensorView(wide.data(), DType::f32, Device::cpu(), {9, 4})), "rows:",
                    "[8, 4]", "max_rows");
  GMOE_EXPECT_ERROR(ep_combine(g, plan, x), "rows:", "[16, 4]", "recv_capacity");
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, TensorView(rows.data(), DType::f32, Device::cpu(), {8, 4}, {1, 8})),
                    "rows:", "contiguous");
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, x, TensorView(scal7.data(), DType::f32, Device::cpu(), {7})), "scalars");
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, x, TensorView(scal.data(), DType::i32, Device::cpu(), {8})), "scalars");
  // An allocator of another device.
  struct CudaLike final : Allocator {
    void* allocate(std::size_t, Stream) override { return nullptr; }
    void free(void*, Stream) override {}
    Device device() const override { return Device::cuda(0); }
  } cuda_like;
  GMOE_EXPECT_ERROR(ep_dispatch(g, plan, x, {}, &cuda_like), "alloc:");
  GMOE_EXPECT_ERROR(ep_plan(g, counts_view(c4), &cuda_like), "alloc:");
}

}  // namespace
}  // namespace gmoe::test
