// src/cuda/fp8_gemm/fp8_grouped_gemm.cu — the CUDA backend's FP8 grouped GEMM entry points (fprop, dgrad,
// wgrad) for the blockwise, tensorwise and MXFP8 recipes of gmoe/fp8.h.
//
// blockwise / tensorwise: the same life cycle as the 16-bit grouped GEMM (grouped_gemm.cu): check
// what is CUDA-specific and throw before any launch; take one workspace from the caller's
// allocator on the stream; then enqueue, without a sync:
//   1. prepare (grouped_gemm_prepare.cu, one block): counts -> clamped offsets -> per-expert
//      shapes, operand pointers and strides, and for FP8 the per-expert scale pointers (blockwise)
//      or alpha_e = s_a[e]·s_b[e] (tensorwise); wgrad locates each expert's tokens in the
//      columnwise copies through their padded_offsets;
//   2. for a list of dW tensors, their pointers, passed by value in kernel parameters;
//   3. zeros where the GEMM writes nothing (rows past the total; dW of empty experts);
//   4. the CUTLASS FP8 grouped GEMM (sm90_fp8_grouped_gemm.cuh): the instantiation of
//      fp8_grouped_gemm_instances.def that the heuristics choose (fp8_gemm_heuristics.cu).
// All three passes are one "TN" GEMM with K-major FP8 operands (see fp8_grouped_gemm_kernels.h).
//
// mxfp8: Hopper cannot scale 32-wide blocks inside its FP8 tensor-core path, so every operand is
// dequantized to bf16 (exactly: an e4m3/e5m2 value times a power of two fits bf16) by the kernels
// below, and the bf16 grouped GEMM runs on the result:
//   fprop  dequant(x.data), dequant(w.data) [E, N, K]      -> bf16 fprop
//   dgrad  dequant(dy.data), dequant(w.data_t) [E, K, N]  -> bf16 fprop with W'_e = W_eᵀ
//   wgrad  dequant(dy.data_t)ᵀ [padded, N], dequant(x.data_t)ᵀ [padded, K] -> bf16 wgrad whose
//          counts are the padded per-expert token counts (the padding is zero, so the extra terms
//          are exact zeros)
// This costs the dequantization traffic (the weights on every call) on top of a bf16 GEMM.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/backend.h"
#include "common/fp8_rules.h"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/fp8_gemm/fp8_gemm_heuristics.h"
#include "cuda/fp8_gemm/fp8_grouped_gemm_kernels.h"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {

// ---------------------------------------------------------------------------------------------
// The compiled instantiations: one entry per line of fp8_grouped_gemm_instances.def.

namespace {
template <Fp8Scaling S, Fp8Operands Ops, DType Out, Fp8Epilogue Epi, DType A, Fp8Tile Tile>
Fp8Kernel fp8_kernel() {
  using K = Fp8GroupedGemmKernel<S, Ops, Out, Epi == Fp8Epilogue::bias, A, Tile>;
  return {{S, Ops, Out, Epi, A, Tile}, &K::workspace_bytes, &K::run};
}

const Fp8Kernel kFp8Kernels[] = {
#define GMOE_FP8_GEMM(file, S, OPS, OUT, EPI, A, TILE) \
  fp8_kernel<Fp8Scaling::S, Fp8Operands::OPS, DType::OUT, Fp8Epilogue::EPI, DType::A, Fp8Tile::TILE>(),
#include "cuda/fp8_gemm/fp8_grouped_gemm_instances.def"
#undef GMOE_FP8_GEMM
};
}  // namespace

const Fp8Kernel* find_fp8_kernel(const Fp8KernelKey& key) {
  for (const Fp8Kernel& k : kFp8Kernels) {
    if (k.key == key) return &k;
  }
  return nullptr;
}

