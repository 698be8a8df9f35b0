// src/cuda/fp8_gemm/sm90_fp8_grouped_gemm.cuh — the CUTLASS 3.x FP8 grouped (pointer-array)
// warp-specialized GEMM behind Fp8GroupedGemmKernel, for sm_90a.
//
// Include this only from the instantiation files that CMake generates from
// fp8_grouped_gemm_instances.def (GMOE_FP8_GEMM_INSTANTIATE, at the end): it is heavy.
//
// Two mainloops, both with fp32 accumulation that is promoted out of the tensor cores every
// 128-long k-tile (Hopper's FP8 wgmma accumulates with fewer than fp32's bits):
//   blockwise   CUTLASS's MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise (its producer: TMA for
//               the operands, 4-byte cp.async for the scales, so any 4-byte aligned scale pointer
//               works) with gmoe's own consumer loop (BlockwiseMainloop::mma): after each k-tile
//               the partial sums are multiplied by the A scale of their row (granularity 1 along
//               M) and the B scale of their column block (128 for weights, 1 for wgrad's x) and
//               added to the accumulators, while the next k-tile's wgmmas run.
//   tensorwise  CUTLASS's FP8 pointer-array mainloop (no scales) with the same consumer loop
//               (TensorwiseMainloop: the partial sums added, unscaled, while the next k-tile's
//               wgmmas run); the epilogue multiplies by the group's alpha_e = sa[e]·sb[e], read
//               through a per-group pointer array. With fast accumulation (128x256 tiles) the
//               tensor cores accumulate the whole reduction: CUTLASS's mainloop as it is.
//
// The scale layout of a group. In CUTLASS 4.2 the grouped blockwise mainloop derives each group's
// scale layout from its problem shape alone (K-major: row stride ceil(K/128); MN-major: k-block
// stride M or N), ignoring the per-group layouts passed in its arguments. BlockwiseMainloop below
// derives from CUTLASS's collective and makes those strides launch arguments (the same for every
// group of a launch), so that they are the buffers' own: fprop/dgrad read A's MN-major scales,
// the columns [offsets[e], ...) of the token-major [ceil(K/128), capacity] scales of the rowwise
// copy (k-block stride: capacity), and the weights' K-major ones; wgrad reads MN-major ones for
// both operands, the rows [padded_offsets[e]/128, ...) of the token-block-major
// [padded_capacity/128, cols] scales of the columnwise copies.
//
// Why MN-major: a k-tile needs 128 scales of A (and, in wgrad, 128 of B). K-major, they are 128
// floats in 128 different cache lines, loaded 4 bytes at a time by the producer warp; the lines
// do not fit in what the 200+ KB of shared memory leave of L1 when the reduction is long, so every
// k-tile misses again. MN-major, they are contiguous 512-byte runs.
//
// Everything else follows sm90_grouped_gemm.cuh: device-only problem shapes (the group scheduler
// walks them on the device), empty groups as M = 0, TMA clipping partial tiles.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/thread/activation.h>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <type_traits>

#include "cuda/runtime/cuda_check.h"
#include "cuda/fp8_gemm/fp8_grouped_gemm_kernels.h"
#include "cuda/gemm/sm90_bias_epilogue.cuh"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace sm90fp8 {

/// The tensorwise fused-bias epilogue: D = alpha_e·acc + bias_e, one FMA in f32 and one rounding.
/// alpha_e (= sa_e·sb_e) is read through a per-group pointer array (L stride 1, refreshed per
/// tile), the bias as sm90::BiasTree reads it (a per-group row broadcast).
template <class ElementD, class ElementBias, class TileShape>
struct ScaledBiasTree {
  using RowBias = typename sm90::BiasTree<ElementD, ElementBias, TileShape>::RowBias;
  using Alpha = cutlass::epilogue::fusion::Sm90ScalarBroadcastPtrArray<float, cute::Stride<cute::_0, cute::_0, int64_t>>;
  using Fma = cutlass::epilogue::fusion::Sm90Compute<cutlass::homogeneous_multiply_add, ElementD, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
  using type = cutlass::epilogue::fusion::Sm90EVT<Fma, Alpha, cutlass::epilogue::fusion::Sm90AccFetch, RowBias>;
};

