// python/csrc/torch_bridge.cpp — torch tensors as gmoe views, and the CPU side of Exec.
#include "torch_bridge.h"

#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace gmoe_torch {
namespace {

/// gmoe's host scratch through torch's CPU allocator (stream ignored, as for the host allocator).
/// torch aligns CPU memory to 64 bytes; gmoe's Allocator contract asks 256, so each allocation
/// takes 256 bytes more and returns the first 256-byte boundary past a slot that keeps torch's
/// pointer for free().
class TorchCpuAllocator final : public gmoe::Allocator {
 public:
  static constexpr std::size_t kAlign = 256;
  void* allocate(std::size_t bytes, gmoe::Stream) override {
    if (bytes == 0) return nullptr;
    char* raw = static_cast<char*>(c10::GetCPUAllocator()->raw_allocate(bytes + kAlign));
    const std::uintptr_t at = (reinterpret_cast<std::uintptr_t>(raw) + sizeof(void*) + kAlign - 1) / kAlign * kAlign;
    void* aligned = reinterpret_cast<void*>(at);
    std::memcpy(static_cast<char*>(aligned) - sizeof(void*), &raw, sizeof(void*));
    return aligned;
  }
  void free(void* ptr, gmoe::Stream) override {
    if (ptr == nullptr) return;
    void* raw = nullptr;
    std::memcpy(&raw, static_cast<char*>(ptr) - sizeof(void*), sizeof(void*));
    c10::GetCPUAllocator()->raw_deallocate(raw);
  }
  gmoe::Device device() const override { return gmoe::Device::cpu(); }
};

gmoe::Device device_of(const c10::Device& d, const char* what) {
  if (d.is_cpu()) return gmoe::Device::cpu();
  if (d.is_cuda()) return gmoe::Device::cuda(d.index());
  TORCH_CHECK_VALUE(false, what, ": gmoe runs on CPU and CUDA tensors, got a tensor on ", d.str());
}

}  // namespace

gmoe::DType dtype_of(c10::ScalarType t, const char* what) {
  switch (t) {
    case at::kFloat: return gmoe::DType::f32;
    case at::kBFloat16: return gmoe::DType::bf16;
    case at::kHalf: return gmoe::DType::f16;
    case at::kFloat8_e4m3fn: return gmoe::DType::e4m3;
    case at::kFloat8_e5m2: return gmoe::DType::e5m2;
    case at::kFloat8_e8m0fnu: return gmoe::DType::e8m0;
    case at::kInt: return gmoe::DType::i32;
    case at::kLong: return gmoe::DType::i64;
    default: break;
  }
  TORCH_CHECK_VALUE(false, what, ": gmoe has no dtype for torch.", c10::toString(t),
                    " (it takes float32, bfloat16, float16, float8_e4m3fn, float8_e5m2, float8_e8m0fnu, "
                    "int32, int64)");
}

c10::ScalarType scalar_type_of(gmoe::DType t) {
  switch (t) {
    case gmoe::DType::f32: return at::kFloat;
    case gmoe::DType::bf16: return at::kBFloat16;
    case gmoe::DType::f16: return at::kHalf;
    case gmoe::DType::e4m3: return at::kFloat8_e4m3fn;
    case gmoe::DType::e5m2: return at::kFloat8_e5m2;
    case gmoe::DType::e8m0: return at::kFloat8_e8m0fnu;
    case gmoe::DType::i32: return at::kInt;
    case gmoe::DType::i64: return at::kLong;
  }
  TORCH_CHECK(false, "unknown gmoe dtype");
}

gmoe::TensorView view_of(const at::Tensor& t, const char* what) {
  gmoe::TensorView v;
  if (!t.defined()) return v;
  TORCH_CHECK_VALUE(t.dim() <= gmoe::TensorView::kMaxDims, what, ": gmoe views have at most ",
                    gmoe::TensorView::kMaxDims, " dimensions, got ", t.dim());
  v.data = t.data_ptr();
  v.dtype = dtype_of(t.scalar_type(), what);
  v.device = device_of(t.device(), what);
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  // A tensor without elements addresses no memory, and torch calls it contiguous whatever its
  // strides (autograd's gradient of a sum over 0 tokens is an expanded [0, H] with strides 0, and
  // .contiguous() keeps it): gmoe sees the contiguous strides of its shape.
  if (t.numel() == 0) {
    int64_t stride = 1;
    for (int d = v.ndim - 1; d >= 0; --d) {
      v.strides[d] = stride;
      stride *= std::max<int64_t>(v.shape[d], 1);
    }
  }
  return v;
}

gmoe::TensorView view_of(const std::optional<at::Tensor>& t, const char* what) {
  return t.has_value() ? view_of(*t, what) : gmoe::TensorView();
}

namespace {

/// The views of a per-expert list, each of `ndim` dimensions.
std::vector<gmoe::TensorView> per_expert_views(at::TensorList ts, int64_t ndim, const char* what,
                                               const char* expected) {
  std::vector<gmoe::TensorView> list;
  list.reserve(ts.size());
  for (const at::Tensor& t : ts) {
    TORCH_CHECK_VALUE(t.dim() == ndim, what, ": expected ", expected, ", got a ", t.dim(), "-D tensor ", t.sizes(),
                      " among ", ts.size());
    list.push_back(view_of(t, what));
  }
  return list;
}

}  // namespace

gmoe::ExpertWeights weights_of(at::TensorList w, const char* what) {
  TORCH_CHECK_VALUE(!w.empty(), what, ": expected one stacked [E, N, K] tensor or E tensors [N, K], got none");
  if (w.size() == 1 && w[0].dim() == 3) return gmoe::ExpertWeights::from_stacked(view_of(w[0], what));
  return gmoe::ExpertWeights::from_list(per_expert_views(w, 2, what, "one stacked [E, N, K] tensor or E tensors [N, K]"));
}

gmoe::ExpertBias bias_of(at::TensorList b, const char* what) {
  if (b.empty()) return gmoe::ExpertBias::none();
  if (b.size() == 1 && b[0].dim() == 2) return gmoe::ExpertBias::from_grouped(view_of(b[0], what));
  return gmoe::ExpertBias::from_list(per_expert_views(b, 1, what, "one grouped [E, N] tensor or E tensors [N]"));
}

Exec exec_on(const c10::Device& device) {
  if (device.is_cpu()) {
    static TorchCpuAllocator cpu_allocator;
    return Exec{nullptr, &cpu_allocator};
  }
#ifdef GMOE_TORCH_CUDA
  if (device.is_cuda()) return cuda_exec(device.index());
#endif
  TORCH_CHECK_VALUE(false, "gmoe: no backend for tensors on ", device.str(),
                    " (this build has the CPU backend", device.is_cuda() ? " only)" : " and CUDA)");
}

}  // namespace gmoe_torch
