// src/common/copy.cpp — the public copy and zero-fill ops: edge checks, then the tensors' backend.
#include "gmoe/copy.h"

#include <cstring>

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"

namespace gmoe {

void copy_rows(const TensorView& dst, const TensorView& src, Stream stream) {
  check_rows(dst, "dst");
  check_rows(src, "src");
  GMOE_CHECK(dst.size(0) == src.size(0) && dst.size(1) == src.size(1) && dst.dtype == src.dtype, "dst: expected ",
             dtype_name(src.dtype), src.shape_str(), " (src's), got ", dst.str());
  check_same_device(dst.device, src.device, "dst");
  check_disjoint(dst, "dst", src, "src");
  if (src.device.is_cpu()) {
    cpu_backend::copy_rows(dst, src);
  } else {
    check_cuda_compiled("copy_rows");
    cuda_backend::copy_rows(dst, src, stream);
  }
}

void fill_zero(const TensorView& t, Stream stream) {
  GMOE_CHECK(t.defined(), "t: absent");
  GMOE_CHECK(t.is_contiguous(), "t: must be contiguous, got ", t.str());
  GMOE_CHECK(t.data != nullptr || t.numel() == 0, "t: null data for ", t.shape_str());
  const auto bytes = static_cast<std::size_t>(t.nbytes());
  if (bytes == 0) return;
  if (t.device.is_cpu()) {
    std::memset(t.data, 0, bytes);
  } else {
    check_cuda_compiled("fill_zero");
    cuda_backend::zero_bytes(t.data, bytes, stream);
  }
}

Tensor upload_counts(const TensorView& host_counts, Device device, Stream stream, Allocator* alloc) {
  check_counts(host_counts, "host_counts", Device::cpu());
  Allocator& a = pick_allocator(alloc, device);
  GMOE_CHECK(a.device() == device, "alloc: serves ", a.device().str(), ", the counts go to ", device.str());
  const int64_t E = host_counts.size(0);
  Tensor out = Tensor::empty({E}, host_counts.dtype, a, stream);
  const auto bytes = static_cast<std::size_t>(host_counts.nbytes());
  if (device.is_cpu()) {
    std::memcpy(out.view().data, host_counts.data, bytes);
  } else {
    check_cuda_compiled("upload_counts");
    cuda_backend::upload_host_bytes(out.view().data, host_counts.data, bytes, stream);
  }
  return out;
}

}  // namespace gmoe
