// tests/cuda/cuda_test_util.h — device-side helpers for the CUDA suites: a GPU check for
// GTEST_SKIP, owning device tensors copied from/to the harness's HostTensor, and the device twins
// of GemmProblem / HostExpertTensor.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/graph_capture.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "cuda/gemm/grouped_gemm_prepare.h"
#include "cuda/gemm/grouped_gemm_heuristics.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/tuning.h"

namespace gmoe::test {

#define GMOE_TEST_CUDA(call)                                                         \
  do {                                                                               \
    const cudaError_t status_ = (call);                                              \
    ASSERT_EQ(status_, cudaSuccess) << #call << ": " << cudaGetErrorString(status_); \
  } while (0)

/// Empty when an sm_90 GPU is present, else why the CUDA suites skip.
inline std::string missing_gpu_reason() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return "no CUDA device";
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "cannot read device properties";
  if (prop.major != 9 || prop.minor != 0) {
    return "gmoe's kernels are built for sm_90a; device 0 is sm_" + std::to_string(prop.major) +
           std::to_string(prop.minor);
  }
  return "";
}

#define GMOE_SKIP_WITHOUT_GPU()                                         \
  do {                                                                  \
    const std::string reason_ = ::gmoe::test::missing_gpu_reason();     \
    if (!reason_.empty()) GTEST_SKIP() << reason_;                      \
  } while (0)

/// Throws (a test failure) when a CUDA call of test set-up code fails.
inline void test_cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

/// Two non-blocking streams and an event that joins the second back into the first: the set-up of
/// tests that run delayed weight gradients on a side stream. Destroyed at scope exit.
class ForkedStreams {
 public:
  ForkedStreams() {
    test_cuda_check(cudaStreamCreateWithFlags(&main_, cudaStreamNonBlocking), "cudaStreamCreate");
    test_cuda_check(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking), "cudaStreamCreate");
    test_cuda_check(cudaEventCreateWithFlags(&joined_, cudaEventDisableTiming), "cudaEventCreate");
  }
  ~ForkedStreams() {
    cudaEventDestroy(joined_);
    cudaStreamDestroy(side_);
    cudaStreamDestroy(main_);
  }
  ForkedStreams(const ForkedStreams&) = delete;
  ForkedStreams& operator=(const ForkedStreams&) = delete;
  cudaStream_t main() const { return main_; }
  cudaStream_t side() const { return side_; }
  /// Orders what was enqueued on side() so far before what is enqueued on main() next (capturable).
  void join() const {
    test_cuda_check(cudaEventRecord(joined_, side_), "cudaEventRecord");
    test_cuda_check(cudaStreamWaitEvent(main_, joined_, 0), "cudaStreamWaitEvent");
  }

 private:
  cudaStream_t main_ = nullptr, side_ = nullptr;
  cudaEvent_t joined_ = nullptr;
};

/// Holds `stream` at this point until open() (or the destructor): a host function that waits, so
/// that the work enqueued behind it cannot have run while the gate is closed, whatever the GPU's
/// speed. The flag lives on the heap and the host function frees it, so closing the scope never
/// waits for the stream (two gates on two streams may share CUDA's callback thread).
class StreamGate {
 public:
  explicit StreamGate(cudaStream_t stream) : open_(new std::atomic<bool>(false)) {
    test_cuda_check(cudaLaunchHostFunc(stream, &StreamGate::wait, open_), "cudaLaunchHostFunc");
  }
  ~StreamGate() { open(); }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  /// Lets the stream go on (once: the host function frees the flag as soon as it sees it set).
  void open() {
    if (opened_) return;
    opened_ = true;
    open_->store(true);
  }

 private:
  static void CUDART_CB wait(void* flag) {
    auto* open = static_cast<std::atomic<bool>*>(flag);
    while (!open->load()) std::this_thread::yield();
    delete open;
  }
  std::atomic<bool>* open_;
  bool opened_ = false;
};

