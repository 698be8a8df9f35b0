// src/cuda/elementwise/fp8_quantize_weights.cu — FP8 quantization of expert weights on the device: one
// tile-kernel launch over E x ceil(N/128) x ceil(K/128) tiles writes data [E, N, K] and its
// transpose data_t [E, K, N] together (tensorwise: a memset and one amax launch before it; the
// list layout: one small launch writing the experts' pointers first).
#include <algorithm>
#include <vector>

#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/elementwise/fp8_quantize.cuh"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
using fp8::QuantParams;

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
  fp8::check_scales_aligned(q, o);

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
  fp8::set_outputs(p, q, o);
  p.data_t_ld = N;
  if (o.recipe == Fp8Recipe::mxfp8) {
    p.scale_ld = (K + kMxBlock - 1) / kMxBlock;
    p.scale_t_ld = (N + kMxBlock - 1) / kMxBlock;
  }
  p.amax_bits = amax;
  p.vec = src_aligned && K % 16 == 0 && (p.data == nullptr || aligned(p.data, 16));
  p.vec_t = p.data_t == nullptr || (aligned(p.data_t, 16) && N % 16 == 0);

  const dim3 grid(static_cast<unsigned>(E * row_tiles), static_cast<unsigned>(col_tiles));
  fp8::launch_quantize<true>(w.dtype(), o.recipe, p, grid, amax, stream, "quantize_weights: w");
}

}  // namespace gmoe::cuda_backend
