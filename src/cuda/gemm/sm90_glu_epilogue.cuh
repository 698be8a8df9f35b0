// src/cuda/gemm/sm90_glu_epilogue.cuh — the gated activation in the epilogue of the bf16 fprop grouped
// GEMM, and its backward in the epilogue of the bf16 dgrad (GluEpilogue of grouped_gemm_kernels.h):
// the visitor nodes Sm90GatedActivation and Sm90GatedActivationBackward that sm90_grouped_gemm.cuh
// declares. Included (before sm90_grouped_gemm.cuh) only by the sm90_bf16_grouped_gemm_*_glu_*.cu
// instantiations.
#pragma once

#include <cuda_bf16.h>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/numeric_conversion.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/activation_math.h"
#include "cuda/gemm/grouped_gemm_kernels.h"

namespace gmoe::cuda_backend {
namespace sm90 {

// What both gated-activation nodes share: CUTLASS's visitor-node interface for a root node that
// takes GluEpilogue as its arguments, needs no shared memory, workspace or producer loads, and
// hands each consumer thread Node::ConsumerStoreCallbacks over the coordinates of its fragment
// (the tile's (row, column) within the group) with the group's M and N.
template <class Node>
struct GluNodeBase {
  struct SharedStorage {};
  using Arguments = GluEpilogue;
  using Params = GluEpilogue;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) {
    return a;
  }
  template <class ProblemShape>
  static std::size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  CUTLASS_HOST_DEVICE GluNodeBase() {}
  CUTLASS_HOST_DEVICE GluNodeBase(Params const& params, SharedStorage const&) : params_ptr(&params) {}
  Params const* params_ptr = nullptr;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }
  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(cutlass::epilogue::fusion::ProducerLoadArgs<Args...> const&) {
    return cutlass::epilogue::fusion::EmptyProducerLoadCallbacks{};
  }

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(cutlass::epilogue::fusion::ConsumerStoreArgs<Args...> const& args) {
    auto [M, N, K, L] = args.problem_shape_mnkl;
    auto [m, n, k, l] = args.tile_coord_mnkl;  // l: the group of a grouped GEMM
    auto c = cute::local_tile(cute::make_identity_tensor(cute::make_shape(M, N)),
                              cute::take<0, 2>(args.tile_shape_mnk), cute::make_coord(m, n));
    auto tC_c = cutlass::epilogue::fusion::sm90_partition_for_epilogue<ReferenceSrc>(
        c, args.epi_tile, args.tiled_copy, args.thread_idx);
    return typename Node::template ConsumerStoreCallbacks<decltype(tC_c)>(
        tC_c, *params_ptr, static_cast<int>(l), static_cast<int>(M), static_cast<int>(N));
  }
};

