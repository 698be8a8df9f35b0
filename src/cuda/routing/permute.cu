// src/cuda/routing/permute.cu — permute, combine and their backwards on the device (gmoe/routing.h).
//
// Permute is a counting sort, not a comparison sort: three launches whatever the routing, nothing
// read on the host, no memset.
//   1. tile_histogram: a tile is kSubTiles sub-tiles of sub_tile_tokens(k) tokens (about
//      kSubTilePairs (token, slot) pairs each); a warp counts its sub-tile's pairs per expert
//      (shared-memory integer atomics: exact in any order), then per expert the sub-tiles' exclusive
//      scan -> sub_first[tile, sub, e] (the sub-tile's first position inside the tile) and the
//      tile's total -> tile_counts[tile, e]. An id outside [0, E) is left out and recorded in the
//      device error word.
//   2. expert_offsets (one block, a thread per expert and run of tiles, the whole tile-count matrix
//      loaded at once): per expert, the exclusive scan of its tile counts over the tiles (the
//      tile's first position inside the expert), the expert's total, the kept part under the
//      capacity, its group padded to pad_multiple; then the exclusive scan of the padded groups
//      over the experts -> offsets, counts, kept, dropped.
//   3. permute_rows: one warp per token places its pairs and copies its row. A pair's position in
//      its expert is the tile's first position + the sub-tile's + the number of the sub-tile's
//      earlier pairs (those of earlier tokens and earlier slots) with the same expert, counted
//      with ballots over at most kSubTilePairs ids: (token, slot) order inside an expert, stable
//      and deterministic. The warp writes row_of, src_token and the permuted probability of each
//      kept pair, then x[t] to each kept row. Then the rows no pair owns (each expert's padding
//      past its kept pairs, the rows past the padded total) are written as zeros with src_token
//      -1 and probability 0, found from offsets and kept alone. Every row of the output written
//      once, x read from memory once (a row-major gather re-reads each token's row k times, from
//      memory whenever x does not fit in L2). Placing inside the copy's warps keeps the
//      placement off the launch chain: as a launch of its own it has a block per tile, too few
//      to fill the device, between the scan and the copy.
// Combine (and permute's backward, a combine with weights 1) is one warp per token summing its k
// rows in slot order in f32, the loads of a batch of slots' rows issued together. Its backward is
// one pass over the tokens too: for each slot, the gradient row it owns and its dprobs as a
// warp-reduced dot product, dout read once per token; then zeros on the rows no slot owns.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "common/backend.h"
#include "cuda/routing/routing_common.cuh"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_errors.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::cuda_backend {
namespace {

using routing::from_f;
using routing::LoadedPack;
using routing::Pack;
using routing::to_f;
using routing::warp_sum;

constexpr int kSubTiles = 8;         // sub-tiles per tile, one warp each in the histogram
constexpr int kSubTilePairs = 256;   // (token, slot) pairs a sub-tile holds, about: what a pair's
                                     // rank inside its sub-tile costs (ids read, ballots per slot)
constexpr int kScanThreads = 1024;   // the one-block scan of expert_offsets
static_assert(routing::kMaxRoutingExperts <= kScanThreads, "the scan takes a thread per expert (at least one run)");
constexpr int kScanLoads = 8;        // tile counts a scan thread loads at once
constexpr int kRowWarps = 8;         // warps per block of the row kernels (one row or token per warp)

// Tokens per sub-tile: kSubTilePairs / k, at least 1.
__host__ __device__ __forceinline__ int64_t sub_tile_tokens(int64_t k) {
  return k >= kSubTilePairs ? 1 : kSubTilePairs / k;
}

__global__ void __launch_bounds__(kSubTiles * 32)
    tile_histogram_kernel(const int32_t* __restrict__ ids, int64_t T, int k, int E, int* __restrict__ tile_counts,
                          int* __restrict__ sub_first, uint32_t* error_word) {
  extern __shared__ int run[];  // [kSubTiles][E]: each sub-tile's counts
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < kSubTiles * E; i += blockDim.x) run[i] = 0;
  __syncthreads();
  const int64_t st = sub_tile_tokens(k);
  const int64_t t0 = (int64_t(blockIdx.x) * kSubTiles + warp) * st;
  const int64_t i0 = min(t0, T) * k, i1 = min(t0 + st, T) * k;
  bool bad = false;
  int* mine = run + warp * E;
  // A sub-tile's ids are loaded at once (kSubTilePairs / 32 a lane; more steps only past
  // kSubTilePairs slots a token): one memory round trip, not one per 32 ids.
  constexpr int kIds = kSubTilePairs / 32;
  for (int64_t i = i0 + lane; i < i1; i += 32 * kIds) {
    int32_t e[kIds];
#pragma unroll
    for (int q = 0; q < kIds; ++q) e[q] = i + 32 * q < i1 ? ids[i + 32 * q] : 0;
#pragma unroll
    for (int q = 0; q < kIds; ++q) {
      if (i + 32 * q >= i1) continue;
      if (e[q] >= 0 && e[q] < E) {
        atomicAdd(&mine[e[q]], 1);
      } else {
        bad = true;
      }
    }
  }
  if (bad) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {  // exclusive scan over the sub-tiles, per expert
    int pos = 0;
    for (int w = 0; w < kSubTiles; ++w) {
      sub_first[(int64_t(blockIdx.x) * kSubTiles + w) * E + e] = pos;
      pos += run[w * E + e];
    }
    tile_counts[int64_t(blockIdx.x) * E + e] = pos;
  }
}

