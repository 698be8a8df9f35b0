// tools/bench/results.h — benchmark result rows, the table printed last, and the JSON/markdown
// files in the format of docs/benchmarks.md ("Results format").
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "bench/graph_nodes.h"

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
  // Layer rows (impl gmoe_linear) only:
  std::optional<double> bare_ms;            ///< the bare GEMMs of the same work, timed in the same run
  /// FP8 rows (whose bare_ms is the native layer or MLP timed interleaved with them): the native
  /// one's time from the same run beside its bare GEMMs (layer) or the unfused MLP (mlp), not beside
  /// the FP8 one. At a GPU's power cap the two interleaved layers share the clocks the limiter
  /// sets, so a lighter FP8 step also speeds its bf16 twin up: both ratios are worth reading.
  std::optional<double> native_alone_ms;
  std::optional<GraphNodeCounts> launches;  ///< what one call launches (CUDA graph capture)
  /// Set when the row was not run: the reason (an unsupported combination, or the error that
  /// ended the case). Such a row has no time and no correctness result.
  std::optional<std::string> skipped;
  // moe cases (kind "moe") and offload mode (kind "offload"; docs/benchmarks.md):
  std::string kind;                           ///< where the rows need it: "moe", "offload"; else empty
  std::optional<double> peak_mib;             ///< peak memory of one pass (or step) beyond inputs and weights
  std::optional<double> kept_bytes_per_token; ///< what forward keeps for backward, per token
  std::optional<double> gbps;                 ///< bytes moved (read + written) per second, GB/s
  std::optional<double> copy_gbps;            ///< a plain device (offload: pinned) copy's GB/s in the same run
  std::optional<double> activations_mib;      ///< offload: memory the activations hold after forward
  std::optional<double> offloaded_mib;        ///< offload: bytes the scheduler offloads per step
};

/// A row of `flops` done in `ms` (TFLOP/s derived; 0 for a zero time).
ResultRow timed_row(const std::string& case_name, const std::string& pass, const std::string& impl,
                    const std::string& dtype, double ms, double flops, std::optional<bool> correct = std::nullopt,
                    std::string note = {});

/// A row that was not run, with the reason (docs/benchmarks.md's `skipped`).
ResultRow skipped_row(const std::string& case_name, const std::string& pass, const std::string& impl,
                      const std::string& dtype, const std::string& reason);

struct RunInfo {
  std::string gpu;     ///< device name, or "cpu"
  std::string commit;  ///< from GMOE_COMMIT, or "unknown"
  std::string date;    ///< YYYY-MM-DD
  std::string suite;
};

/// One line per case and pass: TFLOP/s of every impl and gmoe's ratio to each baseline. The rows of
/// mlp cases (passes forward and forward_backward of impls gmoe, gmoe_unfused) get a table of their
/// own, with their own geometric means; layer rows (impl gmoe_linear) another: time, bare GEMM
/// time, overhead, launches; moe rows (kind "moe") two: the MoE layer's passes with peak memory
/// and bytes kept for backward, and permute / combine against a device copy; offload rows (kind
/// "offload") one: time, copy bandwidth and memory. Skipped rows show as "skipped" and are listed
/// with their reasons.
void print_table(const std::vector<ResultRow>& rows);
void write_json(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows);
void write_markdown(const std::string& path, const RunInfo& info, const std::vector<ResultRow>& rows);

}  // namespace gmoe::bench