/// The consumer k-loop of gmoe's promoting FP8 mainloops (BlockwiseMainloop, TensorwiseMainloop),
/// replacing their CUTLASS collectives'. Those issue a k-tile's wgmmas, wait for them, and only
/// then scale the partial sums and add them to the accumulators (tensorwise: every 4 k-steps, its
/// promotion interval), so the tensor cores idle through every promotion (both consumer
/// warpgroups reach it together). Here the partial sums alternate between two register fragments:
/// the wgmmas of k-tile t+1 are issued into one before k-tile t's partial sums in the other are
/// promoted, so the promotion's arithmetic runs while the tensor cores work (the same register
/// pipelining as FlashAttention-3's softmax). Cost: one more 64-float fragment per thread. Each
/// stage goes back to the producer as soon as its partial sums (and scales) have been read, so
/// mma_tail has nothing left to release. The accumulators start from zero here (CUTLASS's
/// collectives leave them as they were when a tile has no k-tiles).
///
/// `Collective`: the CUTLASS collective whose operand stages (`shared_tensors`) are read.
/// `init(stage)` runs once, when the first k-tile's stage has arrived and its wgmmas are issued:
/// it may set the accumulators' starting values (zero otherwise; the fused bias, below).
/// `prepare(stage)` runs while k-tile `stage`'s wgmmas may still be in flight (the scale loads);
/// `promote(part, stage)` once they have completed: accum += part, scaled.
template <class Collective, class FrgTensorC, class Init, class Prepare, class Promote>
CUTLASS_DEVICE void promoted_k_loop(typename Collective::TensorStorage& shared_tensors, int thread_idx,
                                    FrgTensorC& accum, typename Collective::MainloopPipeline& pipeline,
                                    typename Collective::PipelineState smem_pipe_read, int k_tile_count,
                                    Init&& init, Prepare&& prepare, Promote&& promote) {
  using namespace cute;
  using TiledMma = typename Collective::TiledMma;
  using PipelineState = typename Collective::PipelineState;
  static_assert(is_rmem<FrgTensorC>::value, "C tensor must be rmem resident.");
  Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Collective::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Collective::SmemLayoutB{});
  constexpr int kNumThreadsPerWarpGroup = 128;
  constexpr int kMmaWarpGroups = size(TiledMma{}) / kNumThreadsPerWarpGroup;
  Layout warp_group_thread_layout = make_layout(Int<kMmaWarpGroups>{}, Int<kNumThreadsPerWarpGroup>{});
  int warp_group_idx = __shfl_sync(0xFFFFFFFF, thread_idx / kNumThreadsPerWarpGroup, 0);
  TiledMma tiled_mma;
  auto thread_mma = tiled_mma.get_slice(warp_group_thread_layout(warp_group_idx));
  Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA,MMA_M,MMA_K,PIPE)
  Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA,MMA_N,MMA_K,PIPE)

  Tensor part0 = make_fragment_like(accum);
  Tensor part1 = make_fragment_like(accum);
  clear(accum);
  warpgroup_fence_operand(accum);
  if (k_tile_count <= 0) return;  // an empty reduction (a wgrad group without tokens): zeros

  // Issue one k-tile's wgmmas into `part` (overwriting it) and commit them as one batch.
  auto issue = [&](auto& part, int stage) {
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(part);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
      cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), part);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(part);
  };
  auto promote_fenced = [&](auto& part, int stage) {
    warpgroup_fence_operand(part);
    warpgroup_fence_operand(accum);
    promote(part, stage);
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(part);
  };

  PipelineState smem_pipe_release = smem_pipe_read;
  // Wait for the next k-tile's stage and issue its wgmmas into `part`; returns the stage.
  auto issue_next = [&](auto& part) {
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    pipeline.consumer_wait(smem_pipe_read, barrier_token);
    const int stage = smem_pipe_read.index();
    issue(part, stage);
    ++smem_pipe_read;
    return stage;
  };
  auto release = [&]() {  // the oldest k-tile's operands (and scales) have been read
    pipeline.consumer_release(smem_pipe_release);
    ++smem_pipe_release;
  };

  // k-tile t's wgmmas run into one fragment while t-1's partial sums in the other are promoted.
  // The steady state takes two k-tiles per trip so that the fragments are named statically and
  // every wgmma wait is unconditional (ptxas serializes wgmmas it cannot prove are waited for).
  int stage0 = issue_next(part0);
  init(stage0);
  int t = 0;
  CUTLASS_PRAGMA_NO_UNROLL
  for (; t + 2 < k_tile_count; t += 2) {
    const int stage1 = issue_next(part1);
    prepare(stage0);
    warpgroup_wait<1>();
    promote_fenced(part0, stage0);
    release();
    stage0 = issue_next(part0);
    prepare(stage1);
    warpgroup_wait<1>();
    promote_fenced(part1, stage1);
    release();
  }
  if (t + 1 < k_tile_count) {  // two k-tiles left: t in part0, t+1 still to issue
    const int stage1 = issue_next(part1);
    prepare(stage0);
    warpgroup_wait<1>();
    promote_fenced(part0, stage0);
    release();
    prepare(stage1);
    warpgroup_wait<0>();
    promote_fenced(part1, stage1);
    release();
  } else {  // one k-tile left
    prepare(stage0);
    warpgroup_wait<0>();
    promote_fenced(part0, stage0);
    release();
  }
  warpgroup_fence_operand(accum);
}

