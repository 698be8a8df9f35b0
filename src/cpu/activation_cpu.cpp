// src/cpu/activation_cpu.cpp — the reference grouped activations (forward and backward).
//
// Plain loops over rows (OpenMP across rows), the formulas of common/activation_math.h in f32,
// storage converted on the fly. dprobs sums a row's F products in column order in f32: one fixed
// order, so deterministic.
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "common/activation_kinds.h"
#include "common/activation_math.h"
#include "common/backend.h"
#include "common/float_convert.h"
#include "common/fp8_rules.h"
#include "gmoe/error.h"

namespace gmoe::cpu_backend {
namespace {

act::Params params_of(const ActivationOptions& o) { return act::Params{o.alpha, o.limit, o.gelu_tanh}; }

int64_t block_of(const ActivationOptions& o) {
  return o.glu.layout == GluLayout::interleaved ? o.glu.block : 0;
}

// amax_out[e] = the largest finite |value| of t (as stored) over expert e's rows (0 without rows).
void expert_amax(const TensorView& t, const TensorView& counts, const TensorView& amax_out) {
  if (!amax_out.defined()) return;
  const std::vector<int64_t> off = host_group_offsets(counts, t.size(0));
  float* a = static_cast<float*>(amax_out.data);
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    float m = 0.0f;
    for (int64_t r = off[e]; r < off[e + 1]; ++r) {
      for (int64_t c = 0; c < t.size(1); ++c) {
        m = std::max(m, fp8_rules::finite_abs(load_float(t.data, t.dtype, r * t.stride(0) + c)));
      }
    }
    a[e] = m;
  }
}

int64_t real_total(const TensorView& counts, int64_t capacity) {
  return host_group_offsets(counts, capacity).back();
}

// Element (row, col) of a 2-D view with unit column stride.
float at(const TensorView& t, int64_t row, int64_t col) { return load_float(t.data, t.dtype, row * t.stride(0) + col); }
void put(const TensorView& t, int64_t row, int64_t col, float v) { store_float(t.data, t.dtype, row * t.stride(0) + col, v); }

void zero_row(const TensorView& t, int64_t row) {
  if (!t.defined()) return;
  for (int64_t c = 0; c < t.size(1); ++c) put(t, row, c, 0.0f);
}

template <ActivationKind K>
void forward_rows(const TensorView& h, const TensorView& z, const float* probs, int64_t total,
                  const act::Params& prm, int64_t block) {
  const int64_t cap = h.size(0), F = z.size(1);
  const int64_t up = act::up_offset(F, block);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < cap; ++r) {
    if (r >= total) {
      zero_row(z, r);
      continue;
    }
    const float p = probs != nullptr ? probs[r] : 1.0f;
    for (int64_t j = 0; j < F; ++j) {
      float a;
      if constexpr (K == ActivationKind::squared_relu) {
        a = act::squared_relu_value(at(h, r, j));
      } else {
        const int64_t gc = act::gate_column(j, block);
        a = act::gated_value<K>(at(h, r, gc), at(h, r, gc + up), prm);
      }
      put(z, r, j, probs != nullptr ? a * p : a);
    }
  }
}

template <ActivationKind K>
void backward_rows(const TensorView& h, const TensorView& dz, const TensorView& dh, const float* probs,
                   float* dprobs, const TensorView& z_out, int64_t total, const act::Params& prm, int64_t block) {
  const int64_t cap = h.size(0), F = dz.size(1);
  const int64_t up = act::up_offset(F, block);
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < cap; ++r) {
    if (r >= total) {
      zero_row(dh, r);
      zero_row(z_out, r);
      if (dprobs != nullptr) dprobs[r] = 0.0f;
      continue;
    }
    const float p = probs != nullptr ? probs[r] : 1.0f;
    float dp = 0.0f;
    for (int64_t j = 0; j < F; ++j) {
      const float g = at(dz, r, j);
      const float gp = probs != nullptr ? g * p : g;
      float a;
      if constexpr (K == ActivationKind::squared_relu) {
        const float x = at(h, r, j);  // read before dh (which may be h) is written
        a = act::squared_relu_value(x);
        put(dh, r, j, gp * act::squared_relu_derivative(x));
      } else {
        const int64_t gc = act::gate_column(j, block);
        const act::Eval ev = act::gated_eval<K>(at(h, r, gc), at(h, r, gc + up), prm);
        a = ev.value;
        put(dh, r, gc, gp * ev.d_gate);
        put(dh, r, gc + up, gp * ev.d_up);
      }
      dp += g * a;
      if (z_out.defined()) put(z_out, r, j, probs != nullptr ? a * p : a);
    }
    if (dprobs != nullptr) dprobs[r] = dp;
  }
}

using act::with_kind;

}  // namespace

void grouped_activation_forward(const TensorView& h, const TensorView& counts, const TensorView& z,
                                const ActivationOptions& options, const TensorView& probs,
                                const TensorView& amax_out) {
  const int64_t total = real_total(counts, h.size(0));
  const float* p = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  with_kind(options.kind, [&](auto k) {
    forward_rows<decltype(k)::value>(h, z, p, total, params_of(options), block_of(options));
  });
  expert_amax(z, counts, amax_out);
}

void grouped_activation_backward(const TensorView& h, const TensorView& dz, const TensorView& counts,
                                 const TensorView& dh, const ActivationOptions& options, const TensorView& probs,
                                 const TensorView& dprobs, const TensorView& z_out, const TensorView& amax_out) {
  const int64_t total = real_total(counts, h.size(0));
  const float* p = probs.defined() ? static_cast<const float*>(probs.data) : nullptr;
  float* dp = dprobs.defined() ? static_cast<float*>(dprobs.data) : nullptr;
  with_kind(options.kind, [&](auto k) {
    backward_rows<decltype(k)::value>(h, dz, dh, p, dp, z_out, total, params_of(options), block_of(options));
  });
  expert_amax(dh, counts, amax_out);
}

}  // namespace gmoe::cpu_backend
