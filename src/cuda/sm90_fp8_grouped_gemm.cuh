// src/cuda/sm90_fp8_grouped_gemm.cuh — the CUTLASS 3.x FP8 grouped (pointer-array)
// warp-specialized GEMM behind Fp8GroupedGemmKernel, for sm_90a.
//
// Include this only from the one-instantiation sm90_fp8_*.cu files: it is heavy.
//
// Two mainloops, both with fp32 accumulation that is promoted out of the tensor cores every
// 128-long k-tile (Hopper's FP8 wgmma accumulates with fewer than fp32's bits):
//   blockwise   CUTLASS's MainloopSm90ArrayTmaGmmaWarpSpecializedBlockwise: after each k-tile the
//               partial sums are multiplied by the A scale of their row (granularity 1 along M)
//               and the B scale of their column block (128 for weights, 1 for wgrad's x) and
//               added to the accumulators. Scales are loaded by a producer warp with 4-byte
//               cp.async, so any 4-byte aligned scale pointer works.
//   tensorwise  CUTLASS's FP8 pointer-array mainloop (no scales); the epilogue multiplies by the
//               group's alpha_e = sa[e]·sb[e], read through a per-group pointer array.
//
// The scale layout of a group. In CUTLASS 4.2 the grouped blockwise mainloop derives each group's
// scale layout from its problem shape alone (K-major: row stride ceil(K/128)), ignoring the
// per-group layouts passed in its arguments. That fits fprop/dgrad (scales [rows, ceil(K/128)]
// row-major) but not wgrad, whose token-block scales are the columns [padded_offsets[e]/128, ...)
// of a [cols, padded_capacity/128] matrix: row stride padded_capacity/128. BlockwiseMainloop below
// derives from CUTLASS's collective and changes only that: the row strides of the A and B scale
// matrices become launch arguments (they are the same for every group of a launch).
//
// Everything else follows sm90_grouped_gemm.cuh: device-only problem shapes (the group scheduler
// walks them on the device), empty groups as M = 0, TMA clipping partial tiles.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include <type_traits>

#include "cuda/cuda_check.h"
#include "cuda/fp8_grouped_gemm_kernels.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace sm90fp8 {

/// CUTLASS's grouped blockwise FP8 mainloop with each group's scale layout built from its problem
/// shape and the per-launch row strides `sfa_ld` / `sfb_ld` (see the file comment). Only the
/// arguments, the parameters and the per-group tensor update differ from the base collective.
template <class Base>
struct BlockwiseMainloop : Base {
  static_assert(!Base::MMajorSFA && !Base::NMajorSFB,
                "gmoe's FP8 scale matrices are K-major (one row of k-block scales per row)");

  struct Arguments : Base::Arguments {
    int32_t sfa_ld = 0;  ///< elements between the scales of two consecutive rows of A
    int32_t sfb_ld = 0;  ///< elements between two consecutive scale rows of B
  };
  struct Params : Base::Params {
    int32_t sfa_ld = 0;
    int32_t sfb_ld = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args,
                                        void* workspace) {
    return Params{Base::to_underlying_arguments(problem_shapes, args, workspace), args.sfa_ld,
                  args.sfb_ld};
  }

  // The base collective's scale tensor of a group with its K-major row stride replaced.
  template <class ScaleTensor>
  CUTLASS_DEVICE static auto with_row_stride(ScaleTensor const& t, int32_t ld) {
    auto layout = t.layout();
    auto stride = layout.stride();  // ((_0, ld), (_0, _1), batch)
    auto new_stride = cute::replace<0>(stride, cute::replace<1>(cute::get<0>(stride), ld));
    auto new_layout = cute::make_layout(layout.shape(), new_stride);
    static_assert(std::is_same_v<decltype(new_layout), decltype(layout)>,
                  "the scale layout's row stride must be a run-time int");
    return cute::make_tensor(t.data(), new_layout);
  }

  // Called by the kernel whenever a CTA moves to another group: the base version (problem-shape
  // layouts) with the launch's row strides.
  template <class InputTensors, class ProblemShape_MNKL>
  CUTLASS_DEVICE InputTensors tensors_perform_update(InputTensors const&, Params const& params,
                                                     ProblemShape_MNKL problem_shape_mnkl,
                                                     int32_t next_batch) {
    auto tensors = Base::load_init(problem_shape_mnkl, params, params.ptr_SFA[next_batch],
                                   params.ptr_SFB[next_batch]);
    return cute::make_tuple(cute::get<0>(tensors), cute::get<1>(tensors),
                            with_row_stride(cute::get<2>(tensors), params.sfa_ld),
                            with_row_stride(cute::get<3>(tensors), params.sfb_ld));
  }
};

