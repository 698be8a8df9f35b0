// tests/cpu/test_fp8_quantize_cpu.cpp — the CPU reference FP8 quantizer against the independent
// oracle (tests/common/fp8_oracle.h), bit for bit: every recipe x format x input dtype on cases
// with expert boundaries at every alignment, empty experts, zero totals, E = 256, partial blocks;
// exact round trips of representable values; the per-element error bound; all-zero, huge, tiny,
// NaN and inf blocks; weights in both layouts; caller-given outputs; the column sums made in the
// same pass (the bias gradient of dy); argument errors.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>

#include "common/activation_oracle.h"
#include "common/expect_error.h"
#include "common/float_convert.h"
#include "common/fp8_oracle.h"
#include "common/fp8_rules.h"
#include "common/gemm_fixture.h"
#include "common/harness.h"
#include "gmoe/fp8.h"
#include "gmoe/grouped_bias.h"

namespace gmoe::test {
namespace {

using fp8::Expected;

const char* copy_name(Fp8Copy c) { return c == Fp8Copy::rowwise ? "rowwise" : "columnwise"; }

// ---------------------------------------------------------------------------------------------
// The element conversion.

TEST(Fp8Conversion, SoftwareEncodeMatchesOracle) {
  Rng rng;
  for (DType f : {DType::e4m3, DType::e5m2}) {
    const bool e5 = f == DType::e5m2;
    auto check = [&](float y) {
      const uint8_t got = fp8_rules::fp8_from_float(y, e5);
      const uint8_t want = fp8::encode(y, f);
      ASSERT_EQ(int(got), int(want)) << dtype_name(f) << " of " << y << " (bits 0x" << std::hex
                                     << float_bits(y) << ")";
    };
    // Every bf16 value (all exponents, NaN, inf, subnormals).
    for (uint32_t h = 0; h < 65536; ++h) check(bits_float(h << 16));
    // Midpoints between neighbouring codes and their f32 neighbours (ties to even, both signs).
    for (int c = 0; c < (e5 ? 0x7b : 0x7e); ++c) {
      const double mid = 0.5 * (fp8::decode(uint8_t(c), f) + fp8::decode(uint8_t(c + 1), f));
      const float m = static_cast<float>(mid);
      for (float y : {m, std::nextafter(m, 0.0f), std::nextafter(m, 1e30f)}) {
        check(y);
        check(-y);
      }
    }
    // Around the saturation threshold, and random f32 bit patterns.
    const float mx = static_cast<float>(fp8::max_value(f));
    for (float y : {mx, std::nextafter(mx, 1e30f), mx * 1.0625f, mx * 1.125f, FLT_MAX, INFINITY, -INFINITY,
                    0.0f, -0.0f, FLT_MIN, FLT_TRUE_MIN, -FLT_TRUE_MIN}) {
      check(y);
    }
    for (int i = 0; i < 200000; ++i) check(bits_float(static_cast<uint32_t>(rng.engine()())));
  }
}

TEST(Fp8Conversion, DecodeAllCodes) {
  for (DType f : {DType::e4m3, DType::e5m2}) {
    for (int b = 0; b < 256; ++b) {
      const float got = fp8_rules::fp8_to_float(uint8_t(b), f == DType::e5m2);
      const double want = fp8::decode(uint8_t(b), f);
      if (std::isnan(want)) {
        EXPECT_TRUE(std::isnan(got)) << dtype_name(f) << " code " << b;
      } else {
        EXPECT_EQ(double(got), want) << dtype_name(f) << " code " << b;
      }
      // Every finite code encodes back to itself (the canonical NaN is 0x7F).
      if (std::isfinite(want) && b != 0x80) {
        EXPECT_EQ(int(fp8_rules::fp8_from_float(got, f == DType::e5m2)), b);
      }
    }
  }
}

TEST(Fp8Rules, ScalesAreFinite) {
  for (DType f : {DType::e4m3, DType::e5m2}) {
    const float fmax = static_cast<float>(fp8::max_value(f));
    for (float amax : {0.0f, FLT_TRUE_MIN, 1e-40f, FLT_MIN, 1e-30f, 1.0f, 448.0f, 1e30f, FLT_MAX}) {
      for (bool pow2 : {false, true}) {
        const float s = fp8_rules::scale_from_amax(amax, fmax, pow2);
        const float inv = fp8_rules::scale_inv_from_scale(s);
        EXPECT_TRUE(std::isfinite(s) && s > 0 && std::isfinite(inv) && inv > 0) << amax;
        if (amax == 0.0f) {
          EXPECT_EQ(inv, 1.0f);
        }
      }
      const uint8_t b = fp8_rules::e8m0_from_amax(amax, f == DType::e5m2 ? 15 : 8);
      EXPECT_LT(b, 255);
      EXPECT_TRUE(std::isfinite(fp8_rules::e8m0_quant_multiplier(b)));
      if (amax == 0.0f) {
        EXPECT_EQ(b, 127);
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Grouped rows.

struct GroupedCase {
  std::string name;
  std::vector<int64_t> counts;
  int64_t capacity;
  int64_t cols;
};

std::vector<GroupedCase> grouped_cases(Rng& rng) {
  std::vector<GroupedCase> cases = {
      {"align_1_31_127_129", {1, 31, 127, 129}, 300, 200},
      {"align_128_255_0_256_1", {128, 255, 0, 256, 1}, 700, 128},
      {"all_empty", {0, 0, 0}, 10, 64},
      {"zero_capacity", {0, 0}, 0, 96},
      {"one_expert", {0, 300, 0}, 300, 160},
      {"cols_1", {3, 130}, 140, 1},
      {"cols_0", {5, 0, 2}, 9, 0},
      {"cols_40", {33, 0, 64}, 100, 40},
  };
  GroupedCase e256{"e256", std::vector<int64_t>(256), 0, 48};
  for (auto& c : e256.counts) c = rng.integer(0, 4) == 0 ? 0 : rng.integer(1, 40);
  for (int64_t c : e256.counts) e256.capacity += c;
  e256.capacity += 17;
  cases.push_back(e256);
  return cases;
}

/// Random values with a few blocks all zero, NaN/inf sprinkled in when `nasty`.
HostTensor grouped_input(DType dtype, int64_t cap, int64_t cols, Rng& rng, bool nasty) {
  HostTensor x(dtype, {cap, cols});
  fill_random(x, rng, -3.0, 3.0);
  if (cap * cols == 0) return x;
  // Rows of zeros and a column of zeros: all-zero 1x128 and 128x1 blocks.
  for (int64_t c = 0; c < cols; ++c) x.set(std::min<int64_t>(cap - 1, 2) * cols + c, 0.0);
  for (int64_t r = 0; r < cap; ++r) x.set(r * cols + (cols - 1), 0.0);
  if (nasty) {
    const double big = dtype == DType::f16 ? 60000.0 : (dtype == DType::bf16 ? 3.38e38 : 1e30);
    for (int i = 0; i < 6; ++i) x.set(rng.integer(0, cap * cols - 1), big * (i % 2 ? -1 : 1));
    x.set(rng.integer(0, cap * cols - 1), std::numeric_limits<double>::quiet_NaN());
    x.set(rng.integer(0, cap * cols - 1), std::numeric_limits<double>::infinity());
    x.set(rng.integer(0, cap * cols - 1), -std::numeric_limits<double>::infinity());
    x.set(rng.integer(0, cap * cols - 1), dtype == DType::f32 ? 1e-40 : 1e-7);
  }
  return x;
}

void expect_grouped_equal(const Fp8Grouped& q, const Expected& ex, const Fp8QuantizeOptions& o) {
  if (o.rowwise) {
    EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.data), ex.data, "data"));
    EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.scale_inv), ex.scale_inv, "scale_inv"));
  }
  if (o.columnwise) {
    EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.data_t), ex.data_t, "data_t"));
    EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.scale_inv_t), ex.scale_inv_t, "scale_inv_t"));
  }
  EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.padded_offsets), ex.padded_offsets, "padded_offsets"));
}