namespace {

// ---------------------------------------------------------------------------------------------
// CUDA-specific argument checks (the public edge has checked the layouts, shapes and devices).

void check_aligned(const void* p, std::size_t bytes, const char* name) {
  GMOE_CHECK(aligned(p, bytes), name, ": the CUDA backend needs ",
             bytes, "-byte aligned data, got address ", p);
}

void check_extent(int64_t v, const char* name, const char* what) {
  GMOE_CHECK(v <= INT32_MAX, name, ": ", what, " of ", v,
             " exceeds the 32-bit extents of the CUDA grouped GEMM");
}

// Whether every expert's bias vector is contiguous and starts at a multiple of `bytes`.
bool bias_rows_aligned(const ExpertBias& bias, int64_t bytes) {
  if (bias.is_grouped()) {
    const TensorView& b = bias.grouped;
    return b.stride(1) == 1 && aligned(b.data, bytes) &&
           (b.size(0) <= 1 || (b.stride(0) * static_cast<int64_t>(dtype_size(b.dtype))) % bytes == 0);
  }
  for (const TensorView& v : bias.list) {
    if (!aligned(v.data, bytes) || (v.size(0) > 1 && v.stride(0) != 1)) return false;
  }
  return true;
}

// FP8 rows are read by TMA in 16-byte units: both GEMM extents of the layer (its K and N) must be
// multiples of 16 elements. (y/dx rows of N or K bf16 are then 16-byte multiples too.)
void check_dim16(int64_t v, const char* name, const char* what) {
  GMOE_CHECK(v % 16 == 0, name, ": ", what, " = ", v,
             " is not a multiple of 16; the CUDA FP8 GEMM reads FP8 rows with TMA in 16-byte "
             "units (pad the layer's dimensions to multiples of 16)");
}

// Operand roles: A (x in fprop, dy in dgrad and wgrad) may be e4m3 or e5m2 for blockwise and
// tensorwise; B (the weights, and x in wgrad) must be e4m3, the only B these kernels are compiled
// for. mxfp8 dequantizes both to bf16 and takes either format anywhere.
// (The public edge has already checked that every format is e4m3 or e5m2.)
void check_format_cuda(Fp8Recipe recipe, DType format, bool operand_a, const char* name) {
  GMOE_CHECK(recipe == Fp8Recipe::mxfp8 || format == DType::e4m3 || operand_a, name, ".format: the CUDA ",
             fp8_recipe_name(recipe), " FP8 GEMM takes e4m3 here (e5m2 only as the activations of fprop or the "
             "gradient dy), got ", dtype_name(format));
}

void check_grouped_cuda(const Fp8Grouped& q, bool columnwise, bool operand_a, const char* name) {
  check_format_cuda(q.recipe, q.format, operand_a, name);
  check_extent(q.capacity, name, "capacity");
  check_extent(q.cols, name, "column count");
  if (columnwise) {
    check_extent(q.padded_capacity, name, "padded capacity");
    check_aligned(q.data_t.data, 16, name);
    check_aligned(q.scale_inv_t.data, 4, name);
    check_aligned(q.padded_offsets.data, 8, name);
  } else {
    check_aligned(q.data.data, 16, name);
    check_aligned(q.scale_inv.data, 4, name);
  }
}

void check_weights_cuda(const Fp8Weights& q, bool transposed, const char* name) {
  check_format_cuda(q.recipe, q.format, false, name);
  check_extent(q.rows, name, "rows (N)");
  check_extent(q.cols, name, "columns (K)");
  check_aligned(transposed ? q.data_t.data : q.data.data, 16, name);
  check_aligned(transposed ? q.scale_inv_t.data : q.scale_inv.data, 4, name);
}

void check_out_rows_cuda(const TensorView& t, const char* name) {
  GMOE_CHECK(t.dtype == DType::bf16, name, ": the CUDA FP8 GEMM writes bf16, got ",
             dtype_name(t.dtype));
  check_aligned(t.data, 16, name);
  GMOE_CHECK(t.stride(0) * 2 % 16 == 0, name, ": the row stride must be a multiple of 16 bytes "
             "(TMA), got ", t.stride(0), " elements");
}

void check_dw_cuda(const ExpertWeights& dw, const char* name) {
  const int64_t es = static_cast<int64_t>(dtype_size(dw.dtype()));
  auto check_stride = [&](int64_t elems, const char* which) {
    GMOE_CHECK(elems * es % 16 == 0, name, ": the CUDA backend needs ", which,
               " that are a multiple of 16 bytes (TMA), got ", elems, " elements");
  };
  if (dw.is_stacked()) {
    check_aligned(dw.stacked.data, 16, name);
    check_stride(dw.stacked.stride(0), "expert strides");
    check_stride(dw.stacked.stride(1), "row strides");
  } else {
    for (const TensorView& t : dw.list) {
      check_aligned(t.data, 16, name);
      check_stride(t.stride(0), "row strides");
    }
  }
}

void check_experts_count(int64_t E) {
  GMOE_CHECK(E <= kMaxExperts, "counts: ", E, " experts, the CUDA backend takes at most ",
             kMaxExperts);
}

// ---------------------------------------------------------------------------------------------
// One blockwise/tensorwise call, planned on the host and enqueued on the stream.

struct Fp8Plan : CallPlan {
  Fp8KernelKey kernel;             // the heuristics' choice (fp8_gemm_heuristics.h)
  int32_t sfa_ld = 0, sfb_ld = 0;  // blockwise: the scale matrices' row strides
  float beta = 0.0f;
  bool raster_along_n = false;  // wgrad: the tile order
};

void execute(Fp8Plan& plan, Stream stream, Allocator& alloc) {
  const Fp8Kernel* kernel = find_fp8_kernel(plan.kernel);
  GMOE_CHECK(kernel != nullptr, "FP8 grouped GEMM: the heuristics chose a kernel that is not compiled");
  plan.block_scales = plan.kernel.scaling == Fp8Scaling::blockwise;
  plan.alpha = !plan.block_scales;
  PreparedCall call =
      prepare_call(plan, plan.run_gemm ? kernel->workspace_bytes(sm_count(current_device())) : 0, stream, alloc);
  LaunchRecord& record = last_launch_record();
  record.fp8 = true;
  record.cluster_m = fp8_cluster_m(plan.kernel.tile);
  record.cluster_n = fp8_cluster_n(plan.kernel.tile);
  record.tile_n = fp8_tile_n(plan.kernel.tile);
  if (plan.run_gemm) {
    Fp8GemmLaunch launch;
    launch.gemm = call.launch;
    launch.gemm.beta = plan.beta;
    launch.gemm.raster_along_n = plan.raster_along_n;
    launch.ptr_sfa = call.arrays.ptr_sfa;
    launch.ptr_sfb = call.arrays.ptr_sfb;
    launch.sfa_ld = plan.sfa_ld;
    launch.sfb_ld = plan.sfb_ld;
    launch.alpha_ptrs = call.arrays.alpha_ptr;
    kernel->run(launch, stream);
  }
  // `call.workspace` is released on `stream` here, after everything above.
}

Fp8Scaling scaling_of(Fp8Recipe r) {
  return r == Fp8Recipe::blockwise ? Fp8Scaling::blockwise : Fp8Scaling::tensorwise;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// fprop and dgrad: A = grouped rows (rowwise copy), B = one copy of the weights, D = rows.
// `b_data` [E, n, k] and its scales `b_scale` (blockwise [E, ceil(n/128), ceil(k/128)] or
// tensorwise [E]), where n is the GEMM's N (y's columns) and k its reduction. `fused_bias`
// (blockwise fprop, bf16): D = A·Bᵀ + bias_e in the epilogue. `fast_accumulation`: Fp8GemmOptions.
void rows_pass(GemmPass pass, const Fp8Grouped& a, const TensorView& b_data,
               const TensorView& b_scale, const TensorView& counts, const TensorView& d,
               Stream stream, Allocator& alloc, bool fast_accumulation,
               const ExpertBias* fused_bias = nullptr) {
  const int64_t capacity = a.capacity;
  const int64_t gemm_n = d.size(1);
  const int64_t gemm_k = a.cols;
  DeviceGuard guard(a.data.device.index);
  Fp8RowsProblem problem;
  problem.scaling = scaling_of(a.recipe);
  problem.format_a = a.format;
  problem.bias = fused_bias != nullptr;
  problem.fast_accumulation = fast_accumulation;
  problem.capacity = capacity;
  problem.num_experts = counts.size(0);
  problem.gemm_n = gemm_n;
  problem.gemm_k = gemm_k;
  Fp8Plan plan;
  plan.kernel = choose_fp8_rows_kernel(problem);
  plan.prep = prepare_params(pass, counts, capacity);
  plan.prep.gemm_n = static_cast<int32_t>(gemm_n);
  plan.prep.gemm_k = static_cast<int32_t>(gemm_k);
  plan.prep.rows_a = {a.data.data, a.data.stride(0), 1};
  plan.prep.rows_d = {d.data, d.stride(0), static_cast<int32_t>(dtype_size(d.dtype))};
  plan.prep.expert_stacked = true;
  plan.prep.expert = {b_data.data, b_data.stride(0), b_data.stride(1), 1};
  if (fused_bias != nullptr) {
    GMOE_CHECK(pass == GemmPass::fprop, "FP8 grouped GEMM: a fused bias is an fprop epilogue");
    plan.bias = fused_bias;  // a list's pointers are written by prepare_call
    if (fused_bias->is_grouped()) {
      const TensorView& b = fused_bias->grouped;
      plan.prep.bias = {b.data, b.stride(0), 0, static_cast<int32_t>(dtype_size(b.dtype))};
    }
  }
  if (problem.scaling == Fp8Scaling::blockwise) {
    // A's scales are token-major [ceil(K/128), capacity]: group e's start at its first row, and a
    // k-tile's are one contiguous run of the tile's rows (the MN-major loads of the kernel).
    plan.prep.scale_a = {static_cast<const float*>(a.scale_inv.data), ScaleStart::rows, 1, 0};
    plan.prep.scale_b = {static_cast<const float*>(b_scale.data), ScaleStart::expert, 0,
                         b_scale.stride(0)};
    plan.sfa_ld = static_cast<int32_t>(capacity);
    plan.sfb_ld = static_cast<int32_t>(b_scale.stride(1));
  } else {
    plan.prep.alpha_a = static_cast<const float*>(a.scale_inv.data);
    plan.prep.alpha_b = static_cast<const float*>(b_scale.data);
  }
  plan.run_gemm = capacity > 0 && gemm_n > 0 && gemm_k > 0;
  plan.out_base = d.data;
  plan.out_ld_bytes = d.stride(0) * static_cast<int64_t>(dtype_size(d.dtype));
  plan.out_row_bytes = gemm_n * static_cast<int64_t>(dtype_size(d.dtype));
  plan.zero_all_rows = gemm_k == 0;  // an empty reduction: every row is zero
  execute(plan, stream, alloc);
}

// The blockwise/tensorwise weight gradient: A = dy's columnwise copy, B = x's, each expert's
// tokens located by the padded offsets; D = dW_e (f32 or bf16; accumulated into when asked).
void wgrad_pass(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts, const ExpertWeights& dw,
                const WgradOptions& options, Stream stream, Allocator& alloc) {
  const int64_t pc = dy.padded_capacity;
  const Fp8Scaling scaling = scaling_of(dy.recipe);
  Fp8Plan plan;
  plan.kernel = choose_fp8_wgrad_kernel(scaling, dw.dtype(), dy.format, dy.cols);
  plan.raster_along_n = choose_fp8_wgrad_raster_along_n(plan.kernel, dy.cols, x.cols, pc, counts.size(0));
  plan.prep = prepare_params(GemmPass::wgrad, counts, dy.capacity);
  plan.prep.gemm_m = static_cast<int32_t>(dy.cols);  // N
  plan.prep.gemm_n = static_cast<int32_t>(x.cols);   // K
  plan.prep.rows_a = {dy.data_t.data, pc, 1, static_cast<const int64_t*>(dy.padded_offsets.data),
                      pc};
  plan.prep.rows_b = {x.data_t.data, pc, 1, static_cast<const int64_t*>(x.padded_offsets.data), pc};
  plan.prep.expert_stacked = dw.is_stacked();
  if (dw.is_stacked()) {
    plan.prep.expert = {dw.stacked.data, dw.stacked.stride(0), dw.stacked.stride(1),
                        static_cast<int32_t>(dtype_size(dw.dtype()))};
  }
  set_wgrad_mask(plan, options);
  if (scaling == Fp8Scaling::blockwise) {
    // Token-block-major scales [padded/128, cols]: a k-tile's scales of A (B) are one contiguous
    // run of the tile's rows (columns), the layout the kernel's MN-major scale loads read.
    plan.prep.scale_a = {static_cast<const float*>(dy.scale_inv_t.data), ScaleStart::columns,
                         dy.cols, 0};
    plan.prep.scale_b = {static_cast<const float*>(x.scale_inv_t.data), ScaleStart::columns,
                         x.cols, 0};
    plan.sfa_ld = static_cast<int32_t>(dy.cols);
    plan.sfb_ld = static_cast<int32_t>(x.cols);
  } else {
    plan.prep.alpha_a = static_cast<const float*>(dy.scale_inv_t.data);
    plan.prep.alpha_b = static_cast<const float*>(x.scale_inv_t.data);
  }
  plan.run_gemm = dy.capacity > 0 && dy.cols > 0 && x.cols > 0;
  plan.beta = options.accumulate ? 1.0f : 0.0f;
  plan.experts = &dw;
  plan.dw_elem_bytes = static_cast<int32_t>(dtype_size(dw.dtype()));
  plan.dw_rows = dy.cols;
  plan.dw_row_bytes = x.cols * static_cast<int64_t>(dtype_size(dw.dtype()));
  execute(plan, stream, alloc);
}

// ---------------------------------------------------------------------------------------------
// MXFP8: dequantization to bf16, then the bf16 grouped GEMM.

constexpr int kDequantThreads = 256;

__device__ __forceinline__ float2 fp8x2_to_float2(uint16_t v, bool e5m2) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(v),
                                                   e5m2 ? __NV_E5M2 : __NV_E4M3);
  return __half22float2(__half2(h));
}

