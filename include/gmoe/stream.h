// gmoe/stream.h — the stream handle every op takes, without pulling CUDA headers into users' code.
#pragma once

// The CUDA runtime declares `typedef struct CUstream_st* cudaStream_t;`. Declaring the same
// incomplete struct here makes gmoe::Stream the very same type as cudaStream_t, so callers pass
// their CUDA streams directly while the public headers stay free of CUDA includes.
struct CUstream_st;

namespace gmoe {

/// A CUDA stream (cudaStream_t). nullptr is the legacy default stream; CPU-backend ops ignore it.
using Stream = CUstream_st*;

}  // namespace gmoe