/// CUTLASS's grouped blockwise FP8 mainloop with each group's scale layout built from its problem
/// shape and the per-launch strides `sfa_ld` / `sfb_ld` (see the file comment), and its own
/// consumer loop (mma, below).
///
/// kBias (fprop): D = A·Bᵀ + bias_e with the bias in the accumulators' starting values, not in the
/// epilogue. The scale warp (load_auxiliary) copies the tile's 128 bf16 of group e's bias
/// (`ptr_bias[e]`, 16-byte aligned: the dispatcher's condition) into the tile's first stage, one
/// 16-byte cp.async per lane, counted by that stage's barrier like the scales; the consumers start
/// their accumulators from it. CUTLASS's row-broadcast epilogue instead loads the bias from
/// global memory when each tile's epilogue begins, with both consumer warpgroups waiting on the
/// load and a barrier, a cost that a short reduction does not hide.
template <class Base, bool kBias = false>
struct BlockwiseMainloop : Base {
  using ElementBias = cutlass::bfloat16_t;
  static constexpr int kTileN = cute::size<1>(typename Base::TileShape{});
  static constexpr int kStages = Base::DispatchPolicy::Stages;

  struct Arguments : Base::Arguments {
    int32_t sfa_ld = 0;  ///< A's scales: elements between rows (K-major) or k-blocks (MN-major)
    int32_t sfb_ld = 0;  ///< B's scales: likewise
    ElementBias const* const* ptr_bias = nullptr;  ///< kBias: group e's [N] bias
  };
  struct Params : Base::Params {
    int32_t sfa_ld = 0;
    int32_t sfb_ld = 0;
    ElementBias const* const* ptr_bias = nullptr;
  };