// out[r, c] = data[r, c] * 2^(scale[r, c / 32] - 127) for a row-major [rows, cols] operand with
// cols % 16 == 0: each thread converts 16 elements (one 16-byte load, two 16-byte stores; the 16
// share one scale).
__global__ void mx_dequant_rows_kernel(const uint8_t* __restrict__ data,
                                       const uint8_t* __restrict__ scale, int64_t rows,
                                       int64_t cols, int64_t scale_cols, bool e5m2,
                                       __nv_bfloat16* __restrict__ out) {
  const int64_t per_row = cols / 16;
  const int64_t total = rows * per_row;
  for (int64_t v = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; v < total;
       v += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = v / per_row;
    const int64_t c = (v - r * per_row) * 16;
    const uint4 d = *reinterpret_cast<const uint4*>(data + r * cols + c);
    const float s = fp8_rules::e8m0_to_float(scale[r * scale_cols + c / kMxBlock]);
    const uint32_t words[4] = {d.x, d.y, d.z, d.w};
    uint32_t packed[8];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 lo = fp8x2_to_float2(static_cast<uint16_t>(words[i] & 0xffffu), e5m2);
      const float2 hi = fp8x2_to_float2(static_cast<uint16_t>(words[i] >> 16), e5m2);
      const __nv_bfloat162 blo = __floats2bfloat162_rn(lo.x * s, lo.y * s);
      const __nv_bfloat162 bhi = __floats2bfloat162_rn(hi.x * s, hi.y * s);
      packed[2 * i] = *reinterpret_cast<const uint32_t*>(&blo);
      packed[2 * i + 1] = *reinterpret_cast<const uint32_t*>(&bhi);
    }
    uint4* o = reinterpret_cast<uint4*>(out + r * cols + c);
    o[0] = make_uint4(packed[0], packed[1], packed[2], packed[3]);
    o[1] = make_uint4(packed[4], packed[5], packed[6], packed[7]);
  }
}

