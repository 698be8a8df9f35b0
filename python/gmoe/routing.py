"""Token routing for a Mixture-of-Experts block (gmoe/routing.h): the router's top-k over expert
logits with its auxiliary losses, the permutation of tokens into rows grouped by expert, and the
probability-weighted combine back into tokens. Differentiable in x, the logits and the
probabilities; the integer outputs (ids, counts, the map) are constants of the graph.

Every output shape is known on the host: ``permute`` returns ``permuted_rows(...)`` rows, the
largest padded total any routing can reach; the real per-expert counts stay on the device (rows
past their total are zeros). Nothing reads them on the host, so a block built from these
functions never synchronises and can be captured in a CUDA graph and replayed under any logits.

Shapes, with T tokens, E experts, k = top_k:

* logits [T, E] (float32, bfloat16, float16); ids int32 [T, k], best first; probs float32 [T, k];
  counts int32 [E].
* x [T, H]; permuted [rows, H] grouped by expert; ``RoutingMap``: ``row_of`` int32 [T, k] (the
  permuted row of each (token, slot), -1 where the capacity dropped it) and ``src_token`` int32
  [rows] (the token of each permuted row, -1 for padding).
"""
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ._meta import permuted_rows as _permuted_rows

_ops = torch.ops.gmoe
SCORE_FUNCS = ("softmax", "sigmoid")


class RouterOutput(NamedTuple):
    """What :func:`router_topk` returns."""
    ids: Tensor     #: int32 [T, k], each token's experts, best first (ties: the lower id)
    probs: Tensor   #: float32 [T, k], their probabilities (differentiable in the logits)
    counts: Tensor  #: int32 [E], tokens routed to each expert (before any capacity drop)


class RoutingMap(NamedTuple):
    """What undoes a permutation (gmoe::RoutingMap)."""
    row_of: Tensor     #: int32 [T, k]: the permuted row of (t, j), -1 where it was dropped
    src_token: Tensor  #: int32 [rows]: the token of each permuted row, -1 for padding and past the total


class Permuted(NamedTuple):
    """What :func:`permute` returns."""
    rows: Tensor                     #: [rows, H], x's rows grouped by expert (zero rows for padding)
    counts: Tensor                   #: int32 [E], each expert's padded group size (the experts' m_splits)
    map: RoutingMap                  #: for :func:`combine` and :func:`unpermute`
    probs: Optional[Tensor]          #: float32 [rows], each row's probability (when probs were given)
    dropped: Tensor                  #: int32 [1], (token, slot) pairs dropped by the capacity


def router_topk(logits: Tensor, top_k: int, *, score_func: str = "softmax", normalize: bool = False,
                n_group: int = 1, topk_group: int = 1, scaling_factor: float = 1.0,
                score_bias: Optional[Tensor] = None) -> RouterOutput:
    """Top-k routing (gmoe/routing.h's router_topk): per token, the scores are the softmax of its
    logits (``score_func="softmax"``: Mixtral, Qwen) or one sigmoid per logit (``"sigmoid"``:
    DeepSeek-V3); the experts are chosen by score + ``score_bias`` (float32 [E], selection only,
    no gradient), within the best ``topk_group`` of ``n_group`` expert groups when ``n_group`` > 1;
    probs are the chosen scores, renormalised to sum 1 when ``normalize``, times
    ``scaling_factor``. Differentiable in the logits through probs."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func: expected one of {SCORE_FUNCS}, got {score_func!r}")
    probs, ids, counts = _ops.router_topk(logits, top_k, score_func, normalize, n_group, topk_group,
                                          float(scaling_factor), score_bias)
    return RouterOutput(ids, probs, counts)


def router_aux_loss(logits: Tensor, counts: Tensor, top_k: int, coeff: float = 1.0, *,
                    score_func: str = "softmax") -> Tensor:
    """The load-balancing loss of Switch / Megatron, a 0-d float32 tensor: ``coeff · E · Σ_e f_e ·
    P_e``, f_e = counts[e] / (T·k), P_e the mean over tokens of the softmax of the logits (or of the
    sigmoids normalised to sum 1). Differentiable in the logits (counts are constants)."""
    return _ops.router_aux_loss(logits, counts, top_k, score_func, float(coeff)).view(())


def router_z_loss(logits: Tensor, coeff: float = 1.0) -> Tensor:
    """The router z-loss, a 0-d float32 tensor: ``coeff · mean_t logsumexp(logits[t])²``.
    Differentiable in the logits."""
    return _ops.router_z_loss(logits, float(coeff)).view(())


def permuted_rows(tokens: int, top_k: int, num_experts: int, pad_multiple: int = 1,
                  capacity_factor: float = 0.0) -> int:
    """The rows :func:`permute` returns: ``min(T·k, E·capacity) + E·(pad_multiple - 1)``, with
    capacity = ``ceil(capacity_factor · T · k / E)`` rows per expert (no limit for 0)."""
    return _permuted_rows(tokens, top_k, num_experts, pad_multiple, capacity_factor)


def permute(x: Tensor, ids: Tensor, num_experts: int, probs: Optional[Tensor] = None, *, pad_multiple: int = 1,
            capacity_factor: float = 0.0) -> Permuted:
    """x [T, H] copied once per (token, slot) into rows grouped by the expert of ``ids`` (int32
    [T, k]), in (token, slot) order inside an expert. ``capacity_factor`` > 0 keeps at most
    ``ceil(capacity_factor·T·k/E)`` rows per expert (the later tokens dropped); each group is padded
    with zero rows to a multiple of ``pad_multiple`` (16 or 128 for the FP8 recipes). With
    ``probs`` (float32 [T, k]) each row's probability comes out too (the experts' router-probability
    input). Differentiable in x and probs."""
    rows, counts, row_of, src_token, permuted_probs, dropped = _ops.permute(
        x, ids, num_experts, pad_multiple, float(capacity_factor), probs)
    return Permuted(rows, counts, RoutingMap(row_of, src_token), permuted_probs if probs is not None else None,
                    dropped)


def unpermute(permuted: Tensor, map: RoutingMap) -> Tensor:
    """The token sum of permuted rows: ``out[t] = Σ_j permuted[row_of[t, j]]`` over the kept slots
    ([T, H]; the gradient of :func:`permute` in x). Same as ``combine(permuted, map)``."""
    return combine(permuted, map)


def combine(expert_out: Tensor, map: RoutingMap, probs: Optional[Tensor] = None) -> Tensor:
    """``out[t] = Σ_j probs[t, j] · expert_out[row_of[t, j]]`` over the kept slots, in slot order,
    in float32, rounded once to expert_out's dtype ([T, H]; a token whose slots were all dropped
    gets 0). ``probs`` float32 [T, k], or None for weights of 1. Differentiable in expert_out and
    probs; deterministic."""
    return _ops.combine(expert_out, map.row_of, map.src_token, probs)
