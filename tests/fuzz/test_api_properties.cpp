// tests/fuzz/test_api_properties.cpp — a property test of the public ops on the CPU backend: random
// shapes, strides, dtypes and counts, valid and hostile (null data, sizes past 2^64, negative and
// overflowing counts, overlapping rows, column strides, wrong dtypes and lengths, a mask without
// data). Each call must either give the right result or throw gmoe::Error; any other exception, a
// crash or a sanitizer report is a failure, and so is a hostile call that is accepted or a valid
// one that is refused.
//
// Every tensor lives in storage that holds exactly the elements its view addresses, so an access
// outside the view is an AddressSanitizer report; outputs are poisoned (NaN) first, results are
// compared with an fp64 reference, and storage the view does not address must stay poisoned.
// GMOE_PROPERTY_ITERATIONS=N runs more (default 400, a few seconds under the sanitizers);
// GMOE_TEST_SEED=S replays a run.
#include <gtest/gtest.h>

#include <cmath>
#include <algorithm>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>
#include <typeinfo>
#include <vector>

#include "common/harness.h"
#include "common/tolerance.h"
#include "gmoe/activation.h"
#include "gmoe/error.h"
#include "gmoe/fp8.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_gemm.h"

namespace gmoe::test {
namespace {

constexpr int64_t kI64Max = std::numeric_limits<int64_t>::max();

// What a tensor argument should look like; materialized into exact-size storage by Arg.
struct Spec {
  DType dtype = DType::f32;
  std::vector<int64_t> shape, strides;  // strides empty: contiguous
  bool null_data = false;               // data == nullptr whatever the shape
  std::vector<int64_t> values;          // integer tensors (counts, mask): the exact values
};

Spec contiguous(DType t, std::vector<int64_t> shape) {
  Spec s;
  s.dtype = t;
  s.shape = std::move(shape);
  return s;
}

// Storage holding exactly the elements a view addresses, and the view.
struct Arg {
  HostTensor storage;  // flat
  TensorView view;
  int64_t base = 0;     // storage index of view.data
  bool addressable = false;

  explicit Arg(const Spec& s) {
    view.dtype = s.dtype;
    view.device = Device::cpu();
    view.ndim = static_cast<int>(s.shape.size());
    std::vector<int64_t> st = s.strides;
    if (st.empty()) {  // contiguous, computed without trusting the sizes
      st.assign(s.shape.size(), 1);
      for (int d = view.ndim - 2; d >= 0; --d) {
        if (__builtin_mul_overflow(st[d + 1], std::max<int64_t>(s.shape[d + 1], 1), &st[d])) st[d] = 1;
      }
    }
    for (int d = 0; d < view.ndim; ++d) {
      view.shape[d] = s.shape[d];
      view.strides[d] = st[d];
    }
    // The range of offsets the view addresses, when it has elements and sane sizes.
    bool empty = false, sane = true;
    __int128 lo = 0, hi = 0;
    for (int d = 0; d < view.ndim; ++d) {
      if (s.shape[d] < 0) sane = false;
      if (s.shape[d] == 0) empty = true;
      if (s.shape[d] > 0) {
        const __int128 span = static_cast<__int128>(s.shape[d] - 1) * st[d];
        (span < 0 ? lo : hi) += span;
      }
    }
    if (s.null_data || !sane) return;
    if (empty) {
      view.data = nullptr;
      return;
    }
    if (hi - lo + 1 > (__int128{1} << 22)) return;  // not allocatable: data stays null
    storage = HostTensor(s.dtype, {static_cast<int64_t>(hi - lo + 1)});
    base = static_cast<int64_t>(-lo);
    view.data = static_cast<char*>(storage.data()) + base * static_cast<int64_t>(dtype_size(s.dtype));
    addressable = true;
    if (!s.values.empty()) {
      for (size_t i = 0; i < s.values.size() && static_cast<int64_t>(i) < s.shape[0]; ++i) {
        const int64_t at = base + static_cast<int64_t>(i) * st[0];
        if (s.dtype == DType::i64) static_cast<int64_t*>(storage.data())[at] = s.values[i];
        if (s.dtype == DType::i32) static_cast<int32_t*>(storage.data())[at] = static_cast<int32_t>(s.values[i]);
        if (s.dtype == DType::f32) static_cast<float*>(storage.data())[at] = static_cast<float>(s.values[i]);
      }
    }
  }
  // Storage index of a logical element.
  int64_t at(std::initializer_list<int64_t> idx) const {
    int64_t o = base, d = 0;
    for (int64_t i : idx) o += i * view.strides[d++];
    return o;
  }
  double get(std::initializer_list<int64_t> idx) const { return storage.get(at(idx)); }
  void set(std::initializer_list<int64_t> idx, double v) { storage.set(at(idx), v); }
};

// One generated call: the specs of its arguments, how to run it, and how to check its result.
struct Problem {
  DType dt = DType::f32;
  int64_t E = 1, N = 1, K = 1, capacity = 0;
  std::vector<int64_t> counts;
  DType counts_dtype = DType::i32;
  bool stacked = true;
};

int64_t total_of(const Problem& p) {
  int64_t t = 0;
  for (int64_t c : p.counts) t += c;
  return t;
}

std::vector<int64_t> offsets_of(const Problem& p) {
  std::vector<int64_t> off{0};
  for (int64_t c : p.counts) off.push_back(off.back() + c);
  return off;
}

class ApiProperties : public ::testing::Test {
 protected:
  Rng rng;
  int64_t pick(int64_t lo, int64_t hi) { return rng.integer(lo, hi); }
  bool coin(int one_in) { return rng.integer(0, one_in - 1) == 0; }