/// What `work` enqueues on `stream`, captured once in global capture mode (which fails on any host
/// sync inside: bench::capture_graph) and instantiated. Destroyed at scope exit.
class CapturedGraph {
 public:
  CapturedGraph(cudaStream_t stream, const std::function<void()>& work)
      : graph_(bench::capture_graph(stream, work)) {
    const cudaError_t err = cudaGraphInstantiate(&exec_, graph_, 0);
    if (err != cudaSuccess) {
      cudaGraphDestroy(graph_);
      test_cuda_check(err, "cudaGraphInstantiate");
    }
  }
  ~CapturedGraph() {
    if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
    if (graph_ != nullptr) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  /// The capture's nodes by type (what one call launches).
  bench::GraphNodeCounts nodes() const { return bench::count_graph_nodes(graph_); }
  /// How many kernel nodes the capture holds (launches per call).
  std::size_t kernel_nodes() const { return static_cast<std::size_t>(nodes().kernels); }
  /// One replay on `stream`, waited for.
  void replay(cudaStream_t stream) const {
    test_cuda_check(cudaGraphLaunch(exec_, stream), "cudaGraphLaunch");
    test_cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
  }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

/// An owning device copy of a contiguous host tensor (cudaMalloc: test code, not the hot path).
class DeviceTensor {
 public:
  DeviceTensor() = default;
  explicit DeviceTensor(const HostTensor& h) : dtype_(h.dtype()), shape_(h.shape()) {
    bytes_ = h.bytes().size();
    if (bytes_ > 0) {
      if (cudaMalloc(&data_, bytes_) != cudaSuccess) throw std::runtime_error("cudaMalloc failed");
      upload(h);
    }
  }
  /// Uninitialised device memory of a dtype and shape.
  DeviceTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t s : shape_) n *= s;
    bytes_ = static_cast<std::size_t>(n) * dtype_size(dtype_);
    if (bytes_ > 0 && cudaMalloc(&data_, bytes_) != cudaSuccess) {
      throw std::runtime_error("cudaMalloc failed");
    }
  }
  DeviceTensor(DeviceTensor&& o) noexcept { *this = std::move(o); }
  DeviceTensor& operator=(DeviceTensor&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(bytes_, o.bytes_);
    std::swap(dtype_, o.dtype_);
    std::swap(shape_, o.shape_);
    return *this;
  }
  ~DeviceTensor() {
    if (data_ != nullptr) cudaFree(data_);
  }
  // cudaMemcpy from pageable memory returns once the data is staged, possibly before its DMA has
  // landed; work on a non-blocking stream is not ordered after it. So wait for the copy: without
  // this, a kernel on another stream could run before the upload finished, and a poisoned output
  // uploaded last could overwrite what the kernel wrote (seen once on an H100 under load).
  void upload(const HostTensor& h) {
    if (bytes_ > 0 && (cudaMemcpy(data_, h.data(), bytes_, cudaMemcpyHostToDevice) != cudaSuccess ||
                       cudaStreamSynchronize(cudaStreamLegacy) != cudaSuccess)) {
      throw std::runtime_error("upload failed");
    }
  }
  /// A host tensor of the same dtype/shape holding the device contents.
  HostTensor download() const {
    HostTensor h(dtype_, shape_);
    if (bytes_ > 0 && cudaMemcpy(h.data(), data_, bytes_, cudaMemcpyDeviceToHost) != cudaSuccess) {
      throw std::runtime_error("download failed");
    }
    return h;
  }
  TensorView view() const { return contiguous_view(data_, dtype_, Device::cuda(0), shape_); }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
};

/// A host copy of a contiguous view on either device, shape kept.
/// Checks what the last grouped GEMM call on this thread launched (cuda_backend::LaunchRecord)
/// against the default rules' choice: that it ran, as FP8 or not, with row chunks of
/// row_chunk_rows() where `chunked` (more groups than the `experts`), and, unless the run's
/// --tuning (main.cpp) forces a tile or a cluster (gpu_check's forced runs), in a cluster_m x
/// cluster_n cluster: a silent fallback to another instantiation or to unsplit experts fails here.
/// Expects the device error word to be set (check_device_errors throws, which also clears it) with
/// a message that contains every one of `words`.
inline void expect_device_error(std::initializer_list<const char*> words) {
  try {
    check_device_errors(nullptr);
    ADD_FAILURE() << "expected the device error word to be set";
  } catch (const Error& e) {
    const std::string what = e.what();
    for (const char* w : words) EXPECT_NE(what.find(w), std::string::npos) << what;
  }
}

