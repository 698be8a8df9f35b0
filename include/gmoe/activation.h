// gmoe/activation.h — the activations of an expert MLP, applied to grouped rows.
//
// Between FC1 and FC2 of a gated expert MLP, each row r of FC1's output h (gate and up halves of
// 2F columns) becomes F columns
//   forward   z[r, j]   = act(gate[r, j], up[r, j]) · p[r]            (p: optional router probability)
//   backward  dgate     = dz · p · ∂act/∂gate,   dup = dz · p · ∂act/∂up
//             dp[r]     = Σ_j dz[r, j] · act(gate[r, j], up[r, j])     (f32, deterministic, no atomics)
// The non-gated squared ReLU maps h [capacity, F] to z [capacity, F] the same way.
//
// Activations (fp32 math on every backend, whatever the storage dtype):
//   swiglu          silu(g)·u = g·σ(g)·u
//   geglu           gelu(g)·u, gelu exact with erf (torch's default, approximate='none'); or the
//                   tanh approximation when `gelu_tanh` (torch's approximate='tanh')
//   clamped_swiglu  gpt-oss: g' = min(g, limit), u' = clamp(u, -limit, limit),
//                   g'·σ(alpha·g')·(u' + 1). Gradients follow torch autograd of clamp: a gradient
//                   flows where the value was not clamped, and AT the limit too (g <= limit,
//                   -limit <= u <= limit pass it; g > limit, |u| > limit get 0; NaN gets 0).
//   squared_relu    relu(h)² (not gated; its derivative 2·relu(h) is 0 at h = 0)
//
// Gate/up layout of h's 2F columns (GluFormat below, also the layout checkpoints name):
// concatenated ([gate | up]), or interleaved in blocks of `block` columns (gate 0..b-1, up 0..b-1,
// gate b..2b-1, ...), which keeps matching gate and up columns inside one GEMM output tile. The
// block must divide F. The CUDA kernels move 16 bytes per load when F, the block and every row
// stride are multiples of 16 bytes' worth of elements and the pointers are 16-byte aligned, and
// fall back to element loads otherwise.
//
// Rows are grouped rows (gmoe/grouped.h): rows past the real total sum(counts) get z = 0, dh = 0,
// dp = 0. The device reads the counts only to find that total (a one-block launch, clamping
// negative counts and totals past the capacity as the GEMMs do, recorded in the device error
// word); nothing reads them on the host, nothing synchronises, everything is graph-capturable.
#pragma once

#include <cstdint>
#include <string>

#include "gmoe/allocator.h"
#include "gmoe/grouped.h"
#include "gmoe/grouped_bias.h"
#include "gmoe/stream.h"
#include "gmoe/tensor.h"

namespace gmoe {

/// Gate/up layout of a GLU FC1 output dimension of 2F rows (FC1's weight rows, its bias entries, the
/// columns of its output h).
enum class GluLayout : uint8_t {
  concatenated,  ///< rows [0, F) gate, [F, 2F) up
  interleaved,   ///< blocks of `block` rows: gate 0..b-1, up 0..b-1, gate b..2b-1, up b..2b-1, ...
};

/// A gate/up layout; `block` matters only when interleaved, and must divide F.
struct GluFormat {
  GluLayout layout = GluLayout::concatenated;  ///< how gate and up alternate
  int64_t block = 1;                           ///< interleaved: rows per gate (or up) block
  /// Equal layouts (the block is compared only when interleaved).
  bool operator==(const GluFormat& o) const {
    return layout == o.layout && (layout == GluLayout::concatenated || block == o.block);
  }
  /// Different layouts.
  bool operator!=(const GluFormat& o) const { return !(*this == o); }
};

/// The activation between the two GEMMs of an expert MLP.
enum class ActivationKind : uint8_t {
  swiglu,          ///< silu(gate)·up
  geglu,           ///< gelu(gate)·up
  clamped_swiglu,  ///< gpt-oss: min(gate, limit)·σ(alpha·min(gate, limit))·(clamp(up, ±limit) + 1)
  squared_relu,    ///< relu(h)², not gated
};

/// "swiglu", "geglu", "clamped_swiglu", "squared_relu".
const char* activation_name(ActivationKind kind);
/// Parses activation_name's names; throws gmoe::Error naming the text otherwise.
ActivationKind activation_from_name(const std::string& name);
/// True for the activations that take gate and up halves.
constexpr bool is_gated(ActivationKind kind) { return kind != ActivationKind::squared_relu; }

/// What the activation computes, and how h is laid out.
struct ActivationOptions {
  ActivationKind kind = ActivationKind::swiglu;  ///< which activation
  float alpha = 1.702f;    ///< clamped_swiglu: the sigmoid's slope
  float limit = 7.0f;      ///< clamped_swiglu: the clamp (> 0)
  bool gelu_tanh = false;  ///< geglu: the tanh approximation instead of the exact erf form
  /// Gated kinds: where gate and up live among h's 2F columns (ignored by squared_relu).
  GluFormat glu{GluLayout::concatenated, 1};
};

/// Columns of h for an activation with F output columns: 2F when gated, else F.
constexpr int64_t activation_input_cols(ActivationKind kind, int64_t F) {
  return is_gated(kind) ? 2 * F : F;
}

/// z = act(h) [· probs]. h: [capacity, 2F] (gated) or [capacity, F], bf16/f16 (f32 too);
/// z: [capacity, F], h's dtype; counts: [E] i32/i64; probs: absent or f32 [capacity] (contiguous).
/// Rows past the real total: z = 0. All on one device. `alloc`: scratch (nullptr: the device's
/// default allocator). amax_out (optional, f32 [E], contiguous): each expert's largest finite |z|
/// over its rows (0 for an expert without rows), from the same pass — what a tensorwise FP8
/// quantization of z takes as Fp8QuantizeOptions::amax instead of reading z once more for it.
void grouped_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                                const ActivationOptions& options, const TensorView& probs = {},
                                Stream stream = nullptr, Allocator* alloc = nullptr,
                                const TensorView& amax_out = {});

