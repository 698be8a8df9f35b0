// src/common/grouped_bias.cpp — ExpertBias, and the public grouped bias ops: edge checks, then
// dispatch to the backend of the tensors' device.
#include "gmoe/grouped_bias.h"

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/error.h"
#include "gmoe/grouped.h"

namespace gmoe {

ExpertBias ExpertBias::from_grouped(const TensorView& grouped) {
  GMOE_CHECK(grouped.defined() && grouped.ndim == 2, "bias: grouped layout must be [E, N], got ",
             grouped.str());
  ExpertBias b;
  b.grouped = grouped;
  return b;
}

ExpertBias ExpertBias::from_list(std::vector<TensorView> list) {
  GMOE_CHECK(!list.empty(), "bias: the per-expert list is empty");
  for (size_t e = 0; e < list.size(); ++e) {
    GMOE_CHECK(list[e].defined() && list[e].ndim == 1, "bias: list[", e, "] must be [N], got ",
               list[e].str());
  }
  ExpertBias b;
  b.list = std::move(list);
  return b;
}

int64_t ExpertBias::num_experts() const {
  return is_grouped() ? grouped.size(0) : static_cast<int64_t>(list.size());
}
int64_t ExpertBias::size() const {
  return is_grouped() ? grouped.size(1) : (list.empty() ? 0 : list[0].size(0));
}
DType ExpertBias::dtype() const { return is_grouped() ? grouped.dtype : list.at(0).dtype; }
Device ExpertBias::device() const { return is_grouped() ? grouped.device : list.at(0).device; }
TensorView ExpertBias::expert(int64_t e) const {
  GMOE_CHECK(e >= 0 && e < num_experts(), "bias: expert ", e, " out of range [0, ", num_experts(), ")");
  return is_grouped() ? grouped.select0(e) : list[static_cast<size_t>(e)];
}

void check_expert_bias(const ExpertBias& b, const char* name, int64_t E, int64_t N, DType rows_dtype,
                       Device device) {
  GMOE_CHECK(b.defined(), name, ": absent");
  GMOE_CHECK(b.num_experts() == E, name, ": ", b.num_experts(), " experts, but counts has length ", E);
  GMOE_CHECK(b.size() == N, name, ": expected vectors of ", N, ", got ", b.size());
  GMOE_CHECK(b.dtype() == rows_dtype || b.dtype() == DType::f32, name, ": expected dtype ",
             dtype_name(rows_dtype), " or f32, got ", dtype_name(b.dtype()));
  if (b.is_grouped()) {
    GMOE_CHECK(b.grouped.stride(1) == 1 || N <= 1, name, ": [E, N] must have unit column stride");
    GMOE_CHECK(b.grouped.data != nullptr || E * N == 0, name, ": null data");
  }
  for (size_t e = 0; e < b.list.size(); ++e) {
    const TensorView& v = b.list[e];
    GMOE_CHECK(v.size(0) == N && v.dtype == b.dtype() && v.device == b.device(), name, "[", e,
               "]: expected ", dtype_name(b.dtype()), "[", N, "] on ", b.device().str(), ", got ", v.str());
    GMOE_CHECK(v.stride(0) == 1 || N <= 1, name, "[", e, "]: must be contiguous");
    GMOE_CHECK(v.data != nullptr || N == 0, name, "[", e, "]: null data");
  }
  check_same_device(b.device(), device, name);
}

void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts, Stream stream,
                      Allocator* alloc) {
  check_rows(y, "y");
  check_input_dtype(y.dtype, "y");
  check_counts(counts, "counts", y.device);
  check_expert_bias(bias, "bias", counts.size(0), y.size(1), y.dtype, y.device);
  if (y.device.is_cpu()) {
    cpu_backend::grouped_bias_add(y, bias, counts);
  } else {
    check_cuda_compiled("grouped_bias_add");
    cuda_backend::grouped_bias_add(y, bias, counts, stream, pick_allocator(alloc, y.device));
  }
}

void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias, Stream stream,
                       Allocator* alloc) {
  check_rows(dy, "dy");
  check_input_dtype(dy.dtype, "dy");
  check_counts(counts, "counts", dy.device);
  check_expert_bias(dbias, "dbias", counts.size(0), dy.size(1), dy.dtype, dy.device);
  if (dy.device.is_cpu()) {
    cpu_backend::grouped_bias_grad(dy, counts, dbias);
  } else {
    check_cuda_compiled("grouped_bias_grad");
    cuda_backend::grouped_bias_grad(dy, counts, dbias, stream, pick_allocator(alloc, dy.device));
  }
}

}  // namespace gmoe
