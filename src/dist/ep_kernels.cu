// src/dist/ep_kernels.cu — the NCCL backend's kernels: the plan's all-gather of counts, the push of
// rows into the peers' symmetric windows, and the copy of a rank's window into its output.
//
// Every kernel that touches a peer's window is barrier -> writes -> barrier, on NCCL's LSA
// barriers (one per CTA index, pairing CTA i of every rank). The first barrier orders the peers'
// reads of their windows by the previous op (its copy-out kernel, which precedes the peer's next
// push kernel on its stream) before this op's writes into them; the second publishes the writes
// (release on arrive, acquire on wait) before any rank copies its window out. Both use acq_rel, so
// the two hazards hold without relying on kernel boundaries.
//
// What does not depend on the peers runs beside the push, on the SMs the pushing CTAs leave: the
// rows a rank keeps for itself go from its input straight into its output, and the output's rows
// past the valid ones are zeroed. Only the rows that came from peers wait for the second barrier:
// a second kernel copies them out of the window. That copy is a kernel of its own rather than a
// step folded into the next op: the output must be allocator-owned (several micro-batches'
// outputs alive at once), and an op must return a finished tensor.
//
// Each kernel rebuilds the offsets it needs (src/dist/ep_plan_math.h's segment tables) in shared
// memory from the plan's counts matrix, with block scans: a few microseconds that spare the plan a
// table per direction in global memory.
#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <cstdint>

#include "cuda/runtime/cuda_check.h"
#include "dist/ep_kernels.h"
#include "gmoe/grouped.h"

