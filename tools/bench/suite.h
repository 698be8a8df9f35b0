// tools/bench/suite.h — benchmark suite files (bench/suites/*.json, the format of
// ../shared/bench/public_suite.json): gemm cases (rows × K input, E weights N × K) and mlp cases
// (rows × hidden input, FC1 [E, 2·ffn, hidden], FC2 [E, hidden, ffn]), each with explicit counts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gmoe::bench {

struct BenchCase {
  std::string kind;  ///< "gemm" or "mlp"
  std::string name;
  int64_t E = 0, rows = 0;
  int64_t K = 0, N = 0;            ///< gemm
  int64_t hidden = 0, ffn = 0;     ///< mlp
  std::string activation;          ///< mlp
  std::vector<int64_t> counts;     ///< rows per expert; sums to rows
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
double mlp_flops(const BenchCase& c);

}  // namespace gmoe::bench
