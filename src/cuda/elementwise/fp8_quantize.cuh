// src/cuda/elementwise/fp8_quantize.cuh — the FP8 quantization tile kernel (grouped rows and expert weights),
// the tensorwise amax kernel, and their parameters. Instantiated in fp8_quantize_grouped.cu,
// fp8_quantize_weights.cu and, with the activation's source, fp8_quantize_activation.cu.
//
// One CTA (256 threads) quantizes one 128 x 128 tile of the source:
//   grouped rows: blockIdx.x walks the per-expert PADDED 128-row tiles (expert e owns padded rows
//     [padded[e], padded[e+1]), a multiple of 128), so a tile never spans two experts; the CTA
//     finds its expert by binary search in the device offsets. Tiles past padded[E] ("tail"
//     tiles) zero the rows past the real total and the unused columns of data_t.
//   weights: blockIdx.x = e * ceil(N/128) + n-tile.
//   blockIdx.y is the 128-column tile.
// Phases: (1) the source's 16-byte granules of the tile into registers (RowsSource: loads of the
// tensor; an activation's source computes them from h; rows past the expert's count and
// columns past `cols` read as 0) and into shared memory (16-byte granules XOR-swizzled by
// (row / 16) % 8); (2) rowwise: amax of each 1x128 (1x32 for mxfp8) block by warp shuffles
// over the lanes that hold the row (a 1x128 block's scale then computed once, by one lane, in
// shared memory), quantize from registers, store; (3) columnwise: each lane reads one 4-byte word
// (2 bf16/f16 columns, or 1 f32 column) of 16 consecutive rows — the swizzle makes these reads
// conflict-free — takes the 128x1 (32x1) amax by shuffles over the 8 (2) lanes holding one
// column's 128 (32) tokens, and stores 16 fp8 bytes of the transposed row: 8 lanes write one
// 128-byte segment of data_t (coalesced). Amaxes are taken on the source's bits ("Amax on the
// bits" below). Grouped rows may also give each tile's
// column sums of the source (QuantParams::col_sums: quantize_grouped's column_sums, the bias
// gradient of dy), from the registers of phase (1) (tensorwise: of the amax pass, which reads
// every element too). The host side that the callers share (set_outputs, grouped_params,
// launch_typed, launch_quantize) closes the file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "common/fp8_rules.h"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/group_offsets.cuh"
#include "gmoe/error.h"
#include "gmoe/fp8.h"

namespace gmoe::cuda_backend::fp8 {

constexpr int kTile = 128;     // rows and columns of a CTA's tile
constexpr int kThreads = 256;  // 8 warps
constexpr int kWarps = kThreads / 32;

/// Everything a quantization launch reads. Element strides are in source elements.
struct QuantParams {
  // Source
  const void* src = nullptr;               // grouped: x; weights stacked: expert 0
  int64_t src_ld = 0;                      // row stride
  int64_t src_expert_stride = 0;           // weights stacked: elements between experts
  const void* const* src_ptrs = nullptr;   // weights list: [E] device array, or nullptr
  const int64_t* src_lds = nullptr;        // weights list: [E] row strides
  int64_t rows = 0;                        // grouped: capacity; weights: N
  int64_t cols = 0;                        // grouped: cols; weights: K
  int num_experts = 0;
  int64_t row_tiles = 0;                   // weights: ceil(N / 128)
  // Grouped rows: device offsets [E+1] (real and padded)
  const int64_t* offsets = nullptr;
  const int64_t* padded = nullptr;
  // Outputs (nullptr: not asked for)
  uint8_t* data = nullptr;                 // rowwise [rows(, E), cols]
  void* scale = nullptr;                   // rowwise scales (or tensorwise [E])
  int64_t scale_ld = 0;                    // grouped rows: mxfp8 elements per row of `scale`;
                                           // blockwise (token-major) elements per column block
  uint8_t* data_t = nullptr;               // columnwise
  int64_t data_t_ld = 0;                   // bytes per row of data_t (padded_capacity, or N)
  void* scale_t = nullptr;                 // columnwise scales (tensorwise: a second [E] array)
  int64_t scale_t_ld = 0;
  const uint32_t* amax_bits = nullptr;     // tensorwise: [E] amax as f32 bits
  bool amax_given = false;                 // tensorwise: amax_bits is the caller's (no amax pass)
  // Grouped rows from memory (RowsSource), optional: each tile's column sums of the source,
  // [padded_capacity / 128, cols] f32, row = the tile's padded index (its expert's 128-row chunk
  // counted from the expert's first row); blockwise / mxfp8: the tile kernel, tensorwise: the
  // amax kernel. Rows of tail tiles are not written.
  float* col_sums = nullptr;
  // Rule
  float fp8_max = 448.0f;
  int emax = 8;
  bool e5m2 = false;
  bool pow2 = false;
  // Vector paths (checked on the host): 16-byte source loads and 4/8-byte data stores;
  // 16-byte data_t stores.
  bool vec = false;
  bool vec_t = false;
};

__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

// ---------------------------------------------------------------------------------------------
// Element types

template <typename T>
struct Elem;
// Besides the conversions, each type names the bits of |x| (kAbsMask over a 4-byte word; those of
// 16-bit types are compared as u16x2, of f32 as u32: for x >= 0 the order of the bits is that of
// the values), the first of them that is not finite (kInfBits: inf, above it NaN), and the value of
// such bits and back (to_bits of a value of type T only, so both are exact).
template <>
struct Elem<__nv_bfloat16> {
  static constexpr int kPerWord = 2;
  static constexpr uint32_t kAbsMask = 0x7fff7fffu;
  static constexpr uint32_t kInfBits = 0x7f80u;
  __device__ static float from_bits(uint32_t b) { return __uint_as_float(b << 16); }
  __device__ static uint32_t to_bits(float f) { return __float_as_uint(f) >> 16; }
  // bf16 -> f32 is the bits shifted up: the high element is the word masked (one LOP3 instead of
  // a byte permute and a shift).
  __device__ static float2 word(uint32_t w) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  }
  __device__ static float one(const void* p, int64_t i) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  }
};
template <>
struct Elem<__half> {
  static constexpr int kPerWord = 2;
  static constexpr uint32_t kAbsMask = 0x7fff7fffu;
  static constexpr uint32_t kInfBits = 0x7c00u;
  __device__ static float from_bits(uint32_t b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b)));
  }
  __device__ static uint32_t to_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }
  __device__ static float2 word(uint32_t w) {
    __half2 h;
    memcpy(&h, &w, 4);
    return __half22float2(h);
  }
  __device__ static float one(const void* p, int64_t i) {
    return __half2float(static_cast<const __half*>(p)[i]);
  }
};
template <>
struct Elem<float> {
  static constexpr int kPerWord = 1;
  static constexpr uint32_t kAbsMask = 0x7fffffffu;
  static constexpr uint32_t kInfBits = 0x7f800000u;
  __device__ static float from_bits(uint32_t b) { return __uint_as_float(b); }
  __device__ static uint32_t to_bits(float f) { return __float_as_uint(f); }
  __device__ static float2 word(uint32_t w) { return make_float2(__uint_as_float(w), 0.0f); }
  __device__ static float one(const void* p, int64_t i) { return static_cast<const float*>(p)[i]; }
};