// The columnwise copy transposed back: out[p, c] = data_t[c, p] * 2^(scale_t[c, p / 32] - 127),
// data_t [cols, padded] with padded % 128 == 0, out [padded, cols] with cols % 16 == 0. 64x64
// tiles through shared memory: 4-byte loads along p, 8-byte stores along c.
constexpr int kTile = 64;
__global__ void __launch_bounds__(256)
    mx_dequant_transpose_kernel(const uint8_t* __restrict__ data, const uint8_t* __restrict__ scale,
                                int64_t cols, int64_t padded, bool e5m2,
                                __nv_bfloat16* __restrict__ out) {
  __shared__ float tile[kTile][kTile + 1];
  const int64_t p0 = int64_t{blockIdx.x} * kTile;
  const int64_t c0 = int64_t{blockIdx.y} * kTile;
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;  // 16 x 16 threads
  const int64_t scale_cols = padded / kMxBlock;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int cl = ty + 16 * i;
    const int64_t c = c0 + cl;
    const int64_t p = p0 + 4 * tx;
    if (c < cols) {  // p + 3 < padded: padded is a multiple of 64
      const uint32_t w = *reinterpret_cast<const uint32_t*>(data + c * padded + p);
      const float s = fp8_rules::e8m0_to_float(scale[c * scale_cols + p / kMxBlock]);
      const float2 lo = fp8x2_to_float2(static_cast<uint16_t>(w & 0xffffu), e5m2);
      const float2 hi = fp8x2_to_float2(static_cast<uint16_t>(w >> 16), e5m2);
      tile[cl][4 * tx] = lo.x * s;
      tile[cl][4 * tx + 1] = lo.y * s;
      tile[cl][4 * tx + 2] = hi.x * s;
      tile[cl][4 * tx + 3] = hi.y * s;
    }
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int pl = ty + 16 * i;
    const int64_t p = p0 + pl;
    const int64_t c = c0 + 4 * tx;
    if (c < cols) {  // c + 3 < cols: cols is a multiple of 16
      const __nv_bfloat162 a = __floats2bfloat162_rn(tile[4 * tx][pl], tile[4 * tx + 1][pl]);
      const __nv_bfloat162 b = __floats2bfloat162_rn(tile[4 * tx + 2][pl], tile[4 * tx + 3][pl]);
      uint2 v;
      v.x = *reinterpret_cast<const uint32_t*>(&a);
      v.y = *reinterpret_cast<const uint32_t*>(&b);
      *reinterpret_cast<uint2*>(out + p * cols + c) = v;
    }
  }
}