// The multiplier that dequantizes element (r, c) of the rowwise / columnwise copy.
double row_scale_inv(const Fp8Grouped& q, const std::vector<int64_t>& off, int64_t r, int64_t c, Fp8Copy which) {
  const TensorView& s = which == Fp8Copy::rowwise ? q.scale_inv : q.scale_inv_t;
  int64_t e = 0;
  while (off[e + 1] <= r) ++e;
  int64_t i = e;
  const int64_t B = q.recipe == Fp8Recipe::mxfp8 ? kMxBlock : kFp8Block;
  if (q.recipe != Fp8Recipe::tensorwise) {
    if (which == Fp8Copy::rowwise) {
      // blockwise: token-major [ceil(cols/128), capacity]; mxfp8 [capacity, ceil(cols/32)]
      i = q.recipe == Fp8Recipe::blockwise ? c / B * s.size(1) + r : r * s.size(1) + c / B;
    } else {
      const int64_t t = static_cast<const int64_t*>(q.padded_offsets.data)[e] + (r - off[e]);
      // blockwise: token-block-major [P/128, cols]; mxfp8 [cols, P/32]
      i = q.recipe == Fp8Recipe::blockwise ? t / B * s.size(1) + c : c * s.size(1) + t / B;
    }
  }
  if (q.recipe == Fp8Recipe::mxfp8) return fp8_rules::e8m0_to_float(static_cast<const uint8_t*>(s.data)[i]);
  return static_cast<const float*>(s.data)[i];
}

