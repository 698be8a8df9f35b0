// src/cpu/routing_cpu.cpp — reference router top-k and losses, permute and combine: plain loops
// in f32, sums in index order, the formulas of src/common/routing_math.h. The ids and maps are on
// the host here, so one out of range throws (the CUDA backend records it in the device error word).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "common/backend.h"
#include "common/float_convert.h"
#include "common/routing_math.h"
#include "gmoe/error.h"

namespace gmoe::cpu_backend {
namespace {

int64_t load_int(const TensorView& t, int64_t i) {
  return t.dtype == DType::i64 ? static_cast<const int64_t*>(t.data)[i]
                               : static_cast<int64_t>(static_cast<const int32_t*>(t.data)[i]);
}
void store_int(const TensorView& t, int64_t i, int64_t v) {
  if (t.dtype == DType::i64) {
    static_cast<int64_t*>(t.data)[i] = v;
  } else {
    static_cast<int32_t*>(t.data)[i] = static_cast<int32_t>(v);
  }
}

// One token's logits as f32.
void load_row(const TensorView& logits, int64_t t, std::vector<float>& x) {
  const int64_t E = logits.size(1);
  for (int64_t e = 0; e < E; ++e) x[e] = load_float(logits.data, logits.dtype, t * E + e);
}

// softmax(x) in place; returns logsumexp.
float softmax_inplace(std::vector<float>& x) {
  float m = -std::numeric_limits<float>::infinity();
  for (float v : x) m = std::fmax(m, v);
  float sum = 0.f;
  for (float& v : x) {
    v = expf(v - m);
    sum += v;
  }
  for (float& v : x) v /= sum;
  return m + logf(sum);
}

// The router's scores of one token (softmax, or one sigmoid per logit).
void scores_of(const std::vector<float>& x, RouterScore kind, std::vector<float>& s) {
  s = x;
  if (kind == RouterScore::softmax) {
    softmax_inplace(s);
  } else {
    for (float& v : s) v = route::sigmoid(v);
  }
}

// The aux loss's per-token distribution q: softmax, or the sigmoids normalised to sum 1.
void aux_distribution(const std::vector<float>& x, RouterScore kind, std::vector<float>& q) {
  scores_of(x, kind, q);
  if (kind == RouterScore::sigmoid) {
    float sum = 0.f;
    for (float v : q) sum += v;
    for (float& v : q) v /= sum + route::kNormEps;
  }
}

// dlogits[t, :] (+)= d, rounded to dlogits' dtype.
void store_grad_row(const TensorView& dlogits, int64_t t, const std::vector<float>& d, bool accumulate) {
  const int64_t E = dlogits.size(1);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t i = t * E + e;
    const float prev = accumulate ? load_float(dlogits.data, dlogits.dtype, i) : 0.f;
    store_float(dlogits.data, dlogits.dtype, i, accumulate ? prev + d[e] : d[e]);
  }
}

float loss_grad_scale(const TensorView& dloss) {
  return dloss.defined() ? *static_cast<const float*>(dloss.data) : 1.f;
}

// The backward of a per-token distribution through its logits: softmax (q = softmax(x)), or the
// sigmoids normalised to sum 1 (q = σ / (Σσ + eps)). dq -> dx.
void distribution_backward(const std::vector<float>& x, RouterScore kind, const std::vector<float>& dq,
                           std::vector<float>& dx) {
  const size_t E = x.size();
  std::vector<float> s;
  scores_of(x, kind, s);
  if (kind == RouterScore::softmax) {
    float dot = 0.f;
    for (size_t e = 0; e < E; ++e) dot += dq[e] * s[e];
    for (size_t e = 0; e < E; ++e) dx[e] = s[e] * (dq[e] - dot);
    return;
  }
  float sum = 0.f, dot = 0.f;
  for (size_t e = 0; e < E; ++e) {
    sum += s[e];
    dot += dq[e] * s[e];
  }
  const float d = sum + route::kNormEps;
  for (size_t e = 0; e < E; ++e) dx[e] = (dq[e] / d - dot / (d * d)) * s[e] * (1.f - s[e]);
}

int32_t checked_row(const TensorView& row_of, int64_t i, int64_t rows) {
  const int32_t r = static_cast<const int32_t*>(row_of.data)[i];
  GMOE_CHECK(r >= -1 && r < rows, "map.row_of[", i, "] = ", r, " is outside [-1, ", rows, ")");
  return r;
}

}  // namespace

