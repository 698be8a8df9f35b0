// gmoe/expert_parallel.h — expert parallelism: the token rows of a rank travel to the ranks that hold
// their experts (dispatch) and back (combine), with the counts only on the device.
//
// Rank r of a group of R holds the global experts [r*El, (r+1)*El), El = E / R. Every op here is
// COLLECTIVE: all ranks of a group call the same ops in the same order, on one stream order per
// group (the caller orders ops it puts on different streams). No op reads counts on the host, so
// every op is CUDA-graph capturable; buffers are sized from host-known upper bounds (max_rows,
// max_recv_rows). Two backends: NCCL on CUDA devices (one process or thread per GPU, the rows pushed
// straight into the peers' memory), and the CPU backend, R ranks in one process, one thread each.
//
// Layouts. The source layout of rank s is its permuted rows [max_rows, H], grouped by global expert
// in expert order (its counts: i32 [E]). The receive layout of rank r is [recv_capacity, H], grouped
// by local expert, within an expert by source rank, within a source in source order:
//   receive row of (local expert e, source s, row j of global expert g = r*El+e in s's layout)
//     = sum_{e' < e} local_counts[e'] + sum_{s' < s} counts_all[s'][g] + j
//   source row of (row j of global expert g on rank s) = sum_{g' < g} counts_all[s][g'] + j.
// Rows past a layout's valid total are zeros. Rows that would land past recv_capacity are dropped
// and recorded in the device error word (check_device_errors; the CPU backend throws gmoe::Error on
// every rank once the exchange is over), never written out of bounds.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "gmoe/allocator.h"
#include "gmoe/dtype.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// The fixed shape of what a group moves, the same on every rank: the host-known bounds that size
/// every buffer, so that no op needs the real counts on the host.
struct EpGroupOptions {
  int64_t num_experts = 0;     ///< E, global; a positive multiple of the group size
  int64_t hidden = 0;          ///< H: the width (elements) of the rows dispatch and combine move
  DType dtype = DType::bf16;   ///< element type of the rows (any dtype: rows move as bytes)
  int64_t max_rows = 0;        ///< upper bound of the rows ONE rank holds in the source layout
  int64_t max_recv_rows = 0;   ///< receive capacity of a rank; 0: size * max_rows (never drops)
};

/// One rank's membership of an expert-parallel group: made by make_ep_group_nccl (one per process
/// or thread per GPU) or make_ep_group_local (the CPU backend). Holds the backend's communication
/// state (on NCCL: the communicator, the symmetric window, the device barriers). Non-copyable.
class EpGroup {
 public:
  EpGroup() = default;
  EpGroup(const EpGroup&) = delete;
  EpGroup& operator=(const EpGroup&) = delete;
  /// Frees the backend state. On NCCL this is itself collective (every rank destroys its group)
  /// and first waits for the device's queued work (a deliberate sync, never under graph capture).
  virtual ~EpGroup();
  /// This rank's index in [0, size()).
  virtual int rank() const = 0;
  /// R, the number of ranks.
  virtual int size() const = 0;
  /// Where this rank's tensors live (a CUDA device for NCCL, the CPU for the local backend).
  virtual Device device() const = 0;
  /// The options the group was made with (max_recv_rows as given, 0 included).
  virtual const EpGroupOptions& options() const = 0;
  /// El = E / size(): the experts this rank holds, global experts [rank*El, (rank+1)*El).
  int64_t local_experts() const;
  /// Rows of the receive layout: options().max_recv_rows, or size() * max_rows when that is 0.
  int64_t recv_capacity() const;
};

/// NCCL's unique id (ncclUniqueId), made by one rank and handed to every rank of the group (through
/// a file, a pipe, a fork, or torch.distributed's store).
struct EpUniqueId {
  unsigned char bytes[128];  ///< the id's bytes, opaque
};

/// A new NCCL unique id (ncclGetUniqueId). Call it before the process makes any CUDA call when it
/// forks the ranks afterwards. Throws gmoe::Error in a build without CUDA/NCCL, or when NCCL fails.
EpUniqueId ep_unique_id();

