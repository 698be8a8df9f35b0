// python/csrc/ep_ops.cpp — expert parallelism (gmoe/expert_parallel.h) in PyTorch's dispatcher.
//
// A group lives in this extension and is named by an int handle (torch ops take no C++ objects
// without TorchScript classes, and an int stays a constant under torch.compile): ep_group_nccl /
// ep_group_local make groups, ep_group_info describes one, ep_group_destroy frees it. The collective
// ops take the handle:
//   ep_plan(group, counts)                                   -> (counts_all [R, E], local_counts [El])
//   ep_dispatch(group, counts_all, local_counts, rows, scalars?)  -> (rows [recv_capacity, H], scalars)
//   ep_combine(group, counts_all, local_counts, rows, scalars?)   -> (rows [max_rows, H], scalars)
// scalars out: f32 [capacity], or an empty f32 [0] when none were given. The plan is passed as its
// two tensors, so that autograd and torch.compile see ordinary tensors.
//
// The outputs are torch tensors: gmoe allocates them through an allocator that hands out torch
// tensors' memory (at::empty on the op's device and current stream, so torch's caching allocator and
// a CUDA graph's private pool own it) and keeps them, so the op returns the very tensor gmoe wrote.
// The ops run with the GIL released (torch.ops does so), so the CPU backend's ranks can be threads of
// one Python process.
#include <torch/library.h>

#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "gmoe/expert_parallel.h"
#include "torch_bridge.h"

namespace gmoe_torch {
namespace {

std::mutex groups_mutex;
// Never destroyed: a group still open at exit is left to the process's end, not destroyed by a static
// destructor (on NCCL that is collective, and the other ranks may be gone, or CUDA torn down, by then).
auto& groups = *new std::unordered_map<int64_t, std::unique_ptr<gmoe::EpGroup>>();
int64_t next_handle = 1;

int64_t keep(std::unique_ptr<gmoe::EpGroup> g) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  groups.emplace(next_handle, std::move(g));
  return next_handle++;
}

gmoe::EpGroup& group_of(int64_t handle) {
  std::lock_guard<std::mutex> lock(groups_mutex);
  auto it = groups.find(handle);
  TORCH_CHECK_VALUE(it != groups.end(), "group: no expert-parallel group ", handle, " (destroyed, or never made)");
  return *it->second;
}

gmoe::EpGroupOptions options_of(int64_t num_experts, int64_t hidden, c10::ScalarType dtype, int64_t max_rows,
                                int64_t max_recv_rows) {
  gmoe::EpGroupOptions o;
  o.num_experts = num_experts;
  o.hidden = hidden;
  o.dtype = dtype_of(dtype, "dtype");
  o.max_rows = max_rows;
  o.max_recv_rows = max_recv_rows;
  return o;
}

/// gmoe's allocations as torch tensors: every block is a byte tensor kept here until gmoe frees it;
/// as_tensor() hands out the tensor behind an output, which then outlives this allocator.
class TensorAllocator final : public gmoe::Allocator {
 public:
  explicit TensorAllocator(const c10::Device& device) : device_(device) {}
  void* allocate(std::size_t bytes, gmoe::Stream) override {
    if (bytes == 0) return nullptr;
    // at::empty allocates on the current stream of the device, which is the op's stream.
    at::Tensor t = at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().device(device_).dtype(at::kByte));
    void* p = t.data_ptr();
    blocks_.emplace(p, std::move(t));
    return p;
  }
  void free(void* ptr, gmoe::Stream) override {
    if (ptr != nullptr) blocks_.erase(ptr);
  }
  gmoe::Device device() const override {
    return device_.is_cuda() ? gmoe::Device::cuda(device_.index()) : gmoe::Device::cpu();
  }
  /// The torch tensor of `t` (made by this allocator): t's shape and dtype on t's memory; an empty
  /// tensor of `absent` dtype for an absent one.
  at::Tensor as_tensor(const gmoe::Tensor& t, c10::ScalarType absent) const {
    const gmoe::TensorView& v = t.view();
    if (!v.defined()) return at::empty({0}, at::TensorOptions().device(device_).dtype(absent));
    const std::vector<int64_t> sizes(v.shape.begin(), v.shape.begin() + v.ndim);
    const auto options = at::TensorOptions().device(device_).dtype(scalar_type_of(v.dtype));
    if (v.data == nullptr) return at::empty(sizes, options);  // zero elements: no memory
    auto it = blocks_.find(v.data);
    TORCH_CHECK(it != blocks_.end(), "gmoe expert parallelism: an output not made by the op's allocator");
    return at::empty({0}, options).set_(it->second.storage(), 0, sizes);
  }