__device__ __forceinline__ int64_t warp_inclusive_sum(int64_t v) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int64_t up = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += up;
  }
  return v;
}

// Counts c0 .. c0 + kScanLoads - 1 of a scan thread's run col[0], col[E], ..., col[(n - 1) · E]
// (0 past n), the loads issued together.
__device__ __forceinline__ void load_run(int (&v)[kScanLoads], const int* col, int c0, int n, int E) {
#pragma unroll
  for (int q = 0; q < kScanLoads; ++q) v[q] = c0 + q < n ? col[(c0 + q) * E] : 0;
}

// One block of kScanThreads, laid out as runs x cols threads: thread i takes expert e = i % cols
// (cols: E rounded up to whole warps, so a warp reads 32 adjacent counts of a tile, one 128-byte
// line) and the g = i / cols-th of runs = kScanThreads / cols contiguous runs of the tiles. The
// whole count matrix is loaded at once, kScanLoads counts a thread at a time: one memory round trip
// while a run is at most kScanLoads tiles (tiles <= kScanLoads · runs), not a round trip or two per
// expert in turn, as a warp per expert takes. A thread's loads are strided by E, each a 64-bit
// address: 8 at a time keep it at about 40 registers (16 take all 64 a thread of the block may have).
//   1. Each thread sums its run -> part[g][e] (shared).
//   2. A run starts at the sum of its expert's earlier runs; the thread reloads its counts (from L1
//      or L2) and rewrites them as the tiles' first positions. The threads of run 0 take an expert
//      each: its total, the kept part under the capacity, the group padded to pad_multiple; a warp
//      scan of the groups over 32 experts.
//   3. Each warp scan plus the earlier warps' totals -> offsets; counts, kept, dropped.
__global__ void __launch_bounds__(kScanThreads)
    expert_offsets_kernel(int* tile_counts /* in: counts; out: first positions */, int64_t tiles, int E,
                          int64_t capacity, int64_t pad, int64_t* offsets, int64_t* kept_out, void* counts,
                          bool counts_i64, void* dropped, bool dropped_i64) {
  __shared__ int part[kScanThreads];  // [runs][cols]: each run's sum (0 past E and past the runs)
  __shared__ int64_t warp_total[kScanThreads / 32];
  __shared__ unsigned long long n_dropped;
  const int cols = (E + 31) / 32 * 32, runs = kScanThreads / cols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int e = threadIdx.x % cols, g = threadIdx.x / cols;
  // Sums of counts fit an int: an expert holds at most T·k < 2^31 pairs (checked on the host). A
  // thread's counts are col[0], col[E], ..., col[(n - 1) · E]; the offsets fit an int too, a tile
  // holding more than 1024 pairs (sub_tile_tokens(k) · k > 128), so tiles · E < 2^31.
  const int64_t per = (tiles + runs - 1) / runs;
  const int64_t t0 = e < E ? min(per * g, tiles) : 0;
  const int n = static_cast<int>(e < E ? min(t0 + per, tiles) - t0 : 0);
  int* const col = tile_counts + t0 * E + e;
  int sum = 0;
  for (int c0 = 0; c0 < n; c0 += kScanLoads) {
    int v[kScanLoads];
    load_run(v, col, c0, n, E);
#pragma unroll
    for (int q = 0; q < kScanLoads; ++q) sum += v[q];
  }
  part[threadIdx.x] = sum;
  if (threadIdx.x == 0) n_dropped = 0;
  __syncthreads();

  int run = 0;  // the run's first position inside its expert
  for (int r = 0; r < g; ++r) run += part[r * cols + e];
  for (int c0 = 0; c0 < n; c0 += kScanLoads) {
    int v[kScanLoads];
    load_run(v, col, c0, n, E);
#pragma unroll
    for (int q = 0; q < kScanLoads; ++q) {
      if (c0 + q < n) {
        col[(c0 + q) * E] = run;
        run += v[q];
      }
    }
  }
  const bool expert_thread = threadIdx.x < cols;  // whole warps: cols is a multiple of 32
  int64_t group = 0, inclusive = 0;
  if (expert_thread) {
    if (e < E) {
      int total = 0;
      for (int r = 0; r < runs; ++r) total += part[r * cols + e];
      const int64_t kept = min(int64_t(total), capacity);
      if (total != kept) atomicAdd(&n_dropped, static_cast<unsigned long long>(total - kept));
      kept_out[e] = kept;
      group = (kept + pad - 1) / pad * pad;
    }
    inclusive = warp_inclusive_sum(group);
    if (lane == 31) warp_total[warp] = inclusive;
  }
  __syncthreads();
  if (!expert_thread) return;
  int64_t at = inclusive;
  for (int w = 0; w < warp; ++w) at += warp_total[w];
  if (e < E) {
    offsets[e + 1] = at;
    if (counts_i64) {
      static_cast<int64_t*>(counts)[e] = group;
    } else {
      static_cast<int32_t*>(counts)[e] = static_cast<int32_t>(group);
    }
  }
  if (threadIdx.x == 0) {
    offsets[0] = 0;
    if (dropped != nullptr) {
      if (dropped_i64) {
        *static_cast<int64_t*>(dropped) = static_cast<int64_t>(n_dropped);
      } else {
        *static_cast<int32_t*>(dropped) = static_cast<int32_t>(n_dropped);
      }
    }
  }
}