/// The 4 words of a 16-byte granule as floats: out[0 .. 16/sizeof(T)).
template <typename T>
__device__ __forceinline__ void granule_to_float(const uint4& g, float* out) {
  const uint32_t w[4] = {g.x, g.y, g.z, g.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = Elem<T>::word(w[i]);
    out[i * Elem<T>::kPerWord] = f.x;
    if constexpr (Elem<T>::kPerWord == 2) out[i * 2 + 1] = f.y;
  }
}

// ---------------------------------------------------------------------------------------------
// Amax on the bits. The max of |x| over finite values (fp8_rules::finite_abs's) is taken on the
// source's own bits, two 16-bit elements per instruction (max.u16x2), not on floats (an f32
// conversion, abs, finiteness test and select per element): masked words are max'ed in their
// halves, and only where the result is not finite (an inf or NaN among them) are the values
// taken again one by one. Bits stay bits through the shuffles (two slots' 16-bit maxima share a
// word); from_bits makes the float that the scale rule takes, the same float as before.

/// Packed max of the |x| bits of word w into m (per 16-bit half, or the whole f32 word).
template <typename T>
__device__ __forceinline__ uint32_t abs_bits_max(uint32_t m, uint32_t w) {
  w &= Elem<T>::kAbsMask;
  if constexpr (Elem<T>::kPerWord == 2) {
    return __vmaxu2(m, w);
  } else {
    return m > w ? m : w;
  }
}
/// The larger of a packed word's halves (16-bit types; f32: the word).
template <typename T>
__device__ __forceinline__ uint32_t fold_abs_bits(uint32_t m) {
  if constexpr (Elem<T>::kPerWord == 2) {
    return max(m & 0xffffu, m >> 16);
  } else {
    return m;
  }
}
/// Bits of the max over finite values of float array f (the slow path: some value not finite).
template <typename T, int N>
__device__ __forceinline__ uint32_t finite_amax_bits(const float (&f)[N]) {
  float m = 0.0f;
#pragma unroll
  for (int j = 0; j < N; ++j) m = fmaxf(m, fp8_rules::finite_abs(f[j]));
  return Elem<T>::to_bits(m);
}
/// The packed max of the |x| bits of a 16-byte granule's words (16-bit types: per half; not folded).
template <typename T>
__device__ __forceinline__ uint32_t granule_abs_bits_packed(const uint4& g) {
  return abs_bits_max<T>(abs_bits_max<T>(abs_bits_max<T>(g.x & Elem<T>::kAbsMask, g.y), g.z), g.w);
}
/// Whether either 16-bit half of packed amax bits is not finite (kInfBits or above).
template <typename T>
__device__ __forceinline__ bool any_half_not_finite(uint32_t w) {
  return (w & 0xffffu) >= Elem<T>::kInfBits || (w >> 16) >= Elem<T>::kInfBits;
}
/// Bits of the max |x| over the finite values of a 16-byte granule.
template <typename T>
__device__ __forceinline__ uint32_t granule_amax_bits(const uint4& g) {
  const uint32_t b = fold_abs_bits<T>(granule_abs_bits_packed<T>(g));
  if (b < Elem<T>::kInfBits) return b;
  float f[16 / sizeof(T)];
  granule_to_float<T>(g, f);
  return finite_amax_bits<T>(f);
}
/// Max of amax bits over aligned groups of `lanes` lanes (a power of two <= 32; every lane calls
/// it): one value, or kN values at once, of which 16-bit types shuffle two per word.
__device__ __forceinline__ uint32_t warp_max_bits(uint32_t b, int lanes) {
  for (int d = 1; d < lanes; d <<= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, d));
  return b;
}
/// The same for a word of two 16-bit amax bits (each half its own max).
__device__ __forceinline__ uint32_t warp_max_u16x2(uint32_t v, int lanes) {
  for (int d = 1; d < lanes; d <<= 1) v = __vmaxu2(v, __shfl_xor_sync(0xffffffffu, v, d));
  return v;
}
template <typename T, int kN>
__device__ __forceinline__ void warp_max_bits(uint32_t (&b)[kN], int lanes) {
  if constexpr (Elem<T>::kPerWord == 2) {
    static_assert(kN % 2 == 0, "pairs of 16-bit values");
#pragma unroll
    for (int n = 0; n < kN; n += 2) {
      const uint32_t v = warp_max_u16x2(b[n] | (b[n + 1] << 16), lanes);
      b[n] = v & 0xffffu;
      b[n + 1] = v >> 16;
    }
  } else {
#pragma unroll
    for (int n = 0; n < kN; ++n) b[n] = warp_max_bits(b[n], lanes);
  }
}

/// Two f32 -> two fp8 bytes (low byte = a), RN-even, saturating, NaN -> 0x7F. The format is a
/// template parameter: cuda_fp8.hpp selects the instruction by a run-time branch, which ptxas kept
/// around every conversion of the tile kernel.
template <bool kE5m2>
__device__ __forceinline__ uint32_t cvt_pair(float a, float b) {
  const __nv_fp8x2_storage_t s =
      __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, kE5m2 ? __NV_E5M2 : __NV_E4M3);
  return static_cast<uint32_t>(s);
}

/// The scale of a block: the quantization multiplier and what is stored.
struct BlockScale {
  float mult;
  float inv;
  uint8_t e8m0;
};

template <Fp8Recipe R>
__device__ __forceinline__ BlockScale block_scale(float amax, const QuantParams& p) {
  BlockScale s;
  if (R == Fp8Recipe::mxfp8) {
    s.e8m0 = fp8_rules::e8m0_from_amax(amax, p.emax);
    s.mult = fp8_rules::e8m0_quant_multiplier(s.e8m0);
    s.inv = 0.0f;
  } else {
    s.mult = fp8_rules::scale_from_amax(amax, p.fp8_max, p.pow2);
    s.inv = fp8_rules::scale_inv_from_scale(s.mult);
    s.e8m0 = 0;
  }
  return s;
}

template <Fp8Recipe R>
__device__ __forceinline__ void store_scale(void* base, int64_t i, const BlockScale& s) {
  if (R == Fp8Recipe::mxfp8) {
    static_cast<uint8_t*>(base)[i] = s.e8m0;
  } else {
    static_cast<float*>(base)[i] = s.inv;
  }
}
template <Fp8Recipe R>
__device__ __forceinline__ void store_scale_one(void* base, int64_t i) {
  if (R == Fp8Recipe::mxfp8) {
    static_cast<uint8_t*>(base)[i] = fp8_rules::kE8m0One;
  } else {
    static_cast<float*>(base)[i] = 1.0f;
  }
}

// ---------------------------------------------------------------------------------------------
// Tile geometry

struct Tile {
  int e = 0;                    // expert
  const char* src = nullptr;    // source row 0 of the tile (bytes)
  int64_t src_ld_bytes = 0;
  int nrows = 0;                // valid source rows (0: a tail tile or nothing to do)
  int64_t out_row0 = 0;         // rowwise output row of tile row 0 (index into data / scale)
  int64_t out_col_row0 = 0;     // columnwise: data_t row of tile column 0 (minus col0)
  int64_t tok0 = 0;             // columnwise: first token (byte column of data_t) of the tile
  int tokens = 0;               // columnwise: tokens stored (grouped: 128, padding as zeros)
  int64_t tile_index = 0;       // grouped: padded tile index (= tok0 / 128)
  bool tail = false;            // grouped: past padded[E]
  int64_t tail_row0 = 0;        // grouped tail: first rowwise row to zero
};

