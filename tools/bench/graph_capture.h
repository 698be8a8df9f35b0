// tools/bench/graph_capture.h — capturing what a call enqueues in a CUDA graph and counting the
// graph's nodes: shared by gmoe-bench (launches per layer call) and the CUDA tests (graph replays,
// launch counts independent of E). Header-only; included by CUDA builds only.
#pragma once

#include <cuda_runtime.h>

#include <functional>
#include <vector>

#include "bench/graph_nodes.h"
#include "gmoe/error.h"

namespace gmoe::bench {

/// What `work` enqueues on `stream`, captured in global capture mode (which fails on any host sync
/// inside). The caller owns the graph (cudaGraphDestroy). If `work` throws, the capture is ended and
/// discarded and the exception goes on; a capture that fails throws gmoe::Error.
inline cudaGraph_t capture_graph(cudaStream_t stream, const std::function<void()>& work) {
  cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal);
  GMOE_CHECK(err == cudaSuccess, "cudaStreamBeginCapture failed: ", cudaGetErrorString(err));
  try {
    work();
  } catch (...) {
    cudaGraph_t broken = nullptr;
    cudaStreamEndCapture(stream, &broken);
    if (broken != nullptr) cudaGraphDestroy(broken);
    cudaGetLastError();
    throw;
  }
  cudaGraph_t graph = nullptr;
  err = cudaStreamEndCapture(stream, &graph);
  GMOE_CHECK(err == cudaSuccess, "capturing a call in a CUDA graph failed (", cudaGetErrorString(err),
             "): it synchronised with the host or made a call that cannot be captured");
  return graph;
}

/// The nodes of `graph` by type.
inline GraphNodeCounts count_graph_nodes(cudaGraph_t graph) {
  size_t n = 0;
  cudaError_t err = cudaGraphGetNodes(graph, nullptr, &n);
  GMOE_CHECK(err == cudaSuccess, "cudaGraphGetNodes failed: ", cudaGetErrorString(err));
  std::vector<cudaGraphNode_t> nodes(n);
  if (n > 0) {
    err = cudaGraphGetNodes(graph, nodes.data(), &n);
    GMOE_CHECK(err == cudaSuccess, "cudaGraphGetNodes failed: ", cudaGetErrorString(err));
  }
  GraphNodeCounts counts;
  for (cudaGraphNode_t node : nodes) {
    cudaGraphNodeType type;
    err = cudaGraphNodeGetType(node, &type);
    GMOE_CHECK(err == cudaSuccess, "cudaGraphNodeGetType failed: ", cudaGetErrorString(err));
    switch (type) {
      case cudaGraphNodeTypeKernel: ++counts.kernels; break;
      case cudaGraphNodeTypeMemset: ++counts.memsets; break;
      case cudaGraphNodeTypeMemcpy: ++counts.memcpys; break;
      case cudaGraphNodeTypeMemAlloc: ++counts.allocs; break;
      case cudaGraphNodeTypeMemFree: ++counts.frees; break;
      default: ++counts.other; break;
    }
  }
  return counts;
}

/// capture_graph, count_graph_nodes, and the graph destroyed: what one call of `work` launches.
/// Everything `work` allocates must be freed inside it (its locals die before the capture ends).
inline GraphNodeCounts capture_node_counts(const std::function<void()>& work, cudaStream_t stream) {
  cudaGraph_t graph = capture_graph(stream, work);
  GraphNodeCounts counts;
  try {
    counts = count_graph_nodes(graph);
  } catch (...) {
    cudaGraphDestroy(graph);
    throw;
  }
  cudaGraphDestroy(graph);
  return counts;
}

}  // namespace gmoe::bench