using GroupedParam = std::tuple<Fp8Recipe, DType, DType>;  // recipe, format, input dtype

class CpuFp8Grouped : public ::testing::TestWithParam<GroupedParam> {
 protected:
  Fp8QuantizeOptions options(bool rows, bool cols, bool pow2 = false) const {
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

TEST_P(CpuFp8Grouped, MatchesOracleAndBound) {
  Rng rng;
  for (const GroupedCase& c : grouped_cases(rng)) {
    for (bool nasty : {false, true}) {
      SCOPED_TRACE(c.name + (nasty ? " nasty" : ""));
      const HostTensor x = grouped_input(dtype(), c.capacity, c.cols, rng, nasty);
      const HostTensor counts = make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
      const GroupedRows rows{x.view(), counts.view()};
      for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
        for (bool pow2 : {false, true}) {
          if (pow2 && std::get<0>(GetParam()) == Fp8Recipe::mxfp8) continue;
          const Fp8QuantizeOptions o = options(rw, cw, pow2);
          // Preallocated, poisoned outputs so unwritten bytes show.
          const Fp8Grouped layout = fp8_grouped_layout(c.capacity, c.cols, c.counts.size(), o, Device::cpu());
          Fp8Grouped out = layout;
          std::vector<HostTensor> keep;
          keep.reserve(5);
          for (TensorView* v : {&out.data, &out.scale_inv, &out.data_t, &out.scale_inv_t, &out.padded_offsets}) {
            if (!v->defined()) continue;
            keep.emplace_back(v->dtype, std::vector<int64_t>(v->shape.begin(), v->shape.begin() + v->ndim));
            fp8::poison_bytes(keep.back());
            v->data = keep.back().numel() ? keep.back().data() : nullptr;
          }
          const Fp8GroupedTensor res = quantize_grouped(rows, o, nullptr, nullptr, &out);
          EXPECT_EQ(res.storage, nullptr);
          const Expected ex = fp8::oracle_grouped(x, c.counts, o);
          SCOPED_TRACE(std::string(fp8_recipe_name(o.recipe)) + " rows " + std::to_string(rw) + " cols " +
                       std::to_string(cw) + " pow2 " + std::to_string(pow2));
          expect_grouped_equal(res.q, ex, o);

          // Dequantize each copy: the error bound against the source, rows past the total zero.
          std::vector<int64_t> off(c.counts.size() + 1, 0);
          for (size_t e = 0; e < c.counts.size(); ++e) off[e + 1] = off[e] + c.counts[e];
          for (Fp8Copy which : {Fp8Copy::rowwise, Fp8Copy::columnwise}) {
            if ((which == Fp8Copy::rowwise && !rw) || (which == Fp8Copy::columnwise && !cw)) continue;
            HostTensor deq(DType::f32, {c.capacity, c.cols});
            poison(deq);
            dequantize_grouped(res.q, counts.view(), deq.view(), which);
            int64_t bad = 0;
            for (int64_t r = 0; r < c.capacity && bad < 5; ++r) {
              for (int64_t col = 0; col < c.cols; ++col) {
                const double got = deq.get(r * c.cols + col);
                if (r >= off.back()) {
                  if (got != 0.0) ++bad;
                  continue;
                }
                const double sinv = row_scale_inv(res.q, off, r, col, which);
                if (!fp8::within_round_trip_bound(x.get(r * c.cols + col), got, sinv, o.format)) {
                  ADD_FAILURE() << copy_name(which) << " (" << r << ", " << col << "): x " << x.get(r * c.cols + col)
                                << " deq " << got << " scale_inv " << sinv;
                  ++bad;
                }
              }
            }
            EXPECT_EQ(bad, 0) << copy_name(which);
          }
        }
      }
    }
  }
}

TEST_P(CpuFp8Grouped, AllocatedEqualsPreallocated) {
  Rng rng;
  const std::vector<int64_t> counts_v = {129, 0, 31};
  const HostTensor x = grouped_input(dtype(), 170, 136, rng, false);
  const HostTensor counts = make_counts(counts_v);
  const Fp8QuantizeOptions o = options(true, true);
  const Fp8GroupedTensor a = quantize_grouped({x.view(), counts.view()}, o);
  ASSERT_NE(a.storage, nullptr);
  EXPECT_EQ(a.q.padded_capacity, 256 + 3 * 128);
  expect_grouped_equal(a.q, fp8::oracle_grouped(x, counts_v, o), o);
  if (o.recipe == Fp8Recipe::tensorwise) {
    EXPECT_EQ(a.q.scale_inv_t.data, a.q.scale_inv.data);
  }
}

TEST_P(CpuFp8Grouped, RoundTripOfRepresentableValuesIsExact) {
  // Values that are fp8 codes times one power of two per expert survive quantize + dequantize
  // exactly: f32 recipes with power-of-two scales (the block's amax times the scale then stays a
  // code times a power of two >= 1, and <= fp8_max), and MXFP8 — except e4m3 blocks whose amax
  // has the mantissa 1.875: the OCP scale 2^(floor(log2 amax) - 8) maps it to 480 > 448, which
  // saturates (that case is covered by the saturation bound), so such codes are left out here.
  Rng rng;
  const Fp8Recipe recipe = std::get<0>(GetParam());
  const DType f = std::get<1>(GetParam());
  const std::vector<int64_t> counts_v = {1, 31, 0, 127, 129, 255};
  int64_t cap = 0;
  for (int64_t c : counts_v) cap += c;
  const int64_t cols = 160;
  HostTensor x(dtype(), {cap, cols});
  // Exponent range that keeps every value (and its subnormal codes) exact in the input dtype.
  const int kmax = dtype() == DType::f16 ? (f == DType::e5m2 ? 0 : 2) : 10;
  const int kmin = dtype() == DType::f16 ? (f == DType::e5m2 ? -8 : -10) : -10;
  const int max_code = f == DType::e5m2 ? 0x7b : 0x7e;
  int64_t r = 0;
  for (size_t e = 0; e < counts_v.size(); ++e) {
    const int k = static_cast<int>(rng.integer(kmin, kmax));
    for (int64_t i = 0; i < counts_v[e]; ++i, ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        uint8_t code = static_cast<uint8_t>(rng.integer(0, max_code) | (rng.integer(0, 1) << 7));
        if (recipe == Fp8Recipe::mxfp8 && f == DType::e4m3 && (code & 7) == 7) code &= 0xfe;
        x.set(r * cols + c, std::ldexp(fp8::decode(code, f), k));
      }
    }
  }
  const HostTensor counts = make_counts(counts_v);
  Fp8QuantizeOptions o = options(true, true, recipe != Fp8Recipe::mxfp8);
  const Fp8GroupedTensor q = quantize_grouped({x.view(), counts.view()}, o);
  for (Fp8Copy which : {Fp8Copy::rowwise, Fp8Copy::columnwise}) {
    HostTensor deq(dtype(), {cap, cols});
    poison(deq);
    dequantize_grouped(q.q, counts.view(), deq.view(), which);
    EXPECT_TRUE(bitwise_equal(deq, x, std::string("round trip ") + copy_name(which)));
  }
  // Without power-of-two scales, blockwise rowwise is exact when each block's amax is
  // fp8_max * 2^k: the scale is then 2^-k exactly.
  if (recipe == Fp8Recipe::blockwise && dtype() != DType::f16) {
    for (int64_t row = 0; row < cap; ++row) {
      for (int64_t b = 0; b * 128 < cols; ++b) {
        const int k = static_cast<int>(rng.integer(-6, 6));
        for (int64_t c = b * 128; c < std::min<int64_t>(cols, b * 128 + 128); ++c) {
          const double v = fp8::decode(static_cast<uint8_t>(rng.integer(0, max_code)), f);
          x.set(row * cols + c, std::ldexp(c == b * 128 ? fp8::max_value(f) : v, k));
        }
      }
    }
    o = options(true, false, false);
    const Fp8GroupedTensor q2 = quantize_grouped({x.view(), counts.view()}, o);
    HostTensor deq(dtype(), {cap, cols});
    dequantize_grouped(q2.q, counts.view(), deq.view(), Fp8Copy::rowwise);
    EXPECT_TRUE(bitwise_equal(deq, x, "blockwise round trip without pow2"));
  }
}

