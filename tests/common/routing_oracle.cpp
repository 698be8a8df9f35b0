// tests/common/routing_oracle.cpp — see routing_oracle.h.
#include "common/routing_oracle.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <sstream>

namespace gmoe::test {
namespace {

constexpr double kFdStep = 1e-5;

std::vector<double> scores(const double* x, int64_t E, RouterScore kind) {
  std::vector<double> s(x, x + E);
  if (kind == RouterScore::softmax) {
    const double m = *std::max_element(s.begin(), s.end());
    double sum = 0;
    for (double& v : s) sum += (v = std::exp(v - m));
    for (double& v : s) v /= sum;
  } else {
    for (double& v : s) v = 1.0 / (1.0 + std::exp(-v));
  }
  return s;
}

// Indices 0..n-1 ordered by value descending, ties by index (stable sort of an ascending index list).
std::vector<int64_t> rank_desc(const std::vector<double>& v) {
  std::vector<int64_t> idx(v.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return v[a] > v[b]; });
  return idx;
}

// Central differences of f (a function of one token's E logits) at x: the gradient [E].
std::vector<double> fd_gradient(std::vector<double> x, const std::function<double(const std::vector<double>&)>& f) {
  std::vector<double> g(x.size());
  for (size_t e = 0; e < x.size(); ++e) {
    const double x0 = x[e];
    x[e] = x0 + kFdStep;
    const double up = f(x);
    x[e] = x0 - kFdStep;
    const double down = f(x);
    x[e] = x0;
    g[e] = (up - down) / (2 * kFdStep);
  }
  return g;
}

double lse(const std::vector<double>& x) {
  const double m = *std::max_element(x.begin(), x.end());
  double s = 0;
  for (double v : x) s += std::exp(v - m);
  return m + std::log(s);
}

}  // namespace

OracleRoute oracle_topk(const std::vector<double>& logits, int64_t T, int64_t E, const RouterOptions& o,
                        const std::vector<double>& bias) {
  OracleRoute r;
  const int64_t k = o.top_k;
  r.ids.resize(T * k);
  r.probs.resize(T * k);
  r.counts.assign(E, 0);
  r.choice.resize(T * E);
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> s = scores(&logits[t * E], E, o.score);
    std::vector<double> choice(E);
    for (int64_t e = 0; e < E; ++e) choice[e] = s[e] + (bias.empty() ? 0.0 : bias[e]);
    std::copy(choice.begin(), choice.end(), r.choice.begin() + t * E);
    std::vector<double> masked = choice;
    if (o.n_group > 1) {
      const int64_t gs = E / o.n_group;
      const int64_t m = std::min(std::max<int64_t>(1, k / o.topk_group), gs);
      std::vector<double> gscore(o.n_group);
      for (int64_t g = 0; g < o.n_group; ++g) {
        std::vector<double> in(choice.begin() + g * gs, choice.begin() + (g + 1) * gs);
        std::sort(in.begin(), in.end(), std::greater<double>());
        gscore[g] = std::accumulate(in.begin(), in.begin() + m, 0.0);
      }
      const std::vector<int64_t> order = rank_desc(gscore);
      std::vector<bool> keep(o.n_group, false);
      for (int64_t i = 0; i < o.topk_group; ++i) keep[order[i]] = true;
      for (int64_t e = 0; e < E; ++e) {
        if (!keep[e / gs]) masked[e] = -std::numeric_limits<double>::infinity();
      }
    }
    const std::vector<int64_t> order = rank_desc(masked);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += s[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = order[j];
      r.ids[t * k + j] = static_cast<int32_t>(e);
      r.probs[t * k + j] = (o.normalize ? s[e] / (sum + 1e-20) : s[e]) * o.scaling_factor;
      ++r.counts[e];
    }
  }
  return r;
}

std::vector<double> oracle_topk_backward(const std::vector<double>& logits, int64_t T, int64_t E,
                                         const std::vector<int32_t>& ids, const std::vector<double>& dprobs,
                                         const RouterOptions& o) {
  const int64_t k = o.top_k;
  std::vector<double> d(T * E);
  for (int64_t t = 0; t < T; ++t) {
    auto objective = [&](const std::vector<double>& x) {
      const std::vector<double> s = scores(x.data(), E, o.score);
      double sum = 0, L = 0;
      for (int64_t j = 0; j < k; ++j) sum += s[ids[t * k + j]];
      for (int64_t j = 0; j < k; ++j) {
        const double g = s[ids[t * k + j]];
        L += dprobs[t * k + j] * (o.normalize ? g / (sum + 1e-20) : g) * o.scaling_factor;
      }
      return L;
    };
    const std::vector<double> g =
        fd_gradient(std::vector<double>(logits.begin() + t * E, logits.begin() + (t + 1) * E), objective);
    std::copy(g.begin(), g.end(), d.begin() + t * E);
  }
  return d;
}

