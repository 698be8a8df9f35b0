// tests/cuda/test_fp8_quantize_cuda.cpp — the sm_90a FP8 quantizer against the CPU reference,
// BIT FOR BIT (data, scales, padded offsets; the CPU reference is itself checked against the
// independent oracle by the CPU suite, and is re-checked here on every case): every recipe x
// format x input dtype on cases with expert boundaries at every alignment (counts 1, 31, 127,
// 128, 129, 255, 0), all tokens in one expert, zero totals, E = 256, cols not multiples of 128 /
// 32 / 16 (the scalar path), strided and misaligned inputs, NaN / inf / huge / tiny values;
// outputs poisoned before each run. Also: the column sums made in the same pass (the bias
// gradient of dy) against the exact sums, one order for every recipe; weights in both layouts,
// dequantization GPU vs CPU, one CUDA graph replayed under changing counts (column sums included),
// device-side count errors, CUDA-specific bad arguments.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "common/activation_oracle.h"
#include "common/expect_error.h"
#include "common/fp8_oracle.h"
#include "common/harness.h"
#include "cuda/cuda_test_util.h"
#include "gmoe/error.h"
#include "gmoe/fp8.h"
#include "gmoe/grouped_bias.h"

namespace gmoe::test {
namespace {

using fp8::Expected;

HostTensor download(const TensorView& v) {
  std::vector<int64_t> shape(v.shape.begin(), v.shape.begin() + v.ndim);
  HostTensor t(v.dtype, shape);
  if (t.numel() > 0) {
    EXPECT_EQ(cudaMemcpy(t.data(), v.data, t.bytes().size(), cudaMemcpyDeviceToHost), cudaSuccess);
  }
  return t;
}

// Equal bit for bit, except that any NaN equals any NaN (dequantized outputs: the GPU's and the
// CPU's f32 -> bf16/f16 conversions pick different NaN payloads).
::testing::AssertionResult same_values(const HostTensor& got, const HostTensor& want, const std::string& what) {
  if (got.shape() != want.shape()) return ::testing::AssertionFailure() << what << ": shapes differ";
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double a = got.get(i), b = want.get(i);
    if (std::isnan(a) && std::isnan(b)) continue;
    if (std::memcmp(static_cast<const char*>(got.data()) + i * dtype_size(got.dtype()),
                    static_cast<const char*>(want.data()) + i * dtype_size(want.dtype()), dtype_size(got.dtype())) != 0) {
      return ::testing::AssertionFailure() << what << ": element " << i << " got " << a << " want " << b;
    }
  }
  return ::testing::AssertionSuccess();
}

struct GroupedCase {
  std::string name;
  std::vector<int64_t> counts;
  int64_t capacity;
  int64_t cols;
};

std::vector<GroupedCase> cuda_cases(Rng& rng) {
  std::vector<GroupedCase> cases = {
      {"align_1_31_127_128_129_255_0", {1, 31, 127, 128, 129, 255, 0}, 700, 256},
      {"cols_200_scalar_path", {1, 31, 0, 129}, 170, 200},
      {"cols_40_scalar_path", {33, 0, 64}, 100, 40},
      {"cols_48", {200, 0, 57}, 300, 48},
      {"all_empty", {0, 0, 0}, 10, 64},
      {"zero_capacity", {0, 0}, 0, 96},
      {"one_expert", {0, 700, 0}, 700, 384},
      {"cols_0", {5, 0, 2}, 9, 0},
      {"cols_1", {3, 130}, 140, 1},
  };
  GroupedCase e256{"e256", std::vector<int64_t>(256), 0, 160};
  for (auto& c : e256.counts) c = rng.integer(0, 4) == 0 ? 0 : rng.integer(1, 70);
  for (int64_t c : e256.counts) e256.capacity += c;
  e256.capacity += 131;
  cases.push_back(e256);
  GroupedCase skewed{"skewed", zipf_counts(8, 3000, 1.2, 4, rng), 3100, 1024};
  cases.push_back(skewed);
  return cases;
}

HostTensor random_rows(DType dtype, int64_t cap, int64_t cols, Rng& rng, bool nasty) {
  HostTensor x(dtype, {cap, cols});
  fill_random(x, rng, -3.0, 3.0);
  if (cap * cols == 0) return x;
  for (int64_t c = 0; c < cols; ++c) x.set(std::min<int64_t>(cap - 1, 2) * cols + c, 0.0);
  for (int64_t r = 0; r < cap; ++r) x.set(r * cols + (cols - 1), 0.0);
  if (nasty) {
    const double big = dtype == DType::f16 ? 60000.0 : (dtype == DType::bf16 ? 3.38e38 : 1e30);
    for (int i = 0; i < 6; ++i) x.set(rng.integer(0, cap * cols - 1), big * (i % 2 ? -1 : 1));
    x.set(rng.integer(0, cap * cols - 1), std::numeric_limits<double>::quiet_NaN());
    x.set(rng.integer(0, cap * cols - 1), std::numeric_limits<double>::infinity());
    x.set(rng.integer(0, cap * cols - 1), -std::numeric_limits<double>::infinity());
    x.set(rng.integer(0, cap * cols - 1), dtype == DType::f32 ? 1e-40 : 1e-7);
    // A tiny-only row: its blocks have subnormal amax (scale clamped to FLT_MAX for f32 input).
    const int64_t r = rng.integer(0, cap - 1);
    for (int64_t c = 0; c < cols; ++c) x.set(r * cols + c, dtype == DType::f32 ? 3e-41 * (c % 5) : 1e-7 * (c % 5));
    // Blocks whose only non-zero values are not finite (their amax is 0: scale 1): a row of zeros
    // but for -inf and a negative NaN, and one inf in the last column (zero in every other row).
    // The kernels take amaxes on the values' bits and fall back to the values only where a max
    // is not finite.
    const int64_t z = rng.integer(0, cap - 1);
    for (int64_t c = 0; c < cols; ++c) x.set(z * cols + c, 0.0);
    x.set(z * cols + rng.integer(0, cols - 1), -std::numeric_limits<double>::infinity());
    x.set(z * cols + rng.integer(0, cols - 1), -std::numeric_limits<double>::quiet_NaN());
    x.set(rng.integer(0, cap - 1) * cols + (cols - 1), std::numeric_limits<double>::infinity());
  }
  return x;
}

// A case's grouped rows on the host and on the device (counts i32 or i64 at random).
// Nasty rows also get, in the first expert of at least 17 rows, an inf in its row 0 and a finite
// row 16 holding a 5, above the random values: with 16-bit sources the tile kernel folds the
// row amaxes of rows i and i + 16 into one word and tests the pair once for a value that is not
// finite, so this pair's fallback must still give row 16 its own scale (the random placements
// above reach such a pair only by chance).
struct CaseRows {
  CaseRows(const GroupedCase& c, DType dtype, Rng& rng, bool nasty)
      : x(with_inf_paired_row(random_rows(dtype, c.capacity, c.cols, rng, nasty), c, nasty)),
        counts_h(make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64)),
        xd(x),
        counts_d(counts_h) {}
  static HostTensor with_inf_paired_row(HostTensor x, const GroupedCase& c, bool nasty) {
    if (!nasty || c.cols < 3) return x;  // column 1 must not be the last one (zero in every row)
    int64_t row0 = 0;
    for (int64_t n : c.counts) {
      if (n >= 17) {
        x.set(row0 * c.cols + 1, std::numeric_limits<double>::infinity());
        x.set((row0 + 16) * c.cols + 1, 5.0);
        break;
      }
      row0 += n;
    }
    return x;
  }
  HostTensor x, counts_h;
  DeviceTensor xd, counts_d;
  GroupedRows host() const { return {x.view(), counts_h.view()}; }
  GroupedRows device() const { return {xd.view(), counts_d.view()}; }
};

