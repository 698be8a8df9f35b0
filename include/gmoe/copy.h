// gmoe/copy.h — plain data movement on either device: the row copies and zero fills that layers built
// on the ops need (a saved input, a gradient buffer). Stream-ordered on CUDA (graph-capturable, no
// host sync); done when the call returns on the CPU.
#pragma once

#include "gmoe/allocator.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// dst[r, :] = src[r, :] for every row of two 2-D tensors of one shape, dtype and device, rows
/// contiguous (stride(1) == 1, any row stride), not overlapping. CUDA: one device-to-device
/// cudaMemcpy2DAsync on `stream`. Throws gmoe::Error naming the argument on any mismatch.
void copy_rows(const TensorView& dst, const TensorView& src, Stream stream = nullptr);

/// Sets every byte of a contiguous tensor to 0 (0 for every integer and floating dtype). CUDA: one
/// cudaMemsetAsync on `stream`. Throws gmoe::Error for an absent or non-contiguous tensor.
void fill_zero(const TensorView& t, Stream stream = nullptr);

/// Counts given on the host (a dataloader's list, a static schedule) made device counts for the
/// ops and layers: `host_counts` (i32/i64 [E], contiguous, in host memory, pageable or pinned) is
/// copied on the host into a pinned staging block of a process-wide pool, then uploaded with one
/// cudaMemcpyAsync on `stream` into a new [E] tensor of the same dtype from `alloc` (nullptr: the
/// device's default allocator) on `device`. No host sync and no pageable copy; the caller may change
/// or free host_counts as soon as this returns. A staging block is handed out again only after an
/// event recorded behind its copy has completed, and never to two calls at once, so calls from
/// several host threads on several streams never share one. Under CUDA graph capture the copy is a
/// graph node that reads its block at every replay: that block is then never reused nor changed
/// (every replay uploads the counts given at capture). The pool grows (cudaHostAlloc) only when all
/// its blocks are busy. For a CPU `device`: a copy in host memory from `alloc`.
Tensor upload_counts(const TensorView& host_counts, Device device, Stream stream = nullptr, Allocator* alloc = nullptr);

}  // namespace gmoe