namespace gmoe::ep {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
using Scan = cub::BlockScan<int64_t, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
static_assert(3 * (kMaxExperts + 1) * sizeof(int64_t) + sizeof(Scan::TempStorage) <= 48 * 1024,
              "the tables of kMaxExperts experts and the scan storage fit a CTA without opting in");

/// What a move kernel needs besides the NCCL handles.
struct MoveArgs {
  Geometry geo;
  bool dispatch = true;
  const int32_t* counts_all = nullptr;
  const unsigned char* in = nullptr;
  const float* in_scalars = nullptr;
  unsigned char* out = nullptr;
  float* out_scalars = nullptr;
  WindowLayout layout;
  uint32_t* error_word = nullptr;
};

/// a[0..n) -> exclusive prefix sums in place, a[n] = the total. Every thread of the CTA calls it.
__device__ void block_exclusive_scan(int64_t* a, int n, Scan::TempStorage& temp) {
  int64_t carry = 0;
  for (int base = 0; base < n; base += kThreads) {
    const int i = base + static_cast<int>(threadIdx.x);
    const int64_t v = i < n ? a[i] : 0;
    int64_t out = 0, total = 0;
    Scan(temp).ExclusiveSum(v, out, total);
    if (i < n) a[i] = carry + out;
    carry += total;
    __syncthreads();  // temp is reused by the next chunk
  }
  if (threadIdx.x == 0) a[n] = carry;
  __syncthreads();
}

/// One direction's segments in shared memory: starts[E + 1], peer_start[E], and a scratch of E + 1.
struct Tables {
  int64_t* starts;
  int64_t* peer_start;
  int64_t* scratch;
};

__device__ Tables carve(int64_t* smem, int64_t E) { return {smem, smem + (E + 1), smem + 2 * (E + 1)}; }

/// The source table of geo.me (ep_plan_math.h source_table): segment e = global expert e.
__device__ void build_source_table(const int32_t* ca, const Geometry& g, Tables t, Scan::TempStorage& temp) {
  const int E = static_cast<int>(g.experts);
  for (int e = threadIdx.x; e < E; e += kThreads) {
    int64_t column = 0, before = 0;
    for (int s = 0; s < g.ranks; ++s) {
      const int64_t c = clamp_count(ca[static_cast<int64_t>(s) * E + e], g.max_rows);
      column += c;
      if (s < g.me) before += c;
    }
    t.starts[e] = clamp_count(ca[static_cast<int64_t>(g.me) * E + e], g.max_rows);
    t.scratch[e] = column;
    t.peer_start[e] = before;
  }
  __syncthreads();
  block_exclusive_scan(t.starts, E, temp);
  block_exclusive_scan(t.scratch, E, temp);
  // The expert's block on its owner starts after the owner's earlier experts' columns.
  for (int e = threadIdx.x; e < E; e += kThreads) t.peer_start[e] += t.scratch[e] - t.scratch[e - e % g.local];
  __syncthreads();
}

/// The receive table of geo.me (ep_plan_math.h receive_table): segment k = (local expert k / R,
/// source k % R).
__device__ void build_receive_table(const int32_t* ca, const Geometry& g, Tables t, Scan::TempStorage& temp) {
  const int E = static_cast<int>(g.experts), R = g.ranks, El = static_cast<int>(g.local);
  const int first = g.me * El;
  for (int k = threadIdx.x; k < E; k += kThreads) {
    t.starts[k] = clamp_count(ca[static_cast<int64_t>(k % R) * E + first + k / R], g.max_rows);
  }
  // Each source's offsets of this rank's experts: a scan of its counts up to the last of them.
  for (int s = 0; s < R; ++s) {
    for (int f = threadIdx.x; f < first + El; f += kThreads) {
      t.scratch[f] = clamp_count(ca[static_cast<int64_t>(s) * E + f], g.max_rows);
    }
    __syncthreads();
    block_exclusive_scan(t.scratch, first + El, temp);
    for (int e = threadIdx.x; e < El; e += kThreads) t.peer_start[e * R + s] = t.scratch[first + e];
    __syncthreads();
  }
  block_exclusive_scan(t.starts, E, temp);
}

/// This rank's table for one side of the op: the rows it sends (sending, the push kernel) or the rows
/// it holds after the push (the copy-out). A dispatch sends from the source layout and receives into
/// the receive layout; a combine the reverse.
__device__ Tables side_tables(const MoveArgs& a, bool sending, int64_t* smem, Scan::TempStorage& temp) {
  const Tables t = carve(smem, a.geo.experts);
  if (a.dispatch == sending) {
    build_source_table(a.counts_all, a.geo, t, temp);
  } else {
    build_receive_table(a.counts_all, a.geo, t, temp);
  }
  return t;
}

/// One warp copies one row: n vectors of V, four loads in flight per lane before their stores.
template <typename V>
__device__ __forceinline__ void copy_row(V* __restrict__ dst, const V* __restrict__ src, int64_t n, int lane) {
  constexpr int kUnroll = 4;
  int64_t c = lane;
  for (; c + 32 * (kUnroll - 1) < n; c += 32 * kUnroll) {
    V v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[c + 32 * u];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[c + 32 * u] = v[u];
  }
  for (; c < n; c += 32) dst[c] = src[c];
}

template <typename V>
__device__ __forceinline__ void zero_row(V* dst, int64_t n, int lane) {
  V z;
  memset(&z, 0, sizeof z);
  for (int64_t c = lane; c < n; c += 32) dst[c] = z;
}

/// Rows of this rank's output layout that hold data (the keep side of a move): dispatch, the rows
/// its experts receive; combine, the rows of its source layout; at most the output's capacity.
/// Every thread of the CTA calls it.
__device__ int64_t kept_rows(const MoveArgs& a) {
  __shared__ unsigned long long total;
  const Geometry& g = a.geo;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  unsigned long long mine = 0;
  if (a.dispatch) {
    for (int64_t x = threadIdx.x; x < g.ranks * g.local; x += kThreads) {
      const int64_t s = x / g.local, e = g.me * g.local + x % g.local;
      mine += clamp_count(a.counts_all[s * g.experts + e], g.max_rows);
    }
  } else {
    for (int64_t e = threadIdx.x; e < g.experts; e += kThreads) {
      mine += clamp_count(a.counts_all[g.me * g.experts + e], g.max_rows);
    }
  }
  atomicAdd(&total, mine);
  __syncthreads();
  const int64_t cap = a.dispatch ? g.recv_cap : g.max_rows;
  const auto kept = static_cast<int64_t>(total);
  return kept < cap ? kept : cap;
}

/// Kernel A. CTAs [0, kPushCtas), one LSA barrier each: push this rank's valid rows that belong to
/// a peer into that peer's window. The CTAs past them, concurrently and without barriers (nothing
/// they do depends on the peers): this rank's rows that stay on this rank, straight from the input
/// into the output (no window round trip), and zeros into the output's rows past its valid ones.
/// A warp per row.
template <typename V>
__global__ void __launch_bounds__(kThreads) push_kernel(MoveArgs a, ncclDevComm comm, ncclWindow_t win) {
  extern __shared__ int64_t smem[];
  __shared__ Scan::TempStorage temp;
  const Geometry& g = a.geo;
  const Tables t = side_tables(a, true, smem, temp);
  const int n = static_cast<int>(g.experts);  // segments: E both ways (E experts, or El * R)
  const int64_t local_cap = a.dispatch ? g.max_rows : g.recv_cap;
  const int64_t remote_cap = a.dispatch ? g.recv_cap : g.max_rows;
  const int64_t row_bytes = static_cast<int64_t>(a.layout.row_bytes);
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t valid = min(t.starts[n], local_cap);
  const bool pusher = blockIdx.x < kPushCtas;
  // Pushers walk the rows over their warps, the local CTAs over theirs.
  const int64_t first = (pusher ? blockIdx.x : blockIdx.x - kPushCtas) * static_cast<int64_t>(kWarps) + warp;
  const int64_t stride = (pusher ? kPushCtas : gridDim.x - kPushCtas) * static_cast<int64_t>(kWarps);

  if (pusher) {
    ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), blockIdx.x);
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // the peers have read their windows
    // The source layout is ordered by owner rank, so walking it from row 0 on every rank would have
    // all ranks push to rank 0 first, then to rank 1, ... (incast on one receiver's links while the
    // others idle). Each rank starts at the rows of the rank after it and wraps around instead.
    const int64_t rot =
        a.dispatch && valid > 0 ? min(t.starts[((g.me + 1) % g.ranks) * g.local], valid - 1) : 0;
    for (int64_t j = first; j < valid; j += stride) {
      const int64_t i = j + rot < valid ? j + rot : j + rot - valid;
      const int k = find_segment(t.starts, n, i);
      const int peer = a.dispatch ? owner_of(k, g.local) : receive_segment_source(k, g.ranks);
      if (peer == g.me) continue;  // a local CTA's row
      const int64_t row = t.peer_start[k] + (i - t.starts[k]);
      if (row >= remote_cap) {  // no place on the peer: dropped, recorded
        if (lane == 0) atomicOr(a.error_word, kDeviceErrorCountsPastCapacity);
        continue;
      }
      auto* dst = static_cast<V*>(ncclGetLsaPointer(win, a.layout.rows + static_cast<size_t>(row * row_bytes), peer));
      copy_row(dst, reinterpret_cast<const V*>(a.in + i * row_bytes), vecs, lane);
      if (lane == 0 && a.in_scalars != nullptr) {
        *static_cast<float*>(ncclGetLsaPointer(win, a.layout.scalars + static_cast<size_t>(row) * 4, peer)) =
            a.in_scalars[i];
      }
    }
    bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every push into every window has landed
    return;
  }
  for (int64_t i = first; i < valid; i += stride) {
    const int k = find_segment(t.starts, n, i);
    const int peer = a.dispatch ? owner_of(k, g.local) : receive_segment_source(k, g.ranks);
    if (peer != g.me) continue;  // a pusher's row
    const int64_t row = t.peer_start[k] + (i - t.starts[k]);
    if (row >= remote_cap) {
      if (lane == 0) atomicOr(a.error_word, kDeviceErrorCountsPastCapacity);
      continue;
    }
    copy_row(reinterpret_cast<V*>(a.out + row * row_bytes), reinterpret_cast<const V*>(a.in + i * row_bytes), vecs,
             lane);
    if (lane == 0 && a.out_scalars != nullptr) a.out_scalars[row] = a.in_scalars != nullptr ? a.in_scalars[i] : 0.0f;
  }
  const int64_t out_cap = a.dispatch ? g.recv_cap : g.max_rows;
  for (int64_t i = kept_rows(a) + first; i < out_cap; i += stride) {
    zero_row(reinterpret_cast<V*>(a.out + i * row_bytes), vecs, lane);
    if (lane == 0 && a.out_scalars != nullptr) a.out_scalars[i] = 0.0f;
  }
}