TEST_P(CpuFp8Grouped, SpecialValues) {
  // All-zero blocks get scale_inv 1 (e8m0 127); NaN -> 0x7F; ±inf -> ±max; neither moves the
  // scale; huge finite values (near FLT_MAX / bf16 max) and subnormal-only blocks give finite,
  // positive scales.
  const Fp8Recipe recipe = std::get<0>(GetParam());
  const DType f = std::get<1>(GetParam());
  const int64_t cols = 128;
  const std::vector<int64_t> counts_v = {4};
  HostTensor x(dtype(), {4, cols});
  for (int64_t i = 0; i < x.numel(); ++i) x.set(i, 0.0);
  const double huge = dtype() == DType::f32 ? 3.0e38 : (dtype() == DType::bf16 ? 3.38e38 : 65504.0);
  const double tiny = dtype() == DType::f32 ? 1e-42 : (dtype() == DType::bf16 ? 1e-40 : 6e-8);
  // Row 0: zeros. Row 1: NaN, +inf, -inf and 1.5 (amax 1.5). Row 2: huge. Row 3: tiny.
  x.set(1 * cols + 0, std::numeric_limits<double>::quiet_NaN());
  x.set(1 * cols + 1, std::numeric_limits<double>::infinity());
  x.set(1 * cols + 2, -std::numeric_limits<double>::infinity());
  x.set(1 * cols + 3, 1.5);
  x.set(2 * cols + 5, huge);
  x.set(2 * cols + 6, -huge / 2);
  x.set(3 * cols + 7, tiny);
  const HostTensor counts = make_counts(counts_v);
  const Fp8QuantizeOptions o = options(true, true);
  const Fp8GroupedTensor q = quantize_grouped({x.view(), counts.view()}, o);
  expect_grouped_equal(q.q, fp8::oracle_grouped(x, counts_v, o), o);
  const uint8_t* d = static_cast<const uint8_t*>(q.q.data.data);
  const uint8_t maxc = f == DType::e5m2 ? 0x7b : 0x7e;
  EXPECT_EQ(d[1 * cols + 0], 0x7f);
  EXPECT_EQ(d[1 * cols + 1], maxc);
  EXPECT_EQ(d[1 * cols + 2], 0x80 | maxc);
  for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(d[c], 0) << c;
  if (recipe == Fp8Recipe::blockwise) {
    const float* s = static_cast<const float*>(q.q.scale_inv.data);
    EXPECT_EQ(s[0], 1.0f);                                       // zero row
    EXPECT_EQ(s[1], fp8_rules::scale_inv_from_scale(fp8_rules::scale_from_amax(
                        1.5f, static_cast<float>(fp8::max_value(f)), false)));  // amax skips NaN/inf
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(std::isfinite(s[r]) && s[r] > 0) << r;
  }
  if (recipe == Fp8Recipe::mxfp8) {
    const uint8_t* s = static_cast<const uint8_t*>(q.q.scale_inv.data);
    for (int b = 0; b < 4; ++b) EXPECT_EQ(s[b], 127);  // zero row: 1.0
    for (int i = 0; i < 16; ++i) EXPECT_LT(s[i], 255);
  }
}

