// tools/bench/runner.h — running one suite case on a backend: correctness first, then timing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/results.h"
#include "bench/suite.h"
#include "gmoe/dtype.h"

namespace gmoe::bench {

struct BenchOptions {
  DType dtype = DType::bf16;
  int warmup = 3;        ///< untimed runs before timing
  int iters = 30;        ///< timed runs; the median is reported (>= 20 on the GPU)
  int samples = 256;     ///< sampled elements per correctness check
  uint64_t seed = 1;
  bool baselines = true; ///< also time cuBLAS dense and the per-expert cuBLAS loop (GPU)
  bool layer_copy_input = false;  ///< layer mode: GroupedLinear copies x (its default) instead of
                                  ///< keeping a reference (save_original_input)
  /// Layer mode on CUDA: also GroupedLinear with these FP8 recipes (linear_recipe_name), rows
  /// gmoe_linear_<recipe>, timed interleaved with the native layer.
  std::vector<std::string> layer_recipes;
  /// FP8 gemm rows: dW's dtype in the wgrad pass. bf16 (the default) is what the bf16 grouped
  /// GEMM row and torch write, so the ratios compare like with like; f32 is the main_grad kernel.
  DType fp8_wgrad_out = DType::bf16;
  /// FP8 gemm rows: the format of dy in the dgrad and wgrad passes (e4m3, or e5m2: rows named
  /// gmoe_fp8_<recipe>_e5m2 for those passes).
  DType fp8_grad_format = DType::e4m3;
  /// mlp mode: weight gradients accumulated in f32 into main_grads (Megatron's configuration)
  /// instead of fresh bf16 ones (torch's autograd's, the default).
  bool mlp_main_grad = false;
  /// mlp mode: FC1's gate/up rows interleaved in blocks of this many (0: concatenated).
  int64_t mlp_glu_block = 0;
  /// layer and mlp modes on CUDA: wall-clock milliseconds of untimed back-to-back work before each
  /// timing, so that GroupedLinear, GroupedMLP and bench/torch_baseline.py's compositions (which
  /// warm the same way) are timed at the clocks of sustained load (cuda_util.h,
  /// time_interleaved_ms). The gemm mode has its own, gemm_warm_ms.
  double warm_ms = 1000;
  /// gemm mode on CUDA: the same warm-up before each timing (0, the default: bursts, as the anchors
  /// in docs/benchmarks.md were measured). The FP8 rows are timed interleaved with the bf16 grouped GEMM
  /// of the same pass (their bare_ms), so their ratio to it holds at either clock.
  double gemm_warm_ms = 0;
  /// gemm mode: only this pass (fprop, dgrad or wgrad; empty: all three), e.g. to profile one kernel.
  std::string only_pass;
  bool runs_pass(const std::string& pass) const { return only_pass.empty() || only_pass == pass; }
};

/// CPU reference backend on the case as given (the caller scales rows down first). Wall-clock
/// timing, no baselines.
std::vector<ResultRow> run_gemm_case_cpu(const BenchCase& c, const BenchOptions& o);

/// True when a CUDA device is usable; `name` gets its name.
bool cuda_available(std::string* name);
/// Between cases: waits for the current CUDA device, then gives the memory that gmoe's pool keeps
/// cached (gmoe/memory_pool.h) back to it, so that a case's own allocations (cudaMalloc'd inputs,
/// cuBLAS workspaces, CUDA graphs' memory) do not find the previous case's scratch still held.
/// Prints, and leaves the error to the next CUDA call, where the sync fails.
void release_cached_memory_cuda();
/// CUDA backend with CUDA-event timing, and in the same run the cuBLAS baselines.
std::vector<ResultRow> run_gemm_case_cuda(const BenchCase& c, const BenchOptions& o);

/// Layer mode (bench/layer_common.h): GroupedLinear forward and forward+backward on a gemm case,
/// beside the bare GEMMs of the same work. CPU: wall-clock, no launch counts.
std::vector<ResultRow> run_layer_case_cpu(const BenchCase& c, const BenchOptions& o);
/// CUDA: CUDA-event timing (layer and bare GEMMs interleaved), and what one forward and one
/// forward+backward launch, counted on a CUDA graph capture of each.
std::vector<ResultRow> run_layer_case_cuda(const BenchCase& c, const BenchOptions& o);
/// Captures one GroupedLinear forward and one forward+backward for E = 8 and E = 256 on a small
/// shape, prints what each launches, and returns whether the counts are the same for both E.
bool check_layer_launches_cuda(const BenchOptions& o);

/// MLP mode (bench/mlp_common.h): GroupedMLP (impl gmoe) and the unfused composition of separate
/// public ops (gmoe_unfused), forward and forward+backward, on an mlp case. CPU: wall-clock (the
/// caller scales rows down first).
std::vector<ResultRow> run_mlp_case_cpu(const BenchCase& c, const BenchOptions& o);
/// CUDA: CUDA-event timing, the two implementations interleaved.
std::vector<ResultRow> run_mlp_case_cuda(const BenchCase& c, const BenchOptions& o);

/// MoE mode (bench/moe_common.h): MoELayer forward, backward and forward+backward on a moe case,
/// its peak memory and the bytes it keeps for backward, and permute / combine alone against a
/// device copy. CPU: wall-clock (the caller scales the case down first).
std::vector<ResultRow> run_moe_case_cpu(const BenchCase& c, const BenchOptions& o);
/// CUDA: CUDA-event timing, eager calls and the captured passes replayed (CUDA graphs).
std::vector<ResultRow> run_moe_case_cuda(const BenchCase& c, const BenchOptions& o);

}  // namespace gmoe::bench