/// Kernel B: the output's valid rows that came from the peers, out of this rank's window; zeros for
/// the rows whose counterpart has no place on the peer (combine: rows dispatch dropped). The rows
/// from this rank itself and the tail past the valid rows are kernel A's.
template <typename V>
__global__ void __launch_bounds__(kThreads) copy_out_kernel(MoveArgs a, ncclWindow_t win) {
  extern __shared__ int64_t smem[];
  __shared__ Scan::TempStorage temp;
  const Geometry& g = a.geo;
  const Tables t = side_tables(a, false, smem, temp);
  const int n = static_cast<int>(g.experts);
  const int64_t out_cap = a.dispatch ? g.recv_cap : g.max_rows;
  const int64_t peer_cap = a.dispatch ? g.max_rows : g.recv_cap;
  const int64_t row_bytes = static_cast<int64_t>(a.layout.row_bytes);
  const int64_t vecs = row_bytes / static_cast<int64_t>(sizeof(V));
  const int lane = threadIdx.x % 32;
  const int64_t valid = min(t.starts[n], out_cap);
  // The window through the mapping the pushes wrote through (ncclMemAlloc's pointer is another).
  const auto* rows = static_cast<const unsigned char*>(ncclGetLocalPointer(win, a.layout.rows));
  const auto* scalars = static_cast<const float*>(ncclGetLocalPointer(win, a.layout.scalars));
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; i < valid;
       i += static_cast<int64_t>(gridDim.x) * kWarps) {
    const int k = find_segment(t.starts, n, i);
    const int peer = a.dispatch ? receive_segment_source(k, g.ranks) : owner_of(k, g.local);
    auto* dst = reinterpret_cast<V*>(a.out + i * row_bytes);
    if (t.peer_start[k] + (i - t.starts[k]) >= peer_cap) {  // combine: dispatch dropped it
      zero_row(dst, vecs, lane);
      if (lane == 0 && a.out_scalars != nullptr) a.out_scalars[i] = 0.0f;
    } else if (peer != g.me) {
      copy_row(dst, reinterpret_cast<const V*>(rows + i * row_bytes), vecs, lane);
      if (lane == 0 && a.out_scalars != nullptr) a.out_scalars[i] = scalars[i];
    }
  }
}

