// src/dist/ep_plan_math.h — where every row goes in an expert-parallel exchange: the offsets of
// gmoe/expert_parallel.h, shared by the CPU backend, the NCCL kernels and the tests' oracles.
//
// Both directions are one pattern. A rank's local layout is cut into segments (dispatch: one per
// global expert of its source layout; combine: one per (local expert, source rank) of its receive
// layout); segment k starts at local row starts[k], goes to rank peer(k) and lands there at row
// peer_start[k] onwards. A move pushes local row i of segment k to peer_start[k] + (i - starts[k])
// on peer(k), and the copy-out on the other side keeps a row only when its counterpart exists
// there. Dispatch pushes with the source table and copies out with the receive table; combine the
// reverse, so the same two tables describe both.
//
// Every count is read through clamp_count (negative: 0; at most max_rows) and every sum is 64-bit,
// so a hostile counts matrix cannot wrap an offset; a row whose place lies past a capacity is
// dropped, never written.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#ifdef __CUDACC__
#define GMOE_EP_FN __host__ __device__ __forceinline__
#else
#define GMOE_EP_FN inline
#endif

namespace gmoe::ep {

/// The host-known geometry of one rank's exchange.
struct Geometry {
  int ranks = 1;           ///< R
  int me = 0;              ///< this rank
  int64_t experts = 0;     ///< E (global)
  int64_t local = 0;       ///< El = E / R
  int64_t max_rows = 0;    ///< rows of a source layout
  int64_t recv_cap = 0;    ///< rows of a receive layout
};

/// A count as every offset uses it: negative counts are 0, none passes the source capacity.
GMOE_EP_FN int64_t clamp_count(int64_t c, int64_t max_rows) {
  return c < 0 ? 0 : (c > max_rows ? max_rows : c);
}

/// The segment of local row `i`: the largest k in [0, n) with starts[k] <= i, for non-decreasing
/// starts[0..n] with starts[0] = 0 <= i < starts[n]. Empty segments are skipped by construction
/// (starts[k] == starts[k + 1] <= i puts i past them).
GMOE_EP_FN int find_segment(const int64_t* starts, int n, int64_t i) {
  int lo = 0, hi = n;  // invariant: starts[lo] <= i < starts[hi]
  while (hi - lo > 1) {
    const int mid = lo + (hi - lo) / 2;
    if (starts[mid] <= i) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// Segment k of a receive table: local expert k / R from source rank k % R (source-major within an
/// expert, as the receive layout orders them).
GMOE_EP_FN int receive_segment_source(int k, int ranks) { return k % ranks; }
/// The global expert of receive segment k on rank `me`.
GMOE_EP_FN int64_t receive_segment_expert(int k, const Geometry& g) {
  return static_cast<int64_t>(g.me) * g.local + k / g.ranks;
}
/// The rank holding global expert `expert`.
GMOE_EP_FN int owner_of(int64_t expert, int64_t local) { return static_cast<int>(expert / local); }

/// The sanitised counts a rank contributes to the plan, as the device forms them: each count
/// clamped, then the running total clamped to max_rows (clamped_group_offsets' order), so that
/// the rows of a source layout never pass its capacity: out[e] = min(P[e+1], cap) - min(P[e], cap)
/// with P the exact prefix of clamped counts. Returns the DeviceErrorBits-style flags through
/// `negative` and `past_capacity`.
inline void sanitize_counts(const int32_t* counts, int64_t E, int64_t max_rows, int32_t* out, bool* negative,
                            bool* past_capacity) {
  int64_t prefix = 0;
  *negative = false;
  *past_capacity = false;
  for (int64_t e = 0; e < E; ++e) {
    if (counts[e] < 0) *negative = true;
    const int64_t c = clamp_count(counts[e], max_rows);
    const int64_t before = std::min(prefix, max_rows);
    prefix += c;
    if (prefix > max_rows) *past_capacity = true;
    out[e] = static_cast<int32_t>(std::min(prefix, max_rows) - before);
  }
}

/// One direction's segments of one rank (host form; the kernels build the same arrays in shared
/// memory, in parallel).
struct SegmentTable {
  std::vector<int64_t> starts;      ///< [n + 1] local rows, non-decreasing; starts[n] = valid total
  std::vector<int> peer;            ///< [n] the rank each segment goes to
  std::vector<int64_t> peer_start;  ///< [n] where the segment's first row lands on its peer
  int64_t local_cap = 0;            ///< rows of the local layout
  int64_t remote_cap = 0;           ///< rows of the peer's layout

  /// n empty segments between layouts of local_cap and remote_cap rows.
  SegmentTable(int64_t n, int64_t local_cap_rows, int64_t remote_cap_rows)
      : starts(static_cast<size_t>(n) + 1, 0),
        peer(static_cast<size_t>(n), 0),
        peer_start(static_cast<size_t>(n), 0),
        local_cap(local_cap_rows),
        remote_cap(remote_cap_rows) {}

  int segments() const { return static_cast<int>(peer.size()); }
  /// Local rows that hold data: the valid total, at most the local capacity.
  int64_t valid_rows() const { return std::min(starts.back(), local_cap); }
  /// Where local row i (< valid_rows()) lands: its peer, and its row there (may pass remote_cap:
  /// then the row has no place and is dropped).
  void place(int64_t i, int* to, int64_t* row) const {
    const int k = find_segment(starts.data(), segments(), i);
    *to = peer[k];
    *row = peer_start[k] + (i - starts[k]);
  }
};

/// counts_all [R, E] (row-major, any values) -> the source table of rank g.me: segment e = global
/// expert e of its source layout, to rank e / El at the receive offset of gmoe/expert_parallel.h.
inline SegmentTable source_table(const int32_t* counts_all, const Geometry& g) {
  const int R = g.ranks;
  const int64_t E = g.experts;
  auto c = [&](int s, int64_t e) { return clamp_count(counts_all[s * E + e], g.max_rows); };
  SegmentTable t(E, g.max_rows, g.recv_cap);
  int64_t base = 0;  // receive offset of expert e's block on its owner
  for (int64_t e = 0; e < E; ++e) {
    if (e % g.local == 0) base = 0;
    int64_t before = 0;  // rows of this expert from the sources before me
    int64_t column = 0;  // rows of this expert from all sources
    for (int s = 0; s < R; ++s) {
      if (s < g.me) before += c(s, e);
      column += c(s, e);
    }
    t.starts[e + 1] = t.starts[e] + c(g.me, e);
    t.peer[e] = owner_of(e, g.local);
    t.peer_start[e] = base + before;
    base += column;
  }
  return t;
}

/// counts_all [R, E] -> the receive table of rank g.me: segment k = (local expert k / R, source
/// k % R), back to that source at the expert's offset in its source layout.
inline SegmentTable receive_table(const int32_t* counts_all, const Geometry& g) {
  const int R = g.ranks;
  const int64_t E = g.experts;
  auto c = [&](int s, int64_t e) { return clamp_count(counts_all[s * E + e], g.max_rows); };
  const int n = static_cast<int>(g.local) * R;
  SegmentTable t(n, g.recv_cap, g.max_rows);
  for (int k = 0; k < n; ++k) {
    const int s = receive_segment_source(k, R);
    const int64_t e = receive_segment_expert(k, g);
    int64_t source_offset = 0;
    for (int64_t f = 0; f < e; ++f) source_offset += c(s, f);
    t.starts[k + 1] = t.starts[k] + c(s, e);
    t.peer[k] = s;
    t.peer_start[k] = source_offset;
  }
  return t;
}

/// Rows rank `r` receives in total (the sum of its local_counts), from counts_all [R, E].
inline int64_t received_rows(const int32_t* counts_all, const Geometry& g, int r) {
  int64_t total = 0;
  for (int s = 0; s < g.ranks; ++s) {
    for (int64_t e = r * g.local; e < (r + 1) * g.local; ++e) total += clamp_count(counts_all[s * g.experts + e], g.max_rows);
  }
  return total;
}

}  // namespace gmoe::ep