inline void expect_launch(const std::string& what, bool fp8, int64_t experts, bool chunked, int cluster_m,
                          int cluster_n) {
  const cuda_backend::LaunchRecord& l = cuda_backend::last_launch_record();
  EXPECT_TRUE(l.ran) << what << ": no GEMM ran";
  EXPECT_EQ(l.fp8, fp8) << what;
  if (chunked) {
    EXPECT_EQ(l.row_chunk, cuda_backend::row_chunk_rows()) << what;
    if (l.row_chunk > 0) EXPECT_GT(l.num_groups, experts) << what << ": the experts were not split";
  }
  const Tuning& t = current_tuning();
  if (t.gemm_tile == GemmTile::automatic && t.cluster == ClusterShape::automatic &&
      t.fp8_rows_cluster == ClusterShape::automatic) {
    EXPECT_EQ(l.cluster_m, cluster_m) << what << ": cluster";
    EXPECT_EQ(l.cluster_n, cluster_n) << what << ": cluster";
  }
}

inline HostTensor host_of(const TensorView& v) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  HostTensor h(v.dtype, shape);
  if (!h.bytes().empty()) {
    test_cuda_check(cudaMemcpy(h.data(), v.data, h.bytes().size(),
                               v.device.is_cuda() ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost),
                    "cudaMemcpy");
  }
  return h;
}
/// The values of a view on either device, expert-major for weights and biases (absent: none).
inline std::vector<double> values(const TensorView& v) { return host_of(v).to_double(); }
inline std::vector<double> values(const ExpertWeights& w) {
  std::vector<double> out;
  for (int64_t e = 0; e < w.num_experts(); ++e) {
    const std::vector<double> v = values(w.expert(e));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}
inline std::vector<double> values(const ExpertBias& b) {
  std::vector<double> out;
  for (int64_t e = 0; b.defined() && e < b.num_experts(); ++e) {
    const std::vector<double> v = values(b.expert(e));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

/// Expert-shaped tensors on the device, in either layout.
struct DeviceExperts {
  DeviceTensor stacked;
  std::vector<DeviceTensor> list;
  Layout layout = Layout::kStacked;

  DeviceExperts() = default;
  DeviceExperts(const HostTensor& stacked_host, const std::vector<HostTensor>& list_host, Layout l)
      : layout(l) {
    if (l == Layout::kStacked) {
      stacked = DeviceTensor(stacked_host);
    } else {
      for (const HostTensor& t : list_host) list.emplace_back(t);
    }
  }
  explicit DeviceExperts(const HostExpertTensor& h) : layout(h.layout) {
    if (h.layout == Layout::kStacked) {
      stacked = DeviceTensor(h.stacked);
    } else {
      for (const HostTensor& t : h.list) list.emplace_back(t);
    }
  }
  ExpertWeights view() const {
    if (layout == Layout::kStacked) return ExpertWeights::from_stacked(stacked.view());
    std::vector<TensorView> v;
    for (const DeviceTensor& t : list) v.push_back(t.view());
    return ExpertWeights::from_list(std::move(v));
  }
  void upload(const HostExpertTensor& h) {
    if (layout == Layout::kStacked) {
      stacked.upload(h.stacked);
    } else {
      for (size_t e = 0; e < list.size(); ++e) list[e].upload(h.list[e]);
    }
  }
  /// Expert-major values as doubles.
  std::vector<double> to_double() const {
    if (layout == Layout::kStacked) return stacked.download().to_double();
    std::vector<double> out;
    for (const DeviceTensor& t : list) {
      const std::vector<double> v = t.download().to_double();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
};

/// An f32 weight gradient written over random contents, then accumulated onto itself: every
/// element must come out exactly doubled (stored once, then added once). `run(dw, accumulate)`
/// computes the gradient into dw.
template <class Run>
void expect_overwrite_then_accumulate(Layout layout, int64_t E, int64_t N, int64_t K, Rng& rng, Run&& run) {
  HostTensor init(DType::f32, {E, N, K});
  fill_random(init, rng, -4.0, 4.0);
  HostExpertTensor dw_host(layout, DType::f32, E, N, K);
  dw_host.set_all(init.to_double());
  DeviceExperts dw(dw_host);
  run(dw.view(), false);
  const std::vector<double> once = dw.to_double();
  run(dw.view(), true);
  EXPECT_TRUE(doubled_exactly(once, dw.to_double(), "wgrad f32 overwrite, then accumulate"));
}

}  // namespace gmoe::test
