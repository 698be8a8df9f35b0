"""FP8 operands and FP8 grouped GEMMs (gmoe/fp8.h, gmoe/fp8_gemm.h) as torch tensors.

Recipes: ``"tensorwise"`` (one f32 scale per expert), ``"blockwise"`` (1x128 scales on grouped
rows, 128x128 on weights: DeepSeek-V3's), ``"mxfp8"`` (1x32 blocks, e8m0 scales). Quantization is
bit-exact between the CPU and CUDA backends; the CPU GEMMs are the dequantize-then-f32 reference.
"""
from typing import NamedTuple, Optional, Sequence, Union

import torch
from torch import Tensor

from .ops import Biases, Weights, _list, wgrad_mask_args

_ops = torch.ops.gmoe


class Fp8Rows(NamedTuple):
    """Quantized grouped rows [capacity, cols]: the rowwise copy (data, scale_inv), the columnwise
    (transposed, per-expert token-padded) copy (data_t, scale_inv_t, padded_offsets); a copy not
    asked for is made of [0] tensors."""
    data: Tensor
    scale_inv: Tensor
    data_t: Tensor
    scale_inv_t: Tensor
    padded_offsets: Tensor
    recipe: str
    capacity: int
    cols: int


class Fp8Weights(NamedTuple):
    """Quantized expert weights [E, N, K]: data [E, N, K] + scale_inv (fprop), data_t [E, K, N] +
    scale_inv_t (dgrad)."""
    data: Tensor
    scale_inv: Tensor
    data_t: Tensor
    scale_inv_t: Tensor
    recipe: str


def quantize_grouped(x: Tensor, counts: Tensor, recipe: str = "blockwise", format: str = "e4m3",
                     rowwise: bool = True, columnwise: bool = False, pow2_scales: bool = False) -> Fp8Rows:
    """One-pass grouped quantization of x [capacity, cols] split by counts (``format``: ``"e4m3"``
    or ``"e5m2"``)."""
    t = _ops.quantize_grouped(x, counts, recipe, format, rowwise, columnwise, pow2_scales)
    return Fp8Rows(*t, recipe, x.shape[0], x.shape[1])


def quantize_weights(w: Weights, recipe: str = "blockwise", rowwise: bool = True, columnwise: bool = True,
                     pow2_scales: bool = False) -> Fp8Weights:
    """Quantizes expert weights (stacked [E, N, K] or E tensors [N, K]) to e4m3."""
    return Fp8Weights(*_ops.quantize_weights(_list(w), recipe, rowwise, columnwise, pow2_scales), recipe)


def dequantize_grouped(q: Fp8Rows, counts: Tensor, columnwise: bool = False,
                       out_dtype: torch.dtype = torch.float32) -> Tensor:
    """One copy of q back to [capacity, cols] (for tests and debugging)."""
    return _ops.dequantize_grouped(q.data, q.scale_inv, q.data_t, q.scale_inv_t, q.padded_offsets, counts, q.capacity,
                                   q.cols, q.recipe, columnwise, out_dtype)


def dequantize_weights(q: Fp8Weights, transposed: bool = False, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """One copy of q back to [E, N, K] (the transposed copy transposed back; for tests and debugging)."""
    if transposed:
        return _ops.dequantize_weights(q.data_t, q.scale_inv_t, True, q.recipe, out_dtype)
    return _ops.dequantize_weights(q.data, q.scale_inv, False, q.recipe, out_dtype)


def fp8_grouped_gemm(x: Fp8Rows, w: Fp8Weights, counts: Tensor, bias: Biases = None, fast_accumulation: bool = False,
                     out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """fprop ``y = dequant(x) @ dequant(w[e]).T (+ bias)``: bf16 on CUDA, f32 on the CPU by default."""
    return _ops.fp8_grouped_gemm_fprop(x.data, x.scale_inv, w.data, w.scale_inv, counts, x.recipe, _list(bias),
                                       fast_accumulation, out_dtype)


def fp8_grouped_gemm_dgrad(dy: Fp8Rows, w: Fp8Weights, counts: Tensor, fast_accumulation: bool = False,
                           out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """dgrad ``dx = dequant(dy) @ dequant(w[e])`` from w's transposed copy."""
    return _ops.fp8_grouped_gemm_dgrad(dy.data, dy.scale_inv, w.data_t, w.scale_inv_t, counts, dy.recipe,
                                       fast_accumulation, out_dtype)


def fp8_grouped_gemm_wgrad(dy: Fp8Rows, x: Fp8Rows, counts: Tensor, out: Union[None, Tensor, Sequence[Tensor]] = None,
                           accumulate: bool = False, expert_mask: Optional[Tensor] = None,
                           out_dtype: Optional[torch.dtype] = None, masked_off: str = "skip",
                           fresh_out: Union[None, Tensor, Sequence[Tensor]] = None) -> Optional[Tensor]:
    """wgrad ``dw[e] = dequant(dy_e).T @ dequant(x_e)`` from the columnwise copies; into ``out`` (e.g. an
    f32 main_grad, ``accumulate``, ``expert_mask`` with ``masked_off`` and ``fresh_out`` as for
    :func:`gmoe.grouped_gemm_wgrad`) or a new [E, N, K] tensor (f32 by default; with an
    ``expert_mask`` the experts with mask 0 are zeros)."""
    args = (dy.data_t, dy.scale_inv_t, x.data_t, x.scale_inv_t, dy.padded_offsets, counts, dy.capacity, dy.recipe)
    if out is None:
        if accumulate or masked_off != "skip" or fresh_out is not None:
            raise ValueError("fp8_grouped_gemm_wgrad: accumulate, masked_off='fresh' and fresh_out need `out`")
        return _ops.fp8_grouped_gemm_wgrad(*args, out_dtype, expert_mask)
    out = _list(out)
    fresh_dw, ret = wgrad_mask_args(out, expert_mask, masked_off, fresh_out, "fp8_grouped_gemm_wgrad")
    _ops.fp8_grouped_gemm_wgrad_(*args, out, accumulate, expert_mask, masked_off, fresh_dw)
    return ret