/// Device outputs for an Fp8Grouped layout, poisoned (0xA5), owned by the vector.
Fp8Grouped device_outputs(const Fp8Grouped& layout, std::vector<DeviceTensor>& keep) {
  Fp8Grouped out = layout;
  keep.reserve(keep.size() + 5);
  for (TensorView* v : {&out.data, &out.scale_inv, &out.data_t, &out.scale_inv_t, &out.padded_offsets}) {
    if (!v->defined()) continue;
    keep.emplace_back(v->dtype, std::vector<int64_t>(v->shape.begin(), v->shape.begin() + v->ndim));
    if (v->nbytes() > 0) cudaMemset(keep.back().data(), 0xa5, static_cast<size_t>(v->nbytes()));
    v->data = keep.back().data();
  }
  return out;
}

void expect_same(const Fp8Grouped& gpu, const Fp8Grouped& cpu, const Fp8QuantizeOptions& o) {
  if (o.rowwise) {
    EXPECT_TRUE(fp8::same_bytes(download(gpu.data), fp8::host_copy(cpu.data), "data"));
    EXPECT_TRUE(fp8::same_bytes(download(gpu.scale_inv), fp8::host_copy(cpu.scale_inv), "scale_inv"));
  }
  if (o.columnwise) {
    EXPECT_TRUE(fp8::same_bytes(download(gpu.data_t), fp8::host_copy(cpu.data_t), "data_t"));
    EXPECT_TRUE(fp8::same_bytes(download(gpu.scale_inv_t), fp8::host_copy(cpu.scale_inv_t), "scale_inv_t"));
  }
  EXPECT_TRUE(fp8::same_bytes(download(gpu.padded_offsets), fp8::host_copy(cpu.padded_offsets), "padded_offsets"));
}

