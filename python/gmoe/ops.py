"""Typed entry points to the gmoe ops (``torch.ops.gmoe.*``).

Shapes, with E experts and ``counts`` (``m_splits``) an int32/int64 tensor [E] of rows per expert on
the inputs' device:

* grouped rows ``x`` [capacity, K]: rows split into E contiguous groups by ``counts``; rows past
  ``counts.sum()`` are outputs' zeros (the total is never read on the host).
* expert weights ``w``: one stacked tensor [E, N, K], or a sequence of E tensors [N, K].
* expert biases: one grouped tensor [E, N], or a sequence of E tensors [N].

CPU tensors run gmoe's CPU reference backend (float32, bfloat16, float16); CUDA tensors its CUDA
backend (bfloat16, float16) on the current stream. Bad arguments raise ValueError with gmoe's
message, before anything is written.
"""
from typing import List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

Weights = Union[Tensor, Sequence[Tensor]]
Biases = Union[None, Tensor, Sequence[Tensor]]

#: The activations of gmoe/activation.h.
ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu", "squared_relu")


def _list(w: Union[None, Tensor, Sequence[Tensor]]) -> List[Tensor]:
    if w is None:
        return []
    if isinstance(w, Tensor):
        return [w]
    return list(w)


def glu_block_of(glu_layout: Union[str, int]) -> int:
    """The ops' ``glu_block`` of a gate/up layout: ``"concatenated"`` (0), ``"interleaved:B"`` or an
    int B > 0 (interleaved in blocks of B)."""
    if isinstance(glu_layout, int):
        return glu_layout
    if glu_layout in ("concat", "concatenated"):
        return 0
    if glu_layout == "interleaved":
        return 1
    if glu_layout.startswith("interleaved:"):
        return int(glu_layout.split(":", 1)[1])
    raise ValueError(f"glu_layout: expected 'concatenated' or 'interleaved:B', got {glu_layout!r}")


