// src/cuda/fp8_gemm/fp8_gemm_heuristics.cu — the FP8 grouped GEMM's heuristics, in one place:
// which compiled kernel (fp8_grouped_gemm_instances.def) runs a call, in which cluster, and the
// tile order of a weight gradient.
//
// Overrides come only from gmoe::current_tuning() (gmoe/tuning.h): fp8_rows_cluster, else
// cluster, for fprop/dgrad here; cluster and wgrad_raster for the weight gradient through the
// rules it shares with the 16-bit GEMM (wgrad_cluster_2x1, choose_wgrad_raster_along_n in
// cuda/gemm/grouped_gemm_prepare.h). A forced cluster that is not compiled for a call is ignored
// for that call.
#include "cuda/fp8_gemm/fp8_gemm_heuristics.h"

#include <algorithm>

#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"
#include "gmoe/tuning.h"

namespace gmoe::cuda_backend {
namespace {

// fprop/dgrad's cluster. 2x1: two CTAs along M share B's tile by TMA multicast, but the tiles are
// scheduled in pairs along M, so a group with an odd number of M tiles computes one all-out-of-range
// tile per N tile, and groups of few tiles lose more than the multicast gains. The promoted
// mainloops (blockwise, tensorwise) gain from 2048 rows per expert on average. The fast-accumulation
// kernels (128x256 tiles) gain less from the multicast: they pair from 4096 rows per expert, and
// only while the output is at most 2048 columns wide.
constexpr int64_t kCluster2x1MinRows = 2048;
constexpr int64_t kFastCluster2x1MinRows = 4096;
constexpr int64_t kFast2x1MaxN = 2048;
// 2x2 multicasts A's tile along N as well. The tiles in flight walk along M, so every N tile reads
// A again; with a long reduction the A tiles in flight (128 rows x K each: 3.6 MB at K = 28672)
// overflow the L2 and each N tile reads them from DRAM, where 2x2 loads each once for two N tiles.
// That pays from a reduction of 16384; shorter ones run as fast or slower in 2x2.
constexpr int64_t kCluster2x2MinK = 16384;

// Fast accumulation (Fp8GemmOptions) runs tensorwise fprop/dgrad in 128x256 tiles whose
// accumulators never leave the tensor cores: faster than the promoted 128x128 kernel wherever
// it is asked. Not with a fused bias (no such kernel), and not in 2x2 clusters (the promoted 2x2
// kernel runs).
bool wants_fast_tiles(const Fp8RowsProblem& p) {
  return p.fast_accumulation && p.scaling == Fp8Scaling::tensorwise && !p.bias;
}

// The heuristic's tile and cluster for an fprop/dgrad call.
Fp8Tile rows_tile(const Fp8RowsProblem& p) {
  // An e5m2 A (the gradient in dgrad, under the gradient recipes) runs its one kernel, 128x128
  // in 1x1: every cluster would add a kernel to the build for that format.
  if (p.format_a == DType::e5m2) return Fp8Tile::t128x128;
  // A fused bias gains from the 2x1 pairs as the GEMM without it does, so the 2x1 rule holds for
  // it; its kernels come in 1x1 and 2x1 only, so the 2x2 rule does not.
  if (!p.bias && p.gemm_k >= kCluster2x2MinK) return Fp8Tile::t128x128_2x2;
  const bool fast = wants_fast_tiles(p);
  if (fast && p.gemm_n > kFast2x1MaxN) return Fp8Tile::t128x256;
  const int64_t rows_per_expert = p.capacity / std::max<int64_t>(p.num_experts, 1);
  const bool pairs = rows_per_expert >= (fast ? kFastCluster2x1MinRows : kCluster2x1MinRows);
  if (fast) return pairs ? Fp8Tile::t128x256_2x1 : Fp8Tile::t128x256;
  return pairs ? Fp8Tile::t128x128_2x1 : Fp8Tile::t128x128;
}

// The tile of a forced cluster: fast accumulation's 128x256 tile where one is compiled in it.
Fp8Tile tile_in_cluster(ClusterShape cluster, bool fast) {
  switch (cluster) {
    case ClusterShape::c2x1: return fast ? Fp8Tile::t128x256_2x1 : Fp8Tile::t128x128_2x1;
    case ClusterShape::c2x2: return Fp8Tile::t128x128_2x2;
    default: return fast ? Fp8Tile::t128x256 : Fp8Tile::t128x128;
  }
}

}  // namespace

Fp8KernelKey choose_fp8_rows_kernel(const Fp8RowsProblem& p) {
  Fp8KernelKey key;
  key.scaling = p.scaling;
  key.operands = Fp8Operands::rows;
  key.out = DType::bf16;
  key.epilogue = p.bias ? Fp8Epilogue::bias : Fp8Epilogue::none;
  key.format_a = p.format_a;
  const ClusterShape forced = current_tuning().fp8_rows_cluster_forced();
  if (forced != ClusterShape::automatic) {
    key.tile = tile_in_cluster(forced, wants_fast_tiles(p));
    if (find_fp8_kernel(key) != nullptr) return key;
  }
  key.tile = rows_tile(p);
  return key;
}

// The weight gradient's cluster is the 16-bit weight gradient's rule (wgrad_cluster_2x1: the
// layer's N spans an even number of tiles, or many) for the tensorwise kernels with an e4m3 A.
// The blockwise weight gradient runs 1x1: its time goes to the promotion by its column scales
// (sm90_fp8_grouped_gemm.cuh), not to B's tiles, so the multicast gains nothing. An e5m2 A has
// its 1x1 kernels only (as in fprop/dgrad).
// The tensorwise weight gradient into bf16 is the rows kernel: TN, bf16 out, no source operand,
// the GEMM of fprop and dgrad; only the arrays that prepare writes differ.
Fp8KernelKey choose_fp8_wgrad_kernel(Fp8Scaling scaling, DType out, DType format_a, int64_t m) {
  Fp8KernelKey key;
  key.scaling = scaling;
  key.operands = scaling == Fp8Scaling::tensorwise && out == DType::bf16 ? Fp8Operands::rows : Fp8Operands::wgrad;
  key.out = out;
  key.format_a = format_a;
  const bool pairs = scaling == Fp8Scaling::tensorwise && format_a == DType::e4m3 && wgrad_cluster_2x1(m);
  key.tile = pairs ? Fp8Tile::t128x128_2x1 : Fp8Tile::t128x128;
  return key;
}

// The 16-bit weight gradient's rule, on 1-byte operands: along N when A (dy_e) overflows half the
// L2 and B (x_e) fits. The tensorwise weight gradient into bf16 (the rows kernel) walks along N
// whatever the sizes: along M its time varies widely from run to run on the large skewed cases,
// along N it holds steady and is never slower. The f32 and blockwise kernels keep the rule: along
// N they run a few percent slower.
bool choose_fp8_wgrad_raster_along_n(const Fp8KernelKey& kernel, int64_t m, int64_t n, int64_t padded_capacity,
                                     int64_t num_experts) {
  const bool rows_kernel = kernel.operands == Fp8Operands::rows;
  return choose_wgrad_raster_along_n(m, n, padded_capacity, num_experts, DType::e4m3, rows_kernel);
}

}  // namespace gmoe::cuda_backend
