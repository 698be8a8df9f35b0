// gmoe/copy.h — plain data movement on either device: the row copies and zero fills that layers built
// on the ops need (a saved input, a gradient buffer). Stream-ordered on CUDA (graph-capturable, no
// host sync); done when the call returns on the CPU.
#pragma once

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

}  // namespace gmoe
