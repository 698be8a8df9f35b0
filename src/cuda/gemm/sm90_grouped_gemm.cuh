// src/cuda/gemm/sm90_grouped_gemm.cuh — the CUTLASS 3.x grouped (pointer-array) warp-specialized GEMM
// behind GroupedGemmKernel, for sm_90a (TMA loads/stores, wgmma, persistent grid).
//
// Include this only from the sm90_*.cu files that CMake generates from grouped_gemm_instances.def:
// it is heavy. Each of those files holds its lines' GMOE_GROUPED_GEMM_INSTANTIATE (at the end):
// `template struct GroupedGemmKernel<...>;`.
//
// How the kernel meets gmoe's contract (counts never on the host):
// - The problem shapes, pointer arrays and strides live on the device, written by the preparation
//   kernels (grouped_gemm_prepare.cu). CUTLASS gets no host problem shapes (nullptr): its group
//   tile scheduler then launches one CTA per SM and walks the groups' tile counts on the device.
// - An empty group is given M = 0, so no tile of it is ever scheduled. (A group with K = 0 would
//   be scheduled and write its uninitialised accumulators: the mainloop zeroes them only inside
//   the k-loop. wgrad therefore never hands CUTLASS a zero-length reduction; see prepare.)
// - Partial tiles are safe: TMA clips loads (zero fill) and stores to each group's own extent.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <type_traits>

#include "cuda/runtime/cuda_check.h"
#include "cuda/gemm/sm90_bias_epilogue.cuh"
#include "cuda/gemm/grouped_gemm_kernels.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace sm90 {

template <DType T> struct CutlassElement;
template <> struct CutlassElement<DType::bf16> { using type = cutlass::bfloat16_t; };
template <> struct CutlassElement<DType::f16> { using type = cutlass::half_t; };
template <> struct CutlassElement<DType::f32> { using type = float; };

// Operand layouts per pass, in CUTLASS's convention (A is MxK, B is KxN; "ColumnMajor" B is
// K-major). See GemmPass for what the operands are.
template <GemmPass P> struct PassLayouts;
template <> struct PassLayouts<GemmPass::fprop> {
  using A = cutlass::layout::RowMajor;     // x [rows, K]: K-major
  using B = cutlass::layout::ColumnMajor;  // W_e [N, K]: K-major ("TN")
};
template <> struct PassLayouts<GemmPass::dgrad> {
  using A = cutlass::layout::RowMajor;     // dy [rows, N]: K-major (K = N here)
  using B = cutlass::layout::RowMajor;     // W_e [N, K] read as B[k=N, n=K]: N-major
};
template <> struct PassLayouts<GemmPass::wgrad> {
  using A = cutlass::layout::ColumnMajor;  // dy_e [rows, N] read as A[m=N, k=row]: M-major
  using B = cutlass::layout::RowMajor;     // x_e [rows, K] read as B[k=row, n=K]: N-major
};

