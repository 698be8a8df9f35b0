// src/dist/ep_kernels.h — the NCCL backend's kernels (ep_kernels.cu), launched by its group
// (ep_group_nccl.cu). Internal: includes NCCL's device API types.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>

#include "dist/ep_plan_math.h"
#include "gmoe/stream.h"

namespace gmoe::ep {

/// CTAs of every kernel that synchronises with the peers (the push kernels; the plan kernel uses
/// barrier 0 of them): one LSA barrier each, so the group creates this many. The same on every
/// rank, whatever its GPU: the barriers pair CTA i of every rank. 64 CTAs of 16 warps keep enough
/// 16-byte stores in flight to fill the NVLink ports of a rank (decision record: EP push CTAs).
constexpr int kPushCtas = 64;

/// The most experts the kernels' shared-memory tables hold: three arrays of E + 1 int64 and the
/// block scan's storage within the 48 KiB a CTA gets without opting in.
constexpr int64_t kMaxExperts = 1536;

/// Where the parts of the symmetric window lie (bytes from its base), the same on every rank.
struct WindowLayout {
  size_t rows = 0;     ///< rows area: window_rows rows of row_bytes
  size_t scalars = 0;  ///< f32 per row
  size_t counts = 0;   ///< i32 [R, E]: the plan's all-gather
  size_t bytes = 0;    ///< the whole window
  size_t row_bytes = 0;
};

/// The window of a group: its layout, NCCL's handle, the local base pointer and the device comm.
struct Window {
  WindowLayout layout;
  ncclWindow_t handle = nullptr;
  unsigned char* local = nullptr;
  ncclDevComm comm{};
};

/// ep_plan: counts i32 [E] -> counts_all i32 [R, E], local_counts i32 [El]; negative counts and
/// counts past max_rows are recorded in `error_word`.
void launch_plan(const int32_t* counts, int32_t* counts_all, int32_t* local_counts, const Geometry& geo,
                 const Window& win, uint32_t* error_word, Stream stream);

/// One move: push `in` (in_cap rows; scalars may be null) into the peers' windows along the
/// direction (dispatch: source table; combine: receive table), then copy this rank's window into
/// `out` (out_cap rows; scalars may be null), zeros where no row landed.
void launch_move(bool dispatch, const int32_t* counts_all, const void* in, const float* in_scalars, void* out,
                 float* out_scalars, const Geometry& geo, const Window& win, uint32_t* error_word, int sm_count,
                 Stream stream);

}  // namespace gmoe::ep
