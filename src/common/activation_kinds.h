// src/common/activation_kinds.h — the host-side switch from a run-time activation kind onto
// kernels compiled per kind, shared by the CPU and CUDA backends.
#pragma once

#include <type_traits>

#include "gmoe/activation.h"
#include "gmoe/error.h"

namespace gmoe::act {

/// f(std::integral_constant<ActivationKind, kind>{}); throws gmoe::Error on an unknown kind.
template <typename F>
void with_kind(ActivationKind kind, F&& f) {
  switch (kind) {
    case ActivationKind::swiglu: f(std::integral_constant<ActivationKind, ActivationKind::swiglu>{}); return;
    case ActivationKind::geglu: f(std::integral_constant<ActivationKind, ActivationKind::geglu>{}); return;
    case ActivationKind::clamped_swiglu:
      f(std::integral_constant<ActivationKind, ActivationKind::clamped_swiglu>{});
      return;
    case ActivationKind::squared_relu:
      f(std::integral_constant<ActivationKind, ActivationKind::squared_relu>{});
      return;
  }
  GMOE_FAIL("unknown activation ", static_cast<int>(kind));
}

}  // namespace gmoe::act