template <Fp8Scaling S, Fp8Operands Ops, DType Out>
struct Fp8GemmTypes {
  using ElementA = cutlass::float_e4m3_t;
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

  // 128x128x128, two consumer warpgroups of 64x128 each. The blockwise mainloop keeps a second
  // set of accumulators for the k-tile's partial sums, so a 128x256 tile would need 256 registers
  // per thread; the k-tile is the 128-long scale block. Cluster 1x1: a group with a single M tile
  // (common in MoE) would leave half of a 2x1 cluster idle. A ping-pong 64x128x128 variant (each
  // consumer warpgroup its own tile, one's promotion and epilogue overlapping the other's wgmma)
  // measured 0.85x this one in the geometric mean of the public suite on an H100 (fprop/dgrad
  // 0.71-1.02x, wgrad to f32 0.79-0.99x), 2026-11-23, and was dropped.
  using TileShape = cute::Shape<cute::_128, cute::_128, cute::_128>;  // BLOCK_M, N, K
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using KernelSchedule = std::conditional_t<S == Fp8Scaling::blockwise,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                            cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;

  static constexpr int kAlignAB = 16;  // TMA: 16-byte aligned rows of 1-byte elements
  static constexpr int kAlignD = 16 / sizeof(ElementD);

  // Scale granularity (M, N, K): A rows are scaled one by one (1x128 blocks along K); B by
  // 128x128 blocks (weights) or row by row (wgrad's x, 1x128 along tokens).
  static constexpr int kScaleN = Ops == Fp8Operands::rows ? 128 : 1;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, 128, cute::GMMA::Major::K,
                                                                cute::GMMA::Major::K>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using GmemLayoutA =
      std::conditional_t<S == Fp8Scaling::blockwise, cute::tuple<LayoutA*, LayoutSFA*>, LayoutA*>;
  using GmemLayoutB =
      std::conditional_t<S == Fp8Scaling::blockwise, cute::tuple<LayoutB*, LayoutSFB*>, LayoutB*>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAccumulator, ElementAccumulator,
      ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAccumulator, ElementC,
                                                   ElementAccumulator>>::CollectiveOp;

  using BuiltMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, GmemLayoutA, kAlignAB,
      ElementB, GmemLayoutB, kAlignAB, ElementAccumulator, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;
  using CollectiveMainloop = std::conditional_t<S == Fp8Scaling::blockwise,
                                                BlockwiseMainloop<BuiltMainloop>, BuiltMainloop>;

  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
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
    if constexpr (kHasSource) {
      args.epilogue.ptr_C = reinterpret_cast<ElementC const**>(const_cast<void const**>(l.ptr_c));
      args.epilogue.dC = reinterpret_cast<StrideC*>(const_cast<int64_t*>(l.stride_c));
    } else {
      args.epilogue.ptr_C = nullptr;
      args.epilogue.dC = nullptr;
    }
    args.epilogue.ptr_D = reinterpret_cast<ElementD**>(const_cast<void**>(l.ptr_d));
    args.epilogue.dD = reinterpret_cast<StrideD*>(const_cast<int64_t*>(l.stride_d));
    args.hw_info = hw_info;
    return args;
  }
};

}  // namespace sm90fp8

template <Fp8Scaling S, Fp8Operands Ops, DType Out>
std::size_t Fp8GroupedGemmKernel<S, Ops, Out>::workspace_bytes(int sm_count) {
  using Types = sm90fp8::Fp8GemmTypes<S, Ops, Out>;
  Fp8GemmLaunch l;
  l.gemm.sm_count = sm_count;
  return Types::Gemm::get_workspace_size(Types::make_arguments(l));
}

template <Fp8Scaling S, Fp8Operands Ops, DType Out>
void Fp8GroupedGemmKernel<S, Ops, Out>::run(const Fp8GemmLaunch& l, cudaStream_t stream) {
  using Types = sm90fp8::Fp8GemmTypes<S, Ops, Out>;
  using Gemm = typename Types::Gemm;
  GMOE_CHECK(Types::kHasSource || l.gemm.beta == 0.0f, "FP8 grouped GEMM: this instantiation "
             "has no source operand, but beta = ", l.gemm.beta);
  GMOE_CHECK(S != Fp8Scaling::blockwise || (l.ptr_sfa != nullptr && l.ptr_sfb != nullptr),
             "FP8 grouped GEMM: blockwise scaling without scale pointers");
  GMOE_CHECK(S != Fp8Scaling::tensorwise || l.alpha_ptrs != nullptr,
             "FP8 grouped GEMM: tensorwise scaling without per-expert alpha");
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
