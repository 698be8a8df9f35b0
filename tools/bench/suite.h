// tools/bench/suite.h — benchmark suite files (bench/suites/*.json, the format of
// ../shared/bench/public_suite.json): gemm cases (rows × K input, E weights N × K) and mlp cases
// (rows × hidden input, FC1 [E, 2·ffn, hidden], FC2 [E, hidden, ffn]), each with explicit counts;
// and moe cases (the whole MoE block on `tokens` tokens, top_k experts each), whose routing comes
// from router logits of a given distribution instead (docs/benchmarks.md).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gmoe::bench {

struct BenchCase {
  std::string kind;  ///< "gemm", "mlp" or "moe"
  std::string name;
  int64_t E = 0, rows = 0;         ///< moe: rows = tokens · top_k, the rows the experts run
  int64_t K = 0, N = 0;            ///< gemm
  int64_t hidden = 0, ffn = 0;     ///< mlp, moe
  std::string activation;          ///< mlp, moe
  std::vector<int64_t> counts;     ///< gemm, mlp: rows per expert; sums to rows
  int64_t tokens = 0, top_k = 0;   ///< moe
  /// moe: the router logits of token t are logit_std · N(0, 1) + logit_bias[e] (logit_bias: E
  /// values, all 0 for uniform routing); `routing` names the distribution (uniform, skewed).
  std::string routing;
  double logit_std = 1.0;
  std::vector<double> logit_bias;
};

struct Suite {
  std::string name;  ///< file stem, e.g. "public"
  std::vector<BenchCase> cases;
};

/// Loads and validates a suite file; throws gmoe::Error naming the file and the case on a problem.
Suite load_suite(const std::string& path);

/// The same case with rows scaled by `factor` (≤ 1): counts scaled by largest remainder so empty
/// experts stay empty, the skew is kept, and every non-empty expert keeps at least one row.
BenchCase scale_rows(const BenchCase& c, double factor);

/// FLOPs of one GEMM pass of a gemm case: 2·rows·N·K.
double gemm_flops(const BenchCase& c);

/// FLOPs of one forward of an mlp case (docs/benchmarks.md): 2·rows·hidden·2·ffn + 2·rows·ffn·hidden
/// (FC1 has ffn outputs instead of 2·ffn for the non-gated squared_relu); forward+backward is 3×.
/// For a moe case, the expert GEMMs' (rows = tokens · top_k).
double mlp_flops(const BenchCase& c);

/// A moe case made small enough for the CPU reference backend: tokens scaled so that one forward
/// is about `gflop` GFLOP (at least 16 tokens), and when the experts' weights exceed
/// `max_weight_bytes`, hidden and ffn scaled down alike (kept multiples of 16).
BenchCase scale_moe_for_cpu(const BenchCase& c, double gflop, double max_weight_bytes);

}  // namespace gmoe::bench
