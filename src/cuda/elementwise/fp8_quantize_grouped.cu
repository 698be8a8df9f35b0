// src/cuda/elementwise/fp8_quantize_grouped.cu — grouped FP8 quantization of grouped rows (x, dy) on the
// device: one offsets launch (shared with the grouped bias ops), then ONE tile-kernel launch that
// writes the rowwise and the columnwise (transposed, token-padded) copies together. Tensorwise
// adds a memset and one amax launch before it (the scale of an expert needs all its rows).
// Column sums (the bias gradient when x is dy) come from the launch that reads every element (the
// tile kernel; tensorwise: the amax kernel) as partial sums per 128-row tile, then the bias
// gradient's final reduction over each expert's tiles (grouped_bias.h): no second read of x.
//
// The grid is sized from host-known bounds only (padded_capacity / 128 row tiles, cols / 128
// column tiles), so the launch sequence is the same for any counts: capturable in a CUDA graph
// and replayable under any routing.
#include "common/backend.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/elementwise/fp8_quantize.cuh"
#include "cuda/runtime/group_offsets.cuh"
#include "cuda/elementwise/grouped_bias.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
using fp8::QuantParams;

namespace fp8 {

QuantParams grouped_params(const TensorView& counts, int64_t cap, int64_t cols, const Fp8QuantizeOptions& o,
                           const Fp8Grouped& q, Buffer& scratch, Allocator& alloc, Stream stream_, dim3& grid) {
  const int E = static_cast<int>(counts.size(0));
  const int64_t col_tiles = std::max<int64_t>(1, (cols + kTile - 1) / kTile);
  GMOE_CHECK(col_tiles <= 65535, "x.data: at most ", 65535 * kTile, " columns on CUDA, got ", cols);
  check_scales_aligned(q, o);
  GMOE_CHECK(aligned(q.padded_offsets.data, 8), "out.padded_offsets: must be 8-byte aligned");

  // Scratch: real offsets [E+1] i64, tensorwise amax [E] u32.
  scratch = Buffer(alloc, sizeof(int64_t) * (E + 1) + sizeof(uint32_t) * E, stream_);
  int64_t* offsets = static_cast<int64_t*>(scratch.data());
  int64_t* padded = static_cast<int64_t*>(q.padded_offsets.data);
  launch_group_offsets(counts, cap, offsets, padded, kFp8TokenPad, kFp8TokenPad, stream_);

  QuantParams p;
  p.rows = cap;
  p.cols = cols;
  p.num_experts = E;
  p.offsets = offsets;
  p.padded = padded;
  set_outputs(p, q, o);
  p.data_t_ld = q.padded_capacity;
  if (o.recipe == Fp8Recipe::blockwise) {
    p.scale_ld = cap;     // token-major [ceil(cols/128), capacity]
    p.scale_t_ld = cols;  // token-block-major [padded_capacity/128, cols]
  } else if (o.recipe == Fp8Recipe::mxfp8) {
    p.scale_ld = (cols + kMxBlock - 1) / kMxBlock;
    p.scale_t_ld = q.padded_capacity / kMxBlock;
  }
  p.amax_given = o.amax.defined();  // (f32 [E], checked: its bits are what the amax pass would write)
  p.amax_bits = p.amax_given ? static_cast<const uint32_t*>(o.amax.data)
                             : reinterpret_cast<uint32_t*>(offsets + E + 1);
  p.vec_t = p.data_t == nullptr || aligned(p.data_t, 16);
  grid = dim3(static_cast<unsigned>(q.padded_capacity / kTile), static_cast<unsigned>(col_tiles));
  return p;
}

}  // namespace fp8

void quantize_grouped(const GroupedRows& x, const Fp8QuantizeOptions& o, const Fp8Grouped& q,
                      Stream stream_, Allocator& alloc, const ExpertBias& column_sums) {
  const int64_t cap = x.capacity(), cols = x.cols();
  const int64_t es = static_cast<int64_t>(dtype_size(x.data.dtype));
  Buffer scratch;
  dim3 grid;
  QuantParams p = fp8::grouped_params(x.counts, cap, cols, o, q, scratch, alloc, stream_, grid);
  p.src = x.data.data;
  p.src_ld = x.data.stride(0);
  p.vec = aligned(x.data.data, 16) && (cap <= 1 || (x.data.stride(0) * es) % 16 == 0) && cols % 16 == 0 &&
          (p.data == nullptr || aligned(p.data, 16));
  // Column sums: one f32 row per 128-row tile (the tiles of expert e are its chunks of 128 rows
  // from its first row, rows padded[e] / 128 ...), reduced per expert in tile order.
  Buffer partial;
  if (column_sums.defined() && cols > 0) {
    partial = Buffer(alloc, sizeof(float) * static_cast<size_t>(q.padded_capacity / fp8::kTile * cols), stream_);
    p.col_sums = static_cast<float*>(partial.data());
  }
  fp8::launch_quantize<false>(x.data.dtype, o.recipe, p, grid, const_cast<uint32_t*>(p.amax_bits), stream_,
                              "quantize_grouped: x.data");
  if (p.col_sums != nullptr) {
    launch_bias_grad_final(p.col_sums, cols, p.padded, fp8::kTile, column_sums, stream_, alloc);
  }
}

}  // namespace gmoe::cuda_backend
