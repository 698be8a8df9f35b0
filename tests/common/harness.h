// tests/common/harness.h — what every gmoe test suite shares: fresh random inputs (seed printed on
// failure), owning host tensors, output poisoning, the named shape cases, and the exact (fp64)
// grouped GEMM with its own-precision (f32) twin for the one tolerance rule of common/tolerance.h.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "common/tolerance.h"
#include "gmoe/grouped.h"
#include "gmoe/tensor.h"

namespace gmoe::test {

// ---------------------------------------------------------------------------------------------
// Randomness: a fresh seed for every test (from std::random_device), or GMOE_TEST_SEED to replay.

/// Seed for this test: GMOE_TEST_SEED if set, else fresh.
uint64_t test_seed();

/// A random generator whose seed is printed with every failure in the scope it lives in.
class Rng {
 public:
  Rng() : Rng(test_seed()) {}
  explicit Rng(uint64_t seed);
  uint64_t seed() const { return seed_; }
  std::mt19937_64& engine() { return engine_; }
  double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(engine_); }
  int64_t integer(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(engine_); }

 private:
  uint64_t seed_;
  std::mt19937_64 engine_;
  ::testing::ScopedTrace trace_;
};

// ---------------------------------------------------------------------------------------------
// Owning host tensors.

/// A contiguous (row-major) view of `shape` at `data`.
TensorView contiguous_view(void* data, DType dtype, Device device, const std::vector<int64_t>& shape);

/// A contiguous host tensor that owns its bytes; view() gives the TensorView.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<int64_t> shape);
  TensorView view() const;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int64_t numel() const;
  void* data() { return bytes_.data(); }
  const void* data() const { return bytes_.data(); }
  std::vector<uint8_t>& bytes() { return bytes_; }
  const std::vector<uint8_t>& bytes() const { return bytes_; }
  /// Element i as a double (float dtypes and integers).
  double get(int64_t i) const;
  void set(int64_t i, double v);
  std::vector<double> to_double() const;

 private:
  DType dtype_ = DType::f32;
  std::vector<int64_t> shape_;
  std::vector<uint8_t> bytes_;
};

/// Uniform values in [lo, hi), rounded to the tensor's dtype (so exact references see the same
/// numbers the kernel sees). Never zeros only: zeros hide unwritten outputs and wrong indexing.
void fill_random(HostTensor& t, Rng& rng, double lo = -1.0, double hi = 1.0);
/// Fills float tensors with NaN (integer tensors with 0x5a bytes) so unwritten elements show.
void poison(HostTensor& t);
/// Host counts tensor (i32 or i64) from values.
HostTensor make_counts(const std::vector<int64_t>& counts, DType dtype = DType::i32);

// ---------------------------------------------------------------------------------------------
// Named shape cases (DESIGN.md, "Testing and measuring").

/// A grouped-GEMM problem: E experts of [N, K], grouped rows [capacity, *] split by counts.
struct ShapeCase {
  std::string name;
  int64_t E = 0, N = 0, K = 0, capacity = 0;
  std::vector<int64_t> counts;
  int64_t total() const;
};

/// Sizes: kSmall keeps fp64 references cheap on a 2-core CPU; kLarge is for GPU suites.
enum class CaseScale { kSmall, kLarge };

/// A case with given counts (E = their number), capacity = their total + `slack` rows past it.
ShapeCase fixed_case(const std::string& name, int64_t N, int64_t K, std::vector<int64_t> counts, int64_t slack);

/// Names of the named cases, for test parameterisation: uniform, skewed (Zipf with empty experts
/// and slack rows past the total), one_expert (every token in one expert), all_empty, zero_total,
/// ragged (counts not multiples of 8/16/128), dim192, dim1408, dim2880, e1, e128, e256.
const std::vector<std::string>& named_case_names();
/// Builds a case with fresh random counts from `rng`.
ShapeCase make_case(const std::string& name, Rng& rng, CaseScale scale = CaseScale::kSmall);

/// The routings that CUDA-graph tests replay one capture under, for E experts and `per` rows each
/// (capacity E·per + slack): uniform (per each, slack rows past the total), skewed (Zipf over
/// capacity - slack, with empty experts), every token in one random expert, all experts empty.
/// graph_case() is the case of the first routing.
std::vector<std::vector<int64_t>> graph_routings(int64_t E, int64_t per, int64_t slack, Rng& rng);
ShapeCase graph_case(int64_t E, int64_t N, int64_t K, int64_t per, int64_t slack);
/// Zipf(s) counts over E experts in random order, about `empty_every`-th expert empty, summing to
/// `total` (the docs/benchmarks.md "skewed" split).
std::vector<int64_t> zipf_counts(int64_t E, int64_t total, double s, int64_t empty_every, Rng& rng);

// ---------------------------------------------------------------------------------------------
// Exact comparisons (the tolerance rule is in common/tolerance.h).

/// twice[i] == 2·once[i] exactly: a result accumulated onto itself (f32 x + x is exact), so each
/// element was added once, no more, no less.
::testing::AssertionResult doubled_exactly(const std::vector<double>& once, const std::vector<double>& twice,
                                           const std::string& what);

/// Bitwise equality of two buffers (for graph replay vs eager, delayed vs immediate).
::testing::AssertionResult bitwise_equal(const HostTensor& a, const HostTensor& b,
                                         const std::string& what);

// ---------------------------------------------------------------------------------------------
// Exact (fp64) grouped GEMM on host tensors, with the f32 sums of the own-precision reference.

/// Exact results of the three passes, per element Σ|a·b|, and the f32 sums.
struct ExactResult {
  std::vector<double> value;
  std::vector<double> abs_sum;
  std::vector<double> f32;  ///< the same sums in f32, added in order: the own-precision reference
                            ///< before the output's rounding (common/tolerance.h)
  int64_t reduction = 0;  ///< longest reduction length (K, N, or the largest count)
};
/// y[r, n] = Σ_k x[r,k]·w_e[n,k]; rows past the total are 0.
ExactResult exact_fprop(const HostTensor& x, const std::vector<HostTensor>& w,
                        const std::vector<int64_t>& counts);
/// dx[r, k] = Σ_n dy[r,n]·w_e[n,k].
ExactResult exact_dgrad(const HostTensor& dy, const std::vector<HostTensor>& w,
                        const std::vector<int64_t>& counts);
/// dw[e, n, k] = Σ_r dy[r,n]·x[r,k] (+ init when accumulating; masked experts keep init).
ExactResult exact_wgrad(const HostTensor& dy, const HostTensor& x, const std::vector<int64_t>& counts,
                        const std::vector<double>* init, const std::vector<int32_t>* mask);

/// Adds bias_e (bias: [E, N]) to exact fprop results on the rows of expert e: to the fp64 values,
/// and to the f32 sums as the op adds it, before the output's one rounding (`one_rounding`: bf16 x,
/// bias and y) or onto the sums rounded to `out` (every other combination: a second rounding).
void add_bias(ExactResult& exact, const HostTensor& bias, const std::vector<int64_t>& counts, DType out,
              bool one_rounding);

/// db[e, n] = Σ over the rows of expert e of g[row, n] (the bias gradient; 0 for an empty expert),
/// g [capacity, N] with the experts' rows in order from row 0.
ExactResult exact_bias_grad(const HostTensor& g, const std::vector<int64_t>& counts);

}  // namespace gmoe::test