 private:
  c10::Device device_;
  std::unordered_map<void*, at::Tensor> blocks_;
};

// ---- groups -------------------------------------------------------------------------------------

at::Tensor ep_unique_id() {
  return guarded([&] {
    const gmoe::EpUniqueId id = gmoe::ep_unique_id();
    at::Tensor out = at::empty({static_cast<int64_t>(sizeof(id.bytes))}, at::kByte);
    std::memcpy(out.data_ptr(), id.bytes, sizeof(id.bytes));
    return out;
  });
}

int64_t ep_group_nccl(const at::Tensor& unique_id, int64_t rank, int64_t size, c10::Device device,
                      int64_t num_experts, int64_t hidden, c10::ScalarType dtype, int64_t max_rows,
                      int64_t max_recv_rows) {
  return guarded([&] {
    gmoe::EpUniqueId id;
    TORCH_CHECK_VALUE(unique_id.device().is_cpu() && unique_id.scalar_type() == at::kByte &&
                          unique_id.numel() == static_cast<int64_t>(sizeof(id.bytes)),
                      "unique_id: expected a CPU uint8 tensor of ", sizeof(id.bytes), " bytes (ep_unique_id), got ",
                      unique_id.scalar_type(), " ", unique_id.sizes(), " on ", unique_id.device());
    TORCH_CHECK_VALUE(device.is_cuda() && device.has_index(), "device: expected a CUDA device with an index, got ",
                      device);
    std::memcpy(id.bytes, unique_id.contiguous().data_ptr(), sizeof(id.bytes));
    return keep(gmoe::make_ep_group_nccl(id, static_cast<int>(rank), static_cast<int>(size),
                                         gmoe::Device::cuda(device.index()),
                                         options_of(num_experts, hidden, dtype, max_rows, max_recv_rows)));
  });
}

std::vector<int64_t> ep_group_local(int64_t size, int64_t num_experts, int64_t hidden, c10::ScalarType dtype,
                                    int64_t max_rows, int64_t max_recv_rows) {
  return guarded([&] {
    std::vector<int64_t> handles;
    for (auto& g : gmoe::make_ep_group_local(static_cast<int>(size),
                                             options_of(num_experts, hidden, dtype, max_rows, max_recv_rows)))
      handles.push_back(keep(std::move(g)));
    return handles;
  });
}

void ep_group_destroy(int64_t handle) {
  std::unique_ptr<gmoe::EpGroup> g;
  {
    std::lock_guard<std::mutex> lock(groups_mutex);
    auto it = groups.find(handle);
    TORCH_CHECK_VALUE(it != groups.end(), "group: no expert-parallel group ", handle);
    g = std::move(it->second);
    groups.erase(it);
  }
  guarded([&] { g.reset(); });  // NCCL: collective, outside the lock
}

/// [rank, size, device type (0 CPU, 1 CUDA), device index, E, H, dtype (torch ScalarType), max_rows,
/// recv_capacity, local_experts]
std::vector<int64_t> ep_group_info(int64_t handle) {
  const gmoe::EpGroup& g = group_of(handle);
  const gmoe::EpGroupOptions& o = g.options();
  const gmoe::Device d = g.device();
  return {g.rank(), g.size(), d.is_cuda() ? 1 : 0, d.is_cuda() ? d.index : -1, o.num_experts, o.hidden,
          static_cast<int64_t>(scalar_type_of(o.dtype)), o.max_rows, g.recv_capacity(), g.local_experts()};
}