// ---- the row kernels: token-major, so a token's row is read (or written) once from memory ----
//
// Every row kernel gives a warp one token at a time. Its lanes move a row in 16-byte packs (V
// elements), U packs each per step, all U loads issued before the first use, so a warp has 32·U
// packs in flight instead of one per lane. The slots of a token are taken 32 at a time: lane l
// holds slot j0 + l's row (and weight), and the warp walks them in slot order through shuffles.

constexpr int kCopyPacks = 8;  // packs per lane per step in permute's row copy

template <typename P, int U>
__device__ __forceinline__ void load_packs(P (&p)[U], const P* __restrict__ row, int64_t c0, int64_t packs) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c0 + 32 * u < packs) p[u] = row[c0 + 32 * u];
  }
}

template <typename P, int U>
__device__ __forceinline__ void store_packs(P* __restrict__ row, const P (&p)[U], int64_t c0, int64_t packs) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (c0 + 32 * u < packs) row[c0 + 32 * u] = p[u];
  }
}

// Slot j0 + lane of token t: the gradient row it writes, or -1. A row is written by the one
// (token, slot) that owns it: the row is in [0, rows), src_token[row] is t and no earlier slot of
// t names the row (the (t, slot) that the row's src_token leads to).
__device__ __forceinline__ int32_t owned_row(const int32_t* __restrict__ row_of, const int32_t* __restrict__ src_token,
                                             int64_t t, int k, int j0, int64_t rows) {
  const int lane = threadIdx.x & 31;
  const int j = j0 + lane;
  const int32_t r = j < k ? row_of[t * k + j] : -1;
  bool own = r >= 0 && r < rows && src_token[r] == t;
  const unsigned peers = __match_any_sync(0xffffffffu, r);
  own = own && (peers & ((1u << lane) - 1u)) == 0u;
  for (int e = 0; e < j0 && own; ++e) own = row_of[t * k + e] != r;
  return own ? r : -1;
}

// The second phase of combine's backward: every gradient row that no (token, slot) owns (padding,
// rows past the total, a src_token out of range) is written as zeros. A thread checks a row; the
// warp then zeros the rows its lanes found, one at a time. A src_token >= T is recorded.
template <typename T, int V>
__device__ void zero_unowned_rows(T* out, int64_t ld_out, int64_t rows, int64_t H, const int32_t* __restrict__ row_of,
                                  const int32_t* __restrict__ src_token, int k, int64_t T_, uint32_t* error_word) {
  using P = Pack<T, V>;
  const int lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  const int64_t step = int64_t(gridDim.x) * kRowWarps * 32;
  for (int64_t base = (int64_t(blockIdx.x) * kRowWarps + threadIdx.x / 32) * 32; base < rows; base += step) {
    const int64_t r = base + lane;
    bool owned = true;
    if (r < rows) {
      const int32_t t = src_token[r];
      owned = t >= 0 && t < T_;
      if (t >= T_) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
      if (owned) {  // no short circuit: the k loads go out together, not one after another
        bool found = false;
        for (int j = 0; j < k; ++j) found |= row_of[int64_t(t) * k + j] == r;
        owned = found;
      }
    }
    P zero;
#pragma unroll
    for (int v = 0; v < V; ++v) zero.v[v] = from_f<T>(0.f);
    for (unsigned m = __ballot_sync(0xffffffffu, !owned); m != 0u; m &= m - 1u) {
      P* dst = reinterpret_cast<P*>(out + (base + __ffs(m) - 1) * ld_out);
      for (int64_t c = lane; c < packs; c += 32) dst[c] = zero;
    }
  }
}