  // kBias: each stage carries a tile's bias (written for the first k-tile of a tile only).
  struct BiasTensorStorage : Base::TensorStorage {
    cute::array_aligned<ElementBias, kTileN * kStages, 16> smem_bias;
  };
  using TensorStorage = std::conditional_t<kBias, BiasTensorStorage, typename Base::TensorStorage>;

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args,
                                        void* workspace) {
    return Params{Base::to_underlying_arguments(problem_shapes, args, workspace), args.sfa_ld,
                  args.sfb_ld, args.ptr_bias};
  }

  // The scale warp's group and N (kBias), set by tensors_perform_update before its tiles.
  int32_t bias_group_ = 0;
  int32_t bias_n_ = 0;

  // The base collective's scale tensor of a group with its run-time stride replaced: between rows
  // (K-major: ((_0, ld), (_0, _1), batch)) or between k-blocks (MN-major: ((_0, _1), (_0, ld),
  // batch)).
  template <bool kMnMajor, class ScaleTensor>
  CUTLASS_DEVICE static auto with_ld(ScaleTensor const& t, int32_t ld) {
    constexpr int kMode = kMnMajor ? 1 : 0;
    auto layout = t.layout();
    auto stride = layout.stride();
    auto new_stride = cute::replace<kMode>(stride, cute::replace<1>(cute::get<kMode>(stride), ld));
    auto new_layout = cute::make_layout(layout.shape(), new_stride);
    static_assert(std::is_same_v<decltype(new_layout), decltype(layout)>,
                  "the scale layout's replaced stride must be a run-time int");
    return cute::make_tensor(t.data(), new_layout);
  }

  // Called by the kernel whenever a CTA moves to another group: the base version (problem-shape
  // layouts) with the launch's strides.
  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl,
                                                     int32_t next_batch) {
    if constexpr (kBias) {
      bias_group_ = next_batch;
      bias_n_ = cute::get<1>(problem_shape_mnkl);
    }
    auto tensors = Base::load_init(problem_shape_mnkl, params, params.ptr_SFA[next_batch],
                                   params.ptr_SFB[next_batch]);
    return cute::make_tuple(cute::get<0>(tensors), cute::get<1>(tensors),
                            with_ld<Base::MMajorSFA>(cute::get<2>(tensors), params.sfa_ld),
                            with_ld<Base::NMajorSFB>(cute::get<3>(tensors), params.sfb_ld));
  }

  using TiledMma = typename Base::TiledMma;
  using TileShape = typename Base::TileShape;
  using ElementBlockScale = typename Base::ElementBlockScale;
  using MainloopPipeline = typename Base::MainloopPipeline;
  using PipelineState = typename Base::PipelineState;
  using SmemLayoutSFA = typename Base::SmemLayoutSFA;
  using SmemLayoutSFB = typename Base::SmemLayoutSFB;

  /// The scale warp (its lanes: thread_idx 0-31): the base version, which copies each k-tile's
  /// scales and arrives on its stage's barrier when its cp.asyncs complete; with kBias first the
  /// tile's bias into the first stage, whose arrival then covers it too.
  template <class LoadInputs, class BlockCoord, class KTileIterator>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     LoadInputs const& load_inputs, BlockCoord const& blk_coord,
                                     KTileIterator k_tile_iter, int k_tile_count, int thread_idx,
                                     uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    if constexpr (kBias) {
      if (k_tile_count > 0) {
        // The stage must be free before it is written; the base version's own acquire of it is
        // then a wait that has already completed.
        pipeline.producer_acquire(smem_pipe_write);
        constexpr int kChunk = 16 / sizeof(ElementBias);  // elements per 16-byte copy
        static_assert(kTileN / kChunk <= 32, "one copy per lane");
        const int n = static_cast<int>(cute::get<1>(blk_coord)) * kTileN + thread_idx * kChunk;
        // N is a multiple of 16 (fp8_grouped_gemm_fprop), so a chunk is wholly in or out; a chunk
        // past N is left as it was: it only feeds columns that are never stored.
        if (thread_idx < kTileN / kChunk && n < bias_n_) {
          ElementBias* dst = shared_tensors.smem_bias.data() + smem_pipe_write.index() * kTileN + thread_idx * kChunk;
          const ElementBias* src = params.ptr_bias[bias_group_] + n;
          const uint32_t dst_addr = cute::cast_smem_ptr_to_uint(dst);
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst_addr), "l"(src) : "memory");
        }
      }
    }
    Base::load_auxiliary(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count,
                         thread_idx, block_rank_in_cluster, shared_tensors);
  }
  static_assert(Base::ScaleMsPerTile == cute::size<0>(TileShape{}),
                "A is scaled row by row (1x128 blocks)");
  static_assert(Base::ScaleNsPerTile == 1 || Base::ScaleNsPerTile == cute::size<1>(TileShape{}),
                "B is scaled per 128-column block (weights) or column by column (wgrad's x)");
  static_assert(Base::ScalePromotionInterval * cute::size<2>(typename TiledMma::AtomShape_MNK{}) ==
                    cute::size<2>(TileShape{}),
                "one scale block along K per k-tile: every k-tile is promoted");

  /// The consumer mainloop (promoted_k_loop above), replacing the base collective's: the partial
  /// sums of k-tile t are scaled and added while k-tile t+1's wgmmas run.
  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*params*/) {
    using namespace cute;
    // The scales as (BLK_M, BLK_N, (BLK_K, PIPE)) views broadcast along the other operand's mode,
    // partitioned like the accumulators (as in the base collective).
    Tensor sSFA = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFA.data()),
        make_layout(make_shape(shape<0>(SmemLayoutSFA{}), get<1>(TileShape{}),
                               make_shape(shape<1>(SmemLayoutSFA{}), shape<2>(SmemLayoutSFA{}))),
                    make_stride(stride<0>(SmemLayoutSFA{}), _0{},
                                make_stride(stride<1>(SmemLayoutSFA{}), stride<2>(SmemLayoutSFA{})))));
    Tensor sSFB = make_tensor(
        make_smem_ptr(shared_tensors.smem_SFB.data()),
        make_layout(make_shape(get<0>(TileShape{}), shape<0>(SmemLayoutSFB{}),
                               make_shape(shape<1>(SmemLayoutSFB{}), shape<2>(SmemLayoutSFB{}))),
                    make_stride(_0{}, stride<0>(SmemLayoutSFB{}),
                                make_stride(stride<1>(SmemLayoutSFB{}), stride<2>(SmemLayoutSFB{})))));

    TiledMma tiled_mma;
    Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);  // (MMA,MMA_M,MMA_N,(K,PIPE))
    Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
    // This thread's distinct row scales (the column mode stays a stride-0 broadcast).
    Tensor tCrSFA = make_tensor_like<ElementBlockScale>(tCsSFA(_, _, _, _0{}));

    // Read k-tile `stage`'s row scales of A into registers (while wgmmas may still run), folding
    // in B's one scale where B has a single scale per tile.
    auto load_scales = [&](int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      if constexpr (Base::ScaleNsPerTile == 1) {
        const ElementBlockScale scale_b = tCsSFB(_0{}, _0{}, _0{}, make_coord(_0{}, stage));
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) {
          filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * scale_b;
        }
      }
    };
    // accum += part · scales, once part's wgmmas have completed.
    //
    // Column scales (wgrad) are read from shared memory where they are used (32 more live
    // registers per thread spill), two at a time: in wgmma's accumulator fragment, elements
    // 4j..4j+3 are rows (r, r, r+8, r+8) by columns (c, c+1, c, c+1) with c = 8j + 2·(lane % 4)
    // even, so one 8-byte load serves four elements (half the loads of one per column).
    // Power-of-two scales packed as exponent bytes would need one 4-byte load per four elements
    // but 5 integer operations to unpack them, which cost more than they save.
    auto promote = [&](auto& part, int stage) {
      if constexpr (Base::ScaleNsPerTile == 1) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) {
          accum(i) = fmaf(part(i), tCrSFA(i), accum(i));
        }
      } else {
        Tensor sfb = tCsSFB(_, _, _, make_coord(_0{}, stage));  // (MMA,MMA_M,MMA_N)
        static_assert(cosize(typename FrgTensorC::layout_type{}) % 4 == 0,
                      "wgmma accumulators come in 2x2 quads");
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size(accum) / 4; ++j) {
          const float2 sb = *reinterpret_cast<const float2*>(&sfb(4 * j));
          accum(4 * j + 0) = fmaf(part(4 * j + 0) * sb.x, tCrSFA(4 * j + 0), accum(4 * j + 0));
          accum(4 * j + 1) = fmaf(part(4 * j + 1) * sb.y, tCrSFA(4 * j + 1), accum(4 * j + 1));
          accum(4 * j + 2) = fmaf(part(4 * j + 2) * sb.x, tCrSFA(4 * j + 2), accum(4 * j + 2));
          accum(4 * j + 3) = fmaf(part(4 * j + 3) * sb.y, tCrSFA(4 * j + 3), accum(4 * j + 3));
        }
      }
    };
    // kBias: the accumulators start from the tile's bias, in the first stage (load_auxiliary). In
    // wgmma's accumulator fragment, elements 4j..4j+3 are rows (r, r, r+8, r+8) by columns (c, c+1,
    // c, c+1) with c even: one 4-byte load of two bf16 serves four.
    auto init = [&](int stage) {
      if constexpr (kBias) {
        Tensor sBias = make_tensor(make_smem_ptr(shared_tensors.smem_bias.data()),
                                   make_layout(make_shape(get<0>(TileShape{}), get<1>(TileShape{}), Int<kStages>{}),
                                               make_stride(_0{}, _1{}, Int<kTileN>{})));
        Tensor bias = tiled_mma.get_slice(thread_idx).partition_C(sBias)(_, _, _, stage);  // (MMA,MMA_M,MMA_N)
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < size(accum) / 4; ++j) {
          const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&bias(4 * j)));
          accum(4 * j + 0) = b.x;
          accum(4 * j + 1) = b.y;
          accum(4 * j + 2) = b.x;
          accum(4 * j + 3) = b.y;
        }
      }
    };
    promoted_k_loop<Base>(shared_tensors, thread_idx, accum, pipeline, smem_pipe_read, k_tile_count, init,
                          load_scales, promote);
  }

  /// mma() has released every stage it consumed.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

