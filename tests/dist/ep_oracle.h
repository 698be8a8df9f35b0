// tests/dist/ep_oracle.h — the expert-parallel exchange computed directly from every rank's inputs:
// what dispatch and combine must return, written from gmoe/expert_parallel.h's layout rules by
// walking the rows (not from src/dist/ep_plan_math.h's segment tables, which it checks). No
// GoogleTest: the CPU suite and the multi-GPU binary share it.
#pragma once

#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gmoe/dtype.h"
#include "gmoe/expert_parallel.h"

namespace gmoe::test::ep_oracle {

/// Every rank's inputs of one exchange: the global view each rank can rebuild from a shared seed.
struct World {
  int ranks = 1;             ///< R
  int64_t experts = 0;       ///< E
  int64_t hidden = 0;        ///< H
  size_t elt = 4;            ///< bytes per element
  int64_t max_rows = 0;      ///< source layout rows
  int64_t recv_cap = 0;      ///< receive layout rows
  std::vector<std::vector<int32_t>> counts;  ///< [R][E], non-negative, each row's sum <= max_rows
  std::vector<std::vector<uint8_t>> rows;    ///< [R] source layouts, max_rows * row_bytes()
  std::vector<std::vector<float>> scalars;   ///< [R] per-row scalars, max_rows

  int64_t local() const { return experts / ranks; }
  size_t row_bytes() const { return static_cast<size_t>(hidden) * elt; }
};

/// One rank's layout: rows and their scalars.
struct Layout {
  std::vector<uint8_t> rows;
  std::vector<float> scalars;
};

/// Row offset of global expert g in rank s's source layout.
inline int64_t source_offset(const World& w, int s, int64_t g) {
  int64_t off = 0;
  for (int64_t f = 0; f < g; ++f) off += w.counts[s][f];
  return off;
}

/// local_counts of rank r.
inline std::vector<int32_t> local_counts(const World& w, int r) {
  std::vector<int32_t> lc(static_cast<size_t>(w.local()), 0);
  for (int64_t e = 0; e < w.local(); ++e) {
    for (int s = 0; s < w.ranks; ++s) lc[e] += w.counts[s][r * w.local() + e];
  }
  return lc;
}

/// Visits every row (source s, global expert g, row j) that lands on rank r, in receive order,
/// with its receive position (which may pass recv_cap: that row is dropped).
template <typename F>
void for_each_received(const World& w, int r, F&& f) {
  int64_t pos = 0;
  for (int64_t e = 0; e < w.local(); ++e) {
    const int64_t g = r * w.local() + e;
    for (int s = 0; s < w.ranks; ++s) {
      for (int64_t j = 0; j < w.counts[s][g]; ++j) f(s, g, j, pos++);
    }
  }
}

/// What ep_dispatch returns on rank r for inputs `src` ([R] source layouts of w's shape).
inline Layout dispatch(const World& w, int r, const std::vector<Layout>& src) {
  const size_t rb = w.row_bytes();
  Layout out{std::vector<uint8_t>(static_cast<size_t>(w.recv_cap) * rb, 0),
             std::vector<float>(static_cast<size_t>(w.recv_cap), 0.0f)};
  for_each_received(w, r, [&](int s, int64_t g, int64_t j, int64_t pos) {
    if (pos >= w.recv_cap) return;
    const int64_t i = source_offset(w, s, g) + j;
    std::memcpy(out.rows.data() + pos * rb, src[s].rows.data() + i * rb, rb);
    out.scalars[pos] = src[s].scalars[i];
  });
  return out;
}

/// What ep_combine returns on rank s for receive layouts `recv` ([R], each recv_cap rows).
inline Layout combine(const World& w, int s, const std::vector<Layout>& recv) {
  const size_t rb = w.row_bytes();
  Layout out{std::vector<uint8_t>(static_cast<size_t>(w.max_rows) * rb, 0),
             std::vector<float>(static_cast<size_t>(w.max_rows), 0.0f)};
  for (int r = 0; r < w.ranks; ++r) {
    for_each_received(w, r, [&](int from, int64_t g, int64_t j, int64_t pos) {
      if (from != s || pos >= w.recv_cap) return;
      const int64_t i = source_offset(w, s, g) + j;
      std::memcpy(out.rows.data() + i * rb, recv[r].rows.data() + pos * rb, rb);
      out.scalars[i] = recv[r].scalars[pos];
    });
  }
  return out;
}

/// The world's own source layouts as Layouts.
inline std::vector<Layout> sources(const World& w) {
  std::vector<Layout> v(static_cast<size_t>(w.ranks));
  for (int s = 0; s < w.ranks; ++s) v[s] = Layout{w.rows[s], w.scalars[s]};
  return v;
}

/// Random bytes for `n` rows that are finite numbers of any float dtype (the high byte of each
/// element avoids the all-ones exponent), and random scalars.
inline Layout random_layout(int64_t n, const World& w, std::mt19937_64& rng) {
  Layout l{std::vector<uint8_t>(static_cast<size_t>(n) * w.row_bytes()), std::vector<float>(static_cast<size_t>(n))};
  for (size_t b = 0; b < l.rows.size(); ++b) {
    const bool high = b % w.elt == w.elt - 1;
    l.rows[b] = static_cast<uint8_t>(rng() % (high ? 0x7f : 0x100));
  }
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (float& x : l.scalars) x = u(rng);
  return l;
}

/// A world of R ranks with El experts each, rows of H elements of `dt`, all counts zero and no rows.
inline World make_world(int R, int64_t El, int64_t H, DType dt, int64_t max_rows, int64_t recv_cap) {
  World w;
  w.ranks = R;
  w.experts = R * El;
  w.hidden = H;
  w.elt = dtype_size(dt);
  w.max_rows = max_rows;
  w.recv_cap = recv_cap;
  w.counts.assign(R, std::vector<int32_t>(static_cast<size_t>(w.experts), 0));
  return w;
}

/// Fresh random source layouts (rows and scalars) for every rank.
inline void fill_rows(World& w, std::mt19937_64& rng) {
  w.rows.clear();
  w.scalars.clear();
  for (int s = 0; s < w.ranks; ++s) {
    Layout l = random_layout(w.max_rows, w, rng);
    w.rows.push_back(l.rows);
    w.scalars.push_back(l.scalars);
  }
}

/// The group options that move w's rows.
inline EpGroupOptions options_of(const World& w, DType dt, int64_t max_recv_rows) {
  EpGroupOptions o;
  o.num_experts = w.experts;
  o.hidden = w.hidden;
  o.dtype = dt;
  o.max_rows = w.max_rows;
  o.max_recv_rows = max_recv_rows;
  return o;
}

/// Counts of one rank: `total` rows spread over the experts with weights `weight[g]` (0: none).
inline std::vector<int32_t> spread_counts(int64_t total, const std::vector<double>& weight, std::mt19937_64& rng) {
  std::vector<int32_t> c(weight.size(), 0);
  double sum = 0;
  for (double x : weight) sum += x;
  if (sum <= 0) return c;
  std::discrete_distribution<size_t> pick(weight.begin(), weight.end());
  for (int64_t t = 0; t < total; ++t) ++c[pick(rng)];
  return c;
}

}  // namespace gmoe::test::ep_oracle
