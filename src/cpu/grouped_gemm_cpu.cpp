// src/cpu/grouped_gemm_cpu.cpp — the reference grouped GEMM: the oracle for every kernel.
//
// Plain loops with f32 accumulation in a fixed order, so results are deterministic:
//   fprop  y[r, n]  = Σ_k x[r,k]·w[n,k]   eight interleaved partial sums over k, combined pairwise;
//   dgrad  dx[r, :] = Σ_n dy[r,n]·w[n,:]  sequential over n (a row-wise axpy);
//   wgrad  dw[n, :] = Σ_r dy[r,n]·x[r,:]  sequential over the expert's rows (a row-wise axpy).
// Every inner loop runs over contiguous memory and converts 16-bit inputs on the fly, so it
// vectorises and nothing the size of the weights is ever packed or transposed: with few rows per
// expert (the reduced benchmark suite) the cost stays proportional to the weights read once.
// Parallel with OpenMP where available.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/backend.h"
#include "common/float_convert.h"
#include "gmoe/error.h"

namespace gmoe::cpu_backend {
namespace {

// Storage types, each with an exact conversion to f32 and a rounding one back.
struct Bf16 { uint16_t bits; };
struct F16 { uint16_t bits; };
inline float to_f32(float v) { return v; }
inline float to_f32(Bf16 v) { return bits_float(static_cast<uint32_t>(v.bits) << 16); }
inline float to_f32(F16 v) { return f16_bits_to_float(v.bits); }
template <typename T> T from_f32(float v);
template <> inline float from_f32<float>(float v) { return v; }
template <> inline Bf16 from_f32<Bf16>(float v) { return Bf16{float_to_bf16_bits(v)}; }
template <> inline F16 from_f32<F16>(float v) { return F16{float_to_f16_bits(v)}; }

// Calls f(T{}) with T the storage type of `dt`.
template <typename F>
void with_storage(DType dt, F&& f) {
  switch (dt) {
    case DType::f32: f(float{}); return;
    case DType::bf16: f(Bf16{}); return;
    case DType::f16: f(F16{}); return;
    default: GMOE_FAIL("CPU grouped GEMM: dtype ", dtype_name(dt), " not supported");
  }
}

template <typename T>
const T* row_ptr(const TensorView& t, int64_t row) {
  return static_cast<const T*>(t.data) + row * t.stride(0);
}
template <typename T>
T* row_ptr_mut(const TensorView& t, int64_t row) {
  return static_cast<T*>(t.data) + row * t.stride(0);
}

template <typename T>
float dot(const float* a, const T* b, int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t l = 0;
  for (; l + 8 <= n; l += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[l + j] * to_f32(b[l + j]);
  }
  for (int j = 0; l < n; ++l, ++j) acc[j] += a[l] * to_f32(b[l]);
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
}

template <typename T>
void axpy(float* acc, float a, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += a * to_f32(x[i]);
}

// Rows [row0, row0 + rows) of a 2-D view as packed f32 [rows, cols] (small: one expert's rows).
template <typename T>
std::vector<float> pack_rows(const TensorView& t, int64_t row0, int64_t rows) {
  const int64_t cols = t.size(1);
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    const T* src = row_ptr<T>(t, row0 + r);
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = to_f32(src[c]);
  }
  return out;
}

template <typename O>
void store_row(const TensorView& out, int64_t row, const float* acc, bool accumulate) {
  O* dst = row_ptr_mut<O>(out, row);
  for (int64_t c = 0; c < out.size(1); ++c) {
    dst[c] = from_f32<O>(accumulate ? acc[c] + to_f32(dst[c]) : acc[c]);
  }
}

template <typename O>
void zero_rows(const TensorView& t, int64_t row0, int64_t row1) {
  for (int64_t r = row0; r < row1; ++r) std::fill_n(row_ptr_mut<O>(t, r), t.size(1), from_f32<O>(0.f));
}

// Expert e's bias as f32 (empty without a bias).
std::vector<float> bias_of(const ExpertBias& bias, int64_t e, int64_t N) {
  std::vector<float> b;
  if (!bias.defined()) return b;
  const TensorView v = bias.expert(e);
  b.resize(static_cast<size_t>(N));
  with_storage(v.dtype, [&](auto t) {
    using B = decltype(t);
    for (int64_t n = 0; n < N; ++n) b[n] = to_f32(static_cast<const B*>(v.data)[n * v.stride(0)]);
  });
  return b;
}

template <typename T, typename O>
void fprop(const TensorView& x, const ExpertWeights& w, const ExpertBias& bias, const std::vector<int64_t>& off,
           const TensorView& y) {
  const int64_t E = w.num_experts(), K = x.size(1), N = w.rows();
  constexpr int64_t kBlockN = 64;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    const std::vector<float> xe = pack_rows<T>(x, off[e], rows);
    const std::vector<float> be = bias_of(bias, e, N);
    const bool one_rounding = !bias.defined() || bias_in_epilogue(x.dtype, bias.dtype(), y.dtype);
    const TensorView we = w.expert(e);
    // Blocks of weight rows outermost: each block of W is read from memory once for all rows.
#pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += kBlockN) {
      const int64_t n1 = std::min(N, n0 + kBlockN);
      for (int64_t r = 0; r < rows; ++r) {
        O* dst = row_ptr_mut<O>(y, off[e] + r);
        for (int64_t n = n0; n < n1; ++n) {
          const float acc = dot(xe.data() + r * K, row_ptr<T>(we, n), K);  // K may be 0: no &xe[]
          if (be.empty()) {
            dst[n] = from_f32<O>(acc);
          } else {
            dst[n] = one_rounding ? from_f32<O>(acc + be[n]) : from_f32<O>(to_f32(from_f32<O>(acc)) + be[n]);
          }
        }
      }
    }
  }
  zero_rows<O>(y, off[E], y.size(0));
}

