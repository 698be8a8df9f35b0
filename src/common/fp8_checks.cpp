// src/common/fp8_checks.cpp — edge checks of FP8 operands (see fp8_checks.h).
#include "common/fp8_checks.h"

#include "gmoe/error.h"

namespace gmoe {
namespace {

void check_recipe(Fp8Recipe r, DType format, const char* name) {
  GMOE_CHECK(r == Fp8Recipe::tensorwise || r == Fp8Recipe::blockwise || r == Fp8Recipe::mxfp8, name,
             ".recipe: unknown value ", static_cast<int>(r));
  GMOE_CHECK(is_fp8_format(format), name, ".format: expected e4m3 or e5m2, got ", dtype_name(format));
}

Fp8QuantizeOptions copy_options(Fp8Recipe recipe, DType format, Fp8Copy which) {
  Fp8QuantizeOptions o;
  o.recipe = recipe;
  o.format = format;
  o.rowwise = which == Fp8Copy::rowwise;
  o.columnwise = which == Fp8Copy::columnwise;
  return o;
}

}  // namespace

void check_layout_view(const TensorView& given, const TensorView& expected, const std::string& name) {
  GMOE_CHECK(given.defined(), name, ": absent (expected ", expected.str(), ")");
  GMOE_CHECK(given.ndim == expected.ndim && given.dtype == expected.dtype && given.device == expected.device, name,
             ": expected ", expected.str(), ", got ", given.str());
  for (int d = 0; d < expected.ndim; ++d) {
    GMOE_CHECK(given.shape[d] == expected.shape[d], name, ": expected shape ", expected.shape_str(), ", got ",
               given.shape_str());
  }
  GMOE_CHECK(given.is_contiguous(), name, ": must be contiguous, got ", given.str());
  GMOE_CHECK(given.data != nullptr || given.numel() == 0, name, ": null data for ", given.shape_str());
}

namespace {

// The rowwise copy (data, scale_inv) of an Fp8Grouped or Fp8Weights against its layout `l`.
template <class Q>
void check_rowwise_copy(const Q& q, const Q& l, const char* name, const char* reader) {
  GMOE_CHECK(q.data.defined(), name, ": the rowwise copy (data) is absent", reader);
  check_layout_view(q.data, l.data, std::string(name) + ".data");
  check_layout_view(q.scale_inv, l.scale_inv, std::string(name) + ".scale_inv");
}

}  // namespace

void check_fp8_grouped(const Fp8Grouped& q, int64_t E, Fp8Copy which, Device device, const char* name,
                       const char* reader) {
  check_recipe(q.recipe, q.format, name);
  GMOE_CHECK(q.capacity >= 0 && q.cols >= 0, name, ": negative shape [", q.capacity, ", ", q.cols, "]");
  const Fp8Grouped l = fp8_grouped_layout(q.capacity, q.cols, E, copy_options(q.recipe, q.format, which), device);
  const std::string n(name);
  if (which == Fp8Copy::rowwise) {
    check_rowwise_copy(q, l, name, reader);
  } else {
    GMOE_CHECK(q.data_t.defined(), name, ": the columnwise copy (data_t) is absent", reader);
    GMOE_CHECK(q.padded_capacity == l.padded_capacity, name, ".padded_capacity: expected ", l.padded_capacity,
               " (fp8_padded_capacity(", q.capacity, ", ", E, ")), got ", q.padded_capacity);
    check_layout_view(q.data_t, l.data_t, n + ".data_t");
    check_layout_view(q.scale_inv_t, l.scale_inv_t, n + ".scale_inv_t");
    check_layout_view(q.padded_offsets, l.padded_offsets, n + ".padded_offsets");
  }
}

void check_fp8_weights(const Fp8Weights& q, int64_t E, Fp8Copy which, Device device, const char* name,
                       const char* reader) {
  check_recipe(q.recipe, q.format, name);
  if (E >= 0) {
    GMOE_CHECK(q.experts == E, name, ".experts: ", q.experts, ", but counts has length ", E);
  } else {
    GMOE_CHECK(q.experts >= 1, name, ".experts: expected at least 1, got ", q.experts);
  }
  GMOE_CHECK(q.rows >= 0 && q.cols >= 0, name, ": negative shape [", q.rows, ", ", q.cols, "]");
  const Fp8Weights l = fp8_weights_layout(q.experts, q.rows, q.cols, copy_options(q.recipe, q.format, which), device);
  const std::string n(name);
  if (which == Fp8Copy::rowwise) {
    check_rowwise_copy(q, l, name, reader);
  } else {
    GMOE_CHECK(q.data_t.defined(), name, ": the transposed copy (data_t) is absent", reader);
    check_layout_view(q.data_t, l.data_t, n + ".data_t");
    check_layout_view(q.scale_inv_t, l.scale_inv_t, n + ".scale_inv_t");
  }
}

}  // namespace gmoe