// The gated activation in the epilogue (GluEpilogue): a visitor node at the root of the fusion
// tree. It receives each thread's fragment of the 32-column epilogue subtile (16 values: for an
// 8-column group g = 0..3, the thread holds columns 8g + 2q, 8g + 2q + 1 of rows r and r + 8, as
// element 4g + 2·(row half) + column parity), rounds it to D's type (h as the TMA store writes
// it, returned unchanged), and for every gate element i whose up partner is in the fragment
// writes z = act(gate, up) · p straight from registers to global memory (two adjacent z columns,
// 4 bytes, per store). With h interleaved in blocks of B columns, gate columns c (c mod 2B < B)
// pair with c + B: for B = 8 the partner is element i + 4, for B = 16 element i + 8. That layout
// (CUTLASS 4.2's wgmma accumulators and its automatic 32-wide epilogue subtile for both tiles) is
// pinned by static_asserts below; the tests compare every z with grouped_activation_forward's.
// The activation is act::gated_value of activation_math.h, the very code of the activation
// kernels, on the same bf16 values, so z is bitwise what the separate kernel would write.
template <class ElementZ>
struct Sm90GatedActivation : GluNodeBase<Sm90GatedActivation<ElementZ>> {
  static_assert(std::is_same_v<ElementZ, cutlass::bfloat16_t>, "the fused activation writes bf16");
  using Base = GluNodeBase<Sm90GatedActivation<ElementZ>>;
  using Base::Base;
  using typename Base::Arguments;
  using typename Base::Params;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return (a.block == 8 || a.block == 16) && a.ptr_z != nullptr && a.stride_z != nullptr &&
           a.kind == static_cast<int32_t>(ActivationKind::swiglu);
  }

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor coords, Params const& p, int group, int m, int n)
        : tC_cH(coords),
          z(static_cast<__nv_bfloat16*>(p.ptr_z[group])),
          ldz(p.stride_z[group]),
          probs(p.ptr_probs != nullptr ? p.ptr_probs[group] : nullptr),
          block(p.block),
          rows(m),
          cols(n) {}
    CoordTensor tC_cH;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) -> (row, column) of h within the group
    __nv_bfloat16* z;
    int64_t ldz;
    const float* probs;
    int32_t block;
    int rows, cols;

    // SwiGLU only: the epilogue loop is unrolled over every subtile, so each activation's code is
    // replicated 8 x 16 times per kernel; with a run-time switch over all gated activations (erff,
    // tanhf) that code thrashed the instruction cache (ncu: 14.7 of 31 cycles per issued
    // instruction waiting for instruction fetch, qwen3's fused FC1 at 1.99 ms against ~0.6 ms for the plain GEMM).
    CUTLASS_DEVICE float activation(float g, float u) const {
      return act::gated_value<ActivationKind::swiglu>(g, u, act::Params{});  // SwiGLU has no parameters
    }

    // kHalf = B / 2: the distance from a gate element to its up partner in the fragment; elements
    // with that bit set are up elements. Compile-time, so the fragment stays in registers.
    template <int kHalf, class Coords, int N>
    CUTLASS_DEVICE void store_z(Coords const& c, int base, cutlass::Array<ElementZ, N> const& h) const {
      constexpr int kBlock = 2 * kHalf;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < N; i += 2) {
        if ((i & kHalf) != 0) continue;
        auto rc = c(base + i);
        const int r = cute::get<0>(rc), col = cute::get<1>(rc);
        if (r < rows && col < cols) {
          const float p = probs != nullptr ? probs[r] : 1.0f;
          const int zc = (col / (2 * kBlock)) * kBlock + col % kBlock;
          __nv_bfloat162 v;
          v.x = __float2bfloat16_rn(activation(float(h[i]), float(h[i + kHalf])) * p);
          v.y = __float2bfloat16_rn(activation(float(h[i + 1]), float(h[i + 1 + kHalf])) * p);
          *reinterpret_cast<__nv_bfloat162*>(z + int64_t(r) * ldz + zc) = v;
        }
      }
    }

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementZ, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& input) {
      static_assert(FragmentSize == 16, "the fused activation expects 16 values (four 8-column groups, two rows) "
                                        "per thread and epilogue subtile");
      // h as the epilogue stores it: one round to nearest, as the unfused GEMM's conversion.
      const cutlass::Array<ElementZ, FragmentSize> h =
          cutlass::NumericArrayConverter<ElementZ, ElementInput, FragmentSize,
                                         cutlass::FloatRoundStyle::round_to_nearest>{}(input);
      auto c = tC_cH(cute::_, cute::_, cute::_, epi_m, epi_n);
      if (block == 8) {
        store_z<4>(c, epi_v * FragmentSize, h);
      } else {
        store_z<8>(c, epi_v * FragmentSize, h);
      }
      return h;
    }
  };

};

