// tests/common/harness.cpp — implementation of the shared test harness.
#include "common/harness.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <sstream>
#include <utility>

#include "common/float_convert.h"
#include "gmoe/error.h"

namespace gmoe::test {

uint64_t test_seed() {
  if (const char* env = std::getenv("GMOE_TEST_SEED")) return std::strtoull(env, nullptr, 10);
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

Rng::Rng(uint64_t seed)
    : seed_(seed),
      engine_(seed),
      trace_(__FILE__, __LINE__, "random seed " + std::to_string(seed) +
                                     " (replay with GMOE_TEST_SEED=" + std::to_string(seed) + ")") {}

// ---------------------------------------------------------------------------------------------

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape)
    : dtype_(dtype), shape_(std::move(shape)) {
  bytes_.resize(static_cast<size_t>(numel()) * dtype_size(dtype_));
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

TensorView contiguous_view(void* data, DType dtype, Device device, const std::vector<int64_t>& shape) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.device = device;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  return v;
}

TensorView HostTensor::view() const {
  void* data = bytes_.empty() ? nullptr : const_cast<uint8_t*>(bytes_.data());
  return contiguous_view(data, dtype_, Device::cpu(), shape_);
}

double HostTensor::get(int64_t i) const {
  switch (dtype_) {
    case DType::i32: return reinterpret_cast<const int32_t*>(bytes_.data())[i];
    case DType::i64: return static_cast<double>(reinterpret_cast<const int64_t*>(bytes_.data())[i]);
    default: return load_float(bytes_.data(), dtype_, i);
  }
}

void HostTensor::set(int64_t i, double v) {
  switch (dtype_) {
    case DType::i32: reinterpret_cast<int32_t*>(bytes_.data())[i] = static_cast<int32_t>(v); return;
    case DType::i64: reinterpret_cast<int64_t*>(bytes_.data())[i] = static_cast<int64_t>(v); return;
    default: store_float(bytes_.data(), dtype_, i, static_cast<float>(v));
  }
}

std::vector<double> HostTensor::to_double() const {
  std::vector<double> out(static_cast<size_t>(numel()));
  for (int64_t i = 0; i < numel(); ++i) out[i] = get(i);
  return out;
}

void fill_random(HostTensor& t, Rng& rng, double lo, double hi) {
  std::uniform_real_distribution<float> dist(static_cast<float>(lo), static_cast<float>(hi));
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, dist(rng.engine()));
}

void poison(HostTensor& t) {
  if (t.dtype() == DType::i32 || t.dtype() == DType::i64) {
    std::fill(t.bytes().begin(), t.bytes().end(), uint8_t{0x5a});
    return;
  }
  for (int64_t i = 0; i < t.numel(); ++i) t.set(i, std::numeric_limits<double>::quiet_NaN());
}

HostTensor make_counts(const std::vector<int64_t>& counts, DType dtype) {
  HostTensor t(dtype, {static_cast<int64_t>(counts.size())});
  for (size_t e = 0; e < counts.size(); ++e) t.set(static_cast<int64_t>(e), static_cast<double>(counts[e]));
  return t;
}

// ---------------------------------------------------------------------------------------------

int64_t ShapeCase::total() const { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }

ShapeCase fixed_case(const std::string& name, int64_t N, int64_t K, std::vector<int64_t> counts, int64_t slack) {
  ShapeCase c;
  c.name = name;
  c.E = static_cast<int64_t>(counts.size());
  c.N = N;
  c.K = K;
  c.counts = std::move(counts);
  c.capacity = c.total() + slack;
  return c;
}

const std::vector<std::string>& named_case_names() {
  static const std::vector<std::string> kNames = {
      "uniform", "skewed", "one_expert", "all_empty", "zero_total", "ragged",
      "dim192",  "dim1408", "dim2880",   "e1",        "e128",       "e256"};
  return kNames;
}

