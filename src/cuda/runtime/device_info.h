// src/cuda/runtime/device_info.h — device properties the CUDA backend needs, read from the device once.
#pragma once

#include <cstdint>

namespace gmoe::cuda_backend {

/// Multiprocessor count of CUDA device `device`, read with cudaDeviceGetAttribute on first use and
/// cached per device (never hard-coded: H100 SXM has 132, PCIe 114, H200 132, and MIG slices less).
int sm_count(int device);

/// L2 cache bytes of CUDA device `device`, read once and cached per device (50 MB on H100 SXM).
int64_t l2_bytes(int device);

/// The current CUDA device.
int current_device();

/// Makes `device` current for the guard's lifetime (a no-op when it already is).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace gmoe::cuda_backend
