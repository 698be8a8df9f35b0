// tests/common/offload_fixture.h — a stack of GroupedMLP layers run forward, backward and (delayed)
// backward_dw with and without activation offloading (gmoe/offload.h), on either backend: the
// outputs as host tensors for a bitwise comparison, and the allocator's bytes in use after forward
// for the memory that offloading gives back. The CPU and CUDA suites run the same stacks.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/harness.h"
#include "gmoe/allocator.h"
#include "gmoe/grouped_linear.h"
#include "gmoe/offload.h"

namespace gmoe::test {

/// Wraps an allocator and counts the bytes it has handed out and not yet been given back. On the
/// CPU freed blocks are poisoned and held until the allocator goes, so that no address is handed out
/// twice: a view left pointing at released memory reads garbage instead of a lucky reuse.
class CountingAllocator final : public Allocator {
 public:
  explicit CountingAllocator(Allocator& base) : base_(&base) {}
  ~CountingAllocator() override;
  CountingAllocator(const CountingAllocator&) = delete;
  CountingAllocator& operator=(const CountingAllocator&) = delete;
  void* allocate(std::size_t bytes, Stream stream) override;
  void free(void* ptr, Stream stream) override;
  Device device() const override { return base_->device(); }
  std::size_t in_use() const { return in_use_; }
  std::size_t peak() const { return peak_; }
  void reset_peak() { peak_ = in_use_; }

 private:
  Allocator* base_;
  std::map<void*, std::size_t> live_;
  std::vector<void*> quarantine_;
  std::size_t in_use_ = 0, peak_ = 0;
};

/// Host <-> device transfers of a suite (identity copies on the CPU): upload returns a view that
/// lives as long as the object.
struct DeviceIO {
  Device device;
  std::function<TensorView(const HostTensor&)> upload;
  std::function<HostTensor(const TensorView&)> download;
  std::function<void()> sync;  ///< waits for every stream (test set-up and read-back only)
};

/// DeviceIO of the CPU backend.
DeviceIO cpu_io(std::deque<HostTensor>& storage);

/// How a stack runs.
enum class OffloadMode {
  none,       ///< nothing offloaded
  scheduler,  ///< OffloadScheduler over the layers (forward_done / backward_begin)
  everything, ///< scheduler with keep_last_layer off, and each context offloaded again between
              ///< backward and backward_dw (delayed weight gradients)
};

/// One stack: layers, sizes, the recipe and the MLP options that change what is saved.
struct StackSpec {
  std::string name;
  int layers = 4;
  int64_t E = 4, H = 64, F = 32, cap = 64;
  std::vector<int64_t> counts{20, 0, 30, 10};
  LinearRecipe recipe = LinearRecipe::native;
  bool probs = false, bias = false, recompute = false, delay_wgrad = false, save_original_input = false;
  int reload_ahead = 1;
};

/// The named stacks the suites sweep (every recipe; probs, bias, recompute, delayed wgrad).
std::vector<StackSpec> offload_stack_specs();

/// The host inputs of a stack (bf16), fresh random per construction.
struct StackInputs {
  HostTensor x, dy, probs, counts;
  std::vector<HostTensor> w1, w2, b1, b2;
  StackInputs(const StackSpec& spec, Rng& rng);
};

/// What a run gives back.
struct StackRun {
  std::vector<HostTensor> outputs;      ///< y of every layer, dx, dprobs, every gradient, in order
  std::vector<std::string> names;       ///< what each output is
  std::size_t in_use_after_forward = 0; ///< the counting allocator's bytes after the forward
  std::size_t offloaded_bytes = 0;      ///< Σ offloadable_bytes of the layers offloaded
  int64_t pool_chunks = 0;              ///< the pool's chunk allocations after the run
};

/// Runs `steps` steps (forward, backward, backward_dw when delayed) of the stack; the result is the
/// last step's. `compute`/`copy`: streams (nullptr on the CPU). `between` (optional) runs after the
/// forward, before the backward, with the stack's allocator and the compute stream (a test that
/// scribbles over freed memory there catches a copy not ordered before the free).
StackRun run_mlp_stack(const StackSpec& spec, const StackInputs& in, OffloadMode mode, DeviceIO& io,
                       Stream compute, Stream copy, int steps = 1,
                       const std::function<void(Allocator&, Stream)>& between = {});

/// Every output of two runs bitwise equal.
::testing::AssertionResult runs_bitwise_equal(const StackRun& a, const StackRun& b);

}  // namespace gmoe::test
