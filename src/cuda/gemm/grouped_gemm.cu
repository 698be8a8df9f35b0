// src/cuda/gemm/grouped_gemm.cu — the CUDA backend's grouped GEMM entry points (fprop, dgrad, wgrad).
//
// Each call: check what is CUDA-specific (dtypes the kernels take, 16-byte alignment of pointers
// and row strides for TMA, sizes CUTLASS's 32-bit group extents hold) and throw gmoe::Error before
// anything is launched; pick a tile configuration from host-known sizes only; take one workspace
// from the caller's allocator on the stream; then enqueue, all on `stream` and without a sync:
//   1. prepare (one block): counts -> clamped offsets -> per-expert shapes, pointers, strides;
//   2. for a list of expert tensors, their pointers, passed by value in kernel parameters;
//   3. zeros where the GEMM writes nothing: rows past the real total (fprop, dgrad), or dW of
//      experts without rows (wgrad; not when accumulating or masked);
//   4. the CUTLASS grouped GEMM, reading the arrays of step 1.
// Steps 1-3 are prepare_call (grouped_gemm_prepare.h), shared with the FP8 GEMMs. Everything is
// graph-capturable: the counts may change between replays of one captured graph.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "common/backend.h"
#include "common/checks.h"
#include "cuda/runtime/alignment.h"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_info.h"
#include "cuda/gemm/grouped_gemm_kernels.h"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "gmoe/error.h"

