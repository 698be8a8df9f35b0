// src/dist/ep_backend.h — the contract between the expert-parallel ops (src/dist/ep.cpp) and the
// group backends (ep_group_cpu.cpp, ep_group_nccl.cu).
//
// The ops check every host-visible property of their arguments and allocate the outputs; a
// backend receives valid views on its device and runs the collective: plan() all-gathers the
// counts, move() pushes rows into the peers' windows and copies its own window out.
#pragma once

#include "gmoe/expert_parallel.h"

namespace gmoe::ep {

/// Which way a move goes: source layout -> receive layout, or back.
enum class Direction { dispatch, combine };

/// Every EpGroup made by gmoe is one of these.
class GroupBackend : public EpGroup {
 public:
  /// counts: i32 [E] of this rank. Writes counts_all i32 [R, E] (each rank's sanitised counts:
  /// ep_plan_math.h sanitize_counts) and local_counts i32 [El].
  virtual void plan(const TensorView& counts, const TensorView& counts_all, const TensorView& local_counts,
                    Stream stream) = 0;
  /// in_rows [in_cap, H] -> out_rows [out_cap, H] along `dir` (caps: max_rows and recv_capacity, in
  /// the direction's order); scalars absent on both sides or f32 [in_cap] -> f32 [out_cap].
  virtual void move(Direction dir, const TensorView& counts_all, const TensorView& in_rows,
                    const TensorView& in_scalars, const TensorView& out_rows, const TensorView& out_scalars,
                    Stream stream) = 0;
};

/// Throws gmoe::Error naming the field when `options` cannot serve a group of `size` ranks.
void check_group_options(int size, const EpGroupOptions& options);

}  // namespace gmoe::ep
