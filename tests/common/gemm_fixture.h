// tests/common/gemm_fixture.h — the inputs of one grouped-GEMM problem on the host, built from a
// named shape case: fresh random x, dy and weights (both layouts), counts, poisoned outputs.
// CPU and CUDA suites build the same problem from it, so they test the same thing.
#pragma once

#include <string>
#include <vector>

#include "common/harness.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"

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

}  // namespace gmoe::test
