"""Fake (meta) kernels of the gmoe ops: the shapes and dtypes of their outputs, for torch.compile,
FakeTensor and torch.library.opcheck. They mirror python/csrc/ops.cpp's output allocation; the
argument checks stay in gmoe (run by the real kernels)."""
import math
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
def _grouped_gemm_wgrad(dy: Tensor, x: Tensor, counts: Tensor, out_dtype: Optional[torch.dtype] = None,
                        expert_mask: Optional[Tensor] = None) -> Tensor:
    return dy.new_empty((counts.shape[0], dy.shape[1], x.shape[1]), dtype=out_dtype or dy.dtype)


@torch.library.register_fake(_lib + "grouped_gemm_wgrad_")
def _grouped_gemm_wgrad_(dy: Tensor, x: Tensor, counts: Tensor, dw: Sequence[Tensor], accumulate: bool = False,
                         expert_mask: Optional[Tensor] = None, masked_off: str = "skip",
                         fresh_dw: Optional[Sequence[Tensor]] = None) -> None:
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


@torch.library.register_fake(_lib + "grouped_gemm_fprop_of_activation")
def _grouped_gemm_fprop_of_activation(h: Tensor, w: Sequence[Tensor], counts: Tensor, bias: Sequence[Tensor], kind: str,
                                      probs: Optional[Tensor] = None, alpha: float = 1.702, limit: float = 7.0,
                                      gelu_tanh: bool = False, glu_block: int = 0) -> Tensor:
    return h.new_empty((h.shape[0], _expert_rows(w)))


@torch.library.register_fake(_lib + "grouped_linear_forward")
def _grouped_linear_forward(x: Tensor, w: Sequence[Tensor], counts: Tensor, bias: Sequence[Tensor],
                            w_main_grad: Sequence[Tensor], bias_main_grad: Sequence[Tensor],
                            w_placeholder: Sequence[Tensor], bias_placeholder: Sequence[Tensor],
                            accumulate: bool = True, delay_wgrad: bool = False, activation: Optional[str] = None,
                            probs: Optional[Tensor] = None, alpha: float = 1.702, limit: float = 7.0,
                            gelu_tanh: bool = False, glu_block: int = 0,
                            expert_mask: Optional[Tensor] = None) -> Tensor:
    return x.new_empty((x.shape[0], _expert_rows(w)))


@torch.library.register_fake(_lib + "fc1_glu_convert")
def _fc1_glu_convert(src: Tensor, from_block: int, to_block: int) -> Tensor:
    return src.new_empty(src.shape)


# ---- FP8 (layouts of gmoe/fp8.h: fp8_grouped_layout, fp8_weights_layout) ------------------------

_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_BLOCK, _MX_BLOCK, _TOKEN_PAD = 128, 32, 128


def _cdiv(a, b):
    return (a + b - 1) // b


def _scale_dtype(recipe):
    return torch.float8_e8m0fnu if recipe == "mxfp8" else torch.float32


def padded_capacity(capacity, experts):
    """fp8_padded_capacity: roundup(capacity, 128) + 128 * experts."""
    return _cdiv(capacity, _TOKEN_PAD) * _TOKEN_PAD + _TOKEN_PAD * experts