/// The backward of grouped_activation_forward. dz: [capacity, F]; dh: h's shape; both h's dtype.
/// dh = act'(h)·dz [· probs]. Optional outputs: dprobs, f32 [capacity], the probabilities'
/// gradient Σ_j dz·act(h) (needs no probs; rows past the total get 0); z_out, [capacity, F] of h's
/// dtype, receives z = act(h) [· probs] recomputed on the way (for FC2's weight gradient when the
/// forward's z was not kept). Rows past the real total: dh = 0 (and z_out = 0). amax_out (optional,
/// f32 [E]): each expert's largest finite |dh|, as for grouped_activation_forward.
void grouped_activation_backward(const TensorView& h, const TensorView& dz,
                                 const TensorView& counts, const TensorView& dh,
                                 const ActivationOptions& options, const TensorView& probs = {},
                                 const TensorView& dprobs = {}, const TensorView& z_out = {},
                                 Stream stream = nullptr, Allocator* alloc = nullptr,
                                 const TensorView& amax_out = {});

/// Copies FC1 weights `src` into `dst` (same number of experts and shapes, dtype and device; either
/// layout each; not overlapping) re-ordering every expert's 2F rows from gate/up layout `from` to
/// `to`. CUDA tensors: stream-ordered kernels on `stream`; CPU tensors: the checkpoint module's
/// convert_glu (contiguous experts).
void convert_fc1_glu(const ExpertWeights& src, const GluFormat& from, const ExpertWeights& dst,
                     const GluFormat& to, Stream stream = nullptr);
/// The same for FC1 biases (E × [2F]).
void convert_fc1_glu(const ExpertBias& src, const GluFormat& from, const ExpertBias& dst,
                     const GluFormat& to, Stream stream = nullptr);

/// Concatenated [gate; up] → interleaved in blocks of `block` rows.
inline void fc1_to_interleaved(const ExpertWeights& src, const ExpertWeights& dst, int64_t block,
                               Stream stream = nullptr) {
  convert_fc1_glu(src, {GluLayout::concatenated, 1}, dst, {GluLayout::interleaved, block}, stream);
}
/// Interleaved in blocks of `block` rows → concatenated [gate; up].
inline void fc1_to_concatenated(const ExpertWeights& src, const ExpertWeights& dst, int64_t block,
                                Stream stream = nullptr) {
  convert_fc1_glu(src, {GluLayout::interleaved, block}, dst, {GluLayout::concatenated, 1}, stream);
}
/// FC1 biases: concatenated [gate; up] → interleaved in blocks of `block` entries.
inline void fc1_to_interleaved(const ExpertBias& src, const ExpertBias& dst, int64_t block,
                               Stream stream = nullptr) {
  convert_fc1_glu(src, {GluLayout::concatenated, 1}, dst, {GluLayout::interleaved, block}, stream);
}
/// FC1 biases: interleaved in blocks of `block` entries → concatenated [gate; up].
inline void fc1_to_concatenated(const ExpertBias& src, const ExpertBias& dst, int64_t block,
                                Stream stream = nullptr) {
  convert_fc1_glu(src, {GluLayout::interleaved, block}, dst, {GluLayout::concatenated, 1}, stream);
}

}  // namespace gmoe
