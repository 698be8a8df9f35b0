// src/common/glu_convert.cpp — convert_fc1_glu (gmoe/activation.h): FC1 weights and biases moved
// between gate/up layouts, checked at the edge, then converted per expert on the CPU (the checkpoint
// module's convert_glu) or by the CUDA backend's row permutation.
#include <vector>

#include "common/backend.h"
#include "common/checks.h"
#include "gmoe/activation.h"
#include "gmoe/checkpoint.h"
#include "gmoe/error.h"

namespace gmoe {

namespace {

void check_glu_format(const GluFormat& f, int64_t F, const char* name) {
  GMOE_CHECK(f.layout == GluLayout::concatenated || f.layout == GluLayout::interleaved, name,
             ": unknown gate/up layout ", static_cast<int>(f.layout));
  if (f.layout == GluLayout::interleaved) {
    GMOE_CHECK(f.block >= 1 && F % f.block == 0, name, ".block: the interleave block ", f.block,
               " must be >= 1 and divide the ", F, " rows of each half (gate, up)");
  }
}

// [N] or [N, K] as [1, N, K'] (K' = 1 for a vector), the shape permute_glu_rows takes.
TensorView as_outer_rows(const TensorView& v) {
  TensorView t = v;
  const int64_t rows = v.size(0), cols = v.ndim == 2 ? v.size(1) : 1;
  const int64_t row_stride = v.stride(0), col_stride = v.ndim == 2 ? v.stride(1) : 1;
  t.ndim = 3;
  t.shape = {1, rows, cols, 0, 0, 0};
  t.strides = {rows * row_stride, row_stride, col_stride, 0, 0, 0};
  return t;
}
// [E, N] as [E, N, 1].
TensorView grouped_as_rows(const TensorView& v) {
  TensorView t = v;
  t.ndim = 3;
  t.shape = {v.size(0), v.size(1), 1, 0, 0, 0};
  t.strides = {v.stride(0), v.stride(1), 1, 0, 0, 0};
  return t;
}

// The same source and destination set-up for weights and biases: E views each (or one stacked/
// grouped view each), checked not to overlap, converted per expert on the CPU or launched on the
// device (one launch when both are stacked/grouped).
void convert_views(const std::vector<TensorView>& src, const std::vector<TensorView>& dst, bool one_view_each,
                   const GluFormat& from, const GluFormat& to, Stream stream) {
  for (size_t i = 0; i < src.size(); ++i) {
    for (size_t j = 0; j < dst.size(); ++j) check_disjoint(src[i], "src", dst[j], "dst");
  }
  const Device dev = src[0].device;
  if (dev.is_cpu()) {
    // convert_glu moves whole contiguous tensors along the gate/up axis (0 for one expert).
    const int axis = one_view_each ? 1 : 0;
    for (size_t i = 0; i < src.size(); ++i) {
      GMOE_CHECK(src[i].is_contiguous(), "src: on the CPU every expert must be contiguous, got ", src[i].str());
      GMOE_CHECK(dst[i].is_contiguous(), "dst: on the CPU every expert must be contiguous, got ", dst[i].str());
      convert_glu(src[i], from, dst[i], to, axis);
    }
    return;
  }
  check_cuda_compiled("convert_fc1_glu");
  for (size_t i = 0; i < src.size(); ++i) cuda_backend::permute_glu_rows(src[i], dst[i], from, to, stream);
}

}  // namespace

void convert_fc1_glu(const ExpertWeights& src, const GluFormat& from, const ExpertWeights& dst, const GluFormat& to,
                     Stream stream) {
  check_expert_weights(src, "src");
  check_expert_weights(dst, "dst");
  const int64_t E = src.num_experts(), rows = src.rows(), cols = src.cols();
  GMOE_CHECK(dst.num_experts() == E && dst.rows() == rows && dst.cols() == cols, "dst: expected ", E,
             " experts of [", rows, ", ", cols, "] (src's), got ", dst.num_experts(), " of [", dst.rows(), ", ",
             dst.cols(), "]");
  GMOE_CHECK(dst.dtype() == src.dtype(), "dst: expected dtype ", dtype_name(src.dtype()), " (src's), got ",
             dtype_name(dst.dtype()));
  check_same_device(dst.device(), src.device(), "dst");
  GMOE_CHECK(rows % 2 == 0, "src: FC1 weights need an even number of rows (gate and up halves), got ", rows);
  check_glu_format(from, rows / 2, "from");
  check_glu_format(to, rows / 2, "to");
  const bool stacked = src.is_stacked() && dst.is_stacked();
  std::vector<TensorView> s, d;
  if (stacked) {
    s.push_back(src.stacked);
    d.push_back(dst.stacked);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      s.push_back(src.expert(e));
      d.push_back(dst.expert(e));
    }
  }
  if (src.device().is_cuda() && !stacked) {
    for (auto* v : {&s, &d}) {
      for (TensorView& t : *v) t = as_outer_rows(t);
    }
  }
  convert_views(s, d, stacked, from, to, stream);
}

void convert_fc1_glu(const ExpertBias& src, const GluFormat& from, const ExpertBias& dst, const GluFormat& to,
                     Stream stream) {
  GMOE_CHECK(src.defined(), "src: absent (no bias to convert)");
  const int64_t E = src.num_experts(), rows = src.size();
  check_expert_bias(src, "src", E, rows, src.dtype(), src.device());
  GMOE_CHECK(dst.defined(), "dst: absent");
  GMOE_CHECK(dst.dtype() == src.dtype(), "dst: expected dtype ", dtype_name(src.dtype()), " (src's), got ",
             dtype_name(dst.dtype()));
  check_expert_bias(dst, "dst", E, rows, src.dtype(), src.device());
  GMOE_CHECK(rows % 2 == 0, "src: FC1 biases need an even number of entries (gate and up halves), got ", rows);
  check_glu_format(from, rows / 2, "from");
  check_glu_format(to, rows / 2, "to");
  const bool grouped = src.is_grouped() && dst.is_grouped();
  const bool cuda = src.device().is_cuda();
  std::vector<TensorView> s, d;
  if (grouped) {
    s.push_back(cuda ? grouped_as_rows(src.grouped) : src.grouped);
    d.push_back(cuda ? grouped_as_rows(dst.grouped) : dst.grouped);
  } else {
    for (int64_t e = 0; e < E; ++e) {
      s.push_back(cuda ? as_outer_rows(src.expert(e)) : src.expert(e));
      d.push_back(cuda ? as_outer_rows(dst.expert(e)) : dst.expert(e));
    }
  }
  convert_views(s, d, grouped, from, to, stream);
}

}  // namespace gmoe