struct PermuteRowsArgs {
  const int32_t* ids;
  int64_t T;
  int k, E;
  const int* first_pos;    // [tiles, E]: the tile's first position inside each expert
  const int* sub_first;    // [tiles, kSubTiles, E]: the sub-tile's first position inside its tile
  const int64_t* offsets;  // [E + 1]: each expert's first row; offsets[E], the padded total
  const int64_t* kept;     // [E]: each expert's pairs under the capacity
  int64_t capacity;
  const float* probs;     // or nullptr (then permuted_probs is too)
  float* permuted_probs;  // or nullptr
  int32_t* row_of;
  int32_t* src_token;
  const void* x;
  int64_t ld_x;
  void* out;
  int64_t ld_out, rows, H;
};

constexpr int kRankLoads = 4;  // ids a lane loads at once when ranking a pair in its sub-tile

// Permute's placement and copy, one warp per token (see the top of the file): each kept (t, j)
// gets its row, row_of / src_token / permuted_probs, and permuted[row] = x[t], x[t] read once and
// written k times; then zeros on every other row (padding, past the total).
template <typename T, int V>
__global__ void __launch_bounds__(kRowWarps * 32, 4)  // <= 64 registers: 4 blocks (32 warps) per SM
    permute_rows_kernel(PermuteRowsArgs a) {
  using P = Pack<T, V>;
  constexpr int U = kCopyPacks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const unsigned below = (1u << lane) - 1u;
  const int64_t packs = a.H / V;
  const int k = a.k;
  // Token and pair indices in 32 bits: T·k < 2^31 (checked on the host), and 64-bit division and
  // compares cost instructions and registers the copy needs.
  const unsigned st = static_cast<unsigned>(sub_tile_tokens(k)), tile_tokens = st * kSubTiles;
  T* out = static_cast<T*>(a.out);
  for (int64_t t = blockIdx.x * int64_t(kRowWarps) + warp; t < a.T; t += int64_t(gridDim.x) * kRowWarps) {
    const P* src = reinterpret_cast<const P*>(static_cast<const T*>(a.x) + t * a.ld_x);
    const unsigned tile = static_cast<unsigned>(t) / tile_tokens, sub = static_cast<unsigned>(t) % tile_tokens / st;
    const unsigned p0 = (tile * tile_tokens + sub * st) * k;  // the sub-tile's first pair
    const int* first = a.first_pos + int64_t(tile) * a.E;
    const int* sub_first = a.sub_first + (int64_t(tile) * kSubTiles + sub) * a.E;
    for (int j0 = 0; j0 < k; j0 += 32) {
      const int j = j0 + lane;
      const unsigned i = static_cast<unsigned>(t) * k + j;
      const int32_t raw = j < k ? a.ids[i] : -1;
      const int32_t e = raw >= 0 && raw < a.E ? raw : -1;
      int pos = 0;
      int64_t off = 0;
      if (e >= 0) {
        pos = first[e] + sub_first[e];
        off = a.offsets[e];
      }
      const float prob = (a.probs != nullptr && j < k) ? a.probs[i] : 0.f;
      // The sub-tile's pairs before (t, j0) with the expert of slot j0 + s, by ballots over the ids,
      // then the chunk's own earlier slots.
      const int n = min(32, k - j0);
      const unsigned p1 = static_cast<unsigned>(t) * k + j0;
      int before = 0;
      for (unsigned c = p0; c < p1; c += 32 * kRankLoads) {
        int32_t id[kRankLoads];
#pragma unroll
        for (int q = 0; q < kRankLoads; ++q) id[q] = c + 32 * q + lane < p1 ? a.ids[c + 32 * q + lane] : -1;
        for (int s = 0; s < n; ++s) {
          const int32_t es = __shfl_sync(0xffffffffu, e, s);
          if (es < 0) continue;  // the same for every lane
          int same = 0;
#pragma unroll
          for (int q = 0; q < kRankLoads; ++q) same += __popc(__ballot_sync(0xffffffffu, id[q] == es));
          if (lane == s) before += same;
        }
      }
      before += __popc(__match_any_sync(0xffffffffu, e) & below);
      pos += before;
      const int32_t row = (e >= 0 && pos < a.capacity) ? static_cast<int32_t>(off + pos) : -1;
      if (j < k) a.row_of[i] = row;
      if (row >= 0) {
        a.src_token[row] = static_cast<int32_t>(t);
        if (a.permuted_probs != nullptr) a.permuted_probs[row] = prob;
      }
      const unsigned live = __ballot_sync(0xffffffffu, row >= 0);
      for (int64_t base = 0; live != 0u && base < packs; base += 32 * U) {
        P p[U];
        load_packs(p, src, base + lane, packs);
        for (unsigned m = live; m != 0u; m &= m - 1u) {
          const int32_t r = __shfl_sync(0xffffffffu, row, __ffs(m) - 1);
          store_packs(reinterpret_cast<P*>(out + r * a.ld_out), p, base + lane, packs);
        }
      }
    }
  }
  // The rows no pair owns: expert e's [offsets[e] + kept[e], offsets[e + 1]) (unit e), then the
  // rows past the padded total in runs of 32 (one unit each); a warp per unit.
  const int64_t total = min(a.offsets[a.E], a.rows);
  const int64_t units = a.E + (a.rows - total + 31) / 32;
  P zero;
#pragma unroll
  for (int v = 0; v < V; ++v) zero.v[v] = from_f<T>(0.f);
  for (int64_t u = blockIdx.x * int64_t(kRowWarps) + warp; u < units; u += int64_t(gridDim.x) * kRowWarps) {
    const int64_t r0 = u < a.E ? a.offsets[u] + a.kept[u] : total + (u - a.E) * 32;
    const int64_t r1 = min(u < a.E ? a.offsets[u + 1] : r0 + 32, a.rows);
    for (int64_t r = r0 + lane; r < r1; r += 32) {
      a.src_token[r] = -1;
      if (a.permuted_probs != nullptr) a.permuted_probs[r] = 0.f;
    }
    for (int64_t r = r0; r < r1; ++r) {
      P* dst = reinterpret_cast<P*>(out + r * a.ld_out);
      for (int64_t c = lane; c < packs; c += 32) dst[c] = zero;
    }
  }
}