void router_topk(const TensorView& logits, const RouterOptions& o, const TensorView& ids, const TensorView& probs,
                 const TensorView& counts, const TensorView& score_bias) {
  const int64_t T = logits.size(0), E = logits.size(1), k = o.top_k;
  const bool has_bias = score_bias.defined();
  const bool by_logit = route::choice_is_logit(has_bias, o.n_group);
  const int64_t gsize = E / o.n_group;
  const int m = route::group_terms(k, o.topk_group, gsize);
  std::vector<float> x(E), s(E), choice(E), gscore(o.n_group);
  std::vector<int64_t> hist(E, 0);
  std::vector<char> eligible(E);
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, x);
    scores_of(x, o.score, s);
    for (int64_t e = 0; e < E; ++e) {
      choice[e] = by_logit ? x[e] : s[e] + (has_bias ? static_cast<const float*>(score_bias.data)[e] : 0.f);
    }
    std::fill(eligible.begin(), eligible.end(), 1);
    if (o.n_group > 1) {
      for (int64_t g = 0; g < o.n_group; ++g) gscore[g] = route::group_score(&choice[g * gsize], int(gsize), m);
      std::fill(eligible.begin(), eligible.end(), 0);
      int prev = -1;
      for (int64_t r = 0; r < o.topk_group; ++r) {
        int best = -1;
        for (int g = 0; g < int(o.n_group); ++g) {
          if (prev >= 0 && !route::ranks_above(gscore[prev], prev, gscore[g], g)) continue;
          if (best < 0 || route::ranks_above(gscore[g], g, gscore[best], best)) best = g;
        }
        for (int64_t e = best * gsize; e < (best + 1) * gsize; ++e) eligible[e] = 1;
        prev = best;
      }
    }
    int prev = -1;
    std::vector<float> p(k);
    for (int64_t j = 0; j < k; ++j) {
      int best = -1;
      for (int e = 0; e < int(E); ++e) {
        if (!eligible[e]) continue;
        if (prev >= 0 && !route::ranks_above(choice[prev], prev, choice[e], e)) continue;
        if (best < 0 || route::ranks_above(choice[e], e, choice[best], best)) best = e;
      }
      static_cast<int32_t*>(ids.data)[t * k + j] = best;
      p[j] = s[best];
      ++hist[best];
      prev = best;
    }
    float sum = 0.f;
    for (float v : p) sum += v;
    for (int64_t j = 0; j < k; ++j) {
      const float v = o.normalize ? p[j] / (sum + route::kNormEps) : p[j];
      static_cast<float*>(probs.data)[t * k + j] = v * o.scaling_factor;
    }
  }
  for (int64_t e = 0; e < E; ++e) store_int(counts, e, hist[e]);
}

void router_topk_backward(const TensorView& logits, const TensorView& ids, const TensorView& dprobs,
                          const RouterOptions& o, const TensorView& dlogits, bool accumulate) {
  const int64_t T = logits.size(0), E = logits.size(1), k = o.top_k;
  std::vector<float> x(E), s(E), dscore(E), dx(E), g(k), dp(k), dg(k);
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, x);
    scores_of(x, o.score, s);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = static_cast<const int32_t*>(ids.data)[t * k + j];
      GMOE_CHECK(e >= 0 && e < E, "ids[", t, ", ", j, "] = ", e, " is outside [0, ", E, ")");
      g[j] = s[e];
      dp[j] = static_cast<const float*>(dprobs.data)[t * k + j];
    }
    route::probs_backward(g.data(), dp.data(), int(k), o.normalize, o.scaling_factor, dg.data());
    std::fill(dscore.begin(), dscore.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) dscore[static_cast<const int32_t*>(ids.data)[t * k + j]] += dg[j];
    if (o.score == RouterScore::softmax) {
      float dot = 0.f;
      for (int64_t e = 0; e < E; ++e) dot += dscore[e] * s[e];
      for (int64_t e = 0; e < E; ++e) dx[e] = s[e] * (dscore[e] - dot);
    } else {
      for (int64_t e = 0; e < E; ++e) dx[e] = dscore[e] * s[e] * (1.f - s[e]);
    }
    store_grad_row(dlogits, t, dx, accumulate);
  }
}

