"""gmoe: the expert layers of Mixture-of-Experts models as PyTorch ops and modules.

Importing the package loads the compiled extension, which registers gmoe's ops in PyTorch's
dispatcher under ``torch.ops.gmoe`` (CPU tensors run gmoe's CPU reference backend, CUDA tensors its
CUDA backend on the current stream) with their autograd formulas, and their fake kernels
(``torch.compile``). The typed Python entry points are in :mod:`gmoe.ops` (expert GEMMs, activations),
:mod:`gmoe.fp8`, :mod:`gmoe.routing` (router top-k, aux and z losses, permute, combine) and
:mod:`gmoe.expert_parallel` (:class:`EpGroup`, dispatch and combine across ranks); the modules are
:class:`GroupedLinear`, :class:`GroupedMLP` and :class:`MoELayer` (the whole block, optionally
expert-parallel).

Per-expert token counts (``m_splits``) stay on the tensors' device: nothing here reads them on the
host, so a training step with CUDA tensors never synchronises and can be captured in a CUDA graph
once and replayed under any routing.
"""
import os as _os

import torch as _torch

_LIBRARY = _os.path.join(_os.path.dirname(__file__), "_ops.so")
if not _os.path.exists(_LIBRARY):
    raise ImportError(
        f"gmoe: the compiled extension {_LIBRARY} is missing; install the package with `pip install .` "
        "from the repository root, or build it in place (scripts/test_python.sh --inplace)")
_torch.ops.load_library(_LIBRARY)

from . import _meta  # noqa: E402,F401  (fake kernels)
from . import _autograd  # noqa: E402,F401  (the overlapped dispatch's autograd, for MoELayer)
from .ops import (  # noqa: E402
    ACTIVATIONS,
    MASKED_OFF_WGRAD,
    check_device_errors,
    set_debug_sync,
    fc1_glu_convert,
    grouped_activation,
    grouped_activation_backward,
    grouped_bias_add,
    grouped_bias_grad,
    grouped_gemm,
    grouped_gemm_dgrad,
    grouped_gemm_wgrad,
)
from .fp8 import (  # noqa: E402
    Fp8Rows,
    Fp8Weights,
    dequantize_grouped,
    dequantize_weights,
    fp8_grouped_gemm,
    fp8_grouped_gemm_dgrad,
    fp8_grouped_gemm_wgrad,
    quantize_grouped,
    quantize_weights,
)
from .modules import FP8_RECIPES, GroupedLinear, GroupedMLP, fp8_autocast  # noqa: E402
from .routing import (  # noqa: E402
    SCORE_FUNCS,
    Permuted,
    RouterOutput,
    RoutingMap,
    combine,
    permute,
    permuted_rows,
    router_aux_loss,
    router_topk,
    router_z_loss,
    unpermute,
)
from .expert_parallel import (  # noqa: E402
    EpGroup,
    EpPlan,
    EpRows,
    ep_combine,
    ep_dispatch,
    ep_plan,
    merge_ep_state_dicts,
)
from .moe_layer import MoELayer  # noqa: E402
from .offload import OffloadStats, offload_activations  # noqa: E402

__all__ = [
    "ACTIVATIONS",
    "FP8_RECIPES",
    "MASKED_OFF_WGRAD",
    "fp8_autocast",
    "Fp8Rows",
    "Fp8Weights",
    "dequantize_grouped",
    "dequantize_weights",
    "fp8_grouped_gemm",
    "fp8_grouped_gemm_dgrad",
    "fp8_grouped_gemm_wgrad",
    "quantize_grouped",
    "quantize_weights",
    "GroupedLinear",
    "GroupedMLP",
    "MoELayer",
    "EpGroup",
    "EpPlan",
    "EpRows",
    "ep_combine",
    "ep_dispatch",
    "ep_plan",
    "merge_ep_state_dicts",
    "OffloadStats",
    "offload_activations",
    "SCORE_FUNCS",
    "Permuted",
    "RouterOutput",
    "RoutingMap",
    "combine",
    "permute",
    "permuted_rows",
    "router_aux_loss",
    "router_topk",
    "router_z_loss",
    "unpermute",
    "check_device_errors",
    "set_debug_sync",
    "fc1_glu_convert",
    "grouped_activation",
    "grouped_activation_backward",
    "grouped_bias_add",
    "grouped_bias_grad",
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
]
