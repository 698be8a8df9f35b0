// src/cuda/gemm/sm90_bias_epilogue.cuh — the fused-bias epilogue tree shared by the 16-bit and FP8
// grouped GEMMs (sm90_grouped_gemm.cuh, sm90_fp8_grouped_gemm.cuh): D = acc + bias_e, the bias a
// row vector of N per group broadcast over the tile's rows. Sm90RowBroadcast with an array of
// pointers reads group l's vector through ptr_bias[l] (its L stride is 0), loading the tile's N
// slice into shared memory once per tile (element-wise: the bias needs no alignment). The sum is
// taken in f32 and rounded to D's type once.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

namespace gmoe::cuda_backend::sm90 {

template <class ElementD, class ElementBias, class TileShape>
struct BiasTree {
  using RowBias = cutlass::epilogue::fusion::Sm90RowBroadcast<
      0, TileShape, ElementBias*, float, cute::Stride<cute::_0, cute::_1, cute::_0>,
      128 / cutlass::sizeof_bits_v<ElementBias>>;
  using Add = cutlass::epilogue::fusion::Sm90Compute<cutlass::plus, ElementD, float,
                                                     cutlass::FloatRoundStyle::round_to_nearest>;
  using type = cutlass::epilogue::fusion::Sm90EVT<Add, cutlass::epilogue::fusion::Sm90AccFetch, RowBias>;
};

}  // namespace gmoe::cuda_backend::sm90
