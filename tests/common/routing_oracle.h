// tests/common/routing_oracle.h — the routing ops of gmoe/routing.h computed independently for the
// test suites: in fp64, with sorts instead of the library's selection loops, gradients by central
// finite differences of the fp64 forward (not from the library's formulas), and the permutation by
// a stable sort of the (token, slot) pairs by expert. Plus the comparisons the suites share.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "common/harness.h"
#include "gmoe/routing.h"

namespace gmoe::test {

/// The router's result: ids [T, k], probs [T, k], counts [E], and each token's selection values.
struct OracleRoute {
  std::vector<int32_t> ids;
  std::vector<double> probs;
  std::vector<int64_t> counts;
  std::vector<double> choice;  ///< [T, E]: score (+ bias), what the selection ranks
};
/// logits [T, E] as doubles (the rounded inputs), bias [E] or empty.
OracleRoute oracle_topk(const std::vector<double>& logits, int64_t T, int64_t E, const RouterOptions& o,
                        const std::vector<double>& bias);

/// d(Σ dprobs·probs)/dlogits [T, E] with the selection `ids` held fixed (finite differences).
std::vector<double> oracle_topk_backward(const std::vector<double>& logits, int64_t T, int64_t E,
                                         const std::vector<int32_t>& ids, const std::vector<double>& dprobs,
                                         const RouterOptions& o);

/// The aux loss with the counts fixed, and its gradient [T, E] times dloss (finite differences).
double oracle_aux_loss(const std::vector<double>& logits, int64_t T, int64_t E, const std::vector<int64_t>& counts,
                       const RouterOptions& o, double coeff);
std::vector<double> oracle_aux_loss_grad(const std::vector<double>& logits, int64_t T, int64_t E,
                                         const std::vector<int64_t>& counts, const RouterOptions& o, double coeff,
                                         double dloss);
/// The z-loss and its gradient times dloss (finite differences).
double oracle_z_loss(const std::vector<double>& logits, int64_t T, int64_t E, double coeff);
std::vector<double> oracle_z_loss_grad(const std::vector<double>& logits, int64_t T, int64_t E, double coeff,
                                       double dloss);

/// The permutation of T tokens' ids [T, k] over E experts into `rows` rows.
struct OraclePermutation {
  std::vector<int64_t> counts;     ///< padded group sizes
  std::vector<int32_t> row_of;     ///< [T, k], -1 dropped
  std::vector<int32_t> src_token;  ///< [rows], -1 padding / past the total
  int64_t dropped = 0;
};
OraclePermutation oracle_permutation(const std::vector<int32_t>& ids, int64_t T, int64_t k, int64_t E, int64_t rows,
                                     const PermuteOptions& options);

/// Σ_j w[t, j] · src[row_of[t, j], :]: the combine (w = probs) and the permute's backward (w empty:
/// 1). src: [rows, H]. In fp64, and in f32 slot by slot (the own-precision reference of
/// common/tolerance.h); the reduction is k.
ExactResult oracle_gather_sum(const std::vector<double>& src, int64_t H, const std::vector<int32_t>& row_of,
                              int64_t T, int64_t k, const std::vector<double>& w);

/// The combine's dprobs [T, k]: Σ_h dout[t, h] · y[row_of[t, j], h], 0 for a dropped slot. In fp64
/// and in f32 (h in order); the reduction is H.
ExactResult oracle_combine_dprobs(const std::vector<double>& dout, const std::vector<double>& y, int64_t H,
                                  const std::vector<int32_t>& row_of, int64_t T, int64_t k);

/// Element-wise |got - want| <= atol + rtol·|want| (NaN never passes), naming the worst element.
::testing::AssertionResult all_close(const std::vector<double>& got, const std::vector<double>& want, double atol,
                                     double rtol, const std::string& what);

/// ids equal slot by slot, except where the two selections differ only between experts whose
/// selection values (`choice`, [T, E]) are within `tie_tol` — a near-tie that rounding may order
/// either way. Sets *swapped to the number of such slots.
::testing::AssertionResult same_selection(const std::vector<int32_t>& got, const std::vector<int32_t>& want,
                                          const std::vector<double>& choice, int64_t T, int64_t E, int64_t k,
                                          double tie_tol, int64_t* swapped);

/// Per-expert histogram of ids [T·k] (every id in [0, E)).
std::vector<int64_t> histogram(const std::vector<int32_t>& ids, int64_t E);

/// The values of an integer host tensor.
std::vector<int32_t> int32_values(const HostTensor& t);
std::vector<int64_t> int64_values(const HostTensor& t);

/// RouterOptions from its fields.
RouterOptions router_options(int64_t k, RouterScore score, bool normalize, int64_t n_group = 1, int64_t topk_group = 1,
                             float scaling_factor = 1.0f);

/// One router configuration of the routing suites, named.
struct RouterCase {
  std::string name;
  int64_t T, E;
  RouterOptions o;
  bool bias = false;
  DType dtype = DType::bf16;
};

/// One permute configuration of the routing suites, named.
struct PermuteCase {
  std::string name;
  int64_t T, E, k, H;
  PermuteOptions o;
  DType dtype = DType::bf16;
};

/// PermuteOptions with padding to `pad` rows and capacity factor `cf` (0: no capacity).
PermuteOptions popts(int64_t pad, double cf);

/// Random ids i32 [T, k], distinct per token; a fraction `hot` of the picks goes to the first
/// min(E, 4) experts, so that capacities bite and some experts stay empty-ish.
HostTensor random_routing(int64_t T, int64_t E, int64_t k, Rng& rng, double hot = 0.4);

}  // namespace gmoe::test