void router_aux_loss(const TensorView& logits, const TensorView& counts, const RouterOptions& o, float coeff,
                     const TensorView& loss) {
  const int64_t T = logits.size(0), E = logits.size(1);
  std::vector<float> x(E), q(E), colsum(E, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, x);
    aux_distribution(x, o.score, q);
    for (int64_t e = 0; e < E; ++e) colsum[e] += q[e];
  }
  float acc = 0.f;
  for (int64_t e = 0; e < E; ++e) acc += static_cast<float>(load_int(counts, e)) * colsum[e];
  const double factor = T == 0 ? 0.0 : double(coeff) * double(E) / (double(T) * double(T) * double(o.top_k));
  *static_cast<float*>(loss.data) = acc * static_cast<float>(factor);
}

void router_aux_loss_backward(const TensorView& logits, const TensorView& counts, const RouterOptions& o, float coeff,
                              const TensorView& dloss, const TensorView& dlogits, bool accumulate) {
  const int64_t T = logits.size(0), E = logits.size(1);
  if (T == 0) return;
  const float factor = static_cast<float>(double(coeff) * double(E) / (double(T) * double(T) * double(o.top_k))) *
                       loss_grad_scale(dloss);
  std::vector<float> x(E), dq(E), dx(E);
  for (int64_t e = 0; e < E; ++e) dq[e] = factor * static_cast<float>(load_int(counts, e));
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, x);
    distribution_backward(x, o.score, dq, dx);
    store_grad_row(dlogits, t, dx, accumulate);
  }
}

void router_z_loss(const TensorView& logits, float coeff, const TensorView& loss) {
  const int64_t T = logits.size(0), E = logits.size(1);
  std::vector<float> x(E);
  float acc = 0.f;
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, x);
    const float lse = softmax_inplace(x);
    acc += lse * lse;
  }
  *static_cast<float*>(loss.data) = T == 0 ? 0.f : acc * static_cast<float>(double(coeff) / double(T));
}

void router_z_loss_backward(const TensorView& logits, float coeff, const TensorView& dloss, const TensorView& dlogits,
                            bool accumulate) {
  const int64_t T = logits.size(0), E = logits.size(1);
  if (T == 0) return;
  const float factor = static_cast<float>(2.0 * double(coeff) / double(T)) * loss_grad_scale(dloss);
  std::vector<float> x(E);
  for (int64_t t = 0; t < T; ++t) {
    load_row(logits, t, x);
    const float lse = softmax_inplace(x);
    for (float& v : x) v *= factor * lse;
    store_grad_row(dlogits, t, x, accumulate);
  }
}

void permute(const TensorView& x, const TensorView& ids, const PermuteOptions& options, const TensorView& permuted,
             const TensorView& counts, const RoutingMap& map, const TensorView& probs, const TensorView& permuted_probs,
             const TensorView& dropped) {
  const int64_t T = x.size(0), H = x.size(1), k = ids.size(1), E = counts.size(0);
  const int64_t rows = permuted.size(0), pad = options.pad_multiple;
  const int64_t cap_opt = expert_capacity(T, k, E, options);
  const int64_t cap = cap_opt < 0 ? std::numeric_limits<int64_t>::max() : cap_opt;
  const int32_t* id = static_cast<const int32_t*>(ids.data);
  std::vector<int64_t> seen(E, 0), pos(static_cast<size_t>(T * k));
  for (int64_t i = 0; i < T * k; ++i) {
    GMOE_CHECK(id[i] >= 0 && id[i] < E, "ids[", i / k, ", ", i % k, "] = ", id[i], " is outside [0, ", E, ")");
    pos[i] = seen[id[i]]++;  // (token, slot) order: stable
  }
  std::vector<int64_t> offset(E + 1, 0);
  int64_t n_dropped = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t kept = std::min(seen[e], cap);
    n_dropped += seen[e] - kept;
    const int64_t group = (kept + pad - 1) / pad * pad;
    offset[e + 1] = offset[e] + group;
    store_int(counts, e, group);
  }
  int32_t* src = static_cast<int32_t*>(map.src_token.data);
  std::fill(src, src + rows, -1);
  int32_t* row_of = static_cast<int32_t*>(map.row_of.data);
  for (int64_t i = 0; i < T * k; ++i) {
    const bool kept = pos[i] < cap;
    row_of[i] = kept ? static_cast<int32_t>(offset[id[i]] + pos[i]) : -1;
    if (kept) src[row_of[i]] = static_cast<int32_t>(i / k);
  }
  const size_t es = dtype_size(x.dtype), row_bytes = static_cast<size_t>(H) * es;
  // H == 0 views may be null, and memcpy/memset take no null pointer even for 0 bytes.
  for (int64_t r = 0; row_bytes > 0 && r < rows; ++r) {
    char* dst = static_cast<char*>(permuted.data) + r * permuted.stride(0) * es;
    if (src[r] < 0) {
      std::memset(dst, 0, row_bytes);
    } else {
      std::memcpy(dst, static_cast<const char*>(x.data) + src[r] * x.stride(0) * es, row_bytes);
    }
  }
  if (probs.defined()) {
    float* pp = static_cast<float*>(permuted_probs.data);
    std::fill(pp, pp + rows, 0.f);
    for (int64_t i = 0; i < T * k; ++i) {
      if (row_of[i] >= 0) pp[row_of[i]] = static_cast<const float*>(probs.data)[i];
    }
  }
  if (dropped.defined()) store_int(dropped, 0, n_dropped);
}

