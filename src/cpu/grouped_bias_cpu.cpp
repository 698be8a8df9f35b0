// src/cpu/grouped_bias_cpu.cpp — reference grouped bias add and bias gradient, and row copies.
#include <cstring>
#include <vector>

#include "common/backend.h"
#include "common/float_convert.h"

namespace gmoe::cpu_backend {

void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts) {
  const std::vector<int64_t> off = host_group_offsets(counts, y.size(0));
  const int64_t N = y.size(1);
  for (int64_t e = 0; e < bias.num_experts(); ++e) {
    const TensorView b = bias.expert(e);
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t i = r * y.stride(0) + n;
        store_float(y.data, y.dtype, i, load_float(y.data, y.dtype, i) + load_float(b.data, b.dtype, n));
      }
    }
  }
}

void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias) {
  const std::vector<int64_t> off = host_group_offsets(counts, dy.size(0));
  const int64_t N = dy.size(1);
  std::vector<float> acc(static_cast<size_t>(N));
  for (int64_t e = 0; e < dbias.num_experts(); ++e) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t n = 0; n < N; ++n) acc[n] += load_float(dy.data, dy.dtype, r * dy.stride(0) + n);
    }
    const TensorView db = dbias.expert(e);
    for (int64_t n = 0; n < N; ++n) store_float(db.data, db.dtype, n, acc[n]);
  }
}

void copy_rows(const TensorView& dst, const TensorView& src) {
  const size_t row_bytes = static_cast<size_t>(src.size(1)) * dtype_size(src.dtype);
  const size_t es = dtype_size(src.dtype);
  // A zero-width view may carry a null pointer; memcpy's arguments must not be null even for 0 bytes.
  if (row_bytes == 0) return;
  for (int64_t r = 0; r < src.size(0); ++r) {
    std::memcpy(static_cast<char*>(dst.data) + r * dst.stride(0) * es,
                static_cast<const char*>(src.data) + r * src.stride(0) * es, row_bytes);
  }
}

}  // namespace gmoe::cpu_backend