std::vector<int64_t> zipf_counts(int64_t E, int64_t total, double s, int64_t empty_every, Rng& rng) {
  std::vector<int64_t> order(static_cast<size_t>(E));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), rng.engine());
  const int64_t n_empty = E >= 2 ? std::max<int64_t>(1, E / empty_every) : 0;
  std::vector<double> weight(static_cast<size_t>(E), 0.0);
  for (int64_t rank = 0; rank < E - n_empty; ++rank) weight[order[rank]] = 1.0 / std::pow(rank + 1.0, s);
  const double sum = std::accumulate(weight.begin(), weight.end(), 0.0);
  std::vector<int64_t> counts(static_cast<size_t>(E), 0);
  int64_t assigned = 0;
  for (int64_t e = 0; e < E; ++e) {
    counts[e] = static_cast<int64_t>(std::floor(total * weight[e] / sum));
    assigned += counts[e];
  }
  for (int64_t i = 0; assigned < total; ++i, ++assigned) ++counts[order[i % (E - n_empty)]];
  return counts;
}

ShapeCase make_case(const std::string& name, Rng& rng, CaseScale scale) {
  const bool large = scale == CaseScale::kLarge;
  ShapeCase c;
  c.name = name;
  c.E = 8;
  c.N = large ? 512 : 64;
  c.K = large ? 384 : 96;
  const int64_t per = large ? 256 : 24;
  auto uniform_counts = [&](int64_t E, int64_t each) { return std::vector<int64_t>(E, each); };
  if (name == "uniform") {
    c.counts = uniform_counts(c.E, per);
  } else if (name == "skewed") {
    c.counts = zipf_counts(c.E, c.E * per + rng.integer(0, 7), 1.1, 4, rng);
  } else if (name == "one_expert") {
    c.counts = uniform_counts(c.E, 0);
    c.counts[rng.integer(0, c.E - 1)] = c.E * per + rng.integer(1, 9);
  } else if (name == "all_empty") {
    c.counts = uniform_counts(c.E, 0);
  } else if (name == "zero_total") {
    c.counts = uniform_counts(c.E, 0);
    c.capacity = 0;
    return c;
  } else if (name == "ragged") {
    // Counts straddling multiples of 8, 16 and 128 rows (tile edges), in random order.
    c.counts = {1, 7, 9, 15, 17, 31, 127, 129};
    if (!large) c.counts = {1, 7, 9, 15, 17, 31, 33, 47};
    std::shuffle(c.counts.begin(), c.counts.end(), rng.engine());
  } else if (name == "dim192" || name == "dim1408" || name == "dim2880") {
    const int64_t d = std::stoll(name.substr(3));
    c.E = 4;
    c.N = d;
    c.K = name == "dim192" ? 2880 : 192;  // both the N and the K sides see an odd size
    c.counts = zipf_counts(c.E, large ? 1000 : 40, 1.1, 4, rng);
  } else if (name == "e1") {
    c.E = 1;
    c.counts = {large ? 1000 : 37};
  } else if (name == "e128" || name == "e256") {
    c.E = name == "e128" ? 128 : 256;
    c.N = large ? 256 : 32;
    c.K = large ? 256 : 64;
    c.counts = zipf_counts(c.E, c.E * (large ? 40 : 3), 1.1, 16, rng);
  } else {
    GMOE_FAIL("unknown shape case '", name, "'");
  }
  // Slack rows past the total on most cases: outputs there must be written as zeros.
  c.capacity = c.total() + (name == "uniform" ? 0 : rng.integer(1, 13));
  return c;
}

std::vector<std::vector<int64_t>> graph_routings(int64_t E, int64_t per, int64_t slack, Rng& rng) {
  const int64_t cap = E * per + slack;
  std::vector<int64_t> one(static_cast<size_t>(E), 0);
  one[static_cast<size_t>(rng.integer(0, E - 1))] = cap;
  return {std::vector<int64_t>(static_cast<size_t>(E), per), zipf_counts(E, cap - slack, 1.1, 4, rng), one,
          std::vector<int64_t>(static_cast<size_t>(E), 0)};
}

ShapeCase graph_case(int64_t E, int64_t N, int64_t K, int64_t per, int64_t slack) {
  return fixed_case("graph", N, K, std::vector<int64_t>(static_cast<size_t>(E), per), slack);
}

// ---------------------------------------------------------------------------------------------

