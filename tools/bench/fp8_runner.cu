// tools/bench/fp8_runner.cu — gmoe-bench's FP8 grouped GEMM rows (see fp8_runner.h).
//
// Inputs: the case's bf16 x [rows, K], dy [rows, N] and weights [E, N, K], filled like the bf16
// runner's, quantized by gmoe::quantize_grouped / quantize_weights (e4m3) into several copies
// rotated through so no timed run finds its operands in L2. Correctness first: the output is
// poisoned, one run, then sampled elements are recomputed in fp64 from the FP8 bytes and scales
// copied to the host (decoded here from the format, independently of the library's dequantizers)
// and compared with |got - exact| <= 2^-8 |exact| + 2^-11 Σ|a·b| (the output's rounding and the
// tensor cores' FP8 accumulation), and every output element must be finite.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <vector>

#include "bench/check.h"
#include "bench/cuda_util.h"
#include "bench/fp8_runner.h"
#include "common/float_convert.h"
#include "common/fp8_rules.h"
#include "gmoe/error.h"
#include "gmoe/fp8_gemm.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::bench {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::vector<uint8_t> to_host(const TensorView& v) {
  std::vector<uint8_t> h(static_cast<size_t>(v.nbytes()));
  if (!h.empty()) BENCH_CUDA(cudaMemcpy(h.data(), v.data, h.size(), cudaMemcpyDeviceToHost));
  return h;
}

// One FP8 matrix on the host: bytes [rows, cols] and the scale of element (r, c).
struct HostFp8Matrix {
  std::vector<uint8_t> bytes, scales;
  int64_t cols = 0;
  bool e5m2 = false, e8m0 = false;
  // Scale index of (r, c): one per expert (tensorwise: the caller's index), or 1 x block_c
  // blocks with `scale_ld` scales per row, or (block_major) per block of columns.
  int64_t block_c = 0, scale_ld = 0;
  bool block_major = false;
  double at(int64_t r, int64_t c, int64_t single_index) const {
    const uint8_t b = bytes[static_cast<size_t>(r * cols + c)];
    const int64_t si = block_c == 0 ? single_index
                       : block_major ? c / block_c * scale_ld + r
                                     : r * scale_ld + c / block_c;
    const double s = e8m0 ? fp8_rules::e8m0_to_float(scales[si])
                          : reinterpret_cast<const float*>(scales.data())[si];
    return fp8_rules::fp8_to_float(b, e5m2) * s;
  }
};

// The two copies of a grouped operand: rowwise [capacity, cols], columnwise data [cols, padded].
HostFp8Matrix host_rows(const Fp8Grouped& q) {
  HostFp8Matrix m;
  m.bytes = to_host(q.data);
  m.scales = to_host(q.scale_inv);
  m.cols = q.cols;
  m.e5m2 = q.format == DType::e5m2;
  m.e8m0 = q.recipe == Fp8Recipe::mxfp8;
  if (q.recipe != Fp8Recipe::tensorwise) {
    m.block_c = q.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block;
    m.block_major = q.recipe == Fp8Recipe::blockwise;  // token-major [ceil(cols/128), capacity]
    m.scale_ld = m.block_major ? q.capacity : ceil_div(q.cols, m.block_c);
  }
  return m;
}
HostFp8Matrix host_cols(const Fp8Grouped& q) {
  HostFp8Matrix m;
  m.bytes = to_host(q.data_t);
  m.scales = to_host(q.scale_inv_t);
  m.cols = q.padded_capacity;
  m.e5m2 = q.format == DType::e5m2;
  m.e8m0 = q.recipe == Fp8Recipe::mxfp8;
  if (q.recipe != Fp8Recipe::tensorwise) {
    m.block_c = q.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block;
    // blockwise: token-block-major [padded/128, cols]; mxfp8 [cols, padded/32]
    m.block_major = q.recipe == Fp8Recipe::blockwise;
    m.scale_ld = m.block_major ? q.cols : q.padded_capacity / m.block_c;
  }
  return m;
}
// Weights stacked as [E * R, C] (R, C = N, K for data; K, N for data_t); weight_at indexes them.
HostFp8Matrix host_weights(const Fp8Weights& q, bool transposed) {
  HostFp8Matrix m;
  m.bytes = to_host(transposed ? q.data_t : q.data);
  m.scales = to_host(transposed ? q.scale_inv_t : q.scale_inv);
  m.cols = transposed ? q.rows : q.cols;
  m.e5m2 = q.format == DType::e5m2;
  m.e8m0 = q.recipe == Fp8Recipe::mxfp8;
  if (q.recipe != Fp8Recipe::tensorwise) {
    m.scale_ld = ceil_div(m.cols, q.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block);
  }
  return m;
}