// The gated activation's backward in the epilogue of FC2's data gradient (GluEpilogue of a dgrad
// launch, ptr_z/stride_z then address h): the root node over the accumulators of dz = dy·W2_e. The
// GEMM stores no D (void ElementD: dz never reaches memory). For each element of a thread's
// fragment it rounds the accumulator to bf16 (dz as the unfused GEMM stores it), reads h's gate and
// up values of that column (gate column act::gate_column(c, block), up act::up_offset(F, block)
// further; block 0: concatenated halves, F = the GEMM's N), and writes dh's gate and up values over
// them with the activation kernel's arithmetic (activation_math.h's gated_eval, then dz · derivative
// rounded once): bitwise what grouped_activation_backward writes from the stored dz. Two adjacent
// columns per access (4 bytes): a fragment's element pairs (2q, 2q + 1) are adjacent in dz, and so
// are their gate (and up) columns for even blocks. Each h element is read and then written by the
// same thread only, so dh may be h. No probabilities, dprobs, recomputed z or amax in this node
// (grouped_gemm_dgrad_activation_backward takes the unfused path for those).
template <class ElementH>
struct Sm90GatedActivationBackward : GluNodeBase<Sm90GatedActivationBackward<ElementH>> {
  static_assert(std::is_same_v<ElementH, cutlass::bfloat16_t>, "the fused activation backward is bf16");
  using ElementAux = ElementH;  // what the epilogue's shared-memory types take with no D (void)
  using Base = GluNodeBase<Sm90GatedActivationBackward<ElementH>>;
  using Base::Base;
  using typename Base::Arguments;
  using typename Base::Params;

  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& a) {
    return (a.block == 0 || a.block % 2 == 0) && a.ptr_z != nullptr && a.stride_z != nullptr &&
           a.ptr_probs == nullptr && a.kind == static_cast<int32_t>(ActivationKind::swiglu);
  }

  template <class CoordTensor>
  struct ConsumerStoreCallbacks : cutlass::epilogue::fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(CoordTensor coords, Params const& p, int group, int m, int n)
        : tC_cD(coords),
          h(static_cast<__nv_bfloat16*>(p.ptr_z[group])),
          ldh(p.stride_z[group]),
          block(p.block),
          up(act::up_offset(n, p.block)),
          rows(m),
          cols(n) {}
    CoordTensor tC_cD;  // (CPY, CPY_M, CPY_N, EPI_M, EPI_N) -> (row, column) of dz within the group
    __nv_bfloat16* h;   // h in, dh out (over it)
    int64_t ldh;
    int32_t block;
    int up, rows, cols;

    template <class ElementAccumulator, class ElementInput, int FragmentSize>
    CUTLASS_DEVICE cutlass::Array<ElementH, FragmentSize> visit(
        cutlass::Array<ElementAccumulator, FragmentSize> const&, int epi_v, int epi_m, int epi_n,
        cutlass::Array<ElementInput, FragmentSize> const& input) {
      static_assert(FragmentSize % 2 == 0, "the fragment holds pairs of adjacent columns");
      // dz as the unfused GEMM stores it: one round to nearest.
      const cutlass::Array<ElementH, FragmentSize> dz =
          cutlass::NumericArrayConverter<ElementH, ElementInput, FragmentSize,
                                         cutlass::FloatRoundStyle::round_to_nearest>{}(input);
      auto c = tC_cD(cute::_, cute::_, cute::_, epi_m, epi_n);
      const int base = epi_v * FragmentSize;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < FragmentSize; i += 2) {
        auto rc = c(base + i);
        const int r = cute::get<0>(rc), col = cute::get<1>(rc);
        if (r < rows && col < cols) {  // col even, cols even (the host takes F even): col + 1 < cols too
          __nv_bfloat162* g2 = reinterpret_cast<__nv_bfloat162*>(h + int64_t(r) * ldh + act::gate_column(col, block));
          __nv_bfloat162* u2 = g2 + up / 2;
          const __nv_bfloat162 hg = *g2, hu = *u2;
          const act::Eval e0 = act::gated_eval<ActivationKind::swiglu>(__low2float(hg), __low2float(hu), act::Params{});
          const act::Eval e1 = act::gated_eval<ActivationKind::swiglu>(__high2float(hg), __high2float(hu), act::Params{});
          // The activation kernel's arithmetic without probabilities: gp = dz · 1.0f = dz.
          const float d0 = float(dz[i]), d1 = float(dz[i + 1]);
          *g2 = __floats2bfloat162_rn(d0 * e0.d_gate, d1 * e1.d_gate);
          *u2 = __floats2bfloat162_rn(d0 * e0.d_up, d1 * e1.d_up);
        }
      }
      return dz;
    }
  };

};

}  // namespace sm90
}  // namespace gmoe::cuda_backend