// ---- the collective ops --------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> ep_plan(int64_t handle, const at::Tensor& counts) {
  return guarded([&] {
    gmoe::EpGroup& g = group_of(handle);
    OpScope s(counts);
    TensorAllocator alloc(counts.device());
    gmoe::EpPlan plan = gmoe::ep_plan(g, view_of(counts, "counts"), &alloc, s.stream());
    return std::make_tuple(alloc.as_tensor(plan.counts_all, at::kInt), alloc.as_tensor(plan.local_counts, at::kInt));
  });
}

gmoe::EpPlan plan_of(const at::Tensor& counts_all, const at::Tensor& local_counts) {
  gmoe::EpPlan plan;
  plan.counts_all = gmoe::Tensor::wrap(view_of(counts_all, "counts_all"));
  plan.local_counts = gmoe::Tensor::wrap(view_of(local_counts, "local_counts"));
  return plan;
}

using EpMove = gmoe::EpRows (*)(gmoe::EpGroup&, const gmoe::EpPlan&, const gmoe::TensorView&, const gmoe::TensorView&,
                                gmoe::Allocator*, gmoe::Stream);

/// ep_dispatch or ep_combine (`op`) on torch tensors.
template <EpMove op>
std::tuple<at::Tensor, at::Tensor> ep_move(int64_t handle, const at::Tensor& counts_all, const at::Tensor& local_counts,
                                           const at::Tensor& rows, const std::optional<at::Tensor>& scalars) {
  return guarded([&] {
    gmoe::EpGroup& g = group_of(handle);
    OpScope s(rows);
    TensorAllocator alloc(rows.device());
    gmoe::EpRows out = op(g, plan_of(counts_all, local_counts), view_of(rows, "rows"), view_of(scalars, "scalars"),
                          &alloc, s.stream());
    return std::make_tuple(alloc.as_tensor(out.rows, rows.scalar_type()), alloc.as_tensor(out.scalars, at::kFloat));
  });
}

void register_ep_impls(torch::Library& m) {
  m.impl("ep_plan", &ep_plan);
  m.impl("ep_dispatch", &ep_move<&gmoe::ep_dispatch>);
  m.impl("ep_combine", &ep_move<&gmoe::ep_combine>);
}

}  // namespace
}  // namespace gmoe_torch

TORCH_LIBRARY_FRAGMENT(gmoe, m) {
  // Host-side group management: no tensor to dispatch on, one kernel for every backend.
  m.def("ep_unique_id() -> Tensor", &gmoe_torch::ep_unique_id);
  m.def("ep_group_nccl(Tensor unique_id, int rank, int size, Device device, int num_experts, int hidden, "
        "ScalarType dtype, int max_rows, int max_recv_rows=0) -> int",
        &gmoe_torch::ep_group_nccl);
  m.def("ep_group_local(int size, int num_experts, int hidden, ScalarType dtype, int max_rows, "
        "int max_recv_rows=0) -> int[]",
        &gmoe_torch::ep_group_local);
  m.def("ep_group_destroy(int group) -> ()", &gmoe_torch::ep_group_destroy);
  m.def("ep_group_info(int group) -> int[]", &gmoe_torch::ep_group_info);
  m.def("ep_plan(int group, Tensor counts) -> (Tensor counts_all, Tensor local_counts)");
  m.def("ep_dispatch(int group, Tensor counts_all, Tensor local_counts, Tensor rows, Tensor? scalars=None) "
        "-> (Tensor rows, Tensor scalars)");
  m.def("ep_combine(int group, Tensor counts_all, Tensor local_counts, Tensor rows, Tensor? scalars=None) "
        "-> (Tensor rows, Tensor scalars)");
}

TORCH_LIBRARY_IMPL(gmoe, CPU, m) { gmoe_torch::register_ep_impls(m); }
#ifdef GMOE_TORCH_CUDA
TORCH_LIBRARY_IMPL(gmoe, CUDA, m) { gmoe_torch::register_ep_impls(m); }
#endif
