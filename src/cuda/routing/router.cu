// src/cuda/routing/router.cu — the router on the device: top-k, its backward, the aux load-balancing
// loss and the z-loss with their gradients (gmoe/routing.h).
//
// One warp per token. The lanes stride over the token's E experts; the scores and the selection
// values sit in the warp's slice of shared memory. The top-k is k rounds of a warp arg-max under
// route::ranks_above (a strict total order: higher value, NaN last, lower id), each round taking
// the best expert ranked below the previous round's: no marks, and the same experts as the CPU
// backend for the same selection values. Group-limited routing first ranks the groups the same way
// (lanes own groups, n_group <= 64 so the kept groups fit one 64-bit mask).
//
// The counts are integers: each block histograms its tokens in shared memory and adds the histogram
// to the zeroed device counts with integer atomics, so they are exact whatever the order.
// The losses' sums over tokens are deterministic: fixed chunks of tokens reduced in order, then one
// block reducing the chunks in order (no float atomics).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "common/backend.h"
#include "common/routing_math.h"
#include "cuda/routing/routing_common.cuh"
#include "cuda/runtime/cuda_check.h"
#include "cuda/runtime/device_errors.h"
#include "cuda/runtime/device_info.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe::cuda_backend {
namespace routing {

int grid_for(int64_t work, int per_block) {
  const int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(blocks, int64_t(sm_count(current_device())) * 16)));
}

}  // namespace routing

namespace {

using routing::to_f;
using routing::warp_max;
using routing::warp_sum;

constexpr int kMaxGroups = 64;  // the kept groups are one 64-bit mask
constexpr int kSharedBudget = 48 * 1024;
constexpr int kReduceThreads = 256;  // the final loss reductions
constexpr int64_t kAuxMaxChunks = 256;  // the aux loss's partial column sums, at most

// Tokens per partial column sum of the aux loss: a power of two from 64 up, so that there are at
// most kAuxMaxChunks partials for the final block to add per expert. A function of T alone, so the
// summation order (and the loss's bits) is the same on every device.
int64_t aux_chunk_tokens(int64_t T) {
  int64_t c = 64;
  while (c * kAuxMaxChunks < T) c *= 2;
  return c;
}

// Warps per block for `floats_per_warp` floats of shared memory each, plus `fixed` bytes.
int warps_for(int64_t floats_per_warp, int64_t fixed) {
  const int64_t w = (kSharedBudget - fixed) / (floats_per_warp * 4);
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(8, w)));
}

struct TopkArgs {
  const void* logits;
  const float* bias;  // or nullptr
  int64_t T;
  int E, k, n_group, topk_group, group_terms;
  RouterScore score;
  bool normalize, by_logit;
  float scale;
  int32_t* ids;
  float* probs;
  void* counts;
  bool counts_i64;
};

// The scores of one token into s[E] (the warp's slice), lanes striding; returns nothing, leaves s
// complete after __syncwarp. softmax: expf(x - max) / Σ; sigmoid: route::sigmoid.
template <typename T>
__device__ void token_scores(const T* x, int E, RouterScore score, float* s) {
  const int lane = threadIdx.x & 31;
  if (score == RouterScore::softmax) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, to_f(x[e]));
    m = warp_max(m);
    float sum = 0.f;
    for (int e = lane; e < E; e += 32) sum += expf(to_f(x[e]) - m);
    sum = warp_sum(sum);
    for (int e = lane; e < E; e += 32) s[e] = expf(to_f(x[e]) - m) / sum;
  } else {
    for (int e = lane; e < E; e += 32) s[e] = route::sigmoid(to_f(x[e]));
  }
  __syncwarp();
}

// Warp arg-max of (v, i) under route::ranks_above; i < 0 is "none" and ranks last.
__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, d);
    const int oi = __shfl_xor_sync(0xffffffffu, i, d);
    if (oi >= 0 && (i < 0 || route::ranks_above(ov, oi, v, i))) {
      v = ov;
      i = oi;
    }
  }
}