using Param = std::tuple<Fp8Recipe, DType, DType>;  // recipe, format, input dtype

class CudaFp8Grouped : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
  Fp8QuantizeOptions options(bool rows, bool cols, bool pow2) const {
    Fp8QuantizeOptions o;
    o.recipe = std::get<0>(GetParam());
    o.format = std::get<1>(GetParam());
    o.rowwise = rows;
    o.columnwise = cols;
    o.pow2_scales = pow2;
    return o;
  }
  DType dtype() const { return std::get<2>(GetParam()); }
};

TEST_P(CudaFp8Grouped, BitwiseEqualToCpu) {
  Rng rng;
  for (const GroupedCase& c : cuda_cases(rng)) {
    for (bool nasty : {false, true}) {
      SCOPED_TRACE(c.name + (nasty ? " nasty" : ""));
      const CaseRows r(c, dtype(), rng, nasty);
      const HostTensor& x = r.x;
      const GroupedRows rows_d = r.device();
      int variant = 0;
      for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
        for (bool pow2 : {false, true}) {
          if (pow2 && std::get<0>(GetParam()) == Fp8Recipe::mxfp8) continue;
          const Fp8QuantizeOptions o = options(rw, cw, pow2);
          SCOPED_TRACE(std::string(fp8_recipe_name(o.recipe)) + " rows " + std::to_string(rw) + " cols " +
                       std::to_string(cw) + " pow2 " + std::to_string(pow2));
          const Fp8GroupedTensor cpu = quantize_grouped(r.host(), o);
          if (!nasty && c.cols > 0 && c.capacity > 0) {  // the reference itself, vs the oracle
            const Expected ex = fp8::oracle_grouped(x, c.counts, o);
            if (rw) {
              ASSERT_TRUE(fp8::same_bytes(fp8::host_copy(cpu.q.data), ex.data, "cpu data vs oracle"));
            }
          }
          // Alternate allocated and caller-given (poisoned) outputs.
          std::vector<DeviceTensor> keep;
          Fp8GroupedTensor gpu;
          if (variant++ % 2 == 0) {
            gpu = quantize_grouped(rows_d, o);
          } else {
            const Fp8Grouped out = device_outputs(
                fp8_grouped_layout(c.capacity, c.cols, c.counts.size(), o, Device::cuda(0)), keep);
            gpu = quantize_grouped(rows_d, o, nullptr, nullptr, &out);
          }
          ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
          check_device_errors(nullptr);
          expect_same(gpu.q, cpu.q, o);

          // Dequantization, GPU vs CPU, to the input dtype and f32.
          for (Fp8Copy which : {Fp8Copy::rowwise, Fp8Copy::columnwise}) {
            if ((which == Fp8Copy::rowwise && !rw) || (which == Fp8Copy::columnwise && !cw)) continue;
            for (DType od : {dtype(), DType::f32}) {
              HostTensor want(od, {c.capacity, c.cols}), poisoned(od, {c.capacity, c.cols});
              dequantize_grouped(cpu.q, r.counts_h.view(), want.view(), which);
              poison(poisoned);
              DeviceTensor got_d(poisoned);
              dequantize_grouped(gpu.q, r.counts_d.view(), got_d.view(), which);
              EXPECT_TRUE(same_values(got_d.download(), want, which == Fp8Copy::rowwise ? "dequant rows" : "dequant cols"));
            }
          }
        }
      }
    }
  }
}