TEST_P(CpuFp8Grouped, ColumnSumsAreTheBiasGradient) {
  // quantize_grouped's column_sums: grouped_bias_grad of x, bit for bit (the CPU backend's one f32
  // order), within the f32 summation bound of the exact sums, 0 for empty experts; the quantized
  // copies unchanged. Counts 0, 1, 31, 127, 129, all tokens in one expert, zero totals, odd column
  // counts; grouped and list sums of x's dtype and f32; poisoned first.
  Rng rng;
  std::vector<GroupedCase> cases = grouped_cases(rng);
  cases.push_back({"empty_1_31_127_129_cols_33", {0, 1, 31, 0, 127, 129}, 320, 33});
  for (const GroupedCase& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size());
    const HostTensor x = grouped_input(dtype(), c.capacity, c.cols, rng, false);
    const HostTensor counts = make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
    const GroupedRows rows{x.view(), counts.view()};
    const ExactResult exact = exact_bias_grad(x, c.counts);
    for (const BiasForm& form : bias_forms(dtype())) {
      SCOPED_TRACE(form.name());
      HostTensor want(form.dtype, {E, c.cols});
      poison(want);
      grouped_bias_grad(x.view(), counts.view(), expert_bias(want.view(), form.layout));
      for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
        const Fp8QuantizeOptions o = options(rw, cw);
        HostTensor got(form.dtype, {E, c.cols});
        poison(got);
        const Fp8GroupedTensor q =
            quantize_grouped(rows, o, nullptr, nullptr, nullptr, expert_bias(got.view(), form.layout));
        expect_grouped_equal(q.q, fp8::oracle_grouped(x, c.counts, o), o);
        EXPECT_TRUE(bitwise_equal(got, want, "column sums vs grouped_bias_grad"));
        EXPECT_TRUE(within_rule(got.to_double(), exact, form.dtype, "column sums vs exact"));
        for (int64_t e = 0; e < E; ++e) {
          for (int64_t n = 0; c.counts[e] == 0 && n < c.cols; ++n) {
            ASSERT_EQ(got.get(e * c.cols + n), 0.0) << "column sums of empty expert " << e;
          }
        }
      }
    }
  }
}

