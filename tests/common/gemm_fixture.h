// tests/common/gemm_fixture.h — the inputs of one grouped-GEMM problem on the host, built from a
// named shape case: fresh random x, dy and weights (both layouts), counts, poisoned outputs.
// CPU and CUDA suites build the same problem from it, so they test the same thing.
#pragma once

#include <string>
#include <vector>

#include "common/harness.h"
#include "common/tolerance.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/grouped_linear.h"

namespace gmoe::test {

enum class Layout { kStacked, kList };
inline const char* layout_name(Layout l) { return l == Layout::kStacked ? "stacked" : "list"; }

struct GemmProblem {
  ShapeCase shape;
  DType dtype = DType::bf16;
  HostTensor x;                 ///< [capacity, K]
  HostTensor dy;                ///< [capacity, N]
  HostTensor w_stacked;         ///< [E, N, K]
  std::vector<HostTensor> w;    ///< E × [N, K], same values as w_stacked
  HostTensor counts;            ///< [E] i32 or i64

  GemmProblem(const ShapeCase& c, DType dtype, Rng& rng, DType counts_dtype = DType::i32);
  /// Weights in a layout, as views of the host tensors above.
  ExpertWeights weights(Layout layout) const;
};

/// Biases (or bias gradients) over [E, N] storage on either device: the grouped layout (kStacked),
/// or a list of its E rows (kList).
ExpertBias expert_bias(const TensorView& storage, Layout layout);
/// The forms of biases that ops taking an ExpertBias are tested with: grouped and list, of the
/// rows' dtype and f32.
struct BiasForm {
  DType dtype;
  Layout layout;
  std::string name() const;  ///< "bf16 grouped", "f32 list", ...
};
std::vector<BiasForm> bias_forms(DType rows_dtype);

/// A bias-gradient problem: dy [capacity, cols] with fresh random values (rows past the total too,
/// which the op must not add), stored with a row stride of cols + pad.
struct BiasGradCase {
  std::string name;
  std::vector<int64_t> counts;
  int64_t capacity = 0, cols = 0, pad = 0;
  HostTensor storage;  ///< [capacity, cols + pad]
  HostTensor dy;       ///< the same rows, contiguous [capacity, cols] (for the exact sums)
  /// dy as the strided view of storage that the op reads.
  TensorView view() const;
};
/// The named cases of the bias gradient: skewed counts with empty experts and slack rows, every row
/// in one expert, zero rows, all experts empty over slack rows, odd widths (1, 3, 33, 129), 300 and
/// 1000 experts (past the list layout's by-value pointer limit of the CUDA kernel), a long expert
/// beside short ones.
std::vector<BiasGradCase> bias_grad_cases(DType dtype, Rng& rng);

/// Host storage for a weight-shaped output ([E, N, K], viewable in either layout).
struct HostExpertTensor {
  HostTensor stacked;              ///< storage when stacked
  std::vector<HostTensor> list;    ///< storage when a list
  Layout layout = Layout::kStacked;

  HostExpertTensor(Layout layout, DType dtype, int64_t E, int64_t N, int64_t K);
  ExpertWeights view() const;
  /// All experts' values, expert-major, as doubles.
  std::vector<double> to_double() const;
  void poison_all();
  /// Sets every element from expert-major values.
  void set_all(const std::vector<double>& values);
};

/// A weight gradient with two destinations (WgradOptions::masked_off == fresh, or a layer's
/// main_grad with MaskedOffWgrad::fresh): a random 0/1 expert mask (both values present when E >= 2),
/// and random finite contents for main_grad and the fresh buffer before the call, so that every
/// element the call must not touch can be checked bitwise.
struct MaskedOffDestinations {
  std::vector<int32_t> mask;       ///< [E]
  HostTensor mask_t;               ///< the same, i32 [E]
  std::vector<double> main_init;   ///< main_grad before the call, expert-major [E, N, K]
  std::vector<double> fresh_init;  ///< the fresh buffer before the call
  MaskedOffDestinations(int64_t E, int64_t N, int64_t K, Rng& rng);
};

/// main_grad in `layout` and the fresh buffer in the other one (each destination's layout is its
/// own), f32 on the host, holding d's main_init and fresh_init.
struct MaskedOffBuffers {
  HostExpertTensor main, fresh;
  MaskedOffBuffers(const MaskedOffDestinations& d, Layout layout, int64_t E, int64_t N, int64_t K);
};

/// The op's options for two destinations: mask-0 experts' dW into `fresh` (MaskedOffWgrad::fresh),
/// the others into the call's dw, accumulated or not.
WgradOptions masked_off_wgrad_options(bool accumulate, const TensorView& mask, const ExpertWeights& fresh);

/// GroupedLinear options writing the weight gradient into `main_grad` (accumulating or not, now or
/// delayed), scratch from `alloc`; with `mask` given, mask-0 experts get fresh gradients
/// (MaskedOffWgrad::fresh).
GroupedLinearOptions main_grad_options(LinearRecipe recipe, const ExpertWeights& main_grad, bool accumulate,
                                       bool delayed, Allocator* alloc, const TensorView& mask);

/// Checks every expert's destination after the call, `main` and `fresh` expert-major: mask 1 →
/// main_grad holds init + dW_e (accumulate) or dW_e (exact zeros for an empty expert; an empty
/// expert accumulated into stays bitwise init), fresh untouched (bitwise); mask 0 → main_grad
/// untouched (bitwise), fresh holds dW_e (exact zeros for an empty expert). dW_e = dyᵀ·x of the
/// expert's rows of `dy` and `x` (the operands in the precision the GEMM reads), both within the
/// tolerance rule; `own_main`/`own_fresh` (optional): the CPU backend's results for a CUDA run.
void expect_masked_off_destinations(const MaskedOffDestinations& d, const HostTensor& dy, const HostTensor& x,
                                    const std::vector<int64_t>& counts, bool accumulate,
                                    const std::vector<double>& main, const std::vector<double>& fresh,
                                    const std::vector<double>* own_main, const std::vector<double>* own_fresh,
                                    const std::string& what, Fp8Accumulation fp8 = Fp8Accumulation::kNone);

/// A layer's MaskedOffWgrad::fresh (main_grad, an expert mask), checked against `product`: every
/// expert's dW_e from the same layer run into a main_grad without a mask and without accumulating
/// (the same GEMMs, so the same values). mask 1 → main_grad = f32(init + dW_e) (accumulate) or dW_e,
/// and the fresh view untouched (bitwise `untouched`, the value the test's allocator filled memory
/// with); mask 0 → main_grad bitwise init, and the fresh view dW_e. `rel` = 0: every computed value
/// bitwise (the CPU backend); else the relative error allowed (a kernel whose epilogue may fuse
/// the accumulation's addition).
void expect_layer_masked_off(const std::vector<int32_t>& mask, bool accumulate, const std::vector<double>& main_init,
                             double untouched, const std::vector<double>& product, const std::vector<double>& main,
                             const std::vector<double>& fresh, double rel, const std::string& what);

}  // namespace gmoe::test