TEST_P(CudaFp8Grouped, StridedAndMisalignedInput) {
  // Row stride cols + 3 (not a 16-byte multiple) and a base offset of one element: the kernel
  // must take its scalar path and still match the CPU.
  Rng rng;
  const std::vector<int64_t> counts_v = {130, 0, 1, 127};
  const int64_t cap = 270, cols = 256, ld = cols + 3;
  HostTensor big(dtype(), {cap + 1, ld});
  fill_random(big, rng, -2.0, 2.0);
  const DeviceTensor big_d(big);
  const int64_t es = static_cast<int64_t>(dtype_size(dtype()));
  const TensorView xh(static_cast<char*>(const_cast<void*>(big.data())) + es, dtype(), Device::cpu(), {cap, cols}, {ld, 1});
  const TensorView xd(static_cast<char*>(big_d.data()) + es, dtype(), Device::cuda(0), {cap, cols}, {ld, 1});
  const HostTensor counts_h = make_counts(counts_v);
  const DeviceTensor counts_d(counts_h);
  const Fp8QuantizeOptions o = options(true, true, false);
  const Fp8GroupedTensor cpu = quantize_grouped({xh, counts_h.view()}, o);
  const Fp8GroupedTensor gpu = quantize_grouped({xd, counts_d.view()}, o);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  expect_same(gpu.q, cpu.q, o);
}

TEST_P(CudaFp8Grouped, ColumnSumsAreTheBiasGradient) {
  // quantize_grouped's column_sums, made by the launch that reads x (tensorwise: the amax kernel;
  // blockwise, mxfp8: the tile kernel) as sums per 128-row tile, then the bias gradient's final
  // reduction: within the f32 summation bound of the exact sums, as grouped_bias_grad on the device
  // (which adds in another order); one order for every recipe, format and copy (the tile's), so the
  // same bits; 0 for empty experts; the quantized copies still bitwise the CPU's. Grouped and list
  // sums of x's dtype and f32, poisoned first. (Non-finite inputs: sums of huge values may overflow
  // in one order and not in another, so those are left to the bitwise checks above.)
  Rng rng;
  for (const GroupedCase& c : cuda_cases(rng)) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size());
    const CaseRows r(c, dtype(), rng, false);
    const HostTensor& x = r.x;
    const GroupedRows rows_d = r.device();
    const ExactResult exact = exact_bias_grad(x, c.counts);
    for (const BiasForm& form : bias_forms(dtype())) {
      SCOPED_TRACE(form.name());
      HostTensor poisoned(form.dtype, {E, c.cols});
      poison(poisoned);
      DeviceTensor separate(poisoned), first(poisoned);
      grouped_bias_grad(r.xd.view(), r.counts_d.view(), expert_bias(separate.view(), form.layout));
      Fp8QuantizeOptions blockwise_rows;
      blockwise_rows.recipe = Fp8Recipe::blockwise;
      quantize_grouped(rows_d, blockwise_rows, nullptr, nullptr, nullptr, expert_bias(first.view(), form.layout));
      GMOE_TEST_CUDA(cudaDeviceSynchronize());
      check_device_errors(nullptr);
      const HostTensor want = first.download();
      EXPECT_TRUE(within_rule(separate.download().to_double(), exact, form.dtype, "grouped_bias_grad"));
      EXPECT_TRUE(within_rule(want.to_double(), exact, form.dtype, "column sums vs exact"));
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t n = 0; c.counts[e] == 0 && n < c.cols; ++n) {
          ASSERT_EQ(want.get(e * c.cols + n), 0.0) << "column sums of empty expert " << e;
        }
      }
      for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
        const Fp8QuantizeOptions o = options(rw, cw, false);
        SCOPED_TRACE(std::string(fp8_recipe_name(o.recipe)) + " rows " + std::to_string(rw) + " cols " +
                     std::to_string(cw));
        DeviceTensor got(poisoned);
        const Fp8GroupedTensor gpu =
            quantize_grouped(rows_d, o, nullptr, nullptr, nullptr, expert_bias(got.view(), form.layout));
        const Fp8GroupedTensor cpu = quantize_grouped(r.host(), o);
        GMOE_TEST_CUDA(cudaDeviceSynchronize());
        check_device_errors(nullptr);
        expect_same(gpu.q, cpu.q, o);
        EXPECT_TRUE(bitwise_equal(got.download(), want, "column sums: one order for every recipe and copy"));
      }
    }
  }
}

