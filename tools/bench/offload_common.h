// tools/bench/offload_common.h — offload mode of gmoe-bench (issue 42): a stack of kOffloadLayers
// GroupedMLP layers built from one mlp case, one training step (forward of every layer, backward in
// reverse) without activation offloading and with each of kOffloadSchedules (gmoe/offload.h,
// OffloadScheduler, one layer reloaded ahead: the last layer kept on the device, or every layer
// offloaded). Correctness: dx of each offloaded step bitwise equal to the step's without. Reported
// per case and run: the step's time, the memory the activations hold after forward, the step's
// peak, and the bytes offloaded per step; on CUDA also the copy bandwidth of the offloader against
// one plain pinned cudaMemcpyAsync of the same bytes.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/results.h"
#include "bench/runner.h"
#include "bench/suite.h"
#include "gmoe/grouped_mlp.h"
#include "gmoe/offload.h"

namespace gmoe::bench {

/// Layers in the stack.
constexpr int kOffloadLayers = 4;

/// The stack: kOffloadLayers GroupedMLPs of one mlp case over weights the caller owns (w1[l], w2[l]).
struct OffloadStack {
  std::vector<std::unique_ptr<GroupedMLP>> layers;
  OffloadStack(const BenchCase& c, const std::vector<TensorView>& w1, const std::vector<TensorView>& w2,
               Allocator* allocator);
};

/// One step: forward of every layer from x (each layer's output released once the next layer's
/// forward has copied it), backward from dy in reverse, dx copied into dx_out. With `sched`, its
/// calls around them; `after_forward` (optional) runs between the forward and the backward (to read
/// the memory the activations hold). Returns the bytes the scheduler offloaded.
std::size_t offload_stack_step(OffloadStack& s, const TensorView& x, const TensorView& counts, const TensorView& dy,
                               OffloadScheduler* sched, Stream stream, const TensorView& dx_out,
                               const std::function<void()>& after_forward = {});

/// An offloaded run of the stack: its row's impl and whether the last layer stays on the device.
struct OffloadSchedule {
  const char* impl;
  bool keep_last_layer;
};

/// The offloaded runs, each a row: the last layer kept (its backward comes right after its forward,
/// so its copies would overlap nothing), and every layer offloaded (the least memory held: the last
/// layer's copies out and back then stand in the step's path).
constexpr OffloadSchedule kOffloadSchedules[] = {{"gmoe_stack_offload", true}, {"gmoe_stack_offload_all", false}};
constexpr int kOffloadRuns = 1 + static_cast<int>(sizeof(kOffloadSchedules) / sizeof(kOffloadSchedules[0]));

/// The scheduler's options for the stack: one layer reloaded ahead, the last layer kept or not.
OffloadSchedulerOptions offload_bench_schedule(bool keep_last_layer);

/// What one run of the step measured.
struct OffloadStepRun {
  double ms = 0;
  std::size_t held = 0;       ///< bytes the activations hold after forward
  std::size_t peak = 0;       ///< the step's peak beyond what was held before it
  std::size_t offloaded = 0;  ///< bytes the scheduler offloaded
  bool equal = true;          ///< dx bitwise equal to the step's without offloading
  std::string extra;          ///< appended to the note
};

/// The step rows of one case: runs[0] without offloading (impl gmoe_stack), runs[1 + i] with
/// kOffloadSchedules[i].
std::vector<ResultRow> offload_step_rows(const std::string& case_name, const std::string& dtype,
                                         const std::vector<OffloadStepRun>& runs);

/// Offload mode for one mlp case: on CUDA, or on the CPU backend with the rows scaled down to
/// `cpu_gflop` GFLOP per forward of one layer; a failure becomes a skipped row with the reason.
std::vector<ResultRow> run_offload_mode(const BenchCase& c, const BenchOptions& o, bool use_cuda, double cpu_gflop,
                                        const std::string& dtype);
/// Offload mode on the CPU backend (rows scaled down by the caller): wall-clock, a smoke run.
std::vector<ResultRow> run_offload_case_cpu(const BenchCase& c, const BenchOptions& o);
/// Offload mode on CUDA: CUDA-event timing, memory-pool peaks, copy bandwidth.
std::vector<ResultRow> run_offload_case_cuda(const BenchCase& c, const BenchOptions& o);

}  // namespace gmoe::bench
