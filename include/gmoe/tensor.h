// gmoe/tensor.h — devices and non-owning tensor views.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "gmoe/dtype.h"

namespace gmoe {

/// Where memory lives.
enum class DeviceType : uint8_t { cpu, cuda };

/// A device: CPU, or a CUDA device with its ordinal.
struct Device {
  DeviceType type = DeviceType::cpu;  ///< CPU or CUDA
  int index = 0;  ///< CUDA device ordinal; 0 for the CPU.

  static Device cpu() { return Device{DeviceType::cpu, 0}; }                ///< the CPU
  static Device cuda(int index = 0) { return Device{DeviceType::cuda, index}; }  ///< CUDA device `index`
  bool is_cpu() const { return type == DeviceType::cpu; }    ///< type == cpu
  bool is_cuda() const { return type == DeviceType::cuda; }  ///< type == cuda
  bool operator==(const Device& o) const { return type == o.type && index == o.index; }  ///< same type and index
  bool operator!=(const Device& o) const { return !(*this == o); }                        ///< not ==
  /// "cpu" or "cuda:N".
  std::string str() const;
};

/// A non-owning view of a strided tensor: data pointer, dtype, device, and up to kMaxDims 64-bit
/// sizes and strides (strides in elements). All indexing is 64-bit: tensors past 2^31 elements are
/// normal in MoE. A default-constructed view is "absent" (data == nullptr, ndim == 0); optional
/// arguments are passed that way.
struct TensorView {
  static constexpr int kMaxDims = 6;  ///< the most dimensions a view has

  void* data = nullptr;                      ///< element (0, ..., 0); nullptr when absent
  DType dtype = DType::f32;                  ///< element type
  Device device{};                           ///< where `data` lives
  int ndim = 0;                              ///< dimensions in use (0: absent)
  std::array<int64_t, kMaxDims> shape{};     ///< sizes of the first ndim dimensions
  std::array<int64_t, kMaxDims> strides{};   ///< strides in elements of the first ndim dimensions

  /// An absent view.
  TensorView() = default;
  /// A contiguous (row-major) view of `shape`. Throws gmoe::Error on a negative size, or when the
  /// strides or the element count do not fit in int64 (the non-zero sizes' product must fit).
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape);
  /// A view with explicit strides (elements).
  TensorView(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape,
             std::initializer_list<int64_t> strides);

  /// True when the view refers to something (data != nullptr or a zero-element tensor with a shape).
  bool defined() const { return data != nullptr || ndim > 0; }
  /// Size of dimension `dim` (negative: from the end).
  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  /// Stride in elements of dimension `dim` (negative: from the end).
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  /// Number of elements: 0 when a size is 0, else the product of the sizes. Throws gmoe::Error
  /// when a size is negative or the product of the non-zero sizes does not fit in int64.
  int64_t numel() const;
  /// numel() times the element size; throws gmoe::Error when that does not fit in int64.
  int64_t nbytes() const;
  /// Row-major contiguous (strides are the products of the trailing sizes; size-1 dims ignored).
  bool is_contiguous() const;
  /// Element pointer at a flat row-major position of a contiguous view.
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  /// A view of index `i` along dimension 0 (drops that dimension).
  TensorView select0(int64_t i) const;
  /// "bf16[8, 4096, 7168] on cuda:0".
  std::string str() const;
  /// "[8, 4096, 7168]".
  std::string shape_str() const;
};

}  // namespace gmoe
