// tests/cuda/fp8_device.h — device copies of FP8 operands quantized on the host (the CPU
// quantizer is bit-exact with the CUDA one), for the CUDA suites that run FP8 GEMMs on them.
#pragma once

#include <cstring>
#include <memory>
#include <vector>

#include "cuda/cuda_test_util.h"
#include "gmoe/fp8.h"

namespace gmoe::test {

/// A host copy of a contiguous host view (any dtype), as a HostTensor.
inline HostTensor copy_of(const TensorView& v) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  HostTensor t(v.dtype, shape);
  if (v.nbytes() > 0) std::memcpy(t.data(), v.data, static_cast<size_t>(v.nbytes()));
  return t;
}

/// Owns the device memory behind a device Fp8Grouped / Fp8Weights; reupload() rewrites it in
/// place (same shapes), so a captured graph sees new operands.
class DeviceFp8 {
 public:
  TensorView add(const TensorView& host) {
    if (!host.defined()) return TensorView();
    tensors_.push_back(std::make_unique<DeviceTensor>(copy_of(host)));
    return tensors_.back()->view();
  }
  void reupload(size_t i, const TensorView& host) { tensors_[i]->upload(copy_of(host)); }

 private:
  std::vector<std::unique_ptr<DeviceTensor>> tensors_;
};

/// The device twin of a host Fp8Grouped (every copy it holds).
struct DeviceGrouped {
  DeviceFp8 mem;
  Fp8Grouped q;
  explicit DeviceGrouped(const Fp8Grouped& h) : q(h) {
    q.data = mem.add(h.data);
    q.scale_inv = mem.add(h.scale_inv);
    q.data_t = mem.add(h.data_t);
    q.scale_inv_t = mem.add(h.scale_inv_t);
    q.padded_offsets = mem.add(h.padded_offsets);
  }
  void upload(const Fp8Grouped& h) {
    const TensorView views[] = {h.data, h.scale_inv, h.data_t, h.scale_inv_t, h.padded_offsets};
    for (size_t i = 0; i < 5; ++i) mem.reupload(i, views[i]);
  }
};

/// The device twin of host Fp8Weights.
struct DeviceWeights {
  DeviceFp8 mem;
  Fp8Weights q;
  explicit DeviceWeights(const Fp8Weights& h) : q(h) {
    q.data = mem.add(h.data);
    q.scale_inv = mem.add(h.scale_inv);
    q.data_t = mem.add(h.data_t);
    q.scale_inv_t = mem.add(h.scale_inv_t);
  }
  void upload(const Fp8Weights& h) {
    const TensorView views[] = {h.data, h.scale_inv, h.data_t, h.scale_inv_t};
    for (size_t i = 0; i < 4; ++i) mem.reupload(i, views[i]);
  }
};

}  // namespace gmoe::test