// counts[e] = padded_offsets[e + 1] - padded_offsets[e]: the bf16 weight gradient over the padded
// token layout of the columnwise copies.
__global__ void padded_counts_kernel(const int64_t* __restrict__ padded_offsets, int E,
                                     int64_t* __restrict__ counts) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e < E) counts[e] = padded_offsets[e + 1] - padded_offsets[e];
}

void launch_mx_dequant_rows(const TensorView& data, const TensorView& scale, int64_t rows,
                            int64_t cols, bool e5m2, void* out, int sms, cudaStream_t stream) {
  const int64_t total = rows * (cols / 16);
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + kDequantThreads - 1) / kDequantThreads,
                                           int64_t{16} * sms);
  mx_dequant_rows_kernel<<<static_cast<unsigned>(blocks), kDequantThreads, 0, stream>>>(
      static_cast<const uint8_t*>(data.data), static_cast<const uint8_t*>(scale.data), rows, cols,
      ceil_div(cols, kMxBlock), e5m2, static_cast<__nv_bfloat16*>(out));
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void launch_mx_dequant_transpose(const TensorView& data_t, const TensorView& scale_t, int64_t cols,
                                 int64_t padded, bool e5m2, void* out, cudaStream_t stream) {
  if (cols == 0 || padded == 0) return;
  GMOE_CHECK(ceil_div(cols, kTile) <= 65535, "mxfp8 dequantization: ", cols,
             " columns exceed the grid's y extent");
  const dim3 grid(static_cast<unsigned>(padded / kTile),
                  static_cast<unsigned>(ceil_div(cols, kTile)));
  mx_dequant_transpose_kernel<<<grid, 256, 0, stream>>>(
      static_cast<const uint8_t*>(data_t.data), static_cast<const uint8_t*>(scale_t.data), cols,
      padded, e5m2, static_cast<__nv_bfloat16*>(out));
  GMOE_CUDA_CHECK(cudaGetLastError());
}