/// CUTLASS's FP8 pointer-array mainloop (tensorwise: no scales in the mainloop) with gmoe's
/// promoting consumer loop (promoted_k_loop above): accum += part after every 128-long k-tile, as
/// CUTLASS promotes (its interval: 4 k-steps of 32), but while the next k-tile's wgmmas run instead
/// of after waiting for them. The sums are added in the same order as CUTLASS's.
template <class Base>
struct TensorwiseMainloop : Base {
  using MainloopPipeline = typename Base::MainloopPipeline;
  using PipelineState = typename Base::PipelineState;
  using TensorStorage = typename Base::TensorStorage;
  using Params = typename Base::Params;
  static_assert(cute::size<2>(typename Base::TileShape{}) == 128, "one promotion per 128-long k-tile");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read,
                          FrgTensorC& accum, int k_tile_count, int thread_idx,
                          TensorStorage& shared_tensors, Params const& /*params*/) {
    auto promote = [&](auto& part, int) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < cute::size(accum); ++i) {
        accum(i) += part(i);
      }
    };
    promoted_k_loop<Base>(shared_tensors, thread_idx, accum, pipeline, smem_pipe_read, k_tile_count, [](int) {},
                          [](int) {}, promote);
  }

  /// mma() has released every stage it consumed.
  CUTLASS_DEVICE void mma_tail(MainloopPipeline, PipelineState, int) {}
};