// Value (r, c) of expert e's weight matrix in a stacked [E * R, C] host view.
double weight_at(const HostFp8Matrix& m, const Fp8Weights& q, bool transposed, int64_t e, int64_t r,
                 int64_t c) {
  const int64_t R = transposed ? q.cols : q.rows;
  const uint8_t b = m.bytes[static_cast<size_t>((e * R + r) * m.cols + c)];
  double s;
  if (q.recipe == Fp8Recipe::tensorwise) {
    s = reinterpret_cast<const float*>(m.scales.data())[e];
  } else if (q.recipe == Fp8Recipe::blockwise) {
    const int64_t si = (e * ceil_div(R, kFp8Block) + r / kFp8Block) * m.scale_ld + c / kFp8Block;
    s = reinterpret_cast<const float*>(m.scales.data())[si];
  } else {
    s = fp8_rules::e8m0_to_float(m.scales[static_cast<size_t>((e * R + r) * m.scale_ld + c / kMxBlock)]);
  }
  return fp8_rules::fp8_to_float(b, m.e5m2) * s;
}

struct Fp8Set {
  Fp8GroupedTensor x, dy;
  Fp8WeightsTensor w;
};

uint64_t splitmix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double load_out(const std::vector<uint8_t>& out, DType dt, int64_t i) {
  return load_float(out.data(), dt, i);
}

double unit_roundoff_of(DType dt) { return dt == DType::f32 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -8); }

// Sampled check of one pass's output (host copy `out`, dtype `dt`) on set 0's operands.
CheckResult check_fp8_pass(const BenchCase& c, const std::vector<int64_t>& off, const Fp8Set& s,
                           const std::string& pass, const std::vector<uint8_t>& out, DType dt,
                           int samples, uint64_t seed, bool fast) {
  CheckResult r;
  // Fast accumulation (fprop/dgrad): 2^-13 of Σ|a·b| more per 32-long k-step of the reduction, the
  // tests' bound (tests/cuda/test_fp8_gemm_cuda.cpp).
  const int64_t reduction = pass == "fprop" ? c.K : c.N;
  const double fast_fraction = fast && pass != "wgrad" ? static_cast<double>((reduction + 31) / 32) / 8192.0 : 0.0;
  const int64_t total_out = pass == "fprop" ? c.rows * c.N : pass == "dgrad" ? c.rows * c.K
                                                                              : c.E * c.N * c.K;
  int64_t nonfinite = 0;
  for (int64_t i = 0; i < total_out; ++i) nonfinite += !std::isfinite(load_out(out, dt, i));
  std::vector<int64_t> active;
  for (int64_t e = 0; e < c.E; ++e) {
    if (c.counts[e] > 0) active.push_back(e);
  }
  double worst = 0;
  std::ostringstream detail;
  if (!active.empty()) {
    std::mt19937_64 rng(splitmix(seed));
    const bool rows_pass = pass != "wgrad";
    const HostFp8Matrix a = pass == "fprop" ? host_rows(s.x.q) : pass == "dgrad" ? host_rows(s.dy.q)
                                                                                 : host_cols(s.dy.q);
    const HostFp8Matrix b = pass == "fprop" ? host_weights(s.w.q, false)
                            : pass == "dgrad" ? host_weights(s.w.q, true)
                                              : host_cols(s.x.q);
    const std::vector<uint8_t> po_bytes = rows_pass ? std::vector<uint8_t>() : to_host(s.dy.q.padded_offsets);
    const int64_t* po = reinterpret_cast<const int64_t*>(po_bytes.data());
    for (int i = 0; i < samples; ++i) {
      const int64_t e = active[rng() % active.size()];
      double exact = 0, abs_sum = 0, got = 0;
      if (rows_pass) {
        const int64_t row = off[e] + static_cast<int64_t>(rng() % c.counts[e]);
        const int64_t n_out = pass == "fprop" ? c.N : c.K;
        const int64_t col = static_cast<int64_t>(rng() % n_out);
        const int64_t len = pass == "fprop" ? c.K : c.N;
        for (int64_t k = 0; k < len; ++k) {
          const double p = a.at(row, k, e) * weight_at(b, s.w.q, pass == "dgrad", e, col, k);
          exact += p;
          abs_sum += std::abs(p);
        }
        got = load_out(out, dt, row * n_out + col);
      } else {
        const int64_t n = static_cast<int64_t>(rng() % c.N), k = static_cast<int64_t>(rng() % c.K);
        for (int64_t t = 0; t < c.counts[e]; ++t) {
          const double p = a.at(n, po[e] + t, e) * b.at(k, po[e] + t, e);
          exact += p;
          abs_sum += std::abs(p);
        }
        got = load_out(out, dt, (e * c.N + n) * c.K + k);
      }
      const double bound = unit_roundoff_of(dt) * std::abs(exact) + abs_sum * (1.0 / 2048.0 + fast_fraction) + 1e-6;
      worst = std::max(worst, std::abs(got - exact) / bound);
    }
  }
  r.ok = nonfinite == 0 && worst <= 1.0;
  detail << samples << " samples: worst error/bound " << worst << "; " << nonfinite << " non-finite";
  r.detail = detail.str();
  return r;
}

}  // namespace