template <typename T, typename O>
void dgrad(const TensorView& dy, const ExpertWeights& w, const std::vector<int64_t>& off, const TensorView& dx) {
  const int64_t E = w.num_experts(), N = dy.size(1), K = w.cols();
  constexpr int64_t kBlockK = 512;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) continue;
    const std::vector<float> dye = pack_rows<T>(dy, off[e], rows);
    const TensorView we = w.expert(e);
#pragma omp parallel for schedule(static)
    for (int64_t k0 = 0; k0 < K; k0 += kBlockK) {
      const int64_t kn = std::min(K, k0 + kBlockK) - k0;
      std::vector<float> acc(static_cast<size_t>(rows * kn), 0.f);
      for (int64_t n = 0; n < N; ++n) {
        const T* wrow = row_ptr<T>(we, n) + k0;
        for (int64_t r = 0; r < rows; ++r) axpy(&acc[r * kn], dye[r * N + n], wrow, kn);
      }
      for (int64_t r = 0; r < rows; ++r) {
        O* dst = row_ptr_mut<O>(dx, off[e] + r) + k0;
        for (int64_t k = 0; k < kn; ++k) dst[k] = from_f32<O>(acc[r * kn + k]);
      }
    }
  }
  zero_rows<O>(dx, off[E], dx.size(0));
}

template <typename T, typename O>
void wgrad(const TensorView& dy, const TensorView& x, const std::vector<int64_t>& off, const ExpertWeights& dw,
           const WgradOptions& options) {
  const int64_t E = dw.num_experts(), N = dy.size(1), K = x.size(1);
  const int32_t* mask = options.expert_mask.defined() ? static_cast<const int32_t*>(options.expert_mask.data) : nullptr;
  for (int64_t e = 0; e < E; ++e) {
    const bool masked_off = mask != nullptr && mask[e] == 0;
    if (masked_off && options.masked_off == MaskedOffWgrad::skip) continue;  // left untouched
    // Masked-off experts' fresh gradient is written, never accumulated into.
    const bool accumulate = options.accumulate && !masked_off;
    const TensorView dwe = masked_off ? options.fresh_dw.expert(e) : dw.expert(e);
    const int64_t rows = off[e + 1] - off[e];
    if (rows == 0) {
      if (!accumulate) zero_rows<O>(dwe, 0, N);  // accumulating nothing leaves it as it is
      continue;
    }
    const std::vector<float> xe = pack_rows<T>(x, off[e], rows);
    const std::vector<float> dye = pack_rows<T>(dy, off[e], rows);
#pragma omp parallel
    {
      std::vector<float> acc(static_cast<size_t>(K));
#pragma omp for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        std::fill(acc.begin(), acc.end(), 0.f);
        // xe.data(), not &xe[...]: with K = 0 the vector is empty and indexing it is undefined.
        for (int64_t r = 0; r < rows; ++r) axpy(acc.data(), dye[r * N + n], xe.data() + r * K, K);
        store_row<O>(dwe, n, acc.data(), accumulate);
      }
    }
  }
}

}  // namespace

void grouped_gemm_fprop(const TensorView& x, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& y, const ExpertBias& bias) {
  const std::vector<int64_t> off = host_group_offsets(counts, x.size(0));
  with_storage(x.dtype, [&](auto t) {
    with_storage(y.dtype, [&](auto o) { fprop<decltype(t), decltype(o)>(x, w, bias, off, y); });
  });
}

void grouped_gemm_dgrad(const TensorView& dy, const ExpertWeights& w, const TensorView& counts,
                        const TensorView& dx) {
  const std::vector<int64_t> off = host_group_offsets(counts, dy.size(0));
  with_storage(dy.dtype, [&](auto t) {
    with_storage(dx.dtype, [&](auto o) { dgrad<decltype(t), decltype(o)>(dy, w, off, dx); });
  });
}

void grouped_gemm_wgrad(const TensorView& dy, const TensorView& x, const TensorView& counts,
                        const ExpertWeights& dw, const WgradOptions& options) {
  const std::vector<int64_t> off = host_group_offsets(counts, dy.size(0));
  with_storage(dy.dtype, [&](auto t) {
    with_storage(dw.dtype(), [&](auto o) { wgrad<decltype(t), decltype(o)>(dy, x, off, dw, options); });
  });
}

}  // namespace gmoe::cpu_backend