template <Fp8Tile T> struct Fp8TileTraits {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;  // BLOCK_M, N, K
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
};
template <> struct Fp8TileTraits<Fp8Tile::t128x128_2x1> : Fp8TileTraits<Fp8Tile::t128x128> {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
template <> struct Fp8TileTraits<Fp8Tile::t128x128_2x2> : Fp8TileTraits<Fp8Tile::t128x128> {
  using ClusterShape = cute::Shape<cute::_2, cute::_2, cute::_1>;
};
template <> struct Fp8TileTraits<Fp8Tile::t128x256> : Fp8TileTraits<Fp8Tile::t128x128> {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_128>;
};
template <> struct Fp8TileTraits<Fp8Tile::t128x256_2x1> : Fp8TileTraits<Fp8Tile::t128x256> {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
};

template <Fp8Scaling S, Fp8Operands Ops, DType Out, bool Bias, DType FormatA, Fp8Tile Tile>
struct Fp8GemmTypes {
  static_assert(!Bias || (Ops == Fp8Operands::rows && Out == DType::bf16 && FormatA == DType::e4m3),
                "a fused bias is an fprop epilogue to bf16, for e4m3 activations");
  static_assert(FormatA == DType::e4m3 || FormatA == DType::e5m2, "A is e4m3 or e5m2");
  static_assert(fp8_tile_n(Tile) == 128 || (S == Fp8Scaling::tensorwise && Ops == Fp8Operands::rows && !Bias),
                "128x256 tiles (fast accumulation) are compiled for tensorwise rows without a fused bias only");
  // A: the activations (fprop) or the gradient dy (dgrad, wgrad), e4m3 or e5m2; B: the weights
  // (fprop, dgrad) or the activations (wgrad), e4m3. wgmma takes the mixed pair at full rate.
  using ElementA = std::conditional_t<FormatA == DType::e5m2, cutlass::float_e5m2_t, cutlass::float_e4m3_t>;
  using ElementB = cutlass::float_e4m3_t;
  using ElementD = std::conditional_t<Out == DType::f32, float, cutlass::bfloat16_t>;
  // Only the f32 weight gradient can accumulate into a main_grad (C = D, beta = 1); every other
  // output has no source operand, which frees the shared memory CUTLASS would stage C in.
  static constexpr bool kHasSource = Ops == Fp8Operands::wgrad && Out == DType::f32;
  using ElementC = std::conditional_t<kHasSource, ElementD, void>;
  using ElementAccumulator = float;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LayoutA = cutlass::layout::RowMajor;     // [M, K], K-major
  using LayoutB = cutlass::layout::ColumnMajor;  // [N, K], K-major
  using LayoutD = cutlass::layout::RowMajor;

  // 128x128x128, two consumer warpgroups of 64x128 each (cooperative). The blockwise mainloop
  // keeps a second set of accumulators for the k-tile's partial sums, so a 128x256 tile would need
  // 256 registers per thread; the k-tile is the 128-long scale block. The tensorwise mainloop
  // promotes too (every 128 of the reduction, for the precision the tensor cores' own FP8
  // accumulation lacks), so a promoted 128x256 tensorwise tile spills as well. Fast accumulation
  // (Fp8GemmOptions: no promotion, the accumulators live in the wgmma registers only) fits
  // 128x256x128 tiles (64x256 per warpgroup, 128 registers, no spills). The cluster
  // (Fp8TileTraits) is chosen per call (fp8_gemm_heuristics.cu). A ping-pong 64x128x128 schedule
  // (each consumer warpgroup its own tile) is slower than this one on every pass and is not built.
  using TileShape = typename Fp8TileTraits<Tile>::TileShape;
  using ClusterShape = typename Fp8TileTraits<Tile>::ClusterShape;
  using KernelSchedule = std::conditional_t<S == Fp8Scaling::blockwise,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                            std::conditional_t<fp8_tile_n(Tile) == 256,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>>;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  static constexpr int kAlignAB = 16;  // TMA: 16-byte aligned rows of 1-byte elements
  // The shared memory the stage count leaves for the mainloop bias (BlockwiseMainloop's per-stage
  // tile row of bf16), as for up to 8 stages (the static_assert below checks the total).
  static constexpr int kBiasCarveout =
      8 * cute::size<1>(typename Fp8TileTraits<Tile>::TileShape{}) * static_cast<int>(sizeof(cutlass::bfloat16_t));
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  // Scale granularity (M, N, K): A rows are scaled one by one (1x128 blocks along K); B by
  // 128x128 blocks (weights) or row by row (wgrad's x, 1x128 along tokens). A's scales are
  // MN-major in every pass (grouped rows: token-major; wgrad: token-block-major; see the file
  // comment); the weights' (fprop/dgrad B, one per tile and k-tile) K-major.
  static constexpr int kScaleN = Ops == Fp8Operands::rows ? 128 : 1;
  static constexpr auto kScaleMajorB =
      Ops == Fp8Operands::rows ? cute::GMMA::Major::K : cute::GMMA::Major::MN;
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, 128, cute::GMMA::Major::MN, kScaleMajorB>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using GmemLayoutA =
      std::conditional_t<S == Fp8Scaling::blockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using GmemLayoutB =
      std::conditional_t<S == Fp8Scaling::blockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  // D = alpha·acc + beta·C; with a bias, blockwise: D = acc, the accumulators started from the
  // bias (BlockwiseMainloop, kBias); tensorwise: D = alpha_e·acc + bias_e in the epilogue.
  //
  // Blockwise without a source: D = acc, a tree of the accumulator alone. CUTLASS's pointer-array
  // LinearCombination (alpha = 1) would do the same arithmetic, but its alpha and beta nodes
  // (Sm90ScalarBroadcastPtrArray) count as producer loads, so every 128x32 subtile's epilogue
  // would wait on the epilogue load pipeline that an otherwise idle producer warp fills.
  static constexpr bool kEpilogueBias = Bias && S == Fp8Scaling::tensorwise;
  static constexpr bool kMainloopBias = Bias && S == Fp8Scaling::blockwise;
  static constexpr bool kAccOnly = S == Fp8Scaling::blockwise && !kHasSource;
  using AccOnlyFusion = cutlass::epilogue::fusion::Sm90EVT<
      cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float,
                                             cutlass::FloatRoundStyle::round_to_nearest>,
      cutlass::epilogue::fusion::Sm90AccFetch>;
  using Fusion = std::conditional_t<
      kEpilogueBias, typename ScaledBiasTree<ElementD, cutlass::bfloat16_t, TileShape>::type,
      std::conditional_t<kAccOnly, AccOnlyFusion,
                         cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator, ElementC,
                                                                      ElementAccumulator>>>;
  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
      ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule, Fusion>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, GmemLayoutA, kAlignAB,
      ElementB, GmemLayoutB, kAlignAB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage) + (kMainloopBias ? kBiasCarveout : 0))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<
      S == Fp8Scaling::blockwise, BlockwiseMainloop<BuiltMainloop, kMainloopBias>,
      std::conditional_t<fp8_tile_n(Tile) == 256, BuiltMainloop, TensorwiseMainloop<BuiltMainloop>>>;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  static_assert(sizeof(typename Kernel::SharedStorage) <= 227 * 1024,
                "the kernel's shared memory exceeds an sm_90 CTA's 227 KB");
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

  // The preparation kernel writes plain int64 strides and {int m, n, k} shapes that CUTLASS reads
  // as its own types (as in sm90_grouped_gemm.cuh).
  static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t) &&
                    sizeof(StrideD) == sizeof(int64_t) && sizeof(StrideC) == sizeof(int64_t),
                "per-group CUTLASS strides must be a single int64");
  static_assert(sizeof(UnderlyingShape) == sizeof(GroupShape),
                "CUTLASS's group problem shape must be three ints");
  static_assert(std::is_trivially_copyable_v<StrideA> && std::is_trivially_copyable_v<StrideB> &&
                std::is_trivially_copyable_v<StrideD> &&
                std::is_trivially_copyable_v<UnderlyingShape>);

  using ScaledAlpha = typename ScaledBiasTree<ElementD, cutlass::bfloat16_t, TileShape>::Alpha;

  static typename Gemm::Arguments make_arguments(const Fp8GemmLaunch& f) {
    const GroupedGemmLaunch& l = f.gemm;
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = l.device;
    hw_info.sm_count = l.sm_count;

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // nullptr host shapes: the counts are on the device only.
    args.problem_shape = {l.num_groups,
                          reinterpret_cast<UnderlyingShape*>(const_cast<GroupShape*>(l.shapes)),
                          nullptr};
    args.mainloop.ptr_A = reinterpret_cast<ElementA const**>(const_cast<void const**>(l.ptr_a));
    args.mainloop.dA = reinterpret_cast<StrideA*>(const_cast<int64_t*>(l.stride_a));
    args.mainloop.ptr_B = reinterpret_cast<ElementB const**>(const_cast<void const**>(l.ptr_b));
    args.mainloop.dB = reinterpret_cast<StrideB*>(const_cast<int64_t*>(l.stride_b));
    if constexpr (S == Fp8Scaling::blockwise) {
      args.mainloop.ptr_SFA = const_cast<float const**>(f.ptr_sfa);
      args.mainloop.ptr_SFB = const_cast<float const**>(f.ptr_sfb);
      // Not read by the grouped kernel (BlockwiseMainloop builds the layouts from the shapes).
      args.mainloop.layout_SFA = nullptr;
      args.mainloop.layout_SFB = nullptr;
      args.mainloop.sfa_ld = f.sfa_ld;
      args.mainloop.sfb_ld = f.sfb_ld;
    }
    if constexpr (kMainloopBias) {
      args.mainloop.ptr_bias = reinterpret_cast<cutlass::bfloat16_t const* const*>(l.ptr_bias);
    }
    if constexpr (kEpilogueBias) {
      // RowBroadcast {ptr_row, null_default, dRow}
      const typename sm90::BiasTree<ElementD, cutlass::bfloat16_t, TileShape>::RowBias::Arguments bias{
          reinterpret_cast<cutlass::bfloat16_t const* const*>(l.ptr_bias), cutlass::bfloat16_t(0), {}};
      // {ScalarBroadcastPtrArray {scalars, scalar_ptrs, scalar_ptr_arrays, dScalar}, AccFetch,
      //  RowBroadcast, Compute}: alpha_e through the per-group array (L stride 1).
      typename ScaledAlpha::Arguments alpha{};
      alpha.scalar_ptr_arrays[0] = const_cast<float const* const*>(f.alpha_ptrs);
      alpha.dScalar[0] = {cute::_0{}, cute::_0{}, 1};
      args.epilogue.thread = {alpha, {}, bias, {}};
    } else if constexpr (kAccOnly) {
      args.epilogue.thread = {};  // {AccFetch, Compute}: nothing to set
    } else {
      auto& fusion = args.epilogue.thread;
      fusion.beta = l.beta;
      fusion.beta_ptr = nullptr;
      fusion.beta_ptr_array = nullptr;
      fusion.alpha_ptr = nullptr;
      if (f.alpha_ptrs != nullptr) {
        // One alpha per group, through the pointer array (L stride 1: nothing is read in the
        // epilogue's constructor, each tile reads its group's value).
        fusion.alpha = 0.0f;
        fusion.alpha_ptr_array = const_cast<float const* const*>(f.alpha_ptrs);
        fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};
      } else {
        fusion.alpha = 1.0f;
        fusion.alpha_ptr_array = nullptr;
      }
    }
    if constexpr (kHasSource) {
      args.epilogue.ptr_C = reinterpret_cast<ElementC const**>(const_cast<void const**>(l.ptr_c));
      args.epilogue.dC = reinterpret_cast<StrideC*>(const_cast<int64_t*>(l.stride_c));
    } else {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(const_cast<void**>(l.ptr_d));
    args.epilogue.dD = reinterpret_cast<StrideD*>(const_cast<int64_t*>(l.stride_d));
    // The group scheduler's tile order (its default, AlongM, unless the dispatcher chose N: wgrad).
    using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = l.raster_along_n ? RasterOrderOptions::AlongN : RasterOrderOptions::AlongM;
    args.hw_info = hw_info;
    return args;
  }
};

}  // namespace sm90fp8