// A bf16 buffer of `shape` from the allocator, and its view.
struct Bf16Scratch {
  Buffer buffer;
  TensorView view;
  Bf16Scratch(Allocator& alloc, Stream stream, Device device,
              std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    buffer = Buffer(alloc, static_cast<std::size_t>(n) * 2, stream);
    view = TensorView(buffer.data(), DType::bf16, device, shape);
  }
};

// MXFP8 fprop and dgrad: d = dequant(a) · dequant(b_e)ᵀ with b [E, b_rows, b_cols] (e8m0 scales
// 1x32 along b_cols), both dequantized to bf16 scratch, then the bf16 fprop.
void mx_rows_pass(const Fp8Grouped& a, const TensorView& b_data, const TensorView& b_scale, int64_t b_rows,
                  int64_t b_cols, DType b_format, const TensorView& counts, const TensorView& d, Stream stream,
                  Allocator& alloc, const ExpertBias& bias = ExpertBias()) {
  DeviceGuard guard(a.data.device.index);
  const int sms = sm_count(a.data.device.index);
  const Device dev = a.data.device;
  const int64_t E = counts.size(0);
  Bf16Scratch ab(alloc, stream, dev, {a.capacity, a.cols});
  Bf16Scratch bb(alloc, stream, dev, {E, b_rows, b_cols});
  launch_mx_dequant_rows(a.data, a.scale_inv, a.capacity, a.cols, a.format == DType::e5m2, ab.buffer.data(), sms,
                         stream);
  launch_mx_dequant_rows(b_data, b_scale, E * b_rows, b_cols, b_format == DType::e5m2, bb.buffer.data(), sms,
                         stream);
  cuda_backend::grouped_gemm_fprop(ab.view, ExpertWeights::from_stacked(bb.view), counts, d, stream, alloc,
                                   bias);
}