// The combine kernels take a token's slots S at a time (a batch) and, per batch and step, issue
// the U-pack loads of all S rows before summing any: S·U independent 16-byte loads per lane in
// flight, one memory round trip per step for the whole batch instead of one per slot or pair. The
// sums still run in slot order, so the result does not depend on S or U. S comes from k on the host
// (a batch wider than k leaves loads unused). U and the blocks per SM (the register bound) are the
// largest that ptxas fits without spilling: combine holds S·U packs and U·V f32 sums per lane, its
// backward S·U + U packs, S dot products and S rows of each of its three maps, so it takes at most
// 4 slots a batch.
template <int S>
struct CombineShape {
  static constexpr int kPacks = S == 2 ? 4 : 2;
  static constexpr int kBlocks = S == 4 ? 3 : 2;
};
template <int S>
struct CombineBackwardShape {
  static_assert(S <= 4, "combine's backward takes at most 4 slots a batch");
  static constexpr int kPacks = 8 / S;
  static constexpr int kBlocks = 2;
};

// The slots of token t in lanes, 32 at a time (slot j0 + lane): its row (-1 past k) and weight.
// `bad` records a row outside [-1, rows).
__device__ __forceinline__ void lane_slot(const int32_t* __restrict__ row_of, const float* __restrict__ w, int64_t t,
                                          int k, int j0, int64_t rows, int32_t& r, float& p, bool& bad) {
  const int j = j0 + (threadIdx.x & 31);
  r = j < k ? row_of[t * k + j] : -1;
  p = (j < k && w != nullptr) ? w[t * k + j] : 1.f;
  bad = bad || r >= rows || r < -1;
}

