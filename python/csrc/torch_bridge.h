// python/csrc/torch_bridge.h — what the op kernels need to call gmoe with torch tensors: views of
// tensors, the stream and allocator of the tensors' device, and gmoe's errors as Python exceptions.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <optional>

#include "gmoe/allocator.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe_torch {

/// The gmoe dtype of a torch dtype; a ValueError naming `what` for dtypes gmoe has none for.
gmoe::DType dtype_of(c10::ScalarType t, const char* what);
/// The torch dtype of a gmoe dtype.
c10::ScalarType scalar_type_of(gmoe::DType t);

/// A view of `t` (its storage, shape and strides, unchanged); absent for an undefined tensor.
gmoe::TensorView view_of(const at::Tensor& t, const char* what);
gmoe::TensorView view_of(const std::optional<at::Tensor>& t, const char* what);
/// Expert weights from a schema `Tensor[]`: one 3-D tensor is the stacked layout [E, N, K], 2-D
/// tensors are the per-expert layout.
gmoe::ExpertWeights weights_of(at::TensorList w, const char* what);
/// Expert biases from a schema `Tensor[]`: empty is no bias, one 2-D tensor the grouped [E, N]
/// layout, 1-D tensors the per-expert one.
gmoe::ExpertBias bias_of(at::TensorList b, const char* what);

/// Where an op runs: the current torch stream of the device (nullptr on the CPU) and an allocator
/// on torch's caching allocator for gmoe's scratch, so that gmoe and torch share one memory pool
/// (and a CUDA graph's private pool during capture).
struct Exec {
  gmoe::Stream stream = nullptr;
  gmoe::Allocator* alloc = nullptr;
};
Exec exec_on(const c10::Device& device);

#ifdef GMOE_TORCH_CUDA
/// cuda_bridge.cpp: the current stream of CUDA device `index` and the caching allocator's view.
Exec cuda_exec(c10::DeviceIndex index);
#endif

/// The device of an op (the device of its first tensor argument), made current for the call.
class OpScope {
 public:
  explicit OpScope(const at::Tensor& anchor) : guard_(anchor.device()), exec_(exec_on(anchor.device())) {}
  gmoe::Stream stream() const { return exec_.stream; }
  gmoe::Allocator* alloc() const { return exec_.alloc; }

 private:
  c10::DeviceGuard guard_;
  Exec exec_;
};

/// Runs `f`, turning gmoe::Error into a c10::ValueError (Python ValueError) with gmoe's message.
template <class F>
auto guarded(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const gmoe::Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace gmoe_torch