Fp8BenchRecipe fp8_recipe_from_name(const std::string& name) {
  Fp8BenchRecipe r;
  r.name = name;
  if (name == "blockwise" || name == "blockwise_pow2") {
    r.recipe = Fp8Recipe::blockwise;
  } else if (name == "tensorwise" || name == "tensorwise_pow2" || name == "tensorwise_fast") {
    r.recipe = Fp8Recipe::tensorwise;
  } else if (name == "mxfp8") {
    r.recipe = Fp8Recipe::mxfp8;
  } else {
    GMOE_FAIL("--fp8: unknown recipe '", name,
              "' (blockwise, tensorwise, mxfp8, blockwise_pow2, tensorwise_pow2, tensorwise_fast)");
  }
  r.pow2 = name.size() > 5 && name.compare(name.size() - 5, 5, "_pow2") == 0;
  r.fast = name == "tensorwise_fast";
  return r;
}

std::vector<ResultRow> run_fp8_gemm_case_cuda(const BenchCase& c, const BenchOptions& o,
                                              const Fp8BenchRecipe& br) {
  const Fp8Recipe recipe = br.recipe;
  const BenchStream stream;
  const Device gpu = Device::cuda(0);
  const int64_t nx = c.rows * c.K, ndy = c.rows * c.N, nw = c.E * c.N * c.K;

  Fp8QuantizeOptions qo;
  qo.recipe = recipe;
  qo.format = DType::e4m3;
  qo.rowwise = true;
  qo.columnwise = true;
  qo.pow2_scales = br.pow2;
  Fp8QuantizeOptions qo_grad = qo;  // dy: e4m3 or e5m2 (--fp8-grad-format)
  qo_grad.format = o.fp8_grad_format;

  DeviceBuffer counts_d(c.E * sizeof(int32_t));
  const std::vector<int32_t> counts(c.counts.begin(), c.counts.end());
  BENCH_CUDA(cudaMemcpy(counts_d.ptr, counts.data(), c.E * sizeof(int32_t), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaStreamSynchronize(cudaStreamLegacy));  // a pageable upload may return before it lands
  const TensorView cv(counts_d.ptr, DType::i32, gpu, {c.E});
  const std::vector<int64_t> off = prefix_offsets(c.counts);

  // The bf16 operands of every set stay: set 0's x and dy are the sources of the quantize+GEMM
  // timing, and every set's feed the bf16 grouped GEMM timed interleaved with the FP8 one.
  const size_t fp8_set_bytes = static_cast<size_t>(2 * (nx + ndy + nw));
  const int sets = rotation_sets(fp8_set_bytes);
  std::vector<Fp8Set> fp8(sets);
  std::vector<std::unique_ptr<DeviceBuffer>> xb, dyb, wb;
  auto x_bf16 = [&](int s) { return TensorView(xb[s]->ptr, DType::bf16, gpu, {c.rows, c.K}); };
  auto dy_bf16 = [&](int s) { return TensorView(dyb[s]->ptr, DType::bf16, gpu, {c.rows, c.N}); };
  auto w_bf16 = [&](int s) {
    return ExpertWeights::from_stacked(TensorView(wb[s]->ptr, DType::bf16, gpu, {c.E, c.N, c.K}));
  };
  for (int s = 0; s < sets; ++s) {
    xb.push_back(std::make_unique<DeviceBuffer>(nx * 2));
    dyb.push_back(std::make_unique<DeviceBuffer>(ndy * 2));
    wb.push_back(std::make_unique<DeviceBuffer>(nw * 2));
    fill_uniform(xb[s]->ptr, DType::bf16, nx, o.seed + 10 * s);
    fill_uniform(dyb[s]->ptr, DType::bf16, ndy, o.seed + 10 * s + 1);
    fill_uniform(wb[s]->ptr, DType::bf16, nw, o.seed + 10 * s + 2);
    BENCH_CUDA(cudaDeviceSynchronize());
    fp8[s].x = quantize_grouped(GroupedRows{x_bf16(s), cv}, qo, stream);
    fp8[s].dy = quantize_grouped(GroupedRows{dy_bf16(s), cv}, qo_grad, stream);
    fp8[s].w = quantize_weights(w_bf16(s), qo, stream);
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
  check_device_errors(stream);

  DeviceBuffer y(ndy * 2), dx(nx * 2), dw(nw * 4);
  const TensorView yv(y.ptr, DType::bf16, gpu, {c.rows, c.N}), dxv(dx.ptr, DType::bf16, gpu, {c.rows, c.K});
  const DType dw_dtype = o.fp8_wgrad_out;  // bf16 or f32 (the buffer fits either)
  const ExpertWeights dwv = ExpertWeights::from_stacked(TensorView(dw.ptr, dw_dtype, gpu, {c.E, c.N, c.K}));

  // quantize+GEMM: the activation copies a pass needs, requantized from set 0's bf16 into set 0's
  // own FP8 buffers.
  Fp8QuantizeOptions rowwise_only = qo, columnwise_only = qo;
  rowwise_only.columnwise = false;
  columnwise_only.rowwise = false;
  Fp8QuantizeOptions grad_rowwise_only = rowwise_only, grad_columnwise_only = columnwise_only;
  grad_rowwise_only.format = grad_columnwise_only.format = o.fp8_grad_format;
  auto rows_out = [](const Fp8Grouped& q) {
    Fp8Grouped o = q;
    o.data_t = TensorView();
    o.scale_inv_t = TensorView();
    return o;
  };
  auto cols_out = [](const Fp8Grouped& q) {
    Fp8Grouped o = q;
    o.data = TensorView();
    o.scale_inv = TensorView();
    return o;
  };
  const Fp8Grouped x_rows_out = rows_out(fp8[0].x.q), dy_rows_out = rows_out(fp8[0].dy.q);
  const Fp8Grouped x_cols_out = cols_out(fp8[0].x.q), dy_cols_out = cols_out(fp8[0].dy.q);
  const GroupedRows x_src{x_bf16(0), cv};
  const GroupedRows dy_src{dy_bf16(0), cv};

  struct Pass {
    const char* name;
    void* out;
    int64_t out_elems;
    DType out_dtype;
    std::function<void(int)> gemm, with_quant;
    std::function<void(int)> native;  ///< the bf16 grouped GEMM of the same pass and output dtype
  };
  const Fp8Set& s0 = fp8[0];
  const Fp8GemmOptions gemm_options{br.fast};
  std::vector<Pass> passes = {
      {"fprop", y.ptr, ndy, DType::bf16,
       [&](int i) { fp8_grouped_gemm_fprop(fp8[i % sets].x.q, fp8[i % sets].w.q, {}, cv, yv, gemm_options, stream); },
       [&](int) {
         quantize_grouped(x_src, rowwise_only, stream, nullptr, &x_rows_out);
         fp8_grouped_gemm_fprop(s0.x.q, s0.w.q, {}, cv, yv, gemm_options, stream);
       },
       [&](int i) { grouped_gemm_fprop(x_bf16(i % sets), w_bf16(i % sets), cv, yv, stream); }},
      {"dgrad", dx.ptr, nx, DType::bf16,
       [&](int i) { fp8_grouped_gemm_dgrad(fp8[i % sets].dy.q, fp8[i % sets].w.q, cv, dxv, gemm_options, stream); },
       [&](int) {
         quantize_grouped(dy_src, grad_rowwise_only, stream, nullptr, &dy_rows_out);
         fp8_grouped_gemm_dgrad(s0.dy.q, s0.w.q, cv, dxv, gemm_options, stream);
       },
       [&](int i) { grouped_gemm_dgrad(dy_bf16(i % sets), w_bf16(i % sets), cv, dxv, stream); }},
      {"wgrad", dw.ptr, nw, dw_dtype,
       [&](int i) { fp8_grouped_gemm_wgrad(fp8[i % sets].dy.q, fp8[i % sets].x.q, cv, dwv, {}, stream); },
       [&](int) {
         quantize_grouped(dy_src, grad_columnwise_only, stream, nullptr, &dy_cols_out);
         quantize_grouped(x_src, columnwise_only, stream, nullptr, &x_cols_out);
         fp8_grouped_gemm_wgrad(s0.dy.q, s0.x.q, cv, dwv, {}, stream);
       },
       [&](int i) { grouped_gemm_wgrad(dy_bf16(i % sets), x_bf16(i % sets), cv, dwv, {}, stream); }},
  };

  const std::string impl = recipe == Fp8Recipe::mxfp8
                               ? std::string("gmoe_mxfp8")
                               : std::string("gmoe_fp8_") + br.name;
  std::vector<ResultRow> rows;
  const double flops = gemm_flops(c);
  // bf16_ms: the bf16 grouped GEMM timed interleaved with the row (its bare_ms).
  auto add = [&](const char* pass, const std::string& name, double ms, std::optional<bool> ok, std::string note,
                 double bf16_ms) {
    rows.push_back(timed_row(c.name, pass, name, "fp8", ms, flops, ok, std::move(note)));
    rows.back().bare_ms = bf16_ms;
  };
  for (Pass& p : passes) {
    if (!o.runs_pass(p.name)) continue;
    const size_t out_bytes = static_cast<size_t>(p.out_elems) * dtype_size(p.out_dtype);
    BENCH_CUDA(cudaMemsetAsync(p.out, 0xff, out_bytes, stream));  // NaN in bf16 and f32
    p.gemm(0);
    BENCH_CUDA(cudaStreamSynchronize(stream));
    check_device_errors(stream);
    std::vector<uint8_t> host(out_bytes);
    BENCH_CUDA(cudaMemcpy(host.data(), p.out, out_bytes, cudaMemcpyDeviceToHost));
    const CheckResult chk = check_fp8_pass(c, off, s0, p.name, host, p.out_dtype, o.samples, o.seed + 7, br.fast);
    // The FP8 GEMM, the same with its quantization, and the bf16 GEMM of the pass, interleaved: at a
    // power cap the three share the clocks the limiter sets, so the ratios to the bf16 one (bare_ms)
    // compare like with like in bursts and in sustained runs (--gemm-warm-ms) alike.
    const std::vector<double> ms =
        time_interleaved_ms({p.gemm, p.with_quant, p.native}, o.warmup, o.iters, stream, o.gemm_warm_ms);
    const std::string name =
        impl + (o.fp8_grad_format == DType::e5m2 && std::string(p.name) != "fprop" ? "_e5m2" : "");
    add(p.name, name, ms[0], chk.ok, chk.detail, ms[2]);
    add(p.name, name + "_with_quant", ms[1], std::nullopt, "quantization of the pass's activations + GEMM", ms[2]);
  }
  fp8.clear();  // frees the FP8 operands on `stream`, before it goes
  BENCH_CUDA(cudaStreamSynchronize(stream));
  return rows;
}

}  // namespace gmoe::bench