  Problem random_problem() {
    Problem p;
    const DType dts[] = {DType::f32, DType::bf16, DType::f16};
    p.dt = dts[pick(0, 2)];
    p.E = pick(1, 5);
    p.N = coin(8) ? 0 : pick(1, 24);
    p.K = coin(8) ? 0 : pick(1, 24);
    for (int64_t e = 0; e < p.E; ++e) p.counts.push_back(coin(4) ? 0 : pick(0, 9));
    p.capacity = total_of(p) + (coin(2) ? 0 : pick(0, 5));
    p.counts_dtype = coin(2) ? DType::i32 : DType::i64;
    p.stacked = !coin(3);
    return p;
  }

  // A valid 2-D rows spec, sometimes with padded rows.
  Spec rows(DType t, int64_t r, int64_t c) {
    Spec s = contiguous(t, {r, c});
    if (coin(3)) s.strides = {c + pick(1, 5), 1};
    return s;
  }

  void fill(Arg& a) {
    if (!a.addressable || a.storage.numel() == 0) return;
    if (a.view.dtype == DType::i32 || a.view.dtype == DType::i64) return;
    if (dtype_size(a.view.dtype) == 1) {  // fp8 (a hostile dtype): any bytes
      for (uint8_t& b : a.storage.bytes()) b = static_cast<uint8_t>(rng.integer(0, 255));
      return;
    }
    fill_random(a.storage, rng);
  }
};

// The hostile changes a call can get; each must make the call throw gmoe::Error.
enum class Hostile {
  none, null_data, huge_shape, negative_size, column_stride, overlapping_rows, wrong_dtype,
  wrong_cols, negative_count, overflowing_counts, counts_past_capacity, counts_dtype,
  counts_length, counts_2d, mask_without_data, count
};
const char* hostile_name(Hostile h) {
  static const char* names[] = {"none", "null_data", "huge_shape", "negative_size", "column_stride",
                                "overlapping_rows", "wrong_dtype", "wrong_cols", "negative_count",
                                "overflowing_counts", "counts_past_capacity", "counts_dtype",
                                "counts_length", "counts_2d", "mask_without_data"};
  return names[static_cast<int>(h)];
}

// Applies `h` to `target` (a 2-D rows spec) or to the counts; false when it does not apply.
bool apply(Hostile h, Spec& target, Spec& counts, const Problem& p, Rng& rng) {
  const int64_t r = target.shape[0], c = target.shape[1];
  switch (h) {
    case Hostile::none: return true;
    case Hostile::null_data:
      if (r == 0 || c == 0) return false;
      target.null_data = true;
      return true;
    case Hostile::huge_shape:
      target.shape = {int64_t{1} << 32, int64_t{1} << 33};
      target.strides = {int64_t{1} << 33, 1};
      target.null_data = true;
      return true;
    case Hostile::negative_size:
      target.shape[0] = -1 - rng.integer(0, 3);
      target.strides = {std::max<int64_t>(c, 1), 1};
      return true;
    case Hostile::column_stride:
      if (r == 0 || c < 2) return false;
      target.strides = {2 * c, 2};
      return true;
    case Hostile::overlapping_rows:
      if (r < 2 || c < 2) return false;
      target.strides = {c - 1, 1};
      return true;
    case Hostile::wrong_dtype:
      target.dtype = DType::e4m3;  // no rows argument of these ops takes an fp8 dtype
      return true;
    case Hostile::wrong_cols:
      target.shape[1] = c + 1;
      target.strides.clear();
      return true;
    case Hostile::negative_count:
      counts.values[static_cast<size_t>(rng.integer(0, p.E - 1))] = -rng.integer(1, 1 << 20);
      return true;
    case Hostile::overflowing_counts:
      if (counts.dtype != DType::i64) return false;
      counts.values[static_cast<size_t>(rng.integer(0, p.E - 1))] = kI64Max - rng.integer(0, 3);
      return true;
    case Hostile::counts_past_capacity:
      counts.values.back() += p.capacity - total_of(p) + rng.integer(1, 1000);
      return true;
    case Hostile::counts_dtype:
      counts.dtype = DType::f32;
      return true;
    case Hostile::counts_length:
      counts.shape[0] += 1;
      counts.values.push_back(0);
      return true;
    case Hostile::counts_2d:
      counts.shape = {1, counts.shape[0]};
      return true;
    case Hostile::mask_without_data: return true;  // applied by the wgrad call
    case Hostile::count: return false;
  }
  return false;
}

// Storage elements the view does not address must still be poisoned (NaN).
::testing::AssertionResult untouched_outside(const Arg& a, const std::vector<int64_t>& addressed) {
  if (!a.addressable) return ::testing::AssertionSuccess();
  std::vector<bool> in(static_cast<size_t>(a.storage.numel()), false);
  for (int64_t i : addressed) in[static_cast<size_t>(i)] = true;
  for (int64_t i = 0; i < a.storage.numel(); ++i) {
    if (!in[static_cast<size_t>(i)] && !std::isnan(a.storage.get(i))) {
      return ::testing::AssertionFailure() << "storage element " << i << " outside the view was written";
    }
  }
  return ::testing::AssertionSuccess();
}

enum class Op { fprop, fprop_bias, dgrad, wgrad, bias_add, bias_grad, activation_forward, quantize, count };
const char* op_name(Op o) {
  static const char* names[] = {"grouped_gemm_fprop", "grouped_gemm_fprop+bias", "grouped_gemm_dgrad",
                                "grouped_gemm_wgrad", "grouped_bias_add", "grouped_bias_grad",
                                "grouped_activation_forward", "quantize_grouped"};
  return names[static_cast<int>(o)];
}

TEST_F(ApiProperties, EveryOpGivesTheRightResultOrAnError) {
  int iterations = 400;
  if (const char* s = std::getenv("GMOE_PROPERTY_ITERATIONS")) iterations = std::atoi(s);
  int accepted = 0, refused = 0;
  for (int it = 0; it < iterations; ++it) {
    Problem p = random_problem();
    const Op op = static_cast<Op>(pick(0, static_cast<int>(Op::count) - 1));
    Hostile h = coin(3) ? Hostile::none : static_cast<Hostile>(pick(1, static_cast<int>(Hostile::count) - 1));
    // Which rows argument the change hits: the op's input or its output (where it has both).
    const bool uses_in = op != Op::bias_add && op != Op::bias_grad;
    const bool uses_out = op != Op::quantize;
    const bool hit_output = uses_out && (!uses_in || coin(2));
    if (op == Op::quantize && h == Hostile::wrong_cols) h = Hostile::none;  // any width is valid
    if (h == Hostile::mask_without_data && op != Op::wgrad) h = Hostile::none;
    // Without weights or biases, the counts alone say how many experts there are.
    if (h == Hostile::counts_length && (op == Op::quantize || op == Op::activation_forward)) h = Hostile::none;

    Spec counts;
    counts.dtype = p.counts_dtype;
    counts.shape = {p.E};
    counts.values = p.counts;
    // The rows arguments of each op: in [capacity, in_cols], out [capacity, out_cols].
    int64_t in_cols = p.K, out_cols = p.N;
    if (op == Op::dgrad) std::swap(in_cols, out_cols);
    if (op == Op::bias_add || op == Op::bias_grad) in_cols = out_cols = p.N;
    const int64_t F = std::max<int64_t>(1, p.N / 2);
    if (op == Op::activation_forward) {
      in_cols = 2 * F;
      out_cols = F;
    }
    if (op == Op::quantize) in_cols = out_cols = 128 * pick(1, 2);  // whole 1x128 blocks
    Spec in = rows(p.dt, p.capacity, in_cols), out = rows(p.dt, p.capacity, out_cols);
    if (op == Op::wgrad) out = rows(p.dt, p.capacity, p.N);  // dy
    Spec& target = hit_output ? out : in;
    if (!apply(h, target, counts, p, rng)) h = Hostile::none;
    SCOPED_TRACE(std::string(op_name(op)) + " " + dtype_name(p.dt) + " hostile=" + hostile_name(h) +
                 (hit_output ? " (output)" : " (input)") + " E=" + std::to_string(p.E) + " N=" +
                 std::to_string(p.N) + " K=" + std::to_string(p.K) + " capacity=" +
                 std::to_string(p.capacity) + " counts=" + ::testing::PrintToString(p.counts) +
                 " iteration " + std::to_string(it));
    if (h == Hostile::none) {  // the spec may have been touched by a change that did not apply
      in = rows(p.dt, p.capacity, in_cols);
      out = op == Op::wgrad ? rows(p.dt, p.capacity, p.N) : rows(p.dt, p.capacity, out_cols);
      counts = Spec();
      counts.dtype = p.counts_dtype;
      counts.shape = {p.E};
      counts.values = p.counts;
    }

    SCOPED_TRACE("counts given: " + ::testing::PrintToString(counts.values));
    Arg a_in(in), a_out(out), a_counts(counts);
    fill(a_in);
    fill(a_out);
    // Weights [E, N, K] (stacked or listed), biases [E, N] f32 or the rows' dtype.
    const DType wdt = p.dt;
    Arg w(contiguous(wdt, {p.E, p.N, p.K}));
    fill(w);
    std::vector<TensorView> w_list;
    for (int64_t e = 0; e < p.E; ++e) w_list.push_back(w.view.select0(e));
    const ExpertWeights weights = p.stacked ? ExpertWeights::from_stacked(w.view) : ExpertWeights::from_list(w_list);
    Arg bias(contiguous(coin(2) ? DType::f32 : p.dt, {p.E, p.N}));
    fill(bias);
    Arg dw(contiguous(DType::f32, {p.E, p.N, p.K}));
    if (dw.addressable) poison(dw.storage);
    const bool out_is_output = op != Op::wgrad && op != Op::bias_grad && op != Op::quantize;
    if (out_is_output && op != Op::bias_add && a_out.addressable) {
      if (dtype_size(a_out.view.dtype) == 1) {  // fp8 (a hostile dtype): poison bytes
        std::fill(a_out.storage.bytes().begin(), a_out.storage.bytes().end(), uint8_t{0x7f});
      } else {
        poison(a_out.storage);
      }
    }
    const HostTensor out_before = a_out.storage;

    bool threw = false;
    try {
      switch (op) {
        case Op::fprop: grouped_gemm_fprop(a_in.view, weights, a_counts.view, a_out.view); break;
        case Op::fprop_bias:
          grouped_gemm_fprop(a_in.view, weights, ExpertBias::from_grouped(bias.view), a_counts.view, a_out.view);
          break;
        case Op::dgrad: grouped_gemm_dgrad(a_in.view, weights, a_counts.view, a_out.view); break;
        case Op::wgrad: {
          WgradOptions wo;
          if (h == Hostile::mask_without_data) wo.expert_mask = TensorView(nullptr, DType::i32, Device::cpu(), {p.E});
          grouped_gemm_wgrad(a_out.view, a_in.view, a_counts.view, ExpertWeights::from_stacked(dw.view), wo);
          break;
        }
        case Op::bias_add: grouped_bias_add(a_out.view, ExpertBias::from_grouped(bias.view), a_counts.view); break;
        case Op::bias_grad:
          if (bias.addressable) poison(bias.storage);
          grouped_bias_grad(a_out.view, a_counts.view, ExpertBias::from_grouped(bias.view));
          break;
        case Op::activation_forward:
          grouped_activation_forward(a_in.view, a_counts.view, a_out.view, ActivationOptions{});
          break;
        case Op::quantize: {
          GroupedRows x{a_in.view, a_counts.view};
          Fp8QuantizeOptions qo;
          qo.recipe = Fp8Recipe::blockwise;
          const Fp8GroupedTensor q = quantize_grouped(x, qo);
          HostTensor back(DType::f32, {p.capacity, in_cols});
          dequantize_grouped(q.q, a_counts.view, back.view());
          // fp8 keeps about 3 significant bits: each value within 1/8 of the block's largest.
          for (int64_t r = 0; r < total_of(p); ++r) {
            for (int64_t c0 = 0; c0 < in_cols; c0 += 128) {
              double amax = 0;
              for (int64_t c = c0; c < c0 + 128; ++c) amax = std::max(amax, std::fabs(a_in.get({r, c})));
              for (int64_t c = c0; c < c0 + 128; ++c) {
                ASSERT_LE(std::fabs(back.get(r * in_cols + c) - a_in.get({r, c})), amax / 8 + 1e-30)
                    << "row " << r << " col " << c;
              }
            }
          }
          break;
        }
        case Op::count: break;
      }
    } catch (const Error&) {
      threw = true;
    } catch (const std::exception& e) {
      FAIL() << "threw " << typeid(e).name() << " (not gmoe::Error): " << e.what();
    }
    if (h != Hostile::none) {
      EXPECT_TRUE(threw) << "a hostile call was accepted";
      if (threw && out_is_output && a_out.addressable) {
        ASSERT_TRUE(out_before.bytes() == a_out.storage.bytes()) << "a refused call wrote its output";
      }
      refused += threw;
      continue;
    }
    ASSERT_FALSE(threw) << "a valid call was refused";
    ++accepted;

    // The fp64 reference on the same rounded inputs.
    const std::vector<int64_t> off = offsets_of(p);
    auto expert_of = [&](int64_t r) {
      for (int64_t e = 0; e < p.E; ++e) {
        if (r < off[static_cast<size_t>(e) + 1]) return e;
      }
      return p.E;
    };
    std::vector<int64_t> addressed;
    switch (op) {
      case Op::fprop:
      case Op::fprop_bias:
      case Op::dgrad:
      case Op::activation_forward:
      case Op::bias_add: {
        // exact: fp64; own: the same formula in f32 rounded to the output dtype (common/tolerance.h).
        const int64_t red = op == Op::dgrad ? p.N : op == Op::bias_add || op == Op::activation_forward ? 1 : p.K;
        const bool one_rounding = p.dt == DType::bf16 && bias.view.dtype == DType::bf16;  // the bias epilogue
        std::vector<double> got, exact, own;
        for (int64_t r = 0; r < p.capacity; ++r) {
          const int64_t e = expert_of(r);
          for (int64_t c = 0; c < out_cols; ++c) {
            double x = 0;
            float o = 0;
            if (op == Op::bias_add) {
              const double a = out_before.get(a_out.at({r, c})), b = e < p.E ? bias.get({e, c}) : 0.0;
              x = a + b;
              o = static_cast<float>(a) + static_cast<float>(b);
            } else if (e < p.E && op == Op::activation_forward) {
              const double g = a_in.get({r, c}), u = a_in.get({r, F + c});
              x = g / (1 + std::exp(-g)) * u;
              const float gf = static_cast<float>(g);
              o = gf * (1.0f / (1.0f + std::exp(-gf))) * static_cast<float>(u);
            } else if (e < p.E) {
              for (int64_t k = 0; k < red; ++k) {
                const double wv = op == Op::dgrad ? w.get({e, k, c}) : w.get({e, c, k});
                x += a_in.get({r, k}) * wv;
                o += static_cast<float>(a_in.get({r, k})) * static_cast<float>(wv);
              }
              if (op == Op::fprop_bias) {
                const double b = bias.get({e, c});
                x += b;
                o = one_rounding ? o + static_cast<float>(b)
                                 : static_cast<float>(rounded({o}, p.dt)[0]) + static_cast<float>(b);
              }
            }
            got.push_back(a_out.get({r, c}));
            exact.push_back(x);
            own.push_back(o);
            addressed.push_back(a_out.at({r, c}));
          }
        }
        ASSERT_TRUE(within_rule(got, rounded(own, p.dt), exact, Precision{p.dt, red}, op_name(op)));
        if (op != Op::bias_add) {
          ASSERT_TRUE(untouched_outside(a_out, addressed));
        }
        break;
      }
      case Op::wgrad:
      case Op::bias_grad: {
        // dW[e, n, k] = Σ_r dy[r, n]·x[r, k] (f32), dbias[e, n] = Σ_r dy[r, n]: sums over expert e's rows.
        const bool is_wgrad = op == Op::wgrad;
        const DType out = is_wgrad ? DType::f32 : bias.view.dtype;
        const int64_t kk = is_wgrad ? p.K : 1;
        int64_t red = 1;
        std::vector<double> got, exact, own;
        for (int64_t e = 0; e < p.E; ++e) {
          red = std::max(red, p.counts[static_cast<size_t>(e)]);
          for (int64_t n = 0; n < p.N; ++n) {
            for (int64_t k = 0; k < kk; ++k) {
              double x = 0;
              float o = 0;
              for (int64_t r = off[static_cast<size_t>(e)]; r < off[static_cast<size_t>(e) + 1]; ++r) {
                const double a = a_out.get({r, n}), b = is_wgrad ? a_in.get({r, k}) : 1.0;
                x += a * b;
                o += static_cast<float>(a) * static_cast<float>(b);
              }
              got.push_back(is_wgrad ? dw.get({e, n, k}) : bias.get({e, n}));
              exact.push_back(x);
              own.push_back(o);
            }
          }
        }
        ASSERT_TRUE(within_rule(got, rounded(own, out), exact, Precision{out, red}, op_name(op)));
        break;
      }
      case Op::quantize:
      case Op::count: break;
    }
  }
  std::printf("[ properties ] %d calls: %d valid (checked against fp64), %d hostile (refused)\n", iterations,
              accepted, refused);
  EXPECT_GT(accepted, 0);
  EXPECT_GT(refused, 0);
}

}  // namespace
}  // namespace gmoe::test
