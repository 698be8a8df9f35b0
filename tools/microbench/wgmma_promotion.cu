// tools/microbench/wgmma_promotion.cu — how fast can the consumers of a Hopper FP8 GEMM promote?
//
// The blockwise (1x128 by 1x128) FP8 weight gradient scales every accumulator on every 128-long
// k-tile by its row's and its column's scale: two FP32 operations per accumulator, against one
// (an add) for tensorwise. This benchmark isolates the consumer side of such a kernel: no producer,
// no pipeline, no epilogue, every operand already in shared memory (random e4m3, several stages so
// that addresses rotate as in a real mainloop). Each CTA (one per SM) runs 2 or 3 consumer
// warpgroups, each a 64x128 accumulator tile (64x192 for the n192 rows), over many k-tiles of
// 4 wgmma.m64nNk32 each, with:
//
//   promotion  none:    the wgmmas only (the tensor cores' bound for this tile);
//              add:     accum += part (tensorwise);
//              scaled:  accum = fma(part * sb[col], sa[row], accum) with sb read from shared memory
//                       two columns per 8-byte load (gmoe's blockwise weight gradient);
//              scaledr: the same arithmetic with the column scales in registers (no loads);
//              scaledp: as scaled, with this k-tile's column and row scales loaded into registers
//                       (34 of them) before its wgmmas are waited for;
//              scaledlm: the column scales permuted in shared memory (per 8 columns: the even ones,
//                       then the odd ones) and read with ldmatrix.x4, every row address of a
//                       matrix the same 16 bytes: each thread gets its 4 columns of two 8-column
//                       groups per instruction, 8 per k-tile;
//              scaledg: as scaled, with the column scales read from global memory (a 16 KB array
//                       that stays in L1) instead of shared memory;
//              scaled128: the column scales permuted in shared memory so that each thread's 32
//                       are contiguous, read 16 bytes (four columns) per load;
//   schedule   overlap: k-tile t+1's wgmmas run while t's partial sums are promoted (two partial
//                       fragments: 192 accumulator registers, 2 warpgroups at most);
//              serial:  each warpgroup waits for its k-tile and then promotes (one partial fragment:
//                       128 registers, room for 3 consumer warpgroups beside a producer warpgroup).
//
// It answers: would a kernel with 3 consumer warpgroups on a 192x128 tile (serial promotion), a
// 128x192 tile, or another way of getting the column scales to the registers keep the tensor cores
// busier than gmoe's 2 warpgroups on 128x128 (overlapped, 8-byte loads)? A producer warpgroup is
// launched as in the real kernels (its registers given back with setmaxnreg) and does nothing.
// Results: bench/results/2026-11-26-h100-wgmma-promotion-microbench.md.
//
// Build: cmake --build --preset default --target gmoe-microbench-wgmma-promotion, or by hand:
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//        -I.deps/cutlass/include tools/microbench/wgmma_promotion.cu -o wgmma_promotion
// Run: ./wgmma_promotion [k_tiles=16384] [reps=5]   (prints one line per configuration and rep)
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cutlass/arch/reg_reconfig.h>

namespace gmoe_microbench {

using namespace cute;

enum class Promotion { none, add, scaled, scaledr, scaled128, scaledp, scaledlm, scaledg };
enum class Schedule { overlap, serial };

constexpr int kStages = 4;
constexpr int kTileK = 128;
constexpr int kWgM = 64;  // rows per consumer warpgroup

using Fp8 = cutlass::float_e4m3_t;
template <int kN>
using MmaOp = decltype(GMMA::ss_op_selector<Fp8, Fp8, float, Shape<_64, Int<kN>, _32>>());
using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Fp8>{},
                                           make_shape(Int<kWgM>{}, Int<kTileK>{}, Int<kStages>{})));
template <int kN>
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Fp8>{},
                                           make_shape(Int<kN>{}, Int<kTileK>{}, Int<kStages>{})));

template <int kWg, int kTileN>
struct Smem {
  alignas(1024) Fp8 a[kWg][cosize_v<SmemLayoutA>];
  alignas(1024) Fp8 b[cosize_v<SmemLayoutB<kTileN>>];
  alignas(16) float sfa[kStages][kWg * kWgM];
  alignas(16) float sfb[kStages][kTileN];
};