// Tile shapes and schedules. Cluster 1x1, but for the cooperative tile's 2x1 variant (the weight
// gradient's, wgrad_cluster_2x1; bf16 fprop/dgrad's where operand rows are off the 128-byte lines,
// choose_rows_tile): in fprop/dgrad a group with a single M tile (common in MoE) leaves the second
// CTA of a 2x1 cluster computing an all-out-of-bounds tile; 1x2 clusters along N gain nothing.
template <TileConfig T> struct TileTraits;
template <> struct TileTraits<TileConfig::coop_128x256> {
  using TileShape = cute::Shape<cute::_128, cute::_256, cute::_64>;  // BLOCK_M, BLOCK_N, BLOCK_K
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
template <> struct TileTraits<TileConfig::coop_128x256_2x1> : TileTraits<TileConfig::coop_128x256> {
  using ClusterShape = cute::Shape<cute::_2, cute::_1, cute::_1>;
};
template <> struct TileTraits<TileConfig::coop_128x256_2x2> : TileTraits<TileConfig::coop_128x256> {
  using ClusterShape = cute::Shape<cute::_2, cute::_2, cute::_1>;
};
template <> struct TileTraits<TileConfig::pingpong_128x128> {
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// The epilogue's fusion: D = alpha·acc + beta·C (LinearCombination), or, with a bias, the tree
// D = acc + bias_e of sm90_bias_epilogue.cuh.
template <class ElementD, class ElementC, class ElementBias, class TileShape, GemmEpilogue Epilogue>
struct EpilogueFusion {
  using type = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementC, float>;
};
template <class ElementD, class ElementC, class ElementBias, class TileShape>
struct EpilogueFusion<ElementD, ElementC, ElementBias, TileShape, GemmEpilogue::bias> {
  using type = typename BiasTree<ElementD, ElementBias, TileShape>::type;
};

template <DType In, DType Out, GemmPass Pass, TileConfig Tile, GemmEpilogue Epilogue>
struct GemmTypes {
  using ElementIn = typename CutlassElement<In>::type;
  using ElementD = typename CutlassElement<Out>::type;
  static constexpr bool kBias = Epilogue == GemmEpilogue::bias;
  // Only an f32 weight gradient can accumulate into an existing main_grad; every other output has
  // no source operand at all, which frees the shared memory CUTLASS would stage C in.
  static constexpr bool kHasSource = Pass == GemmPass::wgrad && Out == DType::f32;
  static_assert(!kBias || (Pass == GemmPass::fprop && !kHasSource), "a fused bias is an fprop epilogue");
  using ElementC = std::conditional_t<kHasSource, ElementD, void>;
  using ElementAccumulator = float;
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  using LayoutA = typename PassLayouts<Pass>::A;
  using LayoutB = typename PassLayouts<Pass>::B;
  using LayoutD = cutlass::layout::RowMajor;
  using Traits = TileTraits<Tile>;

  static constexpr int kAlignIn = 16 / sizeof(ElementIn);  // TMA: 16-byte aligned rows
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  using Fusion = typename EpilogueFusion<ElementD, ElementC, ElementIn, typename Traits::TileShape, Epilogue>::type;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Traits::TileShape,
      typename Traits::ClusterShape, cutlass::epilogue::collective::EpilogueTileAuto,
      ElementAccumulator, ElementAccumulator, ElementC, LayoutD*, kAlignD, ElementD, LayoutD*,
      kAlignD, typename Traits::EpilogueSchedule, Fusion>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementIn, LayoutA*, kAlignIn,
      ElementIn, LayoutB*, kAlignIn, ElementAccumulator, typename Traits::TileShape,
      typename Traits::ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      typename Traits::KernelSchedule>::CollectiveOp;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

  // The preparation kernels write plain int64 strides and {int m, n, k} shapes that CUTLASS reads
  // as its own types: each per-group stride has exactly one run-time member (the other modes are
  // compile-time _1/_0), so it is one int64 at offset 0.
  static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t) &&
                    sizeof(StrideD) == sizeof(int64_t) && sizeof(StrideC) == sizeof(int64_t),
                "per-group CUTLASS strides must be a single int64");
  static_assert(sizeof(UnderlyingShape) == sizeof(GroupShape),
                "CUTLASS's group problem shape must be three ints");
  static_assert(std::is_trivially_copyable_v<StrideA> && std::is_trivially_copyable_v<StrideB> &&
                std::is_trivially_copyable_v<StrideD> &&
                std::is_trivially_copyable_v<UnderlyingShape>);

  static typename Gemm::Arguments make_arguments(const GroupedGemmLaunch& l) {
    cutlass::KernelHardwareInfo hw_info;
    hw_info.device_id = l.device;
    hw_info.sm_count = l.sm_count;

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // nullptr host shapes: the counts are on the device only.
    args.problem_shape = {l.num_groups,
                          reinterpret_cast<UnderlyingShape*>(const_cast<GroupShape*>(l.shapes)),
                          nullptr};
    args.mainloop.ptr_A = reinterpret_cast<ElementIn const**>(const_cast<void const**>(l.ptr_a));
    args.mainloop.dA = reinterpret_cast<StrideA*>(const_cast<int64_t*>(l.stride_a));
    args.mainloop.ptr_B = reinterpret_cast<ElementIn const**>(const_cast<void const**>(l.ptr_b));
    args.mainloop.dB = reinterpret_cast<StrideB*>(const_cast<int64_t*>(l.stride_b));
    if constexpr (kBias) {
      // {AccFetch, RowBroadcast {ptr_row, null_default, dRow}, Compute}
      args.epilogue.thread = {{}, {reinterpret_cast<ElementIn const* const*>(l.ptr_bias), ElementIn(0), {}}, {}};
    } else {
      auto& fusion = args.epilogue.thread;
      fusion.alpha = l.alpha;
      fusion.beta = l.beta;
    }
    if constexpr (kHasSource) {
      args.epilogue.ptr_C =
          reinterpret_cast<ElementC const**>(const_cast<void const**>(l.ptr_c));
      args.epilogue.dC = reinterpret_cast<StrideC*>(const_cast<int64_t*>(l.stride_c));
    } else {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(const_cast<void**>(l.ptr_d));
    args.epilogue.dD = reinterpret_cast<StrideD*>(const_cast<int64_t*>(l.stride_d));
    using RasterOrderOptions = cutlass::gemm::kernel::detail::RasterOrderOptions;
    args.scheduler.raster_order = l.raster_along_n ? RasterOrderOptions::AlongN : RasterOrderOptions::AlongM;
    args.hw_info = hw_info;
    return args;
  }
};

}  // namespace sm90