namespace gmoe::cuda_backend {
namespace {

// Average rows per expert from which f32 wgrad uses the cooperative tile (choose_wgrad_tile).
constexpr int64_t kWgradCoopMinRows = 1024;

// ---------------------------------------------------------------------------------------------
// The compiled instantiations, and the one place that maps runtime values onto them.

struct KernelEntry {
  std::size_t (*workspace_bytes)(int sm_count) = nullptr;
  void (*run)(const GroupedGemmLaunch&, cudaStream_t) = nullptr;
  bool has_source = false;
  TileConfig tile = TileConfig::coop_128x256;  ///< of the instantiation (for LaunchRecord)
};

template <DType In, DType Out, GemmPass Pass, TileConfig Tile, bool Bias = false, bool Glu = false>
KernelEntry entry() {
  using K = GroupedGemmKernel<In, Out, Pass, Tile, Bias, Glu>;
  return {&K::workspace_bytes, &K::run, Pass == GemmPass::wgrad && Out == DType::f32, Tile};
}

// The instantiations that exist (one sm90_*.cu file each). A 16-bit dW is written at half the
// bytes of an f32 one: cooperative only (a ping-pong 16-bit wgrad measured no faster, see below).
// The 2x1-clustered cooperative tile: the bf16 weight gradient (to bf16 or f32). In fprop/dgrad
// it measured 0.89-1.03x the 1x1 tile (wgrad_cluster_2x1) and is not compiled.
constexpr bool compiled(DType in, DType out, GemmPass pass, TileConfig tile) {
  switch (tile) {
    case TileConfig::coop_128x256: return true;
    case TileConfig::pingpong_128x128: return pass != GemmPass::wgrad || out == DType::f32;
    case TileConfig::coop_128x256_2x1: return in == DType::bf16 && pass == GemmPass::wgrad;
  }
  return false;
}

template <DType In, DType Out, GemmPass Pass>
KernelEntry entry_for_tile(TileConfig tile) {
  if constexpr (compiled(In, Out, Pass, TileConfig::pingpong_128x128)) {
    if (tile == TileConfig::pingpong_128x128) return entry<In, Out, Pass, TileConfig::pingpong_128x128>();
  }
  if constexpr (compiled(In, Out, Pass, TileConfig::coop_128x256_2x1)) {
    if (tile == TileConfig::coop_128x256_2x1) return entry<In, Out, Pass, TileConfig::coop_128x256_2x1>();
  }
  return entry<In, Out, Pass, TileConfig::coop_128x256>();
}

template <DType In>
KernelEntry entry_for_input(DType out, GemmPass pass, TileConfig tile) {
  switch (pass) {
    case GemmPass::fprop: return entry_for_tile<In, In, GemmPass::fprop>(tile);
    case GemmPass::dgrad: return entry_for_tile<In, In, GemmPass::dgrad>(tile);
    case GemmPass::wgrad:
      return out == DType::f32 ? entry_for_tile<In, DType::f32, GemmPass::wgrad>(tile)
                               : entry_for_tile<In, In, GemmPass::wgrad>(tile);
  }
  GMOE_FAIL("unknown grouped GEMM pass");
}

// fprop with the bias in the epilogue: bf16 with a bf16 bias only (the training configuration;
// every other combination adds the bias in a second pass, see grouped_gemm_fprop).
KernelEntry find_bias_kernel(TileConfig tile) {
  return tile == TileConfig::pingpong_128x128
             ? entry<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::pingpong_128x128, true>()
             : entry<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::coop_128x256, true>();
}

// fprop with the gated activation in the epilogue (bf16; the bias, if any, bf16 and fused too).
template <bool Bias>
KernelEntry glu_kernel(TileConfig tile) {
  return tile == TileConfig::pingpong_128x128
             ? entry<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::pingpong_128x128, Bias, true>()
             : entry<DType::bf16, DType::bf16, GemmPass::fprop, TileConfig::coop_128x256, Bias, true>();
}

// dgrad with the gated activation's backward in the epilogue (bf16, no bias; dz is not stored).
KernelEntry glu_dgrad_kernel(TileConfig tile) {
  return tile == TileConfig::pingpong_128x128
             ? entry<DType::bf16, DType::bf16, GemmPass::dgrad, TileConfig::pingpong_128x128, false, true>()
             : entry<DType::bf16, DType::bf16, GemmPass::dgrad, TileConfig::coop_128x256, false, true>();
}

KernelEntry find_kernel(DType in, DType out, GemmPass pass, TileConfig tile) {
  switch (in) {
    case DType::bf16: return entry_for_input<DType::bf16>(out, pass, tile);
    case DType::f16: return entry_for_input<DType::f16>(out, pass, tile);
    default: GMOE_FAIL("no CUDA grouped GEMM for input dtype ", dtype_name(in));
  }
}

// GMOE_CUDA_TILE=coop|pingpong (read once) forces a tile wherever that tile is compiled for the
// call, for benchmarking and for tests that must run every kernel (GMOE_CLUSTER, the cluster).
bool forced_tile(DType in, DType out, GemmPass pass, TileConfig* tile) {
  static const int forced = env_option("GMOE_CUDA_TILE", {"coop", "pingpong"});  // TileConfig order
  if (forced < 0 || !compiled(in, out, pass, static_cast<TileConfig>(forced))) return false;
  *tile = static_cast<TileConfig>(forced);
  return true;
}

// fprop/dgrad: a group's M is its row count, which only the device knows; the host knows the
// average, capacity / E. The cooperative 128x256 tile is the fast one when groups fill it (>= 128
// rows) and there are enough tiles to occupy every SM. Below that, a 128x256 tile computes mostly
// out-of-range rows or leaves SMs idle; the 128x128 ping-pong tile makes twice as many tiles and
// overlaps one warpgroup's epilogue with the other's mainloop. Measured on H100 (bf16, K=7168,
// N=4096): 8 experts x 4096 rows, cooperative 2.51 ms (768 TFLOP/s) vs ping-pong 3.91 ms;
// 128 x 512 rows, 5.16 vs 5.95 ms; at 128 x 128 rows and below both take ~3 ms, the time to read
// the 7.5 GB of weights once, so the choice there matters little.
TileConfig choose_rows_tile(DType in, GemmPass pass, int64_t capacity, int64_t num_experts,
                            int64_t gemm_n, int sms) {
  TileConfig forced;
  if (forced_tile(in, in, pass, &forced)) return forced;
  const int64_t avg_rows = capacity / num_experts;
  const int64_t coop_tiles = num_experts * ((avg_rows + 127) / 128) * ((gemm_n + 255) / 256);
  return (avg_rows >= 128 && coop_tiles >= sms) ? TileConfig::coop_128x256
                                                : TileConfig::pingpong_128x128;
}

// wgrad to f32: each output tile costs 2·BM·BN·rows flops in the mainloop and BM·BN·4 bytes in the
// epilogue. Per SM (~5.6 TFLOP/s, ~23 GB/s of the write bandwidth) the two take equal time near
// rows = 500, so with fewer than ~1000 rows per expert the dW write is a large share, and the
// ping-pong schedule hides it behind the other warpgroup's mainloop; the cooperative tile (no
// overlap, fewer and larger tiles) wins when the reduction is long. Measured on H100 (bf16 in,
// K=7168, N=4096): 128 experts x 512 rows, ping-pong 8.26 ms vs cooperative 9.25 ms; 8 x 4096
// rows, cooperative 2.85 ms vs ping-pong 3.81 ms. 16-bit dW: cooperative only (a ping-pong 16-bit
// wgrad and 1x2 clusters measured no faster). The cooperative tile of a bf16 input runs in 2x1
// clusters where wgrad_cluster_2x1 says so (B's tile multicast; the measurements are there).
TileConfig choose_wgrad_tile(DType in, DType out, int64_t capacity, int64_t num_experts, int64_t gemm_m) {
  TileConfig tile;
  if (!forced_tile(in, out, GemmPass::wgrad, &tile)) {
    tile = out == DType::f32 && capacity / num_experts < kWgradCoopMinRows ? TileConfig::pingpong_128x128
                                                                           : TileConfig::coop_128x256;
  }
  return tile == TileConfig::coop_128x256 && in == DType::bf16 && wgrad_cluster_2x1(gemm_m)
             ? TileConfig::coop_128x256_2x1
             : tile;
}

// ---------------------------------------------------------------------------------------------
// CUDA-specific argument checks (the public edge has checked shapes, dtypes, devices, counts).

void check_input_dtype_cuda(DType t, const char* name) {
  GMOE_CHECK(t == DType::bf16 || t == DType::f16, name,
             ": the CUDA grouped GEMM takes bf16 or f16 inputs, got ", dtype_name(t));
}

void check_aligned(const void* p, const char* name) {
  GMOE_CHECK(aligned(p, 16), name,
             ": the CUDA backend needs 16-byte aligned data (TMA), got address ", p);
}

void check_stride_bytes(int64_t stride_elems, DType t, const char* name, const char* which) {
  const int64_t bytes = stride_elems * static_cast<int64_t>(dtype_size(t));
  GMOE_CHECK(bytes % 16 == 0, name, ": the CUDA backend needs ", which,
             " that are a multiple of 16 bytes (TMA), got ", stride_elems, " elements = ", bytes,
             " bytes");
}

void check_extent(int64_t v, const char* name, const char* what) {
  GMOE_CHECK(v <= INT32_MAX, name, ": ", what, " of ", v,
             " exceeds the 32-bit extents of the CUDA grouped GEMM");
}

void check_rows_cuda(const TensorView& t, const char* name) {
  check_aligned(t.data, name);
  check_stride_bytes(t.stride(0), t.dtype, name, "row strides");
  check_extent(t.size(0), name, "capacity");
  check_extent(t.size(1), name, "column count");
}

void check_experts_cuda(const ExpertWeights& w, const char* name) {
  check_extent(w.rows(), name, "rows");
  check_extent(w.cols(), name, "columns");
  GMOE_CHECK(w.num_experts() <= kMaxExperts, name, ": ", w.num_experts(),
             " experts, the CUDA backend takes at most ", kMaxExperts);
  if (w.is_stacked()) {
    check_aligned(w.stacked.data, name);
    check_stride_bytes(w.stacked.stride(0), w.dtype(), name, "expert strides");
    check_stride_bytes(w.stacked.stride(1), w.dtype(), name, "row strides");
  } else {
    for (const TensorView& t : w.list) {
      check_aligned(t.data, name);
      check_stride_bytes(t.stride(0), t.dtype, name, "row strides");
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One call, planned on the host and enqueued on the stream.

struct Plan : CallPlan {
  DType in = DType::bf16, out = DType::bf16;
  float beta = 0.0f;
  TileConfig tile = TileConfig::coop_128x256;
  bool raster_along_n = false;
  int32_t glu_kind = 0, glu_block = 0;  ///< glu: the activation and interleave block (pointers: prepare_call)
};

KernelEntry kernel_of(const Plan& plan) {
  if (plan.glu && plan.prep.pass == GemmPass::dgrad) return glu_dgrad_kernel(plan.tile);
  if (plan.glu) return plan.bias != nullptr ? glu_kernel<true>(plan.tile) : glu_kernel<false>(plan.tile);
  if (plan.bias != nullptr) return find_bias_kernel(plan.tile);
  return find_kernel(plan.in, plan.out, plan.prep.pass, plan.tile);
}

void execute(const Plan& plan, Stream stream, Allocator& alloc) {
  const KernelEntry kernel = kernel_of(plan);
  GMOE_CHECK(plan.beta == 0.0f || kernel.has_source,
             "grouped GEMM: accumulate needs the f32 weight-gradient kernels");
  PreparedCall call =
      prepare_call(plan, plan.run_gemm ? kernel.workspace_bytes(sm_count(current_device())) : 0, stream, alloc);
  last_launch_record().cluster_m = kernel.tile == TileConfig::coop_128x256_2x1 ? 2 : 1;
  if (plan.run_gemm) {
    call.launch.beta = plan.beta;
    call.launch.raster_along_n = plan.raster_along_n;
    if (plan.glu) {
      call.launch.glu.kind = plan.glu_kind;
      call.launch.glu.block = plan.glu_block;
    }
    kernel.run(call.launch, stream);
  }
  // `call.workspace` is released on `stream` here, after everything above.
}

RowsOperand rows_operand(const TensorView& t) {
  return {t.data, t.stride(0), static_cast<int32_t>(dtype_size(t.dtype))};
}

void set_expert_operand(PrepareParams& p, const ExpertWeights& w) {
  p.expert_stacked = w.is_stacked();
  if (w.is_stacked()) {
    p.expert = {w.stacked.data, w.stacked.stride(0), w.stacked.stride(1),
                static_cast<int32_t>(dtype_size(w.dtype()))};
  }
}

// The gated activation fused into an fprop (grouped_gemm_fprop_activation): z, its options, probs.
struct FusedActivation {
  TensorView z;
  ActivationOptions options;
  TensorView probs;
};

// fprop and dgrad differ only in which weight extent is the GEMM's N and which is its reduction.
void rows_pass(GemmPass pass, const TensorView& a, const ExpertWeights& w, const TensorView& counts,
               const TensorView& d, Stream stream, Allocator& alloc, const char* a_name,
               const char* d_name, const ExpertBias* fused_bias = nullptr,
               const FusedActivation* fused_act = nullptr) {
  check_input_dtype_cuda(a.dtype, a_name);
  GMOE_CHECK(d.dtype == a.dtype, d_name, ": the CUDA grouped GEMM writes ", d_name,
             " in the input dtype (", dtype_name(a.dtype), "); ", dtype_name(d.dtype),
             " output is not implemented");
  check_rows_cuda(a, a_name);
  check_rows_cuda(d, d_name);
  check_experts_cuda(w, "w");
  GMOE_CHECK(counts.size(0) <= kMaxExperts, "counts: ", counts.size(0),
             " experts, the CUDA backend takes at most ", kMaxExperts);

  DeviceGuard guard(a.device.index);
  const int64_t capacity = a.size(0);
  const int64_t gemm_n = d.size(1);  // fprop: N; dgrad: K
  const int64_t gemm_k = a.size(1);  // fprop: K; dgrad: N
  Plan plan;
  plan.in = a.dtype;
  plan.out = d.dtype;
  plan.prep = prepare_params(pass, counts, capacity);
  plan.prep.gemm_n = static_cast<int32_t>(gemm_n);
  plan.prep.gemm_k = static_cast<int32_t>(gemm_k);
  plan.prep.rows_a = rows_operand(a);
  plan.prep.rows_d = rows_operand(d);
  set_expert_operand(plan.prep, w);
  plan.experts = &w;
  if (fused_bias != nullptr) {
    plan.bias = fused_bias;
    if (fused_bias->is_grouped()) {
      const TensorView& b = fused_bias->grouped;
      plan.prep.bias = {b.data, b.stride(0), 0, static_cast<int32_t>(dtype_size(b.dtype))};
    }
  }
  if (fused_act != nullptr) {
    const ActivationOptions& o = fused_act->options;
    plan.glu = true;
    plan.prep.rows_z = rows_operand(fused_act->z);
    plan.prep.probs = static_cast<const float*>(fused_act->probs.data);
    plan.z_row_bytes = fused_act->z.size(1) * static_cast<int64_t>(dtype_size(fused_act->z.dtype));
    plan.glu_kind = static_cast<int32_t>(o.kind);
    plan.glu_block = o.glu.layout == GluLayout::concatenated ? 0 : static_cast<int32_t>(o.glu.block);
  }
  plan.run_gemm = capacity > 0 && gemm_n > 0 && gemm_k > 0;
  plan.tile = choose_rows_tile(a.dtype, pass, capacity, counts.size(0), gemm_n,
                               sm_count(a.device.index));
  plan.out_base = d.data;
  plan.out_ld_bytes = d.stride(0) * static_cast<int64_t>(dtype_size(d.dtype));
  plan.out_row_bytes = gemm_n * static_cast<int64_t>(dtype_size(d.dtype));
  plan.zero_all_rows = gemm_k == 0;  // an empty reduction: every row is zero
  execute(plan, stream, alloc);
}

// GMOE_FUSED_ACTIVATION=1 (read at each call, host-side only) enables the activation in FC1's
// epilogue. Off by default: measured on an H100 (2026-11-23, qwen3_30b_a3b) the first version,
// which switched at run time between every gated activation, made FC1 3.3x slower (1.99 ms against
// ~0.6 ms: its replicated activation code thrashed the instruction cache); this SwiGLU-only one is
// to be measured before it becomes the default (docs/architecture.md).
bool fused_activation_enabled() {
  return env_equals("GMOE_FUSED_ACTIVATION", "1");
}

// The fused path's conditions (else: the GEMM, then the activation kernel, which is what the fused
// path reproduces bit for bit): enabled (above); bf16; SwiGLU with gate and up interleaved in
// blocks of 8 or 16 columns (the pairs one epilogue fragment holds); no bias or a bf16 one (fused
// too); a non-empty reduction (K = 0 makes h all zeros, which the activation kernel then maps); z
// 16-byte aligned with 16-byte rows (the rows past the total are zeroed with 16-byte stores).
bool activation_fusable(const TensorView& x, const ExpertBias& bias, const TensorView& z,
                        const ActivationOptions& o) {
  const bool blocks = o.glu.layout == GluLayout::interleaved && (o.glu.block == 8 || o.glu.block == 16);
  const bool bias_ok = !bias.defined() || bias_in_epilogue(x.dtype, bias.dtype(), x.dtype);
  const bool z_ok = aligned(z.data, 16) && z.stride(0) % 8 == 0;
  return fused_activation_enabled() && x.dtype == DType::bf16 && o.kind == ActivationKind::swiglu && blocks &&
         bias_ok && x.size(1) > 0 && z_ok;
}

// GMOE_FUSED_ACTIVATION_BWD=1 (read at each call, host-side only) enables the activation's backward
// in FC2's dgrad epilogue. Off by default: on an H100 (d67f96a) the epilogue added 813 µs to FC2's
// dgrad on dsv3_ep32 to save a 233 µs kernel (GroupedMLP forward+backward 0.95-0.96x; the bound is
// in docs/architecture.md).
bool fused_activation_backward_enabled() {
  return env_equals("GMOE_FUSED_ACTIVATION_BWD", "1");
}

// The fused backward's conditions (else: the GEMM into a dz buffer, then the activation kernel,
// which the fused path reproduces bit for bit): enabled (above); bf16; SwiGLU; gate and up
// concatenated or interleaved in blocks of an even number of columns (two adjacent dz columns
// address two adjacent gate and up columns: 4-byte accesses); a non-empty reduction (N = 0 makes
// dz all zeros); dh written over h (the epilogue reads each pair, then writes it); h 16-byte aligned
// with 16-byte rows; F even (a pair of dz columns never straddles the last column, and with
// concatenated halves the up column F further stays 4-byte aligned: a strided h can have odd F).
bool activation_backward_fusable(const TensorView& dy, const TensorView& h, const TensorView& dh,
                                 const ActivationOptions& o) {
  const bool layout = (o.glu.layout == GluLayout::concatenated || o.glu.block % 2 == 0) && h.size(1) % 4 == 0;
  const auto rows_ok = [](const TensorView& t) { return aligned(t.data, 16) && t.stride(0) % 8 == 0; };
  const bool in_place = dh.data == h.data && dh.stride(0) == h.stride(0);
  return fused_activation_backward_enabled() && dy.dtype == DType::bf16 && o.kind == ActivationKind::swiglu &&
         layout && dy.size(1) > 0 && in_place && rows_ok(h);
}

}  // namespace

void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, Stream stream, Allocator& alloc, const ExpertBias& bias) {
  if (!bias.defined()) {
    rows_pass(GemmPass::fprop, x, w, counts, y, stream, alloc, "x", "y");
    return;
  }
  // bf16 with a bf16 bias: in the epilogue (the bias is read element-wise into shared memory, so
  // it needs no alignment). Other dtypes, and an empty reduction (K = 0 runs no GEMM, so y = 0 +
  // bias needs the bias added to the zeroed rows): a second pass over y.
  if (bias_in_epilogue(x.dtype, bias.dtype(), y.dtype) && x.size(1) > 0) {
    rows_pass(GemmPass::fprop, x, w, counts, y, stream, alloc, "x", "y", &bias);
    return;
  }
  rows_pass(GemmPass::fprop, x, w, counts, y, stream, alloc, "x", "y");
  cuda_backend::grouped_bias_add(y, bias, counts, stream, alloc);
}

void grouped_gemm_fprop_activation(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                                   const TensorView& h, const TensorView& z, const ActivationOptions& options,
                                   const TensorView& probs, Stream stream, Allocator& alloc,
                                   const ExpertBias& bias) {
  if (!activation_fusable(x, bias, z, options)) {
    cuda_backend::grouped_gemm_fprop(x, w, counts, h, stream, alloc, bias);
    cuda_backend::grouped_activation_forward(h, counts, z, options, probs, {}, stream, alloc);
    return;
  }
  const FusedActivation act{z, options, probs};
  rows_pass(GemmPass::fprop, x, w, counts, h, stream, alloc, "x", "h", bias.defined() ? &bias : nullptr, &act);
}

void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx, Stream stream, Allocator& alloc) {
  rows_pass(GemmPass::dgrad, dy, w, counts, dx, stream, alloc, "dy", "dx");
}

void grouped_gemm_dgrad_activation_backward(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                                            const TensorView& h, const TensorView& dh,
                                            const ActivationOptions& options, Stream stream, Allocator& alloc) {
  const int64_t cap = h.size(0), F = h.size(1) / 2;
  if (!activation_backward_fusable(dy, h, dh, options)) {
    // dz's rows padded to 16 bytes, as the GEMM's TMA stores need, whatever F is.
    const int64_t ld = (F + 7) / 8 * 8;
    Tensor dz = Tensor::empty({cap, ld}, dy.dtype, alloc, stream);
    const TensorView dzv(dz.view().data, dy.dtype, dy.device, {cap, F}, {ld, 1});
    rows_pass(GemmPass::dgrad, dy, w, counts, dzv, stream, alloc, "dy", "dz");
    cuda_backend::grouped_activation_backward(h, dzv, counts, dh, options, {}, {}, {}, {}, stream, alloc);
    dz.release_on(stream);
    return;
  }
  // The epilogue reads h and writes dh over it, element pair by element pair. The plan's D (never
  // stored: the kernel has no D, but its rows past the total are zeroed, with the rest of dh's by
  // the z rows of the plan) is dh's first F columns.
  const TensorView d(dh.data, dh.dtype, dh.device, {cap, F}, {dh.stride(0), 1});
  const FusedActivation act{dh, options, {}};
  rows_pass(GemmPass::dgrad, dy, w, counts, d, stream, alloc, "dy", "dh", nullptr, &act);
}

void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options, Stream stream,
                        Allocator& alloc) {
  check_input_dtype_cuda(dy.dtype, "dy");
  GMOE_CHECK(dw.dtype() == dy.dtype || dw.dtype() == DType::f32, "dw: the CUDA grouped GEMM "
             "writes dW in the input dtype (", dtype_name(dy.dtype), ") or f32, got ",
             dtype_name(dw.dtype()));
  check_rows_cuda(dy, "dy");
  check_rows_cuda(x, "x");
  check_experts_cuda(dw, "dw");
  if (options.expert_mask.defined()) check_aligned(options.expert_mask.data, "options.expert_mask");

  DeviceGuard guard(dy.device.index);
  const int64_t capacity = dy.size(0);
  const int64_t n = dy.size(1), k = x.size(1);
  Plan plan;
  plan.in = dy.dtype;
  plan.out = dw.dtype();
  plan.prep = prepare_params(GemmPass::wgrad, counts, capacity);
  plan.prep.gemm_m = static_cast<int32_t>(n);
  plan.prep.gemm_n = static_cast<int32_t>(k);
  plan.prep.rows_a = rows_operand(dy);
  plan.prep.rows_b = rows_operand(x);
  set_expert_operand(plan.prep, dw);
  plan.prep.mask = static_cast<const int32_t*>(options.expert_mask.data);
  plan.prep.accumulate = options.accumulate;
  plan.experts = &dw;
  plan.run_gemm = capacity > 0 && n > 0 && k > 0;
  plan.beta = options.accumulate ? 1.0f : 0.0f;
  plan.tile = choose_wgrad_tile(dy.dtype, dw.dtype(), capacity, counts.size(0), n);
  plan.raster_along_n = choose_wgrad_raster_along_n(n, k, capacity, counts.size(0), dy.dtype);
  plan.dw_elem_bytes = static_cast<int32_t>(dtype_size(dw.dtype()));
  plan.dw_rows = n;
  plan.dw_row_bytes = k * static_cast<int64_t>(dtype_size(dw.dtype()));
  execute(plan, stream, alloc);
}

}  // namespace gmoe::cuda_backend