@torch.library.register_fake(_lib + "quantize_grouped")
def _quantize_grouped(x: Tensor, counts: Tensor, recipe: str, format: str = "e4m3", rowwise: bool = True,
                      columnwise: bool = False, pow2_scales: bool = False):
    cap, cols, E = x.shape[0], x.shape[1], counts.shape[0]
    fmt, sdt = _FORMATS[format], _scale_dtype(recipe)
    padded = padded_capacity(cap, E)
    if recipe == "tensorwise":
        s_rows, s_cols = (E,), (E,)
    elif recipe == "blockwise":
        s_rows, s_cols = (_cdiv(cols, _BLOCK), cap), (padded // _BLOCK, cols)
    else:
        s_rows, s_cols = (cap, _cdiv(cols, _MX_BLOCK)), (cols, padded // _MX_BLOCK)
    empty = lambda shape, dt, wanted: x.new_empty(shape if wanted else (0,), dtype=dt)  # noqa: E731
    return (empty((cap, cols), fmt, rowwise), empty(s_rows, sdt, rowwise), empty((cols, padded), fmt, columnwise),
            empty(s_cols, sdt, columnwise), x.new_empty((E + 1,), dtype=torch.int64))


@torch.library.register_fake(_lib + "quantize_weights")
def _quantize_weights(w: Sequence[Tensor], recipe: str, rowwise: bool = True, columnwise: bool = True,
                      pow2_scales: bool = False):
    stacked = len(w) == 1 and w[0].dim() == 3
    E = w[0].shape[0] if stacked else len(w)
    N, K = _expert_rows(w), _expert_cols(w)
    fmt, sdt = torch.float8_e4m3fn, _scale_dtype(recipe)
    if recipe == "tensorwise":
        s, st = (E,), (E,)
    elif recipe == "blockwise":
        s, st = (E, _cdiv(N, _BLOCK), _cdiv(K, _BLOCK)), (E, _cdiv(K, _BLOCK), _cdiv(N, _BLOCK))
    else:
        s, st = (E, N, _cdiv(K, _MX_BLOCK)), (E, K, _cdiv(N, _MX_BLOCK))
    empty = lambda shape, dt, wanted: w[0].new_empty(shape if wanted else (0,), dtype=dt)  # noqa: E731
    return (empty((E, N, K), fmt, rowwise), empty(s, sdt, rowwise), empty((E, K, N), fmt, columnwise),
            empty(st, sdt, columnwise))


def _fp8_out(t: Tensor, out_dtype):
    return out_dtype or (torch.bfloat16 if t.device.type == "cuda" else torch.float32)


@torch.library.register_fake(_lib + "fp8_grouped_gemm_fprop")
def _fp8_fprop(x_data, x_scale_inv, w_data, w_scale_inv, counts, recipe, bias, fast_accumulation=False,
               out_dtype=None):
    return x_data.new_empty((x_data.shape[0], w_data.shape[1]), dtype=_fp8_out(x_data, out_dtype))


@torch.library.register_fake(_lib + "fp8_grouped_gemm_dgrad")
def _fp8_dgrad(dy_data, dy_scale_inv, w_data_t, w_scale_inv_t, counts, recipe, fast_accumulation=False,
               out_dtype=None):
    return dy_data.new_empty((dy_data.shape[0], w_data_t.shape[1]), dtype=_fp8_out(dy_data, out_dtype))


@torch.library.register_fake(_lib + "fp8_grouped_gemm_wgrad")
def _fp8_wgrad(dy_data_t, dy_scale_inv_t, x_data_t, x_scale_inv_t, padded_offsets, counts, capacity, recipe,
               out_dtype=None, expert_mask=None):
    return dy_data_t.new_empty((counts.shape[0], dy_data_t.shape[0], x_data_t.shape[0]),
                               dtype=out_dtype or torch.float32)


@torch.library.register_fake(_lib + "fp8_grouped_gemm_wgrad_")
def _fp8_wgrad_(dy_data_t, dy_scale_inv_t, x_data_t, x_scale_inv_t, padded_offsets, counts, capacity, recipe, dw,
                accumulate=False, expert_mask=None, masked_off="skip", fresh_dw=None):
    return None


@torch.library.register_fake(_lib + "dequantize_grouped")
def _dequantize_grouped(data, scale_inv, data_t, scale_inv_t, padded_offsets, counts, capacity, cols, recipe,
                        columnwise, out_dtype):
    return (data_t if columnwise else data).new_empty((capacity, cols), dtype=out_dtype)


@torch.library.register_fake(_lib + "dequantize_weights")
def _dequantize_weights(data, scale_inv, transposed, recipe, out_dtype):
    E, a, b = data.shape
    return data.new_empty((E, b, a) if transposed else (E, a, b), dtype=out_dtype)


@torch.library.register_fake(_lib + "check_device_errors")
def _check_device_errors(anchor: Tensor) -> None:
    return None


# ---- routing (gmoe/routing.h; python/csrc/routing_ops.cpp) ------------------------------------------

def permuted_rows(tokens, top_k: int, num_experts: int, pad_multiple: int = 1, capacity_factor: float = 0.0):
    """gmoe::permuted_rows: min(T·k, E·capacity) + E·(pad_multiple - 1), capacity =
    ceil(capacity_factor·T·k / E) (no limit when capacity_factor is 0). `tokens` may be symbolic."""
    kept = tokens * top_k
    if capacity_factor > 0:
        # The same double expression, in the same order, as gmoe::expert_capacity.
        cap = math.ceil(capacity_factor * tokens * top_k / num_experts)
        kept = torch.sym_min(kept, num_experts * torch.sym_min(cap, kept))
    return kept + num_experts * (pad_multiple - 1)


@torch.library.register_fake(_lib + "router_topk")
def _router_topk(logits: Tensor, top_k: int, score: str = "softmax", normalize: bool = False, n_group: int = 1,
                 topk_group: int = 1, scaling_factor: float = 1.0, score_bias: Optional[Tensor] = None):
    T, E = logits.shape
    return (logits.new_empty((T, top_k), dtype=torch.float32), logits.new_empty((T, top_k), dtype=torch.int32),
            logits.new_empty((E,), dtype=torch.int32))


@torch.library.register_fake(_lib + "router_topk_backward")
def _router_topk_backward(logits, ids, dprobs, score="softmax", normalize=False, scaling_factor=1.0,
                          out_dtype=None):
    return logits.new_empty(logits.shape, dtype=out_dtype or logits.dtype)


@torch.library.register_fake(_lib + "router_aux_loss")
def _router_aux_loss(logits, counts, top_k, score="softmax", coeff=1.0):
    return logits.new_empty((1,), dtype=torch.float32)


@torch.library.register_fake(_lib + "router_aux_loss_backward")
def _router_aux_loss_backward(logits, counts, dloss, top_k, score="softmax", coeff=1.0, out_dtype=None):
    return logits.new_empty(logits.shape, dtype=out_dtype or logits.dtype)


@torch.library.register_fake(_lib + "router_z_loss")
def _router_z_loss(logits, coeff=1.0):
    return logits.new_empty((1,), dtype=torch.float32)


@torch.library.register_fake(_lib + "router_z_loss_backward")
def _router_z_loss_backward(logits, dloss, coeff=1.0, out_dtype=None):
    return logits.new_empty(logits.shape, dtype=out_dtype or logits.dtype)


@torch.library.register_fake(_lib + "permute")
def _permute(x: Tensor, ids: Tensor, num_experts: int, pad_multiple: int = 1, capacity_factor: float = 0.0,
             probs: Optional[Tensor] = None):
    T, H = x.shape
    k = ids.shape[1]
    rows = permuted_rows(T, k, num_experts, pad_multiple, capacity_factor)
    i32 = torch.int32
    return (x.new_empty((rows, H)), x.new_empty((num_experts,), dtype=i32), x.new_empty((T, k), dtype=i32),
            x.new_empty((rows,), dtype=i32), x.new_empty((rows if probs is not None else 0,), dtype=torch.float32),
            x.new_empty((1,), dtype=i32))


@torch.library.register_fake(_lib + "permute_backward")
def _permute_backward(dpermuted, row_of, src_token, dpermuted_probs=None):
    dprobs = dpermuted.new_empty(row_of.shape if dpermuted_probs is not None else (0,), dtype=torch.float32)
    return dpermuted.new_empty((row_of.shape[0], dpermuted.shape[1])), dprobs


@torch.library.register_fake(_lib + "combine")
def _combine(expert_out, row_of, src_token, probs=None):
    return expert_out.new_empty((row_of.shape[0], expert_out.shape[1]))


@torch.library.register_fake(_lib + "combine_backward")
def _combine_backward(dout, row_of, src_token, probs=None, expert_out=None, need_dprobs=False):
    dprobs = dout.new_empty(row_of.shape if need_dprobs else (0,), dtype=torch.float32)
    return dout.new_empty((src_token.shape[0], dout.shape[1])), dprobs


# ---- expert parallelism: the shapes come from the group (a host-side handle) ---------------------

def _ep_info(group: int):
    """(max_rows, recv_capacity, local_experts, size, num_experts) of an expert-parallel group."""
    info = torch.ops.gmoe.ep_group_info(group)
    return info[7], info[8], info[9], info[1], info[4]


@torch.library.register_fake(_lib + "ep_plan")
def _ep_plan(group: int, counts: Tensor):
    _, _, local_experts, size, num_experts = _ep_info(group)
    return (counts.new_empty((size, num_experts), dtype=torch.int32),
            counts.new_empty((local_experts,), dtype=torch.int32))


def _ep_moved(rows: Tensor, scalars: Optional[Tensor], capacity: int):
    return (rows.new_empty((capacity, rows.shape[1])),
            rows.new_empty((capacity if scalars is not None else 0,), dtype=torch.float32))


@torch.library.register_fake(_lib + "ep_dispatch")
def _ep_dispatch(group: int, counts_all: Tensor, local_counts: Tensor, rows: Tensor, scalars: Optional[Tensor] = None):
    return _ep_moved(rows, scalars, _ep_info(group)[1])


@torch.library.register_fake(_lib + "ep_combine")
def _ep_combine(group: int, counts_all: Tensor, local_counts: Tensor, rows: Tensor, scalars: Optional[Tensor] = None):
    return _ep_moved(rows, scalars, _ep_info(group)[0])
