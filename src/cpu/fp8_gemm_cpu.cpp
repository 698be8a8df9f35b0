// src/cpu/fp8_gemm_cpu.cpp — the FP8 grouped GEMM reference: dequantize each operand to f32 with
// the format's own dequantization (cpu_backend::dequantize_grouped / dequantize_weights, the
// columnwise copies mapped back to token rows), then the f32 reference grouped GEMM. The result is
// the product of the dequantized operands accumulated in f32, which is what the CUDA kernels
// compute up to the order of their fp32 additions.
#include <vector>

#include "common/backend.h"

namespace gmoe::cpu_backend {
namespace {

// An f32 host buffer and its contiguous view.
struct F32Buffer {
  std::vector<float> storage;
  TensorView view;
  explicit F32Buffer(std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    storage.assign(static_cast<size_t>(n), 0.0f);
    view = TensorView(storage.data(), DType::f32, Device::cpu(), shape);
  }
};

}  // namespace

void fp8_grouped_gemm_fprop(const Fp8Grouped& x, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& y, const ExpertBias& bias) {
  F32Buffer xf({x.capacity, x.cols});
  F32Buffer wf({w.experts, w.rows, w.cols});
  cpu_backend::dequantize_grouped(x, counts, xf.view, Fp8Copy::rowwise);
  const ExpertWeights ws = ExpertWeights::from_stacked(wf.view);
  cpu_backend::dequantize_weights(w, ws, Fp8Copy::rowwise);
  cpu_backend::grouped_gemm_fprop(xf.view, ws, counts, y, bias);
}

void fp8_grouped_gemm_dgrad(const Fp8Grouped& dy, const Fp8Weights& w, const TensorView& counts,
                            const TensorView& dx) {
  F32Buffer dyf({dy.capacity, dy.cols});
  F32Buffer wf({w.experts, w.rows, w.cols});
  cpu_backend::dequantize_grouped(dy, counts, dyf.view, Fp8Copy::rowwise);
  // The transposed copy (quantized along N, dgrad's reduction), transposed back to [E, N, K].
  const ExpertWeights ws = ExpertWeights::from_stacked(wf.view);
  cpu_backend::dequantize_weights(w, ws, Fp8Copy::columnwise);
  cpu_backend::grouped_gemm_dgrad(dyf.view, ws, counts, dx);
}

void fp8_grouped_gemm_wgrad(const Fp8Grouped& dy, const Fp8Grouped& x, const TensorView& counts,
                            const ExpertWeights& dw, const WgradOptions& options) {
  // The columnwise copies (quantized along tokens, wgrad's reduction), mapped back to token rows.
  F32Buffer dyf({dy.capacity, dy.cols});
  F32Buffer xf({x.capacity, x.cols});
  cpu_backend::dequantize_grouped(dy, counts, dyf.view, Fp8Copy::columnwise);
  cpu_backend::dequantize_grouped(x, counts, xf.view, Fp8Copy::columnwise);
  cpu_backend::grouped_gemm_wgrad(dyf.view, xf.view, counts, dw, options);
}

}  // namespace gmoe::cpu_backend