def grouped_gemm(x: Tensor, w: Weights, counts: Tensor, bias: Biases = None,
                 out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Forward: ``y[rows of e] = x[rows of e] @ w[e].T (+ bias[e])``, y [capacity, N].

    Differentiable in ``x``, ``w`` and ``bias``."""
    return torch.ops.gmoe.grouped_gemm_fprop(x, _list(w), counts, _list(bias), out_dtype)


def grouped_gemm_dgrad(dy: Tensor, w: Weights, counts: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Data gradient: ``dx[rows of e] = dy[rows of e] @ w[e]``, dx [capacity, K]."""
    return torch.ops.gmoe.grouped_gemm_dgrad(dy, _list(w), counts, out_dtype)


#: What ``expert_mask`` 0 means for a weight gradient (MaskedOffWgrad of gmoe/grouped_gemm.h).
MASKED_OFF_WGRAD = ("skip", "fresh")


def wgrad_mask_args(out: List[Tensor], expert_mask: Optional[Tensor], masked_off: str,
                    fresh_out: Optional[Weights], op: str) -> Tuple[Optional[List[Tensor]], Optional[Tensor]]:
    """The checked ``masked_off`` arguments of an in-place wgrad op: (fresh_dw list, the tensor to
    return). With ``"fresh"`` and no ``fresh_out``, a new stacked [E, N, K] tensor of out's dtype
    (its experts with mask 1 are not written: undefined contents)."""
    if masked_off not in MASKED_OFF_WGRAD:
        raise ValueError(f"masked_off: expected one of {MASKED_OFF_WGRAD}, got {masked_off!r}")
    if masked_off == "skip":
        if fresh_out is not None:
            raise ValueError(f"{op}: fresh_out is only written with masked_off='fresh'")
        return None, None
    if expert_mask is None:
        raise ValueError(f"{op}: masked_off='fresh' needs an expert_mask (the experts with mask 0 get fresh_out)")
    if fresh_out is not None:
        return _list(fresh_out), None
    E, (N, K) = (out[0].shape[0], out[0].shape[1:]) if len(out) == 1 and out[0].dim() == 3 else (len(out), out[0].shape)
    fresh = out[0].new_empty((E, N, K))
    return [fresh], fresh


def grouped_gemm_wgrad(dy: Tensor, x: Tensor, counts: Tensor, out: Optional[Weights] = None,
                       accumulate: bool = False, expert_mask: Optional[Tensor] = None,
                       out_dtype: Optional[torch.dtype] = None, masked_off: str = "skip",
                       fresh_out: Optional[Weights] = None) -> Optional[Tensor]:
    """Weight gradient: ``dw[e] = dy[rows of e].T @ x[rows of e]`` (exactly 0 for an expert without rows).

    Without ``out``: returns a new [E, N, K] tensor (``out_dtype``, default dy's); with an
    ``expert_mask`` (int32 [E] on the inputs' device) the experts whose entry is 0 are zeros.

    With ``out`` (one stacked [E, N, K] tensor or E tensors [N, K], e.g. Megatron's float32
    ``main_grad``): writes the experts with mask 1 (every expert without a mask) into it, adding to
    its contents when ``accumulate`` (float32 only). The experts with mask 0 follow ``masked_off``:

    * ``"skip"``: no gradient is computed for them; ``out`` keeps their contents. Returns None.
    * ``"fresh"``: their gradient is written (never accumulated) into ``fresh_out`` (E x [N, K] of
      out's dtype, stacked or a list, disjoint from ``out``) in the same launch; the other experts of
      ``fresh_out`` are left untouched. Without ``fresh_out`` a new stacked tensor is returned
      (its experts with mask 1 are not written: undefined contents); else None."""
    if out is None:
        if accumulate or masked_off != "skip" or fresh_out is not None:
            raise ValueError("grouped_gemm_wgrad: accumulate, masked_off='fresh' and fresh_out need `out`")
        return torch.ops.gmoe.grouped_gemm_wgrad(dy, x, counts, out_dtype, expert_mask)
    out = _list(out)
    fresh_dw, ret = wgrad_mask_args(out, expert_mask, masked_off, fresh_out, "grouped_gemm_wgrad")
    torch.ops.gmoe.grouped_gemm_wgrad_(dy, x, counts, out, accumulate, expert_mask, masked_off, fresh_dw)
    return ret


def grouped_bias_add(y: Tensor, bias: Biases, counts: Tensor) -> Tensor:
    """``y[rows of e] + bias[e]`` as a new tensor (rows past the total copied unchanged).
    Differentiable in ``y`` and ``bias``."""
    return torch.ops.gmoe.grouped_bias_add(y, _list(bias), counts)


def grouped_bias_grad(dy: Tensor, counts: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``db[e] = sum of dy over the rows of e`` (f32 accumulation in row order), [E, N]."""
    return torch.ops.gmoe.grouped_bias_grad(dy, counts, out_dtype)


def grouped_activation(h: Tensor, counts: Tensor, kind: str = "swiglu", probs: Optional[Tensor] = None,
                       alpha: float = 1.702, limit: float = 7.0, gelu_tanh: bool = False,
                       glu_layout: Union[str, int] = "concatenated") -> Tensor:
    """``z = act(h) * probs`` per row: h [capacity, 2F] (gated kinds, gate and up in ``glu_layout``)
    or [capacity, F] (``squared_relu``), z [capacity, F]; ``probs`` optional float32 [capacity].
    ``kind`` is one of :data:`ACTIVATIONS`; ``alpha``/``limit`` are clamped SwiGLU's, ``gelu_tanh``
    GeGLU's tanh approximation. Differentiable in ``h`` and ``probs``."""
    return torch.ops.gmoe.grouped_activation_forward(h, counts, kind, probs, alpha, limit, gelu_tanh,
                                                     glu_block_of(glu_layout))


def grouped_activation_backward(h: Tensor, dz: Tensor, counts: Tensor, kind: str = "swiglu",
                                probs: Optional[Tensor] = None, need_dprobs: bool = False, alpha: float = 1.702,
                                limit: float = 7.0, gelu_tanh: bool = False,
                                glu_layout: Union[str, int] = "concatenated") -> Tuple[Tensor, Optional[Tensor]]:
    """The backward of :func:`grouped_activation`: (dh, dprobs), dprobs float32 [capacity] when
    ``need_dprobs`` else None."""
    dh, dprobs = torch.ops.gmoe.grouped_activation_backward(h, dz, counts, kind, probs, need_dprobs, alpha, limit,
                                                            gelu_tanh, glu_block_of(glu_layout))
    return dh, (dprobs if need_dprobs else None)


def fc1_glu_convert(src: Tensor, from_layout: Union[str, int], to_layout: Union[str, int]) -> Tensor:
    """FC1 weights [E, 2F, H] (or biases [E, 2F]) re-ordered from one gate/up layout to another
    (``"concatenated"``, ``"interleaved:B"``), as a new tensor."""
    return torch.ops.gmoe.fc1_glu_convert(src, glu_block_of(from_layout), glu_block_of(to_layout))


def check_device_errors(device: Union[None, str, torch.device] = None) -> None:
    """Raises ValueError describing what gmoe's CUDA kernels found and clamped since the last check
    (negative counts, counts past the capacity, inconsistent FP8 padding), on the current stream of
    ``device`` (default: the current CUDA device). A deliberate sync: never on the hot path."""
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    torch.ops.gmoe.check_device_errors(torch.empty(0, device=dev))


def set_debug_sync(enabled: bool) -> None:
    """gmoe's debug mode: every CUDA op ends with a device-error check (a sync; never under graph
    capture)."""
    torch.ops.gmoe.set_debug_sync(enabled)
