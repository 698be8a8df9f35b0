// src/cuda/fp8_quantize_grouped.cu — grouped FP8 quantization of grouped rows (x, dy) on the
// device: one offsets launch (shared with the grouped bias ops), then ONE tile-kernel launch that
// writes the rowwise and the columnwise (transposed, token-padded) copies together. Tensorwise
// adds a memset and one amax launch before it (the scale of an expert needs all its rows).
//
// The grid is sized from host-known bounds only (padded_capacity / 128 row tiles, cols / 128
// column tiles), so the launch sequence is the same for any counts: capturable in a CUDA graph
// and replayable under any routing.
#include "common/backend.h"
#include "cuda/cuda_check.h"
#include "cuda/fp8_quantize.cuh"
#include "cuda/group_offsets.cuh"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

using fp8::QuantParams;

bool aligned(const void* p, std::size_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

template <typename T, Fp8Recipe R>
void launch_tile(const QuantParams& p, dim3 grid, bool columnwise, cudaStream_t stream) {
  const int smem = columnwise ? fp8::tile_smem_bytes<T>() : 0;
  auto kernel = fp8::quantize_tile_kernel<T, R, false>;
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
      fp8::amax_tile_kernel<T, false><<<grid, fp8::kThreads, 0, stream>>>(p, amax);
      GMOE_CUDA_CHECK(cudaGetLastError());
      launch_tile<T, Fp8Recipe::tensorwise>(p, grid, columnwise, stream);
      return;
    case Fp8Recipe::blockwise: launch_tile<T, Fp8Recipe::blockwise>(p, grid, columnwise, stream); return;
    case Fp8Recipe::mxfp8: launch_tile<T, Fp8Recipe::mxfp8>(p, grid, columnwise, stream); return;
  }
}

}  // namespace

void quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& o, const Fp8Grouped& q,
                      Stream stream_, Allocator& alloc) {
  cudaStream_t stream = stream_;
  const int E = static_cast<int>(x.num_groups());
  const int64_t cap = x.capacity(), cols = x.cols();
  const int64_t es = static_cast<int64_t>(dtype_size(x.data.dtype));
  const int64_t col_tiles = std::max<int64_t>(1, (cols + fp8::kTile - 1) / fp8::kTile);
  GMOE_CHECK(col_tiles <= 65535, "x.data: at most ", 65535 * fp8::kTile, " columns on CUDA, got ", cols);
  if (o.recipe != Fp8Recipe::mxfp8) {
    GMOE_CHECK(q.scale_inv.data == nullptr || aligned(q.scale_inv.data, 4), "out.scale_inv: f32 scales must be 4-byte aligned");
    GMOE_CHECK(q.scale_inv_t.data == nullptr || aligned(q.scale_inv_t.data, 4),
               "out.scale_inv_t: f32 scales must be 4-byte aligned");
  }
  GMOE_CHECK(aligned(q.padded_offsets.data, 8), "out.padded_offsets: must be 8-byte aligned");

  // Scratch: real offsets [E+1] i64, tensorwise amax [E] u32.
  Buffer scratch(alloc, sizeof(int64_t) * (E + 1) + sizeof(uint32_t) * E, stream_);
  int64_t* offsets = static_cast<int64_t*>(scratch.data());
  uint32_t* amax = reinterpret_cast<uint32_t*>(offsets + E + 1);
  int64_t* padded = static_cast<int64_t*>(q.padded_offsets.data);
  launch_group_offsets(x.counts, cap, offsets, padded, kFp8TokenPad, kFp8TokenPad, stream);

  QuantParams p;
  p.src = x.data.data;
  p.src_ld = x.data.stride(0);
  p.rows = cap;
  p.cols = cols;
  p.num_experts = E;
  p.offsets = offsets;
  p.padded = padded;
  p.data = static_cast<uint8_t*>(q.data.data);
  p.scale = q.scale_inv.data;
  p.data_t = static_cast<uint8_t*>(q.data_t.data);
  p.data_t_ld = q.padded_capacity;
  // Tensorwise: the columnwise scales are written only when they are a separate array.
  p.scale_t = (o.recipe == Fp8Recipe::tensorwise && q.scale_inv_t.data == q.scale_inv.data)
                  ? nullptr
                  : q.scale_inv_t.data;
  if (o.recipe == Fp8Recipe::blockwise) {
    p.scale_ld = (cols + kFp8Block - 1) / kFp8Block;
    p.scale_t_ld = q.padded_capacity / kFp8Block;
  } else if (o.recipe == Fp8Recipe::mxfp8) {
    p.scale_ld = (cols + kMxBlock - 1) / kMxBlock;
    p.scale_t_ld = q.padded_capacity / kMxBlock;
  }
  p.amax_bits = amax;
  p.e5m2 = o.format == DType::e5m2;
  p.fp8_max = p.e5m2 ? fp8_rules::kE5m2Max : fp8_rules::kE4m3Max;
  p.emax = p.e5m2 ? fp8_rules::kE5m2Emax : fp8_rules::kE4m3Emax;
  p.pow2 = o.pow2_scales;
  p.vec = aligned(x.data.data, 16) && (cap <= 1 || (x.data.stride(0) * es) % 16 == 0) && cols % 16 == 0 &&
          (p.data == nullptr || aligned(p.data, 16));
  p.vec_t = p.data_t == nullptr || aligned(p.data_t, 16);

  const dim3 grid(static_cast<unsigned>(q.padded_capacity / fp8::kTile), static_cast<unsigned>(col_tiles));
  const bool columnwise = p.data_t != nullptr;
  switch (x.data.dtype) {
    case DType::bf16: launch_typed<__nv_bfloat16>(o.recipe, p, grid, columnwise, amax, stream); break;
    case DType::f16: launch_typed<__half>(o.recipe, p, grid, columnwise, amax, stream); break;
    case DType::f32: launch_typed<float>(o.recipe, p, grid, columnwise, amax, stream); break;
    default: GMOE_FAIL("quantize_grouped: x.data dtype ", dtype_name(x.data.dtype), " not supported");
  }
}

}  // namespace gmoe::cuda_backend