template <Fp8Scaling S, Fp8Operands Ops, DType Out, bool Bias, DType FormatA, Fp8Tile Tile>
std::size_t Fp8GroupedGemmKernel<S, Ops, Out, Bias, FormatA, Tile>::workspace_bytes(int sm_count) {
  using Types = sm90fp8::Fp8GemmTypes<S, Ops, Out, Bias, FormatA, Tile>;
  Fp8GemmLaunch l;
  l.gemm.sm_count = sm_count;
  return Types::Gemm::get_workspace_size(Types::make_arguments(l));
}

template <Fp8Scaling S, Fp8Operands Ops, DType Out, bool Bias, DType FormatA, Fp8Tile Tile>
void Fp8GroupedGemmKernel<S, Ops, Out, Bias, FormatA, Tile>::run(const Fp8GemmLaunch& l, cudaStream_t stream) {
  using Types = sm90fp8::Fp8GemmTypes<S, Ops, Out, Bias, FormatA, Tile>;
  using Gemm = typename Types::Gemm;
  GMOE_CHECK(Types::kHasSource || l.gemm.beta == 0.0f, "FP8 grouped GEMM: this instantiation "
             "has no source operand, but beta = ", l.gemm.beta);
  GMOE_CHECK(S != Fp8Scaling::blockwise || (l.ptr_sfa != nullptr && l.ptr_sfb != nullptr),
             "FP8 grouped GEMM: blockwise scaling without scale pointers");
  GMOE_CHECK(S != Fp8Scaling::tensorwise || l.alpha_ptrs != nullptr,
             "FP8 grouped GEMM: tensorwise scaling without per-expert alpha");
  GMOE_CHECK(!Bias || l.gemm.ptr_bias != nullptr, "FP8 grouped GEMM: a fused bias without bias pointers");
  GMOE_CHECK(!Types::kAccOnly || (l.alpha_ptrs == nullptr && l.gemm.beta == 0.0f),
             "FP8 grouped GEMM: the blockwise D = acc epilogue takes no alpha or beta");
  const typename Gemm::Arguments args = Types::make_arguments(l);
  const std::size_t need = Gemm::get_workspace_size(args);
  GMOE_CHECK(l.gemm.workspace_bytes >= need, "FP8 grouped GEMM: workspace of ",
             l.gemm.workspace_bytes, " bytes, CUTLASS needs ", need);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  GMOE_CHECK(status == cutlass::Status::kSuccess,
             "FP8 grouped GEMM: CUTLASS can_implement refused the arguments: ",
             cutlass::cutlassGetStatusString(status));
  status = gemm.initialize(args, l.gemm.workspace, stream);
  GMOE_CHECK(status == cutlass::Status::kSuccess, "FP8 grouped GEMM: CUTLASS initialize failed: ",
             cutlass::cutlassGetStatusString(status));
  status = gemm.run(stream);
  GMOE_CUDA_CHECK(cudaGetLastError());
  GMOE_CHECK(status == cutlass::Status::kSuccess, "FP8 grouped GEMM: CUTLASS run failed: ",
             cutlass::cutlassGetStatusString(status));
}

}  // namespace gmoe::cuda_backend

/// One line of fp8_grouped_gemm_instances.def compiled: its generated .cu is this header and
/// GMOE_FP8_GEMM_INSTANTIATE(scaling, operands, out, epilogue, format_a, tile).
#define GMOE_FP8_GEMM_INSTANTIATE(S, OPS, OUT, EPI, A, TILE)                                              \
  template struct gmoe::cuda_backend::Fp8GroupedGemmKernel<                                               \
      gmoe::cuda_backend::Fp8Scaling::S, gmoe::cuda_backend::Fp8Operands::OPS, gmoe::DType::OUT,          \
      gmoe::cuda_backend::Fp8Epilogue::EPI == gmoe::cuda_backend::Fp8Epilogue::bias, gmoe::DType::A, \
      gmoe::cuda_backend::Fp8Tile::TILE>;