// out[t] = Σ_j w[t, j] · y[row_of[t, j]] over the kept slots, in slot order, f32, rounded once
// (w: probs, or 1 when nullptr). A row outside [-1, rows) counts as dropped and is recorded.
template <typename T, int V, int S>
__global__ void __launch_bounds__(kRowWarps * 32, CombineShape<S>::kBlocks)
    combine_kernel(const T* __restrict__ y, int64_t ld_y, int64_t rows, const int32_t* __restrict__ row_of,
                   const float* __restrict__ w, int k, T* __restrict__ out, int64_t ld_out, int64_t T_, int64_t H,
                   uint32_t* error_word) {
  using P = Pack<T, V>;
  using L = LoadedPack<T, V>;
  constexpr int U = CombineShape<S>::kPacks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  for (int64_t t = blockIdx.x * int64_t(kRowWarps) + warp; t < T_; t += int64_t(gridDim.x) * kRowWarps) {
    bool bad = false;
    int32_t r = -1;
    float p = 1.f;
    if (k <= 32) lane_slot(row_of, w, t, k, 0, rows, r, p, bad);  // every step reuses them
    for (int64_t base = 0; base < packs; base += 32 * U) {
      float acc[U][V];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int v = 0; v < V; ++v) acc[u][v] = 0.f;
      }
      for (int j0 = 0; j0 < k; j0 += 32) {
        if (k > 32) lane_slot(row_of, w, t, k, j0, rows, r, p, bad);
        const int n = min(32, k - j0);
        for (int jb = 0; jb < n; jb += S) {  // jb + s < 32: S divides 32
          int32_t rs[S];
          float ps[S];
#pragma unroll
          for (int s = 0; s < S; ++s) {
            rs[s] = __shfl_sync(0xffffffffu, r, jb + s);
            ps[s] = __shfl_sync(0xffffffffu, p, jb + s);
          }
          L in[S][U];
#pragma unroll
          for (int s = 0; s < S; ++s) {
            if (rs[s] >= 0 && rs[s] < rows) {
              load_packs(in[s], reinterpret_cast<const L*>(y + rs[s] * ld_y), base + lane, packs);
            }
          }
#pragma unroll
          for (int s = 0; s < S; ++s) {
            if (rs[s] >= 0 && rs[s] < rows) {
#pragma unroll
              for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int v = 0; v < V; ++v) acc[u][v] += ps[s] * in[s][u].at(v);
              }
            }
          }
        }
      }
      P o[U];
#pragma unroll
      for (int u = 0; u < U; ++u) {
#pragma unroll
        for (int v = 0; v < V; ++v) o[u].v[v] = from_f<T>(acc[u][v]);
      }
      store_packs(reinterpret_cast<P*>(out + t * ld_out), o, base + lane, packs);
    }
    if (bad) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
  }
}

// combine's backward in one pass over the tokens. For each slot (t, j):
//   dy[r] = w[t, j] · dout[t] when (t, j) owns its row r (see owned_row);
//   dprobs[t, j] = Σ_h dout[t, h] · y[r, h] in f32 when r is in [0, rows), else 0: each lane over
//   its packs in order, then the warp butterfly.
// A batch of S slots walks the row once: each step loads dout's packs once and the S expert rows'
// packs together (as in combine), then writes the S gradient rows. dout[t] is read from memory
// once (its re-reads, one per batch, hit the caches), each expert row once, each gradient row
// written once. Then zeros on every row no slot owns.
template <typename T, int V, int S>
__global__ void __launch_bounds__(kRowWarps * 32, CombineBackwardShape<S>::kBlocks)
    combine_backward_kernel(const T* __restrict__ dout, int64_t ld_dout, int64_t T_, const int32_t* __restrict__ row_of,
                            const int32_t* __restrict__ src_token, const float* __restrict__ w, int k,
                            const T* __restrict__ y, int64_t ld_y, T* __restrict__ dy, int64_t ld_dy, int64_t rows,
                            int64_t H, float* __restrict__ dprobs, uint32_t* error_word) {
  using P = Pack<T, V>;
  using L = LoadedPack<T, V>;
  constexpr int U = CombineBackwardShape<S>::kPacks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int64_t packs = H / V;
  for (int64_t t = blockIdx.x * int64_t(kRowWarps) + warp; t < T_; t += int64_t(gridDim.x) * kRowWarps) {
    const L* g = reinterpret_cast<const L*>(dout + t * ld_dout);
    for (int j0 = 0; j0 < k; j0 += 32) {
      const int32_t mine = owned_row(row_of, src_token, t, k, j0, rows);
      int32_t r;
      float p;
      bool unused = false;
      lane_slot(row_of, w, t, k, j0, rows, r, p, unused);
      const int n = min(32, k - j0);
      for (int jb = 0; jb < n; jb += S) {  // jb + s < 32: S divides 32
        int32_t own[S], rs[S];
        float ps[S], dot[S];
        bool any = false;
#pragma unroll
        for (int s = 0; s < S; ++s) {
          own[s] = __shfl_sync(0xffffffffu, mine, jb + s);
          rs[s] = __shfl_sync(0xffffffffu, r, jb + s);
          ps[s] = __shfl_sync(0xffffffffu, p, jb + s);
          if (dprobs == nullptr || rs[s] >= rows) rs[s] = -1;  // -1: no dot product for the slot
          dot[s] = 0.f;
          any = any || own[s] >= 0 || rs[s] >= 0;
        }
        for (int64_t base = 0; any && base < packs; base += 32 * U) {
          L a[U], b[S][U];
          load_packs(a, g, base + lane, packs);
#pragma unroll
          for (int s = 0; s < S; ++s) {
            if (rs[s] >= 0) load_packs(b[s], reinterpret_cast<const L*>(y + rs[s] * ld_y), base + lane, packs);
          }
#pragma unroll
          for (int s = 0; s < S; ++s) {
            if (rs[s] >= 0) {
#pragma unroll
              for (int u = 0; u < U; ++u) {
                if (base + lane + 32 * u < packs) {
#pragma unroll
                  for (int v = 0; v < V; ++v) dot[s] += a[u].at(v) * b[s][u].at(v);
                }
              }
            }
          }
#pragma unroll
          for (int s = 0; s < S; ++s) {
            if (own[s] >= 0) {
              P o[U];
#pragma unroll
              for (int u = 0; u < U; ++u) {
#pragma unroll
                for (int v = 0; v < V; ++v) o[u].v[v] = from_f<T>(ps[s] * a[u].at(v));
              }
              store_packs(reinterpret_cast<P*>(dy + own[s] * ld_dy), o, base + lane, packs);
            }
          }
        }
        if (dprobs != nullptr) {
#pragma unroll
          for (int s = 0; s < S; ++s) {
            const float d = warp_sum(dot[s]);
            if (lane == 0 && jb + s < n) dprobs[t * k + j0 + jb + s] = d;
          }
        }
      }
    }
  }
  zero_unowned_rows<T, V>(dy, ld_dy, rows, H, row_of, src_token, k, T_, error_word);
}

