// src/common/checks.cpp — argument checks shared by the public ops.
#include "common/checks.h"

#include <cstdlib>
#include <cstring>

#include "common/backend.h"
#include "gmoe/error.h"

namespace gmoe {

void check_rows(const TensorView& t, const char* name) {
  GMOE_CHECK(t.defined() && t.ndim == 2, name, ": expected a 2-D tensor [capacity, cols], got ",
             t.str());
  GMOE_CHECK(t.stride(1) == 1 || t.size(1) <= 1, name,
             ": rows must be contiguous (stride(1) == 1), got strides [", t.stride(0), ", ",
             t.stride(1), "]");
  GMOE_CHECK(t.stride(0) >= t.size(1) || t.size(0) <= 1, name, ": row stride ", t.stride(0),
             " is smaller than the row length ", t.size(1));
  GMOE_CHECK(t.data != nullptr || t.numel() == 0, name, ": null data for ", t.shape_str());
}

void check_counts(const TensorView& counts, const char* name, Device device) {
  GMOE_CHECK(counts.defined() && counts.ndim == 1, name, ": expected a 1-D tensor [E], got ",
             counts.str());
  GMOE_CHECK(counts.size(0) >= 1, name, ": needs at least one expert, got length 0");
  GMOE_CHECK(counts.dtype == DType::i32 || counts.dtype == DType::i64, name,
             ": expected dtype i32 or i64, got ", dtype_name(counts.dtype));
  GMOE_CHECK(counts.stride(0) == 1 || counts.size(0) == 1, name,
             ": must be contiguous, got stride ", counts.stride(0));
  GMOE_CHECK(counts.data != nullptr, name, ": null data");
  check_same_device(counts.device, device, name);
}

static void check_expert_matrix(const TensorView& m, const char* name, int64_t e) {
  GMOE_CHECK(m.stride(1) == 1 || m.size(1) <= 1, name, "[", e,
             "]: columns must be contiguous (stride 1), got strides [", m.stride(0), ", ",
             m.stride(1), "]");
  GMOE_CHECK(m.stride(0) >= m.size(1) || m.size(0) <= 1, name, "[", e, "]: row stride ",
             m.stride(0), " is smaller than the row length ", m.size(1));
  GMOE_CHECK(m.data != nullptr || m.numel() == 0, name, "[", e, "]: null data");
}

void check_expert_weights(const ExpertWeights& w, const char* name) {
  GMOE_CHECK(w.is_stacked() != !w.list.empty(), name,
             ": exactly one of the stacked and list layouts must be set");
  if (w.is_stacked()) {
    const TensorView& s = w.stacked;
    GMOE_CHECK(s.ndim == 3, name, ": stacked layout must be [E, N, K], got ", s.str());
    GMOE_CHECK(s.size(0) >= 1, name, ": needs at least one expert");
    check_expert_matrix(s.select0(0), name, 0);
    GMOE_CHECK(s.stride(0) >= s.size(1) * s.stride(1) || s.size(0) <= 1, name,
               ": expert stride ", s.stride(0), " overlaps the experts (", s.size(1), " rows of stride ",
               s.stride(1), ")");
    return;
  }
  const TensorView& first = w.list[0];
  for (size_t e = 0; e < w.list.size(); ++e) {
    const TensorView& m = w.list[e];
    GMOE_CHECK(m.ndim == 2, name, "[", e, "]: expected [N, K], got ", m.str());
    GMOE_CHECK(m.size(0) == first.size(0) && m.size(1) == first.size(1), name, "[", e,
               "]: every expert must have the shape of expert 0 ", first.shape_str(), ", got ",
               m.shape_str());
    GMOE_CHECK(m.dtype == first.dtype, name, "[", e, "]: dtype ", dtype_name(m.dtype),
               " differs from expert 0's ", dtype_name(first.dtype));
    GMOE_CHECK(m.device == first.device, name, "[", e, "]: on ", m.device.str(),
               ", expert 0 is on ", first.device.str());
    check_expert_matrix(m, name, static_cast<int64_t>(e));
  }
}

void check_same_device(Device given, Device expected, const char* name) {
  GMOE_CHECK(given == expected, name, ": expected a tensor on ", expected.str(), ", got one on ",
             given.str());
}

void check_f32_vector(const TensorView& v, const char* name, int64_t n, const char* what, Device device) {
  GMOE_CHECK(v.ndim == 1 && v.size(0) == n && v.dtype == DType::f32, name, ": expected f32[", n, "] (", what,
             "), got ", v.str());
  GMOE_CHECK(v.stride(0) == 1 || n <= 1, name, ": must be contiguous, got stride ", v.stride(0));
  GMOE_CHECK(v.data != nullptr || n == 0, name, ": null data");
  check_same_device(v.device, device, name);
}

namespace {

// Bytes [first, last) that a view touches (absent or empty views touch nothing).
struct ByteRange {
  const char* first = nullptr;
  const char* last = nullptr;
};
ByteRange byte_range(const TensorView& t) {
  if (!t.defined() || t.numel() == 0) return {};
  const int64_t es = static_cast<int64_t>(dtype_size(t.dtype));
  const char* p = static_cast<const char*>(t.data);
  int64_t last_elem = 0;
  for (int d = 0; d < t.ndim; ++d) last_elem += (t.size(d) - 1) * t.stride(d);
  return {p, p + (last_elem + 1) * es};
}

}  // namespace

void check_disjoint(const TensorView& a, const char* a_name, const TensorView& b, const char* b_name) {
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  if (ra.first == nullptr || rb.first == nullptr) return;
  GMOE_CHECK(ra.last <= rb.first || rb.last <= ra.first, a_name, " and ", b_name,
             " overlap in memory (", a.str(), " at ", a.data, ", ", b.str(), " at ", b.data, ")");
}

void check_input_dtype(DType t, const char* name) {
  GMOE_CHECK(t == DType::bf16 || t == DType::f16 || t == DType::f32, name,
             ": dtype not supported: expected bf16, f16 or f32, got ", dtype_name(t));
}

void check_output_dtype(DType out, DType in, const char* name) {
  GMOE_CHECK(out == in || out == DType::f32, name, ": expected dtype ", dtype_name(in),
             in == DType::f32 ? " (the input's)" : " (the input's) or f32", ", got ", dtype_name(out));
}

void check_expert_mask(const TensorView& mask, int64_t E, Device device) {
  if (!mask.defined()) return;
  GMOE_CHECK(mask.ndim == 1 && mask.size(0) == E && mask.dtype == DType::i32,
             "options.expert_mask: expected i32[", E, "], got ", mask.str());
  GMOE_CHECK(mask.stride(0) == 1 || mask.size(0) <= 1, "options.expert_mask: must be contiguous");
  // A mask given as a shape without data must not read as "no mask": the experts it protects
  // would be overwritten.
  GMOE_CHECK(mask.data != nullptr || E == 0, "options.expert_mask: ", mask.str(),
             " has no data (pass an absent view for no mask)");
  check_same_device(mask.device, device, "options.expert_mask");
}

void check_wgrad_mask(const WgradOptions& options, const ExpertWeights& dw, Device device) {
  const int64_t E = dw.num_experts();
  check_expert_mask(options.expert_mask, E, device);
  const ExpertWeights& fresh = options.fresh_dw;
  const bool has_fresh = fresh.is_stacked() || !fresh.list.empty();
  if (options.masked_off == MaskedOffWgrad::skip) {
    GMOE_CHECK(!has_fresh, "options.fresh_dw: given, but options.masked_off is skip (fresh_dw is only ",
               "written with MaskedOffWgrad::fresh)");
    return;
  }
  GMOE_CHECK(options.expert_mask.defined(), "options.masked_off: fresh needs an expert_mask (the experts with ",
             "mask 0 go to fresh_dw)");
  GMOE_CHECK(has_fresh, "options.fresh_dw: expected E x [", dw.rows(), ", ", dw.cols(),
             "] for masked_off = fresh, got none");
  check_expert_weights(fresh, "options.fresh_dw");
  GMOE_CHECK(fresh.num_experts() == E && fresh.rows() == dw.rows() && fresh.cols() == dw.cols(),
             "options.fresh_dw: expected ", E, " experts of [", dw.rows(), ", ", dw.cols(), "] (dw's), got ",
             fresh.num_experts(), " of [", fresh.rows(), ", ", fresh.cols(), "]");
  GMOE_CHECK(fresh.dtype() == dw.dtype(), "options.fresh_dw: expected ", dtype_name(dw.dtype()),
             " (dw's dtype: both destinations are written by one kernel), got ", dtype_name(fresh.dtype()));
  check_same_device(fresh.device(), device, "options.fresh_dw");
  // Two destinations of one launch must not overlap: a masked-off expert would overwrite a main_grad.
  const TensorView fresh_all = fresh.is_stacked() ? fresh.stacked : TensorView();
  const TensorView dw_all = dw.is_stacked() ? dw.stacked : TensorView();
  for (int64_t e = 0; e < (fresh.is_stacked() ? 1 : E); ++e) {
    const TensorView f = fresh.is_stacked() ? fresh_all : fresh.expert(e);
    for (int64_t d = 0; d < (dw.is_stacked() ? 1 : E); ++d) {
      check_disjoint(f, "options.fresh_dw", dw.is_stacked() ? dw_all : dw.expert(d), "dw");
    }
  }
}

Allocator& pick_allocator(Allocator* alloc, Device device) {
  if (alloc == nullptr) return default_allocator(device);
  GMOE_CHECK(alloc->device().type == device.type, "alloc: allocator for ", alloc->device().str(),
             " used with tensors on ", device.str());
  return *alloc;
}

void check_cuda_compiled(const char* op) {
  GMOE_CHECK(cuda_backend::compiled(), op,
             ": tensors are on CUDA but gmoe was built without CUDA");
}

}  // namespace gmoe