::testing::AssertionResult doubled_exactly(const std::vector<double>& once, const std::vector<double>& twice,
                                           const std::string& what) {
  if (once.size() != twice.size()) return ::testing::AssertionFailure() << what << ": sizes differ";
  for (size_t i = 0; i < once.size(); ++i) {
    if (!(twice[i] == 2.0 * once[i])) {
      return ::testing::AssertionFailure() << what << ": element " << i << " is " << twice[i]
                                           << " after accumulating " << once[i] << " onto itself";
    }
  }
  return ::testing::AssertionSuccess();
}

::testing::AssertionResult bitwise_equal(const HostTensor& a, const HostTensor& b,
                                         const std::string& what) {
  if (a.bytes().size() != b.bytes().size()) {
    return ::testing::AssertionFailure() << what << ": sizes differ";
  }
  for (size_t i = 0; i < a.bytes().size(); ++i) {
    if (a.bytes()[i] != b.bytes()[i]) {
      const size_t el = i / dtype_size(a.dtype());
      return ::testing::AssertionFailure() << what << ": first difference at element " << el << " ("
                                           << a.get(el) << " vs " << b.get(el) << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

// ---------------------------------------------------------------------------------------------

namespace {

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> off(counts.size() + 1, 0);
  for (size_t e = 0; e < counts.size(); ++e) off[e + 1] = off[e] + counts[e];
  return off;
}

}  // namespace

ExactResult exact_fprop(const HostTensor& x, const std::vector<HostTensor>& w,
                        const std::vector<int64_t>& counts) {
  const int64_t cap = x.shape()[0], K = x.shape()[1], N = w[0].shape()[0];
  const std::vector<int64_t> off = offsets_of(counts);
  const std::vector<double> xd = x.to_double();
  ExactResult r;
  r.value.assign(static_cast<size_t>(cap * N), 0.0);
  r.abs_sum.assign(r.value.size(), 0.0);
  r.f32.assign(r.value.size(), 0.0);
  r.reduction = K;
  for (size_t e = 0; e < counts.size(); ++e) {
    const std::vector<double> wd = w[e].to_double();
#pragma omp parallel for schedule(static)
    for (int64_t row = off[e]; row < off[e + 1]; ++row) {
      for (int64_t n = 0; n < N; ++n) {
        double s = 0, a = 0;
        float s32 = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double p = xd[row * K + k] * wd[n * K + k];
          s += p;
          a += std::abs(p);
          s32 += static_cast<float>(xd[row * K + k]) * static_cast<float>(wd[n * K + k]);
        }
        r.value[row * N + n] = s;
        r.abs_sum[row * N + n] = a;
        r.f32[row * N + n] = s32;
      }
    }
  }
  return r;
}

ExactResult exact_dgrad(const HostTensor& dy, const std::vector<HostTensor>& w,
                        const std::vector<int64_t>& counts) {
  const int64_t cap = dy.shape()[0], N = dy.shape()[1], K = w[0].shape()[1];
  const std::vector<int64_t> off = offsets_of(counts);
  const std::vector<double> dyd = dy.to_double();
  ExactResult r;
  r.value.assign(static_cast<size_t>(cap * K), 0.0);
  r.abs_sum.assign(r.value.size(), 0.0);
  r.reduction = N;
  std::vector<float> s32(r.value.size(), 0.0f);
  for (size_t e = 0; e < counts.size(); ++e) {
    const std::vector<double> wd = w[e].to_double();
#pragma omp parallel for schedule(static)
    for (int64_t row = off[e]; row < off[e + 1]; ++row) {  // each row writes only its own outputs
      for (int64_t n = 0; n < N; ++n) {
        const double g = dyd[row * N + n];
        for (int64_t k = 0; k < K; ++k) {
          r.value[row * K + k] += g * wd[n * K + k];
          r.abs_sum[row * K + k] += std::abs(g * wd[n * K + k]);
          s32[row * K + k] += static_cast<float>(g) * static_cast<float>(wd[n * K + k]);
        }
      }
    }
  }
  r.f32.assign(s32.begin(), s32.end());
  return r;
}

ExactResult exact_wgrad(const HostTensor& dy, const HostTensor& x, const std::vector<int64_t>& counts,
                        const std::vector<double>* init, const std::vector<int32_t>* mask) {
  const int64_t N = dy.shape()[1], K = x.shape()[1];
  const int64_t E = static_cast<int64_t>(counts.size());
  const std::vector<int64_t> off = offsets_of(counts);
  const std::vector<double> dyd = dy.to_double(), xd = x.to_double();
  ExactResult r;
  r.value.assign(static_cast<size_t>(E * N * K), 0.0);
  r.abs_sum.assign(r.value.size(), 0.0);
  r.f32.assign(r.value.size(), 0.0);
  r.reduction = 0;
  std::vector<float> s32;
  for (int64_t e = 0; e < E; ++e) {
    r.reduction = std::max(r.reduction, counts[e]);
    double* v = &r.value[e * N * K];
    double* a = &r.abs_sum[e * N * K];
    const bool skip = mask != nullptr && (*mask)[e] == 0;
    if (init != nullptr) {
      for (int64_t i = 0; i < N * K; ++i) {
        v[i] = (*init)[e * N * K + i];
        a[i] = std::abs(v[i]);
      }
    }
    // The f32 reference sums the products, then adds the sum onto init once.
    s32.assign(static_cast<size_t>(N * K), 0.0f);
    if (!skip) {
      // Each n owns one output row; the sum over the expert's rows keeps its order.
#pragma omp parallel for schedule(static)
      for (int64_t n = 0; n < N; ++n) {
        for (int64_t row = off[e]; row < off[e + 1]; ++row) {
          const double g = dyd[row * N + n];
          for (int64_t k = 0; k < K; ++k) {
            v[n * K + k] += g * xd[row * K + k];
            a[n * K + k] += std::abs(g * xd[row * K + k]);
            s32[n * K + k] += static_cast<float>(g) * static_cast<float>(xd[row * K + k]);
          }
        }
      }
    }
    for (int64_t i = 0; i < N * K; ++i) {
      const float base = init != nullptr ? static_cast<float>((*init)[e * N * K + i]) : 0.0f;
      r.f32[e * N * K + i] = skip ? base : base + s32[i];
    }
  }
  return r;
}

void add_bias(ExactResult& exact, const HostTensor& bias, const std::vector<int64_t>& counts, DType out,
              bool one_rounding) {
  const int64_t N = bias.shape()[1];
  const std::vector<double> gemm_rounded = rounded(exact.f32, out);
  int64_t row = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    for (int64_t r = 0; r < counts[e]; ++r, ++row) {
      for (int64_t n = 0; n < N; ++n) {
        const int64_t i = row * N + n;
        const float b = static_cast<float>(bias.get(static_cast<int64_t>(e) * N + n));
        exact.value[i] += b;
        exact.abs_sum[i] += std::abs(b);
        exact.f32[i] = (one_rounding ? static_cast<float>(exact.f32[i]) : static_cast<float>(gemm_rounded[i])) + b;
      }
    }
  }
}

ExactResult exact_bias_grad(const HostTensor& g, const std::vector<int64_t>& counts) {
  const int64_t N = g.shape()[1];
  const int64_t E = static_cast<int64_t>(counts.size());
  const std::vector<int64_t> off = offsets_of(counts);
  const std::vector<double> gd = g.to_double();
  ExactResult r;
  r.value.assign(static_cast<size_t>(E * N), 0.0);
  r.abs_sum.assign(r.value.size(), 0.0);
  std::vector<float> s32(r.value.size(), 0.0f);
  for (int64_t e = 0; e < E; ++e) {
    r.reduction = std::max(r.reduction, counts[e]);
    for (int64_t row = off[e]; row < off[e + 1]; ++row) {
      for (int64_t n = 0; n < N; ++n) {
        r.value[e * N + n] += gd[row * N + n];
        r.abs_sum[e * N + n] += std::abs(gd[row * N + n]);
        s32[e * N + n] += static_cast<float>(gd[row * N + n]);
      }
    }
  }
  r.f32.assign(s32.begin(), s32.end());
  return r;
}

}  // namespace gmoe::test