/// The plan: sanitise this rank's counts (ep_plan_math.h sanitize_counts), write them into every
/// peer's counts area, then read the gathered matrix out. One CTA, barrier 0.
__global__ void __launch_bounds__(kThreads) plan_kernel(const int32_t* counts, int32_t* counts_all,
                                                        int32_t* local_counts, Geometry g, WindowLayout layout,
                                                        uint32_t* error_word,
                                                        ncclDevComm comm, ncclWindow_t win) {
  extern __shared__ int64_t smem[];
  __shared__ Scan::TempStorage temp;
  __shared__ uint32_t bits;
  const int E = static_cast<int>(g.experts);
  if (threadIdx.x == 0) bits = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += kThreads) {
    if (counts[e] < 0) atomicOr(&bits, kDeviceErrorNegativeCount);
    smem[e] = clamp_count(counts[e], g.max_rows);
  }
  __syncthreads();
  block_exclusive_scan(smem, E, temp);
  if (threadIdx.x == 0) {
    const uint32_t b = bits | (smem[E] > g.max_rows ? kDeviceErrorCountsPastCapacity : 0u);
    if (b != 0) atomicOr(error_word, b);
  }

  ncclLsaBarrierSession<ncclCoopCta> bar(ncclCoopCta(), comm, ncclTeamTagLsa(), 0);
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // the peers have read their counts areas
  for (int idx = threadIdx.x; idx < g.ranks * E; idx += kThreads) {
    const int peer = idx / E, e = idx % E;
    const int64_t eff = min(smem[e + 1], g.max_rows) - min(smem[e], g.max_rows);
    const size_t at = layout.counts + (static_cast<size_t>(g.me) * E + e) * sizeof(int32_t);
    *static_cast<int32_t*>(ncclGetLsaPointer(win, at, peer)) = static_cast<int32_t>(eff);
  }
  bar.sync(ncclCoopCta(), cuda::memory_order_acq_rel);  // every rank's counts have landed
  // Read through the mapping every rank (this one included) wrote through.
  const auto* area = static_cast<const int32_t*>(ncclGetLocalPointer(win, layout.counts));
  for (int idx = threadIdx.x; idx < g.ranks * E; idx += kThreads) counts_all[idx] = area[idx];
  for (int e = threadIdx.x; e < g.local; e += kThreads) {
    int64_t sum = 0;
    for (int s = 0; s < g.ranks; ++s) sum += area[static_cast<int64_t>(s) * E + g.me * g.local + e];
    local_counts[e] = static_cast<int32_t>(sum);
  }
}