// MXFP8 weight gradient: both columnwise copies dequantized and transposed back to bf16 [padded,
// cols], then the bf16 weight gradient over the padded per-expert token counts (the padding is
// zero, so its terms are exact zeros).
void mx_wgrad_pass(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts, const ExpertWeights& dw,
                   const WgradOptions& options, Stream stream, Allocator& alloc) {
  const int64_t E = counts.size(0);
  const int64_t pc = dy.padded_capacity;
  const Device dev = dy.data_t.device;
  Bf16Scratch dyb(alloc, stream, dev, {pc, dy.cols});
  Bf16Scratch xb(alloc, stream, dev, {pc, x.cols});
  Buffer padded_counts(alloc, static_cast<std::size_t>(E) * sizeof(int64_t), stream);
  launch_mx_dequant_transpose(dy.data_t, dy.scale_inv_t, dy.cols, pc, dy.format == DType::e5m2,
                              dyb.buffer.data(), stream);
  launch_mx_dequant_transpose(x.data_t, x.scale_inv_t, x.cols, pc, x.format == DType::e5m2,
                              xb.buffer.data(), stream);
  // dy's padded offsets locate the tokens of both copies (the edge checked equal capacities;
  // both were quantized with the same counts).
  padded_counts_kernel<<<static_cast<unsigned>(ceil_div(E, 256)), 256, 0, stream>>>(
      static_cast<const int64_t*>(dy.padded_offsets.data), static_cast<int>(E),
      static_cast<int64_t*>(padded_counts.data()));
  GMOE_CUDA_CHECK(cudaGetLastError());
  const TensorView pcounts(padded_counts.data(), DType::i64, dev, {E});
  cuda_backend::grouped_gemm_wgrad(dyb.view, xb.view, pcounts, dw, options, stream, alloc);
}

}  // namespace