template <int kWg, Schedule S, Promotion P, int kTileN = 128>
__global__ void __launch_bounds__((kWg + 1) * 128, 1) consumer_kernel(int k_tiles, float* out, const float* gscales) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  using SmemT = Smem<kWg, kTileN>;
  auto& smem = *reinterpret_cast<SmemT*>(smem_raw);

  // Random e4m3 operands (|x| < 2, no NaN) and scales near 1.
  {
    auto* bytes = reinterpret_cast<uint32_t*>(&smem);
    const int words = static_cast<int>(offsetof(SmemT, sfa) / 4);
    for (int i = threadIdx.x; i < words; i += blockDim.x) {
      uint32_t h = (i + 1) * 2654435761u ^ (blockIdx.x * 40503u);
      h ^= h >> 13;
      h *= 0x5bd1e995u;
      bytes[i] = h & 0xbfbfbfbfu;
    }
    for (int i = threadIdx.x; i < kStages * kWg * kWgM; i += blockDim.x) (&smem.sfa[0][0])[i] = 1.0f + 1e-3f * (i % 7);
    for (int i = threadIdx.x; i < kStages * kTileN; i += blockDim.x) (&smem.sfb[0][0])[i] = 1.0f - 1e-3f * (i % 5);
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == kWg) {  // the producer warpgroup: nothing to load here
    cutlass::arch::warpgroup_reg_dealloc<40>();
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<kWg == 2 ? 232 : 152>();

  const int tid = threadIdx.x % 128;
  const int lane = tid % 32;
  const int row = (tid / 32) * 16 + lane / 4;  // this thread's rows: row and row + 8
  auto tiled_mma = make_tiled_mma(MmaOp<kTileN>{});
  auto thr = tiled_mma.get_slice(tid);
  Tensor sA = make_tensor(make_smem_ptr(smem.a[wg]), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem.b), SmemLayoutB<kTileN>{});
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor accum = partition_fragment_C(tiled_mma, Shape<Int<kWgM>, Int<kTileN>>{});
  static_assert(size(decltype(accum){}) == kTileN / 2, "m64nN f32: N/2 accumulators per thread");
  clear(accum);

  auto issue = [&](auto& part, int stage) {
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    warpgroup_fence_operand(part);
    warpgroup_arrive();
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < size<2>(tCrA); ++k) {
      cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), part);
      tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    }
    warpgroup_commit_batch();
    warpgroup_fence_operand(part);
  };
  // Column scales held in registers (scaledr): four pairs, loaded once and reused (the arithmetic
  // of `scaled` without its loads; 8 registers, so that 3 warpgroups do not spill).
  float2 sb_reg[4];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < 4; ++j) sb_reg[j] = *reinterpret_cast<const float2*>(&smem.sfb[0][8 * j + 2 * (lane % 4)]);

  // scaledp: the k-tile's scales, loaded ahead of the wgmma wait.
  float2 sb_pre[kTileN / 8];
  float sa_pre0 = 0.f, sa_pre1 = 0.f;
  auto prepare = [&](int stage) {
    if constexpr (P == Promotion::scaledp) {
      sa_pre0 = smem.sfa[stage][wg * kWgM + row];
      sa_pre1 = smem.sfa[stage][wg * kWgM + row + 8];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kTileN / 8; ++j) sb_pre[j] = *reinterpret_cast<const float2*>(&smem.sfb[stage][8 * j + 2 * (lane % 4)]);
    }
  };
  auto promote = [&](auto& part, int stage) {
    warpgroup_fence_operand(part);
    warpgroup_fence_operand(accum);
    if constexpr (P == Promotion::add) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += part(i);
    } else if constexpr (P == Promotion::scaledp) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kTileN / 8; ++j) {
        const float2 sb = sb_pre[j];
        accum(4 * j + 0) = fmaf(part(4 * j + 0) * sb.x, sa_pre0, accum(4 * j + 0));
        accum(4 * j + 1) = fmaf(part(4 * j + 1) * sb.y, sa_pre0, accum(4 * j + 1));
        accum(4 * j + 2) = fmaf(part(4 * j + 2) * sb.x, sa_pre1, accum(4 * j + 2));
        accum(4 * j + 3) = fmaf(part(4 * j + 3) * sb.y, sa_pre1, accum(4 * j + 3));
      }
    } else if constexpr (P == Promotion::scaledlm) {
      static_assert(kTileN == 128, "8 ldmatrix.x4 of 16 columns each");
      const float sa0 = smem.sfa[stage][wg * kWgM + row];
      const float sa1 = smem.sfa[stage][wg * kWgM + row + 8];
      const uint32_t base = cute::cast_smem_ptr_to_uint(&smem.sfb[stage][0]) + 16 * (lane / 8);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 8; ++i) {
        uint32_t r0, r1, r2, r3;
        asm("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                     : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                     : "r"(base + 64 * i));
        const float sb[4] = {__uint_as_float(r0), __uint_as_float(r1), __uint_as_float(r2), __uint_as_float(r3)};
        CUTLASS_PRAGMA_UNROLL
        for (int g = 0; g < 2; ++g) {
          const int j = 2 * i + g;
          accum(4 * j + 0) = fmaf(part(4 * j + 0) * sb[2 * g], sa0, accum(4 * j + 0));
          accum(4 * j + 1) = fmaf(part(4 * j + 1) * sb[2 * g + 1], sa0, accum(4 * j + 1));
          accum(4 * j + 2) = fmaf(part(4 * j + 2) * sb[2 * g], sa1, accum(4 * j + 2));
          accum(4 * j + 3) = fmaf(part(4 * j + 3) * sb[2 * g + 1], sa1, accum(4 * j + 3));
        }
      }
    } else if constexpr (P == Promotion::scaled128) {
      static_assert(kTileN == 128, "the permuted scales are laid out for 128 columns");
      // The column scales permuted (column_slot below): this thread's 32 are contiguous, read as
      // eight 16-byte loads, each of one wavefront (the four column groups of a warp in distinct
      // banks).
      const float sa0 = smem.sfa[stage][wg * kWgM + row];
      const float sa1 = smem.sfa[stage][wg * kWgM + row + 8];
      const int q = lane % 4;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < 8; ++i) {
        const float4 sb = *reinterpret_cast<const float4*>(&smem.sfb[stage][q * 32 + 4 * (i ^ q)]);
        const int j = 2 * i;
        accum(4 * j + 0) = fmaf(part(4 * j + 0) * sb.x, sa0, accum(4 * j + 0));
        accum(4 * j + 1) = fmaf(part(4 * j + 1) * sb.y, sa0, accum(4 * j + 1));
        accum(4 * j + 2) = fmaf(part(4 * j + 2) * sb.x, sa1, accum(4 * j + 2));
        accum(4 * j + 3) = fmaf(part(4 * j + 3) * sb.y, sa1, accum(4 * j + 3));
        accum(4 * j + 4) = fmaf(part(4 * j + 4) * sb.z, sa0, accum(4 * j + 4));
        accum(4 * j + 5) = fmaf(part(4 * j + 5) * sb.w, sa0, accum(4 * j + 5));
        accum(4 * j + 6) = fmaf(part(4 * j + 6) * sb.z, sa1, accum(4 * j + 6));
        accum(4 * j + 7) = fmaf(part(4 * j + 7) * sb.w, sa1, accum(4 * j + 7));
      }
    } else if constexpr (P == Promotion::scaled || P == Promotion::scaledr || P == Promotion::scaledg) {
      const float sa0 = smem.sfa[stage][wg * kWgM + row];
      const float sa1 = smem.sfa[stage][wg * kWgM + row + 8];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kTileN / 8; ++j) {
        float2 sb;
        if constexpr (P == Promotion::scaled) {
          sb = *reinterpret_cast<const float2*>(&smem.sfb[stage][8 * j + 2 * (lane % 4)]);
        } else if constexpr (P == Promotion::scaledg) {
          sb = __ldg(reinterpret_cast<const float2*>(gscales + stage * kTileN + 8 * j + 2 * (lane % 4)));
        } else {
          sb = sb_reg[j % 4];
        }
        accum(4 * j + 0) = fmaf(part(4 * j + 0) * sb.x, sa0, accum(4 * j + 0));
        accum(4 * j + 1) = fmaf(part(4 * j + 1) * sb.y, sa0, accum(4 * j + 1));
        accum(4 * j + 2) = fmaf(part(4 * j + 2) * sb.x, sa1, accum(4 * j + 2));
        accum(4 * j + 3) = fmaf(part(4 * j + 3) * sb.y, sa1, accum(4 * j + 3));
      }
    }
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(part);
  };

  Tensor part0 = make_fragment_like(accum);
  Tensor part1 = make_fragment_like(accum);
  if constexpr (P == Promotion::none) {
    // wgmmas only, into one fragment, the next k-tile's batch issued before the last one is
    // waited for (as CUTLASS's plain mainloop).
    clear(part0);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < k_tiles; ++t) {
      const int stage = t % kStages;
      warpgroup_fence_operand(part0);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) cute::gemm(tiled_mma, tCrA(_, _, k, stage), tCrB(_, _, k, stage), part0);
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      warpgroup_fence_operand(part0);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(part0);
    float s = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < size(part0); ++i) s += part0(i);
    out[(blockIdx.x * kWg + wg) * 128 + tid] = s;
    return;
  } else if constexpr (S == Schedule::serial) {
    CUTLASS_PRAGMA_NO_UNROLL
    for (int t = 0; t < k_tiles; ++t) {
      const int stage = t % kStages;
      issue(part0, stage);
      prepare(stage);
      warpgroup_wait<0>();
      promote(part0, stage);
    }
  } else {
    static_assert(kWg == 2, "the overlapped schedule's three fragments fit two consumer warpgroups");
    issue(part0, 0);
    int t = 0;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; t + 2 < k_tiles; t += 2) {
      issue(part1, (t + 1) % kStages);
      prepare(t % kStages);
      warpgroup_wait<1>();
      promote(part0, t % kStages);
      issue(part0, (t + 2) % kStages);
      prepare((t + 1) % kStages);
      warpgroup_wait<1>();
      promote(part1, (t + 1) % kStages);
    }
    // The tail branches as gmoe's loop does: with an unconditional tail ptxas serializes every
    // wgmma of the kernel (C7514).
    if (t + 1 < k_tiles) {
      issue(part1, (t + 1) % kStages);
      prepare(t % kStages);
      warpgroup_wait<1>();
      promote(part0, t % kStages);
      prepare((t + 1) % kStages);
      warpgroup_wait<0>();
      promote(part1, (t + 1) % kStages);
    } else {
      prepare(t % kStages);
      warpgroup_wait<0>();
      promote(part0, t % kStages);
    }
  }
  float s = 0.f;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(accum); ++i) s += accum(i);
  out[(blockIdx.x * kWg + wg) * 128 + tid] = s;
}

