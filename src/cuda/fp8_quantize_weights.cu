// src/cuda/fp8_quantize_weights.cu — FP8 quantization of expert weights on the device: one
// tile-kernel launch over E x ceil(N/128) x ceil(K/128) tiles writes data [E, N, K] and its
// transpose data_t [E, K, N] together (tensorwise: a memset and one amax launch before it; the
// list layout: one small launch writing the experts' pointers first).
#include <algorithm>
#include <vector>

#include "common/backend.h"
#include "cuda/cuda_check.h"
#include "cuda/fp8_quantize.cuh"
#include "cuda/grouped_gemm_prepare.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

using fp8::QuantParams;

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <typename T, Fp8Recipe R>
void launch_tile(const QuantParams& p, dim3 grid, bool columnwise, cudaStream_t stream) {
  const int smem = columnwise ? fp8::tile_smem_bytes<T>() : 0;
  auto kernel = fp8::quantize_tile_kernel<T, R, true>;
  GMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, fp8::kThreads, smem, stream>>>(p);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void launch_typed(Fp8Recipe r, const QuantParams& p, dim3 grid, bool columnwise, uint32_t* amax,
                  cudaStream_t stream) {
  switch (r) {
    case Fp8Recipe::tensorwise:
      GMOE_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(uint32_t) * p.num_experts, stream));
      fp8::amax_tile_kernel<T, true><<<grid, fp8::kThreads, 0, stream>>>(p, amax);
      GMOE_CUDA_CHECK(cudaGetLastError());
      launch_tile<T, Fp8Recipe::tensorwise>(p, grid, columnwise, stream);
      return;
    case Fp8Recipe::blockwise: launch_tile<T, Fp8Recipe::blockwise>(p, grid, columnwise, stream); return;
    case Fp8Recipe::mxfp8: launch_tile<T, Fp8Recipe::mxfp8>(p, grid, columnwise, stream); return;
  }
}

}  // namespace

void quantize_weights(const ExpertWeights& w, const Fp8QuantizeOptions& o, const Fp8Weights& q,
                      Stream stream_, Allocator& alloc) {
  cudaStream_t stream = stream_;
  const int E = static_cast<int>(w.num_experts());
  const int64_t N = w.rows(), K = w.cols();
  const int64_t es = static_cast<int64_t>(dtype_size(w.dtype()));
  const int64_t row_tiles = std::max<int64_t>(1, (N + fp8::kTile - 1) / fp8::kTile);
  const int64_t col_tiles = std::max<int64_t>(1, (K + fp8::kTile - 1) / fp8::kTile);
  GMOE_CHECK(col_tiles <= 65535, "w: at most ", 65535 * fp8::kTile, " columns (K) on CUDA, got ", K);
  GMOE_CHECK(E * row_tiles <= INT32_MAX, "w: too many row tiles (", E, " experts x ", row_tiles, ")");
  if (o.recipe != Fp8Recipe::mxfp8) {
    GMOE_CHECK(q.scale_inv.data == nullptr || aligned(q.scale_inv.data, 4), "out.scale_inv: f32 scales must be 4-byte aligned");
    GMOE_CHECK(q.scale_inv_t.data == nullptr || aligned(q.scale_inv_t.data, 4),
               "out.scale_inv_t: f32 scales must be 4-byte aligned");
  }

  // Scratch: tensorwise amax [E] u32; list layout: the experts' pointers and row strides.
  const bool list = !w.is_stacked();
  const std::size_t amax_bytes = (sizeof(uint32_t) * E + 15) / 16 * 16;
  Buffer scratch(alloc, amax_bytes + (list ? (sizeof(void*) + sizeof(int64_t)) * E : 0), stream_);
  uint32_t* amax = static_cast<uint32_t*>(scratch.data());
  const void** ptrs = nullptr;
  int64_t* lds = nullptr;

  QuantParams p;
  bool src_aligned = true;
  if (list) {
    ptrs = reinterpret_cast<const void**>(static_cast<char*>(scratch.data()) + amax_bytes);
    lds = reinterpret_cast<int64_t*>(ptrs + E);
    std::vector<const void*> hp(E);
    std::vector<int64_t> hl(E);
    for (int e = 0; e < E; ++e) {
      hp[e] = w.list[e].data;
      hl[e] = w.list[e].stride(0);
      src_aligned = src_aligned && aligned(hp[e], 16) && (N <= 1 || (hl[e] * es) % 16 == 0);
    }
    launch_write_expert_pointers(hp.data(), hl.data(), E, ptrs, lds, nullptr, nullptr, stream);
    p.src_ptrs = ptrs;
    p.src_lds = lds;
  } else {
    p.src = w.stacked.data;
    p.src_ld = w.stacked.stride(1);
    p.src_expert_stride = w.stacked.stride(0);
    src_aligned = aligned(p.src, 16) && (N <= 1 || (p.src_ld * es) % 16 == 0) &&
                  (E <= 1 || (p.src_expert_stride * es) % 16 == 0);
  }
  p.rows = N;
  p.cols = K;
  p.num_experts = E;
  p.row_tiles = row_tiles;
  p.data = static_cast<uint8_t*>(q.data.data);
  p.scale = q.scale_inv.data;
  p.data_t = static_cast<uint8_t*>(q.data_t.data);
  p.data_t_ld = N;
  p.scale_t = (o.recipe == Fp8Recipe::tensorwise && q.scale_inv_t.data == q.scale_inv.data)
                  ? nullptr
                  : q.scale_inv_t.data;
  if (o.recipe == Fp8Recipe::mxfp8) {
    p.scale_ld = (K + kMxBlock - 1) / kMxBlock;
    p.scale_t_ld = (N + kMxBlock - 1) / kMxBlock;
  }
  p.amax_bits = amax;
  p.e5m2 = o.format == DType::e5m2;
  p.fp8_max = p.e5m2 ? fp8_rules::kE5m2Max : fp8_rules::kE4m3Max;
  p.emax = p.e5m2 ? fp8_rules::kE5m2Emax : fp8_rules::kE4m3Emax;
  p.pow2 = o.pow2_scales;
  p.vec = src_aligned && K % 16 == 0 && (p.data == nullptr || aligned(p.data, 16));
  p.vec_t = p.data_t == nullptr || (aligned(p.data_t, 16) && N % 16 == 0);

  const dim3 grid(static_cast<unsigned>(E * row_tiles), static_cast<unsigned>(col_tiles));
  const bool columnwise = p.data_t != nullptr;
  switch (w.dtype()) {
    case DType::bf16: launch_typed<__nv_bfloat16>(o.recipe, p, grid, columnwise, amax, stream); break;
    case DType::f16: launch_typed<__half>(o.recipe, p, grid, columnwise, amax, stream); break;
    case DType::f32: launch_typed<float>(o.recipe, p, grid, columnwise, amax, stream); break;
    default: GMOE_FAIL("quantize_weights: w dtype ", dtype_name(w.dtype()), " not supported");
  }
}

}  // namespace gmoe::cuda_backend
