// gmoe/grouped_bias.h — per-expert biases on grouped rows: y[rows of e] += b_e, and the bias
// gradient db_e = Σ over the rows of e of dy (a deterministic grouped column reduction).
#pragma once

#include <cstdint>
#include <vector>

#include "gmoe/allocator.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Expert biases in either layout: one grouped [E, N] tensor, or a list of E vectors [N]. Both
/// absent means "no bias".
struct ExpertBias {
  TensorView grouped;            ///< [E, N], or absent
  std::vector<TensorView> list;  ///< E views of [N], or empty

  /// No bias.
  static ExpertBias none() { return {}; }
  /// The grouped layout [E, N].
  static ExpertBias from_grouped(const TensorView& grouped);
  /// The per-expert layout, E vectors [N].
  static ExpertBias from_list(std::vector<TensorView> list);

  /// False for "no bias".
  bool defined() const { return grouped.defined() || !list.empty(); }
  /// True for the grouped layout.
  bool is_grouped() const { return grouped.defined(); }
  int64_t num_experts() const;  ///< E
  int64_t size() const;         ///< N
  DType dtype() const;          ///< the biases' dtype
  Device device() const;        ///< the biases' device
  /// The [N] view of expert e.
  TensorView expert(int64_t e) const;
};

/// y[r, :] += bias_e for every row r of expert e (rows past the real total are left as they are).
/// y: [capacity, N] bf16/f16/f32; bias: E × [N] of y's dtype or f32; counts [E] i32/i64.
void grouped_bias_add(const TensorView& y, const ExpertBias& bias, const TensorView& counts,
                      Stream stream = nullptr, Allocator* alloc = nullptr);

/// dbias_e[n] = Σ over the rows r of expert e of dy[r, n], accumulated in f32 in row order
/// (deterministic, no atomics); exactly 0 for an expert with no rows. dbias: E × [N], dtype of dy
/// or f32.
void grouped_bias_grad(const TensorView& dy, const TensorView& counts, const ExpertBias& dbias,
                       Stream stream = nullptr, Allocator* alloc = nullptr);

}  // namespace gmoe