void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& y, Stream stream, Allocator& alloc, const ExpertBias& bias,
                            bool fast_accumulation) {
  check_grouped_cuda(x, false, true, "x");
  check_weights_cuda(w, false, "w");
  check_dim16(x.cols, "x", "K (columns)");
  check_dim16(w.rows, "w", "N (rows)");
  check_out_rows_cuda(y, "y");
  check_experts_count(counts.size(0));
  if (x.recipe == Fp8Recipe::mxfp8) {  // the bf16 fprop, with its own bias handling
    mx_rows_pass(x, w.data, w.scale_inv, w.rows, w.cols, w.format, counts, y, stream, alloc, bias);
    return;
  }
  // A bf16 bias with an e4m3 x, fused: blockwise starts the accumulators from the bias (each
  // tile's 128 values copied 16 bytes at a time, so every expert's bias must start 16-byte
  // aligned), tensorwise adds it in the epilogue (alpha_e·acc + bias, read element-wise: any
  // alignment); both in f32 with one rounding. Otherwise (another dtype, an e5m2 x, a misaligned
  // blockwise bias, K = 0 where y = bias): a second pass over y.
  if (bias.defined() && bias.dtype() == DType::bf16 && x.format == DType::e4m3 && x.cols > 0 &&
      (x.recipe != Fp8Recipe::blockwise || bias_rows_aligned(bias, 16))) {
    rows_pass(GemmPass::fprop, x, w.data, w.scale_inv, counts, y, stream, alloc, fast_accumulation, &bias);
    return;
  }
  rows_pass(GemmPass::fprop, x, w.data, w.scale_inv, counts, y, stream, alloc, fast_accumulation);
  if (bias.defined()) cuda_backend::grouped_bias_add(y, bias, counts, stream, alloc);
}

void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx, Stream stream, Allocator& alloc, bool fast_accumulation) {
  check_grouped_cuda(dy, false, true, "dy");
  check_weights_cuda(w, true, "w");
  check_dim16(dy.cols, "dy", "N (columns)");
  check_dim16(w.cols, "w", "K (columns)");
  check_out_rows_cuda(dx, "dx");
  check_experts_count(counts.size(0));
  if (dy.recipe != Fp8Recipe::mxfp8) {
    // dx = dy · W_e = dy · (W_eᵀ)ᵀ: the fprop GEMM with B = data_t [E, K, N].
    rows_pass(GemmPass::dgrad, dy, w.data_t, w.scale_inv_t, counts, dx, stream, alloc, fast_accumulation);
    return;
  }
  // dx = dy · W_e = dy · (W_eᵀ)ᵀ: fprop with the transposed copy [E, K, N].
  mx_rows_pass(dy, w.data_t, w.scale_inv_t, w.cols, w.rows, w.format, counts, dx, stream, alloc);
}

void fp8_grouped_gemm_wgrad(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts,
                            const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                            Allocator& alloc) {
  check_grouped_cuda(dy, true, true, "dy");
  check_grouped_cuda(x, true, false, "x");
  check_dim16(dy.cols, "dy", "N (columns)");
  check_dim16(x.cols, "x", "K (columns)");
  check_dw_cuda(dw, "dw");
  check_experts_count(counts.size(0));
  if (options.expert_mask.defined()) {
    check_aligned(options.expert_mask.data, 4, "options.expert_mask");
  }
  if (options.masked_off == MaskedOffWgrad::fresh) check_dw_cuda(options.fresh_dw, "options.fresh_dw");
  DeviceGuard guard(dy.data_t.device.index);
  if (dy.recipe == Fp8Recipe::mxfp8) {
    mx_wgrad_pass(dy, x, counts, dw, options, stream, alloc);
  } else {
    wgrad_pass(dy, x, counts, dw, options, stream, alloc);
  }
}

}  // namespace gmoe::cuda_backend
