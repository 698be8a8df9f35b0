// src/common/activation_math.h — the activation formulas, shared by the CPU and CUDA backends.
//
// One definition of each activation and its derivatives, in fp32, compiled for the host and (under
// nvcc) the device, so both backends evaluate the same expressions; the forward value is computed
// by the same code in the forward and in the backward (which recomputes it for dprobs and z), so a
// recomputed z equals the forward's bit for bit on one backend. The math functions are the
// accurate ones (expf, erff, tanhf; no fast-math intrinsics).
#pragma once

#include <math.h>

#include "gmoe/activation.h"

#ifdef __CUDACC__
#define GMOE_ACT_FN __host__ __device__ __forceinline__
#else
#define GMOE_ACT_FN inline
#endif

namespace gmoe::act {

/// The run-time parameters of an activation (options, not constants baked into kernels).
struct Params {
  float alpha = 1.702f;
  float limit = 7.0f;
  bool gelu_tanh = false;
};

/// A gated activation's value and its partial derivatives at (gate, up).
struct Eval {
  float value = 0.f;
  float d_gate = 0.f;
  float d_up = 0.f;
};

GMOE_ACT_FN float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

constexpr float kInvSqrt2 = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;
constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kGeluTanhCoeff = 0.044715f;

// gelu and its derivative (exact erf form, or the tanh approximation).
GMOE_ACT_FN float gelu(float g, bool tanh_form, float* derivative) {
  if (tanh_form) {
    const float inner = kSqrt2OverPi * (g + kGeluTanhCoeff * g * g * g);
    const float t = tanhf(inner);
    if (derivative != nullptr) {
      *derivative = 0.5f * (1.0f + t) +
                    0.5f * g * (1.0f - t * t) * kSqrt2OverPi * (1.0f + 3.0f * kGeluTanhCoeff * g * g);
    }
    return 0.5f * g * (1.0f + t);
  }
  const float cdf = 0.5f * (1.0f + erff(g * kInvSqrt2));
  if (derivative != nullptr) *derivative = cdf + g * kInvSqrt2Pi * expf(-0.5f * g * g);
  return g * cdf;
}

/// Gated activations: the value alone (forward) ...
template <ActivationKind K>
GMOE_ACT_FN float gated_value(float g, float u, const Params& p) {
  if constexpr (K == ActivationKind::swiglu) {
    return g * sigmoid(g) * u;
  } else if constexpr (K == ActivationKind::geglu) {
    return gelu(g, p.gelu_tanh, nullptr) * u;
  } else {
    static_assert(K == ActivationKind::clamped_swiglu, "not a gated activation");
    // Ternaries, not fminf: a NaN input stays NaN, as torch.clamp leaves it.
    const float gc = g > p.limit ? p.limit : g;
    const float uc = u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u);
    return gc * sigmoid(p.alpha * gc) * (uc + 1.0f);
  }
}

/// ... and the value with the partial derivatives (backward). `value` equals gated_value's bitwise.
template <ActivationKind K>
GMOE_ACT_FN Eval gated_eval(float g, float u, const Params& p) {
  Eval r;
  if constexpr (K == ActivationKind::swiglu) {
    const float s = sigmoid(g);
    const float silu = g * s;
    r.value = silu * u;
    r.d_gate = u * (s * (1.0f + g * (1.0f - s)));
    r.d_up = silu;
  } else if constexpr (K == ActivationKind::geglu) {
    float dgelu = 0.f;
    const float ge = gelu(g, p.gelu_tanh, &dgelu);
    r.value = ge * u;
    r.d_gate = u * dgelu;
    r.d_up = ge;
  } else {
    static_assert(K == ActivationKind::clamped_swiglu, "not a gated activation");
    const float gc = g > p.limit ? p.limit : g;
    const float uc = u > p.limit ? p.limit : (u < -p.limit ? -p.limit : u);
    const float s = sigmoid(p.alpha * gc);
    const float glu = gc * s;
    r.value = glu * (uc + 1.0f);
    // torch's clamp backward: the gradient passes where lo <= x <= hi (limits included), else 0.
    r.d_gate = g <= p.limit ? (uc + 1.0f) * (s * (1.0f + p.alpha * gc * (1.0f - s))) : 0.0f;
    r.d_up = (u >= -p.limit && u <= p.limit) ? glu : 0.0f;
  }
  return r;
}

/// squared ReLU: relu(h)² (NaN stays NaN) ...
GMOE_ACT_FN float squared_relu_value(float h) {
  const float r = h <= 0.0f ? 0.0f : h;
  return r * r;
}
/// ... and its derivative 2·relu(h) (0 at h = 0 and for NaN, as torch's threshold_backward).
GMOE_ACT_FN float squared_relu_derivative(float h) { return h > 0.0f ? 2.0f * h : 0.0f; }

/// Column of gate element j among the 2F columns of h (block == 0: concatenated halves); the
/// matching up element is `up_offset` columns further.
/// Templated on the index type so that kernels can use 32-bit division.
template <typename I>
GMOE_ACT_FN I gate_column(I j, I block) {
  return block == 0 ? j : (j / block) * 2 * block + j % block;
}
template <typename I>
GMOE_ACT_FN I up_offset(I F, I block) {
  return block == 0 ? F : block;
}

}  // namespace gmoe::act