template <typename T>
__device__ __forceinline__ Tile grouped_tile(const QuantParams& p, int64_t t) {
  Tile g;
  const int E = p.num_experts;
  const int64_t row_pad = t * kTile;
  const int64_t padded_end = p.padded[E];
  g.tile_index = t;
  g.tok0 = row_pad;
  g.tokens = kTile;
  g.out_col_row0 = 0;
  if (row_pad >= padded_end) {
    g.tail = true;
    g.tail_row0 = p.offsets[E] + (row_pad - padded_end);
    return g;
  }
  const int e = find_group(p.padded, E, row_pad);
  const int64_t r0 = p.offsets[e] + (row_pad - p.padded[e]);
  g.e = e;
  g.nrows = static_cast<int>(min64(kTile, p.offsets[e + 1] - r0));
  g.src = static_cast<const char*>(p.src) + r0 * p.src_ld * static_cast<int64_t>(sizeof(T));
  g.src_ld_bytes = p.src_ld * static_cast<int64_t>(sizeof(T));
  g.out_row0 = r0;
  return g;
}

template <typename T>
__device__ __forceinline__ Tile weights_tile(const QuantParams& p, int64_t x) {
  Tile g;
  const int e = static_cast<int>(x / p.row_tiles);
  const int64_t nb = x % p.row_tiles;
  const int64_t n0 = nb * kTile;
  const char* base;
  int64_t ld;
  if (p.src_ptrs != nullptr) {
    base = static_cast<const char*>(p.src_ptrs[e]);
    ld = p.src_lds[e];
  } else {
    base = static_cast<const char*>(p.src) + e * p.src_expert_stride * static_cast<int64_t>(sizeof(T));
    ld = p.src_ld;
  }
  g.e = e;
  g.nrows = static_cast<int>(min64(kTile, p.rows - n0));
  g.src = base + n0 * ld * static_cast<int64_t>(sizeof(T));
  g.src_ld_bytes = ld * static_cast<int64_t>(sizeof(T));
  g.out_row0 = static_cast<int64_t>(e) * p.rows + n0;
  g.out_col_row0 = static_cast<int64_t>(e) * p.cols;
  g.tok0 = n0;
  g.tokens = g.nrows;
  g.tile_index = nb;
  return g;
}

/// The 16-byte granule of source row i at tile columns [v*V, v*V + V) (V = 16 / sizeof(T)),
/// zeros where rows or columns are past the tile's valid extent.
template <typename T>
__device__ __forceinline__ uint4 load_granule(const QuantParams& p, const Tile& g, int i, int v,
                                              int ncols, int64_t col0) {
  constexpr int V = 16 / sizeof(T);
  uint4 r = make_uint4(0, 0, 0, 0);
  if (i >= g.nrows || v * V >= ncols) return r;
  const char* row = g.src + i * g.src_ld_bytes;
  if (p.vec) {
    return __ldg(reinterpret_cast<const uint4*>(row + (col0 + v * V) * static_cast<int64_t>(sizeof(T))));
  }
  T tmp[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    tmp[j] = v * V + j < ncols ? reinterpret_cast<const T*>(row)[col0 + v * V + j] : T(0.0f);
  }
  memcpy(&r, tmp, 16);
  return r;
}

/// Index in the rowwise scales of grouped rows of row r's scale over column block b (of 128
/// columns, blockwise: token-major; of 32, mxfp8: row-major), as fp8_rows_scale_index.
template <Fp8Recipe R>
__device__ __forceinline__ int64_t rows_scale_index(const QuantParams& p, int64_t r, int64_t b) {
  return R == Fp8Recipe::mxfp8 ? r * p.scale_ld + b : b * p.scale_ld + r;
}

// ---------------------------------------------------------------------------------------------
// The tile kernel

/// Zeroes what a grouped tail tile owns: rowwise rows [tail_row0, tail_row0 + 128) ∩ [0, rows)
/// and data_t columns [tok0, tok0 + 128), for the tile's columns; their scales become 1.
template <Fp8Recipe R>
__device__ void zero_tail(const QuantParams& p, const Tile& g, int64_t col0, int ncols) {
  const int tid = threadIdx.x;
  if (p.data != nullptr) {
    const int64_t row_end = min64(g.tail_row0 + kTile, p.rows);
    const int nr = static_cast<int>(max64(0, row_end - g.tail_row0));
    if (p.vec) {  // ncols is a multiple of 16, rows start 16-byte aligned
      const int per_row = ncols / 16;
      for (int idx = tid; idx < nr * per_row; idx += kThreads) {
        const int64_t r = g.tail_row0 + idx / per_row;
        *reinterpret_cast<uint4*>(p.data + r * p.cols + col0 + (idx % per_row) * 16) = make_uint4(0, 0, 0, 0);
      }
    } else {
      for (int idx = tid; idx < nr * ncols; idx += kThreads) {
        const int64_t r = g.tail_row0 + idx / ncols;
        p.data[r * p.cols + col0 + idx % ncols] = 0;
      }
    }
    if (R != Fp8Recipe::tensorwise) {
      const int per_row = R == Fp8Recipe::mxfp8 ? (ncols + 31) / 32 : (ncols > 0 ? 1 : 0);
      const int64_t first = R == Fp8Recipe::mxfp8 ? col0 / 32 : col0 / kTile;
      for (int idx = tid; idx < nr * per_row; idx += kThreads) {
        const int64_t r = g.tail_row0 + idx / per_row;
        store_scale_one<R>(p.scale, rows_scale_index<R>(p, r, first + idx % per_row));
      }
    }
  }
  if (p.data_t != nullptr) {
    // 128 bytes per column (tok0 is a multiple of 128; data_t_ld too).
    for (int idx = tid; idx < ncols * 8; idx += kThreads) {
      uint8_t* d = p.data_t + (col0 + idx / 8) * p.data_t_ld + g.tok0 + (idx % 8) * 16;
      if (p.vec_t) {
        *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
      } else {
#pragma unroll
        for (int j = 0; j < 16; ++j) d[j] = 0;
      }
    }
    if (R == Fp8Recipe::blockwise) {  // [padded/128, cols] (scale_t_ld = cols): this tile's block row
      for (int idx = tid; idx < ncols; idx += kThreads) {
        store_scale_one<R>(p.scale_t, fp8_cols_scale_index(R, col0 + idx, g.tile_index, p.scale_t_ld, 0));
      }
    } else if (R == Fp8Recipe::mxfp8) {  // [cols, padded/32]: 4 blocks per column
      for (int idx = tid; idx < ncols * 4; idx += kThreads) {
        store_scale_one<R>(p.scale_t, (col0 + idx / 4) * p.scale_t_ld + g.tok0 / 32 + idx % 4);
      }
    }
  }
}

/// The default tile source: the tile's rows of T as stored (grouped rows or expert weights), the
/// column tile blockIdx.y. A source supplies the tile's values granule by granule, so that a
/// kernel producing them (an activation, fp8_quantize_activation.cu) can quantize them without
/// writing them out first: col0() is the CTA's first output column, granule(i, v) the 16 bytes of
/// row i of the tile, granule column v.
struct RowsSource {
  __device__ int64_t col0() const { return static_cast<int64_t>(blockIdx.y) * kTile; }
  template <typename T>
  __device__ uint4 granule(const QuantParams& p, const Tile& g, int i, int v, int ncols, int64_t col0) const {
    return load_granule<T>(p, g, i, v, ncols, col0);
  }
};

/// RowsSource for a tensorwise tile kernel that makes the column sums itself: with the amax given
/// (Fp8QuantizeOptions::amax) no amax pass runs to make them.
struct RowsSourceTileSums : RowsSource {};