template <DType In, DType Out, GemmPass Pass, TileConfig Tile, GemmEpilogue Epilogue>
std::size_t GroupedGemmKernel<In, Out, Pass, Tile, Epilogue>::workspace_bytes(int sm_count) {
  using Types = sm90::GemmTypes<In, Out, Pass, Tile, Epilogue>;
  GroupedGemmLaunch l;
  l.sm_count = sm_count;
  return Types::Gemm::get_workspace_size(Types::make_arguments(l));
}

template <DType In, DType Out, GemmPass Pass, TileConfig Tile, GemmEpilogue Epilogue>
void GroupedGemmKernel<In, Out, Pass, Tile, Epilogue>::run(const GroupedGemmLaunch& l, cudaStream_t stream) {
  using Types = sm90::GemmTypes<In, Out, Pass, Tile, Epilogue>;
  using Gemm = typename Types::Gemm;
  GMOE_CHECK(Types::kHasSource || l.beta == 0.0f, "grouped GEMM: this instantiation has no source "
             "operand, but beta = ", l.beta);
  GMOE_CHECK(!Types::kBias || l.ptr_bias != nullptr, "grouped GEMM: a fused-bias kernel without bias pointers");
  const typename Gemm::Arguments args = Types::make_arguments(l);
  const std::size_t need = Gemm::get_workspace_size(args);
  GMOE_CHECK(l.workspace_bytes >= need, "grouped GEMM: workspace of ", l.workspace_bytes,
             " bytes, CUTLASS needs ", need);
  Gemm gemm;
  cutlass::Status status = gemm.can_implement(args);
  GMOE_CHECK(status == cutlass::Status::kSuccess, "grouped GEMM (", dtype_name(In), " -> ",
             dtype_name(Out), "): CUTLASS can_implement refused the arguments: ",
             cutlass::cutlassGetStatusString(status));
  status = gemm.initialize(args, l.workspace, stream);
  GMOE_CHECK(status == cutlass::Status::kSuccess, "grouped GEMM: CUTLASS initialize failed: ",
             cutlass::cutlassGetStatusString(status));
  status = gemm.run(stream);
  GMOE_CUDA_CHECK(cudaGetLastError());
  GMOE_CHECK(status == cutlass::Status::kSuccess, "grouped GEMM: CUTLASS run failed: ",
             cutlass::cutlassGetStatusString(status));
}

}  // namespace gmoe::cuda_backend

// The explicit instantiation that a generated sm90_*.cu file holds for its line of
// grouped_gemm_instances.def (cmake/instances.cmake writes GMOE_GROUPED_GEMM_INSTANTIATE with the
// line's arguments after the file name).
#define GMOE_GROUPED_GEMM_INSTANTIATE(in, out, pass, epilogue, tile)                              \
  template struct gmoe::cuda_backend::GroupedGemmKernel<                                          \
      gmoe::DType::in, gmoe::DType::out, gmoe::cuda_backend::GemmPass::pass,                      \
      gmoe::cuda_backend::TileConfig::tile, gmoe::cuda_backend::GemmEpilogue::epilogue>;