// A combine with weights 1 (p·y with p = 1 is y exactly), then the probabilities gathered.
void permute_backward(const TensorView& dpermuted, const RoutingMap& map, const TensorView& dx,
                      const TensorView& dpermuted_probs, const TensorView& dprobs) {
  cpu_backend::combine(dpermuted, map, TensorView{}, dx);
  if (!dprobs.defined()) return;
  const int64_t n = map.row_of.numel(), rows = dpermuted.size(0);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t r = checked_row(map.row_of, i, rows);
    static_cast<float*>(dprobs.data)[i] = r >= 0 ? static_cast<const float*>(dpermuted_probs.data)[r] : 0.f;
  }
}

void combine(const TensorView& expert_out, const RoutingMap& map, const TensorView& probs, const TensorView& out) {
  const int64_t T = out.size(0), H = out.size(1), k = map.row_of.size(1), rows = expert_out.size(0);
  std::vector<float> acc(H);
  for (int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = checked_row(map.row_of, t * k + j, rows);
      if (r < 0) continue;
      const float p = probs.defined() ? static_cast<const float*>(probs.data)[t * k + j] : 1.f;
      for (int64_t h = 0; h < H; ++h) {
        acc[h] += p * load_float(expert_out.data, expert_out.dtype, r * expert_out.stride(0) + h);
      }
    }
    for (int64_t h = 0; h < H; ++h) store_float(out.data, out.dtype, t * out.stride(0) + h, acc[h]);
  }
}

void combine_backward(const TensorView& dout, const RoutingMap& map, const TensorView& probs,
                      const TensorView& expert_out, const TensorView& dexpert_out, const TensorView& dprobs) {
  const int64_t T = dout.size(0), H = dout.size(1), k = map.row_of.size(1), rows = dexpert_out.size(0);
  const size_t es = dtype_size(dexpert_out.dtype);
  for (int64_t r = 0; H > 0 && r < rows; ++r) {
    std::memset(static_cast<char*>(dexpert_out.data) + r * dexpert_out.stride(0) * es, 0, static_cast<size_t>(H) * es);
  }
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = checked_row(map.row_of, t * k + j, rows);
      const float p = probs.defined() ? static_cast<const float*>(probs.data)[t * k + j] : 1.f;
      float dot = 0.f;
      for (int64_t h = 0; h < H && r >= 0; ++h) {
        const float g = load_float(dout.data, dout.dtype, t * dout.stride(0) + h);
        store_float(dexpert_out.data, dexpert_out.dtype, r * dexpert_out.stride(0) + h, p * g);
        if (dprobs.defined()) dot += g * load_float(expert_out.data, expert_out.dtype, r * expert_out.stride(0) + h);
      }
      if (dprobs.defined()) static_cast<float*>(dprobs.data)[t * k + j] = dot;
    }
  }
}

}  // namespace gmoe::cpu_backend