// ---------------------------------------------------------------------------------------------
// Column sums (QuantParams::col_sums), in a fixed order: each thread sums its load slots in slot
// order, the lanes of a warp that hold the same columns are added by shuffles, then the warps'
// sums in warp order. The order depends only on the tile (the source dtype sets V), the same in
// the amax and the tile kernels, so every recipe gives the same bits.

/// Whether kernels of source Src write col_sums: grouped rows read from memory only (the
/// activation's sources and the weights compile without them).
template <class Src, bool kWeights>
constexpr bool kColumnSums =
    !kWeights && (std::is_same<Src, RowsSource>::value || std::is_same<Src, RowsSourceTileSums>::value);

/// Whether Src is the tensor as stored (RowsSource and its tile-sums variant), whose granules the
/// tile kernel loads itself, from one base pointer.
template <class Src>
constexpr bool kFromMemory = std::is_base_of<RowsSource, Src>::value;

/// Adds a 16-byte granule's values to the thread's running column sums (V of them).
template <typename T>
__device__ __forceinline__ void add_to_sums(const uint4& raw, float (&sums)[16 / sizeof(T)]) {
  float f[16 / sizeof(T)];
  granule_to_float<T>(raw, f);
#pragma unroll
  for (int j = 0; j < 16 / static_cast<int>(sizeof(T)); ++j) sums[j] += f[j];
}

/// Step 1: thread t's load slots are the rows t / NV + it · (kThreads / NV) of one granule column
/// v = t % NV, so `sums` (the slots' sums) are the columns [v·V, v·V + V) over those rows. The
/// lanes of a warp that share v are added (xor NV, ..., 16), and warp w's sums go to red[w][:].
/// The caller then syncs the CTA and calls store_column_sums.
template <typename T>
__device__ __forceinline__ void stage_column_sums(float (&sums)[16 / sizeof(T)], float (*red)[kTile]) {
  constexpr int V = 16 / sizeof(T);
  constexpr int NV = kTile / V;
  static_assert(kThreads % NV == 0 && NV % 16 == 0 && NV <= 32, "a thread's slots share one granule column");
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int d = NV; d < 32; d <<= 1) {
#pragma unroll
    for (int j = 0; j < V; ++j) sums[j] += __shfl_xor_sync(0xffffffffu, sums[j], d);
  }
  if (lane < NV) {
    float4* dst = reinterpret_cast<float4*>(red[threadIdx.x >> 5] + lane * V);
#pragma unroll
    for (int j = 0; j < V; j += 4) dst[j / 4] = make_float4(sums[j], sums[j + 1], sums[j + 2], sums[j + 3]);
  }
}

/// Step 2, after the barrier: col_sums[tile, col0 + c] = Σ_w red[w][c] in warp order, c < ncols.
__device__ __forceinline__ void store_column_sums(const QuantParams& p, const Tile& g, int64_t col0, int ncols,
                                                  const float (*red)[kTile]) {
  const int c = threadIdx.x;
  if (c >= ncols) return;
  float s = red[0][c];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) s += red[w][c];
  p.col_sums[g.tile_index * p.cols + col0 + c] = s;
}

// ---------------------------------------------------------------------------------------------
// The tile's phases (quantize_tile, at the end, calls them in turn). All are inlined into the
// kernel: each instantiation compiles to one straight body, with the recipe, the source and the
// element type as template constants, not run-time branches.

/// A thread's place in the tile. Load slot it of thread tid is granule (it * kRowsPerIt + r0, v):
/// every slot of a thread has the same granule column, and the rows advance by kRowsPerIt, a
/// divisor of the swizzle's 16 rows, so a slot's swizzle ((row / 16) % 8) is a constant of the
/// slot. Unsigned index math: the divisions are shifts (signed ones took ~20 instructions per slot).
template <typename T>
struct Slots {
  static constexpr int V = 16 / sizeof(T);              // elements per granule
  static constexpr int NV = kTile / V;                  // granules per tile row (16 or 32)
  static constexpr int kIters = kTile * NV / kThreads;  // load slots per thread
  static constexpr int kRowsPerIt = kThreads / NV;      // rows between a thread's slots
  static constexpr int kWordCols = Elem<T>::kPerWord;   // columns per 4-byte word
  static constexpr int kRowsPerSlot = 32 / NV;          // rows of one slot of a warp
  static constexpr int kWarpBlocks = kIters * kRowsPerSlot;  // rows (1x128 blocks) of a warp
  static_assert(kThreads % NV == 0 && 16 % kRowsPerIt == 0, "slots of whole rows within a swizzle period");
  static_assert(kWarpBlocks <= 32, "a lane per block");

  unsigned tid;
  int lane, warp;
  int r0, v;  // the slots' first row and granule column
  __device__ __forceinline__ Slots() {
    tid = threadIdx.x;
    lane = static_cast<int>(tid & 31u);
    warp = static_cast<int>(tid >> 5);
    r0 = static_cast<int>(tid / NV);
    v = static_cast<int>(tid % NV);
  }
};

/// (1) The thread's load slots of the tile's columns [col0, col0 + ncols): loaded by the kernel
/// from the tensor as stored, or computed by the source.
template <typename T, class Src, int kIters>
__device__ __forceinline__ void load_slots(const QuantParams& p, const Tile& g, int64_t col0, int ncols,
                                           const Src& src, Slots<T> t, uint4 (&raw)[kIters]) {
  using S = Slots<T>;
  if constexpr (kFromMemory<Src>) {
    if (p.vec) {  // 16-byte loads from one base pointer and row step (one test of p.vec per tile)
      const char* ptr = g.src + t.r0 * g.src_ld_bytes + (col0 + t.v * S::V) * static_cast<int64_t>(sizeof(T));
      const int64_t step = S::kRowsPerIt * g.src_ld_bytes;
      // Slots it < my_slots hold rows of the tile (none where the granule column is past ncols).
      const int my_slots = t.v * S::V < ncols ? (g.nrows - t.r0 + S::kRowsPerIt - 1) / S::kRowsPerIt : 0;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        raw[it] = it < my_slots ? __ldg(reinterpret_cast<const uint4*>(ptr)) : make_uint4(0, 0, 0, 0);
        ptr += step;
      }
    } else {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        raw[it] = load_granule<T>(p, g, it * S::kRowsPerIt + t.r0, t.v, ncols, col0);
      }
    }
  } else {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      raw[it] = src.template granule<T>(p, g, it * S::kRowsPerIt + t.r0, t.v, ncols, col0);
    }
  }
}

/// The slots into the shared tile ([128][NV] granules, XOR-swizzled by (row / 16) % 8), for the
/// columnwise phase.
template <typename T, int kIters>
__device__ __forceinline__ void store_swizzled(const uint4 (&raw)[kIters], Slots<T> t, uint4* smem_tile) {
  using S = Slots<T>;
  uint4* const row0 = smem_tile + t.r0 * S::NV;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    row0[it * S::kRowsPerIt * S::NV + (t.v ^ (((it * S::kRowsPerIt) >> 4) & 7))] = raw[it];
  }
}

/// The slots' column sums, staged in red (stage_column_sums; store_column_sums after the barrier).
template <typename T, int kIters>
__device__ __forceinline__ void stage_slot_sums(const uint4 (&raw)[kIters], float (*red)[kTile]) {
  float sums[Slots<T>::V] = {};
#pragma unroll
  for (int it = 0; it < kIters; ++it) add_to_sums<T>(raw[it], sums);
  stage_column_sums<T>(sums, red);
}