template <typename T>
__global__ void router_topk_kernel(TopkArgs a) {
  extern __shared__ float smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  int* hist = reinterpret_cast<int*>(smem);
  float* s = smem + a.E + warp * 2 * a.E;
  float* choice = s + a.E;
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int gsize = a.E / a.n_group;
  for (int64_t t = blockIdx.x * int64_t(warps) + warp; t < a.T; t += int64_t(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(a.logits) + t * a.E;
    token_scores(x, a.E, a.score, s);
    for (int e = lane; e < a.E; e += 32) {
      choice[e] = a.by_logit ? to_f(x[e]) : s[e] + (a.bias ? a.bias[e] : 0.f);
    }
    __syncwarp();
    uint64_t kept = ~uint64_t{0};
    if (a.n_group > 1) {
      float gs[2];
      for (int r = 0; r < 2; ++r) {
        const int g = lane + 32 * r;
        gs[r] = g < a.n_group ? route::group_score(choice + g * gsize, gsize, a.group_terms) : 0.f;
      }
      kept = 0;
      float prev_v = 0.f;
      int prev = -1;
      for (int round = 0; round < a.topk_group; ++round) {
        float v = 0.f;
        int best = -1;
        for (int r = 0; r < 2; ++r) {
          const int g = lane + 32 * r;
          if (g >= a.n_group || (prev >= 0 && !route::ranks_above(prev_v, prev, gs[r], g))) continue;
          if (best < 0 || route::ranks_above(gs[r], g, v, best)) v = gs[r], best = g;
        }
        warp_best(v, best);
        kept |= uint64_t{1} << best;
        prev = best;
        prev_v = v;
      }
    }
    float prev_v = 0.f, sum = 0.f;
    int prev = -1;
    for (int j = 0; j < a.k; ++j) {
      float v = 0.f;
      int best = -1;
      for (int e = lane; e < a.E; e += 32) {
        if (a.n_group > 1 && !((kept >> (e / gsize)) & 1u)) continue;
        const float c = choice[e];
        if (prev >= 0 && !route::ranks_above(prev_v, prev, c, e)) continue;
        if (best < 0 || route::ranks_above(c, e, v, best)) v = c, best = e;
      }
      warp_best(v, best);
      if (lane == 0) {
        a.ids[t * a.k + j] = best;
        atomicAdd(&hist[best], 1);
      }
      sum += s[best];
      prev = best;
      prev_v = v;
    }
    __syncwarp();  // lane 0's ids visible to the lanes that read them back
    for (int j = lane; j < a.k; j += 32) {
      const float p = s[a.ids[t * a.k + j]];
      a.probs[t * a.k + j] = (a.normalize ? p / (sum + route::kNormEps) : p) * a.scale;
    }
    __syncwarp();
  }
  __syncthreads();
  for (int e = threadIdx.x; e < a.E; e += blockDim.x) {
    if (hist[e] == 0) continue;
    if (a.counts_i64) {
      atomicAdd(static_cast<unsigned long long*>(a.counts) + e, static_cast<unsigned long long>(hist[e]));
    } else {
      atomicAdd(static_cast<int*>(a.counts) + e, hist[e]);
    }
  }
}

struct GradArgs {
  const void* logits;
  int64_t T;
  int E;
  void* dlogits;
  DType dlogits_dtype;
  bool accumulate;
};

__device__ __forceinline__ void store_grad(const GradArgs& a, int64_t i, float v) {
  if (a.dlogits_dtype == DType::f32) {
    float* d = static_cast<float*>(a.dlogits);
    d[i] = a.accumulate ? d[i] + v : v;
  } else if (a.dlogits_dtype == DType::bf16) {
    __nv_bfloat16* d = static_cast<__nv_bfloat16*>(a.dlogits);
    d[i] = __float2bfloat16_rn(a.accumulate ? __bfloat162float(d[i]) + v : v);
  } else {
    __half* d = static_cast<__half*>(a.dlogits);
    d[i] = __float2half_rn(a.accumulate ? __half2float(d[i]) + v : v);
  }
}

// router_topk_backward: per token, dg from dprobs (route::probs_backward, lane 0), scattered into
// dscore[E], then through the softmax or the sigmoids.
template <typename T>
__global__ void router_topk_backward_kernel(GradArgs a, const int32_t* ids, const float* dprobs, int k,
                                            RouterScore score, bool normalize, float scale, uint32_t* error_word) {
  extern __shared__ float smem[];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  float* s = smem + warp * (2 * a.E + 3 * k);
  float* dscore = s + a.E;
  float* g = dscore + a.E;
  float* dp = g + k;
  float* dg = dp + k;
  for (int64_t t = blockIdx.x * int64_t(warps) + warp; t < a.T; t += int64_t(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(a.logits) + t * a.E;
    token_scores(x, a.E, score, s);
    for (int e = lane; e < a.E; e += 32) dscore[e] = 0.f;
    __syncwarp();
    if (lane == 0) {
      bool bad = false;
      for (int j = 0; j < k; ++j) {
        const int32_t e = ids[t * k + j];
        bad = bad || e < 0 || e >= a.E;
        g[j] = (e >= 0 && e < a.E) ? s[e] : 0.f;
        dp[j] = dprobs[t * k + j];
      }
      route::probs_backward(g, dp, k, normalize, scale, dg);
      for (int j = 0; j < k; ++j) {
        const int32_t e = ids[t * k + j];
        if (e >= 0 && e < a.E) dscore[e] += dg[j];
      }
      if (bad) atomicOr(error_word, kDeviceErrorRoutingIndexOutOfRange);
    }
    __syncwarp();
    if (score == RouterScore::softmax) {
      float dot = 0.f;
      for (int e = lane; e < a.E; e += 32) dot += dscore[e] * s[e];
      dot = warp_sum(dot);
      for (int e = lane; e < a.E; e += 32) store_grad(a, t * a.E + e, s[e] * (dscore[e] - dot));
    } else {
      for (int e = lane; e < a.E; e += 32) store_grad(a, t * a.E + e, dscore[e] * s[e] * (1.f - s[e]));
    }
    __syncwarp();
  }
}

// The aux loss's distribution q of one token, element e, given the token's statistics: softmax
// (stat_a = max, stat_b = Σ exp) or normalised sigmoid (stat_b = Σ σ).
struct AuxStats {
  float m, sum;
};
template <typename T>
__device__ AuxStats aux_stats(const T* x, int E, RouterScore score) {
  const int lane = threadIdx.x & 31;
  AuxStats st{0.f, 0.f};
  if (score == RouterScore::softmax) {
    float m = -INFINITY;
    for (int e = lane; e < E; e += 32) m = fmaxf(m, to_f(x[e]));
    st.m = warp_max(m);
    for (int e = lane; e < E; e += 32) st.sum += expf(to_f(x[e]) - st.m);
  } else {
    for (int e = lane; e < E; e += 32) st.sum += route::sigmoid(to_f(x[e]));
  }
  st.sum = warp_sum(st.sum);
  return st;
}

// Stage 1 of the aux loss: partial[chunk, e] = Σ over the chunk's tokens of q[t, e]. Warp w of a
// block takes the chunk's tokens w, w + warps, ... into its own row of shared sums; the block then
// adds the warps' rows in warp order.
template <typename T>
__global__ void aux_partial_kernel(const void* logits, int64_t Tn, int E, RouterScore score, int64_t chunk_tokens,
                                   float* partial) {
  extern __shared__ float acc[];  // [warps][E]
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  float* mine = acc + warp * E;
  for (int e = lane; e < E; e += 32) mine[e] = 0.f;
  const int64_t t0 = int64_t(blockIdx.x) * chunk_tokens;
  const int64_t t1 = min(t0 + chunk_tokens, Tn);
  for (int64_t t = t0 + warp; t < t1; t += warps) {
    const T* x = static_cast<const T*>(logits) + t * E;
    const AuxStats st = aux_stats(x, E, score);
    for (int e = lane; e < E; e += 32) {
      const float v = to_f(x[e]);
      mine[e] +=
          score == RouterScore::softmax ? expf(v - st.m) / st.sum : route::sigmoid(v) / (st.sum + route::kNormEps);
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    float s = 0.f;
    for (int w = 0; w < warps; ++w) s += acc[w * E + e];
    partial[int64_t(blockIdx.x) * E + e] = s;
  }
}

// One block: out = factor · Σ_c (Σ_r partial[r, c]) · (counts ? counts[c] : 1), every sum in a
// fixed order (rows in order per column, columns strided per thread, then a shared-memory tree).
__global__ void __launch_bounds__(kReduceThreads)
    reduce_loss_kernel(const float* partial, int64_t rows, int64_t cols, const void* counts, bool counts_i64,
                       float factor, float* out) {
  __shared__ float red[kReduceThreads];
  float acc = 0.f;
  for (int64_t c = threadIdx.x; c < cols; c += kReduceThreads) {
    float col = 0.f;
    for (int64_t r = 0; r < rows; ++r) col += partial[r * cols + c];
    if (counts != nullptr) {
      col *= counts_i64 ? float(static_cast<const int64_t*>(counts)[c]) : float(static_cast<const int32_t*>(counts)[c]);
    }
    acc += col;
  }
  red[threadIdx.x] = acc;
  __syncthreads();
  for (int d = kReduceThreads / 2; d > 0; d >>= 1) {
    if (threadIdx.x < d) red[threadIdx.x] += red[threadIdx.x + d];
    __syncthreads();
  }
  if (threadIdx.x == 0) *out = red[0] * factor;
}

// The aux loss's gradient: dq[e] = factor · counts[e] · dloss, through q (softmax, or sigmoids
// normalised to sum 1), one warp per token.
template <typename T>
__global__ void aux_backward_kernel(GradArgs a, RouterScore score, const void* counts, bool counts_i64, float factor,
                                    const float* dloss) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const float f = factor * (dloss ? *dloss : 1.f);
  auto dq = [&](int e) {
    return f *
           (counts_i64 ? float(static_cast<const int64_t*>(counts)[e]) : float(static_cast<const int32_t*>(counts)[e]));
  };
  for (int64_t t = blockIdx.x * int64_t(warps) + warp; t < a.T; t += int64_t(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(a.logits) + t * a.E;
    const AuxStats st = aux_stats(x, a.E, score);
    float dot = 0.f;
    for (int e = lane; e < a.E; e += 32) {
      const float v = to_f(x[e]);
      dot += dq(e) * (score == RouterScore::softmax ? expf(v - st.m) / st.sum : route::sigmoid(v));
    }
    dot = warp_sum(dot);
    for (int e = lane; e < a.E; e += 32) {
      const float v = to_f(x[e]);
      if (score == RouterScore::softmax) {
        const float s = expf(v - st.m) / st.sum;
        store_grad(a, t * a.E + e, s * (dq(e) - dot));
      } else {
        const float s = route::sigmoid(v), d = st.sum + route::kNormEps;
        store_grad(a, t * a.E + e, (dq(e) / d - dot / (d * d)) * s * (1.f - s));
      }
    }
  }
}

// z-loss: lse2[t] = logsumexp(x_t)²; with `a.dlogits`, the gradient factor · lse · softmax instead.
template <typename T>
__global__ void z_loss_kernel(GradArgs a, float* lse2, float factor, const float* dloss) {
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  for (int64_t t = blockIdx.x * int64_t(warps) + warp; t < a.T; t += int64_t(gridDim.x) * warps) {
    const T* x = static_cast<const T*>(a.logits) + t * a.E;
    float m = -INFINITY;
    for (int e = lane; e < a.E; e += 32) m = fmaxf(m, to_f(x[e]));
    m = warp_max(m);
    float sum = 0.f;
    for (int e = lane; e < a.E; e += 32) sum += expf(to_f(x[e]) - m);
    sum = warp_sum(sum);
    const float lse = m + logf(sum);
    if (lse2 != nullptr) {
      if (lane == 0) lse2[t] = lse * lse;
      continue;
    }
    const float f = factor * (dloss ? *dloss : 1.f) * lse;
    for (int e = lane; e < a.E; e += 32) store_grad(a, t * a.E + e, (expf(to_f(x[e]) - m) / sum) * f);
  }
}

void check_cuda_router(int64_t E, const RouterOptions& o) {
  GMOE_CHECK(E <= routing::kMaxRoutingExperts, "logits: at most ", routing::kMaxRoutingExperts,
             " experts on CUDA, got ", E);
  GMOE_CHECK(o.n_group <= kMaxGroups, "options.n_group: at most ", kMaxGroups, " groups on CUDA, got ", o.n_group);
}

constexpr int kTokenWarps = 8;  // warps per block of the kernels without per-warp shared memory

double aux_factor(int64_t T, int64_t E, const RouterOptions& o, float coeff) {
  return T == 0 ? 0.0 : double(coeff) * double(E) / (double(T) * double(T) * double(o.top_k));
}

GradArgs grad_args(const TensorView& logits, const TensorView& dlogits, bool accumulate) {
  return GradArgs{logits.data, logits.size(0), int(logits.size(1)), dlogits.data, dlogits.dtype, accumulate};
}

}  // namespace

void router_topk(const TensorView& logits, const RouterOptions& o, const TensorView& ids, const TensorView& probs,
                 const TensorView& counts, const TensorView& score_bias, Stream stream, Allocator&) {
  const int64_t T = logits.size(0), E = logits.size(1);
  check_cuda_router(E, o);
  GMOE_CUDA_CHECK(cudaMemsetAsync(counts.data, 0, counts.nbytes(), stream));
  if (T == 0) return;
  TopkArgs a{};
  a.logits = logits.data;
  a.bias = score_bias.defined() ? static_cast<const float*>(score_bias.data) : nullptr;
  a.T = T;
  a.E = int(E);
  a.k = int(o.top_k);
  a.n_group = int(o.n_group);
  a.topk_group = int(o.topk_group);
  a.group_terms = route::group_terms(o.top_k, o.topk_group, E / o.n_group);
  a.score = o.score;
  a.normalize = o.normalize;
  a.by_logit = route::choice_is_logit(score_bias.defined(), o.n_group);
  a.scale = o.scaling_factor;
  a.ids = static_cast<int32_t*>(ids.data);
  a.probs = static_cast<float*>(probs.data);
  a.counts = counts.data;
  a.counts_i64 = counts.dtype == DType::i64;
  const int warps = warps_for(2 * E, 4 * E);
  const size_t smem = size_t(4) * (E + size_t(warps) * 2 * E);
  routing::with_logit_type(logits.dtype, [&](auto t) {
    using T_ = decltype(t);
    router_topk_kernel<T_><<<routing::grid_for(T, warps), warps * 32, smem, stream>>>(a);
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void router_topk_backward(const TensorView& logits, const TensorView& ids, const TensorView& dprobs,
                          const RouterOptions& o, const TensorView& dlogits, bool accumulate, Stream stream,
                          Allocator&) {
  const int64_t T = logits.size(0), E = logits.size(1), k = o.top_k;
  check_cuda_router(E, o);
  if (T == 0) return;
  const int warps = warps_for(2 * E + 3 * k, 0);
  const size_t smem = size_t(4) * warps * (2 * E + 3 * k);
  const GradArgs a = grad_args(logits, dlogits, accumulate);
  routing::with_logit_type(logits.dtype, [&](auto t) {
    using T_ = decltype(t);
    router_topk_backward_kernel<T_><<<routing::grid_for(T, warps), warps * 32, smem, stream>>>(
        a, static_cast<const int32_t*>(ids.data), static_cast<const float*>(dprobs.data), int(k), o.score, o.normalize,
        o.scaling_factor, device_error_word());
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void router_aux_loss(const TensorView& logits, const TensorView& counts, const RouterOptions& o, float coeff,
                     const TensorView& loss, Stream stream, Allocator& alloc) {
  const int64_t T = logits.size(0), E = logits.size(1);
  check_cuda_router(E, o);
  const int64_t chunk_tokens = aux_chunk_tokens(T);
  const int64_t chunks = (T + chunk_tokens - 1) / chunk_tokens;
  Buffer partial(alloc, size_t(std::max<int64_t>(chunks, 1)) * E * sizeof(float), stream);
  if (chunks > 0) {
    const int warps = warps_for(E, 0);
    routing::with_logit_type(logits.dtype, [&](auto t) {
      using T_ = decltype(t);
      aux_partial_kernel<T_><<<unsigned(chunks), warps * 32, size_t(4) * warps * E, stream>>>(
          logits.data, T, int(E), o.score, chunk_tokens, static_cast<float*>(partial.data()));
    });
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  reduce_loss_kernel<<<1, kReduceThreads, 0, stream>>>(
      static_cast<const float*>(partial.data()), chunks, E, counts.data, counts.dtype == DType::i64,
      static_cast<float>(aux_factor(T, E, o, coeff)), static_cast<float*>(loss.data));
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void router_aux_loss_backward(const TensorView& logits, const TensorView& counts, const RouterOptions& o, float coeff,
                              const TensorView& dloss, const TensorView& dlogits, bool accumulate, Stream stream,
                              Allocator&) {
  const int64_t T = logits.size(0), E = logits.size(1);
  check_cuda_router(E, o);
  if (T == 0) return;
  const GradArgs a = grad_args(logits, dlogits, accumulate);
  routing::with_logit_type(logits.dtype, [&](auto t) {
    using T_ = decltype(t);
    aux_backward_kernel<T_><<<routing::grid_for(T, kTokenWarps), kTokenWarps * 32, 0, stream>>>(
        a, o.score, counts.data, counts.dtype == DType::i64, static_cast<float>(aux_factor(T, E, o, coeff)),
        dloss.defined() ? static_cast<const float*>(dloss.data) : nullptr);
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void router_z_loss(const TensorView& logits, float coeff, const TensorView& loss, Stream stream, Allocator& alloc) {
  const int64_t T = logits.size(0), E = logits.size(1);
  check_cuda_router(E, RouterOptions{});
  Buffer lse2(alloc, size_t(std::max<int64_t>(T, 1)) * sizeof(float), stream);
  if (T > 0) {
    routing::with_logit_type(logits.dtype, [&](auto t) {
      using T_ = decltype(t);
      z_loss_kernel<T_><<<routing::grid_for(T, kTokenWarps), kTokenWarps * 32, 0, stream>>>(
          GradArgs{logits.data, T, int(E), nullptr, DType::f32, false}, static_cast<float*>(lse2.data()), 0.f, nullptr);
    });
    GMOE_CUDA_CHECK(cudaGetLastError());
  }
  // [1 row, T columns]: the threads stride over the tokens.
  reduce_loss_kernel<<<1, kReduceThreads, 0, stream>>>(
      static_cast<const float*>(lse2.data()), T > 0 ? 1 : 0, T, nullptr, false,
      T == 0 ? 0.f : static_cast<float>(double(coeff) / double(T)), static_cast<float*>(loss.data));
  GMOE_CUDA_CHECK(cudaGetLastError());
}

void router_z_loss_backward(const TensorView& logits, float coeff, const TensorView& dloss, const TensorView& dlogits,
                            bool accumulate, Stream stream, Allocator&) {
  const int64_t T = logits.size(0), E = logits.size(1);
  check_cuda_router(E, RouterOptions{});
  if (T == 0) return;
  routing::with_logit_type(logits.dtype, [&](auto t) {
    using T_ = decltype(t);
    z_loss_kernel<T_><<<routing::grid_for(T, kTokenWarps), kTokenWarps * 32, 0, stream>>>(
        grad_args(logits, dlogits, accumulate), nullptr, static_cast<float>(2.0 * double(coeff) / double(T)),
        dloss.defined() ? static_cast<const float*>(dloss.data) : nullptr);
  });
  GMOE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gmoe::cuda_backend
