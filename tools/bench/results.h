// tools/bench/results.h — benchmark result rows, the table printed last, and the JSON/markdown
// files in the format of ../shared/BENCHMARKS.md ("Results format").
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace gmoe::bench {

struct ResultRow {
  std::string case_name;
  std::string pass;   ///< fprop, dgrad, wgrad, forward, forward_backward
  std::string impl;   ///< gmoe, cublas_dense, cublas_loop, torch, ...
  std::string dtype;  ///< bf16, f16, fp8
  double ms = 0;
  double tflops = 0;
  std::optional<bool> correct;  ///< checked against the reference in this run (baselines: none)
  std::string note;             ///< e.g. the correctness detail
};

struct RunInfo {
  std::string gpu;     ///< device name, or "cpu"
  std::string commit;  ///< from GMOE_COMMIT, or "unknown"
  std::string date;    ///< YYYY-MM-DD
  std::string suite;
};

/// One line per case and pass: TFLOP/s of every impl and gmoe's ratio to each baseline.
void print_table(const std::vector<ResultRow>& rows);
void write_json(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows);
void write_markdown(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows);

}  // namespace gmoe::bench