/// Before the CTA's barrier, the amax of a tile with one scale: tensorwise, the expert's (the amax
/// pass's, or the caller's); weights blockwise, each warp's part of the tile's, into warp_amax.
template <typename T, Fp8Recipe R, bool kWeights, int kIters>
__device__ __forceinline__ float tile_amax_partial(const QuantParams& p, const Tile& g, const uint4 (&raw)[kIters],
                                                   Slots<T> t, float* warp_amax) {
  float tensor_amax = 0.0f;
  if (R == Fp8Recipe::tensorwise) {
    tensor_amax = __uint_as_float(p.amax_bits[g.e]);
  } else if (R == Fp8Recipe::blockwise && kWeights) {
    uint32_t m = 0;
#pragma unroll
    for (int it = 0; it < kIters; ++it) m = max(m, granule_amax_bits<T>(raw[it]));
    m = warp_max_bits(m, 32);
    if (t.lane == 0) warp_amax[t.warp] = Elem<T>::from_bits(m);
  }
  return tensor_amax;
}

/// After the barrier, the one scale of the whole tile (tensorwise; weights blockwise, whose
/// scale_inv thread 0 stores in both copies' scales). Other recipes start from it and replace it.
template <Fp8Recipe R, bool kWeights>
__device__ __forceinline__ BlockScale tile_scale(const QuantParams& p, const Tile& g, float tensor_amax,
                                                 const float* warp_amax, int64_t col_tile, unsigned tid) {
  if (R == Fp8Recipe::blockwise && kWeights) {
#pragma unroll
    for (int w = 0; w < kWarps; ++w) tensor_amax = fmaxf(tensor_amax, warp_amax[w]);
  }
  const BlockScale s = block_scale<R>(tensor_amax, p);
  if (R == Fp8Recipe::blockwise && kWeights && tid == 0) {
    const int64_t nbk = (p.cols + kTile - 1) / kTile;
    const int64_t nb = g.tile_index, kb = col_tile;
    if (p.scale != nullptr) store_scale<R>(p.scale, (g.e * p.row_tiles + nb) * nbk + kb, s);
    if (p.scale_t != nullptr) store_scale<R>(p.scale_t, (g.e * nbk + kb) * p.row_tiles + nb, s);
  }
  return s;
}

/// (2) Rowwise, 1x128 blocks of 16-bit sources: the amax of each of the warp's blocks into
/// blocks[] (its rows: kRowsPerSlot per slot). Slots 2q and 2q+1 share word q, (slot 2q's amax
/// bits, slot 2q+1's), folded from their packed maxima by two byte permutes and one max; one test
/// of all the words for a value that is not finite (then every slot is taken again by
/// granule_amax_bits, whose values these are otherwise), and one shuffle per word.
template <typename T, int kIters>
__device__ __forceinline__ void row_block_amax_pairs(const uint4 (&raw)[kIters], Slots<T> t, float* blocks) {
  using S = Slots<T>;
  static_assert(kIters % 2 == 0, "slots in pairs");
  uint32_t wv[kIters / 2];
  uint32_t any = 0;
#pragma unroll
  for (int q = 0; q < kIters / 2; ++q) {
    const uint32_t a = granule_abs_bits_packed<T>(raw[2 * q]);
    const uint32_t b = granule_abs_bits_packed<T>(raw[2 * q + 1]);
    wv[q] = __vmaxu2(__byte_perm(a, b, 0x5410), __byte_perm(a, b, 0x7632));
    any = __vmaxu2(any, wv[q]);
  }
  if (any_half_not_finite<T>(any)) {
#pragma unroll
    for (int q = 0; q < kIters / 2; ++q) {
      wv[q] = granule_amax_bits<T>(raw[2 * q]) | (granule_amax_bits<T>(raw[2 * q + 1]) << 16);
    }
  }
#pragma unroll
  for (int q = 0; q < kIters / 2; ++q) {
    wv[q] = warp_max_u16x2(wv[q], S::NV);  // over the lanes holding the row
  }
  if (t.lane % S::NV == 0) {
#pragma unroll
    for (int q = 0; q < kIters / 2; ++q) {
      blocks[2 * q * S::kRowsPerSlot + t.lane / S::NV] = Elem<T>::from_bits(wv[q] & 0xffffu);
      blocks[(2 * q + 1) * S::kRowsPerSlot + t.lane / S::NV] = Elem<T>::from_bits(wv[q] >> 16);
    }
  }
}

/// The same for f32 sources: one slot's amax per shuffled word.
template <typename T, int kIters>
__device__ __forceinline__ void row_block_amax_words(const uint4 (&raw)[kIters], Slots<T> t, float* blocks) {
  using S = Slots<T>;
  constexpr int kStep = Elem<T>::kPerWord;  // slots per shuffled word
#pragma unroll
  for (int it = 0; it < kIters; it += kStep) {
    uint32_t ab[kStep];
#pragma unroll
    for (int q = 0; q < kStep; ++q) ab[q] = granule_amax_bits<T>(raw[it + q]);
    warp_max_bits<T>(ab, S::NV);  // over the lanes holding the row
    if (t.lane % S::NV == 0) {
#pragma unroll
      for (int q = 0; q < kStep; ++q) blocks[(it + q) * S::kRowsPerSlot + t.lane / S::NV] = Elem<T>::from_bits(ab[q]);
    }
  }
}

/// Lane b of the warp computes block b's scale from its amax in blocks[b] (the IEEE division and
/// reciprocal once per block, not once per lane of its row), stores scale_inv and leaves the
/// multiplier in blocks[b].
template <typename T, Fp8Recipe R>
__device__ __forceinline__ void row_block_scales(const QuantParams& p, const Tile& g, Slots<T> t,
                                                 int64_t col_tile, float* blocks) {
  using S = Slots<T>;
  __syncwarp();
  if (t.lane < S::kWarpBlocks) {
    const int i = (t.lane / S::kRowsPerSlot * kThreads + t.warp * 32 + (t.lane % S::kRowsPerSlot) * S::NV) / S::NV;
    const BlockScale s = block_scale<R>(blocks[t.lane], p);
    blocks[t.lane] = s.mult;
    if (i < g.nrows) store_scale<R>(p.scale, rows_scale_index<R>(p, g.out_row0 + i, col_tile), s);
  }
  __syncwarp();
}

