// tools/bench/offload_common.h — offload mode of gmoe-bench (issue 42): a stack of kOffloadLayers
// GroupedMLP layers built from one mlp case, one training step (forward of every layer, backward in
// reverse) with and without activation offloading (gmoe/offload.h, OffloadScheduler: the last
// layer kept, one layer reloaded ahead). Correctness: dx of the two steps bitwise equal. Reported
// per case: the step's time, the memory the activations hold after forward and the step's peak each way, and the bytes offloaded per step;
// on CUDA also the copy bandwidth of the offloader against one plain pinned cudaMemcpyAsync of
// the same bytes, and the peak activation memory saved.
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

/// The scheduler's options for the stack (last layer kept, one layer ahead).
OffloadSchedulerOptions offload_bench_schedule();

/// Offload mode for one mlp case: on CUDA, or on the CPU backend with the rows scaled down to
/// `cpu_gflop` GFLOP per forward of one layer; a failure becomes a skipped row with the reason.
std::vector<ResultRow> run_offload_mode(const BenchCase& c, const BenchOptions& o, bool use_cuda, double cpu_gflop,
                                        const std::string& dtype);
/// Offload mode on the CPU backend (rows scaled down by the caller): wall-clock, a smoke run.
std::vector<ResultRow> run_offload_case_cpu(const BenchCase& c, const BenchOptions& o);
/// Offload mode on CUDA: CUDA-event timing, memory-pool peaks, copy bandwidth.
std::vector<ResultRow> run_offload_case_cuda(const BenchCase& c, const BenchOptions& o);

}  // namespace gmoe::bench