TEST_P(CudaFp8Grouped, GivenAmaxGivesTheSameBits) {
  // Fp8QuantizeOptions::amax (tensorwise): with each expert's amax of x given, the tile kernel
  // runs alone (no amax pass) and gives the copies and scales of the quantization that computes
  // it, bitwise, for every copy choice; with column sums the tile kernel makes them, the same bits
  // as the amax kernel's (one order). Other recipes refuse it.
  Rng rng;
  const Fp8Recipe recipe = std::get<0>(GetParam());
  for (const GroupedCase& c : cuda_cases(rng)) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size());
    const CaseRows r(c, dtype(), rng, false);
    const GroupedRows rows_d = r.device();
    const DeviceTensor amax_d(expert_amax_tensor(r.x, c.counts));
    if (recipe != Fp8Recipe::tensorwise) {
      Fp8QuantizeOptions o = options(true, true, false);
      o.amax = amax_d.view();
      GMOE_EXPECT_ERROR(quantize_grouped(rows_d, o), "options.amax", "only the tensorwise");
      return;
    }
    HostTensor poisoned(dtype(), {E, c.cols});
    poison(poisoned);
    for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
      for (bool sums : {false, true}) {
        Fp8QuantizeOptions o = options(rw, cw, false);
        SCOPED_TRACE("rows " + std::to_string(rw) + " cols " + std::to_string(cw) + " sums " + std::to_string(sums));
        DeviceTensor want_sums(poisoned), got_sums(poisoned);
        // The device quantization that computes the amax (for the column sums) and the CPU's (for
        // the copies: expect_same compares a device result with a host one).
        quantize_grouped(rows_d, o, nullptr, nullptr, nullptr,
                         sums ? ExpertBias::from_grouped(want_sums.view()) : ExpertBias());
        const Fp8GroupedTensor cpu = quantize_grouped(r.host(), o);
        o.amax = amax_d.view();
        const Fp8GroupedTensor got = quantize_grouped(rows_d, o, nullptr, nullptr, nullptr,
                                                      sums ? ExpertBias::from_grouped(got_sums.view()) : ExpertBias());
        GMOE_TEST_CUDA(cudaDeviceSynchronize());
        check_device_errors(nullptr);
        expect_same(got.q, cpu.q, o);
        if (sums) EXPECT_TRUE(bitwise_equal(got_sums.download(), want_sums.download(), "column sums"));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, CudaFp8Grouped,
    ::testing::Combine(::testing::Values(Fp8Recipe::tensorwise, Fp8Recipe::blockwise, Fp8Recipe::mxfp8),
                       ::testing::Values(DType::e4m3, DType::e5m2),
                       ::testing::Values(DType::bf16, DType::f16, DType::f32)),
    [](const auto& info) {
      return std::string(fp8_recipe_name(std::get<0>(info.param))) + "_" + dtype_name(std::get<1>(info.param)) +
             "_" + dtype_name(std::get<2>(info.param));
    });

// ---------------------------------------------------------------------------------------------
// Weights.

using WeightsParam = std::tuple<Fp8Recipe, DType, DType, Layout>;

class CudaFp8Weights : public ::testing::TestWithParam<WeightsParam> {
 protected:
  void SetUp() override { GMOE_SKIP_WITHOUT_GPU(); }
};