/// Quantizes the slots with their rows' scales and stores them (and mxfp8's 1x32 scales). A row's
/// scale: grouped blockwise, its 1x128 block's multiplier from `blocks`; mxfp8, of the 1x32 block
/// over the lanes holding it; otherwise the tile's.
template <typename T, Fp8Recipe R, bool kWeights, bool kE5m2, int kIters>
__device__ __forceinline__ void store_rows(const QuantParams& p, const Tile& g, int64_t col0, int ncols,
                                           const uint4 (&raw)[kIters], Slots<T> t,
                                           const BlockScale& tile_scale, const float* blocks) {
  using S = Slots<T>;
  constexpr int V = S::V;
  constexpr bool kRowBlocks = R == Fp8Recipe::blockwise && !kWeights;
  // The thread's output granule of slot 0; slot it is kRowsPerIt rows further.
  uint8_t* out = p.data + (g.out_row0 + t.r0) * p.cols + col0 + t.v * V;  // advanced by a slot's rows
  const int64_t out_step = S::kRowsPerIt * p.cols;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = it * S::kRowsPerIt + t.r0;
    BlockScale s = tile_scale;
    if constexpr (kRowBlocks) {
      s.mult = blocks[it * S::kRowsPerSlot + t.lane / S::NV];
    } else if constexpr (R == Fp8Recipe::mxfp8) {  // (before the branch: every lane shuffles)
      s = block_scale<R>(Elem<T>::from_bits(warp_max_bits(granule_amax_bits<T>(raw[it]), 32 / V)), p);
    }
    if (it > 0) out += out_step;
    const bool valid = i < g.nrows && t.v * V < ncols;
    if (!valid) continue;
    float f[V];
    granule_to_float<T>(raw[it], f);
    const int64_t orow = g.out_row0 + i;
    uint32_t packed[V / 4];
#pragma unroll
    for (int j = 0; j < V; j += 4) {
      const uint32_t lo = cvt_pair<kE5m2>(__fmul_rn(f[j], s.mult), __fmul_rn(f[j + 1], s.mult));
      const uint32_t hi = cvt_pair<kE5m2>(__fmul_rn(f[j + 2], s.mult), __fmul_rn(f[j + 3], s.mult));
      packed[j / 4] = lo | (hi << 16);
    }
    if (p.vec) {
      if constexpr (V == 8) {
        *reinterpret_cast<uint2*>(out) = make_uint2(packed[0], packed[1]);
      } else {
        *reinterpret_cast<uint32_t*>(out) = packed[0];
      }
    } else {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        if (t.v * V + j < ncols) out[j] = static_cast<uint8_t>(packed[j / 4] >> (8 * (j % 4)));
      }
    }
    if (R == Fp8Recipe::mxfp8 && (t.v % (32 / V)) == 0) {
      store_scale<R>(p.scale, rows_scale_index<R>(p, orow, (col0 + t.v * V) / 32), s);
    }
  }
}

/// (3) Columnwise, granule column m of the shared tile: the lane's word of each of its 16 tokens
/// [16k, 16k + 16) (word wsub of the granule: kWordCols columns), as floats f[column][token], and
/// their amax bits, packed per column (16-bit halves). The swizzle makes these reads conflict-free.
template <typename T, int kWordCols>
__device__ __forceinline__ uint32_t load_column_words(const uint32_t* tile_words, int m, int k, int wsub,
                                                      float (&f)[kWordCols][16]) {
  constexpr int NV = Slots<T>::NV;
  uint32_t amax_word = 0;
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    const int row = 16 * k + j;  // (row >> 4) & 7 == k
    const uint32_t word = tile_words[(row * NV + (m ^ k)) * 4 + wsub];
    amax_word = abs_bits_max<T>(amax_word, word);
    const float2 w = Elem<T>::word(word);
    f[0][j] = w.x;
    if constexpr (kWordCols == 2) f[1][j] = w.y;
  }
  return amax_word;
}

/// The amax bits of the lane's columns over their 128x1 (mxfp8: 32x1) blocks: the lane's 16
/// tokens, then the 8 (2) lanes holding a column block, by shuffles.
template <typename T, Fp8Recipe R, int kWordCols>
__device__ __forceinline__ void column_block_amax(uint32_t amax_word, const float (&f)[kWordCols][16],
                                                  uint32_t (&ab)[kWordCols]) {
  constexpr int kLanes = R == Fp8Recipe::mxfp8 ? 2 : 8;
  if constexpr (kWordCols == 2) {
    // The packed word is what warp_max_bits would shuffle: one test for both columns.
    uint32_t w = amax_word;
    if (any_half_not_finite<T>(w)) {
      const uint32_t lo = (w & 0xffffu) >= Elem<T>::kInfBits ? finite_amax_bits<T>(f[0]) : w & 0xffffu;
      const uint32_t hi = (w >> 16) >= Elem<T>::kInfBits ? finite_amax_bits<T>(f[1]) : w >> 16;
      w = lo | (hi << 16);
    }
    w = warp_max_u16x2(w, kLanes);
    ab[0] = w & 0xffffu;
    ab[1] = w >> 16;
  } else {
    ab[0] = amax_word;
    if (ab[0] >= Elem<T>::kInfBits) ab[0] = finite_amax_bits<T>(f[0]);
    warp_max_bits<T>(ab, kLanes);
  }
}

/// The scales of the lane's columns in granule column m (token chunk k, word wsub): the tile's
/// (tensorwise, weights blockwise), or their blocks'. Blockwise: one block scale per lane, lane k < kWordCols of the 8
/// holding a column pair computes column k's, stores its scale_inv, and the others take its
/// multiplier. mxfp8: every lane computes its blocks' (their scales are stored with the data).
template <typename T, Fp8Recipe R, bool kWeights, int kWordCols>
__device__ __forceinline__ void column_scales(const QuantParams& p, const Tile& g, int64_t col0, int ncols, int m,
                                              int lane, int k, int wsub, uint32_t amax_word,
                                              const float (&f)[kWordCols][16], const BlockScale& tile_scale,
                                              BlockScale (&s)[kWordCols]) {
  constexpr int V = Slots<T>::V;
#pragma unroll
  for (int wc = 0; wc < kWordCols; ++wc) s[wc] = tile_scale;
  if constexpr (R != Fp8Recipe::tensorwise && !(R == Fp8Recipe::blockwise && kWeights)) {
    uint32_t ab[kWordCols];  // the lane's columns' amax bits
    column_block_amax<T, R>(amax_word, f, ab);
    if constexpr (R == Fp8Recipe::mxfp8) {
#pragma unroll
      for (int wc = 0; wc < kWordCols; ++wc) s[wc] = block_scale<R>(Elem<T>::from_bits(ab[wc]), p);
    } else {
      // (A select, not ab[mine]: a run-time index put ab in local memory.)
      const uint32_t ab_mine = kWordCols == 2 && k == 1 ? ab[kWordCols - 1] : ab[0];
      const BlockScale own = block_scale<R>(Elem<T>::from_bits(ab_mine), p);
      const int c = m * V + wsub * kWordCols + k;
      if (k < kWordCols && c < ncols) {
        store_scale<R>(p.scale_t, fp8_cols_scale_index(R, g.out_col_row0 + col0 + c, g.tile_index, p.scale_t_ld, 0),
                       own);
      }
#pragma unroll
      for (int wc = 0; wc < kWordCols; ++wc) s[wc].mult = __shfl_sync(0xffffffffu, own.mult, (lane & ~7) + wc);
    }
  }
}

/// Quantizes the lane's 16 tokens of column wc and stores them: 16 fp8 bytes of the transposed
/// row at out, where 8 lanes write one 128-byte segment of data_t (coalesced); mxfp8 also its
/// 32x1 block's scale.
template <Fp8Recipe R, bool kE5m2>
__device__ __forceinline__ void store_column(const QuantParams& p, const Tile& g, const float (&f)[16],
                                             const BlockScale& s, int k, int64_t orow, uint8_t* out) {
  uint32_t packed[4];
#pragma unroll
  for (int j = 0; j < 16; j += 4) {
    const uint32_t lo = cvt_pair<kE5m2>(__fmul_rn(f[j], s.mult), __fmul_rn(f[j + 1], s.mult));
    const uint32_t hi = cvt_pair<kE5m2>(__fmul_rn(f[j + 2], s.mult), __fmul_rn(f[j + 3], s.mult));
    packed[j / 4] = lo | (hi << 16);
  }
  if (p.vec_t && 16 * k + 16 <= g.tokens) {
    *reinterpret_cast<uint4*>(out) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
  } else {
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      if (16 * k + j < g.tokens) out[j] = static_cast<uint8_t>(packed[j / 4] >> (8 * (j % 4)));
    }
  }
  if (R == Fp8Recipe::mxfp8 && (k & 1) == 0 && 16 * k < g.tokens) {
    store_scale<R>(p.scale_t, orow * p.scale_t_ld + (g.tok0 + 16 * k) / 32, s);
  }
}