namespace {
// The aux loss's distribution of one token.
std::vector<double> aux_q(const double* x, int64_t E, RouterScore kind) {
  std::vector<double> q = scores(x, E, kind);
  if (kind == RouterScore::sigmoid) {
    const double s = std::accumulate(q.begin(), q.end(), 0.0);
    for (double& v : q) v /= s + 1e-20;
  }
  return q;
}
double aux_factor(int64_t T, int64_t E, const RouterOptions& o, double coeff) {
  return T == 0 ? 0.0 : coeff * double(E) / (double(T) * double(T) * double(o.top_k));
}
}  // namespace

double oracle_aux_loss(const std::vector<double>& logits, int64_t T, int64_t E, const std::vector<int64_t>& counts,
                       const RouterOptions& o, double coeff) {
  double acc = 0;
  for (int64_t t = 0; t < T; ++t) {
    const std::vector<double> q = aux_q(&logits[t * E], E, o.score);
    for (int64_t e = 0; e < E; ++e) acc += double(counts[e]) * q[e];
  }
  return acc * aux_factor(T, E, o, coeff);
}

std::vector<double> oracle_aux_loss_grad(const std::vector<double>& logits, int64_t T, int64_t E,
                                         const std::vector<int64_t>& counts, const RouterOptions& o, double coeff,
                                         double dloss) {
  std::vector<double> d(T * E);
  const double f = aux_factor(T, E, o, coeff) * dloss;
  for (int64_t t = 0; t < T; ++t) {
    auto objective = [&](const std::vector<double>& x) {
      const std::vector<double> q = aux_q(x.data(), E, o.score);
      double acc = 0;
      for (int64_t e = 0; e < E; ++e) acc += double(counts[e]) * q[e];
      return acc * f;
    };
    const std::vector<double> g =
        fd_gradient(std::vector<double>(logits.begin() + t * E, logits.begin() + (t + 1) * E), objective);
    std::copy(g.begin(), g.end(), d.begin() + t * E);
  }
  return d;
}

double oracle_z_loss(const std::vector<double>& logits, int64_t T, int64_t E, double coeff) {
  double acc = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double l = lse(std::vector<double>(logits.begin() + t * E, logits.begin() + (t + 1) * E));
    acc += l * l;
  }
  return T == 0 ? 0.0 : coeff * acc / double(T);
}

std::vector<double> oracle_z_loss_grad(const std::vector<double>& logits, int64_t T, int64_t E, double coeff,
                                       double dloss) {
  std::vector<double> d(T * E);
  for (int64_t t = 0; t < T; ++t) {
    auto objective = [&](const std::vector<double>& x) {
      const double l = lse(x);
      return dloss * coeff * l * l / double(T);
    };
    const std::vector<double> g =
        fd_gradient(std::vector<double>(logits.begin() + t * E, logits.begin() + (t + 1) * E), objective);
    std::copy(g.begin(), g.end(), d.begin() + t * E);
  }
  return d;
}

OraclePermutation oracle_permutation(const std::vector<int32_t>& ids, int64_t T, int64_t k, int64_t E, int64_t rows,
                                     const PermuteOptions& options) {
  OraclePermutation p;
  std::vector<int64_t> pairs(T * k);
  std::iota(pairs.begin(), pairs.end(), 0);
  std::stable_sort(pairs.begin(), pairs.end(), [&](int64_t a, int64_t b) { return ids[a] < ids[b]; });
  const int64_t cap = options.capacity_factor > 0
                          ? static_cast<int64_t>(std::ceil(options.capacity_factor * double(T) * double(k) / double(E)))
                          : T * k;
  p.row_of.assign(T * k, -1);
  p.src_token.assign(rows, -1);
  p.counts.assign(E, 0);
  int64_t row = 0;
  size_t i = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t taken = 0;
    for (; i < pairs.size() && ids[pairs[i]] == e; ++i) {
      if (taken < cap) {
        p.row_of[pairs[i]] = static_cast<int32_t>(row + taken);
        p.src_token[row + taken] = static_cast<int32_t>(pairs[i] / k);
        ++taken;
      } else {
        ++p.dropped;
      }
    }
    const int64_t m = options.pad_multiple;
    p.counts[e] = (taken + m - 1) / m * m;
    row += p.counts[e];
  }
  return p;
}

namespace {

// The gather-sum accumulated in Acc (double: the exact sum; float: the own-precision one), slots in
// order. The inputs are already rounded values, so casting them to float is exact.
template <typename Acc>
std::vector<double> gather_sum(const std::vector<double>& src, int64_t H, const std::vector<int32_t>& row_of,
                               int64_t T, int64_t k, const std::vector<double>& w) {
  std::vector<Acc> acc(T * H, Acc(0));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row_of[t * k + j];
      if (r < 0) continue;
      const Acc wt = w.empty() ? Acc(1) : static_cast<Acc>(w[t * k + j]);
      for (int64_t h = 0; h < H; ++h) acc[t * H + h] += wt * static_cast<Acc>(src[r * H + h]);
    }
  }
  return std::vector<double>(acc.begin(), acc.end());
}