/// Rank `rank` of a group of `size` on CUDA `device` (a CUDA device of this process; it becomes the
/// calling thread's current device): ncclCommInitRank, then one symmetric window for the exchange.
/// Collective: every rank calls it with the same id, size and options (it blocks until all have).
/// Throws gmoe::Error naming the argument (size < 1, rank out of range, a non-CUDA device, options
/// that do not fit: see EpGroupOptions), in a build without CUDA, or when NCCL fails.
std::unique_ptr<EpGroup> make_ep_group_nccl(const EpUniqueId& id, int rank, int size, Device device,
                                            const EpGroupOptions& options);

/// R = `size` ranks in one process on the CPU backend: element i is rank i. Each rank's ops must be
/// called from its own thread (a barrier joins the ranks inside every op). Throws gmoe::Error naming
/// the argument for size < 1 or bad options.
std::vector<std::unique_ptr<EpGroup>> make_ep_group_local(int size, const EpGroupOptions& options);

/// The counts of one exchange, gathered from every rank. One per exchange: a forward's plan serves
/// its backward too. Both tensors live on the group's device, from the op's allocator.
struct EpPlan {
  /// i32 [R, E]: row s = rank s's rows per global expert in its source layout. Each row is stored
  /// as the device uses it: negative counts as 0 and the running total clamped to max_rows (both
  /// recorded as device errors).
  Tensor counts_all;
  /// i32 [El]: the rows this rank's local experts receive (sum over the sources of counts_all's
  /// columns r*El .. r*El+El-1): the counts of the receive layout. Their sum may pass
  /// recv_capacity; the rows past it are dropped by ep_dispatch (an error, see the header comment).
  Tensor local_counts;
};

/// Collective: all-gathers each rank's `counts` (i32 [E], contiguous, on the group's device: the
/// rows per global expert in this rank's source layout, the padded counts if the permute padded)
/// into an EpPlan. Stream-ordered on `stream`; `alloc` (nullptr: the device's default allocator)
/// owns the plan's tensors. Throws gmoe::Error naming the argument on a bad counts tensor.
EpPlan ep_plan(EpGroup& g, const TensorView& counts, Allocator* alloc = nullptr, Stream stream = nullptr);

/// Rows moved by ep_dispatch or ep_combine, with the per-row scalars that travel with them.
struct EpRows {
  Tensor rows;     ///< [capacity, H] of the group's dtype
  Tensor scalars;  ///< f32 [capacity], or absent when the call was given no scalars
};

/// Collective: source layout -> receive layout. `rows`: [max_rows, H] of the group's dtype,
/// contiguous, on the group's device, grouped by global expert per this rank's counts in `plan`.
/// Returns [recv_capacity, H] in the receive layout (rows past sum(local_counts): zeros). `scalars`:
/// absent, or f32 [max_rows] (per-row router probabilities), moved row for row into f32
/// [recv_capacity] (zeros past the valid rows). `plan` is this rank's ep_plan of this exchange.
/// Outputs come from `alloc` (nullptr: the device's default), stream-ordered on `stream`. Throws
/// gmoe::Error naming the argument on a bad dtype, shape, device or plan.
EpRows ep_dispatch(EpGroup& g, const EpPlan& plan, const TensorView& rows, const TensorView& scalars = {},
                   Allocator* alloc = nullptr, Stream stream = nullptr);

/// Collective: the exact reverse of ep_dispatch: `rows` [recv_capacity, H] in the receive layout
/// (e.g. the experts' outputs) go back to the ranks they came from, into [max_rows, H] in each
/// source's layout (rows past the source's total, and rows that dispatch dropped: zeros). `scalars`
/// likewise: absent, or f32 [recv_capacity] -> f32 [max_rows]. Same arguments, checks and streams
/// as ep_dispatch.
EpRows ep_combine(EpGroup& g, const EpPlan& plan, const TensorView& rows, const TensorView& scalars = {},
                  Allocator* alloc = nullptr, Stream stream = nullptr);

}  // namespace gmoe
