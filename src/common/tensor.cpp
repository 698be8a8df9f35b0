// src/common/tensor.cpp — TensorView and Device helpers.
#include "gmoe/tensor.h"

#include <sstream>

#include "common/checked_math.h"
#include "gmoe/error.h"

namespace gmoe {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : "cuda:" + std::to_string(index);
}

// Row-major strides. Every stride must fit even when a size is 0 ([0, 2^62, 4] has no element
// but a first stride of 2^64), which checked_numel of the sizes guarantees.
static void fill_contiguous_strides(TensorView& t) {
  (void)checked_numel(t.shape.begin(), t.shape.begin() + t.ndim, "TensorView: contiguous strides");
  int64_t s = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = s;
    s *= t.shape[d];
  }
}

TensorView::TensorView(void* data_, DType dtype_, Device device_,
                       std::initializer_list<int64_t> shape_)
    : data(data_), dtype(dtype_), device(device_) {
  GMOE_CHECK(shape_.size() <= static_cast<size_t>(kMaxDims), "TensorView: at most ", kMaxDims,
             " dimensions, got ", shape_.size());
  ndim = static_cast<int>(shape_.size());
  int d = 0;
  for (int64_t s : shape_) {
    GMOE_CHECK(s >= 0, "TensorView: negative size ", s, " in dimension ", d);
    shape[d++] = s;
  }
  fill_contiguous_strides(*this);
}

TensorView::TensorView(void* data_, DType dtype_, Device device_,
                       std::initializer_list<int64_t> shape_,
                       std::initializer_list<int64_t> strides_)
    : TensorView(data_, dtype_, device_, shape_) {
  GMOE_CHECK(strides_.size() == shape_.size(), "TensorView: ", shape_.size(), " sizes but ",
             strides_.size(), " strides");
  int d = 0;
  for (int64_t s : strides_) strides[d++] = s;
}

int64_t TensorView::numel() const {
  return checked_numel(shape.begin(), shape.begin() + ndim, "TensorView: element count");
}

int64_t TensorView::nbytes() const {
  return checked_mul(numel(), static_cast<int64_t>(dtype_size(dtype)), "TensorView: byte count");
}

bool TensorView::is_contiguous() const {
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    // A product past int64 cannot be any stride.
    if (__builtin_mul_overflow(expected, shape[d], &expected)) return false;
  }
  return true;
}

TensorView TensorView::select0(int64_t i) const {
  GMOE_CHECK(ndim >= 1, "select0 on a 0-d tensor");
  GMOE_CHECK(i >= 0 && i < shape[0], "select0: index ", i, " out of range [0, ", shape[0], ")");
  TensorView out;
  out.dtype = dtype;
  out.device = device;
  out.ndim = ndim - 1;
  for (int d = 1; d < ndim; ++d) {
    out.shape[d - 1] = shape[d];
    out.strides[d - 1] = strides[d];
  }
  out.data = data == nullptr ? nullptr
                             : static_cast<char*>(data) +
                                   i * strides[0] * static_cast<int64_t>(dtype_size(dtype));
  return out;
}

std::string TensorView::shape_str() const {
  std::ostringstream os;
  os << "[";
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << "]";
  return os.str();
}

std::string TensorView::str() const {
  if (!defined()) return "(absent)";
  return std::string(dtype_name(dtype)) + shape_str() + " on " + device.str();
}

}  // namespace gmoe