/// (3) Columnwise: each warp takes granule columns m = warp, warp + 8, ... of the shared tile;
/// each lane a word (kWordCols columns) of 16 consecutive tokens of one.
template <typename T, Fp8Recipe R, bool kWeights, bool kE5m2>
__device__ __forceinline__ void quantize_columns(const QuantParams& p, const Tile& g, int64_t col0, int ncols,
                                                 const uint4* smem_tile, Slots<T> t,
                                                 const BlockScale& tile_scale) {
  using S = Slots<T>;
  constexpr int V = S::V;
  constexpr int kWordCols = S::kWordCols;
  const int k = t.lane & 7;      // token chunk: tokens [16k, 16k + 16)
  const int wsub = t.lane >> 3;  // word within the granule
  const uint32_t* tile_words = reinterpret_cast<const uint32_t*>(smem_tile);
  // data_t row of the lane's first column (tile column wsub * kWordCols), at its 16 tokens.
  uint8_t* const out_t0 =
      p.data_t + (g.out_col_row0 + col0 + wsub * kWordCols) * p.data_t_ld + g.tok0 + 16 * k;
  for (int m = t.warp; m < S::NV; m += kWarps) {
    // Words of granule m: columns [m*V + wsub*kWordCols, + kWordCols).
    float f[kWordCols][16];
    const uint32_t amax_word = load_column_words<T>(tile_words, m, k, wsub, f);
    BlockScale s[kWordCols];
    column_scales<T, R, kWeights>(p, g, col0, ncols, m, t.lane, k, wsub, amax_word, f, tile_scale, s);
#pragma unroll
    for (int wc = 0; wc < kWordCols; ++wc) {
      const int c = m * V + wsub * kWordCols + wc;  // tile column
      if (c >= ncols) continue;
      const int64_t orow = g.out_col_row0 + col0 + c;  // data_t row
      store_column<R, kE5m2>(p, g, f[wc], s[wc], k, orow, out_t0 + static_cast<int64_t>(m * V + wc) * p.data_t_ld);
    }
  }
}

/// Quantizes the tile's columns [col0, col0 + ncols) (ncols > 0, g.nrows > 0): (1) load, (2)
/// rowwise, (3) columnwise (the file comment). kWeights: expert weights (blockwise = one 128x128
/// block per tile) instead of grouped rows (blockwise = 1x128 and 128x1 blocks).
template <typename T, Fp8Recipe R, bool kWeights, bool kE5m2, class Src>
__device__ __forceinline__ void quantize_tile(const QuantParams& p, const Tile& g, int64_t col0, int ncols,
                                              const Src& src) {
  using S = Slots<T>;
  constexpr int kIters = S::kIters;
  // Column sums here unless tensorwise (its amax pass makes them, unless the amax was given).
  constexpr bool kSums =
      kColumnSums<Src, kWeights> && (R != Fp8Recipe::tensorwise || std::is_same<Src, RowsSourceTileSums>::value);
  constexpr bool kRowBlocks = R == Fp8Recipe::blockwise && !kWeights;  // 1x128 (and 128x1) blocks
  extern __shared__ uint4 smem_tile[];  // [128][NV] granules, swizzled
  __shared__ float warp_amax[kWarps];
  __shared__ __align__(16) float col_red[kSums ? kWarps : 1][kTile];
  __shared__ float row_blocks[kRowBlocks ? kWarps : 1][S::kWarpBlocks];  // amax in, multiplier out
  const S t;
  const int64_t col_tile = static_cast<int64_t>(static_cast<uint64_t>(col0) / kTile);
  const bool do_cols = p.data_t != nullptr;

  uint4 raw[kIters];
  load_slots<T>(p, g, col0, ncols, src, t, raw);
  if (do_cols) store_swizzled<T>(raw, t, smem_tile);
  if constexpr (kSums) {
    if (p.col_sums != nullptr) stage_slot_sums<T>(raw, col_red);
  }
  const float tensor_amax = tile_amax_partial<T, R, kWeights>(p, g, raw, t, warp_amax);
  __syncthreads();
  if constexpr (kSums) {
    if (p.col_sums != nullptr) store_column_sums(p, g, col0, ncols, col_red);
  }
  const BlockScale scale = tile_scale<R, kWeights>(p, g, tensor_amax, warp_amax, col_tile, t.tid);

  if (p.data != nullptr) {
    float* const blocks = row_blocks[kRowBlocks ? t.warp : 0];  // the warp's rows
    if constexpr (kRowBlocks) {
      if constexpr (Elem<T>::kPerWord == 2) {
        row_block_amax_pairs<T>(raw, t, blocks);
      } else {
        row_block_amax_words<T>(raw, t, blocks);
      }
      row_block_scales<T, R>(p, g, t, col_tile, blocks);
    }
    store_rows<T, R, kWeights, kE5m2>(p, g, col0, ncols, raw, t, scale, blocks);
  }
  if (do_cols) quantize_columns<T, R, kWeights, kE5m2>(p, g, col0, ncols, smem_tile, t, scale);
}

/// One CTA: one 128-row tile (blockIdx.x) and one column tile of it (blockIdx.y, src.col0()).
/// __launch_bounds__ names no minimum of CTAs per SM: a minimum of 1 lets ptxas take many more
/// registers for the columnwise kernels, which then run slower at a fraction of the warp slots;
/// minimums of 3-5 make them spill. kE5m2: the output format (p.e5m2).
template <typename T, Fp8Recipe R, bool kWeights, bool kE5m2, class Src = RowsSource>
__global__ void __launch_bounds__(kThreads)
    quantize_tile_kernel(const QuantParams p, const Src src) {
  // Tensorwise: one CTA writes every expert's scale (also for experts without a tile).
  if (R == Fp8Recipe::tensorwise && blockIdx.x == 0 && blockIdx.y == 0) {
    for (int e = threadIdx.x; e < p.num_experts; e += kThreads) {
      const BlockScale s = block_scale<R>(__uint_as_float(p.amax_bits[e]), p);
      if (p.scale != nullptr) static_cast<float*>(p.scale)[e] = s.inv;
      if (p.scale_t != nullptr) static_cast<float*>(p.scale_t)[e] = s.inv;
    }
  }
  const Tile g = kWeights ? weights_tile<T>(p, blockIdx.x) : grouped_tile<T>(p, blockIdx.x);
  const int64_t col0 = src.col0();
  const int ncols = static_cast<int>(max64(0, min64(kTile, p.cols - col0)));
  if (!kWeights && g.tail) {
    zero_tail<R>(p, g, col0, ncols);
  } else if (ncols > 0 && g.nrows > 0) {  // (not: empty matrices; CTA-uniform)
    quantize_tile<T, R, kWeights, kE5m2>(p, g, col0, ncols, src);
  }
}

