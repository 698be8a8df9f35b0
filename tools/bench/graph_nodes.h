// tools/bench/graph_nodes.h — what one captured call launches, by graph node type: the count that
// gmoe-bench reports per layer call and that the CUDA tests require to be independent of E.
#pragma once

#include <sstream>
#include <string>

namespace gmoe::bench {

/// Nodes of one captured call, by type (cudaGraphNodeGetType): what one call launches.
struct GraphNodeCounts {
  int kernels = 0;
  int memsets = 0;
  int memcpys = 0;
  int allocs = 0;  ///< stream-ordered allocations (cudaMallocAsync)
  int frees = 0;
  int other = 0;
  bool operator==(const GraphNodeCounts& o) const {
    return kernels == o.kernels && memsets == o.memsets && memcpys == o.memcpys && allocs == o.allocs &&
           frees == o.frees && other == o.other;
  }
  bool operator!=(const GraphNodeCounts& o) const { return !(*this == o); }
  /// "5 kernels, 0 memsets, 0 memcpys, 3 allocs, 3 frees"
  std::string str() const {
    std::ostringstream os;
    os << kernels << " kernels, " << memsets << " memsets, " << memcpys << " memcpys, " << allocs << " allocs, "
       << frees << " frees";
    if (other) os << ", " << other << " other nodes";
    return os.str();
  }
};

}  // namespace gmoe::bench