TEST_P(CpuFp8Grouped, GivenAmaxGivesTheSameBits) {
  // Fp8QuantizeOptions::amax (tensorwise): each expert's amax given, the same copies and scales
  // as the oracle's (which computes it); half of it stores the scale it implies and saturates the
  // values above it (to the format's largest). Other recipes refuse it.
  Rng rng;
  const Fp8Recipe recipe = std::get<0>(GetParam());
  for (const GroupedCase& c : grouped_cases(rng)) {
    SCOPED_TRACE(c.name);
    const int64_t E = static_cast<int64_t>(c.counts.size());
    const HostTensor x = grouped_input(dtype(), c.capacity, c.cols, rng, false);
    const HostTensor counts = make_counts(c.counts, rng.integer(0, 1) ? DType::i32 : DType::i64);
    const GroupedRows rows{x.view(), counts.view()};
    const std::vector<float> amax_v = expert_amax(x, c.counts);
    HostTensor amax = expert_amax_tensor(x, c.counts);
    Fp8QuantizeOptions o = options(true, true);
    o.amax = amax.view();
    if (recipe != Fp8Recipe::tensorwise) {
      GMOE_EXPECT_ERROR(quantize_grouped(rows, o), "options.amax", "only the tensorwise");
      return;
    }
    expect_grouped_equal(quantize_grouped(rows, o).q, fp8::oracle_grouped(x, c.counts, options(true, true)), o);
    // Half the amax: every value above it saturates to the format's largest.
    for (int64_t e = 0; e < E; ++e) amax.set(e, amax_v[e] / 2);
    const Fp8GroupedTensor half = quantize_grouped(rows, o);
    const float fmax = fp8_max(o.format);
    for (int64_t e = 0; e < E; ++e) {
      const float want = fp8_rules::scale_inv_from_scale(fp8_rules::scale_from_amax(amax_v[e] / 2, fmax, false));
      ASSERT_EQ(static_cast<const float*>(half.q.scale_inv.data)[e], want) << "scale_inv of expert " << e;
    }
    for (int64_t e = 0, row = 0; e < E; row += c.counts[e], ++e) {
      for (int64_t r = row; r < row + c.counts[e] && amax_v[e] > 0; ++r) {
        for (int64_t col = 0; col < c.cols; ++col) {
          const double v = x.get(r * c.cols + col);
          if (std::abs(v) > amax_v[e] / 2) {
            const double q = fp8::decode(static_cast<const uint8_t*>(half.q.data.data)[r * c.cols + col], o.format);
            ASSERT_EQ(std::abs(q), fmax) << "row " << r << " col " << col << " value " << v;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, CpuFp8Grouped,
    ::testing::Combine(::testing::Values(Fp8Recipe::tensorwise, Fp8Recipe::blockwise, Fp8Recipe::mxfp8),
                       ::testing::Values(DType::e4m3, DType::e5m2),
                       ::testing::Values(DType::bf16, DType::f16, DType::f32)),
    [](const auto& info) {
      return std::string(fp8_recipe_name(std::get<0>(info.param))) + "_" + dtype_name(std::get<1>(info.param)) +
             "_" + dtype_name(std::get<2>(info.param));
    });

// ---------------------------------------------------------------------------------------------
// Weights.

using WeightsParam = std::tuple<Fp8Recipe, DType, DType, bool>;  // recipe, format, dtype, list

class CpuFp8Weights : public ::testing::TestWithParam<WeightsParam> {};

TEST_P(CpuFp8Weights, MatchesOracleAndBound) {
  Rng rng;
  const auto [recipe, format, dtype, as_list] = GetParam();
  struct Shape { int64_t E, N, K; };
  for (const Shape s : {Shape{3, 200, 136}, Shape{2, 128, 256}, Shape{1, 1, 1}, Shape{2, 33, 40}, Shape{2, 0, 16}}) {
    SCOPED_TRACE(std::to_string(s.E) + "x" + std::to_string(s.N) + "x" + std::to_string(s.K));
    HostTensor w(dtype, {s.E, s.N, s.K});
    fill_random(w, rng, -2.0, 2.0);
    if (s.N * s.K > 0) {
      for (int64_t k = 0; k < s.K; ++k) w.set(k, 0.0);  // a zero row: zero 1x32 blocks
      w.set(rng.integer(0, w.numel() - 1), std::numeric_limits<double>::quiet_NaN());
    }
    std::vector<HostTensor> parts;
    ExpertWeights ew = ExpertWeights::from_stacked(w.view());
    if (as_list) {
      std::vector<TensorView> views;
      for (int64_t e = 0; e < s.E; ++e) {
        parts.emplace_back(dtype, std::vector<int64_t>{s.N, s.K});
        if (s.N * s.K != 0) std::memcpy(parts.back().data(), static_cast<char*>(w.data()) + e * s.N * s.K * dtype_size(dtype),
                                   parts.back().bytes().size());
        views.push_back(parts.back().view());
      }
      ew = ExpertWeights::from_list(views);
    }
    for (auto [rw, cw] : {std::pair{true, true}, std::pair{true, false}, std::pair{false, true}}) {
      Fp8QuantizeOptions o;
      o.recipe = recipe;
      o.format = format;
      o.rowwise = rw;
      o.columnwise = cw;
      const Fp8WeightsTensor q = quantize_weights(ew, o);
      const Expected ex = fp8::oracle_weights(w, o);
      if (rw) {
        EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.q.data), ex.data, "data"));
        EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.q.scale_inv), ex.scale_inv, "scale_inv"));
      }
      if (cw) {
        EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.q.data_t), ex.data_t, "data_t"));
        EXPECT_TRUE(fp8::same_bytes(fp8::host_copy(q.q.scale_inv_t), ex.scale_inv_t, "scale_inv_t"));
      }
      if (rw && cw && recipe != Fp8Recipe::mxfp8) {  // data_t is exactly the transpose
        const uint8_t* a = static_cast<const uint8_t*>(q.q.data.data);
        const uint8_t* b = static_cast<const uint8_t*>(q.q.data_t.data);
        for (int64_t e = 0; e < s.E; ++e)
          for (int64_t n = 0; n < s.N; ++n)
            for (int64_t k = 0; k < s.K; ++k)
              ASSERT_EQ(a[(e * s.N + n) * s.K + k], b[(e * s.K + k) * s.N + n]);
      }
      for (Fp8Copy which : {Fp8Copy::rowwise, Fp8Copy::columnwise}) {
        if ((which == Fp8Copy::rowwise && !rw) || (which == Fp8Copy::columnwise && !cw)) continue;
        HostTensor deq(DType::f32, {s.E, s.N, s.K});
        poison(deq);
        dequantize_weights(q.q, ExpertWeights::from_stacked(deq.view()), which);
        // Error bound, with each element's own multiplier recomputed from the scale tensors.
        const TensorView& sv = which == Fp8Copy::rowwise ? q.q.scale_inv : q.q.scale_inv_t;
        int bad = 0;
        for (int64_t e = 0; e < s.E && bad < 5; ++e) {
          for (int64_t n = 0; n < s.N; ++n) {
            for (int64_t k = 0; k < s.K; ++k) {
              int64_t si = e;
              if (recipe == Fp8Recipe::blockwise) {
                si = which == Fp8Copy::rowwise ? (e * sv.size(1) + n / 128) * sv.size(2) + k / 128
                                               : (e * sv.size(1) + k / 128) * sv.size(2) + n / 128;
              } else if (recipe == Fp8Recipe::mxfp8) {
                si = which == Fp8Copy::rowwise ? (e * s.N + n) * sv.size(2) + k / 32 : (e * s.K + k) * sv.size(2) + n / 32;
              }
              const double sinv = recipe == Fp8Recipe::mxfp8
                                      ? fp8_rules::e8m0_to_float(static_cast<const uint8_t*>(sv.data)[si])
                                      : static_cast<const float*>(sv.data)[si];
              const int64_t i = (e * s.N + n) * s.K + k;
              if (!fp8::within_round_trip_bound(w.get(i), deq.get(i), sinv, format)) {
                ADD_FAILURE() << copy_name(which) << " " << e << "," << n << "," << k << ": w " << w.get(i)
                              << " deq " << deq.get(i);
                ++bad;
              }
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Recipes, CpuFp8Weights,
    ::testing::Combine(::testing::Values(Fp8Recipe::tensorwise, Fp8Recipe::blockwise, Fp8Recipe::mxfp8),
                       ::testing::Values(DType::e4m3, DType::e5m2), ::testing::Values(DType::bf16, DType::f32),
                       ::testing::Bool()),
    [](const auto& info) {
      return std::string(fp8_recipe_name(std::get<0>(info.param))) + "_" + dtype_name(std::get<1>(info.param)) +
             "_" + dtype_name(std::get<2>(info.param)) + (std::get<3>(info.param) ? "_list" : "_stacked");
    });

// ---------------------------------------------------------------------------------------------
// Errors.

TEST(Fp8Errors, BadArguments) {
  Rng rng;
  HostTensor x(DType::bf16, {8, 16});
  fill_random(x, rng);
  const HostTensor counts = make_counts({3, 5});
  const GroupedRows rows{x.view(), counts.view()};
  Fp8QuantizeOptions o;

  Fp8QuantizeOptions bad = o;
  bad.format = DType::bf16;
  GMOE_EXPECT_ERROR(quantize_grouped(rows, bad), "options.format", "e4m3 or e5m2", "bf16");
  bad = o;
  bad.rowwise = bad.columnwise = false;
  GMOE_EXPECT_ERROR(quantize_grouped(rows, bad), "neither rowwise nor columnwise");

  HostTensor xi(DType::i32, {8, 16});
  GMOE_EXPECT_ERROR(quantize_grouped({xi.view(), counts.view()}, o), "x.data", "dtype not supported");
  const HostTensor counts_f(DType::f32, {2});
  GMOE_EXPECT_ERROR(quantize_grouped({x.view(), counts_f.view()}, o), "x.counts", "i32 or i64");
  const HostTensor too_many = make_counts({5, 5});
  GMOE_EXPECT_ERROR(quantize_grouped({x.view(), too_many.view()}, o), "x.counts", "past the capacity");
  const HostTensor negative = make_counts({-1, 5});
  GMOE_EXPECT_ERROR(quantize_grouped({x.view(), negative.view()}, o), "x.counts[0]", "negative");

  // A given amax: tensorwise, f32, one per expert; never for weights.
  HostTensor amax2(DType::f32, {2}), amax3(DType::f32, {3}), amax_bf16(DType::bf16, {2});
  bad = o;
  bad.recipe = Fp8Recipe::tensorwise;
  bad.amax = amax3.view();
  GMOE_EXPECT_ERROR(quantize_grouped(rows, bad), "options.amax", "f32[2]");
  bad.amax = amax_bf16.view();
  GMOE_EXPECT_ERROR(quantize_grouped(rows, bad), "options.amax", "f32[2]");
  bad.amax = amax2.view();
  bad.recipe = Fp8Recipe::mxfp8;
  GMOE_EXPECT_ERROR(quantize_grouped(rows, bad), "options.amax", "only the tensorwise");
  bad.recipe = Fp8Recipe::tensorwise;
  HostTensor w16(DType::bf16, {2, 16, 16});
  fill_random(w16, rng);
  GMOE_EXPECT_ERROR(quantize_weights(ExpertWeights::from_stacked(w16.view()), bad), "quantize_weights",
                    "options.amax");

  // Caller-given outputs of the wrong shape / dtype.
  HostTensor small(DType::e4m3, {8, 15});
  Fp8Grouped out;
  out.data = small.view();
  GMOE_EXPECT_ERROR(quantize_grouped(rows, o, nullptr, nullptr, &out), "out.data", "[8, 16]");
  HostTensor wrong_dtype(DType::e5m2, {8, 16});
  out.data = wrong_dtype.view();
  GMOE_EXPECT_ERROR(quantize_grouped(rows, o, nullptr, nullptr, &out), "out.data", "e4m3");
  HostTensor pad_small(DType::i64, {2});
  out = Fp8Grouped{};
  out.padded_offsets = pad_small.view();
  GMOE_EXPECT_ERROR(quantize_grouped(rows, o, nullptr, nullptr, &out), "out.padded_offsets");

  // Column sums of the wrong number of experts, length, dtype.
  HostTensor sums_one(DType::f32, {1, 16});
  GMOE_EXPECT_ERROR(quantize_grouped(rows, o, nullptr, nullptr, nullptr, ExpertBias::from_grouped(sums_one.view())),
                    "column_sums", "1 experts", "length 2");
  HostTensor sums_short(DType::f32, {2, 15});
  GMOE_EXPECT_ERROR(quantize_grouped(rows, o, nullptr, nullptr, nullptr, ExpertBias::from_grouped(sums_short.view())),
                    "column_sums", "vectors of 16", "15");
  HostTensor sums_f16(DType::f16, {2, 16});
  GMOE_EXPECT_ERROR(quantize_grouped(rows, o, nullptr, nullptr, nullptr, ExpertBias::from_grouped(sums_f16.view())),
                    "column_sums", "bf16 or f32", "f16");

  // Dequantization of a copy that is absent, or into the wrong shape.
  const Fp8GroupedTensor q = quantize_grouped(rows, o);
  HostTensor deq(DType::f32, {8, 16});
  GMOE_EXPECT_ERROR(dequantize_grouped(q.q, counts.view(), deq.view(), Fp8Copy::columnwise), "data_t", "absent");
  HostTensor deq_bad(DType::f32, {8, 17});
  GMOE_EXPECT_ERROR(dequantize_grouped(q.q, counts.view(), deq_bad.view()), "out", "[8, 16]");
  HostTensor deq_i(DType::i32, {8, 16});
  GMOE_EXPECT_ERROR(dequantize_grouped(q.q, counts.view(), deq_i.view()), "out", "dtype not supported");

  // Weights.
  HostTensor w(DType::f16, {2, 4, 8});
  bad = o;
  bad.format = DType::e8m0;
  GMOE_EXPECT_ERROR(quantize_weights(ExpertWeights::from_stacked(w.view()), bad), "options.format");
  HostTensor wi(DType::i64, {2, 4, 8});
  GMOE_EXPECT_ERROR(quantize_weights(ExpertWeights::from_stacked(wi.view()), o), "w", "dtype not supported");
  const Fp8WeightsTensor qw = quantize_weights(ExpertWeights::from_stacked(w.view()), o);
  HostTensor wout(DType::f32, {2, 4, 9});
  GMOE_EXPECT_ERROR(dequantize_weights(qw.q, ExpertWeights::from_stacked(wout.view())), "out", "[4, 8]");
}

}  // namespace
}  // namespace gmoe::test