/// Tensorwise, pass 1: amax_bits[e] = max over expert e's elements (finite values) as f32 bits;
/// atomicMax on the bits of non-negative floats is order-independent, so deterministic.
/// amax_bits must be zeroed before. Grouped rows from memory: also the column sums (col_sums).
template <typename T, bool kWeights, class Src = RowsSource>
__global__ void __launch_bounds__(kThreads) amax_tile_kernel(const QuantParams p, uint32_t* amax_bits, const Src src) {
  __shared__ float warp_amax[kWarps];
  constexpr bool kSums = kColumnSums<Src, kWeights>;
  __shared__ __align__(16) float col_red[kSums ? kWarps : 1][kTile];
  constexpr int V = 16 / sizeof(T);
  constexpr int NV = kTile / V;
  constexpr int kIters = kTile * NV / kThreads;
  const Tile g = kWeights ? weights_tile<T>(p, blockIdx.x) : grouped_tile<T>(p, blockIdx.x);
  if (g.tail || g.nrows == 0) return;
  uint32_t m = 0;  // amax bits
  [[maybe_unused]] float sums[V] = {};  // kSums: this thread's column sums
  const int64_t col0 = src.col0();
  const int ncols = static_cast<int>(max64(0, min64(kTile, p.cols - col0)));
  if (ncols > 0) {
#pragma unroll
    for (int it = 0; it < kIters; ++it) {
      const int idx = it * kThreads + threadIdx.x;
      const uint4 raw = src.template granule<T>(p, g, idx / NV, idx % NV, ncols, col0);
      m = max(m, granule_amax_bits<T>(raw));
      if constexpr (kSums) add_to_sums<T>(raw, sums);
    }
  }
  m = warp_max_bits(m, 32);
  if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = Elem<T>::from_bits(m);
  if constexpr (kSums) {
    if (p.col_sums != nullptr) stage_column_sums<T>(sums, col_red);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t = fmaxf(t, warp_amax[w]);
    if (t > 0.0f) atomicMax(&amax_bits[g.e], __float_as_uint(t));
  }
  if constexpr (kSums) {
    if (p.col_sums != nullptr) store_column_sums(p, g, col0, ncols, col_red);
  }
}

/// Dynamic shared memory of the tile kernel: the swizzled source tile when columnwise.
template <typename T>
constexpr int tile_smem_bytes() {
  return kTile * kTile * static_cast<int>(sizeof(T));
}

// ---------------------------------------------------------------------------------------------
// Host side, shared by quantize_grouped and quantize_weights.

/// f32 scales must be 4-byte aligned (checked before anything is launched).
template <class Q>
void check_scales_aligned(const Q& q, const Fp8QuantizeOptions& o) {
  if (o.recipe == Fp8Recipe::mxfp8) return;
  GMOE_CHECK(q.scale_inv.data == nullptr || aligned(q.scale_inv.data, 4),
             "out.scale_inv: f32 scales must be 4-byte aligned");
  GMOE_CHECK(q.scale_inv_t.data == nullptr || aligned(q.scale_inv_t.data, 4),
             "out.scale_inv_t: f32 scales must be 4-byte aligned");
}

/// The output fields of p that both launches set alike: the copies' data and scales (tensorwise:
/// the columnwise scales only when they are a separate array), and the quantization rule.
/// scale_ld / scale_t_ld stay the caller's.
template <class Q>
void set_outputs(QuantParams& p, const Q& q, const Fp8QuantizeOptions& o) {
  p.data = static_cast<uint8_t*>(q.data.data);
  p.scale = q.scale_inv.data;
  p.data_t = static_cast<uint8_t*>(q.data_t.data);
  p.scale_t = (o.recipe == Fp8Recipe::tensorwise && q.scale_inv_t.data == q.scale_inv.data) ? nullptr
                                                                                          : q.scale_inv_t.data;
  p.e5m2 = o.format == DType::e5m2;
  p.fp8_max = p.e5m2 ? fp8_rules::kE5m2Max : fp8_rules::kE4m3Max;
  p.emax = p.e5m2 ? fp8_rules::kE5m2Emax : fp8_rules::kE4m3Emax;
  p.pow2 = o.pow2_scales;
}

template <typename T, Fp8Recipe R, bool kWeights, class Src>
void launch_tile(const QuantParams& p, dim3 grid, const Src& src, cudaStream_t stream) {
  const int smem = p.data_t != nullptr ? tile_smem_bytes<T>() : 0;
  auto kernel = p.e5m2 ? quantize_tile_kernel<T, R, kWeights, true, Src>
                       : quantize_tile_kernel<T, R, kWeights, false, Src>;
  GMOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p, src);
  GMOE_CUDA_CHECK(cudaGetLastError());
}

/// The quantization of recipe r from `src` (tensorwise: amax first, into `amax`, [E] u32 of scratch).
template <typename T, bool kWeights, class Src = RowsSource>
void launch_typed(Fp8Recipe r, const QuantParams& p, dim3 grid, uint32_t* amax, cudaStream_t stream,
                  const Src& src = Src()) {
  switch (r) {
    case Fp8Recipe::tensorwise:
      if (p.amax_given) {  // no amax pass: the tile kernel makes the column sums
        if constexpr (!kWeights && std::is_same<Src, RowsSource>::value) {
          if (p.col_sums != nullptr) {
            launch_tile<T, Fp8Recipe::tensorwise, false>(p, grid, RowsSourceTileSums{}, stream);
            return;
          }
        }
        launch_tile<T, Fp8Recipe::tensorwise, kWeights>(p, grid, src, stream);
        return;
      }
      GMOE_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(uint32_t) * p.num_experts, stream));
      amax_tile_kernel<T, kWeights, Src><<<grid, kThreads, 0, stream>>>(p, amax, src);
      GMOE_CUDA_CHECK(cudaGetLastError());
      launch_tile<T, Fp8Recipe::tensorwise, kWeights>(p, grid, src, stream);  // (col_sums: done above)
      return;
    case Fp8Recipe::blockwise: launch_tile<T, Fp8Recipe::blockwise, kWeights>(p, grid, src, stream); return;
    case Fp8Recipe::mxfp8: launch_tile<T, Fp8Recipe::mxfp8, kWeights>(p, grid, src, stream); return;
  }
}

/// Grouped rows [cap, cols] split by `counts` into q (gmoe/fp8.h's layout): every parameter but the
/// source's (src, src_ld, vec), after launching the offsets into `scratch` (which also holds the
/// tensorwise amax, p.amax_bits); `grid` gets the tile grid. fp8_quantize_grouped.cu.
QuantParams grouped_params(const TensorView& counts, int64_t cap, int64_t cols, const Fp8QuantizeOptions& o,
                           const Fp8Grouped& q, Buffer& scratch, Allocator& alloc, Stream stream, dim3& grid);

/// The quantization kernels (tensorwise: amax first, into `amax`, [E] u32 of scratch) for a
/// source of dtype `src` (bf16, f16, f32); `op` names the call in errors.
template <bool kWeights>
void launch_quantize(DType src, Fp8Recipe r, const QuantParams& p, dim3 grid, uint32_t* amax, cudaStream_t stream,
                     const char* op) {
  switch (src) {
    case DType::bf16: launch_typed<__nv_bfloat16, kWeights>(r, p, grid, amax, stream); return;
    case DType::f16: launch_typed<__half, kWeights>(r, p, grid, amax, stream); return;
    case DType::f32: launch_typed<float, kWeights>(r, p, grid, amax, stream); return;
    default: GMOE_FAIL(op, ": source dtype ", dtype_name(src), " not supported");
  }
}

}  // namespace gmoe::cuda_backend::fp8