// dprobs[t, j] = dpermuted_probs[row_of[t, j]], 0 where dropped.
__global__ void gather_probs_kernel(const float* dpp, int64_t rows, const int32_t* row_of, int64_t n, float* dprobs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = row_of[i];
    dprobs[i] = (r >= 0 && r < rows) ? dpp[r] : 0.f;
  }
}

void check_cuda_experts(int64_t E) {
  GMOE_CHECK(E <= routing::kMaxRoutingExperts, "counts: at most ", routing::kMaxRoutingExperts,
             " experts on CUDA, got ", E);
}

// Calls f(std::integral_constant<int, S>{}) with the combine kernels' slot batch for k slots: the
// smallest of 2, 4, 8 that holds them, at most kMax.
template <int kMax, typename F>
void with_slot_batch(int64_t k, F&& f) {
  if (k <= 2 || kMax == 2) {
    f(std::integral_constant<int, 2>{});
  } else if (k <= 4 || kMax == 4) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, (kMax >= 8 ? 8 : 4)>{});
  }
}

void launch_combine(const TensorView& y, const TensorView& row_of, const float* w, const TensorView& out,
                    cudaStream_t stream) {
  const int64_t T = out.size(0), H = out.size(1);
  if (T == 0 || H == 0) return;
  const int64_t k = row_of.size(1);
  routing::with_row_type(y.dtype, H, {y, out}, [&](auto t, auto v) {
    with_slot_batch<8>(k, [&](auto s) {
      using T_ = decltype(t);
      constexpr int V = decltype(v)::value, S = decltype(s)::value;
      combine_kernel<T_, V, S><<<routing::grid_for(T, kRowWarps), kRowWarps * 32, 0, stream>>>(
          static_cast<const T_*>(y.data), y.stride(0), y.size(0), static_cast<const int32_t*>(row_of.data), w, int(k),
          static_cast<T_*>(out.data), out.stride(0), T, H, device_error_word());
    });
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs, const TensorView& permuted_probs,
             const TensorView& dropped, Stream stream_, Allocator& alloc) {
  cudaStream_t stream = stream_;
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = counts.size(0), rows = permuted.size(0);
  check_cuda_experts(E);
  const int64_t cap_opt = expert_capacity(T, k, E, options);
  const int64_t capacity = cap_opt < 0 ? std::numeric_limits<int64_t>::max() : cap_opt;
  const int64_t tile_tokens = sub_tile_tokens(k) * kSubTiles;
  const int64_t tiles = (T + tile_tokens - 1) / tile_tokens;
  // Scratch: offsets [E + 1] and kept [E] (i64); tile counts (then first positions) [tiles, E] and
  // the sub-tiles' first positions [tiles, kSubTiles, E] (int).
  Buffer scratch(alloc, size_t(2 * E + 1) * sizeof(int64_t) + size_t(tiles) * (1 + kSubTiles) * E * sizeof(int) + 16,
                 stream_);
  int64_t* offsets = static_cast<int64_t*>(scratch.data());
  int64_t* kept = offsets + E + 1;
  int* tile_counts = reinterpret_cast<int*>(kept + E);
  int* sub_first = tile_counts + tiles * E;
  const int32_t* id = static_cast<const int32_t*>(ids.data);
  if (tiles > 0) {
    tile_histogram_kernel<<<unsigned(tiles), kSubTiles * 32, size_t(kSubTiles) * E * sizeof(int), stream>>>(
        id, T, int(k), int(E), tile_counts, sub_first, device_error_word());
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  // With no tokens (no tiles) every expert's total is 0: the scan reads no tile.
  expert_offsets_kernel<<<1, kScanThreads, 0, stream>>>(tile_counts, tiles, int(E), capacity, options.pad_multiple,
                                                        offsets, kept, counts.data, counts.dtype == DType::i64,
                                                        dropped.defined() ? dropped.data : nullptr,
                                                        dropped.defined() && dropped.dtype == DType::i64);
  GMOE_CUDA_CHECK(cudaGetLastError());
  if (T == 0 && rows == 0) return;
  PermuteRowsArgs a{id,
                    T,
                    int(k),
                    int(E),
                    tile_counts,
                    sub_first,
                    offsets,
                    kept,
                    capacity,
                    probs.defined() ? static_cast<const float*>(probs.data) : nullptr,
                    permuted_probs.defined() ? static_cast<float*>(permuted_probs.data) : nullptr,
                    static_cast<int32_t*>(map.row_of.data),
                    static_cast<int32_t*>(map.src_token.data),
                    x.data,
                    x.stride(0),
                    permuted.data,
                    permuted.stride(0),
                    rows,
                    H};
  routing::with_row_type(x.dtype, H, {x, permuted}, [&](auto t, auto v) {
    using T_ = decltype(t);
    constexpr int V = decltype(v)::value;
    permute_rows_kernel<T_, V>
        <<<routing::grid_for(std::max(T, (rows + 31) / 32), kRowWarps), kRowWarps * 32, 0, stream>>>(a);
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs, const TensorView& dprobs, Stream stream, Allocator&) {
  launch_combine(dpermuted, map.row_of, nullptr, dx, stream);
  const int64_t n = map.row_of.numel();
  if (dprobs.defined() && n > 0) {
    gather_probs_kernel<<<routing::grid_for(n, 256), 256, 0, stream>>>(
        static_cast<const float*>(dpermuted_probs.data), dpermuted.size(0),
        static_cast<const int32_t*>(map.row_of.data), n, static_cast<float*>(dprobs.data));
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
}

void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out,
             Stream stream, Allocator&) {
  launch_combine(expert_out, map.row_of, probs.defined() ? static_cast<const float*>(probs.data) : nullptr, out,
                 stream);
}

void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs,
                      Stream stream_, Allocator&) {
  cudaStream_t stream = stream_;
  const int64_t T = dout.size(0), H = dout.size(1), rows = dexpert_out.size(0), k = map.row_of.size(1);
  const float* w = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  const int32_t* row_of = static_cast<const int32_t*>(map.row_of.data);
  float* dp = dprobs.defined() ? static_cast<float*>(dprobs.data) : nullptr;
  // One launch writes every row of dexpert_out (rows > 0) and every dprobs (T > 0); the dtype and
  // pack width are chosen over all three row tensors.
  if (!((rows > 0 && H > 0) || (dp != nullptr && T > 0))) return;
  routing::with_row_type(
      dout.dtype, H, {dout, dexpert_out, dp != nullptr ? expert_out : TensorView{}}, [&](auto t, auto v) {
        with_slot_batch<4>(k, [&](auto s) {
          using T_ = decltype(t);
          constexpr int V = decltype(v)::value, S = decltype(s)::value;
          combine_backward_kernel<T_, V, S>
              <<<routing::grid_for(std::max(T, (rows + 31) / 32), kRowWarps), kRowWarps * 32, 0, stream>>>(
                  static_cast<const T_*>(dout.data), dout.stride(0), T, row_of,
                  static_cast<const int32_t*>(map.src_token.data), w, int(k), static_cast<const T_*>(expert_out.data),
                  dp != nullptr ? expert_out.stride(0) : 0, static_cast<T_*>(dexpert_out.data), dexpert_out.stride(0),
                  rows, H, dp, device_error_word());
        });
      });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gmoe::cuda_backend
