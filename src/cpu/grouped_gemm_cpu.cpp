// src/cpu/grouped_gemm_cpu.cpp — the reference grouped GEMM: the oracle for every kernel.
//
// All three passes reduce to one routine, C[i][j] = Σ_l A[i][l]·B[j][l] over f32 rows packed from
// the inputs (inputs are exactly representable in f32), with f32 accumulation in a fixed order:
// eight interleaved partial sums combined pairwise, so the result is deterministic and the loop
// vectorises. Parallel over i with OpenMP where available.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/backend.h"
#include "common/float_convert.h"
#include "gmoe/error.h"

namespace gmoe::cpu_backend {
namespace {

float dot(const float* a, const float* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[l + j] * b[l + j];
  }
  for (int j = 0; l < n; ++l, ++j) acc[j] += a[l] * b[l];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

// Rows [row0, row0 + rows) of a 2-D view as packed f32 [rows, cols].
std::vector<float> pack_rows(const TensorView& t, int64_t row0, int64_t rows) {
  const int64_t cols = t.size(1);
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[r * cols + c] = load_float(t.data, t.dtype, (row0 + r) * t.stride(0) + c * t.stride(1));
    }
  }
  return out;
}

// Rows [row0, row0 + rows) of a 2-D view, transposed: packed f32 [cols, rows].
std::vector<float> pack_cols(const TensorView& t, int64_t row0, int64_t rows) {
  const int64_t cols = t.size(1);
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      out[c * rows + r] = load_float(t.data, t.dtype, (row0 + r) * t.stride(0) + c * t.stride(1));
    }
  }
  return out;
}

// out[i][j] (through a row stride, dtype-converting store) = Σ_l a[i][l]·b[j][l] (+ out when
// accumulating).
void gemm_nt(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n,
             int64_t l, void* out, DType out_dtype, int64_t out_row_stride, bool accumulate) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      float v = dot(&a[i * l], &b[j * l], l);
      const int64_t idx = i * out_row_stride + j;
      if (accumulate) v += load_float(out, out_dtype, idx);
      store_float(out, out_dtype, idx, v);
    }
  }
}

void zero_rows(const TensorView& t, int64_t row0, int64_t row1) {
  for (int64_t r = row0; r < row1; ++r) {
    for (int64_t c = 0; c < t.size(1); ++c) store_float(t.data, t.dtype, r * t.stride(0) + c, 0.f);
  }
}

}  // namespace

void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y) {
  const std::vector<int64_t> off = host_group_offsets(counts, x.size(0));
  const int64_t E = counts.size(0), K = x.size(1), N = w.rows();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    const std::vector<float> xe = pack_rows(x, off[e], rows);
    const std::vector<float> we = pack_rows(w.expert(e), 0, N);
    void* ye = static_cast<char*>(y.data) + off[e] * y.stride(0) * int64_t(dtype_size(y.dtype));
    gemm_nt(xe, we, rows, N, K, ye, y.dtype, y.stride(0), false);
  }
  zero_rows(y, off[E], y.size(0));
}

void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx) {
  const std::vector<int64_t> off = host_group_offsets(counts, dy.size(0));
  const int64_t E = counts.size(0), N = dy.size(1), K = w.cols();
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    const std::vector<float> dye = pack_rows(dy, off[e], rows);
    const std::vector<float> wt = pack_cols(w.expert(e), 0, N);  // [K, N]
    void* dxe = static_cast<char*>(dx.data) + off[e] * dx.stride(0) * int64_t(dtype_size(dx.dtype));
    gemm_nt(dye, wt, rows, K, N, dxe, dx.dtype, dx.stride(0), false);
  }
  zero_rows(dx, off[E], dx.size(0));
}

void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options) {
  const std::vector<int64_t> off = host_group_offsets(counts, dy.size(0));
  const int64_t E = counts.size(0), N = dy.size(1), K = x.size(1);
  const int32_t* mask = options.expert_mask.defined()
                            ? static_cast<const int32_t*>(options.expert_mask.data)
                            : nullptr;
  for (int64_t e = 0; e < E; ++e) {
    if (mask != nullptr && mask[e] == 0) continue;
    const TensorView dwe = dw.expert(e);
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) {
      if (!options.accumulate) zero_rows(dwe, 0, N);
      continue;
    }
    const std::vector<float> dyt = pack_cols(dy, off[e], rows);  // [N, rows]
    const std::vector<float> xt = pack_cols(x, off[e], rows);    // [K, rows]
    gemm_nt(dyt, xt, N, K, rows, dwe.data, dwe.dtype, dwe.stride(0), options.accumulate);
  }
}

}  // namespace gmoe::cpu_backend