template <typename Acc>
std::vector<double> combine_dprobs(const std::vector<double>& dout, const std::vector<double>& y, int64_t H,
                                   const std::vector<int32_t>& row_of, int64_t T, int64_t k) {
  std::vector<Acc> acc(T * k, Acc(0));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t r = row_of[t * k + j];
      for (int64_t h = 0; h < H && r >= 0; ++h) {
        acc[t * k + j] += static_cast<Acc>(dout[t * H + h]) * static_cast<Acc>(y[r * H + h]);
      }
    }
  }
  return std::vector<double>(acc.begin(), acc.end());
}

}  // namespace

ExactResult oracle_gather_sum(const std::vector<double>& src, int64_t H, const std::vector<int32_t>& row_of,
                              int64_t T, int64_t k, const std::vector<double>& w) {
  ExactResult r;
  r.value = gather_sum<double>(src, H, row_of, T, k, w);
  r.f32 = gather_sum<float>(src, H, row_of, T, k, w);
  r.reduction = k;
  return r;
}

ExactResult oracle_combine_dprobs(const std::vector<double>& dout, const std::vector<double>& y, int64_t H,
                                  const std::vector<int32_t>& row_of, int64_t T, int64_t k) {
  ExactResult r;
  r.value = combine_dprobs<double>(dout, y, H, row_of, T, k);
  r.f32 = combine_dprobs<float>(dout, y, H, row_of, T, k);
  r.reduction = H;
  return r;
}

::testing::AssertionResult all_close(const std::vector<double>& got, const std::vector<double>& want, double atol,
                                     double rtol, const std::string& what) {
  if (got.size() != want.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << want.size();
  }
  int64_t bad = 0, worst = -1;
  double worst_excess = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]), tol = atol + rtol * std::fabs(want[i]);
    if (!(err <= tol)) {
      ++bad;
      const double excess = std::isnan(err) ? std::numeric_limits<double>::infinity() : err - tol;
      if (worst < 0 || excess > worst_excess) worst = static_cast<int64_t>(i), worst_excess = excess;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << got.size() << " outside atol " << atol
                                       << " + rtol " << rtol << "; worst [" << worst << "] got " << got[worst]
                                       << ", expected " << want[worst];
}

::testing::AssertionResult same_selection(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                                          const std::vector<double>& choice, int64_t T, int64_t E, int64_t k,
                                          double tie_tol, int64_t* swapped) {
  *swapped = 0;
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "ids: sizes differ";
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int32_t a = got[t * k + j], b = want[t * k + j];
      if (a == b) continue;
      const bool in_range = a >= 0 && a < E && b >= 0 && b < E;
      if (in_range && std::fabs(choice[t * E + a] - choice[t * E + b]) <= tie_tol) {
        ++*swapped;
        continue;
      }
      return ::testing::AssertionFailure()
             << "ids[" << t << ", " << j << "] = " << a << ", expected " << b
             << (in_range ? " (not a near-tie: choices " : "")
             << (in_range ? std::to_string(choice[t * E + a]) + " vs " + std::to_string(choice[t * E + b]) + ")"
                          : std::string());
    }
  }
  return ::testing::AssertionSuccess();
}

std::vector<int64_t> histogram(const std::vector<int32_t>& ids, int64_t E) {
  std::vector<int64_t> h(E, 0);
  for (int32_t id : ids) ++h.at(id);
  return h;
}

std::vector<int32_t> int32_values(const HostTensor& t) {
  std::vector<int32_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<int32_t>(t.get(i));
  return v;
}
std::vector<int64_t> int64_values(const HostTensor& t) {
  std::vector<int64_t> v(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<int64_t>(t.get(i));
  return v;
}

RouterOptions router_options(int64_t k, RouterScore score, bool normalize, int64_t n_group, int64_t topk_group,
                             float scaling_factor) {
  RouterOptions o;
  o.top_k = k;
  o.score = score;
  o.normalize = normalize;
  o.n_group = n_group;
  o.topk_group = topk_group;
  o.scaling_factor = scaling_factor;
  return o;
}

HostTensor random_routing(int64_t T, int64_t E, int64_t k, Rng& rng, double hot) {
  HostTensor ids(DType::i32, {T, k});
  const int64_t hot_experts = std::min<int64_t>(E, 4);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int> taken(E, 0);
    for (int64_t j = 0; j < k; ++j) {
      int64_t e;
      do {
        e = rng.uniform(0, 1) < hot ? rng.integer(0, hot_experts - 1) : rng.integer(0, E - 1);
      } while (taken[e]);
      taken[e] = 1;
      ids.set(t * k + j, double(e));
    }
  }
  return ids;
}

PermuteOptions popts(int64_t pad, double cf) {
  PermuteOptions o;
  o.pad_multiple = pad;
  o.capacity_factor = cf;
  return o;
}

}  // namespace gmoe::test