struct Config {
  const char* name;
  int wg;
  int n;
  void (*kernel)(int, float*, const float*);
  size_t smem;
};

template <int kWg, Schedule S, Promotion P, int kN = 128>
Config make(const char* name) {
  return Config{name, kWg, kN, consumer_kernel<kWg, S, P, kN>, sizeof(Smem<kWg, kN>) + 1024};
}

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

}  // namespace gmoe_microbench

using namespace gmoe_microbench;

int main(int argc, char** argv) {
  const int k_tiles = argc > 1 ? std::atoi(argv[1]) : 16384;
  const int reps = argc > 2 ? std::atoi(argv[2]) : 5;
  if (k_tiles < 2 || k_tiles % 2 != 0) {
    std::fprintf(stderr, "k_tiles must be even and >= 2\n");
    return 2;
  }
  int sms = 0;
  check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), "sm count");
  cudaDeviceProp prop{};
  check(cudaGetDeviceProperties(&prop, 0), "properties");
  std::vector<Config> configs = {
      make<2, Schedule::overlap, Promotion::none>("2wg none"),
      make<2, Schedule::overlap, Promotion::add>("2wg overlap add"),
      make<2, Schedule::overlap, Promotion::scaled>("2wg overlap scaled"),
      make<2, Schedule::overlap, Promotion::scaledr>("2wg overlap scaledr"),
      make<2, Schedule::overlap, Promotion::scaled128>("2wg overlap scaled128"),
      make<2, Schedule::overlap, Promotion::scaledg>("2wg overlap scaledg"),
      make<2, Schedule::serial, Promotion::scaled>("2wg serial scaled"),
      make<2, Schedule::serial, Promotion::scaled128>("2wg serial scaled128"),
      make<2, Schedule::overlap, Promotion::scaledp>("2wg overlap scaledp"),
      make<2, Schedule::serial, Promotion::scaledp>("2wg serial scaledp"),
      make<2, Schedule::overlap, Promotion::scaledlm>("2wg overlap scaledlm"),
      make<2, Schedule::serial, Promotion::scaledlm>("2wg serial scaledlm"),
      make<2, Schedule::serial, Promotion::none, 192>("2wg n192 none"),
      make<2, Schedule::serial, Promotion::add, 192>("2wg n192 serial add"),
      make<2, Schedule::serial, Promotion::scaled, 192>("2wg n192 serial scaled"),
      make<2, Schedule::serial, Promotion::scaledr, 192>("2wg n192 serial scaledr"),
      make<3, Schedule::serial, Promotion::none>("3wg none"),
      make<3, Schedule::serial, Promotion::add>("3wg serial add"),
      make<3, Schedule::serial, Promotion::scaled>("3wg serial scaled"),
      make<3, Schedule::serial, Promotion::scaledr>("3wg serial scaledr"),
      make<3, Schedule::serial, Promotion::scaledg>("3wg serial scaledg"),
      make<3, Schedule::serial, Promotion::scaled128>("3wg serial scaled128"),
      make<3, Schedule::serial, Promotion::scaledp>("3wg serial scaledp"),
      make<3, Schedule::serial, Promotion::scaledlm>("3wg serial scaledlm"),
  };
  float* out = nullptr;
  check(cudaMalloc(&out, sizeof(float) * sms * 3 * 128), "malloc");
  float* gscales = nullptr;  // scaledg's column scales: kStages x 192 floats near 1
  {
    std::vector<float> h(4096);
    for (size_t i = 0; i < h.size(); ++i) h[i] = 1.0f - 1e-3f * (i % 5);
    check(cudaMalloc(&gscales, sizeof(float) * h.size()), "malloc");
    check(cudaMemcpy(gscales, h.data(), sizeof(float) * h.size(), cudaMemcpyHostToDevice), "copy");
  }
  for (auto& c : configs) {
    check(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(c.smem)),
          "smem attribute");
  }
  cudaEvent_t e0, e1;
  check(cudaEventCreate(&e0), "event");
  check(cudaEventCreate(&e1), "event");
  std::printf("# %s, %d SMs, k_tiles %d per warpgroup tile; TFLOP/s and cycles per 128x128x128 of work per SM\n",
              prop.name, sms, k_tiles);
  // Warm the clocks up, then interleave the configurations rep by rep.
  for (int w = 0; w < 3; ++w)
    for (auto& c : configs) c.kernel<<<sms, (c.wg + 1) * 128, c.smem>>>(k_tiles, out, gscales);
  check(cudaDeviceSynchronize(), "warm-up");
  for (int r = 0; r < reps; ++r) {
    for (auto& c : configs) {
      check(cudaEventRecord(e0), "record");
      c.kernel<<<sms, (c.wg + 1) * 128, c.smem>>>(k_tiles, out, gscales);
      check(cudaEventRecord(e1), "record");
      check(cudaEventSynchronize(e1), "sync");
      check(cudaGetLastError(), c.name);
      float ms = 0.f;
      check(cudaEventElapsedTime(&ms, e0, e1), "elapsed");
      const double flop = 2.0 * c.wg * kWgM * c.n * kTileK * static_cast<double>(k_tiles) * sms;
      const double tiles_per_sm = static_cast<double>(c.wg) * kWgM * c.n * k_tiles / (128.0 * 128.0);  // 128x128x128 units
      std::printf("%-22s rep %d  %8.3f ms  %7.1f TFLOP/s  %6.0f ns per 128^3 k-tile per SM\n", c.name, r, ms,
                  flop / (ms * 1e-3) / 1e12, ms * 1e6 / tiles_per_sm);
    }
  }
  check(cudaFree(out), "free");
  check(cudaFree(gscales), "free");
  return 0;
}