size_t table_bytes(const Geometry& g) { return 3 * static_cast<size_t>(g.experts + 1) * sizeof(int64_t); }

template <typename V>
void launch_move_as(const MoveArgs& a, const Window& win, int sm_count, Stream stream) {
  const size_t smem = table_bytes(a.geo);
  // The local CTAs take the SMs the pushers leave (at least a few, should the device be small).
  const int local_ctas = std::max(sm_count - kPushCtas, 4);
  push_kernel<V><<<kPushCtas + local_ctas, kThreads, smem, stream>>>(a, win.comm, win.handle);
  GMOE_CUDA_CHECK(cudaGetLastError());
  const int64_t out_cap = a.dispatch ? a.geo.recv_cap : a.geo.max_rows;
  const int64_t blocks = std::min<int64_t>((out_cap + kWarps - 1) / kWarps, sm_count);
  copy_out_kernel<V><<<static_cast<unsigned>(std::max<int64_t>(blocks, 1)), kThreads, smem, stream>>>(a, win.handle);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void launch_plan(const int32_t* counts, int32_t* counts_all, int32_t* local_counts, const Geometry& geo,
                 const Window& win, uint32_t* error_word, Stream stream) {
  const size_t smem = static_cast<size_t>(geo.experts + 1) * sizeof(int64_t);
  plan_kernel<<<1, kThreads, smem, stream>>>(counts, counts_all, local_counts, geo, win.layout, error_word, win.comm,
                                             win.handle);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_move(bool dispatch, const int32_t* counts_all, const void* in, const float* in_scalars, void* out,
                 float* out_scalars, const Geometry& geo, const Window& win, uint32_t* error_word, int sm_count,
                 Stream stream) {
  MoveArgs a;
  a.geo = geo;
  a.dispatch = dispatch;
  a.counts_all = counts_all;
  a.in = static_cast<const unsigned char*>(in);
  a.in_scalars = in_scalars;
  a.out = static_cast<unsigned char*>(out);
  a.out_scalars = out_scalars;
  a.layout = win.layout;
  a.error_word = error_word;
  // The widest vector that every row of the input, the output and the window starts on.
  const uintptr_t align = win.layout.row_bytes | reinterpret_cast<uintptr_t>(in) | reinterpret_cast<uintptr_t>(out) |
                          win.layout.rows | reinterpret_cast<uintptr_t>(win.local);
  if (align % 16 == 0) {
    launch_move_as<uint4>(a, win, sm_count, stream);
  } else if (align % 8 == 0) {
    launch_move_as<uint2>(a, win, sm_count, stream);
  } else if (align % 4 == 0) {
    launch_move_as<uint32_t>(a, win, sm_count, stream);
  } else if (align % 2 == 0) {
    launch_move_as<uint16_t>(a, win, sm_count, stream);
  } else {
    launch_move_as<uint8_t>(a, win, sm_count, stream);
  }
}

}  // namespace gmoe::ep