TEST_P(CudaFp8Weights, BitwiseEqualToCpu) {
  Rng rng;
  const auto [recipe, format, dtype, layout] = GetParam();
  struct Shape { int64_t E, N, K; };
  for (const Shape s : {Shape{3, 200, 136}, Shape{2, 128, 256}, Shape{1, 1, 1}, Shape{2, 33, 40}, Shape{4, 256, 512},
                        Shape{2, 0, 16}, Shape{5, 96, 1}}) {
    SCOPED_TRACE(std::to_string(s.E) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K));
    HostTensor w(dtype, {s.E, s.N, s.K});
    fill_random(w, rng, -2.0, 2.0);
    if (s.N * s.K > 1) {
      for (int64_t k = 0; k < s.K; ++k) w.set(k, 0.0);
      w.set(rng.integer(0, w.numel() - 1), std::numeric_limits<double>::quiet_NaN());
      w.set(rng.integer(0, w.numel() - 1), dtype == DType::f32 ? 1e30 : 3e38);
    }
    std::vector<HostTensor> parts;
    for (int64_t e = 0; e < s.E; ++e) {
      parts.emplace_back(dtype, std::vector<int64_t>{s.N, s.K});
      if (s.N * s.K != 0) {
        std::memcpy(parts.back().data(), static_cast<char*>(w.data()) + e * s.N * s.K * dtype_size(dtype),
                    parts.back().bytes().size());
      }
    }
    const DeviceExperts wd(w, parts, layout);
    for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
      Fp8QuantizeOptions o;
      o.recipe = recipe;
      o.format = format;
      o.rowwise = rw;
      o.columnwise = cw;
      const Fp8WeightsTensor cpu = quantize_weights(ExpertWeights::from_stacked(w.view()), o);
      const Fp8WeightsTensor gpu = quantize_weights(wd.view(), o);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      if (rw) {
        EXPECT_TRUE(fp8::same_bytes(download(gpu.q.data), fp8::host_copy(cpu.q.data), "data"));
        EXPECT_TRUE(fp8::same_bytes(download(gpu.q.scale_inv), fp8::host_copy(cpu.q.scale_inv), "scale_inv"));
      }
      if (cw) {
        EXPECT_TRUE(fp8::same_bytes(download(gpu.q.data_t), fp8::host_copy(cpu.q.data_t), "data_t"));
        EXPECT_TRUE(fp8::same_bytes(download(gpu.q.scale_inv_t), fp8::host_copy(cpu.q.scale_inv_t), "scale_inv_t"));
      }
      for (Fp8Copy which : {Fp8Copy::rowwise, Fp8Copy::columnwise}) {
        if ((which == Fp8Copy::rowwise && !rw) || (which == Fp8Copy::columnwise && !cw)) continue;
        HostTensor want(DType::f32, {s.E, s.N, s.K});
        dequantize_weights(cpu.q, ExpertWeights::from_stacked(want.view()), which);
        HostTensor poisoned(DType::f32, {s.E, s.N, s.K});
        poison(poisoned);
        DeviceTensor got(poisoned);
        dequantize_weights(gpu.q, ExpertWeights::from_stacked(got.view()), which);
        EXPECT_TRUE(same_values(got.download(), want, "dequant weights"));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, CudaFp8Weights,
    ::testing::Combine(::testing::Values(Fp8Recipe::tensorwise, Fp8Recipe::blockwise, Fp8Recipe::mxfp8),
                       ::testing::Values(DType::e4m3, DType::e5m2),
                       ::testing::Values(DType::bf16, DType::f16, DType::f32),
                       ::testing::Values(Layout::kStacked, Layout::kList)),
    [](const auto& info) {
      return std::string(fp8_recipe_name(std::get<0>(info.param))) + "_" + dtype_name(std::get<1>(info.param)) +
             "_" + dtype_name(std::get<2>(info.param)) + "_" + layout_name(std::get<3>(info.param));
    });

// ---------------------------------------------------------------------------------------------
// Graph capture, device errors, bad arguments, throughput.

TEST(CudaFp8Graph, CaptureOnceReplayUnderChangingCounts) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const int64_t E = 8, cols = 512, cap = 8 * 200 + 37;
  std::vector<std::vector<int64_t>> routings;
  routings.push_back(std::vector<int64_t>(E, 200));
  routings.push_back(zipf_counts(E, cap - 11, 1.1, 4, rng));
  std::vector<int64_t> one(E, 0);
  one[rng.integer(0, E - 1)] = cap;
  routings.push_back(one);
  routings.push_back(std::vector<int64_t>(E, 0));
  routings.push_back({1, 31, 127, 128, 129, 255, 0, 1});

  const HostTensor x = random_rows(DType::bf16, cap, cols, rng, false);
  const DeviceTensor xd(x);
  DeviceTensor counts_d(make_counts(routings[0]));
  cudaStream_t stream = nullptr;
  GMOE_TEST_CUDA(cudaStreamCreate(&stream));
  for (Fp8Recipe recipe : {Fp8Recipe::blockwise, Fp8Recipe::tensorwise, Fp8Recipe::mxfp8}) {
    SCOPED_TRACE(fp8_recipe_name(recipe));
    Fp8QuantizeOptions o;
    o.recipe = recipe;
    o.rowwise = o.columnwise = true;
    std::vector<DeviceTensor> keep;
    const Fp8Grouped out = device_outputs(fp8_grouped_layout(cap, cols, E, o, Device::cuda(0)), keep);
    keep.emplace_back(DType::f32, std::vector<int64_t>{E, cols});  // the column sums (poisoned with the rest)
    const ExpertBias sums = ExpertBias::from_grouped(keep.back().view());
    Fp8GroupedTensor captured;
    const CapturedGraph graph(stream, [&] {
      captured = quantize_grouped({xd.view(), counts_d.view()}, o, stream, nullptr, &out, sums);
    });
    for (const std::vector<int64_t>& routing : routings) {
      SCOPED_TRACE("routing " + ::testing::PrintToString(routing));
      const HostTensor counts_h = make_counts(routing);
      counts_d.upload(counts_h);
      for (const DeviceTensor& t : keep) {
        const HostTensor h = t.download();
        if (!h.bytes().empty()) cudaMemset(t.data(), 0xa5, h.bytes().size());
      }
      graph.replay(stream);
      check_device_errors(stream);
      const Fp8GroupedTensor cpu = quantize_grouped({x.view(), counts_h.view()}, o);
      expect_same(captured.q, cpu.q, o);
      const HostTensor replayed = keep.back().download();
      EXPECT_TRUE(within_rule(replayed.to_double(), exact_bias_grad(x, routing), DType::f32,
                              "column sums (replay) vs exact"));
      quantize_grouped({xd.view(), counts_d.view()}, o, stream, nullptr, nullptr, sums);
      GMOE_TEST_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(bitwise_equal(replayed, keep.back().download(), "column sums: replay vs eager"));
    }
  }
  GMOE_TEST_CUDA(cudaStreamDestroy(stream));
}

