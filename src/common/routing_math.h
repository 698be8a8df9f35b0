// src/common/routing_math.h — the router's per-token formulas, shared by the CPU and CUDA backends.
//
// One definition of the ranking (a total order: higher value first, NaN last, then lower id), of
// the scores, of a group's score and of the gradients, compiled for the host and (under nvcc) the
// device, so both backends select the same experts from the same choice values and evaluate the
// same expressions. Accurate math functions (expf, logf), no fast-math intrinsics.
#pragma once

#include <math.h>

#include <cstdint>

#include "gmoe/routing.h"

#ifdef __CUDACC__
#define GMOE_ROUTE_FN __host__ __device__ __forceinline__
#else
#define GMOE_ROUTE_FN inline
#endif

namespace gmoe::route {

/// The normalisation's guard against a zero sum (Megatron's and DeepSeek-V3's 1e-20).
constexpr float kNormEps = 1e-20f;

/// Whether (a, ia) ranks above (b, ib): the higher value, any number above NaN, then the lower id.
/// A strict total order over distinct ids, so the top-k is unique on every backend.
GMOE_ROUTE_FN bool ranks_above(float a, int ia, float b, int ib) {
  const bool na = isnan(a), nb = isnan(b);
  if (na != nb) return nb;
  if (!na && a != b) return a > b;
  return ia < ib;
}

GMOE_ROUTE_FN float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

/// Whether the choice values are the logits themselves (no bias, no groups): they rank as the
/// scores do, without the rounding of exp that could tie two different logits.
GMOE_ROUTE_FN bool choice_is_logit(bool has_bias, int64_t n_group) { return !has_bias && n_group <= 1; }

/// The number of choices summed into a group's score: top_k / topk_group, at least 1, at most the
/// group size.
GMOE_ROUTE_FN int group_terms(int64_t top_k, int64_t topk_group, int64_t group_size) {
  int64_t m = top_k / (topk_group > 0 ? topk_group : 1);
  m = m < 1 ? 1 : m;
  return static_cast<int>(m < group_size ? m : group_size);
}

/// A group's score: the sum of its best m choices in rank order (choice[0 .. size) of the group,
/// ids relative to the group's first). Each pass takes the best below the previous one, so no
/// marks are needed.
GMOE_ROUTE_FN float group_score(const float* choice, int size, int m) {
  float sum = 0.f;
  int prev = -1;
  for (int r = 0; r < m; ++r) {
    int best = -1;
    for (int e = 0; e < size; ++e) {
      if (prev >= 0 && !ranks_above(choice[prev], prev, choice[e], e)) continue;
      if (best < 0 || ranks_above(choice[e], e, choice[best], best)) best = e;
    }
    sum += choice[best];
    prev = best;
  }
  return sum;
}

/// The gradient of the probabilities with respect to the k raw scores g_j = score[ids[j]]:
/// p_j = s·g_j / (Σ g + eps) (normalize) or s·g_j. dg[j] from dp[j].
GMOE_ROUTE_FN void probs_backward(const float* g, const float* dp, int k, bool normalize, float scale, float* dg) {
  if (!normalize) {
    for (int j = 0; j < k; ++j) dg[j] = scale * dp[j];
    return;
  }
  float sum = 0.f, dot = 0.f;
  for (int j = 0; j < k; ++j) {
    sum += g[j];
    dot += dp[j] * g[j];
  }
  const float d = sum + kNormEps;
  for (int j = 0; j < k; ++j) dg[j] = scale * (dp[j] / d - dot / (d * d));
}

}  // namespace gmoe::route
