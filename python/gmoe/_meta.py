"""Fake (meta) kernels of the gmoe ops: the shapes and dtypes of their outputs, for torch.compile,
FakeTensor and torch.library.opcheck. They mirror python/csrc/ops.cpp's output allocation; the
argument checks stay in gmoe (run by the real kernels)."""
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

_lib = "gmoe::"


def _expert_rows(w: Sequence[Tensor]) -> int:
    """N of expert weights given as one stacked [E, N, K] tensor or E tensors [N, K]."""
    return w[0].shape[1] if len(w) == 1 and w[0].dim() == 3 else w[0].shape[0]


def _expert_cols(w: Sequence[Tensor]) -> int:
    return w[0].shape[-1]


@torch.library.register_fake(_lib + "grouped_gemm_fprop")
def _grouped_gemm_fprop(x: Tensor, w: Sequence[Tensor], counts: Tensor, bias: Sequence[Tensor],
                        out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return x.new_empty((x.shape[0], _expert_rows(w)), dtype=out_dtype or x.dtype)


@torch.library.register_fake(_lib + "grouped_gemm_dgrad")
def _grouped_gemm_dgrad(dy: Tensor, w: Sequence[Tensor], counts: Tensor,
                        out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return dy.new_empty((dy.shape[0], _expert_cols(w)), dtype=out_dtype or dy.dtype)


@torch.library.register_fake(_lib + "grouped_gemm_wgrad")
def _grouped_gemm_wgrad(dy: Tensor, x: Tensor, counts: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return dy.new_empty((counts.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype or dy.dtype)


@torch.library.register_fake(_lib + "grouped_gemm_wgrad_")
def _grouped_gemm_wgrad_(dy: Tensor, x: Tensor, counts: Tensor, dw: Sequence[Tensor], accumulate: bool = False,
                         expert_mask: Optional[Tensor] = None) -> None:
    return None


@torch.library.register_fake(_lib + "grouped_bias_add")
def _grouped_bias_add(y: Tensor, bias: Sequence[Tensor], counts: Tensor) -> Tensor:
    return torch.empty_like(y, memory_format=torch.contiguous_format)


@torch.library.register_fake(_lib + "grouped_bias_grad")
def _grouped_bias_grad(dy: Tensor, counts: Tensor, out_dtype: Optional[torch.dtype] = None) -> Tensor:
    return dy.new_empty((counts.shape[0], dy.shape[1]), dtype=out_dtype or dy.dtype)


def _activation_cols(kind: str, h_cols):
    return h_cols if kind == "squared_relu" else h_cols // 2


@torch.library.register_fake(_lib + "grouped_activation_forward")
def _grouped_activation_forward(h: Tensor, counts: Tensor, kind: str, probs: Optional[Tensor] = None,
                                alpha: float = 1.702, limit: float = 7.0, gelu_tanh: bool = False,
                                glu_block: int = 0) -> Tensor:
    return h.new_empty((h.shape[0], _activation_cols(kind, h.shape[1])))


@torch.library.register_fake(_lib + "grouped_activation_backward")
def _grouped_activation_backward(h: Tensor, dz: Tensor, counts: Tensor, kind: str, probs: Optional[Tensor] = None,
                                 need_dprobs: bool = False, alpha: float = 1.702, limit: float = 7.0,
                                 gelu_tanh: bool = False, glu_block: int = 0) -> Tuple[Tensor, Tensor]:
    dprobs = h.new_empty((h.shape[0] if need_dprobs else 0,), dtype=torch.float32)
    return h.new_empty(h.shape), dprobs


@torch.library.register_fake(_lib + "fc1_glu_convert")
def _fc1_glu_convert(src: Tensor, from_block: int, to_block: int) -> Tensor:
    return src.new_empty(src.shape)