TEST(CudaFp8Errors, DeviceCountErrorsAndBadArguments) {
  GMOE_SKIP_WITHOUT_GPU();
  Rng rng;
  const HostTensor x = random_rows(DType::bf16, 64, 128, rng, false);
  const DeviceTensor xd(x);
  Fp8QuantizeOptions o;
  o.columnwise = true;
  // Counts past the capacity: clamped on the device, recorded in the error word.
  const DeviceTensor past(make_counts({40, 40}));
  quantize_grouped({xd.view(), past.view()}, o);
  GMOE_EXPECT_ERROR(check_device_errors(nullptr), "past the capacity");
  const DeviceTensor negative(make_counts({-3, 10}));
  quantize_grouped({xd.view(), negative.view()}, o);
  GMOE_EXPECT_ERROR(check_device_errors(nullptr), "negative");
  // Clamped like the other grouped ops: the result equals the CPU's on the clamped counts.
  {
    const Fp8GroupedTensor gpu = quantize_grouped({xd.view(), past.view()}, o);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    cudaGetLastError();
    try {
      check_device_errors(nullptr);
    } catch (const Error&) {
    }
    const HostTensor clamped = make_counts({40, 24});
    const Fp8GroupedTensor cpu = quantize_grouped({x.view(), clamped.view()}, o);
    expect_same(gpu.q, cpu.q, o);
  }

  // Host-visible problems are refused before any launch.
  const HostTensor counts_h = make_counts({30, 30});
  GMOE_EXPECT_ERROR(quantize_grouped({xd.view(), counts_h.view()}, o), "x.counts", "cuda:0", "cpu");
  const DeviceTensor counts_d(counts_h);
  DeviceTensor scales(DType::f32, {64 * 2 + 4});
  Fp8Grouped out;
  out.scale_inv = TensorView(static_cast<char*>(scales.data()) + 2, DType::f32, Device::cuda(0), {1, 64});
  GMOE_EXPECT_ERROR(quantize_grouped({xd.view(), counts_d.view()}, o, nullptr, nullptr, &out), "out.scale_inv",
                    "4-byte aligned");
  HostTensor host_sums(DType::f32, {2, 128});
  GMOE_EXPECT_ERROR(quantize_grouped({xd.view(), counts_d.view()}, o, nullptr, nullptr, nullptr,
                                     ExpertBias::from_grouped(host_sums.view())),
                    "column_sums", "cpu");
  HostTensor host_out(DType::e4m3, {64, 128});
  out = Fp8Grouped{};
  out.data = host_out.view();
  GMOE_EXPECT_ERROR(quantize_grouped({xd.view(), counts_d.view()}, o, nullptr, nullptr, &out), "out.data", "cpu");
}

}  // namespace
}  // namespace gmoe::test
